"""What of the outbox goes on the wire next, and which PUBACKs let records leave it.

Per connection: live records (those put after the connect) go first; everything stored
before the connect is the backlog, replayed oldest-first behind them at ``replay_per_s`` and
marked ``historical``.  A record leaves the outbox only once the broker acknowledged it; a
refusal the broker may lift (busy, quota) sends it again with the replay.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import paho.mqtt.client as mqtt

from agent.link.settings import LinkSettings, LinkStatus
from agent.telemetry.outbox import Outbox
from agent.telemetry.outbox_db import Record
from agent.telemetry.records import encode

logger = logging.getLogger("agent.link.mqtt")  # its lines are the link's

# On the wire: at most IN_FLIGHT unacknowledged messages, paho's default and Mosquitto's
# receive maximum.  Handed to paho: up to WINDOW; paho sends the next one as each PUBACK
# arrives, so the connection never idles while the link thread fetches the next batch.
IN_FLIGHT = 20
WINDOW = 200
_RETRYABLE = {0x89, 0x97}  # server busy, quota exceeded: the message may go later
# Acknowledged records leave the outbox in batches: one transaction per batch, not per
# message.  A crash before a batch is deleted re-sends it (duplicates, never a loss).
ACK_BATCH = 200
ACK_BATCH_S = 0.25


def reason_failed(code: Any) -> bool:
    return bool(getattr(code, "is_failure", False))


class Delivery:
    """The outbox side of one link: records in flight by mid, and two cursors into it."""

    def __init__(self, settings: LinkSettings, outbox: Outbox, status: LinkStatus) -> None:
        self.settings, self.outbox, self.status = settings, outbox, status
        self.inflight: dict[int, Record] = {}
        self._acked: list[Record] = []
        self._acked_since = 0.0
        self._live_cursor = self._replay_cursor = 0
        self._replay_below = 1
        self._replay_tokens = 0.0
        self._last_refill = time.monotonic()

    def reset(self) -> None:
        """A new connection: nothing is in flight on it."""
        self.inflight = {}
        self._live_cursor = self._replay_cursor = 0
        self._replay_below = 1

    def begin(self) -> None:
        """The broker accepted the connection: everything stored so far is the backlog.  Runs
        as the session changes (``Sequence.begin``), with every record handed to the outbox
        committed first: the backlog is then every record of the ended session, and the live
        cursor starts where the new one does."""
        self.forget_acked()
        self.outbox.flush()
        backlog = self.outbox.last_id()
        self._live_cursor, self._replay_cursor, self._replay_below = backlog, 0, backlog + 1

    @property
    def pending(self) -> bool:
        """Records in flight, new ones not yet sent, or backlog not yet replayed."""
        return bool(self.inflight) or self.outbox.last_id() > self._live_cursor or \
            self._replay_cursor + 1 < self._replay_below

    def wait_s(self, accepted: bool) -> float:
        """Until the next replay slot or ack batch is due, at most 1 s."""
        wait = 1.0
        if accepted and self._replay_below > self._replay_cursor + 1:
            wait = min(wait, max(0.001, 1.0 / self.settings.replay_per_s))
        if self._acked:
            wait = min(wait, max(0.0, self._acked_since + ACK_BATCH_S - time.monotonic()))
        return wait

    def acknowledged(self, mid: int, code: Any) -> None:
        """A PUBACK: its record leaves the outbox with the next batch (or is sent again)."""
        record = self._settled(mid, code)
        if record is not None:
            if not self._acked:
                self._acked_since = time.monotonic()
            self._acked.append(record)
            self.status.acked += 1

    def settle(self) -> None:
        """Acks are batched while a burst is in flight; once nothing is, the outbox hears at
        once (a record a second must not show as waiting for the broker after its PUBACK)."""
        if len(self._acked) >= ACK_BATCH or (self._acked and (
                not self.inflight or time.monotonic() - self._acked_since >= ACK_BATCH_S)):
            self.forget_acked()

    def forget_acked(self) -> None:
        if self._acked:
            self.outbox.delete(self._acked)
            self._acked = []

    def _settled(self, mid: int, code: Any) -> Record | None:
        """The outbox record a PUBACK settles, or None (a direct message, or retry later)."""
        record = self.inflight.pop(mid, None)
        if record is None:
            return None
        value = getattr(code, "value", 0)
        if reason_failed(code) and value in _RETRYABLE:
            self._replay_below = max(self._replay_below, record.id + 1)
            self._replay_cursor = min(self._replay_cursor, record.id - 1)
            return None
        if reason_failed(code):
            self.status.rejected += 1
            logger.error("mqtt: the broker refused %s: %s; dropped", record.topic, code)
        return record

    def fill(self, client: mqtt.Client, free: int) -> None:
        """Up to ``free`` records: live ones, then the replay as its rate allows."""
        if self.outbox.last_id() > self._live_cursor:  # no query when nothing new was put
            for record in self.outbox.pending(self._live_cursor, free):
                self._send(client, record, record.payload)
                self._live_cursor = record.id
                free -= 1
        now = time.monotonic()
        rate = self.settings.replay_per_s
        self._replay_tokens = min(float(IN_FLIGHT), self._replay_tokens
                                  + (now - self._last_refill) * rate)
        self._last_refill = now
        allowed = min(free, int(self._replay_tokens))
        if allowed <= 0 or self._replay_cursor + 1 >= self._replay_below:
            return
        batch = self.outbox.pending(self._replay_cursor, allowed, self._replay_below)
        for record in batch:
            self._send(client, record, _as_historical(record.payload))
            self._replay_cursor = record.id
            self._replay_tokens -= 1
            self.status.replayed += 1
        if len(batch) < allowed:
            self._replay_cursor = self._replay_below - 1  # the backlog is all sent

    def _send(self, client: mqtt.Client, record: Record, payload: bytes) -> None:
        if len(payload) > self.settings.max_payload_bytes:
            self.status.rejected += 1
            logger.error("mqtt: %s record %d is %d bytes, above the %d limit; dropped",
                         record.topic, record.id, len(payload), self.settings.max_payload_bytes)
            self.outbox.delete([record])
            return
        try:
            info = client.publish(record.topic, payload, qos=1)
        except (ValueError, TypeError) as error:  # paho refused it: it never will take it
            self.status.rejected += 1
            logger.error("mqtt: paho refused %s record %d: %s; dropped", record.topic,
                         record.id, error)
            self.outbox.delete([record])
            return
        self.inflight[info.mid] = record
        self.status.published += 1


def _as_historical(payload: bytes) -> bytes:
    """The same record, marked as replayed (not live) for the subscriber."""
    try:
        document = json.loads(payload)
    except ValueError:
        return payload
    if isinstance(document, dict):
        document["historical"] = True
        return encode(document)
    return payload
