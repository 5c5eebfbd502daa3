"""What a user asks the planner for, besides the model, the hardware (``hardware.ClusterChoice``) and the fixed
parts of the strategy (``search.Constraints``): how much training (``Target``), how to rank and how many to show
(``Ranking``), and a calibration on this machine (``CalibrationRequest``).

Each checks its fields as it is made and refuses a bad one with ``PlanInputError``, naming the field and what it
may be; ``redline plan`` builds the same objects from its options and says its flags in the same words.
"""

from __future__ import annotations

from dataclasses import dataclass

from redline.plan.estimate import Goal
from redline.plan.messages import check_whole, refuse
from redline.plan.search import default_global_batch
from redline.workload.profile import WorkloadProfile

RANK_BY: tuple[str, ...] = ("time", "cost")


@dataclass(frozen=True)
class Target:
    """How much training the plans are for, before the defaults: the global batch, and the run's length in tokens
    or in epochs of a dataset (for the time to train and its cost; neither: the plans rank by step time alone).
    ``goal()`` fills in the default batch for a model and GPU count."""

    global_batch: int | None = None  # samples per optimizer step; None: default_global_batch's
    tokens: float | None = None  # train on this many tokens (a language model)
    epochs: float | None = None  # ... or this many passes over dataset_size samples
    dataset_size: float | None = None  # samples in the dataset (with epochs)

    def __post_init__(self) -> None:
        check_whole("global_batch", self.global_batch, 1)
        if self.epochs is not None or self.dataset_size is not None:
            if self.epochs is None or self.dataset_size is None or not self.epochs > 0:
                raise refuse("{epochs} and {dataset_size} go together (and epochs must be positive)")
            if not self.dataset_size > 0:
                raise refuse("{dataset_size} must be positive, not {value}", value=self.dataset_size)
        if self.tokens is not None:
            if not self.tokens > 0:
                raise refuse("{tokens} must be positive, not {value}", value=self.tokens)
            if self.epochs is not None:
                raise refuse("give {tokens} or {epochs}/{dataset_size}, not both")

    @property
    def samples(self) -> float | None:
        """Samples in the whole run (epochs x dataset size), or None."""
        return None if self.epochs is None or self.dataset_size is None else self.epochs * self.dataset_size

    @property
    def has_length(self) -> bool:
        """Whether the run's length is given (tokens, or epochs of a dataset): a time to train and a cost."""
        return self.tokens is not None or self.samples is not None

    def check_model(self, profile: WorkloadProfile) -> None:
        """A length in tokens is a language model's: other models train on images or other samples."""
        if self.tokens is not None and profile.sample_unit != "sequence":
            raise refuse(
                "{model} trains on {unit}s, not tokens: give {epochs} and {dataset_size}",
                field="tokens",
                model=profile.name,
                unit=profile.sample_unit,
            )

    def goal(self, profile: WorkloadProfile, gpus: int = 1) -> Goal:
        """The goal every estimate reads: the global batch given, or the default for ``profile`` on ``gpus``."""
        batch = self.global_batch if self.global_batch is not None else default_global_batch(profile, gpus)
        return Goal(batch, tokens=self.tokens, samples=self.samples)


@dataclass(frozen=True)
class Ranking:
    """How the plans are ranked and how many of them a caller shows."""

    rank_by: str = "time"  # time, or cost (which needs a price: a cloud instance)
    top: int = 5  # how many of the ranked plans (or cloud options) to show, at least 1

    def __post_init__(self) -> None:
        check_whole("top", self.top, 1)
        if self.rank_by not in RANK_BY:
            raise refuse("{rank_by} must be time or cost, not '{value}'", value=self.rank_by)


@dataclass(frozen=True)
class CalibrationRequest:
    """Time real steps of the model on this machine and correct the plans with them (``plan/calibrate.py``).
    ``model`` as ``workload.load.model_builder`` takes it (it is run, so a formula-only preset cannot be); the steps
    run at ``micro_batch``, half of it and 1 (None: the micro-batch of the best uncalibrated plan)."""

    model: str  # a config.json, a package.module:factory, or a traced preset (resnet50, vit-b-16)
    micro_batch: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model.strip():
            raise refuse(
                "{calibration} runs the model: give it as {calibration.model} "
                "(a config.json, a factory, resnet50, vit-b-16)"
            )
        check_whole("calibration.micro_batch", self.micro_batch, 1)
