"""Each backend x batch measured the same way, checked against eager fp32, and the pick among them.

For one backend at one batch size: the cold start (build: export, compile, session; then the first call), peak
memory while it was built and made its first calls (CUDA's allocator peak on a GPU; on the CPU the process's
resident memory above where it started, sampled), then at least ``iters`` timed calls (and ``min_s`` of them),
interleaved with the other backends' in rounds, each call ended by a device sync: latency p50/p99 of those
calls, throughput = batch / p50 latency, and the speed-up over eager = eager's p50 / the backend's at the same
batch. Throughput and speed-up come from the one statistic, so that one backend's samples/s over eager's is its
speed-up: on a shared machine a few calls descheduled for tens of milliseconds move the mean far more than the
median, most of all for a backend whose calls are short (the p99 shows them).

Parity is against the fp32 eager output on the same batch: the largest absolute error, that error over the
reference's largest magnitude (``max_rel``: one figure whatever the output's scale), and for classifiers and
language models the share of rows whose arg-max (top-1) agrees, among the rows where the reference's top two
classes are further apart than the tolerance's error. A backend passes when ``max_rel`` and top-1
agreement are within its precision's tolerance (``TOLERANCES``); one that does not is reported and never picked.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from redline.errors import BadInput, one_line
from redline.infer.backends import REFERENCE, Backend, Build, Runner, cast, cast_input, default_backends, named
from redline.infer.models import Subject

WARMUP_CALLS = 2
ROUNDS = 5  # timed calls are spread over at least this many interleaved rounds


@dataclasses.dataclass(frozen=True)
class Tolerance:
    max_rel: float  # largest error over the reference's largest magnitude
    top1: float  # least share of rows whose arg-max agrees (classifiers, language models)


# fp32 backends reorder sums (fused kernels, other GEMM blockings): ~1e-6 relative; half precisions keep 8
# (bf16) or 11 (fp16) mantissa bits through a deep stack; int8 weights lose more, and per-call activation
# scales move with the batch
TOLERANCES = {
    "fp32": Tolerance(1e-3, 0.99),
    "fp16": Tolerance(2e-2, 0.95),
    "bf16": Tolerance(6e-2, 0.9),
    "int8": Tolerance(0.15, 0.8),
}


@dataclasses.dataclass
class Parity:
    max_abs: float
    max_rel: float
    top1: float | None  # None where the output has no classes to agree on

    def passes(self, tolerance: Tolerance) -> bool:
        return self.max_rel <= tolerance.max_rel and (self.top1 is None or self.top1 >= tolerance.top1)

    def describe(self) -> str:
        top1 = f", top-1 {self.top1:.1%}" if self.top1 is not None else ""
        return f"max abs {self.max_abs:.2e}, rel {self.max_rel:.2e}{top1}"


@dataclasses.dataclass
class Row:
    """One backend at one batch size."""

    backend: str
    batch: int
    precision: str
    status: str  # ok | parity (outputs disagree) | failed (build or call raised) | absent (cannot run here)
    note: str = ""
    cold_s: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    samples_per_s: float | None = None
    peak_memory_bytes: int | None = None
    calls: int = 0
    parity: Parity | None = None
    meets_slo: bool | None = None
    files: tuple[Path, ...] = ()  # what the backend wrote (an exported graph), kept for the artifact

    @property
    def usable(self) -> bool:
        return self.status == "ok"


def compare(output: torch.Tensor, reference: torch.Tensor, classes: bool, tolerance: Tolerance | None = None) -> Parity:
    """``output`` against ``reference``. Top-1 agreement counts the rows where the reference decides: its top
    two classes further apart than the error ``tolerance`` allows (random weights make near-ties, which an
    error within the tolerance may flip); every row without a tolerance."""
    y, ref = output.detach().float().cpu(), reference.detach().float().cpu()
    if y.shape != ref.shape:
        return Parity(float("inf"), float("inf"), 0.0 if classes else None)
    error = (y - ref).abs()
    max_abs = float(error.max()) if error.numel() else 0.0
    if not torch.isfinite(y).all():
        max_abs = float("inf")
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    top1 = None
    if classes and ref.dim() >= 2 and ref.shape[-1] >= 2:
        top1 = _top1(y, ref, tolerance.max_rel * scale if tolerance else 0.0)
    return Parity(max_abs, max_abs / scale if scale > 0 else max_abs, top1)


def _top1(y: torch.Tensor, ref: torch.Tensor, margin: float) -> float | None:
    """The share of rows whose arg-max agrees, over the rows whose reference top two differ by over ``margin``;
    None where no row does."""
    ref_rows, y_rows = ref.reshape(-1, ref.shape[-1]), y.reshape(-1, ref.shape[-1])
    top2 = ref_rows.topk(2, dim=-1).values
    decisive = (top2[:, 0] - top2[:, 1]) > margin
    if not decisive.any():
        return None
    agree = y_rows.argmax(-1) == ref_rows.argmax(-1)
    return float(agree[decisive].float().mean())


def latency_stats(seconds: list[float], batch: int) -> tuple[float, float, float]:
    """p50 and p99 in ms, and samples per second at the p50 (the statistic every ratio takes), of the timed
    calls."""
    ordered = sorted(seconds)
    p50 = statistics.median(ordered)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return p50 * 1e3, p99 * 1e3, batch / p50


class PeakMemory:
    """The most memory a backend held while built and run: CUDA's allocator peak, else the process's RSS above
    its level at the start, sampled every few milliseconds by a thread."""

    def __init__(self, device: str, interval_s: float = 0.005) -> None:
        self.device = device
        self.interval_s = interval_s
        self.peak = 0
        self._stop = threading.Event()

    @contextmanager
    def watch(self) -> Iterator[PeakMemory]:
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
            yield self
            torch.cuda.synchronize()
            self.peak = max(0, torch.cuda.max_memory_allocated() - start)
            return
        from redline.hw.host_state import process_rss_bytes

        start = process_rss_bytes()

        def sample() -> None:
            while not self._stop.wait(self.interval_s):
                self.peak = max(self.peak, process_rss_bytes() - start)

        thread = threading.Thread(target=sample, name="redline-infer-memory", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            thread.join()
            self.peak = max(self.peak, process_rss_bytes() - start)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


@dataclasses.dataclass
class Settings:
    batches: tuple[int, ...]
    precision: str = "fp32"
    device: str = "cpu"
    iters: int = 20  # timed calls at least
    min_s: float = 1.0  # and at least this long in all (each backend)
    max_iters: int = 1000
    latency_slo_ms: float | None = None


def measure(
    subject: Subject,
    backends: list[Backend],
    settings: Settings,
    workdir: Path,
    progress: Callable[[str], None] = lambda _: None,
) -> list[Row]:
    """Every backend at every batch size; what could not run is a row saying why.

    Per batch size, every backend is built first (one after another: cold start, peak memory, parity), then
    timed in interleaved rounds, so a neighbour's load on a shared machine falls on all of them alike rather
    than on whichever ran during it. The built backends are all held until their batch's rounds end."""
    rows: list[Row] = []
    classes = subject.kind in ("classifier", "lm")
    runnable: list[tuple[Backend, str]] = []
    for backend in backends:
        precision = backend.fixed_precision or settings.precision
        reason = backend.absent(settings.device, settings.precision)
        if reason is not None:
            rows.extend(Row(backend.name, b, precision, "absent", reason) for b in settings.batches)
        else:
            runnable.append((backend, precision))
    for batch in settings.batches:
        # dynamo's caches from the last batch size go (the exported backends are built anew too): each batch's
        # compile is its own, and the compiled runners of one batch size live together through its rounds
        torch.compiler.reset()
        x = subject.example(batch).to(settings.device)
        reference = eager_reference(subject, x)
        built: list[tuple[Row, Runner, torch.Tensor]] = []
        for backend, precision in runnable:
            progress(f"building {backend.name} at batch {batch}")
            folder = workdir / f"{backend.name}-b{batch}"
            folder.mkdir(parents=True, exist_ok=True)
            row, runner, output = _build(subject, backend, precision, x, folder)
            rows.append(row)
            if runner is None or output is None:
                continue
            row.parity = compare(output, reference, classes, TOLERANCES[precision])
            if not row.parity.passes(TOLERANCES[precision]):
                row.status, row.note = "parity", f"outputs differ from eager fp32: {row.parity.describe()}"
            built.append((row, runner, cast_input(x, precision)))
        progress(f"timing {len(built)} backend(s) at batch {batch}")
        _time(built, settings)
    order = [backend.name for backend in backends]
    return sorted(rows, key=lambda r: (settings.batches.index(r.batch), order.index(r.backend)))


