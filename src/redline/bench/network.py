"""Network suite: what a link between two redline endpoints delivers, and what it takes to fill it.

`redline bench network --serve` on one host, `--connect HOST` on the other (with neither, a server on
loopback: a sanity check of this host's TCP stack, not of any network). Measured, as iperf3 and ping would:

- ``rtt``: small request/response round trips on an idle TCP connection (median, p10/p90), in ms;
- ``loss``: a UDP probe train echoed by the server, lost per crossing of the path (TCP retransmits from
  TCP_INFO when UDP does not get through);
- ``tcp_1_stream``, ``tcp_N_streams``: TCP throughput with 1 and N parallel streams, client -> server,
  counted by the receiver after a warm-up (iperf3 -O); ``..._reverse`` server -> client (iperf3 -R);
- ``bdp``: the bandwidth-delay product of the best throughput and the RTT: the bytes that must be in
  flight to keep the link full, hence what socket buffers (net.ipv4.tcp_wmem/tcp_rmem max) must hold;
- ``streams_needed``: the smallest stream count within 10% of the best, with the chunk size to request
  (at least 2x the BDP) and why one stream falls short (buffers or congestion control) in ``extra``.

On a long fat pipe one loss-based stream is held far below the link rate: Reno to about
MSS/RTT x 1.22/sqrt(loss) (Mathis et al., 1997), ~2 Mbit/s at 200 ms and 0.1% loss whatever the link;
CUBIC does several times better, still a fraction of 100 Mbit/s. Parallel streams, or BBR (which does not
take random loss for congestion), are how such a link gets filled; this suite measures how many it takes.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import statistics
import sys
import threading
from dataclasses import dataclass
from typing import Any

from redline.bench.context import BenchContext
from redline.bench.model import Measurement, Spread
from redline.bench.net import wire
from redline.bench.net.client import Client, Throughput, UdpProbe, serve_in_thread
from redline.bench.net.server import Server, local_tcp_settings
from redline.bench.net.streams import BLOCK_BYTES
from redline.errors import BadInput
from redline.units import MiB, fmt_bytes

MAX_STREAMS = 128  # iperf3's -P ceiling: past it a host runs out of sockets and threads, not bandwidth

SUITE = "network"
# a stream count is "enough" when it reaches this share of the best count's throughput
ENOUGH = 0.90
# payload share of a socket buffer: the kernel keeps skb overhead in the same budget (tcp_adv_win_scale=1,
# the long-time default, gives half; newer kernels measure the ratio, typically 50-75%)
PAYLOAD_SHARE = 0.5


@dataclass
class Plan:
    streams: list[int]
    directions: tuple[str, ...]
    omit_s: float
    duration_s: float
    pings: int
    probes: int
    probe_rate_per_s: float
    # per-socket congestion control for the senders (iperf3 -C); None: the system default
    congestion: str | None = None

    @classmethod
    def for_context(cls, ctx: BenchContext) -> Plan:
        """--quick, and the loopback sanity check: 3 s per count after 1 s warm-up, one direction.
        Otherwise 10 s after 2 s (iperf3 -t 10 -O 2), both directions. ``ctx.duration_s`` overrides the
        measured seconds."""
        if ctx.quick or not ctx.connect:
            plan = cls(ctx.streams, ("up",), 1.0, 3.0, pings=10, probes=500, probe_rate_per_s=500)
        else:
            plan = cls(ctx.streams, ("up", "down"), 2.0, 10.0, pings=20, probes=2000, probe_rate_per_s=1000)
        if ctx.duration_s is not None:
            if ctx.duration_s <= 0:
                raise BadInput("network: the duration must be positive")
            plan.duration_s = ctx.duration_s
        plan.congestion = ctx.extra.get("congestion_control")
        return plan


def check(ctx: BenchContext) -> None:
    """Before any suite runs: the options that decide where this suite talks."""
    if ctx.serve and ctx.connect:
        raise BadInput("network: --serve and --connect exclude each other (one host serves, the other connects)")
    if not 1 <= ctx.port <= 65535:
        raise BadInput(f"--port {ctx.port} is not a TCP port (1-65535)")
    if max(ctx.streams, default=1) > MAX_STREAMS:
        raise BadInput(f"--streams: at most {MAX_STREAMS} parallel streams (as iperf3 -P), not {max(ctx.streams)}")


def run(ctx: BenchContext) -> list[Measurement]:
    check(ctx)
    if ctx.serve:
        serve(ctx.port, duration_s=ctx.duration_s, host=ctx.listen)
        return []
    plan = Plan.for_context(ctx)
    local_tcp = dataclasses.asdict(ctx.snapshot.network.tcp) if ctx.snapshot else local_tcp_settings()
    if ctx.connect:
        with Client(ctx.connect, ctx.port) as client:
            return measure(client, plan, ctx, local_tcp, where=f"to {ctx.connect}:{ctx.port}")
    port, stop = serve_in_thread()
    try:
        with Client("127.0.0.1", port) as client:
            where = "on loopback to a server this process started (a sanity check of the TCP stack, not a link)"
            return measure(client, plan, ctx, local_tcp, where=where)
    finally:
        stop()


def serve(port: int, duration_s: float | None = None, host: str = "0.0.0.0") -> None:
    """Serve until Ctrl-C (or ``duration_s``); the sockets close on the way out either way. Every interface
    by default, as iperf3 does: the peer is another machine (``--listen`` narrows it)."""
    with Server(host, port) as server:
        where = "every interface (--listen ADDR to narrow)" if host in ("0.0.0.0", "::") else host
        server.log(f"network bench: serving on {where}, port {server.port} (TCP and UDP); Ctrl-C to stop")
        stop = threading.Event()
        timer = threading.Timer(duration_s, stop.set) if duration_s is not None else None
        if timer:
            timer.start()
        try:
            server.serve_forever(stop)
        finally:
            if timer:
                timer.cancel()


def measure(
    client: Client, plan: Plan, ctx: BenchContext | None, local_tcp: dict[str, Any], where: str
) -> list[Measurement]:
    """RTT and loss on the idle path, then throughput per direction and stream count."""
    progress = ctx or BenchContext()
    with progress.task("network: RTT and loss", 1) as step:
        probe = _ProbeThread(client, plan)
        rtt_ms = client.ping(plan.pings)
        udp = probe.finish()
        step()
    results: list[Throughput] = []
    with progress.task("network: TCP throughput", len(plan.directions) * len(plan.streams)) as step:
        for direction in plan.directions:
            for count in plan.streams:
                results.append(client.throughput(count, direction, plan.omit_s, plan.duration_s, plan.congestion))
                step()
    return build_measurements(rtt_ms, udp, results, local_tcp, client.server_tcp, where, plan)


class _ProbeThread:
    """The UDP probe train runs while the pings go over TCP: both are a trickle, neither disturbs the other."""

    def __init__(self, client: Client, plan: Plan) -> None:
        self._client = client
        self._result: dict[str, Any] = {}
        linger_s = max(0.5, 3 * client.handshake_rtt_s)
        self._thread = threading.Thread(
            target=lambda: self._result.update(train=client.udp_train(plan.probes, plan.probe_rate_per_s, linger_s)),
            name="redline-net-probe",
            daemon=True,
        )
        self._thread.start()

    def finish(self) -> UdpProbe:
        self._thread.join()
        return self._client.udp_finish(self._result.get("train"))


# ------------------------------------------------------------------------------------ the arithmetic


def bdp_bytes(bits_per_s: float, rtt_s: float) -> float:
    """Bandwidth-delay product: the bytes in flight that keep a link of this rate and RTT full."""
    return bits_per_s * rtt_s / 8


def chunk_bytes(bdp: float) -> int:
    """What to ask for per request: at least 2x the BDP (rounded up to a power of two, 64 KiB at least),
    so a stream moves data for most of each request rather than idling one RTT between requests."""
    return max(64 * 1024, 1 << math.ceil(math.log2(max(1.0, 2 * bdp))))


def streams_needed(rates: dict[int, float], enough: float = ENOUGH) -> int:
    """The smallest stream count whose throughput is within (1 - enough) of the best count's."""
    best = max(rates.values())
    return min(n for n, rate in rates.items() if rate >= enough * best)


