"""dataloader suite: the settings grid, a tiny run, workers reaped (also on error), --dataset specs."""

from __future__ import annotations

import sys
import textwrap
import uuid

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
    assert m.value == max(g["samples_per_s"] for g in grid)
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