def eager_reference(subject: Subject, x: torch.Tensor) -> torch.Tensor:
    """Eager fp32's output, every backend's yardstick; a model that cannot run this input is the user's to fix."""
    try:
        with torch.inference_mode(), _full_fp32():
            return subject.served.to(x.device)(x).float().cpu()
    except BadInput:
        raise
    except Exception as exc:  # a wrong --input-shape, a model that needs other inputs, out of memory
        shape = "x".join(str(n) for n in x.shape)
        raise BadInput(
            f"{subject.name} does not run on a {shape} input in eager PyTorch: "
            f"{one_line(exc, typed=False, limit_chars=200)}"
        ) from None


@contextmanager
def _full_fp32() -> Iterator[None]:
    """No TF32 for the reference on a GPU (cuDNN's convolutions use it by default): fp32 is the yardstick."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _build(
    subject: Subject, backend: Backend, precision: str, batch: torch.Tensor, folder: Path
) -> tuple[Row, Runner | None, torch.Tensor | None]:
    """The row (cold start, peak memory), the built backend and its first output on ``batch`` (the batch every
    backend gets, on the device); None, None where it failed."""
    device = batch.device.type
    row = Row(backend.name, batch.shape[0], precision, "ok")
    x = cast_input(batch, precision)
    try:
        with PeakMemory(device).watch() as memory:
            start = time.perf_counter()
            module = cast(subject.served, precision, device)
            runner = backend.build(Build(module, subject.served, x, precision, device, folder))
            # a copy: under CUDA graphs (max-autotune on a GPU) the next call overwrites the output's memory
            output = runner(x).clone()
            _sync(device)
            row.cold_s = time.perf_counter() - start
            for _ in range(WARMUP_CALLS):
                runner(x)
            _sync(device)
    except Exception as exc:  # any backend may fail to export or compile a given model: that is a result
        row.status, row.note = "failed", f"{one_line(exc)}"
        return row, None, None
    row.peak_memory_bytes = memory.peak
    row.files = runner.files
    return row, runner, output


def _time(built: list[tuple[Row, Runner, torch.Tensor]], settings: Settings) -> None:
    """Rounds in which each backend makes a few calls in turn, until each has made ``iters`` calls and spent
    ``min_s`` in them; each call ends with a device sync. Fills in the rows' latencies and throughput."""
    if not built:
        return
    per_round = max(1, math.ceil(min(settings.iters, settings.max_iters) / ROUNDS))
    seconds: list[list[float]] = [[] for _ in built]
    while any(
        row.status != "failed"
        and len(calls) < settings.max_iters
        and (len(calls) < settings.iters or sum(calls) < settings.min_s)
        for (row, _, _), calls in zip(built, seconds, strict=True)
    ):
        for (row, runner, x), calls in zip(built, seconds, strict=True):
            if row.status == "failed":
                continue
            try:
                for _ in range(per_round):
                    t0 = time.perf_counter()
                    runner(x)
                    _sync(settings.device)
                    calls.append(time.perf_counter() - t0)
            except Exception as exc:  # out of memory in a later call, a runtime error: this backend is out
                row.status, row.note = "failed", f"while timed: {one_line(exc)}"
    for (row, _, _), calls in zip(built, seconds, strict=True):
        if row.status == "failed" or not calls:
            continue
        row.calls = len(calls)
        row.p50_ms, row.p99_ms, row.samples_per_s = latency_stats(calls, row.batch)
        if settings.latency_slo_ms is not None and row.usable:
            row.meets_slo = row.p99_ms <= settings.latency_slo_ms


