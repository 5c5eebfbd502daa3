"""The examples train as documented: plain python, and two ranks through `redline run`."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import run_cli

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.slow
@pytest.mark.parametrize("script", ["train_gpt.py", "train_cnn.py"])
def test_example_trains_on_the_cpu(script: str, tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--epochs", "1", "--checkpoint-dir", str(tmp_path / "ckpt")],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=tmp_path,  # the examples write their step metrics in the working directory
    )
    assert result.returncode == 0, result.stderr
    assert "redline:" in result.stderr and "steps" in result.stderr  # the summary line
    assert any(p.name.startswith("step-") for p in (tmp_path / "ckpt").iterdir())


@pytest.mark.slow
@pytest.mark.ranks
def test_example_on_two_ranks_through_redline_run(tmp_path: Path) -> None:
    args = ("run", "--nproc-per-node", "2", str(EXAMPLES / "train_gpt.py"), "--epochs", "1")
    result = run_cli(*args, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "redline:" in result.stderr


@pytest.mark.slow
def test_redline_monitor_follows_the_steps_redline_run_writes(tmp_path: Path) -> None:
    """`redline run --metrics 'm-{rank}.jsonl'` and `redline monitor --steps 'm-{rank}.jsonl'` together: the
    monitor, started first, picks the files up as the run creates them and reports every step, with tokens/s
    from the batches' sequence length (the example has no plan)."""
    monitor = subprocess.Popen(
        [sys.executable, "-m", "redline", "monitor", "--steps", "m-{rank}.jsonl", "--json", "--interval", "0.2"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen: list[dict] = []

    def read() -> None:
        for line in monitor.stdout:
            seen.extend(json.loads(line)["steps"])

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        args = ("--metrics", "m-{rank}.jsonl", str(EXAMPLES / "train_gpt.py"), "--epochs", "1", "--batch", "256")
        result = run_cli("run", *args, timeout=300, cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        deadline = time.monotonic() + 120  # a loaded machine's monitor may poll late, never this late
        while len(seen) < 8 and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        monitor.terminate()  # SIGTERM ends a monitor as Ctrl-C does
    monitor.wait(timeout=60)
    reader.join(timeout=10)  # the reader alone reads stdout
    assert monitor.returncode == 0, monitor.stderr.read()
    written = [json.loads(line) for line in (tmp_path / "m-0.jsonl").read_text().splitlines()]
    assert [s["step"] for s in seen] == [r["step"] for r in written] == list(range(1, 9))
    assert all(s["tokens_per_s"] == pytest.approx(s["samples_per_s"] * 64) for s in seen)
    assert not (tmp_path / "redline-steps").exists()  # --metrics wins over the example's own default


def test_redline_monitor_follows_the_examples_default_steps(tmp_path: Path, monkeypatch) -> None:
    from redline.monitor.steps import DEFAULT_STEPS, step_patterns

    monkeypatch.chdir(tmp_path)
    # watched before any run has written there (a monitor is often started first), as an absolute path
    assert step_patterns([]) == [str(Path.cwd() / DEFAULT_STEPS)]
    assert step_patterns(["m-{rank}.jsonl"]) == [str(Path.cwd() / "m-{rank}.jsonl")]  # --steps replaces it
