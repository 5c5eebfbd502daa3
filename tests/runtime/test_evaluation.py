"""Evaluation beside a sharded model (issue 42, item 7): on every rank in ``run.evaluating()``; on rank 0 alone,
one line naming the cause and the fix instead of a silent hang; ``run.is_main`` for what only rank 0 does."""

from __future__ import annotations

from pathlib import Path

import eval_worker
import pytest
import torch
from order_worker import model
from torch import nn

from conftest import run_cli
from ranks import script_pythonpath
from redline.runtime.prepare import prepare

WORKER = Path(eval_worker.__file__)


def launch(tmp_path: Path, evaluation: str, wait: float) -> tuple[int, str, dict | None]:
    """``eval_worker`` through ``redline run`` on 2 ranks: the exit status, stderr and rank 0's result."""
    out = tmp_path / "result.pt"
    env = {"OUT": str(out), "EVAL": evaluation, "WAIT": str(wait), "PYTHONPATH": script_pythonpath()}
    result = run_cli("run", "--nproc-per-node", "2", str(WORKER), env=env, cwd=tmp_path, timeout=600)
    return result.returncode, result.stderr, torch.load(out) if out.exists() else None


@pytest.mark.ranks
def test_an_evaluation_on_every_rank_computes_with_the_whole_model(tmp_path: Path) -> None:
    """``run.evaluating()`` on both ranks of an FSDP2 plan: eval mode, no gradients, the whole model's loss
    (each rank its half of the samples, summed), the training mode back afterwards."""
    code, stderr, result = launch(tmp_path, "all", wait=120)
    assert code == 0, stderr[-3000:]
    assert result is not None
    assert (result["in_eval_mode"], result["grad_enabled"], result["training_after"]) == (True, False, True)
    whole = model()
    whole.load_state_dict(result["whole"])
    x, y = result["validation"]
    with torch.no_grad():
        expected = nn.functional.mse_loss(whole(x), y).item()
    assert result["loss"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.ranks
@pytest.mark.parametrize(
    ("evaluation", "doing"),
    [
        ("rank0", "ran the model outside the training step (an evaluation?)"),
        ("state_rank0", "asked for the whole model (run.state_dict())"),
    ],
)
def test_rank_0_alone_with_a_sharded_model_is_one_line_not_a_hang(tmp_path: Path, evaluation: str, doing: str) -> None:
    """A script written for DDP evaluates (or gathers the model) on rank 0 only: under FSDP2 rank 0 waited in
    its first all-gather for a rank that had gone on, without a word. Now, after ``wait_for_ranks_s``, one
    line names the rank that did not come, the cause and the fix."""
    code, stderr, _ = launch(tmp_path, evaluation, wait=3)
    assert code != 0
    said = (
        f"redline: rank 0: rank 0 {doing} and rank(s) 1 did not within 3 s: the model is sharded (FSDP2, fsdp) "
        "and every forward gathers it from every rank, so evaluate on every rank (`with run.evaluating():`) and "
        "keep what only rank 0 does under `if run.is_main:`"
    )
    assert said in stderr, stderr[-3000:]
    assert "redline: rank 0 failed first" in stderr, stderr[-3000:]


@pytest.mark.ranks
def test_ranks_that_meet_for_different_work_end_in_one_line(tmp_path: Path) -> None:
    """Rank 0 evaluates alone, then every rank asks for the whole model: rank 0's forward and rank 1's state
    dict meet at once, and their gathers would pair wrongly; what they came for differs, said in one line."""
    code, stderr, _ = launch(tmp_path, "mixed", wait=120)
    assert code != 0
    said = (
        "redline: rank 0: rank 0 ran the model outside the training step (an evaluation?) while rank 1 asked for "
        "the whole model (run.state_dict()): under sharding (FSDP2, fsdp) every rank does the same work"
    )
    assert said in stderr, stderr[-3000:]


def test_on_one_process_evaluating_is_eval_mode_without_gradients_and_loss_is_the_last_steps() -> None:
    net = model()
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=4
    )
    run = prepare(net, torch.optim.SGD(net.parameters(), lr=0.1), data)
    assert run.is_main and run.loss is None  # no step yet
    for x, y in run.micro_batches():
        with run.accumulate():
            loss = nn.functional.mse_loss(run.model(x), y)
            run.backward(loss)
    assert run.loss == pytest.approx(loss.item())  # the last step's: one process, one micro-batch per step
    with run.evaluating() as evaluated:
        assert evaluated is run.model and not evaluated.training and not torch.is_grad_enabled()
        evaluated(torch.randn(2, 4))
    assert run.model.training and torch.is_grad_enabled()
    run.model.eval()
    with run.evaluating():
        pass
    assert not run.model.training  # the mode it had before, not train()
    run.close(checkpoint=False)