def pick(rows: list[Row]) -> Row | None:
    """The most samples per second among rows that pass parity and meet the latency SLO (when one is set)."""
    eligible = [r for r in rows if r.usable and r.meets_slo is not False and r.samples_per_s]
    return max(eligible, key=lambda r: r.samples_per_s or 0.0, default=None)


def speedups(rows: list[Row]) -> dict[tuple[str, int], float]:
    """Each timed row's speed-up over eager: eager's p50 latency at the same batch over the row's (2.0: twice
    as fast; below 1: slower). At one batch it is also the row's samples/s over eager's (``latency_stats``)."""
    eager = {r.batch: r.p50_ms for r in rows if r.backend == REFERENCE and r.p50_ms}
    return {(r.backend, r.batch): eager[r.batch] / r.p50_ms for r in rows if r.p50_ms and eager.get(r.batch)}


def selected(names: list[str] | None, device: str) -> list[Backend]:
    """The backends to measure: ``names`` (or this device's defaults), after the reference when they lack it."""
    backends = named(names or default_backends(device))
    if REFERENCE not in [backend.name for backend in backends]:  # every ratio is taken against it
        backends = [*named([REFERENCE]), *backends]
    return list(dict.fromkeys(backends))


def scratch() -> tempfile.TemporaryDirectory:
    return tempfile.TemporaryDirectory(prefix="redline-infer-")
