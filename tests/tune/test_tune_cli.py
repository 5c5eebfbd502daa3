"""`redline tune` on real runs: every trial is the script launched by `redline run` in its own process group."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from conftest import run_cli
from redline.bench.store import load
from redline.tune.space import Candidate, Machine, default_plan
from redline.tune.trial import Setup, run_trial

SCRIPT = """
    import os, sys, time
    import torch
    import redline

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    data = torch.utils.data.TensorDataset(torch.randn(2048, 32), torch.randn(2048, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=64)
    run = redline.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01), loader)
    for x, y in run.micro_batches():
        if os.environ.get("HANG"):
            time.sleep(3600)
        with run.accumulate():
            if x.shape[0] > int(os.environ.get("FITS", "1000000")):  # a device with room for FITS samples
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            run.backward(torch.nn.functional.mse_loss(run.model(x), y))
"""


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(SCRIPT))
    return path


def tune_args(script: Path, cache: Path, *extra: str) -> list[str]:
    # a small space: the micro-batch, bf16 and one thread count
    space = ("--space", "compile=", "--space", "num_workers=", "--space", "cpu_threads=1")
    return ["tune", "--trial-steps", "3", "--warmup", "1", *space, "--cache-dir", str(cache), *extra, str(script)]


@pytest.mark.slow
def test_tune_writes_a_plan_redline_run_runs_and_a_second_tune_is_a_cache_hit(tmp_path: Path, script: Path) -> None:
    tuned = tmp_path / "tuned.yaml"
    result = run_cli(*tune_args(script, tmp_path / "cache", "--json", "-o", str(tuned)))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    ran = [t for t in report["trials"] if not t["cached"]]
    assert report["baseline"]["status"] == "ok" and len(ran) >= 5
    assert report["winner"] is not None and report["speedup"] > 0  # its size is this machine's: not asserted
    assert report["parity"].startswith("loss within"), report["parity"]  # the script seeds its model
    configs = {c["config"]: c for c in report["configs"]}  # each config's runs, their median and spread
    winner = configs[Candidate.from_dict(report["winner"]).key()]
    assert len(winner["runs"]) >= 2 and winner["median"] == pytest.approx(report["winner_samples_per_s"])
    assert report["spread"] == pytest.approx(max(c["spread"] for c in configs.values() if len(c["runs"]) > 1))
    for trial in ran:  # every trial that ran measured the steps asked, through the runtime's metrics
        assert trial["status"] == "ok", trial
        assert len(trial["losses"]) == 4 and trial["samples_per_step"] == 64
    result = run_cli("run", "--plan", str(tuned), str(script), "--max-steps", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    page = tmp_path / "tune.html"
    again = run_cli(*tune_args(script, tmp_path / "cache", "--json", "--html", str(page)))
    assert again.returncode == 0, again.stderr[-3000:]
    second = json.loads(again.stdout)
    assert all(t["cached"] for t in second["trials"]) and second["winner"] == report["winner"]
    html = page.read_text()  # the report: the plot inline, a row per trial
    assert html.count("data:image/png;base64,") == 1 and html.count("<tr><td>") == len(second["trials"])


@pytest.mark.slow
def test_a_tune_killed_with_sigkill_goes_on_where_it_stopped(tmp_path: Path, script: Path) -> None:
    cache = tmp_path / "cache"
    command = [sys.executable, "-m", "redline", *tune_args(script, cache, "--json")]
    tune = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        while not list(cache.glob("*.jsonl")) or len(next(cache.glob("*.jsonl")).read_text().splitlines()) < 4:
            assert tune.poll() is None, "the tune ended before it could be killed"
            time.sleep(0.2)
    finally:
        os.killpg(tune.pid, signal.SIGKILL)
        tune.wait()
    journal = next(cache.glob("*.jsonl"))
    kept = [json.loads(line)["key"] for line in journal.read_text().splitlines()[1:]]
    result = run_cli(*tune_args(script, cache, "--json"))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["winner"] is not None and report["trials"][0]["cached"]  # the baseline, from the journal
    keys = [json.loads(line)["key"] for line in journal.read_text().splitlines()[1:]]
    assert keys[: len(kept)] == kept and len(keys) == len(set(keys))  # kept, and no trial run twice


@pytest.mark.slow
def test_a_trial_that_runs_out_of_memory_is_told_apart(tmp_path: Path, script: Path) -> None:
    """The runtime goes on at a smaller micro-batch after an out-of-memory: for the tune, the candidate did not
    fit."""
    plan = default_plan(Machine(cuda=False, bf16=True, cpus_per_rank=1, ranks=1), 64)
    setup = Setup(script=str(script), warmup_steps=1, steps=2)
    os.environ["FITS"] = "32"
    try:
        result = run_trial(setup, plan, tmp_path / "oom")
    finally:
        del os.environ["FITS"]
    assert result.status == "oom" and "micro-batch 64 ran out of memory (the run went on at 32)" in result.why


@pytest.mark.slow
def test_a_trial_that_hangs_is_stopped_with_its_processes(tmp_path: Path, script: Path) -> None:
    setup = Setup(script=str(script), warmup_steps=1, steps=2, timeout_s=20)
    os.environ["HANG"] = "1"
    try:
        result = run_trial(setup, None, tmp_path / "hang")
    finally:
        del os.environ["HANG"]
    assert result.status == "hang" and result.why == "no end after 20 s"
    leftover = subprocess.run(["pgrep", "-f", str(script)], capture_output=True, text=True).stdout.split()
    assert leftover == []


@pytest.mark.slow
def test_bad_input_is_one_line(tmp_path: Path, script: Path) -> None:
    for args, message in (
        (["tune", str(tmp_path / "nope.py")], "no such script"),
        (["tune", "--space", "colour=red", str(script)], "--space takes KNOB=V1,V2"),
        (["tune", "--space", "precision=fp64", str(script)], "--space precision takes fp32, bf16, fp16, fp8"),
        (["tune", "--budget", "soon", str(script)], "is not a duration"),
        (["tune", "-o", str(script), str(script)], "was not written by redline"),  # before any trial
        (["tune", "--seq-len", "8", str(script)], "--seq-len and --input-shape go with --model"),
        (["tune", "-m", "nosuchmodel", str(script)], "unknown model 'nosuchmodel'"),
        (["tune", "-m", "nosuch.module:build", str(script)], "cannot import nosuch.module"),
    ):
        result = run_cli(*args)
        assert result.returncode == 2 and message in result.stderr and result.stderr.count("\n") == 1, result.stderr


def test_dry_run_lists_the_knobs_and_runs_nothing(tmp_path: Path, script: Path) -> None:
    result = run_cli("tune", "--dry-run", "--json", "--cache-dir", str(tmp_path / "cache"), str(script))
    assert result.returncode == 0, result.stderr
    listed = json.loads(result.stdout)
    assert listed["knobs"]["precision"] == ["default", "bf16"] and listed["trials_about"] >= 6
    assert not (tmp_path / "cache").exists()


# the script's model as a factory, as `redline plan -m` and `redline tune -m` take it
MODELS = """
import torch

