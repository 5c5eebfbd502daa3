"""A plan made for another device or another model is refused in one line that says how to re-plan or force it;
the batches' tokens per sample count over a plan's; step lines say where the run is and when it ends.

Issue 43: the example's recipe planned 20M parameters on an H100's terms for a 0.9M-parameter model of 64-token
samples, and the run only warned: 85-120 s per step instead of under one, tokens/s 32x too high, "MFU 228%"."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import run_cli
from redline.errors import BadInput
from redline.plan.strategy import Strategy
from redline.runtime.config import PlanFacts, RunConfig
from redline.runtime.metrics import StepMetrics
from redline.runtime.plan_fit import PlanMismatch, replan_command
from redline.runtime.prepare import prepare
from redline.runtime.step_lines import SPLIT_LEGEND, eta_s, format_step

H100 = "NVIDIA H100 SXM5 80GB"


def tokens_data(samples: int = 16, seq: int = 8) -> torch.utils.data.DataLoader:
    """Token ids of ``seq`` per sample, and a target each: a language model's batches in miniature."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 16, (samples, seq), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids, torch.randn(samples, 1, generator=g)), 4)


def tiny_lm(seq: int = 8) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(16, 2), nn.Flatten(), nn.Linear(2 * seq, 1))  # 32 + 17 = 49 parameters


def train(facts: PlanFacts, epochs: int = 1, **settings) -> list:
    model = tiny_lm()
    plan = RunConfig(strategy=Strategy(micro_batch=4, precision="fp32"), plan=facts)
    run = prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), tokens_data(), plan=plan, **settings)
    for ids, y in run.micro_batches(epochs=epochs):
        with run.accumulate():
            run.backward(nn.functional.mse_loss(run.model(ids), y))
    return run.metrics.records


# ------------------------------------------------------------------------------------------- the refusal


@pytest.mark.parametrize(
    ("facts", "said"),
    [
        (PlanFacts(device=H100, params=49), f"it was made for {H100} and this run is on cpu"),
        (PlanFacts(device="cpu", params=20_000_000), "made for a model of 20,000,000 parameters and this model has 49"),
    ],
)
def test_a_plan_for_another_device_or_model_is_refused_saying_how_to_replan_or_force(facts, said) -> None:
    with pytest.raises(PlanMismatch) as refused:
        train(facts)
    message = str(refused.value)
    assert said in message and "\n" not in message
    assert "redline plan --params" in message and "--hardware local -o plan.yaml" in message
    assert "redline run --plan-anyway" in message and "plan_anyway=True" in message
    assert isinstance(refused.value, BadInput)  # exit 2 in the CLI


def test_a_plan_run_anyway_trains_and_says_it_does_not_fit(caplog) -> None:
    with caplog.at_level("WARNING", logger="redline.runtime"):
        records = train(PlanFacts(device=H100, params=20_000_000), plan_anyway=True)
    assert len(records) == 4
    assert f"the plan does not fit this run: it was made for {H100} and this run is on cpu" in caplog.text


def test_a_plan_for_this_device_and_a_model_within_ten_percent_runs_without_a_word(caplog) -> None:
    with caplog.at_level("WARNING", logger="redline.runtime"):
        assert len(train(PlanFacts(device="cpu", params=52))) == 4  # 49 is 6% off 52
    assert "plan" not in caplog.text


def test_the_replan_command_plans_the_same_model_and_batch_here() -> None:
    factory = {"model": "examples.train_gpt:Gpt", "input_shape": [64]}
    assert replan_command(factory, 64, 32) == (
        "redline plan --model examples.train_gpt:Gpt --input-shape 64 --global-batch 32 --hardware local -o plan.yaml"
    )
    bare = replan_command({"params": 20e6}, 2048, 256)  # --params assumed the default sequence: it is spelled out
    assert bare == "redline plan --params 20000000 --seq-len 2048 --global-batch 256 --hardware local -o plan.yaml"


