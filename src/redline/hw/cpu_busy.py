"""Who else keeps the CPUs busy: other processes' CPU time over a sample, against the CPUs this process may use.

A job on a host whose cores other processes already fill runs its threads in the gaps: on a 2-core machine
at load 6 a training step took 7.6x longer with torch's default threads than with one. Load average alone
cannot tell our own work from theirs, so a ``CpuWatch`` reads, at its start and its stop, the busy time
(user, nice, system) of the CPUs this process may run on, the CPU time of our own process tree (the
children it reaped included, so a DataLoader's workers are ours), and each other process's CPU time (for
the list of the busiest). Their difference over the elapsed time is ``CpuBusy``: the doctor judges one taken
during the probe, the bench records one per suite with its figures.

Processes are named by their short name (the kernel's comm) and user, as `ps -o comm,user` shows them to
anyone; command lines, which may carry secrets, are never read.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import psutil

from redline.hw.snapshot import BusyProcess, CpuBusy, HostInfo

# how many of the busiest other processes a CpuBusy names, and the least CPU (cores) one must have used
TOP_PROCESSES = 5
MIN_PROCESS_CORES = 0.05


@dataclass
class CpuReading:
    """CPU time at one instant: of our CPUs, of our process tree, of each other process."""

    at_s: float  # time.monotonic()
    busy_s: float  # user + nice + system seconds of the CPUs we may use, since boot
    own_s: float  # our process tree's CPU seconds, reaped children included
    # pid -> (name, user, user + system seconds), for every process outside our tree
    others: dict[int, tuple[str | None, str | None, float]]


def _own_root() -> int:
    """The process whose tree is "us": under torchrun the launcher (its other ranks are this run's too)."""
    return os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else os.getpid()


def _affinity() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS: no affinity, every CPU
        return list(range(os.cpu_count() or 1))


def _busy_seconds(cpus: list[int]) -> float:
    """user + nice + system seconds of ``cpus`` (guest time is inside user; iowait, irq and steal are not a
    process's): all CPUs together when ours are all of them, else the per-CPU lines of ours."""
    per_cpu = psutil.cpu_times(percpu=True)
    chosen = per_cpu if len(cpus) >= len(per_cpu) else [per_cpu[i] for i in cpus if i < len(per_cpu)]
    return sum(t.user + t.nice + t.system for t in chosen)


def _tree_seconds(root: psutil.Process) -> tuple[float, set[int]]:
    """CPU seconds of ``root`` and its live descendants, with the children each has reaped; and their pids."""
    total, pids = 0.0, set()
    for process in (root, *root.children(recursive=True)):
        try:
            t = process.cpu_times()
        except psutil.Error:  # ended between the listing and the read: its time moved to its parent's children
            continue
        total += t.user + t.system + t.children_user + t.children_system
        pids.add(process.pid)
    return total, pids


def read_cpu(cpus: list[int] | None = None) -> CpuReading:
    """One ``CpuReading`` now, of ``cpus`` (default: those this process may run on)."""
    at_s = time.monotonic()
    busy_s = _busy_seconds(cpus if cpus is not None else _affinity())
    own_s, own = _tree_seconds(psutil.Process(_own_root()))
    others: dict[int, tuple[str | None, str | None, float]] = {}
    for process in psutil.process_iter(["name", "username", "cpu_times"]):
        info = process.info
        times = info.get("cpu_times")
        if process.pid in own or times is None:  # ours, or not readable (gone, another container's)
            continue
        others[process.pid] = (info.get("name"), info.get("username"), times.user + times.system)
    return CpuReading(at_s, busy_s, own_s, others)


def usable_cores(host: HostInfo | None, cpus: int) -> float:
    """The cores this process may use of ``cpus``: its cgroup quota where that is less."""
    quota = host.cgroup_cpu_limit_cores if host else None
    return min(float(cpus), quota) if quota else float(cpus)


def cpu_busy(before: CpuReading, after: CpuReading, *, cpus: int, usable: float, load_1m: float | None) -> CpuBusy:
    """Other processes' CPU use between two readings (a clock that did not move counts as a millisecond)."""
    elapsed_s = max(after.at_s - before.at_s, 1e-3)
    others_s = max(0.0, (after.busy_s - before.busy_s) - (after.own_s - before.own_s))
    top = []
    for pid, (name, user, seconds) in after.others.items():
        earlier = before.others.get(pid)
        if earlier is not None and earlier[0] == name:  # the same process, not a reused pid
            cores = (seconds - earlier[2]) / elapsed_s
            if cores >= MIN_PROCESS_CORES:
                top.append(BusyProcess(pid=pid, name=name, user=user, cpu_cores=round(cores, 2)))
    top.sort(key=lambda p: -p.cpu_cores)
    return CpuBusy(
        sample_s=round(elapsed_s, 3),
        cpus=cpus,
        usable_cores=usable,
        others_cores=round(others_s / elapsed_s, 2),
        load_1m=load_1m,
        top=top[:TOP_PROCESSES],
    )


class CpuWatch:
    """Other processes' CPU use from the watch's start to its ``stop``, on the CPUs this process may use."""

    def __init__(self) -> None:
        self._cpus = _affinity()
        self._start = read_cpu(self._cpus)

    def stop(self, host: HostInfo | None = None, *, at_least_s: float = 0.0) -> CpuBusy:
        """The sample since the start; sleeps first until ``at_least_s`` have passed (a probe that finished
        sooner than a meaningful sample). ``host`` gives the cgroup quota."""
        remaining_s = at_least_s - (time.monotonic() - self._start.at_s)
        if remaining_s > 0:
            time.sleep(remaining_s)
        end = read_cpu(self._cpus)
        load = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
        cpus = len(self._cpus)
        return cpu_busy(self._start, end, cpus=cpus, usable=usable_cores(host, cpus), load_1m=load)
