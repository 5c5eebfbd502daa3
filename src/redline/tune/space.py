"""What ``redline tune`` may change, and to which values on this machine.

A candidate is one value per knob. Each knob is a setting the runtime already has: a field of the plan's
strategy (micro-batch, precision, checkpointing) or a runtime setting (``runtime.config.SETTINGS``: compile,
DataLoader workers, CPU threads, DDP buckets and compression). ``None`` leaves a setting where the script and
the runtime's defaults put it: the baseline is the all-``None`` candidate at the user's batch, which is what
``redline run`` without a plan does.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from redline.errors import BadInput

# the knobs in the order the search visits them (after the micro-batch): those with the largest effect first
ORDER = ("precision", "compile", "checkpointing", "num_workers", "cpu_threads", "comm_hook", "ddp_bucket_cap_mb")
STRATEGY_KNOBS = ("precision", "checkpointing")  # fields of the plan's strategy; the others are runtime settings
# knobs whose values change what the step computes, not only how fast: a winner with one of them off its
# baseline value must train as the baseline does (loss parity)
NUMERICS_KNOBS = ("precision", "comm_hook")


@dataclass(frozen=True)
class Machine:
    """What the space depends on: the device kind, the CPUs each rank has, and the ranks."""

    cuda: bool
    bf16: bool  # the GPU has bf16; a CPU does unless its saved bench figures measured bf16 slower than fp32
    cpus_per_rank: int
    ranks: int
    fp8: bool = False  # every GPU has fp8 units (compute capability 8.9 or later) and torchao is installed

    @classmethod
    def here(cls, ranks: int) -> Machine:
        import torch

        from redline.capability import is_available
        from redline.hw.host import usable_cpus

        cuda = torch.cuda.is_available()
        capabilities = [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]
        return cls(
            cuda=cuda,
            bf16=torch.cuda.is_bf16_supported() if cuda else not _bf16_slower_on_this_cpu(),
            cpus_per_rank=max(1, usable_cpus() // ranks),
            ranks=ranks,
            fp8=bool(capabilities) and min(capabilities) >= (8, 9) and is_available("torchao"),
        )


def _bf16_slower_on_this_cpu() -> bool:
    """Whether this machine's saved ``redline bench compute`` figures measured bf16 matmuls slower than fp32's: a
    CPU without bf16 units (no AVX512-BF16, no AMX) emulates them 20 to 250 times slower, so a bf16 trial would
    only run out its time limit. Nothing saved: not known, and the trial decides."""
    from redline.bench import store

    saved = store.latest_here()
    rates = {m.name: m.value for m in saved.measurements if m.suite == "compute" and m.device == "cpu"} if saved else {}
    return "matmul_bf16" in rates and "matmul_fp32" in rates and rates["matmul_bf16"] < rates["matmul_fp32"]


@dataclass(frozen=True)
class Candidate:
    """One way to run the script: the per-rank batch split into ``micro_batch`` x accumulation, and a value per
    knob (``None``: as the script and the runtime's defaults have it)."""

    micro_batch: int
    knobs: tuple[tuple[str, Any], ...] = field(default=())

    def get(self, knob: str) -> Any:
        return dict(self.knobs).get(knob)

    def with_value(self, knob: str, value: Any) -> Candidate:
        values = dict(self.knobs) | {knob: value}
        return Candidate(self.micro_batch, tuple(sorted((k, v) for k, v in values.items() if v is not None)))

    def with_micro_batch(self, micro_batch: int) -> Candidate:
        return Candidate(micro_batch, self.knobs)

    def key(self) -> str:
        """A stable name: the journal's key and the table's label."""
        return " ".join([f"mb={self.micro_batch}", *(f"{k}={_text(v)}" for k, v in self.knobs)])

    def changes_numerics(self, baseline: Candidate) -> bool:
        return any(self.get(knob) != baseline.get(knob) for knob in NUMERICS_KNOBS)

    def to_dict(self) -> dict[str, Any]:
        return {"micro_batch": self.micro_batch, **dict(self.knobs)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Candidate:
        data = dict(data)
        micro_batch = int(data.pop("micro_batch"))
        return cls(micro_batch, tuple(sorted((k, v) for k, v in data.items() if v is not None)))


def _text(value: Any) -> str:
    return {True: "on", False: "off"}.get(value, str(value)) if isinstance(value, bool) else str(value)


def default_space(machine: Machine) -> dict[str, list[Any]]:
    """The values each knob takes on ``machine``, the runtime's own choice (``None``) first.

    On a CPU the precision is fp32 or bf16 autocast (fp32 alone where bench measured bf16 slower: emulated) and
    the operators' threads matter; on a GPU bf16 or fp16 (bf16 where the GPU has it), fp8 where every GPU has it
    and torchao is installed, and activation checkpointing, which buys a larger micro-batch. DataLoader
    workers go up to the rank's CPUs less the one its loop runs on. DDP's buckets and compression only where
    there are ranks to all-reduce over."""
    space: dict[str, list[Any]] = {"compile": [None, True]}
    if machine.cuda:
        space["precision"] = ([None, "fp16"] if machine.bf16 else [None]) + (["fp8"] if machine.fp8 else [])
        space["checkpointing"] = [None, "selective", "full"]
    else:
        space["precision"] = [None, "bf16"] if machine.bf16 else [None]
        threads = sorted({machine.cpus_per_rank, max(1, machine.cpus_per_rank // 2), 1}, reverse=True)
        space["cpu_threads"] = [None, *threads]
    spare = machine.cpus_per_rank - 1
    space["num_workers"] = [None, *sorted({w for w in (0, 1, 2, 4, 8) if w <= spare})]
    if machine.ranks > 1:
        space["comm_hook"] = [None, "bf16"]
        space["ddp_bucket_cap_mb"] = [None, 100]
    return {knob: space[knob] for knob in ORDER if knob in space}


def restrict(space: dict[str, list[Any]], given: Iterable[str]) -> dict[str, list[Any]]:
    """``space`` with ``--space KNOB=V1,V2`` options applied: those knobs take only those values (plus the
    baseline's, which every comparison needs); ``KNOB=`` leaves a knob out. BadInput for an unknown knob or a
    value it cannot take."""
    out = dict(space)
    for item in given:
        name, sep, values = item.partition("=")
        name = name.strip()
        if not sep or name not in ORDER:
            raise BadInput(f"--space takes KNOB=V1,V2 with KNOB one of {', '.join(ORDER)}; not {item!r}")
        if not values.strip():
            out.pop(name, None)
            continue
        out[name] = [None, *(_parse(name, value.strip()) for value in values.split(","))]
    return {knob: out[knob] for knob in ORDER if knob in out}


def _parse(knob: str, value: str) -> Any:
    """A value of ``knob`` as typed, checked against what the runtime takes."""
    if knob == "compile":
        if value not in ("on", "off"):
            raise BadInput(f"--space compile takes on,off; not {value!r}")
        return value == "on"
    if knob in ("num_workers", "cpu_threads", "ddp_bucket_cap_mb"):
        lowest = 0 if knob == "num_workers" else 1
        if not value.isdigit() or int(value) < lowest:
            raise BadInput(f"--space {knob} takes whole numbers from {lowest}; not {value!r}")
        if knob != "ddp_bucket_cap_mb":  # processes or threads: no more than this host runs
            from redline.runtime.config import check_settings

            check_settings({knob: int(value)}, where=f"--space {knob}")
        return int(value)
    choices = {
        "precision": ("fp32", "bf16", "fp16", "fp8"),
        "checkpointing": ("none", "selective", "full"),
        "comm_hook": ("none", "fp16", "bf16", "powersgd"),
    }[knob]
    if value not in choices:
        raise BadInput(f"--space {knob} takes {', '.join(choices)}; not {value!r}")
    return value


def micro_batches(per_rank_batch: int) -> list[int]:
    """The micro-batches that split the per-rank batch evenly, largest first."""
    return [m for m in range(per_rank_batch, 0, -1) if per_rank_batch % m == 0]


def trial_plan(candidate: Candidate, *, base: dict[str, Any], per_rank_batch: int, ranks: int) -> dict[str, Any]:
    """The plan file (as a mapping) that runs ``candidate``: the base plan's (or the runtime's defaults for this
    machine), its strategy's micro-batch and accumulation and the candidate's strategy knobs, and the runtime
    settings of its other knobs over the base plan's ``runtime:`` section."""
    from redline.runtime.config import setting  # checked again when the trial's `redline run` loads the plan

    plan = dict(base)
    strategy = dict(plan["strategy"])
    strategy |= {"micro_batch": candidate.micro_batch, "accumulation": per_rank_batch // candidate.micro_batch}
    strategy |= {knob: candidate.get(knob) for knob in STRATEGY_KNOBS if candidate.get(knob) is not None}
    plan["strategy"] = strategy
    runtime = {section: dict(values) for section, values in (plan.get("runtime") or {}).items()}
    for knob, value in candidate.knobs:
        if knob in STRATEGY_KNOBS:
            continue
        section, name = setting(knob).path.split(".")
        runtime.setdefault(section, {})[name] = value
    plan["runtime"] = runtime
    if strategy.get("data", ranks) * strategy.get("tensor", 1) * strategy.get("pipeline", 1) != ranks:
        raise BadInput(f"the base plan is laid out for other than {ranks} ranks: tune with its --nproc-per-node")
    return plan


def default_plan(machine: Machine, per_rank_batch: int) -> dict[str, Any]:
    """A plan file for the runtime's defaults on this machine (``runtime.config.default_config``), where the
    user gave none: what ``redline run`` without a plan applies, spelled out so a candidate can change it."""
    from redline.plan.planfile import PLAN_MARKER, PLAN_SCHEMA_VERSION
    from redline.runtime.config import default_config

    config = default_config(machine.ranks, per_rank_batch, cuda=machine.cuda, bf16=machine.bf16)
    return {
        PLAN_MARKER: PLAN_SCHEMA_VERSION,
        "model": {},
        # what the plan runs on: a CPU plan is one `redline submit --plan` queues asking no GPU
        "hardware": {"accelerator": "cuda" if machine.cuda else "cpu"},
        "goal": {"global_batch": per_rank_batch * machine.ranks},
        "strategy": config.strategy.to_dict(),
        "runtime": {},
        "predicted": {},
        "notes": ["written by redline tune"],
    }
