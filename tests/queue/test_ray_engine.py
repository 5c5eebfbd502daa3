"""The Ray engine against a real Ray head, started as users start one (`ray start --head`), with two declared
GPUs: Ray hands out GPU ids without looking for devices, so a CPU-only machine exercises its placement.

The head is shared by the module's tests (it takes 10-20 s to start on a loaded 2-core machine) and torn down
by process id, never with `ray stop`, which would stop every Ray on the machine."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from ports import free_port
from redline.errors import BadInput
from redline.queue.ray_engine import NOT_CARRIED, RayEngine, engine_job, resolve_address
from redline.queue.spec import JobSpec

pytestmark = pytest.mark.system

START_TIMEOUT_S = 90  # the head's RAY_JOB_START_TIMEOUT_SECONDS: a job Ray cannot place fails after it
HANG_S = 300  # only catches a hang: each wait below ends on the work it waits for


@pytest.fixture(autouse=True)
def _no_ray_address(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray's client lets these win over the address it is given: the tests name their head themselves."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_API_SERVER_ADDRESS", raising=False)


def _ray_cli() -> str:
    beside = Path(sys.executable).with_name("ray")
    return str(beside) if beside.exists() else (shutil.which("ray") or "ray")


@pytest.fixture(scope="module")
def ray_head() -> Iterator[str]:
    """A Ray head on this machine, with 2 GPUs and 2 CPUs declared; its dashboard's address. Every port is a free
    one (several heads may run on one machine), its files are in a temporary folder, and its processes are ended
    by id at the end, whatever happened."""
    pytest.importorskip("ray.job_submission")
    temp_dir = tempfile.mkdtemp(prefix="rl-ray-", dir="/tmp")  # short: Ray's socket paths live under it
    try:
        dashboard = free_port()
        ports = {
            "--port": free_port(),
            "--dashboard-port": dashboard,
            "--ray-client-server-port": free_port(),
            "--dashboard-agent-listen-port": free_port(),
            "--dashboard-agent-grpc-port": free_port(),
            "--runtime-env-agent-port": free_port(),
            "--metrics-export-port": free_port(),
            "--node-manager-port": free_port(),
            "--object-manager-port": free_port(),
        }
        command = [_ray_cli(), "start", "--head", "--block", "--num-gpus", "2", "--num-cpus", "2"]
        command += ["--include-dashboard", "true", "--dashboard-host", "127.0.0.1", "--disable-usage-stats"]
        command += ["--temp-dir", temp_dir, "--object-store-memory", str(100 * 2**20)]
        command += [str(part) for option, port in ports.items() for part in (option, port)]
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
        env["RAY_JOB_START_TIMEOUT_SECONDS"] = str(START_TIMEOUT_S)
        with open(Path(temp_dir) / "ray-start.log", "w+") as log:
            head = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            try:
                yield _wait_for_head(head, f"http://127.0.0.1:{dashboard}", log)
            finally:
                _end_tree(head)
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)


def _wait_for_head(head: subprocess.Popen, address: str, log) -> str:
    """``address`` once the head's dashboard answers; the wait ends when it does, or when `ray start` exits."""
    started = time.monotonic()
    while not _answers(address):
        if head.poll() is not None:
            log.seek(0)
            pytest.fail(f"ray start exited with {head.returncode}:\n{log.read()[-3000:]}")
        assert time.monotonic() - started < HANG_S, "the Ray head did not answer"
        time.sleep(0.5)
    print(f"Ray head up in {time.monotonic() - started:.1f} s")
    return address


