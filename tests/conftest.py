"""Fixtures shared by the tests: a real MQTT broker, an operator key and client on it, a real
three-node RabbitMQ cluster, loop devices for real uevents."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from control_helpers import Operator
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from loop_devices import LoopDevices
from mqtt_helpers import Broker
from rabbit_cluster import RabbitCluster, installed
from tuning_helpers import FIXTURES, copy_board, tree_listing

TMPFS = "/dev/shm"


def pytest_configure(config: pytest.Config) -> None:
    """Test directories on tmpfs where the machine has one that allows exec: hundreds of
    tests copy a board's fixture tree (2,000 small files), which costs twice as much on a
    disk filesystem and more again to delete (ext4 with discard).  An explicit --basetemp
    is left alone."""
    if config.option.basetemp or not os.path.isdir(TMPFS):
        return
    flags = os.statvfs(TMPFS).f_flag
    if flags & (os.ST_NOEXEC | os.ST_RDONLY) or not os.access(TMPFS, os.W_OK | os.X_OK):
        return
    config.option.basetemp = tempfile.mkdtemp(prefix="edge-agent-tests-", dir=TMPFS)
    config.stash[_MADE] = config.option.basetemp


def pytest_unconfigure(config: pytest.Config) -> None:
    """The tmpfs directory goes with the session (it holds what failed tests left, for
    their report, until then): memory, unlike a disk's temp files, is not for keeping."""
    made = config.stash.get(_MADE, None)
    if made is not None:
        shutil.rmtree(made, ignore_errors=True)


_MADE = pytest.StashKey[str]()

# The test files on the session's RabbitMQ cluster (fixture rabbit_cluster): one work unit
# of --dist loadfile, so they share one worker and with it one cluster (a session fixture
# is per worker: two workers would boot two clusters, 20 s and 11 s of CPU each, 45 s each
# on a loaded 2-core machine).
CLUSTER_FILES = ("tests/test_rabbit_cluster.py", "tests/test_cluster_fleet.py")
CLUSTER_UNIT = "rabbit_cluster"


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """--dist loadfile with CLUSTER_FILES as one unit, handed out first (the longest unit:
    last, it would be the run's tail).  Other --dist modes are xdist's own."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    if not hasattr(LoadFileScheduling, "_split_scope"):  # an xdist that splits otherwise
        return None  # (its private hook, stable since 1.x): one cluster per worker again

    class ClusterFilesTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return CLUSTER_UNIT if path in CLUSTER_FILES else path

        def _assign_work_unit(self, node: Any) -> None:
            if CLUSTER_UNIT in self.workqueue and hasattr(self.workqueue, "move_to_end"):
                self.workqueue.move_to_end(CLUSTER_UNIT, last=False)
            super()._assign_work_unit(node)

    return ClusterFilesTogether(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test on the cluster outside CLUSTER_FILES would boot a cluster of its own on
    whichever worker runs it, beside one that may be killing members: refused."""
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        if "rabbit_cluster" in getattr(item, "fixturenames", ()) and path not in CLUSTER_FILES:
            raise pytest.UsageError(f"{item.nodeid} uses rabbit_cluster: add {path} to "
                                    "CLUSTER_FILES in tests/conftest.py")


@pytest.fixture(scope="session")
def shared_board(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], Path]]:
    """``shared_board(name)``: one copy of a board's fixture tree for every test of the
    session that only reads and plans (through ``tuning_helpers.ReadOnlyRoot``, which fails a
    write): a copy per test cost a 2,000-file copy and its removal each.  When the session
    ends, each copy must still be the committed tree, byte for byte."""
    base = tmp_path_factory.mktemp("shared-boards")
    made: dict[str, Path] = {}

    def board(name: str) -> Path:
        if name not in made:
            made[name] = copy_board(name, base)
        return made[name]

    yield board
    changed = sorted(name for name, tree in made.items()
                     if tree_listing(tree) != tree_listing(FIXTURES / name))
    assert not changed, f"a test changed the shared fixture copies of {', '.join(changed)}"


@pytest.fixture()
def broker(tmp_path: Path) -> Iterator[Broker]:
    """A Mosquitto of this test's own, on a free loopback port."""
    server = Broker(tmp_path / "broker")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def rabbit_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RabbitCluster]:
    """Three RabbitMQ members with the MQTT plugin, one cluster, for the whole session (a
    boot costs 10-20 s): ``.members`` (``host``/``port`` the MQTT listener), ``kill(member)``
    and ``start(member)``.  A test that kills a member starts it again before it ends.
    Skipped where Debian's rabbitmq-server is missing, except in CI, which must have it."""
    if not installed():
        reason = "Debian's rabbitmq-server is not installed (./install.sh --dev installs it)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason}; CI must run the cluster tests", pytrace=False)
        pytest.skip(reason)
    cluster = RabbitCluster.create(tmp_path_factory.mktemp("rabbitmq-cluster"))
    cluster.boot()
    yield cluster
    cluster.stop(remove=False)  # its logs stay with the session's other temporary files


@pytest.fixture()
def key() -> Ed25519PrivateKey:
    """The operator's signing key, trusted by the nodes a test starts."""
    return Ed25519PrivateKey.generate()


@pytest.fixture()
def operator(broker: Broker, key: Ed25519PrivateKey) -> Iterator[Operator]:
    """The product's operator client on the test's broker, signing with ``key``."""
    client = Operator(broker, key)
    yield client
    client.close()


@pytest.fixture
def loops() -> Iterator[LoopDevices]:
    """Loop devices to cause real block uevents with; removed afterwards."""
    if os.geteuid() != 0:
        pytest.skip("creating loop devices to cause uevents needs root")
    try:
        fd = os.open("/dev/loop-control", os.O_RDWR)
    except OSError as exc:
        pytest.skip(f"/dev/loop-control unavailable: {exc}")
    devices = LoopDevices(fd)
    try:
        yield devices
    finally:
        try:
            for name in sorted(devices.created):
                devices.remove(name)
        finally:
            os.close(fd)
