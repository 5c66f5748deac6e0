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

from agent import yamlfile
from agent.control.running import CommandFailed
from agent.modeltune import configfile
from agent.serving.repository import CONFIG_FILE, valid_name
from agent.serving.settings import ModelSettingsError, Qos, parse_settings, read_settings

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
        return bool(self.change["before"] != self.change["after"])


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
        reason = error.strerror or str(error)
        raise CommandFailed("bad_config", (reason if reason.startswith(str(file)) else
                                           f"{file}: {reason}") +
                            "; fix it first (nothing written)") from None
    document = _document(file, before)
    current = _qos_of(document, file)
    if qos is None:
        document.pop("qos", None)
    else:
        document["qos"] = dict(qos)
    wanted = _qos_of(document, file)
    text = yaml.safe_dump(document, sort_keys=False) if document else ""
    return QosPlan(directory, before, text.encode(), {
        "model": model, "file": str(file), "before": _shown(current), "after": _shown(wanted)})


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
        raise CommandFailed("write_failed", str(error) if isinstance(
            error, configfile.ChangedError) else
            f"{plan.change['file']}: {error.strerror or error}") from None
    return {**plan.change, "written": True,
            "reloaded": _reload(inference, plan.change["model"], plan.change)}


def _document(file: Path, data: bytes | None) -> dict[str, Any]:
    """The config.yaml as a mapping ({} when absent); CommandFailed ``bad_config`` naming
    the file and key when it cannot be used as it is (the data plane refuses it too)."""
    try:
        read_settings(file)  # every check, with the file and key in its message
        document = yamlfile.load(yamlfile.decode(data)) if data is not None else None
    except ModelSettingsError as error:
        raise CommandFailed("bad_config", f"{error}; fix it first (nothing written)") \
            from None
    except (yaml.YAMLError, ValueError):  # it changed between the two reads
        raise CommandFailed("write_failed", f"{file}: changed while set-qos read it; "
                            "nothing written (send it again)") from None
    return dict(document or {})


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
    """Load ``model`` again when the data plane serves it (True); otherwise the file is
    what the data plane reads when it loads the model."""
    from agent.serving.errors import ServeError

    if not inference.enabled or not inference.supervisor.ready:
        return False
    try:
        client = inference.supervisor.client()
        if not any(entry.name == model and entry.state == "READY"
                   for entry in client.index()):
            return False
        client.load(model, {}, timeout_s=RELOAD_TIMEOUT_S)
    except ServeError as error:
        raise CommandFailed("reload_failed", f"{change['file']}: written, but the data "
                            f"plane did not load {model} again: {error.message}",
                            {**change, "written": True, "reloaded": False}) from None
    return True
