"""The planner checks its own inputs: every value `redline plan` refuses, the library refuses too, in the same
words, naming the field where the CLI names its flag (``cli.plan.FLAGS``). And the planner's sequence as the
library runs it: plain inputs in, ``Plans`` and ``CloudRanking`` out, notes as values."""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import typer

from conftest import run_cli
from redline.cli.plan import FLAGS
from redline.errors import BadInput
from redline.plan.cloud import CloudScope, plan_cloud
from redline.plan.estimate import Goal
from redline.plan.hardware import ClusterChoice, parse_hardware
from redline.plan.inputs import CalibrationRequest, Ranking, Target
from redline.plan.messages import Message, PlanInputError
from redline.plan.planner import NoteKind, plan_training
from redline.plan.search import Constraints, search
from redline.workload.presets import preset_profile

GPT2 = preset_profile("gpt2")  # 12 blocks, 12 heads
RESNET = preset_profile("resnet50")
H100X8 = parse_hardware("8xh100-sxm")
H100 = parse_hardware("1xh100-sxm")

# (what the library is given, the field, the library's words, the CLI's words for the same value: what
# `redline plan` printed for it before the checks moved into the library)
REFUSED: list[tuple[str, Callable[[], Any], str, str, str]] = [
    (
        "tensor 0",
        lambda: Constraints(tensor=0),
        "tensor",
        "tensor must be at least 1, not 0",
        "--tp must be at least 1, not 0",
    ),
    (
        "pipeline 0",
        lambda: Constraints(pipeline=0),
        "pipeline",
        "pipeline must be at least 1, not 0",
        "--pp must be at least 1, not 0",
    ),
    (
        "micro-batch 0",
        lambda: Constraints(micro_batch=0),
        "micro_batch",
        "micro_batch must be at least 1, not 0",
        "--micro-batch must be at least 1, not 0",
    ),
    (
        "accumulation -2",
        lambda: Constraints(accumulation=-2),
        "accumulation",
        "accumulation must be at least 1, not -2",
        "--accumulation must be at least 1, not -2",
    ),
    (
        "checkpoint every 0",
        lambda: Constraints(checkpoint_every=0),
        "checkpoint_every",
        "checkpoint_every must be at least 1, not 0",
        "--ac-every must be at least 1, not 0",
    ),
    (
        "checkpoint every 2 of none",
        lambda: Constraints(checkpointing="none", checkpoint_every=2),
        "checkpoint_every",
        "checkpoint_every checkpoints some blocks: it goes with checkpointing selective or full",
        "--ac-every checkpoints some blocks: it goes with --checkpointing selective or full",
    ),
    (
        "sharding zero9",
        lambda: Constraints(sharding="zero9"),
        "sharding",
        "sharding 'zero9' is not one of ddp, zero1, zero2, fsdp, hsdp",
        "--sharding 'zero9' is not one of ddp, zero1, zero2, fsdp, hsdp",
    ),
    (
        "precision int4",
        lambda: Constraints(precision="int4"),
        "precision",
        "precision 'int4' is not one of fp32, bf16, fp16, fp8",
        "--precision 'int4' is not one of fp32, bf16, fp16, fp8",
    ),
    (
        "optimizer lion",
        lambda: Constraints(optimizer="lion"),
        "optimizer",
        "optimizer 'lion' is not one of adamw, adam, sgd, adafactor, adam8bit",
        "--optimizer 'lion' is not one of adamw, adam, sgd, adafactor, adam8bit",
    ),
    (
        "checkpointing some",
        lambda: Constraints(checkpointing="some"),
        "checkpointing",
        "checkpointing 'some' is not one of none, selective, full",
        "--checkpointing 'some' is not one of none, selective, full",
    ),
    (
        "schedule zigzag",
        lambda: Constraints(schedule="zigzag"),
        "schedule",
        "schedule 'zigzag' is not one of gpipe, 1f1b, interleaved",
        "--schedule 'zigzag' is not one of gpipe, 1f1b, interleaved",
    ),
    (
        "virtual stages alone",
        lambda: Constraints(virtual_stages=2),
        "virtual_stages",
        "virtual_stages goes with schedule interleaved",
        "--virtual-stages goes with --schedule interleaved",
    ),
    (
        "virtual stages 1",
        lambda: Constraints(schedule="interleaved", virtual_stages=1),
        "virtual_stages",
        "virtual_stages must be at least 2, not 1",
        "--virtual-stages must be at least 2, not 1",
    ),
    (
        "memory margin 1.5",
        lambda: Constraints(memory_margin=1.5),
        "memory_margin",
        "memory_margin must be a fraction from 0 to below 1 (0.05 = 5%), not 1.5",
        "--memory-margin must be a fraction from 0 to below 1 (0.05 = 5%), not 1.5",
    ),
    (
        "memory margin NaN",
        lambda: Constraints(memory_margin=math.nan),
        "memory_margin",
        "memory_margin must be a fraction from 0 to below 1 (0.05 = 5%), not nan",
        "--memory-margin must be a fraction from 0 to below 1 (0.05 = 5%), not nan",
    ),
    (
        "tensor 3 on 8",
        lambda: search(GPT2, H100X8, Goal(64), Constraints(tensor=3)),
        "tensor",
        "tensor 3 does not divide the 8 GPUs of a node",
        "--tp 3 does not divide the 8 GPUs of a node",
    ),
    (
        "pipeline 16 of 12 blocks",
        lambda: search(GPT2, H100X8, Goal(64), Constraints(pipeline=16)),
        "pipeline",
        "pipeline 16: more pipeline stages than the model has blocks (12)",
        "--pp 16: more pipeline stages than the model has blocks (12)",
    ),
    (
        "pipeline 3 of 8",
        lambda: search(GPT2, H100X8, Goal(64), Constraints(pipeline=3)),
        "pipeline",
        "pipeline 3 does not divide the 8 GPUs",
        "--pp 3 does not divide the 8 GPUs",
    ),
    (
        "hsdp on one node",
        lambda: search(GPT2, H100X8, Goal(64), Constraints(sharding="hsdp")),
        "sharding",
        "sharding hsdp shards inside a node and replicates across nodes: it needs nodes > 1",
        "--sharding hsdp shards inside a node and replicates across nodes: it needs --nodes > 1",
    ),
    (
        "global batch 0",
        lambda: Target(global_batch=0),
        "global_batch",
        "global_batch must be at least 1, not 0",
        "--global-batch must be at least 1, not 0",
    ),
    (
        "goal's global batch -4",
        lambda: Goal(-4),
        "global_batch",
        "global_batch must be at least 1, not -4",
        "--global-batch must be at least 1, not -4",
    ),
    (
        "epochs alone",
        lambda: Target(epochs=2),
        "epochs",
        "epochs and dataset_size go together (and epochs must be positive)",
        "--epochs and --dataset-size go together (and epochs must be positive)",
    ),
    (
        "dataset size alone",
        lambda: Target(dataset_size=1e6),
        "epochs",
        "epochs and dataset_size go together (and epochs must be positive)",
        "--epochs and --dataset-size go together (and epochs must be positive)",
    ),
    (
        "epochs 0",
        lambda: Target(epochs=0, dataset_size=1e6),
        "epochs",
        "epochs and dataset_size go together (and epochs must be positive)",
        "--epochs and --dataset-size go together (and epochs must be positive)",
    ),
    (
        "epochs NaN",
        lambda: Target(epochs=math.nan, dataset_size=1e6),
        "epochs",
        "epochs and dataset_size go together (and epochs must be positive)",
        "--epochs and --dataset-size go together (and epochs must be positive)",
    ),
    (
        "tokens and epochs",
        lambda: Target(tokens=1e9, epochs=1, dataset_size=1e6),
        "tokens",
        "give tokens or epochs/dataset_size, not both",
        "give --tokens or --epochs/--dataset-size, not both",
    ),
    (
        "tokens of an image model",
        lambda: plan_training(RESNET, H100, Target(tokens=1e9)),
        "tokens",
        "resnet50 trains on images, not tokens: give epochs and dataset_size",
        "resnet50 trains on images, not tokens: give --epochs and --dataset-size",
    ),
    ("top 0", lambda: Ranking(top=0), "top", "top must be at least 1, not 0", "--top must be at least 1, not 0"),
    (
        "rank by speed",
        lambda: Ranking(rank_by="speed"),
        "rank_by",
        "rank_by must be time or cost, not 'speed'",
        "--rank must be time or cost, not 'speed'",
    ),
    (
        "cost without a price",
        lambda: plan_training(GPT2, H100, ranking=Ranking(rank_by="cost")),
        "rank_by",
        "1xh100-sxm has no price: rank by time, or plan for a cloud instance (or plan_cloud)",
        "1xh100-sxm has no price: rank by time, or plan for a cloud instance (or --cloud)",
    ),
    (
        "nodes 0",
        lambda: ClusterChoice("8xh100-sxm", nodes=0),
        "nodes",
        "nodes must be between 1 and 16384, not 0",
        "--nodes must be between 1 and 16384, not 0",
    ),
    (
        "nodes 10^20",
        lambda: ClusterChoice("8xh100-sxm", nodes=10**20),
        "nodes",
        f"nodes must be between 1 and 16384, not {10**20}",
        f"--nodes must be between 1 and 16384, not {10**20}",
    ),
    (
        "network 0",
        lambda: ClusterChoice("8xh100-sxm", network_gbps=0.0),
        "network_gbps",
        "network_gbps must be positive, not 0.0",
        "--network-gbps must be positive, not 0.0",
    ),
    (
        "64 GPUs a node",
        lambda: ClusterChoice("64xh100-sxm").cluster(),
        "hardware",
        "hardware 64xh100-sxm: a node holds at most 8 GPUs; give the node and nodes, e.g. 8xh100-sxm nodes 8",
        "--hardware 64xh100-sxm: a node holds at most 8 GPUs; give the node and --nodes, e.g. 8xh100-sxm --nodes 8",
    ),
    (
        "0 GPUs",
        lambda: ClusterChoice("0xh100-sxm").cluster(),
        "hardware",
        "hardware 0xh100-sxm: the GPU count must be at least 1",
        "--hardware 0xh100-sxm: the GPU count must be at least 1",
    ),
    (
        "max nodes 0",
        lambda: CloudScope(max_nodes=0),
        "max_nodes",
        "max_nodes must be at least 1, not 0",
        "--max-nodes must be at least 1, not 0",
    ),
    (
        "max nodes 10^20",
        lambda: CloudScope(max_nodes=10**20),
        "max_nodes",
        f"max_nodes must be at most 16384, not {10**20}",
        f"--max-nodes must be at most 16384, not {10**20}",
    ),
    (
        "provider nosuch",
        lambda: CloudScope(providers=("nosuch",)),
        "providers",
        "providers nosuch is not in the catalog; known: aws, azure, gcp, lambda",
        "--provider nosuch is not in the catalog; known: aws, azure, gcp, lambda",
    ),
    (
        "cloud without a length",
        lambda: plan_cloud(GPT2, Target()),
        "plan_cloud",
        "plan_cloud compares the cost of a whole run: give tokens, or epochs with dataset_size",
        "--cloud compares the cost of a whole run: give --tokens, or --epochs with --dataset-size",
    ),
    (
        "calibration without a model",
        lambda: CalibrationRequest(None),
        "calibration",
        "calibration runs the model: give it as calibration.model (a config.json, a factory, resnet50, vit-b-16)",
        "--calibrate runs the model: give it as --model (a config.json, a factory, resnet50, vit-b-16)",
    ),  # type: ignore[arg-type]
    (
        "calibration micro-batch 0",
        lambda: CalibrationRequest("resnet50", micro_batch=0),
        "calibration.micro_batch",
        "calibration.micro_batch must be at least 1, not 0",
        "--calibrate-micro-batch must be at least 1, not 0",
    ),
    (
        "calibration elsewhere",
        lambda: plan_training(GPT2, H100, calibration=CalibrationRequest("resnet50")),
        "calibration",
        "calibration measures this machine: plan with hardware local",
        "--calibrate measures this machine: plan with --hardware local",
    ),
]


