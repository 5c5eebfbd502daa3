"""The planner's sequence for one cluster: check the request, search, calibrate on this machine and search again,
explain a miss (``redline plan`` without ``--cloud``; ``cloud.plan_cloud`` ranks the cloud's instances).

``plan_training`` takes plain inputs (a profile, a cluster, the ``inputs`` dataclasses) and returns ``Plans``: the
ranked strategies, the calibration used and what the user should know, as ``Note`` values that name the inputs
by field, so that each front end words them as its user knows them (``messages.Message``). It prints nothing: a
note it gives while it runs (real steps about to be timed) goes to the caller's ``progress``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from redline import capability
from redline.errors import BadInput
from redline.plan.calibrate import calibrate, check_this_machine, line_sizes, measure
from redline.plan.estimate import Estimate, Goal
from redline.plan.hardware import Cluster
from redline.plan.inputs import CalibrationRequest, Ranking, Target
from redline.plan.messages import Message, refuse
from redline.plan.search import (
    OUT_OF_MEMORY,
    REDUCED_PRECISIONS,
    Constraints,
    SearchResult,
    default_precision,
    explain_no_fit,
    fit_without_pins,
    search,
    slower_than_fp32,
    smallest_fitting,
)
from redline.units import GiB, fmt_bytes, fmt_duration
from redline.workload.profile import Calibration, WorkloadProfile


class NoteKind(Enum):
    """What a note is about."""

    MODEL = "model"  # what the model's profile assumed or could not see (a GPT shape assumed, ...)
    HARDWARE = "hardware"  # what the cluster assumed (the inter-node network, one node only, ...)
    PRECISION = "precision"  # a 16-bit precision runs slower than fp32 here: passed over, or fixed by the user
    CALIBRATING = "calibrating"  # progress: real steps of the model about to be timed
    CALIBRATED = "calibrated"  # the corrections a calibration fitted
    CALIBRATION_UNCERTAIN = "calibration uncertain"  # the smaller micro-batch ran at the launch floor
    DEFAULT_GLOBAL_BATCH = "default global batch"  # the global batch was not given


@dataclass(frozen=True)
class Note:
    """Something the user should know about the plans: what it is about, and its words (``text``: with the inputs
    called as ``naming`` says, by default by field)."""

    kind: NoteKind
    message: Message

    def text(self, naming: Mapping[str, str] | None = None) -> str:
        return self.message.render(naming)


@dataclass(frozen=True)
class Plans:
    """What ``plan_training`` found: every strategy that fits, best first, and what it was found for."""

    profile: WorkloadProfile  # the model as planned: with its calibration where one ran
    cluster: Cluster
    goal: Goal  # the target with its defaults filled in
    constraints: Constraints  # as searched: a calibration pins the precision it measured
    result: SearchResult  # the ranked strategies, how many were considered, what was excluded and why
    ranking: Ranking
    notes: tuple[Note, ...]

    @property
    def ranked(self) -> list[Estimate]:
        """Every strategy that fits, best first (never empty: ``plan_training`` raises where none fits)."""
        return self.result.ranked

    @property
    def best(self) -> Estimate:
        return self.result.ranked[0]

    @property
    def leaders(self) -> list[Estimate]:
        """The best ``ranking.top`` plans."""
        return self.result.ranked[: self.ranking.top]

    @property
    def calibration(self) -> Calibration | None:
        """The calibration the plans were corrected with, or None."""
        return self.profile.calibration

    def to_dict(self) -> dict[str, Any]:
        """The best ``ranking.top`` plans, how many strategies were considered and why the others were excluded,
        and the model's profile (as ``redline plan --json`` shows them beside the plan file)."""
        return {
            "ranked": [e.to_dict() for e in self.leaders],
            "considered": self.result.considered,
            "excluded": self.result.exclusions(),
            "profile": self.profile.to_dict() | {"layers": len(self.profile.layers)},
        }


