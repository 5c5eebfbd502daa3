"""Which cloud machine, how many, at what price: the planner run over the instance catalog.

For every instance with whole GPUs and every node count up to ``max_nodes`` (powers of two), the best
strategy by time; then the options ranked by cost or by time to finish, and the cheapest way to meet a
deadline (elastic scale-out: more nodes finish sooner, usually at a higher total price). ``plan_cloud`` is
the whole sequence (``redline plan --cloud``), from plain inputs to a ``CloudRanking``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from redline.errors import BadInput
from redline.plan.estimate import Estimate, Goal
from redline.plan.hardware import MAX_NODES, instance_cluster
from redline.plan.inputs import Ranking, Target
from redline.plan.memory import Footprints
from redline.plan.messages import check_whole, refuse
from redline.plan.search import Constraints, search
from redline.units import fmt_duration
from redline.workload.profile import WorkloadProfile


@dataclass(frozen=True)
class CloudScope:
    """Which instances and node counts the cloud ranking tries, and by when a run must finish."""

    max_nodes: int = 8  # node counts 1, 2, 4 ... up to this many, 1 to hardware.MAX_NODES
    providers: tuple[str, ...] = ()  # only these providers' instances (names as the catalog has them); (): all
    deadline_s: float | None = None  # keep only the options that finish within this; None: all

    def __post_init__(self) -> None:
        from redline.specs.instances import instance_catalog

        check_whole("max_nodes", self.max_nodes, 1)
        if self.max_nodes > MAX_NODES:
            raise refuse("{max_nodes} must be at most {most}, not {value}", most=MAX_NODES, value=self.max_nodes)
        known = sorted({instance.provider for instance in instance_catalog()})
        for provider in self.providers:
            if provider not in known:
                raise refuse(
                    "{providers} {value} is not in the catalog; known: {known}", value=provider, known=", ".join(known)
                )
        if self.deadline_s is not None and not self.deadline_s > 0:  # NaN too
            raise refuse("{deadline_s} must be positive, not {value}", value=self.deadline_s)


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
    progress: Callable[[int, int], None] | None = None,
) -> list[CloudOption]:
    """The best strategy on each instance type and node count where the model fits, unsorted. ``progress`` is
    told (instances searched, instances in all) as the search goes: a large model takes a minute over them all."""
    from redline.specs.instances import instance_catalog

    if goal.tokens is None and goal.samples is None:
        raise refuse("{plan_cloud} compares the cost of a whole run: the goal needs {tokens} or {samples}")
    options: list[CloudOption] = []
    footprints = Footprints(profile)
    instances = [
        instance
        for instance in instance_catalog()
        if instance.whole_gpus >= 1 and (not providers or instance.provider in providers)
    ]
    for done, instance in enumerate(instances):
        if progress is not None:
            progress(done, len(instances))
        base = instance_cluster(instance)
        for nodes in node_counts(max_nodes):
            try:
                cluster = base.with_nodes(nodes)
                result = search(profile, cluster, goal, constraints, footprints=footprints)
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


@dataclass(frozen=True)
class CloudRanking:
    """What ``plan_cloud`` found: every instance and node count where the model fits, and those that meet the
    deadline, ranked."""

    goal: Goal  # the target with its defaults filled in (the global batch for one GPU)
    options: list[CloudOption]  # every instance and node count where the model fits, unsorted
    ranked: list[CloudOption]  # the options that meet the deadline, best first by ranking.rank_by
    ranking: Ranking
    scope: CloudScope

    @property
    def leaders(self) -> list[CloudOption]:
        """The best ``ranking.top`` options."""
        return self.ranked[: self.ranking.top]

    def to_dict(self) -> dict[str, Any]:
        """The global batch planned for, the best ``ranking.top`` options, and how many options fit at all."""
        return {
            "global_batch": self.goal.global_batch,
            "ranked": [o.to_dict() for o in self.leaders],
            "options": len(self.options),
        }


def plan_cloud(
    profile: WorkloadProfile,
    target: Target,
    constraints: Constraints | None = None,
    *,
    ranking: Ranking | None = None,
    scope: CloudScope | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> CloudRanking:
    """The catalog's instances and node counts for ``profile``, cheapest or fastest first. The target must give the
    run's length (a cost is for a whole run); BadInput where the model fits on no instance within the scope, or
    where no option meets the deadline (naming the fastest). ``progress``: as ``cloud_options`` tells it."""
    constraints, ranking, scope = constraints or Constraints(), ranking or Ranking(), scope or CloudScope()
    target.check_model(profile)
    if not target.has_length:
        raise refuse("{plan_cloud} compares the cost of a whole run: give {tokens}, or {epochs} with {dataset_size}")
    goal = target.goal(profile)
    options = cloud_options(
        profile, goal, constraints, max_nodes=scope.max_nodes, providers=scope.providers, progress=progress
    )
    if not options:
        raise refuse(
            "{model} fits on no catalog instance with up to {count} nodes; raise {max_nodes}",
            model=profile.name,
            count=scope.max_nodes,
        )
    ranked = rank(options, ranking.rank_by, scope.deadline_s)
    if not ranked:
        fastest = min(options, key=lambda o: o.time_s)
        raise refuse(
            "no option finishes within {deadline}: the fastest is {nodes} x {instance} in {time}; raise {max_nodes} "
            "or the deadline",
            field="deadline_s",
            deadline=fmt_duration(scope.deadline_s),
            nodes=fastest.nodes,
            instance=fastest.instance,
            time=fmt_duration(fastest.time_s),
        )
    return CloudRanking(goal, options, ranked, ranking, scope)
