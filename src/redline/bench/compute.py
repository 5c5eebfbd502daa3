"""Matrix-multiply throughput per precision, side by side with the catalog's dense peak.

A GEMM of M x K by K x N does M·N·K multiply-adds, 2·M·N·K floating-point operations, so
TFLOP/s = 2·M·N·K / t / 1e12 (the convention of cuBLAS, MAMF-finder and every MFU calculation).

How it is measured, as the reference tools do (MAMF-finder, nvbandwidth):
- square operands, dims a multiple of 128 so every tensor-core tile is full;
- ``randn`` data, never zeros: predictable bits toggle fewer transistors, draw less power and run faster;
- warm-up for a fixed time first (cuBLAS picks its kernel, lazy loading, clocks ramp up), then each call
  timed with CUDA events on the stream (launches are asynchronous); the value is the median of repeats;
- on a GPU, SM clock, power, temperature and clock-event reasons are sampled during the run and attached,
  so "60% of peak with sw_power_cap set" reads as the power cap it is.

GPU precisions: fp32 with TF32 off (``torch.set_float32_matmul_precision("highest")``), tf32 (the same
fp32 tensors with ``"high"``), fp16, bf16, and fp8 (e4m3 operands through ``torch._scaled_mm``, bf16 out)
on compute capability 8.9+. CPU: fp32 and bf16; a CPU has no catalog peak, so ``peak`` stays None.
"""

from __future__ import annotations

import itertools
import math
import os
import statistics
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from redline import capability
from redline.bench.context import BenchContext
from redline.bench.model import Measurement, Spread
from redline.bench.timing import time_calls
from redline.errors import BadInput, one_line

if TYPE_CHECKING:
    from redline.hw.snapshot import Gpu
    from redline.specs.catalog import GpuSpec

SUITE = "compute"
GPU_PRECISIONS = ("fp32", "tf32", "fp16", "bf16", "fp8")
CPU_PRECISIONS = ("fp32", "bf16")

# square GEMM side. GPU: 8192 keeps every part of an H100/B200 busy (A, B, C are 128-256 MiB each, far
# beyond any L2).
GPU_SIZE = {False: 8192, True: 4096}
# CPU: no fixed side serves every CPU. bf16 runs at fp32's rate or better where the CPU has bf16 matmul
# instructions (AVX512-BF16, AMX, Arm's BF16) and 20-250x slower where oneDNN emulates it: 1536^3 took 0.02 s
# on one 2-core VM and 26 s on another. So the side is sized by a first timed call, to take about
# CPU_CALL_S per call, between CPU_MIN_SIZE and CPU_SIZE (2560 is ~0.15 s in fp32 on 2 cores of a cloud VM).
CPU_SIZE = {False: 2560, True: 1536}
CPU_MIN_SIZE = 256
CPU_CALL_S = {False: 0.25, True: 0.05}
# Other squares timed besides that side, for the rate by size the planner reads for a CPU: a training step's
# products are often small (a micro-batch's tokens by a layer's width), and a CPU runs them well below its best.
# The sweep stops at the first side whose call takes longer than the main side's budget (CPU_CALL_S), so an emulated
# bf16 sweeps its small sides only. Each timed sample repeats the call for at least CPU_SWEEP_SAMPLE_S, above
# perf_counter's and Python's noise.
CPU_SWEEP_SIDES = (64, 128, 256, 512, 1024)
CPU_SWEEP_SAMPLE_S = 0.005
# bf16 below half of fp32's rate: the CPU has no bf16 units and converts to fp32 (oneDNN's reference path)
EMULATED_BELOW = 0.5
# (minimum warm-up seconds, timed repeats)
GPU_TIMING = {False: (1.0, 50), True: (0.3, 20)}
CPU_TIMING = {False: (0.5, 10), True: (0.2, 5)}
MAX_OPERAND_SETS = 3


def tflops(m: int, n: int, k: int, seconds: float) -> float:
    """Throughput of one M x K @ K x N product that took ``seconds``: 2·M·N·K / t / 1e12."""
    return 2 * m * n * k / seconds / 1e12


def require_torch(suite: str) -> None:
    capability.require_torch(f"the {suite} bench")


