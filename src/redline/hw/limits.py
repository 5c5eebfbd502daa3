"""How many processes and threads this host lets a job start: what a count the user types is checked against.

A count option (DataLoader workers, processes per node, CPU threads) above what the machine can run is refused
before anything starts, in one line that says the most and why: hundreds of loader processes on two cores
take the machine down with the job, and a launcher asked for 10^20 ranks fails deep inside torchrun.

- CPU work: each process or thread wants a core; past the usable cores (the affinity, cut to the cgroup's CPU
  quota: ``usable_cores``) they only take turns. A thread is held to one per CPU. Processes may usefully
  outnumber the cores a few times, as one that waits (a DataLoader worker on storage, a CPU rank rehearsing a
  GPU plan on its collectives) leaves its core to the others: ``PROCESSES_PER_CORE`` each.
- Tasks: the kernel counts processes and threads as tasks, and stops a user at the smallest of its
  RLIMIT_NPROC (``ulimit -u``; root is exempt), its cgroup's ``pids.max``, and the machine's ``threads-max``
  and ``pid_max``. Past that a fork fails.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass

from redline.errors import BadInput
from redline.hw.host import cgroup_pids_limit, usable_cores, usable_cpus
from redline.hw.sysfs import SysFs

# beyond a few per core, processes only take turns, and memory: each holds its own interpreter (a CPU rank
# its own torch, ~220 MiB; a DataLoader worker its copy of the dataset object and the batches it prefetches)
PROCESSES_PER_CORE = 4


@dataclass(frozen=True)
class Cap:
    """The most of something this host can run, and why: the words a refusal gives."""

    most: int
    why: str


def task_cap(fs: SysFs | None = None) -> Cap | None:
    """The most tasks (processes and threads) this user may have at once, and the limit that says so; None
    where nothing limits them."""
    fs = fs or SysFs()
    found: list[Cap] = []
    soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    if soft != resource.RLIM_INFINITY and os.geteuid() != 0:  # the kernel does not apply it to root
        found.append(Cap(soft, f"RLIMIT_NPROC, ulimit -u, is {soft}"))
    pids = cgroup_pids_limit(fs)
    if pids is not None:
        found.append(Cap(pids, f"its cgroup's pids.max is {pids}"))
    for name in ("threads-max", "pid_max"):
        value = fs.read_int(f"/proc/sys/kernel/{name}")
        if value is not None:
            found.append(Cap(value, f"the kernel's {name} is {value}"))
    return min(found, key=lambda cap: cap.most, default=None)


def worker_cap(fs: SysFs | None = None) -> Cap:
    """DataLoader worker processes one rank may start."""
    cores = usable_cores(fs)
    return _within_tasks(Cap(PROCESSES_PER_CORE * cores, f"{PROCESSES_PER_CORE} per usable CPU core, {cores} here"), fs)


def thread_cap(fs: SysFs | None = None) -> Cap:
    """CPU threads one process may usefully run: one per CPU it may run on (more only take turns)."""
    cpus = usable_cpus()
    return _within_tasks(Cap(cpus, f"one per CPU this process may run on, {cpus} here"), fs)


def rank_cap(cuda_gpus: int, fs: SysFs | None = None) -> Cap:
    """Processes one node may launch for a job: one per CUDA GPU, or, where that is more, as many as the cores
    hold (CPU ranks)."""
    cores = usable_cores(fs)
    most = max(cuda_gpus, PROCESSES_PER_CORE * cores)
    why = f"{PROCESSES_PER_CORE} per usable CPU core, {cores} here, or one per CUDA GPU, {cuda_gpus} here"
    return _within_tasks(Cap(most, why), fs)


def pid_cap(fs: SysFs | None = None) -> Cap | None:
    """The largest process id this kernel hands out (``pid_max``); None where it does not say."""
    value = (fs or SysFs()).read_int("/proc/sys/kernel/pid_max")
    return None if value is None else Cap(value, f"the kernel's pid_max is {value}")


def check_count(name: str, value: int, what: str, cap: Cap) -> None:
    """BadInput, one line, when ``value`` (of the option or setting ``name``, counting ``what``) is over ``cap``."""
    if value > cap.most:
        raise BadInput(f"{name} {value} is more {what} than this host can run: at most {cap.most} ({cap.why})")


def _within_tasks(cap: Cap, fs: SysFs | None) -> Cap:
    tasks = task_cap(fs)
    return tasks if tasks is not None and tasks.most < cap.most else cap
