"""``edge-agent profile ...``: list, show, plan, apply, verify, rollback, status.

Wires discovery and the tuning engine together for a person or a script (``--json``).
Run as root, ``apply`` and ``rollback`` also write the settings that survive a reboot (kernel
arguments in the boot config, /etc/default/irqbalance, systemd drop-ins), which the service
cannot (ProtectSystem=full); ``--runtime-only`` leaves them alone, as ``rollback
--after-failure`` (the unit's ExecStopPost, inside the same sandbox) always does.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from agent.cli.common import add_state_dir, emit, open_root, resolve_state_dir
from agent.cli.profile_status import persistent_status

if TYPE_CHECKING:
    from agent.tuning.engine import Engine
    from agent.tuning.plan import Change, Plan

ACTIONS = (("list", "profiles, marking those that match this device"),
           ("show", "a profile's merged settings"),
           ("plan", "what applying a profile would change (nothing is written)"),
           ("apply", "apply a profile through the crash-safe journal"),
           ("verify", "check every applied setting still holds (exit 0 if so)"),
           ("rollback", "restore every original value and clear the journal"),
           ("status", "what is applied, from the journal"))


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    profile = commands.add_parser("profile", help="list, plan, apply, verify and roll back "
                                  "tuning profiles")
    actions = profile.add_subparsers(dest="action", required=True, metavar="ACTION")
    for action, text in ACTIONS:
        sub = actions.add_parser(action, help=text)
        if action in ("show", "plan", "apply"):
            sub.add_argument("name", help="profile name, or auto for the best match")
        if action in ("plan", "apply"):
            sub.add_argument("--force", action="store_true",
                             help="apply even if the profile's match excludes this device")
        if action == "apply":
            sub.add_argument("--dry-run", action="store_true",
                             help="show what would be written, write nothing (same as plan)")
        if action in ("apply", "rollback"):
            sub.add_argument("--runtime-only", action="store_true",
                             help="leave settings that survive a reboot (boot config, /etc "
                             "files) alone, as the service does")
        if action == "rollback":
            sub.add_argument("--after-failure", action="store_true",
                             help="for the unit's ExecStopPost: roll back only when the "
                             "service did not stop cleanly (systemd's SERVICE_RESULT); "
                             "runtime settings only")
        sub.add_argument("--root", default="/", metavar="DIR",
                         help="operate on sysfs/procfs below DIR instead of /")
        add_state_dir(sub, "the journal's directory")
        sub.add_argument("--json", action="store_true", help="machine-readable output")
        sub.set_defaults(handler=run)


def _change_line(change: Change) -> str:
    note = f"  # {change.note}" if change.note else ""
    if change.compare == "file":  # a whole config file: the note says what changes in it
        what = "created" if change.current is None else "edited"
        return f"  {change.tuner:<8} {change.path}\n           {what}  ({change.key}){note}"
    return (f"  {change.tuner:<8} {change.path}\n"
            f"           {change.current!r} -> {change.desired!r}  ({change.key}){note}")


def _plan_text(plan: Plan) -> str:
    lines = [f"profile {plan.profile}: {len(plan.changes)} change(s)"]
    lines += [_change_line(c) for c in plan.changes]
    lasting = [c for c in plan.changes if c.persistent]
    if lasting:
        lines.append(f"  persistent: {len(lasting)} change(s) survive a reboot; written by "
                     f"`sudo edge-agent profile apply {plan.profile}`, not by the service")
    for name, value in plan.runtime.items():
        lines.append(f"  runtime  {name}: {value}")
    if plan.cpus:
        lines.append("  cpus     " + ", ".join(f"{role} {cpus or 'none'}" for role, cpus in
                                               plan.to_dict()["cpus"].items()))
    lines += [f"warning: {w}" for w in plan.warnings]
    return "\n".join(lines)


def _list(args: argparse.Namespace, engine: Engine) -> int:
    """Every profile; one that does not load is listed with its error, the others stay
    usable (exit 0)."""
    from agent.tuning.errors import ProfileError
    from agent.tuning.profiles import match_score

    board = engine.topology.board
    rows, errors = [], []
    for name, profile in engine.store.load_all().items():
        if isinstance(profile, ProfileError):
            errors.append({"name": name, "error": str(profile)})
            continue
        rows.append({"name": name, "description": profile.description, "match": profile.match,
                     "matches": not profile.match or match_score(profile.match, board)
                     is not None, "file": profile.file})
    try:
        auto: str | None = engine.store.auto(board).name
    except ProfileError:  # nothing matches and balanced itself is broken: listed above
        auto = None
    lines = [f"{'*' if r['name'] == auto else ' '} {r['name']:<22} "
             f"{'matches' if r['matches'] else 'other board'}  {r['description']}"
             for r in rows]
    lines += [f"! {e['name']:<22} error: {e['error']}" for e in errors]
    emit(args.json, {"auto": auto, "profiles": rows, "errors": errors}, "\n".join(lines) + (
        f"\n(* = auto for this {board.family} board" + (", ! = does not load)" if errors
                                                       else ")")))
    return 0


def _show(args: argparse.Namespace, engine: Engine) -> int:
    import yaml

    profile = engine.store.auto(engine.topology.board) if args.name == "auto" else \
        engine.store.load(args.name)
    data = {"name": profile.name, "file": profile.file, "include_chain": profile.chain,
            "match": profile.match, "settings": profile.settings}
    emit(args.json, data, yaml.safe_dump(data, sort_keys=False).rstrip())
    return 0


def _planned(engine: Engine, args: argparse.Namespace) -> Plan:
    """The plan, with auto's warnings about the profiles it passed over."""
    plan = engine.plan(args.name, force=args.force)
    if args.name == "auto":
        plan.warnings[:0] = engine.store.skipped
    return plan


