"""The fake rknnlite (tests/fake_rknnlite) made importable, and .rknn files laid out as
rknn-toolkit2 writes them, for the RKNN backend's tests."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path
from typing import Any

import pytest

FAKE = Path(__file__).parent / "fake_rknnlite"


def rknn_bytes(toolkit: str | None = "1.6.0+81f21f4d", fmt: int = 6,
               model: bytes = b"\x01" * 32) -> bytes:
    """A .rknn as rknn-toolkit2 lays one out: header, model, JSON metadata."""
    header = b"RKNN" + b"\0" * 4 + struct.pack("<QQ", fmt, len(model))
    if fmt <= 1:
        header += b"\0" * 40
    meta = json.dumps({"version": toolkit, "target_platform": ["rk3588"]}
                      if toolkit else {}).encode()
    return header + model + struct.pack("<Q", len(meta)) + meta


def use_fake_rknnlite(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``rknnlite`` is the fake for this test, freshly imported; its RKNNLite class."""
    monkeypatch.syspath_prepend(str(FAKE))
    for name in [m for m in sys.modules if m == "rknnlite" or m.startswith("rknnlite.")]:
        monkeypatch.delitem(sys.modules, name)
    from rknnlite.api import RKNNLite

    RKNNLite.made.clear()
    RKNNLite.fail_init = RKNNLite.fail_inference = False
    return RKNNLite
