"""The process that runs one attempt of a job and outlives the daemon: Slurm's slurmstepd, in small.

    python shim.py ATTEMPT_DIR    (started by the daemon; reads ATTEMPT_DIR/run.json)

It starts the job (its argv, never a shell) in a session of its own, as the job's user, with the environment
captured at submit and the devices placed; writes ``pid.json`` once the job runs; stops the job's whole process
group at its time limit or when asked (SIGTERM to the shim: a cancel); and writes ``exit.json`` when the job
ends. Both files are written whole (a temporary file renamed), so a reader never sees half of one.

The daemon locks ``ATTEMPT_DIR/lock`` before starting the shim and hands the locked descriptor down: the lock
is held from before the shim exists until the shim exits, whatever kills whom. A daemon that restarts knows an
attempt whose lock it can take has no shim any more (``daemon.Daemon.recover``).

Standard library only, and run as a script: it starts in milliseconds and imports nothing of redline.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

GRACE_S = 10.0  # between SIGTERM and SIGKILL to the job's process group


def write_whole(path: Path, data: dict) -> None:
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(data))
    os.replace(temporary, path)


def stop(job: subprocess.Popen) -> None:
    """SIGTERM to the job's process group, SIGKILL to what is left after the grace period. The job itself is
    reaped as it ends (a zombie still counts as a member of its group); what it started and left behind is
    another parent's to reap, and is gone from the group once it has exited."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(job.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + GRACE_S
        while time.monotonic() < deadline:
            job.poll()
            if not _group_alive(job.pid):
                return
            time.sleep(0.05)


def _group_alive(group: int) -> bool:
    """Whether a process of the group still runs (zombies waiting for a parent to reap them do not)."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == group and fields[0] != "Z":
            return True
    return False


def main(attempt: Path) -> int:
    run = json.loads((attempt / "run.json").read_text())
    asked: list[str] = []
    signal.signal(signal.SIGTERM, lambda *_: asked.append("cancelled"))
    identity = {}
    if run.get("uid") is not None and run["uid"] != os.getuid():
        identity = {"user": run["uid"], "group": run["gid"], "extra_groups": run.get("groups") or []}
    with open(run["log"], "ab") as log:
        try:
            job = subprocess.Popen(
                run["argv"],
                cwd=run["cwd"] or None,
                env=run["env"],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                **identity,
            )
        except OSError as exc:  # no such program, not executable, a cwd that is gone
            log.write(f"redline: the job did not start: {exc}\n".encode())
            write_whole(attempt / "exit.json", {"returncode": 127, "ended_at": time.time(), "reason": str(exc)})
            return 0
    write_whole(attempt / "pid.json", {"pid": job.pid, "shim": os.getpid(), "started_at": time.time()})
    limit = run.get("time_limit_s")
    deadline = None if limit is None else time.monotonic() + limit
    reason = ""
    while job.poll() is None:
        if asked and not reason:
            reason = "cancelled"
            stop(job)
        elif deadline is not None and time.monotonic() > deadline and not reason:
            reason = f"time limit ({limit:g} s)"
            stop(job)
        try:
            job.wait(timeout=0.1)
        except subprocess.TimeoutExpired:
            continue
    stop(job)  # what the job left behind in its session: workers, a launcher's children
    write_whole(attempt / "exit.json", {"returncode": job.returncode, "ended_at": time.time(), "reason": reason})
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
