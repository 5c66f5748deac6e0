"""The gRPC front end: Triton's ``inference.GRPCInferenceService`` over ``Models``.

It only translates, as the HTTP front end does: a message becomes the core's types, a
``ServeError`` becomes the gRPC status of the same name, and any other exception is a bug,
logged and answered ``INTERNAL`` so that no traceback reaches a client.  The server is a
plain synchronous one on the caller's thread pool: ``Models.infer`` blocks in the runtime
anyway, and a pool bounds how many run at once.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grpc
from google.protobuf import json_format  # type: ignore[import-untyped,unused-ignore]

from agent.serving import proto
from agent.serving.access import Access, bearer
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
from agent.serving.tensors import from_raw, from_values, to_raw
from agent.serving.wire import SplitRequest, split_infer_request

logger = logging.getLogger(__name__)

# Which typed field of InferTensorContents carries each datatype (FP16: raw only).
CONTENTS_FIELD = {
    "BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents",
    "INT32": "int_contents", "INT64": "int64_contents", "UINT8": "uint_contents",
    "UINT16": "uint_contents", "UINT32": "uint_contents", "UINT64": "uint64_contents",
    "FP32": "fp32_contents", "FP64": "fp64_contents",
}
CONTENTS_FIELDS = tuple(sorted({*CONTENTS_FIELD.values(), "bytes_contents"}))
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


def _typed_input(tensor: Any) -> Tensor:
    """An input from its typed ``contents``, which must be the datatype's own field."""
    field = CONTENTS_FIELD.get(tensor.datatype)
    if field is None and tensor.datatype == "FP16":
        raise invalid(f"input {tensor.name}: FP16 data goes in raw_input_contents (the "
                      "protocol has no typed field for it)")
    stray = [name for name in CONTENTS_FIELDS
             if name != field and len(getattr(tensor.contents, name))]
    if stray:
        raise invalid(f"input {tensor.name}: {tensor.datatype} data goes in "
                      f"{field or 'a supported datatype'}, not {', '.join(stray)}")
    values = list(getattr(tensor.contents, field)) if field else []
    return from_values(tensor.name, tensor.datatype, list(tensor.shape), values)


def infer_request(message: Any, *, regions: RegionLookup,
                  raw_contents: Sequence[bytes | memoryview] | None = None) -> InferRequest:
    """A ``ModelInferRequest`` decoded and size-checked: inputs in shared memory copied out
    of ``regions``, the others either all raw, one ``raw_input_contents`` entry each in
    their order (tritonclient sends none for an input in shared memory), or all typed.
    ``raw_contents``: those entries as ``wire.split_infer_request`` kept them (not copied).
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
        if ref is not None:
            window = resolve(regions, ref, f"input {tensor.name}")
            inputs.append(read_input(window, tensor.name, tensor.datatype, list(tensor.shape)))
        elif raw:
            inputs.append(from_raw(tensor.name, tensor.datatype, list(tensor.shape),
                                   next(contents)))
        else:
            inputs.append(_typed_input(tensor))
    outputs = []
    for output in message.outputs:
        if "classification" in output.parameters:
            raise invalid(f"output {output.name}: the classification extension is not "
                          "supported")
        outputs.append(OutputRequest(output.name))
    return InferRequest(message.model_name, message.model_version, tuple(inputs),
                        tuple(outputs), message.id,
                        parameter_values(message.parameters) if message.parameters else {})


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

    def __init__(self, models: Models, regions: SharedMemoryRegions, access: Access) -> None:
        self.models = models
        self.regions = regions
        self.access = access

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

    def ModelInfer(self, request: Any, token: str | None = None) -> Any:
        """A region in the request needs the token (see shm.CallerRegions).  ``request`` is
        a message, or what ``wire.split_infer_request`` made of one."""
        message, raw = (request if isinstance(request, SplitRequest) else (request, None))
        regions = CallerRegions(self.regions, lambda: self.access.check(token, control=True))
        targets = output_targets(message, regions)
        decoded = infer_request(message, regions=regions, raw_contents=raw)
        return infer_response(self.models.infer(decoded), targets)

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

    def SystemSharedMemoryRegister(self, request: Any) -> Any:
        self.regions.register(request.name, request.key, request.offset, request.byte_size)
        return proto.SystemSharedMemoryRegisterResponse()

    def SystemSharedMemoryUnregister(self, request: Any) -> Any:
        self.regions.unregister(request.name)
        return proto.SystemSharedMemoryUnregisterResponse()


def _authorization(context: Any) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key.lower() == "authorization" and isinstance(value, str):
            return value
    return None


def guarded(name: str, call: Callable[..., Any], access: Access
            ) -> Callable[[Any, Any], Any]:
    """``call`` behind the token check, with every failure turned into a status."""
    control = name in CONTROL

    def handle(request: Any, context: Any) -> Any:
        try:
            token = bearer(_authorization(context))
            access.check(token, control=control)
            return call(request, token) if name == "ModelInfer" else call(request)
        except ServeError as error:
            context.abort(grpc.StatusCode[error.code], error.message)
        except Exception:
            logger.exception("gRPC %s failed", name)
            context.abort(grpc.StatusCode.INTERNAL, f"{name} failed inside the server (a bug: "
                          "the agent's log has the details)")

    return handle


def build_grpc_server(models: Models, access: Access, *, max_request_bytes: int,
                      executor: concurrent.futures.ThreadPoolExecutor,
                      regions: SharedMemoryRegions | None = None) -> grpc.Server:
    """The server, not yet bound nor started: the caller adds the port
    (``add_insecure_port`` or a secure one) and starts it.  Without ``regions`` (the data
    plane shares one with HTTP) it keeps its own under the default prefix."""
    service = Service(models, regions if regions is not None
                      else bounded_regions(DEFAULT_PREFIX, max_request_bytes), access)
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(
            guarded(name, getattr(service, name), access),
            request_deserializer=(split_infer_request if name == "ModelInfer"
                                  else request.FromString),
            response_serializer=response.SerializeToString)
        for name, (request, response) in proto.METHODS.items()
    }
    server = grpc.server(executor, options=[
        ("grpc.max_receive_message_length", max_request_bytes),
        ("grpc.max_send_message_length", -1),
        # a port another server holds is an error, not shared with it (gRPC's default)
        ("grpc.so_reuseport", 0),
    ])
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(proto.SERVICE, handlers),))
    return server
