"""`redline plan`: will the model fit, how should it run, how fast and at what cost.

Predicts memory per GPU and step time for every way of running the model on the hardware (data, tensor
and pipeline parallel degrees, ZeRO/FSDP sharding, micro-batch and accumulation, activation
checkpointing), keeps those that fit, and ranks them. `-o plan.yaml` writes the best as the plan file the
runtime reads. `--cloud` ranks cloud instances and node counts by cost and by time to finish.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich import box
from rich.table import Table

from redline.cli import params, ui
from redline.errors import BadInput
from redline.report.output import write_output
from redline.units import fmt_bytes, fmt_count, fmt_duration, parse_count, parse_duration

if TYPE_CHECKING:
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
    str | None, typer.Option("--precision", help="fp32 | bf16 | fp16 | fp8 (default: bf16 if the GPU has it).")
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
    typer.Option("--analytic", help="Profile a config.json by formula instead of tracing it (transformers only)."),
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


@params.with_runtime_options
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
    runtime: dict | None = None,  # the runtime options given (params.with_runtime_options)
) -> None:
    """Predict memory, step time and cost of every way to run a model, and pick the best."""
    from redline.plan.estimate import Goal
    from redline.workload.presets import PRESET_NAMES

    if list_models:
        _list_models(PRESET_NAMES, json_output)
        return
    _check_ranking(top, max_nodes, rank_by)
    runtime = dict(runtime or {})
    accumulation = runtime.pop("accumulation", None)
    constraints = _constraints(
        precision, optimizer, sharding, tensor, pipeline, micro_batch, accumulation, checkpointing
    )
    constraints = _checkpoint_every(constraints, runtime.pop("ac_every", None))
    constraints = _layout(constraints, sequence_parallel, flash_attention, schedule, virtual_stages, memory_margin)
    load = model_load(model, _count("--params", params), seq_len, parse_shape(input_shape), analytic)
    profile = _profile(model, params, seq_len, input_shape, analytic)
    tokens_total, samples = _amount(profile, tokens, epochs, dataset_size, seq_len)
    if global_batch is not None and global_batch < 1:
        raise BadInput(f"--global-batch must be at least 1, not {global_batch}")
    _check_cloud_options(cloud, hardware, nodes, network_gbps, deadline, provider, max_nodes, runtime)
    if cloud:
        goal = (global_batch, tokens_total, samples)
        _cloud(profile, constraints, *goal, rank_by, top, max_nodes, provider, deadline, json_output)
        return
    cluster = _cluster(hardware, nodes, network_gbps)
    if rank_by == "cost" and cluster.price_usd_per_node_hour is None:
        raise BadInput(f"{cluster.name} has no price: rank by time, or plan for a cloud instance (or --cloud)")
    _check_calibration(calibrate, model, cluster, calibrate_micro_batch)
    from redline.plan.search import default_global_batch

    batch = global_batch if global_batch is not None else default_global_batch(profile, cluster.gpus)
    goal = Goal(batch, tokens=tokens_total, samples=samples)
    calibration = (model, calibrate_micro_batch) if calibrate else None
    profile, result = _search(profile, cluster, goal, constraints, calibration)
    notes = [*profile.notes, *cluster.notes]
    if global_batch is None:
        notes.append(
            f"global batch {batch} is a default (about 0.5M tokens or 256 images per step); set --global-batch"
        )
    _write(profile, cluster, goal, result, notes, _runtime_section(runtime), load, output, json_output, top)


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
    splits (``_tensor_split``)."""
    from redline.workload.load import load_workload

    return load_workload(
        model,
        params=_count("--params", params),
        seq_len=seq_len,
        input_shape=parse_shape(input_shape),
        analytic=analytic,
        tensor_split=_tensor_split,
    )


def _tensor_split(module: Any) -> TensorSplitPlan | None:
    """What the runtime's tensor-parallel plan splits of a traced module (a ``TensorSplitPlan``, or None), so that
    the plan counts each rank's parameters and activations as ``redline run`` will shard them (imported only when
    a model is traced: it needs torch)."""
    from redline.runtime.tensor_parallel import tensor_split_plan

    return tensor_split_plan(module)


