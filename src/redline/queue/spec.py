"""A job as the user submits it, whichever engine runs it: the embedded queue, Slurm, Ray or Kubernetes.

A job is an argv, never a shell line: the engines that take a script (sbatch) or a command string (Ray's
entrypoint) get it quoted with ``shlex.join``. The environment is captured at submit time, as Slurm's
``--export=ALL`` does, so the job runs with the variables its user had, not the daemon's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from redline.errors import BadInput


class JobState(StrEnum):
    """Where a job is in its life (task-spooler's ``enum Jobstate``). ``starting`` is the embedded queue's
    moment between its decision and the job's shim having started it; the other engines report the rest."""

    QUEUED = "queued"
    HELD = "held"
    STARTING = "starting"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"
    LOST = "lost"


STATES = tuple(JobState)
FINAL_STATES = (JobState.DONE, JobState.FAILED, JobState.CANCELLED, JobState.LOST)
LIVE = (JobState.QUEUED, JobState.HELD, JobState.STARTING, JobState.RUNNING)
ACTIVE = (JobState.STARTING, JobState.RUNNING)  # a shim holds (or is about to hold) the attempt


# the counts a job asks for, and their bounds: past these a value is a typo (or an attack on the queue's
# SQLite integers), not a job; GPUs are checked against the machine at submit as well
COUNTS = (("gpus", 0, 4096), ("nodes", 1, 65536), ("retries", 0, 1000), ("priority", -(10**6), 10**6))
MAX_GPU_MEMORY_BYTES = 2**50
MAX_TIME_LIMIT_S = 366 * 86400.0
MAX_NAME_CHARS = 200
MAX_AFTER = 1000


@dataclass(frozen=True)
class JobSpec:
    argv: tuple[str, ...]
    name: str = ""
    gpus: int = 0  # whole devices (GPUs, or MIG instances) the job asks for; 0: none
    gpu_memory_bytes: int | None = None  # per device: declared (--gpu-memory) or a plan's predicted peak + margin
    exclusive: bool = False  # no other job on its devices
    nodes: int = 1  # past one server: nodes, each with ``gpus`` devices (torchrun under srun, a PyTorchJob)
    priority: int = 0  # higher first
    after: tuple[str, ...] = ()  # job ids that must end well first
    retries: int = 0  # restarts allowed after a preemption-class end (a signal, an Xid, an out-of-memory restart)
    time_limit_s: float | None = None  # the job is stopped past it; also what backfill plans with
    cwd: str = ""
    env: Mapping[str, str] = field(default_factory=dict)
    plan: str | None = None  # a redline plan file: its predicted peak is the job's memory, the job runs with it
    queue: str | None = None  # the engine's queue: a Slurm partition, a Kueue LocalQueue
    umask: int | None = None  # the submitter's (the embedded queue's daemon runs with 077); None: 022

    def __post_init__(self) -> None:
        if not self.argv or not all(isinstance(a, str) for a in self.argv):
            raise BadInput("a job is a command and its arguments: give them after --")
        for name, low, high in COUNTS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise BadInput(f"--{name} must be a whole number from {low} to {high}, not {value}")
        if self.gpu_memory_bytes is not None and not 0 < self.gpu_memory_bytes <= MAX_GPU_MEMORY_BYTES:
            raise BadInput(f"--gpu-memory must be positive and at most 1 PiB, not {self.gpu_memory_bytes}")
        if self.time_limit_s is not None and not 0 < self.time_limit_s <= MAX_TIME_LIMIT_S:
            raise BadInput(f"--time-limit must be positive and at most a year, not {self.time_limit_s} s")
        if not isinstance(self.name, str) or not self.name.isprintable():  # shown on every user's terminal
            raise BadInput("--name must be printable text (no control characters)")
        environment = [*self.env, *self.env.values()] if isinstance(self.env, Mapping) else [None]  # None: refused
        if not all(isinstance(text, str) for text in [self.cwd, *self.after, *environment]):
            raise BadInput("a job's folder, environment and --after ids are text")
        if len(self.name) > MAX_NAME_CHARS or len(self.after) > MAX_AFTER:
            raise BadInput(f"--name takes at most {MAX_NAME_CHARS} characters, --after at most {MAX_AFTER} jobs")
        if self.umask is not None and (not isinstance(self.umask, int) or not 0 <= self.umask <= 0o777):
            raise BadInput(f"a umask is 0 to 0o777, not {self.umask!r}")

    @property
    def label(self) -> str:
        """The job's name, or its program's."""
        return self.name or self.argv[0].rsplit("/", 1)[-1]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"argv": list(self.argv), "after": list(self.after), "env": dict(self.env)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> JobSpec:
        known = set(cls.__dataclass_fields__)
        unknown = set(data) - known
        if unknown:
            raise BadInput(f"a job spec with unknown fields: {', '.join(sorted(unknown))}")
        return cls(**(dict(data) | {"argv": tuple(data["argv"]), "after": tuple(data.get("after") or ())}))


@dataclass(frozen=True)
class EngineJob:
    """A job as an engine reports it, for `redline jobs`: one row whatever ran it."""

    engine: str  # "local", "slurm", "ray", "kubernetes"
    id: str  # the engine's id: a local number, a Slurm job id, a Ray submission id, a Kubernetes Job name
    name: str
    state: str  # one of STATES
    exit_code: int | None = None
    reason: str = ""  # why it waits or how it ended, in the engine's words
    user: str = ""
    submitted_at: float | None = None  # seconds since the epoch
    started_at: float | None = None
    ended_at: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def quoted(argv: Sequence[str]) -> str:
    """The argv as one shell word list: what sbatch's script line and Ray's entrypoint take."""
    import shlex

    return shlex.join(argv)
