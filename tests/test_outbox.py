"""The outbox on its own: bounds, ids, the writer's rounds, a killed process, a full disk."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from mqtt_helpers import wait_until

from agent.telemetry.outbox import WRITE_RETRY_S, Outbox


def test_bounds_drop_the_oldest_and_count_them(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path / "o.sqlite", max_bytes=10 * 110, max_age_s=3600)
    ids = [outbox.put("t", bytes(109)) for _ in range(15)]  # 110 bytes each with the topic
    assert outbox.flush()
    assert outbox.depth == 10 and outbox.size_bytes == 1100
    assert outbox.dropped == 5
    assert [r.id for r in outbox.pending(0, 100)] == ids[5:]
    outbox.delete(outbox.pending(0, 3))
    assert outbox.flush()
    assert outbox.depth == 7 and outbox.size_bytes == 770
    outbox.close()
    reopened = Outbox(tmp_path / "o.sqlite", max_bytes=10 * 110, max_age_s=3600)
    assert reopened.depth == 7 and reopened.dropped == 5  # both persist
    assert [r.id for r in reopened.pending(0, 100)] == ids[8:]
    reopened.close()


def test_acknowledged_records_make_room_before_the_size_bound_is_checked(
        tmp_path: Path) -> None:
    outbox = Outbox(tmp_path / "o.sqlite", max_bytes=10 * 110, max_age_s=3600)
    ids = [outbox.put("t", bytes(109)) for _ in range(10)]  # full
    assert outbox.flush()
    with outbox._db_lock:  # hold the writer back: one round gets the delete and the put
        outbox.delete(outbox.pending(ids[-2], 1))
        newer = outbox.put("t", bytes(109))
    assert outbox.flush()
    assert [r.id for r in outbox.pending(0, 100)] == [*ids[:-1], newer]
    assert outbox.dropped == 0 and outbox.depth == 10
    outbox.close()


def test_a_refused_bounds_delete_is_retried_and_the_link_still_told(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    outbox = Outbox(tmp_path / "o.sqlite", max_bytes=5 * 110, max_age_s=3600)
    told: list[int] = []
    outbox.listen(lambda: told.append(outbox.last_id()))
    refusals = [sqlite3.OperationalError("disk I/O error")]
    forget_through = Outbox._forget_through

    def once_refused(self: Outbox, *args: int) -> None:
        if refusals:
            raise refusals.pop()
        forget_through(self, *args)

    monkeypatch.setattr(Outbox, "_forget_through", once_refused)
    ids = [outbox.put("t", bytes(109)) for _ in range(8)]
    assert wait_until(lambda: outbox.write_errors == 1 and told, 5)
    assert told[0] == ids[-1]  # stored and announced although the bound was refused
    assert wait_until(lambda: outbox.size_bytes <= 5 * 110, WRITE_RETRY_S * 5)
    assert outbox.dropped == 3 and outbox.last_error is None
    assert [r.id for r in outbox.pending(0, 100)] == ids[3:]
    outbox.close()


def test_records_older_than_max_age_are_dropped(tmp_path: Path) -> None:
    now = [1000.0]
    outbox = Outbox(tmp_path / "o.sqlite", max_bytes=1 << 20, max_age_s=60,
                    clock=lambda: now[0])
    for _ in range(3):
        outbox.put("t", b"old")
    assert outbox.flush()
    now[0] += 61
    outbox.put("t", b"new")  # the age check runs when a round stores records
    assert outbox.flush()
    assert [r.payload for r in outbox.pending(0, 10)] == [b"new"]
    assert outbox.stats() == {"depth": 1, "bytes": 4, "dropped": 3, "unwritten": 0,
                              "write_errors": 0}
    outbox.close()


def test_ids_never_repeat_once_the_outbox_empties(tmp_path: Path) -> None:
    """The link's cursors assume ids rise within a run: an emptied table must not restart
    at 1."""
    outbox = Outbox(tmp_path / "o.sqlite", max_bytes=1 << 20, max_age_s=3600)
    first = [outbox.put("t", b"a") for _ in range(3)]
    assert outbox.flush()
    outbox.delete(outbox.pending(0, 10))
    assert outbox.flush() and outbox.depth == 0
    assert outbox.put("t", b"b") == first[-1] + 1
    outbox.close()


def test_nothing_is_pending_before_it_is_on_disk(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path / "o.sqlite", max_bytes=1 << 20, max_age_s=3600)
    seen: list[int] = []
    outbox.listen(lambda: seen.append(outbox.last_id()))
    record_id = outbox.put("t", b"x")
    # The writer wakes on its own; each round that stored something tells the listeners.
    assert wait_until(lambda: seen == [record_id], 5)
    assert outbox.stats()["unwritten"] == 0
    assert [r.payload for r in outbox.pending(0, 10)] == [b"x"]
    outbox.close()


def test_memory_and_disk_answer_alike(tmp_path: Path) -> None:
    """The oldest records not yet acknowledged come from memory, the rest from SQLite: the
    same answers, and a record handed to delete is never offered again by either."""
    outbox = Outbox(tmp_path / "o.sqlite", max_bytes=1 << 30, max_age_s=3600)
    payload = bytes(100 * 1024)  # 100 KiB: memory holds the first 10, ids[0] to ids[9]
    ids = [outbox.put(f"t/{n}", payload) for n in range(30)]
    assert outbox.flush()
    everything = outbox.pending(0, 100)
    assert [r.id for r in everything] == ids and everything[23].topic == "t/23"
    assert [r.id for r in outbox.pending(ids[1], 3)] == ids[2:5]  # memory
    assert [r.id for r in outbox.pending(ids[7], 5)] == ids[8:13]  # memory, then disk
    assert [r.id for r in outbox.pending(ids[7], 5, below_id=ids[9])] == ids[8:9]
    assert [r.id for r in outbox.pending(ids[25], 3)] == ids[26:29]  # disk
    outbox.delete(everything[:12] + everything[27:28])
    # Not yet deleted on disk, but no longer offered: a replay must not send them twice.
    assert [r.id for r in outbox.pending(0, 4)] == ids[12:16]
    assert [r.id for r in outbox.pending(ids[26], 5)] == ids[28:]
    assert outbox.flush()
    assert outbox.depth == 17
    assert [r.id for r in outbox.pending(0, 100)] == ids[12:27] + ids[28:]
    # Emptied by acknowledgements, the window opens again at the next record stored.
    outbox.delete(outbox.pending(0, 100))
    later = outbox.put("t/later", b"x")
    assert outbox.flush() and [r.id for r in outbox.pending(0, 10)] == [later]
    outbox.close()


_KILLED_WRITER = textwrap.dedent("""
    import sys, time
    from agent.telemetry.outbox import Outbox
    outbox = Outbox(sys.argv[1], 1 << 30, 3600)
    for n in range(500):
        outbox.put("t", str(n).encode())
    while outbox.stats()["unwritten"]:  # the writer's own rounds, no flush and no reader
        time.sleep(0.001)
    print("stored", flush=True)
    time.sleep(60)
