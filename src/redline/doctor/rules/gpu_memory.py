"""Is GPU memory healthy and free? ECC errors, row remapping, page retirement, other tenants' processes."""

from __future__ import annotations

from collections.abc import Iterator

from redline.doctor.context import Audit, gpu_subject
from redline.doctor.engine import rule
from redline.doctor.model import Area, Finding, Severity
from redline.units import GiB, MiB, fmt_bytes

# memory NVML shows as used with no process listed: another container's processes, or a leak
UNEXPLAINED_USED_BYTES = 1 * GiB
SMALL_GRAPHICS_BYTES = 256 * MiB
# NVIDIA retires at most 64 pages per GPU (page retirement, pre-A100); near that the GPU needs an RMA
RETIRED_PAGES_WARN = 48


@rule("gpu_memory.ecc-errors", Area.GPU_MEMORY, "Uncorrectable ECC errors")
def ecc_errors(audit: Audit) -> Iterator[Finding]:
    volatile = [g for g in audit.gpus if (g.ecc.volatile_uncorrected or 0) > 0]
    lifetime = [g for g in audit.gpus if g not in volatile and (g.ecc.aggregate_uncorrected or 0) > 0]
    if volatile:
        yield Finding(
            Severity.FAIL,
            "Uncorrectable ECC errors since the driver loaded",
            subject=gpu_subject(volatile),
            cost="A process touching the bad memory is killed; results computed before may be corrupt.",
            fix="Drain the GPU, reset it (the driver remaps the row on reset) and rerun diagnostics; "
            "ask the provider to replace it if errors return.",
            evidence={g.index: g.ecc.volatile_uncorrected for g in volatile},
            command="nvidia-smi -q -d ECC",
        )
    if lifetime:
        yield Finding(
            Severity.INFO,
            "Uncorrectable ECC errors in the GPU's lifetime (none since the driver loaded)",
            subject=gpu_subject(lifetime),
            cost="Past faults that the GPU handled by remapping; worth watching.",
            fix="Watch the counters; if the volatile count rises, drain the GPU.",
            evidence={g.index: g.ecc.aggregate_uncorrected for g in lifetime},
            command="nvidia-smi -q -d ECC",
        )


@rule("gpu_memory.ecc-disabled", Area.GPU_MEMORY, "ECC turned off on a data-centre GPU")
def ecc_disabled(audit: Audit) -> Iterator[Finding]:
    off = [g for g in audit.gpus if g.ecc.enabled is False and (spec := audit.spec(g)) and spec.ecc]
    if off:
        yield Finding(
            Severity.INFO,
            "ECC is disabled on a GPU that supports it",
            subject=gpu_subject(off),
            cost="Bit flips in GPU memory go undetected (silent corruption of weights or gradients).",
            fix="Enable it unless you deliberately traded it for memory: nvidia-smi -e 1, then reset/reboot.",
            evidence={g.index: False for g in off},
            command="nvidia-smi -q -d ECC | grep -A1 'ECC Mode'",
        )


