"""One rank of `redline bench collective`: join the process group, sweep the sizes, time, check, report.

Started as `python -m redline.bench.collective_worker PLAN.json WORKDIR` by the local launcher in
redline.bench.collective, with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT set as torchrun
sets them; under torchrun, redline calls run_rank() in its own process instead.

Inputs are small integers that repeat every PERIOD elements and depend on the rank, so every expected
output (a sum over ranks, a rank's chunk, a peer's block) is exact in float32 and cheap to rebuild for any
size, and a block delivered to the wrong place does not compare equal.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from redline.bench.collective import ELEMENT_BYTES, Plan, bandwidths, coll_counts
from redline.errors import one_line

# 127 elements per period, values 0..126: a sum over up to 130,000 ranks stays below 2**24, exact in float32
PERIOD = 127


def rank_table(rank: int, device: torch.device) -> torch.Tensor:
    """One period of rank ``rank``'s input: (j + 31*rank) mod 127."""
    return ((torch.arange(PERIOD, device=device) + 31 * rank) % PERIOD).to(torch.float32)


def sum_table(world: int, device: torch.device) -> torch.Tensor:
    """One period of the element-wise sum of every rank's input."""
    tables = ((torch.arange(PERIOD, device=device) + 31 * r) % PERIOD for r in range(world))
    return torch.stack(list(tables)).sum(dim=0).to(torch.float32)


def _periods(t: torch.Tensor, table: torch.Tensor, start: int) -> tuple[torch.Tensor, int, int]:
    """``table`` rotated so element i of ``t`` lines up with global index start + i; whole periods; tail."""
    rotated = torch.roll(table, -(start % PERIOD))
    whole, tail = divmod(t.numel(), PERIOD)
    return rotated, whole, tail


def fill_(t: torch.Tensor, table: torch.Tensor, start: int = 0) -> torch.Tensor:
    """t[i] = table[(start + i) % PERIOD] in place, with no temporary as large as ``t``."""
    rotated, whole, tail = _periods(t, table, start)
    if whole:
        t[: whole * PERIOD].view(whole, PERIOD).copy_(rotated)
    if tail:
        t[whole * PERIOD :].copy_(rotated[:tail])
    return t


def count_wrong(t: torch.Tensor, table: torch.Tensor, start: int = 0) -> int:
    """Elements of ``t`` that differ from table[(start + i) % PERIOD]; NaN (never written) counts."""
    rotated, whole, tail = _periods(t, table, start)
    wrong = 0
    if whole:
        wrong += int((t[: whole * PERIOD].view(whole, PERIOD) != rotated).sum())
    if tail:
        wrong += int((t[whole * PERIOD :] != rotated[:tail]).sum())
    return wrong


@dataclass
class Case:
    """One op at one size on this rank."""

    call: Callable[[], Any]  # the collective, once
    reset: Callable[[], Any]  # inputs back to their pattern, outputs poisoned with NaN
    wrong: Callable[[], int]  # output elements that differ from the exact expected result


def make_case(op: str, count: int, rank: int, world: int, device: torch.device) -> Case:
    """Buffers for ``op`` at a sweep point of ``count`` elements, in nccl-tests' count convention."""
    send, recv, per = coll_counts(op, count, world)
    mine = rank_table(rank, device)
    nan = float("nan")

    def empty(n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.float32, device=device)

    if op == "all_reduce":
        # in place, as torch offers it: the timed calls keep summing (values grow, timing does not change);
        # the check refills the input and runs once more
        buf, total = empty(count), sum_table(world, device)
        return Case(
            call=lambda: dist.all_reduce(buf, op=dist.ReduceOp.SUM),
            reset=lambda: fill_(buf, mine),
            wrong=lambda: count_wrong(buf, total),
        )
    if op == "broadcast":
        buf, root = empty(count), rank_table(0, device)
        return Case(
            call=lambda: dist.broadcast(buf, src=0),
            reset=lambda: fill_(buf, root) if rank == 0 else buf.fill_(nan),
            wrong=lambda: count_wrong(buf, root),
        )
    inp, out = fill_(empty(send), mine), empty(recv)
    if op == "reduce_scatter":
        total = sum_table(world, device)
        reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return Case(
            call=lambda: reduce_scatter(out, inp, op=dist.ReduceOp.SUM),
            reset=lambda: out.fill_(nan),
            wrong=lambda: count_wrong(out, total, rank * per),
        )
    if op == "all_gather":
        all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        # block j of the output is rank j's whole input
        return Case(
            call=lambda: all_gather(out, inp),
            reset=lambda: out.fill_(nan),
            wrong=lambda: sum(count_wrong(block, rank_table(j, device)) for j, block in enumerate(out.split(per))),
        )
    if op == "all_to_all":
        # block j of the output is block `rank` of rank j's input
        return Case(
            call=lambda: dist.all_to_all_single(out, inp),
            reset=lambda: out.fill_(nan),
            wrong=lambda: sum(
                count_wrong(block, rank_table(j, device), rank * per) for j, block in enumerate(out.split(per))
            ),
        )
    raise ValueError(f"unknown collective {op!r}")