def _answers(address: str) -> bool:
    try:
        with urllib.request.urlopen(f"{address}/api/version", timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def _end_tree(head: subprocess.Popen) -> None:
    """End `ray start --block` and everything under it: its children share its fate, but the jobs' processes
    sit in sessions of their own, so every descendant is named before the head goes and killed if it stays."""
    try:
        tree = [psutil.Process(head.pid), *psutil.Process(head.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    for proc in tree[:1]:
        proc.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(tree, timeout=30)
    for proc in alive:
        proc.kill()
    psutil.wait_procs(alive, timeout=10)
    head.wait(timeout=10)


@pytest.fixture
def engine(ray_head: str) -> RayEngine:
    return RayEngine(ray_head)


def _job(argv: list[str], tmp_path: Path, **fields) -> JobSpec:
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root")} | fields.pop("env", {})
    return JobSpec(argv=tuple(argv), cwd=str(tmp_path), env=env, **fields)


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def _wait(engine: RayEngine, job_id: str, states: set[str]):
    """The job's row once it is in one of ``states``; the wait ends on the job, not on a clock."""
    started = time.monotonic()
    while True:
        [row] = engine.status([job_id])
        if row.state in states:
            return row
        assert time.monotonic() - started < HANG_S, f"job {job_id} still {row.state}: {row.reason}"
        time.sleep(0.5)


def _wait_for_file(engine: RayEngine, job_id: str, path: Path) -> None:
    """Until the job has made ``path``; it fails if the job ends first."""
    while not path.exists():
        [row] = engine.status([job_id])
        assert row.state in ("queued", "running"), f"job {job_id} ended {row.state} before making {path.name}"
        time.sleep(0.2)


# -- what would be submitted: no Ray needed ------------------------------------------------------------------


def test_render_is_what_submit_hands_ray() -> None:
    env = {"FOO": "a b", "PWD": "/elsewhere", "SHLVL": "2", "_": "/usr/bin/redline", "CUDA_VISIBLE_DEVICES": "3"}
    spec = JobSpec(argv=("python", "train.py", "--lr", "1e-4; rm"), name="my run", gpus=2, cwd="/data/a b", env=env)
    rendered = json.loads(RayEngine("http://head:8265").render(spec))
    arguments = rendered["submit_job"]
    assert rendered["address"] == "http://head:8265"
    assert arguments["entrypoint"] == "cd '/data/a b' && exec python train.py --lr '1e-4; rm'"
    assert arguments["entrypoint_num_gpus"] == 2
    assert arguments["runtime_env"] == {"env_vars": {"FOO": "a b"}}
    assert arguments["metadata"] == {"redline": "1", "name": "my run"}
    assert arguments["submission_id"].startswith("redline-my-run-")
    assert {"PWD", "SHLVL", "_", "CUDA_VISIBLE_DEVICES"} <= NOT_CARRIED


def test_render_without_gpus_asks_none_and_can_upload_the_directory() -> None:
    spec = JobSpec(argv=("./run.sh",), cwd="/src/proj", gpu_memory_bytes=10**9, env={"USER": "ana"})
    arguments = json.loads(RayEngine("http://head:8265", upload_working_dir=True).render(spec))["submit_job"]
    assert "entrypoint_num_gpus" not in arguments
    assert arguments["entrypoint"] == "exec ./run.sh"
    assert arguments["runtime_env"] == {"env_vars": {"USER": "ana"}, "working_dir": "/src/proj"}
    assert arguments["metadata"] == {"redline": "1", "name": "run.sh", "user": "ana", "gpu_memory_bytes": "1000000000"}


def test_what_ray_cannot_carry_is_refused_in_one_line() -> None:
    spec = JobSpec(argv=("true",), after=("12",), retries=2, time_limit_s=60)
    with pytest.raises(BadInput, match="cannot take --after, --retries, --time-limit") as caught:
        RayEngine("http://head:8265").render(spec)
    assert "\n" not in str(caught.value)


def test_address_follows_rays_own_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_address(None) == "http://127.0.0.1:8265"
    assert resolve_address("http://head:8265") == "http://head:8265"
    monkeypatch.setenv("RAY_ADDRESS", "http://other:8265")
    assert resolve_address("http://head:8265") == "http://other:8265"


def test_ray_states_become_the_queues() -> None:
    job_submission = pytest.importorskip("ray.job_submission")
    JobInfo, JobStatus = job_submission.JobInfo, job_submission.JobStatus

    def row(status, **fields):
        return engine_job("r1", JobInfo(status=status, entrypoint="x", metadata={"name": "n"}, **fields))

    assert row(JobStatus.PENDING).state == "queued"
    assert row(JobStatus.RUNNING).state == "running"
    assert row(JobStatus.SUCCEEDED, driver_exit_code=0).state == "done"
    assert row(JobStatus.STOPPED).state == "cancelled"
    died = row(JobStatus.FAILED, error_type="JOB_SUPERVISOR_ACTOR_DIED", message="Job supervisor actor died.")
    assert (died.state, died.reason) == ("lost", "Job supervisor actor died.")
    failed = row(JobStatus.FAILED, driver_exit_code=2, start_time=1_700_000_000_000, end_time=1_700_000_001_500)
    assert (failed.state, failed.exit_code, failed.name) == ("failed", 2, "n")
    assert (failed.submitted_at, failed.started_at, failed.ended_at) == (1_700_000_000.0, None, 1_700_000_001.5)


def test_the_engine_imports_ray_only_to_reach_a_cluster() -> None:
    code = "import sys, redline.queue.ray_engine as m; m.RayEngine().render(m.JobSpec(argv=('x',)))\n"
    code += "print('ray' in sys.modules)"
    env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert done.stdout.strip() == "False"


def test_missing_ray_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray...` now fails as it does where Ray is missing
    monkeypatch.setitem(sys.modules, "ray.job_submission", None)
    with pytest.raises(BadInput, match=r"pip install 'ray\[default\]'"):
        RayEngine("http://127.0.0.1:8265").jobs()


def test_a_cluster_that_does_not_answer_is_one_line() -> None:
    pytest.importorskip("ray.job_submission")
    address = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(BadInput, match=f"cannot reach a Ray cluster at {address}") as caught:
        RayEngine(address).jobs()
    assert "\n" not in str(caught.value)


# -- a real head -------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_job_runs_in_its_directory_and_is_done(engine: RayEngine, tmp_path: Path) -> None:
    code = "import os, pathlib; pathlib.Path('out.txt').write_text(os.getcwd())"
    job_id = engine.submit(_job(_python(code), tmp_path, name="writer", env={"USER": "ana"}))
    row = _wait(engine, job_id, {"done", "failed", "cancelled", "lost"})
    assert (row.state, row.exit_code, row.name, row.user) == ("done", 0, "writer", "ana")
    assert (tmp_path / "out.txt").read_text() == str(tmp_path)
    assert row.submitted_at is not None and row.ended_at is not None and row.submitted_at <= row.ended_at
    assert job_id in [listed.id for listed in engine.jobs()]


def test_the_captured_environment_arrives_less_what_does_not_travel(engine: RayEngine, tmp_path: Path) -> None:
    value = "a b 'quoted' \"double\" costs $ 5 ;|& $(not run) `nor this`"
    env = {"REDLINE_T": value, "REDLINE_NAMED": "${HOME}/x", "PWD": "/nowhere", "SHLVL": "7"}
    env["CUDA_VISIBLE_DEVICES"] = "5"
    code = "import json, os; open('env.json', 'w').write(json.dumps(dict(os.environ)))"
    job_id = engine.submit(_job(_python(code), tmp_path, env=env))
    assert _wait(engine, job_id, {"done", "failed", "cancelled", "lost"}).state == "done"
    seen = json.loads((tmp_path / "env.json").read_text())
    assert seen["REDLINE_T"] == value
    assert seen["REDLINE_NAMED"] == f"{seen['HOME']}/x"  # Ray expands a variable's name in a value, on the node
    assert seen.get("PWD") != "/nowhere" and seen.get("SHLVL") != "7"
    assert "CUDA_VISIBLE_DEVICES" not in seen  # no GPUs asked: Ray does not narrow a driver's devices


def test_a_gpu_job_sees_the_devices_ray_gives_it(engine: RayEngine, tmp_path: Path) -> None:
    code = "import os; open('devices', 'w').write(os.environ.get('CUDA_VISIBLE_DEVICES', 'unset'))"
    job_id = engine.submit(_job(_python(code), tmp_path, gpus=2, env={"CUDA_VISIBLE_DEVICES": "7"}))
    assert _wait(engine, job_id, {"done", "failed", "cancelled", "lost"}).state == "done"
    devices = (tmp_path / "devices").read_text().split(",")
    assert sorted(devices) == ["0", "1"]


def test_a_job_asking_more_gpus_than_the_cluster_has_waits(engine: RayEngine, tmp_path: Path) -> None:
    too_big = engine.submit(_job(["true"], tmp_path, gpus=3))
    after = engine.submit(_job(["true"], tmp_path, gpus=2))  # submitted later, placed and ended meanwhile
    assert _wait(engine, after, {"done", "failed", "cancelled", "lost"}).state == "done"
    [row] = engine.status([too_big])
    assert row.state == "queued"
    assert "waiting for resources" in row.reason


def test_cancelling_a_queued_job_stops_it_as_it_starts(engine: RayEngine, tmp_path: Path) -> None:
    hold = "import pathlib, time\nwhile not pathlib.Path('release').exists(): time.sleep(0.2)"
    holder = engine.submit(_job(_python(hold), tmp_path, gpus=2))
    _wait(engine, holder, {"running"})
    waiting = engine.submit(_job(["sleep", "600"], tmp_path, gpus=2))
    assert _wait(engine, waiting, {"queued", "running"}).state == "queued"  # the holder has both GPUs
    assert engine.cancel(waiting) is True
    assert engine.status([waiting])[0].state == "queued"  # Ray cannot stop a job before it starts
    (tmp_path / "release").touch()
    assert _wait(engine, holder, {"done", "failed", "cancelled", "lost"}).state == "done"
    row = _wait(engine, waiting, {"done", "failed", "cancelled", "lost"})
    assert (row.state, row.exit_code) == ("cancelled", None)


@pytest.mark.slow
def test_a_job_ray_cannot_place_fails_after_the_start_timeout(engine: RayEngine, tmp_path: Path) -> None:
    job_id = engine.submit(_job(["true"], tmp_path, gpus=3))
    row = _wait(engine, job_id, {"done", "failed", "cancelled", "lost"})
    assert (row.state, row.exit_code) == ("failed", None)
    assert f"failed to start within {float(START_TIMEOUT_S)} seconds" in row.reason


def test_a_failing_job_is_failed_with_its_exit_code(engine: RayEngine, tmp_path: Path) -> None:
    exits = engine.submit(_job(_python("raise SystemExit(3)"), tmp_path))
    killed = engine.submit(_job(_python("import os, signal; os.kill(os.getpid(), signal.SIGKILL)"), tmp_path))
    missing = engine.submit(_job(["/no/such/program"], tmp_path))
    rows = {job_id: _wait(engine, job_id, {"done", "failed", "cancelled", "lost"}) for job_id in (exits, killed)}
    assert (rows[exits].state, rows[exits].exit_code) == ("failed", 3)
    assert rows[exits].reason == "Job entrypoint command failed with exit code 3"
    assert (rows[killed].state, rows[killed].exit_code) == ("failed", -9)  # the program's own death, not sh's
    row = _wait(engine, missing, {"done", "failed", "cancelled", "lost"})
    assert (row.state, row.exit_code) == ("failed", 127)


def test_cancel_stops_a_running_job(engine: RayEngine, tmp_path: Path) -> None:
    code = "import pathlib, time; pathlib.Path('started').touch(); time.sleep(600)"
    job_id = engine.submit(_job(_python(code), tmp_path, name="sleeper"))
    _wait_for_file(engine, job_id, tmp_path / "started")  # Ray says RUNNING just before it starts the program
    assert engine.cancel(job_id) is True
    row = _wait(engine, job_id, {"done", "failed", "cancelled", "lost"})
    assert (row.state, row.exit_code) == ("cancelled", None)
    assert engine.cancel(job_id) is False  # already ended


def test_a_job_ray_does_not_know_is_lost_and_cannot_be_cancelled(engine: RayEngine) -> None:
    [row] = engine.status(["redline-nosuch-00000000"])
    assert (row.state, row.reason) == ("lost", "Ray has no such job")
    with pytest.raises(BadInput, match="has no job redline-nosuch-00000000"):
        engine.cancel("redline-nosuch-00000000")


def test_jobs_lists_only_what_redline_submitted(engine: RayEngine, ray_head: str, tmp_path: Path) -> None:
    from ray.job_submission import JobSubmissionClient

    theirs = JobSubmissionClient(ray_head).submit_job(entrypoint="true")
    ours = engine.submit(_job(["true"], tmp_path, name="ours"))
    listed = {row.id: row for row in engine.jobs()}
    assert ours in listed and theirs not in listed
    assert listed[ours].name == "ours" and listed[ours].engine == "ray"
