"""Other processes' CPU use: the arithmetic of two readings, and a live watch that tells ours from theirs."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

import psutil
import pytest

from builders import healthy_server
from redline.hw import cpu_busy as cpu_busy_module
from redline.hw.cpu_busy import CpuReading, CpuWatch, cpu_busy
from redline.hw.snapshot import BUSY_RATIO, BusyProcess, CpuBusy, snapshot_from_dict


def test_others_are_the_busy_time_of_our_cpus_less_our_own():
    before = CpuReading(10.0, busy_s=100.0, own_s=5.0, others={7: ("make", "bob", 1.0), 8: ("cc1", "bob", 2.0)})
    after = CpuReading(
        12.0,
        busy_s=104.0,
        own_s=6.0,  # of 4 busy CPU-seconds in 2 s, 1 was ours
        others={7: ("make", "bob", 1.01), 8: ("python3", "eve", 4.0), 9: ("sshd", "root", 1.0)},
    )
    busy = cpu_busy(before, after, cpus=2, usable=2.0, load_1m=6.1)
    assert busy.others_cores == 1.5 and busy.taken_ratio == 0.75 and busy.busy
    # pid 8 was reused (another name), 9 started during the sample, 7 used under MIN_PROCESS_CORES: none is named
    assert busy.top == []
    after.others[8] = ("cc1", "bob", 4.0)
    busy = cpu_busy(before, after, cpus=2, usable=2.0, load_1m=6.1)
    (cc1,) = busy.top
    assert (cc1.pid, cc1.name, cc1.user, cc1.cpu_cores) == (8, "cc1", "bob", 1.0)
    assert busy.describe() == "other processes kept 1.5 of 2 CPUs busy (load 6.1; cc1 (bob) 1.0)"


@pytest.mark.parametrize(
    ("cpus", "usable", "others", "taken"),
    [
        (2, 2.0, 0.4, 0.2),  # a browser on a laptop: not busy
        (2, 2.0, 2.0, 1.0),
        (64, 2.0, 62.0, 0.0),  # a quota of 2 on 64 CPUs: the other 62 are theirs to use
        (64, 2.0, 63.0, 0.5),
        (8, 8.0, 9.5, 1.0),  # more than the CPUs (rounding of the clock): capped
    ],
)
def test_taken_ratio_counts_what_others_leave_of_our_cores(cpus, usable, others, taken):
    busy = CpuBusy(sample_s=0.5, cpus=cpus, usable_cores=usable, others_cores=others)
    assert busy.taken_ratio == pytest.approx(taken)
    assert busy.busy is (taken >= BUSY_RATIO)


def test_a_snapshot_keeps_its_sample_through_json():
    """`redline probe --json > snap.json` on the busy machine, `redline doctor --from snap.json` elsewhere."""
    snapshot = healthy_server()
    snapshot.host.cpu_busy = CpuBusy(0.5, 2, 2.0, 1.8, 6.1, [BusyProcess(42, "python3", "alice", 1.0)])
    again = snapshot_from_dict(snapshot.to_dict())
    assert again.host.cpu_busy == snapshot.host.cpu_busy and again.host.cpu_busy.busy
    del (old := snapshot.to_dict())["host"]["cpu_busy"]  # a snapshot from before the field
    assert snapshot_from_dict(old).host.cpu_busy is None


SPIN = "import time\nend = time.monotonic() + {s}\nwhile time.monotonic() < end: pass\nprint('done')"


def test_a_live_watch_names_a_stranger_and_not_our_own_children(monkeypatch):
    """A spinning child of ours is our work; a spinning process that is not ours (the shell that started it
    exited, so it is nobody's child here) is another's, and is named by its short name, never its command line."""
    monkeypatch.setattr(cpu_busy_module, "TOP_PROCESSES", 100)  # a shared test machine has busier ones
    ours = subprocess.Popen([sys.executable, "-c", SPIN.format(s=3)], stdout=subprocess.DEVNULL)
    stranger = subprocess.run(
        ["sh", "-c", f'{sys.executable} -c "{SPIN.format(s=3)}" >/dev/null 2>&1 & echo $!'],
        capture_output=True,
        text=True,
        check=True,
    )
    pid = int(stranger.stdout.strip())
    try:
        time.sleep(0.5)  # both interpreters started
        watch = CpuWatch()
        time.sleep(1.0)
        busy = watch.stop(healthy_server(0).host)
    finally:
        ours.kill()
        ours.wait()
        with contextlib.suppress(psutil.Error):
            psutil.Process(pid).kill()
    named = {p.pid: p for p in busy.top}
    assert ours.pid not in named
    assert pid in named and named[pid].name.startswith("python")
    assert busy.cpus == len(os.sched_getaffinity(0)) and 0.9 <= busy.sample_s < 5
    assert busy.others_cores >= named[pid].cpu_cores * 0.5  # the whole machine's count holds the stranger too
