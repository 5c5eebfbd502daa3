"""One process through `redline run` against the same script under torchrun (`--nproc-per-node 1`): the GPT
example, one epoch, rounds alternating, the median step time each run's own summary reports.

    python benchmarks/launch_overhead.py [--rounds 5]

`redline run` starts one process as plain python would (no torchrun agent), sets OMP_NUM_THREADS to the usable
cores unless it is set, and ties the process to its own lifetime; none of that may cost step time.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_gpt.py"
LAUNCHERS = {
    "redline run": [sys.executable, "-m", "redline", "run", str(EXAMPLE), "--epochs", "1"],
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", str(EXAMPLE), "--epochs", "1"],
}
SUMMARY = re.compile(r"median ([\d.]+) (ms|s)/step")


def median_step_s(argv: list[str]) -> float:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "REDLINE_PLAN")}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, check=True)
    value, unit = SUMMARY.findall(done.stderr)[-1]
    return float(value) / (1000 if unit == "ms" else 1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in LAUNCHERS}
    for _ in range(args.rounds):
        for name, argv in LAUNCHERS.items():
            times[name].append(median_step_s(argv))
    reference = statistics.median(times["torchrun"])
    for name, seconds in times.items():
        median = statistics.median(seconds)
        print(
            f"{name:12s} {1000 * median:7.1f} ms/step ({median / reference:.3f} of torchrun)  rounds: "
            + ", ".join(f"{1000 * s:.0f}" for s in seconds)
        )


if __name__ == "__main__":
    main()
