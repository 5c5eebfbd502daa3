"""`redline plan`: will the model fit, how should it run, how fast and at what cost.

Predicts memory per GPU and step time for every way of running the model on the hardware (data, tensor
and pipeline parallel degrees, ZeRO/FSDP sharding, micro-batch and accumulation, activation
checkpointing), keeps those that fit, and ranks them. `-o plan.yaml` writes the best as the plan file the
runtime reads. `--cloud` ranks cloud instances and node counts by cost and by time to finish.

This module parses the options into the planner's inputs, calls the planner (``plan/planner.py``'s
``plan_training``, ``plan/cloud.py``'s ``plan_cloud``) and renders what it returns (``report/plan.py``). The
planner checks its own inputs and names them by field; ``FLAGS`` says them as this command's flags.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from redline.cli import params, ui
from redline.cli.params import count_option as _count
from redline.cli.params import deadline_s, parse_input_shape
from redline.errors import BadInput
from redline.report.output import write_output

if TYPE_CHECKING:
    from rich.console import RenderableType

    from redline.plan.cloud import CloudScope
    from redline.plan.hardware import Cluster
    from redline.plan.inputs import CalibrationRequest, Ranking, Target
    from redline.plan.planner import Note, Plans
    from redline.plan.search import Constraints
    from redline.workload.profile import WorkloadProfile
    from redline.workload.split_marks import TensorSplitPlan

# the options, one line each in plan()'s signature
Model = Annotated[
    str | None,
    typer.Option(
        "--model", "-m", help="A preset (see --list-models), a Hugging Face config.json, or package.module:factory."
    ),
]
Params = Annotated[
    str | None, typer.Option("--params", help="Only a parameter count (7e9, 7B): a GPT shape is assumed.")
]
Hardware = Annotated[
    str,
    typer.Option("--hardware", help="COUNTxGPU (8xh100-sxm), a cloud instance (p5.48xlarge), or local (this machine)."),
]
Nodes = Annotated[int, typer.Option("--nodes", help="Identical nodes.")]
NetworkGbps = Annotated[float | None, typer.Option("--network-gbps", help="Inter-node bandwidth per node, Gbit/s.")]
GlobalBatch = Annotated[int | None, typer.Option("--global-batch", help="Samples per optimizer step.")]
SeqLen = Annotated[int | None, typer.Option("--seq-len", help="Training sequence length (language models).")]
InputShape = Annotated[
    str | None, typer.Option("--input-shape", help="Per-sample input of a factory model: 3,224,224.")
]
Tokens = Annotated[str | None, typer.Option("--tokens", help="Train on this many tokens (300B, 1e12).")]
Epochs = Annotated[float | None, typer.Option("--epochs", help="... or this many epochs of --dataset-size samples.")]
DatasetSize = Annotated[str | None, typer.Option("--dataset-size", help="Samples in the dataset (1.28M).")]
Precision = Annotated[
    str | None,
    typer.Option(
        "--precision",
        help="fp32 | bf16 | fp16 | fp8 (default: bf16, else fp16, where the device runs it faster than fp32; "
        "else fp32).",
    ),
]
Optimizer = Annotated[str, typer.Option("--optimizer", help="adamw | adam | sgd | adafactor | adam8bit.")]
Sharding = Annotated[
    str | None, typer.Option("--sharding", help="Fix the sharding: ddp | zero1 | zero2 | fsdp | hsdp.")
]
Tensor = Annotated[int | None, typer.Option("--tp", help="Fix the tensor-parallel degree.")]
Pipeline = Annotated[int | None, typer.Option("--pp", help="Fix the pipeline-parallel degree.")]
MicroBatch = Annotated[int | None, typer.Option("--micro-batch", help="Fix the micro-batch.")]
Checkpointing = Annotated[
    str | None,
    typer.Option(
        "--checkpointing",
        help="Fix activation checkpointing: none | selective (keep matmul outputs, recompute the attention core "
        "and elementwise ops) | full (keep each block's input).",
    ),
]
SequenceParallel = Annotated[
    bool,
    typer.Option(
        "--sequence-parallel/--no-sequence-parallel", help="Shard norms and dropout along the sequence under --tp."
    ),
]
FlashAttention = Annotated[
    bool,
    typer.Option(
        "--flash-attention/--no-flash-attention", help="Fused attention (no s x s matrices kept), or the math path."
    ),
]
Schedule = Annotated[
    str | None, typer.Option("--schedule", help="Pipeline schedule: gpipe | 1f1b | interleaved (default 1f1b).")
]
VirtualStages = Annotated[
    int | None,
    typer.Option("--virtual-stages", help="With --schedule interleaved: layer chunks per pipeline rank (default 2)."),
]
Analytic = Annotated[
    bool,
    typer.Option(
        "--analytic",
        help="Read a config.json by the transformer formulas instead of tracing it through transformers "
        "(gpt2, llama, mistral, qwen2, qwen3, bert, t5).",
    ),
]
ResidualBytes = Annotated[
    int | None,
    typer.Option(
        "--residual-bytes",
        help="Only to plan for another framework: its residual stream's bytes a value under every sharding (2: "
        "Megatron-LM's bf16; 4: fp32). Default: as redline run keeps it (16-bit under FSDP2: zero2, fsdp, hsdp "
        "or beside --tp/--pp; fp32 under DDP and ZeRO-1's autocast).",
    ),
]
MemoryMargin = Annotated[
    float,
    typer.Option(
        "--memory-margin",
        help="Fraction of each GPU's memory a plan leaves free (0.05 = 5%). Default 0: the prediction already counts "
        "the allocator's 5% reserve, the CUDA context and NCCL's buffers.",
    ),
]
Top = Annotated[int, typer.Option("--top", help="How many strategies (or cloud options) to show.")]
RankBy = Annotated[str, typer.Option("--rank", help="time | cost.")]
Cloud = Annotated[bool, typer.Option("--cloud", help="Rank cloud instances and node counts instead of one machine.")]
MaxNodes = Annotated[int, typer.Option("--max-nodes", help="With --cloud: try 1, 2, 4 ... up to this many nodes.")]
Provider = Annotated[list[str], typer.Option("--provider", help="With --cloud: only these providers (repeatable).")]
Deadline = Annotated[str | None, typer.Option("--deadline", help="With --cloud: must finish within (36h, 7d).")]
Calibrate = Annotated[
    bool,
    typer.Option("--calibrate", help="With --hardware local: time real steps of the model here and correct the plan."),
]
CalibrateMicroBatch = Annotated[
    int | None,
    typer.Option(
        "--calibrate-micro-batch",
        help="With --calibrate: measure at this micro-batch, half of it and 1 (default: the uncalibrated plan's).",
    ),
]
ListModels = Annotated[bool, typer.Option("--list-models", help="List the built-in model presets and exit.")]
JsonOutput = Annotated[bool, typer.Option("--json", help="Print the whole result as JSON.")]
Output = Annotated[
    Path | None, typer.Option("--output", "-o", help="Write the best plan as YAML (the runtime's input).")
]


# the planner's inputs as its refusals and notes name them (plan/messages.py), said as this command's flags
FLAGS: dict[str, str] = {
    # Constraints
    "precision": "--precision", "optimizer": "--optimizer", "sharding": "--sharding", "tensor": "--tp",
    "pipeline": "--pp", "micro_batch": "--micro-batch", "accumulation": "--accumulation",
    "checkpointing": "--checkpointing", "checkpoint_every": "--ac-every", "sequence_parallel": "--sequence-parallel",
    "flash_attention": "--flash-attention", "schedule": "--schedule", "virtual_stages": "--virtual-stages",
    "memory_margin": "--memory-margin", "residual_bytes": "--residual-bytes",
    # Target and Goal, Ranking, ClusterChoice, CloudScope, CalibrationRequest; plan_cloud itself
    "global_batch": "--global-batch", "tokens": "--tokens", "epochs": "--epochs", "dataset_size": "--dataset-size",
    "samples": "--epochs/--dataset-size", "rank_by": "--rank", "top": "--top", "hardware": "--hardware",
    "nodes": "--nodes", "network_gbps": "--network-gbps", "max_nodes": "--max-nodes", "providers": "--provider",
    "deadline_s": "--deadline", "calibration": "--calibrate", "calibration.model": "--model",
    "calibration.micro_batch": "--calibrate-micro-batch", "plan_cloud": "--cloud",
}  # fmt: skip


@contextlib.contextmanager
def _said_as_flags() -> Iterator[None]:
    """The planner's refusals name its inputs by field; the user typed flags: the same words, said with ``FLAGS``."""
    from redline.plan.messages import PlanInputError

    try:
        yield
    except PlanInputError as exc:
        raise BadInput(exc.render(FLAGS)) from None


