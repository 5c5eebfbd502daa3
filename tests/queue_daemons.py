"""The queue's daemon for the tests, for real: a daemon process per test (started by the CLI on first use, or
by the test with its options), jobs that are real processes, `redline` commands as a user types them. A plugin
(tests/conftest.py names it): the ``queue`` fixture is a queue folder of the test's own."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import run_cli
from redline.queue.client import QueueUnavailable, request

WAIT_S = 180.0  # a hang guard only: every wait below ends as soon as the jobs reach their states


@pytest.fixture
def queue(tmp_path: Path):
    """A queue directory of the test's own; whatever daemon and jobs the test started are stopped after."""
    directory = tmp_path / "q"
    yield {"REDLINE_QUEUE_DIR": str(directory)}
    stop_daemon(directory)
    for pid_file in directory.glob("jobs/*/*/pid.json"):
        for key in ("pid", "shim"):
            with contextlib.suppress(ProcessLookupError, PermissionError, ValueError):
                os.killpg(json.loads(pid_file.read_text())[key], signal.SIGKILL)
    # anything else of this queue's still running (a daemon a failed test left, a shim that had not written its
    # pid): its command line names the directory
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError):
            if entry.name.isdigit() and str(directory).encode() in (entry / "cmdline").read_bytes():
                os.kill(int(entry.name), signal.SIGKILL)


def stop_daemon(directory: Path) -> None:
    try:
        pid = int((directory / "daemon.lock").read_text().strip())
        os.kill(pid, signal.SIGTERM)
    except (OSError, ValueError):
        return
    wait_for(lambda: not alive(pid), "the daemon's end")


def alive(pid: int) -> bool:
    """Whether ``pid`` runs: not gone, and not a zombie waiting for its parent (this test, or init) to reap it."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def start_daemon(directory: Path, *options: str) -> subprocess.Popen:
    """The daemon started as the systemd unit starts it, with ``options``; returns once it answers."""
    directory.mkdir(parents=True, exist_ok=True)
    daemon = subprocess.Popen(
        [sys.executable, "-m", "redline", "queue", "daemon", "--dir", str(directory), *options],
        stdout=subprocess.DEVNULL,
        stderr=open(directory / "daemon.log", "ab"),  # noqa: SIM115 (the child keeps it)
    )
    wait_for(lambda: (directory / "queue.sock").exists() and request({"op": "status"}, directory, start=False))
    return daemon


def wait_for(condition, what: str = "the queue"):
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        try:
            result = condition()
        except (FileNotFoundError, ConnectionRefusedError, QueueUnavailable):
            result = None
        if result:
            return result
        time.sleep(0.05)
    raise AssertionError(f"{what} did not get there in {WAIT_S} s")


def jobs(env: dict[str, str]) -> dict[int, dict]:
    return {j["id"]: j for j in request({"op": "jobs", "all": True}, Path(env["REDLINE_QUEUE_DIR"]))["jobs"]}


def until(env: dict[str, str], job: int, *states: str) -> dict:
    return wait_for(lambda: (j := jobs(env)[job])["state"] in states and j, f"job {job} in {states}")


def submit(env: dict[str, str], *args: str) -> int:
    result = run_cli("submit", "--json", *args, env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["id"]
