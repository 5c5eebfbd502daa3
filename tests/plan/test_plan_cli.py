"""`redline plan` as a user runs it: output, plan files, JSON, and one-line errors for bad requests."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from conftest import run_cli
from redline.plan.planfile import load_plan

# what plan says on stderr of a phase still running after 2 s (ui.phase), before its answer or its error
PHASE = re.compile(r"redline: (profiling|planning|ranking cloud instances for) .+ \.\.\.")


def one_line_error(result, code: int = 2) -> str:
    """The error, one line, after any phase a long request said it was in ("redline: profiling resnet50 ...")."""
    assert result.returncode == code, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    said = [line for line in result.stderr.splitlines() if not PHASE.fullmatch(line)]
    assert len(said) == 1 and result.stderr.endswith(said[0] + "\n"), result.stderr
    return said[0]


def test_plan_a_preset_on_named_gpus(tmp_path: Path) -> None:
    out = tmp_path / "plan.yaml"
    result = run_cli("plan", "--model", "llama-2-7b", "--hardware", "8xh100-sxm", "--tokens", "1T", "-o", str(out))
    assert result.returncode == 0, result.stderr
    text = result.stdout
    for expected in ("llama-2-7b", "8 x NVIDIA H100 SXM5 80GB", "MFU", "time to train", "memory of #1", "step time"):
        assert expected in text
    plan = load_plan(out)
    assert plan.strategy.gpus == 8
    assert plan.goal["tokens"] == 1e12
    assert plan.predicted["fits"] is True
    assert plan.predicted["memory_bytes"]["device_total"] <= plan.hardware["memory_bytes"]
    assert plan.hardware["ceilings"]["matmul_flops"]["bf16"]["source"].startswith("catalog")
    # the file is YAML a person can read and edit, marked as redline's
    assert yaml.safe_load(out.read_text())["redline_plan"] == 1


def test_plan_json_ranks_and_explains_exclusions() -> None:
    result = run_cli("plan", "-m", "gpt2", "--hardware", "8xa100-sxm4-80gb", "--global-batch", "64", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    times = [r["step_time_s"]["total"] for r in data["ranked"]]
    assert times == sorted(times) and len(times) == 5
    reasons = {e["reason"] for e in data["excluded"]}
    assert "tensor degree 8 does not divide the attention heads" in reasons
    assert data["plan"]["strategy"] == data["ranked"][0]["strategy"]


def test_plan_does_not_overwrite_a_users_file(tmp_path: Path) -> None:
    mine = tmp_path / "notes.yaml"
    mine.write_text("my: notes\n")
    result = run_cli("plan", "-m", "gpt2", "--hardware", "1xh100-sxm", "-o", str(mine))
    one_line_error(result)
    assert mine.read_text() == "my: notes\n"


def test_plan_for_a_cloud_instance_has_a_cost() -> None:
    result = run_cli("plan", "-m", "llama-2-7b", "--hardware", "p5.48xlarge", "--tokens", "10B", "--json")
    assert result.returncode == 0, result.stderr
    best = json.loads(result.stdout)["ranked"][0]
    assert best["cost_usd"] > 0
    hours = best["time_to_train_s"] / 3600
    assert best["cost_usd"] == pytest.approx(hours * 55.04, rel=1e-6)


@pytest.mark.slow
def test_cloud_ranks_instances_and_meets_a_deadline() -> None:
    result = run_cli(
        "plan",
        "-m",
        "gpt2-xl",
        "--cloud",
        "--tokens",
        "20B",
        "--rank",
        "cost",
        "--max-nodes",
        "2",
        "--provider",
        "aws",
        "--deadline",
        "2d",
        "--json",
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    costs = [o["cost_usd"] for o in data["ranked"]]
    assert costs == sorted(costs)
    assert all(o["time_to_train_s"] <= 2 * 86400 for o in data["ranked"])
    assert {o["provider"] for o in data["ranked"]} == {"aws"}
    assert all(o["price_verified"] for o in data["ranked"])  # AWS rows carry no UNVERIFIED flag


def test_list_models() -> None:
    result = run_cli("plan", "--list-models", "--json")
    names = {row["name"] for row in json.loads(result.stdout)}
    assert {"gpt2", "llama-2-70b", "llama-3-8b", "bert-large", "t5-3b", "resnet50", "vit-b-16"} <= names


def test_bare_parameter_count_says_the_shape_is_assumed() -> None:
    result = run_cli("plan", "--params", "1.3B", "--hardware", "8xa100-sxm4-40gb")
    assert result.returncode == 0, result.stderr
    assert "assumed a GPT-style shape" in result.stdout


@pytest.mark.slow
def test_hf_config_json(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": 2048,
                "intermediate_size": 5632,
                "num_hidden_layers": 22,
                "num_attention_heads": 32,
                "num_key_value_heads": 4,
                "vocab_size": 32000,
                "max_position_embeddings": 2048,
            }
        )
    )
    result = run_cli("plan", "-m", str(config), "--hardware", "1xa10g", "--global-batch", "32", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert 1.0e9 < data["plan"]["model"]["params"] < 1.2e9  # TinyLlama-1.1B's shape


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-m", "gpt5"], "unknown model 'gpt5'"),
        (["-m", "gpt2", "--hardware", "8xh900"], "unknown GPU"),
        (["-m", "gpt2", "--hardware", "not-a-machine"], "not a GPU"),
        (
            ["-m", "gpt2", "--hardware", "8xh100-sxm", "--global-batch", "7", "--tp", "1", "--pp", "1"],
            "global batch not divisible",
        ),
        (["-m", "gpt2", "--hardware", "8xh100-sxm", "--pp", "16"], "more pipeline stages than the model has blocks"),
        (["-m", "gpt2", "--precision", "int4"], "--precision 'int4'"),
        (["-m", "gpt2", "--tokens", "lots"], "--tokens"),
        (["-m", "gpt2", "--cloud"], "--cloud compares the cost"),
        (["--params", "7B", "-m", "gpt2"], "give the model as"),
        (["-m", "llama-2-7b", "--hardware", "1xh100-sxm", "--rank", "cost"], "has no price"),
        (["-m", "gpt2", "--hardware", "8xv100-sxm2-16gb", "--precision", "bf16"], "no bf16 rate"),
    ],
)
def test_impossible_or_malformed_requests_are_one_line(args: list[str], message: str) -> None:
    assert message in one_line_error(run_cli("plan", *args))


@pytest.mark.slow
def test_a_model_that_fits_nowhere_names_the_smallest_hardware_that_would() -> None:
    error = one_line_error(run_cli("plan", "-m", "llama-2-70b", "--hardware", "1xrtx-4090", timeout=600))
    assert "nothing fits on 1xrtx-4090" in error
    assert "Smallest hardware that fits (micro-batch 1, full checkpointing):" in error


def test_malformed_config_and_factory_errors(tmp_path: Path) -> None:
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    assert "not valid JSON" in one_line_error(run_cli("plan", "-m", str(bad), "--hardware", "1xh100-sxm"))
    (tmp_path / "mymodels.py").write_text("def build():\n    raise ValueError('no weights here')\n")
    result = run_cli(
        "plan",
        "-m",
        "mymodels:build",
        "--input-shape",
        "3,32,32",
        "--hardware",
        "1xh100-sxm",
        env={"PYTHONPATH": str(tmp_path)},
    )
    assert "no weights here" in one_line_error(result)


def test_local_cpu_needs_measured_ceilings(tmp_path: Path) -> None:
    result = run_cli("plan", "-m", "gpt2", "--hardware", "local", env={"REDLINE_HOME": str(tmp_path)})
    # this machine may have a GPU (then it plans) or not (then it asks for bench figures, exit 2)
    if result.returncode != 0:
        assert "redline bench compute memory --save" in one_line_error(result)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-m", "gpt2", "--cloud", "--tokens", "1B", "--global-batch", "-4"], "--global-batch must be at least 1"),
        (["--params", "1e400"], "--params"),
        (["--params", "1e30"], "--params"),
        (["-m", "gpt2", "--tokens", "1e400"], "--tokens"),
        (["-m", "gpt2", "--cloud", "--tokens", "1B", "--deadline", "abc"], "--deadline 'abc'"),
        (["-m", "gpt2", "--cloud", "--tokens", "1B", "--provider", "nosuch"], "--provider nosuch"),
        (["-m", "resnet50", "--tokens", "1B", "--hardware", "1xh100-sxm"], "not tokens"),
        (["-m", "gpt2", "--deadline", "7d", "--hardware", "1xh100-sxm"], "--deadline goes with --cloud"),
        (["-m", "gpt2", "--hardware", "8xh100-sxm", "--sharding", "hsdp"], "--nodes > 1"),
        (["-m", "gpt2", "--hardware", "64xh100-sxm"], "at most 8 GPUs"),
        (["-m", "gpt2", "--nodes", "abc"], "Invalid value for '--nodes'"),
    ],
)
def test_more_bad_requests_are_one_line(args: list[str], message: str) -> None:
    assert message in one_line_error(run_cli("plan", *args, timeout=600))


@pytest.mark.parametrize(("field", "value"), [("n_layer", 0), ("n_embd", "abc")])
def test_a_malformed_known_config_is_an_error_even_with_transformers(tmp_path: Path, field: str, value) -> None:
    config = {
        "model_type": "gpt2",
        "n_embd": 768,
        "n_layer": 12,
        "n_head": 12,
        "n_positions": 1024,
        "vocab_size": 50257,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config | {field: value}))
    one_line_error(run_cli("plan", "-m", str(path), "--hardware", "1xh100-sxm"))


def test_the_layout_switches_and_the_schedule_reach_the_plan(tmp_path: Path) -> None:
    out = tmp_path / "plan.yaml"
    args = ("plan", "-m", "llama-2-7b", "--hardware", "8xh100-sxm", "--global-batch", "64", "--pp", "4", "--tp", "2")
    result = run_cli(
        *args,
        *("--checkpointing", "selective", "--no-sequence-parallel", "--no-flash-attention"),
        *("--schedule", "interleaved", "--virtual-stages", "4", "--memory-margin", "0.1", "-o", str(out)),
    )
    assert result.returncode == 0, result.stderr
    strategy = load_plan(out).strategy
    assert (strategy.checkpointing, strategy.sequence_parallel, strategy.flash_attention) == ("selective", False, False)
    assert (strategy.schedule, strategy.virtual_stages) == ("interleaved", 4)
    assert load_plan(out).predicted["memory_bytes"]["device_total"] <= 0.9 * load_plan(out).hardware["memory_bytes"]


def test_analytic_profiles_a_config_by_formula(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {"model_type": "gpt2", "n_embd": 256, "n_layer": 4, "n_head": 4, "n_positions": 256, "vocab_size": 1000}
        )
    )
    result = run_cli("plan", "-m", str(config), "--analytic", "--hardware", "1xh100-sxm", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["plan"]["model"]["method"] == "analytic"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--checkpointing", "some"], "--checkpointing 'some' is not one of none, selective, full"),
        (["--schedule", "zigzag"], "--schedule 'zigzag' is not one of gpipe, 1f1b, interleaved"),
        (["--virtual-stages", "2"], "--virtual-stages goes with --schedule interleaved"),
        (["--schedule", "interleaved", "--virtual-stages", "1"], "--virtual-stages must be at least 2"),
        (["--memory-margin", "1.5"], "--memory-margin must be a fraction"),
        (["--memory-margin", "-0.1"], "--memory-margin must be a fraction"),
        (["--analytic", "-m", "resnet50"], "--analytic: preset 'resnet50' is traced"),
    ],
)
def test_bad_layout_options_are_one_line(args: list[str], message: str) -> None:
    base = ["-m", "gpt2"] if "-m" not in args else []
    assert message in one_line_error(run_cli("plan", *base, *args, "--hardware", "8xh100-sxm"))
