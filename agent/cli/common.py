"""What every command shares: the exit statuses, ``--root`` and ``--state-dir``, the argparse
types and the output helpers.

Exit status, one rule for every command (main() consults EXIT_STATUS):

* 0: done; a check that found nothing wrong; a reader that closed the pipe early.
* 1: the command ran and did not succeed: an operation failed (a refused or failed write, a
  model that does not load, a busy state directory, no dtc, a publish the broker refused)
  or a check found a problem (profile drift, a failed selftest, status: not running).
* 2: the command line, or a file it names, is wrong, and nothing was done: a bad flag or
  value, a missing ``--root``, a config, profile or overlay source that does not load, a
  broker that cannot be reached.
* 128 + N: stopped by signal N before a result (130 for Ctrl-C).

State directory, one rule for every command that has one (resolve_state_dir()):
``--state-dir`` (or the config's ``state_dir`` when it is not the default) as given; else
``/var/lib/edge-agent`` of the tree ``--root`` names; on the host, ``~/.local/state/edge-agent``
instead when ``/var/lib/edge-agent`` neither exists nor can be created (no agent installed,
not root).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent.stopping import Terminated

if TYPE_CHECKING:
    from agent.kernel.fsroot import Root

DEFAULT_STATE_DIR = "/var/lib/edge-agent"
STATE_DIR_RULE = (f"{DEFAULT_STATE_DIR}, below --root when one is given; on the host "
                  f"~/.local/state/edge-agent when {DEFAULT_STATE_DIR} neither exists nor can "
                  "be created")

# Error type (by name, so that no subsystem is imported before it raises) -> exit status; the
# first class of an error's MRO found here decides.
EXIT_STATUS: dict[str, int] = {
    "builtins.BrokenPipeError": 0,  # `edge-agent discover --json | head`
    "agent.cli.common.UsageError": 2,
    "agent.validation.SettingsError": 2,  # a config, profile or overlay source
    "agent.modelbuild.request.BuildError": 2,  # a model, calibration set or flag of a build
    "agent.tuning.engine.TuningError": 1,
    "agent.overlays.errors.InstallRefused": 1,
    "agent.overlays.dtc.DtcMissing": 1,
    "agent.inference.errors.SessionError": 1,
    "agent.service.node.ServiceError": 1,
    "agent.service.local_broker.BrokerStartError": 1,
    "agent.control.operator.FleetError": 1,
    "builtins.OSError": 1,  # RootError (a write outside the allowed paths) among them
    "builtins.KeyboardInterrupt": 130,  # Ctrl-C in a command without its own stop path
}


class UsageError(Exception):
    """A one-line error for the person at the terminal; exit status 2."""


def exit_status(error: BaseException) -> int | None:
    """The status EXIT_STATUS gives ``error``; None for one it does not know (a bug, whose
    traceback is wanted)."""
    if isinstance(error, Terminated):
        return error.status
    for kind in type(error).__mro__:
        status = EXIT_STATUS.get(f"{kind.__module__}.{kind.__qualname__}")
        if status is not None:
            return status
    return None


def tell(args: argparse.Namespace, error: BaseException) -> None:
    """One line on stderr: a usage error names the command (as argparse does), an error of
    the operation the command and its action (``edge-agent profile apply: ...``)."""
    if isinstance(error, BrokenPipeError):
        sys.stderr.close()  # the reader is gone; nothing more to say to anyone
    elif isinstance(error, KeyboardInterrupt) and not isinstance(error, Terminated):
        print(file=sys.stderr)  # ends the line the terminal echoed ^C on
    else:
        action = None if isinstance(error, UsageError) else getattr(args, "action", None)
        name = " ".join(["edge-agent", args.command] + ([action] if action else []))
        print(f"{name}: {error}", file=sys.stderr)


def open_root(directory: str) -> Root:
    """The filesystem layer for ``--root``; a missing directory is a usage error."""
    from agent.kernel.fsroot import Root
    from agent.validation import missing_directory

    problem = missing_directory(directory)
    if problem is not None:
        raise UsageError(f"--root {problem}")
    return Root(directory)


def resolve_state_dir(given: str | None, root: str | os.PathLike[str]) -> str:
    """The state directory (journal, model cache, outbox, status) by the module's rule: the
    unit's ``ExecStopPost`` names ``--state-dir /var/lib/edge-agent``, so its rollback finds
    the journal ``run`` wrote there whatever the defaults."""
    if given:
        return given
    base = Path(root).resolve()
    if base != Path("/"):  # a fixture or a mounted image keeps its state with it
        return f"{base}{DEFAULT_STATE_DIR}"
    if Path(DEFAULT_STATE_DIR).exists() or _creatable(Path(DEFAULT_STATE_DIR)):
        return DEFAULT_STATE_DIR  # an installed agent's: its journal and status are read there
    return str(Path.home() / ".local" / "state" / "edge-agent")


def _creatable(directory: Path) -> bool:
    while not directory.exists():
        directory = directory.parent
    return os.access(directory, os.W_OK)


def add_config_file(parser: argparse.ArgumentParser) -> None:
    """``--config FILE``, the agent.yaml a command reads, with its default in the help."""
    parser.add_argument("--config", metavar="FILE",
                        help="agent.yaml (default: /etc/edge-agent/agent.yaml if present, "
                        "else built-in defaults)")


def add_state_dir(parser: argparse.ArgumentParser, holds: str) -> None:
    """``--state-dir`` with the one rule in its help."""
    parser.add_argument("--state-dir", metavar="DIR",
                        help=f"{holds} (default: {STATE_DIR_RULE})")


def add_repository_choice(parser: argparse.ArgumentParser, config_uses: str) -> None:
    """``--repository DIR | --config FILE`` and ``--state-dir``: where a ``model`` command
    finds the repository, named alike by every command that writes into it."""
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--repository", type=Path, metavar="DIR",
                       help="the model repository (default: the config's)")
    where.add_argument("--config", metavar="FILE",
                       help=f"agent.yaml whose {config_uses} (default: "
                       "/etc/edge-agent/agent.yaml if present, else built-in defaults)")
    add_state_dir(parser, "the agent's state (the default repository is "
                  "<state-dir>/repository)")


def _number(text: str) -> float:
    """``text`` as a float; NaN (which no range admits) when it is not a number."""
    try:
        return float(text)
    except ValueError:
        return math.nan


def _finite(text: str, above_zero: bool) -> float:
    value = _number(text)
    if not (math.isfinite(value) and (value > 0 if above_zero else value >= 0)):
        raise argparse.ArgumentTypeError(
            f"{text}: expected a number {'above 0' if above_zero else '0 or above'}")
    return value


def positive_float(text: str) -> float:
    """An argparse type for durations and rates: a finite number above 0 (argparse names
    the flag: ``argument --seconds: -5: expected a number above 0``, exit 2)."""
    return _finite(text, above_zero=True)


def ranged_float(low: float, high: float) -> Callable[[str], float]:
    """An argparse type for a number ``low``..``high``: a flag's bounds are those of the
    config key it stands in for, so the command line takes what the file would."""
    def parse(text: str) -> float:
        value = _number(text)
        if not (math.isfinite(value) and low <= value <= high):
            raise argparse.ArgumentTypeError(
                f"{text}: expected a number {_plain(low)}..{_plain(high)}")
        return value
    return parse


def _plain(number: float) -> str:
    """3600000, not 3.6e+06: the bound as one would type it."""
    return str(int(number)) if float(number).is_integer() else repr(number)


def non_negative_float(text: str) -> float:
    """An argparse type for a wait that may be none at all (``--settle 0``)."""
    return _finite(text, above_zero=False)


def print_json(data: Any) -> None:
    """The ``--json`` form of every command: one indented document on stdout."""
    print(json.dumps(data, indent=2))


def emit(as_json: bool, data: Any, text: str) -> None:
    """``data`` as JSON with ``--json``, else the text a person reads."""
    if as_json:
        print_json(data)
    else:
        print(text)


def render_table(rows: Sequence[Sequence[str]], indent: str = "") -> str:
    """Columns padded to their widest cell (a header, if any, is the first row)."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(indent + "  ".join(cell.ljust(widths[i])
                                        for i, cell in enumerate(row)).rstrip()
                     for row in rows)
