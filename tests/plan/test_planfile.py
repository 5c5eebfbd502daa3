"""The plan file round-trips, and a broken one is a one-line error naming the file."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from redline.errors import BadInput
from redline.plan.estimate import Goal
from redline.plan.hardware import parse_hardware
from redline.plan.planfile import dump_plan, load_plan, make_plan
from redline.plan.search import search
from redline.plan.strategy import Strategy
from redline.workload.presets import preset_profile


@pytest.fixture
def plan_path(tmp_path: Path) -> Path:
    profile = preset_profile("gpt2")
    cluster = parse_hardware("8xa100-sxm4-80gb")
    goal = Goal(global_batch=64, tokens=1e9)
    best = search(profile, cluster, goal).ranked[0]
    path = tmp_path / "plan.yaml"
    path.write_text(dump_plan(make_plan(profile, cluster, goal, best, ["a note"])))
    return path


def test_round_trip(plan_path: Path) -> None:
    plan = load_plan(plan_path)
    assert plan.strategy.global_batch == 64
    assert plan.model["name"] == "gpt2"
    assert plan.predicted["step_time_s"]["total"] > 0
    assert plan.notes == ("a note",)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.pop("redline_plan"), "not a redline plan"),
        (lambda d: d.update(redline_plan=99), "plan schema 99"),
        (lambda d: d["strategy"].update(warp_drive=True), "unknown strategy fields: warp_drive"),
        (lambda d: d["strategy"].update(micro_batch=0), "micro_batch must be a positive integer"),
        (lambda d: d.pop("strategy"), "malformed plan"),
    ],
)
def test_broken_plans_are_one_line(plan_path: Path, mutate, message: str) -> None:
    data = yaml.safe_load(plan_path.read_text())
    mutate(data)
    plan_path.write_text(yaml.safe_dump(data))
    with pytest.raises(BadInput, match=message) as caught:
        load_plan(plan_path)
    assert "\n" not in str(caught.value)


def test_not_yaml_or_missing(tmp_path: Path) -> None:
    bad = tmp_path / "plan.yaml"
    bad.write_text("strategy: [unclosed\n")
    with pytest.raises(BadInput, match="not valid YAML at line"):
        load_plan(bad)
    with pytest.raises(BadInput, match="no such plan file"):
        load_plan(tmp_path / "missing.yaml")


def test_the_runtime_section_round_trips_and_an_older_plan_without_it_loads(tmp_path: Path) -> None:
    profile = preset_profile("gpt2")
    cluster = parse_hardware("8xa100-sxm4-80gb")
    goal = Goal(global_batch=64, tokens=1e9)
    best = search(profile, cluster, goal).ranked[0]
    path = tmp_path / "plan.yaml"
    runtime = {"metrics": {"path": "m-{rank}.jsonl"}, "data": {"num_workers": 4}}
    path.write_text(dump_plan(make_plan(profile, cluster, goal, best, runtime=runtime)))
    assert load_plan(path).runtime == runtime
    data = yaml.safe_load(path.read_text())
    del data["runtime"]  # as redline wrote plans before the section existed
    path.write_text(yaml.safe_dump(data))
    assert load_plan(path).runtime == {}


def test_the_schedule_round_trips_and_an_older_plan_without_it_loads(plan_path: Path) -> None:
    data = yaml.safe_load(plan_path.read_text())
    data["strategy"].update(data=2, pipeline=4, schedule="interleaved", virtual_stages=3, accumulation=8)
    plan_path.write_text(yaml.safe_dump(data))
    strategy = load_plan(plan_path).strategy
    assert (strategy.schedule, strategy.virtual_stages) == ("interleaved", 3)
    assert "pp4:interleavedx3" in strategy.label()
    for name in ("schedule", "virtual_stages"):  # as redline wrote plans before pipeline schedules were choices
        del data["strategy"][name]
    plan_path.write_text(yaml.safe_dump(data))
    assert (load_plan(plan_path).strategy.schedule, load_plan(plan_path).strategy.virtual_stages) == ("1f1b", 1)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"schedule": "zigzag"}, "Strategy.schedule 'zigzag' is not one of gpipe, 1f1b, interleaved"),
        ({"virtual_stages": 0}, "virtual_stages must be a positive integer"),
        ({"pipeline": 4, "virtual_stages": 2}, "virtual_stages 2 needs the interleaved schedule, not 1f1b"),
        ({"schedule": "interleaved", "virtual_stages": 2}, "interleaved schedule needs pipeline > 1"),
        ({"pipeline": 4, "schedule": "interleaved"}, "virtual_stages > 1"),
    ],
)
def test_a_schedule_that_cannot_run_is_refused(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Strategy(**fields)


def test_the_label_names_the_schedule_only_with_a_pipeline() -> None:
    assert Strategy(data=8).label() == "ddp dp8 mb1x1 bf16"
    assert Strategy(pipeline=2, schedule="gpipe").label() == "ddp dp1 pp2:gpipe mb1x1 bf16"
    assert (
        Strategy(flash_attention=False, checkpointing="selective").label() == "ddp dp1 mb1x1 bf16 ckpt=selective -flash"
    )
