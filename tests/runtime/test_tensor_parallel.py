"""Tensor parallelism on the CPU (gloo, fp32): ranks in tensor-parallel groups train as one process does,
the split is checked before anything is sharded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import tp_worker
from torch.distributed.checkpoint import FileSystemReader

from ranks import script_pythonpath, spawn_ranks
from redline.plan.strategy import Strategy

WORKER = Path(tp_worker.__file__)
# fp32 over gloo: the sharded matmuls and the all-reduced partial sums add in another order than one process
TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}


def ranks(tmp_path: Path, model: str, world: int, strategy: dict, **env: str) -> tuple[dict, list[float]]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = tmp_path / "weights.pt"
    env = {"MODEL": model, "STRATEGY": json.dumps({"precision": "fp32"} | strategy), "OUT": str(out)} | env
    spawn_ranks(WORKER, world, store=tmp_path / "store", env=env)
    return torch.load(out), json.loads((tmp_path / "weights.pt.losses.json").read_text())


def one_process(tmp_path: Path, model: str, **strategy) -> tuple[dict, list[float]]:
    """The reference: the same training in one fresh process (in this test process, state that earlier tests
    leave behind made it differ under the full suite)."""
    return ranks(tmp_path / "one-process", model, 1, strategy)


def assert_same(got: tuple[dict, list[float]], want: tuple[dict, list[float]]) -> None:
    (got_weights, got_losses), (want_weights, want_losses) = got, want
    assert len(got_losses) == len(want_losses) == tp_worker.SAMPLES // 8
    torch.testing.assert_close(torch.tensor(got_losses), torch.tensor(want_losses), **TOLERANCE)
    assert got_weights.keys() == want_weights.keys()
    for name, value in want_weights.items():
        torch.testing.assert_close(got_weights[name], value, **TOLERANCE, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.slow
@pytest.mark.ranks
@pytest.mark.parametrize("model", ["gpt", "llama", "bert", "gpt2", "reference_gpt"])
def test_two_tensor_parallel_ranks_train_as_one_process(tmp_path: Path, model: str) -> None:
    got = ranks(tmp_path, model, 2, {"tensor": 2, "micro_batch": 8})
    assert_same(got, one_process(tmp_path, model, micro_batch=8))
    # the step metrics' global batch: the group's one batch, not one per rank
    assert json.loads((tmp_path / "weights.pt.samples.json").read_text()) == [8] * (tp_worker.SAMPLES // 8)


@pytest.mark.slow
@pytest.mark.ranks
@pytest.mark.parametrize(("model", "norm"), [("llama", "model.norm"), ("gpt", "norm"), ("gpt2", "transformer.ln_f")])
def test_two_sequence_parallel_ranks_train_as_one_process_each_norm_on_half_the_rows(
    tmp_path: Path, model: str, norm: str
) -> None:
    got = ranks(tmp_path, model, 2, {"tensor": 2, "micro_batch": 8, "sequence_parallel": True}, NORM=norm)
    assert_same(got, one_process(tmp_path, model, micro_batch=8))
    for rank in (0, 1):  # the final norm of each step's forward saw its rank's half of the sequence
        rows = json.loads((tmp_path / f"weights.pt.rows.{rank}").read_text())
        assert rows == [tp_worker.SEQ // 2] * (tp_worker.SAMPLES // 8)


@pytest.mark.slow
@pytest.mark.ranks
def test_bert_asked_for_sequence_parallelism_trains_as_one_process_with_its_activations_whole_and_says_so(
    tmp_path: Path,
) -> None:
    strategy = {"precision": "fp32", "tensor": 2, "micro_batch": 8, "sequence_parallel": True}
    env = {
        "MODEL": "bert",
        "STRATEGY": json.dumps(strategy),
        "OUT": str(tmp_path / "weights.pt"),
        "NORM": "bert.encoder.layer.1.output.LayerNorm",
    }
    outputs = spawn_ranks(WORKER, 2, store=tmp_path / "store", env=env)
    assert "sequence parallelism, which the runtime does not apply yet to BertForMaskedLM" in outputs[0]
    got = torch.load(tmp_path / "weights.pt"), json.loads((tmp_path / "weights.pt.losses.json").read_text())
    assert_same(got, one_process(tmp_path, "bert", micro_batch=8))
    assert json.loads((tmp_path / "weights.pt.rows.1").read_text()) == [tp_worker.SEQ] * (tp_worker.SAMPLES // 8)


def test_llama_gpt2_and_a_models_own_plan_taking_the_keyword_have_sequence_parallelism_bert_not() -> None:
    from torch.distributed.tensor.parallel import SequenceParallel

    from redline.errors import BadInput
    from redline.runtime.tensor_parallel import find_plan, has_sequence_parallel

    llama = tp_worker.make_model("llama")
    assert has_sequence_parallel(llama) and has_sequence_parallel(tp_worker.make_model("gpt"))
    assert has_sequence_parallel(tp_worker.make_model("gpt2"))
    assert isinstance(find_plan(llama, 2, sequence_parallel=True)["model.norm"], SequenceParallel)
    assert "model.norm" not in find_plan(llama, 2)
    # apply_tp warns for these and holds the activations whole: BERT's family plan, a model's own plan
    # without the keyword
    for kind in ("bert", "reference_gpt"):
        model = tp_worker.make_model(kind)
        assert not has_sequence_parallel(model)
        with pytest.raises(BadInput, match="lays out no sequence parallelism"):
            find_plan(model, 2, sequence_parallel=True)


@pytest.mark.ranks
@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["fsdp", "ddp"])
def test_tensor_parallel_groups_beside_data_parallel_ranks_train_as_one_process(tmp_path: Path, sharding: str) -> None:
    """TP2 x DP2: the two groups load different halves of each batch, FSDP2 shards over the data ranks (a DDP
    plan too: DDP takes no DTensor parameters)."""
    got = ranks(tmp_path, "gpt", 4, {"data": 2, "tensor": 2, "micro_batch": 4, "sharding": sharding})
    assert_same(got, one_process(tmp_path, "gpt", micro_batch=8))


@pytest.mark.ranks
@pytest.mark.slow
def test_gpt2_tensor_parallel_groups_beside_fsdp_train_to_one_process_whole_weights_packed_bias_too(
    tmp_path: Path,
) -> None:
    """TP2 x DP2 of GPT-2: FSDP2 leaves the packed c_attn's packed dimension to tensor parallelism (the weight
    sharded along its other dimension, the 1-D bias whole on each data rank), so every parameter gathered
    whole (``full_tensor()``), c_attn's bias included, is one process's. With the gradients clipped: they sit on
    three meshes (data x tensor, the data ranks for a parameter the tensor plan leaves whole, the tensor ranks
    for the packed bias), and the norm counts each once."""
    strategy = {"data": 2, "tensor": 2, "micro_batch": 4, "sharding": "fsdp"}
    got = ranks(tmp_path, "gpt2", 4, strategy, GRAD_CLIP="0.5")
    assert "transformer.h.0.attn.c_attn.bias" in got[0]
    assert_same(got, ranks(tmp_path / "one-process", "gpt2", 1, {"micro_batch": 8}, GRAD_CLIP="0.5"))


def test_a_head_count_the_degree_does_not_divide_is_one_line_before_anything_is_sharded() -> None:
    from redline.errors import BadInput
    from redline.runtime.tensor_parallel import check_divisible, find_plan

    gpt = tp_worker.make_model("gpt")
    with pytest.raises(BadInput, match="splits heads over them, and Block has 4: plan with a --tp that divides 4"):
        check_divisible(gpt, find_plan(gpt, 3), 3)
    llama = tp_worker.make_model("llama")
    with pytest.raises(BadInput, match="splits num_key_value_heads over them, and LlamaConfig has 2") as error:
        check_divisible(llama, find_plan(llama, 4), 4)
    assert "\n" not in str(error.value)
    check_divisible(llama, find_plan(llama, 2), 2)


def test_a_conv1d_or_packed_layer_the_degree_does_not_divide_is_one_line() -> None:
    from transformers import GPT2Config, GPT2Model

    from redline.errors import BadInput
    from redline.runtime.tensor_parallel import PackedColwiseParallel, check_divisible, find_plan

    config = GPT2Config(
        vocab_size=tp_worker.VOCAB, n_embd=32, n_layer=1, n_head=4, n_positions=tp_worker.SEQ, n_inner=30
    )
    gpt2 = GPT2Model(config)  # the heads and the vocabulary divide by 4, GPT-2's MLP width does not
    with pytest.raises(
        BadInput, match=r"splits h\.\*\.mlp\.c_fc \(Conv1D \(32, 30\)\) along dimension 1, of 30: not a"
    ) as error:
        check_divisible(gpt2, find_plan(gpt2, 4), 4)
    assert "\n" not in str(error.value)
    # 18 outputs divide by 9, but each of the three packed projections, of 6, does not
    packed = torch.nn.ModuleDict({"qkv": torch.nn.Linear(4, 18)})
    with pytest.raises(BadInput, match=r"splits qkv \(Linear \(18, 4\)\) along dimension 0, 3 packed projections of 6"):
        check_divisible(packed, {"qkv": PackedColwiseParallel(packed=3)}, 9)


@pytest.mark.slow
@pytest.mark.ranks
def test_a_tensor_parallel_run_resumes_from_its_checkpoint_bit_identically(tmp_path: Path) -> None:
    strategy = {"tensor": 2, "micro_batch": 8}
    whole = ranks(tmp_path / "whole", "gpt", 2, strategy)
    directory = str(tmp_path / "checkpoints")
    ranks(tmp_path / "first", "gpt", 2, strategy, CHECKPOINT_DIR=directory, STEPS="2")
    weights, losses = ranks(tmp_path / "second", "gpt", 2, strategy, CHECKPOINT_DIR=directory)
    assert losses == whole[1][2:]  # the resumed run's own steps
    for name, value in whole[0].items():
        assert torch.equal(weights[name], value), name


@pytest.mark.ranks
@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "strategy"),
    [(2, {"tensor": 2, "micro_batch": 8}), (4, {"data": 2, "tensor": 2, "micro_batch": 4, "sharding": "fsdp"})],
    ids=["tp2", "tp2xdp2"],
)
def test_a_tensor_parallel_gpt2_resumes_from_its_checkpoint_bit_identically(
    tmp_path: Path, world: int, strategy: dict
) -> None:
    """GPT-2's packed c_attn (a ``_StridedShard``, which DCP refuses) is saved as its q, k and v shares, with
    its optimizer state (SGD's momentum buffers), and written back on load."""
    whole = ranks(tmp_path / "whole", "gpt2", world, strategy, MOMENTUM="0.9")
    directory = tmp_path / "checkpoints"
    ranks(tmp_path / "first", "gpt2", world, strategy, MOMENTUM="0.9", CHECKPOINT_DIR=str(directory), STEPS="2")
    saved = FileSystemReader(directory / "step-00000002").read_metadata().state_dict_metadata
    packed = "transformer.h.1.attn.c_attn"
    assert {f"model.{packed}.bias.packed2", f"optim.state.{packed}.weight.momentum_buffer.packed0"} <= saved.keys()
    assert not {f"model.{packed}.weight", f"optim.state.{packed}.bias.momentum_buffer"} & saved.keys()
    assert saved[f"model.{packed}.weight.packed1"].size == (32, 32)  # one projection of the Conv1D (32, 96)
    weights, losses = ranks(tmp_path / "second", "gpt2", world, strategy, MOMENTUM="0.9", CHECKPOINT_DIR=str(directory))
    assert losses == whole[1][2:]  # the resumed run's own steps
    for name, value in whole[0].items():
        assert torch.equal(weights[name], value), name


@pytest.mark.ranks
@pytest.mark.slow
def test_a_tensor_parallel_gpt2_checkpoint_resumes_at_another_tensor_parallel_degree(tmp_path: Path) -> None:
    """Saved at TP2, resumed at TP4 with the same batch: each rank reads its heads of q, of k and of v from
    the saved projections (``<name>.packed0..2``), so the run goes on as one that did not stop (a q, k or v
    read from the wrong part of the packed c_attn would not)."""
    strategy = {"tensor": 2, "micro_batch": 8}
    whole = ranks(tmp_path / "whole", "gpt2", 2, strategy, MOMENTUM="0.9")
    directory = str(tmp_path / "checkpoints")
    ranks(tmp_path / "first", "gpt2", 2, strategy, MOMENTUM="0.9", CHECKPOINT_DIR=directory, STEPS="2")
    got = ranks(tmp_path / "second", "gpt2", 4, strategy | {"tensor": 4}, MOMENTUM="0.9", CHECKPOINT_DIR=directory)
    weights, losses = got
    assert len(losses) == len(whole[1]) - 2
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(whole[1][2:]), **TOLERANCE)
    for name, value in whole[0].items():
        torch.testing.assert_close(weights[name], value, **TOLERANCE, msg=lambda m, name=name: f"{name}: {m}")
    # without tensor parallelism the model holds c_attn whole: the checkpoint does not load, and says why
    from redline.errors import BadInput
    from redline.runtime.checkpoint import Checkpointer, CheckpointWarning

    model = tp_worker.make_model("gpt2")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    with pytest.warns(CheckpointWarning), pytest.raises(BadInput) as error:
        Checkpointer(directory).load_latest(model=model, optimizer=optimizer)
    assert "transformer.h.0.attn.c_attn.weight as its packed projections (saved under tensor parallelism)" in str(
        error.value
    )
    assert "resume it with tensor parallelism" in str(error.value) and "\n" not in str(error.value)


