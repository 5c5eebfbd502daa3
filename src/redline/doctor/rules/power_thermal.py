"""Are the GPUs allowed to run at full speed? Power limits, throttling, application clocks, temperature."""

from __future__ import annotations

from collections.abc import Iterator

from redline.doctor.context import Audit, gpu_subject
from redline.doctor.engine import rule
from redline.doctor.model import Area, Finding, Severity

# clock-event reasons that mean the hardware is protecting itself, not just sitting at its power budget
HARDWARE_THROTTLE = {
    "hw_slowdown": "hardware slowdown (power brake, over-temperature or failing power supply)",
    "sw_thermal_slowdown": "driver thermal slowdown (GPU or memory too hot)",
    "hw_thermal_slowdown": "hardware thermal slowdown",
    "hw_power_brake_slowdown": "external power brake (the chassis or PSU asserted it)",
}
POWER_LIMIT_TOLERANCE = 0.98  # enforced limits are rounded by the driver
TDP_TOLERANCE = 0.90
NEAR_SLOWDOWN_C = 5
APP_CLOCK_TOLERANCE = 0.95


@rule("power_thermal.power-capped", Area.POWER_THERMAL, "Power limit below the default or the datasheet TDP")
def power_capped(audit: Audit) -> Iterator[Finding]:
    lowered, low_sku = [], []
    for gpu in audit.gpus:
        p = gpu.power
        if p.enforced_limit_w is None:
            continue
        if p.default_limit_w and p.enforced_limit_w < p.default_limit_w * POWER_LIMIT_TOLERANCE:
            lowered.append(gpu)
        elif (spec := audit.spec(gpu)) and spec.tdp_w and p.enforced_limit_w < spec.tdp_w * TDP_TOLERANCE:
            low_sku.append(gpu)
    if lowered:
        worst = min(lowered, key=lambda g: (g.power.enforced_limit_w or 0) / (g.power.default_limit_w or 1))
        limits = sorted({round(g.power.enforced_limit_w or 0) for g in lowered})
        yield Finding(
            Severity.WARN,
            f"Power limit lowered to {'-'.join(map(str, limits[:: max(1, len(limits) - 1)]))} W "
            f"(default {worst.power.default_limit_w:.0f} W)",
            subject=gpu_subject(lowered),
            cost="Under heavy matmul load the GPU drops its clocks to stay under the cap: up to "
            f"{1 - (worst.power.enforced_limit_w or 0) / (worst.power.default_limit_w or 1):.0%} less power, "
            "typically a similar or somewhat smaller loss of throughput.",
            fix="Ask the provider to restore the default limit (nvidia-smi -pl needs root on the host).",
            evidence={
                x.index: {"enforced_w": x.power.enforced_limit_w, "default_w": x.power.default_limit_w} for x in lowered
            },
            command="nvidia-smi -q -d POWER",
        )
    if low_sku:
        g = low_sku[0]
        spec = audit.spec(g)
        yield Finding(
            Severity.INFO,
            f"Board power limit {g.power.enforced_limit_w:.0f} W is below the datasheet maximum "
            f"{spec.tdp_w:.0f} W ({spec.key})"
            if spec
            else "Board power limit below datasheet",
            subject=gpu_subject(low_sku),
            cost="This board ships configured below the maximum TDP: expect below-datasheet sustained clocks.",
            fix="If the provider sold the full-power SKU, ask them; otherwise budget for the lower clocks.",
            evidence={x.index: x.power.enforced_limit_w for x in low_sku},
            command="nvidia-smi -q -d POWER",
        )