@params.with_runtime_options
@_said_as_flags()
def plan(
    model: Model = None,
    params: Params = None,
    hardware: Hardware = "local",
    nodes: Nodes = 1,
    network_gbps: NetworkGbps = None,
    global_batch: GlobalBatch = None,
    seq_len: SeqLen = None,
    input_shape: InputShape = None,
    tokens: Tokens = None,
    epochs: Epochs = None,
    dataset_size: DatasetSize = None,
    precision: Precision = None,
    optimizer: Optimizer = "adamw",
    sharding: Sharding = None,
    tensor: Tensor = None,
    pipeline: Pipeline = None,
    micro_batch: MicroBatch = None,
    checkpointing: Checkpointing = None,
    sequence_parallel: SequenceParallel = True,
    flash_attention: FlashAttention = True,
    schedule: Schedule = None,
    virtual_stages: VirtualStages = None,
    analytic: Analytic = False,
    residual_bytes: ResidualBytes = None,
    memory_margin: MemoryMargin = 0.0,
    top: Top = 5,
    rank_by: RankBy = "time",
    cloud: Cloud = False,
    max_nodes: MaxNodes = 8,
    provider: Provider = [],  # noqa: B006 (typer's default: never mutated)
    deadline: Deadline = None,
    calibrate: Calibrate = False,
    calibrate_micro_batch: CalibrateMicroBatch = None,
    list_models: ListModels = False,
    json_output: JsonOutput = False,
    output: Output = None,
    runtime: dict[str, Any] | None = None,  # the runtime options given (params.with_runtime_options)
) -> None:
    """Predict memory, step time and cost of every way to run a model, and pick the best."""
    from redline.plan import dtypes, inputs, search
    from redline.plan.hardware import ClusterChoice

    if list_models:
        _list_models(json_output)
        return
    runtime = dict(runtime or {})
    ranking = inputs.Ranking(rank_by=rank_by, top=top)
    constraints = search.Constraints(
        precision=precision,
        optimizer=optimizer,
        sharding=sharding,
        tensor=tensor,
        pipeline=pipeline,
        micro_batch=micro_batch,
        accumulation=runtime.pop("accumulation", None),
        checkpointing=checkpointing,
        checkpoint_every=runtime.pop("ac_every", None),
        sequence_parallel=sequence_parallel,
        flash_attention=flash_attention,
        schedule=schedule,
        virtual_stages=virtual_stages,
        memory_margin=memory_margin,
        time_tolerance=search.TIME_TOLERANCE,  # plans within 1% of the fastest rank by memory headroom
    )
    target = inputs.Target(global_batch, _count("--tokens", tokens), epochs, _count("--dataset-size", dataset_size))
    given = _placement_flags(hardware, nodes, network_gbps, deadline, provider, max_nodes)
    _check_modes(cloud, given, runtime, calibrate, calibrate_micro_batch)
    # options before the model's trace (which takes a while), this machine's hardware after it (a bad model first)
    scope = _cloud_scope(max_nodes, provider, deadline)
    dtypes.check_residual_bytes(residual_bytes)
    calibration = inputs.CalibrationRequest(model or "", calibrate_micro_batch) if calibrate else None
    load = model_load(model, _count("--params", params), seq_len, parse_input_shape(input_shape), analytic)
    profile = dtypes.with_residual_bytes(_profile(model, params, seq_len, input_shape, analytic), residual_bytes)
    if cloud:
        _rank_cloud(profile, target, constraints, ranking, scope, deadline, json_output)
        return
    cluster = ClusterChoice(hardware, nodes, network_gbps).cluster()
    plans = _plans(profile, cluster, target, constraints, ranking, calibration, json_output)
    _write(plans, _runtime_section(runtime), load, output, json_output)


