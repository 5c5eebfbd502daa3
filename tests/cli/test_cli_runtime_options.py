"""The runtime's options on the command line: `redline plan` writes them into the plan's `runtime:` section
(and fixes the accumulation of its search), `redline run` hands them to the script's prepare() over the plan's,
and a bad value is one line and exit 2 before anything starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_cli
from redline.plan.planfile import load_plan

PLAN = ("plan", "-m", "gpt2", "--hardware", "8xh100-sxm", "--global-batch", "64")


def test_plan_writes_the_runtime_options_and_fixes_the_accumulation(tmp_path: Path) -> None:
    out = tmp_path / "plan.yaml"
    options = ("--accumulation", "4", "--metrics", "m-{rank}.jsonl", "--checkpoint-every", "5", "--compile")
    result = run_cli(*PLAN, *options, "-o", str(out))
    assert result.returncode == 0, result.stderr
    plan = load_plan(out)
    assert plan.strategy.accumulation == 4
    assert plan.strategy.micro_batch * 4 * plan.strategy.data == 64
    assert plan.runtime == {
        "numerics": {"compile": True},
        "checkpoint": {"every": 5},
        "metrics": {"path": "m-{rank}.jsonl"},
    }


@pytest.mark.slow
def test_run_hands_its_options_to_the_script(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        "import torch\n"
        "import redline\n"
        "model = torch.nn.Linear(2, 1)\n"
        "data = torch.utils.data.TensorDataset(torch.randn(8, 2), torch.randn(8, 1))\n"
        "loader = torch.utils.data.DataLoader(data, batch_size=4)\n"
        "run = redline.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), loader, checkpoint_every=9)\n"
        "print(run.config.checkpoint.every, run.config.metrics.path, run.micro_batch, run.accumulation)\n"
    )
    options = ("--checkpoint-every", "3", "--metrics", str(tmp_path / "m.jsonl"), "--accumulation", "2")
    result = run_cli("run", *options, str(script), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    # the command line over the script's keyword; accumulation 2 splits the loader's batch of 4 in 2 x 2
    assert result.stdout.split() == ["3", str(tmp_path / "m.jsonl"), "2", "2"]


def test_run_dry_run_shows_the_options_it_hands_over(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('must not run')\n")
    result = run_cli("run", "--dry-run", "--json", "--num-workers", "2", "--comm-hook", "bf16", str(script))
    assert result.returncode == 0, result.stderr
    handed = json.loads(json.loads(result.stdout)["env"]["REDLINE_RUNTIME"])
    assert handed == {"num_workers": 2, "comm_hook": "bf16"}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("run", "--dry-run", "--checkpoint-every", "-1", "SCRIPT"), "checkpoint_every must be 0 or more"),
        (("run", "--dry-run", "--comm-hook", "zip", "SCRIPT"), "comm_hook 'zip' is not one of"),
        (("run", "--dry-run", "--accumulation", "0", "SCRIPT"), "--accumulation"),
        ((*PLAN, "--num-workers", "-2"), "num_workers must be 0 or more"),
        ((*PLAN, "--metrics", ""), "metrics_path is empty"),
        (("plan", "-m", "gpt2", "--cloud", "--tokens", "1B", "--metrics", "m.jsonl"), "--metrics is a setting of"),
    ],
)
def test_a_bad_runtime_option_is_one_line(tmp_path: Path, args: tuple[str, ...], message: str) -> None:
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('must not run')\n")
    result = run_cli(*(str(script) if arg == "SCRIPT" else arg for arg in args))
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and result.stderr.count("\n") == 1, result.stderr
