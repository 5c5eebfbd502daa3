"""Diagnosis rules on GPU memory: nearly full, held by processes outside the job, held on idle GPUs."""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from redline.doctor.model import Area, Finding, Severity
from redline.monitor.diagnose import rule
from redline.monitor.sample import GpuSample
from redline.monitor.window import (
    Window,
    gpus_subject,
    median_of,
    title_figures,
)
from redline.units import fmt_bytes, fmt_duration


def _used_ratio(g: GpuSample) -> float | None:
    if g.memory_used_bytes is None or not g.memory_total_bytes:
        return None
    return g.memory_used_bytes / g.memory_total_bytes


@rule("monitor.memory_near_full", Area.GPU_MEMORY, "GPU memory nearly full for most of the window")
def memory_near_full(w: Window) -> Iterator[Finding]:
    cfg = w.config
    full: dict[int, tuple[float, list[GpuSample], float]] = {}  # index -> (fraction, full samples, seconds)
    for index, series in w.gpus.items():
        judged = [g for g in series if _used_ratio(g) is not None]
        if not w.sustained(len(judged)):
            continue
        hits = [g for g in judged if (_used_ratio(g) or 0.0) >= cfg.memory_full_ratio]
        if len(hits) / len(judged) >= cfg.sustained_fraction:
            full[index] = (len(hits) / len(judged), hits, w.seconds(len(judged)))
    if not full:
        return
    indices = sorted(full)
    worst = max(indices, key=lambda i: max(_used_ratio(g) or 0.0 for g in full[i][1]))
    fraction, hits, seconds = full[worst]
    peak = max(hits, key=lambda g: _used_ratio(g) or 0.0)
    yield Finding(
        Severity.WARN,
        f"{gpus_subject(indices)} memory"
        + ("" if len(indices) == 1 else " nearly full")
        + title_figures(
            indices,
            worst,
            f"{_used_ratio(peak):.0%} full for {fraction:.0%} of {fmt_duration(seconds)}, up to "
            f"{fmt_bytes(peak.memory_used_bytes)} of {fmt_bytes(peak.memory_total_bytes)}",
            lead="",
        ),
        subject=gpus_subject(indices),
        cost="No headroom: a longer sequence, a larger evaluation batch or fragmentation ends in CUDA out-of-memory, "
        "and near the limit PyTorch's caching allocator frees its cache and retries (synchronising the GPU), "
        "which slows steps before anything fails.",
        fix="Leave ~10% free: a smaller micro-batch with more accumulation, activation checkpointing, or sharded "
        "optimizer state (ZeRO/FSDP); PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True reduces fragmentation. "
        "JAX preallocates on purpose (XLA_PYTHON_CLIENT_MEM_FRACTION). If another process holds the memory, "
        "see monitor.foreign_process.",
        evidence={
            i: {
                "full_fraction": round(f, 3),
                "used_ratio_max": round(max(_used_ratio(g) or 0.0 for g in h), 4),
                "used_bytes_max": max(g.memory_used_bytes or 0 for g in h),
                "total_bytes": h[0].memory_total_bytes,
            }
            for i, (f, h, _) in sorted(full.items())
        },
        command="nvidia-smi --query-gpu=index,memory.used,memory.total --format=csv -l 1",
    )


@dataclass(frozen=True)
class _Holder:
    """A process that held GPU memory for most of the window."""

    gpu: int
    pid: int
    name: str | None
    user: str | None
    held_bytes: int

    def label(self) -> str:
        return f"{self.name or '?'}[{self.pid}]"

    def to_dict(self) -> dict[str, Any]:
        return {"gpu": self.gpu, "pid": self.pid, "name": self.name, "user": self.user, "bytes": self.held_bytes}


def _holders(w: Window, index: int) -> list[_Holder]:
    """Processes present in a sustained share of this GPU's samples, holding ``holder_bytes`` or more (median
    over the samples that list them). A process whose memory NVML cannot report is left out: no evidence."""
    series = w.gpus.get(index, [])
    if not w.sustained(len(series)):
        return []
    sizes: dict[int, list[int]] = {}
    present: Counter[int] = Counter()
    names: dict[int, str | None] = {}
    users: dict[int, str | None] = {}
    for g in series:
        for p in g.processes:
            present[p.pid] += 1
            names[p.pid] = p.name or names.get(p.pid)  # /proc may stop answering for a pid: keep what it said
            users[p.pid] = p.user or users.get(p.pid)
            if p.used_memory_bytes is not None:
                sizes.setdefault(p.pid, []).append(p.used_memory_bytes)
    out = []
    for pid, held in sizes.items():
        median = int(statistics.median(held))
        if present[pid] >= w.config.sustained_fraction * len(series) and median >= w.config.holder_bytes:
            out.append(_Holder(index, pid, names[pid], users[pid], median))
    return sorted(out, key=lambda h: -h.held_bytes)


