"""Launch a training script: alone, as plain ``python`` would run it, or as N processes per node through torchrun.

The script calls ``redline.prepare()``, which finds the plan through ``REDLINE_PLAN`` (an absolute path). The
launch is checked before anything starts: the plan's world size (data x tensor x pipeline) must be the number
of processes launched. Elastic runs are torchrun's: with ``--max-restarts K`` a worker that dies makes
torchrun restart the whole worker group, up to K times, and the script resumes from its last checkpoint;
with ``--nnodes MIN:MAX`` nodes may join and leave between MIN and MAX.

Deciding the launch (``resolve_nproc_per_node``, ``check_world_size``, ``build_launch``) is pure; running it
(``execute``) and counting GPUs (``visible_cuda_gpus``) are the two places with processes.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from redline.capability import is_available, torch_is_cpu_only
from redline.env import REDLINE_PLAN, REDLINE_RUNTIME
from redline.errors import BadInput
from redline.files import refuse_non_regular
from redline.plan.hardware import MAX_NODES
from redline.plan.strategy import Strategy
from redline.runtime.supervised import die_with_parent

SUPERVISED = "redline.runtime.supervised"  # the module torchrun's workers run the script through
ELASTIC = "redline.runtime.elastic"  # torchrun (torch.distributed.run), its failure report one line
# How long a signalled script may take to stop before it is killed. torchrun gives its own workers 30 s
# after SIGTERM before killing them; killing torchrun earlier would orphan them.
STOP_GRACE_S = 45.0
# the signals redline answers while the script runs; SIGINT is Ctrl-C
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass(frozen=True)
class Nodes:
    """How many nodes take part: ``min == max`` is a fixed count, ``min < max`` an elastic range."""

    min: int = 1
    max: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.min <= self.max <= MAX_NODES:
            raise ValueError(f"need 1 <= MIN <= MAX <= {MAX_NODES} nodes, not {self.min}:{self.max}")

    @property
    def elastic(self) -> bool:
        return self.min < self.max

    def __str__(self) -> str:
        """torchrun's ``--nnodes`` form: ``2`` or ``1:2``."""
        return f"{self.min}:{self.max}" if self.elastic else str(self.max)


def parse_nodes(text: str) -> Nodes:
    """``--nnodes N`` or ``--nnodes MIN:MAX``."""
    parts = text.split(":")
    try:
        if len(parts) == 1:
            return Nodes(int(parts[0]), int(parts[0]))
        if len(parts) == 2:
            return Nodes(int(parts[0]), int(parts[1]))
    except ValueError:
        pass
    raise BadInput(
        f"--nnodes takes N or MIN:MAX with 1 <= MIN <= MAX <= {MAX_NODES} (the largest cluster redline plans for), "
        f"not {text!r}"
    )


@dataclass(frozen=True)
class Launch:
    """One launch, fully decided: the command, what redline adds to its environment, how many processes."""

    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)  # added to redline's own environment for the script
    script: str = ""
    nproc_per_node: int = 1
    nodes: Nodes = Nodes()
    max_restarts: int = 0
    plan_path: str | None = None  # absolute
    torchrun: bool = False  # False: one process, exactly as `python script.py ARGS` would run it

    @property
    def world_size(self) -> int:
        """Processes when every node has joined (the largest world of an elastic range)."""
        return self.nproc_per_node * self.nodes.max

    def shell_line(self) -> str:
        """The launch as one line a shell would run: the added environment, then the command."""
        return shlex.join([f"{k}={v}" for k, v in self.env.items()] + list(self.argv))

    def to_dict(self) -> dict[str, Any]:
        return {
            "argv": list(self.argv),
            "env": dict(self.env),
            "script": self.script,
            "launcher": "torchrun" if self.torchrun else "python",
            "nproc_per_node": self.nproc_per_node,
            "nnodes": str(self.nodes),
            "world_size": self.world_size,
            "max_restarts": self.max_restarts,
            "plan": self.plan_path,
        }


