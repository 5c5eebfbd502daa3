"""Can the GPUs talk to each other fast? P2P, NVLink, NVSwitch fabric and PCIe topology."""

from __future__ import annotations

from collections.abc import Iterator

from redline.doctor.context import Audit, gpu_subject
from redline.doctor.engine import rule
from redline.doctor.model import Area, Finding, Severity
from redline.hw.snapshot import Gpu


def active_links(gpu: Gpu) -> int:
    return sum(link.active for link in gpu.nvlinks or [])


@rule("multi_gpu.p2p-unavailable", Area.MULTI_GPU, "GPU pairs without peer-to-peer access")
def p2p_unavailable(audit: Audit) -> Iterator[Finding]:
    section = audit.snapshot.gpu
    matrix, topology = section.p2p, section.topology
    if not matrix:
        return
    pairs = {(i, j): status for i, row in enumerate(matrix) for j, status in enumerate(row) if i < j}
    # the GPU model has no P2P (GeForce since the RTX 40 series): a fact of the hardware, not a fault
    by_design = {p: s for p, s in pairs.items() if s == "gpu_not_supported"}
    broken = {p: s for p, s in pairs.items() if s not in ("ok", "self", "gpu_not_supported")}
    # across CPU sockets many PCIe platforms cannot do P2P at all; multi_gpu.cross-socket reports those
    if topology and len(topology) == len(matrix):
        broken = {(i, j): s for (i, j), s in broken.items() if topology[i][j] != "SYS"}
    if broken:
        statuses = sorted(set(broken.values()))
        yield Finding(
            Severity.FAIL,
            f"P2P blocked between {len(broken)} GPU pair(s) under one CPU socket ({', '.join(statuses)})",
            cost="NCCL falls back to copies through host memory: all-reduce bandwidth drops several-fold.",
            fix="disabled_by_regkey: a driver registry key (RmDisableP2P / NVreg) turns it off. Otherwise the "
            "usual causes are PCIe ACS on switches/bridges (disable it in the BIOS or with setpci) or an IOMMU "
            "that translates DMA (boot with iommu=pt); in a VM, the hypervisor must expose P2P.",
            evidence={"pairs": {f"{i}-{j}": s for (i, j), s in broken.items()}},
            command="nvidia-smi topo -p2p r",
        )
    if by_design:
        yield Finding(
            Severity.WARN,
            f"This GPU model does not support P2P ({len(by_design)} pair(s))",
            cost="GPU-to-GPU traffic is staged through host memory (NCCL's SHM transport): slower all-reduce, "
            "more CPU and PCIe load.",
            fix="Expect communication-bound multi-GPU training; prefer gradient accumulation, or GPUs with "
            "P2P/NVLink for large models.",
            evidence={"pairs": {f"{i}-{j}": s for (i, j), s in by_design.items()}},
            command="nvidia-smi topo -p2p r",
        )


@rule("multi_gpu.nvlink-down", Area.MULTI_GPU, "Fewer NVLinks active than the GPU model has")
def nvlink_down(audit: Audit) -> Iterator[Finding]:
    for gpu in audit.gpus:
        spec = audit.spec(gpu)
        if spec is None or not spec.nvlink_links or gpu.nvlinks is None:
            continue
        up = active_links(gpu)
        if up < spec.nvlink_links:
            # an SXM part with no link up at all is unusual; a PCIe card without its bridge is normal
            severity = Severity.FAIL if spec.form_factor.lower().startswith("sxm") or up > 0 else Severity.INFO
            yield Finding(
                severity,
                f"{up} of {spec.nvlink_links} NVLinks active",
                subject=gpu_subject([gpu]),
                cost="GPU-to-GPU bandwidth drops in proportion, or traffic falls back to PCIe.",
                fix="Ask the provider to check the NVLink/NVSwitch hardware; on bridged cards, fit the bridge.",
                evidence={"active": up, "expected": spec.nvlink_links, "catalog": spec.key},
                command=f"nvidia-smi nvlink --status -i {gpu.index}",
            )


@rule("multi_gpu.fabric-not-ready", Area.MULTI_GPU, "NVSwitch fabric registration not completed")
def fabric_not_ready(audit: Audit) -> Iterator[Finding]:
    pending = [g for g in audit.gpus if g.fabric_state in ("not_started", "in_progress")]
    failed = [g for g in audit.gpus if g.fabric_state == "completed" and g.fabric_status not in (None, "success")]
    if failed:
        yield Finding(
            Severity.FAIL,
            f"NVSwitch fabric registration failed ({failed[0].fabric_status})",
            subject=gpu_subject(failed),
            cost="The GPU is not part of the NVLink fabric: CUDA or NCCL fail, or traffic misses NVLink.",
            fix="Check the fabric manager log (journalctl -u nvidia-fabricmanager) and that its version "
            "matches the driver; restart it, then reset the GPUs.",
            evidence={g.index: g.fabric_status for g in failed},
            command="nvidia-smi -q | grep -A4 -i fabric",
        )
    if pending:
        yield Finding(
            Severity.FAIL,
            f"NVSwitch fabric not ready (state {pending[0].fabric_state})",
            subject=gpu_subject(pending),
            cost="CUDA fails with 'system not yet initialized' on NVSwitch systems until the fabric is up.",
            fix="Start the fabric manager (systemctl start nvidia-fabricmanager) with the driver's version.",
            evidence={g.index: g.fabric_state for g in pending},
            command="systemctl status nvidia-fabricmanager; nvidia-smi -q | grep -A3 -i fabric",
        )


@rule("multi_gpu.cross-socket", Area.MULTI_GPU, "GPU pairs that talk across CPU sockets with no NVLink")
def cross_socket(audit: Audit) -> Iterator[Finding]:
    topology = audit.snapshot.gpu.topology
    gpus = audit.snapshot.gpus
    if not topology or len(topology) != len(gpus):
        return  # a hand-edited or truncated snapshot: no way to tell which GPU a row means
    pairs = [
        f"{i}-{j}"
        for i, row in enumerate(topology)
        for j, level in enumerate(row)
        if i < j and level == "SYS" and not (active_links(gpus[i]) and active_links(gpus[j]))
    ]
    if pairs:
        yield Finding(
            Severity.WARN,
            f"{len(pairs)} GPU pair(s) connect only across the CPU socket link (SYS)",
            cost="Traffic between them crosses the inter-socket link, and many platforms allow no P2P there: "
            "NCCL stages it through host memory, at lower all-reduce bandwidth.",
            fix="Keep tightly coupled ranks on one socket (CUDA_VISIBLE_DEVICES), or use NVLink-connected GPUs.",
            evidence={"pairs": pairs},
            command="nvidia-smi topo -m",
        )


@rule("multi_gpu.pcie-only", Area.MULTI_GPU, "Several GPUs with no NVLink between them")
def pcie_only(audit: Audit) -> Iterator[Finding]:
    gpus = audit.gpus
    if len(gpus) < 2 or any(active_links(g) for g in gpus):
        return
    yield Finding(
        Severity.INFO,
        f"{len(gpus)} GPUs connected by PCIe only",
        cost="All-reduce over PCIe reaches tens of GB/s bus bandwidth, against hundreds over NVLink: "
        "data-parallel training of large models becomes communication-bound.",
        fix="Prefer gradient accumulation (fewer all-reduces), FSDP with larger buckets, or NVLink machines "
        "for large models.",
        evidence={"gpus": len(gpus)},
        command="nvidia-smi topo -m",
    )
