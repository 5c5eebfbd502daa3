"""Every sharding starts from rank 0's model: a script that seeds each rank apart, as nanoGPT does
(``torch.manual_seed(1337 + rank)``), trains on two gloo ranks (fp32) to the weights of the same loop without
redline in one process seeded as rank 0 (``start_worker.TOLERANCE``), and is told once that its ranks' weights
differed."""

from __future__ import annotations

from pathlib import Path

import pytest
import start_worker

MLP = {"data": 2, "micro_batch": 4, "accumulation": 2}  # a global batch of 16, 4 steps
PLANS = {
    "ddp": ("mlp", MLP | {"sharding": "ddp"}),
    "zero1": ("mlp", MLP | {"sharding": "zero1"}),
    "zero2": ("mlp", MLP | {"sharding": "zero2"}),
    "fsdp": ("mlp", MLP | {"sharding": "fsdp"}),
    "hsdp": ("mlp", MLP | {"sharding": "hsdp"}),
    "tensor": ("gpt", {"tensor": 2, "micro_batch": 8}),
    "pipeline": ("gpt", {"pipeline": 2, "micro_batch": 2, "accumulation": 4}),
}
SAID = "the ranks built different weights (a seed per rank?): each starts from rank 0's"


@pytest.mark.ranks
@pytest.mark.parametrize("plan", list(PLANS))
def test_ranks_seeded_apart_train_as_one_process_seeded_as_rank_0(tmp_path: Path, plan: str) -> None:
    """DDP replaced the other ranks' weights by rank 0's already; FSDP2 (ZeRO-2, FSDP, HSDP) and tensor and
    pipeline parallelism cut each rank's share from the weights it built. The MLP's broadcast goes in buckets of
    100 bytes: its weights in pieces, several to a bucket; its mixing buffer, drawn from the seed too, is not
    contiguous."""
    kind, strategy = PLANS[plan]
    env = {"OPTIMIZER": "sgd", "SEEDS": "per-rank"} | ({"BUCKET_BYTES": "100"} if kind == "mlp" else {})
    weights, outputs = start_worker.two_ranks(tmp_path, kind, strategy, **env)
    global_batch = 16 if kind == "mlp" else 8
    start_worker.assert_same(weights, start_worker.reference(kind, "sgd", global_batch), kind)
    assert outputs[0].count(SAID) == 1 and SAID not in outputs[1]


@pytest.mark.ranks
def test_ranks_seeded_alike_are_not_told(tmp_path: Path) -> None:
    _, outputs = start_worker.two_ranks(tmp_path, "mlp", MLP | {"sharding": "fsdp"}, OPTIMIZER="sgd", SEEDS="alike")
    assert not any(SAID in output for output in outputs)


@pytest.mark.ranks
def test_ranks_that_built_other_shapes_are_refused_in_one_line_before_any_broadcast(tmp_path: Path) -> None:
    env = {"OPTIMIZER": "sgd", "SEEDS": "alike", "WIDTH_ON_RANK1": "8"}
    start_worker.two_ranks(tmp_path, "mlp", MLP | {"sharding": "fsdp"}, **env)
    for rank in (0, 1):
        error = (tmp_path / f"w.error.{rank}").read_text()
        assert error.startswith("the ranks built models of different shapes: every rank must build the same model")
        assert "\n" not in error
