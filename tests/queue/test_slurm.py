"""The Slurm engine against a real single-node Slurm (Debian's slurmctld + slurmd, started here by slurmlocal) with
two GPUs that are device files: jobs that end well, fail, are cancelled or run out of time, GPUs handed to a job,
the captured environment, what sbatch refuses; and the batch script for a job on several nodes, run under bash with
stand-ins for srun, scontrol and torchrun (one machine cannot be two Slurm nodes)."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from redline.errors import BadInput
from redline.queue import slurm
from redline.queue.spec import FINAL_STATES, JobSpec
from slurmlocal import LocalSlurm, unavailable_reason

pytestmark = pytest.mark.system

HANG_S = 300.0  # only a hung cluster gets here: each wait ends when the job does


def _local_slurm(**options):
    """A local Slurm for this module; everything it made is gone afterwards."""
    reason = unavailable_reason(options.get("accounting", False))
    if reason:
        pytest.skip(reason)
    root = Path(tempfile.mkdtemp(prefix="redline-slurm-"))
    try:
        with LocalSlurm(root / "cluster", gpus=2, **options) as running:
            yield running
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster_without_accounting():
    yield from _local_slurm()


@pytest.fixture(scope="module")
def cluster_with_accounting():
    """With slurmdbd, and a controller that forgets an ended job after 2 s, so sacct has to answer for it."""
    yield from _local_slurm(accounting=True, min_job_age_s=2)


@pytest.fixture
def cluster(cluster_without_accounting, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("SLURM_CONF", str(cluster_without_accounting.conf))
    return cluster_without_accounting


@pytest.fixture
def accounted(cluster_with_accounting, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("SLURM_CONF", str(cluster_with_accounting.conf))
    return cluster_with_accounting


@pytest.fixture
def workdir(cluster, tmp_path: Path) -> Path:
    return tmp_path


def wait_final(job_id: str):
    deadline = time.monotonic() + HANG_S
    while True:
        job = slurm.status([job_id])[job_id]
        if job.state in FINAL_STATES:
            return job
        assert time.monotonic() < deadline, f"job {job_id} still {job.state} ({job.reason}) after {HANG_S:.0f} s"
        time.sleep(0.2)


def wait_running(job_id: str):
    deadline = time.monotonic() + HANG_S
    while (job := slurm.status([job_id])[job_id]).state != "running":
        assert job.state not in FINAL_STATES, f"job {job_id} ended before it ran: {job}"
        assert time.monotonic() < deadline, f"job {job_id} still {job.state} ({job.reason})"
        time.sleep(0.2)
    return job


def sh(line: str, workdir: Path, **fields) -> JobSpec:
    return JobSpec(argv=("bash", "-c", line), cwd=str(workdir), env=dict(os.environ), **fields)


# ---- the batch script ----


def test_render_one_node_lines_and_exact_argv():
    spec = JobSpec(
        argv=("python", "train.py", "--note", "it's $HOME; rm -rf /"),
        name="my run",
        gpus=2,
        time_limit_s=90,
        queue="gpu",
        cwd="/work/my dir",
        after=("11", "12"),
        priority=5,
        retries=1,
        plan="plans/a.yaml",
    )
    script = slurm.render(spec)
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    for line in (
        '#SBATCH --job-name="my run"',
        "#SBATCH --nodes=1",
        "#SBATCH --gres=gpu:2",
        "#SBATCH --time=0-00:01:30",
        "#SBATCH --partition=gpu",
        '#SBATCH --chdir="/work/my dir"',
        "#SBATCH --output=redline-%x-%j.log",
        "#SBATCH --export=ALL",
        "#SBATCH --dependency=afterok:11:12",
        "#SBATCH --nice=-5",
        "#SBATCH --requeue",
        "export REDLINE_PLAN='/work/my dir/plans/a.yaml'",
    ):
        assert line in lines, f"{line!r} not in the script:\n{script}"
    assert lines[-1] == "exec " + shlex.join(spec.argv)
    assert shlex.split(lines[-1])[1:] == list(spec.argv)  # the shell reads back exactly the argv
    assert "srun" not in script and "--ntasks-per-node" not in script
    assert subprocess.run(["bash", "-n"], input=script, text=True, check=False).returncode == 0


def test_render_defaults_and_refusals():
    script = slurm.render(JobSpec(argv=("/bin/true",)))
    assert "#SBATCH --job-name=true" in script and "#SBATCH --no-requeue" in script
    assert not any(word in script for word in ("--gres", "--time", "--partition", "--chdir", "--nice", "REDLINE_PLAN"))
    assert slurm.slurm_time(3 * 86400 + 3600 + 61.2) == "3-01:01:02"
    with pytest.raises(BadInput, match="double quote") as caught:
        slurm.render(JobSpec(argv=("x",), name='say "hi"'))
    assert "\n" not in str(caught.value)


def _run_launch(script: str, tmp_path: Path) -> list[str]:
    """Run the script's lines after the #SBATCH ones under bash as node 1 of 2 would, with stand-ins for
    scontrol (the node list), srun (runs its command, or answers the head's address) and torchrun (records its
    argv): what torchrun is finally started with."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_ins = {
        "scontrol": 'printf "node-a\\nnode-b\\n"',
        "srun": 'if [ "${*: -2:1}" = hostname ]; then echo "10.1.2.3 fd00::3"; else exec "$@"; fi',
        "torchrun": f'for a in "$@"; do printf "%s\\n" "$a"; done > {tmp_path}/torchrun.argv',
    }
    for name, body in stand_ins.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_NNODES": "2", "SLURM_JOB_ID": "77"}
    env["SLURM_JOB_NODELIST"] = "node-[a-b]"
    result = subprocess.run(["bash"], input=script, text=True, env=env, capture_output=True, check=False)
    assert result.returncode == 0, result.stderr
    return (tmp_path / "torchrun.argv").read_text().splitlines()


