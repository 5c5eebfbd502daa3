"""The queue on a server shared with strangers: a second Unix user reads nothing private, root acts on none of
its paths, a full disk runs nothing twice, and no client starves the others (root's daemon, real processes)."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import resource
import select
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import run_cli
from queue_daemons import alive, start_daemon, stop_daemon, submit, until, wait_for
from redline.errors import BadInput
from redline.queue import client
from redline.queue.client import QueueUnavailable, open_log, request
from redline.queue.daemon import SHIM, _locked
from redline.queue.metrics import QueueCollector
from redline.queue.protocol import CONNECTIONS_PER_USER
from redline.queue.shim import identity, preallocate, read_record, recorded
from redline.queue.spec import JobSpec, JobState
from redline.queue.store import Store
from small_disk import fill, small_disk
from unix_users import Refused, as_user

pytestmark = pytest.mark.system

USER_PATH = {"PATH": "/usr/local/bin:/usr/bin:/bin"}


@pytest.fixture
def machine_queue() -> Iterator[Path]:
    """A folder for root's daemon that other users can reach (as /var/lib/redline/queue is); stopped and
    removed after."""
    directory = Path(tempfile.mkdtemp(prefix="redline-queue-", dir="/tmp"))
    directory.chmod(0o755)
    try:
        yield directory
    finally:
        stop_daemon(directory)
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def scratch() -> Iterator[Path]:
    """A folder every user may write in, for the jobs' traces; removed after."""
    folder = Path(tempfile.mkdtemp(prefix="redline-scratch-", dir="/tmp"))
    folder.chmod(0o777)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def submit_as(uid: int, directory: Path, script: str, **spec: object) -> int:
    """A job of user ``uid``'s (``sh -c script``, in /tmp), submitted as that user: its id."""
    job = JobSpec(argv=("sh", "-c", script), cwd=str(spec.pop("cwd", "/tmp")), env=USER_PATH, **spec)  # type: ignore[arg-type]
    return as_user(uid, lambda: request({"op": "submit", "spec": job.to_dict()}, directory, start=False))["job"]["id"]


def read_log(job: int, directory: Path) -> str:
    """A job's log as `redline logs` reads it: through the descriptor the daemon hands over."""
    _, fd = open_log(str(job), directory)
    if fd is None:
        return ""
    assert not os.get_inheritable(fd)  # nothing this process starts may hold it
    with open(fd, "rb") as log:
        return log.read().decode()


def every_file(directory: Path) -> list[str]:
    """Every file under ``directory`` (as root sees them)."""
    return [str(Path(root, name)) for root, _, files in os.walk(directory) for name in files]


def readable(paths: list[str]) -> dict[str, str]:
    """Those of ``paths`` this process can open and read, with their text."""
    found = {}
    for path in paths:
        try:
            found[path] = Path(path).read_bytes().decode(errors="replace")
        except OSError:
            continue
    return found


def loose_modes(directory: Path, shared_logs: tuple[int, ...] = ()) -> list[str]:
    """The paths under ``directory`` whose modes let others in further than the layout allows."""
    allowed = {directory: 0o711, directory / "spool": 0o711, directory / "queue.sock": 0o666}
    allowed |= {directory / "jobs" / str(job) / "output.log": 0o644 for job in shared_logs}
    loose = []
    for root, folders, files in os.walk(directory):
        for name in folders + files:
            path = Path(root, name)
            mode = stat.S_IMODE(os.lstat(path).st_mode)
            if mode & 0o077 and mode != allowed.get(path):
                loose.append(f"{path} {mode:o}")
    if stat.S_IMODE(directory.stat().st_mode) != 0o711:
        loose.append(f"{directory} {stat.S_IMODE(directory.stat().st_mode):o}")
    return loose


