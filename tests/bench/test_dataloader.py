"""dataloader suite: the settings grid, a tiny run, workers reaped (also on error), --dataset specs."""

from __future__ import annotations

import sys
import textwrap
import uuid
from typing import Any

import psutil
import pytest

from builders import healthy_server
from conftest import run_cli
from redline.bench import dataloader
from redline.bench.context import BenchContext
from redline.errors import BadInput

USER_MODULE = """
import torch

class Squares:
    def __len__(self):
        return 40
    def __getitem__(self, i):
        return torch.full((8,), float(i * i)), i

class Broken(Squares):
    def __getitem__(self, i):
        raise ValueError(f"sample {i} is corrupt")

def build():
    return Squares()

def broken():
    return Broken()

def returns_int():
    return 7

def raises():
    raise OSError("no such bucket")

NOT_CALLABLE = 3

def NAME():
    return "squares"
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A module in the current directory, the way a user runs `redline bench dataloader --dataset m:f`."""
    name = f"userdata_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.chdir(tmp_path)
    yield name
    sys.modules.pop(name, None)


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setattr(dataloader, "BATCHES", {True: 5, False: 5})
    monkeypatch.setattr(dataloader, "BATCH_SIZE", 4)


def children() -> int:
    return len(psutil.Process().children(recursive=True))


def test_worker_counts_and_grid():
    assert dataloader.worker_counts(16, quick=False) == [0, 1, 2, 4, 8, 16]
    assert dataloader.worker_counts(6, quick=False) == [0, 1, 2, 4, 6]
    assert dataloader.worker_counts(2, quick=True) == [0, 2]
    assert dataloader.worker_counts(1, quick=True) == [0, 1]
    cpu = dataloader.grid(2, quick=False, cuda=False)
    assert [(s.num_workers, s.prefetch_factor, s.pin_memory) for s in cpu] == [
        (0, None, False),
        (1, 2, False),
        (1, 4, False),
        (2, 2, False),
        (2, 4, False),
    ]
    gpu = dataloader.grid(2, quick=True, cuda=True)
    assert {s.pin_memory for s in gpu} == {False, True} and len(gpu) == 4
    assert dataloader.Setting(0, None, False).loader_kwargs()["persistent_workers"] is False
    assert dataloader.Setting(2, 4, True).loader_kwargs() == {
        "num_workers": 2,
        "prefetch_factor": 4,
        "persistent_workers": True,
        "pin_memory": True,
    }


def test_synthetic_samples_are_deterministic_150_kb_images():
    data = dataloader.SyntheticImages()
    image, label = data[3]
    again, _ = data[3]
    assert tuple(image.shape) == (3, 224, 224) and image.numel() * image.element_size() == 150528
    assert (image == again).all() and not (image == data[4][0]).all() and label == 3


def test_tiny_grid_on_synthetic_data_reaps_its_workers(tiny):
    before = children()
    ctx = BenchContext(quick=True, snapshot=healthy_server(0))
    (m,) = dataloader.run(ctx)
    assert children() == before
    assert m.name == "samples_per_s" and m.unit == "samples/s" and m.value > 0 and m.peak is None
    grid = m.extra["grid"]
    assert [g["num_workers"] for g in grid] == [0, min(2, dataloader.usable_cores(ctx))]
    assert all(g["samples_per_s"] > 0 and g["startup_s"] > 0 for g in grid)
    (recommended,) = [g for g in grid if all(g[k] == v for k, v in m.extra["recommended"].items())]
    assert m.value == recommended["samples_per_s"] and m.extra["setting"] == f"num_workers={recommended['num_workers']}"
    assert m.extra["best_samples_per_s"] == max(g["samples_per_s"] for g in grid)
    assert m.extra["best"]["num_workers"] in (0, 1, 2)
    assert "single-process loader" in m.extra["recommendation"]
    assert "skipped" in m.extra["pin_memory"]
    assert m.extra["batch_bytes"] == 4 * (150528 + 8)  # uint8 images plus int64 labels
    assert "shm_warning" not in m.extra  # the builder's server has 1007 GiB of /dev/shm


