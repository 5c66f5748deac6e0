"""The gRPC front end: Triton's ``inference.GRPCInferenceService`` over ``Models``.

It only translates, as the HTTP front end does: a message becomes the core's types, a
``ServeError`` becomes the gRPC status of the same name, and any other exception is a bug,
logged and answered ``INTERNAL`` so that no traceback reaches a client.  The server is a
plain synchronous one on the caller's thread pool: ``Models.infer`` blocks in the runtime
anyway, and a pool bounds how many run at once.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import grpc
import numpy as np
from google.protobuf import json_format  # type: ignore[import-untyped,unused-ignore]
from google.protobuf.message import DecodeError  # type: ignore[import-untyped,unused-ignore]

from agent.serving import proto
from agent.serving.access import Access, bearer
from agent.serving.budget import MemoryBudget, Reservation, default_limit_bytes
from agent.serving.core import (
    InferRequest,
    InferResult,
    ModelConfigView,
    Models,
    OutputRequest,
    Tensor,
    TensorSpec,
)
from agent.serving.errors import ServeError, invalid
from agent.serving.shm import (
    DEFAULT_PREFIX,
    CallerRegions,
    RegionLookup,
    SharedMemoryRegions,
    bounded_regions,
)
from agent.serving.shm_tensors import Window, read_input, region_ref, resolve, write_output
from agent.serving.tensors import (
    from_raw,
    from_typed,
    protocol_dtype,
    raw_size,
    to_raw,
    typed_bytes,
)
from agent.serving.wire import WalkedRequest, walk_infer_request

logger = logging.getLogger(__name__)

# Which typed field of InferTensorContents carries each datatype (FP16: raw only).
CONTENTS_FIELD = {
    "BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents",
    "INT32": "int_contents", "INT64": "int64_contents", "UINT8": "uint_contents",
    "UINT16": "uint_contents", "UINT32": "uint_contents", "UINT64": "uint64_contents",
    "FP32": "fp32_contents", "FP64": "fp64_contents",
}
CONTENTS_FIELDS = tuple(sorted({*CONTENTS_FIELD.values(), "bytes_contents"}))
# the type of each typed field's elements, as protobuf holds them
CONTENTS_DTYPE = {
    "bool_contents": np.dtype(np.bool_), "int_contents": np.dtype(np.int32),
    "int64_contents": np.dtype(np.int64), "uint_contents": np.dtype(np.uint32),
    "uint64_contents": np.dtype(np.uint64), "fp32_contents": np.dtype(np.float32),
    "fp64_contents": np.dtype(np.float64),
}
MAX_MESSAGE = 2048  # characters of a status message (3 bytes each at worst, escaped)
# the calls whose handler is given the caller's token
TAKES_TOKEN = frozenset({"ModelInfer", "SystemSharedMemoryRegister"})
# the calls that need the token even on loopback
CONTROL = frozenset({"RepositoryModelLoad", "RepositoryModelUnload",
                     "SystemSharedMemoryRegister", "SystemSharedMemoryUnregister"})


def parameter_values(parameters: Mapping[str, Any]) -> dict[str, Any]:
    """A map of InferParameter / ModelRepositoryParameter as plain Python values (an unset
    one is left out: it carries nothing)."""
    values = {}
    for key, parameter in parameters.items():
        choice = parameter.WhichOneof("parameter_choice")
        if choice is not None:
            values[key] = getattr(parameter, choice)
    return values


def _typed_input(tensor: Any, reservation: Reservation) -> Tensor:
    """An input from its typed ``contents``, which must be the datatype's own field; the
    array's bytes are admitted before it is made (protobuf's count of the values is
    exact, so a shape or a count out of proportion is refused before any allocation)."""
    protocol_dtype(tensor.name, tensor.datatype)  # one not carried is refused here
    field = CONTENTS_FIELD.get(tensor.datatype)
    if field is None:  # FP16, the one carried without a typed field
        raise invalid(f"input {tensor.name}: FP16 data goes in raw_input_contents (the "
                      "protocol has no typed field for it)")
    stray = [name for name in CONTENTS_FIELDS
             if name != field and len(getattr(tensor.contents, name))]
    if stray:
        raise invalid(f"input {tensor.name}: {tensor.datatype} data goes in {field}, not "
                      f"{', '.join(stray)}")
    values, dtype = getattr(tensor.contents, field), CONTENTS_DTYPE[field]
    reservation.grow(typed_bytes(tensor.datatype, len(values), dtype), f"input {tensor.name}")
    return from_typed(tensor.name, tensor.datatype, list(tensor.shape), values, dtype)


def infer_request(message: Any, *, regions: RegionLookup, reservation: Reservation,
                  raw_contents: Sequence[bytes | memoryview] | None = None,
                  trusted: bool = False,
                  check: Callable[[str, list[int]], None] | None = None) -> InferRequest:
    """A ``ModelInferRequest`` decoded and size-checked: inputs in shared memory copied out
    of ``regions``, the others either all raw, one ``raw_input_contents`` entry each in
    their order (tritonclient sends none for an input in shared memory), or all typed.
    ``raw_contents``: those entries as ``WalkedRequest.parse`` kept them (not copied);
    raw inputs are views of them, while copies out of shared memory and typed contents
    are admitted on ``reservation`` before they are made, after ``check`` (the serving
    version's input size cap, Models.check_elements) passed their declared shapes; raw
    inputs are views, which the registry's own check sees before any run.  ``trusted``:
    the caller showed the token (see ``InferRequest``).
    An input without parameters is not in shared memory: the usual request (every input raw,
    none with parameters) is decoded without looking for references."""
    tensors = message.inputs
    refs = [region_ref(parameter_values(t.parameters), f"input {t.name}") if t.parameters
            else None for t in tensors]
    by_value = tensors
    if any(ref is not None for ref in refs):
        in_shm = [t.name for t, ref in zip(tensors, refs, strict=True)
                  if ref is not None and t.HasField("contents")]
        if in_shm:
            raise invalid(f"inputs {', '.join(in_shm)} are in shared memory and carry "
                          "contents: use one or the other")
        by_value = [t for t, ref in zip(tensors, refs, strict=True) if ref is None]
    raw = message.raw_input_contents if raw_contents is None else raw_contents
    if raw:
        typed = [t.name for t in by_value if t.HasField("contents")]
        if typed:
            raise invalid(f"inputs {', '.join(typed)} carry typed contents while the request "
                          "carries raw_input_contents: use one or the other")
        if len(raw) != len(by_value):
            raise invalid(f"{len(raw)} raw_input_contents for {len(by_value)} inputs not in "
                          "shared memory: one each, in the inputs' order")
    contents = iter(raw)
    inputs = []
    for tensor, ref in zip(tensors, refs, strict=True):
        if check is not None and (ref is not None or not raw):
            check(tensor.name, list(tensor.shape))
        if ref is not None:
            window = resolve(regions, ref, f"input {tensor.name}")
            reservation.grow(raw_size(tensor.name, tensor.datatype, list(tensor.shape)),
                             f"input {tensor.name}")
            inputs.append(read_input(window, tensor.name, tensor.datatype, list(tensor.shape)))
        elif raw:
            inputs.append(from_raw(tensor.name, tensor.datatype, list(tensor.shape),
                                   next(contents)))
        else:
            inputs.append(_typed_input(tensor, reservation))
    outputs = []
    for output in message.outputs:
        if "classification" in output.parameters:
            raise invalid(f"output {output.name}: the classification extension is not "
                          "supported")
        outputs.append(OutputRequest(output.name))
    return InferRequest(message.model_name, message.model_version, tuple(inputs),
                        tuple(outputs), message.id,
                        parameter_values(message.parameters) if message.parameters else {},
                        trusted=trusted)


def output_targets(message: Any, regions: RegionLookup) -> dict[str, Window]:
    """The regions the request's outputs in shared memory go to, resolved before it runs."""
    targets = {}
    for output in message.outputs:
        ref = region_ref(parameter_values(output.parameters), f"output {output.name}")
        if ref is not None:
            targets[output.name] = resolve(regions, ref, f"output {output.name}")
    return targets


def infer_response(result: InferResult, targets: Mapping[str, Window]) -> Any:
    """The response as Triton's server writes it: each output's bytes in
    ``raw_output_contents``, in the order of ``outputs`` (what tritonclient reads); an
    output in shared memory is written there, named in its parameters, and keeps its place
    with an empty entry."""
    response = proto.ModelInferResponse(model_name=result.model, model_version=result.version,
                                        id=result.id)
    for tensor in result.outputs:
        entry = response.outputs.add(name=tensor.name, datatype=tensor.datatype,
                                     shape=list(tensor.array.shape))
        target = targets.get(tensor.name)
        if target is None:
            response.raw_output_contents.append(to_raw(tensor.array))
            continue
        for key, value in write_output(target, tensor).items():
            if isinstance(value, str):
                entry.parameters[key].string_param = value
            else:
                entry.parameters[key].int64_param = value
        response.raw_output_contents.append(b"")
    return response


def config_type(datatype: str) -> int:
    """model_config.proto's DataType of a protocol datatype (BYTES is TYPE_STRING there)."""
    return proto.enum_number("DataType", "TYPE_STRING" if datatype == "BYTES"
                             else f"TYPE_{datatype}")


def _config_tensors(repeated: Any, specs: tuple[TensorSpec, ...]) -> None:
    for spec in specs:
        repeated.add(name=spec.name, data_type=config_type(spec.datatype), dims=list(spec.shape))


def model_config(view: ModelConfigView) -> Any:
    """Triton's ModelConfig of the fields with an equivalent here."""
    response = proto.ModelConfigResponse()
    config = response.config
    config.name = view.name
    config.platform = view.platform
    config.backend = "onnxruntime"
    config.max_batch_size = view.max_batch_size
    _config_tensors(config.input, view.inputs)
    _config_tensors(config.output, view.outputs)
    for index, group in enumerate(view.instance_groups):
        config.instance_group.add(name=f"{view.name}_{index}", count=group.count,
                                  gpus=list(group.gpus),
                                  kind=proto.enum_number("ModelInstanceGroup.Kind", group.kind))
    policy = view.version_policy
    if "latest" in policy:
        config.version_policy.latest.num_versions = int(policy["latest"])
    elif "specific" in policy:
        config.version_policy.specific.versions.extend(int(v) for v in policy["specific"])
    elif "all" in policy:
        config.version_policy.all.SetInParent()
    for key, value in view.parameters.items():
        config.parameters[key].string_value = value
    return response


def _tensor_metadata(repeated: Any, specs: tuple[TensorSpec, ...]) -> None:
    for spec in specs:
        repeated.add(name=spec.name, datatype=spec.datatype, shape=list(spec.shape))


class Service:
    """One method per call, named as the protocol names it, each a message in and a message
    out; raises ``ServeError``."""

    def __init__(self, models: Models, regions: SharedMemoryRegions, access: Access,
                 budget: MemoryBudget) -> None:
        self.models = models
        self.regions = regions
        self.access = access
        self.budget = budget

    def ServerLive(self, request: Any) -> Any:
        return proto.ServerLiveResponse(live=self.models.live())

    def ServerReady(self, request: Any) -> Any:
        return proto.ServerReadyResponse(ready=self.models.ready())

    def ServerMetadata(self, request: Any) -> Any:
        meta = self.models.server_metadata()
        return proto.ServerMetadataResponse(name=meta["name"], version=meta["version"],
                                            extensions=list(meta["extensions"]))

    def ModelReady(self, request: Any) -> Any:
        return proto.ModelReadyResponse(ready=self.models.model_ready(request.name,
                                                                      request.version))

    def ModelMetadata(self, request: Any) -> Any:
        meta = self.models.model_metadata(request.name, request.version)
        response = proto.ModelMetadataResponse(name=meta.name, versions=list(meta.versions),
                                               platform=meta.platform)
        _tensor_metadata(response.inputs, meta.inputs)
        _tensor_metadata(response.outputs, meta.outputs)
        return response

    def ModelInfer(self, request: WalkedRequest, token: str | None = None) -> Any:
        """A region in the request needs the token (see shm.CallerRegions).  ``request`` is
        what ``wire.walk_infer_request`` made of the message.  The request's bytes, what
        protobuf makes of them and what decoding copies are admitted against the budget
        before each is made, the outputs counted once they exist; all of it is released
        when the call returns (its response is then serialized by gRPC, the one step the
        budget does not see)."""
        with self.budget.reserve(request.cost, "the request") as reservation:
            message, raw = request.parse()
            regions = CallerRegions(self.regions,
                                    lambda: self.access.check(token, control=True))
            targets = output_targets(message, regions)
            decoded = infer_request(
                message, regions=regions, reservation=reservation, raw_contents=raw,
                trusted=self.access.holds(token),
                check=functools.partial(self.models.check_elements, message.model_name,
                                        message.model_version))
            result = self.models.infer(decoded)
            # the arrays, and the copy of each that goes into the response
            reservation.count(2 * sum(tensor.array.nbytes for tensor in result.outputs))
            return infer_response(result, targets)

    def ModelConfig(self, request: Any) -> Any:
        if request.version:
            self.models.model_ready(request.name, request.version)  # NOT_FOUND if it lacks it
        return model_config(self.models.model_config(request.name))

    def ModelStatistics(self, request: Any) -> Any:
        """Triton's statistics JSON is the message's JSON mapping; our own extra keys (not
        in the message) are dropped here and stay on HTTP."""
        response = proto.ModelStatisticsResponse()
        for entry in self.models.statistics(request.name, request.version):
            json_format.ParseDict(entry, response.model_stats.add(), ignore_unknown_fields=True)
        return response

    def RepositoryIndex(self, request: Any) -> Any:
        """One repository here, so ``repository_name`` selects nothing."""
        response = proto.RepositoryIndexResponse()
        for entry in self.models.index(request.ready):
            response.models.add(name=entry.name, version=entry.version, state=entry.state,
                                reason=entry.reason)
        return response

    def RepositoryModelLoad(self, request: Any) -> Any:
        self.models.load(request.model_name, parameter_values(request.parameters))
        return proto.RepositoryModelLoadResponse()

    def RepositoryModelUnload(self, request: Any) -> Any:
        self.models.unload(request.model_name, parameter_values(request.parameters))
        return proto.RepositoryModelUnloadResponse()

    def SystemSharedMemoryStatus(self, request: Any) -> Any:
        response = proto.SystemSharedMemoryStatusResponse()
        for status in self.regions.status(request.name):
            response.regions[status["name"]].CopyFrom(proto.RegionStatus(**status))
        return response

    def SystemSharedMemoryRegister(self, request: Any, token: str | None = None) -> Any:
        """Objects the token's owner may use only (see ``SharedMemoryRegions.register``)."""
        self.regions.register(request.name, request.key, request.offset, request.byte_size,
                              owner=self.access.owner(token))
        return proto.SystemSharedMemoryRegisterResponse()

    def SystemSharedMemoryUnregister(self, request: Any) -> Any:
        self.regions.unregister(request.name)
        return proto.SystemSharedMemoryUnregisterResponse()


def _authorization(context: Any) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key.lower() == "authorization" and isinstance(value, str):
            return value
    return None


class Refused(NamedTuple):
    """A message its deserializer refused, handed to the handler to answer: a deserializer
    that raises makes gRPC answer INTERNAL, which is no answer to a client's mistake."""

    error: ServeError


def deserializer(name: str, message_class: Any) -> Callable[[bytes], Any]:
    """The call's request deserializer.  It runs on gRPC's one thread that reads every
    connection, so ModelInfer's is the bounded walk (``wire``): what the deserializer
    costs, every client waits for."""
    if name == "ModelInfer":
        def walk(data: bytes) -> Any:
            try:
                return walk_infer_request(data)
            except ServeError as error:
                return Refused(error)
        return walk

    def parse(data: bytes) -> Any:
        try:
            return message_class.FromString(data)
        except DecodeError as error:
            return Refused(invalid(f"the request is not a valid {name}Request: {error}"))
    return parse


def _fitting(message: str) -> str:
    """A status message within gRPC's metadata limit (16 KB, counted after escaping): one
    naming a thousand inputs must still reach the client as the status it is."""
    return message if len(message) <= MAX_MESSAGE else message[:MAX_MESSAGE] + "..."


def guarded(name: str, call: Callable[..., Any], access: Access
            ) -> Callable[[Any, Any], Any]:
    """``call`` behind the token check, with every failure turned into a status."""
    control = name in CONTROL

    def handle(request: Any, context: Any) -> Any:
        try:
            token = bearer(_authorization(context))
            access.check(token, control=control)
            if isinstance(request, Refused):
                raise request.error
            return call(request, token) if name in TAKES_TOKEN else call(request)
        except ServeError as error:
            context.abort(grpc.StatusCode[error.code], _fitting(error.message))
        except Exception:
            logger.exception("gRPC %s failed", name)
            context.abort(grpc.StatusCode.INTERNAL, f"{name} failed inside the server (a bug: "
                          "the agent's log has the details)")

    return handle


@dataclass(frozen=True)
class ConnectionLimits:
    """What clients together may hold of the gRPC front end, each enforced by gRPC core.
    Without them 1,100 idle connections (or a slowloris) filled the descriptor table and
    kept every new client out: connections beyond ``connections`` are closed as they come,
    and one that holds a place without using it is closed in seconds (no HTTP/2 preface
    within ``handshake_timeout_ms``) or goes (GOAWAY: a client's channel reconnects on its
    next call) after ``idle_ms`` without a call, or ``age_ms`` (+ ``age_grace_ms`` for the
    calls under way) in all: a call whose message never comes holds a worker no longer.
    Calls beyond ``concurrent_rpcs`` are answered RESOURCE_EXHAUSTED at once rather than
    queued behind the workers."""

    concurrent_rpcs: int = 128  # twice serve.workers' default
    connections: int = 256
    handshake_timeout_ms: int = 5_000
    idle_ms: int = 15_000
    age_ms: int = 120_000
    age_grace_ms: int = 30_000

    def options(self) -> list[tuple[str, int]]:
        return [("grpc.max_allowed_incoming_connections", self.connections),
                ("grpc.server_handshake_timeout_ms", self.handshake_timeout_ms),
                ("grpc.max_connection_idle_ms", self.idle_ms),
                ("grpc.max_connection_age_ms", self.age_ms),
                ("grpc.max_connection_age_grace_ms", self.age_grace_ms)]


def build_grpc_server(models: Models, access: Access, *, max_request_bytes: int,
                      executor: concurrent.futures.ThreadPoolExecutor,
                      regions: SharedMemoryRegions | None = None,
                      budget: MemoryBudget | None = None,
                      limits: ConnectionLimits = ConnectionLimits()) -> grpc.Server:
    """The server, not yet bound nor started: the caller adds the port
    (``add_insecure_port`` or a secure one) and starts it.  Without ``regions`` (the data
    plane shares one with HTTP) it keeps its own under the default prefix; without
    ``budget`` (the data plane's is shared too) one of its own, sized for no device."""
    service = Service(models, regions if regions is not None
                      else bounded_regions(DEFAULT_PREFIX, max_request_bytes), access,
                      budget or MemoryBudget(default_limit_bytes(None, max_request_bytes)))
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(
            guarded(name, getattr(service, name), access),
            request_deserializer=deserializer(name, request),
            response_serializer=response.SerializeToString)
        for name, (request, response) in proto.METHODS.items()
    }
    server = grpc.server(executor, options=[
        ("grpc.max_receive_message_length", max_request_bytes),
        ("grpc.max_send_message_length", -1),
        # a port another server holds is an error, not shared with it (gRPC's default)
        ("grpc.so_reuseport", 0),
        *limits.options(),
    ], maximum_concurrent_rpcs=limits.concurrent_rpcs)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(proto.SERVICE, handlers),))
    return server