def _plans(
    profile: WorkloadProfile,
    cluster: Cluster,
    target: Target,
    constraints: Constraints,
    ranking: Ranking,
    calibration: CalibrationRequest | None,
    json_output: bool,
) -> Plans:
    """The planner's answer for one cluster, said on stderr while it searches (and times real steps first, with
    --calibrate), its notes as it goes told as warnings. Where nothing fits, the one-line reason (exit 2), and with
    --json the refusal as data on stdout first: the closest candidates, what each needs and why it was refused."""
    from redline.plan import planner

    searching = f"planning {profile.name} on {cluster.gpus} x {cluster.device}"
    try:
        with ui.phase(searching + (" (timing real steps here first)" if calibration else "")):
            return planner.plan_training(
                profile, cluster, target, constraints, ranking=ranking, calibration=calibration, progress=_warn
            )
    except planner.NothingFits as refused:
        if json_output:
            ui.print_json(refused.to_dict())
        raise


def _warn(note: Note) -> None:
    ui.warn(note.text(FLAGS))


def model_load(
    model: str | None, params: float | None, seq_len: int | None, shape: tuple[int, ...] | None, analytic: bool
) -> dict[str, Any]:
    """How to load the model again (``load_workload``'s arguments), as the plan file records it under
    ``model.load`` for ``redline tune``: a config file's path made absolute, the options not given left out."""
    from redline.workload.model_spec import ModelKind, parse_model_spec

    spec = None if model is None else parse_model_spec(model)
    if spec is not None and spec.kind is ModelKind.CONFIG and spec.path is not None and spec.path.exists():
        model = str(spec.path.resolve())
    given = {"model": model, "params": params, "seq_len": seq_len, "input_shape": shape and list(shape)}
    return {key: value for key, value in given.items() if value is not None} | ({"analytic": True} if analytic else {})