def test_small_shm_is_reported(tiny):
    snapshot = healthy_server(0)
    snapshot.host.shm_total_bytes = 64 * 2**20  # docker's default
    (m,) = dataloader.run(BenchContext(quick=True, snapshot=snapshot))
    assert "/dev/shm is 64 MiB" in m.extra["shm_warning"]


def test_user_dataset_from_a_module(tiny, user_module):
    (m,) = dataloader.run(BenchContext(quick=True, dataset=f"{user_module}:build"))
    assert m.extra["dataset"] == f"--dataset {user_module}:build" and m.value > 0
    assert m.extra["batch_bytes"] == 4 * (8 * 4 + 8)


def test_a_failing_dataset_is_one_line_and_leaves_no_workers(tiny, user_module, monkeypatch):
    before = children()
    with pytest.raises(BadInput, match=r"sample \d+ is corrupt") as info:
        dataloader.run(BenchContext(quick=True, dataset=f"{user_module}:broken"))
    assert "\n" not in str(info.value)
    assert children() == before
    # with workers the error comes back from a worker process, wrapped in torch's "Caught ValueError in
    # DataLoader worker process 0. Original Traceback ...": the user sees the original line
    monkeypatch.setattr(dataloader, "worker_counts", lambda cores, quick: [2])
    with pytest.raises(BadInput, match=r"num_workers=2.*: ValueError: sample \d+ is corrupt$"):
        dataloader.run(BenchContext(quick=True, dataset=f"{user_module}:broken"))
    assert children() == before


@pytest.mark.parametrize(
    ("attribute", "message"),
    [
        ("missing", "has no attribute 'missing'"),
        ("NAME", "returned a str, not a Dataset"),
        ("NOT_CALLABLE", "'NOT_CALLABLE' is a int, not callable"),
        ("returns_int", "returned a int without __getitem__ and __len__"),
        ("raises", r"raises\(\) raised OSError: no such bucket"),
    ],
)
def test_bad_factories(user_module, attribute, message):
    with pytest.raises(BadInput, match=message):
        dataloader.load_dataset(f"{user_module}:{attribute}")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nocolon", "takes 'module:factory'"),
        (":build", "takes 'module:factory'"),
        ("mod:", "takes 'module:factory'"),
        ("redline_no_such_module_here:build", "module 'redline_no_such_module_here' not found"),
    ],
)
def test_bad_specs(spec, message):
    with pytest.raises(BadInput, match=message):
        dataloader.load_dataset(spec)


def test_the_terminal_shows_the_grid_the_winner_and_the_advice(user_module, tmp_path):
    """What --json holds is on the screen too: every setting with its rate, the one to use, and why."""
    result = run_cli(
        "bench", "dataloader", "--quick", "--dataset", f"{user_module}:build", env={"REDLINE_HOME": str(tmp_path)}
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "dataloader: every setting tried" in out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["0"], ["2"])]
    assert [row[0] for row in rows] == ["0", "2"]  # --quick: 0 and 2 workers
    assert sum("<-" in row for row in rows) == 1  # one recommended
    advice = " ".join(out.split())
    assert "use DataLoader(num_workers=" in advice and "the single-process loader" in advice


# ------------------------------------------------------------------------------------ fair comparisons


class OneThreadOnly:
    """Samples that refuse to load in a process with more than one intra-op thread: the proof that the
    single-process loader ran under the workers' budget (PyTorch gives each worker one thread)."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> tuple[Any, int]:
        import torch

        if torch.get_num_threads() != 1:
            raise RuntimeError(f"loading with {torch.get_num_threads()} threads")
        return torch.zeros(4), i


def test_the_single_process_loader_runs_with_the_workers_thread_budget(tiny):
    """The finding: num_workers=0 ran with torch's default threads (2 on 2 cores), the workers with one each, and
    the difference was reported as the workers' speed-up. Every loading process now has one thread, the grid
    says so, and the process's own thread count is given back afterwards."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(2)  # a 2-core machine's default
    try:
        ctx = BenchContext(quick=True, snapshot=healthy_server(0))
        ctx.extra["dataset"], ctx.dataset = OneThreadOnly(), "tests:one_thread_only"
        (m,) = dataloader.run(ctx)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    grid = m.extra["grid"]
    assert {g["threads"] for g in grid} == {1} and m.extra["threads_per_process"] == 1
    assert grid[0]["num_workers"] == 0
    assert "1 intra-op thread per loading process" in m.method
    assert m.size["runs"] == dataloader.REPEATS[True]
    for g in grid:  # each setting's spread over its runs' windows, the median inside it
        assert g["samples_per_s_p10"] <= g["samples_per_s"] <= g["samples_per_s_p90"]


