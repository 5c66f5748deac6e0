"""Small ONNX models for tests, written into a directory the test owns.

Each helper writes ``path`` and returns it.  The mlp family shares one interface — input ``x``
float32 [1, in_features], output ``y`` float32 [1, 10] — so a hot swap between any two of them
passes the input check and only their behaviour differs: slow, NaN-producing, or (for
``incompatible_model``) a different input shape.  Weights come from fixed seeds.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from agent.inference.demo_model import HeWeights, build_demo_cnn, finish_model

INPUT = "x"
OUTPUT = "y"


def _save(model: onnx.ModelProto, path: Path) -> Path:
    path.write_bytes(model.SerializeToString())
    return path


def _dense(name: str, rng: np.random.RandomState, n_in: int, n_out: int,
           initializers: list[onnx.TensorProto]) -> tuple[str, str]:
    """Weight and bias initializers for a Gemm ``x @ w + b`` (He-scaled)."""
    w = (rng.standard_normal((n_in, n_out)) * np.sqrt(2.0 / n_in)).astype(np.float32)
    b = (rng.standard_normal(n_out) * 0.1).astype(np.float32)
    initializers.append(numpy_helper.from_array(w, f"{name}.w"))
    initializers.append(numpy_helper.from_array(b, f"{name}.b"))
    return f"{name}.w", f"{name}.b"


def _mlp_graph(name: str, batch: str | int, in_features: int, hidden: int, out: int,
               extra_hidden_layers: int = 0, poison: bool = False) -> onnx.GraphProto:
    """x -> Gemm+Relu -> [MatMul+Relu with one shared square weight] * extra -> Gemm -> y.

    ``poison`` ends with ``Sqrt(-(|y| + 1))``, so every output is NaN.
    """
    rng = np.random.RandomState(sum(map(ord, name)))
    initializers: list[onnx.TensorProto] = []
    w1, b1 = _dense("fc1", rng, in_features, hidden, initializers)
    nodes = [helper.make_node("Gemm", [INPUT, w1, b1], ["h0.pre"]),
             helper.make_node("Relu", ["h0.pre"], ["h0"])]
    if extra_hidden_layers:
        # One weight shared by every layer: the file stays small however slow the model is.
        # Scaled to keep the activations' magnitude steady through the chain.
        square = rng.standard_normal((hidden, hidden)) * np.sqrt(2.0 / hidden)
        initializers.append(numpy_helper.from_array(square.astype(np.float32), "square.w"))
    for i in range(extra_hidden_layers):
        nodes.append(helper.make_node("MatMul", [f"h{i}", "square.w"], [f"h{i + 1}.pre"]))
        nodes.append(helper.make_node("Relu", [f"h{i + 1}.pre"], [f"h{i + 1}"]))
    w2, b2 = _dense("fc2", rng, hidden, out, initializers)
    last = OUTPUT if not poison else "logits"
    nodes.append(helper.make_node("Gemm", [f"h{extra_hidden_layers}", w2, b2], [last]))
    if poison:
        one = numpy_helper.from_array(np.ones(1, np.float32), "one")
        initializers.append(one)
        nodes += [helper.make_node("Abs", ["logits"], ["abs"]),
                  helper.make_node("Add", ["abs", "one"], ["positive"]),
                  helper.make_node("Neg", ["positive"], ["negative"]),
                  helper.make_node("Sqrt", ["negative"], [OUTPUT])]
    return helper.make_graph(
        nodes, name,
        [helper.make_tensor_value_info(INPUT, TensorProto.FLOAT, [batch, in_features])],
        [helper.make_tensor_value_info(OUTPUT, TensorProto.FLOAT, [batch, out])],
        initializers)


def conv_net(path: Path, batch: str | int = "N") -> Path:
    """The demo CNN's architecture (input ``image`` [batch,3,64,64], output [batch,10])."""
    return _save(build_demo_cnn(batch), path)


