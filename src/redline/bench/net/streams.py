"""Bulk TCP streams: the sending and receiving loops of a throughput test, and how a test's sockets end.

The receiver's bytes are what count (iperf3's ``end.sum_received``): the sender's counts include what is
still sitting in its socket buffer. The receiver samples its byte count at interval boundaries from the
end of the warm-up (iperf3 -O) on, and the rate is bytes between the first and last sample over the time
between them, with the times actually observed, so a late wake-up shortens no interval.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import math
import selectors
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import cast

# what iperf3 writes per send() for TCP by default
BLOCK_BYTES = 128 * 1024
_RECV_BYTES = 256 * 1024


@dataclass
class Received:
    """What the receiving side counted in the measured window (warm-up excluded)."""

    bytes: int
    window_s: float
    interval_bits_per_s: list[float] = field(default_factory=list)
    stream_bytes: list[int] = field(default_factory=list)

    @property
    def bits_per_s(self) -> float:
        return self.bytes * 8 / self.window_s if self.window_s > 0 else 0.0


def receive(
    socks: list[socket.socket],
    *,
    omit_s: float,
    duration_s: float,
    interval_s: float = 1.0,
    stop: threading.Event | None = None,
) -> Received:
    """Read every stream until omit_s + duration_s from now; count the bytes after omit_s. ``stop`` (a
    server shutting down) ends it early; the figures then cover the time until then."""
    sel = selectors.DefaultSelector()
    for index, sock in enumerate(socks):
        sock.setblocking(False)
        sel.register(sock, selectors.EVENT_READ, index)
    view = memoryview(bytearray(_RECV_BYTES))
    per_stream = [0] * len(socks)
    at_omit = [0] * len(socks)
    total = 0
    start = time.monotonic() + omit_s
    marks = [start + k * interval_s for k in range(math.ceil(duration_s / interval_s))] + [start + duration_s]
    samples: list[tuple[float, int]] = []
    try:
        while len(samples) < len(marks):
            now = time.monotonic()
            if stop is not None and stop.is_set():
                samples.append((now, total))
                break
            if now >= marks[len(samples)]:
                if not samples:
                    at_omit = list(per_stream)
                samples.append((now, total))
                continue
            timeout = min(marks[len(samples)] - now, 0.05)
            if not sel.get_map():  # every sender went away: wait out the window, the rate shows it
                time.sleep(timeout)
                continue
            for key, _ in sel.select(timeout):
                for _ in range(8):  # drain what waits (bounded, so one stream cannot starve the clock)
                    try:
                        got = cast(socket.socket, key.fileobj).recv_into(view)
                    except BlockingIOError:
                        break
                    except OSError:
                        got = 0
                    if not got:
                        sel.unregister(key.fileobj)
                        break
                    per_stream[key.data] += got
                    total += got
                    if got < _RECV_BYTES:
                        break
    finally:
        sel.close()
    if not samples:  # stopped during the warm-up
        return Received(bytes=0, window_s=0.0)
    (t_first, b_first), (t_last, b_last) = samples[0], samples[-1]
    rates = [(b1 - b0) * 8 / (t1 - t0) for (t0, b0), (t1, b1) in itertools.pairwise(samples) if t1 > t0]
    return Received(
        bytes=b_last - b_first,
        window_s=t_last - t_first,
        interval_bits_per_s=rates,
        stream_bytes=[now - then for now, then in zip(per_stream, at_omit, strict=True)],
    )


def send(socks: list[socket.socket], stop: threading.Event) -> None:
    """Write BLOCK_BYTES at a time to every stream until its send buffer is full, until ``stop`` is set or
    all streams are gone.

    Filling each buffer to the brim matters: a socket reads as writable again once a third of its buffer
    is free, so one write per wake-up would keep it about 2/3 full, and where tcp_wmem max is what limits
    a stream (a long link) that is a third less in flight than a blocking writer such as iperf3 keeps.
    """
    sel = selectors.DefaultSelector()
    for sock in socks:
        sock.setblocking(False)
        sel.register(sock, selectors.EVENT_WRITE)
    block = memoryview(bytes(BLOCK_BYTES))
    try:
        while not stop.is_set() and sel.get_map():
            for key, _ in sel.select(0.05):
                try:
                    while cast(socket.socket, key.fileobj).send(block) == BLOCK_BYTES:
                        pass
                except BlockingIOError:
                    pass
                except OSError:  # the receiver ended the test first
                    sel.unregister(key.fileobj)
    finally:
        sel.close()


class Sender:
    """``send`` on a thread of its own, so the caller can wait on the control connection meanwhile."""

    def __init__(self, socks: list[socket.socket]) -> None:
        self.stop = threading.Event()
        self._thread = threading.Thread(target=send, args=(socks, self.stop), name="redline-net-send", daemon=True)
        self._thread.start()

    def finish(self) -> None:
        self.stop.set()
        self._thread.join()


def set_congestion_control(socks: list[socket.socket], name: str) -> None:
    """Per-socket congestion control, set on connected sockets as iperf3 -C does. Root may pick any the
    kernel has; others only those in net.ipv4.tcp_allowed_congestion_control. Raises OSError if refused.

    Set after the handshake, the socket has already been initialised by the system default; if that is
    BBR, it keeps BBR's packet pacing under the new algorithm. That is iperf3's behaviour, matched so the
    two compare (paced and unpaced CUBIC differ: bursts from parallel unpaced streams inflate each other's
    RTT samples and make HyStart leave slow start early)."""
    for sock in socks:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, name.encode())


def connect_all(address: tuple[str, int], count: int, timeout_s: float) -> list[socket.socket]:
    """Open ``count`` TCP connections at once (not one round trip after another: on a 200 ms link 16
    sequential handshakes would take over 3 s). Raises OSError (or TimeoutError) if any fails."""
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET6 if ":" in address[0] else socket.AF_INET, socket.SOCK_STREAM)
            socks.append(sock)
            sock.setblocking(False)
            err = sock.connect_ex(address)
            if err not in (0, errno.EINPROGRESS):
                raise OSError(err, f"connect to {address[0]}:{address[1]} failed")
        deadline = time.monotonic() + timeout_s
        pending = set(socks)
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{len(pending)} of {count} data connections not established in {timeout_s:g} s")
            with selectors.DefaultSelector() as sel:
                for sock in pending:
                    sel.register(sock, selectors.EVENT_WRITE)
                for key, _ in sel.select(remaining):
                    err = cast(socket.socket, key.fileobj).getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                    if err:
                        raise OSError(err, f"data connection to {address[0]}:{address[1]} failed")
                    pending.discard(key.fileobj)
        for sock in socks:
            sock.setblocking(True)
            sock.settimeout(timeout_s)
        return socks
    except BaseException:
        abort(socks)
        raise


def abort(socks: list[socket.socket]) -> None:
    """Close at once with a reset (SO_LINGER 0): a finished test's unsent buffers are dropped, not drained
    over a slow link for seconds."""
    for sock in socks:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
