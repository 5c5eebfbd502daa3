"""What a diagnosis rule sees: a window of monitor samples, its thresholds, and the helpers the rules share.

A field that is ``None`` ("not available here", see ``redline.monitor.sample``) is never evidence either
way: a sample without it is left out of that rule's count, and a window with too few usable samples (or too
short) raises nothing from the rules that need a duration.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from itertools import pairwise

from redline.monitor.sample import GpuSample, HostSample, Sample, StepSample
from redline.units import GiB, MiB, fmt_index_list


@dataclass(frozen=True)
class DiagnosisConfig:
    """Thresholds of the diagnosis rules. The defaults suit a training job sampled once a second."""

    # --- what a window must hold before a rule that needs a duration may judge it
    # ten readings at least: with fewer, one odd sample is 10%+ of the evidence
    min_samples: int = 10
    # and ten seconds: at a 5 s interval ten samples is enough; at 0.1 s, one second of anything is noise
    min_duration_s: float = 10.0
    # "sustained": the condition held in at least this share of the samples that could show it
    sustained_fraction: float = 0.6

    # --- load. NVML utilisation is the share of the sample period in which any kernel ran, not SM
    # occupancy: a training loop keeps it at 90-100%, so half the time is a loose, safe "under load".
    busy_utilization: float = 0.5
    # a GPU below this for the whole window runs nothing worth mentioning (monitoring tools poke it)
    idle_utilization: float = 0.05
    # a GPU above this on average takes part in something (an input-bound job may sit at 20-40%)
    in_use_utilization: float = 0.1

    # --- clocks. Throttling is judged only under load: idle GPUs drop their clocks legitimately.
    # Hardware slowdown (heat, power brake) is never normal, so a fifth of the loaded time is enough.
    hardware_throttle_fraction: float = 0.2
    # the power cap is normal on dense matmuls at full TDP: only a sustained cap is worth saying
    power_cap_fraction: float = 0.6
    # at the cap, an H100 on dense bf16 GEMMs holds ~85-90% of its max SM clock; well below means a cap
    # that costs real speed (a lowered limit, a hot or inefficient board)
    power_cap_clock_ratio: float = 0.75
    # enforced limits are rounded by the driver; a GPU more than 2% below its peers' limit was lowered
    power_limit_peer_tolerance: float = 0.98

    # --- GPU memory: at 95% the allocator has little headroom left for a spike or fragmentation
    memory_full_ratio: float = 0.95

    # --- stragglers across the GPUs of one job
    min_job_gpus: int = 3  # "lower than the median of the others" needs at least two others
    # a synchronous job keeps every rank's GPU near 100% (NCCL kernels spin while waiting), so a rank
    # 20 points below the others leaves its GPU idle for part of every step
    straggler_utilization_gap: float = 0.2
    # identical GPUs under the same load boost within a few percent of each other; 10% lower is a cause
    straggler_clock_ratio: float = 0.9
    # step data: a rank whose own work (data + compute + optimizer) takes 15% longer than the others' median,
    # step after step; ranks of one job differ by a few percent from sequence lengths and kernel jitter
    straggler_step_ratio: float = 1.15
    # ... and the others spend at least half of that excess waiting (exposed communication or time
    # outside their phases): then the job is synchronous and runs at the straggler's pace
    straggler_wait_share: float = 0.5
    min_steps: int = 5  # steps per rank (and in all) before step data is judged

    # --- input-bound
    # a fifth of each step waiting for the next batch: the GPU idles for that fifth
    input_data_share: float = 0.2
    # half of each step waiting: the job runs at half speed or less, fix it before anything else
    input_data_share_fail: float = 0.5
    # without step data: GPUs of the job running kernels at most 60% of the time ...
    input_gpu_utilization_max: float = 0.6
    # ... while the host's CPUs (all cores together) are nearly saturated, or wait on I/O
    host_cpu_saturated: float = 0.85
    host_iowait_high: float = 0.2

    # --- GPU memory held outside the job, or on an idle GPU: smaller than 1 GiB is a CUDA context
    # (300-500 MiB) or a display server, which costs nothing worth reporting
    holder_bytes: int = 1 * GiB

    # --- host swap: 1 MiB/s is 256 pages a second going to or from disk, far above the trickle of
    # idle pages a healthy host swaps out, and the swapping must hold for 30% of the window, so a burst
    # (a checkpoint written through the page cache) does not count
    swap_bytes_per_second: float = 1 * MiB
    swap_fraction: float = 0.3

    # --- errors: a few corrected ECC errors are background; a stream of them in one window points at a
    # weak memory row that the GPU will remap at its next reset
    ecc_corrected_info: int = 10


@dataclass
class Window:
    """The samples a diagnosis judges, in time order, with the lookups every rule would otherwise redo."""

    samples: list[Sample]
    config: DiagnosisConfig = field(default_factory=DiagnosisConfig)
    # pids of the job's processes, as NVML reports them (same PID namespace as the sampler's)
    job_pids: set[int] | None = None

    def __post_init__(self) -> None:
        self.samples = sorted(self.samples, key=lambda s: s.time)

    @cached_property
    def interval_s(self) -> float:
        """The sampling interval: the median gap between samples (robust to one late sample); 0 if unknown."""
        gaps = [b.time - a.time for a, b in pairwise(self.samples) if b.time > a.time]
        return statistics.median(gaps) if gaps else 0.0

    def seconds(self, count: int) -> float:
        """The time ``count`` samples cover."""
        return count * self.interval_s

    def sustained(self, count: int) -> bool:
        """Whether ``count`` usable samples are enough evidence (in number and in time) to judge at all."""
        return count >= self.config.min_samples and self.seconds(count) >= self.config.min_duration_s

    @cached_property
    def rows(self) -> list[dict[int, GpuSample]]:
        """Each sample's readable (not lost) GPUs by index: what rules compare across GPUs at one instant."""
        return [{g.index: g for g in s.gpus if not g.lost} for s in self.samples]

    @cached_property
    def gpus(self) -> dict[int, list[GpuSample]]:
        """Each GPU's readable samples, in time order."""
        out: dict[int, list[GpuSample]] = {}
        for row in self.rows:
            for index, g in row.items():
                out.setdefault(index, []).append(g)
        return dict(sorted(out.items()))

    @cached_property
    def hosts(self) -> list[HostSample]:
        return [s.host for s in self.samples if s.host is not None]

    @cached_property
    def steps(self) -> list[StepSample]:
        return [st for s in self.samples for st in s.steps]

    def loaded(self, index: int) -> list[GpuSample]:
        """This GPU's samples under load: the only ones where clocks and link speed say anything."""
        busy = self.config.busy_utilization
        return [g for g in self.gpus.get(index, []) if g.utilization_ratio is not None and g.utilization_ratio >= busy]

    def mean_utilization(self, index: int) -> float | None:
        return mean_of(g.utilization_ratio for g in self.gpus.get(index, []))

    @cached_property
    def pid_gpus(self) -> set[int]:
        """GPUs on which one of ``job_pids`` holds memory at some point in the window. Empty when no job pid
        shows up at all (pids of another PID namespace, or a job that has not touched a GPU yet): then the
        window cannot tell the job's processes from anyone else's."""
        if not self.job_pids:
            return set()
        return {i for i, series in self.gpus.items() for g in series for p in g.processes if p.pid in self.job_pids}

    def job_gpus(self, min_utilization: float) -> list[int]:
        """The GPUs of the job: those running a job process when ``job_pids`` is given and any of them shows
        up on a GPU; otherwise those whose mean utilisation reaches ``min_utilization``."""
        if self.pid_gpus:
            return sorted(self.pid_gpus)
        return [i for i in self.gpus if (u := self.mean_utilization(i)) is not None and u >= min_utilization]


