"""What the registry holds for each model, and how the protocol's views read it.

A model's served set is one immutable ``Served`` object: a request reads the reference once
and keeps the version it found, and a load replaces the whole set in one assignment.  Every
other field of a ``Slot`` is likewise replaced, never changed in place, so the index and the
probe read it without a lock while a load runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from agent.serving.core import IndexEntry, InstanceGroup, ModelConfigView, TensorSpec
from agent.serving.errors import not_found
from agent.serving.repository import ModelEntry
from agent.serving.settings import Instance, ModelSettings
from agent.serving.versions import Version

MAX_VERSION_DIGITS = 19  # an int64, as Triton's version numbers


@dataclass(frozen=True)
class Served:
    """The versions a model serves; ``default`` answers requests that name no version."""

    versions: Mapping[int, Version]
    default: int
    settings: ModelSettings

    @property
    def ready(self) -> bool:
        return all(not version.probe_error for version in self.versions.values())

    def pick(self, name: str, version: str) -> Version:
        """The version a request names: "" for the default, else its canonical decimal.
        Anything else ("01", "+1", " 1", full-width digits, 5,000 digits, which int()
        refuses) names no version and is NOT_FOUND like "9" or "one": a version is a path
        segment naming a resource, and "01" serving version 1 gave one version two names."""
        if version == "":
            return self.versions[self.default]
        canonical = (0 < len(version) <= MAX_VERSION_DIGITS and version.isascii()
                     and version.isdigit() and version[0] != "0")
        found = self.versions.get(int(version)) if canonical else None
        if found is None:
            shown = version if len(version) <= 40 else version[:40] + "..."
            why = "" if canonical else "; versions are decimal integers without leading zeros"
            raise not_found(f"model {name} has no version {shown!r} serving (serving: "
                            f"{', '.join(map(str, sorted(self.versions)))}){why}")
        return found


@dataclass
class Slot:
    name: str
    served: Served | None = None
    reason: str = "not loaded"  # why nothing serves (when ``served`` is None)
    failed: Mapping[int, str] = field(default_factory=dict)  # version -> its last load's error
    loading: tuple[int, ...] = ()


def index_rows(name: str, slot: Slot | None, entry: ModelEntry | None) -> list[IndexEntry]:
    """The model's rows: one per served version (READY, or UNAVAILABLE after a failed probe),
    one per version loading or failed, else one row saying why nothing serves."""
    if slot is None:
        reason = entry.error if entry is not None and entry.error else "not loaded"
        return [IndexEntry(name, "", "UNAVAILABLE", reason)]
    rows = []
    served = slot.served
    versions = served.versions if served is not None else {}
    for number in sorted(versions):
        error = versions[number].probe_error
        rows.append(IndexEntry(name, str(number), "UNAVAILABLE" if error else "READY",
                               f"probe failed: {error}" if error else ""))
    loading = slot.loading
    for number in loading:
        if number not in versions:
            rows.append(IndexEntry(name, str(number) if number else "", "LOADING"))
    for number, reason in sorted(slot.failed.items()):
        if number not in versions and number not in loading:
            rows.append(IndexEntry(name, str(number) if number else "", "UNAVAILABLE", reason))
    if not rows:
        rows.append(IndexEntry(name, "", "UNAVAILABLE", slot.reason))
    return rows


def _instance_group(instance: Instance, ran_on: str) -> InstanceGroup:
    """Triton's kinds; ``auto`` as what it resolved to (``ran_on``: its backend's device)."""
    device = ran_on if instance.device == "auto" else instance.device
    kind, _, index = device.partition(":")
    if kind in ("cpu", "openvino"):
        return InstanceGroup("KIND_CPU", instance.count)
    gpus = (int(index),) if kind == "gpu" and index.isdigit() else ()
    return InstanceGroup("KIND_GPU", instance.count, gpus)


def _unbatched(specs: tuple[TensorSpec, ...], batched: bool) -> tuple[TensorSpec, ...]:
    """Triton's config dims leave out the batch dimension when the model batches."""
    if not batched:
        return specs
    return tuple(TensorSpec(s.name, s.datatype, s.shape[1:]) for s in specs)


def config_view(name: str, served: Served) -> ModelConfigView:
    version = served.versions[served.default]
    settings = served.settings
    providers = list(version.instances[0][1].providers)
    parameters = {"providers": ",".join(providers), "precision": settings.precision}
    if settings.providers is not None:
        parameters["configured_providers"] = ",".join(settings.providers)
    parameters["instances"] = "; ".join(
        f"{i.count} x {i.device}" + (f" ({i.threads} threads)" if i.threads else "")
        for i in settings.instances)
    parameters["backends"] = "; ".join(
        f"{backend.device}: {backend.kind} {backend.precision}"
        for _, backend in version.instances)
    for number in sorted(served.versions):
        parameters[f"sha256.{number}"] = served.versions[number].digest
    if settings.dynamic_batching is not None:
        parameters["dynamic_batching"] = ("active" if version.policy.batching else
                                          "queue only (max_batch_size 0)")
    if settings.qos is not None:
        parameters.update({f"qos.{key}": str(value)
                           for key, value in settings.qos.to_yaml().items()})
    batched = version.max_batch_size > 0
    return ModelConfigView(
        name=name,
        max_batch_size=version.max_batch_size,
        inputs=_unbatched(version.inputs, batched),
        outputs=_unbatched(version.outputs, batched),
        instance_groups=tuple(_instance_group(i, next(
            (b.device for made, b in version.instances if made is i), "cpu"))
            for i in settings.instances),
        version_policy=settings.version_policy.to_view(),
        parameters=parameters,
    )


def versions_of(slot: Slot, name: str, version: str) -> list[Version]:
    """The versions a statistics request names: every one serving (``version`` ""), else
    the one named (NOT_FOUND when it does not serve); none when nothing serves."""
    served = slot.served
    if served is None:
        return []
    if version:
        return [served.pick(name, version)]
    return [v for _, v in sorted(served.versions.items())]


def swap(slot: Slot, served: Served | None, *also: Served | None) -> None:
    """Serve ``served`` in one assignment and close every version that no longer serves
    (of what served before, and of ``also``): its queued requests still finish."""
    keep = {id(v) for v in served.versions.values()} if served is not None else set()
    dropped = [slot.served, *also]
    slot.served = served
    for before in dropped:
        for version in before.versions.values() if before is not None else ():
            if id(version) not in keep:
                version.close()