def build():
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)), (32,)
"""


@pytest.fixture
def planned(tmp_path: Path, measured_home: Path) -> dict[str, str]:
    """The environment of a user who saved this CPU's ceilings and has the model's factory importable."""
    (tmp_path / "tunemodels.py").write_text(MODELS)
    return {
        "REDLINE_HOME": str(measured_home),
        "PYTHONPATH": str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }


@pytest.mark.slow
def test_the_planner_predicts_the_trials_of_a_plan_made_for_the_model(
    tmp_path: Path, script: Path, planned: dict[str, str]
) -> None:
    """A plan file records how to load its model; a dry run over it lists the planner's prediction of every
    micro-batch and knob value, the base config's the plan's own; `-m` does the same without the plan's."""
    plan = tmp_path / "plan.yaml"
    args = ("-m", "tunemodels:build", "--input-shape", "32", "--hardware", "local", "--global-batch", "64")
    result = run_cli("plan", *args, "--precision", "fp32", "-o", str(plan), env=planned)
    assert result.returncode == 0, result.stderr
    written = yaml.safe_load(plan.read_text())
    assert written["model"]["load"] == {"model": "tunemodels:build", "input_shape": [32]}
    dry = run_cli("tune", "--plan", str(plan), "--dry-run", "--json", str(script), env=planned)
    assert dry.returncode == 0, dry.stderr
    predicted = {row["config"]: row for row in json.loads(dry.stdout)["predicted"]}
    base = written["strategy"]["micro_batch"]
    per_rank = base * written["strategy"]["accumulation"]
    assert {f"mb={m}" for m in range(1, per_rank + 1) if per_rank % m == 0} <= set(predicted)
    assert predicted[f"mb={base}"]["samples_per_s"] == pytest.approx(written["predicted"]["samples_per_s"])
    home = Path(planned["REDLINE_HOME"])
    saved = {m.name: m.value for f in home.glob("bench/*/*.json") for m in load(f).measurements}
    if saved["matmul_bf16"] < saved["matmul_fp32"]:  # bf16 emulated on this CPU, as bench measured: left out
        assert not any("bf16" in config for config in predicted)
    else:  # a CPU that runs bf16 as fast (AMX): tried, and predicted from bench's bf16 figure
        assert predicted[f"mb={base} precision=bf16"]["step_s"] != predicted[f"mb={base}"]["step_s"]
    # a larger micro-batch keeps more activations
    assert predicted[f"mb={per_rank}"]["peak_bytes"] > predicted["mb=1"]["peak_bytes"]
    again = run_cli(
        "tune",
        "--plan",
        str(plan),
        "-m",
        "tunemodels:build",
        "--input-shape",
        "32",
        "--dry-run",
        "--json",
        str(script),
        env=planned,
    )
    assert json.loads(again.stdout)["predicted"] == json.loads(dry.stdout)["predicted"]
    text = run_cli("tune", "--plan", str(plan), "--dry-run", str(script), env=planned | {"COLUMNS": "200"})
    assert "the planner's prediction for tunemodels:build" in text.stdout


def test_without_this_cpus_ceilings_the_tune_says_the_planner_cannot_rank(
    tmp_path: Path, script: Path, planned: dict[str, str]
) -> None:
    bare = planned | {"REDLINE_HOME": str(tmp_path / "empty")}
    result = run_cli("tune", "-m", "tunemodels:build", "--input-shape", "32", "--dry-run", str(script), env=bare)
    assert result.returncode == 0, result.stderr
    assert "the planner does not rank the trials: this machine has no GPU" in result.stderr
    assert "redline bench compute memory --save" in result.stderr


@pytest.mark.slow
def test_a_tune_with_the_model_shows_the_planners_figure_beside_each_trial(
    tmp_path: Path, script: Path, planned: dict[str, str]
) -> None:
    model = ("-m", "tunemodels:build", "--input-shape", "32", "--max-trials", "4")
    result = run_cli(*tune_args(script, tmp_path / "cache", *model, "--json"), env=planned)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    ran = [t for t in report["trials"] if t["config"] is not None]
    assert ran and all(t["predicted_samples_per_s"] > 0 for t in ran)
    assert report["predicted_samples_per_s"]["default"] > 0 and report["predicted_samples_per_s"]["winner"] > 0
