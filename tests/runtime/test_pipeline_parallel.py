"""Pipeline parallelism on the CPU (gloo, fp32): the model cut into stages over ranks, run by each schedule,
trains as one process does; beside data- and tensor-parallel ranks too; a resumed run goes on bit-identically."""

from __future__ import annotations

import json
from pathlib import Path

import pp_worker
import pytest
import torch
import tp_worker

from ranks import script_pythonpath, spawn_ranks
from redline.errors import BadInput

WORKER = Path(pp_worker.__file__)
# fp32 over gloo: the micro-batches' gradients add up in another order than one process's whole batch
TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}
STEPS = tp_worker.SAMPLES // 8


def ranks(tmp_path: Path, model: str, world: int, strategy: dict, **env: str) -> tuple[dict, list[float]]:
    """The run's parameters (each rank's, merged: the stages hold disjoint ones, by the model's own names)
    and its step losses."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = tmp_path / "w"
    env = {"MODEL": model, "STRATEGY": json.dumps({"precision": "fp32"} | strategy), "OUT": str(out)} | env
    spawn_ranks(WORKER, world, store=tmp_path / "store", env=env)
    weights: dict[str, torch.Tensor] = {}
    for rank in range(world):
        weights |= torch.load(f"{out}.{rank}.pt")
    return weights, json.loads((tmp_path / "w.losses.json").read_text())


def one_process(tmp_path: Path, model: str, **env: str) -> tuple[dict, list[float]]:
    """The reference: the same training in one fresh process, the whole batch at once."""
    return ranks(tmp_path / "one-process", model, 1, {"micro_batch": 8}, **env)


@pytest.fixture(scope="module")
def gpt_reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, list[float]]:
    return one_process(tmp_path_factory.mktemp("gpt"), "gpt")


def assert_same(got: tuple[dict, list[float]], want: tuple[dict, list[float]]) -> None:
    (got_weights, got_losses), (want_weights, want_losses) = got, want
    assert len(got_losses) == len(want_losses) == STEPS
    torch.testing.assert_close(torch.tensor(got_losses), torch.tensor(want_losses), **TOLERANCE)
    assert want_weights.keys() <= got_weights.keys()  # a tied head's weight is also there by its own name
    for name, value in want_weights.items():
        torch.testing.assert_close(got_weights[name], value, **TOLERANCE, msg=lambda m, name=name: f"{name}: {m}")


SCHEDULES = {
    "gpipe": {"schedule": "gpipe"},
    "1f1b": {"schedule": "1f1b"},
    "interleaved": {"schedule": "interleaved", "virtual_stages": 2},
}


@pytest.mark.ranks
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_two_pipeline_stages_train_as_one_process_under_each_schedule(
    tmp_path: Path, schedule: str, gpt_reference: tuple[dict, list[float]]
) -> None:
    """The example GPT cut by its own redline_pp_stage: two stages of two blocks, or (interleaved) four of one,
    stages 0 and 2 on the first rank."""
    strategy = {"pipeline": 2, "micro_batch": 2, "accumulation": 4} | SCHEDULES[schedule]
    assert_same(ranks(tmp_path, "gpt", 2, strategy), gpt_reference)


@pytest.mark.ranks
@pytest.mark.slow
@pytest.mark.parametrize("other", ["data", "tensor"])
def test_pipeline_stages_beside_data_or_tensor_parallel_ranks_train_as_one_process(
    tmp_path: Path, other: str, gpt_reference: tuple[dict, list[float]]
) -> None:
    """PP2 x DP2 (each stage sharded by FSDP2 over its two data ranks, which load different halves of the batch)
    and PP2 x TP2 (each stage's layers split over its two tensor ranks): four ranks."""
    strategy = {"pipeline": 2, other: 2, "micro_batch": 1 if other == "data" else 2, "accumulation": 4}
    assert_same(ranks(tmp_path, "gpt", 4, strategy), gpt_reference)


@pytest.mark.ranks
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_releasing_what_megatron_releases_changes_no_loss_or_weight(tmp_path: Path, schedule: str) -> None:
    """redline's stage (sent outputs' data freed, receive buffers lent per micro-batch) against PyTorch's own
    ``PipelineStage`` under each schedule: the same losses and weights, bit for bit, over every step."""
    strategy = {"pipeline": 2, "micro_batch": 2, "accumulation": 4} | SCHEDULES[schedule]
    released = ranks(tmp_path / "released", "gpt", 2, strategy, STEPS="3")
    pytorchs = ranks(tmp_path / "pytorch", "gpt", 2, strategy, STEPS="3", PYTORCH_STAGE="1")
    assert released[1] == pytorchs[1] and len(released[1]) == 3
    assert released[0].keys() == pytorchs[0].keys()
    for name, value in pytorchs[0].items():
        assert torch.equal(released[0][name], value), name


@pytest.mark.ranks
def test_gradient_clipping_takes_the_norm_over_every_stage(tmp_path: Path) -> None:
    """A clip that bites (the norm is above 0.5 at every step): the same scale as one process's over the whole
    model, so the same weights."""
    strategy = {"pipeline": 2, "micro_batch": 2, "accumulation": 4}
    got = ranks(tmp_path, "gpt", 2, strategy, GRAD_CLIP="0.5")
    assert_same(got, one_process(tmp_path, "gpt", GRAD_CLIP="0.5"))


@pytest.mark.ranks
def test_a_pipeline_run_resumes_from_its_checkpoint_bit_identically(tmp_path: Path) -> None:
    """Each rank checkpoints its stages' parameters and optimizer state (DCP), and a second start goes on from
    step 2 to the same weights, bit for bit, as the run that did not stop."""
    strategy = {"pipeline": 2, "micro_batch": 2, "accumulation": 4}
    whole = ranks(tmp_path / "whole", "gpt", 2, strategy)
    directory = str(tmp_path / "checkpoints")
    ranks(tmp_path / "first", "gpt", 2, strategy, CHECKPOINT_DIR=directory, STEPS="2")
    weights, losses = ranks(tmp_path / "second", "gpt", 2, strategy, CHECKPOINT_DIR=directory)
    assert losses == whole[1][2:]  # the resumed run's own steps
    for name, value in whole[0].items():
        assert torch.equal(weights[name], value), name


@pytest.mark.slow
@pytest.mark.ranks
@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_a_hugging_face_model_cut_into_stages_trains_as_one_process(tmp_path: Path, model: str) -> None:
    """Llama's and GPT-2's family layouts; GPT-2's head is tied to its embedding, on the other stage: the two
    stages' gradients of it are summed, and a clip that bites counts it once."""
    strategy = {"pipeline": 2, "micro_batch": 2, "accumulation": 4}
    got = ranks(tmp_path, model, 2, strategy, GRAD_CLIP="0.5")
    want = one_process(tmp_path, model, GRAD_CLIP="0.5")
    assert_same(got, want)
    if model == "gpt2":  # the last stage's head is the tied weight, by its own name
        torch.testing.assert_close(got[0]["lm_head.weight"], want[0]["transformer.wte.weight"], **TOLERANCE)


@pytest.mark.ranks
@pytest.mark.slow
def test_redline_run_applies_a_pipeline_plan_redline_plan_wrote(tmp_path: Path) -> None:
    """`redline plan --pp 2` for a tiny Llama's config.json, then `redline run --plan` of a script training that
    Llama: two stages cut where the plan says, each rank holding the parameter bytes the plan counts for its
    stage, training as one process does."""
    import yaml

    from conftest import run_cli

    tp_worker.make_model("llama", layers=pp_worker.LAYERS).config.to_json_file(tmp_path / "config.json")
    plan = tmp_path / "plan.yaml"
    args = ("--seq-len", str(tp_worker.SEQ), "--hardware", "2xh100-sxm", "--precision", "fp32", "--global-batch", "8")
    result = run_cli("plan", "--model", str(tmp_path / "config.json"), "--pp", "2", *args, "-o", str(plan))
    assert result.returncode == 0, result.stderr[-2000:]
    written = yaml.safe_load(plan.read_text())
    strategy, stages = written["strategy"], written["predicted"]["pipeline_stages"]
    assert (strategy["pipeline"], strategy["schedule"]) == (2, "1f1b")
    assert strategy["accumulation"] >= 2  # 1F1B over two stages needs two micro-batches or more
    assert [stage["blocks"] for stage in stages] == [2, 2]
    env = {"MODEL": "llama", "OUT": str(tmp_path / "w"), "PYTHONPATH": script_pythonpath()}
    argv = ("run", "--plan", str(plan), "--plan-anyway", "--nproc-per-node", "2", str(WORKER))  # an H100's plan here
    result = run_cli(*argv, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    weights = torch.load(tmp_path / "w.0.pt") | torch.load(tmp_path / "w.1.pt")
    got = weights, json.loads((tmp_path / "w.losses.json").read_text())
    assert_same(got, one_process(tmp_path, "llama"))
    for rank, stage in enumerate(stages):  # the first: the embedding and two blocks; the last: two, the norm, the head
        assert int((tmp_path / f"w.bytes.{rank}").read_text()) == stage["weights"]


def test_the_cut_follows_the_plan_and_keeps_the_models_own_names() -> None:
    from redline.runtime.pipeline import find_layout, split, stage_sizes

    assert stage_sizes(6, pipeline=2, virtual=1) == [3, 3]
    assert stage_sizes(7, pipeline=2, virtual=1, rank_blocks=[3, 4]) == [3, 4]
    assert stage_sizes(7, pipeline=2, virtual=1, rank_blocks=[2, 2]) == [3, 4]  # another model's plan: even
    assert stage_sizes(8, pipeline=2, virtual=2) == [2, 2, 2, 2]  # ranks hold stages 0, 2 and 1, 3
    assert stage_sizes(6, pipeline=2, virtual=2, rank_blocks=[2, 4]) == [1, 2, 1, 2]
    llama = tp_worker.make_model("llama", layers=4)
    (last,) = split(llama, find_layout(llama), pipeline=2, virtual=1, pp_rank=1)
    names = {name for name, _ in last.named_parameters()}
    assert "model.layers.3.mlp.up_proj.weight" in names and "lm_head.weight" in names
    assert not any(name.startswith(("model.embed_tokens", "model.layers.0.", "model.layers.1.")) for name in names)
    assert llama.model.embed_tokens.weight.is_meta and llama.model.layers[0].mlp.up_proj.weight.is_meta
    assert not llama.lm_head.weight.is_meta


def test_a_model_without_a_stage_layout_is_told_how_to_give_one() -> None:
    from redline.runtime.pipeline import find_layout

    with pytest.raises(BadInput, match=r"no pipeline stage layout for Sequential: .* redline_pp_stage"):
        find_layout(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)))


