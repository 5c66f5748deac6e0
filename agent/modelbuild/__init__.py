"""``edge-agent model build``: an ONNX model converted for a target, gated against the
original, and installed into the repository only when it passes."""
