"""Per-step metrics of a training run: where each optimizer step's time went, throughput, MFU, peak memory.

The runtime wraps the phases of the user's loop (``data_wait``, ``compute`` per micro-batch, ``optimizer``),
adds the exposed communication it measured (``add_comm``) and closes each optimizer step with ``end_step``,
which returns a JSON-ready ``StepRecord``, appends it to a JSON-lines file and, at most every ``interval_s``,
prints one line. ``summary`` compares the steady-state medians with a plan's prediction.

Conventions (each figure in a record is one of these, nothing else):

- ``time_s``: host wall time from the end of the previous step (for the first step: its first phase) to the
  end of this step's work on the device. Steps tile the wall clock, so the sum of ``time_s`` is the time
  spent training, and what the loop does between ``end_step`` and the next phase (logging, a checkpoint
  save) belongs to the next step. The summary's medians are robust to such occasional steps.
- Phases on CUDA are timed with CUDA events recorded on the device's current stream at each phase's
  entry and exit, and read at ``end_step`` after one ``Event.synchronize()`` on an event recorded there:
  one synchronisation per step, none per phase, so measuring does not stop the host from running ahead
  of the device within a step. ``compute_s`` and ``optimizer_s`` are then device time (including any idle
  gap while the host is late to launch). On the CPU every phase is ``time.perf_counter`` wall time.
- ``data_s`` is host wall time spent waiting for the next batch, on every device: on a GPU it can
  overlap device work still queued, so the phases need not add up to ``time_s``; the console shows the
  remainder as "other" when they fall short.
- ``comm_s``: the exposed (not overlapped) communication the runtime measured and reported with
  ``add_comm`` or ``add_comm_span``; None for a step where it reported none. Under DDP it is the time the
  synchronising backward still waited after its last gradient bucket was ready (redline.runtime.prepare
  times it with a comm hook); that span is taken out of ``compute_s``, so data, compute, optimizer and
  comm never overlap.
- ``samples`` and ``tokens`` are GLOBAL per optimizer step: ``end_step(samples=...)`` takes the samples
  this rank processed (micro-batch x accumulation, the same on every data-parallel rank) and multiplies
  by the data-parallel ranks, ``world_size / ranks_per_batch`` (a tensor-parallel group shares one batch);
  ``tokens = samples x tokens_per_sample``, the tokens per sample of the batches (``count_tokens``: they have
  the last word over a plan's, which may be another sequence length's). ``samples_per_s`` and ``tokens_per_s``
  are these over ``time_s``, comparable with a plan's ``samples_per_s``/``tokens_per_s`` (also global).
- MFU (PaLM's model FLOPs utilisation, ``redline.plan.estimate.model_flops_utilization``, as the planner's)::

      mfu = flops_per_sample x samples_per_s / (world_size x peak_flops)

  with ``flops_per_sample`` the model's training FLOPs per sample (3 x forward, recomputation NOT
  counted), ``samples_per_s`` global, and ``peak_flops`` per device: ``mfu_catalog`` divides by the
  datasheet's dense peak, ``mfu_measured`` by the matmul rate ``redline bench`` measured on this machine
  (what its GEMMs can reach, so usually the higher of the two). Every rank computes the same global
  figure from its own step time. Either is None when its peak or the FLOPs are unknown.
- ``peak_memory_bytes``: ``torch.cuda.max_memory_allocated`` over the same window as ``time_s`` (the
  peak statistics are reset when the first step's first phase begins and at the end of every step);
  None on a CPU.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol, TypeVar

import torch

from redline.errors import BadInput
from redline.plan.estimate import model_flops_utilization
from redline.runtime.step_lines import SPLIT_LEGEND, eta_s, format_step, format_summary
from redline.specs.catalog import peak_precisions
from redline.units import fmt_duration

# the first steps compile kernels, pick cuBLAS algorithms and grow the caching allocator: left out of the
# medians when there are enough steps left to judge the rest
WARMUP_STEPS = 2
MIN_STEPS_FOR_WARMUP = 5

# precisions a training step's matmuls run in, as the catalog and `redline bench compute` name them
MATMUL_PRECISIONS = ("fp32", "tf32", "bf16", "fp16", "fp8")


def print_to_stderr(line: str) -> None:
    """The default console: one line to stderr, flushed, so it interleaves sensibly with the user's output."""
    print(line, file=sys.stderr, flush=True)


