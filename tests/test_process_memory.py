"""The data plane's allocator policy (agent.kernel.process), measured in a child process:
freed large buffers (a gRPC message's tensor) are reused without page faults, and given
back to the kernel on request.  A child, so the test process keeps glibc's defaults."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

CHILD = r"""
import json, resource, sys
from agent.kernel.process import keep_freed_buffers, release_freed_memory

def faults(): return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def rss(): return int(open("/proc/self/statm").read().split()[1]) * 4096

kept = keep_freed_buffers(32 << 20) if sys.argv[1] == "keep" else None
import numpy as np
from agent.serving import proto
tensor = np.ones((1, 3, 224, 224), np.float32)  # 600 KB
before = faults()
for _ in range(100):  # what a gRPC client does per request: the message built and sent
    request = proto.ModelInferRequest(model_name="m")
    request.raw_input_contents.append(tensor.tobytes())
    request.SerializeToString()
reuse = faults() - before
held = [b"\1" * (1 << 20) for _ in range(48)]
del held
burst = rss()
release_freed_memory()
print(json.dumps({"kept": kept, "faults": reuse, "burst": burst, "released": rss()}))
"""


def child(mode: str) -> dict[str, int]:
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True,
                         check=True, timeout=60)
    return dict(json.loads(out.stdout))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_freed_buffers_are_reused_without_faults_and_released_on_request() -> None:
    default, kept = child("default"), child("keep")
    assert kept["kept"] is True
    # glibc's default maps each large buffer afresh or trims it on free, faulting it in
    # again: ~147 faults per 600 KB copy
    assert default["faults"] > 100 * 100
    assert kept["faults"] < default["faults"] / 20
    # the 48 MB burst stays in the heap until release_freed_memory hands it back
    assert kept["burst"] - kept["released"] > 40 << 20


SESSION_CHILD = r"""
import json, resource, sys
import numpy as np
import onnx
from onnx import TensorProto, helper
from agent.kernel.process import keep_freed_buffers
keep_freed_buffers(3 << 20)  # a 4 MB block is beyond it, each 512 KB tensor within it
import onnxruntime as ort
from agent.inference.options import session_options

# eight 512 KB activations alive at once (a batch of 8 rows of 16384 floats each), summed
ops = ["Relu", "Neg", "Abs", "Sigmoid", "Exp", "Tanh", "Floor", "Ceil"]
nodes = [helper.make_node(op, ["x"], [f"a{i}"]) for i, op in enumerate(ops)]
nodes.append(helper.make_node("Sum", [f"a{i}" for i in range(len(ops))], ["y"]))
graph = helper.make_graph(
    nodes, "wide", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16384])],
    [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 16384])])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
options = session_options(1, 1, memory_arena=False)
if sys.argv[1] == "pattern":
    options.enable_mem_pattern = True
session = ort.InferenceSession(model.SerializeToString(), options,
                               providers=["CPUExecutionProvider"])
x = np.ones((8, 16384), np.float32)
for _ in range(5):
    session.run(None, {"x": x})
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    session.run(None, {"x": x})
print(json.dumps({"faults": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_data_plane_sessions_take_activations_from_the_kept_heap_without_faults() -> None:
    """Without ORT's arena, a run's activations come tensor by tensor from the heap the
    data plane keeps; ORT's memory pattern would take them as one block per run, which
    beyond the mmap threshold is mapped (and faulted in) afresh on every run."""

    def faults(mode: str) -> float:
        out = subprocess.run([sys.executable, "-c", SESSION_CHILD, mode], capture_output=True,
                             text=True, check=True, timeout=60)
        return float(json.loads(out.stdout)["faults"])

    pattern, served = faults("pattern"), faults("served")
    assert pattern > 500  # a 4 MB block faulted in per run: about 1000 pages
    assert served * 5 < pattern  # (about 90 here, the output's pages)
