"""Fixtures shared by the tests that need a real MQTT broker."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from mqtt_helpers import Broker


@pytest.fixture()
def broker(tmp_path: Path) -> Iterator[Broker]:
    """A Mosquitto of this test's own, on a free loopback port."""
    server = Broker(tmp_path / "broker")
    server.start()
    yield server
    server.stop()
