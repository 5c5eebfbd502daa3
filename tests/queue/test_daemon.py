"""The queue's daemon on this machine, for real: a daemon process per test (started by the CLI on first use, or
by the test with its options), jobs that are real processes, `redline` commands as a user types them."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import unix_users
from conftest import run_cli
from prometheus_server import start_prometheus, stop
from queue_daemons import alive, jobs, start_daemon, stop_daemon, submit, until, wait_for
from redline.queue.client import request
from redline.queue.spec import JobSpec


def test_jobs_run_in_order_with_their_logs_states_and_dependencies(tmp_path: Path, queue: dict[str, str]) -> None:
    first = submit(queue, "--name", "hello", "--", "sh", "-c", "echo hello from $REDLINE_JOB_ID; pwd")
    assert (Path(queue["REDLINE_QUEUE_DIR"]) / "queue.sock").exists()  # the first use started the daemon
    failing = submit(queue, "--", "sh", "-c", "exit 3")
    after_good = submit(queue, "--after", str(first), "--", "echo", "after")
    after_bad = submit(queue, "--after", str(failing), "--", "echo", "never")
    assert until(queue, first, "done")["exit_code"] == 0
    assert (done := until(queue, failing, "failed"))["exit_code"] == 3 and done["reason"] == "exit 3"
    assert until(queue, after_good, "done")["started_at"] >= jobs(queue)[first]["ended_at"]
    assert until(queue, after_bad, "failed")["reason"] == f"job {failing} it runs after failed"
    log = run_cli("logs", str(first), env=queue)
    assert log.returncode == 0 and log.stdout == f"hello from {first}\n{Path.cwd()}\n"  # the submitter's cwd
    table = run_cli("jobs", env=queue)
    assert table.returncode == 0 and "hello" in table.stdout and "exit 3" in table.stdout


def test_hold_release_and_cancel(queue: dict[str, str]) -> None:
    held = submit(queue, "--hold", "--", "echo", "held")
    running = submit(queue, "--", "sleep", "600")
    assert until(queue, held, "held")["reason"] == "held"
    until(queue, running, "running")
    assert run_cli("release", str(held), env=queue).returncode == 0
    until(queue, held, "done")
    waiting = submit(queue, "--hold", "--", "echo", "never")
    cancelled = run_cli("cancel", str(running), str(waiting), env=queue)
    assert cancelled.returncode == 0, cancelled.stderr
    assert until(queue, running, "cancelled")["reason"] == "cancelled"
    assert jobs(queue)[waiting]["state"] == "cancelled"
    pid = json.loads(next(Path(queue["REDLINE_QUEUE_DIR"]).glob(f"jobs/{running}/*/pid.json")).read_text())["pid"]
    assert not alive(pid)


def test_a_time_limit_stops_the_job(queue: dict[str, str]) -> None:
    job = submit(queue, "--time-limit", "1s", "--", "sleep", "600")
    ended = until(queue, job, "failed")
    assert ended["reason"] == "time limit (1 s)" and ended["exit_code"] == -signal.SIGTERM


def test_a_job_killed_by_a_signal_is_retried_with_backoff_and_counted(tmp_path: Path, queue: dict[str, str]) -> None:
    directory = Path(queue["REDLINE_QUEUE_DIR"])
    start_daemon(directory, "--retry-backoff", "0.1")
    runs = tmp_path / "runs"
    job = submit(queue, "--retries", "2", "--", "sh", "-c", f"echo run >> {runs}; kill -9 $$")
    ended = until(queue, job, "failed")
    assert runs.read_text().count("run") == 3 and ended["attempt"] == 3
    assert ended["reason"] == "killed by signal 9"
    once = submit(queue, "--", "sh", "-c", "kill -9 $$")  # no retries: one run
    assert until(queue, once, "failed")["attempt"] == 1


@pytest.mark.slow
def test_a_daemon_killed_with_sigkill_loses_nothing_and_runs_nothing_twice(
    tmp_path: Path, queue: dict[str, str]
) -> None:
    """Two jobs at a time (a per-user limit); six submitted, each appending its id when it starts. The daemon
    is killed -9 while two run and four wait: the two keep running, the next daemon adopts them, and every
    job runs exactly once."""
    directory = Path(queue["REDLINE_QUEUE_DIR"])
    daemon = start_daemon(directory, "--max-jobs-per-user", "2")
    log = tmp_path / "started"
    gate = tmp_path / "gate"
    script = f"echo $REDLINE_JOB_ID >> {log}; while [ ! -e {gate} ]; do sleep 0.05; done"
    ids = [submit(queue, "--", "sh", "-c", script) for _ in range(6)]
    wait_for(lambda: sum(j["state"] == "running" for j in jobs(queue).values()) == 2, "two running")
    daemon.kill()
    daemon.wait()
    assert sorted(int(line) for line in log.read_text().split()) == ids[:2]
    for pid_file in directory.glob("jobs/*/*/pid.json"):
        assert alive(json.loads(pid_file.read_text())["pid"])  # still running, without a daemon
    start_daemon(directory, "--max-jobs-per-user", "2")
    assert {jobs(queue)[i]["state"] for i in ids[2:]} == {"queued"}
    gate.touch()
    for job in ids:
        until(queue, job, "done")
    assert sorted(int(line) for line in log.read_text().split()) == ids  # each once


def test_recovery_reads_each_attempt_as_the_kernel_left_it(tmp_path: Path, queue: dict[str, str]) -> None:
    """A daemon killed between committing "starting" and starting the shim: no lock holder, no pid: the job did
    not run and waits again. A shim killed -9 while its job ran: the job is stopped and marked lost, then
    retried (it may)."""
    directory = Path(queue["REDLINE_QUEUE_DIR"])
    daemon = start_daemon(directory)
    job = submit(queue, "--retries", "1", "--", "sleep", "600")
    started = until(queue, job, "running")
    pid_file = next(directory.glob(f"jobs/{job}/1/pid.json"))
    pids = json.loads(pid_file.read_text())
    daemon.kill()
    daemon.wait()
    os.kill(pids["shim"], signal.SIGKILL)
    wait_for(lambda: not alive(pids["shim"]), "the shim's end")
    start_daemon(directory, "--retry-backoff", "0.1")
    assert until(queue, job, "running", "starting")["attempt"] == 2
    assert not alive(pids["pid"])  # the first attempt's job was stopped before the retry
    assert started["attempt"] == 1


@pytest.mark.slow
def test_bad_input_is_one_line(queue: dict[str, str]) -> None:
    for args, message in (
        (["submit"], "Missing argument"),
        (["submit", "--gpus", "2", "--", "true"], "the job asks 2 GPUs; this machine has 0: `--gpus 0` runs it on"),
        (["submit", "--gpu-memory", "lots", "--", "true"], "--gpu-memory: 'lots' is not a size"),
        (["submit", "--time-limit", "soon", "--", "true"], "--time-limit: 'soon' is not a duration"),
        (["submit", "--after", "999", "--", "true"], "--after 999: no such job"),
        (["submit", "--retries", "-1", "--", "true"], "--retries must be a whole number from 0"),
        # past SQLite's integers, or past any real job: refused, not a daemon's OverflowError
        (["submit", "--retries", "99999999999999999999", "--", "true"], "--retries must be a whole number from 0 to"),
        (["submit", "--priority", "-99999999999999999999", "--", "true"], "--priority must be a whole number from"),
        (["submit", "--time-limit", "99999h", "--", "true"], "--time-limit must be positive and at most a year"),
        (["submit", "--name", "n" * 201, "--", "true"], "--name takes at most 200 characters"),
        (["cancel", "abc"], "a job id is a number, not 'abc'"),
        (["cancel", "999"], "no job 999"),
        (["logs", "999"], "no job 999"),
        (["hold", "99999999999999999999"], "no job 99999999999999999999"),  # past SQLite's integers
        (["submit", "--after", "99999999999999999999", "--", "true"], "--after 99999999999999999999: no such job"),
        (["queue", "daemon", "--policy", "random"], "--policy is pack or spread"),
    ):
        result = run_cli(*args, env=queue)
        assert result.returncode == 2, (args, result.stderr)
        assert message in result.stderr and result.stderr.count("\n") == 1, (args, result.stderr)


def as_user(uid: int, payload: dict, directory: Path) -> dict:
    """``payload`` sent to the daemon by a process running as ``uid``: its answer, or {"error": the one line}."""
    try:
        return unix_users.as_user(uid, lambda: request(payload, directory, start=False))
    except unix_users.Refused as exc:
        assert exc.kind == "BadInput", exc
        return {"error": exc.message}


def test_users_change_and_read_only_their_own_jobs(queue: dict[str, str], other_user: int) -> None:
    """root's daemon serves the machine: a second user's job runs as that user, with a log only it can read;
    it may not cancel, hold or read root's job, and root may cancel its."""
    directory = Path(tempfile.mkdtemp(prefix="redline-queue-", dir="/tmp"))  # one the other user can reach
    directory.chmod(0o755)
    try:
        start_daemon(directory)
        assert (directory / "queue.sock").stat().st_mode & 0o777 == 0o666
        env = {"REDLINE_QUEUE_DIR": str(directory)}
        mine = submit(env, "--", "sleep", "600")
        spec = JobSpec(argv=("sh", "-c", "id -u; sleep 600"), cwd="/tmp", env={"PATH": "/usr/bin:/bin"})
        theirs = as_user(other_user, {"op": "submit", "spec": spec.to_dict()}, directory)["job"]["id"]
        until(env, theirs, "running")
        log = directory / "jobs" / str(theirs) / "output.log"
        wait_for(lambda: log.read_text().strip(), "the other user's job writing")
        assert log.read_text().split()[0] == str(other_user)  # it ran as the user who submitted it
        assert log.stat().st_uid == other_user and log.stat().st_mode & 0o777 == 0o600
        for op in ("cancel", "hold"):
            refused = as_user(other_user, {"op": op, "ids": [str(mine)]}, directory)
            assert refused["error"] == f"job {mine} is root's: only its owner or root may do that"
        refused = as_user(other_user, {"op": "log", "id": str(mine)}, directory)
        assert "only its owner or root" in refused["error"]
        listed = as_user(other_user, {"op": "jobs"}, directory)["jobs"]
        assert {j["id"]: j["spec"]["env"] for j in listed}[mine] == {}  # root's environment is not shown to others
        assert run_cli("cancel", str(theirs), str(mine), env=env).returncode == 0  # root may
        until(env, theirs, "cancelled")
        until(env, mine, "cancelled")
    finally:
        stop_daemon(directory)
        shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.slow
