"""Rules over what `redline bench --save` measured (`redline doctor --bench`): each compares a measured
figure with the peak it was measured against and says what explains a gap. Without bench results they
stay silent."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from redline.doctor.context import Audit
from redline.doctor.engine import rule
from redline.doctor.model import Area, Finding, Severity
from redline.doctor.rules.power_thermal import HARDWARE_THROTTLE

if TYPE_CHECKING:
    from redline.bench.model import Measurement

# Well-run GEMMs reach 75-90% of the dense datasheet peak (ml-engineering's MAMF table: A100 SXM bf16
# 86.9%, H100 SXM 80.3%); below 60% something other than the kernel is in the way.
GEMM_LOW_RATIO = 0.60
# a device-to-device copy reaches 80-90% of the datasheet HBM bandwidth
COPY_LOW_RATIO = 0.60
# pinned host<->device copies reach ~80% of the PCIe link's per-direction rate
PCIE_LOW_RATIO = 0.50
P2P_LOW_RATIO = 0.50
# a dataset read slower than this from local disk starves even one modern GPU on image-sized samples
SLOW_STORAGE_MBPS = 500.0


def _reasons(measurement: Measurement) -> set[str]:
    return {
        r for state in measurement.extra.get("gpu_state", {}).values() for r in state.get("clock_event_reasons", [])
    }


@rule("power_thermal.gemm-below-peak", Area.POWER_THERMAL, "Measured matmul throughput far below the catalog peak")
def gemm_below_peak(audit: Audit) -> Iterator[Finding]:
    for m in audit.measurements("compute"):
        # --quick shapes are too small to reach a big GPU's peak: no verdict from them
        if m.ratio is None or m.ratio >= GEMM_LOW_RATIO or m.extra.get("quick"):
            continue
        reasons = _reasons(m)
        hardware = sorted(reasons & set(HARDWARE_THROTTLE))
        capped = "sw_power_cap" in reasons
        why = (
            f"with {', '.join(hardware)} active"
            if hardware
            else "at the power cap"
            if capped
            else "with no throttle reason set"
        )
        yield Finding(
            Severity.FAIL if hardware else Severity.WARN,
            f"{m.name} reached {m.value:.4g} {m.unit}, {m.ratio:.0%} of the {m.peak:.4g} peak, {why}",
            subject=m.device,
            cost="Every compute-bound step runs this much slower than the GPU you pay for should allow.",
            fix="Thermal/hardware reasons: cooling or power delivery (ask the provider). Power cap: see "
            "power_thermal.power-capped. No reason: a wrong SKU, MIG/vGPU slice, or another process "
            "sharing the GPU (gpu_memory.in-use).",
            evidence={"value": m.value, "peak": m.peak, "peak_source": m.peak_source, "reasons": sorted(reasons)},
            command="redline bench compute",
        )


@rule("hardware.memory-bandwidth-low", Area.HARDWARE, "Measured GPU memory or PCIe bandwidth far below peak")
def memory_bandwidth_low(audit: Audit) -> Iterator[Finding]:
    for m in audit.measurements("memory"):
        if m.ratio is None:
            continue
        if m.name == "device_copy" and m.ratio < COPY_LOW_RATIO:
            cost = "Memory-bound kernels (attention, norms, optimizers) run slower in proportion."
            fix = "Check clocks and throttle reasons; a vGPU/MIG slice or a relabelled SKU also shows this."
        elif m.name in ("h2d_pinned", "d2h_pinned") and m.ratio < PCIE_LOW_RATIO:
            cost = "Host-to-GPU transfers (input batches, offload, checkpoint loads) crawl."
            fix = (
                "A degraded PCIe link (hardware.pcie-link-degraded), a GPU on the far NUMA node, or a PCIe "
                "switch shared with other GPUs; pin the process to the GPU's NUMA node."
            )
        else:
            continue
        yield Finding(
            Severity.WARN,
            f"{m.name} measured {m.value:.4g} {m.unit}, {m.ratio:.0%} of {m.peak:.4g} ({m.peak_source})",
            subject=m.device,
            cost=cost,
            fix=fix,
            evidence={"value": m.value, "peak": m.peak, "peak_source": m.peak_source},
            command="redline bench memory",
        )


@rule("multi_gpu.p2p-bandwidth-low", Area.MULTI_GPU, "Measured GPU-to-GPU copy bandwidth far below its link")
def p2p_bandwidth_low(audit: Audit) -> Iterator[Finding]:
    slow = [
        m
        for m in audit.measurements("memory")
        if m.name.startswith("p2p_") and m.ratio is not None and m.ratio < P2P_LOW_RATIO
    ]
    if slow:
        yield Finding(
            Severity.WARN,
            f"{len(slow)} GPU pair(s) copy at under {P2P_LOW_RATIO:.0%} of their link rate",
            cost="Collectives between these GPUs are bounded by the slow pairs.",
            fix="PCIe-only pairs behind one switch or across sockets share bandwidth; check P2P status and "
            "topology (nvidia-smi topo -m) and the multi_gpu findings.",
            evidence={m.name: {"gbps": m.value, "peak": m.peak, "peak_source": m.peak_source} for m in slow},
            command="redline bench memory",
        )


@rule("storage.read-throughput-low", Area.STORAGE, "Measured read throughput too low to feed the GPUs")
def read_throughput_low(audit: Audit) -> Iterator[Finding]:
    storage = {m.name: m for m in audit.measurements("storage")}
    loader = {m.name: m for m in audit.measurements("dataloader")}
    seq = storage.get("seq_read")
    if seq is None:
        return
    demand = loader.get("samples_per_s")
    need_mbps = None
    if demand is not None and demand.extra.get("batch_bytes") and demand.extra.get("batch_size"):
        bytes_per_sample = demand.extra["batch_bytes"] / demand.extra["batch_size"]
        need_mbps = demand.value * bytes_per_sample / 1e6
    if seq.value < SLOW_STORAGE_MBPS or (need_mbps and seq.value < need_mbps):
        yield Finding(
            Severity.WARN,
            f"{seq.extra.get('path', 'the data path')} reads at {seq.value:.0f} MB/s sequential"
            + (f", below the {need_mbps:.0f} MB/s the DataLoader consumes" if need_mbps else ""),
            subject=seq.extra.get("path"),
            cost="GPUs wait on input every step once the page cache no longer holds the dataset.",
            fix="Stage the dataset on local NVMe, pack it into large shards read sequentially, or cache it "
            "in RAM if it fits.",
            evidence={name: {"value": m.value, "unit": m.unit} for name, m in storage.items()},
            command="redline bench storage --path DATASET_DIR",
        )


@rule("network.streams-needed", Area.NETWORK, "One TCP stream cannot fill the measured link")
def streams_needed(audit: Audit) -> Iterator[Finding]:
    rates = {m.name: m for m in audit.measurements("network") if m.name.startswith("tcp_")}
    one = rates.get("tcp_1_stream")
    best = max(rates.values(), key=lambda m: m.value, default=None)
    if one is None or best is None or best.value < one.value * 1.5:
        return
    advice = best.extra.get("recommendation") or one.extra.get("recommendation") or {}
    yield Finding(
        Severity.WARN,
        f"One TCP stream carries {one.value:.0f} Mbit/s, {best.name.replace('_', ' ')} carry {best.value:.0f}",
        subject=one.extra.get("peer"),
        cost="Single-stream downloads (git, pip, a plain HTTP fetch of data or checkpoints) use a fraction of "
        "the link.",
        fix=f"Transfer with parallel streams ({advice.get('streams', 'several')}) and chunks of at least "
        f"{advice.get('chunk_bytes', '2x the bandwidth-delay product')} bytes per request (e.g. "
        "`aws s3 cp` / `rclone --transfers`, `aria2c -x`); BBR and larger TCP buffers help one stream.",
        evidence={name: m.value for name, m in rates.items()} | {"recommendation": advice},
        command="redline bench network --connect PEER",
    )