@pytest.mark.parametrize(
    ("make", "field", "library", "cli"), [case[1:] for case in REFUSED], ids=[c[0] for c in REFUSED]
)
def test_the_library_refuses_what_the_cli_refuses_in_the_same_words(
    make: Callable[[], Any], field: str, library: str, cli: str
) -> None:
    with pytest.raises(PlanInputError) as refused:
        make()
    error = refused.value
    assert (str(error), error.field, error.render(FLAGS)) == (library, field, cli)
    assert isinstance(error, BadInput) and isinstance(error, ValueError) and error.exit_code == 2


def test_a_refused_constraint_never_reaches_the_search() -> None:
    """Constraints(tensor=0) divided by zero inside the search; Constraints(sharding='zero9') returned no plans,
    each excluded for a reason that did not name the typo."""
    for bad in ({"tensor": 0}, {"sharding": "zero9"}):
        with pytest.raises(PlanInputError):
            search(GPT2, H100X8, Goal(64), Constraints(**bad))


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"tensor": 2.5}, "tensor must be a whole number, not 2.5"),
        ({"micro_batch": True}, "micro_batch must be a whole number, not True"),
        ({"time_tolerance": -0.1}, "time_tolerance must not be negative, not -0.1"),
    ],
)
def test_values_the_cli_cannot_type_are_refused_too(values: dict[str, Any], message: str) -> None:
    with pytest.raises(PlanInputError, match=message):
        Constraints(**values)


