"""fp8 training (``runtime/fp8.py``) on the CPU: every refusal, in one line, where fp8 cannot run, the layers the
float8 conversion picks, and torchao's conversion of them. Training in fp8 needs a GPU of compute capability 8.9+
(scripts/gpu-check.sh, step runtime-fp8): here the product refuses it, and these tests only convert."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from ranks import spawn_ranks
from redline.errors import BadInput
from redline.plan.strategy import Strategy
from redline.runtime import fp8
from redline.runtime.config import RunConfig, check_runnable
from redline.runtime.fp8 import fp8_filter, output_layers, unavailable
from redline.runtime.prepare import Run, prepare

FP8 = Strategy(precision="fp8")


class Block(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.gate = nn.Linear(width, 20)  # 20 is no multiple of 16: stays as it is

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(self.qkv(x)[..., :32]) + self.down(self.up(x)) + self.gate(x).sum(-1, keepdim=True)


class TinyGpt(nn.Module):
    def __init__(self, vocab: int = 64, width: int = 32, tied: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(2))
        self.head = nn.Linear(width, vocab, bias=False)  # 64 x 32: fp8 could take it, the filter must not
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def picked(model: nn.Module) -> list[str]:
    keep = fp8_filter(model)
    return [name for name, module in model.named_modules() if keep(module, name)]


def test_the_filter_takes_the_blocks_linears_and_leaves_the_head_and_odd_dimensions() -> None:
    names = picked(TinyGpt())
    assert names == [f"blocks.{i}.{layer}" for i in range(2) for layer in ("qkv", "proj", "up", "down")]


def test_a_head_tied_to_the_embedding_stays_in_bf16() -> None:
    model = TinyGpt(tied=True)
    assert model.head in output_layers(model)
    assert "head" not in picked(model)


def test_a_stack_of_linear_layers_keeps_its_last_one_as_the_output() -> None:
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 16))
    assert picked(model) == ["0", "1"]


def test_a_hugging_face_models_lm_head_stays_in_bf16() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4
    )
    model = transformers.LlamaForCausalLM(config)
    names = picked(model)
    assert "lm_head" not in names
    projections = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert len(names) == 2 * len(projections) and all(name.endswith(projections) for name in names)


def test_conversion_makes_the_picked_layers_float8_and_keeps_their_parameters() -> None:
    pytest.importorskip("torchao.float8")
    from torchao.float8.float8_linear import Float8Linear

    model = TinyGpt()
    before = {name: p for name, p in model.named_parameters()}
    converted = fp8.apply_fp8(model)
    assert converted is model
    float8 = [name for name, m in model.named_modules() if isinstance(m, Float8Linear)]
    assert float8 == picked(TinyGpt())
    assert type(model.head) is nn.Linear and type(model.blocks[0].gate) is nn.Linear
    # the same parameter objects: the optimizer the user built beforehand still steps them
    assert all(p is before[name] for name, p in model.named_parameters())


# ------------------------------------------------------------------------------------------------ refusals


def fake_gpus(monkeypatch: pytest.MonkeyPatch, *capabilities: tuple[int, int], torchao: bool = True) -> None:
    """This process sees GPUs of these compute capabilities (nothing is allocated on a GPU by the check)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(capabilities))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=0: capabilities[index])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: f"GPU{index} {capabilities[index]}")
    monkeypatch.setattr(fp8, "is_available", lambda package: torchao or package != "torchao")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has a GPU")
def test_without_a_gpu_an_fp8_plan_is_refused_before_training() -> None:
    with pytest.raises(BadInput, match=r"fp8 training needs an NVIDIA GPU of compute capability 8\.9") as caught:
        check_runnable(FP8, "plan.yaml")
    message = str(caught.value)
    assert message.startswith("plan.yaml: ") and "\n" not in message and "--precision bf16" in message


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has a GPU")
def test_prepare_refuses_fp8_on_the_cpu_before_touching_the_model() -> None:
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 4))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(8, 16)), batch_size=8)
    plan = RunConfig(strategy=Strategy(precision="fp8", micro_batch=8))  # a plan is data: it holds fp8
    with pytest.raises(BadInput, match="this machine has none"):
        prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), loader, plan=plan)
    assert all(type(m) in (nn.Sequential, nn.Linear) for m in model.modules())


