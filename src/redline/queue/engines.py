"""The engines a job spec can go to past the embedded queue, behind one face: render it (``--dry-run``), submit
it, list the jobs redline gave the engine, cancel one. Each engine's options (a Kubernetes image, a Ray address)
are given when the engine is made; each engine's module imports its client only when asked."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from redline.errors import BadInput
from redline.queue.spec import EngineJob, JobSpec

ENGINES = ("slurm", "ray", "kubernetes")


class Engine(Protocol):
    name: str

    def render(self, spec: JobSpec) -> str: ...

    def submit(self, spec: JobSpec) -> str: ...

    def jobs(self) -> Sequence[EngineJob]: ...

    def cancel(self, job_id: str) -> Any: ...


class Kubernetes:
    """``queue.kubernetes`` with the options of one submission: image, kind, namespace, priority class."""

    name = "kubernetes"

    def __init__(self, *, image: str | None = None, namespace: str = "default", **manifest: Any) -> None:
        self.image = image
        self.namespace = namespace
        self.manifest = {key: value for key, value in manifest.items() if value is not None}

    def _options(self) -> dict[str, Any]:
        if not self.image:
            raise BadInput("a Kubernetes job runs in a container image: give --image")
        return {"image": self.image, "namespace": self.namespace, **self.manifest}

    def render(self, spec: JobSpec) -> str:
        from redline.queue import kubernetes

        return kubernetes.render(spec, **self._options())

    def submit(self, spec: JobSpec) -> str:
        from redline.queue import kubernetes

        return kubernetes.submit(spec, **self._options())

    def jobs(self) -> Sequence[EngineJob]:
        from redline.queue import kubernetes

        return kubernetes.jobs(namespace=self.namespace)

    def cancel(self, job_id: str) -> Any:
        from redline.queue import kubernetes

        return kubernetes.cancel(job_id, namespace=self.namespace)


class Slurm:
    """``queue.slurm``: sbatch, squeue/scontrol/sacct and scancel on this machine's cluster, as its user."""

    name = "slurm"

    def render(self, spec: JobSpec) -> str:
        from redline.queue import slurm

        return slurm.render(spec)

    def submit(self, spec: JobSpec) -> str:
        from redline.queue import slurm

        return slurm.submit(spec)

    def jobs(self) -> Sequence[EngineJob]:
        from redline.queue import slurm

        return slurm.jobs()

    def cancel(self, job_id: str) -> Any:
        from redline.queue import slurm

        return slurm.cancel(job_id)


def engine(name: str, **options: Any) -> Engine:
    """The engine ``name`` with its options (those it does not take are left out: None)."""
    given = {key: value for key, value in options.items() if value is not None}
    if name == "kubernetes":
        return Kubernetes(**{k: v for k, v in given.items() if k in ("image", "namespace", "kind", "priority_class")})
    if name == "ray":
        from redline.queue.ray_engine import RayEngine

        return RayEngine(given.get("address"))
    if name == "slurm":
        return Slurm()
    raise BadInput(f"--engine is local, {', '.join(ENGINES)}; not {name!r}")
