"""A crowd of scrapers landing at once is answered, every one: the exporter of `redline monitor --port` and
``start_metrics_server`` (for any of redline's series) keep a listen backlog far over prometheus_client's 5.
And a crowd of idle connections (any local user can make them) cannot pile threads into the server: it serves
at most ``MAX_REQUESTS`` at once and drops a silent one after ``HANDLER_TIMEOUT_S``.

The server is stopped (SIGSTOP) while 200 scrapers connect, as a busy accept loop would be: the kernel completes
and queues as many connections as the backlog holds and drops the SYNs of the rest. Then it goes on, and every
connection must get its answer. Nothing here is timed against the machine's speed: the handshakes are the
kernel's own, and the waits are hang guards."""

from __future__ import annotations

import os
import selectors
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from test_monitor_cli import monitor_serving

from redline.monitor.metrics_server import HANDLER_TIMEOUT_S, MAX_REQUESTS

SCRAPERS = 200
HANG_GUARD_S = 300.0
REQUEST = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"


@pytest.fixture(autouse=True)
def deep_enough_kernel() -> None:
    somaxconn = int(Path("/proc/sys/net/core/somaxconn").read_text())
    if somaxconn < SCRAPERS:
        pytest.skip(f"net.core.somaxconn is {somaxconn}: the kernel cuts every backlog below {SCRAPERS}")


def connect_while_stopped(pid: int, port: int) -> list[socket.socket]:
    """SCRAPERS connections to ``port``, made while ``pid`` is stopped, each with its request sent; fails the test
    when the kernel would not take them all (a short listen backlog)."""
    os.kill(pid, signal.SIGSTOP)
    sockets = []
    try:
        for _ in range(SCRAPERS):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            sockets.append(s)
        connected = _handshakes_done(sockets)
        assert connected == SCRAPERS, f"{connected} of {SCRAPERS} connections taken: the listen backlog is short"
        for s in sockets:
            s.sendall(REQUEST)  # a few dozen bytes: the socket's buffer takes them at once
    except BaseException:
        for s in sockets:
            s.close()
        raise
    finally:
        os.kill(pid, signal.SIGCONT)
    return sockets


def _handshakes_done(sockets: list[socket.socket]) -> int:
    """How many of ``sockets`` finish connecting: all, at once, when the backlog holds them; the others' SYNs
    are dropped for as long as the server is stopped, so the wait ends at the guard."""
    pending = {s.fileno(): s for s in sockets}
    done = 0
    with selectors.DefaultSelector() as selector:
        for s in sockets:
            selector.register(s, selectors.EVENT_WRITE)
        deadline = time.monotonic() + 30.0  # the kernel answers a loopback SYN in microseconds; a guard only
        while pending and time.monotonic() < deadline:
            for key, _ in selector.select(timeout=1.0):
                selector.unregister(key.fileobj)
                s = pending.pop(key.fd)
                assert s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0
                done += 1
    return done


def answers(sockets: list[socket.socket]) -> list[bytes]:
    """Each connection's whole answer (read to its end), the server running again."""
    got = {s.fileno(): b"" for s in sockets}
    with selectors.DefaultSelector() as selector:
        for s in sockets:
            selector.register(s, selectors.EVENT_READ)
        deadline = time.monotonic() + HANG_GUARD_S
        while selector.get_map() and time.monotonic() < deadline:
            for key, _ in selector.select(timeout=1.0):
                chunk = key.fileobj.recv(65536)
                got[key.fd] += chunk
                if not chunk:
                    selector.unregister(key.fileobj)
    for s in sockets:
        s.close()
    return list(got.values())


def test_the_exporter_answers_200_scrapes_that_land_at_once() -> None:
    with monitor_serving() as (monitor, port):
        replies = answers(connect_while_stopped(monitor.pid, port))
    good = [r for r in replies if r.startswith(b"HTTP/1.0 200") and b"redline_host_memory_total_bytes" in r]
    assert len(good) == SCRAPERS, f"{len(good)} of {SCRAPERS} scrapes answered"


SERVE = """
import sys, time
from prometheus_client import CollectorRegistry, Gauge
from redline.monitor.metrics_server import start_metrics_server

registry = CollectorRegistry()
Gauge("redline_queue_jobs", "Jobs in the queue.", registry=registry).set(3)
server, _ = start_metrics_server(0, registry=registry)
print(server.server_address[1], flush=True)
time.sleep(3600)
"""


def test_start_metrics_server_answers_200_scrapes_that_land_at_once() -> None:
    """The function the queue's daemon can serve its series with, as it does prometheus_client's today."""
    server = subprocess.Popen([sys.executable, "-c", textwrap.dedent(SERVE)], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        replies = answers(connect_while_stopped(server.pid, port))
    finally:
        server.kill()
        server.wait(timeout=HANG_GUARD_S)
    assert sum(r.startswith(b"HTTP/1.0 200") and b"redline_queue_jobs 3.0" in r for r in replies) == SCRAPERS


IDLE = 300  # connections that never send a request: more than the server serves at once


def _threads(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("Threads:")))


def _most_threads(pid: int, seconds: float) -> int:
    """The most threads ``pid`` ran, sampled over ``seconds`` (under the handler timeout: none dropped yet)."""
    most, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        most = max(most, _threads(pid))
        time.sleep(0.02)
    return most


def _dropped_after(sockets: list[socket.socket], opened: list[float]) -> list[float]:
    """Seconds from each connection's opening until the server closed it (EOF or a reset); inf where it kept
    it past the hang guard."""
    after = [float("inf")] * len(sockets)
    index = {s.fileno(): i for i, s in enumerate(sockets)}
    with selectors.DefaultSelector() as selector:
        for s in sockets:
            selector.register(s, selectors.EVENT_READ)
        deadline = time.monotonic() + HANDLER_TIMEOUT_S + 60.0
        while selector.get_map() and time.monotonic() < deadline:
            for key, _ in selector.select(timeout=1.0):
                try:
                    data = key.fileobj.recv(1)
                except ConnectionResetError:
                    data = b""
                if not data:
                    selector.unregister(key.fileobj)
                    after[index[key.fd]] = time.monotonic() - opened[index[key.fd]]
    return after


@pytest.mark.slow
def test_idle_connections_cannot_pile_threads_into_the_server_and_are_dropped() -> None:
    server = subprocess.Popen([sys.executable, "-c", textwrap.dedent(SERVE)], stdout=subprocess.PIPE, text=True)
    idle: list[socket.socket] = []
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        before = _threads(server.pid)
        opened = []
        for _ in range(IDLE):
            idle.append(socket.create_connection(("127.0.0.1", port)))
            opened.append(time.monotonic())
        most = _most_threads(server.pid, HANDLER_TIMEOUT_S / 2)
        assert most <= before + MAX_REQUESTS, f"{most} threads for {IDLE} idle connections"
        after = _dropped_after(idle, opened)
        scrape = socket.create_connection(("127.0.0.1", port))
        scrape.sendall(REQUEST)
        reply = answers([scrape])[0]
    finally:
        for s in idle:
            s.close()
        server.kill()
        server.wait(timeout=HANG_GUARD_S)
    assert max(after) < float("inf"), f"{after.count(float('inf'))} idle connections kept past the guard"
    held = [a for a in after if a >= HANDLER_TIMEOUT_S - 0.05]  # a held one is dropped at its timeout, not sooner
    assert len(held) == MAX_REQUESTS, "the rest are closed as they are accepted, past the cap"
    assert reply.startswith(b"HTTP/1.0 200") and b"redline_queue_jobs 3.0" in reply