# ------------------------------------------------------------------------------------------ helpers


def mean_of(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def median_of(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def gpus_subject(indices: Iterable[int]) -> str:
    """'GPU 3' or 'GPUs 0-3,5', as the doctor's gpu_subject writes them: one finding covers every GPU."""
    ordered = sorted(indices)
    return f"GPU {ordered[0]}" if len(ordered) == 1 else f"GPUs {fmt_index_list(ordered)}"


def ranks_subject(ranks: Iterable[int]) -> str:
    ordered = sorted(ranks)
    return f"rank {ordered[0]}" if len(ordered) == 1 else f"ranks {fmt_index_list(ordered)}"


def title_figures(
    indices: Sequence[int], worst: int, detail: str, *, lead: str | None = "for", noun: str = "GPU"
) -> str:
    """The figures at the end of a title: ' for 72% of 60 s' (or ' (72% of 60 s)' without a lead word) for
    one GPU or rank; ' (worst GPU 3: 72% of 60 s)' when the finding covers several."""
    if len(indices) > 1:
        return f" (worst {noun} {worst}: {detail})"
    if lead is None:
        return f" ({detail})"
    return f" {lead} {detail}" if lead else f" {detail}"


def sentence_case(text: str) -> str:
    """Upper-case the first letter only ('driver thermal slowdown (GPU ...)' keeps its 'GPU')."""
    return text[:1].upper() + text[1:]


def mhz_text(hertz: float | None) -> str:
    return "?" if hertz is None else f"{hertz / 1e6:.0f}"


def whole_mhz(hertz: float | None) -> int | None:
    """Hertz as whole MHz, for evidence."""
    return None if hertz is None else round(hertz / 1e6)


def rounded(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def counter_growth(values: Iterable[int | None]) -> int:
    """How much a counter grew: the sum of its rises between readings. A fall is a driver or host restart
    that reset it, not negative growth, and a missing reading bridges to the next one."""
    known = [v for v in values if v is not None]
    return sum(max(0, b - a) for a, b in pairwise(known))


@dataclass(frozen=True)
class Share:
    """How often a condition held on one GPU, over the samples where it could be judged."""

    index: int
    judged: list[GpuSample]
    hits: list[GpuSample]
    seconds: float  # time the judged samples cover

    @property
    def fraction(self) -> float:
        return len(self.hits) / len(self.judged)


def share_under_load(
    w: Window, index: int, known: Callable[[GpuSample], bool], hit: Callable[[GpuSample], bool]
) -> Share | None:
    """The condition over this GPU's loaded samples that carry the fields it needs; None when too few."""
    judged = [g for g in w.loaded(index) if known(g)]
    if not w.sustained(len(judged)):
        return None
    return Share(index, judged, [g for g in judged if hit(g)], w.seconds(len(judged)))


def reasons_of(g: GpuSample) -> set[str]:
    return set(g.clock_event_reasons or [])


def has_reasons(g: GpuSample) -> bool:
    return g.clock_event_reasons is not None


def clock_detail(hits: list[GpuSample]) -> tuple[float | None, float | None]:
    """Median SM clock while the condition held, and the GPU's maximum SM clock."""
    return median_of(g.sm_clock_hertz for g in hits), median_of(g.sm_clock_max_hertz for g in hits)


def clock_cost(clock: float | None, clock_max: float | None) -> str:
    if clock is None or not clock_max:
        return "the SM clock drops"
    return f"SM clock {mhz_text(clock_max)} → {mhz_text(clock)} MHz, ~{1 - clock / clock_max:.0%} slower compute"