def mlp(path: Path, in_features: int = 64, hidden: int = 128, out: int = 10) -> Path:
    """``x`` [1,in_features] -> ``y`` [1,out]: two Gemm layers."""
    return _save(finish_model(_mlp_graph("mlp", 1, in_features, hidden, out)), path)


def dynamic_batch_mlp(path: Path) -> Path:
    """``mlp`` with a symbolic batch dimension ``N``."""
    return _save(finish_model(_mlp_graph("dynamic_batch_mlp", "N", 64, 128, 10)), path)


def slow_model(path: Path, factor: int = 50) -> Path:
    """Same interface as the default ``mlp`` plus ``factor`` chained 512x512 MatMul+Relu layers,
    each ~25x the mlp's whole arithmetic: at the default a call takes ~2 ms, ~80x an mlp's."""
    graph = _mlp_graph("slow_model", 1, 64, 512, 10, extra_hidden_layers=factor)
    return _save(finish_model(graph), path)


def nan_model(path: Path) -> Path:
    """Same interface as the default ``mlp``; every output is NaN."""
    return _save(finish_model(_mlp_graph("nan_model", 1, 64, 128, 10, poison=True)), path)


def incompatible_model(path: Path) -> Path:
    """Input ``x`` [1,32] instead of [1,64]: a hot swap must refuse it."""
    return _save(finish_model(_mlp_graph("incompatible_model", 1, 32, 128, 10)), path)


def sqrt_model(path: Path) -> Path:
    """Input ``x`` [1,64] like ``mlp``; the output is ``sqrt(x)``: finite for x >= 0, NaN for
    negative inputs, so it passes a warm-up and then fails on other data."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])
    graph = helper.make_graph([helper.make_node("Sqrt", ["x"], ["y"])], "sqrt_model", [x],
                              [y])
    return _save(finish_model(graph), path)


def small_nchw_cnn(path: Path, batch: str | int = 1) -> Path:
    """``image`` [batch,3,32,32] -> ``logits`` [batch,10]: three 3x3 Conv+Relu (8, 16, 32
    channels; the last two stride 2), GlobalAveragePool, Flatten, Gemm.  No softmax, so a
    converted model's error shows in the cosine of the logits."""
    weight = HeWeights(21)
    nodes: list[onnx.NodeProto] = []

    x = "image"
    for name, c_in, c_out, stride in (("c1", 3, 8, 1), ("c2", 8, 16, 2), ("c3", 16, 32, 2)):
        w = weight(f"{name}.w", (c_out, c_in, 3, 3), c_in * 9)
        b = weight(f"{name}.b", (c_out,), c_out)
        nodes.append(helper.make_node("Conv", [x, w, b], [f"{name}.conv"], kernel_shape=[3, 3],
                                      strides=[stride, stride], pads=[1, 1, 1, 1]))
        nodes.append(helper.make_node("Relu", [f"{name}.conv"], [name]))
        x = name
    nodes += [helper.make_node("GlobalAveragePool", [x], ["gap"]),
              helper.make_node("Flatten", ["gap"], ["flat"]),
              helper.make_node("Gemm", ["flat", weight("fc.w", (10, 32), 32),
                                        weight("fc.b", (10,), 10)], ["logits"], transB=1)]
    graph = helper.make_graph(
        nodes, "small_nchw_cnn",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, [batch, 3, 32, 32])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, 10])],
        weight.initializers)
    return _save(finish_model(graph), path)


def slow_image_model(path: Path, layers: int = 300, batch: str | int = 1) -> Path:
    """``image`` float32 [batch, 3, H, W] with dynamic H and W -> ``out`` of the same shape:
    ``layers`` chained 3x3 Convs sharing one weight, so the file stays small while a run's
    time grows with H x W (~15 ms a layer at 1024 x 1024 on one core: seconds a run, each
    operator short, so a cancelled run stops within milliseconds)."""
    rng = np.random.RandomState(7)
    weight = numpy_helper.from_array((rng.standard_normal((3, 3, 3, 3)) * 0.2)
                                     .astype(np.float32), "w")
    nodes, last = [], "image"
    for i in range(layers):
        nodes.append(helper.make_node("Conv", [last, "w"], [f"c{i}"], pads=[1, 1, 1, 1]))
        last = f"c{i}"
    nodes.append(helper.make_node("Relu", [last], ["out"]))
    graph = helper.make_graph(
        nodes, "slow_image_model",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, [batch, 3, "H", "W"])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [batch, 3, "H", "W"])],
        [weight])
    return _save(finish_model(graph), path)


