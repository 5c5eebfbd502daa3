"""What the runtime applies: the plan's strategy plus the settings only a running job needs, one tree.

``RunConfig`` holds one section per component, each a frozen dataclass with a docstring per field and its
checks in ``__post_init__`` (torchtitan's per-component configs): ``numerics``, ``ddp``, ``data``,
``checkpoint``, ``metrics``, ``loop``, beside the plan file's ``strategy`` (the same ``Strategy`` the planner
ranks) and ``plan``, the facts the planner worked out. The settings come from, each over the one before: the
defaults below, the plan file's ``runtime:`` section, ``prepare()``'s keywords, and ``redline run``'s options
(``$REDLINE_RUNTIME``: the command line has the last word).

``SETTINGS`` is the one table of the settings a user sets by name: a setting's place in the tree, its keyword
(``prepare(checkpoint_dir=...)`` and ``$REDLINE_RUNTIME``'s keys), and its option on the command line where it
has one, which ``redline run`` and ``redline plan`` both take from here.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from redline.capability import is_available
from redline.env import REDLINE_RUNTIME
from redline.errors import BadInput
from redline.files import refuse_non_folder, refuse_non_regular
from redline.plan.strategy import Strategy

if TYPE_CHECKING:
    import torch

log = logging.getLogger("redline.runtime")

COMM_HOOKS: tuple[str, ...] = ("none", "fp16", "bf16", "powersgd")
SCHEDULER_INTERVALS: tuple[str, ...] = ("step", "epoch")
LOADER_BATCHES: tuple[str, ...] = ("per_rank", "global")


@dataclass(frozen=True)
class NumericsConfig:
    tf32: bool = True
    """TF32 matmuls and convolutions on Ampere and newer (fp32 plans run on TF32 tensor cores)."""
    cudnn_benchmark: bool = True
    """Pick the fastest convolution algorithm per input shape."""
    compile: bool = False
    """``torch.compile`` each repeated block (the whole model when it has none)."""
    grad_clip_norm: float | None = None
    """Clip the global gradient norm to this before each optimizer step; None: no clipping."""
    cpu_threads: int | None = None
    """Threads of each rank's CPU operators (``torch.set_num_threads``); None keeps PyTorch's choice."""

    def __post_init__(self) -> None:
        if self.grad_clip_norm is not None and not self.grad_clip_norm > 0:
            raise BadInput(f"grad_clip_norm must be positive, not {self.grad_clip_norm}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise BadInput(f"cpu_threads must be 1 or more, not {self.cpu_threads}")
        if self.cpu_threads is not None:
            from redline.hw.limits import check_count, thread_cap

            check_count("cpu_threads", self.cpu_threads, "CPU threads per rank", thread_cap())


@dataclass(frozen=True)
class LoopConfig:
    max_steps: int | None = None
    """End the run after this many optimizer steps, counted from its start (a resumed run counts the steps
    before it), as if the data had run out: a short trial (``redline tune``) or a smoke test. None: the epochs
    decide."""
    scheduler_interval: str = "step"
    """When the LR scheduler given to ``prepare()`` steps: after each optimizer ``step``, or at the end of each
    ``epoch`` (StepLR over epochs, as PyTorch's examples use it)."""

    wait_for_ranks_s: float = 600.0
    """Under sharding, how long a rank that evaluates, or asks for the whole model, waits for the other ranks
    to do the same before it ends the run saying which did not (a rank-0-only evaluation would hang): as long
    as NCCL's own default timeout, so that a rank busy with work of its own first (an upload, a long log) is
    not taken for one that went elsewhere."""

    def __post_init__(self) -> None:
        if not self.wait_for_ranks_s > 0:
            raise BadInput(f"wait_for_ranks_s must be positive, not {self.wait_for_ranks_s}")
        if self.max_steps is not None and self.max_steps < 1:
            raise BadInput(f"max_steps must be 1 or more, not {self.max_steps}")
        if self.scheduler_interval not in SCHEDULER_INTERVALS:
            raise BadInput(
                f"scheduler_interval must be one of {', '.join(SCHEDULER_INTERVALS)}, not {self.scheduler_interval!r}"
            )


@dataclass(frozen=True)
class DdpConfig:
    bucket_cap_mb: int = 25
    """DistributedDataParallel's gradient bucket size, MB."""
    static_graph: bool = False
    """DDP's ``static_graph``: the same parameters take part in every step."""
    comm_hook: str = "none"
    """Compress DDP's all-reduce: none, fp16, bf16, or powersgd (for slow inter-node links)."""
    powersgd_rank: int = 4
    """PowerSGD's matrix approximation rank (``comm_hook="powersgd"``)."""
    sync_batchnorm: bool = True
    """On several ranks, BatchNorm normalises over the global batch (SyncBatchNorm), as one process would."""

    def __post_init__(self) -> None:
        if self.comm_hook not in COMM_HOOKS:
            raise BadInput(f"comm_hook '{self.comm_hook}' is not one of {', '.join(COMM_HOOKS)}")


@dataclass(frozen=True)
class DataConfig:
    num_workers: int | None = None
    """DataLoader worker processes; None keeps the user's loader's."""
    pin_memory: bool | None = None
    """DataLoader ``pin_memory``; None keeps the user's loader's."""
    persistent_workers: bool | None = None
    """DataLoader ``persistent_workers``; None keeps the user's loader's."""
    prefetch_factor: int | None = None
    """Batches each worker loads ahead; None keeps the user's loader's."""
    loader_stall_s: float = 300.0
    """A loader with workers and no timeout of its own that gives no batch for this long ends the run, naming
    the worker that owes the batch; 0: wait forever."""
    shard_stream: bool = True
    """An IterableDataset is shared over ranks and workers; False: it shards itself."""
    seed: int | None = None
    """Seeds the loader's order and its workers' seeds where neither the loader nor its sampler has a generator
    of its own (whose seed wins); None: drawn from the process's seed (``torch.manual_seed``), as a plain
    DataLoader draws it. Every rank takes rank 0's, and a resumed run its checkpoint's. It seeds nothing else:
    the user seeds their own model."""
    loader_batch: str = "per_rank"
    """What the DataLoader's batch is: ``per_rank``, each rank's (DDP's, Accelerate's, Lightning's convention: N
    ranks train on N of them per optimizer step), or ``global``, one optimizer step's over all the ranks, shared
    out among them. A batch sampler's batches likewise: each one rank's, or each one split over the ranks. A
    plan's batch replaces it (said before the first step)."""
    adapt_workers: bool = True
    """When the steps of an epoch wait for batches more than ``data_wait_limit`` of their time, the next
    epoch loads with more DataLoader workers (none to two, then twice as many, up to this rank's share of the
    CPUs), then with a deeper prefetch; said in the log, and in the step metrics (``data_workers``). With
    ``num_workers`` set, or False, or a stream: the run says so and changes nothing."""
    data_wait_limit: float = 0.2
    """The share of an epoch's time its steps spent waiting for their batches above which the loading is too
    slow."""

    def __post_init__(self) -> None:
        if self.loader_batch not in LOADER_BATCHES:
            raise BadInput(f"loader_batch must be one of {', '.join(LOADER_BATCHES)}, not {self.loader_batch!r}")
        if not 0 < self.data_wait_limit < 1:
            raise BadInput(f"data_wait_limit is a share of the time, between 0 and 1, not {self.data_wait_limit}")
        if self.loader_stall_s < 0:
            raise BadInput(f"loader_stall_s must be 0 (no limit) or more, not {self.loader_stall_s}")
        if self.num_workers is not None and self.num_workers < 0:
            raise BadInput(f"num_workers must be 0 or more, not {self.num_workers}")
        if self.num_workers is not None:  # each a process: hundreds on a few cores take the machine down
            from redline.hw.limits import check_count, worker_cap

            check_count("num_workers", self.num_workers, "DataLoader workers per rank", worker_cap())


@dataclass(frozen=True)
class CheckpointConfig:
    dir: str | None = None
    """Where checkpoints go (and a run resumes from); None: no checkpoints."""
    every: int = 0
    """Optimizer steps between checkpoints; 0: only at the end."""

    def __post_init__(self) -> None:
        if self.every < 0:
            raise BadInput(f"checkpoint_every must be 0 or more, not {self.every}")
        if self.dir is not None and not self.dir.strip():
            raise BadInput("checkpoint_dir is empty: give a directory, or none for no checkpoints")
        if self.dir is not None:
            refuse_non_folder(self.dir, "checkpoint_dir")


@dataclass(frozen=True)
class MetricsConfig:
    path: str | None = None
    """Step metrics as JSON lines, one per optimizer step; ``{rank}`` in it: one file per rank. None: none."""
    interval_s: float = 10.0
    """Seconds between the step lines printed to stderr."""

    def __post_init__(self) -> None:
        if self.path is not None and not self.path.strip():
            raise BadInput("metrics_path is empty: give a file, or none for no step metrics")
        if self.path is not None and "{rank}" not in self.path:  # each rank's own file is checked as it opens
            refuse_non_regular(self.path, "metrics_path")


@dataclass(frozen=True)
class PlanFacts:
    """What the planner worked out, from the plan file: the prediction and the model's size, for the metrics
    and for the checks that the plan suits this run."""

    predicted: dict[str, Any] | None = None
    """Memory, step time and throughput the planner predicted; the run's summary compares with it."""
    training_flops_per_sample: float | None = None
    """The model's training FLOPs per sample, for MFU."""
    tokens_per_sample: int | None = None
    """Tokens per sample (the sequence length); None: read from the first batch (1 when it has no tokens)."""
    device: str | None = None
    """The device the plan was made for ("NVIDIA H100 SXM5 80GB", "cpu")."""
    params: int | None = None
    """The model's parameters as the planner counted them."""
    stage_blocks: tuple[int, ...] | None = None
    """The repeated blocks each pipeline rank holds, first to last: where the runtime cuts the model."""
    load: dict[str, Any] | None = None
    """How the planner loaded the model (the plan file's ``model.load``): the re-plan command a refusal gives."""
    anyway: bool = False
    """Run the plan where it was made for another device or another model (``redline run --plan-anyway``,
    ``prepare(plan_anyway=True)``): said, not refused (``plan_fit.py``)."""


@dataclass(frozen=True)
class RunConfig:
    strategy: Strategy = field(default_factory=Strategy)
    """How the step is laid out: the plan file's ``strategy`` section."""
    numerics: NumericsConfig = field(default_factory=NumericsConfig)
    """TF32, cudnn, compile, clipping (``apply_numerics``, ``apply_compile``, the optimizer step)."""
    ddp: DdpConfig = field(default_factory=DdpConfig)
    """DistributedDataParallel and BatchNorm over the ranks (``apply_ddp``, ``apply_sync_batchnorm``)."""
    data: DataConfig = field(default_factory=DataConfig)
    """The user's DataLoader over the ranks (``feed.py``, ``data.py``)."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Where and how often to checkpoint (``checkpoint.py``)."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """Step metrics (``metrics.py``)."""
    loop: LoopConfig = field(default_factory=LoopConfig)
    """When the loop ends (``Run.micro_batches``)."""
    plan: PlanFacts = field(default_factory=PlanFacts)
    """What the planner worked out; empty without a plan file."""

    @property
    def per_rank_batch(self) -> int:
        """Samples each rank loads per optimizer step: micro-batch x accumulation."""
        return self.strategy.micro_batch * self.strategy.accumulation

    def with_settings(self, settings: dict[str, Any]) -> RunConfig:
        """This config with ``settings`` ({keyword: value}, ``SETTINGS``' keywords) applied; a None value
        leaves a setting as it is. ``accumulation`` splits each rank's batch in that many micro-batches: the
        global batch stays the same."""
        by_section: dict[str, dict[str, Any]] = {}
        for keyword, value in settings.items():
            if value is None:
                continue
            section, name = setting(keyword).path.split(".")
            by_section.setdefault(section, {})[name] = value
        if not by_section:
            return self
        changes = {section: _replaced(getattr(self, section), values) for section, values in by_section.items()}
        if "strategy" in changes:
            changes["strategy"] = _split_batch(self.strategy, changes["strategy"])
        return dataclasses.replace(self, **changes)

    def runtime_section(self) -> dict[str, dict[str, Any]]:
        """The settings that differ from the defaults, by section: a plan file's ``runtime:`` section."""
        default = RunConfig()
        out: dict[str, dict[str, Any]] = {}
        for section in SECTIONS:
            mine, theirs = dataclasses.asdict(getattr(self, section)), dataclasses.asdict(getattr(default, section))
            changed = {name: value for name, value in mine.items() if value != theirs[name]}
            if changed:
                out[section] = changed
        return out


# the sections a plan file's `runtime:` holds (the strategy has its own section, the plan facts are its others)
SECTIONS: dict[str, type] = {
    "numerics": NumericsConfig,
    "ddp": DdpConfig,
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
    "metrics": MetricsConfig,
    "loop": LoopConfig,
}


@dataclass(frozen=True)
class Setting:
    """A setting a user sets by name: ``path`` (section.field of ``RunConfig``), ``keyword`` (``prepare()``'s
    and ``$REDLINE_RUNTIME``'s), and ``flag``, its option of ``redline run`` and ``redline plan`` (None: set in
    Python or the plan file only), with the option's ``help``."""

    path: str
    keyword: str
    flag: str | None = None
    help: str = ""

    @property
    def owner(self) -> type:
        """The dataclass the setting is a field of: a runtime section, the strategy, or the plan's facts."""
        section = self.path.split(".")[0]
        return {"strategy": Strategy, "plan": PlanFacts}.get(section) or SECTIONS[section]

    @property
    def type(self) -> Any:
        """The field's type, read off the section's dataclass (``int | None``, ``bool``, ``str | None``...)."""
        return typing.get_type_hints(self.owner)[self.path.split(".")[1]]


SETTINGS: tuple[Setting, ...] = (
    Setting("numerics.tf32", "tf32"),
    Setting("numerics.cudnn_benchmark", "cudnn_benchmark"),
    Setting("numerics.compile", "compile", "--compile", "torch.compile each repeated block of the model."),
    Setting("numerics.grad_clip_norm", "grad_clip_norm"),
    Setting("numerics.cpu_threads", "cpu_threads", "--cpu-threads", "Threads of each rank's CPU operators."),
    Setting(
        "strategy.checkpoint_every",
        "ac_every",
        "--ac-every",
        "Checkpoint activations in every K-th block only, as the plan says (full or selective; 1: each block).",
    ),
    Setting("ddp.bucket_cap_mb", "ddp_bucket_cap_mb"),
    Setting("ddp.static_graph", "ddp_static_graph"),
    Setting("ddp.comm_hook", "comm_hook", "--comm-hook", f"Compress DDP's all-reduce: {' | '.join(COMM_HOOKS)}."),
    Setting("ddp.powersgd_rank", "powersgd_rank"),
    Setting("ddp.sync_batchnorm", "sync_batchnorm"),
    Setting("data.num_workers", "num_workers", "--num-workers", "DataLoader workers (default: the loader's own)."),
    Setting("data.pin_memory", "pin_memory"),
    Setting("data.persistent_workers", "persistent_workers"),
    Setting("data.prefetch_factor", "prefetch_factor"),
    Setting("data.loader_stall_s", "loader_stall_s"),
    Setting("data.shard_stream", "shard_stream"),
    Setting("data.seed", "seed"),
    Setting(
        "data.loader_batch",
        "loader_batch",
        "--loader-batch",
        f"The DataLoader's batch is {' | '.join(LOADER_BATCHES)} (default per_rank, as under DDP).",
    ),
    Setting("data.adapt_workers", "adapt_workers"),
    Setting("data.data_wait_limit", "data_wait_limit"),
    Setting("checkpoint.dir", "checkpoint_dir", "--checkpoint-dir", "Checkpoint here, and resume from the newest."),
    Setting("checkpoint.every", "checkpoint_every", "--checkpoint-every", "Steps between checkpoints (0: at the end)."),
    Setting(
        "metrics.path",
        "metrics_path",
        "--metrics",
        "Step metrics as JSON lines ('{rank}': a file per rank), for `redline monitor --steps`.",
    ),
    Setting("metrics.interval_s", "metrics_interval_s"),
    Setting("loop.max_steps", "max_steps", "--max-steps", "End the run after this many optimizer steps."),
    Setting("loop.scheduler_interval", "scheduler_interval"),
    Setting("loop.wait_for_ranks_s", "wait_for_ranks_s"),
    Setting(
        "strategy.accumulation",
        "accumulation",
        "--accumulation",
        "Micro-batches per optimizer step (the global batch stays the same).",
    ),
    # `redline run --plan-anyway` is run's own option (a plan to make has nothing to force)
    Setting("plan.anyway", "plan_anyway"),
)


def setting(keyword: str) -> Setting:
    """The setting of ``keyword``; BadInput naming the known ones otherwise."""
    for candidate in SETTINGS:
        if candidate.keyword == keyword:
            return candidate
    raise BadInput(f"unknown runtime setting '{keyword}'; known: {', '.join(s.keyword for s in SETTINGS)}")


def check_settings(settings: dict[str, Any], where: str | None = None) -> None:
    """Each setting's value as its section checks it, alone (a command line's options, before anything
    runs): BadInput naming the option (or ``where``)."""
    for keyword, value in settings.items():
        known = setting(keyword)
        option = where or known.flag or keyword
        try:
            _replaced(known.owner(), {known.path.split(".")[1]: value}, where=option)
        except BadInput as exc:  # a section's own words, said of the option the user typed
            message = str(exc)
            raise BadInput(message if message.startswith(option) else f"{option}: {message}") from None


def check_runnable(strategy: Strategy, where: str = "the plan", device: torch.device | None = None) -> None:
    """What the runtime cannot apply here, refused in one line before training: by ``redline run`` before any
    rank starts (``device`` None: every GPU the launcher sees), and by ``prepare()`` on the rank's own
    ``device``. An fp8 plan needs a GPU with fp8 tensor cores and torchao, and no tensor parallelism
    (``runtime/fp8.py``)."""
    if strategy.precision != "fp8":
        return
    if not is_available("torch"):
        raise BadInput(f"{where}: fp8 training needs PyTorch and torchao: pip install torch torchao (the fp8 extra)")
    from redline.runtime.fp8 import unavailable

    reason = unavailable(strategy, device)
    if reason is not None:
        raise BadInput(f"{where}: {reason}")


def from_plan_file(path: str | Path) -> RunConfig:
    """A RunConfig from a plan file written by ``redline plan -o``: its strategy, its ``runtime:`` section (an
    older plan file has none: the defaults) and what the planner worked out."""
    from redline.plan.planfile import load_plan

    plan = load_plan(Path(path))
    model = plan.model
    tokens = model.get("tokens_per_sample")
    return RunConfig(
        strategy=plan.strategy,
        plan=PlanFacts(
            predicted=plan.predicted,
            training_flops_per_sample=model.get("training_flops_per_sample"),
            tokens_per_sample=int(tokens) if tokens else None,
            device=_planned_device(plan.hardware or {}),
            params=model.get("params"),
            stage_blocks=tuple(int(stage["blocks"]) for stage in plan.predicted.get("pipeline_stages", ())) or None,
            load=model.get("load"),
        ),
        **runtime_sections(plan.runtime, str(path)),
    )


def runtime_sections(runtime: dict[str, Any], where: str) -> dict[str, Any]:
    """The sections of a plan file's ``runtime:`` mapping, checked: an unknown section or field, or a value a
    section refuses, is one line naming the file."""
    sections = {}
    for name, values in runtime.items():
        if name not in SECTIONS:
            raise BadInput(f"{where}: unknown runtime section '{name}'; known: {', '.join(SECTIONS)}")
        if not isinstance(values, dict):
            raise BadInput(f"{where}: runtime section '{name}' must be a mapping of settings")
        sections[name] = _replaced(SECTIONS[name](), values, where=f"{where}: runtime.{name}")
    return sections


def runtime_from_env() -> dict[str, Any]:
    """The settings ``redline run`` gave this process's ``prepare()`` ({keyword: value}); none outside it."""
    text = os.environ.get(REDLINE_RUNTIME)
    if not text:
        return {}
    try:
        settings = json.loads(text)
    except json.JSONDecodeError:
        raise BadInput(f"${REDLINE_RUNTIME} is not JSON: {text[:80]!r}") from None
    if not isinstance(settings, dict):
        raise BadInput(f"${REDLINE_RUNTIME} must be a JSON object of settings, not {text[:80]!r}")
    return settings


def resolve_config(
    plan: str | Path | RunConfig | None,
    keywords: dict[str, Any],
    *,
    world: int,
    say: bool,
    batch_without_plan: Callable[[str], int],
) -> RunConfig:
    """What a run applies: the plan (a RunConfig, a plan file; None: defaults for ``world`` ranks on this
    machine, with the per-rank batch ``batch_without_plan(loader_batch)`` makes of the loader's), then
    ``prepare()``'s ``keywords``, then ``redline run``'s options over both. Where either splits a plan's
    per-rank batch otherwise than the plan did, said before the first step (``say``: rank 0)."""
    import torch

    options = runtime_from_env()
    if isinstance(plan, RunConfig):
        config = plan
    elif plan is not None:
        config = from_plan_file(plan)
    else:  # what the loader's batch is: the command line's word, else the keyword's, else the default
        setting = options.get("loader_batch") or keywords.get("loader_batch") or DataConfig.loader_batch
        bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        config = default_config(world, batch_without_plan(setting), cuda=torch.cuda.is_available(), bf16=bf16)
    resolved = config.with_settings(keywords).with_settings(options)
    was, now = config.strategy, resolved.strategy
    if plan is not None and say and now.accumulation != was.accumulation:
        log.warning(
            "%s splits the plan's per-rank batch of %d in %d micro-batch(es) of %d, not the plan's %d of %d",
            "--accumulation" if options.get("accumulation") else "prepare(accumulation=...)",
            resolved.per_rank_batch,
            now.accumulation,
            now.micro_batch,
            was.accumulation,
            was.micro_batch,
        )
    return resolved


def default_config(world_size: int, per_rank_batch: int, *, cuda: bool, bf16: bool) -> RunConfig:
    """Without a plan: plain data parallelism over the ranks there are, the user's batch as one micro-batch,
    bf16 autocast where the GPU has it, fp32 on a CPU."""
    precision = "bf16" if cuda and bf16 else ("fp16" if cuda else "fp32")
    return RunConfig(strategy=Strategy(data=world_size, micro_batch=per_rank_batch, precision=precision))


def _replaced(section: Any, values: dict[str, Any], where: str = "runtime setting") -> Any:
    """``section`` with ``values`` set; a strategy's ValueError and an unknown field become BadInput."""
    known = {f.name for f in dataclasses.fields(section)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise BadInput(f"{where}: unknown setting '{unknown[0]}'; known: {', '.join(sorted(known))}")
    try:
        return dataclasses.replace(section, **values)
    except (TypeError, ValueError) as exc:
        raise BadInput(f"{where}: {exc}") from None


def _split_batch(before: Strategy, after: Strategy) -> Strategy:
    """A new accumulation splits the same per-rank batch: the micro-batch follows (it must divide evenly)."""
    if after.accumulation == before.accumulation:
        return after
    per_rank = before.micro_batch * before.accumulation
    if per_rank % after.accumulation:
        raise BadInput(
            f"accumulation {after.accumulation} does not divide the per-rank batch of {per_rank} "
            f"(micro-batch {before.micro_batch} x accumulation {before.accumulation})"
        )
    return dataclasses.replace(after, micro_batch=per_rank // after.accumulation)


def _planned_device(hardware: dict[str, Any]) -> str | None:
    """The GPU's name a plan was made for, or "cpu" (a plan for ``--hardware local`` on a machine without one)."""
    if hardware.get("accelerator") == "cpu":
        return "cpu"
    return hardware.get("device")