def test_the_other_inputs_refuse_what_only_the_library_can_be_given() -> None:
    for make, message in (
        (lambda: Goal(8, tokens=0), "tokens must be positive, not 0"),
        (lambda: Goal(8, tokens=1e9, samples=1e6), "give tokens or samples, not both"),
        (lambda: Target(tokens=-1.0), "tokens must be positive, not -1.0"),
        (lambda: Target(epochs=1, dataset_size=0), "dataset_size must be positive, not 0"),
        (lambda: ClusterChoice(""), "hardware is empty"),
        (lambda: ClusterChoice("8xh100-sxm", nodes=2.0), "nodes must be a whole number, not 2.0"),
        (lambda: CloudScope(deadline_s=0), "deadline_s must be positive, not 0"),
    ):
        with pytest.raises(PlanInputError, match=message):
            make()


@pytest.mark.parametrize(
    ("args", "case"),
    [
        (["--tp", "0"], "tensor 0"),
        (["--sharding", "zero9"], "sharding zero9"),
        (["--ac-every", "2", "--checkpointing", "none"], "checkpoint every 2 of none"),
        (["--nodes", "0"], "nodes 0"),
        (["--rank", "speed"], "rank by speed"),
        (["--epochs", "2"], "epochs alone"),
    ],
)
def test_the_cli_prints_the_librarys_words_with_its_flags(args: list[str], case: str) -> None:
    (cli,) = [row[4] for row in REFUSED if row[0] == case]
    result = run_cli("plan", "-m", "gpt2", "--hardware", "8xh100-sxm", *args)
    assert result.returncode == 2 and result.stderr.strip() == f"redline: {cli}", result.stderr


