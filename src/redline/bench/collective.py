"""Collective bandwidth across ranks, counted exactly as nccl-tests counts it.

`redline bench collective` runs all_reduce (sum), all_gather, reduce_scatter, broadcast and all_to_all
over a sweep of message sizes (nccl-tests' `-b 8 -e MAX -f 2`), NCCL with one rank per GPU or gloo with
ranks on the CPU. Each size gets warm-up calls, then a wall-clock timing of `iters` back-to-back calls
between a barrier plus device sync and a final device sync; the per-call time is averaged across ranks
(nccl-tests `-a 1`, its default). Every size is then run once more on freshly filled inputs and every
output element compared with the exact expected value (#wrong must be 0).

Bandwidths follow nccl-tests (doc/PERFORMANCE.md, src/*.cu), GB = 1e9 bytes:

    algbw = S / t                  S: bytes per rank in the op's own convention (below)
    busbw = algbw * factor         what each link carried, comparable across ops and rank counts

    op              S                       factor
    all_reduce      count * size            2(n-1)/n
    reduce_scatter  recvcount * size * n    (n-1)/n
    all_gather      sendcount * size * n    (n-1)/n
    all_to_all      count * size * n        (n-1)/n   (count: elements sent to each peer)
    broadcast       count * size            1

Launch: locally the parent starts N `python -m redline.bench.collective_worker` processes with the
environment torchrun would give them (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR=127.0.0.1, a free
MASTER_PORT); rank 0 writes the sweep to a temp directory. Across nodes, run redline itself under torchrun:

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m redline bench collective

and each process runs as its rank (RANK/WORLD_SIZE/MASTER_ADDR already set); only rank 0 returns figures.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from redline.bench.context import BenchContext
from redline.bench.model import Measurement
from redline.errors import BadInput, RedlineError
from redline.units import GiB, KiB, MiB

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
DTYPE = "float32"  # nccl-tests' default -d float
ELEMENT_BYTES = 4


# nccl-tests' -e: quick stays small everywhere; a full GPU sweep reaches the sizes where NCCL peaks (>= 1-8 GB,
# nccl-tests #149/#212); the worker lowers it to what fits in each GPU's memory
QUICK_MAX_BYTES = 4 * MiB
CPU_MAX_BYTES = 64 * MiB
GPU_MAX_BYTES = 8 * GiB

# a rank that dies leaves the others waiting in a collective: the launcher kills them all after this
# grace period, and the process group's own timeout bounds one collective under torchrun
KILL_GRACE_S = 5.0
STARTUP_ALLOWANCE_S = 60.0


def coll_counts(op: str, count: int, nranks: int) -> tuple[int, int, int]:
    """(sendcount, recvcount, paramcount) in elements for a sweep point of ``count`` elements.

    nccl-tests' getCollByteCount: all_gather sends count/n and receives (count/n)*n; reduce_scatter the
    reverse; all_to_all sends and receives (count/n)*n, count/n to each peer; all_reduce and broadcast use
    count for both. ``paramcount`` is the count nccl-tests prints and feeds to its bandwidth formula.
    """
    if op in ("all_reduce", "broadcast"):
        return count, count, count
    per_rank = count // nranks
    if op == "all_gather":
        return per_rank, per_rank * nranks, per_rank
    if op == "reduce_scatter":
        return per_rank * nranks, per_rank, per_rank
    if op == "all_to_all":
        return per_rank * nranks, per_rank * nranks, per_rank
    raise ValueError(f"unknown collective {op!r}")


def bus_factor(op: str, nranks: int) -> float:
    """nccl-tests' busbw correction: the share of the data each rank's link must carry for the op."""
    n = nranks
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("reduce_scatter", "all_gather", "all_to_all"):
        return (n - 1) / n
    if op == "broadcast":
        return 1.0
    raise ValueError(f"unknown collective {op!r}")


def algbw_bytes(op: str, paramcount: int, element_bytes: int, nranks: int) -> int:
    """S in algbw = S / t: count*size for all_reduce and broadcast, count*size*n for the others."""
    if op in ("all_reduce", "broadcast"):
        return paramcount * element_bytes
    if op in ("reduce_scatter", "all_gather", "all_to_all"):
        return paramcount * element_bytes * nranks
    raise ValueError(f"unknown collective {op!r}")


def bandwidths(op: str, paramcount: int, element_bytes: int, nranks: int, time_s: float) -> tuple[float, float]:
    """(algbw_gbps, busbw_gbps) with GB = 1e9, as nccl-tests prints them."""
    algbw_gbps = algbw_bytes(op, paramcount, element_bytes, nranks) / time_s / 1e9
    return algbw_gbps, algbw_gbps * bus_factor(op, nranks)


def sweep_sizes(min_bytes: int, max_bytes: int, factor: int = 2) -> list[int]:
    """nccl-tests -b MIN -e MAX -f FACTOR: MIN, MIN*F, ... up to MAX."""
    sizes = []
    size = min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= factor
    return sizes


@dataclass
class Plan:
    """What every rank runs; JSON-ready, it travels to the worker processes as a file."""

    backend: str  # "gloo" | "nccl"
    device: str  # "cpu" | "cuda" (rank r on cuda:LOCAL_RANK)
    ops: list[str] = field(default_factory=lambda: list(OPS))
    sizes_bytes: list[int] = field(default_factory=lambda: sweep_sizes(8, QUICK_MAX_BYTES))
    warmup: int = 5
    iters: int = 20
    # bounds the whole local run (plus startup) and, as the process-group timeout, one collective
    timeout_s: float = 600.0
    # fault injection for tests only: {"rank": 1, "kind": "raise" | "hang"}
    fault: dict[str, Any] | None = None


def plan_for(ctx: BenchContext) -> Plan:
    """nccl-tests-like defaults: 5 warm-up + 20 timed iterations full, 2 + 10 quick."""
    cuda = ctx.device.startswith("cuda")
    if ctx.quick:
        max_bytes, warmup, iters, timeout_s = QUICK_MAX_BYTES, 2, 10, 300.0
    elif cuda:
        max_bytes, warmup, iters, timeout_s = GPU_MAX_BYTES, 5, 20, 1800.0
    else:
        max_bytes, warmup, iters, timeout_s = CPU_MAX_BYTES, 5, 20, 900.0
    return Plan(
        backend="nccl" if cuda else "gloo",
        device="cuda" if cuda else "cpu",
        sizes_bytes=sweep_sizes(8, max_bytes),
        warmup=warmup,
        iters=iters,
        timeout_s=timeout_s,
    )


def run(ctx: BenchContext) -> list[Measurement]:
    plan = plan_for(ctx)
    if under_torchrun():
        return _run_as_torchrun_rank(ctx, plan)
    nranks = _local_ranks(ctx, plan)
    description = f"collective {plan.backend} x{nranks}"
    with ctx.task(description, len(plan.ops) * len(plan.sizes_bytes)) as step:
        if plan.device == "cuda":
            from redline.bench.sampler import GpuSampler

            with GpuSampler(list(range(nranks))) as sampler:
                result = run_local(plan, nranks, on_size=step)
            result["gpu_state"] = sampler.summary()
        else:
            result = run_local(plan, nranks, on_size=step)
    return measurements(result, plan)


def under_torchrun() -> bool:
    """torchrun (and other launchers of its kind) export these for every process it starts."""
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


# what one CPU rank holds: torch imported with gloo (~220 MiB measured), plus its send and receive buffers of
# the largest size (all_gather's output is ranks x the input: counted as the whole size, twice)
RANK_BASE_BYTES = 256 * MiB


def check(ctx: BenchContext) -> None:
    """Before any suite runs: the ranks this host can start. Thousands of processes that each import torch
    take the machine down with them; a CPU rank beyond the cores only time-slices with the others."""
    if under_torchrun():
        return
    nranks = ctx.ranks
    if nranks < 2:
        raise BadInput("collective needs at least 2 ranks (--ranks 2 or more)")
    if ctx.device.startswith("cuda"):
        return  # one rank per GPU: checked against the GPUs torch sees when the suite starts
    from redline.hw.host import usable_cores

    host = ctx.snapshot.host if ctx.snapshot else None
    most = max(2, usable_cores())
    if nranks > most:
        raise BadInput(f"--ranks {nranks}: this host can run {most} CPU ranks (one per usable core); give at most that")
    available = _available_memory(host)
    per_rank = RANK_BASE_BYTES + 2 * max(plan_for(ctx).sizes_bytes)
    if available is not None and nranks * per_rank > available:
        raise BadInput(
            f"--ranks {nranks}: {nranks} ranks need about {nranks * per_rank / GiB:.1f} GiB and "
            f"{available / GiB:.1f} GiB is available; give at most {max(2, available // per_rank)}"
        )


def _available_memory(host: Any) -> int | None:
    if host is None or host.memory_available_bytes is None:
        return None
    limit = host.cgroup_memory_limit_bytes
    return min(host.memory_available_bytes, limit) if limit else host.memory_available_bytes


def _local_ranks(ctx: BenchContext, plan: Plan) -> int:
    check(ctx)
    nranks = ctx.ranks
    if plan.device == "cuda":
        if ctx.device != "cuda":
            raise BadInput(f"collective runs one rank per GPU: use --device cuda (all GPUs), not {ctx.device}")
        import torch

        gpus = torch.cuda.device_count()
        if nranks > gpus:
            raise BadInput(
                f"collective on cuda runs one rank per GPU: {nranks} ranks need {nranks} GPUs, "
                f"torch sees {gpus} (use --device cpu for gloo ranks on the CPU)"
            )
    return nranks


def _run_as_torchrun_rank(ctx: BenchContext, plan: Plan) -> list[Measurement]:
    """Run in this process as the rank torchrun made it; only rank 0 returns the figures."""
    from redline.bench.collective_worker import run_rank

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    if rank != 0:
        run_rank(plan, rank, world, local_rank)
        return []
    with ctx.task(f"collective {plan.backend} x{world}", len(plan.ops) * len(plan.sizes_bytes)) as step:
        if plan.device == "cuda":
            from redline.bench.sampler import GpuSampler

            with GpuSampler(list(range(local_world))) as sampler:
                result = run_rank(plan, rank, world, local_rank, on_size=step)
            if result is not None:
                result["gpu_state"] = sampler.summary()
        else:
            result = run_rank(plan, rank, world, local_rank, on_size=step)
    if result is None:
        raise RuntimeError("collective: rank 0 returned no results")  # run_rank returns them on rank 0
    result["launcher"] = "torchrun"
    result["nodes"] = world // local_world if local_world else None
    return measurements(result, plan)


def run_local(plan: Plan, nranks: int, on_size: Callable[[], None] | None = None) -> dict[str, Any]:
    """Start ``nranks`` worker processes on this host, wait for rank 0's result, leave nothing behind.

    Every child is reaped on success, on a rank's failure (the others would wait in a collective until
    the process-group timeout, so they are terminated at once), on timeout and on Ctrl-C.
    """
    with tempfile.TemporaryDirectory(prefix="redline-collective-") as tmp:
        workdir = Path(tmp)
        plan_path = workdir / "plan.json"
        plan_path.write_text(json.dumps(asdict(plan)))
        env = _rank_env(plan, nranks)
        procs: list[subprocess.Popen[bytes]] = []
        logs = []
        try:
            for rank in range(nranks):
                log = open(workdir / f"rank-{rank}.log", "wb")  # noqa: SIM115 - closed in finally
                logs.append(log)
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "redline.bench.collective_worker", str(plan_path), str(workdir)],
                        env=env | {"RANK": str(rank), "LOCAL_RANK": str(rank)},
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )
            _wait(procs, workdir, plan.timeout_s + STARTUP_ALLOWANCE_S, on_size)
            return json.loads((workdir / "result.json").read_text())
        finally:
            _reap(procs)
            for log in logs:
                log.close()


def _rank_env(plan: Plan, nranks: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        WORLD_SIZE=str(nranks),
        LOCAL_WORLD_SIZE=str(nranks),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        PYTHONUNBUFFERED="1",
    )
    # as torchrun does: ranks sharing the cores should not each start a thread per core
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nranks)))
    if plan.backend == "gloo":
        # all ranks are on this host: talk over loopback rather than whatever the hostname resolves to
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return env


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait(
    procs: list[subprocess.Popen[bytes]], workdir: Path, deadline_s: float, on_size: Callable[[], None] | None
) -> None:
    """Poll the ranks until all exit 0; the first that fails (or the deadline) raises."""
    start = time.monotonic()
    reported = 0
    progress = workdir / "progress"
    while True:
        codes = [p.poll() for p in procs]
        if on_size is not None and progress.exists():
            done = len(progress.read_text().splitlines())
            for _ in range(done - reported):
                on_size()
            reported = max(reported, done)
        if any(code not in (None, 0) for code in codes):
            raise RedlineError(_failure(procs, codes, workdir))
        if all(code == 0 for code in codes):
            if not (workdir / "result.json").exists():
                raise RedlineError("collective: the ranks exited without a result from rank 0")
            return
        if time.monotonic() - start > deadline_s:
            running = [str(rank) for rank, code in enumerate(codes) if code is None]
            raise RedlineError(
                f"collective: no result after {deadline_s:.0f} s (rank {', '.join(running)} still running); "
                "stopped all ranks"
            )
        time.sleep(0.1)


def _failure(procs: list[subprocess.Popen[bytes]], codes: list[int | None], workdir: Path) -> str:
    """One line naming the rank that failed first and why (its own message, else its exit status)."""
    errors = sorted(workdir.glob("error-*.txt"), key=lambda p: p.stat().st_mtime)
    if errors:
        failed = errors[0].stem.removeprefix("error-")
        return f"collective: rank {failed} failed: {errors[0].read_text().strip()}"
    rank, code = next((r, c) for r, c in enumerate(codes) if c not in (None, 0))
    how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
    tail = (workdir / f"rank-{rank}.log").read_text(errors="replace").strip().splitlines()
    return f"collective: rank {rank} {how}" + (f": {tail[-1]}" if tail else "")


def _reap(procs: list[subprocess.Popen[bytes]]) -> None:
    """Terminate whatever still runs, then kill what ignores it; wait on every child."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + KILL_GRACE_S
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _size_text(size_bytes: int) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if size_bytes >= scale:
            return f"{size_bytes / scale:g} {unit}"
    return f"{size_bytes} B"


