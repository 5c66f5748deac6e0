"""Triton's gRPC messages and the core's types, each way: a ``ModelInferRequest`` decoded
(and bounded: every copy admitted against the request's reservation first), the response,
the model configuration and metadata.  ``grpc_api`` serves them; the translation is kept
apart so that the service reads as the list of calls it is.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from agent.serving import proto
from agent.serving.budget import Reservation
from agent.serving.core import (
    InferRequest,
    InferResult,
    ModelConfigView,
    OutputRequest,
    Tensor,
    TensorSpec,
)
from agent.serving.errors import invalid
from agent.serving.shm import RegionLookup
from agent.serving.shm_tensors import Window, read_input, region_ref, resolve, write_output
from agent.serving.tensors import (
    from_raw,
    from_typed,
    protocol_dtype,
    raw_size,
    to_raw,
    typed_bytes,
)

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


def tensor_metadata(repeated: Any, specs: tuple[TensorSpec, ...]) -> None:
    for spec in specs:
        repeated.add(name=spec.name, datatype=spec.datatype, shape=list(spec.shape))
