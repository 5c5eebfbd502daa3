"""The plan file: the contract between ``redline plan`` and the runtime.

It says how to run (strategy, degrees, precision, micro-batch, accumulation, checkpointing; and in its
optional ``runtime:`` section the runtime's settings by component, which ``redline.runtime.config`` reads and
checks) and what the planner expects (memory per component, step time per part, throughput), so a run can be
compared with its prediction. YAML, because people edit it; the first key is the marker that lets redline
overwrite a plan it wrote and nothing else.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from redline.errors import BadInput, one_line
from redline.files import read_user_file
from redline.plan.estimate import Estimate, Goal
from redline.plan.hardware import Cluster
from redline.plan.memory import stage_memory, stages
from redline.plan.strategy import Strategy
from redline.workload.profile import WorkloadProfile

PLAN_SCHEMA_VERSION = 1
PLAN_MARKER = "redline_plan"


@dataclass(frozen=True)
class Plan:
    strategy: Strategy
    model: dict[str, Any]  # name, source, method, params, tokens per sample
    hardware: dict[str, Any]  # cluster, and the ceilings the prediction used with their sources
    goal: dict[str, Any]  # global batch, tokens or samples
    predicted: dict[str, Any]  # memory, step time, throughput, MFU, time to train, cost
    created_at: str = ""
    notes: tuple[str, ...] = field(default=())
    # the runtime's settings by section (numerics, ddp, data, checkpoint, metrics): {section: {field: value}};
    # a plan file without the section (older ones) runs with the runtime's defaults
    runtime: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            PLAN_MARKER: PLAN_SCHEMA_VERSION,
            "created_at": self.created_at,
            "model": self.model,
            "hardware": self.hardware,
            "goal": self.goal,
            "strategy": self.strategy.to_dict(),
            "runtime": self.runtime,
            "predicted": self.predicted,
            "notes": list(self.notes),
        }


def make_plan(
    profile: WorkloadProfile,
    cluster: Cluster,
    goal: Goal,
    chosen: Estimate,
    notes: Iterable[str] = (),
    runtime: dict[str, Any] | None = None,
    load: dict[str, Any] | None = None,
) -> Plan:
    """The plan file of ``chosen``; ``load``: how to load the model again (``workload.load.load_workload``'s
    arguments: ``redline tune`` predicts its candidates with it)."""
    predicted = chosen.to_dict()
    del predicted["strategy"]
    if chosen.strategy.pipeline > 1:
        predicted["pipeline_stages"] = pipeline_stages(profile, chosen.strategy, cluster.gpus_per_node)
    return Plan(
        strategy=chosen.strategy,
        model={
            "name": profile.name,
            "source": profile.source,
            "method": profile.method,
            "params": profile.params_total,
            "tokens_per_sample": profile.tokens_per_sample,
            "sample_unit": profile.sample_unit,
            "training_flops_per_sample": profile.training_flops_per_sample,
            "calibration": profile.calibration.to_dict() if profile.calibration else None,
        }
        | ({"load": load} if load else {}),
        hardware=describe_cluster(cluster),
        goal={"global_batch": goal.global_batch, "tokens": goal.tokens, "samples": goal.samples},
        predicted=predicted,
        created_at=dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        notes=tuple(notes),
        runtime=dict(runtime or {}),
    )


def pipeline_stages(profile: WorkloadProfile, strategy: Strategy, gpus_per_node: int) -> list[dict[str, float]]:
    """Each pipeline rank's share, first to last: its repeated blocks (the runtime cuts the model there) and
    the bytes of the weights it holds."""
    return [
        {
            "blocks": len(stage.blocks),
            "weights": stage_memory(profile, strategy, stage, gpus_per_node=gpus_per_node).weights,
        }
        for stage in stages(profile, strategy.pipeline)
    ]


def describe_cluster(cluster: Cluster) -> dict[str, Any]:
    return {
        "name": cluster.name,
        "device": cluster.device,
        "accelerator": "cuda" if cluster.gpu is not None else "cpu",
        "gpus_per_node": cluster.gpus_per_node,
        "nodes": cluster.nodes,
        "memory_bytes": cluster.memory_bytes,
        "ceilings": {
            "matmul_flops": {p: {"value": c.value, "source": c.source} for p, c in cluster.matmul.items()},
            "memory_bandwidth": {"value": cluster.memory_bandwidth.value, "source": cluster.memory_bandwidth.source},
            "intra_node_busbw": {"value": cluster.intra.busbw_bytes_per_s, "source": cluster.intra.source},
            "inter_node": None
            if cluster.inter is None
            else {"value": cluster.inter.busbw_bytes_per_s, "source": cluster.inter.source},
        },
        "price_usd_per_node_hour": cluster.price_usd_per_node_hour,
        "price_source": cluster.price_source,
    }


def dump_plan(plan: Plan) -> str:
    import yaml

    return yaml.safe_dump(plan.to_dict(), sort_keys=False, width=120)


def load_plan(path: Path) -> Plan:
    """Read a plan file; anything malformed is one line of BadInput naming the file and the problem."""
    import yaml

    text = read_user_file(path, "plan file")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" at line {where.line + 1}" if where is not None else ""
        raise BadInput(f"{path} is not valid YAML{line}") from None
    if not isinstance(data, dict) or PLAN_MARKER not in data:
        raise BadInput(f"{path} is not a redline plan (no '{PLAN_MARKER}' key)")
    if data[PLAN_MARKER] != PLAN_SCHEMA_VERSION:
        raise BadInput(f"{path} is plan schema {data[PLAN_MARKER]!r}; this redline reads {PLAN_SCHEMA_VERSION}")
    try:
        strategy = Strategy.from_dict(data["strategy"])
        return Plan(
            strategy=strategy,
            model=dict(data["model"]),
            hardware=dict(data["hardware"]),
            goal=dict(data["goal"]),
            predicted=dict(data["predicted"]),
            created_at=str(data.get("created_at", "")),
            notes=tuple(data.get("notes") or ()),
            runtime=dict(data.get("runtime") or {}),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise BadInput(f"{path}: malformed plan ({one_line(exc)})") from None
