"""A detector's outputs in Frigate's form: ``[20, 6]`` float32 rows ``[class, score, y_min,
x_min, y_max, x_max]``, normalised to the input, zero rows after the last.

One function per model type, under the name Frigate's header sends (its ``ModelTypeEnum``
member names), each doing what Frigate's own detectors do for that type: a score threshold of
0.4, NMS at an IoU of 0.4, the best 20.  The NMS is numpy's (class-agnostic, greedy by score,
as OpenCV's ``NMSBoxes`` that Frigate calls), so the data plane needs no OpenCV.  A model whose
outputs do not have the type's form raises ``DetectionError`` naming what was expected.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from agent.serving.frigate_types import SERVED

ROWS = 20  # Frigate reads at most this many detections a frame
THRESHOLD = 0.4  # its detectors keep a score above this
IOU = 0.4  # and suppress a box that overlaps a better one more than this


class DetectionError(Exception):
    """A model's outputs are not what its model type produces."""


def zero_result() -> np.ndarray:
    """Frigate's "nothing detected", which is also its answer to every failure."""
    return np.zeros((ROWS, 6), np.float32)


def nms(boxes: np.ndarray, scores: np.ndarray, iou: float = IOU,
        limit: int = ROWS) -> np.ndarray:
    """Indices of the boxes (``[N, 4]`` x1, y1, x2, y2) kept, best score first: each kept
    box suppresses the lower-scored ones that overlap it by more than ``iou``."""
    order = np.argsort(-scores, kind="stable")
    x1, y1, x2, y2 = (boxes[:, k] for k in range(4))
    areas = np.clip(x2 - x1, 0, None) * np.clip(y2 - y1, 0, None)
    kept: list[int] = []
    while order.size and len(kept) < limit:
        best, rest = order[0], order[1:]
        kept.append(int(best))
        width = np.clip(np.minimum(x2[best], x2[rest]) - np.maximum(x1[best], x1[rest]), 0, None)
        height = np.clip(np.minimum(y2[best], y2[rest]) - np.maximum(y1[best], y1[rest]), 0,
                         None)
        overlap = width * height
        union = areas[best] + areas[rest] - overlap
        ratio = np.divide(overlap, union, out=np.zeros_like(overlap), where=union > 0)
        order = rest[ratio <= iou]
    return np.asarray(kept, dtype=np.int64)


def _rows(classes: np.ndarray, scores: np.ndarray, boxes_yxyx: np.ndarray) -> np.ndarray:
    """The result with these detections first (at most ROWS)."""
    result = zero_result()
    count = min(ROWS, len(scores))
    result[:count, 0] = classes[:count]
    result[:count, 1] = scores[:count]
    result[:count, 2:] = boxes_yxyx[:count]
    return result


def _xyxy_to_yxyx(boxes: np.ndarray) -> np.ndarray:
    return boxes[:, [1, 0, 3, 2]]


def ssd(outputs: Sequence[np.ndarray], height: int, width: int) -> np.ndarray:
    """A TF Object Detection API SSD (as Frigate's TFLite detectors read it): outputs boxes
    ``[1, N, 4]`` (y_min, x_min, y_max, x_max, normalised), classes ``[1, N]``, scores
    ``[1, N]`` best first, count ``[1]``; kept until the first score below the threshold."""
    if len(outputs) < 4:
        raise DetectionError(f"ssd takes 4 outputs (boxes, classes, scores, count), "
                             f"not {len(outputs)}")
    boxes, classes, scores = (np.asarray(o)[0] for o in outputs[:3])
    count = int(np.asarray(outputs[3]).reshape(-1)[0])
    if boxes.ndim != 2 or boxes.shape[1] != 4 or classes.shape != scores.shape or \
            scores.ndim != 1 or len(scores) != len(boxes):
        raise DetectionError("ssd outputs must be boxes [1, N, 4], classes [1, N], scores "
                             f"[1, N]: got {[list(np.shape(o)) for o in outputs[:3]]}")
    count = max(0, min(count, len(scores), ROWS))
    below = np.flatnonzero(scores[:count] < THRESHOLD)
    count = int(below[0]) if below.size else count
    return _rows(classes[:count], scores[:count], boxes[:count])


