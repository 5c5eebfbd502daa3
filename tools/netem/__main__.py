"""``PYTHONPATH=tools python -m netem``: hold an emulated link open until Ctrl-C, and say how to use it."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading

from netem.link import EmulatedLink, LinkSpec, LinkUnavailable


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="PYTHONPATH=tools python -m netem", description=__doc__)
    parser.add_argument("--rtt-ms", type=float, default=200.0)
    parser.add_argument("--loss", type=float, default=0.001, help="random loss probability per direction")
    parser.add_argument("--rate-mbit", type=float, default=100.0, help="rate cap per direction (0: none)")
    parser.add_argument("--queue-bytes", type=int, default=None, help="tail-drop queue (default: one BDP)")
    parser.add_argument("--backend", choices=["auto", "netem", "tun"], default="auto")
    allowed = "one listed in net.ipv4.tcp_allowed_congestion_control"
    parser.add_argument("--congestion-control", help=f"default TCP congestion control in both namespaces ({allowed})")
    args = parser.parse_args(argv)
    spec = LinkSpec(args.rtt_ms, args.loss, args.rate_mbit or None, args.queue_bytes)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    try:
        with EmulatedLink(spec, backend=args.backend) as link:
            if args.congestion_control:
                link.set_congestion_control(args.congestion_control)
            a, b = link.namespaces["a"], link.namespaces["b"]
            print(f"link up ({link.backend}): {spec.rtt_ms:g} ms RTT, loss {spec.loss:g}, "
                  f"{spec.rate_mbit or 'no'} Mbit/s cap, queue {spec.effective_queue_bytes} bytes")  # fmt: skip
            print(f"  side a: ip netns exec {a} ...   ({link.address['a']})")
            print(f"  side b: ip netns exec {b} ...   ({link.address['b']})")
            print(f"  e.g.  ip netns exec {a} iperf3 -s  and  ip netns exec {b} iperf3 -c {link.address['a']}")
            print("Ctrl-C to tear it down", flush=True)
            with contextlib.suppress(KeyboardInterrupt):
                done.wait()
        if link.forwarder_counters:
            print(f"forwarder: {link.forwarder_counters}")
    except LinkUnavailable as exc:
        print(f"error: cannot build the link: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
