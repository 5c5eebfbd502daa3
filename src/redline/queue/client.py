"""Talking to the queue's daemon: find its directory, start it on first use, send one request.

The directory: ``redline.env.state_dir(State.QUEUE)``: ``$REDLINE_QUEUE_DIR``; else ``$REDLINE_HOME/queue``;
else the machine's queue (``/var/lib/redline/queue``, run by root, by the shipped systemd unit or by root's
first use) for root and where it runs; else the user's own under the data home, which the first request
starts. A daemon that does not answer within ``CLIENT_WAIT_S`` is said to
be stuck, in one line, rather than waited on for good.
"""

from __future__ import annotations

import array
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from redline.env import MACHINE_QUEUE, State, state_dir
from redline.errors import RedlineError
from redline.queue.protocol import CLIENT_WAIT_S, MAX_ANSWER_BYTES, Op, check_answer, request_line

MACHINE_DIR = MACHINE_QUEUE
START_WAIT_S = 60.0  # a daemon that has not opened its socket by then did not start: its log says why


class QueueUnavailable(RedlineError):
    """The daemon could not be reached or started."""


def queue_dir() -> Path:
    """The queue this process talks to (``redline.env.state_dir``'s rule)."""
    return state_dir(State.QUEUE)


def whose(directory: Path) -> str:
    """Whose queue ``directory`` is, as a user is told: the machine's, shared by every user, or their own."""
    return "the machine's" if directory == MACHINE_DIR else "yours"


def request(payload: dict[str, Any], directory: Path | None = None, *, start: bool = True) -> dict[str, Any]:
    """The daemon's answer to ``payload`` (``{"op": ..., fields}``); BadInput with the daemon's one line when it
    refuses. Without a daemon, one is started (``start``) where this user may run one. A descriptor the daemon
    sends along (a log's) is closed: ``open_log`` keeps it."""
    answer, fds = exchange(payload, directory, start=start)
    for fd in fds:
        os.close(fd)
    return answer


def open_log(job: str, directory: Path | None = None) -> tuple[dict[str, Any], int | None]:
    """The daemon's answer about job ``job``'s log and the log's descriptor (None: nothing written yet)."""
    answer, fds = exchange({"op": Op.LOG, "id": job}, directory, start=False)
    for extra in fds[1:]:
        os.close(extra)
    return answer, fds[0] if fds else None


def exchange(
    payload: dict[str, Any], directory: Path | None = None, *, start: bool = True
) -> tuple[dict[str, Any], list[int]]:
    directory = directory or queue_dir()
    try:
        return _ask(directory / "queue.sock", payload)
    except (FileNotFoundError, ConnectionRefusedError):
        if not start:
            raise QueueUnavailable(f"no queue daemon answers at {directory}") from None
    start_daemon(directory)
    return _ask(directory / "queue.sock", payload)


def _ask(path: Path, payload: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
    fields = dict(payload)
    line = request_line(Op(fields.pop("op")), **fields)
    data, fds = bytearray(), []
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(CLIENT_WAIT_S)
        try:
            _connect(sock, path)
            sock.sendall(line)
            while not data.endswith(b"\n") and len(data) <= MAX_ANSWER_BYTES:
                chunk, received = _receive(sock)
                fds += received
                if not chunk:
                    break
                data += chunk
        except TimeoutError:
            _close(fds)
            raise QueueUnavailable(
                f"the queue daemon at {path.parent} did not answer within {CLIENT_WAIT_S:g} s: it is stuck or "
                f"overloaded (its log: {path.parent / 'daemon.log'}, or `journalctl -u redline-queue`)"
            ) from None
    if not data:
        _close(fds)
        raise QueueUnavailable(f"the queue daemon at {path.parent} closed the connection without an answer")
    try:
        return check_answer(json.loads(data), str(path.parent)), fds
    except BaseException:
        _close(fds)
        raise


def _receive(sock: socket.socket) -> tuple[bytes, list[int]]:
    """Bytes of the answer and the descriptors that came with them, close-on-exec as they arrive (a log's
    descriptor must not reach what this process may start; socket.recv_fds would drop the flag that says so)."""
    fds = array.array("i")
    data, ancillary, _, _ = sock.recvmsg(1 << 16, socket.CMSG_SPACE(4 * fds.itemsize), socket.MSG_CMSG_CLOEXEC)
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    return data, list(fds)


def _connect(sock: socket.socket, path: Path) -> None:
    """Connect, waiting while the daemon's backlog is full (a unix socket with a timeout says EAGAIN then)."""
    deadline = time.monotonic() + CLIENT_WAIT_S
    while True:
        try:
            sock.connect(str(path))
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise TimeoutError from None
            time.sleep(0.05)


def _close(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def start_daemon(directory: Path) -> None:
    """Start this user's daemon for ``directory``, detached (it outlives this command), and wait until it
    answers. Another process starting one at the same time is fine: the second daemon exits (one lock)."""
    if directory == MACHINE_DIR and os.geteuid() != 0:
        raise QueueUnavailable(
            f"the machine's queue at {directory} is not running: `systemctl start redline-queue` (as root)"
        )
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    log_fd = os.open(directory / "daemon.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    with open(log_fd, "ab") as log:
        daemon = subprocess.Popen(
            [sys.executable, "-m", "redline", "queue", "daemon", "--dir", str(directory)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + START_WAIT_S
    while time.monotonic() < deadline:
        try:
            _ask(directory / "queue.sock", {"op": Op.STATUS})
            return
        except (FileNotFoundError, ConnectionRefusedError):
            if daemon.poll() not in (None, 0):
                break
            time.sleep(0.05)
    raise QueueUnavailable(f"the queue daemon did not start; see {directory / 'daemon.log'}")
