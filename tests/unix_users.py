"""A second Unix user, for the tests of what one user may do to another's files, processes and sockets.

``second_user()`` makes one (``useradd``, no home, no shell) and removes it after; the tests run as root (CI
does), elsewhere they are skipped. The fixtures ``other_user`` and ``stranger`` are two such users, one per
test (a plugin: tests/conftest.py names this module). ``as_user(uid, call)`` runs ``call()`` in a forked
child that has become that user (groups, gid, uid), so it is the kernel, not the test, that says what the user
may do; the child's result or its exception comes back as JSON.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import subprocess
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import pytest


@contextlib.contextmanager
def second_user(name: str = "redline-other") -> Iterator[int]:
    """A user made for the test and removed after (with whatever processes it still runs): its uid."""
    if os.geteuid() != 0:
        pytest.skip("making a second Unix user needs root (CI runs as root)")
    made = subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name], capture_output=True)
    if made.returncode not in (0, 9):  # 9: it exists (a test run killed before its cleanup)
        pytest.skip(f"cannot make a second user: {made.stderr.decode().strip()}")
    uid = pwd.getpwnam(name).pw_uid
    try:
        yield uid
    finally:
        subprocess.run(["pkill", "-KILL", "-U", str(uid)], capture_output=True)
        subprocess.run(["userdel", name], capture_output=True)


@pytest.fixture
def other_user() -> Iterator[int]:
    """A second Unix user, made for the test and removed after: its uid."""
    with second_user("redline-qtest") as uid:
        yield uid


@pytest.fixture
def stranger() -> Iterator[int]:
    """Another user, of another name (a test may want two, and suites running at once each their own): its
    uid; the trust checks' messages name it (redline-stranger)."""
    with second_user("redline-stranger") as uid:
        yield uid


class Refused(Exception):
    """What the call raised in the other user's process: ``kind`` (the exception's class name) and its text."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind, self.message = kind, message


def as_user(uid: int, call: Callable[[], Any]) -> Any:
    """``call()``'s result (JSON-able), run as ``uid`` in a forked child; Refused with what it raised."""
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover (runs in the child)
        try:
            os.setgroups([])
            os.setgid(pwd.getpwuid(uid).pw_gid)
            os.setuid(uid)
            try:
                outcome = {"result": call()}
            except BaseException as exc:
                outcome = {"raised": type(exc).__name__, "message": str(exc), "trace": traceback.format_exc()}
            os.write(write, json.dumps(outcome).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        text = pipe.read()
    os.waitpid(child, 0)
    outcome = json.loads(text)
    if "raised" in outcome:
        raise Refused(outcome["raised"], outcome["message"])
    return outcome["result"]
