"""Time of one matrix product on one device, from its shape: the planner's GEMM efficiency model.

One rate for every matrix cannot be right: a GEMM's rate depends on M, N and K. Three effects set it:

- **Wave quantisation.** cuBLAS splits the M x N output into tiles, one per streaming multiprocessor at a time;
  the tiles run in waves of ``sm_count``, and a last wave that is partly empty takes as long as a full one
  (NVIDIA, "Matrix Multiplication Background User's Guide", sections "Tile quantization" and "Wave
  quantization"). 576 tiles on an A100's 108 SMs take 6 waves, 5.33 waves' work: 89% of the rate.
- **Size.** A small or skinny product does too little arithmetic per byte it moves: its time is at least
  its operands' and result's bytes, ``e (MK + KN + MN)`` at e bytes per element, over the memory bandwidth
  (the roofline; ``runtime_estimator.py`` in torch.distributed._tools applies it per operator). And each tile
  writes its M x N result only after its K loop, while its SM waits: a wave takes its arithmetic plus its
  tiles' output bytes over the SMs' share of the bandwidth, so a short K (an attention core's head dimension,
  a row-parallel projection's K/t) runs further below the peak than a long one. Kernel launches bound a
  product from below too; the step-time model counts them per block (``steptime.KERNELS_PER_BLOCK``).
- **A sustained fraction of the datasheet peak** for large, well-shaped GEMMs (``hardware.MATMUL_EFFICIENCY``,
  or what ``redline bench compute`` measured): the rate of a full wave's arithmetic.

A CPU has no waves to count and no datasheet: its rate by size comes from ``redline bench compute``'s measured
sweep of square products, interpolated at the call's equivalent side (the cube root of its batch x M N K: one
call of a batched product pays its threads' start-up once).
"""

from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass

# cuBLAS's workhorse tile on Ampere and Hopper tensor cores is 128 x 128 or larger (128 x 256, 256 x 128); the
# guide above works its examples with 128-wide tiles. The smaller tile is the one cuBLAS falls back to where a
# larger one would leave a wave emptier, so it sets the quantisation the model counts.
TILE_ROWS = 128
TILE_COLS = 128


@dataclass(frozen=True)
class Gemm:
    """``batch`` independent products of an M x K matrix by a K x N one (a batched matmul over heads: batch > 1).
    ``fused``: the product runs inside a kernel that keeps its result on chip (flash attention's scores), so
    neither its output write nor its operands' memory traffic bounds it: its waves alone do."""

    m: int
    n: int
    k: int
    batch: int = 1
    fused: bool = False

    @property
    def flops(self) -> float:
        """2 M N K per product: one multiply and one add per multiply-accumulate."""
        return 2.0 * self.m * self.n * self.k * self.batch


@dataclass(frozen=True)
class GemmDevice:
    """What sets a GEMM's time on one device in one precision (hashable: GEMM times are cached by it and shape).

    On a GPU, ``sustained_flops`` is the rate of every full wave and ``sm_count`` how many tiles a wave holds.
    On a CPU, ``sweep`` holds measured (square side, FLOP/s) pairs, smallest side first, and the rate of a product
    is read from them; ``sustained_flops`` is the best of them.
    """

    sustained_flops: float
    memory_bytes_per_s: float
    element_bytes: int  # bytes per operand element: 2 in 16-bit, 4 in fp32, 1 in fp8
    sm_count: int | None = None
    sweep: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if not self.sustained_flops > 0 or not self.memory_bytes_per_s > 0:
            raise ValueError("a GEMM device needs positive sustained FLOP/s and memory bandwidth")
        if self.sm_count is not None and self.sm_count < 1:
            raise ValueError(f"sm_count must be at least 1, not {self.sm_count}")
        if any(side < 1 or not rate > 0 for side, rate in self.sweep) or list(self.sweep) != sorted(self.sweep):
            raise ValueError("a GEMM sweep is (side, FLOP/s) pairs, positive, by increasing side")

    def seconds(self, gemm: Gemm) -> float:
        """Seconds of ``gemm`` on this device (cached by shape: a search asks for the same few shapes often)."""
        return _gemm_s(self, gemm.m, gemm.n, gemm.k, gemm.batch, gemm.fused)

    def efficiency(self, gemm: Gemm) -> float:
        """The share of ``sustained_flops`` this product reaches (1.0 for a large, well-shaped one)."""
        return gemm.flops / self.seconds(gemm) / self.sustained_flops


def wave_efficiency(m: int, n: int, batch: int, sm_count: int) -> float:
    """The share of the tile slots of its waves that an M x N output (``batch`` of them) fills: the useful
    M N over the tiles' area, times the tiles over the waves' slots. 1.0 only when both divide evenly."""
    tiles = batch * math.ceil(m / TILE_ROWS) * math.ceil(n / TILE_COLS)
    waves = math.ceil(tiles / sm_count)
    return batch * m * n / (waves * sm_count * TILE_ROWS * TILE_COLS)


def swept_flops(sweep: tuple[tuple[int, float], ...], side: float) -> float:
    """The measured rate at a square side, linear in log(side) between the sweep's points, flat past its ends."""
    sides = [s for s, _ in sweep]
    if side <= sides[0]:
        return sweep[0][1]
    if side >= sides[-1]:
        return sweep[-1][1]
    upper = bisect.bisect_right(sides, side)
    (s0, r0), (s1, r1) = sweep[upper - 1], sweep[upper]
    weight = math.log(side / s0) / math.log(s1 / s0)
    return r0 + weight * (r1 - r0)


@functools.lru_cache(maxsize=65536)
def _gemm_s(device: GemmDevice, m: int, n: int, k: int, batch: int, fused: bool) -> float:
    flops = 2.0 * m * n * k * batch
    if flops <= 0:
        return 0.0
    if device.sweep:  # a CPU: the measured rate at the product's size holds its memory traffic already
        # one call runs the whole batch, its threads splitting the products: the call's work sets the rate
        return flops / swept_flops(device.sweep, (batch * m * n * k) ** (1 / 3))
    compute_s = flops / device.sustained_flops
    if device.sm_count is not None:
        filled = wave_efficiency(m, n, batch, device.sm_count)
        compute_s /= filled
        if fused:
            return compute_s
        # each tile writes its result after its K loop, while its SM waits: the output's bytes of every tile slot
        compute_s += device.element_bytes * batch * m * n / filled / device.memory_bytes_per_s
    elif fused:
        return compute_s
    memory_s = device.element_bytes * (m * k + k * n + m * n) * batch / device.memory_bytes_per_s
    return max(compute_s, memory_s)
