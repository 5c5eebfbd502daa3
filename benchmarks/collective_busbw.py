"""redline's collective busbw against nccl-tests on the same GPUs, side by side (GPU machines only).

nccl-tests (github.com/NVIDIA/nccl-tests) is what people quote busbw from. This runs each of its
`*_perf` binaries (found on PATH or in --nccl-tests DIR) over all local GPUs in one process (-g N) and
redline's NCCL sweep with the same sizes, warm-up and iterations, in alternating rounds, and compares
out-of-place busbw at the largest size; the ratio redline/nccl-tests should be ~1 (target: within 10%).
torch's collectives go through the same NCCL, so a gap is launch or timing overhead, not the network.
There is no such peer for gloo on the CPU, so on a machine without 2 GPUs and nccl-tests this only says so.

    python benchmarks/collective_busbw.py [--max-bytes 1G] [--rounds 3] [--nccl-tests DIR]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
from pathlib import Path

from redline.bench.collective import OPS, GiB, Plan, measurements, run_local, sweep_sizes

PEER_BINARY = {
    "all_reduce": "all_reduce_perf",
    "all_gather": "all_gather_perf",
    "reduce_scatter": "reduce_scatter_perf",
    "broadcast": "broadcast_perf",
    "all_to_all": "alltoall_perf",
}
WARMUP, ITERS = 5, 20


def peer_busbw(binary: str, gpus: int, max_bytes: int) -> dict[int, float]:
    """nccl-tests' out-of-place busbw per size: columns size count type redop root time algbw busbw #wrong."""
    cmd = [binary, "-b", "8", "-e", str(max_bytes), "-f", "2", "-g", str(gpus), "-w", str(WARMUP)]
    cmd += ["-n", str(ITERS), "-d", "float", "-o", "sum", "-c", "1"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600).stdout
    busbw = {}
    for line in out.splitlines():
        cols = line.split()
        if len(cols) >= 9 and cols[0].isdigit():
            busbw[int(cols[0])] = float(cols[7])
    return busbw


def redline_busbw(op: str, gpus: int, max_bytes: int) -> dict[int, float]:
    plan = Plan(
        backend="nccl",
        device="cuda",
        ops=[op],
        sizes_bytes=sweep_sizes(8, max_bytes),
        warmup=WARMUP,
        iters=ITERS,
        timeout_s=900,
    )
    (m,) = measurements(run_local(plan, gpus), plan)
    return {row["size_bytes"]: row["busbw_gbps"] for row in m.extra["rows"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-bytes", type=int, default=1 * GiB)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--nccl-tests", type=Path, help="directory holding the *_perf binaries")
    args = parser.parse_args()

    import torch

    gpus = torch.cuda.device_count()
    if gpus < 2:
        print(f"skipped: needs 2 GPUs (one NCCL rank each), torch sees {gpus}")
        return
    print(f"{gpus} GPUs, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, float32, -b 8 -e {args.max_bytes}")
    for op in OPS:
        name = PEER_BINARY[op]
        binary = str(args.nccl_tests / name) if args.nccl_tests else shutil.which(name)
        if not binary or not Path(binary).exists():
            print(f"{op}: {name} not found (build nccl-tests, pass --nccl-tests DIR)")
            continue
        ours, peers = [], []
        for _ in range(args.rounds):
            ours.append(redline_busbw(op, gpus, args.max_bytes))
            peers.append(peer_busbw(binary, gpus, args.max_bytes))
        size = max(ours[0])
        ours_median = statistics.median(r[size] for r in ours)
        peer_median = statistics.median(p[size] for p in peers)
        print(
            f"{op}: busbw at {size} B redline {ours_median:.2f} GB/s  nccl-tests {peer_median:.2f} GB/s  "
            f"ratio {ours_median / peer_median:.3f}"
        )


if __name__ == "__main__":
    main()