class NothingFits(BadInput):
    """No strategy fits: the one-line reason (``str()``, with the smallest catalog hardware that would fit) and, as
    data (``to_dict``), the candidates that came nearest, what each needs and why each was refused."""

    def __init__(
        self,
        message: str,
        result: SearchResult,
        profile: WorkloadProfile,
        cluster: Cluster,
        smallest: list[tuple[Cluster, Estimate]],
        unpinned: tuple[list[str], Estimate] | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.result, self.profile, self.cluster = message, result, profile, cluster
        self.smallest, self.unpinned = smallest, unpinned

    def to_dict(self) -> dict[str, Any]:
        """The keys of ``Plans.to_dict`` (no plan, nothing ranked) and ``nothing_fits``: the summary the CLI says,
        the device's memory, the closest candidates (strategy, memory per GPU by component in GiB, the reason each
        was excluded), the pins to drop where a free layout fits here, and the smallest catalog hardware that fits."""
        cluster, margin = self.cluster, self.result.memory_margin
        usable = (1 - margin) * cluster.memory_bytes

        def gib(size: float) -> float:
            return round(size / GiB, 3)  # to the MiB

        closest = [
            {
                "label": e.strategy.label(),
                "strategy": e.strategy.to_dict(),
                "reason": OUT_OF_MEMORY,
                "needs_gib": {k: gib(v) for k, v in e.memory.to_dict().items() if not isinstance(v, bool)},
                "over_gib": gib(e.memory.device_total - usable),
                "step_time_s": e.time.total,
                "mfu": e.mfu,
            }
            for e in self.result.closest_misfits
        ]
        smallest = [
            {"gpu": c.gpu.key if c.gpu else c.device, "gpus": c.gpus, "label": e.strategy.label()}
            | {"needs_gib": gib(e.memory.device_total), "device_gib": gib(c.memory_bytes)}
            for c, e in self.smallest
        ]
        fits_without = None
        if self.unpinned is not None:
            pins, best = self.unpinned
            fits_without = {
                "pins": pins,
                "label": best.strategy.label(),
                "strategy": best.strategy.to_dict(),
                "needs_gib": gib(best.memory.device_total),
            }
        refusal = {
            "summary": self.message,
            "hardware": cluster.name,
            "device_gib": gib(cluster.memory_bytes),
            "memory_margin": margin,
            "usable_gib": gib(usable),
            "closest": closest,
            "fits_without_pins": fits_without,
            "smallest_hardware": smallest,
        }
        return {
            "plan": None,
            "ranked": [],
            "considered": self.result.considered,
            "excluded": self.result.exclusions(),
            "nothing_fits": refusal,
            "profile": self.profile.to_dict() | {"layers": len(self.profile.layers)},
        }

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.message, self.result, self.profile, self.cluster, self.smallest, self.unpinned)


def plan_training(
    profile: WorkloadProfile,
    cluster: Cluster,
    target: Target | None = None,
    constraints: Constraints | None = None,
    *,
    ranking: Ranking | None = None,
    calibration: CalibrationRequest | None = None,
    progress: Callable[[Note], None] | None = None,
) -> Plans:
    """The strategies for ``profile`` on ``cluster`` that fit, best first. With ``calibration``: real steps of the
    model timed on this machine around the best uncalibrated plan's micro-batch correct the profile, and the
    search runs again. ``NothingFits`` where nothing fits, saying why and the smallest catalog hardware that would."""
    target, constraints, ranking = target or Target(), constraints or Constraints(), ranking or Ranking()
    _check_request(profile, cluster, target, ranking, calibration)
    precision_notes = _precision_notes(cluster, constraints.precision)
    goal = target.goal(profile, cluster.gpus)
    result = search(profile, cluster, goal, constraints)
    calibrated: tuple[Note, ...] = ()
    if calibration is not None:
        chosen = result.ranked[0].strategy.micro_batch if result.ranked else 1
        micro_batch = calibration.micro_batch or chosen  # measured where the plan runs
        profile, constraints, calibrated = _calibrated(
            profile, cluster, constraints, calibration, micro_batch, progress
        )
        result = search(profile, cluster, goal, constraints)
    if not result.ranked:
        raise _nothing_fits(result, profile, cluster, goal, constraints)
    notes = (
        *(Note(NoteKind.MODEL, Message.plain(note)) for note in profile.notes),
        *calibrated,
        *precision_notes,
        *(Note(NoteKind.HARDWARE, Message.plain(note)) for note in cluster.notes),
    )
    if target.global_batch is None:
        default = "global batch {batch} is a default (about 0.5M tokens or 256 images per step); set {global_batch}"
        notes += (Note(NoteKind.DEFAULT_GLOBAL_BATCH, Message(default, {"batch": goal.global_batch})),)
    return Plans(profile, cluster, goal, constraints, result, ranking, notes)


def _check_request(
    profile: WorkloadProfile,
    cluster: Cluster,
    target: Target,
    ranking: Ranking,
    calibration: CalibrationRequest | None,
) -> None:
    """What the inputs cannot ask of each other, refused before any search: a cost without a price, tokens of a
    model that reads images, a calibration without PyTorch or away from this machine."""
    if ranking.rank_by == "cost" and cluster.price_usd_per_node_hour is None:
        raise refuse(
            "{cluster} has no price: rank by time, or plan for a cloud instance (or {plan_cloud})",
            field="rank_by",
            cluster=cluster.name,
        )
    target.check_model(profile)
    if calibration is not None:
        if not capability.is_available("torch"):
            raise refuse(
                "{calibration} (it times real training steps) needs PyTorch: install the build that fits this "
                "machine (pip install torch)"
            )
        check_this_machine(cluster)


