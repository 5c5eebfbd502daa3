"""Is this the hardware you paid for, and is it healthy? GPU identity, capacity, PCIe links, Xids."""

from __future__ import annotations

from collections.abc import Iterator

from redline.doctor.context import Audit, gpu_subject
from redline.doctor.engine import rule
from redline.doctor.model import Area, Finding, Severity
from redline.hw.kernel_log import CRITICAL_XIDS, XID_MEANINGS
from redline.hw.snapshot import Gpu
from redline.units import GB, fmt_bytes

# NVML reports a little less than the marketing size (81559 MiB on an "80 GB" H100); a vGPU slice or
# a relabelled card is off by far more than this.
MEMORY_TOLERANCE = 0.10
# bytes per parameter for full training with Adam in mixed precision (ZeRO paper §3.1: 2+2+12)
TRAIN_BYTES_PER_PARAM = 16
# bf16 weights plus ~20% for KV cache and buffers (EleutherAI, Transformer Math 101)
INFER_BYTES_PER_PARAM = 2 * 1.2
PCIE_REPLAY_WARN = 100
NOT_HEALTH = frozenset({"NO_PERMISSION", "NOT_SUPPORTED"})
# a remapped row (63) or a contained ECC error (94) is the GPU repairing itself: worth a reset, not an RMA
WARN_XIDS = frozenset({63, 94})
FAIL_XIDS = CRITICAL_XIDS - WARN_XIDS


@rule("hardware.no-gpu", Area.HARDWARE, "No NVIDIA GPU is visible through NVML")
def no_gpu(audit: Audit) -> Iterator[Finding]:
    section = audit.snapshot.gpu
    if section.gpus or section.error_code == "driver_mismatch":  # software.driver-mismatch explains that
        return
    torch = audit.snapshot.software.torch
    reason = section.error or "NVML found no devices"
    if torch and torch.hip:
        yield Finding(
            Severity.INFO,
            f"No NVIDIA GPU; PyTorch is a ROCm build (HIP {torch.hip})",
            cost="This release audits NVIDIA GPUs only: AMD GPUs are not probed, so GPU rules are skipped.",
            fix="Use rocm-smi and rocminfo to inspect AMD GPUs.",
            evidence={"nvml_error": section.error, "torch_hip": torch.hip},
            command="rocm-smi",
        )
        return
    yield Finding(
        Severity.WARN,
        f"No NVIDIA GPU found ({reason})",
        cost="Everything runs on the CPU: training is one to two orders of magnitude slower.",
        fix="On a GPU server: install the NVIDIA driver so that nvidia-smi works; in a container, start it "
        "with --gpus all (NVIDIA Container Toolkit). On a CPU-only machine this is expected.",
        evidence={"nvml_available": section.nvml_available, "error": section.error},
        command="nvidia-smi",
    )


@rule("hardware.gpu-lost", Area.HARDWARE, "A GPU fell off the bus (NVML: GPU is lost)")
def gpu_lost(audit: Audit) -> Iterator[Finding]:
    lost = [g for g in audit.snapshot.gpus if g.lost]
    if lost:
        yield Finding(
            Severity.FAIL,
            "GPU is lost: it stopped answering on the PCIe bus (Xid 79)",
            subject=gpu_subject(lost),
            cost="Any job on this GPU crashes; NCCL jobs across all GPUs hang or fail.",
            fix="Drain the node and reset or reboot it; if it repeats, ask the provider to replace the GPU "
            "or check the riser, power and cooling.",
            evidence={"pci_bus_id": [g.pci_bus_id for g in lost]},
            command="nvidia-smi -q | grep -i -A2 'bus id'; dmesg | grep -i xid",
        )