def test_a_second_user_reads_nothing_private_on_disk_or_over_the_socket(machine_queue: Path, other_user: int) -> None:
    """root's job carries a token in its environment. The other user, looking at every file it can open under
    the queue's folder, finds none of it (the database, its WAL, run.json are root's and private); over the
    socket it sees root's job without its environment and may not read its log. Its own job's log it reads
    through the daemon (the folders are not its to enter); a log shared with --share-logs, too."""
    directory = machine_queue
    start_daemon(directory)
    env = {"REDLINE_QUEUE_DIR": str(directory)}
    token = "hf_" + "Zq7" * 8
    mine = submit(env | {"HF_TOKEN": token}, "--", "sh", "-c", "echo root-output; sleep 600")
    until(env, mine, "running")
    shared = submit(env, "--share-logs", "--", "echo", "for everyone")
    theirs = submit_as(other_user, directory, "echo their-output")
    until(env, theirs, "done")
    until(env, shared, "done")

    files = every_file(directory)
    assert token in "".join(readable(files).values())  # root finds it: the look below would find it too
    seen = as_user(other_user, lambda: readable(files))
    assert not [path for path, text in seen.items() if token in text], seen.keys()
    assert set(seen) <= {str(directory / "metrics.port")}, seen.keys()  # the shared log: through the daemon only
    assert loose_modes(directory, shared_logs=(shared,)) == []
    listed = as_user(other_user, lambda: request({"op": "jobs"}, directory, start=False))["jobs"]
    assert {j["id"]: j["spec"]["env"] for j in listed}[mine] == {}
    with pytest.raises(Refused, match="only its owner or root may do that"):
        as_user(other_user, lambda: read_log(mine, directory))
    assert as_user(other_user, lambda: read_log(theirs, directory)) == "their-output\n"
    assert as_user(other_user, lambda: read_log(shared, directory)) == "for everyone\n"
    assert read_log(mine, directory) == "root-output\n"  # root reads every log
    assert run_cli("cancel", str(mine), env=env).returncode == 0


def test_an_older_folder_is_made_private_at_start_and_said_once(machine_queue: Path) -> None:
    directory = machine_queue
    env = {"REDLINE_QUEUE_DIR": str(directory)}
    start_daemon(directory)
    until(env, submit(env | {"AWS_SECRET_ACCESS_KEY": "x" * 40}, "--", "true"), "done")
    stop_daemon(directory)
    (directory / "daemon.log").write_text("")
    for root, folders, files in os.walk(directory):  # as an older redline left it: 0755 folders, 0644 files
        for name in folders:
            os.chmod(Path(root, name), 0o755)
        for name in files:
            os.chmod(Path(root, name), 0o644)
    start_daemon(directory)
    assert loose_modes(directory) == []
    stop_daemon(directory)
    start_daemon(directory)  # nothing left to change: nothing said
    said = [line for line in (directory / "daemon.log").read_text().splitlines() if "private" in line]
    assert len(said) == 1 and said[0].startswith("made ") and str(directory) in said[0], said


def test_root_takes_no_record_a_user_planted_and_waits_on_none(
    machine_queue: Path, other_user: int, scratch: Path
) -> None:
    """The other user's jobs leave, where the runtime leaves its out-of-memory record, a FIFO (a blocking open
    would hang root's daemon), a symlink to a root-only file (whose field the reason would show), and 1 MiB.
    None is taken, each job ends failed with why in one line, and the daemon keeps answering. A true record
    of the user's own still requeues its job."""
    directory = machine_queue
    start_daemon(directory, "--retry-backoff", "0.1")
    env = {"REDLINE_QUEUE_DIR": str(directory)}
    secret = scratch / "root-only.json"
    secret.write_text('{"micro_batch": "ROOT-ONLY-VALUE"}')
    secret.chmod(0o600)
    record = '"$REDLINE_QUEUE_RECORDS/oom.json"'
    planted = {
        "is a FIFO, not a file": f"mkfifo {record}; exit 3",
        "is a symlink: it is not followed here": f"ln -s {secret} {record}; exit 3",
        "over the 64.0 KiB one may be": f"head -c 1048576 /dev/zero | tr '\\\\0' ' ' > {record}; exit 3",
    }
    ids = {why: submit_as(other_user, directory, script, retries=1) for why, script in planted.items()}
    for why, job in ids.items():
        # through the CLI, in a process of its own: a daemon hung on the FIFO fails the test instead of hanging it
        ended = wait_for(
            lambda job=job: (j := _listed(env)[job])["state"] in ("failed", "done", "queued") and j["attempt"] and j
        )
        assert ended["state"] == "failed" and ended["attempt"] == 1, ended
        assert ended["reason"].startswith("exit 3; not taken: out-of-memory record") and why in ended["reason"]
        assert "\n" not in ended["reason"]
    assert "ROOT-ONLY-VALUE" not in json.dumps(_listed(env))
    marker = scratch / "first"
    true_record = f"if [ ! -e {marker} ]; then touch {marker}; echo '{{\"micro_batch\": 2}}' > {record}; exit 1; fi"
    assert until(env, submit_as(other_user, directory, true_record, retries=1), "done")["attempt"] == 2
    assert list((directory / "spool").iterdir()) == []  # each attempt's records folder went once read


