"""ui.phase: a long phase is said on stderr (a spinner on a terminal, one plain line off one), never on stdout;
`redline plan` says its model's trace, which left a terminal blank for 13-20 s."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import pytest
from rich.console import Console

from conftest import run_cli
from redline.cli import ui


def _stderr(monkeypatch: pytest.MonkeyPatch, *, terminal: bool) -> io.StringIO:
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=terminal, width=80, markup=False, color_system=None)
    monkeypatch.setattr(ui, "err_console", console)
    return buffer


def test_off_a_terminal_a_long_phase_is_one_plain_line(monkeypatch: pytest.MonkeyPatch) -> None:
    said = _stderr(monkeypatch, terminal=False)
    with ui.phase("tracing config.json", after_s=0.05) as update:
        for done in range(3):
            update(done, 3)  # a count is for a terminal: no redraws in a log
            time.sleep(0.1)
    assert said.getvalue() == "redline: tracing config.json ...\n"


def test_off_a_terminal_a_short_phase_says_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    said = _stderr(monkeypatch, terminal=False)
    with ui.phase("tracing config.json", after_s=0.5):
        pass
    time.sleep(0.6)  # past the time it would have said it
    assert said.getvalue() == ""


def test_on_a_terminal_a_spinner_with_the_count(monkeypatch: pytest.MonkeyPatch) -> None:
    drawn = _stderr(monkeypatch, terminal=True)
    with ui.phase("ranking cloud instances for gpt2") as update:
        update(7, 40)
        time.sleep(0.3)  # the live display redraws several times a second
    text = drawn.getvalue()
    assert "ranking cloud instances for gpt2" in text and "7/40" in text
    assert "0:00:00" in text  # the time spent so far


SLOW_FACTORY = """
import time

from torch import nn

time.sleep(2.5)  # importing the model's code takes a while, as a Hugging Face model's does


def model():
    return nn.Sequential(nn.Linear(16, 16)), (16,)
"""


@pytest.mark.slow  # the model's import sleeps past the 2 s after which a phase is said
def test_plan_says_it_is_profiling_a_slow_model_on_stderr_only(tmp_path: Path) -> None:
    (tmp_path / "slow_model.py").write_text(SLOW_FACTORY)
    result = run_cli("plan", "-m", "slow_model:model", "--hardware", "1xa10g", "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["plan"]  # stdout is the JSON alone
    assert result.stderr.count("redline: profiling slow_model:model ...\n") == 1, result.stderr
