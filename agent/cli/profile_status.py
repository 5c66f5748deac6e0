"""The persistent settings' state for ``edge-agent profile status``.

A kernel argument is "active" once the running kernel booted with it (/proc/cmdline), and
"takes effect after reboot" while it is only in the boot config; a config file is "written"
while it holds what the profile asked for.  Anything else has drifted (edited since).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agent.tuning.engine import Engine
    from agent.tuning.plan import Change


def _state(engine: Engine, change: Change, booted: list[str]) -> str:
    from agent.tuning.bootargs import AFTER_REBOOT
    from agent.tuning.plan import matches, read_normalised

    if change.note and change.note.startswith("restored"):
        return "restored"
    try:
        actual = read_normalised(engine.root, change.path, change.compare)
    except (OSError, ValueError) as error:
        return f"unreadable: {error}"
    if not matches(change, actual):
        return "drifted: edited since it was applied"
    if change.compare == "cmdline":
        return "active" if change.desired in booted else f"in the boot config; {AFTER_REBOOT}"
    return "written"


def persistent_status(engine: Engine) -> dict[str, Any] | None:
    """The persistent journal's profile and each setting's state; None without one."""
    from agent.tuning.bootargs import running

    kept = engine.lasting.load()
    if kept is None:
        return None
    booted = running(engine.root)
    return {"profile": kept.profile, "journal": str(engine.lasting.path), "changes": [
        {"path": c.path, "key": c.key, "desired": c.desired if c.compare != "file" else None,
         "state": _state(engine, c, booted)} for c in kept.changes]}