def window_ceiling_bits_per_s(sender_wmem_max: int | None, receiver_rmem_max: int | None, rtt_s: float) -> float | None:
    """The most one stream can carry when its window is capped by the socket buffer ceilings: the smaller
    of the sender's tcp_wmem and the receiver's tcp_rmem max, times the payload share, per RTT."""
    limits = [b for b in (sender_wmem_max, receiver_rmem_max) if b]
    if not limits or rtt_s <= 0:
        return None
    return min(limits) * PAYLOAD_SHARE * 8 / rtt_s


def advise(
    rates: dict[int, float],
    one_stream: Throughput | None,
    rtt_s: float,
    sender_tcp: dict[str, Any],
    receiver_tcp: dict[str, Any],
) -> tuple[dict[str, Any], list[str]]:
    """How many streams fill the link, the chunk size, and what holds a single stream back."""
    best_streams = max(rates, key=lambda n: rates[n])
    best = rates[best_streams]
    needed = streams_needed(rates)
    bdp = bdp_bytes(best * 1e6, rtt_s)
    chunk = chunk_bytes(bdp)
    facts: dict[str, Any] = {
        "streams_needed": needed,
        "best_mbit_s": best,
        "best_streams": best_streams,
        "bdp_bytes": bdp,
        "chunk_bytes": chunk,
    }
    lines = [
        f"{needed} stream{'s' if needed > 1 else ''} reach {rates[needed]:.1f} Mbit/s, within {1 - ENOUGH:.0%} "
        f"of the best ({best:.1f} Mbit/s with {best_streams})",
        f"request at least {fmt_bytes(chunk)} per request per stream: 2x the bandwidth-delay product "
        f"({fmt_bytes(bdp)} = {best:.1f} Mbit/s x {rtt_s * 1e3:.0f} ms)",
    ]
    counts = sorted(rates)
    if len(counts) > 1 and best_streams == counts[-1] and rates[counts[-1]] > 1.1 * rates[counts[-2]]:
        lines.append(f"throughput still rose from {counts[-2]} to {counts[-1]} streams: try more (--streams)")
    ceiling = window_ceiling_bits_per_s(
        sender_tcp.get("tcp_wmem_max_bytes"), receiver_tcp.get("tcp_rmem_max_bytes"), rtt_s
    )
    facts["buffer_ceiling_mbit_s"] = ceiling / 1e6 if ceiling else None
    if ceiling is not None and ceiling < best * 1e6:
        lines.append(
            f"socket buffers cap one stream near {ceiling / 1e6:.0f} Mbit/s at this RTT (sender tcp_wmem max "
            f"{fmt_bytes(sender_tcp.get('tcp_wmem_max_bytes'))}, receiver tcp_rmem max "
            f"{fmt_bytes(receiver_tcp.get('tcp_rmem_max_bytes'))}): raise both to at least {fmt_bytes(2 * bdp)}"
        )
    if one_stream is not None:
        stats = one_stream.sender
        for share, what in (
            (stats.sndbuf_limited_share, "the sender's buffer (net.ipv4.tcp_wmem max on the sender)"),
            (stats.rwnd_limited_share, "the receiver's window (net.ipv4.tcp_rmem max on the receiver)"),
        ):
            if share is not None and share > 0.2:
                lines.append(f"one stream was held back by {what} {share:.0%} of its busy time (TCP_INFO)")
        cc = stats.congestion_control or sender_tcp.get("congestion_control")
        available = sender_tcp.get("available_congestion_control") or []
        facts["congestion_control"] = cc
        if cc in ("cubic", "reno") and rates.get(1, best) < 0.5 * best:
            hint = (
                "switch the sender to BBR (sysctl -w net.ipv4.tcp_congestion_control=bbr)"
                if "bbr" in available
                else "use parallel streams (BBR, which would not back off, is not available on the sender)"
            )
            lines.append(
                f"one {cc} stream gets {rates.get(1, 0) / best:.0%} of the best: loss-based congestion control "
                f"cuts its window on every loss (CUBIC to 70%, Reno to half), slow to win back at "
                f"{rtt_s * 1e3:.0f} ms; {hint}"
            )
    return facts, lines


