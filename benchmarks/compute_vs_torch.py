"""redline's matmul TFLOP/s against torch.utils.benchmark timing the very same product, side by side.

torch.utils.benchmark.Timer is PyTorch's own timing harness (blocked_autorange: it picks a block size so
timer overhead vanishes, and reports the median over blocks). Both sides multiply the same randn
operands with the same thread count, in alternating rounds so a noisy neighbour hits both alike; the
ratio redline/peer should be ~1.

    python benchmarks/compute_vs_torch.py [--size 1024] [--rounds 5] [--precision fp32]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch
import torch.utils.benchmark as torch_benchmark

from redline.bench.compute import matmul_call, tflops, timed_matmul


def redline_tflops(precision: str, size: int, repeats: int = 30) -> float:
    samples, _ = timed_matmul(precision, size, "cpu", warmup_s=0.2, repeats=repeats)
    return statistics.median(samples)


def peer_tflops(precision: str, size: int, min_run_time_s: float = 0.5) -> float:
    call = matmul_call(precision, size, "cpu")
    # Timer defaults to one thread; give it the threads redline's run has
    timer = torch_benchmark.Timer(stmt="call()", globals={"call": call}, num_threads=torch.get_num_threads())
    return tflops(size, size, size, timer.blocked_autorange(min_run_time=min_run_time_s).median)


def compare(
    precision: str,
    size: int,
    rounds: int,
    *,
    repeats: int = 30,
    min_run_time_s: float = 0.5,
    statistic: Callable[[list[float]], float] = statistics.median,
) -> tuple[float, float, float]:
    """(redline, peer, ratio) over ``rounds`` alternating rounds of similar length: the median round of each
    side, or ``statistic``'s (``max``, the best round, is what a host that other jobs load lets through)."""
    ours, peers = [], []
    for r in range(rounds):
        for side in ("redline", "peer") if r % 2 == 0 else ("peer", "redline"):  # alternate who goes first
            if side == "redline":
                ours.append(redline_tflops(precision, size, repeats))
            else:
                peers.append(peer_tflops(precision, size, min_run_time_s))
    ours_rate, peer_rate = statistic(ours), statistic(peers)
    return ours_rate, peer_rate, ours_rate / peer_rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--precision", choices=["fp32", "bf16"], action="append")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.size}^3 matmul, {args.rounds} rounds")
    for precision in args.precision or ["fp32", "bf16"]:
        ours, peer, ratio = compare(precision, args.size, args.rounds)
        print(f"{precision}: redline {ours:.4f} TFLOP/s  torch.utils.benchmark {peer:.4f} TFLOP/s  ratio {ratio:.3f}")


if __name__ == "__main__":
    main()
