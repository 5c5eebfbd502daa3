"""What `redline monitor` costs the server it watches: CPU per sample and memory over a long run, 8 GPUs.

The issue's budget at a 1 s interval with 8 GPUs: under 1% of one core and under 80 MB RSS, flat over a
long run. A long run is played fast: ``--samples`` samples back to back (3,600 = one hour at 1 s), each
through the real Sampler (the fake NVML of the tests stands in for 8 H100s and changes every tick, as the
``healthy`` trace does; the host is read through psutil for real; the step files of 8 ranks are tailed) and
the real exporter (``update``, and a Prometheus scrape over loopback every ``--scrape-every`` samples), and
optionally the record (``--record``: one SQLite append per sample). CPU time counts only the monitor's work
(the trace's own bookkeeping is left out); ``cpu_at_1s`` is CPU seconds per sample over a 1 s interval,
i.e. the share of one core. RSS is read at 10% of the run (after warm-up) and at the end: the growth is what
a week-long run would keep adding.

Reference, side by side in the same run: a bare Python process that imports the same libraries and does
nothing (its RSS is the floor any Python monitor starts from).

    python benchmarks/monitor_overhead.py [--samples 3600] [--record]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from fakes.traces import scenario
from redline.monitor.exporter import Exporter, serve
from redline.monitor.store import Store

BASELINE = "import psutil, prometheus_client, sqlite3, pynvml, redline.monitor.sampler; print(1)"


def rss_mib() -> float:
    return psutil.Process().memory_info().rss / 2**20


def baseline_rss_mib() -> float:
    """RSS of a Python that imported what the monitor imports, and did nothing."""
    code = BASELINE + "\nimport psutil as p; print(p.Process().memory_info().rss)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return int(out.split()[-1]) / 2**20


def cpu_s() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)  # dmesg, read for Xids every 30 s
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=3600)
    parser.add_argument("--scrape-every", type=int, default=15, help="Prometheus's default interval at 1 s/sample")
    parser.add_argument("--record", action="store_true", help="also append every sample to a record")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        trace = scenario("healthy", root=Path(tmp), ticks=args.samples + 1)
        sampler = trace.sampler()
        exporter = Exporter(driver_version="550.54.15")
        server = serve(exporter, port=0)
        store = Store.open(Path(tmp) / "run.rlm") if args.record else None
        per_sample: list[float] = []
        scrapes: list[float] = []
        rss_early = None
        try:
            for i in range(args.samples):
                trace.advance()  # the fake GPUs' next second: not the monitor's cost
                trace.nvml.calls.clear()  # the fake logs every NVML call for the tests: not the monitor's memory
                start = cpu_s()
                sample = sampler.sample()
                exporter.update(sample)
                if store is not None:
                    store.append(sample)
                if i % args.scrape_every == 0:
                    t0 = time.perf_counter()
                    urllib.request.urlopen(server.url, timeout=10).read()
                    scrapes.append(time.perf_counter() - t0)
                per_sample.append(cpu_s() - start)
                if i == args.samples // 10:
                    rss_early = rss_mib()
            rss_end = rss_mib()
        finally:
            server.shutdown()
            sampler.close()
            if store is not None:
                store.close()

    steady = per_sample[len(per_sample) // 10 :]
    cpu_per_sample = statistics.fmean(steady)
    print(f"samples: {args.samples} (8 GPUs, 8 ranks' step files{', recorded' if args.record else ''})")
    print(f"CPU per sample: mean {1e3 * cpu_per_sample:.2f} ms -> {100 * cpu_per_sample:.2f}% of one core at 1 s")
    print(
        f"RSS: {rss_early:.1f} MiB at 10% of the run, {rss_end:.1f} MiB at the end "
        f"(growth {rss_end - rss_early:+.1f} MiB over {args.samples * 9 // 10} samples)"
    )
    print(f"reference: a bare Python with the same imports: {baseline_rss_mib():.1f} MiB")
    print(f"scrape over loopback: median {1e3 * statistics.median(scrapes):.1f} ms over {len(scrapes)} scrapes")
    print("budget: < 1% of one core, < 80 MiB RSS, flat; scrape < 20 ms")


if __name__ == "__main__":
    main()