# ------------------------------------------------------------------------------------- measurements


def _stream_name(count: int, direction: str) -> str:
    base = "tcp_1_stream" if count == 1 else f"tcp_{count}_streams"
    return base if direction == "up" else base + "_reverse"


def build_measurements(
    rtt_ms: list[float],
    udp: UdpProbe,
    results: list[Throughput],
    local_tcp: dict[str, Any],
    server_tcp: dict[str, Any],
    where: str,
    plan: Plan,
) -> list[Measurement]:
    rtt = Spread.of(rtt_ms)
    out = [_rtt(rtt, rtt_ms, udp, where), _loss(udp, results)]
    for direction in plan.directions:
        mine = [r for r in results if r.direction == direction]
        if not mine:
            continue
        rates = {r.streams: r.mbit_s for r in mine}
        out += [_throughput(r, rates, where) for r in mine]
        if direction == "up":
            sender_tcp, receiver_tcp = local_tcp, server_tcp
        else:
            sender_tcp, receiver_tcp = server_tcp, local_tcp
        out += _what_fills_the_link(direction, mine, rates, rtt, sender_tcp, receiver_tcp)
    return out


def _rtt(rtt: Spread, rtt_ms: list[float], udp: UdpProbe, where: str) -> Measurement:
    return Measurement(
        SUITE,
        "rtt",
        rtt.median,
        "ms",
        f"request/response round trips of a few bytes on an idle TCP connection (TCP_NODELAY), {where}",
        size={"round_trips": len(rtt_ms)},
        repeats=len(rtt_ms),
        spread=rtt,
        extra={"udp_rtt_ms_median": statistics.median(udp.rtt_ms) if udp.rtt_ms else None},
    )