def test_gpu_jobs_are_placed_by_memory_on_the_gpus_nvml_shows(tmp_path: Path, queue: dict[str, str]) -> None:
    """Two fake H100s (80 GiB; GPU 1 with 21 GiB of a process the queue did not start). Pack puts the first
    30 GiB job where it fits most tightly, beside that process (58.6 GiB of room), and the next two share GPU 0;
    a job asking a whole GPU waits, and says why; each job sees its GPU by UUID, in PCI bus order."""
    directory = Path(queue["REDLINE_QUEUE_DIR"])
    directory.mkdir()
    script = Path(__file__).with_name("fake_gpu_daemon.py")
    command = [sys.executable, str(script), "--dir", str(directory)]
    daemon = subprocess.Popen(command, stderr=open(tmp_path / "d.log", "wb"))  # noqa: SIM115
    wait_for(lambda: request({"op": "status"}, directory, start=False))
    show = "echo $CUDA_VISIBLE_DEVICES $CUDA_DEVICE_ORDER; sleep 600"
    ids = [submit(queue, "--gpus", "1", "--gpu-memory", "30G", "--", "sh", "-c", show) for _ in range(3)]
    whole = submit(queue, "--gpus", "1", "--", "true")
    for job in ids:
        until(queue, job, "running")
    status = request({"op": "status"}, directory)
    gpu0, gpu1 = status["gpus"]
    assert [j["id"] for j in gpu1["jobs"]] == [str(ids[0])]
    assert [j["id"] for j in gpu0["jobs"]] == [str(ids[1]), str(ids[2])]
    assert gpu1["foreign"] == [{"pid": 4242, "bytes": 21 * 2**30}]
    for job, gpu in zip(ids, (gpu1, gpu0, gpu0), strict=True):
        log = directory / "jobs" / str(job) / "output.log"
        assert wait_for(lambda log=log: log.read_text()) == f"{gpu['uuid']} PCI_BUS_ID\n"
    waiting = jobs(queue)[whole]
    assert waiting["state"] == "queued" and "GPU 0 runs job" in waiting["reason"]
    assert run_cli("cancel", *map(str, ids), env=queue).returncode == 0
    until(queue, whole, "done")  # GPU 0 emptied; GPU 1 keeps its foreign process: GPU 0 it is
    assert jobs(queue)[whole]["placement"]["uuids"] == [gpu0["uuid"]]
    daemon.terminate()
    daemon.wait()


