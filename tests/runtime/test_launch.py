"""`redline run`: the plan reaches the script, the launch matches the plan, torchrun runs the ranks and restarts
them when one dies, exit codes and signals pass through. Real processes on the CPU (gloo), each bounded."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from conftest import run_cli
from redline.errors import BadInput
from redline.plan.estimate import Goal
from redline.plan.hardware import parse_hardware
from redline.plan.planfile import dump_plan, make_plan
from redline.plan.search import search
from redline.plan.strategy import Strategy
from redline.runtime.launch import (
    Launch,
    Nodes,
    build_launch,
    check_world_size,
    execute,
    parse_nodes,
    resolve_nproc_per_node,
    thread_settings,
    visible_cuda_gpus,
)
from redline.workload.presets import preset_profile


def _plan(tmp_path: Path, hardware: str) -> Path:
    profile = preset_profile("gpt2")
    cluster = parse_hardware(hardware)
    goal = Goal(global_batch=32, tokens=1e9)
    path = tmp_path / f"plan-{hardware}.yaml"
    path.write_text(dump_plan(make_plan(profile, cluster, goal, search(profile, cluster, goal).ranked[0])))
    return path


def _script(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


@pytest.fixture
def plan1(tmp_path: Path) -> Path:
    return _plan(tmp_path, "1xh100-sxm")


@pytest.fixture
def plan2(tmp_path: Path) -> Path:
    return _plan(tmp_path, "2xh100-sxm")


# --- deciding the launch (pure) ---


def test_nodes_and_nproc_resolution() -> None:
    assert parse_nodes("2") == Nodes(2, 2) and str(parse_nodes("1:4")) == "1:4" and parse_nodes("1:4").elastic
    for bad in ("0", "3:2", "x", "1:2:3"):
        with pytest.raises(BadInput, match="--nnodes takes N or MIN:MAX"):
            parse_nodes(bad)
    dp8 = Strategy(data=8)

    def no_gpus() -> int:
        return 0

    assert resolve_nproc_per_node("4", Nodes(), dp8, no_gpus)[0] == 4
    assert resolve_nproc_per_node("auto", Nodes(), dp8, lambda: 2) == (2, "auto: 2 CUDA GPUs")
    assert resolve_nproc_per_node("auto", Nodes(2, 2), dp8, no_gpus)[0] == 4  # the plan's count, per node
    assert resolve_nproc_per_node("auto", Nodes(), None, no_gpus)[0] == 1
    with pytest.raises(BadInput, match="positive number or auto"):
        resolve_nproc_per_node("0", Nodes(), None, no_gpus)


def test_gpus_are_counted_in_a_child_python_unless_the_build_is_cpu_only(monkeypatch) -> None:
    import importlib.metadata

    started = []

    def child(argv, **_):
        started.append(argv)
        return subprocess.CompletedProcess(argv, 0, "2\n", "")

    monkeypatch.setattr(subprocess, "run", child)
    for version, gpus in (("2.13.0+cpu", 0), ("2.13.0+cu128", 2), ("2.13.0", 2)):
        monkeypatch.setattr(importlib.metadata, "version", lambda _name, version=version: version)
        assert visible_cuda_gpus() == gpus, version
    assert len(started) == 2 and started[0][1:] == ["-c", "import torch; print(torch.cuda.device_count())"]


def test_world_size_checks() -> None:
    layout = Strategy(data=4, tensor=2)  # 8 processes in tensor groups of 2
    check_world_size(layout, 4, Nodes(2, 2), "p.yaml")
    check_world_size(layout, 2, Nodes(2, 4), "p.yaml")  # elastic: the maximum matches, the minimum holds groups
    with pytest.raises(BadInput, match=r"laid out for 8 processes .* 4 per node x 1 node = 4"):
        check_world_size(layout, 4, Nodes(), "p.yaml")
    with pytest.raises(BadInput, match="cannot hold whole tensor x pipeline groups of 2"):
        check_world_size(Strategy(data=3, tensor=2), 1, Nodes(1, 6), "p.yaml")


def test_each_process_gets_its_share_of_the_cores_unless_the_user_chose(monkeypatch) -> None:
    """One process under `redline run` had no thread setting; torchrun sets 1 for several and none for one."""
    from redline.hw import host

    monkeypatch.setattr(host, "usable_cores", lambda fs=None: 16)
    assert thread_settings(1, {}) == {"OMP_NUM_THREADS": "16"}
    assert thread_settings(4, {}) == {"OMP_NUM_THREADS": "4"}
    assert thread_settings(32, {}) == {"OMP_NUM_THREADS": "1"}
    assert thread_settings(4, {"OMP_NUM_THREADS": "3"}) == {}


def test_usable_cores_follow_affinity_and_the_cgroup_quota(tmp_path: Path) -> None:
    from redline.hw.host import usable_cores
    from redline.hw.sysfs import SysFs

    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text("0::/\n")
    (tmp_path / "sys/fs/cgroup").mkdir(parents=True)
    (tmp_path / "sys/fs/cgroup/cpu.max").write_text("150000 100000\n")  # 1.5 cores
    assert usable_cores(SysFs(tmp_path)) == 1
    (tmp_path / "sys/fs/cgroup/cpu.max").write_text("max 100000\n")
    assert usable_cores(SysFs(tmp_path)) == len(os.sched_getaffinity(0))


def test_torchrun_command_lines(tmp_path: Path) -> None:
    script = str(_script(tmp_path, "train.py", "pass\n"))
    alone = build_launch(script, ["-x"], nproc_per_node=1, nodes=Nodes(), python="py")
    # one process runs the script through supervised too: an error of redline's own is one line and its exit code
    assert alone.argv == ("py", "-m", "redline.runtime.supervised", script, "-x") and not alone.torchrun
    assert set(alone.env) <= {"OMP_NUM_THREADS"}
    restarts = build_launch(script, [], nproc_per_node=1, nodes=Nodes(), max_restarts=2, python="py")
    assert restarts.torchrun and "--standalone" in restarts.argv  # restarts need torchrun's agent
    elastic = build_launch(
        script, ["a"], nproc_per_node=8, nodes=Nodes(1, 2), rdzv_endpoint="h:29400", rdzv_id="job", python="py"
    )
    assert elastic.argv == (
        *("py", "-m", "redline.runtime.elastic", "--nproc-per-node", "8", "--nnodes", "1:2"),
        *("--rdzv-backend", "c10d", "--rdzv-endpoint", "h:29400", "--rdzv-id", "job", "--max-restarts", "0"),
        *("-m", "redline.runtime.supervised", script, "a"),
    )
    for kwargs, message in (
        ({"nodes": Nodes(2, 2)}, "needs --rdzv-endpoint"),
        ({"rdzv_id": "job"}, "--rdzv-id goes with --rdzv-endpoint"),
        ({"rdzv_endpoint": "host"}, "HOST:PORT"),
        ({"max_restarts": -1}, "0 or more"),
    ):
        with pytest.raises(BadInput, match=message):
            build_launch(script, [], **({"nproc_per_node": 1, "nodes": Nodes()} | kwargs))


# --- the command ---


def test_one_process_gets_the_plan_its_arguments_and_gives_its_exit_code(tmp_path: Path, plan1: Path) -> None:
    script = _script(
        tmp_path,
        "train.py",
        """
        import json, os, sys
        print(json.dumps({"plan": os.environ["REDLINE_PLAN"], "args": sys.argv[1:], "rank": os.environ.get("RANK")}))
        sys.exit(3)
        """,
    )
    # options after the script are the script's, even those redline also has
    # an H100's plan on this CPU, on purpose (the launch is under test, not the plan's fit): --plan-anyway
    result = run_cli(
        "run", "--plan", str(plan1), "--plan-anyway", "--nproc-per-node", "1", str(script), "--foo", "1", "--plan", "x"
    )
    assert result.returncode == 3, result.stderr
    seen = json.loads(result.stdout)
    assert seen == {"plan": str(plan1.resolve()), "args": ["--foo", "1", "--plan", "x"], "rank": None}
    assert result.stderr.startswith("redline: running") and "1 process (plain python)" in result.stderr


@pytest.mark.ranks
def test_two_ranks_through_torchrun_all_reduce(tmp_path: Path, plan2: Path) -> None:
    out = tmp_path / "result.json"
    script = _script(
        tmp_path,
        "train.py",
        """
        import json, os, sys
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        total = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(total)
        if dist.get_rank() == 0:
            result = {"sum": total.item(), "world": dist.get_world_size(), "plan": os.environ["REDLINE_PLAN"]}
            open(sys.argv[1], "w").write(json.dumps(result))
        dist.barrier()  # leave together: a gloo group torn down under a busy peer can abort it
        dist.destroy_process_group()
        """,
    )
    result = run_cli(
        "run", "--plan", str(plan2), "--plan-anyway", "--nproc-per-node", "2", str(script), str(out), timeout=600
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(out.read_text()) == {"sum": 3.0, "world": 2, "plan": str(plan2.resolve())}
    assert "as 2 processes (torchrun, 2 per node (as given) x 1 node(s))" in result.stderr


@pytest.mark.ranks
def test_a_killed_worker_is_restarted_and_the_run_completes(tmp_path: Path) -> None:
    log = tmp_path / "attempts.log"
    script = _script(
        tmp_path,
        "train.py",
        """
        import os, signal, sys
        rank, attempt = os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
        with open(sys.argv[1], "a") as log:
            log.write(f"{rank} {attempt}\\n")
        if rank == "1" and attempt == "0":
            os.kill(os.getpid(), signal.SIGKILL)  # a worker lost mid-run
        """,
    )
    result = run_cli("run", "--nproc-per-node", "2", "--max-restarts", "1", str(script), str(log), timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    attempts = sorted(log.read_text().split("\n")[:-1])
    assert "1 0" in attempts and {"0 1", "1 1"} <= set(attempts)  # the whole group ran again, as restart 1
    assert max(int(line.split()[1]) for line in attempts) == 1


def test_bad_launches_are_one_line_and_exit_2(tmp_path: Path, plan2: Path) -> None:
    script = _script(tmp_path, "train.py", "pass\n")
    bad_plan = tmp_path / "bad.yaml"
    bad_plan.write_text("strategy: [unclosed\n")
    for args, message in (
        (("--plan", str(plan2), "--nproc-per-node", "1", str(script)), "laid out for 2 processes"),
        (("--nproc-per-node", "1", str(tmp_path / "missing.py")), "no such script"),
        (("--plan", str(bad_plan), "--nproc-per-node", "1", str(script)), "not valid YAML"),
        (("--json", str(script)), "goes with --dry-run"),
    ):
        result = run_cli("run", *args)
        assert result.returncode == 2, (args, result.stderr)
        assert message in result.stderr and result.stderr.count("\n") == 1, result.stderr


def test_dry_run_prints_the_launch(tmp_path: Path, plan2: Path) -> None:
    script = _script(tmp_path, "train.py", "raise SystemExit('must not run')\n")
    shell = run_cli("run", "--dry-run", "--plan", str(plan2), "--nproc-per-node", "2", str(script), "--lr", "1e-3")
    assert shell.returncode == 0, shell.stderr
    line = shell.stdout.strip()
    from redline.hw.host import usable_cores

    threads = max(1, usable_cores() // 2) if "OMP_NUM_THREADS" not in os.environ else None
    env = f"REDLINE_PLAN={plan2.resolve()}" + (f" OMP_NUM_THREADS={threads}" if threads else "")
    assert line.startswith(f"{env} {sys.executable} -m redline.runtime.elastic"), line
    assert line.endswith(f"--standalone --max-restarts 0 -m redline.runtime.supervised {script} --lr 1e-3")
    as_json = run_cli("run", "--dry-run", "--json", "--plan", str(plan2), "--nproc-per-node", "2", str(script))
    launch = json.loads(as_json.stdout)
    assert launch["world_size"] == 2 and launch["launcher"] == "torchrun"
    assert launch["env"]["REDLINE_PLAN"] == str(plan2.resolve())


# --- signals ---


def test_sigterm_reaches_the_script_and_exits_143(tmp_path: Path) -> None:
    stopped = tmp_path / "stopped"
    script = _script(
        tmp_path,
        "train.py",
        f"""
        import signal, sys, time
        signal.signal(signal.SIGTERM, lambda *_: (open({str(stopped)!r}, "w").close(), sys.exit(0)))
        print("ready", flush=True)
        time.sleep(60)
        """,
    )
    # no terminal: the signal reaches redline alone, as from a scheduler
    proc = subprocess.Popen(
        [sys.executable, "-m", "redline", "run", "--nproc-per-node", "1", str(script)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 143
        assert stopped.exists()
        assert "interrupted (SIGTERM)" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.stdout.close()
        proc.stderr.close()


def test_ctrl_c_at_the_terminal_interrupts_the_script_once_and_exits_130(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        "train.py",
        """
        import time
        print("ready", flush=True)
        try:
            time.sleep(30)
        except KeyboardInterrupt:
            time.sleep(0.5)  # clean-up that a second interrupt would cut short
            print("cleaned up", flush=True)
            raise
        """,
    )
    pid, terminal = pty.fork()  # redline in the foreground of a terminal of its own, as a user runs it
    if pid == 0:
        os.execv(sys.executable, [sys.executable, "-m", "redline", "run", "--nproc-per-node", "1", str(script)])
    seen, sent, status = b"", False, None
    deadline = time.monotonic() + 30
    try:
        while status is None and time.monotonic() < deadline:
            if select.select([terminal], [], [], 0.1)[0]:
                with contextlib.suppress(OSError):  # the terminal closes when redline exits
                    seen += os.read(terminal, 4096)
            if b"ready" in seen and not sent:
                time.sleep(0.3)  # into the script's sleep, past its print
                os.write(terminal, b"\x03")  # Ctrl-C: the terminal signals its whole foreground group
                sent = True
            done, code = os.waitpid(pid, os.WNOHANG)
            status = os.waitstatus_to_exitcode(code) if done else None
    finally:
        if status is None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(terminal)
    text = seen.decode(errors="replace")
    assert status == 130, text
    assert "cleaned up" in text and "interrupted (SIGINT)" in text


def test_a_script_that_ignores_the_signal_is_killed_after_the_grace() -> None:
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(30)"
    launch = Launch(argv=(sys.executable, "-c", code))
    # SIGTERM to this process while execute() holds the handlers; execute passes it on, then kills
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM))
    started = time.monotonic()
    timer.start()
    try:
        outcome = execute(launch, stop_grace_s=1.0)
    finally:
        timer.cancel()
    assert outcome.exit_code == 143 and outcome.signal == "SIGTERM"
    assert time.monotonic() - started < 10


@pytest.mark.slow
@pytest.mark.ranks
def test_out_of_memory_inside_the_gradient_all_reduce_restarts_smaller_with_the_same_result(tmp_path: Path) -> None:
    """Rank 1 runs out of memory in the synchronising micro-batch, where rank 0 already waits in DDP's all-reduce:
    no agreement is possible in place, so rank 1 records a smaller micro-batch and fails; torchrun restarts both,
    they resume from the last checkpoint with it, and the weights come out as one process's on the same batches."""
    out = tmp_path / "weights.pt"
    script = _script(
        tmp_path,
        "train.py",
        f"""
        import json, sys
        import torch
        from torch import nn
        # test modules import each other (and tests/ranks.py) by plain name, as pytest's pythonpath lets them
        sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(Path(__file__).parents[1])!r}]
        from test_prepare import dataset, make_model
        from redline.plan.strategy import Strategy
        from redline.runtime.config import RunConfig
        from redline.runtime.prepare import prepare

        plan = RunConfig(strategy=Strategy(data=2, micro_batch=4, accumulation=2, sharding="ddp", precision="fp32"))
        model = make_model()
        loader = torch.utils.data.DataLoader(dataset(), batch_size=8)
        run = prepare(model, lambda ps: torch.optim.SGD(ps, lr=0.1), loader, plan=plan,
                      checkpoint_dir={str(tmp_path / "checkpoints")!r}, checkpoint_every=2)
        for x, y in run.micro_batches():
            with run.accumulate():
                run.backward(nn.functional.mse_loss(run.model(x), y))
        if torch.distributed.get_rank() == 0:
            torch.save({{n.removeprefix("module."): p.detach() for n, p in run.model.named_parameters()}}, {str(out)!r})
            json.dump(run.oom_events, open({str(out)!r} + ".json", "w"))
        """,
    )
    # step 3, rank 1, the second (synchronising) micro-batch; the last checkpoint is step 2's, so the failing
    # rank must not try to save one on its way out (a collective: it would wait for rank 0 forever)
    env = {"REDLINE_TEST_OOM_AT": "3:1:1"}
    result = run_cli("run", "--nproc-per-node", "2", "--max-restarts", "1", str(script), timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "recorded micro-batch 2 x 4 accumulation" in result.stderr
    assert json.loads(Path(str(out) + ".json").read_text()) == [{"step": 2, "micro_batch": 2, "accumulation": 4}]

    sys.path.insert(0, str(Path(__file__).parent))
    from test_prepare import config, train

    single = train(config(micro_batch=16, accumulation=1))
    ranks = torch.load(out)
    for name, param in single.named_parameters():
        torch.testing.assert_close(ranks[name], param.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.ranks
@pytest.mark.parametrize("target", ["redline", "its process group"])
def test_kill_9_of_redline_run_leaves_no_process_of_the_job(tmp_path: Path, target: str) -> None:
    """torchrun starts its workers in sessions of their own: they used to train on, unsupervised, to the end."""
    import psutil

    script = _script(
        tmp_path,
        "train.py",
        """
        import os, sys, time
        open(os.path.join(sys.argv[1], f"{os.environ['RANK']}.pid"), "w").write(f"{os.getpid()} {os.getppid()}")
        time.sleep(3600)
        """,
    )
    env = {k: v for k, v in os.environ.items() if k != "REDLINE_DEBUG"}
    redline = subprocess.Popen(
        [sys.executable, "-m", "redline", "run", "--nproc-per-node", "2", str(script), str(tmp_path)],
        env=env,
        start_new_session=True,  # its own group, to kill as a user's shell would
        stderr=subprocess.DEVNULL,
    )
    job = []
    try:
        deadline = time.monotonic() + 600  # a hang guard: both workers write their pid once started
        while len(job) < 2 and time.monotonic() < deadline and redline.poll() is None:
            time.sleep(0.1)
            job = [tmp_path / f"{rank}.pid" for rank in (0, 1) if (tmp_path / f"{rank}.pid").exists()]
        assert len(job) == 2, "the workers did not start"
        time.sleep(0.2)  # the pid file may be written but not yet closed
        pids = {int(n) for path in job for n in path.read_text().split()}  # the workers and torchrun
        if target == "redline":
            os.kill(redline.pid, signal.SIGKILL)
        else:
            os.killpg(redline.pid, signal.SIGKILL)
        redline.wait()
        _, alive = psutil.wait_procs([psutil.Process(pid) for pid in pids if psutil.pid_exists(pid)], timeout=5)
        assert not alive, f"still running 5 s after kill -9 of {target}: {alive}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(redline.pid, signal.SIGKILL)
        for path in job:
            for pid in map(int, path.read_text().split()):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_sigterm_checkpoints_at_the_next_step_and_the_resumed_run_is_bit_identical(tmp_path: Path) -> None:
    """A spot instance's preemption notice: SIGTERM used to end the run with no checkpoint."""
    script = _script(
        tmp_path,
        "train.py",
        """
        import os, sys, time
        import torch
        from torch import nn
        import redline

        ckpt, out, gate = sys.argv[1:4]
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        g = torch.Generator().manual_seed(1)
        data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
        loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        run = redline.prepare(model, optimizer, loader, checkpoint_dir=ckpt)
        for x, y in run.micro_batches(epochs=2):
            with run.accumulate():
                run.backward(nn.functional.mse_loss(run.model(x), y))
            if run.step == 3 and gate != "-":  # hold here until the test has signalled (an event, not a delay)
                print("at step 3", file=sys.stderr, flush=True)
                while not os.path.exists(gate):
                    time.sleep(0.02)
        torch.save(model.state_dict(), out)
        """,
    )
    env = {k: v for k, v in os.environ.items() if k != "REDLINE_DEBUG"}

    def launch(ckpt: str, out: str, gate: str) -> subprocess.Popen:
        argv = [sys.executable, "-m", "redline", "run", str(script), ckpt, out, gate]
        return subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True, cwd=tmp_path)

    whole = launch(str(tmp_path / "ckpt-whole"), str(tmp_path / "whole.pt"), "-")
    assert whole.wait(timeout=600) == 0, whole.stderr.read()

    stopped = launch(str(tmp_path / "ckpt"), str(tmp_path / "resumed.pt"), str(tmp_path / "gate"))
    try:
        lines = iter(stopped.stderr.readline, "")
        assert any("at step 3" in line for line in lines)
        stopped.send_signal(signal.SIGTERM)  # to redline run, which passes it on
        assert any("SIGTERM: checkpointing at the end of step 4" in line for line in lines)
        (tmp_path / "gate").touch()
        assert stopped.wait(timeout=600) == 128 + signal.SIGTERM
        rest = stopped.stderr.read()
        assert "stopped after step 4" in rest, rest
        assert not (tmp_path / "resumed.pt").exists()  # the code after the loop did not run
    finally:
        stopped.kill()
    resumed = launch(str(tmp_path / "ckpt"), str(tmp_path / "resumed.pt"), "-")
    assert resumed.wait(timeout=600) == 0, resumed.stderr.read()
    assert "resumed from step 4" in resumed.stderr.read()
    a, b = torch.load(tmp_path / "whole.pt"), torch.load(tmp_path / "resumed.pt")
    assert all(torch.equal(a[name], b[name]) for name in a)


@pytest.mark.ranks
def test_a_redline_error_in_two_ranks_is_a_line_per_rank_and_a_short_summary(tmp_path: Path) -> None:
    """It used to be each rank's traceback and 86 lines of torchrun's failure table."""
    script = _script(
        tmp_path,
        "train.py",
        """
        import torch
        import redline

        model = torch.nn.Linear(2, 1)
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(8, 2)), batch_size=3)
        # a global batch of 3 does not split over 2 ranks
        redline.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), loader, loader_batch="global")
        """,
    )
    result = run_cli("run", "--nproc-per-node", "2", str(script), timeout=600)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    for rank in (0, 1):
        said = (
            f"redline: rank {rank}: loader_batch='global': the loader's batch of 3 is the global batch, which 2 ranks"
        )
        assert said in result.stderr
    assert "failed first (exit 2); 1 other process failed too" in result.stderr
    assert len(result.stderr.splitlines()) < 12, result.stderr


@pytest.mark.ranks
def test_a_plan_the_runtime_cannot_apply_is_refused_before_any_rank_starts(tmp_path: Path, plan2: Path) -> None:
    """An fp8 plan, which needs a GPU with fp8 tensor cores, is refused once by the launcher rather than in every rank,
    saying why (here: no GPU at all)."""
    import yaml

    plan = yaml.safe_load(plan2.read_text())
    plan["strategy"] |= {"precision": "fp8"}
    tp = tmp_path / "fp8.yaml"
    tp.write_text(yaml.safe_dump(plan))
    marker = tmp_path / "ran"
    script = _script(tmp_path, "train.py", f"open({str(marker)!r}, 'w').close()\n")
    result = run_cli("run", "--plan", str(tp), "--nproc-per-node", "2", str(script))
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "fp8 training needs an NVIDIA GPU of compute capability 8.9 or newer" in result.stderr
    assert not marker.exists()
