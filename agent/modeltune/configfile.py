"""The model's config.yaml replaced by ``model tune`` (and by the fleet's ``set-qos`` and
desired state's per-model ``qos``), and put back by ``model tune --rollback``.

The tuning journal holds a profile's kernel settings, keyed by boot id and rolled back as
one profile; a model file is neither, so it is not written through it.  Instead the file is
replaced atomically (ConfinedFiles: temp file, fsync, rename, fsync of the directory) after
the original is kept beside it, byte for byte, as ``config.yaml.previous``, or, when there
was none, the empty marker ``config.yaml.absent``.  A second tune keeps the first original:
rollback restores the file as it was before any tune, as a profile rollback does.  What the
last write put there is kept too (``config.yaml.written``), so that a rollback finding the
file edited since (an operator's hand) keeps those edits as ``config.yaml.edited`` and says
so, instead of dropping them without a word.
"""

from __future__ import annotations

from pathlib import Path

from agent.kernel.fsroot import Root
from agent.overlays.bootfs import ConfinedFiles
from agent.serving.repository import CONFIG_FILE

PREVIOUS = CONFIG_FILE + ".previous"
ABSENT = CONFIG_FILE + ".absent"
WRITTEN = CONFIG_FILE + ".written"  # what the last write put in config.yaml
EDITED = CONFIG_FILE + ".edited"  # config.yaml as a rollback found it, edited since


class RollbackError(OSError):
    """Nothing to roll back: no tune wrote this model's config.yaml."""


class ChangedError(OSError):
    """The config.yaml is not what the tune read: someone else wrote it meanwhile."""


def _files(directory: Path) -> ConfinedFiles:
    names = {f"/{name}" for name in (CONFIG_FILE, PREVIOUS, ABSENT, WRITTEN, EDITED)}
    return ConfinedFiles(Root(directory), names.__contains__,
                         f"the model directory {directory}")


def read_current(directory: Path) -> bytes | None:
    """The model's config.yaml as it is now (None: there is none)."""
    return _files(directory).read(f"/{CONFIG_FILE}") if directory.is_dir() else None


def write_tuned(directory: Path, data: bytes, expected: bytes | None,
                during: str = "model tune measured") -> None:
    """``directory``/config.yaml holds ``data``; its original is kept first (once).
    ``expected``: what the file held when the tune read it; a file changed since (an
    operator's edit during the minutes a search takes) is not overwritten; ``during``
    names what read it, in that refusal."""
    directory.mkdir(parents=True, exist_ok=True)
    files = _files(directory)
    if files.read(f"/{CONFIG_FILE}") != expected:
        raise ChangedError(f"{directory / CONFIG_FILE}: changed while {during}; "
                           "nothing written (run it again)")
    if files.read(f"/{PREVIOUS}") is None and files.read(f"/{ABSENT}") is None:
        original = files.read(f"/{CONFIG_FILE}")
        if original is None:
            files.write(f"/{ABSENT}", b"")
        else:
            files.write(f"/{PREVIOUS}", original)
    files.write(f"/{CONFIG_FILE}", data)
    files.write(f"/{WRITTEN}", data)


def put_back(directory: Path, data: bytes | None, expected: bytes) -> None:
    """Undo one write that took ``data`` (None: no file) to ``expected``: a change of a
    desired state that failed part-way; ChangedError when the file is no longer that.
    Back at the original kept beside it, the directory is as before any write: the
    markers go too (else a rollback would "restore" what is already there)."""
    files = _files(directory)
    if files.read(f"/{CONFIG_FILE}") != expected:
        raise ChangedError(f"{directory / CONFIG_FILE}: changed since it was written; "
                           "left as it is")
    if data is None:
        files.remove(f"/{CONFIG_FILE}")
    else:
        files.write(f"/{CONFIG_FILE}", data)
    original = files.read(f"/{PREVIOUS}")
    if (data is not None and original == data) or (
            data is None and files.read(f"/{ABSENT}") is not None):
        for marker in (PREVIOUS, ABSENT, WRITTEN):
            files.remove(f"/{marker}")
    else:
        files.write(f"/{WRITTEN}", data or b"")


def rollback(directory: Path) -> str:
    """Put the original back (or remove the file a tune created); what was done.  The file
    as it is now is kept first as config.yaml.edited when it is not what the last write
    put there (a tune from before .written existed: not known, so kept too)."""
    files = _files(directory)
    original, absent = files.read(f"/{PREVIOUS}"), files.read(f"/{ABSENT}")
    if original is None and absent is None:
        raise RollbackError(f"{directory / CONFIG_FILE}: model tune has not changed it "
                            f"(no {PREVIOUS} or {ABSENT} beside it)")
    current = files.read(f"/{CONFIG_FILE}")
    kept = ""
    if current is not None and current != files.read(f"/{WRITTEN}"):
        files.write(f"/{EDITED}", current)
        kept = f"; the edits made since model tune wrote it are kept in {directory / EDITED}"
    if original is not None:
        files.write(f"/{CONFIG_FILE}", original)
        done = "restored as it was before model tune"
    else:
        files.remove(f"/{CONFIG_FILE}")
        done = "removed (there was none before model tune)"
    for marker in (PREVIOUS, ABSENT, WRITTEN):
        files.remove(f"/{marker}")
    return f"{directory / CONFIG_FILE}: {done}{kept}"
