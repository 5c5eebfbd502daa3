"""The process that runs one attempt of a job and outlives the daemon: Slurm's slurmstepd, in small.

    python shim.py ATTEMPT_DIR    (started by the daemon; reads ATTEMPT_DIR/run.json)

It forks the job's process, which becomes the job's user (groups, gid, uid, in that order) before it touches
anything of the job's: only then does it enter the job's folder and exec the job's argv (never a shell), so
root never enters a folder its user could not. The job runs in a session of its own, with the environment and
umask captured at submit and the devices placed. The shim stops the job's whole process group at its time
limit or when asked (SIGTERM to the shim: a cancel).

Two records say how the attempt went: ``pid.json`` once the job may run (its pid, the shim's, and the boot and
start times that tell them from later processes given the same numbers) and ``exit.json`` when it ended. The
daemon makes both before the shim starts, full of zeros, and the shim writes each in place and syncs it; on a
filesystem that overwrites in place (ext4, XFS, tmpfs) that needs no free space, and where it does (a
copy-on-write one) the shim waits for room, holding its lock, before it exits: a job that exited 0 is never
taken for lost and run again. The job's process waits for a go from the shim, sent only once ``pid.json`` is
written and no cancel came: a shim killed before that leaves a job that never ran, which the daemon requeues.
A cancel or a time limit also applies to a job still on its way in (a folder on a hung NFS).

The daemon locks ``ATTEMPT_DIR/lock`` before starting the shim and hands the locked descriptor down: the lock
is held from before the shim exists until the shim exits, whatever kills whom, and never reaches the job. A
daemon that restarts knows an attempt whose lock it can take has no shim any more
(``daemon.Daemon.recover``).

Standard library only, and run as a script: it starts in milliseconds and imports nothing of redline.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import resource
import select
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
    """The job's process, forked by the shim: its pid is the job's (exec keeps it) and its process group's.
    It runs only after ``go``; until then it waits on the go pipe, and the shim's end (EOF) ends it unrun."""

    def __init__(self, run: dict, log_fd: int) -> None:
        self.returncode: int | None = None
        go_read, self._go = os.pipe()  # the shim's go: written once pid.json is
        self._errors, error_write = os.pipe()  # why the job could not start; closed by a successful exec
        self._said = b""
        self.pid = os.fork()
        if self.pid == 0:  # pragma: no cover (the child)
            os.close(self._go)  # else a shim that died before its go would leave the child waiting for good
            os.close(self._errors)
            _become_the_job(run, log_fd, go_read, error_write)
        os.close(go_read)
        os.close(error_write)

    def go(self) -> None:
        os.write(self._go, b"g")
        os.close(self._go)

    def withhold(self) -> None:
        """No go: the job's process exits without running anything."""
        os.close(self._go)
        os.close(self._errors)
        self.wait()

    def started(self, wait_s: float) -> str | None:
        """After ``go``: "" once the job's program runs, why it could not start once it has said so, None
        while it is still on its way (entering a folder on a slow NFS, say) after ``wait_s``."""
        ready, _, _ = select.select([self._errors], [], [], wait_s)
        if not ready:
            return None
        data = os.read(self._errors, 4096)
        if data:
            self._said += data
            return None
        os.close(self._errors)
        return self._said.decode(errors="replace")

    def kill(self) -> None:
        """SIGKILL before it runs (a cancel or a time limit while it was starting), reaped."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        self.wait()

    def poll(self) -> int | None:
        """The job's exit status once it ended (negative: the signal that killed it), reaped; else None."""
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        while self.poll() is None:
            time.sleep(0.01)
        assert self.returncode is not None
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
        _as_exec_expects(run)
        if run.get("uid") is not None and run["uid"] != os.getuid():
            os.setgroups(run.get("groups") or [])
            os.setresgid(run["gid"], run["gid"], run["gid"])
            os.setresuid(run["uid"], run["uid"], run["uid"])
        umask = run.get("umask")
        os.umask(umask if umask is not None else DEFAULT_UMASK)
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


def _as_exec_expects(run: dict) -> None:  # pragma: no cover (the child)
    """What a program expects to start with, whatever the daemon was started with (nohup, a shell that
    ignores SIGINT, a raised descriptor limit): every signal at its default, none blocked, and the descriptor
    limit the daemon itself was given."""
    for sig in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError):  # SIGKILL and SIGSTOP cannot be set
            signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, ())
    if run.get("nofile"):
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(run["nofile"], hard), hard))


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