def _precision_notes(cluster: Cluster, fixed: str | None) -> tuple[Note, ...]:
    """Why the plans do not train in a 16-bit precision that ``cluster`` has: it runs slower than fp32 here (a CPU
    that emulates bf16), by how much; or, where the user ``fixed`` such a precision, that fp32 would be faster."""
    from redline.bench.compute import EMULATED_BELOW  # bench's word for a 16-bit rate this far below fp32's

    chosen = fixed or default_precision(cluster)
    preference = (*REDUCED_PRECISIONS, "fp32")
    fp32 = cluster.matmul["fp32"].value if "fp32" in cluster.matmul else 0.0
    notes = []
    for precision in slower_than_fp32(cluster):
        passed_over = fixed is None and preference.index(precision) < preference.index(chosen)
        if not passed_over and precision != fixed:  # a slow fp16 where bf16 runs fast: nothing to say
            continue
        rate = cluster.matmul[precision].value
        values = {
            "p": precision,
            "how": "runs emulated" if rate < EMULATED_BELOW * fp32 else "runs slower than fp32",
            "rate": f"{rate / 1e12:.3g}",
            "reference": f"{fp32 / 1e12:.3g}",
            "chosen": chosen,
        }
        said = "{p} {how} here: {rate} TFLOP/s against fp32's {reference}"
        template = (
            said + ", so the plans train in {chosen} ({precision} {p} plans it anyway)"
            if passed_over
            else said + ": the plans would run faster in fp32 (leave out {precision})"
        )
        notes.append(Note(NoteKind.PRECISION, Message(template, values)))
    return tuple(notes)


def _calibrated(
    profile: WorkloadProfile,
    cluster: Cluster,
    constraints: Constraints,
    request: CalibrationRequest,
    micro_batch: int,
    progress: Callable[[Note], None] | None,
) -> tuple[WorkloadProfile, Constraints, tuple[Note, ...]]:
    """The profile corrected by real steps on this machine's first device, the constraints pinned to the precision
    it was measured in (a calibration holds for that precision only), and the notes saying what was fitted."""
    from redline.workload.load import model_builder  # imports the user's module: only when calibrating

    sizes = line_sizes(micro_batch)
    cuda = cluster.gpu is not None
    precision = constraints.precision or ("bf16" if cuda else "fp32")
    build = model_builder(request.model, profile.input_shape)  # run it on the inputs it was traced with
    if progress is not None:
        floor = "" if sizes[0] == 1 else " (and 1, for the floor)"
        text = f"calibrating: timing steps of {profile.name} at micro-batch {sizes[0]} and {sizes[1]}{floor} ..."
        progress(Note(NoteKind.CALIBRATING, Message.plain(text)))
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
    if fitted is None:  # calibrate() always sets it
        raise RuntimeError(f"calibration left {profile.name} without its fitted line")
    notes: tuple[Note, ...] = (Note(NoteKind.CALIBRATED, Message.plain(_fitted_text(fitted, precision))),)
    if fitted.launch_bound:
        uncertain = (
            "micro-batch {size} ran close to the floor (the device waited for Python to launch kernels), so the "
            "fitted line is uncertain: calibrate at a larger {calibration.micro_batch}"
        )
        sizes_fitted = fitted.micro_batches
        notes += (Note(NoteKind.CALIBRATION_UNCERTAIN, Message(uncertain, {"size": sizes_fitted[0]})),)
    return profile, dataclasses.replace(constraints, precision=precision), notes


def _fitted_text(fitted: Calibration, precision: str) -> str:
    """What a calibration corrects, in one line: compute, the optimizer step, activations (on CUDA) and the floor."""
    scale, offset = fitted.compute
    memory = fitted.memory
    text = (
        f"calibrated on {fitted.device} ({precision}, micro-batches {fitted.micro_batches[0]} and "
        f"{fitted.micro_batches[1]}): compute x{scale:.2f} {'+' if offset >= 0 else '-'} "
        f"{fmt_duration(abs(offset))} per micro-batch, optimizer x{fitted.optimizer_scale:.2f}"
    )
    if memory:
        text += f", activations x{memory[0]:.2f} {'+' if memory[1] >= 0 else '-'} {fmt_bytes(abs(memory[1]))}"
    else:
        text += ", memory not measured on a CPU"
    if fitted.measured_floor_s:
        text += f"; no micro-batch under {fmt_duration(fitted.measured_floor_s)}"
    return text


def _nothing_fits(
    result: SearchResult, profile: WorkloadProfile, cluster: Cluster, goal: Goal, constraints: Constraints
) -> NothingFits:
    """Why no strategy fits, and what would: the pins to drop where a free layout fits this hardware, else (where
    the model was too big) the smallest catalog hardware on which it would."""
    message = explain_no_fit(result, cluster)
    smallest: list[tuple[Cluster, Estimate]] = []
    unpinned = fit_without_pins(profile, cluster, goal, constraints)
    if unpinned is not None:
        pins, best = unpinned
        message += (
            f". Without {', '.join(pins)} it fits here: {best.strategy.label()} needs "
            f"{best.memory.device_total / GiB:.1f} GiB per GPU"
        )
    elif result.closest_misfit is not None:
        smallest = smallest_fitting(profile, goal, constraints, prefer=cluster.gpu.key if cluster.gpu else None)
        if smallest:
            options = "; ".join(
                f"{c.gpus} x {c.gpu.key if c.gpu else c.device} ({e.strategy.label()})" for c, e in smallest
            )
            message += f". Smallest hardware that fits (micro-batch 1, full checkpointing): {options}"
        else:
            message += ". It fits on no catalog GPU up to 1024 GPUs"
    return NothingFits(message, result, profile, cluster, smallest, unpinned)
