"""redline.prepare() on the CPU: the plan is applied exactly, and the numbers come out as without it.

Multi-rank cases run real processes (gloo over localhost), each calling prepare() as a user's script would.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from ranks import spawn_ranks
from redline.errors import BadInput
from redline.plan.strategy import Strategy
from redline.runtime.config import RunConfig
from redline.runtime.prepare import prepare

SAMPLES = 64


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 32), nn.Tanh(), nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32)), nn.Linear(32, 4)
    )


def dataset() -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(
        torch.randn(SAMPLES, 16, generator=generator), torch.randn(SAMPLES, 4, generator=generator)
    )


OPTIMIZERS = {"sgd": lambda params: torch.optim.SGD(params, lr=0.1), "adamw": lambda params: torch.optim.AdamW(params)}


def train(config: RunConfig, epochs: int = 1, optimizer: str = "sgd", **overrides) -> nn.Module:
    model = make_model()
    loader = torch.utils.data.DataLoader(dataset(), batch_size=config.per_rank_batch)
    run = prepare(model, OPTIMIZERS[optimizer](model.parameters()), loader, plan=config, **overrides)
    for x, y in run.micro_batches(epochs=epochs):
        with run.accumulate():
            run.backward(nn.functional.mse_loss(run.model(x), y))
    return model


def config(**strategy) -> RunConfig:
    return RunConfig(strategy=Strategy(**({"precision": "fp32"} | strategy)))


def weights(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_accumulation_matches_one_large_batch() -> None:
    whole = train(config(micro_batch=16, accumulation=1))
    split = train(config(micro_batch=4, accumulation=4))
    torch.testing.assert_close(weights(split), weights(whole), rtol=1e-5, atol=1e-6)


def test_bf16_autocast_runs_and_learns() -> None:
    before = weights(make_model())
    after = weights(train(config(micro_batch=8, accumulation=2, precision="bf16")))
    assert torch.isfinite(after).all() and not torch.equal(before, after)


def test_fp16_needs_a_gpu() -> None:  # and fp8 one with fp8 tensor cores: test_fp8.py
    with pytest.raises(BadInput, match="fp16"):
        train(config(micro_batch=8, precision="fp16"))


def test_a_plan_for_other_ranks_is_refused_before_training() -> None:
    with pytest.raises(BadInput, match="plan is for 8 data-parallel ranks but 1 are running"):
        train(config(data=8, micro_batch=2))


def test_out_of_memory_halves_the_micro_batch_and_keeps_the_result(monkeypatch) -> None:
    reference = train(config(micro_batch=16, accumulation=1))
    monkeypatch.setenv("REDLINE_TEST_OOM_AT", "1:0")  # at the second optimizer step, on rank 0
    model = make_model()
    loader = torch.utils.data.DataLoader(dataset(), batch_size=16)
    run = prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), loader, plan=config(micro_batch=16))
    for x, y in run.micro_batches():
        with run.accumulate():
            run.backward(nn.functional.mse_loss(run.model(x), y))
    assert run.oom_events == [{"step": 1, "micro_batch": 8, "accumulation": 2}]
    assert (run.micro_batch, run.accumulation) == (8, 2)
    torch.testing.assert_close(weights(model), weights(reference), rtol=1e-5, atol=1e-6)


def test_out_of_memory_with_an_odd_micro_batch_takes_the_next_divisor(monkeypatch) -> None:
    reference = train(config(micro_batch=12, accumulation=1))
    monkeypatch.setenv("REDLINE_TEST_OOM_AT", "0:0")
    run_model = make_model()
    loader = torch.utils.data.DataLoader(dataset(), batch_size=12)
    run = prepare(run_model, torch.optim.SGD(run_model.parameters(), lr=0.1), loader, plan=config(micro_batch=12))
    for x, y in run.micro_batches():
        with run.accumulate():
            run.backward(nn.functional.mse_loss(run.model(x), y))
    assert run.oom_events == [{"step": 0, "micro_batch": 6, "accumulation": 2}]
    torch.testing.assert_close(weights(run_model), weights(reference), rtol=1e-5, atol=1e-6)


def test_a_resumed_run_does_not_load_the_samples_it_already_trained_on(tmp_path: Path) -> None:
    class Counting(torch.utils.data.Dataset):
        def __init__(self) -> None:
            self.data, self.loaded = dataset(), 0

        def __len__(self) -> int:
            return len(self.data)

        def __getitem__(self, index: int):
            self.loaded += 1
            return self.data[index]

    def loop(stop_at: int | None) -> Counting:
        data = Counting()
        model = make_model()
        loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)
        run = prepare(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            loader,
            plan=config(micro_batch=8),
            checkpoint_dir=str(tmp_path),
            checkpoint_every=1,
        )
        for x, y in run.micro_batches():
            if run.step == stop_at:
                break
            with run.accumulate():
                run.backward(nn.functional.mse_loss(run.model(x), y))
        return data

    loop(stop_at=5)
    assert loop(stop_at=None).loaded == SAMPLES - 5 * 8  # the 3 batches left, nothing read and thrown away


def test_activation_checkpointing_changes_nothing_numerically() -> None:
    plain = train(config(micro_batch=8, accumulation=2))
    checkpointed = train(config(micro_batch=8, accumulation=2, checkpointing="full"))
    torch.testing.assert_close(weights(checkpointed), weights(plain), rtol=1e-5, atol=1e-6)


def test_a_hugging_face_model_trains_without_its_kv_cache() -> None:
    """The cache would hold every layer's keys and values with the output to the end of the step, and under
    checkpointing each recomputation would append them again. The user's config is left as it was; the
    gradients with checkpointing are those without."""
    transformers = pytest.importorskip("transformers")
    settings = {"n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 16, "vocab_size": 50}
    ids = torch.randint(0, 50, (8, 16), generator=torch.Generator().manual_seed(2))
    grads = []
    for checkpointing in ("none", "full"):
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**settings, attn_pdrop=0.0, resid_pdrop=0.0))
        model.transformer.drop.p = 0.0
        run = prepare(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=8),
            plan=config(micro_batch=8, checkpointing=checkpointing),
        )
        ((batch,),) = run.micro_batches()
        output = run.model(batch)
        assert output.past_key_values is None and model.config.use_cache
        assert run.model(batch, use_cache=True).past_key_values is not None  # asked for, it is there
        run.backward(nn.functional.cross_entropy(output.logits.flatten(0, 1), batch.flatten()))
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(grads[1], grads[0])


def test_adam_steps_fused_unless_its_maker_chose() -> None:
    """The plan counts a fused step; foreach (PyTorch's default on a GPU) holds a parameter-sized temporary.
    prepare() fuses an Adam/AdamW left to PyTorch's default, and flags one whose maker chose otherwise."""
    from redline.runtime.parallelize import fuse_adam, unfused_adam

    params = list(make_model().parameters())
    assert unfused_adam(torch.optim.AdamW(params))
    assert unfused_adam(torch.optim.Adam(params, foreach=True))
    assert not unfused_adam(torch.optim.AdamW(params, fused=True))
    assert not unfused_adam(torch.optim.SGD(params, lr=0.1))
    chosen = [torch.optim.Adam(params, foreach=True), torch.optim.AdamW(params, fused=False)]
    assert not any(fuse_adam(optimizer) for optimizer in chosen)
    stepped = torch.optim.AdamW(params)
    for p in params:
        p.grad = torch.zeros_like(p)
    stepped.step()  # its states exist in the form the unfused step keeps them
    assert not fuse_adam(stepped) and unfused_adam(stepped)

    class Custom(torch.optim.AdamW):  # a step of its own may ignore the flag: left alone
        pass

    assert not fuse_adam(Custom(params)) and unfused_adam(Custom(params))

    model = make_model()
    loader = torch.utils.data.DataLoader(dataset(), batch_size=8)
    run = prepare(model, torch.optim.AdamW(model.parameters(), lr=0.01), loader, plan=config(micro_batch=8))
    assert not unfused_adam(run.optimizer) and run.optimizer.param_groups[0]["fused"] is True
    run.optimizer.load_state_dict(torch.optim.AdamW(model.parameters()).state_dict())  # a checkpoint's settings
    assert unfused_adam(run.optimizer)  # read from the groups, as the step reads them
    before = weights(model)
    for x, y in run.micro_batches():
        with run.accumulate():
            run.backward(nn.functional.mse_loss(run.model(x), y))
    assert torch.isfinite(weights(model)).all() and not torch.equal(before, weights(model))


def test_a_rebuilt_optimizer_keeps_the_settings_its_constructor_takes() -> None:
    """ZeRO-1 and FSDP2 rebuild the optimizer from its class and its group's settings: AdamW's group holds
    ``decoupled_weight_decay``, which AdamW's constructor refuses; a subclass taking ``**kwargs`` passes its
    base's arguments on."""
    from redline.runtime.parallelize import constructor_settings

    class Wrapped(torch.optim.AdamW):
        def __init__(self, params, **settings):
            super().__init__(params, **settings)

    params = list(make_model().parameters())
    for cls in (torch.optim.AdamW, Wrapped):
        settings = constructor_settings(cls, cls(params, lr=0.5, weight_decay=0.3).param_groups[0])
        assert settings["lr"] == 0.5 and settings["weight_decay"] == 0.3
        assert "decoupled_weight_decay" not in settings and "params" not in settings
        cls(params, **settings)  # takes them all


def test_a_ready_optimizer_must_hold_the_models_parameters() -> None:
    model = make_model()
    other = torch.optim.SGD(make_model().parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=8)
    with pytest.raises(BadInput, match="optimizer does not hold"):
        prepare(model, other, loader, plan=config(micro_batch=8))


# -------------------------------------------------------------------------------------- two ranks


SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch
    from torch import nn
    sys.path.insert(0, {tests!r})
    from test_prepare import OPTIMIZERS, dataset, make_model, weights
    from redline.plan.strategy import Strategy
    from redline.runtime.config import RunConfig
    from redline.runtime.prepare import prepare

    strategy = Strategy(**json.loads(os.environ["STRATEGY"]))
    # a file rendezvous: no port to race for; prepare() finds the group already initialised
    torch.distributed.init_process_group(
        "gloo", init_method="file://" + os.environ["STORE"], rank=int(os.environ["RANK"]), world_size=2
    )
    model = make_model()
    loader = torch.utils.data.DataLoader(dataset(), batch_size=4)
    optimizer = OPTIMIZERS[os.environ["OPTIMIZER"]]
    run = prepare(model, optimizer, loader, plan=RunConfig(strategy=strategy))
    held = None  # after the first micro-batch's backward (no step yet): gradient elements this rank holds
    for x, y in run.micro_batches():
        with run.accumulate():
            run.backward(nn.functional.mse_loss(run.model(x), y))
        if held is None:
            grads = [p.grad for p in run.model.parameters()]
            local = [g.to_local() if hasattr(g, "to_local") else g for g in grads if g is not None]
            held = {{"missing": grads.count(None), "local": sum(g.numel() for g in local)}}
    full = {{
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()  # FSDP2 parameters are DTensors
        for name, p in run.model.named_parameters()
    }}
    if int(os.environ["RANK"]) == 0:
        torch.save(full, os.environ["OUT"])
        with open(os.environ["OUT"] + ".comm.json", "w") as f:
            json.dump([record.comm_s for record in run.metrics.records], f)
        with open(os.environ["OUT"] + ".held.json", "w") as f:
            json.dump(held, f)
        inner = getattr(run.optimizer, "optim", run.optimizer)  # ZeRO-1's shard optimizer
        with open(os.environ["OUT"] + ".fused.json", "w") as f:
            json.dump(inner.param_groups[0].get("fused"), f)
    torch.distributed.barrier()  # leave together: a gloo group torn down under a busy peer can abort it
    torch.distributed.destroy_process_group()
    # the results are written: skip the interpreter's teardown, where gloo's threads still abort now and then
    # ("terminate called without an active exception", a clean-clone CI run in torch 2.13 saw it with FSDP2)
    os._exit(0)
    """
)


def two_ranks(tmp_path: Path, strategy: dict, optimizer: str = "sgd") -> dict[str, torch.Tensor]:
    script = tmp_path / "worker.py"
    script.write_text(SCRIPT.format(tests=str(Path(__file__).parent)))
    out = tmp_path / "weights.pt"
    env = {"STRATEGY": json.dumps(strategy), "OPTIMIZER": optimizer, "OUT": str(out)}
    spawn_ranks(script, 2, store=tmp_path / "store", env=env)
    return torch.load(out)


@pytest.mark.ranks
@pytest.mark.parametrize("sharding", ["ddp", "zero1", "fsdp", "zero2", "hsdp"])
def test_two_ranks_match_one_process_on_the_same_global_batch(tmp_path: Path, sharding: str) -> None:
    # two ranks x micro-batch 4 x accumulation 2 = one process x 16 samples per step
    ranks = two_ranks(
        tmp_path, {"data": 2, "micro_batch": 4, "accumulation": 2, "sharding": sharding, "precision": "fp32"}
    )
    single = train(config(micro_batch=16, accumulation=1))
    ranks = {name.removeprefix("module."): value for name, value in ranks.items()}  # DDP's wrapper prefix
    for name, param in single.named_parameters():
        torch.testing.assert_close(ranks[name], param.detach(), rtol=1e-5, atol=1e-6)
    held = json.loads((tmp_path / "weights.pt.held.json").read_text())
    whole = sum(param.numel() for param in single.parameters())
    if sharding == "hsdp":  # its reduce-scattered shard waits outside .grad for the boundary's all-reduce
        assert held == {"missing": len(list(single.parameters())), "local": 0}
    elif sharding in ("fsdp", "zero2"):
        # between micro-batches a rank holds its shard of the gradients, reduce-scattered each micro-batch, as
        # the plan counts them: not the whole gradient FSDP2 keeps when told not to sync until the boundary
        assert held["missing"] == 0 and held["local"] < 0.75 * whole, held
    else:
        assert held == {"missing": 0, "local": whole}
    comm = json.loads((tmp_path / "weights.pt.comm.json").read_text())
    if sharding in ("ddp", "zero1"):  # DDP's comm hook times what the synchronising backward waited
        assert len(comm) == SAMPLES // 16 and all(c is not None and c >= 0 for c in comm)
    else:
        assert comm == [None] * (SAMPLES // 16)  # not measurable under FSDP2: said so, not guessed


@pytest.mark.ranks
@pytest.mark.parametrize("sharding", ["zero1", "fsdp"])
def test_a_rebuilt_adamw_steps_fused_and_matches_one_process(tmp_path: Path, sharding: str) -> None:
    """ZeRO-1 and FSDP2 rebuild the optimizer from its class and settings: it comes out fused, and two ranks
    still train as one process does."""
    ranks = two_ranks(
        tmp_path, {"data": 2, "micro_batch": 4, "accumulation": 2, "sharding": sharding, "precision": "fp32"}, "adamw"
    )
    assert json.loads((tmp_path / "weights.pt.fused.json").read_text()) is True
    single = train(config(micro_batch=16, accumulation=1), optimizer="adamw")
    ranks = {name.removeprefix("module."): value for name, value in ranks.items()}
    for name, param in single.named_parameters():
        torch.testing.assert_close(ranks[name], param.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.ranks
def test_selective_checkpointing_under_fsdp_matches_one_process(tmp_path: Path) -> None:
    """Each block's forward checkpointed selectively inside FSDP2's per-block all-gather: the recomputation
    runs on the gathered weights and two ranks still train as one process without checkpointing does."""
    strategy = {"data": 2, "micro_batch": 4, "accumulation": 2, "sharding": "fsdp", "precision": "fp32"}
    ranks = two_ranks(tmp_path, strategy | {"checkpointing": "selective"})
    single = train(config(micro_batch=16, accumulation=1))
    for name, param in single.named_parameters():
        torch.testing.assert_close(ranks[name], param.detach(), rtol=1e-5, atol=1e-6)


def test_resume_from_a_checkpoint_finishes_like_an_uninterrupted_run(tmp_path: Path) -> None:
    plan = config(micro_batch=4, accumulation=2)

    def loop(checkpoints: Path, stop_at: int | None, seed: int) -> nn.Module:
        torch.manual_seed(seed)  # a different initialisation: the checkpoint must restore everything
        model = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.1), nn.Linear(32, 4))
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        loader = torch.utils.data.DataLoader(dataset(), batch_size=8, shuffle=True)
        run = prepare(model, optimizer, loader, plan=plan, checkpoint_dir=str(checkpoints), checkpoint_every=1)
        for x, y in run.micro_batches(epochs=2):
            if stop_at is not None and run.step == stop_at:
                break  # as if killed here: the step's checkpoint is on disk
            with run.accumulate():
                run.backward(nn.functional.mse_loss(run.model(x), y))
        return model

    whole = loop(tmp_path / "a", None, seed=0)
    loop(tmp_path / "b", stop_at=3, seed=0)
    resumed = loop(tmp_path / "b", None, seed=123)
    assert torch.equal(weights(resumed), weights(whole))


def test_a_scheduler_factory_is_built_on_the_optimizer_in_use() -> None:
    model = make_model()
    loader = torch.utils.data.DataLoader(dataset(), batch_size=16)
    run = prepare(
        model,
        lambda params: torch.optim.SGD(params, lr=0.1),
        loader,
        plan=config(micro_batch=16),
        scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.0),
    )
    assert run.scheduler.optimizer is run.optimizer
    before = weights(model)
    for x, y in run.micro_batches():
        with run.accumulate():
            run.backward(nn.functional.mse_loss(run.model(x), y))
    # LambdaLR sets lr to 0.1 x 0 from the start: the optimizer in use obeys it, so nothing moves
    assert run.optimizer.param_groups[0]["lr"] == 0.0 and torch.equal(before, weights(model))


def test_stopping_early_still_checkpoints_and_summarises(tmp_path: Path) -> None:
    model = make_model()
    loader = torch.utils.data.DataLoader(dataset(), batch_size=8)
    run = prepare(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        loader,
        plan=config(micro_batch=8),
        checkpoint_dir=str(tmp_path),
    )
    batches = run.micro_batches(epochs=3)
    for x, y in batches:
        with run.accumulate():
            run.backward(nn.functional.mse_loss(run.model(x), y))
        if run.step == 2:
            break
    batches.close()  # what leaving the loop does once the generator is dropped
    assert run.summary and run.checkpointer.latest_step() == 2


def test_each_batch_has_one_state_made_read_and_dropped() -> None:
    """accumulate() and backward() read the BatchState of the batch in hand (which micro-batch ends it, each
    one's share of the loss); the next batch gets a new one, and none is left after the loop. Outside the loop a
    micro-batch is a whole batch: its whole loss, the optimizer step after it."""
    model = make_model()
    loader = torch.utils.data.DataLoader(dataset(), batch_size=16)
    run = prepare(
        model, torch.optim.SGD(model.parameters(), lr=0.1), loader, plan=config(micro_batch=4, accumulation=4)
    )
    states, seen = [], []
    for x, y in run.micro_batches():
        state = run._in_hand
        states.append(state)
        seen.append((state.micro_index, state.boundary, state.loss_divisor, run.step))
        with run.accumulate():
            run.backward(nn.functional.mse_loss(run.model(x), y))
        assert state.stepped == state.boundary
    assert seen[:5] == [
        (0, False, 4.0, 0),
        (1, False, 4.0, 0),
        (2, False, 4.0, 0),
        (3, True, 4.0, 0),
        (0, False, 4.0, 1),
    ]
    assert len({id(state) for state in states}) == SAMPLES // 16 and run._in_hand is None
    x, y = dataset()[:4]
    with run.accumulate():
        run.backward(nn.functional.mse_loss(run.model(x), y))
        assert run._in_hand.loss_divisor == 1.0 and run._in_hand.boundary
    assert run.step == SAMPLES // 16 + 1 and run._in_hand is None


def test_max_steps_ends_the_run_and_a_resumed_run_goes_on_to_the_next_limit(tmp_path: Path) -> None:
    """8 steps per epoch of 64 samples at 8: a limit of 3 stops mid-epoch with its checkpoint; resumed with
    a limit of 11 it takes the rest of the first epoch and 3 of the second, as an uninterrupted run does."""
    plan = config(micro_batch=8)

    def loop(checkpoints: Path, max_steps: int) -> tuple[nn.Module, int]:
        model = make_model()
        loader = torch.utils.data.DataLoader(dataset(), batch_size=8, shuffle=True)
        run = prepare(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            loader,
            plan=plan,
            checkpoint_dir=str(checkpoints),
            max_steps=max_steps,
        )
        for x, y in run.micro_batches(epochs=5):
            with run.accumulate():
                run.backward(nn.functional.mse_loss(run.model(x), y))
        return model, run.step

    _, steps = loop(tmp_path / "a", 3)
    assert steps == 3
    resumed, steps = loop(tmp_path / "a", 11)
    assert steps == 11
    whole, steps = loop(tmp_path / "b", 11)
    assert steps == 11 and torch.equal(weights(resumed), weights(whole))
    with pytest.raises(BadInput, match="max_steps must be 1 or more, not 0"):
        prepare(make_model(), torch.optim.SGD(make_model().parameters(), lr=0.1), [], plan=plan, max_steps=0)


def test_cpu_threads_sets_the_operators_threads() -> None:
    before = torch.get_num_threads()
    try:
        train(config(micro_batch=16), cpu_threads=1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
