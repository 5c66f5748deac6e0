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
