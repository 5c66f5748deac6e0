"""A test-only MQTT 5 server that redirects: Mosquitto cannot send reason 0x9C or 0x9D.

It answers every CONNECT with a refusing CONNACK (``connack=True``) or accepts and then sends
a DISCONNECT, either carrying the reason code and a Server Reference property; then it closes
the connection.  It reads one packet per connection, at most ``MAX_PACKET`` bytes, and
serves until closed; ``connects`` counts the CONNECTs it answered.
"""

from __future__ import annotations

import contextlib
import socket
import threading

MAX_PACKET = 64 * 1024
SERVER_REFERENCE = 0x1C  # the property's identifier


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value % 128, value // 128
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _packet(kind: int, body: bytes) -> bytes:
    return bytes([kind]) + _varint(len(body)) + body


def _properties(reference: str | None) -> bytes:
    if reference is None:
        return _varint(0)
    encoded = reference.encode()
    prop = bytes([SERVER_REFERENCE]) + len(encoded).to_bytes(2, "big") + encoded
    return _varint(len(prop)) + prop


def connack(reason: int, reference: str | None = None) -> bytes:
    """CONNACK: no session present, ``reason``, and the Server Reference when given."""
    return _packet(0x20, bytes([0, reason]) + _properties(reference))


def disconnect(reason: int, reference: str | None = None) -> bytes:
    return _packet(0xE0, bytes([reason]) + _properties(reference))


def _read_packet(conn: socket.socket) -> bytes | None:
    """One whole packet (header byte, remaining length, body), or None."""
    header = conn.recv(1)
    if not header:
        return None
    length, shift = 0, 0
    for _ in range(4):
        byte = conn.recv(1)
        if not byte:
            return None
        length += (byte[0] & 0x7F) << shift
        shift += 7
        if not byte[0] & 0x80:
            break
    if length > MAX_PACKET:
        return None
    body = b""
    while len(body) < length:
        chunk = conn.recv(length - len(body))
        if not chunk:
            return None
        body += chunk
    return header + body


class RedirectingServer:
    """Listens on a free loopback port; each CONNECT gets the redirect it is built with."""

    def __init__(self, reason: int, reference: str | None, *, connack: bool = True) -> None:
        self.reason, self.reference, self.at_connack = reason, reference, connack
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.port: int = self._listener.getsockname()[1]
        self.connects = 0
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except (TimeoutError, OSError):
                continue
            with conn, contextlib.suppress(OSError):
                conn.settimeout(5)
                packet = _read_packet(conn)
                if packet is None or packet[0] != 0x10:  # not a CONNECT
                    continue
                self.connects += 1
                if self.at_connack:
                    conn.sendall(connack(self.reason, self.reference))
                else:
                    conn.sendall(connack(0) + disconnect(self.reason, self.reference))
                conn.shutdown(socket.SHUT_WR)
                conn.recv(MAX_PACKET)  # until the client closes (or the timeout)

    def close(self) -> None:
        self._closed.set()
        self._thread.join(5)
        self._listener.close()
