"""What a count option is checked against: the tasks this user may have, the cores, and the refusal's words,
the same from the library's config as from the command line."""

from __future__ import annotations

import resource
from pathlib import Path

import pytest

from redline.errors import BadInput
from redline.hw.limits import Cap, rank_cap, task_cap, thread_cap, worker_cap
from redline.runtime.config import DataConfig, NumericsConfig
from redline.runtime.launch import Nodes, resolve_nproc_per_node
from sysroot import SysRoot

HUGE = 99999999999999999999


@pytest.fixture
def no_rlimit(monkeypatch: pytest.MonkeyPatch) -> None:
    """RLIMIT_NPROC unlimited, as for root: the fake tree alone decides."""
    monkeypatch.setattr(resource, "getrlimit", lambda _: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def container(tmp_path: Path, *, cores: int, pids: int | None) -> SysRoot:
    """A cgroup v2 container of ``cores`` CPUs' quota and ``pids`` tasks (None: no pids limit)."""
    root = SysRoot(tmp_path)
    root.write("/proc/self/cgroup", "0::/\n")
    root.write("/sys/fs/cgroup/cpu.max", f"{cores * 100000} 100000")
    if pids is not None:
        root.write("/sys/fs/cgroup/pids.max", pids)
    root.write("/proc/sys/kernel/threads-max", 190000)
    root.write("/proc/sys/kernel/pid_max", 32768)
    return root


def test_the_smallest_task_limit_binds_and_says_which_it_is(tmp_path: Path, no_rlimit: None) -> None:
    assert task_cap(container(tmp_path, cores=1, pids=None).sysfs()) == Cap(32768, "the kernel's pid_max is 32768")
    fs = container(tmp_path, cores=1, pids=3).sysfs()
    assert task_cap(fs) == Cap(3, "its cgroup's pids.max is 3")
    assert worker_cap(fs) == Cap(3, "its cgroup's pids.max is 3")  # under the cores' 4
    assert task_cap(SysRoot(tmp_path / "bare").sysfs()) is None  # nothing limits them


def test_processes_follow_the_usable_cores_and_ranks_the_gpus(tmp_path: Path, no_rlimit: None) -> None:
    fs = container(tmp_path, cores=1, pids=None).sysfs()
    assert worker_cap(fs) == Cap(4, "4 per usable CPU core, 1 here")
    assert rank_cap(0, fs) == Cap(4, "4 per usable CPU core, 1 here, or one per CUDA GPU, 0 here")
    assert rank_cap(8, fs).most == 8  # one rank per GPU, whatever the cores


def test_the_library_and_the_command_line_refuse_a_count_in_the_same_words() -> None:
    cap = worker_cap()
    words = (
        f"num_workers {HUGE} is more DataLoader workers per rank than this host can run: at most {cap.most} ({cap.why})"
    )
    with pytest.raises(BadInput) as caught:
        DataConfig(num_workers=HUGE)
    assert str(caught.value) == words
    DataConfig(num_workers=cap.most)  # the cap itself is allowed
    from redline.runtime.config import check_settings

    with pytest.raises(BadInput) as caught:
        check_settings({"num_workers": HUGE})
    assert str(caught.value) == f"--num-workers: {words}"
    threads = thread_cap()
    with pytest.raises(BadInput, match=rf"^cpu_threads {threads.most + 1} is more CPU threads per rank than this"):
        NumericsConfig(cpu_threads=threads.most + 1)


def test_gpus_are_counted_only_for_a_count_the_cores_do_not_allow() -> None:
    counted: list[int] = []

    def gpus() -> int:
        counted.append(1)
        return 0

    assert resolve_nproc_per_node("2", Nodes(), None, gpus) == (2, "as given")
    assert not counted  # counting costs a child process that imports torch
    with pytest.raises(BadInput) as caught:
        resolve_nproc_per_node(str(HUGE), Nodes(), None, gpus)
    assert counted == [1]
    cap = rank_cap(0)
    assert str(caught.value) == (
        f"--nproc-per-node {HUGE} is more processes per node than this host can run: at most {cap.most} ({cap.why})"
    )