def _listed(env: dict[str, str]) -> dict[int, dict]:
    result = run_cli("jobs", "--all", "--json", env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    return {j["id"]: j for j in json.loads(result.stdout)["jobs"]}


def test_a_job_enters_its_folder_as_its_user_or_does_not_start(
    machine_queue: Path, other_user: int, scratch: Path
) -> None:
    """A folder under one only root may enter: root's daemon used to enter it before dropping privileges, and
    the job ran there. Now the job's own process enters it as the user: it cannot, and the job fails at
    start with one line, having run nothing. Its umask is the submitter's, not the daemon's 077."""
    directory = machine_queue
    start_daemon(directory)
    env = {"REDLINE_QUEUE_DIR": str(directory)}
    hidden = scratch / "root-only" / "inside"
    hidden.mkdir(parents=True)
    hidden.parent.chmod(0o700)
    hidden.chmod(0o777)
    ran = scratch / "ran"
    job = submit_as(other_user, directory, f"pwd > {ran}", cwd=hidden)
    ended = until(env, job, "failed", "done")
    why = f"did not start: cannot enter its folder {hidden} as uid {other_user}: Permission denied"
    assert ended["state"] == "failed" and ended["exit_code"] == 127 and ended["reason"] == why, ended
    assert not ran.exists()
    assert read_log(job, directory) == f"redline: the job did not start: {why.removeprefix('did not start: ')}\n"
    made = scratch / "made-by-the-job"
    job = submit_as(other_user, directory, f"touch {made}", umask=0o027)
    until(env, job, "done")
    assert made.stat().st_uid == other_user and stat.S_IMODE(made.stat().st_mode) == 0o640


def test_a_full_disk_refuses_submits_keeps_jobs_running_and_runs_nothing_twice(tmp_path: Path) -> None:
    """The queue's disk fills while a job runs (which may retry). A submit is refused in one line; the listing
    still answers; the job ends well and its shim's record of it is written all the same; the daemon lives
    through it and, once there is room, the job is done, having run once."""
    with small_disk(tmp_path / "disk") as disk:
        directory = disk / "q"
        env = {"REDLINE_QUEUE_DIR": str(directory)}
        daemon = start_daemon(directory, "--retry-backoff", "0.1")
        runs, go = tmp_path / "runs", tmp_path / "go"
        job = submit(
            env, "--retries", "2", "--", "sh", "-c", f"echo run >> {runs}; while [ ! -e {go} ]; do sleep 0.05; done"
        )
        try:
            until(env, job, "running")
            _fill_and_finish(env, directory, job, disk, go)
            assert until(env, job, "done")["attempt"] == 1
            assert runs.read_text() == "run\n"
            assert alive(daemon.pid)
        finally:
            go.touch()  # the job ends whatever failed
            stop_daemon(directory)


def _fill_and_finish(env: dict[str, str], directory: Path, job: int, disk: Path, go: Path) -> None:
    """With the disk full: a submit refused, the listing answered, the job ended and its record written, the
    daemon alive; then the room given back."""
    filler = fill(disk)
    try:
        refused = run_cli("submit", "--", "true", env=env)
        assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
        assert "the queue's disk is full" in refused.stderr and "running jobs go on" in refused.stderr
        assert run_cli("jobs", env=env, timeout=120).returncode == 0
        go.touch()
        ended = wait_for(lambda: read_record(directory / "jobs" / str(job) / "1" / "exit.json"), "the shim's record")
        assert ended["returncode"] == 0
    finally:
        filler.unlink()


@pytest.mark.slow
def test_idle_connections_of_one_user_leave_the_others_served(machine_queue: Path, other_user: int) -> None:
    """The daemon may hold 256 descriptors. The other user opens 400 connections and sends nothing. Those past
    its cap are refused at once, in one line; the rest are dropped once their request is overdue; root is
    served all along."""
    directory = machine_queue
    limit = lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))  # noqa: E731
    command = [sys.executable, "-m", "redline", "queue", "daemon", "--dir", str(directory)]
    with open(directory / "daemon.log", "ab") as log:
        daemon = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, preexec_fn=limit)
    try:
        wait_for(lambda: request({"op": "status"}, directory, start=False))
        env = {"REDLINE_QUEUE_DIR": str(directory)}
        holding = HeldConnections(other_user, directory / "queue.sock", 400)
        try:
            holding.wait_until_open()
            listed = run_cli("jobs", "--json", env=env, timeout=120)  # a hung daemon would be a timeout, not a hang
            assert listed.returncode == 0, listed.stderr
        finally:
            answers = holding.answers()
        refused_at_once = [a for a in answers if "connections open to the queue already" in a]
        overdue = [a for a in answers if "no whole request within" in a]
        assert len(refused_at_once) >= 400 - CONNECTIONS_PER_USER and len(overdue) <= CONNECTIONS_PER_USER
        assert len(refused_at_once) + len(overdue) == 400, answers[:3]
        assert as_user(other_user, lambda: request({"op": "jobs"}, directory, start=False))["jobs"] == []
    finally:
        daemon.terminate()
        daemon.wait()


