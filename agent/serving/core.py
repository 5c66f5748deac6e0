"""What the front ends (HTTP, gRPC) need of the data plane, in the protocol's own terms.

The front ends only translate: they decode a request into these types, call ``Models``
(which the registry implements) and encode what comes back.  Anything a request can get
wrong raises ``errors.ServeError``; ``infer`` blocks (a runtime call), so the front ends run
it off their event loops.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from agent.serving.errors import ServeError

if TYPE_CHECKING:
    from agent.serving.levers import LeverChange

PLATFORM = "onnxruntime_onnx"  # Triton's name for what serves an ONNX model
# The protocol's datatypes this server carries, little-endian as the protocol fixes.
DATATYPES: dict[str, np.dtype[Any]] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype("<u1"), "UINT16": np.dtype("<u2"), "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"), "INT16": np.dtype("<i2"), "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"), "FP32": np.dtype("<f4"), "FP64": np.dtype("<f8"),
}


# each datatype by its dtype in either byte order ("|" ones have none): one dict look-up per
# tensor, where comparing with every datatype in turn cost 5 us a tensor, twice a request
_NAMES: dict[np.dtype[Any], str] = {
    variant: name for name, dtype in DATATYPES.items()
    for variant in (dtype, dtype.newbyteorder(">"))}


def datatype_of(array: np.ndarray) -> str:
    """The protocol's name for an output array's element type."""
    name = _NAMES.get(array.dtype)
    if name is None:
        raise ServeError("INVALID_ARGUMENT",
                         f"output of type {array.dtype} has no protocol datatype")
    return name


@dataclass(frozen=True)
class TensorSpec:
    """A model input or output: protocol datatype, shape with -1 for a dynamic dimension."""

    name: str
    datatype: str
    shape: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}


@dataclass(frozen=True)
class Tensor:
    """A request's input or a result's output."""

    name: str
    array: np.ndarray

    @property
    def datatype(self) -> str:
        return datatype_of(self.array)


@dataclass(frozen=True)
class OutputRequest:
    """One output a client asked for; ``binary`` is HTTP's ``binary_data`` (None: the
    request's default)."""

    name: str
    binary: bool | None = None


@dataclass(frozen=True)
class InferRequest:
    model: str
    version: str  # "" : the version the policy serves (the newest ready one)
    inputs: tuple[Tensor, ...]
    outputs: tuple[OutputRequest, ...] = ()  # empty: every output
    id: str = ""
    parameters: Mapping[str, Any] = field(default_factory=dict)
    # the caller showed the bearer token (the front end checked it): it may ask for the
    # privileged priority levels (serve.privileged_priority)
    trusted: bool = False


@dataclass(frozen=True)
class InferResult:
    model: str
    version: str
    id: str
    outputs: tuple[Tensor, ...]


@dataclass(frozen=True)
class ModelMetadata:
    name: str
    versions: tuple[str, ...]  # the versions that serve, ascending
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    platform: str = PLATFORM


@dataclass(frozen=True)
class InstanceGroup:
    kind: str  # Triton's KIND_CPU / KIND_GPU
    count: int
    gpus: tuple[int, ...] = ()


@dataclass(frozen=True)
class ModelConfigView:
    """Triton's model configuration fields that have an equivalent here; ours go under
    ``parameters`` (string values, as Triton's ModelParameter)."""

    name: str
    max_batch_size: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    instance_groups: tuple[InstanceGroup, ...]
    version_policy: Mapping[str, Any]  # {"latest": n} | {"specific": [..]} | {"all": {}}
    parameters: Mapping[str, str]
    platform: str = PLATFORM


@dataclass(frozen=True)
class IndexEntry:
    """One row of the repository index: Triton's states READY, UNAVAILABLE, LOADING,
    UNLOADING; ``version`` is "" for a model with no version loaded."""

    name: str
    version: str
    state: str
    reason: str = ""


class Models(Protocol):
    """The data plane as both front ends see it."""

    def live(self) -> bool: ...

    def ready(self) -> bool: ...

    def server_metadata(self) -> dict[str, Any]:
        """``{name, version, extensions}``."""
        ...

    def model_ready(self, name: str, version: str) -> bool:
        """Raises NOT_FOUND for a model the repository does not hold."""
        ...

    def model_metadata(self, name: str, version: str) -> ModelMetadata: ...

    def model_config(self, name: str) -> ModelConfigView: ...

    def check_elements(self, model: str, version: str, name: str,
                       shape: Sequence[Any]) -> None:
        """INVALID_ARGUMENT when input ``name`` of this declared shape holds more elements
        than the version that would serve it takes (config.yaml ``max_input_elements``):
        for a front end to call before it decodes the tensor."""
        ...

    def infer(self, request: InferRequest) -> InferResult: ...

    def index(self, ready_only: bool) -> list[IndexEntry]: ...

    def load(self, name: str, parameters: Mapping[str, Any]) -> None: ...

    def unload(self, name: str, parameters: Mapping[str, Any]) -> None: ...

    def statistics(self, name: str, version: str) -> list[dict[str, Any]]:
        """Triton's ``model_stats`` entries ("" name: every model), plus ours."""
        ...

    def set_levers(self, name: str, change: LeverChange) -> dict[str, Any]:
        """The QoS controller's instant levers on the model's serving versions (levers.py):
        ``{version: the levers now served}``."""
        ...
