"""The wire protocol between `redline bench network --serve` and `--connect`.

Every TCP connection opens with MAGIC from the client. Then both sides exchange frames: a 4-byte big-endian
length and that many bytes of UTF-8 JSON, one object with an "op". The first frame says what the connection
is for:

- ``{"op": "hello", "version": 1}`` opens a control connection; the server answers MAGIC and a hello with
  a session token and its TCP settings (congestion control, socket buffer ceilings), or ``{"op": "busy"}``.
  On it: ``ping``/``pong`` (RTT), ``udp_count`` (probes the server got), ``tcp`` (a throughput test), ``bye``.
- ``{"op": "data", "session": ..., "test": ..., "stream": i}`` is one stream of a throughput test; after
  the frame only bulk bytes flow, from whichever side sends in that test.

A throughput test: client ``tcp`` (streams, direction, omit_s, duration_s) -> server ``ready`` -> client
opens the data connections -> server ``started`` -> bulk data. The receiver times the window and ends the
test: for "up" (client sends, as iperf3 by default) the server answers ``result``; for "down" (iperf3 -R)
the client sends ``stop`` and the server answers ``sender`` with its TCP_INFO counters.

The UDP loss probe: datagrams of PROBE (magic, session token, sequence number, client send time) that the
server echoes back unchanged and counts.
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

from redline.errors import BadInput

PROTOCOL_VERSION = 1
DEFAULT_PORT = 5211
MAGIC = b"RLBNET01"
MAX_FRAME_BYTES = 1 << 20
_LENGTH = struct.Struct(">I")
# magic, session token, sequence number, client monotonic send time in seconds
PROBE = struct.Struct(">4s8sId")
PROBE_MAGIC = b"RLP1"


class ProtocolError(Exception):
    """The peer broke the protocol or went away; the client turns it into BadInput with context."""


def encode(message: dict[str, Any]) -> bytes:
    body = json.dumps(message, separators=(",", ":")).encode()
    if len(body) > MAX_FRAME_BYTES:
        raise ValueError(f"frame of {len(body)} bytes exceeds {MAX_FRAME_BYTES}")
    return _LENGTH.pack(len(body)) + body


def send_frame(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.sendall(encode(message))


def recv_exact(sock: socket.socket, size: int) -> bytes:
    """Exactly ``size`` bytes; ProtocolError when the peer closes first. Socket timeouts propagate."""
    chunks = bytearray()
    while len(chunks) < size:
        chunk = sock.recv(size - len(chunks))
        if not chunk:
            raise ProtocolError("connection closed by the peer")
        chunks += chunk
    return bytes(chunks)


def recv_frame(sock: socket.socket) -> dict[str, Any]:
    (length,) = _LENGTH.unpack(recv_exact(sock, _LENGTH.size))
    if length > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {length} bytes announced (at most {MAX_FRAME_BYTES}): not this protocol")
    try:
        message = json.loads(recv_exact(sock, length))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"malformed frame: {exc}") from None
    if not isinstance(message, dict) or not isinstance(message.get("op"), str):
        raise ProtocolError("frame without an op")
    return message


def expect(sock: socket.socket, op: str) -> dict[str, Any]:
    """The next frame, which must be ``op``; an ``error`` frame from the peer becomes BadInput."""
    message = recv_frame(sock)
    if message["op"] == "error":
        raise BadInput(f"the network bench server refused: {message.get('reason', 'no reason given')}")
    if message["op"] != op:
        raise ProtocolError(f"expected {op!r}, got {message['op']!r}")
    return message


def recv_magic(sock: socket.socket) -> None:
    if recv_exact(sock, len(MAGIC)) != MAGIC:
        raise ProtocolError("the peer does not speak the redline network bench protocol")