def test_every_input_field_has_a_flag_of_redline_plan() -> None:
    from redline.cli.main import app
    from redline.plan.estimate import Goal

    unflagged = {"time_tolerance"}  # the CLI fixes it (TIME_TOLERANCE)
    fields = {
        f.name
        for cls in (Constraints, Goal, Target, Ranking, ClusterChoice, CloudScope)
        for f in dataclasses.fields(cls)
    }
    # the other names said: and plan.dtypes.with_residual_bytes's input
    named = {"calibration", "calibration.model", "calibration.micro_batch", "plan_cloud", "residual_bytes"}
    assert fields - unflagged | named == set(FLAGS)
    command = typer.main.get_command(app).commands["plan"]  # type: ignore[attr-defined]
    options = {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)}
    assert {flag for value in FLAGS.values() for flag in value.split("/")} <= options


def test_a_message_names_inputs_and_never_reads_a_value_as_a_name() -> None:
    message = Message("{tensor} {value} is odd; try {pipeline}", {"value": "{pipeline}"})
    assert message.names == ("tensor", "pipeline")
    assert message.render() == "tensor {pipeline} is odd; try pipeline"
    assert message.render({"tensor": "--tp", "pipeline": "--pp"}) == "--tp {pipeline} is odd; try --pp"
    assert Message.plain("a {brace} of text").render({"brace": "no"}) == "a {brace} of text"


