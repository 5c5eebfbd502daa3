"""The engines a job spec can go to past the embedded queue, one registry: each engine is one class (an
``engine.Engine``) in its own module, and one line of ``ENGINES`` here. Adding an engine is its module and that
line; the CLI lists, checks and makes engines through this registry alone."""

from __future__ import annotations

from typing import Any

from redline.errors import BadInput
from redline.queue.engine import Engine
from redline.queue.kubernetes import Kubernetes
from redline.queue.ray_engine import RayEngine
from redline.queue.slurm import Slurm

# in the order the CLI names them
ENGINES: dict[str, type[Engine]] = {engine.name: engine for engine in (Slurm, RayEngine, Kubernetes)}


def engine(name: str, **options: Any) -> Engine:
    """The engine ``name``, made with those of ``options`` it takes (one given as None is left out: its default)."""
    made = ENGINES.get(name)
    if made is None:
        raise BadInput(f"--engine is local, {', '.join(ENGINES)}; not {name!r}")
    return made(**{key: value for key, value in options.items() if key in made.options and value is not None})