def test_render_several_nodes_runs_torchrun_under_srun(tmp_path: Path):
    spec = JobSpec(argv=("python", "train.py", "--name", "a b", "$HOME"), nodes=2, gpus=4)
    script = slurm.render(spec)
    assert "#SBATCH --nodes=2" in script and "#SBATCH --ntasks-per-node=1" in script
    assert "#SBATCH --gres=gpu:4" in script
    assert (
        'exec srun torchrun --nnodes "$SLURM_NNODES" --nproc-per-node 4 --rdzv-id "$SLURM_JOB_ID" '
        "--rdzv-backend c10d --rdzv-endpoint \"$head_addr:29500\" --no-python python train.py --name 'a b' '$HOME'"
    ) in script.splitlines()
    argv = _run_launch(script, tmp_path)
    assert argv == [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "4",
        "--rdzv-id",
        "77",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "10.1.2.3:29500",
        "--no-python",
        "python",
        "train.py",
        "--name",
        "a b",
        "$HOME",
    ]


def test_render_several_nodes_keeps_a_torchrun_argv_options_last(tmp_path: Path):
    spec = JobSpec(argv=("torchrun", "--nproc-per-node", "2", "train.py"), nodes=3, gpus=8)
    argv = _run_launch(slurm.render(spec), tmp_path)
    assert argv[-3:] == ["--nproc-per-node", "2", "train.py"]  # the user's, after ours: argparse keeps the last
    assert "--no-python" not in argv and argv[:2] == ["--nnodes", "2"]


def test_render_several_nodes_without_gpus_is_one_task_per_node():
    script = slurm.render(JobSpec(argv=("hostname",), nodes=2))
    assert script.splitlines()[-1] == "exec srun hostname" and "torchrun" not in script


def test_no_sbatch_is_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("PATH", str(tmp_path))
    for call in (lambda: slurm.submit(JobSpec(argv=("true",))), lambda: slurm.status(["1"]), slurm.jobs):
        with pytest.raises(BadInput, match="not on PATH") as caught:
            call()
        assert "\n" not in str(caught.value)


# ---- a real Slurm ----


def test_job_that_ends_well(workdir: Path):
    spec = sh("echo hello > out.txt", workdir, name="writer")
    job_id = slurm.submit(spec)
    assert job_id.isdigit()
    job = wait_final(job_id)
    assert (job.state, job.exit_code, job.name, job.id) == ("done", 0, "writer", job_id)
    assert job.user == "root" and job.submitted_at <= job.started_at <= job.ended_at
    assert (workdir / "out.txt").read_text() == "hello\n"
    assert (workdir / f"redline-writer-{job_id}.log").exists()


def test_argv_reaches_the_job_exactly(workdir: Path):
    words = ["it's", "$HOME", "a  b", "; false", '"q"', "*"]
    program = "import sys, json; print(json.dumps(sys.argv[1:]))"
    spec = JobSpec(argv=("python3", "-c", program, *words), cwd=str(workdir))
    job_id = slurm.submit(spec, output="argv.log")
    assert wait_final(job_id).state == "done"
    assert json.loads((workdir / "argv.log").read_text()) == words


