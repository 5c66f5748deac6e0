"""SessionError, the one exception inference setup raises, and how a refused model file
becomes one.

Apart from the session code so that callers which only catch it (the service's swap command,
the CLI) do not import onnxruntime for it.
"""

from __future__ import annotations

import re
from pathlib import Path


class SessionError(RuntimeError):
    """The session cannot be built as configured (providers, model file, digest).

    ``model`` is set when the model file is the problem; the message then begins with it.
    """

    def __init__(self, message: str, model: str | None = None) -> None:
        super().__init__(message)
        self.model = model


def model_error(path: Path, what: str) -> SessionError:
    return SessionError(f"{path}: {what}", model=str(path))


_ORT_STATUS = re.compile(r"^\[ONNXRuntimeError\] : \d+ : (\w+) : ")


def ort_error(path: Path, error: Exception) -> SessionError:
    """ORT's refusal of a model file as one line that names the file.

    ORT reports bytes that are no ONNX protobuf as INVALID_PROTOBUF (a truncated or random
    file) or, for an empty or graph-less one, INVALID_ARGUMENT "No graph was found".
    """
    lines = str(error).strip().splitlines()
    first = lines[0] if lines else type(error).__name__
    status = _ORT_STATUS.match(first)
    code, text = (status.group(1), first[status.end():]) if status else ("", first)
    if code == "INVALID_PROTOBUF" or (code == "INVALID_ARGUMENT" and "No graph" in text):
        return model_error(path, f"not an ONNX model (onnxruntime: {text})")
    return model_error(path, f"onnxruntime cannot build a session for it: {text}")
