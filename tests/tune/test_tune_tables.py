"""`redline tune`'s tables readable at 80 and 120 columns: the trials, the knobs a dry run lists and the
planner's prediction, every config, figure and status whole on a line, nothing cut, no line past the width
(through ``ui.print_table``; in process, the search on the fake device of test_search)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console
from rich.table import Table
from test_search import GIB, MACHINE, PER_RANK, FakeDevice, tuner

from redline.cli import ui
from redline.cli.tune import knobs_table, prediction_table, trials_table
from redline.tune.predict import Prediction
from redline.tune.space import Machine, default_plan, default_space
from tables import WIDTHS, assert_whole


def _drawn(table: Table, width: int) -> str:
    out = io.StringIO()
    ui.print_table(table, out=Console(file=out, width=width, color_system=None, markup=False))
    return out.getvalue()


@pytest.mark.parametrize("width", WIDTHS)
def test_the_trials_are_whole_at_any_width(tmp_path: Path, width: int) -> None:
    base = default_plan(MACHINE, PER_RANK)
    base["strategy"] |= {"micro_batch": 8, "accumulation": 8}
    outcome = tuner(tmp_path, FakeDevice(memory=20 * GIB), space={"precision": [None, "fp16"]}, base_plan=base).tune()
    text = _drawn(trials_table(outcome), width)
    assert_whole(text, "baseline", "mb=32", "precision=fp16", "198.0", "323.2", "17.00", "(spread", width=width)
    assert_whole(text, "oom:", "64 ran out of", width=width)
    assert "planned/s" not in text  # no planner: a column of nothing is left out
    assert ("┃ config" in text) == (width >= 120)  # a table where it fits, else one block per trial


@pytest.mark.parametrize("width", WIDTHS)
def test_the_dry_runs_knobs_and_predictions_are_whole_at_any_width(width: int) -> None:
    space = default_space(Machine(cuda=True, bf16=True, cpus_per_rank=4, ranks=1))
    values = {knob: ["default" if v is None else v for v in vs] for knob, vs in space.items()}
    knobs = _drawn(knobs_table(values), width)
    assert_whole(knobs, "micro_batch", "precision", "fp16", "selective", "per-rank", width=width)
    rows = [
        ("micro_batch=8,accumulation=8", Prediction(0.412, 155.3, 9.5 * GIB)),
        ("micro_batch=32,accumulation=2,precision=bf16", Prediction(0.198, 323.2, 21.25 * GIB)),
    ]
    predicted = _drawn(prediction_table("tunemodels:build", rows), width)
    assert_whole(predicted, "micro_batch=32,accumulation=2,precision=bf16", "198.0", "323.2", "2.08", width=width)
    assert_whole(predicted, "21.2 GiB", "tunemodels:build", width=width)