def test_two_gpus_are_handed_to_the_job(workdir: Path):
    job_id = slurm.submit(sh("echo $CUDA_VISIBLE_DEVICES/$SLURM_JOB_GPUS > gpus.txt", workdir, gpus=2))
    assert wait_final(job_id).state == "done"
    assert (workdir / "gpus.txt").read_text().strip() == "0,1/0,1"


def test_the_captured_environment_is_the_jobs(workdir: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("REDLINE_NOT_CAPTURED", "1")  # in this process, not in the job's captured environment
    env = {"PATH": os.environ["PATH"], "REDLINE_CAPTURED": "a b $c"}
    spec = JobSpec(argv=("bash", "-c", "env > env.txt"), cwd=str(workdir), env=env)
    assert wait_final(slurm.submit(spec)).state == "done"
    seen = (workdir / "env.txt").read_text().splitlines()
    assert "REDLINE_CAPTURED=a b $c" in seen
    assert not any(line.startswith("REDLINE_NOT_CAPTURED=") for line in seen)


def test_failing_job_keeps_its_exit_code(workdir: Path):
    job = wait_final(slurm.submit(sh("exit 3", workdir)))
    assert (job.state, job.exit_code, job.reason) == ("failed", 3, "NonZeroExitCode")


def test_cancel_a_sleeping_job(workdir: Path):
    job_id = slurm.submit(sh("sleep 600", workdir, name="sleeper"))
    wait_running(job_id)
    assert [job.id for job in slurm.jobs() if job.state == "running"].count(job_id) == 1
    slurm.cancel(job_id)
    job = wait_final(job_id)
    assert job.state == "cancelled" and job.ended_at is not None
    slurm.cancel(job_id)  # an ended job: nothing to do


def test_unknown_jobs(cluster):
    with pytest.raises(BadInput, match="no Slurm job 99999") as caught:
        slurm.cancel("99999")
    assert "\n" not in str(caught.value)
    job = slurm.status(["99999"])["99999"]
    assert job.state == "lost" and "no longer knows" in job.reason


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"queue": "nope"}, "Invalid partition name specified"),
        ({"gpus": 3}, "Requested node configuration is not available"),  # the node has 2
    ],
)
def test_sbatch_refusals_are_one_line(workdir: Path, fields, words):
    with pytest.raises(BadInput, match=words) as caught:
        slurm.submit(sh("true", workdir, **fields))
    assert str(caught.value).startswith("sbatch refused the job: ") and "\n" not in str(caught.value)


def test_queued_behind_a_dependency_held_released_listed(cluster, workdir: Path):
    first = slurm.submit(sh("sleep 600", workdir, name="first"))
    second = slurm.submit(sh("true", workdir, name="second", after=(first,)))
    job = slurm.status([second])[second]
    assert (job.state, job.started_at, job.exit_code) == ("queued", None, None)
    deadline = time.monotonic() + HANG_S
    while (job := slurm.status([second])[second]).reason != "Dependency":
        assert time.monotonic() < deadline, job
        time.sleep(0.2)
    cluster.command("scontrol", "hold", second)
    job = slurm.status([second])[second]
    assert (job.state, job.started_at) == ("held", None) and job.reason.startswith("JobHeld")
    cluster.command("scontrol", "release", second)
    assert slurm.status([second])[second].state == "queued"
    listed = {job.id: job for job in slurm.jobs()}
    assert listed[second].state == "queued" and listed[first].name == "first"
    assert slurm.jobs(user="nobody-here") == []
    slurm.cancel(first)  # afterok can no longer hold: Slurm leaves the second pending (DependencyNeverSatisfied)
    assert wait_final(first).state == "cancelled"
    slurm.cancel(second)
    assert wait_final(second).state == "cancelled"


def test_scontrol_fallback_reads_what_squeue_json_does(workdir: Path):
    """The parser for Slurms without squeue --json, checked against the JSON one on the same real jobs."""
    ids = [slurm.submit(sh(line, workdir)) for line in ("true", "exit 4", "kill -TERM $$")]
    for job_id in ids:
        wait_final(job_id)
    result = subprocess.run(["scontrol", "show", "job", "--oneliner"], capture_output=True, text=True, check=True)
    from_scontrol = slurm.parse_scontrol_jobs(result.stdout)
    from_json = slurm.status(ids)
    for job_id in ids:
        a, b = from_scontrol[job_id], from_json[job_id]
        assert (a.state, a.exit_code, a.name, a.user, a.reason) == (b.state, b.exit_code, b.name, b.user, b.reason)
        for when in ("submitted_at", "started_at", "ended_at"):
            assert getattr(a, when) == getattr(b, when)
    assert [from_json[i].exit_code for i in ids] == [0, 4, 128 + 15]