def _profile(
    model: str | None, params: str | None, seq_len: int | None, input_shape: str | None, analytic: bool
) -> WorkloadProfile:
    """The model's workload profile; a traced one counts, per layer, what the runtime's tensor-parallel plan
    splits (``_tensor_split``). A sequence length is a language model's."""
    from redline.workload.load import load_workload

    with ui.phase(f"profiling {model or 'the model'}"):  # tracing a config.json or a factory takes 10-20 s
        profile = load_workload(
            model,
            params=_count("--params", params),
            seq_len=seq_len,
            input_shape=parse_input_shape(input_shape),
            analytic=analytic,
            tensor_split=_tensor_split,
        )
    if seq_len is not None and profile.sample_unit != "sequence":
        raise BadInput(f"--seq-len applies to language models; {profile.name} takes {profile.sample_unit}s")
    return profile


def _tensor_split(module: Any) -> TensorSplitPlan | None:
    """What the runtime's tensor-parallel plan splits of a traced module (a ``TensorSplitPlan``, or None), so that
    the plan counts each rank's parameters and activations as ``redline run`` will shard them (imported only when
    a model is traced: it needs torch)."""
    from redline.runtime.tensor_parallel import tensor_split_plan

    return tensor_split_plan(module)


def _check_modes(
    cloud: bool, given: dict[str, bool], runtime: dict[str, Any], calibrate: bool, calibrate_micro_batch: int | None
) -> None:
    """The options of a --cloud ranking and of a plan for one machine, each refused with the other (``given``: which
    of those options the user set), and --calibrate-micro-batch without --calibrate."""
    if cloud:
        if given["--hardware"] or given["--nodes"] or given["--network-gbps"]:
            raise BadInput("--cloud picks the hardware itself: drop --hardware, --nodes and --network-gbps")
        if runtime:
            from redline.runtime.config import setting

            flag = setting(next(iter(runtime))).flag
            raise BadInput(f"{flag} is a setting of the plan file, which --cloud does not write")
        return
    for option in ("--deadline", "--provider", "--max-nodes"):
        if given[option]:
            raise BadInput(f"{option} goes with --cloud")
    if calibrate_micro_batch is not None and not calibrate:
        raise BadInput("--calibrate-micro-batch goes with --calibrate")