def run_rank(
    plan: Plan,
    rank: int,
    world: int,
    local_rank: int,
    on_size: Callable[[], None] | None = None,
    on_error: Callable[[BaseException], None] | None = None,
) -> dict[str, Any] | None:
    """Join the group (env:// rendezvous), run the sweep, leave the group; rank 0 returns the result.

    ``on_error`` hears of a failure before the group is torn down: leaving the group is what makes the
    peers fail in turn, so this is how the launcher tells the rank that failed first from its victims.
    """
    # torch marks the *_into_tensor/_tensor names deprecated; where the new names exist they are used
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    cuda = plan.device == "cuda"
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    options: dict[str, Any] = {}
    if cuda:
        torch.cuda.set_device(device)
        options["device_id"] = device
    dist.init_process_group(
        plan.backend, rank=rank, world_size=world, timeout=timedelta(seconds=plan.timeout_s), **options
    )
    try:
        _inject_fault(plan, rank)
        sizes = _sizes_that_fit(plan, device)
        rows = []
        for op in plan.ops:
            for size_bytes in sizes:
                row = _measure(plan, op, size_bytes // ELEMENT_BYTES, rank, world, device)
                if rank == 0:
                    if row is not None:
                        rows.append(row)
                    if on_size is not None:
                        on_size()
        dist.barrier()  # leave together: a gloo group torn down under a peer still reading it can abort the peer
        if rank != 0:
            return None
        return {
            "world_size": world,
            "rows": rows,
            "torch": torch.__version__,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
            "sizes_dropped_for_memory": [s for s in plan.sizes_bytes if s not in sizes] or None,
        }
    except BaseException as exc:
        if on_error is not None:
            on_error(exc)
        raise
    finally:
        dist.destroy_process_group()


def _measure(plan: Plan, op: str, count: int, rank: int, world: int, device: torch.device) -> dict[str, Any] | None:
    """Time ``iters`` calls after ``warmup``, then check one call on fresh inputs; reduce over ranks."""
    send, recv, per = coll_counts(op, count, world)
    if per == 0:  # fewer elements than ranks: nothing to move for this op at this size
        return None
    case = make_case(op, count, rank, world, device)
    case.reset()
    for _ in range(plan.warmup):
        case.call()
    _sync(device)
    dist.barrier()
    _sync(device)
    start = time.perf_counter()
    for _ in range(plan.iters):
        case.call()
    _sync(device)
    time_s = (time.perf_counter() - start) / plan.iters

    case.reset()
    case.call()
    _sync(device)
    totals = torch.tensor([time_s, float(case.wrong())], dtype=torch.float64, device=device)
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    mean_time_s, wrong = totals[0].item() / world, int(totals[1].item())
    algbw_gbps, busbw_gbps = bandwidths(op, per, ELEMENT_BYTES, world, mean_time_s)
    return {
        "op": op,
        "size_bytes": max(send, recv) * ELEMENT_BYTES,  # nccl-tests' size column
        "count": per,
        "dtype": "float32",
        "time_us": mean_time_s * 1e6,
        "algbw_gbps": algbw_gbps,
        "busbw_gbps": busbw_gbps,
        "wrong": wrong,
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _sizes_that_fit(plan: Plan, device: torch.device) -> list[int]:
    """On GPUs, drop sizes above an eighth of the smallest GPU's memory (input, output, check, NCCL)."""
    if device.type != "cuda":
        return plan.sizes_bytes
    cap = torch.tensor([torch.cuda.get_device_properties(device).total_memory // 8], device=device)
    dist.all_reduce(cap, op=dist.ReduceOp.MIN)
    return [s for s in plan.sizes_bytes if s <= cap.item()]


def _inject_fault(plan: Plan, rank: int) -> None:
    """Tests only: make one rank raise or hang after joining, as a broken peer would."""
    if not plan.fault or plan.fault.get("rank") != rank:
        return
    if plan.fault.get("kind") == "hang":
        time.sleep(plan.timeout_s * 10)
    raise RuntimeError("injected fault")


def _exit_with_parent() -> None:
    """A launcher killed outright (SIGKILL, SIGTERM) cannot reap its ranks: they notice and leave."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="redline-parent-watch", daemon=True).start()


def main(argv: list[str]) -> int:
    """Entry point of a locally launched rank: results and errors go to files in WORKDIR."""
    plan_path, workdir = Path(argv[0]), Path(argv[1])
    rank = int(os.environ["RANK"])
    _exit_with_parent()

    def step() -> None:
        with open(workdir / "progress", "a") as progress:
            progress.write("x\n")

    def record(exc: BaseException) -> None:
        if isinstance(exc, KeyboardInterrupt):
            return
        message = one_line(exc, limit_chars=400)
        error = workdir / f"error-{rank}.txt"
        if not error.exists():
            error.write_text(message + "\n")

    try:
        plan = Plan(**json.loads(plan_path.read_text()))
        result = run_rank(
            plan,
            rank,
            int(os.environ["WORLD_SIZE"]),
            int(os.environ["LOCAL_RANK"]),
            on_size=step,
            on_error=record,
        )
        if result is not None:
            partial = workdir / "result.json.partial"
            partial.write_text(json.dumps(result))
            partial.rename(workdir / "result.json")
        return 0
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        record(exc)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
