"""What every suite gets: the options the user gave, the device to use, and a way to show progress."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from redline.hw.snapshot import Snapshot


@dataclass
class BenchContext:
    quick: bool = False
    # "cpu", "cuda" (every visible GPU), or "cuda:N"; resolved by the CLI from --device and the probe
    device: str = "cpu"
    snapshot: Snapshot | None = None
    # storage: where to read and write test files
    path: str | None = None
    # network: run as server (on ``listen``: every interface unless told), or connect to one; port; parallel
    # stream counts to try
    serve: bool = False
    listen: str = "0.0.0.0"
    connect: str | None = None
    port: int = 5211
    streams: list[int] = field(default_factory=lambda: [1, 4, 8, 16])
    duration_s: float | None = None
    # collective: how many local ranks
    ranks: int = 2
    # dataloader: a user's "module:factory" that returns a Dataset
    dataset: str | None = None
    # progress: called as progress(description, completed, total); the CLI draws it, tests ignore it
    progress: Callable[[str, int, int], None] = lambda description, completed, total: None
    extra: dict[str, Any] = field(default_factory=dict)

    @contextmanager
    def task(self, description: str, total: int) -> Iterator[Callable[[], None]]:
        """A unit of long work: `with ctx.task("matmul bf16", 20) as step: ... step()`."""
        done = 0
        self.progress(description, 0, total)

        def step() -> None:
            nonlocal done
            done += 1
            self.progress(description, done, total)

        yield step
        self.progress(description, total, total)