def _check_ranking(top: int, max_nodes: int, rank_by: str) -> None:
    from redline.plan.hardware import MAX_NODES

    for name, value in (("--top", top), ("--max-nodes", max_nodes)):
        if value < 1:
            raise BadInput(f"{name} must be at least 1, not {value}")
    if max_nodes > MAX_NODES:
        raise BadInput(f"--max-nodes must be at most {MAX_NODES}, not {max_nodes}")
    if rank_by not in ("time", "cost"):
        raise BadInput(f"--rank must be time or cost, not '{rank_by}'")


def _amount(profile, tokens: str | None, epochs: float | None, dataset_size: str | None, seq_len: int | None):
    """(tokens, samples) to train on: --tokens, or --epochs of --dataset-size samples, or neither."""
    samples = None
    if epochs is not None or dataset_size is not None:
        if epochs is None or dataset_size is None or epochs <= 0:
            raise BadInput("--epochs and --dataset-size go together (and epochs must be positive)")
        samples = epochs * _count("--dataset-size", dataset_size)
    tokens_total = _count("--tokens", tokens)
    if tokens_total is not None and samples is not None:
        raise BadInput("give --tokens or --epochs/--dataset-size, not both")
    if profile.sample_unit != "sequence":
        if tokens_total is not None:
            raise BadInput(
                f"{profile.name} trains on {profile.sample_unit}s, not tokens: give --epochs and --dataset-size"
            )
        if seq_len is not None:
            raise BadInput(f"--seq-len applies to language models; {profile.name} takes {profile.sample_unit}s")
    return tokens_total, samples


def _check_cloud_options(cloud, hardware, nodes, network_gbps, deadline, provider, max_nodes, runtime) -> None:
    """The options of a --cloud ranking and of a plan for one machine, each refused with the other."""
    if cloud:
        if hardware != "local" or nodes != 1 or network_gbps is not None:
            raise BadInput("--cloud picks the hardware itself: drop --hardware, --nodes and --network-gbps")
        if runtime:
            from redline.runtime.config import setting

            flag = setting(next(iter(runtime))).flag
            raise BadInput(f"{flag} is a setting of the plan file, which --cloud does not write")
        return
    for option, given in (("--deadline", deadline), ("--provider", provider), ("--max-nodes", max_nodes != 8)):
        if given:
            raise BadInput(f"{option} goes with --cloud")


def _runtime_section(runtime: dict) -> dict:
    """The runtime options given, checked, as the plan file's ``runtime:`` section."""
    from redline.runtime.config import RunConfig, check_settings

    check_settings(runtime)
    return RunConfig().with_settings(runtime).runtime_section()


def _search(profile, cluster, goal, constraints, calibration):
    """The ranked strategies (after a calibration on this machine, with ``calibration``: (model, micro-batch));
    BadInput saying why none fits, and the smallest hardware that would."""
    from redline.plan.search import explain_no_fit, search, smallest_fitting

    result = search(profile, cluster, goal, constraints)
    if calibration is not None:
        model, micro_batch = calibration
        # measured where the plan runs: the micro-batch the uncalibrated search chose, half of it, 1 for the floor
        chosen = result.ranked[0].strategy.micro_batch if result.ranked else 1
        measured_at = chosen if micro_batch is None else micro_batch
        profile, constraints = _calibrated(profile, cluster, model, constraints, measured_at)
        result = search(profile, cluster, goal, constraints)
    if result.ranked:
        return profile, result
    message = explain_no_fit(result, cluster)
    if result.closest_misfit is not None:
        smallest = smallest_fitting(profile, goal, constraints)
        if smallest:
            options = "; ".join(
                f"{c.gpus} x {c.gpu.key if c.gpu else c.device} ({e.strategy.label()})" for c, e in smallest
            )
            message += f". Smallest hardware that fits (micro-batch 1, full checkpointing): {options}"
        else:
            message += ". It fits on no catalog GPU up to 1024 GPUs"
    raise BadInput(message)