class TimeLimit:
    def __init__(self, limit_s: float | None) -> None:
        self.limit_s = limit_s
        self.end = None if limit_s is None else time.monotonic() + limit_s

    def passed(self) -> bool:
        return self.end is not None and time.monotonic() > self.end

    def why(self) -> str:
        return f"time limit ({self.limit_s:g} s)"


def start(job: Job, attempt: Path, asked: list[str], limit: TimeLimit) -> dict | None:
    """Let the job run: None once its program runs; else how it ended without running (a cancel that came
    first, a time limit passed while it was still starting, a folder or program it could not reach)."""
    if asked or (attempt / "cancel").exists():  # cancelled while "starting": the daemon left word
        job.withhold()
        return {"returncode": None, "reason": "cancelled"}
    job.go()
    while (said := job.started(wait_s=0.1)) is None:
        if asked or limit.passed():
            job.kill()
            return {"returncode": job.returncode, "reason": "cancelled" if asked else limit.why()}
    if said:
        job.wait()
        return {"returncode": NO_START, "reason": f"did not start: {said}"}
    return None


def supervise(job: Job, limit: TimeLimit, asked: list[str]) -> str:
    """Wait for the job's end, stopping it when cancelled or past its time limit; why it was stopped ("")."""
    reason = ""
    while job.poll() is None:
        if asked and not reason:
            reason = "cancelled"
            stop(job)
        elif limit.passed() and not reason:
            reason = limit.why()
            stop(job)
        time.sleep(0.1)
    stop(job)  # what the job left behind in its session: workers, a launcher's children
    return reason


def record_end(attempt: Path, ended: dict) -> None:
    """exit.json written, however long a full disk takes: the shim keeps the attempt's lock until then, so
    the daemon waits for the record instead of taking a finished job for lost and running it again."""
    while True:
        try:
            write_record(attempt / "exit.json", ended | {"ended_at": time.time()})
            return
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            time.sleep(1.0)


def main(attempt: Path) -> int:
    run = json.loads((attempt / "run.json").read_text())
    asked: list[str] = []
    signal.signal(signal.SIGTERM, lambda *_: asked.append("cancelled"))
    limit = TimeLimit(run.get("time_limit_s"))
    # the log is in the daemon's private folder (no user can put anything at its path) and the job's user's
    log_fd = os.open(run["log"], os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
    job = Job(run, log_fd)
    try:
        write_record(attempt / "pid.json", identity(job.pid))
    except BaseException:
        job.withhold()  # a job whose start is not on record must not run: the daemon starts it again
        raise
    ended = start(job, attempt, asked, limit)
    if ended is None:
        os.close(log_fd)
        ended = {"reason": supervise(job, limit, asked)}
        ended["returncode"] = job.returncode
    elif ended["reason"].startswith("did not start"):
        with contextlib.suppress(OSError):  # a full disk: the record below says it all the same
            os.write(log_fd, f"redline: the job {ended['reason']}\n".encode())
    record_end(attempt, ended)
    return 0


# ------------------------------------------------------------------------------- which process is which


def identity(pid: int) -> dict:
    """pid.json: the job's pid (its process group's), the shim's, and what tells each from a later process
    given the same number (after a reboot, or the numbers wrapping): the boot and their start times."""
    return {
        "pid": pid,
        "shim": os.getpid(),
        "started_at": time.time(),
        "boot_id": boot_id(),
        "pid_ticks": start_ticks(pid),
        "shim_ticks": start_ticks(os.getpid()),
    }


def boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def start_ticks(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (/proc/PID/stat's 22nd field); None: gone."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def recorded(started: dict, which: str) -> bool:
    """Whether ``started[which]`` ("pid": the job's process group; "shim") may still be signalled as the
    process pid.json recorded: not from an earlier boot, and not another process that got its number since.
    A job's group may outlive its leader; while any member lives its number is not given to another."""
    if started.get("boot_id") is not None:
        if started["boot_id"] != boot_id():
            return False
    elif started.get("started_at", 0) < _boot_time():  # an older record, without a boot id
        return False
    ticks = start_ticks(started[which])
    return ticks is None or started.get(f"{which}_ticks") in (None, ticks)


def _boot_time() -> float:
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("btime "):
            return float(line.split()[1])
    return 0.0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
