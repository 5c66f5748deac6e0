"""What each fleet command does on this node, and the guarded changes behind them.

``apply-profile`` and ``set-model`` are guarded: validate, apply, watch a health window
(inference p99 and error rate against the values before, the hottest thermal zone), then
keep the change or undo it by themselves and fail with the reason.  Guard thresholds come
from the command, else from ``control.guard`` in the config.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent import protocol
from agent.control.controller import CommandFailed, Handler, Progress
from agent.control.running import Job
from agent.service import builds
from agent.service.buildmodel import build_model
from agent.service.collaborators import Collaborators
from agent.service.health import guard_problem
from agent.service.serve import builtin_models
from agent.service.setqos import QosPlan, apply_qos, plan_qos, set_qos, undo_qos
from agent.tuning.engine import TuningError
from agent.tuning.errors import ProfileError

if TYPE_CHECKING:
    from agent.inference.stats import Window


MAX_WINDOW_S = 3600  # a health window longer than the schema's bound cannot be meant
OPTIONAL_THRESHOLDS = ("max_temp_c", "max_p99_ms")  # null: not judged


class ServiceCommands:
    """The handlers the controller runs, bound to one running agent's parts."""

    def __init__(self, parts: Collaborators, sleep: Callable[[float], None] = time.sleep) -> None:
        self.parts, self.sleep = parts, sleep
        self._reported: dict[str, Any] | None = None  # the last reported state, published

    def handlers(self) -> dict[str, Handler]:
        return {"ping": self.ping, "get-topology": self.get_topology,
                "get-status": self.get_status, "apply-profile": self.apply_profile,
                "rollback-profile": self.rollback_profile, "set-model": self.set_model,
                "set-telemetry": self.set_telemetry, "rebirth": self.rebirth,
                "restart-inference": self.restart_inference, "selftest": self.selftest,
                "build-model": self.build_model, "set-qos": self.set_qos}

    def _guard(self, args: dict[str, Any]) -> dict[str, Any]:
        """The thresholds of a guarded change; CommandFailed ``bad_args`` before anything
        changes when one could not be judged (NaN passes every comparison: a guard with it
        would keep any change)."""
        guard = {**self.parts.guard_defaults, **args.get("guard", {})}
        for name, value in guard.items():
            if value is None and name in OPTIONAL_THRESHOLDS:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not (
                    isinstance(value, int) or math.isfinite(value)) or value < 0:
                raise CommandFailed("bad_args", f"guard.{name}: {value!r} is not a finite "
                                    "number 0 or above")
        if guard["window_s"] > MAX_WINDOW_S:
            raise CommandFailed("bad_args", f"guard.window_s: above {MAX_WINDOW_S} s")
        return guard

    # -- simple commands --------------------------------------------------------------------

    def ping(self, args: dict[str, Any], progress: Progress) -> dict[str, Any]:
        return {"pong": True, "agent_time_ms": int(time.time() * 1000)}

    def get_topology(self, args: dict[str, Any], progress: Progress) -> dict[str, Any]:
        return self.parts.topology().to_dict()

    def get_status(self, args: dict[str, Any], progress: Progress) -> dict[str, Any]:
        return self.parts.status()

    def rebirth(self, args: dict[str, Any], progress: Progress) -> dict[str, Any]:
        link = self.parts.link()
        link.rebirth()
        return {"session": link.status.session}

    def set_telemetry(self, args: dict[str, Any], progress: Progress) -> dict[str, Any]:
        sampler = self.parts.sampler
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
        """A fresh data-plane process, answered once it is ready again (or why not)."""
        inference = self.parts.inference
        if not inference.enabled:
            raise CommandFailed("inference_failed", "inference is disabled in the config")
        inference.restart()
        if not inference.supervisor.ready:
            raise CommandFailed("inference_failed", "; ".join(inference.problems())
                                or "the data plane is not ready")
        return {"model": inference.model_path, "data_plane": inference.supervisor.status()}

    def selftest(self, args: dict[str, Any], progress: Progress) -> dict[str, Any]:
        report = self.parts.selftest()
        if any(check["status"] == "fail" for check in report["checks"]):
            raise CommandFailed("selftest_failed", "a check failed", report)
        return report

    # -- guarded changes --------------------------------------------------------------------

    def _window(self) -> tuple[int, Window] | None:
        """The default model's window (None while the data plane does not serve it)."""
        return self.parts.inference.window()

    @staticmethod
    def _between(before: tuple[int, Window] | None,
                 now: tuple[int, Window] | None) -> tuple[Window | None, Window | None]:
        """Two windows the guard may compare: of one data-plane process, else neither."""
        if before is None or now is None or before[0] != now[0]:
            return None, None
        return now[1], before[1]

    def apply_profile(self, args: dict[str, Any], progress: Progress) -> dict[str, Any]:
        tuning = self.parts.tuning
        guard = self._guard(args)
        previous = tuning.profile if tuning.applied else None
        progress("validating")
        try:
            tuning.engine.plan(args["profile"], force=bool(args.get("force")))
        except ProfileError as error:
            raise CommandFailed("invalid_profile", str(error)) from None
        before = self._window()
        progress("applying")
        try:
            changes = tuning.switch(args["profile"], force=bool(args.get("force")))
        except (ProfileError, TuningError, OSError) as error:
            raise CommandFailed("apply_failed", str(error)) from None
        self._announce_tuning()
        progress("health_window")
        try:
            self.sleep(guard["window_s"])
            now, then = self._between(before, self._window())
            reason = guard_problem(now, then, self.parts.sampler.last, guard)
        except Exception as error:  # fail closed: a change the guard cannot judge is undone
            reason = f"the health window could not run ({type(error).__name__}: {error})"
        if reason is None:
            return {"profile": tuning.profile, "changes": changes, "drift": tuning.drift}
        progress("rolling_back")
        self._restore_profile(previous)
        raise CommandFailed("health_check", f"{reason}; rolled back"
                            + (f" to {previous}" if previous else ""),
                            {"profile": previous, "rolled_back": args["profile"]})

    def _restore_profile(self, previous: str | None) -> None:
        """Put back the profile that was applied (None: none), announced however it ends."""
        tuning = self.parts.tuning
        try:
            if tuning.applied:
                tuning.rollback()
            if previous is not None:
                tuning.switch(previous)
        finally:
            self._announce_tuning()

    def rollback_profile(self, args: dict[str, Any], progress: Progress) -> dict[str, Any]:
        tuning = self.parts.tuning
        try:
            rolled_back = tuning.rollback()
        except (TuningError, OSError) as error:
            raise CommandFailed("rollback_failed", str(error)) from None
        self._announce_tuning()
        return {"rolled_back": rolled_back}

    def _announce_tuning(self) -> None:
        """Birth names the profile and whether it is applied: publish it again after a
        change, so ``fleet watch`` and other readers of the retained birth are not stale."""
        self.parts.link().rebirth()

    def model_allowed(self, path: str) -> bool:
        return self.parts.model_allowed(path)

    def set_model(self, args: dict[str, Any], progress: Progress) -> dict[str, Any]:
        """Install a verified file as the next version of a model (the default one unless
        ``name``) through the data plane's canary; a failing canary keeps the old version."""
        from agent.service.inference import InstallFailed

        inference = self.parts.inference
        if not self.model_allowed(args["model"]):
            raise CommandFailed("not_allowed", f"{args['model']} is outside the model "
                                "directories (control.model_dirs, <state_dir>/models)")
        if not inference.enabled or not inference.supervisor.ready:
            raise CommandFailed("model_rejected", "the data plane is not ready: "
                                + ("; ".join(inference.problems()) or "inference is disabled"))
        model = Path(args["model"])
        report = builds.read_report(model)  # built elsewhere: its report goes into the guard
        extras: dict[str, Path] = {}
        if report is not None:
            problem = builds.refusal(model, report, builds.runnable_targets(
                self.parts.topology(), inference.available))
            if problem is not None:
                raise CommandFailed("gate_failed", problem, {"build": builds.figures(report)})
            extras = builds.version_files(model.parent, report)
        guard = self._guard(args)
        progress("loading")
        try:
            installed = inference.install(model, args.get("sha256"), args.get("name"),
                                          builds.canary_of(guard), extras)
        except InstallFailed as failure:
            raise CommandFailed(failure.code, str(failure),
                                {"model": inference.model_path}) from None
        self.parts.link().rebirth()  # birth lists the served models
        return {**installed, "canary": "passed",
                **({"build": builds.figures(report)} if report is not None else {})}

    def set_qos(self, args: dict[str, Any], progress: Progress) -> dict[str, Any]:
        """Write a model's objective into its config.yaml and load it again (service.setqos)."""
        inference = self.parts.inference
        return set_qos(inference, builtin_models(inference.config), args["model"], args["qos"])

    def build_model(self, args: dict[str, Any], progress: Progress) -> Job:
        """Build and install a model on this node, as a job beside the command worker."""
        return build_model(self.parts, args, self._guard(args))

    # -- desired state ----------------------------------------------------------------------

    def _qos_plans(self, qos: dict[str, dict[str, Any] | None],
                   installing: str | None) -> list[QosPlan]:
        """Each model's change checked (``installing``'s only once it is a directory);
        CommandFailed naming every model that cannot take its qos, so none is written."""
        inference, plans, problems = self.parts.inference, [], []
        builtins = builtin_models(inference.config)
        for name, wanted in qos.items():
            if name == installing and not (inference.repository / name).is_dir():
                continue
            try:
                plans.append(plan_qos(inference, builtins, name, wanted))
            except CommandFailed as failure:
                problems.append(failure)
        if problems:
            raise CommandFailed(problems[0].code, "; ".join(map(str, problems)) + (
                f"; none of the {len(qos)} models' qos was written" if len(qos) > 1 else ""))
        return plans

    def converge(self, envelope: dict[str, Any]) -> dict[str, Any]:
        """Bring the node to a desired state and report what it runs, retained."""
        args, tuning, inference = envelope["args"], self.parts.tuning, self.parts.inference
        status, message = "converged", None
        models: dict[str, dict[str, Any]] = {}  # set-qos's results: what it holds, if written
        qos = {name: spec["qos"] for name, spec in sorted(args.get("models", {}).items())
               if "qos" in spec}
        model = args.get("model")
        installing = model and Path(model).resolve() != Path(inference.model_path).resolve()
        previous, switched = tuning.profile if tuning.applied else None, False
        installed, served_before = None, inference.model_path
        try:
            # every model's qos checked before anything changes; the one the model step
            # installs may have no directory yet: it is checked when it has
            self._qos_plans(qos, inference.default if installing else None)
            wanted = args.get("profile")
            if wanted and not (tuning.applied and tuning.profile == wanted):
                switched = True  # (a profile its guard refuses puts itself back)
                self.apply_profile({"profile": wanted}, lambda step: None)
            elif "profile" in args and wanted is None and tuning.applied:
                switched = True
                tuning.rollback()
                self._announce_tuning()
            if installing:
                installed = self.set_model({"model": model, **({"sha256": args["sha256"]}
                                                   if "sha256" in args else {})},
                               lambda step: None)
            # read and checked again: the profile's guard window may have run for minutes
            self._apply_qos(self._qos_plans(qos, None), models)
        except CommandFailed as failure:
            status, message = "failed", str(failure)
            if installed is not None:  # put back in the order applied, the last first
                message += self._withdraw(installed, served_before)
            if switched and (tuning.profile if tuning.applied else None) != previous:
                message += self._put_back(previous)
        reported = {"schema": "reported/1", "desired_id": envelope["id"],
                    "desired_issued_at": envelope["issued_at"], "status": status,
                    "message": message,
                    "profile": tuning.profile if tuning.applied else None,
                    "model": inference.model_path, "ts": int(time.time() * 1000),
                    **({"models": {name: {"qos": done["after"], "written": done["written"]}
                                   for name, done in models.items()}} if models else {})}
        self.parts.link().publish_now(protocol.REPORTED, reported, retain=True)
        self._reported = reported
        return reported

    def _apply_qos(self, plans: list[QosPlan], models: dict[str, dict[str, Any]]) -> None:
        """Each planned change written and loaded (into ``models``); when one fails, the
        ones written before it, and its own file when written, are put back."""
        inference, written = self.parts.inference, list[tuple[QosPlan, bool]]()
        for plan in plans:
            try:
                done = apply_qos(inference, plan)
            except CommandFailed as failure:
                if failure.code == "reload_failed":  # written, the old one still served
                    written.append((plan, False))
                problems = [p for p in (undo_qos(inference, w, loaded)
                                        for w, loaded in reversed(written)) if p]
                models.clear()
                raise CommandFailed(failure.code, f"{failure}; " + (
                    "putting the qos back failed: " + "; ".join(problems) if problems else
                    f"the qos written put back ({len(written)} file(s))")) from None
            models[plan.change["model"]] = done
            if done["written"]:
                written.append((plan, done["reloaded"]))

    def _withdraw(self, installed: dict[str, Any], path: str) -> str:
        """The version a failed desired state installed taken back: the one before it
        serves again (whole or not at all); what it did, for the report's message."""
        from agent.serving.errors import ServeError

        name, version = installed["model"], installed["version"]
        try:
            self.parts.inference.withdraw(installed, path)
        except (OSError, ServeError) as error:
            return f"; taking {name} version {version} back failed: {error}"
        finally:
            self.parts.link().rebirth()  # birth lists the served models
        return f"; {name} version {version} taken back"

    def _put_back(self, previous: str | None) -> str:
        """A desired state that failed after its profile step: the profile before it
        again, so that the state is applied whole or not at all; what it did, for the
        report's message."""
        try:
            self._restore_profile(previous)
        except (ProfileError, TuningError, OSError) as error:
            return f"; putting the profile back to {previous or 'none'} failed: {error}"
        return f"; the profile put back to {previous or 'none'}"

    def refused_desired(self, refusal: dict[str, Any]) -> None:
        """Say, retained, that a signed desired state was refused (per scope: its id, the
        code and why) beside what the node last converged to, which it still runs (nothing
        then: ``desired_id`` and ``status`` null).  The same refusal again is not said."""
        last = self._reported or {
            "schema": "reported/1", "desired_id": None, "desired_issued_at": None,
            "status": None, "message": None}
        scope, entry = refusal["scope"], {k: v for k, v in refusal.items() if k != "scope"}
        refused = dict(last.get("refused") or {})
        if refused.get(scope) == entry:
            return
        refused[scope] = entry
        tuning = self.parts.tuning
        self._reported = {**last, "refused": refused,
                          "profile": tuning.profile if tuning.applied else None,
                          "model": self.parts.inference.model_path,
                          "ts": int(time.time() * 1000)}
        self.parts.link().publish_now(protocol.REPORTED, self._reported, retain=True)