def _throughput(r: Throughput, rates: dict[int, float], where: str) -> Measurement:
    """One stream count in one direction, against the best count of that direction (``rates``)."""
    arrow = "client -> server" if r.direction == "up" else "server -> client (as iperf3 -R)"
    intervals = [b / 1e6 for b in r.received.interval_bits_per_s]
    return Measurement(
        SUITE,
        _stream_name(r.streams, r.direction),
        r.mbit_s,
        "Mbit/s",
        f"{r.streams} TCP stream{'s' if r.streams > 1 else ''} {arrow}, {r.sender.congestion_control}: "
        f"bytes the receiver got in {r.duration_s:g} s after a {r.omit_s:g} s warm-up (iperf3 -O); "
        f"p10-p90 over 1 s intervals, {where}",
        size={
            "streams": r.streams,
            "direction": r.direction,
            "duration_s": r.duration_s,
            "omit_s": r.omit_s,
            "block_bytes": BLOCK_BYTES,
        },
        repeats=1,
        spread=Spread.of(intervals) if intervals else None,
        peak=max(rates.values()),
        peak_source=f"best of {', '.join(map(str, sorted(rates)))} streams in this run",
        extra={
            "sender": r.sender.to_dict(),
            "received_bytes": r.received.bytes,
            "window_s": r.received.window_s,
            "interval_mbit_s": intervals,
            "stream_mbit_s": [b * 8 / r.received.window_s / 1e6 for b in r.received.stream_bytes]
            if r.received.window_s > 0
            else [],
        },
    )


def _what_fills_the_link(
    direction: str,
    mine: list[Throughput],
    rates: dict[int, float],
    rtt: Spread,
    sender_tcp: dict[str, Any],
    receiver_tcp: dict[str, Any],
) -> list[Measurement]:
    """The bandwidth-delay product of one direction and the streams it takes to fill it, with the advice."""
    one = next((r for r in mine if r.streams == 1), None)
    facts, advice = advise(rates, one, rtt.median / 1e3, sender_tcp, receiver_tcp)
    suffix = "" if direction == "up" else "_reverse"
    tcp_facts = {"sender": _tcp_summary(sender_tcp), "receiver": _tcp_summary(receiver_tcp)}
    return [
        Measurement(
            SUITE,
            "bdp" + suffix,
            facts["bdp_bytes"] / MiB,
            "MiB",
            f"bandwidth-delay product: best throughput {facts['best_mbit_s']:.1f} Mbit/s x RTT {rtt.median:.1f} ms",
            extra={"bdp_bytes": facts["bdp_bytes"], "tcp": tcp_facts},
        ),
        Measurement(
            SUITE,
            "streams_needed" + suffix,
            facts["streams_needed"],
            "streams",
            f"smallest stream count within {1 - ENOUGH:.0%} of the best; chunks of at least "
            f"{fmt_bytes(facts['chunk_bytes'])} per request (2x BDP)",
            extra=facts | {"advice": advice, "tcp": tcp_facts},
        ),
    ]


