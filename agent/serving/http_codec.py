"""The HTTP front end's bodies: an inference request in JSON with the binary tensor extension
decoded into ``InferRequest``, and results, metadata and configs encoded back.

Every field is checked for its type before it is used, and every size against the body it
came in, so a hostile body costs at most a pass over its own bytes and ends in a 400 that
says which field is wrong; nothing in it reaches numpy or the runtime unchecked.

What a body turns into is admitted against the data plane's memory budget before it is
built: the Python objects its JSON can become (its elements counted with a scan of its
separators before ``json.loads``, and bounded: 60 MB of ``{}`` would be 1.6 GB of dicts and
seconds of a parse that holds the GIL), tensors decoded from JSON values
or copied out of shared memory, and the outputs as they are encoded.  Binary inputs are
views of the body, already paid for, so the binary path costs no copy and no estimate.
JSON numbers that are not finite (``NaN``, ``Infinity``, ``1e999``) are refused for float
tensors: JSON has no such numbers, and a client that means them sends the binary extension.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from agent.serving.budget import Reservation
from agent.serving.core import (
    DATATYPES,
    IndexEntry,
    InferRequest,
    InferResult,
    ModelConfigView,
    ModelMetadata,
    OutputRequest,
    Tensor,
    TensorSpec,
)
from agent.serving.errors import invalid
from agent.serving.json_body import loads
from agent.serving.shm import RegionLookup
from agent.serving.shm_tensors import (
    RegionRef,
    Window,
    read_input,
    region_ref,
    resolve,
    write_output,
)
from agent.serving.tensors import from_raw, from_values, raw_size, to_raw, to_values

HEADER_LENGTH = "Inference-Header-Content-Length"
BACKEND = "onnxruntime"
MAX_NAME = 1024
# Far above any model's inputs or outputs, far below what a flood of them would cost.
MAX_TENSORS = 256
MAX_PARAMETERS = 64
VALUE_SLOT_BYTES = 8  # a JSON value's place in the flat list a tensor is built from
JSON_OUTPUT_VALUE_BYTES = 56  # an output value in a JSON response: a float object, its text
_DIGITS = re.compile(r"[0-9]{1,20}")


def dumps(document: Any) -> bytes:
    return json.dumps(document, separators=(",", ":")).encode("utf-8")


def header_length(value: str | None, body_length: int) -> int | None:
    """The JSON part's length from ``Inference-Header-Content-Length`` (None: the whole
    body), refused unless it is a plain decimal within the body."""
    if value is None:
        return None
    text = value.strip()
    if not _DIGITS.fullmatch(text):
        raise invalid(f"{HEADER_LENGTH} {value[:40]!r} is not a byte count")
    length = int(text)
    if length > body_length:
        raise invalid(f"{HEADER_LENGTH} {length} is beyond the body's {body_length} bytes")
    return length


def _name(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise invalid(f"{what} must be a non-empty string")
    if len(value) > MAX_NAME:
        raise invalid(f"{what} is longer than {MAX_NAME} characters")
    return value


def _object(value: Any, what: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise invalid(f"{what} must be a JSON object")
    return value


def _bounded(items: Any, limit: int, what: str) -> None:
    if len(items) > limit:
        raise invalid(f"{what}: {len(items)} given, at most {limit}")


def parameters(value: Any, what: str) -> dict[str, Any]:
    """A ``$parameters`` object: each value a string, number or boolean, as the protocol
    says (a finite number: NaN is no parameter), at most MAX_PARAMETERS of them."""
    found = _object(value, what)
    _bounded(found, MAX_PARAMETERS, what)
    for key, item in found.items():
        if isinstance(item, float) and not math.isfinite(item):
            raise invalid(f"{what}.{key[:64]} must be finite")
        if not isinstance(item, str | int | float | bool):
            raise invalid(f"{what}.{key[:64]} must be a string, number or boolean")
    return found


def _flag(params: Mapping[str, Any], key: str, what: str) -> bool | None:
    value = params.get(key)
    if value is not None and not isinstance(value, bool):
        raise invalid(f"{what}.{key} must be true or false")
    return value


@dataclass(frozen=True)
class _InputHead:
    name: str
    datatype: Any
    shape: Sequence[Any]
    binary_size: int | None
    data: Any
    ref: RegionRef | None  # the input lies in shared memory


def _input_head(index: int, item: Any) -> _InputHead:
    where = f"inputs[{index}]"
    if not isinstance(item, dict):
        raise invalid(f"{where} must be a JSON object")
    name = _name(item.get("name"), f"{where}.name")
    shape = item.get("shape")
    if not isinstance(shape, list):
        raise invalid(f"input {name}: shape must be a list of integers")
    params = parameters(item.get("parameters"), f"input {name}: parameters")
    ref = region_ref(params, f"input {name}")
    size = params.get("binary_data_size")
    if ref is not None:
        if size is not None or "data" in item:
            raise invalid(f"input {name}: in shared memory, so neither data nor "
                          "binary_data_size")
        return _InputHead(name, item.get("datatype"), shape, None, None, ref)
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 0):
        raise invalid(f"input {name}: binary_data_size must be an integer 0 or above")
    if size is not None and "data" in item:
        raise invalid(f"input {name}: both data and binary_data_size given")
    if size is None and "data" not in item:
        raise invalid(f"input {name}: no data and no binary_data_size")
    return _InputHead(name, item.get("datatype"), shape, size, item.get("data"), None)


def _outputs(value: Any, regions: RegionLookup
             ) -> tuple[tuple[OutputRequest, ...], dict[str, Window]]:
    """The requested outputs, and the regions those in shared memory go to."""
    if value is None:
        return (), {}
    if not isinstance(value, list):
        raise invalid("outputs must be a list")
    _bounded(value, MAX_TENSORS, "outputs")
    found, targets = [], {}
    for index, item in enumerate(value):
        if not isinstance(item, dict):
            raise invalid(f"outputs[{index}] must be a JSON object")
        name = _name(item.get("name"), f"outputs[{index}].name")
        params = parameters(item.get("parameters"), f"output {name}: parameters")
        if "classification" in params:
            raise invalid(f"output {name}: classification is not supported")
        ref = region_ref(params, f"output {name}")
        if ref is not None:
            targets[name] = resolve(regions, ref, f"output {name}")
        found.append(OutputRequest(name, _flag(params, "binary_data", f"output {name}")))
    return tuple(found), targets


@dataclass(frozen=True)
class DecodedInfer:
    """A request, whether its outputs come back binary by default, and the regions its
    outputs in shared memory go to."""

    request: InferRequest
    binary_default: bool
    targets: Mapping[str, Window]


def decode_infer(model: str, version: str, body: bytes | bytearray, length: int | None, *,
                 regions: RegionLookup, reservation: Reservation,
                 trusted: bool = False,
                 check: Callable[[str, list[int]], None] | None = None) -> DecodedInfer:
    """The request in ``body``: JSON (its first ``length`` bytes, or all of it), then each
    binary input's bytes in input order, which must add up to exactly the rest; inputs in
    shared memory are copied out of ``regions``.  What the JSON and the decoded tensors
    cost is admitted against ``reservation`` before they are built, after ``check`` (the
    serving version's input size cap, Models.check_elements) passed the shapes of those
    that are copies; binary inputs are views, which the registry's own check sees before
    any run.  ``trusted``: the caller showed the token (InferRequest.trusted)."""
    view = memoryview(body)
    head_end = len(body) if length is None else length
    json_part = body if head_end == len(body) else bytes(view[:head_end])
    document = loads(json_part, "the inference request", reservation)
    if not isinstance(document, dict):
        raise invalid("the inference request must be a JSON object")
    request_id = document.get("id", "")
    if not isinstance(request_id, str):
        raise invalid("id must be a string")
    params = parameters(document.get("parameters"), "parameters")
    binary_default = _flag(params, "binary_data_output", "parameters") or False
    items = document.get("inputs")
    if not isinstance(items, list) or not items:
        raise invalid("inputs must be a non-empty list")
    _bounded(items, MAX_TENSORS, "inputs")
    heads = [_input_head(index, item) for index, item in enumerate(items)]
    outputs, targets = _outputs(document.get("outputs"), regions)
    binary = view[head_end:]
    wanted = sum(head.binary_size or 0 for head in heads)
    if wanted != len(binary):
        raise invalid(f"binary_data_size of the inputs add up to {wanted} bytes, but "
                      f"{len(binary)} follow the JSON")
    if check is not None:
        for head in heads:
            if head.binary_size is None:
                check(head.name, list(head.shape))
    reservation.grow(sum(_decoded_cost(head) for head in heads), "the decoded inputs")
    inputs, offset = [], 0
    for head in heads:
        if head.ref is not None:
            window = resolve(regions, head.ref, f"input {head.name}")
            inputs.append(read_input(window, head.name, head.datatype, head.shape))
        elif head.binary_size is None:
            inputs.append(_finite(from_values(head.name, head.datatype, head.shape,
                                              head.data)))
        else:
            chunk = binary[offset:offset + head.binary_size]
            offset += head.binary_size
            inputs.append(from_raw(head.name, head.datatype, head.shape, chunk))
    extra = {key: value for key, value in params.items() if key != "binary_data_output"}
    return DecodedInfer(InferRequest(model, version, tuple(inputs), outputs, request_id, extra,
                                     trusted), binary_default, targets)


def _decoded_cost(head: _InputHead) -> int:
    """The bytes decoding an input allocates: nothing for a view of the body, the array for
    a copy out of shared memory, the array and the flat list of its values for JSON (the
    shape's rank, product and datatype checked here, before anything is built)."""
    if head.binary_size is not None:
        return 0
    size = raw_size(head.name, head.datatype, head.shape)
    if head.ref is not None:
        return size
    return size + VALUE_SLOT_BYTES * (size // DATATYPES[head.datatype].itemsize)


def _finite(tensor: Tensor) -> Tensor:
    """A float tensor from JSON without NaN or infinities (see the module)."""
    array = tensor.array
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        raise invalid(f"input {tensor.name}: NaN, Infinity or a number beyond "
                      f"{tensor.datatype} (such as 1e999) in its JSON data; send such values "
                      "with the binary tensor extension")
    return tensor


def encode_infer(result: InferResult, decoded: DecodedInfer,
                 reservation: Reservation) -> tuple[bytes, int | None]:
    """The response body and, when any output travels binary, the JSON part's length; an
    output in shared memory is written there and only named in the response.  The outputs
    and what encoding them makes are counted on ``reservation`` first (they exist: counted,
    never refused)."""
    asked = {out.name: out.binary for out in decoded.request.outputs}
    reservation.count(sum(_encoded_cost(tensor, asked.get(tensor.name), decoded)
                          for tensor in result.outputs))
    document: dict[str, Any] = {"model_name": result.model, "model_version": result.version}
    if decoded.request.id:
        document["id"] = decoded.request.id
    entries, chunks = [], []
    for tensor in result.outputs:
        entry: dict[str, Any] = {"name": tensor.name, "datatype": tensor.datatype,
                                 "shape": list(tensor.array.shape)}
        binary = asked.get(tensor.name)
        target = decoded.targets.get(tensor.name)
        if target is not None:
            entry["parameters"] = write_output(target, tensor)
        elif binary if binary is not None else decoded.binary_default:
            raw = to_raw(tensor.array)
            entry["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            entry["data"] = to_values(tensor.array)
        entries.append(entry)
    document["outputs"] = entries
    head = dumps(document)
    if not chunks:
        return head, None
    return b"".join([head, *chunks]), len(head)


def _encoded_cost(tensor: Tensor, binary: bool | None, decoded: DecodedInfer) -> int:
    """An output's array, and its bytes twice when it travels binary (its raw copy, the
    joined body), or its values as Python floats and text when it travels in JSON."""
    size = tensor.array.nbytes
    if tensor.name in decoded.targets:
        return size
    if binary if binary is not None else decoded.binary_default:
        return 3 * size
    return size + JSON_OUTPUT_VALUE_BYTES * tensor.array.size


def metadata_json(meta: ModelMetadata) -> dict[str, Any]:
    return {"name": meta.name, "versions": list(meta.versions), "platform": meta.platform,
            "inputs": [spec.to_dict() for spec in meta.inputs],
            "outputs": [spec.to_dict() for spec in meta.outputs]}


def config_type(datatype: str) -> str:
    """Triton's model-config name of a protocol datatype (BYTES is its TYPE_STRING)."""
    return "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"


def _config_tensor(spec: TensorSpec) -> dict[str, Any]:
    return {"name": spec.name, "data_type": config_type(spec.datatype),
            "dims": list(spec.shape)}


def config_json(view: ModelConfigView) -> dict[str, Any]:
    """The model configuration as Triton's ``GET …/config`` spells it."""
    return {
        "name": view.name, "platform": view.platform, "backend": BACKEND,
        "max_batch_size": view.max_batch_size,
        "input": [_config_tensor(spec) for spec in view.inputs],
        "output": [_config_tensor(spec) for spec in view.outputs],
        "instance_group": [{"name": f"{view.name}_{index}", "kind": group.kind,
                            "count": group.count, "gpus": list(group.gpus)}
                           for index, group in enumerate(view.instance_groups)],
        "version_policy": dict(view.version_policy),
        "parameters": {key: {"string_value": value} for key, value in view.parameters.items()},
    }


def index_json(entries: Sequence[IndexEntry]) -> list[dict[str, str]]:
    return [{"name": e.name, "version": e.version, "state": e.state, "reason": e.reason}
            for e in entries]


def optional_object(body: bytes | bytearray, what: str,
                    reservation: Reservation) -> dict[str, Any]:
    """An optional JSON object body (index, load, unload): empty is ``{}``."""
    if not body.strip():
        return {}
    document = loads(body, what, reservation)
    if not isinstance(document, dict):
        raise invalid(f"{what} must be a JSON object")
    return document