def test_a_gpu_without_fp8_tensor_cores_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpus(monkeypatch, (9, 0), (8, 0))
    with pytest.raises(BadInput, match=r"needs compute capability 8.9 or newer .*GPU1 \(8, 0\) is 8.0"):
        check_runnable(FP8)
    # a rank checks its own GPU only
    check_runnable(FP8, device=torch.device("cuda:0"))
    with pytest.raises(BadInput, match=r"is 8\.0"):
        check_runnable(FP8, device=torch.device("cuda:1"))


def test_without_torchao_fp8_is_refused_naming_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpus(monkeypatch, (9, 0), torchao=False)
    with pytest.raises(BadInput, match=r"runs through torchao, which is not installed: pip install torchao \(the fp8"):
        check_runnable(FP8)


def test_on_an_fp8_gpu_with_torchao_the_plan_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpus(monkeypatch, (8, 9), (9, 0))
    assert unavailable(FP8) is None
    check_runnable(FP8)
    check_runnable(Strategy(precision="bf16"))  # other precisions are none of its business


def test_fp8_beside_tensor_parallelism_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpus(monkeypatch, (9, 0), (9, 0))
    with pytest.raises(BadInput, match="does not combine with tensor parallelism"):
        check_runnable(Strategy(precision="fp8", tensor=2))


# ------------------------------------------------------------------------------ prepare()'s wiring, emulated


def test_prepare_converts_the_model_and_trains_it_under_torchaos_cpu_emulation(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    """The product refuses fp8 here; with the check opened and torchao emulating the float8 GEMM on the CPU,
    prepare() converts the picked layers before anything wraps them, trains them (the loss falls), and a
    checkpoint of the float8 model resumes."""
    pytest.importorskip("torchao.float8")
    from torchao.float8 import Float8LinearConfig, float8_linear_utils
    from torchao.float8.float8_linear import Float8Linear

    monkeypatch.setattr(fp8, "unavailable", lambda strategy, device=None: None)
    monkeypatch.setattr(float8_linear_utils, "Float8LinearConfig", lambda: Float8LinearConfig(emulate=True))
    tokens = torch.randint(0, 64, (64, 9), generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
    plan = RunConfig(strategy=Strategy(precision="fp8", micro_batch=8, accumulation=2))

    def start() -> Run:
        torch.manual_seed(0)
        model = TinyGpt()
        run = prepare(
            model,
            torch.optim.AdamW(model.parameters(), lr=1e-2),
            torch.utils.data.DataLoader(data, batch_size=16),
            plan=plan,
            loss_fn=lambda logits, target: nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten()),
            checkpoint_dir=str(tmp_path),
        )
        assert sum(isinstance(m, Float8Linear) for m in run.model.modules()) == 8
        return run

    run, losses = start(), []
    for x, y in run.micro_batches(epochs=3):
        with run.accumulate():
            losses.append(run.forward_backward(x, y).item())
    assert all(map(math.isfinite, losses)) and sum(losses[-4:]) < sum(losses[:4])
    resumed = start()
    assert resumed.step == run.step == 12


@pytest.mark.ranks
@pytest.mark.parametrize(
    ("strategy", "float8"),
    [
        ({"data": 2, "micro_batch": 8, "sharding": "ddp"}, [8, 8]),
        ({"data": 2, "micro_batch": 8, "sharding": "fsdp"}, [8, 8]),
        ({"data": 1, "pipeline": 2, "micro_batch": 4, "accumulation": 4}, [4, 4]),  # a stage of one block each
    ],
    ids=["ddp", "fsdp", "pipeline"],
)
def test_the_float8_layers_train_through_ddp_fsdp2_and_a_pipeline(tmp_path, strategy: dict, float8: list) -> None:
    """Two gloo ranks, torchao emulating on the CPU: each rank holds its float8 layers, every loss is finite and
    falls (on a pipeline, where the last stage computes it)."""
    pytest.importorskip("torchao.float8")
    out = tmp_path / "out"
    env = {"STRATEGY": json.dumps(strategy), "OUT": str(out)}
    spawn_ranks(Path(__file__).parent / "fp8_worker.py", 2, store=tmp_path / "store", env=env)
    results = [json.loads(Path(f"{out}.{rank}.json").read_text()) for rank in range(2)]
    assert [r["float8"] for r in results] == float8
    computed = [r["losses"] for r in results if None not in r["losses"]]
    assert computed and all(len(losses) == 16 for losses in computed)
    for losses in computed:
        assert all(map(math.isfinite, losses)) and sum(losses[-4:]) < sum(losses[:4]), losses