""")


def test_a_killed_process_keeps_what_the_writer_stored(tmp_path: Path) -> None:
    path = tmp_path / "o.sqlite"
    repo = Path(__file__).resolve().parents[1]
    child = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(path)], cwd=repo,
                             stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(repo)})
    try:
        assert child.stdout is not None and child.stdout.readline() == "stored\n"
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait(10)
    assert child.returncode == -signal.SIGKILL
    reopened = Outbox(path, max_bytes=1 << 30, max_age_s=3600)
    records = reopened.pending(0, 1000)
    assert [r.payload for r in records] == [str(n).encode() for n in range(500)]
    reopened.close()


def test_a_full_disk_keeps_records_in_memory_and_retries(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path / "o.sqlite", max_bytes=1 << 30, max_age_s=3600)
    # SQLite's page limit gives the same SQLITE_FULL a full filesystem gives, without one.
    pages = outbox._db.execute("PRAGMA page_count").fetchone()[0]
    outbox._db.execute(f"PRAGMA max_page_count={pages + 2}")
    ids = [outbox.put("t", bytes(4000)) for _ in range(20)]
    assert wait_until(lambda: outbox.write_errors >= 1, 5)
    assert outbox.last_error is not None and "o.sqlite" in outbox.last_error
    assert "full" in outbox.last_error
    stats = outbox.stats()
    assert stats["unwritten"] == 20 and stats["depth"] == 20 and stats["dropped"] == 0
    assert outbox.pending(0, 100) == []  # nothing is offered that is not on disk
    outbox._db.execute("PRAGMA max_page_count=1073741823")
    assert wait_until(lambda: outbox.stats()["unwritten"] == 0, WRITE_RETRY_S * 5)
    assert outbox.last_error is None
    assert [r.id for r in outbox.pending(0, 100)] == ids
    outbox.close()


def test_records_handed_to_delete_no_longer_count_as_waiting(tmp_path: Path) -> None:
    """The depth a person sees is what still waits for the broker: an acknowledged record
    leaves it on hand-over, before the writer's round deletes it from disk."""
    outbox = Outbox(tmp_path / "o.sqlite", max_bytes=1 << 20, max_age_s=3600)
    for _ in range(5):
        outbox.put("t", bytes(9))
    assert outbox.flush()
    with outbox._db_lock:  # hold the writer's round back: the deletes stay handed over
        outbox.delete(outbox.pending(0, 3))
        assert outbox.stats()["depth"] == 2 and outbox.size_bytes == 20
    assert outbox.flush() and outbox.depth == 2 and outbox.size_bytes == 20
    outbox.close()
    assert Outbox(tmp_path / "o.sqlite", max_bytes=1 << 20, max_age_s=3600).depth == 2
