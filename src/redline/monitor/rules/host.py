"""Diagnosis rules on the host: input-bound jobs (data loading, CPU, storage) and swapping."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Iterator

from redline.doctor.model import Area, Finding, Severity
from redline.monitor.diagnose import rule
from redline.monitor.sample import HostSample, StepSample
from redline.monitor.window import (
    Window,
    gpus_subject,
    mean_of,
    median_of,
    ranks_subject,
    rounded,
)
from redline.units import fmt_bytes, fmt_duration


@rule("monitor.input_bound", Area.HOST, "The job's GPUs wait for input: data loading or the host sets the pace")
def input_bound(w: Window) -> Iterator[Finding]:
    """Step data, when the window holds enough of it, decides alone: a host at 100% CPU with GPUs half idle
    and no time spent waiting for batches is bound by something else (Python overhead, kernel launches)."""
    steps = [st for st in w.steps if st.time_s > 0]
    if len(steps) >= w.config.min_steps:
        yield from _input_bound_steps(w, steps)
    else:
        yield from _input_bound_host(w)


def _host_context(hosts: Iterable[HostSample]) -> dict[str, float | None]:
    listed = list(hosts)
    return {
        "host_cpu_ratio": rounded(median_of(h.cpu_ratio for h in listed)),
        "host_iowait_ratio": rounded(median_of(h.cpu_iowait_ratio for h in listed)),
        "disk_read_bytes_per_second": median_of(h.disk_read_bytes_per_second for h in listed),
    }


INPUT_FIX_CPU = (
    "Feed the GPUs faster: more DataLoader workers (up to the cores per GPU), pin_memory=True, "
    "persistent_workers=True, prefetch_factor=4; move decoding and augmentation to the GPU (DALI, torchvision "
    "v2 on tensors) or do them once offline."
)
INPUT_FIX_STORAGE = (
    "Read faster: stage the data set on local NVMe instead of network storage, pack small files into shards "
    "(WebDataset, tar, Arrow) and read them sequentially, with more workers to keep more reads in flight."
)


def _input_bound_steps(w: Window, steps: list[StepSample]) -> Iterator[Finding]:
    cfg = w.config
    shares = [st.data_s / st.time_s for st in steps]
    waiting = [s for s in shares if s >= cfg.input_data_share]
    if len(waiting) / len(shares) < cfg.sustained_fraction:
        return
    share = sum(st.data_s for st in steps) / sum(st.time_s for st in steps)
    context = _host_context(w.hosts)
    storage = (context["host_iowait_ratio"] or 0.0) >= cfg.host_iowait_high
    yield Finding(
        Severity.FAIL if statistics.median(shares) >= cfg.input_data_share_fail else Severity.WARN,
        f"Steps wait for data {share:.0%} of the time ({len(waiting)} of {len(steps)} steps wait "
        f"{cfg.input_data_share:.0%} or more)",
        subject=ranks_subject({st.rank for st in steps}),
        cost=f"The GPUs idle while the next batch is prepared: with the input keeping up, steps would run up to "
        f"{1 / max(1 - share, 0.01):.1f}x faster.",
        fix=INPUT_FIX_STORAGE if storage else INPUT_FIX_CPU,
        evidence={
            "data_share": round(share, 3),
            "waiting_steps": len(waiting),
            "steps": len(steps),
            "data_median_s": round(statistics.median(st.data_s for st in steps), 4),
            "step_median_s": round(statistics.median(st.time_s for st in steps), 4),
        }
        | context,
        command="top -H; iostat -x 1",
    )


def _input_bound_host(w: Window) -> Iterator[Finding]:
    cfg = w.config
    job = w.job_gpus(cfg.in_use_utilization)
    if not job:
        return
    judged = 0
    hits: list[tuple[float, HostSample]] = []
    for sample, row in zip(w.samples, w.rows, strict=True):
        host = sample.host
        utilization = mean_of(row[i].utilization_ratio for i in job if i in row)
        if host is None or utilization is None or (host.cpu_ratio is None and host.cpu_iowait_ratio is None):
            continue
        judged += 1
        cpu = host.cpu_ratio is not None and host.cpu_ratio >= cfg.host_cpu_saturated
        io = host.cpu_iowait_ratio is not None and host.cpu_iowait_ratio >= cfg.host_iowait_high
        if utilization <= cfg.input_gpu_utilization_max and (cpu or io):
            hits.append((utilization, host))
    if not w.sustained(judged) or len(hits) / judged < cfg.sustained_fraction:
        return
    busy = statistics.median(u for u, _ in hits)
    context = _host_context(h for _, h in hits)
    cpu_ratio, iowait = context["host_cpu_ratio"], context["host_iowait_ratio"]
    storage = iowait is not None and iowait >= cfg.host_iowait_high and not (cpu_ratio or 0) >= cfg.host_cpu_saturated
    waits_on = f"waits on storage (iowait {iowait:.0%})" if storage else f"CPU runs at {cpu_ratio or 0:.0%}"
    yield Finding(
        Severity.WARN,
        f"{gpus_subject(job)} busy only {busy:.0%} while the host {waits_on}, for {len(hits) / judged:.0%} of "
        f"{fmt_duration(w.seconds(judged))}",
        subject=gpus_subject(job),
        cost=(
            f"Reading the data set sets the pace, not the GPUs: they run kernels only {busy:.0%} of the time."
            if storage
            else f"The GPUs run kernels only {busy:.0%} of the time while the host's CPUs are saturated: the input "
            "pipeline (decoding, augmentation, collation) or other host work (Python overhead, kernel launches) "
            "sets the pace."
        ),
        fix=INPUT_FIX_STORAGE
        if storage
        else INPUT_FIX_CPU + " Per-step metrics (redline.prepare) tell input waits from host overhead.",
        evidence={"gpu_utilization_median": round(busy, 3), "judged_samples": judged, "bound_samples": len(hits)}
        | context,
        command="top -H; iostat -x 1; nvidia-smi dmon -s u -d 1",
    )


@rule("monitor.host_swapping", Area.HOST, "The host swaps pages to and from disk for a sustained time")
def host_swapping(w: Window) -> Iterator[Finding]:
    cfg = w.config
    rates = [
        (h.swap_in_bytes_per_second or 0.0, h.swap_out_bytes_per_second or 0.0, h)
        for h in w.hosts
        if h.swap_in_bytes_per_second is not None or h.swap_out_bytes_per_second is not None
    ]
    if not w.sustained(len(rates)):
        return
    hits = [r for r in rates if r[0] + r[1] >= cfg.swap_bytes_per_second]
    if len(hits) / len(rates) < cfg.swap_fraction:
        return
    swap_in = statistics.median(r[0] for r in hits)
    swap_out = statistics.median(r[1] for r in hits)
    memory = median_of(
        h.memory_used_bytes / h.memory_total_bytes
        for _, _, h in hits
        if h.memory_used_bytes is not None and h.memory_total_bytes
    )
    yield Finding(
        Severity.WARN,
        f"Host swapping {fmt_bytes(swap_in + swap_out)}/s (in {fmt_bytes(swap_in)}/s, out {fmt_bytes(swap_out)}/s) "
        f"for {len(hits) / len(rates):.0%} of {fmt_duration(w.seconds(len(rates)))}"
        + (f", memory {memory:.0%} used" if memory is not None else ""),
        subject="host",
        cost="Pages of the training processes and DataLoader workers go to disk and back: each swap-in stalls "
        "whoever touches the page (milliseconds to seconds), so steps slow down and jitter; the OOM killer may "
        "follow.",
        fix="Use less host memory: fewer DataLoader workers or a smaller prefetch_factor, a memory-mapped data set "
        "instead of a copy in every worker, fewer pinned buffers; or a host with more RAM.",
        evidence={
            "swap_in_bytes_per_second": swap_in,
            "swap_out_bytes_per_second": swap_out,
            "swapping_fraction": round(len(hits) / len(rates), 3),
            "memory_used_ratio": rounded(memory),
            "swap_used_bytes": median_of(h.swap_used_bytes for _, _, h in hits),
        },
        command="vmstat 1  # si/so columns",
    )
