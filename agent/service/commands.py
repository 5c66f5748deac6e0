"""What each fleet command does on this node, and the guarded changes behind them.

``apply-profile`` and ``set-model`` are guarded: validate, apply, watch a health window
(inference p99 and error rate against the values before, the hottest thermal zone), then
keep the change or undo it by themselves and fail with the reason.  Guard thresholds come
from the command, else from ``control.guard`` in the config.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent.control.controller import CommandFailed, Handler, Progress
from agent.inference.demo_model import DEMO_MODEL_PATH
from agent.telemetry.records import hottest_c
from agent.tuning.engine import TuningError
from agent.tuning.errors import ProfileError

if TYPE_CHECKING:
    from agent.service.node import Service


def _health(service: Service, before: Any, guard: dict[str, Any]) -> str | None:
    """Why the window since ``before`` (a stats Window) is unhealthy, or None."""
    assert service.inference is not None
    loop = service.inference.loop
    if loop is not None and before is not None:
        stats = loop.active.stats
        now = stats.window()
        if now.generation == before.generation:
            window = now.since(before)
            calls = window.count + window.errors
            if calls and window.errors / calls > guard["max_error_rate"]:
                return (f"inference error rate {window.errors / calls:.2%} above "
                        f"{guard['max_error_rate']:.2%}")
            old_p99 = before.percentile_ns(99)
            new_p99 = window.percentile_ns(99)
            if before.count and window.count and new_p99 > guard["max_p99_ratio"] * old_p99:
                return (f"inference p99 {new_p99 / 1e6:.3f} ms above {guard['max_p99_ratio']}x "
                        f"the {old_p99 / 1e6:.3f} ms before")
    hottest = hottest_c((service.last or {}).get("metrics") or {})
    if guard.get("max_temp_c") is not None and hottest is not None and \
            hottest > guard["max_temp_c"]:
        return f"hottest thermal zone {hottest:.1f} °C above {guard['max_temp_c']} °C"
    return None


class ServiceCommands:
    """The handlers the controller runs, bound to one running service."""

    def __init__(self, service: Service, sleep: Callable[[float], None] = time.sleep) -> None:
        self.service, self.sleep = service, sleep
        self.guard_defaults = dataclasses.asdict(service.config.control.guard)

    def handlers(self) -> dict[str, Handler]:
        return {"ping": self.ping, "get-topology": self.get_topology,
                "get-status": self.get_status, "apply-profile": self.apply_profile,
                "rollback-profile": self.rollback_profile, "set-model": self.set_model,
                "set-telemetry": self.set_telemetry, "rebirth": self.rebirth,
                "restart-inference": self.restart_inference, "selftest": self.selftest}

    def _guard(self, args: dict[str, Any]) -> dict[str, Any]:
        return {**self.guard_defaults, **args.get("guard", {})}

    # -- simple commands --------------------------------------------------------------------

    def ping(self, args: dict[str, Any], progress: Progress) -> dict[str, Any]:
        return {"pong": True, "agent_time_ms": int(time.time() * 1000)}

    def get_topology(self, args: dict[str, Any], progress: Progress) -> dict[str, Any]:
        assert self.service.topology is not None
        return self.service.topology.to_dict()

    def get_status(self, args: dict[str, Any], progress: Progress) -> dict[str, Any]:
        return self.service.status()

    def rebirth(self, args: dict[str, Any], progress: Progress) -> dict[str, Any]:
        assert self.service.link is not None
        self.service.link.rebirth()
        return {"session": self.service.link.status.session}

    def set_telemetry(self, args: dict[str, Any], progress: Progress) -> dict[str, Any]:
        sampler = self.service.sampler
        assert sampler is not None
        if "metrics" in args:
            known = {c.key for c in sampler.collectors}
            wanted = None if args["metrics"] == "all" else set(args["metrics"])
            unknown = sorted((wanted or set()) - known)
            if unknown:
                raise CommandFailed("bad_args", f"unknown metric groups {unknown}; known: "
                                    f"{', '.join(sorted(known))}")
            sampler.set_metrics(wanted)
        if "interval_s" in args:
            sampler.interval_s = float(args["interval_s"])
        return {"interval_s": sampler.interval_s,
                "metrics": "all" if sampler.metrics is None else sorted(sampler.metrics)}

    def restart_inference(self, args: dict[str, Any], progress: Progress) -> dict[str, Any]:
        inference = self.service.inference
        assert inference is not None
        inference.restart()
        if inference.error:
            raise CommandFailed("inference_failed", inference.error)
        return {"model": inference.model_path}

    def selftest(self, args: dict[str, Any], progress: Progress) -> dict[str, Any]:
        from agent.selftest import run_checks

        report = run_checks(self.service)
        if any(check["status"] == "fail" for check in report["checks"]):
            raise CommandFailed("selftest_failed", "a check failed", report)
        return report

    # -- guarded changes --------------------------------------------------------------------

    def _stats_window(self) -> Any:
        inference = self.service.inference
        loop = inference.loop if inference is not None else None
        return loop.active.stats.window() if loop is not None else None

    def apply_profile(self, args: dict[str, Any], progress: Progress) -> dict[str, Any]:
        tuning = self.service.tuning
        assert tuning is not None
        guard = self._guard(args)
        previous = tuning.profile if tuning.applied else None
        progress("validating")
        try:
            tuning.engine.plan(args["profile"], force=bool(args.get("force")))
        except ProfileError as error:
            raise CommandFailed("invalid_profile", str(error)) from None
        before = self._stats_window()
        progress("applying")
        try:
            changes = tuning.switch(args["profile"], force=bool(args.get("force")))
        except (ProfileError, TuningError, OSError) as error:
            raise CommandFailed("apply_failed", str(error)) from None
        self._announce_tuning()
        progress("health_window")
        self.sleep(guard["window_s"])
        reason = _health(self.service, before, guard)
        if reason is None:
            return {"profile": tuning.profile, "changes": changes, "drift": tuning.drift}
        progress("rolling_back")
        try:
            tuning.rollback()
            if previous is not None:
                tuning.switch(previous)
        finally:
            self._announce_tuning()
        raise CommandFailed("health_check", f"{reason}; rolled back"
                            + (f" to {previous}" if previous else ""),
                            {"profile": previous, "rolled_back": args["profile"]})

    def rollback_profile(self, args: dict[str, Any], progress: Progress) -> dict[str, Any]:
        tuning = self.service.tuning
        assert tuning is not None
        try:
            rolled_back = tuning.rollback()
        except (TuningError, OSError) as error:
            raise CommandFailed("rollback_failed", str(error)) from None
        self._announce_tuning()
        return {"rolled_back": rolled_back}

    def _announce_tuning(self) -> None:
        """Birth names the profile and whether it is applied: publish it again after a
        change, so ``fleet watch`` and other readers of the retained birth are not stale."""
        if self.service.link is not None:
            self.service.link.rebirth()

    def model_allowed(self, path: str) -> bool:
        """Models load only from the configured directories (and the bundled demo), so a
        command cannot make the agent parse an arbitrary file."""
        config = self.service.config
        allowed = [Path(d) for d in config.control.model_dirs] + [
            Path(config.state_dir) / "models", DEMO_MODEL_PATH.parent,
            Path(config.inference.model).parent]
        resolved = Path(path).resolve()
        return any(resolved.is_relative_to(d.resolve()) for d in allowed)

    def set_model(self, args: dict[str, Any], progress: Progress) -> dict[str, Any]:
        from agent.inference.loop import SwapRejected
        from agent.inference.session import SessionError

        inference = self.service.inference
        assert inference is not None
        if not self.model_allowed(args["model"]):
            raise CommandFailed("not_allowed", f"{args['model']} is outside the model "
                                "directories (control.model_dirs, <state_dir>/models)")
        guard = self._guard(args)
        progress("loading")
        try:
            result = inference.swap(args["model"], args.get("sha256"), guard["canary_s"],
                                    guard["max_error_rate"],
                                    guard["max_p99_ratio"], guard.get("max_p99_ms"))
        except (SessionError, SwapRejected, OSError, RuntimeError) as error:
            raise CommandFailed("model_rejected", str(error)) from None
        if result.rolled_back:
            raise CommandFailed("canary_failed", f"{result.reason}; switched back",
                                {"model": inference.model_path})
        return {"model": inference.model_path, "canary": result.reason}

    # -- desired state ----------------------------------------------------------------------

    def converge(self, envelope: dict[str, Any]) -> dict[str, Any]:
        """Bring the node to a desired state and report what it runs, retained."""
        args, service = envelope["args"], self.service
        assert service.tuning is not None and service.inference is not None
        status, message = "converged", None
        try:
            wanted = args.get("profile")
            if wanted and not (service.tuning.applied and service.tuning.profile == wanted):
                self.apply_profile({"profile": wanted}, lambda step: None)
            elif "profile" in args and wanted is None and service.tuning.applied:
                service.tuning.rollback()
                self._announce_tuning()
            model = args.get("model")
            if model and Path(model).resolve() != Path(service.inference.model_path).resolve():
                self.set_model({"model": model, **({"sha256": args["sha256"]}
                                                   if "sha256" in args else {})},
                               lambda step: None)
        except CommandFailed as failure:
            status, message = "failed", str(failure)
        reported = {"schema": "reported/1", "desired_id": envelope["id"],
                    "desired_issued_at": envelope["issued_at"], "status": status,
                    "message": message,
                    "profile": service.tuning.profile if service.tuning.applied else None,
                    "model": service.inference.model_path, "ts": int(time.time() * 1000)}
        if service.link is not None:
            service.link.publish_now("reported", reported, retain=True)
        return reported
