"""The bundled demo model: where it ships, and how it was made.

The agent runs the demo when no model is configured.  Only ``DEMO_MODEL_PATH`` is used at run
time; ``build_demo_cnn`` regenerates the file (``scripts/make_demo_model.py``) and lets a test
catch a shipped file that drifted from its source.  ``onnx`` is a build-time dependency, so it
(and numpy) is imported inside the builders: importing this module for the path loads neither,
and the builder stays next to the file it produces instead of in a script tests cannot import.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import onnx

DEMO_MODEL_PATH = Path(__file__).with_name("models") / "demo_cnn.onnx"
OPSET = 17
# Pinned rather than onnx's newest, so runtimes back to onnxruntime 1.16 (common on Jetson
# images) load the file, and a newer onnx does not change the bytes.
IR_VERSION = 8
DEMO_INPUT = "image"
DEMO_OUTPUT = "probabilities"
DEMO_CLASSES = 10
_SEED = 20240517


class HeWeights:
    """He-scaled initializers from one seeded generator, collected in creation order: the
    same seed gives the same bytes, and activations stay in range through the layers."""

    def __init__(self, seed: int) -> None:
        import numpy as np

        self.rng = np.random.RandomState(seed)
        self.initializers: list[onnx.TensorProto] = []

    def __call__(self, name: str, shape: tuple[int, ...], fan_in: int) -> str:
        import numpy as np
        from onnx import numpy_helper

        values = self.rng.standard_normal(shape) * np.sqrt(2.0 / fan_in)
        self.initializers.append(numpy_helper.from_array(values.astype(np.float32), name))
        return name


def finish_model(graph: onnx.GraphProto) -> onnx.ModelProto:
    """A checked model at the pinned opset and IR version."""
    import onnx
    from onnx import helper

    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="edge-agent", ir_version=IR_VERSION)
    onnx.checker.check_model(model, full_check=True)
    return model


def build_demo_cnn(batch: str | int = "N") -> onnx.ModelProto:
    """A small MobileNet-like CNN: ``image`` [batch,3,64,64] float32 -> 10 class probabilities.

    Stem conv (stride 2), two depthwise-separable blocks (depthwise conv with group=channels,
    then a 1x1 conv), global average pool, a Gemm classifier and a softmax.  He-scaled weights
    from a fixed seed keep activations in range and the bytes reproducible.
    """
    from onnx import TensorProto, helper

    weight = HeWeights(_SEED)
    initializers = weight.initializers
    nodes: list[onnx.NodeProto] = []

    def conv_relu(x: str, name: str, c_in: int, c_out: int, kernel: int, stride: int,
                  group: int = 1) -> str:
        w = weight(f"{name}.w", (c_out, c_in // group, kernel, kernel),
                   c_in // group * kernel * kernel)
        b = weight(f"{name}.b", (c_out,), c_out)
        pad = kernel // 2
        nodes.append(helper.make_node("Conv", [x, w, b], [f"{name}.conv"], name=name,
                                      kernel_shape=[kernel, kernel], strides=[stride, stride],
                                      pads=[pad] * 4, group=group))
        nodes.append(helper.make_node("Relu", [f"{name}.conv"], [f"{name}.out"],
                                      name=f"{name}.relu"))
        return f"{name}.out"

    x = conv_relu(DEMO_INPUT, "stem", 3, 16, 3, 2)  # 32x32
    x = conv_relu(x, "block1.dw", 16, 16, 3, 1, group=16)
    x = conv_relu(x, "block1.pw", 16, 32, 1, 1)
    x = conv_relu(x, "block2.dw", 32, 32, 3, 2, group=32)  # 16x16
    x = conv_relu(x, "block2.pw", 32, 64, 1, 1)
    nodes.append(helper.make_node("GlobalAveragePool", [x], ["pooled"], name="pool"))
    nodes.append(helper.make_node("Flatten", ["pooled"], ["features"], name="flatten", axis=1))
    w = weight("classifier.w", (DEMO_CLASSES, 64), 64)
    b = weight("classifier.b", (DEMO_CLASSES,), DEMO_CLASSES)
    nodes.append(helper.make_node("Gemm", ["features", w, b], ["logits"], name="classifier",
                                  transB=1))
    nodes.append(helper.make_node("Softmax", ["logits"], [DEMO_OUTPUT], name="softmax", axis=1))

    graph = helper.make_graph(
        nodes, "demo_cnn",
        [helper.make_tensor_value_info(DEMO_INPUT, TensorProto.FLOAT, [batch, 3, 64, 64])],
        [helper.make_tensor_value_info(DEMO_OUTPUT, TensorProto.FLOAT, [batch, DEMO_CLASSES])],
        initializers)
    return finish_model(graph)