class HeldConnections:
    """A process of user ``uid`` that opens ``count`` connections to the socket and sends nothing; at
    ``answers()`` it reads what the daemon said on each (waiting for every one to be answered or closed). A
    daemon that stops accepting or answering makes its answers "" after ``HANG_GUARD_S``, not a hang."""

    HANG_GUARD_S = 300.0

    def __init__(self, uid: int, path: Path, count: int) -> None:
        self._opened, opened = os.pipe()  # the child says its connections are open
        go_on, self._go_on = os.pipe()  # the test says: read the answers now
        self._answers, answers = os.pipe()  # the child's answers, as JSON
        self.child = os.fork()
        if self.child == 0:  # pragma: no cover (the child)
            try:
                os.setgid(uid)
                os.setuid(uid)
                deadline = time.monotonic() + self.HANG_GUARD_S
                socks = [_connected(path, deadline) for _ in range(count)]
                os.write(opened, b"x")
                os.read(go_on, 1)
                deadline = time.monotonic() + self.HANG_GUARD_S
                said = [_answer_of(sock, deadline) for sock in socks]
                os.write(answers, json.dumps(said).encode())
            finally:
                os._exit(0)
        for fd in (opened, go_on, answers):
            os.close(fd)

    def wait_until_open(self) -> None:
        ready, _, _ = select.select([self._opened], [], [], 2 * self.HANG_GUARD_S)
        assert ready and os.read(self._opened, 1) == b"x", "the other user's connections did not open"

    def answers(self) -> list[str]:
        os.write(self._go_on, b"x")
        with os.fdopen(self._answers) as pipe:
            said = json.loads(pipe.read() or "[]")
        os.waitpid(self.child, 0)
        return said


def _connected(path: Path, deadline: float) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX)
    sock.setblocking(False)
    while sock.connect_ex(str(path)) == errno.EAGAIN and time.monotonic() < deadline:
        time.sleep(0.01)  # the daemon's backlog is full: it may accept in a moment
    return sock


def _answer_of(sock: socket.socket, deadline: float) -> str:
    data = b""
    try:
        sock.settimeout(max(0.1, deadline - time.monotonic()))
        while chunk := sock.recv(1 << 16):
            data += chunk
    except OSError:
        return ""
    return json.loads(data).get("error", "") if data else ""


def test_a_request_of_another_protocol_or_an_unknown_one_is_refused_in_one_line(queue: dict[str, str]) -> None:
    directory = Path(queue["REDLINE_QUEUE_DIR"])
    start_daemon(directory)
    older = _raw(directory, {"op": "jobs"})  # an older client: no version
    assert older["ok"] is False and older["v"] == 2
    assert older["error"].startswith("this queue daemon speaks queue protocol 2, the client 1: use the redline")
    assert _raw(directory, {"v": 2, "op": "frobnicate"})["error"] == "unknown request 'frobnicate'"
    assert _raw(directory, {"v": 2, "op": "job", "id": "12"})["error"] == "no job 12"
    assert _raw(directory, {"v": 2, "op": "log", "id": "x"})["error"] == "no job x"
    huge = "9" * 20  # past SQLite's integers
    assert _raw(directory, {"v": 2, "op": "cancel", "ids": [huge]})["error"] == f"no job {huge}"