@dataclass
class StepRecord:
    """One optimizer step, as measured. Units are in the names; see the module docstring for conventions."""

    step: int  # the optimizer step's number in the run: a resumed run continues the count (continue_from)
    time_s: float  # host wall time of the whole step
    data_s: float  # host wall time waiting for batches
    compute_s: float  # forward + backward of every micro-batch (device time on CUDA)
    optimizer_s: float  # unscale, clip, step, zero_grad (device time on CUDA)
    comm_s: float | None  # exposed communication the runtime reported; None if it reported none
    samples: int  # global: per-rank samples x world size
    tokens: int  # global: samples x tokens per sample
    samples_per_s: float  # global
    tokens_per_s: float  # global
    mfu_catalog: float | None  # over the datasheet's dense peak
    mfu_measured: float | None  # over the matmul rate `redline bench` measured here
    peak_memory_bytes: int | None  # torch.cuda.max_memory_allocated over the step; None on a CPU
    loss: float | None
    micro_batch: int  # samples per micro-batch on this rank
    accumulation: int  # micro-batches per optimizer step
    skipped: bool  # the optimizer step was skipped (fp16 GradScaler found inf/nan gradients)
    rank: int
    attempt: int = 0  # 0 for a fresh start, then one more for each resume from the run's checkpoints
    data_workers: int = 0  # DataLoader worker processes of this rank's loader (the runtime may add some per epoch)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ------------------------------------------------------------------------------------------- timers


_Mark = TypeVar("_Mark")


class _Timer(Protocol[_Mark]):
    """Points in a device's stream of work (``mark``) and the seconds between two; each timer reads only the
    marks it made."""

    def mark(self) -> _Mark: ...

    def wait(self, mark: _Mark) -> None: ...

    def seconds(self, start: _Mark, end: _Mark) -> float: ...


class _HostTimer:
    """Wall time between marks: right for a CPU, whose work is done when the call returns."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock

    def mark(self) -> float:
        return self._clock()

    def wait(self, mark: float) -> None:
        pass

    def seconds(self, start: float, end: float) -> float:
        return end - start


class _CudaTimer:
    """Device time between CUDA events; ``wait`` is the one synchronisation of a step."""

    def __init__(self, device: torch.device) -> None:
        self._device = device

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self._device))
        return event

    def wait(self, mark: torch.cuda.Event) -> None:
        mark.synchronize()

    def seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return start.elapsed_time(end) / 1e3  # elapsed_time is in milliseconds


class _NoMemory:
    def reset(self) -> None:
        pass

    def peak(self) -> int | None:
        return None


class _CudaMemory:
    """The caching allocator's own statistics: host-side bookkeeping, so reading them does not synchronise."""

    def __init__(self, device: torch.device) -> None:
        self._device = device

    def reset(self) -> None:
        torch.cuda.reset_peak_memory_stats(self._device)

    def peak(self) -> int | None:
        return int(torch.cuda.max_memory_allocated(self._device))


# -------------------------------------------------------------------------------------------- sinks


class _NoSink:
    def write(self, record: StepRecord) -> None:
        pass

    def close(self) -> None:
        pass


class _JsonLines:
    """One JSON object per line, line-buffered so a crashed run keeps every step it finished.

    Appends: a run resumed from a checkpoint into the same path keeps the lines of the first attempt.
    """

    def __init__(self, path: Path) -> None:
        from redline.files import open_append

        path.parent.mkdir(parents=True, exist_ok=True)
        fd = open_append(path, "metrics_path")  # a FIFO (or a device) in its place would block the rank or eat it
        self._file: IO[str] | None = os.fdopen(fd, "a", encoding="utf-8", buffering=1)

    def write(self, record: StepRecord) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record.to_dict()) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def rank_path(path: str | Path | None, rank: int) -> Path | None:
    """Where this rank writes its JSON lines: rank 0 writes ``path``; other ranks write only when the path
    names them with ``{rank}`` (replaced by the rank, also for rank 0), else nothing."""
    if path is None:
        return None
    text = str(path)
    if "{rank}" in text:
        return Path(text.replace("{rank}", str(rank)))
    return Path(text) if rank == 0 else None


def _discard(line: str) -> None:
    pass


# -------------------------------------------------------------------------------------------- metrics


