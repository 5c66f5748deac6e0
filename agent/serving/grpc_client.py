"""A small client of the gRPC front end, for ``edge-agent infer --url grpc://...`` (the
benchmark): the same private message classes as the server, tensors as raw bytes, so the
agent measures itself without tritonclient installed.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import TracebackType
from typing import Any

import grpc
import numpy as np

from agent.serving import proto
from agent.serving.core import DATATYPES, ModelMetadata, TensorSpec, datatype_of
from agent.serving.errors import HTTP_STATUS, ServeError
from agent.serving.grpc_codec import CONTENTS_FIELD
from agent.serving.shm_tensors import REGION, RegionInput, RegionRef
from agent.serving.tensors import to_raw


def _error(error: grpc.RpcError) -> ServeError:
    """The call's status as a ``ServeError``; a status the data plane never answers
    (UNIMPLEMENTED, CANCELLED, UNKNOWN...) keeps its name in the message."""
    code = error.code()
    name = code.name if code is not None else "UNKNOWN"
    details = error.details() or name
    if name in HTTP_STATUS:
        return ServeError(name, details)
    return ServeError("UNAVAILABLE" if name in ("CANCELLED", "UNKNOWN") else "INTERNAL",
                      f"{name}: {details}")


def _set_parameters(target: Any, values: Mapping[str, Any]) -> None:
    """InferParameters as tritonclient writes them: strings and int64s."""
    for key, value in values.items():
        if isinstance(value, str):
            target[key].string_param = value
        else:
            target[key].int64_param = value


def _specs(tensors: Any) -> tuple[TensorSpec, ...]:
    return tuple(TensorSpec(t.name, t.datatype, tuple(t.shape)) for t in tensors)


def _output(tensor: Any, raw: bytes | None) -> np.ndarray:
    """An output array from its raw bytes (what Triton and we send) or, failing those, its
    typed contents; refused unless the sizes agree."""
    dtype = DATATYPES.get(tensor.datatype)
    if dtype is None:
        raise ServeError("INTERNAL", f"output {tensor.name}: datatype {tensor.datatype!r} "
                         "is not one this client reads")
    shape = tuple(tensor.shape)
    count = int(np.prod(shape, dtype=np.int64))
    if raw is not None:
        if len(raw) != count * dtype.itemsize:
            raise ServeError("INTERNAL", f"output {tensor.name}: {len(raw)} bytes for shape "
                             f"{list(shape)} of {tensor.datatype}")
        return np.frombuffer(raw, dtype=dtype, count=count).reshape(shape)
    field = CONTENTS_FIELD.get(tensor.datatype)
    if field is None:
        raise ServeError("INTERNAL", f"output {tensor.name}: {tensor.datatype} came without "
                         "raw_output_contents")
    values = getattr(tensor.contents, field)
    if len(values) != count:
        raise ServeError("INTERNAL", f"output {tensor.name}: {len(values)} values for shape "
                         f"{list(shape)}")
    return np.array(list(values), dtype=dtype).reshape(shape)


def set_parameter(parameter: Any, key: str, value: Any) -> None:
    """One InferParameter from a Python value, typed as tritonclient types it: ``priority``
    as uint64, others by their type."""
    if key == "priority":
        parameter.uint64_param = int(value)
    elif isinstance(value, bool):
        parameter.bool_param = value
    elif isinstance(value, int):
        parameter.int64_param = value
    elif isinstance(value, float):
        parameter.double_param = value
    elif isinstance(value, str):
        parameter.string_param = value
    else:
        raise ServeError("INVALID_ARGUMENT", f"parameter {key}: {type(value).__name__} is "
                         "not a bool, number or string")


class GrpcClient:
    """One channel to ``target`` ("host:port"); each call waits at most ``timeout_s``."""

    def __init__(self, target: str, token: str | None = None, timeout_s: float = 30.0) -> None:
        self.timeout_s = timeout_s
        self._headers = (("authorization", f"Bearer {token}"),) if token else ()
        self.channel = grpc.insecure_channel(target, options=[
            ("grpc.max_receive_message_length", -1),
            ("grpc.max_send_message_length", -1),
        ])
        self._calls = {
            name: self.channel.unary_unary(f"/{proto.SERVICE}/{name}",
                                           request_serializer=request.SerializeToString,
                                           response_deserializer=response.FromString)
            for name, (request, response) in proto.METHODS.items()
        }

    def call(self, method: str, request: Any) -> Any:
        """One unary call; a failure comes back as ``ServeError``."""
        try:
            return self._calls[method](request, timeout=self.timeout_s,
                                       metadata=self._headers)
        except grpc.RpcError as error:
            raise _error(error) from None

    def live(self) -> bool:
        return bool(self.call("ServerLive", proto.ServerLiveRequest()).live)

    def ready(self) -> bool:
        return bool(self.call("ServerReady", proto.ServerReadyRequest()).ready)

    def model_metadata(self, model: str, version: str = "") -> ModelMetadata:
        response = self.call("ModelMetadata", proto.ModelMetadataRequest(name=model,
                                                                         version=version))
        return ModelMetadata(response.name, tuple(response.versions), _specs(response.inputs),
                             _specs(response.outputs), response.platform)

    def infer(self, model: str, feeds: Mapping[str, np.ndarray | RegionInput],
              version: str = "", outputs: tuple[str, ...] = (), request_id: str = "",
              regions: Mapping[str, RegionRef] | None = None,
              parameters: Mapping[str, Any] | None = None) -> dict[str, np.ndarray]:
        """Run the model once; every output unless ``outputs`` or ``regions`` name some.  A
        feed may lie in a registered shared memory region (no raw entry then); the outputs
        in ``regions`` are written there and left out of the answer."""
        request = proto.ModelInferRequest(model_name=model, model_version=version,
                                          id=request_id)
        for key, value in (parameters or {}).items():
            set_parameter(request.parameters[key], key, value)
        for name, array in feeds.items():
            if isinstance(array, RegionInput):
                tensor = request.inputs.add(name=name, datatype=array.datatype,
                                            shape=list(array.shape))
                _set_parameters(tensor.parameters, array.ref.parameters())
                continue
            try:
                datatype = datatype_of(array)
            except ServeError:
                raise ServeError("INVALID_ARGUMENT", f"input {name}: numpy type {array.dtype} "
                                 "has no protocol datatype") from None
            request.inputs.add(name=name, datatype=datatype, shape=list(array.shape))
            request.raw_input_contents.append(to_raw(array))
        targets = dict(regions or {})
        for name in outputs:
            if name not in targets:
                request.outputs.add(name=name)
        for name, ref in targets.items():
            _set_parameters(request.outputs.add(name=name).parameters, ref.parameters())
        response = self.call("ModelInfer", request)
        raw = list(response.raw_output_contents)
        if raw and len(raw) != len(response.outputs):
            raise ServeError("INTERNAL", f"{len(raw)} raw_output_contents for "
                             f"{len(response.outputs)} outputs")
        return {tensor.name: _output(tensor, raw[index] if raw else None)
                for index, tensor in enumerate(response.outputs)
                if REGION not in tensor.parameters}

    def register_shm(self, name: str, key: str, byte_size: int, offset: int = 0) -> None:
        """Register ``byte_size`` bytes from ``offset`` of the POSIX shared memory object
        ``key`` as region ``name`` (needs the token)."""
        self.call("SystemSharedMemoryRegister", proto.SystemSharedMemoryRegisterRequest(
            name=name, key=key, offset=offset, byte_size=byte_size))

    def unregister_shm(self, name: str = "") -> None:
        """One region, or every region for "" (needs the token)."""
        self.call("SystemSharedMemoryUnregister",
                  proto.SystemSharedMemoryUnregisterRequest(name=name))

    def shm_status(self, name: str = "") -> list[dict[str, Any]]:
        response = self.call("SystemSharedMemoryStatus",
                             proto.SystemSharedMemoryStatusRequest(name=name))
        return [{"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size}
                for r in response.regions.values()]

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> GrpcClient:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()