def test_more_stages_than_blocks_is_one_line() -> None:
    from redline.runtime.pipeline import find_layout, split

    gpt = tp_worker.make_model("gpt", layers=2)
    with pytest.raises(BadInput, match="into 4 pipeline stages, and it has 2 repeated blocks"):
        split(gpt, find_layout(gpt), pipeline=2, virtual=2, pp_rank=0)


@pytest.mark.ranks
@pytest.mark.parametrize(
    ("misuse", "strategy", "said"),
    [
        ("no_loss_fn", {}, "a pipeline-parallel plan computes the loss on its last stage: pass prepare(..., loss_fn="),
        ("call_model", {}, "call run.forward_backward(inputs, target) in the loop, not run.model(...)"),
        ("", {"micro_batch": 8, "accumulation": 1}, "the 1f1b schedule over 2 stages cannot run 1 micro-batches"),
    ],
)
def test_a_loop_a_pipeline_cannot_run_is_told_so_in_one_line(
    tmp_path: Path, misuse: str, strategy: dict, said: str
) -> None:
    env = {"MODEL": "gpt", "OUT": str(tmp_path / "w"), "MISUSE": misuse}
    env["STRATEGY"] = json.dumps({"precision": "fp32", "pipeline": 2, "micro_batch": 2, "accumulation": 4} | strategy)
    spawn_ranks(WORKER, 2, store=tmp_path / "store", env=env)
    error = (tmp_path / "w.error").read_text()
    assert said in error and "\n" not in error