def resolve_nproc_per_node(
    value: str, nodes: Nodes, strategy: Strategy | None, cuda_gpus: Callable[[], int]
) -> tuple[int, str]:
    """Processes per node and why: a number as given; ``auto`` is every CUDA GPU the script would see, on a
    machine without one the plan's processes per node (so a plan can be rehearsed on CPUs), without a plan 1.

    ``cuda_gpus`` is only called for ``auto``: counting costs a child process that imports torch.
    """
    if value != "auto":
        try:
            count = int(value)
        except ValueError:
            count = 0
        if count < 1:
            raise BadInput(f"--nproc-per-node takes a positive number or auto, not {value!r}")
        check_nproc_per_node(count, cuda_gpus)
        return count, "as given"
    gpus = cuda_gpus()
    if gpus > 0:
        return gpus, f"auto: {gpus} CUDA GPU{'s' if gpus != 1 else ''}"
    if strategy is not None:
        # a world the nodes cannot share evenly is left to check_world_size, which says so
        count = max(1, strategy.gpus // nodes.max)
        check_nproc_per_node(count, lambda: 0)
        return count, "auto: no CUDA GPU, the plan's processes per node"
    return 1, "auto: no CUDA GPU and no plan"


def check_nproc_per_node(count: int, cuda_gpus: Callable[[], int]) -> None:
    """BadInput when ``count`` processes per node are more than this node runs (``hw.limits.rank_cap``); the
    GPUs are counted only for a count the cores alone do not allow (counting costs a child that imports torch)."""
    from redline.hw.limits import check_count, rank_cap

    if count > rank_cap(0).most:
        check_count("--nproc-per-node", count, "processes per node", rank_cap(cuda_gpus()))


def check_world_size(strategy: Strategy, nproc_per_node: int, nodes: Nodes, plan_path: str) -> None:
    """The plan's layout must be the launched world: BadInput naming both numbers when it is not.

    An elastic range is checked at its maximum, which is what the plan was laid out for; at its minimum the
    world must still hold whole tensor x pipeline groups, since only data parallelism can shrink.
    """
    world = nproc_per_node * nodes.max
    layout = f"data {strategy.data} x tensor {strategy.tensor} x pipeline {strategy.pipeline}"
    if world != strategy.gpus:
        where = f"{nodes.max} node{'s' if nodes.max != 1 else ''}"
        raise BadInput(
            f"{plan_path} is laid out for {strategy.gpus} processes ({layout}), but this launch starts "
            f"{nproc_per_node} per node x {where} = {world}: set --nproc-per-node/--nnodes to match, "
            "or plan again for this hardware"
        )
    group = strategy.tensor * strategy.pipeline
    smallest = nproc_per_node * nodes.min
    if nodes.elastic and smallest % group:
        raise BadInput(
            f"--nnodes {nodes}: with {nodes.min} node(s) the world is {smallest} processes, which cannot hold "
            f"whole tensor x pipeline groups of {group} ({layout} in {plan_path}); raise MIN"
        )


def build_launch(
    script: str,
    script_args: list[str],
    *,
    nproc_per_node: int,
    nodes: Nodes,
    rdzv_endpoint: str | None = None,
    rdzv_id: str | None = None,
    max_restarts: int = 0,
    plan_path: str | None = None,
    runtime: dict[str, Any] | None = None,
    python: str = sys.executable,
) -> Launch:
    """The command that runs ``script``: plain python for one process on one node with nothing to restart,
    else torchrun (``--standalone`` on one node without a rendezvous endpoint, c10d rendezvous otherwise). Either
    runs the script through ``supervised``, as ``python SCRIPT`` would, so that an error of redline's own (a plan
    that does not fit the run) ends it in one line and redline's exit code, not a traceback."""
    refuse_non_regular(script, "script")
    if not Path(script).is_file():
        raise BadInput(f"no such script: {script}")
    if max_restarts < 0:
        raise BadInput(f"--max-restarts must be 0 or more, not {max_restarts}")
    if rdzv_endpoint is not None:
        _check_endpoint(rdzv_endpoint)
    if nodes.max > 1 and rdzv_endpoint is None:
        raise BadInput(f"--nnodes {nodes} needs --rdzv-endpoint HOST:PORT, the same on every node")
    if rdzv_id is not None and rdzv_endpoint is None:
        raise BadInput("--rdzv-id goes with --rdzv-endpoint (a single-node launch makes its own rendezvous)")
    env = {REDLINE_PLAN: plan_path} if plan_path else {}
    if runtime:  # the runtime options, for the script's prepare() (config.runtime_from_env)
        env[REDLINE_RUNTIME] = json.dumps(runtime, sort_keys=True)
    env |= thread_settings(nproc_per_node)
    launch = functools.partial(
        Launch,
        script=script,
        nproc_per_node=nproc_per_node,
        nodes=nodes,
        max_restarts=max_restarts,
        plan_path=plan_path,
        env=env,
    )
    if nproc_per_node == 1 and nodes.max == 1 and rdzv_endpoint is None and max_restarts == 0:
        return launch(argv=(python, "-m", SUPERVISED, script, *script_args), torchrun=False)
    # torchrun's main through redline.runtime.elastic: the same launch, a one-line report when a worker fails
    argv = [python, "-m", ELASTIC, "--nproc-per-node", str(nproc_per_node), "--nnodes", str(nodes)]
    if rdzv_endpoint is None:
        argv.append("--standalone")
    else:
        argv += ["--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint]
        if rdzv_id is not None:
            argv += ["--rdzv-id", rdzv_id]
    # each worker runs the script through redline.runtime.supervised: it dies with torchrun, as torchrun does
    # with redline (execute)
    argv += ["--max-restarts", str(max_restarts), "-m", SUPERVISED, script, *script_args]
    return launch(argv=tuple(argv), torchrun=True)


def thread_settings(nproc_per_node: int, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """Each process's CPU threads: the usable cores shared among the node's processes (at least one), in
    ``OMP_NUM_THREADS``, which PyTorch's intra-op pool and OpenMP/MKL read. Processes that together ask for more
    threads than there are cores time-slice, and a matmul waits for its slowest thread. A value the user set
    is theirs. (torchrun sets 1 for several processes, and nothing for one.)"""
    if "OMP_NUM_THREADS" in environ:
        return {}
    from redline.hw.host import usable_cores

    return {"OMP_NUM_THREADS": str(max(1, usable_cores() // nproc_per_node))}


def _check_endpoint(endpoint: str) -> None:
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise BadInput(f"--rdzv-endpoint takes HOST:PORT, not {endpoint!r}")


def visible_cuda_gpus(timeout_s: float = 60.0) -> int:
    """CUDA GPUs a script would see (CUDA_VISIBLE_DEVICES applied); 0 without torch, with a CPU build, or
    when counting fails.

    Counted in a child python: torch.cuda.device_count() asks NVML first and leaves CUDA uninitialised, but
    falls back to cudaGetDeviceCount() when NVML fails, and importing torch costs seconds; this process
    stays clear of both. A build labelled CPU-only is not asked.
    """
    if not is_available("torch") or torch_is_cpu_only():
        return 0
    try:
        done = subprocess.run(
            [sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        return int(done.stdout.split()[-1]) if done.returncode == 0 else 0
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return 0


@dataclass(frozen=True)
class Outcome:
    exit_code: int  # the script's (or torchrun's) exit status; 128+N when redline was stopped by signal N
    signal: str | None = None  # the first signal redline received while the script ran (SIGINT: Ctrl-C)


def execute(launch: Launch, *, stop_grace_s: float = STOP_GRACE_S) -> Outcome:
    """Run the launch in the foreground and wait for it.

    As POSIX system() does, the script shares redline's process group: Ctrl-C at the terminal reaches it
    directly and it behaves as under plain python (KeyboardInterrupt, a debugger reads the terminal);
    torchrun, in the same place, stops its workers itself. SIGTERM or SIGHUP sent to redline alone, and a
    SIGINT sent with kill, are passed on. Once redline is signalled, the script has ``stop_grace_s`` to
    stop before it is killed. The child dies with redline however redline ends (``supervised``: a kill -9 of
    redline, or of its process group, leaves no part of the job running).
    """
    received: list[int] = []
    child: list[subprocess.Popen] = []

    def on_signal(signum: int, _frame: Any) -> None:
        received.append(signum)
        if child and len(received) == 1:
            _pass_on(child[0], signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in STOP_SIGNALS}
    try:
        launcher = os.getpid()
        proc = subprocess.Popen(
            list(launch.argv), env=os.environ | launch.env, preexec_fn=lambda: die_with_parent(launcher)
        )
        child.append(proc)
        if received:  # signalled while the child was starting: it has not seen the signal
            proc.terminate()
        deadline: float | None = None
        while True:
            try:
                code = proc.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                if received and deadline is None:
                    deadline = time.monotonic() + stop_grace_s
                elif deadline is not None and time.monotonic() > deadline:
                    proc.kill()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received:
        return Outcome(exit_code=128 + received[0], signal=signal.Signals(received[0]).name)
    return Outcome(exit_code=128 - code if code < 0 else code)


def _pass_on(proc: subprocess.Popen, signum: int) -> None:
    """Send the child the signal redline got, unless the terminal already sent it to both.

    A Ctrl-C goes to every process of the terminal's foreground group, the child included; passing it on
    would interrupt the child twice (a second KeyboardInterrupt inside its clean-up). A SIGINT that only
    redline received, from kill, is passed on.
    """
    if signum == signal.SIGINT and _terminal_sent_to_group():
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM if signum == signal.SIGHUP else signum)


def _terminal_sent_to_group() -> bool:
    """Whether redline runs in the terminal's foreground process group, where a Ctrl-C reaches the child too."""
    for stream in (sys.stdin, sys.stdout, sys.stderr):
        try:
            fd = stream.fileno()
            if os.isatty(fd):
                return os.tcgetpgrp(fd) == os.getpgrp()
        except (AttributeError, OSError, ValueError):
            continue
    return False