@rule("hardware.nvml-errors", Area.HARDWARE, "NVML reports GPU health errors (InfoROM, reset, power, timeouts)")
def nvml_errors(audit: Audit) -> Iterator[Finding]:
    # a container refused some GPUs answers NO_PERMISSION for their handles: access, not health
    errors = {g.index: {f: e for f, e in g.health_errors.items() if e not in NOT_HEALTH} for g in audit.gpus}
    sick = [g for g in audit.gpus if errors[g.index]]
    if sick:
        kinds = sorted({e for g in sick for e in errors[g.index].values()})
        yield Finding(
            Severity.FAIL,
            "NVML calls fail with health errors: " + ", ".join(kinds),
            subject=gpu_subject(sick),
            cost="The GPU is in a degraded state (corrupted InfoROM, reset required, insufficient power, "
            "unresponsive): jobs may crash or run slowly, and its readings cannot be trusted.",
            fix="Drain the GPU; a reset or reboot clears RESET_REQUIRED; INSUFFICIENT_POWER means a loose or "
            "missing power cable; CORRUPTED_INFOROM needs the provider (InfoROM reflash or replacement).",
            evidence={g.index: errors[g.index] for g in sick},
            command="nvidia-smi -q",
        )


@rule("hardware.unknown-gpu", Area.HARDWARE, "GPU model is not in redline's catalog")
def unknown_gpu(audit: Audit) -> Iterator[Finding]:
    unknown = [g for g in audit.gpus if audit.spec(g) is None]
    if unknown:
        names = sorted({g.name or "unnamed" for g in unknown})
        yield Finding(
            Severity.INFO,
            f"GPU model not in the catalog: {', '.join(names)}",
            subject=gpu_subject(unknown),
            cost="Identity, power and peak-FLOP checks are skipped for these GPUs.",
            fix="Add the GPU to the catalog (src/redline/specs/data/gpus.csv, with its datasheet as source).",
            evidence={"names": names},
            command="redline catalog gpus",
        )


@rule("hardware.identity", Area.HARDWARE, "GPU memory size or compute capability differs from its datasheet")
def identity(audit: Audit) -> Iterator[Finding]:
    for gpu in audit.gpus:
        spec = audit.spec(gpu)
        if spec is None:
            continue
        problems = {}
        if gpu.memory_total_bytes is not None:
            ratio = gpu.memory_total_bytes / spec.memory_bytes
            if abs(1 - ratio) > MEMORY_TOLERANCE:
                problems["memory"] = f"{fmt_bytes(gpu.memory_total_bytes)} vs {spec.memory_gb} GB"
        if gpu.compute_capability and gpu.compute_capability != spec.compute_capability:
            problems["compute_capability"] = f"{gpu.compute_capability} vs {spec.compute_capability}"
        if problems:
            yield Finding(
                Severity.FAIL,
                f"{gpu.name} does not match its datasheet: " + "; ".join(f"{k} {v}" for k, v in problems.items()),
                subject=gpu_subject([gpu]),
                cost="You may be paying for a GPU you are not getting (a relabelled card or a vGPU slice).",
                fix="Ask the provider which SKU this is; check `nvidia-smi -q` for a vGPU or MIG profile.",
                evidence={"catalog": spec.key, **problems},
                command=f"nvidia-smi -i {gpu.index} --query-gpu=name,memory.total,compute_cap --format=csv",
            )


@rule("hardware.capacity", Area.HARDWARE, "What model sizes the GPU memory holds (training and inference)")
def capacity(audit: Audit) -> Iterator[Finding]:
    sizes = [g.memory_total_bytes for g in audit.gpus if g.memory_total_bytes]
    if not sizes:
        return
    per_gpu, total = min(sizes), sum(sizes)
    train_one = per_gpu / TRAIN_BYTES_PER_PARAM / 1e9
    train_all = total / TRAIN_BYTES_PER_PARAM / 1e9
    infer_one = per_gpu / INFER_BYTES_PER_PARAM / 1e9
    yield Finding(
        Severity.INFO,
        f"{len(sizes)} GPU(s) with {fmt_bytes(per_gpu)} each: full training fits up to ~{train_one:.1f}B "
        f"parameters per GPU, ~{train_all:.1f}B sharded over all (FSDP/ZeRO-3), before activations",
        cost="Larger models need sharding, activation checkpointing, offload, or bigger GPUs.",
        fix=f"bf16 inference fits ~{infer_one:.0f}B parameters per GPU; activations come on top, growing with "
        "batch and sequence length.",
        evidence={
            "gpu_memory_bytes": per_gpu,
            "total_gpu_memory_gb": round(total / GB, 1),
            "train_params_per_gpu_b": round(train_one, 2),
            "train_params_sharded_b": round(train_all, 2),
            "bf16_inference_params_per_gpu_b": round(infer_one, 1),
        },
    )


