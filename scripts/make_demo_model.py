"""Regenerate the bundled demo model and print its size and sha256.

Run after changing ``build_demo_cnn``; tests/test_demo_model.py fails until the shipped file
matches the builder again.  Needs the dev dependency ``onnx``.
"""

from __future__ import annotations

import hashlib

from agent.inference.demo_model import DEMO_MODEL_PATH, build_demo_cnn


def main() -> None:
    data = build_demo_cnn().SerializeToString()
    DEMO_MODEL_PATH.parent.mkdir(parents=True, exist_ok=True)
    DEMO_MODEL_PATH.write_bytes(data)
    print(f"{DEMO_MODEL_PATH}: {len(data)} bytes, sha256 {hashlib.sha256(data).hexdigest()}")


if __name__ == "__main__":
    main()
