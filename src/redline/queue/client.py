"""Talking to the queue's daemon: find its directory, start it on first use, send one request.

The directory: ``$REDLINE_QUEUE_DIR``; else the machine's queue (``/var/lib/redline/queue``, run by root, by
the shipped systemd unit or by root's first use) where it answers; else the user's own under the data
directory, which the first request starts.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from redline.errors import BadInput, RedlineError

DIR_ENV = "REDLINE_QUEUE_DIR"
MACHINE_DIR = Path("/var/lib/redline/queue")
START_WAIT_S = 60.0  # a daemon that has not opened its socket by then did not start: its log says why


class QueueUnavailable(RedlineError):
    """The daemon could not be reached or started."""


def queue_dir() -> Path:
    if os.environ.get(DIR_ENV):
        return Path(os.environ[DIR_ENV])
    if os.geteuid() == 0 or (MACHINE_DIR / "queue.sock").exists():
        return MACHINE_DIR
    base = os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share")
    return Path(base) / "redline" / "queue"


def request(payload: dict[str, Any], directory: Path | None = None, *, start: bool = True) -> dict[str, Any]:
    """The daemon's answer to ``payload``; BadInput with the daemon's one line when it refuses. Without a
    daemon, one is started (``start``) where this user may run one."""
    directory = directory or queue_dir()
    try:
        return _ask(directory / "queue.sock", payload)
    except (FileNotFoundError, ConnectionRefusedError):
        if not start:
            raise QueueUnavailable(f"no queue daemon answers at {directory}") from None
    start_daemon(directory)
    return _ask(directory / "queue.sock", payload)


def _ask(path: Path, payload: dict[str, Any]) -> dict[str, Any]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(str(path))
        sock.sendall(json.dumps(payload).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = sock.recv(1 << 16)
            if not chunk:
                break
            data += chunk
    if not data:
        raise QueueUnavailable(f"the queue daemon at {path.parent} closed the connection without an answer")
    answer = json.loads(data)
    if not answer.pop("ok"):
        raise BadInput(answer["error"])
    return answer


def start_daemon(directory: Path) -> None:
    """Start this user's daemon for ``directory``, detached (it outlives this command), and wait until it
    answers. Another process starting one at the same time is fine: the second daemon exits (one lock)."""
    if directory == MACHINE_DIR and os.geteuid() != 0:
        raise QueueUnavailable(
            f"the machine's queue at {directory} is not running: `systemctl start redline-queue` (as root)"
        )
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "daemon.log", "ab") as log:
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
            _ask(directory / "queue.sock", {"op": "status"})
            return
        except (FileNotFoundError, ConnectionRefusedError):
            if daemon.poll() not in (None, 0):
                break
            time.sleep(0.05)
    raise QueueUnavailable(f"the queue daemon did not start; see {directory / 'daemon.log'}")
