"""`redline monitor` started before the training run: it says where it looks for the step files, and the run's
steps show in the live view and on /metrics once the run writes them. In process: the CLI's own function, its
console a terminal of a given width, the sampling loop driven one sample at a time (so the test waits on
samples, not on the clock), the steps written by the runtime's own writer."""

from __future__ import annotations

import io
import re
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console

from ports import free_port
from redline.cli import monitor as monitor_cli
from redline.cli import ui
from redline.monitor import sampler as sampler_module
from redline.monitor.steps import DEFAULT_STEPS
from redline.runtime.metrics import StepMetrics
from tables import WIDTHS

ESCAPE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # the cursor moves and erasures of a live screen
STEPS = 3
MAX_SAMPLES_AFTER_THE_RUN = 5  # a sample reads every whole line written before it: one should do


def scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()


def run_training(steps: int) -> None:
    """A training run in this folder, as the examples write their steps (``metrics_path=DEFAULT_STEPS``)."""
    metrics = StepMetrics(device=torch.device("cpu"), path=DEFAULT_STEPS, console=None)
    for _ in range(steps):
        with metrics.compute():
            pass
        metrics.end_step(samples=8, loss=2.5, micro_batch=8, accumulation=1)
    metrics.close()


def monitor(port: int) -> None:
    """`redline monitor --port PORT`, every option as the command line leaves it."""
    monitor_cli.monitor(
        interval=1.0,
        record=None,
        retention=None,
        port=port,
        listen=None,
        steps=[],
        gpus=None,
        job_pids=[],
        window="60s",
        duration=None,
        once=False,
        json_out=False,
    )


@pytest.mark.parametrize("width", WIDTHS)
def test_a_monitor_started_before_the_run_shows_its_steps_live_and_on_metrics(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, width: int
) -> None:
    monkeypatch.chdir(tmp_path)  # a fresh folder: no run has written a step file here yet
    screen, said = io.StringIO(), io.StringIO()
    monkeypatch.setattr(ui, "console", Console(file=screen, width=width, force_terminal=True, color_system=None))
    monkeypatch.setattr(ui, "err_console", Console(file=said, width=width, color_system=None))
    port = free_port()
    seen: dict[str, Any] = {}

    def samples_one_by_one(sampler: Any, interval_s: float, on_sample: Callable[[Any], None], stop: Any) -> None:
        on_sample(sampler.sample())  # the monitor's first look: no run yet
        seen["before"] = (ESCAPE.sub("", screen.getvalue()), scrape(port))
        run_training(STEPS)
        for _ in range(MAX_SAMPLES_AFTER_THE_RUN):
            on_sample(sampler.sample())
            seen["metrics"] = scrape(port)
            if f'redline_train_step{{rank="0"}} {STEPS:.1f}' in seen["metrics"]:
                break

    monkeypatch.setattr(sampler_module, "run_sampler", samples_one_by_one)
    monitor(port)

    assert 'redline_train_loss{rank="0"} 2.5' in seen["metrics"], seen["metrics"]
    lines = ESCAPE.sub("", screen.getvalue()).splitlines()
    assert any(line.startswith(f"rank 0: step {STEPS} |") for line in lines), lines
    assert all(len(line.rstrip()) <= width for line in lines), [line for line in lines if len(line) > width]

    watched = str(tmp_path / DEFAULT_STEPS)
    assert f"watching for step files at {watched}: none yet" in said.getvalue().replace("\n", "")
    before_screen, before_metrics = seen["before"]
    assert "steps: none yet" in before_screen and "rank 0" not in before_screen
    assert "watching" in before_screen and watched.replace("{rank}", "*") in "".join(before_screen.splitlines())
    assert "redline_train_step{" not in before_metrics