@rule("power_thermal.throttled", Area.POWER_THERMAL, "Clocks held down by thermal or hardware slowdown")
def throttled(audit: Audit) -> Iterator[Finding]:
    hit = {g.index: [r for r in g.clock_event_reasons or [] if r in HARDWARE_THROTTLE] for g in audit.gpus}
    hit = {i: reasons for i, reasons in hit.items() if reasons}
    if hit:
        reasons = sorted({r for rs in hit.values() for r in rs})
        yield Finding(
            Severity.FAIL,
            "Clocks throttled: " + "; ".join(HARDWARE_THROTTLE[r] for r in reasons),
            subject=gpu_subject([g for g in audit.gpus if g.index in hit]),
            cost="The GPU runs below its rated clocks: every kernel is slower, and the cause is physical.",
            fix="Check cooling (fans, airflow, inlet temperature) and power delivery; ask the provider.",
            evidence={i: rs for i, rs in hit.items()}
            | {"sm_mhz": {g.index: [g.clocks.sm_mhz, g.clocks.sm_max_mhz] for g in audit.gpus if g.index in hit}},
            command="nvidia-smi -q -d PERFORMANCE",
        )


@rule("power_thermal.power-cap-active", Area.POWER_THERMAL, "GPU is at its power cap right now")
def power_cap_active(audit: Audit) -> Iterator[Finding]:
    capped = [g for g in audit.gpus if "sw_power_cap" in (g.clock_event_reasons or [])]
    if capped:
        yield Finding(
            Severity.INFO,
            "Software power cap is limiting clocks",
            subject=gpu_subject(capped),
            cost="Normal at full load on dense matmuls; at light load it means a low power limit.",
            fix="Nothing if the GPU is busy; see power_thermal.power-capped for a lowered limit.",
            evidence={g.index: {"draw_w": g.power.draw_w, "limit_w": g.power.enforced_limit_w} for g in capped},
            command="nvidia-smi -q -d PERFORMANCE,POWER",
        )


@rule("power_thermal.app-clocks", Area.POWER_THERMAL, "Application clocks set below the maximum")
def app_clocks(audit: Audit) -> Iterator[Finding]:
    # the reason bit says the setting is what holds the clocks now; on parts whose default application
    # clock is below max (V100: 1312 of 1530 MHz) auto boost normally lifts them, and the bit stays clear
    held = [
        g
        for g in audit.gpus
        if "applications_clocks_setting" in (g.clock_event_reasons or [])
        and g.clocks.applications_sm_mhz
        and g.clocks.sm_max_mhz
        and g.clocks.applications_sm_mhz < g.clocks.sm_max_mhz * APP_CLOCK_TOLERANCE
    ]
    if held:
        g = held[0]
        applications_mhz, max_mhz = g.clocks.applications_sm_mhz or 0, g.clocks.sm_max_mhz or 1  # both set: above
        yield Finding(
            Severity.WARN,
            f"Clocks held by an application-clock setting ({applications_mhz} MHz SM, max {max_mhz} MHz)",
            subject=gpu_subject(held),
            cost=f"The SMs run at most {applications_mhz / max_mhz:.0%} of their maximum "
            "clock: compute-bound kernels slow down in proportion.",
            fix=f"Raise them (needs root on the host): nvidia-smi -i {g.index} -ac "
            f"{g.clocks.memory_max_mhz or '<mem MHz>'},{max_mhz}; or nvidia-smi -rac for the defaults.",
            evidence={
                x.index: {"applications_sm_mhz": x.clocks.applications_sm_mhz, "sm_max_mhz": x.clocks.sm_max_mhz}
                for x in held
            },
            command="nvidia-smi -q -d CLOCK",
        )


@rule("power_thermal.near-slowdown", Area.POWER_THERMAL, "GPU temperature near its slowdown threshold")
def near_slowdown(audit: Audit) -> Iterator[Finding]:
    hot = [
        g
        for g in audit.gpus
        if g.thermal.temperature_c is not None
        and g.thermal.slowdown_c
        and g.thermal.temperature_c >= g.thermal.slowdown_c - NEAR_SLOWDOWN_C
    ]
    if hot:
        yield Finding(
            Severity.WARN,
            f"GPU within {NEAR_SLOWDOWN_C} °C of its slowdown temperature",
            subject=gpu_subject(hot),
            cost="Any more heat and the GPU lowers its clocks (thermal slowdown).",
            fix="Improve airflow or lower the inlet temperature; ask the provider to check the cooling.",
            evidence={
                g.index: {"temperature_c": g.thermal.temperature_c, "slowdown_c": g.thermal.slowdown_c} for g in hot
            },
            command="nvidia-smi -q -d TEMPERATURE",
        )
