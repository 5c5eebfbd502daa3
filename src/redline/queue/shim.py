"""The process that runs one attempt of a job and outlives the daemon: Slurm's slurmstepd, in small.

    python shim.py ATTEMPT_DIR    (started by the daemon; reads ATTEMPT_DIR/run.json)

It forks the job's process, which becomes the job's user (groups, gid, uid, in that order) before it touches
anything of the job's: only then does it enter the job's folder and exec the job's argv (never a shell), so
root never enters a folder its user could not. The job runs in a session of its own, with the environment and
umask captured at submit and the devices placed. The shim stops the job's whole process group at its time
limit or when asked (SIGTERM to the shim: a cancel).

Two records say how the attempt went: ``pid.json`` once the job may run and ``exit.json`` when it ended. The
daemon makes both before the shim starts, full of zeros, and the shim writes each in place and syncs it, so a
full disk cannot keep the shim from saying how its job ended (a job that exited 0 is never taken for lost and
run again). The job's process waits for a go from the shim, sent only once ``pid.json`` is written: a shim
killed before that leaves a job that never ran, which the daemon requeues.

The daemon locks ``ATTEMPT_DIR/lock`` before starting the shim and hands the locked descriptor down: the lock
is held from before the shim exists until the shim exits, whatever kills whom, and never reaches the job. A
daemon that restarts knows an attempt whose lock it can take has no shim any more
(``daemon.Daemon.recover``).

Standard library only, and run as a script: it starts in milliseconds and imports nothing of redline.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

GRACE_S = 10.0  # between SIGTERM and SIGKILL to the job's process group
RECORD_BYTES = 4096  # pid.json and exit.json: made this size by the daemon, written in place by the shim
DEFAULT_UMASK = 0o022
NO_START = 127  # the exit status of a job that could not start (the shell's for a command not found)


def preallocate(path: Path) -> None:
    """``path`` made empty of meaning but full of blocks (zeros), synced: ``write_record`` then needs no space."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, bytes(RECORD_BYTES))
        os.fsync(fd)
    finally:
        os.close(fd)


def write_record(path: Path, data: dict) -> None:
    """``data`` as JSON over the record's zeros, in place, synced (a longer reason is cut to fit)."""
    payload = json.dumps(data).encode()
    if len(payload) > RECORD_BYTES and "reason" in data:
        excess = len(payload) - RECORD_BYTES + 8
        payload = json.dumps(data | {"reason": data["reason"][: max(0, len(data["reason"]) - excess)]}).encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.pwrite(fd, payload[:RECORD_BYTES].ljust(RECORD_BYTES, b" "), 0)
        os.fsync(fd)
    finally:
        os.close(fd)


def read_record(path: Path) -> dict | None:
    """A record's data; None while it is still zeros (not written yet), missing, or cut short."""
    try:
        data = path.read_bytes().strip(b"\0 \n")
        return json.loads(data) if data else None
    except (OSError, ValueError):
        return None


class Job:
    """The job's process, forked by the shim: its pid is the job's (exec keeps it) and its process group's."""

    def __init__(self, run: dict, log_fd: int) -> None:
        self.returncode: int | None = None
        go_read, self._go = os.pipe()  # the shim's go: written once pid.json is
        self._errors, error_write = os.pipe()  # why the job could not start; closed by a successful exec
        self.pid = os.fork()
        if self.pid == 0:  # pragma: no cover (the child)
            _become_the_job(run, log_fd, go_read, error_write)
        os.close(go_read)
        os.close(error_write)

    def go(self) -> str:
        """Let the job run; "" once it runs, else why it could not start (it has then exited)."""
        os.write(self._go, b"g")
        os.close(self._go)
        with os.fdopen(self._errors, "rb") as errors:
            return errors.read().decode(errors="replace")

    def poll(self) -> int | None:
        """The job's exit status once it ended (negative: the signal that killed it), reaped; else None."""
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


def _become_the_job(run: dict, log_fd: int, go_read: int, error_write: int) -> None:  # pragma: no cover
    """In the forked child: the job's user first, then its folder, then its program. Never returns."""
    try:
        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        if os.read(go_read, 1) != b"g":  # the shim died before it could record the job: it must not run
            os._exit(0)
        # nothing of the shim's reaches the job: not the attempt's lock, not the pipes (the error pipe is
        # close-on-exec, so a successful exec closes it: the shim's sign that the job runs)
        os.closerange(3, error_write)
        os.closerange(error_write + 1, os.sysconf("SC_OPEN_MAX"))
        for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGTERM):  # as exec'd programs expect them
            signal.signal(sig, signal.SIG_DFL)
        if run.get("uid") is not None and run["uid"] != os.getuid():
            os.setgroups(run.get("groups") or [])
            os.setresgid(run["gid"], run["gid"], run["gid"])
            os.setresuid(run["uid"], run["uid"], run["uid"])
        os.umask(run.get("umask") if run.get("umask") is not None else DEFAULT_UMASK)
        folder = run.get("cwd") or "/"
        try:
            os.chdir(folder)
        except OSError as exc:
            raise OSError(f"cannot enter its folder {folder} as uid {os.getuid()}: {exc.strerror}") from None
        try:
            os.execvpe(run["argv"][0], run["argv"], run["env"])
        except OSError as exc:
            raise OSError(f"cannot run {run['argv'][0]}: {exc.strerror}") from None
    except BaseException as exc:
        os.write(error_write, str(exc).encode())
    finally:
        os._exit(NO_START)


def stop(job: Job) -> None:
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


def supervise(job: Job, limit_s: float | None, asked: list[str]) -> str:
    """Wait for the job's end, stopping it when cancelled or past its time limit; why it was stopped ("")."""
    deadline = None if limit_s is None else time.monotonic() + limit_s
    reason = ""
    while job.poll() is None:
        if asked and not reason:
            reason = "cancelled"
            stop(job)
        elif deadline is not None and time.monotonic() > deadline and not reason:
            reason = f"time limit ({limit_s:g} s)"
            stop(job)
        time.sleep(0.1)
    stop(job)  # what the job left behind in its session: workers, a launcher's children
    return reason


def main(attempt: Path) -> int:
    run = json.loads((attempt / "run.json").read_text())
    asked: list[str] = []
    signal.signal(signal.SIGTERM, lambda *_: asked.append("cancelled"))
    # the log is in the daemon's private folder (no user can put anything at its path) and the job's user's
    log_fd = os.open(run["log"], os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
    job = Job(run, log_fd)
    write_record(attempt / "pid.json", {"pid": job.pid, "shim": os.getpid(), "started_at": time.time()})
    failed = job.go()
    if failed:  # no such program, not executable, a folder the user cannot enter
        os.write(log_fd, f"redline: the job did not start: {failed}\n".encode())
        while job.poll() is None:
            time.sleep(0.01)
        record = {"returncode": NO_START, "ended_at": time.time(), "reason": f"did not start: {failed}"}
        write_record(attempt / "exit.json", record)
        return 0
    os.close(log_fd)
    reason = supervise(job, run.get("time_limit_s"), asked)
    write_record(attempt / "exit.json", {"returncode": job.returncode, "ended_at": time.time(), "reason": reason})
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
