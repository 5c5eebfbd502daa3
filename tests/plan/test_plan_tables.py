"""`redline plan`'s tables read whole at 80 and 120 columns: every strategy, number and mark on one line, nothing
cut with an ellipsis, no line wider than the terminal (a pipe or an SSH window is 80 columns)."""

from __future__ import annotations

import json
import re

import pytest

from conftest import run_cli
from redline.units import fmt_bytes
from tables import WIDTHS, assert_whole

# a priced instance and a run's length: the table's widest form (memory, step, rate, MFU, time to train, cost)
PRICED = ("plan", "-m", "llama-2-7b", "--hardware", "p5.48xlarge", "--tokens", "1T")
# a few cloud options, quickly: one provider, up to 2 nodes (a 2x8 row), unverified prices (the * mark)
CLOUD = ("plan", "-m", "gpt2", "--cloud", "--tokens", "300B", "--provider", "gcp", "--max-nodes", "2", "--rank", "cost")


def _text(*args: str, width: int) -> str:
    result = run_cli(*args, columns=width)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.parametrize("width", WIDTHS)
def test_the_ranked_plans_and_the_summary_are_whole(width: int) -> None:
    ranked = json.loads(_text(*PRICED, "--json", width=width))["ranked"]
    text = _text(*PRICED, width=width)
    words = {word for e in ranked for word in e["label"].split()}  # a strategy may wrap, never inside a word
    costs = [f"${e['cost_usd']:,.0f}" for e in ranked]  # the finding: "$17,4…"
    memory = [fmt_bytes(e["memory_bytes"]["device_total"]) for e in ranked]
    assert_whole(text, *words, *costs, *memory, "mem/GPU", "tokens/s", "time to train", "cost", width=width)
    assert_whole(text, "llama-2-7b", "NVIDIA H100 SXM5 80GB", "989.4 TFLOP/s", width=width)
    assert "best of" in text and "excluded" in text and "nearest miss" in text


@pytest.mark.parametrize("width", WIDTHS)
def test_a_plan_without_a_price_or_a_length_leaves_those_columns_out(width: int) -> None:
    text = _text("plan", "-m", "gpt2", "--hardware", "8xa100-sxm4-80gb", width=width)
    assert "mem/GPU" in text and "cost" not in text and "time to train" not in text
    assert_whole(text, "tokens/s", width=width)


@pytest.mark.slow
@pytest.mark.parametrize("width", WIDTHS)
def test_the_cloud_ranking_is_whole(width: int) -> None:
    ranked = json.loads(_text(*CLOUD, "--json", width=width))["ranked"]
    text = _text(*CLOUD, width=width)
    marks = ["" if o["price_verified"] else "*" for o in ranked]
    rows = [
        (o["instance"], f"${o['cost_usd']:,.0f}", f"{o['price_usd_per_hour']:,.2f}{mark}")
        for o, mark in zip(ranked, marks, strict=True)
    ]
    assert_whole(text, *(cell for row in rows for cell in row), width=width)
    for index, (instance, cost, _) in enumerate(rows, 1):  # one line per option: a table, not stacked
        assert any(line.startswith(f"{index} ") and instance in line and cost in line for line in text.splitlines())
    for index, option in enumerate(ranked, 1):  # each option's strategy, under the table
        assert_whole(text, f"#{index} runs  {option['best']['label']}", width=width)
    assert_whole(text, "2x8", "unverified", width=width)


@pytest.mark.parametrize("width", WIDTHS)
def test_the_presets_are_whole(width: int) -> None:
    text = _text("plan", "--list-models", width=width)
    assert_whole(text, "llama-2-70b", "6.74B", "traced from redline.workload.zoo", width=width)
    # in the style of the plan's other tables: titled, and flush left (the finding: each line began with a space)
    lines = text.splitlines()
    assert re.fullmatch(r"\d+ model presets \(redline plan --model NAME\)", lines[0].rstrip()) and lines[1].split() == [
        "preset",
        "params",
        "sequence",
        "profile",
    ]
    assert any(line.startswith("llama-2-70b ") for line in lines)
    assert not [line for line in lines if line.startswith(" ")], text