class StepMetrics:
    """Measure each optimizer step of a training loop; see the module docstring for what each figure means.

    ``device``: where the step runs; CUDA gets event timing and peak memory, anything else host timing.
    ``world_size``, ``rank``: the ranks and this one (figures are global, output is rank 0's).
    ``ranks_per_batch``: ranks that share each batch (a tensor-parallel group): the global batch is
    ``samples x world_size / ranks_per_batch``, and MFU counts every rank.
    ``flops_per_sample``: training FLOPs per sample, 3 x forward (from the plan or a trace); None: no MFU.
    ``tokens_per_sample``: tokens per sample (sequence length for a language model; 1 otherwise), a plan's, with
    ``flops_per_sample`` for that length; None: 1 until the batches say (``count_tokens``).
    ``peak_flops_catalog``, ``peak_flops_measured``: per-device peaks in FLOP/s (see ``peak_flops``).
    ``path``: JSON lines, one per step; rank 0 writes it, other ranks only if it contains ``{rank}``.
    ``interval_s``: print a console line at most this often (the first step always prints).
    ``console``: where lines go (stderr by default; None: nowhere). Only rank 0 prints.
    ``clock``: the host clock in seconds; tests pass a fake one.
    """

    def __init__(
        self,
        *,
        device: torch.device,
        world_size: int = 1,
        rank: int = 0,
        ranks_per_batch: int = 1,
        flops_per_sample: float | None = None,
        tokens_per_sample: int | None = None,
        peak_flops_catalog: float | None = None,
        peak_flops_measured: float | None = None,
        path: str | Path | None = None,
        interval_s: float = 10.0,
        console: Callable[[str], None] | None = print_to_stderr,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, not {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), not {rank}")
        if ranks_per_batch < 1 or world_size % ranks_per_batch:
            raise ValueError(f"ranks_per_batch must divide world_size {world_size}, not {ranks_per_batch}")
        if tokens_per_sample is not None and tokens_per_sample < 1:
            raise ValueError(f"tokens_per_sample must be at least 1, not {tokens_per_sample}")
        if interval_s < 0:
            raise ValueError(f"interval_s must not be negative, not {interval_s}")
        self.device = torch.device(device)
        self.world_size = world_size
        self.rank = rank
        self.ranks_per_batch = ranks_per_batch
        self.flops_per_sample = flops_per_sample
        self.tokens_per_sample = tokens_per_sample or 1
        self.peak_flops_catalog = peak_flops_catalog
        self.peak_flops_measured = peak_flops_measured
        self.interval_s = interval_s
        self.records: list[StepRecord] = []
        self.first_step = 1  # the number the next step of this object gets, if it is the first
        self.attempt = 0
        self.data_workers = 0  # set by the runtime: its loader's workers
        self.total_steps: int | None = None  # set by the runtime where the run's length is known: "N of M", ETA
        # a plan's tokens and FLOPs per sample, which the batches' tokens per sample may overrule (count_tokens)
        self._planned = (tokens_per_sample, flops_per_sample) if tokens_per_sample is not None else None
        self._said_tokens = False  # that the batches' tokens per sample are not the plan's
        self._said_split = False  # the legend of the step's split printed (under the first line)

        self._clock = clock
        cuda = self.device.type == "cuda"
        # its marks are host times or CUDA events: Any, as they reach the caller (``mark``)
        self._timer: _Timer[Any] = _CudaTimer(self.device) if cuda else _HostTimer(clock)
        self._memory: _NoMemory | _CudaMemory = _CudaMemory(self.device) if cuda else _NoMemory()
        self._where = rank_path(path, rank)
        self._sink: _NoSink | _JsonLines = _JsonLines(self._where) if self._where is not None else _NoSink()
        self._console = console if console is not None and rank == 0 else _discard
        self._last_line_at: float | None = None
        self._closed = False

        # the step in progress
        self._created = clock()
        self._step_start: float | None = None  # host clock; set by the first phase, then by each end_step
        self._spans: list[tuple[str, Any, Any]] = []  # (phase, start mark, end mark)
        self._data_s = 0.0
        self._comm_s: float | None = None

    # ------------------------------------------------------------------------------ phases

    def _begin(self) -> None:
        """Start the first step at its first phase; later steps start where the previous one ended."""
        if self._step_start is None:
            self._memory.reset()
            self._step_start = self._clock()

    @contextmanager
    def data_wait(self) -> Iterator[None]:
        """Wrap waiting for the next batch (host wall time, also on a GPU)."""
        self._begin()
        start = self._clock()
        try:
            yield
        finally:
            self._data_s += self._clock() - start

    @contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        self._begin()
        start = self._timer.mark()
        try:
            yield
        finally:
            self._spans.append((name, start, self._timer.mark()))

    def compute(self) -> AbstractContextManager[None]:
        """Wrap the forward and backward of one micro-batch (entered once per micro-batch)."""
        return self._phase("compute")

    def optimizer(self) -> AbstractContextManager[None]:
        """Wrap unscale, clip, optimizer step and zero_grad."""
        return self._phase("optimizer")

    def add_comm(self, seconds: float) -> None:
        """Add exposed communication time the runtime measured for this step, outside any compute phase."""
        self._begin()
        self._comm_s = (self._comm_s or 0.0) + seconds

    def mark(self) -> Any:
        """A point in this device's stream of work (a CUDA event on the current stream, or host time), to
        bound a span given to ``add_comm_span``. Cheap: it does not synchronise."""
        return self._timer.mark()

    def add_comm_span(self, start: Any, end: Any) -> None:
        """Exposed communication between two ``mark()``s taken INSIDE a compute phase (the backward waiting
        for its last gradient all-reduce): read with the step's other spans at ``end_step``, and moved from
        ``compute_s`` to ``comm_s`` so the phases stay disjoint."""
        self._begin()
        self._spans.append(("comm", start, end))

    def count_tokens(self, batch_tokens: int) -> None:
        """The tokens per sample of the batch at hand (its token ids' length; 1: it has none), which the steps'
        tokens and MFU count from then on. Over a plan's count the batches win where they have token ids, and
        the plan's training FLOPs per sample scale with them (the ``6 x params`` FLOPs per token are the bulk;
        attention's, quadratic in the length, scale only roughly): said once, as the plan's predictions are for
        its own length."""
        if batch_tokens == self.tokens_per_sample or (self._planned is not None and batch_tokens == 1):
            return
        if self._planned is not None:
            planned_tokens, planned_flops = self._planned
            if planned_flops is not None:
                self.flops_per_sample = planned_flops * batch_tokens / planned_tokens
            if not self._said_tokens:
                self._said_tokens = True
                self._console(
                    f"redline: the batches hold {batch_tokens} tokens per sample and the plan {planned_tokens}: "
                    f"tokens/s and MFU count the batches', the plan's predictions are for {planned_tokens} "
                    f"(re-plan with --seq-len {batch_tokens})"
                )
        self.tokens_per_sample = batch_tokens

    def continue_from(self, steps_done: int, attempt: int) -> None:
        """A run resumed after ``steps_done`` steps, as its ``attempt``-th resume: records go on counting from
        there, so a metrics file appended to by several attempts reads as one run."""
        self.first_step = steps_done + 1
        self.attempt = attempt

    # ------------------------------------------------------------------------------ steps

    def end_step(
        self,
        *,
        samples: int,
        loss: float | torch.Tensor | None,
        micro_batch: int,
        accumulation: int,
        skipped: bool = False,
        global_samples: int | None = None,
    ) -> StepRecord:
        """Close the optimizer step: wait for its device work (one synchronisation), read the phases,
        write the record and maybe a console line. ``samples`` is what THIS rank processed in the step.
        ``loss`` may be a tensor: it is read after that synchronisation, so passing one costs no extra
        sync (``loss.item()`` in the loop would add one). ``global_samples``: the step's samples over every
        rank where the ranks' batches differ (a batch sampler's, a short last batch); else ``samples`` times
        the ranks that load batches."""
        if samples < 0:
            raise ValueError(f"samples must not be negative, not {samples}")
        end = self._timer.mark()
        self._timer.wait(end)  # the step's one synchronisation point
        now = self._clock()
        # a loop that wraps no phase at all: its first step started when this object was made
        time_s = now - (self._step_start if self._step_start is not None else self._created)

        phase_s = {"compute": 0.0, "optimizer": 0.0, "comm": 0.0}
        for name, start, stop in self._spans:
            phase_s[name] += self._timer.seconds(start, stop)
        comm_s = self._comm_s
        if any(name == "comm" for name, _, _ in self._spans):
            phase_s["compute"] = max(phase_s["compute"] - phase_s["comm"], 0.0)
            comm_s = (comm_s or 0.0) + phase_s["comm"]

        if global_samples is None:
            global_samples = samples * (self.world_size // self.ranks_per_batch)
        samples_per_s = global_samples / time_s if time_s > 0 else 0.0
        record = StepRecord(
            step=self.first_step + len(self.records),
            time_s=time_s,
            data_s=self._data_s,
            compute_s=phase_s["compute"],
            optimizer_s=phase_s["optimizer"],
            comm_s=comm_s,
            samples=global_samples,
            tokens=global_samples * self.tokens_per_sample,
            samples_per_s=samples_per_s,
            tokens_per_s=samples_per_s * self.tokens_per_sample,
            mfu_catalog=model_flops_utilization(
                self.flops_per_sample, samples_per_s, self.world_size, self.peak_flops_catalog
            ),
            mfu_measured=model_flops_utilization(
                self.flops_per_sample, samples_per_s, self.world_size, self.peak_flops_measured
            ),
            peak_memory_bytes=self._memory.peak(),
            loss=None if loss is None else float(loss),
            micro_batch=micro_batch,
            accumulation=accumulation,
            skipped=skipped,
            rank=self.rank,
            attempt=self.attempt,
            data_workers=self.data_workers,
        )
        self.records.append(record)
        self._sink.write(record)
        if self._last_line_at is None or now - self._last_line_at >= self.interval_s:
            self._last_line_at = now
            eta = eta_s(self.records, self.total_steps)
            self._console(format_step(record, self.tokens_per_sample, total_steps=self.total_steps, eta=eta))
            if not self._said_split:
                self._said_split = True
                self._console(SPLIT_LEGEND)

        self._memory.reset()
        self._step_start = now
        self._spans = []
        self._data_s = 0.0
        self._comm_s = None
        return record

    def summary(self, predicted: dict[str, Any] | None = None) -> dict[str, Any]:
        """Medians over the steps after warm-up, totals over all steps, the peak memory of all steps, and
        with ``predicted`` (a plan's ``predicted`` section) each prediction next to its measurement."""
        out = summarize(self.records, self.world_size)
        if predicted is not None:
            out["vs_predicted"] = compare_with_prediction(out, predicted)
            out["why"] = explain(out, predicted)
        return out

    def reopen(self) -> None:
        """Go on after ``close``: the JSON lines appended to the same file, the summary printed again at the
        next ``close`` (over every step since the start). A loop that trains one epoch per call closes and
        reopens at each."""
        if not self._closed:
            return
        self._closed = False
        self._sink = _JsonLines(self._where) if self._where is not None else _NoSink()

    def close(self, predicted: dict[str, Any] | None = None) -> None:
        """Close the JSON-lines file and print the summary line (rank 0). Calling it again does nothing."""
        if self._closed:
            return
        self._closed = True
        self._sink.close()
        if self.records:
            summary = self.summary(predicted)
            self._console(format_summary(summary, self.tokens_per_sample))
            for reason in summary.get("why") or []:
                self._console(f"redline: {reason}")


# ------------------------------------------------------------------------------------------- summary


def warmup_steps(steps: int) -> int:
    """How many leading steps the medians leave out: ``WARMUP_STEPS`` when more than 4 steps ran, else none."""
    return WARMUP_STEPS if steps >= MIN_STEPS_FOR_WARMUP else 0


def _median(values: list[Any]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarize(records: list[StepRecord], world_size: int = 1) -> dict[str, Any]:
    """Steady-state medians (after ``warmup_steps``), totals over every step, and the largest step peak of
    memory over every step (the optimizer states appear in the first step and stay)."""
    warmup = warmup_steps(len(records))
    steady = records[warmup:]
    medians = {
        name: _median([getattr(r, name) for r in steady])
        for name in (
            "time_s",
            "data_s",
            "compute_s",
            "optimizer_s",
            "comm_s",
            "samples_per_s",
            "tokens_per_s",
            "mfu_catalog",
            "mfu_measured",
        )
    }
    comm = [r.comm_s for r in records if r.comm_s is not None]
    memory = [r.peak_memory_bytes for r in records if r.peak_memory_bytes is not None]
    return {
        "steps": len(records),
        "warmup_steps": warmup,
        "skipped_steps": sum(r.skipped for r in records),
        "world_size": world_size,
        "median": medians,
        "total": {
            "time_s": sum(r.time_s for r in records),
            "data_s": sum(r.data_s for r in records),
            "compute_s": sum(r.compute_s for r in records),
            "optimizer_s": sum(r.optimizer_s for r in records),
            "comm_s": sum(comm) if comm else None,
            "samples": sum(r.samples for r in records),
            "tokens": sum(r.tokens for r in records),
        },
        "peak_memory_bytes": max(memory) if memory else None,
    }


def _ratio(measured: float | None, predicted: float | None) -> float | None:
    if measured is None or not predicted:
        return None
    return measured / predicted


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def compare_with_prediction(summary: dict[str, Any], predicted: dict[str, Any]) -> dict[str, Any]:
    """Each prediction of a plan (``Plan.predicted``) with its measurement; ``ratio`` is always measured /
    predicted (above 1: a slower step, a faster throughput, more memory than predicted). A figure the plan
    lacks has ``predicted`` None; one not measured (memory on a CPU) has ``measured`` None."""
    step_time = predicted.get("step_time_s")
    memory = predicted.get("memory_bytes")
    pairs = {
        "step_time_s": (
            summary["median"]["time_s"],
            _number(step_time.get("total") if isinstance(step_time, dict) else step_time),
        ),
        "samples_per_s": (summary["median"]["samples_per_s"], _number(predicted.get("samples_per_s"))),
        "tokens_per_s": (summary["median"]["tokens_per_s"], _number(predicted.get("tokens_per_s"))),
        "peak_memory_bytes": (
            summary["peak_memory_bytes"],
            _number(memory.get("allocated") if isinstance(memory, dict) else memory),
        ),
        # the plan's MFU is over the catalog peak (its ceilings come from bench only for `--hardware local`)
        "mfu": (summary["median"]["mfu_catalog"], _number(predicted.get("mfu"))),
    }
    return {
        name: {"predicted": want, "measured": got, "ratio": _ratio(got, want)} for name, (got, want) in pairs.items()
    }


# a part of the step explains the gap to the plan when it is off by more than this share of the predicted step
EXPLAIN_SHARE = 0.05

# what to look at when a part of the step is slower than planned
_SLOWER = {
    "data": "the plan assumes each batch is ready when the GPU wants it: raise DataLoader num_workers, pin memory, "
    "or move the data off a network filesystem (`redline bench dataloader`, `redline bench storage`)",
    "compute": "the kernels reach less of the ceiling than planned: check clocks and throttling (`redline doctor`), "
    "measure this machine (`redline bench --save`, then re-plan with --hardware local), or compile the model",
    "optimizer": "the optimizer step is slower than planned: use a fused or foreach optimizer (fused=True)",
    "comm": "the gradient communication is not hidden behind the backward: check the links (`redline bench "
    "collective`), raise the DDP bucket size, or compress gradients (comm_hook bf16 or powersgd)",
    "compute+comm": "the kernels or the collectives behind them (not timed apart here) are slower than planned: "
    "check the links (`redline bench collective`), clocks and throttling (`redline doctor`), and re-plan with "
    "--hardware local after `redline bench --save`",
}


def explain(summary: dict[str, Any], predicted: dict[str, Any]) -> list[str]:
    """Why the measured step differs from the plan's: each part of the step (data wait, compute, optimizer,
    exposed communication) whose median is off its prediction by more than ``EXPLAIN_SHARE`` of the predicted
    step, the largest gap first, with what to look at when it is slower. A part not measured (communication
    where the runtime cannot time it) or not predicted is left out; so is everything when the plan has no
    step-time breakdown."""
    step = predicted.get("step_time_s")
    median = summary["median"]
    if not isinstance(step, dict) or not _number(step.get("total")) or median["time_s"] is None:
        return []
    total = float(step["total"])

    def part(*names: str) -> float:
        return sum(_number(step.get(name)) or 0.0 for name in names)

    comm = ("data_parallel_comm", "tensor_parallel_comm", "pipeline_comm")
    pairs = {
        "data": (median["data_s"], 0.0),  # the planner assumes the input pipeline keeps up
        "compute": (median["compute_s"], part("compute", "bubble")),
        "optimizer": (median["optimizer_s"], part("optimizer")),
        "comm": (median["comm_s"], part(*comm)),
    }
    if median["comm_s"] is None:  # not measured (FSDP2): what the collectives left exposed is inside compute_s
        pairs["compute+comm"] = (median["compute_s"], part("compute", "bubble", *comm))
        del pairs["compute"], pairs["comm"]
    gaps = [
        (measured - want, name, measured, want)
        for name, (measured, want) in pairs.items()
        if measured is not None and abs(measured - want) > EXPLAIN_SHARE * total
    ]
    reasons = []
    for gap, name, measured, want in sorted(gaps, key=lambda g: -abs(g[0])):
        where = f"{name} {fmt_duration(measured)}/step against {fmt_duration(want)} planned"
        if gap > 0:
            reasons.append(f"{where} (+{100 * gap / total:.0f}% of the planned step): {_SLOWER[name]}")
        else:
            reasons.append(f"{where} ({100 * gap / total:.0f}% of the planned step): faster than the plan assumed")
    return reasons


# ------------------------------------------------------------------------------------------- peaks


def peak_flops(device: torch.device | str, precision: str) -> tuple[float | None, float | None]:
    """(catalog, measured) peak FLOP/s per device of ``device`` for matmuls in ``precision``.

    The precision is the one MFU is quoted against (``specs.catalog.peak_precisions``, as the planner): fp32 on a
    GPU counts as TF32 when TF32 matmuls are allowed right now (``torch.backends.cuda.matmul.fp32_precision``
    or ``torch.set_float32_matmul_precision``), else plain fp32; fp8 counts against the bf16 peak (fp8
    recipes keep attention and the output layer in bf16; Llama 3 reports its MFU so). Where the device has
    no figure for that precision (fp32 on a V100: no TF32), the requested precision's figure is used.

    Catalog: the datasheet's dense peak of the GPU ``torch.cuda.get_device_name`` names (memory size picks
    the variant); None for a CPU or a GPU not in the catalog.

    Measured: the ``matmul_*`` figure of the newest ``redline bench compute --save`` run of this machine
    (median over the GPUs it measured, or its CPU figure for a CPU device); None when nothing was saved.
    The machine is found by the same fingerprint ``redline bench --save`` files its runs under (hostname,
    CPU model, GPU names and UUIDs), from the host and NVML probes alone (about 0.1 s; a full snapshot
    also probes storage, network and software, seconds), so only runs of this very machine count: a
    hostname alone would also match a container that moved to other GPUs.
    """
    device = torch.device(device)
    if precision not in MATMUL_PRECISIONS:
        raise BadInput(f"unknown precision '{precision}'; known: {', '.join(MATMUL_PRECISIONS)}")
    keys = _peak_keys(device, precision)
    return _catalog_peak(device, keys), _measured_peak(device, keys)


def _peak_keys(device: torch.device, precision: str) -> tuple[str, ...]:
    """The precisions whose peak to use, best first (TF32 for fp32 only where TF32 matmuls run now)."""
    return peak_precisions(precision, tf32=device.type == "cuda" and _tf32_matmuls())


def _tf32_matmuls() -> bool:
    """Whether fp32 matmuls on CUDA may run on TF32 tensor cores. Since torch 2.9 the legacy reader
    ``get_float32_matmul_precision`` raises once the new ``fp32_precision`` API has been used, while the
    new attribute reflects settings made through either API, so it is read first."""
    matmul = getattr(torch.backends.cuda.matmul, "fp32_precision", None)
    if matmul is not None:
        if matmul == "none":  # inherits the global setting
            matmul = getattr(torch.backends, "fp32_precision", "ieee")
        return matmul == "tf32"
    return torch.get_float32_matmul_precision() != "highest"


def _catalog_peak(device: torch.device, keys: tuple[str, ...]) -> float | None:
    if device.type != "cuda":
        return None
    from redline.specs.catalog import match_gpu

    spec = match_gpu(torch.cuda.get_device_name(device), torch.cuda.get_device_properties(device).total_memory)
    if spec is None:
        return None
    return next((peak for key in keys if (peak := spec.peak_flops(key)) is not None), None)


def _measured_peak(device: torch.device, keys: tuple[str, ...]) -> float | None:
    from redline.bench import store

    run = store.latest_here()
    if run is None:
        return None

    def ours(measured_on: str) -> bool:
        return measured_on.startswith("cuda") if device.type == "cuda" else measured_on == device.type

    for key in keys:
        tflops = [
            m.value
            for m in run.measurements
            if m.suite == "compute" and m.name == f"matmul_{key}" and ours(m.device) and math.isfinite(m.value)
        ]
        if tflops:
            return statistics.median(tflops) * 1e12
    return None