@rule("hardware.mixed-models", Area.HARDWARE, "GPUs of different models in one server")
def mixed_models(audit: Audit) -> Iterator[Finding]:
    names = sorted({g.name for g in audit.gpus if g.name})
    if len(names) > 1:
        yield Finding(
            Severity.WARN,
            f"Different GPU models in one server: {', '.join(names)}",
            cost="Data-parallel training runs every rank at the pace of the slowest GPU.",
            fix="Pin jobs to one model with CUDA_VISIBLE_DEVICES, or balance the work per GPU.",
            evidence={"models": {n: sum(g.name == n for g in audit.gpus) for n in names}},
            command="nvidia-smi -L",
        )


@rule("hardware.pcie-link-degraded", Area.HARDWARE, "GPU PCIe link narrower or slower than it can run")
def pcie_link_degraded(audit: Audit) -> Iterator[Finding]:
    for gpu in audit.gpus:
        link = gpu.pcie
        narrow = link.width_current is not None and link.width_max and link.width_current < link.width_max
        slow = link.gen_current is not None and link.gen_max and link.gen_current < link.gen_max
        if not (narrow or slow):
            continue
        busy = (gpu.utilization_ratio or 0) >= 0.5
        evidence = {
            "gen": f"{link.gen_current}/{link.gen_max}",
            "width": f"x{link.width_current}/x{link.width_max}",
            "utilization": gpu.utilization_ratio,
        }
        command = (
            f"nvidia-smi -i {gpu.index} --format=csv "
            "--query-gpu=pcie.link.gen.current,pcie.link.width.current,utilization.gpu"
        )
        if narrow or busy:
            yield Finding(
                Severity.FAIL if busy else Severity.WARN,
                f"PCIe link at Gen{link.gen_current} x{link.width_current}, capable of "
                f"Gen{link.gen_max} x{link.width_max}" + (" under load" if busy else ""),
                subject=gpu_subject([gpu]),
                cost="Host-to-GPU copies, data loading and PCIe all-reduce run at a fraction of their speed.",
                fix="Reseat the GPU or riser, check the slot wiring and BIOS PCIe settings; ask the provider.",
                evidence=evidence,
                command=command,
            )
        else:
            yield Finding(
                Severity.INFO,
                f"PCIe link idles at Gen{link.gen_current} (max Gen{link.gen_max})",
                subject=gpu_subject([gpu]),
                cost="None if it returns to full speed under load: idle GPUs lower the link speed to save power.",
                fix="Re-check under load: run the command below while a job keeps the GPU busy.",
                evidence=evidence,
                command=command,
            )


