"""``edge-agent profile ...``: list, show, plan, apply, verify, rollback, status.

Wires discovery and the tuning engine together for a person or a script (``--json``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import yaml

from agent.discovery import discover
from agent.kernel.fsroot import Root, RootError
from agent.tuning.engine import Engine, TuningError
from agent.tuning.errors import ProfileError
from agent.tuning.journal import Journal
from agent.tuning.plan import Change, Plan
from agent.tuning.profiles import ProfileStore, match_score

DEFAULT_STATE_DIR = "/var/lib/edge-agent"


def _state_dir(args: argparse.Namespace, root: Root) -> str:
    if args.state_dir:
        return str(args.state_dir)
    return DEFAULT_STATE_DIR if root.is_host else f"{root.base}{DEFAULT_STATE_DIR}"


def _emit(args: argparse.Namespace, data: Any, text: str) -> None:
    print(json.dumps(data, indent=2) if args.json else text)


def _change_line(change: Change) -> str:
    note = f"  # {change.note}" if change.note else ""
    return (f"  {change.tuner:<8} {change.path}\n"
            f"           {change.current!r} -> {change.desired!r}  ({change.key}){note}")


def _plan_text(plan: Plan) -> str:
    lines = [f"profile {plan.profile}: {len(plan.changes)} change(s)"]
    lines += [_change_line(c) for c in plan.changes]
    for name, value in plan.runtime.items():
        lines.append(f"  runtime  {name}: {value}")
    lines += [f"warning: {w}" for w in plan.warnings]
    return "\n".join(lines)


def _list(args: argparse.Namespace, engine: Engine) -> int:
    """Every profile; one that does not load is listed with its error, the others stay
    usable (exit 0)."""
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
    _emit(args, {"auto": auto, "profiles": rows, "errors": errors}, "\n".join(lines) + (
        f"\n(* = auto for this {board.family} board" + (", ! = does not load)" if errors
                                                       else ")")))
    return 0


def _show(args: argparse.Namespace, engine: Engine) -> int:
    profile = engine.store.auto(engine.topology.board) if args.name == "auto" else \
        engine.store.load(args.name)
    data = {"name": profile.name, "file": profile.file, "include_chain": profile.chain,
            "match": profile.match, "settings": profile.settings}
    _emit(args, data, yaml.safe_dump(data, sort_keys=False).rstrip())
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
    if args.action == "list":
        return _list(args, engine)
    if args.action == "show":
        return _show(args, engine)
    if args.action == "plan":
        plan = _planned(engine, args)
        _emit(args, plan.to_dict(), _plan_text(plan))
        return 0
    if args.action == "apply" and args.dry_run:
        plan = _planned(engine, args)
        _emit(args, plan.to_dict(), "dry run, nothing written\n" + _plan_text(plan))
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
        _emit(args, {**result.plan.to_dict(), "written": len(result.written),
                     "skipped": result.skipped, "notes": result.notes,
                     "drift": [c.path for c, _ in drift]}, text)
        return 0 if not drift else 1
    if args.action == "verify":
        if not engine.journal.exists():
            _emit(args, {"ok": False, "drift": [], "applied": None}, "no profile applied")
            return 1
        drift = engine.verify()
        _emit(args, {"ok": not drift, "drift": [
            {"path": c.path, "expected": c.desired, "actual": a, "key": c.key}
            for c, a in drift]}, _verify_text(drift))
        return 0 if not drift else 1
    if args.action == "rollback" and args.after_failure and \
            os.environ.get("SERVICE_RESULT", "success") == "success":
        _emit(args, {"rolled_back": None, "notes": ["clean stop: nothing to roll back"]},
              "clean stop: nothing to roll back")
        return 0
    if args.action == "rollback":
        profile, notes = engine.rollback()
        _emit(args, {"rolled_back": profile, "notes": notes}, "\n".join(
            ([f"rolled back {profile}"] if profile else []) + notes))
        return 0
    state = engine.journal.load()
    data = None if state is None else {
        "profile": state.profile, "status": state.status, "boot_id": state.boot_id,
        "changes": len(state.changes), "created_ms": state.created_ms,
        "drift": len(engine.verify())}
    _emit(args, {"applied": data}, "no profile applied" if data is None else
          f"{data['profile']} {data['status']}: {data['changes']} setting(s), "
          f"{data['drift']} drifted")
    return 0


def run(args: argparse.Namespace) -> int:
    from agent.cli.common import open_root

    root = open_root(args.root)
    engine = Engine(root, discover(root), Journal(_state_dir(args, root)), ProfileStore(root))
    try:
        return _dispatch(args, engine)
    except ProfileError as error:
        print(f"edge-agent profile {args.action}: {error}", file=sys.stderr)
        return 2
    except (TuningError, RootError, OSError) as error:
        print(f"edge-agent profile {args.action}: {error}", file=sys.stderr)
        return 1