def _write(profile, cluster, goal, result, notes, runtime, load, output, json_output: bool, top: int) -> None:
    """The best plan (with the runtime section and how to load the model) to ``output``, and the result as JSON
    or tables."""
    from redline.plan.planfile import PLAN_MARKER, dump_plan, make_plan

    best = make_plan(profile, cluster, goal, result.ranked[0], notes, runtime=runtime, load=load)
    if output is not None:
        write_output(output, dump_plan(best), marker=PLAN_MARKER)
    if json_output:
        ui.print_json(
            {
                "plan": best.to_dict(),
                "ranked": [e.to_dict() for e in result.ranked[:top]],
                "considered": result.considered,
                "excluded": result.exclusions(),
                "profile": profile.to_dict() | {"layers": len(profile.layers)},
            }
        )
        return
    _render(profile, cluster, goal, result, top, notes)
    if output is not None:
        ui.console.print(ui.dim(f"plan written to {output}"))


# ----------------------------------------------------------------------------------------- parsing


def _count(option: str, text: str | None) -> float | None:
    if text is None:
        return None
    try:
        return parse_count(text)
    except ValueError as exc:
        raise BadInput(f"{option}: {exc}") from None


def parse_shape(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        shape = tuple(int(part) for part in text.replace("x", ",").split(",") if part.strip())
    except ValueError:
        shape = ()
    if not shape or min(shape) < 1:
        raise BadInput(f"--input-shape '{text}' is not a list of positive sizes like 3,224,224")
    return shape


def _duration(text: str) -> float:
    try:
        return parse_duration(text, bare_unit_s=3600)  # a bare number is hours
    except ValueError as exc:
        raise BadInput(f"--deadline {exc}") from None


def _constraints(precision, optimizer, sharding, tensor, pipeline, micro_batch, accumulation, checkpointing):
    """The strategy parts the user fixed, each checked against what the planner knows."""
    from redline.plan.model_states import OPTIMIZERS, PRECISIONS, SHARDINGS
    from redline.plan.search import Constraints
    from redline.plan.strategy import CHECKPOINTING

    for option, value, known in (
        ("--precision", precision, PRECISIONS),
        ("--optimizer", optimizer, OPTIMIZERS),
        ("--sharding", sharding, SHARDINGS),
        ("--checkpointing", checkpointing, CHECKPOINTING),
    ):
        if value is not None and value not in known:
            raise BadInput(f"{option} '{value}' is not one of {', '.join(known)}")
    for option, value in (
        ("--tp", tensor),
        ("--pp", pipeline),
        ("--micro-batch", micro_batch),
        ("--accumulation", accumulation),
    ):
        if value is not None and value < 1:
            raise BadInput(f"{option} must be at least 1, not {value}")
    return Constraints(
        precision=precision,
        optimizer=optimizer,
        sharding=sharding,
        tensor=tensor,
        pipeline=pipeline,
        micro_batch=micro_batch,
        accumulation=accumulation,
        checkpointing=checkpointing,
    )


def _checkpoint_every(constraints, every: int | None):
    """``--ac-every K``: the plans checkpoint every K-th block (the search tries 1, 2 and 4 otherwise)."""
    import dataclasses

    if every is None:
        return constraints
    if every < 1:
        raise BadInput(f"--ac-every must be at least 1, not {every}")
    if every > 1 and constraints.checkpointing == "none":
        raise BadInput("--ac-every checkpoints some blocks: it goes with --checkpointing selective or full")
    return dataclasses.replace(constraints, checkpoint_every=every)


def _layout(constraints, sequence_parallel: bool, flash_attention: bool, schedule, virtual_stages, memory_margin):
    """The constraints with the user's layout switches, pipeline schedule and memory margin, each checked; plans
    within ``TIME_TOLERANCE`` of the fastest rank by memory headroom."""
    import dataclasses

    from redline.plan.search import TIME_TOLERANCE
    from redline.plan.strategy import SCHEDULES

    if schedule is not None and schedule not in SCHEDULES:
        raise BadInput(f"--schedule '{schedule}' is not one of {', '.join(SCHEDULES)}")
    if virtual_stages is not None:
        if schedule != "interleaved":
            raise BadInput("--virtual-stages goes with --schedule interleaved")
        if virtual_stages < 2:
            raise BadInput(f"--virtual-stages must be at least 2, not {virtual_stages}")
    if not 0 <= memory_margin < 1:
        raise BadInput(f"--memory-margin must be a fraction from 0 to below 1 (0.05 = 5%), not {memory_margin}")
    return dataclasses.replace(
        constraints,
        sequence_parallel=sequence_parallel,
        flash_attention=flash_attention,
        schedule=schedule,
        virtual_stages=virtual_stages,
        memory_margin=memory_margin,
        time_tolerance=TIME_TOLERANCE,
    )


def _check_calibration(calibrate: bool, model, cluster, micro_batch: int | None) -> None:
    """What --calibrate needs, checked before any planning: PyTorch, a model it can run, this machine."""
    if not calibrate:
        if micro_batch is not None:
            raise BadInput("--calibrate-micro-batch goes with --calibrate")
        return
    from redline import capability

    capability.require_torch("--calibrate (it times real training steps)")
    if model is None:
        raise BadInput("--calibrate runs the model: give it as --model (a config.json, a factory, resnet50, vit-b-16)")
    if cluster.name != "local":
        raise BadInput("--calibrate measures this machine: plan with --hardware local")
    if micro_batch is not None and micro_batch < 1:
        raise BadInput(f"--calibrate-micro-batch must be at least 1, not {micro_batch}")


def _calibrated(profile, cluster, model, constraints, micro_batch):
    """The profile corrected by real steps on this machine's first device, and the constraints pinned to the
    precision it was measured in (a calibration holds for that precision only)."""
    import dataclasses

    from redline.plan.calibrate import calibrate, line_sizes, measure
    from redline.workload.load import model_builder

    sizes = line_sizes(micro_batch)
    cuda = cluster.gpu is not None
    precision = constraints.precision or ("bf16" if cuda else "fp32")
    build = model_builder(model, profile.input_shape)  # run it on the inputs it was traced with
    floor = "" if sizes[0] == 1 else " (and 1, for the floor)"
    ui.warn(f"calibrating: timing steps of {profile.name} at micro-batch {sizes[0]} and {sizes[1]}{floor} ...")
    try:
        measured = measure(
            build.build,
            build.input_shape,
            micro_batch,
            device="cuda:0" if cuda else "cpu",
            precision=precision,
            name=profile.name,
        )
    except (RuntimeError, ValueError) as exc:  # out of memory, a kernel the device lacks: the model's error
        raise BadInput(f"calibration steps failed: {str(exc).splitlines()[0]}") from None
    profile = calibrate(profile, cluster, precision, measured)
    fitted = profile.calibration
    scale, offset = fitted.compute
    memory = fitted.memory
    note = (
        f"calibrated on {fitted.device} ({precision}, micro-batches {fitted.micro_batches[0]} and "
        f"{fitted.micro_batches[1]}): compute x{scale:.2f} {'+' if offset >= 0 else '-'} "
        f"{fmt_duration(abs(offset))} per micro-batch, optimizer x{fitted.optimizer_scale:.2f}"
        + (
            f", activations x{memory[0]:.2f} {'+' if memory[1] >= 0 else '-'} {fmt_bytes(abs(memory[1]))}"
            if memory
            else ", memory not measured on a CPU"
        )
        + (f"; no micro-batch under {fmt_duration(fitted.measured_floor_s)}" if fitted.measured_floor_s else "")
    )
    notes = [note]
    if fitted.launch_bound:
        notes.append(
            f"micro-batch {fitted.micro_batches[0]} ran close to the floor (the device waited for Python to launch "
            "kernels), so the fitted line is uncertain: calibrate at a larger --calibrate-micro-batch"
        )
    profile = dataclasses.replace(profile, notes=(*profile.notes, *notes))
    return profile, dataclasses.replace(constraints, precision=precision)


def _cluster(hardware: str, nodes: int, network_gbps: float | None):
    from redline.plan.hardware import parse_hardware, this_machine

    cluster = this_machine() if hardware.strip().lower() == "local" else parse_hardware(hardware)
    if network_gbps is not None:
        cluster = cluster.with_network(network_gbps)
    return cluster.with_nodes(nodes)


# ----------------------------------------------------------------------------------------- output


def _list_models(names, json_output: bool) -> None:
    from redline.workload.presets import TRANSFORMER_PRESETS
    from redline.workload.transformer import count_params

    rows = []
    for name in names:
        shape = TRANSFORMER_PRESETS.get(name)
        rows.append(
            {
                "name": name,
                "params": count_params(shape) if shape else None,
                "kind": "transformer (analytic)" if shape else "traced from redline.workload.zoo",
                "seq_len": shape.seq_len if shape else None,
            }
        )
    if json_output:
        ui.print_json(rows)
        return
    table = Table(box=box.SIMPLE_HEAD, show_edge=False)
    for column in ("preset", "params", "sequence", "profile"):
        table.add_column(column)
    for row in rows:
        table.add_row(
            row["name"],
            fmt_count(row["params"]) if row["params"] else "traced",
            str(row["seq_len"] or "image"),
            row["kind"],
        )
    ui.console.print(table)


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value:.0%}"