@pytest.mark.ranks
@pytest.mark.slow
def test_a_checkpoint_saved_without_tensor_parallelism_refuses_a_tensor_parallel_gpt2_in_one_line(
    tmp_path: Path,
) -> None:
    """One process saves GPT-2's c_attn whole; two tensor-parallel ranks, which save and load it as its
    projections, do not load it, and say why rather than which key DCP missed."""
    directory = str(tmp_path / "checkpoints")
    ranks(tmp_path / "first", "gpt2", 1, {"micro_batch": 8}, CHECKPOINT_DIR=directory, STEPS="2")
    with pytest.raises(AssertionError) as error:
        ranks(tmp_path / "second", "gpt2", 2, {"tensor": 2, "micro_batch": 8}, CHECKPOINT_DIR=directory)
    why = "it holds transformer.h.0.attn.c_attn.weight whole (saved without tensor parallelism), which this run"
    assert f"BadInput: no checkpoint in {directory} loads (step-00000002: rank 0: {why}" in str(error.value)
    assert "Missing key" not in str(error.value)


@pytest.mark.ranks
@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "gpus", "sharding"), [("llama", 2, ()), ("gpt2", 2, ()), ("gpt2", 4, ("--sharding", "fsdp"))]
)
def test_redline_run_applies_a_tensor_parallel_plan_redline_plan_wrote(
    tmp_path: Path, model: str, gpus: int, sharding: tuple[str, ...]
) -> None:
    """`redline plan --tp 2` for a tiny Llama's or GPT-2's config.json, then `redline run --plan` of a script
    training it: one tensor-parallel group (or two beside FSDP), as one process trains it with the plan's batch,
    each rank holding exactly the parameter bytes the plan counts."""
    import yaml

    from conftest import run_cli

    tp_worker.make_model(model).config.to_json_file(tmp_path / "config.json")
    plan = tmp_path / "plan.yaml"
    args = ("--seq-len", str(tp_worker.SEQ), "--hardware", f"{gpus}xh100-sxm", "--precision", "fp32")
    args += ("--global-batch", "8", *sharding)
    result = run_cli("plan", "--model", str(tmp_path / "config.json"), "--tp", "2", *args, "-o", str(plan))
    assert result.returncode == 0, result.stderr[-2000:]
    strategy = yaml.safe_load(plan.read_text())["strategy"]
    assert (strategy["data"], strategy["tensor"]) == (gpus // 2, 2)
    assert strategy["data"] * strategy["micro_batch"] * strategy["accumulation"] == 8
    out = tmp_path / "weights.pt"
    env = {"MODEL": model, "OUT": str(out), "PYTHONPATH": script_pythonpath()}
    # an H100's plan on this CPU: run anyway (the layout is what is tested)
    argv = ("run", "--plan", str(plan), "--plan-anyway", "--nproc-per-node", str(gpus), str(WORKER))
    result = run_cli(*argv, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert strategy["sequence_parallel"]  # the plan asked for it, and the family's plan applies it: no warning
    assert "sequence parallelism, which the runtime does not apply yet" not in result.stderr
    got = torch.load(out), json.loads((tmp_path / "weights.pt.losses.json").read_text())
    batch = strategy["data"] * strategy["micro_batch"]
    assert_same(got, one_process(tmp_path, model, micro_batch=batch, accumulation=strategy["accumulation"]))
    # each rank holds half of every projection and of the token embedding and head; the norms, a row-wise
    # layer's bias and GPT-2's position embedding whole; beside FSDP its share of each of those over the data
    # ranks, but GPT-2's packed c_attn bias whole: the plan counts them the same way
    planned = yaml.safe_load(plan.read_text())["predicted"]["memory_bytes"]["weights"]
    for rank in range(gpus):
        assert int((tmp_path / f"weights.pt.bytes.{rank}").read_text()) == planned


def test_the_planner_is_told_which_parameters_the_plan_splits() -> None:
    """Column-wise layers split weight and bias, row-wise ones only the weight; GPT-2's position embedding and
    the norms stay whole; a model with no plan has no answer."""
    from redline.runtime.tensor_parallel import tensor_split_plan

    split = tensor_split_plan(tp_worker.make_model("gpt2", layers=1))
    block = {f"transformer.h.0.{name}" for name in ("attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight")}
    block |= {f"transformer.h.0.{name}" for name in ("mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight")}
    assert split.params == block | {"transformer.wte.weight", "lm_head.weight"}  # tied: one parameter, two names
    # FSDP2 cannot shard the packed 1-D bias along another dimension: each data rank keeps it whole
    assert split.replicated_beside_fsdp == {"transformer.h.0.attn.c_attn.bias"}
    assert tensor_split_plan(tp_worker.make_model("llama", layers=1)).replicated_beside_fsdp == set()
    assert tensor_split_plan(torch.nn.Sequential(torch.nn.Linear(4, 4))) is None


def test_the_planner_is_told_which_layers_outputs_the_plan_splits() -> None:
    """Column-wise layers leave their output split (not the head, whose logits are gathered whole), row-wise ones
    reduce theirs: what the tracer follows to count a rank's activations."""
    from redline.runtime.tensor_parallel import tensor_split_plan

    model = tp_worker.make_model("llama", layers=1)
    plan = tensor_split_plan(model)
    layer = "model.layers.0."
    columns = {f"{layer}self_attn.{name}_proj" for name in "qkv"} | {f"{layer}mlp.{n}_proj" for n in ("gate", "up")}
    assert set(plan.columns) == columns
    assert set(plan.rows) == {f"{layer}self_attn.o_proj", f"{layer}mlp.down_proj", "model.embed_tokens"}
    # the split layers' weights are split parameters; Llama packs nothing FSDP2 must keep whole
    assert {f"{name}.weight" for name in columns | set(plan.rows)} <= set(plan.params)
    assert not plan.replicated_beside_fsdp
    assert tensor_split_plan(torch.nn.Sequential(torch.nn.Linear(4, 4))) is None


@pytest.mark.ranks
@pytest.mark.slow
@pytest.mark.parametrize(("gpus", "degrees"), [(2, (1, 2)), (4, (2, 2))], ids=["tp2", "tp2xdp2"])
def test_redline_run_resumes_a_tensor_parallel_gpt2_plan_bit_identically(
    tmp_path: Path, gpus: int, degrees: tuple[int, int]
) -> None:
    """`redline plan --tp 2` for a tiny GPT-2's config.json, `redline run --plan` of a script training it,
    stopped after 2 steps with a checkpoint and run again: the second run resumes where the first stopped
    and ends with the weights (and step losses) of a run that did not stop, bit for bit."""
    import yaml

    from conftest import run_cli

    tp_worker.make_model("gpt2").config.to_json_file(tmp_path / "config.json")
    plan = tmp_path / "plan.yaml"
    args = ("--seq-len", str(tp_worker.SEQ), "--hardware", f"{gpus}xh100-sxm", "--precision", "fp32")
    result = run_cli(
        "plan", "--model", str(tmp_path / "config.json"), "--tp", "2", *args, "--global-batch", "8", "-o", str(plan)
    )
    assert result.returncode == 0, result.stderr[-2000:]
    strategy = yaml.safe_load(plan.read_text())["strategy"]
    assert (strategy["data"], strategy["tensor"]) == degrees

    def launch(name: str, **env: str) -> tuple[dict, list[float]]:
        (tmp_path / name).mkdir()
        out = tmp_path / name / "weights.pt"
        env = {"MODEL": "gpt2", "OUT": str(out), "MOMENTUM": "0.9", "PYTHONPATH": script_pythonpath()} | env
        argv = ("run", "--plan", str(plan), "--plan-anyway", "--nproc-per-node", str(gpus), str(WORKER))
        result = run_cli(*argv, env=env, cwd=tmp_path / name)
        assert result.returncode == 0, result.stderr[-3000:]
        return torch.load(out), json.loads((tmp_path / name / "weights.pt.losses.json").read_text())

    whole = launch("whole")
    directory = str(tmp_path / "checkpoints")
    launch("first", CHECKPOINT_DIR=directory, STEPS="2")
    weights, losses = launch("second", CHECKPOINT_DIR=directory)
    assert len(whole[1]) > 2 and losses == whole[1][2:]
    for name, value in whole[0].items():
        assert torch.equal(weights[name], value), name


def test_a_model_without_a_plan_is_told_how_to_give_one() -> None:
    from redline.errors import BadInput
    from redline.runtime.tensor_parallel import find_plan

    with pytest.raises(BadInput, match=r"no tensor-parallel plan for Sequential: .* redline_tp_plan"):
        find_plan(torch.nn.Sequential(torch.nn.Linear(4, 4)), 2)


def test_a_bare_hugging_face_body_gets_its_familys_plan_under_its_own_names() -> None:
    from redline.runtime.tensor_parallel import find_plan

    body = tp_worker.make_model("llama").model  # LlamaModel: embed_tokens, layers.N at the root
    assert "layers.*.self_attn.q_proj" in find_plan(body, 2) and "lm_head" not in find_plan(body, 2)
    assert "cls.predictions.decoder" in find_plan(tp_worker.make_model("bert"), 2)


def test_the_mesh_orders_tensor_innermost_and_leaves_degrees_of_one_out() -> None:
    from redline.runtime.mesh import ParallelDims

    def sizes(per_node: int = 8, **strategy) -> dict[str, int]:
        return ParallelDims.from_strategy(Strategy(**strategy), per_node=per_node).sizes()

    assert list(sizes(data=4, tensor=2, sharding="fsdp").items()) == [("dp_shard", 4), ("tp", 2)]
    assert sizes(data=4, tensor=2, sharding="ddp") == {"dp_replicate": 4, "tp": 2}
    assert sizes(data=4, tensor=2, sharding="hsdp") == {"dp_shard": 4, "tp": 2}  # one node holds them all
    assert sizes(per_node=4, data=4, tensor=2, sharding="hsdp") == {"dp_replicate": 2, "dp_shard": 2, "tp": 2}
    assert sizes(tensor=2) == {"tp": 2}