@rule("gpu_memory.row-remap", Area.GPU_MEMORY, "Row remapping failed or pending; retired pages near the limit")
def row_remap(audit: Audit) -> Iterator[Finding]:
    failed = [g for g in audit.gpus if g.retirement.remap_failed]
    pending = [g for g in audit.gpus if g.retirement.remap_pending or g.retirement.retired_pages_pending]
    worn = [
        g
        for g in audit.gpus
        if (g.retirement.retired_pages_single_bit or 0) + (g.retirement.retired_pages_double_bit or 0)
        >= RETIRED_PAGES_WARN
    ]
    if failed:
        yield Finding(
            Severity.FAIL,
            "Row remapping failed: the GPU has run out of spare memory rows",
            subject=gpu_subject(failed),
            cost="Faulty memory stays in use; uncorrectable errors and crashes follow.",
            fix="The GPU needs replacement (RMA): ask the provider.",
            evidence={g.index: {"uncorrectable_rows": g.retirement.remapped_rows_uncorrectable} for g in failed},
            command="nvidia-smi -q -d ROW_REMAPPER",
        )
    if pending:
        yield Finding(
            Severity.FAIL,
            "A memory row remap or page retirement is pending until the GPU is reset",
            subject=gpu_subject(pending),
            cost="The faulty memory is still in use until the reset.",
            fix="Drain the GPU and reset it (nvidia-smi -r -i N, or reboot).",
            evidence={
                g.index: {
                    "remap_pending": g.retirement.remap_pending,
                    "retired_pages_pending": g.retirement.retired_pages_pending,
                }
                for g in pending
            },
            command="nvidia-smi -q -d ROW_REMAPPER,PAGE_RETIREMENT",
        )
    if worn:
        yield Finding(
            Severity.WARN,
            f"{RETIRED_PAGES_WARN}+ memory pages retired (the limit is 64)",
            subject=gpu_subject(worn),
            cost="The GPU is close to its retirement limit; further faults cannot be handled.",
            fix="Plan to replace the GPU; ask the provider.",
            evidence={
                g.index: {
                    "single_bit": g.retirement.retired_pages_single_bit,
                    "double_bit": g.retirement.retired_pages_double_bit,
                }
                for g in worn
            },
            command="nvidia-smi -q -d PAGE_RETIREMENT",
        )


@rule("gpu_memory.in-use", Area.GPU_MEMORY, "GPU memory held by other users, containers or tenants")
def in_use(audit: Audit) -> Iterator[Finding]:
    me = audit.snapshot.host.probe_uid
    for gpu in audit.gpus:
        # a small graphics context (Xorg, a display manager) costs nothing worth reporting
        procs = [
            p for p in gpu.processes or [] if p.kind == "compute" or (p.used_memory_bytes or 0) > SMALL_GRAPHICS_BYTES
        ]
        # a pid we cannot see lives in another PID namespace: another container
        foreign = [p for p in procs if p.uid is None or (me is not None and p.uid != me)]
        own = [p for p in procs if p not in foreign]
        used = gpu.memory_used_bytes or 0
        if foreign:
            held = sum(p.used_memory_bytes or 0 for p in foreign)
            yield Finding(
                Severity.WARN,
                f"{len(foreign)} process(es) of other users or containers on the GPU, holding {fmt_bytes(held)}: "
                + ", ".join(f"{p.name or '?'}[{p.pid}]" for p in foreign[:4]),
                subject=gpu_subject([gpu]),
                cost="Your job gets less memory (OOM at a smaller batch) and shares the SMs: slower steps.",
                fix="Pick another GPU (CUDA_VISIBLE_DEVICES) or agree on GPU assignments with the other users.",
                evidence={
                    "processes": [
                        {"pid": p.pid, "name": p.name, "uid": p.uid, "bytes": p.used_memory_bytes} for p in foreign
                    ]
                },
                command=f"nvidia-smi -i {gpu.index} --query-compute-apps=pid,process_name,used_memory --format=csv",
            )
        elif own:
            held = sum(p.used_memory_bytes or 0 for p in own)
            yield Finding(
                Severity.INFO,
                f"{len(own)} of your own process(es) on the GPU, holding {fmt_bytes(held)}: "
                + ", ".join(f"{p.name or '?'}[{p.pid}]" for p in own[:4]),
                subject=gpu_subject([gpu]),
                cost="Expected while you train; a leftover from a crashed run holds memory for nothing.",
                fix="If no job of yours should be running, kill the stale processes.",
                evidence={"processes": [{"pid": p.pid, "name": p.name, "bytes": p.used_memory_bytes} for p in own]},
                command=f"nvidia-smi -i {gpu.index} --query-compute-apps=pid,process_name,used_memory --format=csv",
            )
        elif used > UNEXPLAINED_USED_BYTES:
            yield Finding(
                Severity.WARN,
                f"{fmt_bytes(used)} of GPU memory in use with no visible process",
                subject=gpu_subject([gpu]),
                cost="Another container or VM tenant is probably using this GPU: less memory and shared SMs.",
                fix="Ask who else runs on this GPU; in containers processes of other PID namespaces are hidden.",
                evidence={"memory_used_bytes": used},
                command=f"nvidia-smi -i {gpu.index}",
            )