def measurements(result: dict[str, Any], plan: Plan) -> list[Measurement]:
    """One Measurement per op: busbw at the largest size, the whole sweep in extra["rows"].

    Wrong results are an error, not a figure: a fast collective that corrupts data is a broken setup
    (bad NCCL transport, faulty NVLink), and its bandwidth must not be saved or judged.
    """
    world = result["world_size"]
    wrong_ops = {op: sum(r["wrong"] for r in result["rows"] if r["op"] == op) for op in plan.ops}
    if any(wrong_ops.values()):
        bad = ", ".join(f"{op}: {n} wrong elements" for op, n in wrong_ops.items() if n)
        raise RedlineError(f"collective results are WRONG ({bad}; {plan.backend} x{world}): check the transport")
    out = []
    for op in plan.ops:
        rows = [row for row in result["rows"] if row["op"] == op]
        if not rows:
            continue
        top = rows[-1]
        wrong = sum(row["wrong"] for row in rows)
        factor = {"all_reduce": "2(n-1)/n", "broadcast": "1"}.get(op, "(n-1)/n")
        method = (
            f"nccl-tests busbw = algbw x {factor} at {_size_text(top['size_bytes'])}, {plan.backend} x{world} "
            f"{DTYPE}, {plan.iters} calls, mean over ranks; "
            + ("#wrong 0" if wrong == 0 else f"WRONG RESULTS: {wrong} elements")
        )
        extra: dict[str, Any] = {
            "rows": [{k: v for k, v in row.items() if k != "op"} for row in rows],
            "avg_busbw_gbps": sum(row["busbw_gbps"] for row in rows) / len(rows),
            "wrong_total": wrong,
            "backend": plan.backend,
            "world_size": world,
            "warmup": plan.warmup,
            "iters": plan.iters,
            "time": "wall clock over the timed calls / iters, mean across ranks (nccl-tests -a 1)",
            "launcher": result.get("launcher", "local"),
            "torch": result.get("torch"),
        }
        for key in ("nccl", "nodes", "sizes_dropped_for_memory", "gpu_state"):
            if result.get(key) is not None:
                extra[key] = result[key]
        if op == "reduce_scatter" and plan.backend == "gloo":
            extra["note"] = (
                "torch's gloo backend runs reduce_scatter as an all_reduce of the whole input and keeps this "
                "rank's chunk, so it moves all_reduce's traffic; busbw still uses nccl-tests' (n-1)/n"
            )
        out.append(
            Measurement(
                suite="collective",
                name=op,
                value=top["busbw_gbps"],
                unit="GB/s",
                method=method,
                device=plan.device,
                size={"size_bytes": top["size_bytes"], "count": top["count"], "dtype": DTYPE, "ranks": world},
                repeats=plan.iters,
                extra=extra,
            )
        )
    return out
