"""Frigate's model type names (its header's ``model_type``, the ``ModelTypeEnum`` member
names), in a module of their own: ``config check`` and the config loader validate
``serve.frigate.model_type`` against them without importing numpy (loading the config stays
light); ``detections`` holds the post-processing of each served one."""

from __future__ import annotations

SERVED = ("ssd", "yologeneric", "yolonas", "rfdetr")
# the DESIGN spelling of a type, beside Frigate's own header names
ALIASES = {"yolo-generic": "yologeneric"}
# Frigate's types the data plane does not post-process: yolox needs its export's grid and
# strides, dfine a second input with the original size
UNSERVED = ("yolox", "dfine")


def model_type_name(name: str) -> str:
    """Frigate's header name for ``name`` (an alias such as yolo-generic resolved)."""
    return ALIASES.get(name, name)