def _runtime_section(runtime: dict[str, Any]) -> dict[str, Any]:
    """The runtime options given, checked, as the plan file's ``runtime:`` section."""
    from redline.runtime.config import RunConfig, check_settings

    check_settings(runtime)
    return RunConfig().with_settings(runtime).runtime_section()


# ----------------------------------------------------------------------------------------- parsing


def _placement_flags(
    hardware: str, nodes: int, network_gbps: float | None, deadline: str | None, provider: list[str], max_nodes: int
) -> dict[str, bool]:
    """Which of the options that place the run (on hardware of one's own, or in the cloud) were given."""
    given = {"--hardware": hardware != "local", "--nodes": nodes != 1, "--network-gbps": network_gbps is not None}
    return given | {"--deadline": deadline is not None, "--provider": bool(provider), "--max-nodes": max_nodes != 8}


def _cloud_scope(max_nodes: int, providers: list[str], deadline: str | None) -> CloudScope:
    """--max-nodes, --provider and --deadline, checked (also without --cloud, where they keep their defaults)."""
    from redline.plan.cloud import CloudScope

    return CloudScope(max_nodes, tuple(providers), deadline_s(deadline) if deadline is not None else None)


# ----------------------------------------------------------------------------------------- output


def _write(plans: Plans, runtime: dict[str, Any], load: dict[str, Any], output: Path | None, json_output: bool) -> None:
    """The best plan (with the runtime section and how to load the model) to ``output``, and the result as JSON
    or tables."""
    from redline.plan.planfile import PLAN_MARKER, dump_plan, make_plan

    notes = [note.text(FLAGS) for note in plans.notes]
    best = make_plan(plans.profile, plans.cluster, plans.goal, plans.best, notes, runtime=runtime, load=load)
    if output is not None:
        write_output(output, dump_plan(best), marker=PLAN_MARKER)
    if json_output:
        ui.print_json({"plan": best.to_dict()} | plans.to_dict())
        return
    from redline.report.plan import plans_view

    _print(plans_view(plans, notes))
    if output is not None:
        ui.console.print(ui.dim(f"plan written to {output}"))


def _list_models(json_output: bool) -> None:
    from redline.report.plan import preset_rows, presets_table

    rows = preset_rows()
    if json_output:
        ui.print_json(rows)
        return
    ui.print_table(presets_table(rows))


def _rank_cloud(
    profile: WorkloadProfile,
    target: Target,
    constraints: Constraints,
    ranking: Ranking,
    scope: CloudScope,
    deadline: str | None,
    json_output: bool,
) -> None:
    """--cloud: the catalog's instances and node counts ranked for the model, as JSON or a table."""
    from redline.plan.cloud import plan_cloud
    from redline.report.plan import cloud_view

    # every instance and node count searched: a minute for a large model, said as it goes
    with ui.phase(f"ranking cloud instances for {profile.name}") as progress:
        found = plan_cloud(profile, target, constraints, ranking=ranking, scope=scope, progress=progress)
    if json_output:
        ui.print_json(found.to_dict())
        return
    _print(cloud_view(found, profile.name, deadline))


def _print(parts: list[RenderableType]) -> None:
    """A report's parts in turn, each table through ``ui.print_table`` (whole at any width)."""
    from rich.table import Table

    for part in parts:
        if isinstance(part, Table):
            ui.print_table(part)
        else:
            ui.console.print(part)
