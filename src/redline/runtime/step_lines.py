"""The console lines of a run's step metrics (``metrics.py``): one per step, at most every ``interval_s``, and
the summary at the end.

A step line says where the run is, what the step cost and where its time went, what it trained on, and when
the run will end::

    step 120 of 1,000 (12%) | loss 2.346 | 400 ms/step (data 3%, compute 81%, optimizer 9%, comm 4%, other 3%)
    | 328k tokens/s | MFU 41.2% | peak mem 61.0 GiB | ETA 5.9 min

"of 1,000" and the ETA appear where the run's length is known (epochs of a loader with a length, or
``max_steps``); the ETA is the steps left times the median of the last ``ETA_STEPS`` steps. The split of the
step's time is explained once, under the first line (``SPLIT_LEGEND``): "other" is what none of the measured
phases holds, which a reader cannot guess.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from redline.units import fmt_bytes, fmt_count, fmt_duration

if TYPE_CHECKING:
    from redline.runtime.metrics import StepRecord

# the recent steps whose median time the ETA extrapolates: enough to ride out a step that saved a checkpoint,
# few enough to follow a run that sped up after its warm-up
ETA_STEPS = 20

SPLIT_LEGEND = (
    "redline: each step's time splits into data (waiting for the next batch), compute (forward and backward), "
    "optimizer (its step, clipping, zero_grad), comm (communication left exposed) and other: the rest of the "
    "step, outside those phases (the loop's own code between them, yours and redline's: splitting the batch, "
    "moving it to the device, bookkeeping; logging; checkpoint saves; on a GPU, the device idle between them)"
)


def eta_s(records: Sequence[StepRecord], total_steps: int | None) -> float | None:
    """Seconds until step ``total_steps``: the steps left times the median time of the last ``ETA_STEPS``
    steps; None when the run's length is not known or no step has run."""
    if total_steps is None or not records:
        return None
    left = max(total_steps - records[-1].step, 0)
    return left * statistics.median(r.time_s for r in records[-ETA_STEPS:])


def _percent(part: float | None, whole: float) -> str:
    return "n/a" if part is None or whole <= 0 else f"{100 * part / whole:.0f}%"


def _throughput(samples_per_s: float | None, tokens_per_s: float | None, tokens_per_sample: int) -> str:
    if tokens_per_sample > 1:
        return "n/a tokens/s" if tokens_per_s is None else f"{fmt_count(tokens_per_s)} tokens/s"
    return "n/a samples/s" if samples_per_s is None else f"{fmt_count(samples_per_s)} samples/s"


def _mfu(catalog: float | None, measured: float | None) -> str | None:
    """Utilisation as a share of a peak; above 100% it cannot be: the peak is wrong (a bench run on other
    hardware, a CPU figure under a GPU run) or the FLOPs per sample are, and the line says so instead."""
    parts = []
    for label, value in (("MFU", catalog), ("of measured peak", measured)):
        if value is None:
            continue
        text = f"{100 * value:.1f}%" if value <= 1.0 else f"{100 * value:.0f}% (over 100%: a wrong peak or FLOP count)"
        parts.append(f"MFU {text}" if label == "MFU" else f"{text} {label}")
    return ", ".join(parts) or None


def _where(step: int, total_steps: int | None) -> str:
    """'step 120', or 'step 120 of 1,000 (12%)' where the run's length is known."""
    if not total_steps:
        return f"step {step}"
    return f"step {step} of {total_steps:,} ({100 * step / total_steps:.0f}%)"


def format_step(
    record: StepRecord, tokens_per_sample: int = 1, *, total_steps: int | None = None, eta: float | None = None
) -> str:
    """One console line: 'step 120 of 1,000 (12%) | loss 2.346 | 412 ms/step (data 3%, compute 81%, optimizer
    9%, comm 4%, other 3%) | 12.3k tokens/s | MFU 41.2%, 52.0% of measured peak | peak mem 61.2 GiB | ETA 5.9
    min'; ``total_steps`` and ``eta`` (seconds) where the run's length is known."""
    t = record.time_s
    accounted = record.data_s + record.compute_s + record.optimizer_s + (record.comm_s or 0.0)
    split = [
        f"data {_percent(record.data_s, t)}",
        f"compute {_percent(record.compute_s, t)}",
        f"optimizer {_percent(record.optimizer_s, t)}",
    ]
    if record.comm_s is not None:
        split.append(f"comm {_percent(record.comm_s, t)}")
    split.append(f"other {_percent(max(t - accounted, 0.0), t)}")
    loss = "n/a" if record.loss is None else f"{record.loss:.4g}"
    parts = [
        _where(record.step, total_steps) + (" (skipped)" if record.skipped else ""),
        f"loss {loss}",
        f"{fmt_duration(t)}/step ({', '.join(split)})",
        _throughput(record.samples_per_s, record.tokens_per_s, tokens_per_sample),
    ]
    if (mfu := _mfu(record.mfu_catalog, record.mfu_measured)) is not None:
        parts.append(mfu)
    if record.peak_memory_bytes is not None:
        parts.append(f"peak mem {fmt_bytes(record.peak_memory_bytes)}")
    if eta is not None:
        parts.append(f"ETA {fmt_duration(eta)}")
    return " | ".join(parts)


def format_summary(summary: dict[str, Any], tokens_per_sample: int = 1) -> str:
    """The closing line: steady-state medians, and the ratios to the plan when there was one."""
    median = summary["median"]
    warmup = f" ({summary['warmup_steps']} warm-up)" if summary["warmup_steps"] else ""
    step = "n/a" if median["time_s"] is None else fmt_duration(median["time_s"])
    parts = [
        f"redline: {summary['steps']} steps{warmup}, median {step}/step",
        _throughput(median["samples_per_s"], median["tokens_per_s"], tokens_per_sample),
    ]
    if (mfu := _mfu(median["mfu_catalog"], median["mfu_measured"])) is not None:
        parts.append(mfu)
    if summary["peak_memory_bytes"] is not None:
        parts.append(f"peak mem {fmt_bytes(summary['peak_memory_bytes'])}")
    if summary["skipped_steps"]:
        parts.append(f"{summary['skipped_steps']} skipped")
    line = ", ".join(parts)
    versus = summary.get("vs_predicted")
    if versus:
        ratios = [f"{name} {v['ratio']:.3g}x" for name, v in versus.items() if v["ratio"] is not None]
        if ratios:
            line += "; measured/predicted: " + ", ".join(ratios)
    return line
