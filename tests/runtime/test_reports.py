"""What the runtime says about a run: honest steps and losses across resumes, plans that do not match, and
figures that cannot be true."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from redline.errors import BadInput
from redline.plan.strategy import Strategy
from redline.runtime.config import PlanFacts, RunConfig
from redline.runtime.prepare import prepare
from redline.runtime.step_lines import _mfu


def data() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    dataset = torch.utils.data.TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g))
    return torch.utils.data.DataLoader(dataset, batch_size=4)


def train(epochs: int, facts: PlanFacts | None = None, **overrides) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    plan = RunConfig(strategy=Strategy(micro_batch=4, precision="fp32"), plan=facts or PlanFacts())
    plan = plan.with_settings(overrides)
    run = prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), data(), plan=plan)
    for x, y in run.micro_batches(epochs=epochs):
        with run.accumulate():
            run.backward(nn.functional.mse_loss(run.model(x), y))


def test_a_resumed_run_continues_the_step_count_with_its_attempt(tmp_path: Path) -> None:
    """A resumed run's metrics used to restart at step 1, with nothing to tell the attempts apart."""
    metrics = tmp_path / "steps.jsonl"
    train(1, checkpoint_dir=str(tmp_path / "ckpt"), metrics_path=str(metrics))
    train(2, checkpoint_dir=str(tmp_path / "ckpt"), metrics_path=str(metrics))
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [(r["step"], r["attempt"]) for r in lines] == [
        (1, 0),
        (2, 0),
        (3, 0),
        (4, 0),
        (5, 1),
        (6, 1),
        (7, 1),
        (8, 1),
    ]


def test_restarts_that_resume_from_one_checkpoint_have_their_own_attempts(tmp_path: Path) -> None:
    """Each attempt was the saved checkpoint's + 1: two crashes after one checkpoint read as one attempt."""
    metrics = tmp_path / "steps.jsonl"
    settings = {"checkpoint_dir": str(tmp_path / "ckpt"), "metrics_path": str(metrics), "checkpoint_every": 2}

    def crash_at(step: int) -> None:
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        plan = RunConfig(strategy=Strategy(micro_batch=4, precision="fp32")).with_settings(settings)
        run = prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), data(), plan=plan)
        with pytest.raises(RuntimeError, match="crash"):
            for x, y in run.micro_batches():
                with run.accumulate():
                    if run.step == step:
                        raise RuntimeError("crash")  # in the step: no checkpoint on the way out
                    run.backward(nn.functional.mse_loss(run.model(x), y))

    crash_at(3)  # checkpoint at step 2, then a crash after step 3
    crash_at(3)  # resumes from step 2, crashes after step 3 again: no new checkpoint
    train(1, **settings)  # resumes from step 2 and completes
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [(r["step"], r["attempt"]) for r in lines] == [(1, 0), (2, 0), (3, 0), (3, 1), (3, 2), (4, 2)]


def test_a_finished_run_run_again_says_so(tmp_path: Path, caplog) -> None:
    train(1, checkpoint_dir=str(tmp_path / "ckpt"))
    with caplog.at_level("WARNING", logger="redline.runtime"):
        train(1, checkpoint_dir=str(tmp_path / "ckpt"))
    assert "nothing to train: the checkpoint in" in caplog.text and "at step 4, after epoch 1 of 1" in caplog.text


def test_a_recorded_micro_batch_is_said_and_cleared_when_the_run_completes(tmp_path: Path, caplog) -> None:
    """It stayed next to the checkpoints and silently applied to every later run."""
    from redline.runtime.checkpoint import MICRO_BATCH_FILE, Checkpointer

    Checkpointer(tmp_path / "ckpt").record_micro_batch(2, 2)
    with caplog.at_level("WARNING", logger="redline.runtime"):
        train(1, checkpoint_dir=str(tmp_path / "ckpt"))
    assert f"{MICRO_BATCH_FILE} records micro-batch 2 x 2" in caplog.text
    assert not (tmp_path / "ckpt" / MICRO_BATCH_FILE).exists()


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"facts": PlanFacts(device="NVIDIA H100 SXM5 80GB")}, "made for NVIDIA H100 SXM5 80GB and this run is on cpu"),
        ({"facts": PlanFacts(params=1000)}, "made for a model of 1,000 parameters and this model has 5"),
    ],
)
def test_a_plan_for_other_hardware_or_another_model_is_said_when_run_anyway(caplog, overrides, expected) -> None:
    """Refused without plan_anyway (tests/runtime/test_plan_fit.py)."""
    with caplog.at_level("WARNING", logger="redline.runtime"):
        train(1, plan_anyway=True, **overrides)
    assert expected in caplog.text


def test_a_plan_for_this_device_and_model_says_nothing(caplog) -> None:
    with caplog.at_level("WARNING", logger="redline.runtime"):
        train(1, facts=PlanFacts(device="cpu", params=5))
    assert "plan" not in caplog.text


def test_utilisation_over_100_percent_is_not_printed_as_fact() -> None:
    assert _mfu(0.41, 0.5) == "MFU 41.0%, 50.0% of measured peak"
    assert _mfu(10.3, None) == "MFU 1030% (over 100%: a wrong peak or FLOP count)"


def test_an_optimizer_factory_that_expects_the_model_is_told_what_it_gets() -> None:
    model = nn.Linear(4, 1)
    with pytest.raises(BadInput, match="receives a flat list of the wrapped model's trainable parameters"):
        prepare(model, lambda m: torch.optim.AdamW(m.parameters()), data(), plan=RunConfig())