def check(ctx: BenchContext) -> None:
    """Before any suite runs: the precisions asked for are ones this suite knows."""
    requested = ctx.extra.get("precisions")
    if requested is None:
        return
    if not requested:
        raise BadInput(f"--precision takes a comma-separated list such as fp32,bf16 from {', '.join(GPU_PRECISIONS)}")
    unknown = [p for p in requested if p not in GPU_PRECISIONS]
    if unknown:
        raise BadInput(f"unknown precision {', '.join(map(repr, unknown))}; choose from {', '.join(GPU_PRECISIONS)}")


def run(ctx: BenchContext) -> list[Measurement]:
    check(ctx)
    require_torch(SUITE)
    requested = ctx.extra.get("precisions")
    if ctx.device == "cpu":
        return measure_cpu(ctx, requested)
    return [m for index in cuda_indices(ctx.device) for m in measure_gpu(ctx, index, requested)]


# ------------------------------------------------------------------------------------- precisions


def unsupported_reason(precision: str, device: str, capability: tuple[int, int] | None = None) -> str | None:
    """Why ``precision`` cannot be measured on this device, or None when it can."""
    import torch

    if precision not in GPU_PRECISIONS:
        raise BadInput(f"unknown precision '{precision}'; choose from {', '.join(GPU_PRECISIONS)}")
    if device == "cpu":
        return None if precision in CPU_PRECISIONS else f"{precision} is measured on GPUs only"
    major_minor = capability or (0, 0)
    if precision in ("tf32", "bf16") and major_minor < (8, 0):
        return f"{precision} tensor cores need compute capability 8.0+ (this GPU: {_cc(major_minor)})"
    if precision == "fp8":
        if major_minor < (8, 9):
            return f"fp8 tensor cores need compute capability 8.9+ (this GPU: {_cc(major_minor)})"
        if not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn"):
            return f"this torch ({torch.__version__}) has no torch._scaled_mm / float8_e4m3fn"
    return None


def select_precisions(
    requested: list[str] | None, device: str, capability: tuple[int, int] | None = None
) -> tuple[list[str], dict[str, str]]:
    """The precisions to measure and, for those left out, why.

    With nothing requested every precision the device supports is measured and the others are skipped
    quietly (noted in ``extra``); a precision the user asked for by name that this device lacks is an error.
    """
    default = CPU_PRECISIONS if device == "cpu" else GPU_PRECISIONS
    chosen, skipped = [], {}
    for precision in requested or default:
        reason = unsupported_reason(precision, device, capability)
        if reason is None:
            chosen.append(precision)
        elif requested:
            raise BadInput(f"cannot measure {precision} on {device}: {reason}")
        else:
            skipped[precision] = reason
    return chosen, skipped


def _cc(capability: tuple[int, int]) -> str:
    return f"{capability[0]}.{capability[1]}"


@contextmanager
def fp32_matmul_precision(precision: str) -> Iterator[None]:
    """fp32 matmuls with TF32 off ("highest") or on ("high"), restored afterwards.

    Only ``torch.set_float32_matmul_precision`` is used: since torch 2.9 mixing it with the legacy
    ``torch.backends.cuda.matmul.allow_tf32`` flag makes torch refuse to read the flag back.
    """
    import torch

    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if precision == "tf32" else "highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


# --------------------------------------------------------------------------------------- operands