def _verify_text(drift: list[tuple[Change, str | None]]) -> str:
    if not drift:
        return "verify: every applied setting holds"
    return "\n".join(["verify: drift found"] + [
        f"  {c.path}: expected {c.desired!r}, found {actual!r} ({c.key})" for c, actual in drift])


def _dispatch(args: argparse.Namespace, engine: Engine) -> int:
    from agent.tuning.journal import gone_with_boot

    if args.action == "list":
        return _list(args, engine)
    if args.action == "show":
        return _show(args, engine)
    if args.action == "plan":
        plan = _planned(engine, args)
        emit(args.json, plan.to_dict(), _plan_text(plan))
        return 0
    if args.action == "apply" and args.dry_run:
        plan = _planned(engine, args)
        emit(args.json, plan.to_dict(), "dry run, nothing written\n" + _plan_text(plan))
        return 0
    if args.action == "apply":
        try:
            result = engine.apply(args.name, force=args.force)
        except KeyboardInterrupt:  # as after a crash: the journal has every original
            if not engine.journal.exists():
                print("edge-agent profile apply: interrupted before anything was written",
                      file=sys.stderr)
                return 130
            print(f"edge-agent profile apply: interrupted; {engine.journal.path} holds every "
                  "original value: `edge-agent profile rollback` restores them (the unit's "
                  "ExecStopPost does so after a crash)", file=sys.stderr)
            return 130
        if args.name == "auto":
            result.plan.warnings[:0] = engine.store.skipped
        drift = engine.verify()
        text = "\n".join([f"applied {result.plan.profile}: {len(result.written)} write(s)"]
                         + [f"skipped: {s}" for s in result.skipped]
                         + [f"note: {n}" for n in result.notes]
                         + [f"warning: {w}" for w in result.plan.warnings]
                         + [_verify_text(drift)])
        emit(args.json, {**result.plan.to_dict(), "written": len(result.written),
                     "skipped": result.skipped, "notes": result.notes,
                     "drift": [c.path for c, _ in drift]}, text)
        return 0 if not drift else 1
    if args.action == "verify":
        if not engine.journal.exists() and not engine.lasting.exists():
            emit(args.json, {"ok": False, "drift": [], "applied": None}, "no profile applied")
            return 1
        drift = engine.verify()
        gone = gone_with_boot(engine.journal.load(), engine.root)
        emit(args.json, {"ok": not drift and gone is None, "gone_with_boot": gone, "drift": [
            {"path": c.path, "expected": c.desired, "actual": a, "key": c.key}
            for c, a in drift]}, "\n".join(
                ([f"verify: {gone}"] if gone else []) + ([_verify_text(drift)]
                                                         if drift or not gone else [])))
        return 0 if not drift and gone is None else 1
    if args.action == "rollback" and args.after_failure and \
            os.environ.get("SERVICE_RESULT", "success") == "success":
        emit(args.json, {"rolled_back": None, "notes": ["clean stop: nothing to roll back"]},
              "clean stop: nothing to roll back")
        return 0
    if args.action == "rollback":
        profile, notes = engine.rollback()
        emit(args.json, {"rolled_back": profile, "notes": notes}, "\n".join(
            ([f"rolled back {profile}"] if profile else []) + notes))
        return 0
    state = engine.journal.load()
    gone = gone_with_boot(state, engine.root)
    data = None if state is None else {
        "profile": state.profile, "status": "gone with the boot" if gone else state.status,
        "boot_id": state.boot_id, "changes": len(state.changes),
        "created_ms": state.created_ms, "drift": 0 if gone else len(engine.verify()),
        "gone_with_boot": gone}
    lasting = persistent_status(engine)
    lines = ["no profile applied" if data is None else gone if gone else
             f"{data['profile']} {data['status']}: {data['changes']} setting(s), "
             f"{data['drift']} drifted"]
    if lasting is not None:
        lines.append(f"persistent settings of {lasting['profile']} ({engine.lasting.path}):")
        lines += [f"  {row['path']}: {row['state']}" for row in lasting["changes"]]
    emit(args.json, {"applied": data, "persistent": lasting}, "\n".join(lines))
    return 0


def run(args: argparse.Namespace) -> int:
    from agent.discovery import discover
    from agent.tuning.engine import Engine
    from agent.tuning.journal import Journal
    from agent.tuning.profiles import ProfileStore

    root = open_root(args.root)
    journal = Journal(resolve_state_dir(args.state_dir, root.base))
    persistent = args.action in ("apply", "rollback") and not args.runtime_only and \
        not getattr(args, "after_failure", False)
    engine = Engine(root, discover(root), journal, ProfileStore(root), persistent=persistent)
    return _dispatch(args, engine)