def _money(value: float | None) -> str:
    return "—" if value is None else f"${value:,.0f}"


def _render(profile, cluster, goal, result, top: int, notes: list[str]) -> None:
    from redline.plan.estimate import mfu_peak

    console = ui.console
    per_step = goal.global_batch * profile.tokens_per_sample
    console.print(
        f"model     {profile.name} ({profile.method}, {profile.source}): {fmt_count(profile.params_total)} params, "
        f"{fmt_count(profile.training_flops_per_sample)} training FLOPs per {profile.sample_unit}"
    )
    precision = result.ranked[0].strategy.precision
    ceiling = cluster.matmul[precision]
    console.print(
        f"hardware  {cluster.gpus} x {cluster.device} ({cluster.nodes} node{'s' if cluster.nodes > 1 else ''}, "
        f"{fmt_bytes(cluster.memory_bytes)} each)"
    )
    console.print(
        f"ceilings  {precision} matmul {ceiling.value / 1e12:.4g} TFLOP/s ({ceiling.source}); "
        f"memory {cluster.memory_bandwidth.value / 1e9:.4g} GB/s ({cluster.memory_bandwidth.source}); "
        f"GPU-GPU {cluster.intra.busbw_bytes_per_s / 1e9:.4g} GB/s ({cluster.intra.source})"
    )
    goal_text = f"global batch {goal.global_batch}"
    if profile.sample_unit == "sequence":
        goal_text += f" x {profile.tokens_per_sample} tokens = {fmt_count(per_step)} tokens per step"
    if goal.tokens:
        goal_text += f"; {fmt_count(goal.tokens)} tokens in all"
    elif goal.samples:
        goal_text += f"; {fmt_count(goal.samples)} samples in all"
    console.print(f"goal      {goal_text}")
    if not mfu_peak(cluster, precision):
        console.print(ui.dim("(no datasheet peak for this device: MFU is not shown)"))

    table = Table(
        box=box.SIMPLE_HEAD, show_edge=False, title=f"best of {len(result.ranked)} that fit", title_justify="left"
    )
    for column, justify in (
        ("#", "right"),
        ("strategy", "left"),
        ("memory/GPU", "right"),
        ("step", "right"),
        ("tokens/s" if profile.sample_unit == "sequence" else "samples/s", "right"),
        ("MFU", "right"),
        ("time to train", "right"),
        ("cost", "right"),
    ):
        table.add_column(column, justify=justify)
    for index, e in enumerate(result.ranked[:top], 1):
        rate = e.tokens_per_s if profile.sample_unit == "sequence" else e.samples_per_s
        table.add_row(
            str(index),
            e.strategy.label(),
            fmt_bytes(e.memory.device_total),
            fmt_duration(e.time.total),
            fmt_count(rate),
            _pct(e.mfu),
            fmt_duration(e.time_to_train_s) if e.time_to_train_s else "—",
            _money(e.cost_usd),
        )
    console.print(table)
    _breakdown(result.ranked[0], cluster)
    excluded = ", ".join(f"{r['count']} {r['reason']}" for r in result.exclusions())
    if excluded:
        console.print(f"excluded  {excluded}")
        if result.closest_misfit is not None:
            miss = result.closest_misfit
            console.print(
                ui.dim(
                    f"          nearest miss: {miss.strategy.label()} needs {fmt_bytes(miss.memory.device_total)} "
                    f"of {fmt_bytes(cluster.memory_bytes)}"
                )
            )
    for note in notes:
        console.print(ui.dim(f"note: {note}"))


