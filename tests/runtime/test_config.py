"""The runtime's config tree: each section checks its own fields, a plan file's ``runtime:`` section is read
(an older plan file without one runs with the defaults), and the settings stack up in one order: the plan,
``prepare()``'s keywords, ``redline run``'s options. Tokens per sample come from the batch without a plan."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from redline.env import REDLINE_RUNTIME
from redline.errors import BadInput
from redline.plan.estimate import Goal
from redline.plan.hardware import parse_hardware
from redline.plan.planfile import dump_plan, make_plan
from redline.plan.search import search
from redline.runtime.batch import tokens_per_sample
from redline.runtime.config import (
    CheckpointConfig,
    DataConfig,
    DdpConfig,
    MetricsConfig,
    NumericsConfig,
    RunConfig,
    check_settings,
    from_plan_file,
    runtime_from_env,
)
from redline.runtime.prepare import prepare
from redline.workload.presets import preset_profile


@pytest.fixture
def plan_file(tmp_path: Path) -> Path:
    profile = preset_profile("gpt2")
    cluster = parse_hardware("8xa100-sxm4-80gb")
    goal = Goal(global_batch=64, tokens=1e9)
    best = search(profile, cluster, goal).ranked[0]
    runtime = {"checkpoint": {"dir": "ckpt", "every": 5}, "numerics": {"compile": True}}
    path = tmp_path / "plan.yaml"
    path.write_text(dump_plan(make_plan(profile, cluster, goal, best, runtime=runtime)))
    return path


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: NumericsConfig(grad_clip_norm=0), "grad_clip_norm must be positive"),
        (lambda: DdpConfig(comm_hook="zip"), "comm_hook 'zip' is not one of none, fp16, bf16, powersgd"),
        (lambda: DataConfig(loader_stall_s=-1), "loader_stall_s must be 0"),
        (lambda: DataConfig(num_workers=-1), "num_workers must be 0 or more"),
        (lambda: CheckpointConfig(every=-1), "checkpoint_every must be 0 or more"),
        (lambda: CheckpointConfig(dir=" "), "checkpoint_dir is empty"),
        (lambda: MetricsConfig(path=""), "metrics_path is empty"),
    ],
)
def test_each_section_checks_its_fields(make, message: str) -> None:
    with pytest.raises(BadInput, match=message):
        make()


def test_a_plan_files_runtime_section_is_read(plan_file: Path) -> None:
    config = from_plan_file(plan_file)
    assert config.checkpoint == CheckpointConfig(dir="ckpt", every=5)
    assert config.numerics.compile and config.numerics.tf32  # the rest stays as the defaults have it
    assert config.plan.tokens_per_sample == 1024 and config.plan.predicted is not None
    assert config.runtime_section() == {"numerics": {"compile": True}, "checkpoint": {"dir": "ckpt", "every": 5}}


def test_an_older_plan_file_without_a_runtime_section_runs_with_the_defaults(plan_file: Path) -> None:
    data = yaml.safe_load(plan_file.read_text())
    del data["runtime"]
    plan_file.write_text(yaml.safe_dump(data))
    config = from_plan_file(plan_file)
    assert config.checkpoint == CheckpointConfig() and config.numerics == NumericsConfig()
    assert config.strategy.global_batch == 64


@pytest.mark.parametrize(
    ("runtime", "message"),
    [
        ({"warp": {"speed": 9}}, "unknown runtime section 'warp'"),
        ({"checkpoint": {"often": True}}, "runtime.checkpoint: unknown setting 'often'"),
        ({"checkpoint": {"every": -2}}, "checkpoint_every must be 0 or more"),
        ({"data": [1, 2]}, "runtime section 'data' must be a mapping"),
    ],
)
def test_a_bad_runtime_section_is_one_line(plan_file: Path, runtime: dict, message: str) -> None:
    data = yaml.safe_load(plan_file.read_text())
    data["runtime"] = runtime
    plan_file.write_text(yaml.safe_dump(data))
    with pytest.raises(BadInput, match=message) as caught:
        from_plan_file(plan_file)
    assert "\n" not in str(caught.value)


def test_keywords_override_the_plan_and_redline_runs_options_override_both(plan_file: Path, monkeypatch) -> None:
    monkeypatch.setenv(REDLINE_RUNTIME, json.dumps({"checkpoint_every": 7, "metrics_path": "m-{rank}.jsonl"}))
    config = from_plan_file(plan_file).with_settings({"checkpoint_every": 6, "checkpoint_dir": None, "seed": 3})
    assert (config.checkpoint.every, config.checkpoint.dir, config.data.seed) == (6, "ckpt", 3)
    config = config.with_settings(runtime_from_env())
    assert (config.checkpoint.every, config.metrics.path) == (7, "m-{rank}.jsonl")


def test_accumulation_splits_the_same_batch(plan_file: Path) -> None:
    planned = from_plan_file(plan_file).strategy
    per_rank = planned.micro_batch * planned.accumulation
    changed = from_plan_file(plan_file).with_settings({"accumulation": per_rank}).strategy
    assert (changed.micro_batch, changed.accumulation, changed.global_batch) == (1, per_rank, planned.global_batch)
    with pytest.raises(BadInput, match=f"accumulation {per_rank + 1} does not divide the per-rank batch"):
        from_plan_file(plan_file).with_settings({"accumulation": per_rank + 1})


def test_settings_are_checked_by_name(monkeypatch) -> None:
    with pytest.raises(BadInput, match="unknown runtime setting 'turbo'"):
        RunConfig().with_settings({"turbo": True})
    with pytest.raises(BadInput, match=r"--accumulation: Strategy\.accumulation must be a positive integer"):
        check_settings({"accumulation": -1})
    monkeypatch.setenv(REDLINE_RUNTIME, "{not json")
    with pytest.raises(BadInput, match="REDLINE_RUNTIME is not JSON"):
        runtime_from_env()


# ------------------------------------------------------------------------------------- tokens per sample


def test_tokens_per_sample_is_the_sequence_length_of_the_token_ids() -> None:
    tokens = torch.zeros(4, 64, dtype=torch.long)
    assert tokens_per_sample((tokens, tokens)) == 64
    assert tokens_per_sample({"attention_mask": torch.ones(4, 9, dtype=torch.long), "input_ids": tokens}) == 64
    assert tokens_per_sample((torch.randn(4, 3, 8, 8), torch.zeros(4, dtype=torch.long))) == 1  # images
    assert tokens_per_sample(torch.randn(4, 16)) == 1  # features


def test_tokens_per_second_of_a_language_model_without_a_plan(tmp_path: Path) -> None:
    """Without a plan, tokens/s used to be samples/s (one token per sample); the batch says 16."""

    class TinyLm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.head = nn.Embedding(32, 8), nn.Linear(8, 32)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.head(self.embed(tokens))

    torch.manual_seed(0)
    tokens = torch.randint(0, 32, (16, 17))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)
    model = TinyLm()
    metrics = tmp_path / "steps.jsonl"
    run = prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), loader, metrics_path=str(metrics))
    for x, y in run.micro_batches():
        with run.accumulate():
            run.backward(nn.functional.cross_entropy(run.model(x).flatten(0, 1), y.flatten()))
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert len(records) == 4
    for record in records:
        assert record["tokens"] == record["samples"] * 16
        assert record["tokens_per_s"] == pytest.approx(record["samples_per_s"] * 16)