def wide_conv_net(path: Path, size: int = 96, channels: int = 32) -> Path:
    """``image`` [1,3,size,size] -> ``logits`` [1,10] through two 3x3 Conv+Relu of
    ``channels`` at full resolution: a small file (~40 kB) whose activations are large
    (about 4.7 MB an input at the defaults), as a calibration set's memory grows with them."""
    weight = HeWeights(5)
    nodes: list[onnx.NodeProto] = []
    x = "image"
    for name, c_in in (("c1", 3), ("c2", channels)):
        w = weight(f"{name}.w", (channels, c_in, 3, 3), c_in * 9)
        b = weight(f"{name}.b", (channels,), channels)
        nodes += [helper.make_node("Conv", [x, w, b], [f"{name}.conv"], kernel_shape=[3, 3],
                                   pads=[1, 1, 1, 1]),
                  helper.make_node("Relu", [f"{name}.conv"], [name])]
        x = name
    nodes += [helper.make_node("GlobalAveragePool", [x], ["gap"]),
              helper.make_node("Flatten", ["gap"], ["flat"]),
              helper.make_node("Gemm", ["flat", weight("fc.w", (10, channels), channels),
                                        weight("fc.b", (10,), 10)], ["logits"], transB=1)]
    graph = helper.make_graph(
        nodes, "wide_conv_net",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, [1, 3, size, size])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 10])],
        weight.initializers)
    return _save(finish_model(graph), path)


SSD_SCORES = np.array([0.95, 0.9, 0.8, 0.7, 0.6, 0.5, 0.45, 0.3, 0.2, 0.1], np.float32)


def ssd_detector(path: Path, size: int = 64) -> Path:
    """A detector with a TF Object Detection API SSD's outputs: ``image`` uint8 [1, size, size,
    3] -> ``boxes`` [1, 10, 4] (y_min, x_min, y_max, x_max), ``classes`` [1, 10], ``scores``
    [1, 10] (SSD_SCORES times the image's brightest value / 255, so a darker image has fewer
    above Frigate's 0.4) and ``count`` [1]."""
    rng = np.random.RandomState(11)
    corners = np.sort(rng.random_sample((10, 2, 2)).astype(np.float32), axis=1)
    constants = {"boxes.c": corners.reshape(1, 10, 4), "scores.c": SSD_SCORES[None],
                 "classes.c": rng.randint(0, 80, (1, 10)).astype(np.float32),
                 "count.c": np.array([10], np.float32), "full": np.array(255, np.float32)}
    nodes = [helper.make_node("Cast", ["image"], ["pixels"], to=TensorProto.FLOAT),
             helper.make_node("ReduceMax", ["pixels"], ["peak"], keepdims=0),
             helper.make_node("Div", ["peak", "full"], ["level"]),
             helper.make_node("Mul", ["scores.c", "level"], ["scores"]),
             *(helper.make_node("Identity", [f"{name}.c"], [name])
               for name in ("boxes", "classes", "count"))]
    outputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape))
               for name, shape in (("boxes", (1, 10, 4)), ("classes", (1, 10)),
                                   ("scores", (1, 10)), ("count", (1,)))]
    graph = helper.make_graph(
        nodes, "ssd_detector",
        [helper.make_tensor_value_info("image", TensorProto.UINT8, [1, size, size, 3])],
        outputs, [numpy_helper.from_array(value, name) for name, value in constants.items()])
    return _save(finish_model(graph), path)
