"""One trial: the user's script run once through ``redline run`` with a candidate's plan file, for a bounded
number of optimizer steps, in a process group of its own (a crash, an out-of-memory or a hang ends the trial,
not the tune), and measured by the runtime's own step metrics.

The score is the end-to-end global samples per second over the steps after the warm-up (data wait included,
as the runtime's ``time_s`` is the whole step); the warm-up's excess over the steady step, which is mostly
``torch.compile``'s, is reported apart as ``startup_s``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from redline.env import REDLINE_PLAN

STATUSES = ("ok", "oom", "failed", "hang", "pruned", "parity")


@dataclass(frozen=True)
class Setup:
    """How every trial runs: the script and its arguments, the ranks, the steps, the per-trial limit."""

    script: str
    args: tuple[str, ...] = ()
    nproc_per_node: int = 1
    warmup_steps: int = 2
    steps: int = 8  # measured steps after the warm-up
    timeout_s: float = 600.0
    run_steps: int | None = None  # the real run's optimizer steps: a trial's startup is spread over them


@dataclass(frozen=True)
class TrialResult:
    status: str  # one of STATUSES
    samples_per_s: float | None = None  # global, over the measured steps
    step_s: float | None = None  # median measured step
    startup_s: float | None = None  # the warm-up steps' time beyond as many steady steps (compile, workers)
    peak_memory_bytes: int | None = None  # torch.cuda.max_memory_allocated, the largest step (None on a CPU)
    samples_per_step: int | None = None  # global
    losses: tuple[float, ...] = field(default=())  # every step's, warm-up included: for the parity check
    wall_s: float = 0.0  # the trial's whole time, launch to exit
    why: str = ""  # for a status other than ok: one line

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"losses": list(self.losses)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrialResult:
        return cls(**(data | {"losses": tuple(data.get("losses") or ())}))


def run_trial(setup: Setup, plan: dict[str, Any] | None, workdir: Path) -> TrialResult:
    """Run the script once with ``plan`` (None: no plan, as plain ``redline run`` does) in ``workdir`` and
    measure it. The trial's processes get their own session: past ``setup.timeout_s`` all of them are
    stopped (SIGTERM, then SIGKILL), whatever they were doing."""
    import yaml

    workdir.mkdir(parents=True, exist_ok=True)
    metrics = workdir / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    command = [sys.executable, "-m", "redline", "run", "--nproc-per-node", str(setup.nproc_per_node)]
    command += ["--metrics", str(metrics), "--max-steps", str(setup.warmup_steps + setup.steps)]
    if plan is not None:
        path = workdir / "plan.yaml"
        path.write_text(yaml.safe_dump(plan, sort_keys=False))
        command += ["--plan", str(path)]
    command += [setup.script, *setup.args]
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    env.pop(REDLINE_PLAN, None)  # the trial's plan, or none: not one the tune itself was started with
    started = time.monotonic()
    with open(workdir / "output.log", "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code = process.wait(timeout=setup.timeout_s)
        except subprocess.TimeoutExpired:
            _stop_group(process)
            return TrialResult("hang", wall_s=time.monotonic() - started, why=f"no end after {setup.timeout_s:.0f} s")
    wall_s = time.monotonic() - started
    _kill_leftovers(process.pid)
    records = read_records(metrics)
    if code != 0:
        tail = _last_line(workdir / "output.log")
        status = "oom" if "out of memory" in tail.lower() or "outofmemory" in tail.lower() else "failed"
        return TrialResult(status, wall_s=wall_s, why=f"exit {code}: {tail}")
    return measure(records, plan, setup, wall_s)


def measure(records: list[dict[str, Any]], plan: dict[str, Any] | None, setup: Setup, wall_s: float) -> TrialResult:
    """A trial's result from its rank-0 step records. A micro-batch smaller than the plan's means the runtime
    ran out of memory and went on smaller: the candidate does not fit."""
    if plan is not None:
        asked = int(plan["strategy"]["micro_batch"])
        shrunk = [r["micro_batch"] for r in records if r["micro_batch"] < asked]
        if shrunk:
            return TrialResult(
                "oom", wall_s=wall_s, why=f"micro-batch {asked} ran out of memory (the run went on at {shrunk[0]})"
            )
    measured = records[setup.warmup_steps :]
    if not measured:
        return TrialResult(
            "failed",
            wall_s=wall_s,
            why=f"{len(records)} step(s): the script's data ends before {setup.warmup_steps} warm-up and "
            f"{setup.steps} measured steps (give it more data or fewer --trial-steps)",
        )
    times = [r["time_s"] for r in measured]
    samples = sum(r["samples"] for r in measured)
    steady = statistics.median(times)
    warmup = [r["time_s"] for r in records[: setup.warmup_steps]]
    peaks = [r["peak_memory_bytes"] for r in records if r.get("peak_memory_bytes") is not None]
    return TrialResult(
        "ok",
        samples_per_s=samples / sum(times) if sum(times) > 0 else None,
        step_s=steady,
        startup_s=max(0.0, sum(warmup) - steady * len(warmup)),
        peak_memory_bytes=max(peaks) if peaks else None,
        samples_per_step=measured[0]["samples"],
        losses=tuple(r["loss"] for r in records if r.get("loss") is not None),
        wall_s=wall_s,
    )


def read_records(path: Path) -> list[dict[str, Any]]:
    """Rank 0's step records of the latest attempt (a run resumed after an out-of-memory restarts the count)."""
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    last = max((r.get("attempt", 0) for r in records), default=0)
    return [r for r in records if r.get("attempt", 0) == last]


def _stop_group(process: subprocess.Popen) -> None:
    """Stop the trial's whole process group: its launcher, its ranks and their DataLoader workers."""
    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _kill_leftovers(group: int) -> None:
    """A process of the trial's group that outlived it (a worker its rank did not reap) would hold CPU and
    memory through the next trial."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(group, signal.SIGKILL)


def _last_line(path: Path) -> str:
    """The output's last line that says something (an error), for the table."""
    lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no output"
