"""The bench suites, by name. Each is a module with ``run(ctx: BenchContext) -> list[Measurement]``,
imported only when asked for (torch and friends load with it, not with `redline --help`)."""

from __future__ import annotations

import dataclasses
import importlib
import shlex
from collections.abc import Callable

from redline.bench.context import BenchContext
from redline.bench.model import Measurement
from redline.errors import BadInput

SUITES: dict[str, str] = {
    "compute": "matrix-multiply throughput per precision, against the catalog peak",
    "memory": "device memory bandwidth, host<->device (pinned, pageable), GPU peer-to-peer",
    "collective": "all_reduce, all_gather, reduce_scatter, broadcast, all_to_all busbw (nccl-tests rules)",
    "storage": "sequential and random read throughput/IOPS of --path, many-small-files reads",
    "network": "TCP throughput with 1..N streams, RTT and loss to a redline peer (--serve / --connect)",
    "dataloader": "samples/s of a Dataset across num_workers / pin_memory / prefetch settings",
}
# what `redline bench` runs with no suite named: everything that needs no peer machine
DEFAULT_SUITES = ["compute", "memory", "collective", "storage", "dataloader"]


def resolve(names: list[str]) -> list[str]:
    unknown = [n for n in names if n not in SUITES]
    if unknown:
        raise BadInput(f"unknown bench suite {', '.join(unknown)}; choose from {', '.join(SUITES)}")
    return names or DEFAULT_SUITES


def runner(name: str) -> Callable[[BenchContext], list[Measurement]]:
    return importlib.import_module(f"redline.bench.{name}").run


def run_suite(name: str, ctx: BenchContext) -> list[Measurement]:
    """Suite ``name``'s measurements, each with how busy other processes kept the CPUs meanwhile
    (``extra["host_cpu"]``: the figures, a one-line summary, and ``busy`` when they took BUSY_RATIO of our
    cores): a figure measured on a busy host is marked in the table, in saved results and for the planner."""
    from redline.hw.cpu_busy import CpuWatch

    try:
        watch: CpuWatch | None = CpuWatch()
    except Exception:  # /proc unreadable here (a locked-down sandbox): the figures go unmarked, not unmeasured
        watch = None
    measurements = runner(name)(ctx)
    try:
        busy = watch.stop(ctx.snapshot.host if ctx.snapshot else None) if watch else None
    except Exception:  # a process table that changed under psutil in a way it did not expect: as above
        busy = None
    if busy is not None:
        record = {**dataclasses.asdict(busy), "taken_ratio": busy.taken_ratio, "busy": busy.busy}
        record["summary"] = busy.describe()
        for m in measurements:
            m.extra["host_cpu"] = record
    return measurements


def check(names: list[str], ctx: BenchContext) -> None:
    """Every chosen suite's ``check(ctx)``, before the first one runs: a bad option for the last suite is
    refused in a second, not after minutes of the others' measurements."""
    for name in names:
        module = importlib.import_module(f"redline.bench.{name}")
        getattr(module, "check", lambda ctx: None)(ctx)


def rerun_command(measurements: list[Measurement]) -> str:
    """The command that measures ``measurements`` again and saves them: their suites, with the options that
    chose what they measured (storage's ``--path``, the dataloader's ``--dataset``). Saved figures are kept per
    suite, name and device, so the new ones replace these; a bare `redline bench --save` would rerun every
    suite, and a storage rerun without its ``--path`` would measure the current folder's disk in its place.
    Figures from several paths or datasets get a placeholder the user fills in."""
    suites = list(dict.fromkeys(m.suite for m in measurements))
    words = ["redline", "bench", *suites]
    for suite, option, key, placeholder in (
        ("storage", "--path", "path", "DATASET_DIR"),
        ("dataloader", "--dataset", "dataset_spec", "MODULE:FACTORY"),
    ):
        values = {m.extra.get(key) for m in measurements if m.suite == suite}
        given = {v for v in values if isinstance(v, str) and v}
        if given:  # a value absent from a figure is the suite's default (the synthetic dataset)
            words += [option, given.pop() if len(values) == 1 else placeholder]
    return shlex.join([*words, "--save"])