# ------------------------------------------------------------------------------------------ the planner's sequence


def test_plan_training_returns_the_ranked_plans_and_notes_as_values() -> None:
    plans = plan_training(GPT2, H100X8, Target(tokens=1e9), Constraints(tensor=1), ranking=Ranking(top=3))
    assert plans.best is plans.ranked[0] and len(plans.leaders) == 3
    assert all(e.strategy.tensor == 1 for e in plans.ranked) and plans.calibration is None
    assert plans.goal == Goal(512, tokens=1e9)  # GPT-2's default: 512 x 1024 tokens, about 0.5M a step
    (default,) = [note for note in plans.notes if note.kind is NoteKind.DEFAULT_GLOBAL_BATCH]
    assert default.text().endswith("set global_batch") and default.text(FLAGS).endswith("set --global-batch")
    assert plans.to_dict()["ranked"] == [e.to_dict() for e in plans.leaders]
    given = plan_training(GPT2, H100X8.with_nodes(2), Target(global_batch=64))
    assert [note.kind for note in given.notes] == [NoteKind.HARDWARE]  # the network assumed; the batch given


@pytest.mark.slow  # the smallest hardware: a search on every catalog GPU at growing sizes
def test_plan_training_says_why_nothing_fits_and_what_would() -> None:
    with pytest.raises(BadInput, match=r"nothing fits on 1xh100-sxm.*Smallest hardware that fits"):
        plan_training(preset_profile("llama-2-70b"), H100, Target(global_batch=8))


def test_plan_cloud_ranks_instances_and_keeps_to_the_deadline() -> None:
    scope, target = CloudScope(max_nodes=1, providers=("lambda",)), Target(global_batch=64, tokens=1e9)
    found = plan_cloud(GPT2, target, ranking=Ranking(rank_by="cost", top=3), scope=scope)
    costs = [o.cost_usd for o in found.ranked]
    assert costs == sorted(costs) and len(found.leaders) == 3 and {o.provider for o in found.options} == {"lambda"}
    assert found.to_dict()["options"] == len(found.options)
    fastest = min(o.time_s for o in found.options)
    with pytest.raises(PlanInputError, match="no option finishes within") as refused:
        plan_cloud(GPT2, target, scope=dataclasses.replace(scope, deadline_s=fastest / 2))
    assert refused.value.render(FLAGS).endswith("raise --max-nodes or the deadline")


TINY = """
import torch
from torch import nn

def build():
    return nn.Sequential(nn.Embedding(100, 32), nn.Linear(32, 100)), (16,)
"""


def test_plan_training_calibrates_on_this_machine_and_reports_as_it_goes(tmp_path: Path) -> None:
    """Real steps of a tiny model on the CPU (the cluster says "local" and has no GPU): the progress note comes
    before they run, the fitted corrections come back as notes, the plans with the precision measured."""
    pytest.importorskip("torch")
    (tmp_path / "tiny_calibrated.py").write_text(TINY)
    sys.path.insert(0, str(tmp_path))
    try:
        from redline.workload.load import load_workload

        profile = load_workload("tiny_calibrated:build")
        cpu = dataclasses.replace(H100, name="local", gpu=None)
        said = []
        plans = plan_training(
            profile,
            cpu,
            Target(global_batch=8),
            calibration=CalibrationRequest("tiny_calibrated:build"),
            progress=said.append,
        )
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("tiny_calibrated", None)
    assert [note.kind for note in said] == [NoteKind.CALIBRATING]
    assert plans.calibration is not None and plans.calibration.precision == "fp32"
    assert plans.constraints.precision == "fp32" and plans.best.strategy.precision == "fp32"
    assert NoteKind.CALIBRATED in {note.kind for note in plans.notes}