def _breakdown(best, cluster) -> None:
    memory, time = best.memory, best.time
    parts = [
        ("weights", memory.weights),
        ("gradients", memory.grads),
        ("optimizer", memory.optimizer),
        ("compute copies", memory.weight_copies),
        ("activations", memory.activations),
        ("backward working set", memory.temporary),
        ("embedding table grads", memory.table_grads),
        ("comm buffers", memory.comm_buffers),
        ("cuBLAS workspaces", memory.workspaces),
        ("allocator margin", memory.fragmentation),
        ("CUDA context + NCCL", memory.cuda_context + memory.nccl),
    ]
    ui.console.print(
        f"memory of #1: {fmt_bytes(memory.device_total)} of {fmt_bytes(cluster.memory_bytes)} "
        f"(torch max_memory_allocated ~ {fmt_bytes(memory.allocated)})"
    )
    width = 30
    for name, value in parts:
        if value <= 0:
            continue
        bar = "█" * max(1, round(width * value / memory.device_total))
        ui.console.print(f"  {name:>22} {fmt_bytes(value):>10}  {bar}")
    steps = [
        ("compute", time.compute),
        ("pipeline bubble", time.bubble),
        ("data-parallel comm", time.data_parallel_comm),
        ("tensor-parallel comm", time.tensor_parallel_comm),
        ("pipeline comm", time.pipeline_comm),
        ("optimizer step", time.optimizer),
    ]
    ui.console.print(f"step time of #1: {fmt_duration(time.total)} (exposed parts)")
    for name, value in steps:
        if value <= 0:
            continue
        bar = "█" * max(1, round(width * value / time.total))
        ui.console.print(f"  {name:>22} {fmt_duration(value):>10}  {bar}")