@pytest.mark.slow
def test_time_limit_ends_the_job(workdir: Path):
    job_id = slurm.submit(sh("sleep 600", workdir, time_limit_s=1))  # Slurm's shortest limit: 1 minute
    job = wait_final(job_id)
    assert job.state == "failed" and job.reason.startswith("TIMEOUT")
    assert job.ended_at - job.started_at >= 60


# ---- with accounting: sacct ----


def test_sacct_reads_what_squeue_does(accounted, tmp_path: Path):
    """The same ended jobs from the controller (squeue --json) and from accounting (sacct -P). Not their names:
    slurmdbd may name a job that just ended "allocation" for a while (the next test reads a name from sacct)."""
    lines = ("true", "exit 4", "kill -TERM $$", "sleep 600")
    ids = [slurm.submit(sh(line, tmp_path, name=f"acct{i}")) for i, line in enumerate(lines)]
    wait_running(ids[-1])
    slurm.cancel(ids[-1])
    from_squeue = {job_id: wait_final(job_id) for job_id in ids}

    def view(jobs):
        return {i: (j.state, j.exit_code, j.user, j.submitted_at, j.started_at, j.ended_at) for i, j in jobs.items()}

    # slurmctld sends the job's and its batch step's records to slurmdbd as they come: they land within moments,
    # the step's (a cancelled job's signal) sometimes after the job's
    deadline = time.monotonic() + HANG_S
    while view(from_sacct := slurm._accounted_jobs(ids=ids)) != view(from_squeue):
        assert time.monotonic() < deadline, (view(from_sacct), view(from_squeue))
        time.sleep(0.5)
    assert [from_sacct[i].state for i in ids] == ["done", "failed", "failed", "cancelled"]
    assert [from_sacct[i].exit_code for i in ids] == [0, 4, 128 + 15, 128 + 15]


def test_status_after_the_controller_forgets_comes_from_sacct(accounted, tmp_path: Path):
    job_id = slurm.submit(sh("exit 5", tmp_path, name="forgotten"))
    assert wait_final(job_id).exit_code == 5
    deadline = time.monotonic() + HANG_S
    while job_id in slurm._live_jobs():  # slurmctld purges ended jobs past MinJobAge (2 s here) within seconds
        assert time.monotonic() < deadline, "slurmctld still holds the job"
        time.sleep(1)
    job = slurm.status([job_id])[job_id]
    assert (job.state, job.exit_code, job.name) == ("failed", 5, "forgotten")
    assert job_id in {job.id for job in slurm.jobs()}


# ---- Slurm's newer JSON ----


def test_newer_json_shapes():
    """From Slurm 23.02 on, squeue --json wraps numbers as {set, infinite, number}, gives the state as a list and
    the exit code as {status, return_code, signal}: the same job reads the same as 22.05's plain values."""
    number = lambda n: {"set": True, "infinite": False, "number": n}  # noqa: E731
    job = {
        "job_id": 7,
        "name": "x",
        "user_name": "ann",
        "job_state": ["FAILED"],
        "state_reason": "NonZeroExitCode",
        "exit_code": {"status": ["EXITED"], "return_code": number(3), "signal": {"id": {"set": False}, "name": ""}},
        "submit_time": number(100),
        "start_time": number(110),
        "end_time": number(120),
        "array_job_id": number(0),
        "array_task_id": {"set": False, "infinite": False, "number": 0},
    }
    parsed = slurm.parse_squeue_json(json.dumps({"jobs": [job], "errors": []}))["7"]
    assert (parsed.state, parsed.exit_code, parsed.submitted_at, parsed.ended_at) == ("failed", 3, 100.0, 120.0)
    job |= {"job_state": ["CANCELLED"], "exit_code": {"signal": {"id": number(9)}, "return_code": number(0)}}
    parsed = slurm.parse_squeue_json(json.dumps({"jobs": [job]}))["7"]
    assert (parsed.state, parsed.exit_code) == ("cancelled", 137)
    job |= {"job_state": ["RUNNING", "COMPLETING"], "array_job_id": number(5), "array_task_id": number(2)}
    parsed = slurm.parse_squeue_json(json.dumps({"jobs": [job]}))["5_2"]
    assert (parsed.state, parsed.exit_code, parsed.ended_at) == ("running", None, None)
