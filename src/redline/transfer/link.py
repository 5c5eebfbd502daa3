"""How big a transfer's requests are and how many run at once, from what is known about the link.

On a long link one TCP stream is held far below the link rate (loss-based congestion control halves its window
on each loss and wins it back one segment per RTT), and a request shorter than the bandwidth-delay product
leaves its stream idle one RTT in every request. So a transfer asks for chunks of at least 2x the BDP (8 MiB at
least: per-request overhead, and the journal's granularity) over as many streams as it takes to fill the link.

Where the figures come from, best first: this machine's saved ``redline bench network`` run against the far
end (the server -> client figures for a download, client -> server for an upload), else the connection time to
the endpoint (a TCP handshake is one RTT) with the link's rate unknown.
"""

from __future__ import annotations

import math
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from redline.bench.network import bdp_bytes
from redline.units import MiB

if TYPE_CHECKING:
    from redline.bench.model import BenchRun

MIN_CHUNK_BYTES = 8 * MiB
MAX_CHUNK_BYTES = 256 * MiB  # one retry re-sends at most this much
# streams when nothing says how many the link needs: a long link (loss-based TCP at 100+ ms needs 8-16 streams
# to fill 100 Mbit/s, as bench network measures) or a short one, where a few hide each request's latency
LONG_RTT_S = 0.05
DEFAULT_STREAMS_LONG = 16
DEFAULT_STREAMS_SHORT = 4
# what one endpoint gets at most unless told otherwise: aria2's ceiling per server, and what web servers and
# object stores tolerate from one client before they throttle
DEFAULT_PER_ENDPOINT = 16


@dataclass(frozen=True)
class Link:
    """What is known of the path to an endpoint; None where nothing measured it."""

    rtt_s: float | None = None
    rate_bits_per_s: float | None = None  # what the link carries with enough streams
    streams_needed: int | None = None  # the fewest streams that carry it (bench network)
    source: str = "nothing measured"

    def chunk_bytes(self) -> int:
        """max(8 MiB, 2 x BDP), rounded up to a whole MiB, at most 256 MiB."""
        if self.rtt_s is None or self.rate_bits_per_s is None:
            return MIN_CHUNK_BYTES
        wanted = 2 * bdp_bytes(self.rate_bits_per_s, self.rtt_s)
        return min(MAX_CHUNK_BYTES, max(MIN_CHUNK_BYTES, math.ceil(wanted / MiB) * MiB))

    def streams(self, cap: int) -> int:
        """The streams to run at once, at most ``cap``."""
        if self.streams_needed:
            wanted = self.streams_needed
        elif self.rtt_s is not None and self.rtt_s >= LONG_RTT_S:
            wanted = DEFAULT_STREAMS_LONG
        else:
            wanted = DEFAULT_STREAMS_SHORT
        return max(1, min(cap, wanted))

    def describe(self) -> str:
        parts = []
        if self.rtt_s is not None:
            parts.append(f"RTT {self.rtt_s * 1e3:.0f} ms")
        if self.rate_bits_per_s is not None:
            parts.append(f"{self.rate_bits_per_s / 1e6:.0f} Mbit/s")
        if self.streams_needed:
            parts.append(f"{self.streams_needed} streams fill it")
        return f"{', '.join(parts) or 'unknown link'} ({self.source})"


def connect_rtt_s(host: str, port: int, tries: int = 3, timeout_s: float = 10.0) -> float | None:
    """The median time of a TCP handshake to ``host:port`` (one round trip), the tries made at once (on a
    200 ms link three in a row would cost 0.6 s before the first byte), or None when it cannot connect (the
    transfer then says what failed, with the real error)."""
    from concurrent.futures import ThreadPoolExecutor

    def handshake(_: int) -> float | None:
        start = time.perf_counter()
        try:
            with socket.create_connection((host, port), timeout=timeout_s):
                return time.perf_counter() - start
        except OSError:
            return None

    with ThreadPoolExecutor(max_workers=tries) as pool:
        times = [t for t in pool.map(handshake, range(tries)) if t is not None]
    if len(times) < tries:  # a handshake failed
        return None
    return statistics.median(times)


def from_bench(run: BenchRun | None, direction: str) -> Link | None:
    """The link a saved bench network run measured, in ``direction`` ("down": server -> client, what a fetch
    receives; "up": what a push sends), or None when the run has no network figures that way."""
    if run is None:
        return None
    suffix = "_reverse" if direction == "down" else ""
    by_name = {m.name: m for m in run.measurements if m.suite == "network"}
    needed, rtt = by_name.get("streams_needed" + suffix), by_name.get("rtt")
    if needed is None:
        return None
    return Link(
        rtt_s=rtt.value / 1e3 if rtt else None,
        rate_bits_per_s=needed.extra["best_mbit_s"] * 1e6 if needed.extra.get("best_mbit_s") else None,
        streams_needed=int(needed.value),
        source=f"bench network of {run.taken_at}",
    )


def to_endpoint(endpoint: str, direction: str, measure_rtt: Callable[[str, int], float | None] = connect_rtt_s) -> Link:
    """What is known of the path to ``endpoint`` (scheme://[user@]host:port): this machine's saved bench
    network figures when their RTT is that of this endpoint (within 2x: the same far end, or one as far),
    else the endpoint's handshake time alone. A local path is no link at all."""
    from urllib.parse import urlsplit

    from redline.bench import store

    parts = urlsplit(endpoint)
    if not parts.hostname:  # a path's endpoint is its mount (file:///mnt/data), an fsspec one its protocol alone
        return Link(source="a local filesystem")
    rtt = measure_rtt(parts.hostname, parts.port or 443)
    bench = from_bench(store.latest_here(), direction)
    if bench is not None and (rtt is None or bench.rtt_s is None or 0.5 <= rtt / bench.rtt_s <= 2.0):
        return Link(rtt or bench.rtt_s, bench.rate_bits_per_s, bench.streams_needed, bench.source)
    if rtt is None:
        return Link(source=f"{parts.hostname} did not answer a TCP handshake")
    return Link(rtt_s=rtt, source=f"TCP handshake to {parts.hostname}; the rate is unknown (no bench network run)")
