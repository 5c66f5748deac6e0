"""``edge-agent model build``: an ONNX model turned into what a target runs best (INT8, FP16,
``.rknn``), checked against the original by an accuracy gate and a speed ratio measured on
this device, and installed as the next repository version only when it passes.

Control-plane only: the data plane never imports it (quantization pulls in ``onnx``)."""
