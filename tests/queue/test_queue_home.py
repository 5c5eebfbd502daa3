"""Where redline keeps its state: one rule (``redline.env.state_dir``). ``$REDLINE_HOME`` holds every part, the
queue included, even for root and beside a running machine queue; without it the queue is the machine's where
its daemon runs, else the user's own; `redline jobs` and `redline submit` say which one they talk to."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import run_cli
from queue_daemons import stop_daemon
from redline import env
from redline.bench import store
from redline.env import State, state_dir
from redline.queue import client
from redline.transfer.cache import default_root
from redline.tune import journal


@pytest.fixture
def machine_queue(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A stand-in for /var/lib/redline/queue with its daemon's socket open, and no variable set."""
    folder = tmp_path / "machine"
    folder.mkdir()
    for name in ("REDLINE_HOME", "REDLINE_QUEUE_DIR", "REDLINE_TUNE_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.setattr(env, "MACHINE_QUEUE", folder)
    monkeypatch.setattr(client, "MACHINE_DIR", folder)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listening:
        listening.bind(str(folder / "queue.sock"))
        yield folder


def test_redline_home_holds_every_part_the_queue_included(
    machine_queue: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As root (these tests' user) and beside a running machine queue, $REDLINE_HOME still has its own queue: on
    main the queue went to the machine's, and tune's journals to ~/.cache whatever REDLINE_HOME said."""
    home = tmp_path / "home"
    monkeypatch.setenv("REDLINE_HOME", str(home))
    assert client.queue_dir() == home / "queue" and client.whose(client.queue_dir()) == "yours"
    assert journal.cache_dir() == home / "tune"
    assert store.runs_dir() == home / "bench"
    assert default_root() == home / "cache"
    assert {part: state_dir(part).parent for part in State} == {part: home for part in State} | {
        State.PUSH: home / "transfer"
    }


def test_without_redline_home_the_machine_queue_where_it_runs_else_the_users_own(
    machine_queue: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert client.queue_dir() == machine_queue and client.whose(machine_queue) == "the machine's"
    assert state_dir(State.BENCH) == tmp_path / "data" / "redline" / "bench"  # the rest: the user's data home
    monkeypatch.setattr(env.os, "geteuid", lambda: 1000)  # a user, once the machine's daemon is gone
    (machine_queue / "queue.sock").unlink()
    assert client.queue_dir() == tmp_path / "data" / "redline" / "queue"


def test_the_variables_that_name_one_part_win(
    machine_queue: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("REDLINE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("REDLINE_QUEUE_DIR", str(tmp_path / "q"))
    monkeypatch.setenv("REDLINE_TUNE_CACHE", str(tmp_path / "journals"))
    assert client.queue_dir() == tmp_path / "q"
    assert journal.cache_dir() == tmp_path / "journals"
    assert state_dir(State.STAGE) == tmp_path / "home" / "cache"


@pytest.fixture
def home_env(tmp_path: Path) -> Iterator[dict[str, str]]:
    """A REDLINE_HOME of the test's own (no queue folder named outright); its daemon stopped after."""
    home = tmp_path / "home"
    yield {"REDLINE_HOME": str(home), "REDLINE_QUEUE_DIR": ""}
    stop_daemon(home / "queue")


def test_jobs_and_submit_say_which_queue_and_json_stays_clean(home_env: dict[str, str]) -> None:
    queue = Path(home_env["REDLINE_HOME"]) / "queue"
    listed = run_cli("jobs", env=home_env)
    assert listed.returncode == 0, listed.stderr
    assert f"queue: {queue} (yours)" in listed.stderr
    assert (queue / "queue.sock").exists()  # the first use started the daemon there, not the machine's
    as_json = run_cli("jobs", "--json", env=home_env)
    assert as_json.returncode == 0 and json.loads(as_json.stdout)["jobs"] == [] and as_json.stderr == ""
    dry = run_cli("submit", "--dry-run", "--", "true", env=home_env)
    assert dry.returncode == 0 and f"queue: {queue} (yours)" in dry.stderr
    assert json.loads(dry.stdout)["argv"] == ["true"]
