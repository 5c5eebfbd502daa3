"""Diagnosis rules on GPU health: lost GPUs, ECC and Xid errors, PCIe links that run slower than they can."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from redline.doctor.model import Area, Finding, Severity
from redline.monitor.diagnose import rule
from redline.monitor.sample import GpuSample
from redline.monitor.window import (
    Share,
    Window,
    counter_growth,
    gpus_subject,
    median_of,
    share_under_load,
    title_figures,
)
from redline.units import fmt_duration

# usable bandwidth per PCIe lane and direction after line encoding, GB/s (PCI-SIG: 8b/10b up to Gen2,
# 128b/130b from Gen3; Gen6's FLIT mode is counted at its raw rate)
PCIE_LANE_GBPS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}


@rule("monitor.gpu_lost", Area.HARDWARE, "A GPU fell off the bus during the window (NVML: GPU is lost)")
def gpu_lost(w: Window) -> Iterator[Finding]:
    start = w.samples[0].time if w.samples else 0.0
    lost: dict[int, list[float]] = {}
    for s in w.samples:
        for g in s.gpus:
            if g.lost:
                lost.setdefault(g.index, []).append(s.time)
    if not lost:
        return
    first = min(lost, key=lambda i: lost[i][0])
    after = f"{lost[first][0] - start:.0f} s into the window"
    yield Finding(
        Severity.FAIL,
        f"{gpus_subject(lost)} fell off the bus (NVML: GPU is lost), "
        + (after if len(lost) == 1 else f"first GPU {first}, {after}"),
        subject=gpus_subject(lost),
        cost="Any process on the GPU crashes or hangs; a NCCL job across all GPUs hangs or fails with it.",
        fix="Drain the node and reset or reboot it; if it repeats, ask the provider to replace the GPU or check "
        "the riser, power and cooling.",
        evidence={
            i: {
                "first_lost_s": round(times[0] - start, 1),
                "lost_samples": len(times),
                "answering_again": _answers_after(w, i, times[-1]),
                "uuid": next((g.uuid for g in w.gpus.get(i, []) if g.uuid), None),
            }
            for i, times in sorted(lost.items())
        },
        command="nvidia-smi -L; dmesg | grep -i xid",
    )


def _answers_after(w: Window, index: int, time: float) -> bool:
    """Whether the GPU answered again after it was last seen lost (a reset within the window)."""
    return any(g.index == index and not g.lost for s in w.samples if s.time > time for g in s.gpus)


@rule("monitor.ecc_xid_errors", Area.HARDWARE, "ECC error or Xid counters grew during the window")
def ecc_xid_errors(w: Window) -> Iterator[Finding]:
    cfg = w.config
    uncorrected = {i: n for i, s in w.gpus.items() if (n := counter_growth(g.ecc_uncorrected_total for g in s)) > 0}
    xids = {i: n for i, s in w.gpus.items() if (n := counter_growth(g.xid_total for g in s)) > 0}
    corrected = {
        i: n
        for i, s in w.gpus.items()
        if (n := counter_growth(g.ecc_corrected_total for g in s)) >= cfg.ecc_corrected_info
    }
    span = fmt_duration(w.seconds(len(w.samples)))
    if uncorrected:
        yield Finding(
            Severity.FAIL,
            f"{sum(uncorrected.values())} uncorrectable ECC error(s) in the last {span}",
            subject=gpus_subject(uncorrected),
            cost="The process that touched the bad memory is killed; results computed before may be corrupt.",
            fix="Drain the GPU and reset it (the driver remaps the row on reset); resume from the last checkpoint "
            "before the error; ask the provider to replace the GPU if errors return.",
            evidence={"uncorrected_growth": uncorrected},
            command="nvidia-smi -q -d ECC,ROW_REMAPPER",
        )
    if xids:
        yield Finding(
            Severity.WARN,
            f"{sum(xids.values())} new Xid event(s) in the kernel log in the last {span}",
            subject=gpus_subject(xids),
            cost="An Xid is the driver reporting a GPU fault: from a crashed program (Xid 13, 31, 43) to failing "
            "memory, NVLink or PCIe (48, 74, 79, 92-95); the job may have crashed or slowed.",
            fix="Read the codes (dmesg | grep Xid) and run `redline doctor`, which sorts them into application "
            "faults and hardware faults.",
            evidence={"xid_growth": xids},
            command="dmesg -T | grep -i 'NVRM: Xid'",
        )
    if corrected:
        yield Finding(
            Severity.INFO,
            f"{sum(corrected.values())} corrected ECC errors in the last {span}",
            subject=gpus_subject(corrected),
            cost="Handled by the GPU and harmless by themselves; a steady stream points at a weak memory row "
            "that may turn into uncorrectable errors.",
            fix="Watch the counter; a reset lets the GPU remap the row (nvidia-smi -q -d ROW_REMAPPER shows pending "
            "remaps).",
            evidence={"corrected_growth": corrected},
            command="nvidia-smi -q -d ECC",
        )


def _link_known(g: GpuSample) -> bool:
    return (g.pcie_link_generation is not None and bool(g.pcie_link_generation_max)) or (
        g.pcie_link_width is not None and bool(g.pcie_link_width_max)
    )


def _link_down(g: GpuSample) -> bool:
    slow = g.pcie_link_generation is not None and bool(g.pcie_link_generation_max)
    narrow = g.pcie_link_width is not None and bool(g.pcie_link_width_max)
    return (slow and (g.pcie_link_generation or 0) < (g.pcie_link_generation_max or 0)) or (
        narrow and (g.pcie_link_width or 0) < (g.pcie_link_width_max or 0)
    )


def _link_text(generation: int | None, width: int | None) -> str:
    return " ".join(part for part in (generation and f"Gen{generation}", width and f"x{width}") if part)


def _link_gbps(generation: int | None, width: int | None) -> float | None:
    lane = PCIE_LANE_GBPS.get(generation or 0)
    return lane * width if lane and width else None


@rule("monitor.pcie_downgraded", Area.HARDWARE, "PCIe link slower or narrower than it can run, under load")
def pcie_downgraded(w: Window) -> Iterator[Finding]:
    """Idle GPUs lower their link speed to save power, which is normal: only loaded samples are judged."""
    groups: dict[tuple[int | None, int | None, int | None, int | None], list[Share]] = {}
    for index in w.gpus:
        share = share_under_load(w, index, _link_known, _link_down)
        if share is None or share.fraction < w.config.sustained_fraction:
            continue
        state = Counter(
            (g.pcie_link_generation, g.pcie_link_generation_max, g.pcie_link_width, g.pcie_link_width_max)
            for g in share.hits
        ).most_common(1)[0][0]
        groups.setdefault(state, []).append(share)
    for (gen, gen_max, width, width_max), shares in sorted(groups.items(), key=lambda kv: kv[1][0].index):
        indices = [s.index for s in shares]
        worst = max(shares, key=lambda s: s.fraction)
        now, best = _link_gbps(gen, width), _link_gbps(gen_max, width_max)
        yield Finding(
            Severity.FAIL,
            f"{gpus_subject(indices)} PCIe link at {_link_text(gen, width)} under load, capable of "
            f"{_link_text(gen_max, width_max)}"
            + title_figures(
                indices, worst.index, f"{worst.fraction:.0%} of {fmt_duration(worst.seconds)} under load", lead=None
            ),
            subject=gpus_subject(indices),
            cost=(
                f"Host-to-GPU copies top out at {now:.1f} of {best:.1f} GB/s per direction ({now / best:.0%}): "
                if now and best
                else "Host-to-GPU copies run at a fraction of the link's speed: "
            )
            + "data loading, offload and PCIe collectives slow down.",
            fix="Reseat the GPU or riser, check the slot wiring and the BIOS PCIe setting; ask the provider. A link "
            "that trains down under load can be a failing riser: watch the PCIe replay counter.",
            evidence={
                s.index: {
                    "fraction": round(s.fraction, 3),
                    "generation": gen,
                    "generation_max": gen_max,
                    "width": width,
                    "width_max": width_max,
                    "pcie_rx_bytes_per_second": median_of(g.pcie_rx_bytes_per_second for g in s.hits),
                    "pcie_tx_bytes_per_second": median_of(g.pcie_tx_bytes_per_second for g in s.hits),
                }
                for s in shares
            },
            command=f"nvidia-smi -i {','.join(map(str, indices))} --format=csv -l 1 --query-gpu="
            "index,pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,pcie.link.width.max,utilization.gpu",
        )
