"""Which cloud machine, how many, at what price: the planner run over the instance catalog.

For every instance with whole GPUs and every node count up to ``max_nodes`` (powers of two), the best
strategy by time; then the options ranked by cost or by time to finish, and the cheapest way to meet a
deadline (elastic scale-out: more nodes finish sooner, usually at a higher total price).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from redline.errors import BadInput
from redline.plan.estimate import Estimate, Goal
from redline.plan.hardware import instance_cluster
from redline.plan.search import Constraints, search
from redline.workload.profile import WorkloadProfile


@dataclass(frozen=True)
class CloudOption:
    provider: str
    instance: str
    nodes: int
    gpus: int
    price_usd_per_hour: float  # all nodes together
    price_date: str
    best: Estimate
    price_verified: bool = True

    @property
    def time_s(self) -> float:
        assert self.best.time_to_train_s is not None
        return self.best.time_to_train_s

    @property
    def cost_usd(self) -> float:
        assert self.best.cost_usd is not None
        return self.best.cost_usd

    def to_dict(self) -> dict[str, Any]:
        return {
            "provider": self.provider,
            "instance": self.instance,
            "nodes": self.nodes,
            "gpus": self.gpus,
            "price_usd_per_hour": self.price_usd_per_hour,
            "price_date": self.price_date,
            "price_verified": self.price_verified,
            "time_to_train_s": self.time_s,
            "cost_usd": self.cost_usd,
            "best": self.best.to_dict(),
        }


def node_counts(max_nodes: int) -> list[int]:
    counts, n = [], 1
    while n <= max_nodes:
        counts.append(n)
        n *= 2
    return counts


def cloud_options(
    profile: WorkloadProfile,
    goal: Goal,
    constraints: Constraints,
    *,
    max_nodes: int = 8,
    providers: tuple[str, ...] = (),
) -> list[CloudOption]:
    """The best strategy on each instance type and node count where the model fits, unsorted."""
    from redline.specs.instances import instance_catalog

    if goal.tokens is None and goal.samples is None:
        raise BadInput("--cloud compares the cost of a whole run: give --tokens, or --epochs with --dataset-size")
    options: list[CloudOption] = []
    for instance in instance_catalog():
        if instance.whole_gpus < 1 or (providers and instance.provider not in providers):
            continue
        base = instance_cluster(instance)
        for nodes in node_counts(max_nodes):
            try:
                cluster = base.with_nodes(nodes)
                result = search(profile, cluster, goal, constraints)
            except BadInput:
                continue  # a precision the GPU lacks, no network to more nodes, a --tp/--pp this size cannot take
            if result.ranked:
                options.append(
                    CloudOption(
                        provider=instance.provider,
                        instance=instance.name,
                        nodes=nodes,
                        gpus=cluster.gpus,
                        price_usd_per_hour=instance.price_usd_per_hour * nodes,
                        price_date=instance.price_date,
                        best=result.ranked[0],
                        price_verified=instance.price_verified,
                    )
                )
    return options


def rank(options: list[CloudOption], by: str, deadline_s: float | None = None) -> list[CloudOption]:
    """Options meeting the deadline (all, without one), cheapest or fastest first."""
    kept = [o for o in options if deadline_s is None or o.time_s <= deadline_s]
    key = (lambda o: (o.cost_usd, o.time_s)) if by == "cost" else (lambda o: (o.time_s, o.cost_usd))
    return sorted(kept, key=key)
