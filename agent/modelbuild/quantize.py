"""ONNX Runtime's static quantization (QDQ) and the FP16 conversion, as a build runs them:
the model prepared once (opset raised where per-channel QDQ needs it, then
``quant_pre_process``), each variant quantized from that prepared copy."""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import onnx
from onnx import version_converter
from onnxruntime.quantization import (
    CalibrationDataReader,
    CalibrationMethod,
    QuantFormat,
    QuantType,
    quantize_static,
)
from onnxruntime.quantization.shape_inference import quant_pre_process
from onnxruntime.transformers.float16 import convert_float_to_float16

from agent.modelbuild.request import BuildError, Feed
from agent.modelbuild.variants import SENSITIVE_TYPES, Variant

QDQ_MIN_OPSET = 13  # QuantizeLinear/DequantizeLinear take a per-channel axis from opset 13
COMPUTE_TYPES = ("Conv", "ConvTranspose", "MatMul", "Gemm")  # where INT8 saves the time
# inputs ONNX Runtime's calibrator runs before it folds what it collected into its ranges or
# histograms and lets go: the histogram methods keep every activation of every input until
# then (2.4 GB for 64 inputs of a 6.8 MB MobileNetV3), so memory stays that of one chunk
CALIBRATION_CHUNK = 8


class NothingQuantized(BuildError):
    """A variant that left every compute node in float: it cannot be faster, and timing it
    on a noisy machine could only let noise decide."""


def opset(model: Any) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def prepare(source: Path, workdir: Path) -> Path:
    """The copy every variant quantizes from: raised to opset 13 when below it (the opset-9
    ResNet of opennsfw), shape-inferred and optimized as ONNX Runtime's tool advises."""
    try:
        model = onnx.load(str(source))
        start = source
        if opset(model) < QDQ_MIN_OPSET:
            start = workdir / "upgraded.onnx"
            onnx.save(version_converter.convert_version(model, QDQ_MIN_OPSET), str(start))
        prepared = workdir / "prepared.onnx"
        with _quiet():
            quant_pre_process(str(start), str(prepared), skip_symbolic_shape=True)
        _name_nodes(prepared)
    except Exception as error:  # onnx and the tool raise many kinds for a model they refuse
        raise BuildError(f"{source}: could not be prepared for quantization "
                         f"({type(error).__name__}: {error})") from None
    return prepared


def _name_nodes(path: Path) -> None:
    """Every node named (the optimizer leaves the nodes it makes unnamed, such as the
    HardSigmoid and Mul a HardSwish becomes): the quantizer leaves nodes in float by name."""
    model = onnx.load(str(path))
    taken = {node.name for node in model.graph.node}
    for index, node in enumerate(model.graph.node):
        if not node.name:
            node.name = f"{node.op_type}_{index}"
            while node.name in taken:
                node.name += "_"
            taken.add(node.name)
    onnx.save(model, str(path))


class _Reader(CalibrationDataReader):  # type: ignore[misc]
    """The calibration inputs, in the shape ``quantize_static`` reads them, in chunks of
    ``CALIBRATION_CHUNK``: with ``CalibStridedMinMax`` (which, despite its name, any method
    honours) the tool asks ``len`` and calls ``set_range`` for each chunk in turn.  The
    length is rounded up to whole chunks (the tool refuses a remainder) and the last chunk
    ends at the last input; every chunk holds at least one."""

    def __init__(self, feeds: Sequence[Feed]) -> None:
        self.feeds = feeds
        self.position, self.end = 0, len(feeds)

    def __len__(self) -> int:
        return -(-len(self.feeds) // CALIBRATION_CHUNK) * CALIBRATION_CHUNK

    def set_range(self, start_index: int, end_index: int) -> None:
        self.position, self.end = start_index, min(end_index, len(self.feeds))

    def get_next(self) -> Feed | None:
        if self.position >= self.end:
            return None
        self.position += 1
        return self.feeds[self.position - 1]

    def rewind(self) -> None:
        self.position, self.end = 0, len(self.feeds)


def quantize(prepared: Path, output: Path, variant: Variant, calibration: Sequence[Feed]) -> None:
    """Write ``variant`` of the prepared model to ``output``."""
    types = {"uint8": QuantType.QUInt8, "int8": QuantType.QInt8}
    methods = {"minmax": CalibrationMethod.MinMax, "percentile": CalibrationMethod.Percentile,
               "entropy": CalibrationMethod.Entropy}
    reader = _Reader(calibration)
    # MinMax ranges merged over chunks are exactly those of the whole set; a histogram's
    # bins are set by the first chunk and widened by later ones, so a percentile moves by
    # less than a bin.  (CalibMaxIntermediateOutputs is not used: ONNX Runtime 1.32 drops
    # the outputs it counts instead of merging them.)
    extra: dict[str, Any] = {"ActivationSymmetric": variant.symmetric,
                             "WeightSymmetric": True, "CalibStridedMinMax": CALIBRATION_CHUNK}
    try:
        with _quiet():
            quantize_static(str(prepared), str(output), reader,
                            quant_format=QuantFormat.QDQ, per_channel=variant.per_channel,
                            activation_type=types[variant.activation],
                            weight_type=types[variant.weight],
                            calibrate_method=methods[variant.method],
                            nodes_to_exclude=sensitive_nodes(prepared)
                            if variant.keep_sensitive_float else None,
                            extra_options=extra)
    except Exception as error:  # the tool's refusals are of many kinds
        raise BuildError(f"{variant.name}: quantization failed "
                         f"({type(error).__name__}: {error})") from None
    check_quantized(output)


def check_quantized(model: Path) -> None:
    """NothingQuantized unless some Conv/MatMul/Gemm takes a dequantized weight."""
    graph = onnx.load(str(model)).graph
    dequantized = {out for node in graph.node if node.op_type == "DequantizeLinear"
                   for out in node.output}
    compute = [node for node in graph.node if node.op_type in COMPUTE_TYPES]
    if compute and not any(len(node.input) > 1 and node.input[1] in dequantized
                           for node in compute):
        raise NothingQuantized(f"leaves all {len(compute)} Conv/MatMul/Gemm nodes in float: "
                               "nothing to gain")


def sensitive_nodes(prepared: Path) -> list[str]:
    """The sensitive nodes and the nodes right before and after them: the convolution whose
    output a hard-swish reshapes is where INT8 error grows."""
    graph = onnx.load(str(prepared)).graph
    producers = {out: node for node in graph.node for out in node.output}
    keep: set[str] = set()
    for node in graph.node:
        if node.op_type not in SENSITIVE_TYPES:
            continue
        keep.add(node.name)
        keep.update(producers[i].name for i in node.input if i in producers)
        keep.update(c.name for c in graph.node if set(c.input) & set(node.output))
    return sorted(name for name in keep if name)


def to_fp16(source: Path, output: Path) -> None:
    """FP16 weights and compute, float32 inputs and outputs (so clients do not change)."""
    try:
        with _quiet():
            model = convert_float_to_float16(onnx.load(str(source)), keep_io_types=True)
        onnx.save(model, str(output))
    except Exception as error:
        raise BuildError(f"{source}: FP16 conversion failed "
                         f"({type(error).__name__}: {error})") from None


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The tools print progress bars and warnings meant for a notebook; a build reports its
    own progress, so theirs goes to the debug log."""
    sink = io.StringIO()
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            yield
    finally:
        root.setLevel(level)
        if sink.getvalue():
            logging.getLogger(__name__).debug("%s", sink.getvalue()[-4000:])
