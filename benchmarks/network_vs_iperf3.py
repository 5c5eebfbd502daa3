"""redline's network bench against iperf3 over an emulated cross-border link, side by side.

    python benchmarks/network_vs_iperf3.py [--rounds 5] [--streams 1,8,16] [--duration 10] [--omit 2]
                                           [--cc cubic,bbr] [--rtt-ms 200] [--loss 0.001] [--rate-mbit 100]

Needs root, iproute2 and iperf3 (Debian package `iperf3`). It builds a link between two network namespaces
(tools/netem: netem where the kernel has it, else TUN devices and a user-space forwarder), runs
`iperf3 -s` and `redline bench network --serve` on one side, and from the other, for each congestion
control, round and stream count, `iperf3 -c -P N -t T -O O -J` and redline's client with the same N, T and
O, alternating which goes first. Printed: the median of the rounds for each tool and redline/iperf3
(target: within 10%). Everything is torn down at the end, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))  # the emulated link (tools/netem)

from netem import EmulatedLink, LinkSpec, unavailable_reason
from netem.compare import compare, start_servers


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--streams", default="1,8,16")
    parser.add_argument("--duration", type=int, default=10, help="measured seconds (iperf3 -t)")
    parser.add_argument("--omit", type=int, default=2, help="warm-up seconds left out (iperf3 -O)")
    parser.add_argument("--cc", default="cubic,bbr", help="congestion controls to compare under")
    parser.add_argument("--rtt-ms", type=float, default=200.0)
    parser.add_argument("--loss", type=float, default=0.001)
    parser.add_argument("--rate-mbit", type=float, default=100.0)
    parser.add_argument("--backend", choices=["auto", "netem", "tun"], default="auto")
    args = parser.parse_args()
    reason = unavailable_reason() or (None if shutil.which("iperf3") else "needs iperf3 (apt-get install iperf3)")
    if reason:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    streams = [int(s) for s in args.streams.split(",")]
    ccs = args.cc.split(",")
    spec = LinkSpec(args.rtt_ms, args.loss, args.rate_mbit)
    with EmulatedLink(spec, backend=args.backend) as link:
        print(
            f"link ({link.backend}): {spec.rtt_ms:g} ms RTT, loss {spec.loss:g} per direction, "
            f"{spec.rate_mbit:g} Mbit/s, queue {spec.effective_queue_bytes} bytes; "
            f"{args.rounds} rounds of -t {args.duration} -O {args.omit}",
            flush=True,
        )
        start_servers(link)
        results = compare(
            link,
            congestion_controls=ccs,
            streams=streams,
            rounds=args.rounds,
            duration_s=args.duration,
            omit_s=args.omit,
            progress=lambda line: print("  " + line, flush=True),
        )
    if link.forwarder_counters:  # what the emulated link did: random losses, tail drops at its queue
        print(f"forwarder: {link.forwarder_counters}")
    print()
    print(f"{'cc':6} {'streams':>7} {'iperf3 Mbit/s':>14} {'redline Mbit/s':>15} {'redline/iperf3':>15}  rounds")
    for (cc, count), runs in results.items():
        peer, ours = statistics.median(runs["iperf3"]), statistics.median(runs["redline"])
        rounds = " ".join(f"{p:.1f}/{o:.1f}" for p, o in zip(runs["iperf3"], runs["redline"], strict=True))
        print(f"{cc:6} {count:>7} {peer:>14.1f} {ours:>15.1f} {ours / peer:>15.2f}  {rounds}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
