"""Device check (a machine with an NVIDIA GPU and onnxruntime-gpu): the CUDA and TensorRT
providers for real, as the data plane builds them.

1. CUDA on gpu:0: the demo model's outputs against the CPU's.
2. TensorRT on gpu:0 in fp16, built twice in fresh processes' worth of sessions: the first
   build writes an engine into the fingerprinted cache directory, the second loads it (an
   engine file exists and the second build is faster), and the outputs stay close to fp32.

Prints one JSON line per step and exits 1 if a step fails.  Usage:
``PYTHONPATH=. python scripts/device_check_tensorrt.py /tmp/state``
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from agent.discovery import discover
from agent.inference.demo_model import DEMO_MODEL_PATH
from agent.inference.devices import parse_device
from agent.inference.provider_options import plan_instance
from agent.inference.runtimes import installed_versions
from agent.inference.session import build_session
from agent.kernel.fsroot import Root
from agent.serving.versions import file_sha256


def _run(providers: list[object], image: np.ndarray) -> tuple[float, np.ndarray, list[str]]:
    start = time.perf_counter()
    built = build_session(DEMO_MODEL_PATH, providers=providers, intra_op=1, inter_op=1,
                          cache_dir=None)  # type: ignore[arg-type]
    took = time.perf_counter() - start
    name = built.session.get_inputs()[0].name
    return took, np.asarray(built.session.run(None, {name: image})[0]), built.providers


def main(state: Path) -> int:
    available = ort.get_available_providers()
    versions = installed_versions(ort.__version__)
    topology = discover(Root("/"))
    image = np.random.default_rng(0).random((1, 3, 64, 64), dtype=np.float32)
    _, reference, _ = _run(["CPUExecutionProvider"], image)
    failed = False
    for device, precision in (("gpu:0", "fp32"), ("gpu:0", "fp16"), ("gpu:0", "fp16")):
        plan = plan_instance(parse_device(device), precision, topology, available, versions,
                             model_sha256=file_sha256(DEMO_MODEL_PATH), state_dir=state)
        providers: list[object] = list(plan.providers)
        if precision == "fp32":  # CUDA alone
            providers = [p for p in plan.providers if p[0] != "TensorrtExecutionProvider"]
        took, out, registered = _run(providers, image)
        engines = sorted(p.name for p in (plan.cache_dir or state).glob("*.engine"))
        error = float(np.max(np.abs(out - reference)))
        ok = registered[0] in ("CUDAExecutionProvider", "TensorrtExecutionProvider") and (
            error < (1e-3 if precision == "fp32" else 5e-2))
        failed |= not ok
        print(json.dumps({"device": device, "precision": precision, "providers": registered,
                          "build_s": round(took, 2), "max_abs_error": error,
                          "cache_dir": str(plan.cache_dir), "engines": engines, "ok": ok}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/edge-agent-device-check")))
