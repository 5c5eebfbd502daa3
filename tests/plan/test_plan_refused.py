"""A refused plan is data: where nothing fits, ``redline plan --json`` prints the closest candidates, what each
needs and why it was refused, and exits 2; the tables' output keeps its one line."""

from __future__ import annotations

import json

from test_plan_cli import one_line_error

from conftest import run_cli
from redline.plan import search
from redline.plan.estimate import Goal
from redline.plan.hardware import parse_hardware
from redline.plan.search import OUT_OF_MEMORY
from redline.plan.strategy import Strategy
from redline.workload.presets import preset_profile

TOO_BIG = ("plan", "--model", "llama-2-13b", "--hardware", "1xh100-sxm")


def test_json_says_what_the_closest_candidates_need_and_why_they_were_refused() -> None:
    result = run_cli(*TOO_BIG, "--json")
    line = one_line_error(result)
    assert line.startswith("redline: nothing fits on 1xh100-sxm: the smallest footprint (")
    data = json.loads(result.stdout)
    assert data["plan"] is None and data["ranked"] == []
    assert data["considered"] == sum(e["count"] for e in data["excluded"])
    refused = data["nothing_fits"]
    assert refused["summary"] == line.removeprefix("redline: ")
    assert refused["hardware"] == "1xh100-sxm" and refused["device_gib"] == 79.6 == refused["usable_gib"]
    closest = refused["closest"]
    assert 1 < len(closest) <= 5  # search.CLOSEST_KEPT
    needs = [candidate["needs_gib"]["device_total"] for candidate in closest]
    assert needs == sorted(needs)
    assert f"({closest[0]['label']}) needs {needs[0]:.1f} GiB per GPU of 79.6 GiB" in line
    for candidate in closest:
        assert candidate["reason"] == OUT_OF_MEMORY
        assert Strategy.from_dict(candidate["strategy"]).label() == candidate["label"]
        parts = candidate["needs_gib"]
        assert {"weights", "grads", "optimizer", "activations", "allocated", "device_total"} <= parts.keys()
        assert candidate["over_gib"] == round(parts["device_total"] - 79.6, 3) > 0
    assert refused["fits_without_pins"] is None  # nothing was pinned
    smallest = refused["smallest_hardware"]
    assert smallest and all(option["needs_gib"] <= option["device_gib"] for option in smallest)
    assert smallest[0]["gpu"] == "h100-sxm"  # more of the GPU asked for comes first, then the smallest others
    assert f"{smallest[0]['gpus']} x {smallest[0]['gpu']} ({smallest[0]['label']})" in line


def test_json_of_a_request_no_strategy_can_run_gives_the_reasons() -> None:
    result = run_cli(*TOO_BIG, "--micro-batch", "3", "--json")
    line = one_line_error(result)
    data = json.loads(result.stdout)
    assert data["nothing_fits"]["closest"] == [] and data["nothing_fits"]["smallest_hardware"] == []
    assert data["excluded"] == [{"reason": "--micro-batch 3 does not divide the per-rank batch", "count": 1}]
    assert data["nothing_fits"]["summary"] == line.removeprefix("redline: ")


def test_without_json_a_refusal_is_one_line_saying_what_the_closest_needs() -> None:
    result = run_cli(*TOO_BIG)
    line = one_line_error(result)
    assert result.stdout == ""
    assert "the smallest footprint (ddp dp1 mb1x128 bf16 ckpt=full) needs " in line and "GiB per GPU of 79.6" in line


def test_a_search_keeps_the_candidates_nearest_to_fitting() -> None:
    profile = preset_profile("llama-2-13b")
    result = search.search(profile, parse_hardware("1xh100-sxm"), Goal(global_batch=128))
    totals = [e.memory.device_total for e in result.closest_misfits]
    assert len(totals) == search.CLOSEST_KEPT and totals == sorted(totals)
    assert result.closest_misfit is result.closest_misfits[0] and not result.ranked


PINNED = {"--sharding": "fsdp", "--checkpointing": "none", "--tp": "1", "--pp": "1", "--micro-batch": "8"}
PINNED_FIELDS = {
    "--sharding": "sharding",
    "--checkpointing": "checkpointing",
    "--tp": "tensor",
    "--pp": "pipeline",
    "--micro-batch": "micro_batch",
}


def test_a_pinned_layout_that_does_not_fit_names_the_pins_in_the_way_not_other_hardware() -> None:
    """8 H100s hold a 7B Llama many ways; micro-batches of 8 uncheckpointed 4096-token sequences are not one of
    them. The answer is the pins to drop on this hardware, not a list of other (smaller) GPUs."""
    pins = [part for flag, value in PINNED.items() for part in (flag, value)]
    args = ("plan", "-m", "llama-2-7b", "--hardware", "8xh100-sxm", "--global-batch", "64", "--seq-len", "4096")
    result = run_cli(*args, "--precision", "bf16", *pins, "--json")
    line = one_line_error(result)
    refused = json.loads(result.stdout)["nothing_fits"]
    assert refused["smallest_hardware"] == [] and "Smallest hardware" not in line
    free = refused["fits_without_pins"]
    assert free["needs_gib"] <= refused["usable_gib"]
    strategy = Strategy.from_dict(free["strategy"])
    assert strategy.label() == free["label"] and f"it fits here: {free['label']} needs" in line
    assert free["pins"] and f"Without {', '.join(free['pins'])} it fits here" in line
    for pin in free["pins"]:  # each named pin is given as asked and is one the free strategy does not keep
        flag, value = pin.split(" ")
        assert PINNED[flag] == value and str(getattr(strategy, PINNED_FIELDS[flag])) != value