def _cloud(
    profile, constraints, global_batch, tokens, samples, rank_by, top, max_nodes, providers, deadline, json_output
):
    from redline.plan import cloud as cloud_plan
    from redline.plan.estimate import Goal
    from redline.plan.search import default_global_batch
    from redline.specs.instances import instance_catalog

    known = sorted({i.provider for i in instance_catalog()})
    unknown = [p for p in providers if p not in known]
    if unknown:
        raise BadInput(f"--provider {unknown[0]} is not in the catalog; known: {', '.join(known)}")
    deadline_s = _duration(deadline) if deadline else None
    batch = global_batch if global_batch is not None else default_global_batch(profile)
    goal = Goal(batch, tokens=tokens, samples=samples)
    options = cloud_plan.cloud_options(profile, goal, constraints, max_nodes=max_nodes, providers=tuple(providers))
    if not options:
        raise BadInput(f"{profile.name} fits on no catalog instance with up to {max_nodes} nodes; raise --max-nodes")
    ranked = cloud_plan.rank(options, rank_by, deadline_s)
    if not ranked:
        fastest = min(options, key=lambda o: o.time_s)
        raise BadInput(
            f"no option finishes within {deadline}: the fastest is {fastest.nodes} x {fastest.instance} "
            f"in {fmt_duration(fastest.time_s)}; raise --max-nodes or the deadline"
        )
    if json_output:
        ui.print_json({"global_batch": batch, "ranked": [o.to_dict() for o in ranked[:top]], "options": len(options)})
        return
    title = f"{len(options)} instance/node options where {profile.name} fits, by {rank_by}"
    if deadline_s:
        title += f", finishing within {deadline}"
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, title=title, title_justify="left")
    for column in ("#", "provider", "instance", "nodes", "GPUs", "$/h", "strategy", "MFU", "time", "cost"):
        table.add_column(column, justify="left" if column in ("provider", "instance", "strategy") else "right")
    for index, o in enumerate(ranked[:top], 1):
        table.add_row(
            str(index),
            o.provider,
            o.instance,
            str(o.nodes),
            str(o.gpus),
            f"{o.price_usd_per_hour:,.2f}" + ("" if o.price_verified else "*"),
            o.best.strategy.label(),
            _pct(o.best.mfu),
            fmt_duration(o.time_s),
            _money(o.cost_usd),
        )
    ui.console.print(table)
    if not all(o.price_verified for o in ranked[:top]):
        ui.console.print(ui.dim("* the catalog flags this price as unverified: check it with the provider"))
    dates = sorted({o.price_date for o in options})
    ui.console.print(
        ui.dim(
            f"on-demand prices as of {', '.join(dates)}; global batch {batch}; `redline catalog instances` for sources"
        )
    )