def yolo_generic(outputs: Sequence[np.ndarray], height: int, width: int) -> np.ndarray:
    """A YOLOv8/v9-style head: one output ``[1, 4 + C, N]`` (or ``[1, N, 4 + C]``) of boxes
    (centre x, centre y, width, height in input pixels) and C class scores; each candidate's
    best class above the threshold, NMS, the best 20."""
    if len(outputs) != 1:
        raise DetectionError(f"yologeneric takes one output [1, 4+C, N], not {len(outputs)} "
                             "(the multi-output YOLO v3/v4/v7 form is not served)")
    predictions = np.asarray(outputs[0])
    if predictions.ndim != 3 or predictions.shape[0] != 1 or min(predictions.shape[1:]) < 5:
        raise DetectionError(f"yologeneric's output must be [1, 4+C, N], not "
                             f"{list(predictions.shape)}")
    predictions = predictions[0]
    if predictions.shape[0] < predictions.shape[1]:  # as Frigate: fewer rows than candidates
        predictions = predictions.T
    class_scores = predictions[:, 4:]
    scores = class_scores.max(axis=1)
    keep = scores > THRESHOLD
    predictions, scores = predictions[keep], scores[keep]
    classes = class_scores[keep].argmax(axis=1)
    centre, size = predictions[:, 0:2], predictions[:, 2:4]
    boxes = np.concatenate([centre - size / 2, centre + size / 2], axis=1)
    chosen = nms(boxes, scores)
    scale = np.array([height, width, height, width], np.float32)
    return _rows(classes[chosen], scores[chosen], _xyxy_to_yxyx(boxes[chosen]) / scale)


def yolonas(outputs: Sequence[np.ndarray], height: int, width: int) -> np.ndarray:
    """YOLO-NAS exported with its own NMS ("flat" format): rows ``[_, x_min, y_min, x_max,
    y_max, score, class]`` in input pixels, best first; a class below 0 ends the list."""
    rows = np.asarray(outputs[0]) if outputs else np.zeros((0, 0))
    if rows.ndim != 2 or rows.shape[-1] != 7:
        raise DetectionError(f"yolonas's output must be [N, 7] (flat format), not "
                             f"{list(rows.shape)}")
    rows = rows[:ROWS]
    ended = np.flatnonzero(rows[:, 6] < 0)
    rows = rows[:int(ended[0])] if ended.size else rows
    scale = np.array([height, width, height, width], np.float32)
    return _rows(rows[:, 6], rows[:, 5], _xyxy_to_yxyx(rows[:, 1:5]) / scale)


def rfdetr(outputs: Sequence[np.ndarray], height: int, width: int) -> np.ndarray:
    """RF-DETR: boxes ``[1, N, 4]`` (centre x, centre y, width, height, normalised) and
    logits ``[1, N, 1 + C]`` (class 0 is "no object"); softmax, best class, NMS."""
    if len(outputs) < 2:
        raise DetectionError(f"rfdetr takes 2 outputs (boxes, logits), not {len(outputs)}")
    boxes, logits = np.asarray(outputs[0]), np.asarray(outputs[1], np.float32)
    if boxes.ndim != 3 or boxes.shape[2] != 4 or logits.ndim != 3 or \
            logits.shape[:2] != boxes.shape[:2] or logits.shape[2] < 2:
        raise DetectionError("rfdetr outputs must be boxes [1, N, 4] and logits [1, N, 1+C]")
    exp = np.exp(logits[0] - logits[0].max(axis=-1, keepdims=True))
    probabilities = (exp / exp.sum(axis=-1, keepdims=True))[:, 1:]
    scores, classes = probabilities.max(axis=-1), probabilities.argmax(axis=-1)
    keep = scores > THRESHOLD
    centre, size = boxes[0, keep, 0:2], boxes[0, keep, 2:4]
    corners = np.concatenate([centre - size / 2, centre + size / 2], axis=1)
    chosen = nms(corners, scores[keep])
    return _rows(classes[keep][chosen], scores[keep][chosen], _xyxy_to_yxyx(corners[chosen]))


PostProcess = Callable[[Sequence[np.ndarray], int, int], np.ndarray]
POST_PROCESS: dict[str, PostProcess] = {
    "ssd": ssd, "yologeneric": yolo_generic, "yolonas": yolonas, "rfdetr": rfdetr}
assert tuple(POST_PROCESS) == SERVED, "frigate_types.SERVED names what is post-processed here"