def test_a_plan_for_a_gpu_is_refused_through_redline_run_before_any_rank_starts(tmp_path: Path) -> None:
    """Where the user sees it: a plan of eight H100s launched on this CPU is one line and exit 2, said before
    torchrun starts eight ranks to refuse it eight times, with the way out; --plan-anyway trains."""
    eight, one = tmp_path / "eight.yaml", tmp_path / "one.yaml"
    for hardware, plan in (("8xh100-sxm", eight), ("1xh100-sxm", one)):
        made = run_cli("plan", "--params", "20M", "--hardware", hardware, "--precision", "fp32", "-o", str(plan))
        assert made.returncode == 0, made.stderr[-2000:]
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch, redline
            from torch import nn

            torch.manual_seed(0)
            model = nn.Linear(4, 1)
            data = torch.utils.data.TensorDataset(torch.randn(512, 4), torch.randn(512, 1))  # 2 of the plan's 256
            run = redline.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                  torch.utils.data.DataLoader(data, batch_size=8))
            for x, y in run.micro_batches():
                with run.accumulate():
                    run.backward(nn.functional.mse_loss(run.model(x), y))
            """
        )
    )
    refused = run_cli("run", "--plan", str(eight), str(script))
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert refused.stderr.count("\n") == 1, refused.stderr  # one line: no rank started
    assert refused.stderr.startswith("redline: the plan does not fit this run: it was made for NVIDIA H100")
    assert "this machine has no CUDA GPU" in refused.stderr and "--plan-anyway" in refused.stderr
    assert "redline plan --params 20000000" in refused.stderr and "--hardware local" in refused.stderr

    forced = run_cli("run", "--plan", str(one), "--plan-anyway", "--max-steps", "2", str(script))
    assert forced.returncode == 0, forced.stderr[-3000:]
    assert "the plan does not fit this run" in forced.stderr and "step 1 of 2 (50%)" in forced.stderr

    alone = run_cli("run", "--plan-anyway", str(script))
    assert alone.returncode == 2 and "--plan-anyway goes with --plan" in alone.stderr


# ------------------------------------------------------------------------------------------- tokens per sample


def test_the_batches_tokens_per_sample_count_over_the_plans_and_the_flops_follow() -> None:
    """The plan's 2048 tokens per sample made tokens/s 32x too high and MFU 228% on 64-token samples."""
    lines: list[str] = []
    metrics = StepMetrics(
        device=torch.device("cpu"), tokens_per_sample=2048, flops_per_sample=2048e6, console=lines.append
    )
    metrics.count_tokens(64)
    assert (metrics.tokens_per_sample, metrics.flops_per_sample) == (64, 64e6)
    assert lines == [
        "redline: the batches hold 64 tokens per sample and the plan 2048: tokens/s and MFU count the batches', "
        "the plan's predictions are for 2048 (re-plan with --seq-len 64)"
    ]
    metrics.count_tokens(1)  # a batch without token ids: the count stands
    metrics.count_tokens(32)  # a shorter batch (dynamic padding): counted, not said again
    assert (metrics.tokens_per_sample, metrics.flops_per_sample, len(lines)) == (32, 32e6, 1)

    unplanned = StepMetrics(device=torch.device("cpu"), flops_per_sample=5.0, console=lines.append)
    unplanned.count_tokens(64)  # no plan: the batches say, silently, and the FLOPs are not the plan's to scale
    assert (unplanned.tokens_per_sample, unplanned.flops_per_sample, len(lines)) == (64, 5.0, 1)


def test_a_run_under_a_plan_of_another_sequence_length_counts_its_batches_tokens() -> None:
    records = train(PlanFacts(device="cpu", params=49, tokens_per_sample=2048, training_flops_per_sample=1e9))
    assert [r.tokens for r in records] == [4 * 8] * 4  # 4 samples of 8 tokens each step, not of 2048


# ------------------------------------------------------------------------------------------- step lines


def test_step_lines_say_how_far_the_run_is_and_when_it_ends(capfd) -> None:
    train(PlanFacts(), epochs=2, metrics_interval_s=0.0)
    err = capfd.readouterr().err.splitlines()
    steps = [line for line in err if line.startswith("step ")]
    assert [line.split(" | ")[0] for line in steps] == [f"step {i} of 8 ({100 * i / 8:.0f}%)" for i in range(1, 9)]
    assert all(" | ETA " in line for line in steps) and steps[-1].endswith("ETA 0 ms")
    assert err.count(SPLIT_LEGEND) == 1 and err.index(SPLIT_LEGEND) == err.index(steps[0]) + 1
    assert "other: the rest of the step" in SPLIT_LEGEND

    train(PlanFacts(), epochs=2, metrics_interval_s=0.0, max_steps=3)
    assert "step 3 of 3 (100%)" in capfd.readouterr().err


def test_a_step_line_without_a_known_length_has_no_total_and_no_eta() -> None:
    metrics = StepMetrics(device=torch.device("cpu"), console=None)
    record = metrics.end_step(samples=4, loss=1.0, micro_batch=4, accumulation=1)
    assert format_step(record).startswith("step 1 | loss 1 | ") and "ETA" not in format_step(record)
    assert eta_s([record], None) is None and eta_s([], 10) is None
    assert eta_s([record], 5) == pytest.approx(4 * record.time_s)
