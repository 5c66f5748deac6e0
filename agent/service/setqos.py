"""A model's ``qos:`` set from the fleet (``set-qos``, desired state's ``models``).

The objective lives where an operator writes it by hand, the model's config.yaml in the
repository, so the data plane, ``model tune`` and the QoS controller all read one source.
It is written through modeltune.configfile (atomic, the original kept beside it for
``model tune --rollback``), never when the file already says it (desired state is converged
again on every restart), and a model that serves is loaded again: its versions keep their
sessions (qos is not part of what makes a version "changed"), its config view gains the
``qos.*`` parameters, and the controller reads the new objective at its next window.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from agent.control.running import CommandFailed
from agent.modeltune import configfile
from agent.serving.repository import CONFIG_FILE, valid_name
from agent.serving.settings import ModelSettingsError, Qos, load_document, parse_settings

if TYPE_CHECKING:
    from agent.service.inference import Inference

RELOAD_TIMEOUT_S = 120.0  # a reload whose versions are unchanged builds nothing


@dataclass(frozen=True)
class QosPlan:
    """A checked change of one model's qos: what the file held, what it is to hold."""

    directory: Path
    before: bytes | None  # the file as read (None: absent): written only if still so
    text: bytes
    change: dict[str, Any]  # model, file, before, after: the reply's part

    @property
    def needed(self) -> bool:
        return bool(self.change["before"] != self.change["after"] or
                    "invalid_before" in self.change)


def set_qos(inference: Inference, builtins: Mapping[str, Path], model: str,
            qos: Mapping[str, Any] | None) -> dict[str, Any]:
    """Make ``model``'s config.yaml say ``qos`` (None: no objective); what it said before,
    what it says now, whether the file was written and the model loaded again."""
    return apply_qos(inference, plan_qos(inference, builtins, model, qos))


def plan_qos(inference: Inference, builtins: Mapping[str, Path], model: str,
             qos: Mapping[str, Any] | None) -> QosPlan:
    """Every check of a change of ``model``'s qos, nothing written: CommandFailed for a
    model that has no repository directory to hold a config.yaml (a built-in served in
    place, an unknown name) or a config.yaml that is broken already."""
    directory = inference.repository / model
    file = directory / CONFIG_FILE
    if not valid_name(model) or not directory.is_dir():
        if model in builtins:
            raise CommandFailed("builtin_model", f"model {model}: built in (served in place "
                                f"from {builtins[model]}), so it has no config.yaml to set "
                                f"qos in; a repository directory {directory} (set-model "
                                f"with name {model} installs a version there) can hold one")
        raise CommandFailed("not_found", f"model {model!r} is not in the repository "
                            f"{inference.repository}")
    try:
        before = configfile.read_current(directory)
    except OSError as error:  # a FIFO or directory in its place, a link out of the model
        raise CommandFailed("bad_config", f"{_said(str(file), error)}; fix it first "
                            "(nothing written)") from None
    document = _document(file, before)
    current, invalid = _current(document, file)
    if qos is None:
        document.pop("qos", None)
    else:
        document["qos"] = dict(qos)
    wanted = _qos_of(document, file)
    text = yaml.safe_dump(document, sort_keys=False) if document else ""
    return QosPlan(directory, before, text.encode(), {
        "model": model, "file": str(file), "before": _shown(current), "after": _shown(wanted),
        **({"invalid_before": invalid} if invalid else {})})


def apply_qos(inference: Inference, plan: QosPlan) -> dict[str, Any]:
    """Write a planned change (not when the file says it already) and load the model
    again; CommandFailed for a write that fails (the file changed since it was planned
    included) or a data plane that refuses the reload."""
    if not plan.needed:
        return {**plan.change, "written": False, "reloaded": False}
    try:
        configfile.write_tuned(plan.directory, plan.text, plan.before,
                               during="set-qos read it")
    except OSError as error:
        raise CommandFailed("write_failed", _failed(plan, error)) from None
    return {**plan.change, "written": True,
            "reloaded": _reload(inference, plan.change["model"], plan.change)}


def undo_qos(inference: Inference, plan: QosPlan, loaded: bool) -> str | None:
    """Put a written change back as it was, and load the model again when ``loaded`` with
    it (a reload the data plane refused left it serving the old one): whole or not at
    all, for desired state; None, or why it could not be."""
    try:
        configfile.put_back(plan.directory, plan.before, plan.text)
        if loaded:
            _reload(inference, plan.change["model"], plan.change)
    except OSError as error:
        return _failed(plan, error)
    except CommandFailed as failure:
        return str(failure)
    return None


def _failed(plan: QosPlan, error: OSError) -> str:
    return str(error) if isinstance(error, configfile.ChangedError) else \
        _said(plan.change["file"], error)


def _said(file: str, error: OSError) -> str:
    """``error`` on ``file``, the file named once (a link's refusal names it already)."""
    reason = error.strerror or str(error)
    return reason if reason.startswith(file) else f"{file}: {reason}"


def _document(file: Path, data: bytes | None) -> dict[str, Any]:
    """The config.yaml as a mapping ({} when absent); CommandFailed ``bad_config`` naming
    the file when it is no YAML mapping (the data plane refuses it too)."""
    try:
        document = load_document(data, str(file)) if data is not None else {}
        if not isinstance(document, dict):
            parse_settings(document, str(file))  # refuses it, in the data plane's words
    except ModelSettingsError as error:
        raise CommandFailed("bad_config", f"{error}; fix it first (nothing written)") \
            from None
    return dict(document)


def _current(document: dict[str, Any], file: Path) -> tuple[Qos | None, str | None]:
    """The qos the file holds, or (None, why) when its ``qos`` is what is wrong with it:
    the command replaces it, so a mistyped objective is mended from the fleet.  Any other
    key the data plane refuses is CommandFailed ``bad_config``: not this command's to mend."""
    try:
        return parse_settings(document, str(file)).qos, None
    except ModelSettingsError as error:
        try:
            parse_settings({k: v for k, v in document.items() if k != "qos"}, str(file))
        except ModelSettingsError as other:  # what the command cannot mend, not its qos
            raise CommandFailed("bad_config", f"{other}; fix it first (nothing written)") \
                from None
        return None, str(error)


def _qos_of(document: dict[str, Any], file: Path) -> Qos | None:
    """The qos the document holds, checked with the rest of it as the data plane checks
    a config.yaml (the command's schema bounds are the same; a file is never left bad)."""
    try:
        return parse_settings(document, str(file)).qos
    except ModelSettingsError as error:
        raise CommandFailed("bad_config", f"{error}; nothing written") from None


def _shown(qos: Qos | None) -> dict[str, Any] | None:
    return None if qos is None else qos.to_yaml()


def _reload(inference: Inference, model: str, change: dict[str, Any]) -> bool:
    """Load ``model`` again when the data plane serves it, or when its qos kept it from
    serving (True); otherwise the file is what the data plane reads when it loads it."""
    from agent.serving.errors import ServeError

    if not inference.enabled or not inference.supervisor.ready:
        return False
    try:
        client = inference.supervisor.client()
        # one whose qos was what kept it from serving is loaded now it can be
        wanted = ("READY", "UNAVAILABLE") if "invalid_before" in change else ("READY",)
        if not any(entry.name == model and entry.state in wanted
                   for entry in client.index()):
            return False
        client.load(model, {}, timeout_s=RELOAD_TIMEOUT_S)
    except ServeError as error:
        raise CommandFailed("reload_failed", f"{change['file']}: written, but the data "
                            f"plane did not load {model} again: {error.message}",
                            {**change, "written": True, "reloaded": False}) from None
    return True
