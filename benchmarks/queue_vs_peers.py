"""redline's queue against task-spooler and Slurm (where its single-node harness runs: root, Debian's slurmctld
slurmd slurm-client munge) on this machine, side by side in one run.

1. Throughput: N trivial jobs (`true`) submitted as fast as one client can, through each queue: the submit
   latency (p50, p99), the jobs started per second from the first submit to the last job's end, and the daemon's
   resident memory after. redline is timed twice: through its socket (``client.request``, what a script or a
   library submits with) and through the `redline submit` command (a Python start per job); task-spooler's
   `tsp` is a C program, so its command is its API.
2. Packing: 40 jobs with known GPU memory (10-60 GiB) and run times (sleeps) on 8 fake 80 GiB GPUs (the NVML
   fake, tests/queue/fake_gpu_daemon.py with eight GPUs), through redline packing by memory, against the same
   jobs one per GPU (no memory given: what task-spooler's `ts -G` does), and the lower bound
   max(longest job, sum of memory x time / (8 x 80 GiB)).

    python benchmarks/queue_vs_peers.py [--jobs 2000] [--cli-jobs 50] [--rounds 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from redline.queue.client import request
from redline.queue.spec import JobSpec

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def rss_bytes(pid: int) -> int:
    """A process's resident memory; 0 for one that ended since it was listed."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return 0
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def start_daemon(directory: Path, *command: str) -> subprocess.Popen:
    directory.mkdir(parents=True, exist_ok=True)
    daemon = subprocess.Popen([*command, str(directory)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            request({"op": "status"}, directory, start=False)
            return daemon
        except Exception:
            time.sleep(0.05)
    raise RuntimeError("the daemon did not start")


def stop(daemon: subprocess.Popen) -> None:
    daemon.terminate()
    daemon.wait(60)


def redline_throughput(jobs: int, cli_jobs: int, work: Path) -> dict:
    directory = work / "redline"
    daemon = start_daemon(directory, sys.executable, "-m", "redline", "queue", "daemon", "--dir")
    spec = JobSpec(argv=("true",), cwd=str(work), env={"PATH": os.environ["PATH"]}).to_dict()
    latencies = []
    started = time.perf_counter()
    for _ in range(jobs):
        before = time.perf_counter()
        request({"op": "submit", "spec": spec}, directory, start=False)
        latencies.append(time.perf_counter() - before)
    while request({"op": "jobs", "all": True}, directory)["jobs"][-1]["state"] != "done" or any(
        j["state"] != "done" for j in request({"op": "jobs", "all": True}, directory)["jobs"]
    ):
        time.sleep(0.2)
    elapsed = time.perf_counter() - started
    rss = rss_bytes(daemon.pid)
    env = os.environ | {"REDLINE_QUEUE_DIR": str(directory)}
    cli = []
    for _ in range(cli_jobs):
        before = time.perf_counter()
        subprocess.run(["redline", "submit", "--", "true"], env=env, check=True, capture_output=True)
        cli.append(time.perf_counter() - before)
    stop(daemon)
    return {
        "submit_p50_s": statistics.median(latencies),
        "submit_p99_s": percentile(latencies, 0.99),
        "cli_submit_p50_s": statistics.median(cli),
        "cli_submit_p99_s": percentile(cli, 0.99),
        "jobs_per_s": jobs / elapsed,
        "daemon_rss_bytes": rss,
    }


def tsp_throughput(jobs: int, work: Path) -> dict | None:
    binary = shutil.which("tsp")
    if binary is None:
        return None
    env = os.environ | {"TS_SOCKET": str(work / "tsp.socket"), "TS_MAXFINISHED": str(jobs + 10), "TS_SLOTS": "1"}
    subprocess.run([binary, "-S", "16"], env=env, check=True)  # redline starts every ready CPU job: many slots
    latencies = []
    started = time.perf_counter()
    for _ in range(jobs):
        before = time.perf_counter()
        subprocess.run([binary, "true"], env=env, check=True, capture_output=True)
        latencies.append(time.perf_counter() - before)
    subprocess.run([binary, "-w"], env=env, capture_output=True)  # wait for the last job
    while "running" in subprocess.run([binary], env=env, capture_output=True, text=True).stdout or "queued" in (
        subprocess.run([binary], env=env, capture_output=True, text=True).stdout
    ):
        time.sleep(0.2)
    elapsed = time.perf_counter() - started
    rss = max((rss_bytes(int(pid)) for pid in _pids("tsp")), default=0)
    subprocess.run([binary, "-K"], env=env, capture_output=True)
    return {
        "submit_p50_s": statistics.median(latencies),
        "submit_p99_s": percentile(latencies, 0.99),
        "jobs_per_s": jobs / elapsed,
        "daemon_rss_bytes": rss,
    }


def slurm_throughput(jobs: int, work: Path) -> dict | None:
    """The same jobs through a real single-node Slurm (tools/slurmlocal: slurmctld and slurmd on this machine,
    16 CPUs declared so jobs run side by side), submitted with `sbatch --wrap true`; RSS is slurmctld's plus
    slurmd's. None where Slurm cannot run here (not installed, not root)."""
    sys.path.insert(0, str(ROOT / "tools"))
    from slurmlocal import LocalSlurm, SlurmUnavailable

    cluster = LocalSlurm(work / "slurm", gpus=0, cpus=16)
    try:
        cluster.start()
    except SlurmUnavailable as exc:
        print(f"(no Slurm: {exc})", file=sys.stderr)
        return None
    try:
        latencies = []
        started = time.perf_counter()
        for _ in range(jobs):
            before = time.perf_counter()
            done = cluster.command("sbatch", "--parsable", "--output=/dev/null", "--wrap", "true")
            if done.returncode != 0:
                raise RuntimeError(f"sbatch failed: {done.stderr.strip()}")
            latencies.append(time.perf_counter() - before)
        while cluster.command("squeue", "-h", "-o", "%i").stdout.strip():
            time.sleep(0.2)
        elapsed = time.perf_counter() - started
        pids = [int(p) for name in ("slurmctld", "slurmd") for p in _pids(name)]
        rss = sum(rss_bytes(pid) for pid in pids)
    finally:
        cluster.stop()
    return {
        "submit_p50_s": statistics.median(latencies),
        "submit_p99_s": percentile(latencies, 0.99),
        "jobs_per_s": jobs / elapsed,
        "daemon_rss_bytes": rss,
    }


def _pids(name: str) -> list[str]:
    return subprocess.run(["pgrep", "-x", name], capture_output=True, text=True).stdout.split()


def packing(work: Path, seed: int = 0) -> dict:
    """40 jobs (memory, seconds) on 8 fake 80 GiB GPUs: redline by memory, one per GPU, the lower bound."""
    rng = random.Random(seed)
    jobs = [(rng.choice((10, 20, 30, 40, 60)), rng.choice((1.0, 2.0, 3.0))) for _ in range(40)]
    bound = max(max(s for _, s in jobs), sum(m * s for m, s in jobs) / (8 * 80))
    out = {"lower_bound_s": bound}
    for name, by_memory in (("redline", True), ("one_per_gpu", False)):
        directory = work / name
        script = ROOT / "tests" / "queue" / "fake_gpu_daemon.py"
        daemon = start_daemon(directory, sys.executable, str(script), "--gpus", "8", "--dir")
        started = time.perf_counter()
        for memory, seconds in jobs:
            spec = JobSpec(
                argv=("sleep", str(seconds)),
                gpus=1,
                gpu_memory_bytes=memory * GIB if by_memory else None,
                cwd=str(work),
                env={"PATH": os.environ["PATH"]},
            )
            request({"op": "submit", "spec": spec.to_dict()}, directory, start=False)
        while any(j["state"] != "done" for j in request({"op": "jobs", "all": True}, directory)["jobs"]):
            time.sleep(0.1)
        out[f"{name}_makespan_s"] = time.perf_counter() - started
        stop(daemon)
    return out


def median_of(rounds: list[dict | None]) -> dict | None:
    """Each figure's median over the rounds (None where the system could not run here)."""
    measured = [r for r in rounds if r is not None]
    if not measured:
        return None
    return {key: statistics.median(r[key] for r in measured) for key in measured[0]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--cli-jobs", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3, help="each measure this many times, alternating; medians")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.jobs < 1 or args.cli_jobs < 1 or args.rounds < 1:
        parser.error("--jobs, --cli-jobs and --rounds must be at least 1")
    rounds: dict[str, list] = {"redline": [], "task_spooler": [], "slurm": [], "packing": []}
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            rounds["redline"].append(redline_throughput(args.jobs, args.cli_jobs, work / "r"))
            rounds["task_spooler"].append(tsp_throughput(args.jobs, work))
            rounds["slurm"].append(slurm_throughput(args.jobs, work))
            rounds["packing"].append(packing(work / "p"))  # the same 40 jobs each round
    result = {"jobs": args.jobs, "rounds": args.rounds} | {name: median_of(r) for name, r in rounds.items()}
    result["each_round"] = rounds
    if args.json:
        print(json.dumps(result, indent=2))
        return
    report(result)


def report(result: dict) -> None:
    ours, pack = result["redline"], result["packing"]
    print(f"{result['jobs']} jobs of `true`, medians of {result['rounds']} rounds:")
    print(
        f"  redline: submit p50 {ours['submit_p50_s'] * 1e3:.2f} ms, p99 {ours['submit_p99_s'] * 1e3:.2f} ms "
        f"(the command: p50 {ours['cli_submit_p50_s'] * 1e3:.0f} ms); {ours['jobs_per_s']:.1f} jobs/s; "
        f"daemon RSS {ours['daemon_rss_bytes'] / 2**20:.1f} MiB"
    )
    for name, label in (("task_spooler", "task-spooler"), ("slurm", "Slurm")):
        if theirs := result[name]:
            print(
                f"  {label}: submit p50 {theirs['submit_p50_s'] * 1e3:.2f} ms, p99 {theirs['submit_p99_s'] * 1e3:.2f}"
                f" ms; {theirs['jobs_per_s']:.1f} jobs/s; daemons' RSS {theirs['daemon_rss_bytes'] / 2**20:.1f} MiB;"
                f" redline's jobs/s {ours['jobs_per_s'] / theirs['jobs_per_s']:.2f}x theirs"
            )
    ours_s, theirs_s, bound_s = pack["redline_makespan_s"], pack["one_per_gpu_makespan_s"], pack["lower_bound_s"]
    print(
        f"packing 40 jobs on 8 x 80 GiB: redline {ours_s:.1f} s, one per GPU {theirs_s:.1f} s "
        f"({theirs_s / ours_s:.2f}x redline's), lower bound {bound_s:.1f} s (redline {ours_s / bound_s:.2f}x it)"
    )


if __name__ == "__main__":
    main()