def _raw(directory: Path, request: dict) -> dict:
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(60)
        sock.connect(str(directory / "queue.sock"))
        sock.sendall(json.dumps(request).encode() + b"\n")
        return json.loads(sock.makefile("rb").readline())


def test_an_old_or_silent_daemon_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "queue.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))
    listener.listen()
    held: list[socket.socket] = []

    def serve(answer: bytes | None) -> None:
        conn, _ = listener.accept()
        conn.recv(1 << 16)
        if answer is None:
            held.append(conn)  # never answers
        else:
            conn.sendall(answer)
            conn.close()

    threading.Thread(target=serve, args=(b'{"ok": true, "jobs": []}\n',), daemon=True).start()
    with pytest.raises(BadInput) as old:
        request({"op": "jobs"}, tmp_path, start=False)
    assert str(old.value).startswith(f"the queue daemon at {tmp_path} speaks queue protocol 1, this redline 2")
    monkeypatch.setattr(client, "CLIENT_WAIT_S", 0.5)
    threading.Thread(target=serve, args=(None,), daemon=True).start()
    with pytest.raises(QueueUnavailable) as silent:
        request({"op": "jobs"}, tmp_path, start=False)
    assert str(silent.value).startswith(f"the queue daemon at {tmp_path} did not answer within 0.5 s")
    listener.close()


def test_prometheus_has_a_series_for_every_state_starting_included(tmp_path: Path) -> None:
    store = Store(tmp_path / "queue.db")
    for state in (JobState.STARTING, JobState.RUNNING, JobState.QUEUED):
        store.update(store.add(JobSpec(argv=("true",)), 0, "root").id, state=state)
    collector = QueueCollector(store, lambda: {"gpus": []})
    counts = {
        sample.labels["state"]: sample.value
        for family in collector.collect()
        if family.name == "redline_queue_jobs"
        for sample in family.samples
    }
    assert counts == {state.value: float(state in ("starting", "running", "queued")) for state in JobState}


# ------------------------------------------------------------------------------------------ the shim alone


def shim_attempt(tmp_path: Path, script: str, **run: object) -> tuple[Path, int]:
    """An attempt folder as the daemon makes it (run.json, the records made ahead, the log) and its lock,
    held: the descriptor to hand the shim."""
    attempt = tmp_path / "attempt"
    attempt.mkdir()
    log = tmp_path / "output.log"
    log.touch()
    orders = {"argv": ["sh", "-c", script], "cwd": str(tmp_path), "env": USER_PATH, "log": str(log)} | run
    (attempt / "run.json").write_text(json.dumps(orders))
    for name in ("pid.json", "exit.json"):
        preallocate(attempt / name)
    lock = os.open(attempt / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)
    return attempt, lock


def start_shim(attempt: Path, lock: int) -> subprocess.Popen:
    try:
        return subprocess.Popen([sys.executable, "-I", "-S", str(SHIM), str(attempt)], pass_fds=(lock,))
    finally:
        os.close(lock)


def test_a_shim_killed_before_its_go_leaves_a_job_that_never_runs(tmp_path: Path) -> None:
    """pid.json is a FIFO here, so the shim blocks writing it, after its job's process was forked and before
    the go. Killed there, the job's process must end without running (the go pipe's end), and the lock must be
    free, so the daemon requeues the job instead of waiting on it for good."""
    marker = tmp_path / "ran"
    attempt, lock = shim_attempt(tmp_path, f"touch {marker}")
    (attempt / "pid.json").unlink()
    os.mkfifo(attempt / "pid.json")
    shim = start_shim(attempt, lock)
    wait_for(lambda: _children_of(shim.pid), "the job's process forked")
    shim.kill()
    shim.wait()
    wait_for(lambda: not _locked(attempt / "lock"), "the attempt's lock freed")
    assert not marker.exists()


