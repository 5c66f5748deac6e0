"""One model's ``config.yaml`` in the repository: its keys, their checks and defaults.

Every key is optional; an unknown key or a bad value is refused with the file and the key
path (``repo/m/config.yaml: instances[0].device: 'tpu' is not allowed: ...``), through the
same declarative validator as the agent's own config.  The file is read and checked here;
what a value means for serving is the registry's business.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from agent import yamlfile
from agent.inference.devices import DEVICE, DEVICE_HELP
from agent.kernel.regular import read_regular
from agent.validation import SettingsError, choice, integer, number, shown, text, validate

PRECISIONS = ("fp32", "fp16", "int8")  # checked per instance device as it is built
# A run still going after this is cancelled (max_run_ms absent): far above any run an edge
# model makes (a batch of 8 of a large detector on a Cortex-A55 takes a second or two),
# and below the 15 s after which the supervisor counts a silent server as hung, so a run
# that would never end costs its own requests, never the process.
DEFAULT_MAX_RUN_MS = 10_000
# Threads a model's instances may have in all, per CPU the profile gives inference: two
# instances that each use every such CPU (one computing while the other is fed) is the
# widest layout that still helps; beyond it threads only contend, and each session takes
# seconds to build (4 x 1024 threads: 25-48 s each, a restart loop).
THREADS_PER_CPU = 2
HEX64 = re.compile(r"^[0-9a-f]{64}$")
# QoS classes, most protected first: the order in which models yield when the device is short
QOS_CLASSES = ("latency_critical", "throughput", "best_effort")
QOS_P99_MS = (0.01, 3_600_000)  # the bounds of qos.p99_ms and qos.min_rps (control.schemas
QOS_MIN_RPS = (0.001, 1_000_000)  # repeats them for set-qos: it sits below this layer)
BOOL = choice(True, False)


class ModelSettingsError(SettingsError):
    """A config.yaml that cannot be used: ``file: key: message``."""


@dataclass(frozen=True)
class Instance:
    """``count`` sessions of a version on ``device`` with ``threads`` intra-op threads
    (None: the factory's thread plan).  ``auto``: the discovered providers' order, as a
    model without a config.yaml runs; ``cpu``: the CPU only (agent.inference.devices)."""

    count: int = 1
    device: str = "auto"
    threads: int | None = None


@dataclass(frozen=True)
class Qos:
    """A model's service-level objective (``qos:``): its class orders who yields when the
    device is short; ``p99_ms`` and ``min_rps`` (None: not set) are what the controller and
    ``model tune`` hold it to."""

    service_class: str
    p99_ms: float | None = None
    min_rps: float | None = None

    def to_yaml(self) -> dict[str, Any]:
        """The ``qos:`` mapping as config.yaml spells it (keys that are set only)."""
        shape: dict[str, Any] = {"class": self.service_class}
        if self.p99_ms is not None:
            shape["p99_ms"] = self.p99_ms
        if self.min_rps is not None:
            shape["min_rps"] = self.min_rps
        return shape


@dataclass(frozen=True)
class VersionPolicy:
    """Triton's version policy: ``latest`` n, ``specific`` versions, or ``all``."""

    kind: str = "latest"  # latest | specific | all
    latest: int = 1
    specific: tuple[int, ...] = ()

    def select(self, available: list[int]) -> list[int]:
        """The versions this policy serves out of those on disk, ascending."""
        ordered = sorted(available)
        if self.kind == "all":
            return ordered
        if self.kind == "specific":
            return [v for v in ordered if v in self.specific]
        return ordered[-self.latest:]

    def to_view(self) -> dict[str, Any]:
        """The shape core.ModelConfigView carries (the front ends spell it their way)."""
        if self.kind == "all":
            return {"all": {}}
        if self.kind == "specific":
            return {"specific": list(self.specific)}
        return {"latest": self.latest}

    def __str__(self) -> str:
        if self.kind == "all":
            return "all"
        if self.kind == "specific":
            return f"{{specific: {list(self.specific)}}}"
        return f"{{latest: {self.latest}}}"


@dataclass(frozen=True)
class ModelSettings:
    """What a model's config.yaml says; the defaults when it has none."""

    max_batch_size: int | None = None  # None: derived from the model's inputs
    version_policy: VersionPolicy = field(default_factory=VersionPolicy)
    instances: tuple[Instance, ...] = (Instance(),)
    dynamic_batching: Mapping[str, Any] | None = None  # the queue (policy.SchedulePolicy)
    providers: tuple[str, ...] | None = None  # None: the factory's (discovered) order
    precision: str = "fp32"
    sha256: Mapping[int, str] = field(default_factory=dict)
    max_run_ms: int = DEFAULT_MAX_RUN_MS  # a run past it is cancelled (scheduler)
    # the most elements one input of one request may hold (None: from the model's shapes,
    # versions.input_caps)
    max_input_elements: int | None = None
    qos: Qos | None = None  # None: no objective; the model is served as before


def _positive_version(value: Any) -> str | None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
    return None if ok else "a version number 1 or above"


def _checked_apart(value: Any) -> str | None:
    """A key whose value has checks of its own (``_policy``): a word or a mapping."""
    return None


SCHEMA: dict[str, Any] = {
    "max_batch_size": integer(0, 1 << 16),
    "version_policy": _checked_apart,
    "instances": ("list", {"count": integer(1, 64), "threads": integer(1, 1024),
                           "device": text(DEVICE, DEVICE_HELP)}),
    "dynamic_batching": {
        "max_queue_delay_us": integer(0, 10_000_000),
        "preferred_batch_size": ("list", integer(1, 1 << 16)),
        "priority_levels": integer(0, 1000),
        "default_priority_level": integer(0, 1000),
        "queue": {"max_size": integer(0, 1 << 20), "timeout_us": integer(0, 1 << 40),
                  "allow_timeout_override": BOOL},
    },
    "providers": ("list", text(re.compile(r"^[A-Za-z]+ExecutionProvider$"),
                               "an ONNX Runtime provider name such as "
                               "CPUExecutionProvider")),
    "precision": choice(*PRECISIONS),
    "sha256": ("map", _positive_version, text(HEX64, "64 lower-case hex digits")),
    "max_run_ms": integer(1, 3_600_000),
    "max_input_elements": integer(1, 1 << 31),
    "qos": {"class": choice(*QOS_CLASSES), "p99_ms": number(*QOS_P99_MS),
            "min_rps": number(*QOS_MIN_RPS)},
}


def read_settings(path: Path) -> ModelSettings:
    """The settings in ``path``; defaults when the file is absent or empty.  Raises
    ModelSettingsError naming the file (and key) for anything it cannot use."""
    file = str(path)
    try:
        data = read_regular(path)  # a FIFO in its place must not hang
    except FileNotFoundError:
        return ModelSettings()
    except OSError as error:
        raise ModelSettingsError(file, "", f"cannot read it: {error.strerror or error}") \
            from None
    return parse_settings(load_document(data, file), file)


def load_document(data: bytes, file: str) -> Any:
    """The YAML document in a config.yaml's bytes ({} when empty), before its keys are
    checked; ModelSettingsError naming the file for bytes that are not one."""
    try:
        document = yamlfile.load(yamlfile.decode(data))
    except yamlfile.NotUtf8Error as error:
        raise ModelSettingsError(file, "", str(error)) from None
    except yamlfile.DuplicateKeyError as error:
        raise ModelSettingsError(file, error.path, error.message) from None
    except yaml.YAMLError as error:
        raise ModelSettingsError(file, "", f"not valid YAML: {error}") from None
    return {} if document is None else document


def parse_settings(data: Any, file: str) -> ModelSettings:
    """Check a parsed document against SCHEMA and the rules between its keys."""
    validate(data, SCHEMA, "", file, ModelSettingsError)
    assert isinstance(data, dict)  # validate refuses anything else
    batch = data.get("max_batch_size")
    dynamic = data.get("dynamic_batching")
    if dynamic is not None:
        _check_batching(dynamic, batch, file)
    precision = data.get("precision", "fp32")
    providers = data.get("providers")
    if providers is not None and not providers:
        raise ModelSettingsError(file, "providers", "an empty list: leave the key out for "
                                 "the discovered order")
    instances = tuple(Instance(**item) for item in data.get("instances", [{}]))
    if not instances:
        raise ModelSettingsError(file, "instances", "an empty list: at least one instance")
    return ModelSettings(
        max_batch_size=batch,
        version_policy=_policy(data.get("version_policy", {"latest": 1}), file),
        instances=instances,
        dynamic_batching=dynamic,
        providers=tuple(providers) if providers else None,
        precision=precision,
        sha256=dict(data.get("sha256", {})),
        max_run_ms=data.get("max_run_ms", DEFAULT_MAX_RUN_MS),
        max_input_elements=data.get("max_input_elements"),
        qos=_qos(data["qos"], file) if "qos" in data else None,
    )


def check_threads(settings: ModelSettings, file: str, cpus: int) -> None:
    """ModelSettingsError unless the model's instances have at most THREADS_PER_CPU threads
    per CPU in all (``cpus``: those the profile gives inference).  An instance without
    ``threads`` gets its share of the CPUs, as serving/build.py gives it, and every session
    counts at least one thread, so ``count`` is bounded by the same rule."""
    sessions = sum(instance.count for instance in settings.instances)
    share = max(1, cpus // sessions)
    total = sum(instance.count * (instance.threads or share) for instance in settings.instances)
    allowed = THREADS_PER_CPU * cpus
    if total > allowed:
        parts = " + ".join(f"{instance.count} x {instance.threads or share}"
                           for instance in settings.instances)
        raise ModelSettingsError(file, "instances", f"{parts} threads is above "
                                 f"{THREADS_PER_CPU} per CPU that inference runs on ({cpus} "
                                 f"CPUs; allowed: at most {allowed} threads across the "
                                 "model's instances, count x threads)")


def instances_problem(settings: ModelSettings, file: str, cpus: int,
                      device_problem: Callable[[str], str | None] | None) -> str | None:
    """Why a model's instances cannot run on this node (``file: key: why``), or None: more
    threads than ``cpus`` allow (check_threads), or a device that ``device_problem`` says
    discovery did not find (it lists the devices the board has; None: every device goes)."""
    try:
        check_threads(settings, file, cpus)
    except ModelSettingsError as error:
        return str(error)
    for index, instance in enumerate(settings.instances):
        problem = device_problem(instance.device) if device_problem is not None else None
        if problem:
            return f"{file}: instances[{index}].device: {problem}"
    return None


def _policy(value: Any, file: str) -> VersionPolicy:
    key = "version_policy"
    if value == "all":
        return VersionPolicy("all")
    allowed = "all, {latest: N} or {specific: [versions]}"
    if not isinstance(value, dict) or len(value) != 1:
        raise ModelSettingsError(file, key, f"{shown(value)} is not allowed: expected "
                                 f"{allowed}")
    validate(value, {"latest": integer(1, 1000), "specific": ("list", _positive_version)},
             key, file, ModelSettingsError)
    if "latest" in value:
        return VersionPolicy("latest", latest=value["latest"])
    if not value["specific"]:
        raise ModelSettingsError(file, f"{key}.specific", "an empty list: name at least one "
                                 "version")
    return VersionPolicy("specific", specific=tuple(sorted(set(value["specific"]))))


def _qos(value: dict[str, Any], file: str) -> Qos:
    """SCHEMA checked each key; ``class`` is the one a ``qos:`` mapping cannot leave out."""
    if "class" not in value:
        raise ModelSettingsError(file, "qos.class", "missing: one of " + ", ".join(QOS_CLASSES))
    return Qos(value["class"], value.get("p99_ms"), value.get("min_rps"))


def _check_batching(dynamic: dict[str, Any], batch: int | None, file: str) -> None:
    """The rules between dynamic_batching's keys (and max_batch_size) Triton also enforces."""
    key = "dynamic_batching"
    if batch == 0:
        raise ModelSettingsError(file, key, "needs max_batch_size above 0 (0 turns batching "
                                 "off)")
    for index, size in enumerate(dynamic.get("preferred_batch_size", [])):
        if batch is not None and size > batch:
            raise ModelSettingsError(file, f"{key}.preferred_batch_size[{index}]",
                                     f"{size} is above max_batch_size {batch}")
    levels = dynamic.get("priority_levels", 0)
    default = dynamic.get("default_priority_level")
    if default is not None and not (levels == 0 == default or 1 <= default <= levels):
        raise ModelSettingsError(file, f"{key}.default_priority_level",
                                 f"{default} is not one of the priority_levels 1..{levels}")