def _result(workers: int, rates: list[float], prefetch: int | None = None, pin: bool = False) -> dataloader.Result:
    setting = dataloader.Setting(workers, prefetch if workers else None, pin)
    return dataloader.Result(setting, [0.1], rates, 1000)


def test_no_advice_from_noise():
    """prefetch_factor=4 and 2 workers that beat the default only inside the spread of their runs are not
    advised: the default stays, and the advice says why."""
    base = _result(0, [100, 104, 96, 101, 99, 103])
    advice = dataloader.advise(
        [base, _result(2, [103, 98, 105, 100, 102, 97], 2), _result(2, [106, 101, 108, 103, 104, 99], 4)]
    )
    assert advice.chosen is base and advice.best is not base
    assert "no other setting was worth its processes beyond the spread" in advice.text


def test_advice_takes_the_cheapest_setting_that_is_as_good_as_the_best_beyond_the_spread():
    base = _result(0, [100, 101, 99, 100])
    two, deeper = _result(2, [190, 200, 195, 205], 2), _result(2, [198, 204, 200, 207], 4)
    pinned = _result(2, [201, 206, 199, 208], 2, pin=True)
    advice = dataloader.advise([base, two, deeper, pinned])
    assert advice.best is pinned and advice.chosen is two  # prefetch 4 and pinning won by noise only
    assert advice.text.startswith("num_workers=2, prefetch_factor=2, pin_memory=False: 2.0x the single-process")
    assert "1 thread per process in both" in advice.text
    # a setting clearly faster than the best's spread allows is not traded for fewer processes
    four = _result(4, [390, 400, 395, 405], 2)
    assert dataloader.advise([base, two, four]).chosen is four


def test_a_gain_beyond_the_spread_but_too_small_to_pay_for_workers_is_not_advised():
    base = _result(0, [100.0, 100.1, 100.2, 99.9])
    slightly = _result(1, [102.0, 102.1, 102.2, 101.9], 2)
    assert dataloader.faster_beyond_spread(slightly, base)
    assert dataloader.advise([base, slightly]).chosen is base


def test_the_figure_is_the_recommended_settings_not_the_fastest():
    """The finding: the row showed the fastest setting's samples/s (2 workers, inside the spread) while the
    advice kept num_workers=0, so it read as if workers gave that figure. The figure, its spread and start-up
    are now the advised setting's, the row names it, and the fastest stays in the JSON under its own keys."""
    base = _result(0, [100, 104, 96, 101, 99, 103])
    two = _result(2, [103, 98, 105, 100, 102, 97], 2)
    two.startups_s = [0.5]
    m = dataloader.summarize(BenchContext(), [base, two], source="synthetic", batches=4, cores=2, device="cpu")
    assert m.extra["best"]["num_workers"] == 2 and m.extra["recommended"]["num_workers"] == 0
    assert m.value == base.samples_per_s == 100.5 and m.spread == base.spread
    assert m.repeats == len(base.windows_samples_per_s) and m.extra["startup_s"] == 0.1
    assert m.extra["best_samples_per_s"] == two.samples_per_s == 101.0
    assert m.extra["setting"] == "num_workers=0"
    assert m.method.startswith("DataLoader(num_workers=0, pin_memory=False), the setting advised below")
    # with a setting worth its workers, the figure is that setting's
    fast = _result(2, [200, 204, 196, 201], 2)
    m = dataloader.summarize(BenchContext(), [base, fast], source="synthetic", batches=4, cores=2, device="cpu")
    assert m.value == fast.samples_per_s and m.extra["setting"] == "num_workers=2"