def _loss(udp: UdpProbe, results: list[Throughput]) -> Measurement:
    tcp = next((r for r in sorted(results, key=lambda r: r.streams) if r.direction == "up"), None)
    tcp_ratio = tcp.sender.retransmit_ratio if tcp else None
    extra = {
        "probes_sent": udp.sent,
        "probes_at_server": udp.server_received,
        "probes_echoed": udp.echoed,
        "tcp_retransmit_ratio": tcp_ratio,
    }
    loss = udp.loss_per_traversal  # None when no probe was answered
    if loss is not None:
        attempts = udp.sent + udp.server_received
        return Measurement(
            SUITE,
            "loss",
            loss,
            "ratio",
            f"UDP probe train: {udp.sent} datagrams echoed by the server, lost per crossing of the path, both "
            f"directions pooled (resolution 1/{attempts})",
            size={"probes": udp.sent},
            repeats=attempts,
            extra=extra
            | {
                "forward_loss": 1 - udp.server_received / udp.sent if udp.sent else None,
                "return_loss": 1 - udp.echoed / udp.server_received if udp.server_received else None,
            },
        )
    return Measurement(
        SUITE,
        "loss",
        tcp_ratio or 0.0,
        "ratio",
        "UDP probes went unanswered (blocked on the path?): TCP retransmitted / sent segments of the "
        f"{tcp.streams if tcp else '?'}-stream test (TCP_INFO), which also counts drops at full queues",
        extra=extra,
    )


def _tcp_summary(tcp: dict[str, Any]) -> dict[str, Any]:
    keys = ("congestion_control", "available_congestion_control", "tcp_rmem_max_bytes", "tcp_wmem_max_bytes")
    return {k: tcp.get(k) for k in keys}


# ------------------------------------------------------------------- `python -m redline.bench.network`


def main(argv: list[str] | None = None) -> int:
    """The suite without the machine probe, for scripts (the iperf3 comparison) and network namespaces:
    ``--serve`` or ``--connect HOST --streams 1,8 --duration 10 --omit 2 --direction up``; prints JSON."""
    parser = argparse.ArgumentParser(prog="python -m redline.bench.network", description=main.__doc__)
    parser.add_argument("--serve", action="store_true")
    parser.add_argument("--connect")
    parser.add_argument("--port", type=int, default=wire.DEFAULT_PORT)
    parser.add_argument("--streams", default="1,4,8,16")
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--omit", type=float, default=2.0)
    parser.add_argument("--direction", choices=["up", "down", "both"], default="up")
    parser.add_argument("--congestion", help="senders' congestion control per socket, as iperf3 -C")
    parser.add_argument("--throughput-only", action="store_true", help="skip the RTT and loss probes")
    args = parser.parse_args(argv)
    try:
        if args.serve:
            with contextlib.suppress(KeyboardInterrupt):
                serve(args.port)
            return 0
        if not args.connect:
            parser.error("--serve or --connect HOST")
        try:
            counts = sorted({int(s) for s in args.streams.split(",") if s.strip()})
        except ValueError:
            parser.error(f"--streams takes counts like 1,8, not {args.streams!r}")
        directions = ("up", "down") if args.direction == "both" else (args.direction,)
        plan = Plan(counts, directions, args.omit, args.duration, 10, 500, 500, congestion=args.congestion)
        with Client(args.connect, args.port) as client:
            if args.throughput_only:
                rows = [
                    client.throughput(n, d, plan.omit_s, plan.duration_s, plan.congestion)
                    for d in directions
                    for n in counts
                ]
                out: list[dict[str, Any]] = [
                    {"streams": r.streams, "direction": r.direction, "mbit_s": r.mbit_s} | dataclasses.asdict(r)
                    for r in rows
                ]
            else:
                out = [m.to_dict() for m in measure(client, plan, None, local_tcp_settings(), f"to {args.connect}")]
    except BadInput as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    json.dump(out, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
