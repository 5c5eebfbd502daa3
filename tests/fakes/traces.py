"""Eight-GPU training runs over time, good and bad, for `redline monitor` tests: the fake NVML, the host and
the runtime's step files move together, one tick (one second) at a time.

    trace = scenario("throttling", root=tmp_path)
    samples = trace.run()                      # one Sample per tick, through a real Sampler
    # or by hand:
    sampler = trace.sampler()
    for _ in range(trace.ticks):
        trace.advance()
        sample = sampler.sample()

Each tick sets every FakeGpu's state in NVML's units (percent, MHz, mW, KiB/s...), runs the counters
(energy, PCIe and NVLink bytes, host CPU seconds, swap, disk and network bytes) for the tick's second,
moves the clock on and appends the steps that finished to one JSON-lines file per rank, written as
redline.runtime.metrics writes them (now and then a line lands in two writes, as a reader can see it).
``affected_gpus`` names the GPUs a scenario singles out, so diagnosis tests can check they are the ones
blamed. Values are seeded per scenario: a trace is the same on every run.

Scenarios (``SCENARIOS``): healthy, throttling, power_cap, straggler, input_bound, memory_full,
foreign_process, pcie_downgrade, swapping, nvml_lost.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fakes.fake_nvml import (
    GPU_IDLE,
    HOST_CPUS,
    HW_SLOWDOWN,
    HW_THERMAL,
    SW_POWER_CAP,
    SW_THERMAL,
    FakeNvml,
    FakeProcess,
    eight_gpu_server,
)
from redline.hw.host_state import HostReading
from redline.monitor.sample import Sample
from redline.monitor.sampler import Sampler
from sysroot import SysRoot

GiB = 1 << 30
GB = 1e9
MB = 1e6
TICK_S = 1.0
START_TIME = 1_767_225_600.0  # 2026-01-01 00:00:00 UTC
DEFAULT_TICKS = 40
WORLD_SIZE = 8
JOB_UID = 1000
JOB_PID_BASE = 4100  # rank r runs as pid JOB_PID_BASE + r on GPU r
FOREIGN_PID = 28731
FOREIGN_UID = 1001
# the model every scenario trains: ~7B parameters, sequence 2048, 64 samples per optimizer step
TOKENS_PER_SAMPLE = 2048
SAMPLES_PER_STEP = 64
FLOPS_PER_TOKEN = 6 * 7e9
H100_DENSE_BF16 = 989e12


# ------------------------------------------------------------------------------------------- state


@dataclass
class GpuLoad:
    """One GPU during one tick, in everyday units (the trace turns them into NVML's)."""

    utilization: float = 0.0  # share of time a kernel ran
    memory_bandwidth: float = 0.0
    memory_used_gib: float = 0.6
    sm_mhz: int = 345
    power_w: float = 71.0
    power_limit_w: float | None = None  # None: the board's
    temperature_c: float = 31.0
    reasons: int = GPU_IDLE
    pcie_gen: int | None = None  # None: the board's maximum
    pcie_width: int | None = None
    pcie_tx_bytes_per_s: float = 0.0
    pcie_rx_bytes_per_s: float = 0.0
    nvlink_tx_bytes_per_s: float = 0.0
    nvlink_rx_bytes_per_s: float = 0.0
    sm_activity: float = 0.0
    tensor_activity: float = 0.0
    new_pcie_replays: int = 0  # added to the replay counter this tick
    job_process: bool = True  # the training job's rank holds memory on this GPU
    foreign_gib: float = 0.0  # memory held by a process outside the job (FOREIGN_PID)


@dataclass
class HostState:
    """The host during one tick: gauges, and the rates its counters grow at."""

    cpu_count: int = HOST_CPUS
    cpu_busy: float = 0.22
    cpu_iowait: float = 0.004
    load_1m: float = 50.0
    memory_total_bytes: int = 2048 * GiB
    memory_used_bytes: int = 410 * GiB
    swap_used_bytes: int = 0
    swap_in_bytes_per_s: float = 0.0
    swap_out_bytes_per_s: float = 0.0
    disk_read_bytes_per_s: float = 350 * MB
    disk_write_bytes_per_s: float = 4 * MB
    network_rx_bytes_per_s: float = 30 * MB
    network_tx_bytes_per_s: float = 28 * MB


@dataclass
class RankStep:
    """How one rank spends an optimizer step while this tick lasts (every rank shares ``time_s``: a
    data-parallel step ends when the slowest rank's gradients are reduced)."""

    time_s: float = 1.5
    data_s: float = 0.02
    compute_s: float = 1.3
    optimizer_s: float = 0.08
    comm_s: float = 0.1


@dataclass
class Tick:
    gpus: list[GpuLoad]
    host: HostState
    steps: list[RankStep] | None  # per rank; None: the job is not running
    nvml: str = "ok"  # ok | lost (every GPU answers GPU_IS_LOST) | unloaded (the driver is gone)
    kernel_log: list[str] = field(default_factory=list)  # lines the kernel logs during this tick


class FakeClock:
    """Seconds, moved only by ``advance``: the sampler's wall and monotonic clocks in a trace."""

    def __init__(self, start: float = START_TIME) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FakeHost:
    """Plays psutil for the sampler (``Sampler(host=...)``): the tick's gauges, and counters that grow
    at the tick's rates."""

    def __init__(self) -> None:
        self.state = HostState()
        self.counters = HostReading(
            cpu_total_seconds=8.4e7,  # about four days of uptime on 224 CPUs
            cpu_busy_seconds=1.1e7,
            cpu_iowait_seconds=2.1e5,
            swap_in_bytes_total=0.0,
            swap_out_bytes_total=0.0,
            disk_read_bytes_total=3.1e13,
            disk_write_bytes_total=2.2e12,
            network_rx_bytes_total=8.8e12,
            network_tx_bytes_total=7.9e12,
        )

    def run_for(self, seconds: float) -> None:
        s, c = self.state, self.counters
        cpu_seconds = s.cpu_count * seconds
        c.cpu_total_seconds = (c.cpu_total_seconds or 0) + cpu_seconds
        c.cpu_busy_seconds = (c.cpu_busy_seconds or 0) + s.cpu_busy * cpu_seconds
        c.cpu_iowait_seconds = (c.cpu_iowait_seconds or 0) + s.cpu_iowait * cpu_seconds
        for total, rate in (
            ("swap_in_bytes_total", s.swap_in_bytes_per_s),
            ("swap_out_bytes_total", s.swap_out_bytes_per_s),
            ("disk_read_bytes_total", s.disk_read_bytes_per_s),
            ("disk_write_bytes_total", s.disk_write_bytes_per_s),
            ("network_rx_bytes_total", s.network_rx_bytes_per_s),
            ("network_tx_bytes_total", s.network_tx_bytes_per_s),
        ):
            setattr(c, total, (getattr(c, total) or 0) + rate * seconds)

    def __call__(self) -> HostReading:
        s = self.state
        return dataclasses.replace(
            self.counters,
            cpu_count=s.cpu_count,
            load_1m=s.load_1m,
            memory_used_bytes=s.memory_used_bytes,
            memory_total_bytes=s.memory_total_bytes,
            swap_used_bytes=s.swap_used_bytes,
            notes=[],
        )


# ------------------------------------------------------------------------------------------- trace


class Trace:
    """One scenario played tick by tick; see the module docstring."""

    def __init__(
        self,
        name: str,
        description: str,
        affected_gpus: tuple[int, ...],
        script: Callable[[int, random.Random], Tick],
        ticks: int = DEFAULT_TICKS,
        root: Path | None = None,
    ) -> None:
        self.name = name
        self.description = description
        self.affected_gpus = affected_gpus
        self.ticks = ticks
        self.nvml: FakeNvml = eight_gpu_server("h100")
        self.host = FakeHost()
        self.clock = FakeClock()
        self.tick = -1  # the last tick applied
        self.root = root
        self.steps_dir = None if root is None else root / "metrics"
        self.job_pids = [JOB_PID_BASE + rank for rank in range(WORLD_SIZE)]
        self._script = script
        self._rng = random.Random(name)
        self._kernel_log = ["[    0.000000] Linux version 6.8.0-51-generic (buildd@lcy02-amd64-014)"]
        self._step = 0
        self._step_progress_s = 0.0
        self._held: dict[int, str] = {}  # rank -> the second half of a line written in two goes
        if root is not None:
            self._write_proc(SysRoot(root))

    # ---------------------------------------------------------------------------------- playing

    def advance(self) -> Tick:
        """Play the next tick: set the fakes to its state, run the counters and the clock for TICK_S, and
        write the steps that finished. Returns the tick's script."""
        self.tick += 1
        tick = self._script(self.tick, self._rng)
        self._set_nvml(tick.nvml)
        for rank, (gpu, load) in enumerate(zip(self.nvml.gpus, tick.gpus, strict=True)):
            _apply(gpu, load, self.job_pids[rank])
            if tick.nvml == "ok":
                gpu.run_for(TICK_S)
        self.host.state = tick.host
        self.host.run_for(TICK_S)
        self.clock.advance(TICK_S)
        self._kernel_log.extend(f"[{self.clock.now - START_TIME + 3.6e5:12.6f}] {line}" for line in tick.kernel_log)
        self._write_steps(tick.steps)
        return tick

    def at(self, tick: int) -> None:
        """Play ticks until ``tick`` is the last one applied (forward only)."""
        if tick < self.tick:
            raise ValueError(f"trace {self.name} is at tick {self.tick}; it cannot go back to {tick}")
        while self.tick < tick:
            self.advance()

    def kernel_log(self) -> str:
        """What `dmesg` would print now (the sampler's ``kernel_log``)."""
        return "\n".join(self._kernel_log) + "\n"

    @property
    def step_paths(self) -> list[str]:
        return [] if self.steps_dir is None else [str(self.steps_dir / "steps-{rank}.jsonl")]

    def sampler(self, **overrides: Any) -> Sampler:
        """A Sampler wired to this trace's fakes (``overrides`` replace any of its arguments)."""
        arguments: dict[str, Any] = {
            "nvml": self.nvml,
            "step_paths": self.step_paths,
            "clock": self.clock,
            "monotonic": self.clock,
            "host": self.host,
            "kernel_log": self.kernel_log,
            "proc_root": self.root or "/nonexistent-proc-root",
            "steps_from_start": True,
        }
        return Sampler(**(arguments | overrides))

    def run(self) -> list[Sample]:
        """Every remaining tick, sampled once after each."""
        samples = []
        with self.sampler() as sampler:
            while self.tick < self.ticks - 1:
                self.advance()
                samples.append(sampler.sample())
        return samples

    # ---------------------------------------------------------------------------------- NVML state

    def _set_nvml(self, state: str) -> None:
        if state == "unloaded":
            if self.nvml.unloaded is None:
                self.nvml.unload()
            return
        if self.nvml.unloaded is not None:
            self.nvml.reload()
            for gpu in self.nvml.gpus:  # a reloaded driver starts its counters again
                gpu.energy_mj = gpu.pcie_tx_bytes_total = gpu.pcie_rx_bytes_total = 0
                gpu.nvlink_tx_kib_total = gpu.nvlink_rx_kib_total = 0
                gpu.pcie_replay = gpu.ecc_volatile_corrected = gpu.ecc_volatile_uncorrected = 0
        for gpu in self.nvml.gpus:
            gpu.lost = state == "lost"

    # ---------------------------------------------------------------------------------- steps

    def _write_steps(self, steps: list[RankStep] | None) -> None:
        if self.steps_dir is None:
            return
        lines: dict[int, list[str]] = {rank: [] for rank in range(WORLD_SIZE)}
        if steps is not None:
            self._step_progress_s += TICK_S
            while self._step_progress_s >= steps[0].time_s:
                self._step_progress_s -= steps[0].time_s
                self._step += 1
                for rank, shape in enumerate(steps):
                    lines[rank].append(json.dumps(self._record(rank, shape)))
        else:
            self._step_progress_s = 0.0
        self.steps_dir.mkdir(parents=True, exist_ok=True)
        split = self.tick % 5 == 2  # now and then a line reaches the file in two writes
        for rank, rank_lines in lines.items():
            text = self._held.pop(rank, "") + "".join(line + "\n" for line in rank_lines)
            if split and text:
                cut = len(text) - len(rank_lines[-1]) // 2 - 1 if rank_lines else len(text)
                text, self._held[rank] = text[:cut], text[cut:]
            if text:
                with (self.steps_dir / f"steps-{rank}.jsonl").open("a", encoding="utf-8") as f:
                    f.write(text)

    def _record(self, rank: int, shape: RankStep) -> dict[str, Any]:
        """A StepRecord as the runtime writes it (redline.runtime.metrics.StepRecord.to_dict)."""
        jitter = 1 + self._rng.gauss(0, 0.01)
        time_s = shape.time_s * jitter
        samples_per_s = SAMPLES_PER_STEP / time_s
        tokens_per_s = samples_per_s * TOKENS_PER_SAMPLE
        return {
            "step": self._step,
            "time_s": round(time_s, 6),
            "data_s": round(shape.data_s * jitter, 6),
            "compute_s": round(shape.compute_s * jitter, 6),
            "optimizer_s": round(shape.optimizer_s, 6),
            "comm_s": round(shape.comm_s * jitter, 6),
            "samples": SAMPLES_PER_STEP,
            "tokens": SAMPLES_PER_STEP * TOKENS_PER_SAMPLE,
            "samples_per_s": round(samples_per_s, 4),
            "tokens_per_s": round(tokens_per_s, 1),
            "mfu_catalog": round(tokens_per_s * FLOPS_PER_TOKEN / (WORLD_SIZE * H100_DENSE_BF16), 4),
            "mfu_measured": None,
            "peak_memory_bytes": 66 * GiB + rank * 1024,
            "loss": round(1.7 + 2.5 * math.exp(-self._step / 400) + self._rng.gauss(0, 0.02), 4),
            "micro_batch": 2,
            "accumulation": 4,
            "skipped": False,
            "rank": rank,
        }

    def _write_proc(self, root: SysRoot) -> None:
        for pid in self.job_pids:
            root.add_process(pid, "python", JOB_UID)
        root.add_process(FOREIGN_PID, "python3", FOREIGN_UID)


def _apply(gpu: Any, load: GpuLoad, job_pid: int) -> None:
    """Set one FakeGpu to a tick's load, in NVML's units."""
    gpu.utilization_pct = round(100 * load.utilization)
    gpu.memory_utilization_pct = round(100 * load.memory_bandwidth)
    gpu.memory_used_mib = round(load.memory_used_gib * 1024)
    gpu.sm_clock_mhz = load.sm_mhz
    gpu.power_draw_mw = round(1000 * load.power_w)
    gpu.power_limit_mw = round(1000 * (load.power_limit_w or gpu.power_default_mw / 1000))
    gpu.temperature_c = round(load.temperature_c)
    gpu.clock_event_reasons = load.reasons
    gpu.pcie_gen = load.pcie_gen or gpu.pcie_gen_max
    gpu.pcie_width = load.pcie_width or gpu.pcie_width_max
    gpu.pcie_replay += load.new_pcie_replays
    gpu.pcie_tx_kbps = round(load.pcie_tx_bytes_per_s / 1024)
    gpu.pcie_rx_kbps = round(load.pcie_rx_bytes_per_s / 1024)
    gpu.nvlink_tx_kibps = round(load.nvlink_tx_bytes_per_s / 1024)
    gpu.nvlink_rx_kibps = round(load.nvlink_rx_bytes_per_s / 1024)
    gpu.gpm_sm_util_pct = 100 * load.sm_activity
    gpu.gpm_tensor_util_pct = 100 * load.tensor_activity
    job_gib = load.memory_used_gib - load.foreign_gib - 0.5  # the driver's own share is no process's
    gpu.processes = []
    if load.job_process:
        gpu.processes.append(FakeProcess(job_pid, used_memory=round(job_gib * GiB)))
    if load.foreign_gib:
        gpu.processes.append(FakeProcess(FOREIGN_PID, used_memory=round(load.foreign_gib * GiB)))


# ------------------------------------------------------------------------------------------- building blocks


def busy(rng: random.Random, **overrides: Any) -> GpuLoad:
    """An H100 training a 7B model with data parallelism: busy, steady clocks, heavy NVLink all-reduce."""
    load = GpuLoad(
        utilization=min(1.0, 0.98 + rng.uniform(-0.01, 0.02)),
        memory_bandwidth=0.42 + rng.uniform(-0.04, 0.04),
        memory_used_gib=71.5 + rng.uniform(-0.2, 0.2),
        sm_mhz=1980 - rng.choice((0, 0, 15, 30)),
        power_w=655 + rng.uniform(-25, 25),
        temperature_c=64 + rng.uniform(-2, 2),
        reasons=0,
        pcie_tx_bytes_per_s=0.3 * GB + rng.uniform(-0.05, 0.05) * GB,
        pcie_rx_bytes_per_s=1.6 * GB + rng.uniform(-0.2, 0.2) * GB,
        nvlink_tx_bytes_per_s=142 * GB + rng.uniform(-6, 6) * GB,
        nvlink_rx_bytes_per_s=142 * GB + rng.uniform(-6, 6) * GB,
        sm_activity=0.86 + rng.uniform(-0.02, 0.02),
        tensor_activity=0.55 + rng.uniform(-0.03, 0.03),
    )
    return dataclasses.replace(load, **overrides)


def idle(rng: random.Random, **overrides: Any) -> GpuLoad:
    load = GpuLoad(temperature_c=31 + rng.uniform(-1, 1), power_w=71 + rng.uniform(-2, 2), job_process=False)
    return dataclasses.replace(load, **overrides)


def steady_host(rng: random.Random, **overrides: Any) -> HostState:
    state = HostState(
        cpu_busy=0.22 + rng.uniform(-0.02, 0.02),
        load_1m=50 + rng.uniform(-3, 3),
        disk_read_bytes_per_s=350 * MB + rng.uniform(-30, 30) * MB,
    )
    return dataclasses.replace(state, **overrides)


def even_steps(rng: random.Random, **overrides: Any) -> list[RankStep]:
    return [dataclasses.replace(RankStep(), **overrides) for _ in range(WORLD_SIZE)]


def _ramp(t: int, start: int, end: int) -> float:
    """0 before ``start``, 1 from ``end``, linear in between."""
    return min(max((t - start) / (end - start), 0.0), 1.0)


# ------------------------------------------------------------------------------------------- scenarios


def _healthy(t: int, rng: random.Random) -> Tick:
    return Tick(gpus=[busy(rng) for _ in range(8)], host=steady_host(rng), steps=even_steps(rng))


THROTTLED = (2, 5)


def _throttling(t: int, rng: random.Random) -> Tick:
    """GPUs 2 and 5 heat up from tick 8 (a failing fan, a blocked inlet): past 85 C the driver slows them
    (sw thermal, then hw slowdown), their clocks fall and every rank waits for them at the all-reduce."""
    heat = _ramp(t, 8, 20)
    gpus = []
    for i in range(8):
        if i not in THROTTLED:
            gpus.append(busy(rng))
            continue
        temperature = 66 + 24 * heat + rng.uniform(-0.5, 0.5)
        reasons = (SW_THERMAL if temperature >= 85 else 0) | (HW_SLOWDOWN | HW_THERMAL if temperature >= 89 else 0)
        slow = 1.0 if not reasons else (0.78 if reasons & HW_SLOWDOWN else 0.88)
        gpus.append(
            busy(rng, temperature_c=temperature, reasons=reasons, sm_mhz=round(1980 * slow), power_w=655 * slow)
        )
    slowest = min(g.sm_mhz for g in gpus) / 1980
    step_time = 1.5 / slowest
    steps = []
    for rank in range(WORLD_SIZE):
        compute = 1.3 / (gpus[rank].sm_mhz / 1980)
        steps.append(RankStep(time_s=step_time, compute_s=compute, comm_s=step_time - compute - 0.1))
    return Tick(gpus=gpus, host=steady_host(rng), steps=steps)


def _power_cap(t: int, rng: random.Random) -> Tick:
    """The provider capped every GPU at 500 W (of 700): under load they sit at the cap with sw_power_cap set
    and the clocks float well below their maximum."""
    gpus = [
        busy(
            rng,
            power_limit_w=500.0,
            power_w=500 - rng.uniform(0, 3),
            reasons=SW_POWER_CAP,
            sm_mhz=1500 + rng.choice((-60, -30, 0, 30)),
            temperature_c=55 + rng.uniform(-2, 2),
            tensor_activity=0.50 + rng.uniform(-0.03, 0.03),
        )
        for _ in range(8)
    ]
    return Tick(gpus=gpus, host=steady_host(rng), steps=even_steps(rng, time_s=1.85, compute_s=1.65))


STRAGGLER = 6


def _straggler(t: int, rng: random.Random) -> Tick:
    """Rank 6 reads its shard slowly (data_s 0.55 s a step), so GPU 6 idles between steps while the other
    seven spin in NCCL waiting for its gradients: they look busy, it does not, every step is slower."""
    gpus = []
    for i in range(8):
        if i == STRAGGLER:
            gpus.append(busy(rng, utilization=0.71 + rng.uniform(-0.03, 0.03), power_w=480 + rng.uniform(-20, 20)))
        else:
            # NCCL's wait kernels count as "a kernel ran", but occupy few SMs
            gpus.append(busy(rng, sm_activity=0.63 + rng.uniform(-0.02, 0.02), tensor_activity=0.40))
    steps = [
        RankStep(time_s=2.05, data_s=0.55 if rank == STRAGGLER else 0.02, comm_s=0.1 if rank == STRAGGLER else 0.63)
        for rank in range(WORLD_SIZE)
    ]
    return Tick(gpus=gpus, host=steady_host(rng), steps=steps)


def _input_bound(t: int, rng: random.Random) -> Tick:
    """The data loader cannot keep up: every CPU is busy decoding, every GPU waits (30-50% busy) and most
    of each step is data_s."""
    gpus = [
        busy(
            rng,
            utilization=0.40 + 0.1 * math.sin(t / 3 + i) + rng.uniform(-0.02, 0.02),
            power_w=300 + rng.uniform(-40, 40),
            temperature_c=48 + rng.uniform(-2, 2),
            reasons=GPU_IDLE if rng.random() < 0.3 else 0,
            sm_activity=0.35,
            tensor_activity=0.22,
            nvlink_tx_bytes_per_s=55 * GB,
            nvlink_rx_bytes_per_s=55 * GB,
        )
        for i in range(8)
    ]
    host = steady_host(rng, cpu_busy=0.97 + rng.uniform(-0.02, 0.02), load_1m=236 + rng.uniform(-4, 4))
    return Tick(gpus=gpus, host=host, steps=even_steps(rng, time_s=3.4, data_s=1.95, compute_s=1.3))


def _memory_full(t: int, rng: random.Random) -> Tick:
    """A batch size at the edge: 97% of every GPU's memory in use (one fragmentation spike from an OOM)."""
    total_gib = 81559 / 1024
    gpus = [busy(rng, memory_used_gib=total_gib * (0.97 + rng.uniform(-0.004, 0.004))) for _ in range(8)]
    return Tick(gpus=gpus, host=steady_host(rng), steps=even_steps(rng))


FOREIGN_GPU = 4


def _foreign_process(t: int, rng: random.Random) -> Tick:
    """Someone else's forgotten notebook kernel (pid FOREIGN_PID, another user) holds 22 GiB on GPU 4 and
    does nothing; the job's rank 4 has that much less room."""
    gpus = [busy(rng) for _ in range(8)]
    gpus[FOREIGN_GPU] = busy(rng, memory_used_gib=71.5, foreign_gib=22.0)  # the job gets 22 GiB less
    return Tick(gpus=gpus, host=steady_host(rng), steps=even_steps(rng))


DOWNGRADED = (3, 6)


def _pcie_downgrade(t: int, rng: random.Random) -> Tick:
    """Under load GPU 3's link trained at x8 of x16 and GPU 6's at Gen3 of Gen5 (a riser or a reseat
    away from fixed); both replay packets now and then and move host data at a fraction of the others."""
    gpus = [busy(rng) for _ in range(8)]
    gpus[3] = busy(rng, pcie_width=8, new_pcie_replays=rng.choice((0, 0, 1, 3)), pcie_rx_bytes_per_s=1.1 * GB)
    gpus[6] = busy(rng, pcie_gen=3, new_pcie_replays=rng.choice((0, 1)), pcie_rx_bytes_per_s=0.9 * GB)
    return Tick(gpus=gpus, host=steady_host(rng), steps=even_steps(rng, time_s=1.6, data_s=0.12))


def _swapping(t: int, rng: random.Random) -> Tick:
    """Too many DataLoader workers for the RAM: from tick 6 the host swaps in and out hard, iowait rises,
    batches arrive late and the GPUs wait."""
    pressure = _ramp(t, 6, 12)
    host = steady_host(
        rng,
        memory_used_bytes=round((410 + 1620 * pressure) * GiB),
        swap_used_bytes=round(pressure * (12 + 0.2 * t) * GiB),
        swap_in_bytes_per_s=pressure * (140 + rng.uniform(-30, 30)) * MB,
        swap_out_bytes_per_s=pressure * (190 + rng.uniform(-30, 30)) * MB,
        cpu_iowait=0.004 + 0.16 * pressure,
        load_1m=50 + 120 * pressure,
    )
    gpus = [busy(rng, utilization=0.98 - 0.25 * pressure + rng.uniform(-0.02, 0.02)) for _ in range(8)]
    steps = even_steps(rng, time_s=1.5 + 0.6 * pressure, data_s=0.02 + 0.6 * pressure)
    return Tick(gpus=gpus, host=host, steps=steps)


LOST_AT, UNLOADED_AT, BACK_AT, JOB_BACK_AT = 10, 12, 22, 24


def _nvml_lost(t: int, rng: random.Random) -> Tick:
    """At tick 10 the GPUs fall off the bus (Xid 79) and the job dies; at 12 the operator unloads the driver,
    at 22 it is back (its counters start from zero) and at 24 the job resumes from its checkpoint."""
    if t < LOST_AT or t >= BACK_AT:
        state = "ok"
    elif t < UNLOADED_AT:
        state = "lost"
    else:
        state = "unloaded"
    running = t < LOST_AT or t >= JOB_BACK_AT
    gpus = [busy(rng) if running else idle(rng) for _ in range(8)]
    log = []
    if t == LOST_AT:
        log = [
            f"NVRM: Xid (PCI:0000:{bus:02x}:00): 79, pid=4100, name=python, GPU has fallen off the bus."
            for bus in (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)
        ]
    if t == UNLOADED_AT:
        log = ["nvidia-nvlink: Unregistered Nvlink Core, major device number 234"]
    return Tick(
        gpus=gpus, host=steady_host(rng), steps=even_steps(rng) if running else None, nvml=state, kernel_log=log
    )


_SCENARIOS: dict[str, tuple[str, tuple[int, ...], Callable[[int, random.Random], Tick]]] = {
    "healthy": ("all eight GPUs busy at ~98%, steady clocks, no events", (), _healthy),
    "throttling": ("GPUs 2 and 5 overheat and throttle; everyone waits for them", THROTTLED, _throttling),
    "power_cap": ("every GPU held at a 500 W cap with sw_power_cap", tuple(range(8)), _power_cap),
    "straggler": ("rank 6's slow input stalls every step", (STRAGGLER,), _straggler),
    "input_bound": ("host CPUs saturated, GPUs 30-50% busy, steps mostly data_s", tuple(range(8)), _input_bound),
    "memory_full": ("97% of every GPU's memory in use", tuple(range(8)), _memory_full),
    "foreign_process": ("another user's idle process holds 22 GiB on GPU 4", (FOREIGN_GPU,), _foreign_process),
    "pcie_downgrade": ("GPU 3 at x8 of x16, GPU 6 at Gen3 of Gen5, under load", DOWNGRADED, _pcie_downgrade),
    "swapping": ("the host swaps hard; steps wait for data", (), _swapping),
    "nvml_lost": ("GPUs lost at tick 10, driver gone 12-21, back at 22", tuple(range(8)), _nvml_lost),
}
SCENARIOS = tuple(_SCENARIOS)


def scenario(name: str, root: Path | None = None, ticks: int = DEFAULT_TICKS) -> Trace:
    """A fresh trace of the named scenario. ``root``: a directory for the step files (root/metrics) and a
    fake /proc naming the GPU processes; None: no steps, process names unknown."""
    if name not in _SCENARIOS:
        raise KeyError(f"no scenario {name!r}; there are {', '.join(SCENARIOS)}")
    description, affected, script = _SCENARIOS[name]
    return Trace(name, description, affected, script, ticks=ticks, root=root)
