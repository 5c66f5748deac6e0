"""A real Mosquitto broker on a free loopback port, a recording subscriber, and a test CA.

The broker keeps its state on disk (``persistence true``), so a subscriber with a persistent
session misses nothing while the broker is stopped and started again, as in an outage.
"""

from __future__ import annotations

import datetime
import json
import os
import pwd
import random
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from paho.mqtt.enums import CallbackAPIVersion

MOSQUITTO = shutil.which("mosquitto") or "/usr/sbin/mosquitto"


PORTS_BELOW = 12_000  # how far below the ephemeral range free_port looks


def free_port() -> int:
    """A loopback port free now, below the range the kernel takes clients' ports from.
    One from that range (what binding port 0 gives) can be taken by an outgoing connection
    before the broker binds it, and a client that connects to it while nothing listens
    (a member stopped on purpose) can connect to itself (TCP simultaneous open) and then
    hold it: the member cannot start again ("address in use")."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    choices = random.Random()  # its own, so a test that seeds random does not repeat ports
    for _ in range(1000 if low > 2048 else 0):  # a range from 1024 up: any port is one
        port = choices.randrange(max(1024, low - PORTS_BELOW), low)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use: another
            return port
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def wait_until(predicate: Callable[[], object], seconds: float = 10.0,
               step: float = 0.02) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return bool(predicate())


@dataclass(frozen=True)
class TlsFiles:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_test_ca(directory: Path) -> TlsFiles:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate."""
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "edge-agent test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))

    def issue(name: str, server: bool) -> tuple[bytes, bytes]:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (x509.CertificateBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
                   .issuer_name(ca_name).public_key(key.public_key())
                   .serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1)))
        if server:
            import ipaddress

            builder = builder.add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"),
                 x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        cert = builder.sign(ca_key, hashes.SHA256())
        return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)

    files = TlsFiles(ca=directory / "ca.pem", server_cert=directory / "server.pem",
                     server_key=directory / "server.key", client_cert=directory / "client.pem",
                     client_key=directory / "client.key")
    files.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    cert, key = issue("localhost", server=True)
    files.server_cert.write_bytes(cert)
    files.server_key.write_bytes(key)
    cert, key = issue("edge-node", server=False)
    files.client_cert.write_bytes(cert)
    files.client_key.write_bytes(key)
    return files


class Broker:
    """Mosquitto started by the test; ``stop``/``start`` simulate an outage on one port."""

    def __init__(self, directory: Path, *, tls: TlsFiles | None = None,
                 users: dict[str, str] | None = None) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.host = "127.0.0.1"
        self.process: subprocess.Popen[bytes] | None = None
        # as root, Mosquitto switches to user "mosquitto", who may not write the test's files
        lines = [f"user {pwd.getpwuid(os.geteuid()).pw_name}",
                 f"listener {self.port} 127.0.0.1", "persistence true",
                 f"persistence_location {directory}/", f"log_dest file {directory}/broker.log",
                 "log_type error", "log_type warning", "log_type notice",
                 # as a fleet broker should: small command replies are not held back
                 # by Nagle until a delayed ACK (README, "The broker side")
                 "set_tcp_nodelay true"]
        if tls is not None:
            lines += [f"cafile {tls.ca}", f"certfile {tls.server_cert}",
                      f"keyfile {tls.server_key}", "require_certificate true"]
        if users:
            passwords = directory / "passwords"
            passwords.write_text("")
            for user, password in users.items():
                subprocess.run(["mosquitto_passwd", "-b", str(passwords), user, password],
                               check=True, capture_output=True)
            lines += [f"password_file {passwords}", "allow_anonymous false"]
        else:
            lines.append("allow_anonymous true")
        self.config = directory / "mosquitto.conf"
        self.config.write_text("\n".join(lines) + "\n")

    def start(self) -> None:
        self.process = subprocess.Popen([MOSQUITTO, "-c", str(self.config)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        if not wait_until(self._listening, 10):
            self.stop()
            raise RuntimeError(f"mosquitto did not start: {self.log()}")

    def _listening(self) -> bool:
        try:
            with socket.create_connection((self.host, self.port), timeout=0.2):
                return True
        except OSError:
            return False

    def stop(self) -> None:
        """SIGTERM: Mosquitto saves its persistent sessions, like a broker restart."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(10)
        self.process = None

    def log(self) -> str:
        path = self.directory / "broker.log"
        return path.read_text() if path.exists() else ""


class Subscriber:
    """Records every message on the topics, with a persistent session across outages."""

    def __init__(self, broker: Broker, topics: list[str], client_id: str = "test-subscriber",
                 *, clean: bool = True, tls: TlsFiles | None = None,
                 username: str | None = None, password: str | None = None) -> None:
        self.messages: list[tuple[str, dict[str, Any], bool]] = []
        self.lock = threading.Lock()
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id,
                                  clean_session=clean, protocol=mqtt.MQTTv311)
        if tls is not None:
            self.client.tls_set(ca_certs=str(tls.ca), certfile=str(tls.client_cert),
                                keyfile=str(tls.client_key))
        if username is not None:
            self.client.username_pw_set(username, password)
        self.client.reconnect_delay_set(0.1, 0.5)
        self.topics = topics
        self.client.on_connect = self._subscribe
        self.client.on_message = self._record
        self.subscribed = threading.Event()
        self.client.connect(broker.host, broker.port, keepalive=10)
        self.client.loop_start()

    def _subscribe(self, client: mqtt.Client, userdata: Any, flags: Any, code: Any,
                   properties: Any) -> None:
        for topic in self.topics:
            client.subscribe(topic, qos=1)
        self.subscribed.set()

    def _record(self, client: mqtt.Client, userdata: Any, message: mqtt.MQTTMessage) -> None:
        try:
            payload = json.loads(message.payload)
        except ValueError:
            payload = {"raw": message.payload.decode(errors="replace")}
        with self.lock:
            self.messages.append((message.topic, payload, bool(message.retain)))

    def on(self, suffix: str) -> list[dict[str, Any]]:
        with self.lock:
            return [p for t, p, _ in self.messages if t.endswith("/" + suffix)]

    def close(self) -> None:
        """Disconnect first: it wakes paho's network thread, which then ends at once;
        loop_stop() alone waits out the thread's one-second select (0.7 s a close, on
        average, in every test that watches a topic).  A subscriber publishes nothing, so
        nothing is left unsent."""
        self.client.disconnect()
        self.client.loop_stop()
