"""The examples train as documented: plain python, and two ranks through `redline run`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_cli

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("script", ["train_gpt.py", "train_cnn.py"])
def test_example_trains_on_the_cpu(script: str, tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--epochs", "1", "--checkpoint-dir", str(tmp_path / "ckpt")],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "redline:" in result.stderr and "steps" in result.stderr  # the summary line
    assert any(p.name.startswith("step-") for p in (tmp_path / "ckpt").iterdir())


def test_example_on_two_ranks_through_redline_run() -> None:
    result = run_cli("run", "--nproc-per-node", "2", str(EXAMPLES / "train_gpt.py"), "--epochs", "1", timeout=300)
    assert result.returncode == 0, result.stderr
    assert "redline:" in result.stderr
