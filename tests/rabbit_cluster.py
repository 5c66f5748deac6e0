"""A RabbitMQ cluster with the MQTT plugin on loopback ports, from Debian's rabbitmq-server:
the clustered broker the fleet-failover tests run against (fixture ``rabbit_cluster`` in
``tests/conftest.py``) and that a person can start by hand (``scripts/rabbitmq-cluster``).

Nothing is shared with a system RabbitMQ: the nodes run as the current user from the package's
unwrapped scripts (``/usr/lib/rabbitmq/bin``; ``/usr/sbin``'s wrappers switch to the user
``rabbitmq`` and its ``/var/lib/rabbitmq``), register with an epmd of their own on a free port,
and keep their names (``ea1@localhost`` …), cookie, config, database and logs in one
directory, so a system node (``rabbit@HOST`` on 4369/5672/25672) is never in the way.  Every
listener (MQTT, AMQP, Erlang distribution, epmd) is on 127.0.0.1 and a free port.

The first member is the seed; the others, started one after another once it is up, join it
while they boot (classic-config peer discovery), which saves the stop_app/join_cluster/
start_app round of a cluster formed afterwards.  A killed member restarted on its database
rejoins by itself.

What RabbitMQ 3.10's MQTT plugin gives a fleet, as ``tests/test_rabbit_cluster.py`` asserts:
a QoS 1 message published on one member reaches subscribers on every member; a member killed
with SIGKILL leaves the clients of the others working, and comes back; retained messages are
node-local: a retained message published on member A is delivered to subscribers on A, never
to one on B (each node keeps its own retained store), so a client must publish its retained
state again on every member it lands on; client ids are tracked cluster-wide (a second
connection with an id, on any member, closes the first); and only MQTT 3.1.1 is spoken (an
MQTT 5 CONNECT is closed unanswered, so there are no redirects).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from mqtt_helpers import free_port, wait_until

SCRIPTS = Path("/usr/lib/rabbitmq/bin")
EPMD = shutil.which("epmd") or "/usr/bin/epmd"
STATE = "cluster.json"
HOST = "127.0.0.1"


def installed() -> bool:
    """Debian's rabbitmq-server (and with it Erlang's epmd) is here."""
    return (SCRIPTS / "rabbitmq-server").is_file() and os.access(EPMD, os.X_OK)


@dataclass(frozen=True)
class Member:
    """One node: ``host``/``port`` are its MQTT listener (the shape of mqtt_helpers.Broker)."""

    name: str
    port: int
    amqp_port: int
    dist_port: int
    host: str = HOST

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def distinct_free_ports(count: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


class RabbitCluster:
    """``boot()`` the members, ``kill``/``start`` one of them, ``stop()`` them all.

    Process ids are kept in ``cluster.json`` in the directory, so a cluster booted by one
    process (the script's ``start``) can be stopped by another (its ``stop``)."""

    def __init__(self, directory: Path, members: list[Member], epmd_port: int,
                 pids: dict[str, int] | None = None) -> None:
        self.directory = directory
        self.members = members
        self.epmd_port = epmd_port
        self.pids: dict[str, int] = dict(pids or {})
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

    @classmethod
    def create(cls, directory: Path, size: int = 3) -> RabbitCluster:
        ports = distinct_free_ports(3 * size + 1)
        members = [Member(f"ea{index + 1}@localhost", *ports[3 * index:3 * index + 3])
                   for index in range(size)]
        return cls(directory, members, ports[-1])

    @classmethod
    def load(cls, directory: Path) -> RabbitCluster:
        directory = directory.resolve()
        state = json.loads((directory / STATE).read_text())
        return cls(directory, [Member(**member) for member in state["members"]],
                   state["epmd_port"], state["pids"])

    def _save(self) -> None:
        state = {"members": [asdict(member) for member in self.members],
                 "epmd_port": self.epmd_port, "pids": self.pids}
        (self.directory / STATE).write_text(json.dumps(state, indent=1) + "\n")

    def env(self) -> dict[str, str]:
        """What the servers and the CLI tools share: the cookie (in HOME), the epmd, no
        system-wide rabbitmq-env.conf, and CLI tools on any free distribution port (their
        default range, 35672-35682, is the system node's).  Nothing of the caller's RabbitMQ
        or Erlang settings, nor systemd's NOTIFY_SOCKET (which changes how the server runs).

        The CLI tools' schedulers do not busy-wait (the servers' already do not: the
        scripts' default): a rabbitmqctl whose idle schedulers spin while it waits for a
        node's answer takes the CPU that node needs to answer, and on a loaded 2-core machine
        one cluster_status took 7-10 s where it takes 1 s without the spinning (the boot,
        which asks each time a member joins, 50 s where it takes 20)."""
        inherited = {name: value for name, value in os.environ.items()
                     if not name.startswith(("RABBITMQ_", "ERL_")) and name != "NOTIFY_SOCKET"}
        return {**inherited, "HOME": str(self.directory), "ERL_EPMD_PORT": str(self.epmd_port),
                "ERL_EPMD_ADDRESS": HOST,
                "RABBITMQ_CONF_ENV_FILE": str(self.directory / "rabbitmq-env.conf"),
                "RABBITMQ_CTL_DIST_PORT_MIN": "0", "RABBITMQ_CTL_DIST_PORT_MAX": "0",
                "RABBITMQ_CTL_ERL_ARGS": "+sbwt none +sbwtdcpu none +sbwtdio none"}

    def _node_dir(self, member: Member) -> Path:
        return self.directory / member.name.partition("@")[0]

    def _node_env(self, member: Member) -> dict[str, str]:
        node = self._node_dir(member)
        return {**self.env(), "RABBITMQ_NODENAME": member.name,
                "RABBITMQ_NODE_IP_ADDRESS": HOST, "RABBITMQ_NODE_PORT": str(member.amqp_port),
                "RABBITMQ_DIST_PORT": str(member.dist_port),
                "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel inet_dist_use_interface "
                                                       "{127,0,0,1}",
                "RABBITMQ_CONFIG_FILE": str(node / "rabbitmq.conf"),
                "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.directory / "enabled_plugins"),
                "RABBITMQ_MNESIA_BASE": str(node / "mnesia"),
                "RABBITMQ_LOG_BASE": str(node / "log"),
                "RABBITMQ_PID_FILE": str(node / "beam.pid")}

    def _write_files(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        cookie = self.directory / ".erlang.cookie"
        cookie.write_text(secrets.token_hex(20))
        cookie.chmod(0o400)  # Erlang refuses a cookie others may read
        (self.directory / "rabbitmq-env.conf").write_text("")
        (self.directory / "enabled_plugins").write_text("[rabbitmq_mqtt].\n")
        seed = self.members[0].name
        for member in self.members:
            node = self._node_dir(member)
            node.mkdir(exist_ok=True)
            lines = [f"mqtt.listeners.tcp.default = {HOST}:{member.port}",
                     # anonymous MQTT clients are guest, whom RabbitMQ admits on loopback only
                     "mqtt.allow_anonymous = true", "mqtt.default_user = guest",
                     "mqtt.default_pass = guest",
                     # a small tmpfs must not raise the disk alarm, which blocks publishers
                     "disk_free_limit.absolute = 1MB", "log.console = false"]
            if member.name != seed:
                lines += ["cluster_formation.peer_discovery_backend = classic_config",
                          f"cluster_formation.classic_config.nodes.1 = {seed}",
                          "cluster_formation.discovery_retry_limit = 60",
                          "cluster_formation.discovery_retry_interval = 500"]
            (node / "rabbitmq.conf").write_text("\n".join(lines) + "\n")

    def boot(self, seconds: float = 120.0) -> None:
        """Start epmd, then each member in turn (the seed first); return when all run as one
        cluster and each has answered an MQTT CONNECT.

        Not all at once: the MQTT plugin's client-id registry is a Raft cluster of its own,
        and a member whose plugin asks to join it while its first leader election is under
        way is refused and never asks again (it then times every CONNECT out: RabbitMQ
        3.10).  Joining a registry whose leader is settled is safe, so each member starts
        once the one before it accepts clients (two joining together were seen to leave the
        second one refusing every CONNECT in a CI run)."""
        self._write_files()
        epmd = subprocess.Popen([EPMD, "-port", str(self.epmd_port)], env=self.env(),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        self.processes["epmd"] = epmd
        self.pids["epmd"] = epmd.pid
        self._save()
        try:
            if not wait_until(lambda: _accepts(self.epmd_port), 10):
                raise RuntimeError(f"epmd did not listen on {HOST}:{self.epmd_port}")
            deadline = time.monotonic() + seconds
            for member in self.members:  # one at a time: each joins a settled registry
                self._launch(member)
                self._await([member], deadline)
        except BaseException:
            self.stop(remove=False)
            raise

    def _launch(self, member: Member) -> None:
        node = self._node_dir(member)
        with open(node / "console.log", "ab") as console:
            process = subprocess.Popen([str(SCRIPTS / "rabbitmq-server")],
                                       env=self._node_env(member), cwd=node,
                                       stdin=subprocess.DEVNULL, stdout=console, stderr=console,
                                       start_new_session=True)
        self.processes[member.name] = process
        self.pids[member.name] = process.pid
        self._save()

    def _await(self, members: list[Member], deadline: float) -> None:
        """Each member accepts an MQTT client, then every live member runs in one cluster."""
        for member in members:
            if not wait_until(lambda m=member: _connack(m), deadline - time.monotonic(),
                              step=0.1):
                raise RuntimeError(f"{member.name} accepted no MQTT client on {member.address}"
                                   f" in time:\n{self.log_tail(member)}")
        expected = {member.name for member in self.members if member.name in self.pids}
        if not wait_until(lambda: self.running(members[0]) >= expected,
                          max(deadline - time.monotonic(), 1.0), step=0.25):
            raise RuntimeError(f"the cluster did not form in time: {members[0].name} sees "
                               f"{sorted(self.running(members[0]))}, expected {sorted(expected)}")

    def running(self, member: Member) -> set[str]:
        """The nodes ``member`` sees running in its cluster (none when it does not answer)."""
        result = subprocess.run([str(SCRIPTS / "rabbitmqctl"), "-n", member.name, "-q",
                                 "cluster_status", "--formatter", "json"], env=self.env(),
                                capture_output=True, text=True, timeout=60, check=False)
        if result.returncode != 0:
            return set()
        return set(json.loads(result.stdout).get("running_nodes", []))

    def kill(self, member: Member) -> None:
        """SIGKILL the member's beam and its helpers, as a crash or a power cut would; return
        once its listeners are gone (its peers and clients see the connections drop)."""
        self._kill(member.name)
        self._save()
        if not wait_until(lambda: not (_accepts(member.port) or _accepts(member.dist_port)),
                          30):
            raise RuntimeError(f"{member.name} still listens after SIGKILL")

    def start(self, member: Member, seconds: float = 120.0) -> None:
        """Start a killed member again on its database; return once it is back in the cluster."""
        if member.name in self.pids:
            raise RuntimeError(f"{member.name} is running")
        deadline = time.monotonic() + seconds
        self._launch(member)
        self._await([member], deadline)

    def stop(self, remove: bool = True) -> None:
        """Kill every member and epmd (a stop for good: nothing to save), then remove the
        directory unless told to keep it for its logs."""
        for name in list(self.pids):
            self._kill(name)
        if remove:
            shutil.rmtree(self.directory, ignore_errors=True)
        else:
            self._save()

    def _kill(self, name: str) -> None:
        pid = self.pids.pop(name, None)
        process = self.processes.pop(name, None)
        if pid is None or (process is None and not _ours(pid, self.directory)):
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)  # each was started as its own session's leader
        if process is not None:
            process.wait(30)

    def log_tail(self, member: Member, lines: int = 30) -> str:
        node = self._node_dir(member)
        texts = [path.read_text(errors="replace").splitlines()[-lines:]
                 for path in (node / "console.log", node / "log" / f"{member.name}.log")
                 if path.exists()]
        return "\n".join(line for text in texts for line in text)


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=0.2):
            return True
    except OSError:
        return False


def _connack(member: Member) -> bool:
    """An MQTT 3.1.1 CONNECT (clean session, client id ``ready-probe``) is accepted."""
    client_id = b"ready-probe"
    connect = (b"\x00\x04MQTT\x04\x02\x00\x0a" + len(client_id).to_bytes(2, "big")
               + client_id)
    try:
        with socket.create_connection((member.host, member.port), timeout=10) as probe:
            probe.sendall(bytes([0x10, len(connect)]) + connect)
            return probe.recv(4) == b"\x20\x02\x00\x00"
    except OSError:
        return False


def _ours(pid: int, directory: Path) -> bool:
    """The pid is still a process this cluster started (a stale state file's pid may have
    been reused): its environment names the cluster's directory as HOME."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    return f"HOME={directory}".encode() in environ
