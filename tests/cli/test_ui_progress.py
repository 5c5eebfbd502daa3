"""ui.progress_bar off a terminal (a pipe, a job log): one plain stderr line per description that lasts, as
ui.phase says a long phase; a 10-minute `redline tune` in a job log printed nothing until its end."""

from __future__ import annotations

import io
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from rich.console import Console
from rich.text import Text

from conftest import run_cli
from redline.cli import ui


@pytest.fixture
def said(monkeypatch: pytest.MonkeyPatch) -> io.StringIO:
    """What ui writes on stderr, off a terminal."""
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=False, width=80, markup=False, color_system=None)
    monkeypatch.setattr(ui, "err_console", console)
    return buffer


@pytest.fixture
def timers(monkeypatch: pytest.MonkeyPatch) -> list[threading.Timer]:
    """Every timer a line waits on: a test joins them, so it waits for the lines' events, not a guessed sleep."""
    started: list[threading.Timer] = []
    start = ui._say_later

    def recorded(after_s: float, line: Callable[[], Text | None]) -> threading.Timer:
        timer = start(after_s, line)
        started.append(timer)
        return timer

    monkeypatch.setattr(ui, "_say_later", recorded)
    return started


def test_one_line_per_description_that_lasts_with_its_count(
    said: io.StringIO, timers: list[threading.Timer], capsys: pytest.CaptureFixture[str]
) -> None:
    with ui.progress_bar(after_s=0.01) as progress:
        progress("trial 1: baseline", 0, 12)
        timers[-1].join()  # the trial outlasts after_s: said once
        for done in (1, 1, 1):
            progress("trial 1: baseline", done, 12)  # updates of the same description: no redraws in a log
        progress("memory: host copy", 0, 1)  # a count of one says nothing
        timers[-1].join()
    assert len(timers) == 2
    assert said.getvalue() == "redline: trial 1: baseline (0/12 done) ...\nredline: memory: host copy ...\n"
    assert capsys.readouterr().out == ""  # stdout is the results' (and --json's) alone


def test_descriptions_that_end_sooner_say_nothing(said: io.StringIO, timers: list[threading.Timer]) -> None:
    with ui.progress_bar(after_s=60) as progress:
        progress("building eager at batch 1", 0, 7)
        progress("building compile at batch 1", 1, 7)  # replaces the first before its 60 s
        progress("timing 2 backend(s) at batch 1", 2, 7)
    for timer in timers:
        timer.join(timeout=5)  # cancelled: they end at once
        assert not timer.is_alive()
    assert len(timers) == 3 and said.getvalue() == ""


def test_a_description_replaced_as_its_line_comes_due_says_nothing(
    said: io.StringIO, monkeypatch: pytest.MonkeyPatch
) -> None:
    due: list[Callable[[], Text | None]] = []  # each line as its timer would make it, made here by hand

    def held(after_s: float, line: Callable[[], Text | None]) -> threading.Timer:
        due.append(line)
        return threading.Timer(after_s, line)  # never started: the test fires the lines

    monkeypatch.setattr(ui, "_say_later", held)
    with ui.progress_bar() as progress:
        progress("storage seq_read", 0, 3)
        progress("storage small_files", 1, 3)
        stale, current = due
        assert stale() is None
        line = current()
        assert line is not None and line.plain == "redline: storage small_files (1/3 done) ..."


def test_disabled_it_says_nothing(said: io.StringIO, timers: list[threading.Timer]) -> None:
    with ui.progress_bar(enabled=False, after_s=0) as progress:  # --json, a follower's bench
        progress("compute: matmul on cpu", 0, 3)
    assert timers == [] and said.getvalue() == ""


SLOW_SCRIPT = """
    import time

    import torch

    import redline

    time.sleep(2.5)  # the trial lasts past the 2 s after which its progress is said
    model = torch.nn.Linear(8, 1)
    data = torch.utils.data.TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
    run = redline.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01), torch.utils.data.DataLoader(data, 32))
    for x, y in run.micro_batches():
        with run.accumulate():
            run.backward(torch.nn.functional.mse_loss(run.model(x), y))
"""


@pytest.mark.slow  # a real trial: the script launched by `redline run`
def test_tune_in_a_job_log_says_each_long_trial_on_stderr(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(textwrap.dedent(SLOW_SCRIPT))
    space = ("--space", "compile=", "--space", "num_workers=", "--space", "cpu_threads=1")
    args = ("tune", "--trial-steps", "2", "--warmup", "1", *space, "--max-trials", "1", "--cache-dir", "cache")
    result = run_cli(*args, "train.py", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("redline: trial 1: baseline (0/"), result.stderr
    assert lines[0].endswith(" done) ...") and "baseline" in result.stdout  # the trials' table: stdout
