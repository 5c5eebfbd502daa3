"""`redline bench network --serve`: the far end of the link, serving one client at a time (as iperf3 -s).

It listens on one TCP port for control and data connections and echoes loss probes on the same UDP port.
``close()`` (also on Ctrl-C) closes the listening sockets and every connection, and joins its threads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import queue
import select
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from redline.bench.net import streams, tcpinfo, wire
from redline.errors import BadInput

# how long a new connection may take to say what it is, and a control connection may stay silent
HANDSHAKE_TIMEOUT_S = 10.0
IDLE_TIMEOUT_S = 120.0
DATA_CONNECT_TIMEOUT_S = 15.0
MAX_STREAMS = 128
MAX_TEST_S = 3600.0


def local_tcp_settings() -> dict[str, Any]:
    """This host's congestion control and socket buffer ceilings, as the probe reads them."""
    from redline.hw.network import probe_network
    from redline.hw.sysfs import SysFs

    return dataclasses.asdict(probe_network(SysFs()).tcp)


class Server:
    def __init__(self, host: str = "0.0.0.0", port: int = wire.DEFAULT_PORT, log: Callable[[str], None] | None = None):
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self._lock = threading.Lock()
        self._session: _Session | None = None
        self._threads: set[threading.Thread] = set()
        self._conns: set[socket.socket] = set()
        self._stop = threading.Event()
        self.stopping = self._stop  # set by close(): tests in progress end early
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            self.tcp = socket.create_server((host, port), family=family, backlog=128)
        except OSError as exc:
            raise BadInput(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
        self.port = self.tcp.getsockname()[1]
        self.udp = socket.socket(family, socket.SOCK_DGRAM)
        try:
            self.udp.bind((host, self.port))
        except OSError as exc:
            self.tcp.close()
            self.udp.close()
            raise BadInput(f"cannot bind UDP {host}:{self.port} for the loss probe: {exc.strerror or exc}") from None
        self.sessions_served = 0

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def serve_forever(self, stop: threading.Event | None = None) -> None:
        """Accept connections and echo probes until ``stop`` is set (or Ctrl-C in the caller)."""
        stop = stop or self._stop
        while not stop.is_set() and not self._stop.is_set():
            readable, _, _ = select.select([self.tcp, self.udp], [], [], 0.2)
            if self.udp in readable:
                self._echo_probe()
            if self.tcp in readable:
                try:
                    conn, peer = self.tcp.accept()
                except OSError:
                    continue
                self._spawn(self._handle, conn, peer)

    def close(self) -> None:
        self._stop.set()
        self.tcp.close()
        self.udp.close()
        with self._lock:
            conns, threads = list(self._conns), list(self._threads)
        for conn in conns:  # shutdown wakes a thread blocked in recv on it; close alone would not
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for thread in threads:
            thread.join(timeout=5)
        for conn in conns:
            conn.close()

    # --------------------------------------------------------------------------------------- internals

    def _spawn(self, target: Callable[..., None], *args: Any) -> None:
        def run() -> None:
            try:
                target(*args)
            finally:
                with self._lock:
                    self._threads.discard(threading.current_thread())

        thread = threading.Thread(target=run, name="redline-net-serve", daemon=True)
        with self._lock:
            self._threads.add(thread)
        thread.start()

    def _track(self, conn: socket.socket, keep: bool) -> None:
        with self._lock:
            (self._conns.add if keep else self._conns.discard)(conn)

    def _echo_probe(self) -> None:
        try:
            data, addr = self.udp.recvfrom(64)
        except OSError:
            return
        session = self._session
        if session is None or len(data) != wire.PROBE.size or data[:4] != wire.PROBE_MAGIC:
            return
        if data[4:12] != session.token:
            return
        session.udp_received += 1
        with contextlib.suppress(OSError):
            self.udp.sendto(data, addr)

    def _handle(self, conn: socket.socket, peer: tuple) -> None:
        self._track(conn, True)
        handed_over = False
        try:
            conn.settimeout(HANDSHAKE_TIMEOUT_S)
            wire.recv_magic(conn)
            first = wire.recv_frame(conn)
            if first["op"] == "data":
                handed_over = self._attach_data(conn, first)
                return
            conn.sendall(wire.MAGIC)  # a control connection: whatever comes next, it talks to a redline server
            if first["op"] != "hello":
                wire.send_frame(conn, {"op": "error", "reason": f"unexpected {first['op']!r}"})
                return
            session = _Session(self, conn)
            with self._lock:
                busy = self._session is not None
                if not busy:
                    self._session = session
            if busy:
                wire.send_frame(conn, {"op": "busy"})
                return
            try:
                self.log(f"network bench: session from {peer[0]}")
                session.run()
                self.sessions_served += 1
                self.log(f"network bench: session from {peer[0]} done ({session.tests} tests)")
            finally:
                with self._lock:
                    self._session = None
                session.drop_pending()
        except (OSError, wire.ProtocolError) as exc:
            if not self._stop.is_set():
                self.log(f"network bench: connection from {peer[0]} ended: {exc}")
        finally:
            if not handed_over:
                self._track(conn, False)
                conn.close()

    def _attach_data(self, conn: socket.socket, message: dict[str, Any]) -> bool:
        session = self._session
        if session is None or message.get("session") != session.token.hex():
            return False
        self._track(conn, True)  # stays tracked (so close() can reach it) until its test ends
        conn.settimeout(None)
        session.data.put((message.get("test"), int(message.get("stream", 0)), conn))
        return True

    def _release(self, socks: list[socket.socket]) -> None:
        streams.abort(socks)
        for sock in socks:
            self._track(sock, False)


class _Session:
    """One client's control connection and the tests it asks for."""

    def __init__(self, server: Server, conn: socket.socket) -> None:
        self.server = server
        self.conn = conn
        self.token = os.urandom(8)
        self.udp_received = 0
        self.tests = 0
        self.data: queue.Queue[tuple[Any, int, socket.socket]] = queue.Queue()
        self._test_ids = itertools.count(1)

    def run(self) -> None:
        hello = {"version": wire.PROTOCOL_VERSION, "session": self.token.hex(), "tcp": local_tcp_settings()}
        wire.send_frame(self.conn, {"op": "hello"} | hello)
        self.conn.settimeout(IDLE_TIMEOUT_S)
        while True:
            try:
                message = wire.recv_frame(self.conn)
            except wire.ProtocolError:
                return  # the client hung up
            op = message["op"]
            if op == "ping":
                wire.send_frame(self.conn, {"op": "pong", "seq": message.get("seq")})
            elif op == "udp_count":
                wire.send_frame(self.conn, {"op": "udp_count", "received": self.udp_received})
            elif op == "tcp":
                self._tcp_test(message)
            elif op == "bye":
                return
            else:
                wire.send_frame(self.conn, {"op": "error", "reason": f"unknown op {op!r}"})

    def _tcp_test(self, message: dict[str, Any]) -> None:
        try:
            count = int(message["streams"])
            direction = message["direction"]
            omit_s = float(message["omit_s"])
            duration_s = float(message["duration_s"])
        except (KeyError, TypeError, ValueError):
            wire.send_frame(self.conn, {"op": "error", "reason": "malformed tcp test request"})
            return
        if not (1 <= count <= MAX_STREAMS and direction in ("up", "down")):
            wire.send_frame(self.conn, {"op": "error", "reason": f"streams 1..{MAX_STREAMS}, direction up|down"})
            return
        if not (0 <= omit_s <= MAX_TEST_S and 0 < duration_s <= MAX_TEST_S):
            wire.send_frame(self.conn, {"op": "error", "reason": f"omit and duration up to {MAX_TEST_S:g} s"})
            return
        test_id = next(self._test_ids)
        self.tests += 1
        wire.send_frame(self.conn, {"op": "ready", "test": test_id})
        socks = self._collect(test_id, count)
        try:
            if len(socks) < count:
                wire.send_frame(self.conn, {"op": "error", "reason": f"{len(socks)} of {count} streams arrived"})
                return
            if message.get("congestion") and direction == "down":
                try:
                    streams.set_congestion_control(socks, str(message["congestion"]))
                except OSError as exc:
                    reason = f"congestion control {message['congestion']!r}: {exc.strerror}"
                    wire.send_frame(self.conn, {"op": "error", "reason": reason})
                    return
            wire.send_frame(self.conn, {"op": "started"})
            if direction == "up":
                received = streams.receive(socks, omit_s=omit_s, duration_s=duration_s, stop=self.server.stopping)
                wire.send_frame(self.conn, {"op": "result", "received": dataclasses.asdict(received)})
            else:
                sender = streams.Sender(socks)
                try:
                    self.conn.settimeout(omit_s + duration_s + HANDSHAKE_TIMEOUT_S)
                    wire.expect(self.conn, "stop")
                finally:
                    sender.finish()
                    self.conn.settimeout(IDLE_TIMEOUT_S)
                stats = tcpinfo.sender_stats(socks)
                wire.send_frame(self.conn, {"op": "sender", "stats": stats.to_dict()})
        finally:
            self.server._release(socks)

    def _collect(self, test_id: int, count: int) -> list[socket.socket]:
        """The test's data connections, in stream order, as they arrive (at most DATA_CONNECT_TIMEOUT_S)."""
        found: dict[int, socket.socket] = {}
        deadline = time.monotonic() + DATA_CONNECT_TIMEOUT_S
        while len(found) < count:
            try:
                test, stream, sock = self.data.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if test != test_id or stream in found:
                self.server._release([sock])
                continue
            found[stream] = sock
        return [found[k] for k in sorted(found)]

    def drop_pending(self) -> None:
        while True:
            try:
                _, _, sock = self.data.get_nowait()
            except queue.Empty:
                return
            self.server._release([sock])