def test_a_job_that_ran_out_of_memory_is_requeued(tmp_path: Path, queue: dict[str, str]) -> None:
    """A job whose runtime recorded a smaller micro-batch (as runtime.oom does under the queue) and failed is
    requeued; its next attempt (which resumes with that micro-batch) ends well. Without the record, the same
    failure is final."""
    start_daemon(Path(queue["REDLINE_QUEUE_DIR"]), "--retry-backoff", "0.1")
    marker = tmp_path / "first"
    script = (
        f'if [ ! -e {marker} ]; then touch {marker}; echo \'{{"micro_batch": 4}}\' > "$REDLINE_QUEUE_RECORDS/oom.json";'
        " exit 1; fi"
    )
    job = submit(queue, "--retries", "1", "--", "sh", "-c", script)
    assert until(queue, job, "done")["attempt"] == 2
    plain = submit(queue, "--retries", "1", "--", "sh", "-c", "exit 1")
    assert until(queue, plain, "failed")["attempt"] == 1


@pytest.mark.slow
def test_prometheus_scrapes_the_queues_series(tmp_path: Path, queue: dict[str, str]) -> None:
    """The daemon's series, scraped by a real Prometheus: jobs by state, and the waits of those that started."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus not installed (Debian: apt-get install prometheus)")
    directory = Path(queue["REDLINE_QUEUE_DIR"])
    start_daemon(directory, "--metrics-port", "0")
    port = int((directory / "metrics.port").read_text())
    until(queue, submit(queue, "--", "true"), "done")
    submit(queue, "--hold", "--", "true")
    server = start_prometheus(binary, tmp_path, f"127.0.0.1:{port}")
    try:
        held = server.wait_for('redline_queue_jobs{state="held"}', lambda r: bool(r), "no scrape of the queue")
        assert [float(s["value"][1]) for s in held] == [1.0]
        assert float(server.query('redline_queue_jobs{state="done"}')[0]["value"][1]) == 1.0
        assert float(server.query("redline_queue_wait_seconds_count")[0]["value"][1]) == 1.0
    finally:
        stop(server.process)


def test_the_systemd_unit_runs_the_machines_queue_and_leaves_jobs_running_on_a_restart() -> None:
    result = run_cli("queue", "unit")
    assert result.returncode == 0
    lines = result.stdout.splitlines()
    assert f"ExecStart={sys.executable} -m redline queue daemon --dir /var/lib/redline/queue" in lines
    assert "KillMode=process" in lines  # systemd's default would kill the jobs with the daemon


def test_a_failing_gpu_is_drained_and_a_job_a_gpu_fault_ended_is_retried(tmp_path: Path, queue: dict[str, str]) -> None:
    """On the NVML fake: a job fails (exit 3) after an Xid 79 appeared on its GPU in the kernel log, and is
    retried; failing again the same way without a new Xid, it is not. Then GPU 0's uncorrectable ECC errors
    grow: the monitor's diagnosis drains it, and a job that needs both GPUs waits, saying why."""
    directory = Path(queue["REDLINE_QUEUE_DIR"])
    directory.mkdir()
    kernel_log, faults, go = tmp_path / "dmesg", tmp_path / "faults.json", tmp_path / "go"
    kernel_log.write_text("")
    script = Path(__file__).with_name("fake_gpu_daemon.py")
    command = [sys.executable, str(script), "--dir", str(directory), "--kernel-log", str(kernel_log)]
    command += ["--faults", str(faults), "--retry-backoff", "0.1"]
    daemon = subprocess.Popen(command, stderr=open(tmp_path / "d.log", "wb"))  # noqa: SIM115
    wait_for(lambda: request({"op": "status"}, directory, start=False))
    wait = f"while [ ! -e {go} ]; do sleep 0.05; done; exit 3"
    job = submit(queue, "--gpus", "1", "--gpu-memory", "10G", "--retries", "2", "--", "sh", "-c", wait)
    placed = until(queue, job, "running")["placement"]
    bus = placed["pci_bus_ids"][0].rpartition(".")[0]  # the Xid line names the device without its function
    kernel_log.write_text(f"NVRM: Xid (PCI:{bus}): 79, pid=4242, GPU has fallen off the bus.\n")
    go.touch()
    ended = until(queue, job, "failed")
    # the first end was retried (one retry spent), the second, the job's own, was not
    assert ended["attempt"] == 2 and ended["reason"] == "exit 3" and ended["retries_left"] == 1, ended
    faults.write_text(json.dumps({"0": {"ecc_volatile_uncorrected": 3}}))
    gpu0 = wait_for(lambda: (g := request({"op": "status"}, directory)["gpus"][0])["drained"] and g)
    assert gpu0["drained"].startswith("failing: 3 uncorrectable ECC error(s)"), gpu0
    both = submit(queue, "--gpus", "2", "--", "true")
    waiting = wait_for(lambda: (j := jobs(queue)[both])["reason"] and j)
    assert waiting["state"] == "queued" and "GPU 0 is drained (failing: 3 uncorrectable" in waiting["reason"]
    daemon.terminate()
    daemon.wait()
