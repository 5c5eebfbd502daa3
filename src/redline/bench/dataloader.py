"""Samples/s a Dataset delivers through ``torch.utils.data.DataLoader``, across loader settings.

A GPU waits on its input pipeline more often than on anything else, and the fix is usually a setting:
more worker processes, a deeper prefetch queue, pinned batches. This suite runs the same Dataset through
a grid of settings (num_workers 0, 1, 2, 4, ... up to the usable cores; prefetch_factor 2 and 4 with
workers; pin_memory on and off where there is a GPU; persistent_workers on) and says which to use.

Fair comparisons: every loading process runs its tensor ops on one intra-op thread. PyTorch sets one
thread in each worker; the single-process loader (num_workers=0) is measured under the same budget, since
with torch's default threads its small ops fight over the cores and a "speed-up" of the workers would be
that fight, not their parallelism. Each setting is run ``REPEATS`` times with a fresh loader, the runs of
all settings interleaved so a change in the host's load falls on every setting alike.

Per run: the first batch is timed apart (``startup_s``: forking workers, their first fetches), the batches
the workers queued meanwhile are drained untimed, then a fixed number of batches is timed in equal windows.
A setting's samples/s is the median over the windows of all its runs, with their p10-p90 as its spread;
one setting is called faster than another only when its p10 is above the other's p90, and a setting is
recommended over the default (num_workers=0) only when it is faster beyond that spread. The suite's figure
is the recommended setting's samples/s, not the fastest one's: the rate a user who follows the advice gets.
On a GPU each batch is also copied to it (``non_blocking``, as a training loop does), since that copy is
what pin_memory speeds up. Every loader's workers are shut down before the next run starts, also on error.

The default Dataset (``SyntheticImages``) does the CPU work of a typical image pipeline per sample: draw
a 3x256x256 uint8 "decoded" image, random-crop to 224, random flip, brightness/contrast jitter in float,
back to uint8: a 150 KB tensor (3x224x224) and a label, ~1.5-2 ms of one core. A user's Dataset comes
from ``--dataset module:factory`` (``factory()`` returns it).
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from redline.bench.context import BenchContext
from redline.bench.model import Measurement, Spread
from redline.errors import BadInput, one_line

SUITE = "dataloader"
BATCH_SIZE = 32
# runs of each setting, each with a fresh loader: {quick: runs}
REPEATS = {False: 3, True: 2}
# timed batches per run, after the first: {quick: batches}; split into WINDOWS for the spread
BATCHES = {False: 40, True: 12}
WINDOWS = 4
# intra-op threads of every loading process: what PyTorch gives each worker, so the single-process loader
# gets it too
THREADS_PER_PROCESS = 1
# a setting within this share of the best counts as just as good (then fewer workers win); a setting must
# also be at least 1/GOOD_ENOUGH times the default to be worth its processes
GOOD_ENOUGH = 0.95


# ---------------------------------------------------------------------------------------- dataset


class SyntheticImages:
    """An image-classification Dataset whose samples cost ~1.5-2 ms of CPU each, like JPEG decode plus
    augmentation: deterministic per index, so every setting sees the same work."""

    def __init__(self, length: int = 1_000_000, side: int = 256, crop: int = 224) -> None:
        self.length, self.side, self.crop = length, side, crop

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[Any, int]:
        import torch

        g = torch.Generator().manual_seed(index)
        image = torch.randint(0, 256, (3, self.side, self.side), dtype=torch.uint8, generator=g)
        top, left = (int(v) for v in torch.randint(0, self.side - self.crop + 1, (2,), generator=g))
        x = image[:, top : top + self.crop, left : left + self.crop]
        if torch.rand(1, generator=g).item() < 0.5:
            x = x.flip(-1)
        brightness, contrast = (torch.rand(2, generator=g) * 0.4 + 0.8).tolist()
        x = x.float().div_(255).mul_(brightness)
        mean = x.mean()
        x = x.sub_(mean).mul_(contrast).add_(mean).clamp_(0, 1)
        return x.mul_(255).to(torch.uint8), index % 1000


def load_dataset(spec: str) -> Any:
    """The Dataset ``factory()`` returns, for ``spec`` = "module:factory"; BadInput with one line otherwise.

    The current directory is searched first, as `python -m` would, so ``--dataset mydata:build`` finds
    ./mydata.py.
    """
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute or ":" in attribute:
        raise BadInput(f"--dataset takes 'module:factory' (e.g. mydata:build), not {spec!r}")
    with _cwd_on_path():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and module_name.startswith(exc.name):
                raise BadInput(f"--dataset {spec}: module {module_name!r} not found") from None
            raise BadInput(f"--dataset {spec}: importing {module_name!r} failed: {exc}") from None
        except Exception as exc:
            raise BadInput(f"--dataset {spec}: importing {module_name!r} failed: {_one_line(exc)}") from None
    factory = getattr(module, attribute, None)
    if factory is None:
        raise BadInput(f"--dataset {spec}: module {module_name!r} has no attribute {attribute!r}")
    if not callable(factory):
        raise BadInput(f"--dataset {spec}: {attribute!r} is a {type(factory).__name__}, not callable")
    try:
        dataset = factory()
    except Exception as exc:
        raise BadInput(f"--dataset {spec}: {attribute}() raised {_one_line(exc)}") from None
    if isinstance(dataset, (str, bytes)):
        raise BadInput(f"--dataset {spec}: {attribute}() returned a {type(dataset).__name__}, not a Dataset")
    missing = [m for m in ("__getitem__", "__len__") if not hasattr(dataset, m)]
    if missing:
        raise BadInput(
            f"--dataset {spec}: {attribute}() returned a {type(dataset).__name__} without "
            f"{' and '.join(missing)}; a map-style Dataset needs both"
        )
    if len(dataset) == 0:
        raise BadInput(f"--dataset {spec}: {attribute}() returned an empty dataset")
    return dataset


@contextmanager
def _cwd_on_path() -> Iterator[None]:
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        yield
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)


def _one_line(exc: BaseException) -> str:
    """``one_line(exc)``, but for an error re-raised from a DataLoader worker ("Caught ValueError in
    DataLoader worker process 0. Original Traceback ..."): the original error, the traceback's last line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if lines and lines[0].startswith("Caught ") and "DataLoader worker" in lines[0]:
        return lines[-1]
    return one_line(exc)


# ------------------------------------------------------------------------------------------- grid


@dataclass(frozen=True)
class Setting:
    num_workers: int
    prefetch_factor: int | None  # only with workers
    pin_memory: bool

    def loader_kwargs(self) -> dict[str, Any]:
        workers = self.num_workers > 0
        return {
            "num_workers": self.num_workers,
            "prefetch_factor": self.prefetch_factor if workers else None,
            "persistent_workers": workers,
            "pin_memory": self.pin_memory,
        }

    def describe(self) -> str:
        parts = [f"num_workers={self.num_workers}"]
        if self.num_workers:
            parts.append(f"prefetch_factor={self.prefetch_factor}")
        parts.append(f"pin_memory={self.pin_memory}")
        return ", ".join(parts)


def usable_cores(ctx: BenchContext) -> int:
    """Cores this process may really use: its CPU affinity, capped by a cgroup quota."""
    host = ctx.snapshot.host if ctx.snapshot else None
    cores = len(os.sched_getaffinity(0))
    if host and host.cgroup_cpu_limit_cores:
        cores = min(cores, max(1, int(host.cgroup_cpu_limit_cores)))
    return max(1, cores)


def worker_counts(cores: int, quick: bool) -> list[int]:
    """0 (loading in the training process), then 1, 2, 4, ... and the core count itself."""
    if quick:
        return [0, min(2, cores)]
    counts = [0]
    n = 1
    while n < cores:
        counts.append(n)
        n *= 2
    counts.append(cores)
    return counts


def grid(cores: int, quick: bool, cuda: bool) -> list[Setting]:
    pins = (False, True) if cuda else (False,)
    prefetches = (2,) if quick else (2, 4)
    out = []
    for workers in worker_counts(cores, quick):
        for pin in pins:
            for prefetch in prefetches if workers else (None,):
                out.append(Setting(workers, prefetch, pin))
    return out


# ---------------------------------------------------------------------------------------- measure


@dataclass
class Result:
    """One setting's runs: each run's start-up, and samples/s in every timed window of every run."""

    setting: Setting
    startups_s: list[float]
    windows_samples_per_s: list[float]
    batch_bytes: int

    @property
    def spread(self) -> Spread:
        return Spread.of(self.windows_samples_per_s)

    @property
    def samples_per_s(self) -> float:
        return self.spread.median

    @property
    def startup_s(self) -> float:
        return Spread.of(self.startups_s).median

    @classmethod
    def combined(cls, runs: list[Result]) -> Result:
        """Several runs of one setting as one result: their start-ups and windows side by side."""
        return cls(
            runs[0].setting,
            [s for r in runs for s in r.startups_s],
            [w for r in runs for w in r.windows_samples_per_s],
            runs[0].batch_bytes,
        )


def faster_beyond_spread(a: Result, b: Result) -> bool:
    """Whether ``a`` loads faster than ``b`` by more than their windows scatter: a's p10 above b's p90. Two
    settings whose p10-p90 ranges overlap are not told apart, whatever their medians say."""
    return a.spread.p10 > b.spread.p90


@dataclass(frozen=True)
class Advice:
    """The setting to use and why: ``chosen`` is ``baseline`` (DataLoader's default, num_workers=0) unless
    another setting beat it beyond the spread and by at least 1/GOOD_ENOUGH."""

    best: Result
    chosen: Result
    baseline: Result
    text: str


def advise(results: list[Result]) -> Advice:
    """The cheapest setting (fewest workers, then shallowest prefetch, then no pinning) as good as the best,
    if it is worth its processes over the default; else the default.

    "As good as the best": within GOOD_ENOUGH of its median, or not slower than it beyond the spread. "Worth
    it": faster than the default beyond the spread and by at least 1/GOOD_ENOUGH. So a prefetch_factor=4 or
    a pin_memory=True that won by noise is never advised.
    """
    best = max(results, key=lambda r: r.samples_per_s)
    baseline = next((r for r in results if r.setting.num_workers == 0 and not r.setting.pin_memory), results[0])
    as_good = [
        r for r in results if r.samples_per_s >= GOOD_ENOUGH * best.samples_per_s or not faster_beyond_spread(best, r)
    ]
    worth_it = [
        r
        for r in as_good
        if r is baseline
        or (faster_beyond_spread(r, baseline) and r.samples_per_s * GOOD_ENOUGH >= baseline.samples_per_s)
    ]
    chosen = min(
        worth_it or [baseline],
        key=lambda r: (r.setting.num_workers, r.setting.prefetch_factor or 0, r.setting.pin_memory),
    )
    threads = f"{THREADS_PER_PROCESS} thread{'s' * (THREADS_PER_PROCESS > 1)} per process"
    if chosen is baseline:
        text = f"{chosen.setting.describe()}: the single-process loader"
        if best is not baseline:
            text += (
                f"; no other setting was worth its processes beyond the spread of the runs (the fastest, "
                f"{best.setting.describe()}, {best.samples_per_s / baseline.samples_per_s:.2f}x, p10-p90 "
                f"{best.spread.p10:.4g}-{best.spread.p90:.4g} against {baseline.spread.p10:.4g}-"
                f"{baseline.spread.p90:.4g} samples/s)"
            )
        return Advice(best, chosen, baseline, text)
    speedup = chosen.samples_per_s / baseline.samples_per_s
    text = f"{chosen.setting.describe()}: {speedup:.1f}x the single-process loader ({threads} in both)"
    if chosen is not best:
        text += (
            f" ({chosen.samples_per_s / best.samples_per_s:.0%} of the best, {best.setting.describe()}, "
            "with fewer processes or the same within the spread)"
        )
    return Advice(best, chosen, baseline, text)


def measure_setting(
    dataset: Any, setting: Setting, *, batches: int, batch_size: int | None = None, device: str = "cpu"
) -> Result:
    """One run: time ``batches`` batches of ``dataset`` after the first, in WINDOWS equal windows.

    An epoch that ends early starts the next (persistent workers carry on). The iterator's workers are shut
    down when this returns or raises.
    """
    import torch
    from torch.utils.data import DataLoader

    loader = DataLoader(
        dataset,
        batch_size=batch_size or BATCH_SIZE,
        shuffle=True,
        generator=torch.Generator().manual_seed(0),
        **setting.loader_kwargs(),
    )
    cuda = device.startswith("cuda")
    it = None
    try:
        t0 = time.perf_counter()
        it = iter(loader)
        first = next(it)
        startup_s = time.perf_counter() - t0
        batch_bytes = _tensor_bytes(first)
        # while the first batch was awaited the workers filled their queues: drain that backlog untimed,
        # or the first window would count batches made during start-up
        for _ in range(setting.num_workers * (setting.prefetch_factor or 0)):
            it = _next_batch(loader, it)[1]
        windows = max(1, min(WINDOWS, batches))
        per_window = max(1, batches // windows)
        rates = []
        for _ in range(windows):
            samples = 0
            t0 = time.perf_counter()
            for _ in range(per_window):
                batch, it = _next_batch(loader, it)
                if cuda:
                    batch = _to(batch, device)
                samples += _batch_len(batch)
            if cuda:
                torch.cuda.synchronize(device)
            rates.append(samples / (time.perf_counter() - t0))
        return Result(setting, [startup_s], rates, batch_bytes)
    finally:
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:  # persistent workers outlive the iterator object unless told to stop
            shutdown()
        del it, loader


def _next_batch(loader: Any, it: Any) -> tuple[Any, Any]:
    """The next batch and the iterator to go on with: at the end of an epoch, the next epoch's."""
    try:
        return next(it), it
    except StopIteration:
        it = iter(loader)
        return next(it), it


def _to(batch: Any, device: str) -> Any:
    import torch

    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(_to(b, device) for b in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: _to(v, device) for k, v in batch.items()}
    return batch


def _tensors(batch: Any) -> Iterator[Any]:
    import torch

    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, (list, tuple)):
        for b in batch:
            yield from _tensors(b)
    elif isinstance(batch, dict):
        for b in batch.values():
            yield from _tensors(b)


def _tensor_bytes(batch: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(batch))


def _batch_len(batch: Any) -> int:
    """Samples in a collated batch: the leading dimension of its first tensor."""
    first = next(_tensors(batch), None)
    return int(first.shape[0]) if first is not None and first.dim() else BATCH_SIZE


def check(ctx: BenchContext) -> None:
    """Before any suite runs: the user's Dataset is imported, built and checked (kept for ``run``), so a wrong
    ``--dataset`` is one line in seconds, not after the other suites."""
    if ctx.dataset and "dataset" not in ctx.extra:
        from redline.bench.compute import require_torch

        require_torch(SUITE)
        ctx.extra["dataset"] = load_dataset(ctx.dataset)


def run(ctx: BenchContext) -> list[Measurement]:
    from redline.bench.compute import require_torch

    require_torch(SUITE)
    check(ctx)
    if ctx.dataset:
        dataset, source = ctx.extra["dataset"], f"--dataset {ctx.dataset}"
    else:
        dataset, source = SyntheticImages(), "synthetic images (3x224x224 uint8, ~1.5-2 ms CPU per sample)"
    cuda = ctx.device != "cpu"
    device = "cpu"
    if cuda:
        from redline.bench.compute import cuda_indices

        device = f"cuda:{cuda_indices(ctx.device)[0]}"
    cores = usable_cores(ctx)
    settings = grid(cores, ctx.quick, cuda)
    batches, repeats = BATCHES[ctx.quick], REPEATS[ctx.quick]
    runs: dict[Setting, list[Result]] = {setting: [] for setting in settings}
    with _torch_threads(THREADS_PER_PROCESS), ctx.task("dataloader: settings", len(settings) * repeats) as step:
        for _ in range(repeats):  # round by round: a burst of load elsewhere slows one run of each, not one setting
            for setting in settings:
                try:
                    runs[setting].append(measure_setting(dataset, setting, batches=batches, device=device))
                except BadInput:
                    raise
                except Exception as exc:  # the user's Dataset or collate failing: say so in one line
                    raise BadInput(
                        f"dataloader ({setting.describe()}): loading {source} failed: {_one_line(exc)}"
                    ) from None
                step()
    results = [Result.combined(runs[setting]) for setting in settings]
    return [summarize(ctx, results, source=source, batches=batches, cores=cores, device=device)]


@contextmanager
def _torch_threads(threads: int) -> Iterator[None]:
    """This process's intra-op threads set to ``threads`` for the block (workers set their own to 1)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def summarize(
    ctx: BenchContext, results: list[Result], *, source: str, batches: int, cores: int, device: str
) -> Measurement:
    """The suite's one figure: the samples/s of the setting the advice says to use, not the fastest one.

    The fastest setting may have won only inside the spread of the runs; headlining its rate while advising
    num_workers=0 would read as if workers gave it. So ``value``, ``spread`` and ``startup_s`` are the
    recommended setting's (``recommended``, named short in ``setting`` for the table's row); the fastest is
    kept apart as ``best`` and ``best_samples_per_s``, and every setting's figures are in ``grid``.
    """
    advice = advise(results)
    chosen, best = advice.chosen, advice.best
    runs = len(chosen.startups_s)
    extra: dict[str, Any] = {
        "dataset": source,
        "dataset_spec": ctx.dataset,  # --dataset as given (None: the synthetic images), to measure it again
        "setting": f"num_workers={chosen.setting.num_workers}",
        "recommended": chosen.setting.loader_kwargs(),
        "recommendation": advice.text,
        "best": best.setting.loader_kwargs(),
        "best_samples_per_s": best.samples_per_s,
        "single_process_samples_per_s": advice.baseline.samples_per_s,
        "threads_per_process": THREADS_PER_PROCESS,
        "usable_cores": cores,
        "batch_size": BATCH_SIZE,
        "batch_bytes": chosen.batch_bytes,
        "startup_s": chosen.startup_s,
        "grid": [
            {
                **r.setting.loader_kwargs(),
                "threads": THREADS_PER_PROCESS,
                "samples_per_s": r.samples_per_s,
                "samples_per_s_p10": r.spread.p10,
                "samples_per_s_p90": r.spread.p90,
                "startup_s": r.startup_s,
            }
            for r in results
        ],
    }
    if device == "cpu":
        extra["pin_memory"] = "skipped: no GPU (pinning only speeds host-to-GPU copies)"
    extra.update(_shm_check(ctx, results))
    extra["notes"] = [f"use DataLoader({advice.text.replace(':', '):', 1)}"]
    if "shm_warning" in extra:
        extra["notes"].append(extra["shm_warning"])
    return Measurement(
        suite=SUITE,
        name="samples_per_s",
        value=chosen.samples_per_s,
        unit="samples/s",
        method=f"DataLoader({chosen.setting.describe()}), the setting advised below, over {source}, batch "
        f"{BATCH_SIZE}, shuffle; {len(results)} settings tried, {THREADS_PER_PROCESS} intra-op thread per loading "
        f"process; {runs} runs of each, interleaved, {batches} batches timed per run after the first (start-up "
        f"apart) in {WINDOWS} windows; median and p10-p90 over the windows"
        + ("; each batch copied to the GPU" if device != "cpu" else ""),
        device=device,
        size={"batch_size": BATCH_SIZE, "batches": batches, "runs": runs},
        repeats=len(chosen.windows_samples_per_s),
        spread=chosen.spread,
        extra=extra,
    )


def _shm_check(ctx: BenchContext, results: list[Result]) -> dict[str, Any]:
    """Workers hand batches over in /dev/shm: up to workers x prefetch_factor batches wait there at once."""
    from redline.hw.host import SHM_MIN_BYTES

    shm = ctx.snapshot.host.shm_total_bytes if ctx.snapshot else None
    with_workers = [r for r in results if r.setting.num_workers]
    if shm is None or not with_workers:
        return {}
    in_flight = max(r.setting.num_workers * (r.setting.prefetch_factor or 2) * r.batch_bytes for r in with_workers)
    out: dict[str, Any] = {"shm_total_bytes": shm, "shm_in_flight_bytes": in_flight}
    if shm < max(SHM_MIN_BYTES, 2 * in_flight):
        out["shm_warning"] = (
            f"/dev/shm is {shm / 2**20:.0f} MiB while workers keep up to {in_flight / 2**20:.0f} MiB of batches "
            "there: larger batches or more workers will crash with 'insufficient shared memory' "
            "(docker --shm-size=16g or --ipc=host)"
        )
    return out
