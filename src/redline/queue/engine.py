"""What every engine past the embedded queue does with a job spec: render it (``--dry-run``), submit it, list the
jobs redline gave it, cancel one. Each engine is one class in its own module (``slurm``, ``ray_engine``,
``kubernetes``), registered in ``engines``; the CLI reads its traits (``name``, ``options``), never compares its
name. Its options (a Kubernetes image, a Ray address) are given when it is made; its module imports the engine's
client only when a cluster is reached."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

from redline.queue.spec import EngineJob, JobSpec


class Engine(ABC):
    """One cluster scheduler a job spec can go to."""

    name: ClassVar[str]  # ``--engine``'s word for it, and the ``engine`` of the rows it reports
    options: ClassVar[tuple[str, ...]] = ()  # the keywords it is made with (``--image``, ``--address``...)

    @abstractmethod
    def render(self, spec: JobSpec) -> str:
        """What ``submit`` would hand the engine, as text: what ``--dry-run`` prints. No cluster is reached."""

    @abstractmethod
    def submit(self, spec: JobSpec) -> str:
        """Hand the job to the engine; its id there."""

    @abstractmethod
    def jobs(self) -> Sequence[EngineJob]:
        """The jobs redline gave the engine (the cluster's others left out)."""

    @abstractmethod
    def cancel(self, job_id: str) -> bool | None:
        """Stop or remove the job ``job_id``; an id the engine does not know is a one-line BadInput. False where
        the engine says the job had ended already; None where it does not say."""
