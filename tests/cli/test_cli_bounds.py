"""Counts and paths a user types are bounded before anything starts: a count past what this host can run is
one line and exit 2 (never hundreds of processes, never torchrun's traceback), and a FIFO, a device or a folder
where a file is expected (or a file where a folder is) is refused without being read, never hanging."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from test_cli_bad_input import one_line

from conftest import FIXTURES, run_cli

HUGE = "99999999999999999999"
HANG_GUARD_S = 300  # a refusal takes seconds; this only turns a hang into a failure on a loaded machine
TOUCHES = "import pathlib, sys\npathlib.Path(sys.argv[1]).touch()\n"  # a script that only says it ran


def refused(args: list[str], needle: str, cwd: Path) -> str:
    """`redline ARGS` in ``cwd`` refuses with one line holding ``needle``, exit 2, within the hang guard."""
    try:
        result = run_cli(*args, cwd=cwd, timeout=HANG_GUARD_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"redline {' '.join(args)} hung (still running after {HANG_GUARD_S} s)")
    return one_line(result, needle)


@pytest.fixture
def scratch(tmp_path: Path) -> Path:
    """A folder holding a FIFO no one writes (``fifo``), a script that touches ``ran``, and a tiny factory."""
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "train.py").write_text(TOUCHES)
    (tmp_path / "tinynet.py").write_text(
        "import torch\ndef build():\n    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()), (8,)\n"
    )
    return tmp_path


# --------------------------------------------------------------------------------------------------- counts


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--num-workers", HUGE], f"--num-workers: num_workers {HUGE} is more DataLoader workers per rank than this "),
        (["--nproc-per-node", HUGE], f"--nproc-per-node {HUGE} is more processes per node than this host can run"),
        (["--cpu-threads", HUGE], f"--cpu-threads: cpu_threads {HUGE} is more CPU threads per rank than this host"),
    ],
)
def test_run_refuses_a_count_past_the_host_before_the_script_starts(
    scratch: Path, args: list[str], needle: str
) -> None:
    line = refused(["run", *args, "train.py", "ran"], needle, scratch)
    assert "at most" in line
    assert not (scratch / "ran").exists()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["run", "--dry-run", "--nnodes", HUGE, "--rdzv-endpoint", "127.0.0.1:29400", "train.py"], "MAX <= 16384"),
        (["tune", "--dry-run", "--nproc-per-node", HUGE, "train.py"], "is more processes per node than this host"),
        (["tune", "--dry-run", "--space", f"num_workers=1,{HUGE}", "train.py"], "--space num_workers: num_workers"),
        (["plan", "-m", "gpt2", "--hardware", "8xh100-sxm", "--num-workers", HUGE], "--num-workers: num_workers"),
        (["monitor", "--once", "--job-pid", HUGE], f"--job-pid {HUGE} is not a process id on this host"),
    ],
)
def test_a_count_past_the_host_is_refused_by_every_command_that_takes_it(
    scratch: Path, args: list[str], needle: str
) -> None:
    refused(args, needle, scratch)


# ---------------------------------------------------------------------------------------------------- paths

SNAPSHOT = str(FIXTURES / "h100x8-faulty.json")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["plan", "-m", "gpt2", "--hardware", "8xh100-sxm", "-o", "fifo"], "output file fifo is a FIFO, not a file"),
        (["tune", "--dry-run", "-o", "fifo", "train.py"], "output file fifo is a FIFO, not a file"),
        (["tune", "--dry-run", "--html", "fifo", "train.py"], "output file fifo is a FIFO, not a file"),
        (["tune", "--dry-run", "--cache-dir", "fifo", "train.py"], "--cache-dir fifo is a FIFO, not a folder"),
        (["infer", "-m", "tinynet:build", "--html", "fifo"], "output file fifo is a FIFO, not a file"),
        (["infer", "-m", "tinynet:build", "--weights", "fifo"], "--weights fifo is a FIFO, not a file"),
        (["infer", "-m", "tinynet:build", "-o", "fifo"], "fifo is a FIFO: an artifact is saved as a folder"),
        (["run", "--dry-run", "--metrics", "fifo", "train.py"], "--metrics: metrics_path fifo is a FIFO, not a file"),
        (["run", "--dry-run", "--checkpoint-dir", "fifo", "train.py"], "checkpoint_dir fifo is a FIFO, not a folder"),
        (["run", "--dry-run", "fifo"], "script fifo is a FIFO, not a file"),
        (["monitor", "--once", "--record", "fifo"], "monitor record fifo is a FIFO, not a file"),
        (["monitor", "--once", "--steps", "fifo"], "--steps fifo is a FIFO, not a file"),
        (["report", "fifo"], "monitor record fifo is a FIFO, not a file"),
        (["doctor", "--from", "fifo"], "snapshot fifo is a FIFO, not a file"),
        (["doctor", "--from", "/dev/zero"], "snapshot /dev/zero is a character device, not a file"),
        (["doctor", "--from", SNAPSHOT, "--bench-file", "fifo"], "bench results fifo is a FIFO, not a file"),
        (["doctor", "--from", SNAPSHOT, "--html", "fifo"], "output file fifo is a FIFO, not a file"),
        (["run", "--plan", "fifo", "train.py"], "plan file fifo is a FIFO, not a file"),
        (["plan", "-m", "/dev/zero"], "config file /dev/zero is a character device, not a file"),
    ],
)
def test_a_fifo_or_a_device_where_a_file_is_expected_is_refused_unread(
    scratch: Path, args: list[str], needle: str
) -> None:
    refused(args, needle, scratch)
    assert not (scratch / "ran").exists()


# ------------------------------------------------------------------------------------------- trusted folders


def test_run_refuses_a_checkpoint_directory_others_may_write_before_the_script_starts(scratch: Path) -> None:
    """The resume would refuse it inside the script (its .metadata is a pickle: code); the launch says so first."""
    saved = scratch / "ckpt" / "step-00000001"
    saved.mkdir(parents=True)
    (saved / ".metadata").write_bytes(b"anything")
    (saved / ".metadata").chmod(0o666)
    line = refused(
        ["run", "--checkpoint-dir", "ckpt", "train.py", "ran"], "refusing checkpoint directory ckpt", scratch
    )
    assert line.endswith(
        f"is writable by its group and everyone (mode 0666), and it runs as code here: chmod -R go-w {scratch / 'ckpt'}"
    )
    assert not (scratch / "ran").exists()