def _holders_title(holders: list[_Holder], where: str) -> str:
    total = sum(h.held_bytes for h in holders)
    names = ", ".join(h.label() for h in holders[:4]) + (", ..." if len(holders) > 4 else "")
    return f"{len(holders)} process(es) {where}, holding {fmt_bytes(total)}: {names}"


def _apps_command(indices: Iterable[int]) -> str:
    gpus = ",".join(map(str, sorted(indices)))
    return f"nvidia-smi -i {gpus} --query-compute-apps=pid,process_name,used_memory --format=csv"


@rule("monitor.foreign_process", Area.GPU_MEMORY, "Processes outside the job hold GPU memory")
def foreign_process(w: Window) -> Iterator[Finding]:
    """Only when ``job_pids`` is given and at least one of them shows up on a GPU: otherwise every process,
    the job's own included, would look foreign."""
    job = w.pid_gpus
    if not w.job_pids or not job:
        return
    foreign = [h for i in w.gpus for h in _holders(w, i) if h.pid not in w.job_pids]
    shared = [h for h in foreign if h.gpu in job]
    apart = [h for h in foreign if h.gpu not in job]
    if shared:
        gpus = {h.gpu for h in shared}
        yield Finding(
            Severity.WARN,
            _holders_title(shared, f"outside the job on its {gpus_subject(gpus)}"),
            subject=gpus_subject(gpus),
            cost="They share the job's GPUs: less memory for the job (out-of-memory at a smaller batch) and, "
            "whenever they run kernels, fewer SM cycles for it: slower steps.",
            fix="Find out whose they are (ps -o pid,user,etime,cmd -p PID) and stop them, or move the job to free "
            "GPUs with CUDA_VISIBLE_DEVICES.",
            evidence={"processes": [h.to_dict() for h in shared], "job_gpus": sorted(job)},
            command=_apps_command(gpus),
        )
    if apart:
        gpus = {h.gpu for h in apart}
        yield Finding(
            Severity.INFO,
            _holders_title(apart, f"outside the job on {gpus_subject(gpus)}"),
            subject=gpus_subject(gpus),
            cost="They hold GPUs the job does not use: fine if they are another job of yours, memory held for "
            "nothing if they are leftovers of a finished or crashed run.",
            fix="Stop the leftovers (kill PID) so the GPUs are free for the next job.",
            evidence={"processes": [h.to_dict() for h in apart], "job_gpus": sorted(job)},
            command=_apps_command(gpus),
        )


def _idle(w: Window, index: int) -> bool:
    """Idle over the whole window: every utilisation reading at about zero, and enough readings to say so."""
    readings = [g.utilization_ratio for g in w.gpus.get(index, []) if g.utilization_ratio is not None]
    return w.sustained(len(readings)) and max(readings) <= w.config.idle_utilization


@rule("monitor.idle_memory_holder", Area.GPU_MEMORY, "GPU memory held on a GPU that stays idle")
def idle_memory_holder(w: Window) -> Iterator[Finding]:
    idle = [i for i in w.gpus if _idle(w, i)]
    # where the job's processes are known, the others are monitor.foreign_process's, wherever they sit
    holders = [h for i in idle for h in _holders(w, i) if not w.pid_gpus or h.pid in (w.job_pids or set())]
    span = fmt_duration(w.seconds(len(w.samples)))
    if holders:
        gpus = {h.gpu for h in holders}
        yield Finding(
            Severity.WARN,
            _holders_title(holders, f"on idle {gpus_subject(gpus)} (no kernel for {span})"),
            subject=gpus_subject(gpus),
            cost="Memory held by processes that run nothing: no other job can use these GPUs. Typically a "
            "leftover of a crashed or finished run, a hung rank, or a notebook kernel that still holds a model.",
            fix="Stop the leftovers (kill PID); in a notebook, del the model and call torch.cuda.empty_cache(), "
            "or restart the kernel. A hung rank of a running job: take its stack with py-spy dump --pid PID.",
            evidence={"processes": [h.to_dict() for h in holders], "idle_utilization_max": w.config.idle_utilization},
            command=_apps_command(gpus),
        )
    # memory in use and no process listed at all: processes of another PID namespace (container, VM)
    hidden = {
        i: used
        for i in idle
        if not any(g.processes for g in w.gpus[i])
        and (used := median_of(g.memory_used_bytes for g in w.gpus[i])) is not None
        and used >= w.config.holder_bytes
    }
    if hidden:
        yield Finding(
            Severity.WARN,
            f"{fmt_bytes(sum(hidden.values()))} of memory in use on idle {gpus_subject(hidden)} "
            "with no visible process",
            subject=gpus_subject(hidden),
            cost="Someone holds these GPUs without using them: another container or VM tenant, whose processes "
            "NVML does not show inside this PID namespace.",
            fix="Ask who else runs on this server; on the host, nvidia-smi lists every process.",
            evidence={"memory_used_bytes": {i: int(v) for i, v in hidden.items()}},
            command=f"nvidia-smi -i {','.join(map(str, sorted(hidden)))}",
        )