def matmul_call(precision: str, size: int, device: str, operand_sets: int = 1) -> Callable[[], Any]:
    """A closure that multiplies two ``size`` x ``size`` random matrices in ``precision`` on ``device``.

    With ``operand_sets`` > 1 successive calls rotate among that many independent (A, B) pairs, so
    operands small enough to stay in L2 are re-read from memory as in a real model.
    """
    import torch

    if precision == "fp8":
        return _fp8_call(size, device, operand_sets)
    dtype = {"fp32": torch.float32, "tf32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[precision]
    sets = [
        (torch.randn(size, size, device=device, dtype=dtype), torch.randn(size, size, device=device, dtype=dtype))
        for _ in range(operand_sets)
    ]
    out = torch.empty(size, size, device=device, dtype=dtype)
    pairs = itertools.cycle(sets)

    def call() -> Any:
        a, b = next(pairs)
        return torch.matmul(a, b, out=out)

    return call


def _fp8_call(size: int, device: str, operand_sets: int) -> Callable[[], Any]:
    """fp8 e4m3 GEMM the way training frameworks run it: ``torch._scaled_mm`` with per-tensor scales,
    A row-major and B column-major (cuBLASLt's fp8 layout requirement), bf16 output."""
    import torch

    def operand() -> Any:
        return torch.randn(size, size, device=device).to(torch.float8_e4m3fn)

    sets = [(operand(), operand().t()) for _ in range(operand_sets)]  # .t(): a column-major view
    scale = torch.tensor(1.0, device=device)
    pairs = itertools.cycle(sets)

    def call() -> Any:
        a, b = next(pairs)
        return torch._scaled_mm(a, b, scale_a=scale, scale_b=scale, out_dtype=torch.bfloat16)

    return call


def operand_sets_for(size: int, bytes_per_element: float, l2_bytes: int | None) -> int:
    """How many (A, B) pairs to rotate among: one when A, B and C together overflow twice the L2."""
    set_bytes = 3 * size * size * bytes_per_element
    if not l2_bytes or set_bytes >= 2 * l2_bytes:
        return 1
    return min(MAX_OPERAND_SETS, math.ceil(2 * l2_bytes / set_bytes) + 1)


def _bytes_per_element(precision: str) -> float:
    return {"fp32": 4, "tf32": 4, "fp16": 2, "bf16": 2, "fp8": 1}[precision]


def timed_matmul(
    precision: str, size: int, device: str, *, warmup_s: float, repeats: int, operand_sets: int = 1
) -> tuple[list[float], int]:
    """TFLOP/s of each of ``repeats`` timed calls, after warming up for at least ``warmup_s``.

    Returns the samples and the number of warm-up calls made.
    """
    call = matmul_call(precision, size, device, operand_sets)
    with fp32_matmul_precision(precision):
        # one untimed call (the first is slow: kernel selection, lazy loading), one timed to size the warm-up
        estimate_s = time_calls(call, warmup=1, repeats=1, device=device)[0]
        warmup = max(2, min(1000, math.ceil(warmup_s / max(estimate_s, 1e-6))))
        seconds = time_calls(call, warmup=warmup, repeats=repeats, device=device)
    return [tflops(size, size, size, s) for s in seconds], warmup + 2


# -------------------------------------------------------------------------------------------- CPU


def cpu_size(precision: str, target_s: float, largest: int) -> int:
    """The square side, a multiple of 128 in [CPU_MIN_SIZE, largest], whose matmul takes about ``target_s`` here.

    From the fastest of three calls at the smallest side, scaled by the cube root of the time ratio (the work
    grows as n^3). Small products run below a CPU's best rate, so this errs towards a shorter call.
    """
    call = matmul_call(precision, CPU_MIN_SIZE, "cpu")
    seconds = min(time_calls(call, warmup=1, repeats=3))
    side = CPU_MIN_SIZE * (target_s / max(seconds, 1e-9)) ** (1 / 3)
    return min(largest, max(CPU_MIN_SIZE, round(side) // 128 * 128))


def cpu_sweep(precision: str, main_side: int, repeats: int, call_budget_s: float) -> list[list[float]]:
    """[side, TFLOP/s] of each of CPU_SWEEP_SIDES but ``main_side`` (measured apart), by increasing side, up to the
    first whose call takes longer than ``call_budget_s``: the median of ``repeats`` samples, each as many calls as
    fill CPU_SWEEP_SAMPLE_S."""
    points = []
    for side in (s for s in CPU_SWEEP_SIDES if s != main_side):
        call = matmul_call(precision, side, "cpu")
        once_s = min(time_calls(call, warmup=1, repeats=2))
        if once_s > call_budget_s:
            break
        calls = max(1, math.ceil(CPU_SWEEP_SAMPLE_S / max(once_s, 1e-9)))

        def sample(call: Callable[[], Any] = call, calls: int = calls) -> None:
            for _ in range(calls):
                call()

        seconds = statistics.median(time_calls(sample, warmup=0, repeats=repeats)) / calls
        points.append([side, tflops(side, side, side, seconds)])
    return points


def measure_cpu(ctx: BenchContext, requested: list[str] | None = None, size: int | None = None) -> list[Measurement]:
    import torch

    precisions, skipped = select_precisions(requested, "cpu")
    warmup_s, repeats = CPU_TIMING[ctx.quick]
    out = []
    with ctx.task("compute: matmul on cpu", len(precisions)) as step:
        for precision in precisions:
            side = size or cpu_size(precision, CPU_CALL_S[ctx.quick], CPU_SIZE[ctx.quick])
            samples, warmup = timed_matmul(precision, side, "cpu", warmup_s=warmup_s, repeats=repeats)
            sweep = cpu_sweep(precision, side, repeats, CPU_CALL_S[ctx.quick])
            spread = Spread.of(samples)
            out.append(
                Measurement(
                    suite=SUITE,
                    name=f"matmul_{precision}",
                    value=spread.median,
                    unit="TFLOP/s",
                    method=f"torch.matmul {side}x{side}x{side} randn {precision} (side sized for "
                    f"~{CPU_CALL_S[ctx.quick]:g} s a call), 2*M*N*K/t, median of {repeats} after {warmup} warm-up "
                    f"calls (perf_counter); no catalog peak for CPUs; extra.sweep: the rate at other squares "
                    f"(sides {', '.join(str(int(p[0])) for p in sweep) or 'none'}), median of {repeats} samples",
                    device="cpu",
                    size={"m": side, "n": side, "k": side, "dtype": precision},
                    repeats=repeats,
                    spread=spread,
                    extra={
                        "threads": torch.get_num_threads(),
                        # the SIMD level ATen dispatched to; it does not say whether bf16 has its own units
                        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                        "skipped_precisions": skipped,
                        # [side, TFLOP/s] at other squares, for the planner's rate by size (plan.gemm)
                        "sweep": sweep,
                    },
                )
            )
            step()
    _flag_emulated(out, warmup_s=warmup_s, repeats=repeats)
    return out


def _flag_emulated(measurements: list[Measurement], *, warmup_s: float, repeats: int) -> None:
    """Mark a 16-bit figure far below fp32's on the same CPU: no bf16 units, every product converted to fp32.
    Judged by measurement, not by CPU flags: oneDNN may be capped below what the flags offer
    (ONEDNN_MAX_CPU_ISA, a VM that hides AVX512-BF16).

    Compares the best call of each (a busy machine slows calls down, never speeds them up), so the judgment
    holds on a loaded host where the medians scatter."""
    by_name = {m.name: m for m in measurements}
    for m in measurements:
        if m.size["dtype"] == "fp32" or m.spread is None:
            continue
        fp32 = by_name.get("matmul_fp32")
        if fp32 is not None and fp32.spread is not None:
            reference = fp32.spread.maximum
        else:  # fp32 was not asked for: time it at the same side for the comparison alone
            samples, _ = timed_matmul("fp32", m.size["m"], "cpu", warmup_s=warmup_s, repeats=repeats)
            reference = max(samples)
        ratio = m.spread.maximum / reference
        m.extra["vs_fp32_ratio"] = ratio
        if ratio < EMULATED_BELOW:
            m.extra["emulated"] = True
            m.extra.setdefault("notes", []).append(
                f"{m.size['dtype']} is emulated on this CPU: {ratio:.2g}x the fp32 rate (no bf16 matmul "
                "instructions such as AVX512-BF16 or AMX reach PyTorch here); train in fp32 on it"
            )


# -------------------------------------------------------------------------------------------- GPU


def cuda_indices(device: str) -> list[int]:
    """torch device indices for ``ctx.device``: every visible GPU for "cuda", one for "cuda:N"."""
    import torch

    if not torch.cuda.is_available():
        raise BadInput(f"--device {device}: this torch ({torch.__version__}) cannot use CUDA here")
    count = torch.cuda.device_count()
    if device == "cuda":
        return list(range(count))
    index = int(device.removeprefix("cuda:"))
    if index >= count:
        raise BadInput(f"--device {device}: torch sees {count} GPU(s), cuda:0 to cuda:{count - 1}")
    return [index]


def snapshot_gpu(ctx: BenchContext, index: int) -> Gpu | None:
    """The probe's record of torch device ``index``, matched by PCI address.

    torch numbers GPUs in CUDA's order (fastest first, after CUDA_VISIBLE_DEVICES), NVML in PCI order,
    so the indices agree only by luck; the PCI address always does.
    """
    import torch

    gpus = ctx.snapshot.gpus if ctx.snapshot else []
    props = torch.cuda.get_device_properties(index)
    address = tuple(getattr(props, f, None) for f in ("pci_domain_id", "pci_bus_id", "pci_device_id"))
    if None not in address:
        for gpu in gpus:
            if pci_address(gpu.pci_bus_id) == address:
                return gpu
        return None
    if "CUDA_VISIBLE_DEVICES" not in os.environ and index < len(gpus):
        return gpus[index]
    return None


def pci_address(bus_id: str | None) -> tuple[int, int, int] | None:
    """(domain, bus, device) of an NVML bus id such as "00000000:3B:00.0"."""
    try:
        domain, bus, rest = (bus_id or "").split(":")
        return int(domain, 16), int(bus, 16), int(rest.split(".")[0], 16)
    except ValueError:
        return None


def catalog_spec(ctx: BenchContext, index: int) -> GpuSpec | None:
    import torch

    from redline.specs.catalog import match_gpu

    gpu = snapshot_gpu(ctx, index)
    if gpu is not None:
        return match_gpu(gpu.name, gpu.memory_total_bytes)
    props = torch.cuda.get_device_properties(index)
    return match_gpu(props.name, props.total_memory)


def measure_gpu(ctx: BenchContext, index: int, requested: list[str] | None = None) -> list[Measurement]:
    """Every precision on GPU ``index``, with the GPU's state sampled during the whole run."""
    import torch

    from redline.bench.sampler import GpuSampler

    device = f"cuda:{index}"
    props = torch.cuda.get_device_properties(index)
    capability = (props.major, props.minor)
    precisions, skipped = select_precisions(requested, device, capability)
    spec = catalog_spec(ctx, index)
    gpu = snapshot_gpu(ctx, index)
    size = GPU_SIZE[ctx.quick]
    warmup_s, repeats = GPU_TIMING[ctx.quick]
    l2_bytes = getattr(props, "L2_cache_size", None)
    out = []
    with torch.cuda.device(index), ctx.task(f"compute: matmul on {device}", len(precisions)) as step:
        for precision in precisions:
            sets = operand_sets_for(size, _bytes_per_element(precision), l2_bytes)
            with GpuSampler([gpu.index] if gpu else []) as sampler:
                try:
                    samples, warmup = timed_matmul(
                        precision, size, device, warmup_s=warmup_s, repeats=repeats, operand_sets=sets
                    )
                except torch.cuda.OutOfMemoryError:
                    free_bytes, total_bytes = torch.cuda.mem_get_info(index)
                    raise BadInput(
                        f"{device}: no room for {size}x{size} {precision} operands ({free_bytes / 2**30:.1f} of "
                        f"{total_bytes / 2**30:.1f} GiB free; see nvidia-smi for who holds the rest)"
                    ) from None
                except RuntimeError as exc:  # an fp8 kernel this torch/cuBLAS lacks: skip, say why
                    if precision != "fp8":
                        raise
                    skipped[precision] = one_line(exc, typed=False)
                    step()
                    continue
            spread = Spread.of(samples)
            peak = spec.peak_tflops.get(precision) if spec else None
            out.append(
                Measurement(
                    suite=SUITE,
                    name=f"matmul_{precision}",
                    value=spread.median,
                    unit="TFLOP/s",
                    method=f"{_kernel(precision)} {size}x{size}x{size} randn, 2*M*N*K/t, median of {repeats} "
                    f"CUDA-event-timed calls after {warmup} warm-up calls",
                    device=device,
                    size={"m": size, "n": size, "k": size, "dtype": precision},
                    repeats=repeats,
                    spread=spread,
                    peak=peak,
                    peak_source=f"catalog {spec.key}: dense {precision} ({spec.source})" if spec and peak else None,
                    extra={
                        "gpu_name": props.name,
                        "compute_capability": _cc(capability),
                        "operand_sets": sets,
                        "operand_sets_why": f"A+B+C = {3 * size * size * _bytes_per_element(precision) / 2**20:.0f} "
                        f"MiB vs L2 {(l2_bytes or 0) / 2**20:.0f} MiB: rotate only when they would stay in L2",
                        "gpu_state": sampler.summary(),
                        "skipped_precisions": skipped,
                        **({} if spec else {"catalog": f"no catalog entry for {props.name}"}),
                    },
                )
            )
            step()
    return out


def _kernel(precision: str) -> str:
    return {
        "fp32": "torch.matmul fp32, TF32 off (set_float32_matmul_precision('highest')),",
        "tf32": "torch.matmul fp32 with TF32 on (set_float32_matmul_precision('high')),",
        "fp16": "torch.matmul fp16,",
        "bf16": "torch.matmul bf16,",
        "fp8": "torch._scaled_mm e4m3 x e4m3 -> bf16, per-tensor scale 1,",
    }[precision]