@rule("hardware.pcie-slot-capped", Area.HARDWARE, "Slot or riser caps the GPU below its PCIe generation")
def pcie_slot_capped(audit: Audit) -> Iterator[Finding]:
    capped = [g for g in audit.gpus if g.pcie.gen_max and g.pcie.gen_gpu_max and g.pcie.gen_max < g.pcie.gen_gpu_max]
    if capped:
        slots = sorted({g.pcie.gen_max for g in capped if g.pcie.gen_max})
        gpus = sorted({g.pcie.gen_gpu_max for g in capped if g.pcie.gen_gpu_max})
        yield Finding(
            Severity.WARN,
            f"Slots allow PCIe Gen{'/'.join(map(str, slots))}, the GPUs support Gen{'/'.join(map(str, gpus))}",
            subject=gpu_subject(capped),
            cost="Each generation step halves host-to-GPU bandwidth (x16: Gen3 15.75, Gen4 31.5, Gen5 63 GB/s).",
            fix="Check the BIOS PCIe speed setting and the riser; otherwise choose a server built for this GPU.",
            evidence={g.index: {"slot_max": g.pcie.gen_max, "gpu_max": g.pcie.gen_gpu_max} for g in capped},
            command="nvidia-smi -q | grep -A12 'GPU Link Info'",
        )


@rule("hardware.pcie-replays", Area.HARDWARE, "PCIe replays: the link is retransmitting")
def pcie_replays(audit: Audit) -> Iterator[Finding]:
    noisy = [g for g in audit.gpus if (g.pcie.replay_count or 0) > PCIE_REPLAY_WARN]
    if noisy:
        yield Finding(
            Severity.WARN,
            f"PCIe replay counter above {PCIE_REPLAY_WARN}: the link is retransmitting packets",
            subject=gpu_subject(noisy),
            cost="Lower effective PCIe bandwidth; often precedes the link degrading or the GPU falling off the bus.",
            fix="Reseat the GPU and riser; if the count keeps rising, ask the provider to check the hardware.",
            evidence={g.index: g.pcie.replay_count for g in noisy},
            command="nvidia-smi -q | grep -i replay",
        )


@rule("hardware.xid", Area.HARDWARE, "NVIDIA Xid errors in the kernel log")
def xid_errors(audit: Audit) -> Iterator[Finding]:
    section = audit.snapshot.gpu
    counts = section.xid_counts or {}
    by_device = section.xid_by_device or {}
    for severity, codes, what, fix in (
        (
            Severity.FAIL,
            FAIL_XIDS,
            "Hardware Xid errors",
            "Drain the node and ask the provider to run field diagnostics (dcgmi diag -r 3) or replace the GPU.",
        ),
        (
            Severity.WARN,
            WARN_XIDS,
            "Memory-repair Xid events",
            "The GPU handled a memory fault; reset it when "
            "convenient so a pending remap takes effect, and watch whether they recur.",
        ),
        (
            Severity.INFO,
            None,
            "Application-level Xid errors",
            "Usually a crashed program (bad memory access, "
            "illegal instruction), not the hardware; repeated ones on one GPU warrant diagnostics.",
        ),
    ):
        hit = {x: n for x, n in counts.items() if (int(x) in codes if codes else int(x) not in CRITICAL_XIDS)}
        if not hit:
            continue
        gpus = _gpus_at([dev for dev, seen in by_device.items() if set(seen) & set(hit)], audit)
        yield Finding(
            severity,
            f"{what} in the kernel log: {_describe_xids(hit)}",
            subject=gpu_subject(gpus) if gpus else None,
            cost="These point at failing GPU memory, NVLink, PCIe or firmware: jobs crash or corrupt silently."
            if severity is Severity.FAIL
            else "Worth knowing when a job crashed; not by itself a sign of failing hardware.",
            fix=fix,
            evidence={"xid_counts": hit, "by_device": {d: c for d, c in by_device.items() if set(c) & set(hit)}},
            command="dmesg | grep -i 'NVRM: Xid'",
        )


def _describe_xids(codes: dict[str, int]) -> str:
    return ", ".join(f"Xid {x} ({XID_MEANINGS.get(int(x), 'see NVIDIA Xid catalog')}) x{n}" for x, n in codes.items())


def _gpus_at(addresses: list[str], audit: Audit) -> list[Gpu]:
    """Xid lines name a GPU as 'PCI:0000:3b:00', the bus id without the function number."""
    return [g for g in audit.gpus if g.pci_bus_id and g.pci_bus_id.rsplit(".", 1)[0] in addresses]
