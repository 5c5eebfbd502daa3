"""Diagnosis rules on clocks under load: thermal and hardware slowdown, other throttling, the power cap."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from redline.doctor.model import Area, Finding, Severity
from redline.doctor.rules.power_thermal import HARDWARE_THROTTLE
from redline.monitor.diagnose import rule
from redline.monitor.window import (
    Share,
    Window,
    clock_cost,
    clock_detail,
    gpus_subject,
    has_reasons,
    median_of,
    mhz_text,
    reasons_of,
    sentence_case,
    share_under_load,
    title_figures,
    whole_mhz,
)
from redline.units import fmt_duration

# Clock-event reasons that are not throttling. gpu_idle: clocks drop because nothing runs.
# applications_clocks_setting and display_clock_setting: the clocks sit where a setting puts them (the
# doctor's power_thermal.app-clocks judges a low setting from the snapshot). sync_boost: the GPU follows the
# slowest member of its sync-boost group, whose own reason bit names the cause.
NOT_THROTTLING = frozenset({"gpu_idle", "applications_clocks_setting", "display_clock_setting", "sync_boost"})
POWER_CAP = "sw_power_cap"
# hardware protecting itself (heat, power delivery): the doctor's list, with its descriptions
HARDWARE_REASONS = frozenset(HARDWARE_THROTTLE)
OTHER_REASON_TEXT = {
    "board_limit": "a board-level clock limit",
    "reliability": "a reliability voltage limit",
}


def _throttle_evidence(share: Share, among: Callable[[str], bool]) -> dict[str, Any]:
    """What a throttling finding shows per GPU: how often, which reasons, clocks, power and temperature."""
    return {
        "fraction": round(share.fraction, 3),
        "under_load_s": round(share.seconds, 1),
        "reasons": dict(Counter(r for g in share.hits for r in reasons_of(g) if among(r))),
        "sm_clock_mhz": whole_mhz(median_of(g.sm_clock_hertz for g in share.hits)),
        "sm_clock_max_mhz": whole_mhz(median_of(g.sm_clock_max_hertz for g in share.judged)),
        "temperature_celsius": median_of(g.temperature_celsius for g in share.hits),
        "slowdown_celsius": median_of(g.temperature_slowdown_celsius for g in share.judged),
        "power_watts": median_of(g.power_watts for g in share.hits),
        "power_limit_watts": median_of(g.power_limit_watts for g in share.judged),
    }


def _top_reason(share: Share, among: Callable[[str], bool]) -> str:
    return Counter(r for g in share.hits for r in reasons_of(g) if among(r)).most_common(1)[0][0]


@rule("monitor.thermal", Area.POWER_THERMAL, "Clocks held down by thermal or hardware slowdown under load")
def thermal(w: Window) -> Iterator[Finding]:
    shares = [
        share
        for i in w.gpus
        if (share := share_under_load(w, i, has_reasons, lambda g: bool(reasons_of(g) & HARDWARE_REASONS)))
        and share.fraction >= w.config.hardware_throttle_fraction
    ]
    if not shares:
        return
    indices = [s.index for s in shares]
    worst = max(shares, key=lambda s: (s.fraction, median_of(g.temperature_celsius for g in s.hits) or 0.0))
    reason = _top_reason(worst, HARDWARE_REASONS.__contains__)
    temperature = median_of(g.temperature_celsius for g in worst.hits)
    at = "" if temperature is None else f" at {temperature:.0f} °C"
    clock, clock_max = clock_detail(worst.hits)
    yield Finding(
        Severity.FAIL,
        f"{gpus_subject(indices)} throttled by {reason}"
        + title_figures(indices, worst.index, f"{worst.fraction:.0%} of {fmt_duration(worst.seconds)} under load{at}"),
        subject=gpus_subject(indices),
        cost=f"{sentence_case(HARDWARE_THROTTLE[reason])}: {clock_cost(clock, clock_max)} on GPU {worst.index} "
        "while it lasts, and in a synchronous job every GPU waits for the slowest.",
        fix="Check cooling (fans, airflow, inlet temperature, a blocked heatsink) and power delivery (PSU, cables, "
        "a chassis power brake); ask the provider, with these figures.",
        evidence={s.index: _throttle_evidence(s, HARDWARE_REASONS.__contains__) for s in shares},
        command=f"nvidia-smi -i {worst.index} -q -d PERFORMANCE,TEMPERATURE",
    )


def _other_reason(reason: str) -> bool:
    return reason not in NOT_THROTTLING and reason != POWER_CAP and reason not in HARDWARE_REASONS


@rule("monitor.throttling", Area.POWER_THERMAL, "Clocks limited under load by reasons other than power or heat")
def throttling(w: Window) -> Iterator[Finding]:
    shares = [
        share
        for i in w.gpus
        if (share := share_under_load(w, i, has_reasons, lambda g: any(map(_other_reason, reasons_of(g)))))
        and share.fraction >= w.config.hardware_throttle_fraction
    ]
    if not shares:
        return
    indices = [s.index for s in shares]
    worst = max(shares, key=lambda s: s.fraction)
    reason = _top_reason(worst, _other_reason)
    clock, clock_max = clock_detail(worst.hits)
    yield Finding(
        Severity.WARN,
        f"{gpus_subject(indices)} clocks limited by {reason}"
        + title_figures(indices, worst.index, f"{worst.fraction:.0%} of {fmt_duration(worst.seconds)} under load"),
        subject=gpus_subject(indices),
        cost=f"{sentence_case(OTHER_REASON_TEXT.get(reason, 'a clock limit'))} holds the GPU below its rated "
        f"clocks: {clock_cost(clock, clock_max)} on GPU {worst.index} while it lasts.",
        fix="Ask the provider why the board limits its clocks (nvidia-smi -q -d PERFORMANCE names the reason); "
        "a newer driver may report it more precisely.",
        evidence={s.index: _throttle_evidence(s, _other_reason) for s in shares},
        command=f"nvidia-smi -i {worst.index} -q -d PERFORMANCE",
    )


@rule("monitor.power_limit", Area.POWER_THERMAL, "GPU held at its power cap under load, with the cost in clocks")
def power_limit(w: Window) -> Iterator[Finding]:
    cfg = w.config
    shares = [
        share
        for i in w.gpus
        if (share := share_under_load(w, i, has_reasons, lambda g: POWER_CAP in reasons_of(g)))
        and share.fraction >= cfg.power_cap_fraction
    ]
    if not shares:
        return
    limits = {i: median_of(g.power_limit_watts for g in series) for i, series in w.gpus.items()}
    names = {i: next((g.name for g in series if g.name), None) for i, series in w.gpus.items()}

    def peer_limit(index: int) -> float | None:
        """The highest limit among GPUs of the same model: what this one could be allowed."""
        same = [v for i, v in limits.items() if v is not None and names[i] == names[index]]
        return max(same) if same else None

    def clock_ratio(share: Share) -> float | None:
        clock, clock_max = clock_detail(share.hits)
        return clock / clock_max if clock is not None and clock_max else None

    lowered = [
        s.index
        for s in shares
        if (mine := limits[s.index]) is not None
        and (peer := peer_limit(s.index))
        and mine < peer * cfg.power_limit_peer_tolerance
    ]
    slow = [s.index for s in shares if (r := clock_ratio(s)) is not None and r < cfg.power_cap_clock_ratio]
    indices = [s.index for s in shares]
    # the GPU to name: the one with the lowest lowered limit, else the one that loses most clock
    low = min(lowered, key=lambda i: limits[i] or 0.0) if lowered else None
    worst = (
        next(s for s in shares if s.index == low)
        if low is not None
        else min(shares, key=lambda s: clock_ratio(s) or 1.0)
    )
    draw = median_of(g.power_watts for g in worst.hits)
    limit = limits[worst.index]
    clock, clock_max = clock_detail(worst.hits)
    figures = (
        f"{worst.fraction:.0%} of {fmt_duration(worst.seconds)} under load, "
        + (f"drawing {draw:.0f} of {limit:.0f} W, " if draw is not None and limit is not None else "")
        + f"SM {mhz_text(clock)} of {mhz_text(clock_max)} MHz"
    )
    if low is not None:
        cost = (
            f"GPU {low}'s limit of {limits[low]:.0f} W is below the {peer_limit(low):.0f} W of its peers: it runs "
            "slower than they do, and a synchronous job runs at its pace."
        )
    elif slow:
        cost = f"At the cap the GPU gives up clock speed: {clock_cost(clock, clock_max)} on GPU {worst.index}."
    else:
        cost = (
            "Normal on dense matmuls at full board power: the GPU trades a little clock for power "
            f"({clock_cost(clock, clock_max)})."
        )
    yield Finding(
        Severity.WARN if lowered or slow else Severity.INFO,
        f"{gpus_subject(indices)} held at the power cap" + title_figures(indices, worst.index, figures),
        subject=gpus_subject(indices),
        cost=cost,
        fix="Compare Enforced with Default Power Limit (nvidia-smi -q -d POWER) and ask the provider to restore a "
        "lowered limit (nvidia-smi -pl needs root on the host); at the default limit, a cooler GPU holds higher "
        "clocks at the same power.",
        evidence={s.index: _throttle_evidence(s, POWER_CAP.__eq__) for s in shares}
        | {"lowered_limit": lowered, "clock_below_ratio": slow},
        command=f"nvidia-smi -i {worst.index} -q -d POWER,PERFORMANCE",
    )
