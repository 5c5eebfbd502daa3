"""redline's network bench and iperf3 side by side on one emulated link (benchmarks/network_vs_iperf3.py and
its short test): both servers on side a, both clients on side b, the same stream counts, warm-up and
duration, alternating which tool goes first each round so drift in the machine's load hits both alike.

The figure compared is iperf3's ``end.sum_received.bits_per_second`` (receiver-side bytes after the -O
warm-up) against redline's receiver-side rate over the same window.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable

from netem.link import A_ADDR, EmulatedLink

IPERF3_PORT = 5201
REDLINE_PORT = 5211


def start_servers(link: EmulatedLink, timeout_s: float = 15.0) -> None:
    """`iperf3 -s` and `redline bench network --serve` on side a, ready when both ports listen."""
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    link.popen("a", "iperf3", "-s", "-p", str(IPERF3_PORT), **quiet)
    serve = [sys.executable, "-m", "redline.bench.network", "--serve", "--port", str(REDLINE_PORT)]
    link.popen("a", *serve, **quiet)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        listening = link.run("a", "ss", "-Hltn", check=False).stdout
        if f":{IPERF3_PORT} " in listening and f":{REDLINE_PORT} " in listening:
            return
        time.sleep(0.2)
    raise RuntimeError("iperf3 or redline server did not start listening on the emulated link")


def iperf3_mbit_s(link: EmulatedLink, streams: int, duration_s: int, omit_s: int, congestion: str) -> float:
    """``iperf3 -c A -P N -t T -O O -C CC -J`` from side b (iperf3 takes whole seconds)."""
    argv = ["iperf3", "-c", A_ADDR, "-p", str(IPERF3_PORT), "-P", str(streams), "-t", str(duration_s)]
    argv += ["-O", str(omit_s), "-C", congestion, "-J"]
    result = link.run("b", *argv, timeout=duration_s + omit_s + 60, check=False)
    try:
        report = json.loads(result.stdout)
        return report["end"]["sum_received"]["bits_per_second"] / 1e6
    except (json.JSONDecodeError, KeyError) as exc:
        raise RuntimeError(f"iperf3 failed: {result.stdout[-300:]} {result.stderr[-300:]}") from exc


def redline_mbit_s(link: EmulatedLink, streams: int, duration_s: int, omit_s: int, congestion: str) -> float:
    """redline's client (without the machine probe) from side b, throughput only, the same settings."""
    argv = [sys.executable, "-m", "redline.bench.network", "--connect", A_ADDR, "--port", str(REDLINE_PORT)]
    argv += ["--streams", str(streams), "--duration", str(duration_s), "--omit", str(omit_s)]
    argv += ["--congestion", congestion, "--throughput-only"]
    result = link.run("b", *argv, timeout=duration_s + omit_s + 60, check=False)
    try:
        return json.loads(result.stdout)[0]["mbit_s"]
    except (json.JSONDecodeError, KeyError, IndexError) as exc:
        raise RuntimeError(f"redline client failed: {result.stderr[-500:]}") from exc


def compare(
    link: EmulatedLink,
    *,
    congestion_controls: list[str],
    streams: list[int],
    rounds: int,
    duration_s: int,
    omit_s: int,
    progress: Callable[[str], None] = lambda line: None,
) -> dict[tuple[str, int], dict[str, list[float]]]:
    """{(congestion control, streams): {"iperf3": [Mbit/s per round], "redline": [...]}}."""
    results: dict[tuple[str, int], dict[str, list[float]]] = {}
    for cc in congestion_controls:  # per socket (iperf3 -C): a namespace may not default to every one
        for r in range(rounds):
            for count in streams:
                runs = [("iperf3", iperf3_mbit_s), ("redline", redline_mbit_s)]
                for tool, fn in runs if r % 2 == 0 else runs[::-1]:
                    mbit_s = fn(link, count, duration_s, omit_s, cc)
                    results.setdefault((cc, count), {"iperf3": [], "redline": []})[tool].append(mbit_s)
                    progress(f"{cc} {count} streams round {r + 1}: {tool} {mbit_s:.1f} Mbit/s")
    return results