def _children_of(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_a_cancel_that_came_while_starting_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    attempt, lock = shim_attempt(tmp_path, f"touch {marker}")
    (attempt / "cancel").touch()  # what the daemon leaves when cancelled before pid.json
    assert start_shim(attempt, lock).wait() == 0
    assert read_record(attempt / "exit.json")["reason"] == "cancelled"
    assert not marker.exists()


def test_a_job_starts_with_default_signals_none_blocked_and_the_daemons_descriptor_limit(tmp_path: Path) -> None:
    """The shim started with SIGINT and SIGHUP ignored and SIGUSR1 blocked (a daemon under nohup, or started
    from a shell in the background), and the descriptor limit raised: the job sees none of it."""
    argv = ["cat", "/proc/self/status", "/proc/self/limits"]  # the job's own process: no shell between
    attempt, lock = shim_attempt(tmp_path, "", argv=argv, nofile=512)

    def as_a_daemon_left_it() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    try:
        shim = subprocess.Popen(
            [sys.executable, "-I", "-S", str(SHIM), str(attempt)], pass_fds=(lock,), preexec_fn=as_a_daemon_left_it
        )
    finally:
        os.close(lock)
    assert shim.wait() == 0 and read_record(attempt / "exit.json")["returncode"] == 0
    seen = (tmp_path / "output.log").read_text()
    masks = dict(line.split(":\t") for line in seen.splitlines() if line.startswith(("SigIgn", "SigBlk")))
    assert masks == {"SigIgn": "0" * 16, "SigBlk": "0" * 16}, seen
    assert re.search(r"^Max open files\s+512\s", seen, re.MULTILINE), seen


def test_a_recorded_process_is_told_from_a_later_one_with_its_number() -> None:
    mine = identity(os.getpid())
    assert recorded(mine, "pid") and recorded(mine, "shim")
    assert not recorded(mine | {"boot_id": "another-boot"}, "pid")  # a reboot: the number is someone else's
    assert not recorded(mine | {"pid_ticks": mine["pid_ticks"] - 1}, "pid")  # the number given again
    older = {"pid": os.getpid(), "started_at": 1.0}  # an older daemon's record, from before this boot
    assert not recorded(older, "pid")
    assert recorded(mine | {"pid": 2**22 + 12345, "pid_ticks": 7}, "pid")  # gone: its group may still be there


def test_a_job_whose_user_is_gone_fails_alone(machine_queue: Path, other_user: int) -> None:
    directory = machine_queue
    start_daemon(directory)
    env = {"REDLINE_QUEUE_DIR": str(directory)}
    spec = JobSpec(argv=("true",), cwd="/tmp", env=USER_PATH).to_dict()
    held = {"op": "submit", "spec": spec, "hold": True}
    theirs = as_user(other_user, lambda: request(held, directory, start=False))["job"]["id"]
    subprocess.run(["userdel", "redline-qtest"], check=True, capture_output=True)
    assert run_cli("release", str(theirs), env=env).returncode == 0  # root may
    ended = until(env, theirs, "failed", "done")
    assert (
        ended["state"] == "failed"
        and ended["reason"] == f"its user (uid {other_user}) is not known to this machine now"
    )
    until(env, submit(env, "--", "true"), "done")  # the daemon serves on


def test_what_other_users_name_their_jobs_reaches_no_terminal_as_markup_or_escapes(queue: dict[str, str]) -> None:
    for name in ("\x1b]0;owned\x07", "a\x1b[31mred", "tab\there"):
        with pytest.raises(BadInput, match="--name must be printable text"):
            JobSpec(argv=("true",), name=name)
    with pytest.raises(BadInput, match="--name must be printable text"):
        JobSpec.from_dict({"argv": ["true"], "name": ["a", "b"]})
    env = queue
    job = submit(env, "--name", "[bold]loud[/bold]", "--", "sh", "-c", "exit 3")  # rich markup: printed as it is
    # a folder whose name carries a terminal's escape (a title change): the reason quotes it
    spec = JobSpec(argv=("true",), cwd="/nowhere/\x1b]0;owned\x07", env=USER_PATH)
    escape = request({"op": "submit", "spec": spec.to_dict()}, Path(env["REDLINE_QUEUE_DIR"]))["job"]["id"]
    until(env, job, "failed")
    assert "\x1b]0;owned" in until(env, escape, "failed")["reason"]
    table = run_cli("jobs", env=env | {"COLUMNS": "200"})
    assert "[bold]loud[/bold]" in table.stdout and "\x1b" not in table.stdout, table.stdout
