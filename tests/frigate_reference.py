"""Frigate's post-processing written out plainly, one detection at a time, for the tests to
compare ``agent.serving.detections`` (vectorised) and the served answers with; and the test
material: nudenet's YOLOv8n and an image it finds a face in."""

from __future__ import annotations

from pathlib import Path

import numpy as np

NUDENET = "320n.onnx"  # in the nudenet wheel (install.sh --dev): a YOLOv8n at 320 x 320


def nudenet_model(directory: Path) -> Path:
    """nudenet's YOLOv8n with its input fixed at [1, 3, 320, 320], as Frigate's YOLO exports
    are (the wheel's takes any height and width, and fails the repository's probe at 1 x 1)."""
    import importlib.util

    import onnx

    spec = importlib.util.find_spec("nudenet")  # importing it needs OpenCV, which we lack
    assert spec is not None and spec.origin is not None, "nudenet: install.sh --dev"
    model = onnx.load(Path(spec.origin).parent / NUDENET)
    for dim, size in zip(model.graph.input[0].type.tensor_type.shape.dim, (1, 3, 320, 320),
                         strict=True):
        dim.dim_value = size
    path = directory / "yolov8n-320.onnx"
    onnx.save(model, path)
    return path


def astronaut(size: int = 320) -> np.ndarray:
    """scikit-image's astronaut, uint8 [1, size, size, 3] as Frigate sends a frame (NHWC)."""
    from PIL import Image
    from skimage import data

    image = Image.fromarray(data.astronaut()).resize((size, size), Image.Resampling.BILINEAR)
    return np.asarray(image)[None]


def _iou(a: list[float], b: list[float]) -> float:
    width = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    height = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    overlap = width * height
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - overlap
    return overlap / union if union > 0 else 0.0


def reference_yolo(output: np.ndarray, height: int, width: int) -> np.ndarray:
    """``[1, 4+C, N]``: every candidate's best class over 0.4, greedy NMS at IoU 0.4."""
    candidates = []
    for row in output[0].T:
        best = int(np.argmax(row[4:]))
        score = float(row[4 + best])
        if score > 0.4:
            cx, cy, w, h = (float(v) for v in row[:4])
            candidates.append((score, best, [cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2]))
    candidates.sort(key=lambda c: -c[0])
    kept: list[tuple[float, int, list[float]]] = []
    for candidate in candidates:
        if all(_iou(candidate[2], other[2]) <= 0.4 for other in kept):
            kept.append(candidate)
    result = np.zeros((20, 6), np.float32)
    for i, (score, cls, (x1, y1, x2, y2)) in enumerate(kept[:20]):
        result[i] = [cls, score, y1 / height, x1 / width, y2 / height, x2 / width]
    return result


def reference_ssd(outputs: list[np.ndarray]) -> np.ndarray:
    """Frigate's TFLite reading: rows in order until a score under 0.4, the count, or 20."""
    boxes, classes, scores, count = outputs
    result = np.zeros((20, 6), np.float32)
    for i in range(min(int(count[0]), 20)):
        if scores[0][i] < 0.4:
            break
        result[i] = [classes[0][i], scores[0][i], *boxes[0][i]]
    return result
