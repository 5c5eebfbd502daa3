"""Which waiting jobs start now: priority then first come, aging so that nothing waits forever, per-user limits,
and backfill that never delays the job at the head of the queue.

Backfill is EASY backfilling (Lifka's, which Slurm's backfill scheduler and Maui generalise): the first job
that cannot start gets a shadow time, the earliest moment enough running jobs will have ended (by their time
limits) for it to fit, and the devices it would then take. A job behind it may start now only if it ends
before the shadow time, or if the head job would still fit at the shadow time with this one still running.
A running job without a time limit never ends as far as the shadow is concerned: behind a head that waits for
one, only jobs without GPUs start.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from redline.queue.placement import Devices, Placement, Request

AGING_S = 600.0  # a waiting job gains one step of priority for every 10 minutes it has waited


@dataclass(frozen=True)
class Waiting:
    id: str
    user: int
    priority: int
    submitted_at: float
    request: Request
    time_limit_s: float | None = None


@dataclass(frozen=True)
class Running:
    id: str
    user: int
    started_at: float
    gpus: int
    time_limit_s: float | None = None

    @property
    def ends_at(self) -> float | None:
        return None if self.time_limit_s is None else self.started_at + self.time_limit_s


@dataclass(frozen=True)
class Limits:
    jobs_per_user: int | None = None  # running at once
    gpus_per_user: int | None = None


@dataclass(frozen=True)
class Decision:
    starts: list[tuple[Waiting, Placement]]
    waiting: dict[str, str]  # job id -> why it waits


def effective_priority(job: Waiting, now: float) -> float:
    return job.priority + max(0.0, now - job.submitted_at) // AGING_S


def ordered(waiting: Sequence[Waiting], now: float) -> list[Waiting]:
    """Highest effective priority first (its own plus aging), then first submitted."""
    return sorted(waiting, key=lambda j: (-effective_priority(j, now), j.submitted_at, j.id))


def decide(
    waiting: Sequence[Waiting],
    running: Sequence[Running],
    devices: Devices,
    now: float,
    *,
    limits: Limits = Limits(),
    policy: str = "pack",
) -> Decision:
    """The jobs to start now, on which devices, and why each other waits."""
    running = list(running)
    starts: list[tuple[Waiting, Placement]] = []
    reasons: dict[str, str] = {}
    head: Waiting | None = None
    shadow: tuple[float, Devices] | None = None
    for job in ordered(waiting, now):
        limited = _over_limit(job, running, limits)
        if limited:
            reasons[job.id] = limited
            continue
        placed = devices.place(job.request, policy)
        if isinstance(placed, str):
            reasons[job.id] = placed
            if head is None:
                head, shadow = job, _shadow(job, devices, running, policy)
            continue
        if head is not None and job.request.gpus > 0:
            ok, shadow = _backfills(job, placed, now, head, shadow, policy)
            if not ok:
                reasons[job.id] = f"backfill would delay job {head.id}, first in line"
                continue
        starts.append((job, placed))
        devices = devices.with_job(job.id, placed, job.request.whole)
        running.append(Running(job.id, job.user, now, job.request.gpus, job.time_limit_s))
    return Decision(starts, reasons)


def _over_limit(job: Waiting, running: list[Running], limits: Limits) -> str:
    mine = [r for r in running if r.user == job.user]
    if limits.jobs_per_user is not None and len(mine) >= limits.jobs_per_user:
        return f"its user runs {len(mine)} jobs, the limit"
    gpus = sum(r.gpus for r in mine)
    if limits.gpus_per_user is not None and gpus + job.request.gpus > limits.gpus_per_user:
        return f"its user holds {gpus} GPUs of a limit of {limits.gpus_per_user}"
    return ""


def _shadow(head: Waiting, devices: Devices, running: list[Running], policy: str) -> tuple[float, Devices] | None:
    """When ``head`` will fit, running jobs ending by their time limits, and the devices then with it placed;
    None when no end of a time-limited job makes room."""
    for job in sorted((r for r in running if r.ends_at is not None), key=lambda r: r.ends_at or 0.0):
        devices = devices.without_job(job.id)
        placed = devices.place(head.request, policy)
        if not isinstance(placed, str):
            assert job.ends_at is not None
            return job.ends_at, devices
    return None


def _backfills(
    job: Waiting, placed: Placement, now: float, head: Waiting, shadow: tuple[float, Devices] | None, policy: str
) -> tuple[bool, tuple[float, Devices] | None]:
    """Whether ``job`` may start now without delaying ``head``, and the shadow state with it."""
    if shadow is None:
        return False, shadow
    at, devices = shadow
    if job.time_limit_s is not None and now + job.time_limit_s <= at:
        return True, shadow
    later = devices.with_job(job.id, placed, job.request.whole)
    if isinstance(later.place(head.request, policy), str):
        return False, shadow
    return True, (at, later)
