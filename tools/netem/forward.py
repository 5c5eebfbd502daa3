"""The user-space half of an emulated link: a process that moves IP packets between two TUN devices and
does to them what netem would (where the kernel has no sch_netem).

Per direction, in netem's order: random loss on arrival; then a tail-drop queue in front of a serializer
running at the rate cap (a packet leaves the queue size*8/rate seconds after the one before it); then a
fixed one-way delay. Departure times are computed, not slept, so the rate is exact on average; a packet is
written to the far TUN when its delivery time has come (late by the loop's wake-up, ~0.1-1 ms).

Run by netem.link (by its path) with the two TUN file descriptors inherited:
``python tools/netem/forward.py --fds 5,6 --delay-ms 100 --loss 0.001 --rate-mbit 100 --queue-bytes N``.
On SIGTERM it prints its counters as one JSON line and exits.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import random
import select
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass, field

_PR_SET_PDEATHSIG = 1


@dataclass
class Shaper:
    """One direction of the link. ``admit`` decides a packet's fate from its arrival time and size."""

    delay_s: float
    loss: float
    rate_bits_per_s: float | None
    queue_bytes: int | None
    rng: random.Random = field(default_factory=random.Random, repr=False)
    # when the serializer will have sent everything admitted so far
    free_at: float = 0.0
    forwarded: int = 0
    lost: int = 0
    dropped: int = 0

    def admit(self, now: float, size_bytes: int) -> float | None:
        """The time the packet reaches the far end, or None if it is lost (random) or dropped (queue full)."""
        if self.loss and self.rng.random() < self.loss:
            self.lost += 1
            return None
        if not self.rate_bits_per_s:
            self.forwarded += 1
            return now + self.delay_s
        backlog_bytes = max(0.0, self.free_at - now) * self.rate_bits_per_s / 8
        if self.queue_bytes is not None and backlog_bytes + size_bytes > self.queue_bytes:
            self.dropped += 1
            return None
        self.free_at = max(now, self.free_at) + size_bytes * 8 / self.rate_bits_per_s
        self.forwarded += 1
        return self.free_at + self.delay_s

    def counters(self) -> dict[str, int]:
        return {"forwarded": self.forwarded, "lost": self.lost, "dropped": self.dropped}


def forward(fd_a: int, fd_b: int, a_to_b: Shaper, b_to_a: Shaper, stop: list[bool]) -> None:
    """Move packets both ways until ``stop[0]``. Delivery times in one direction never decrease (a FIFO
    serializer plus a constant delay), so each direction's in-flight packets are a plain queue."""
    lanes = {fd_a: (a_to_b, fd_b, deque()), fd_b: (b_to_a, fd_a, deque())}
    for fd in lanes:
        os.set_blocking(fd, False)
    while not stop[0]:
        now = time.monotonic()
        heads = [q[0][0] for _, _, q in lanes.values() if q]
        timeout = min(0.2, max(0.0, min(heads) - now)) if heads else 0.2
        try:
            readable, _, _ = select.select(list(lanes), [], [], timeout)
        except InterruptedError:
            continue
        now = time.monotonic()
        for fd in readable:
            shaper, _, in_flight = lanes[fd]
            for _ in range(256):  # a bounded batch, so the other direction is not starved
                try:
                    packet = os.read(fd, 65536)
                except BlockingIOError:
                    break
                except OSError:
                    return  # the TUN went away: the link is being torn down
                deliver_at = shaper.admit(now, len(packet))
                if deliver_at is not None:
                    in_flight.append((deliver_at, packet))
        now = time.monotonic()
        for _, out_fd, in_flight in lanes.values():
            while in_flight and in_flight[0][0] <= now:
                try:
                    os.write(out_fd, in_flight.popleft()[1])
                except BlockingIOError:
                    break
                except OSError:
                    pass  # e.g. the far side is down: the packet is gone, as on a wire


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="forward.py")
    parser.add_argument("--fds", required=True, help="the two TUN file descriptors, A,B")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay, each direction")
    parser.add_argument("--loss", type=float, default=0.0, help="random loss probability, each direction")
    parser.add_argument("--rate-mbit", type=float, default=None, help="rate cap, each direction")
    parser.add_argument("--queue-bytes", type=int, default=None, help="tail-drop queue before the rate cap")
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)
    # die with the process that built the link, so a killed test leaves no forwarder behind
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    # a link does not slow down when the CPU is busy: run ahead of the endpoints where allowed (root)
    with contextlib.suppress(OSError):
        os.nice(-10)
    fd_a, fd_b = (int(x) for x in args.fds.split(","))
    rng = random.Random(args.seed)
    rate = args.rate_mbit * 1e6 if args.rate_mbit else None
    shapers = [Shaper(args.delay_ms / 1e3, args.loss, rate, args.queue_bytes, rng=rng) for _ in range(2)]
    stop = [False]

    def on_term(signum: int, frame: object) -> None:
        stop[0] = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    print("ready", flush=True)
    forward(fd_a, fd_b, shapers[0], shapers[1], stop)
    print(json.dumps({"a_to_b": shapers[0].counters(), "b_to_a": shapers[1].counters()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
