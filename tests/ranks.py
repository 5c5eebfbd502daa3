"""Multi-rank tests: a script run as ``world`` gloo ranks, each a process of its own that starts as a new
interpreter would (nothing of the test process's state), meeting through a file rendezvous (no port to race for),
every process gone on the way out.

Each rank is a fork of the server in ``forked``, which has imported PyTorch and transformers once: a new
interpreter spends 5 s of CPU importing a Hugging Face model before its first step. An environment only a new
interpreter reads (``OMP_NUM_THREADS``, ...) gets new interpreters instead.

The script reads ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` (what torchrun sets, so
``prepare()`` finds its place) and ``STORE``, the rendezvous file: ``init_process_group("gloo",
init_method="file://" + os.environ["STORE"], ...)``, or ``prepare()``'s own start, which reads the same
variables. It tears its group down itself, after a barrier: a gloo group torn down under a busy peer can abort it.
"""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

import forked

TESTS = Path(__file__).parent


def script_pythonpath() -> str:
    """``PYTHONPATH`` for a rank script a command launches (``redline run`` through torchrun): this redline,
    whatever the working directory, and tests/, whose modules (this one) the scripts import by plain name."""
    import redline

    source = str(Path(redline.__file__).parents[1])
    return os.pathsep.join(filter(None, [source, str(TESTS), os.environ.get("PYTHONPATH")]))


def spawn_ranks(
    script: Path,
    world: int,
    *,
    store: Path,
    env: dict[str, str] | None = None,
    args: Sequence[str] = (),
    timeout: float = 600,
) -> list[str]:
    """Run ``script`` (with ``args``) as ``world`` ranks; each rank's output (stdout and stderr). A rank that
    exits non-zero fails the test with its output. ``timeout`` is a hang guard only: the ranks' time follows
    their work."""
    # the ranks import test modules (and this one) by plain name, as pytest's pythonpath lets the tests
    path = os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))
    base = os.environ | {
        "PYTHONPATH": path,
        "STORE": str(store),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
    }
    ranks = [base | (env or {}) | {"RANK": str(rank), "LOCAL_RANK": str(rank)} for rank in range(world)]
    run = _new_interpreters if forked.needs_new_interpreter(env) else _forks
    codes, outputs = run([str(script), *args], ranks, timeout)
    for rank, (code, output) in enumerate(zip(codes, outputs, strict=True)):
        assert code == 0, f"rank {rank} exited with {code}:\n{output[-3000:]}"
    return outputs


def leave_together() -> NoReturn:
    """The end of a rank script whose results are written: wait for every rank (a gloo group torn down under a
    busy peer can abort it), tear the group down, and exit 0 without the interpreter's teardown, where gloo's
    threads abort now and then."""
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def _forks(argv: list[str], envs: list[dict[str, str]], timeout: float) -> tuple[list[int], list[str]]:
    with tempfile.TemporaryDirectory(prefix="redline-ranks-") as scratch:
        stdin = Path(scratch, "stdin")
        stdin.touch()
        outputs = [Path(scratch, f"rank{rank}.out") for rank in range(len(envs))]
        statuses = [Path(scratch, f"rank{rank}.status") for rank in range(len(envs))]
        for output in outputs:
            output.touch()
        processes = [
            forked.start(_rank, argv, env, os.getcwd(), str(stdin), str(output), status=status)
            for env, output, status in zip(envs, outputs, statuses, strict=True)
        ]
        try:
            codes = [
                forked.wait(process, status, timeout, [sys.executable, *argv])
                for process, status in zip(processes, statuses, strict=True)
            ]
        finally:
            for process in processes:
                if process.is_alive():
                    forked.kill(process)
        return codes, [output.read_text(errors="replace") for output in outputs]


def _rank(argv: list[str], env: dict[str, str], cwd: str, stdin: str, output: str) -> int:
    """In the fork: `python SCRIPT ARGS` (the script's folder first on sys.path), its output to ``output``."""
    forked.become(env, cwd, stdin=stdin, stdout=output, stderr=output, path=[str(Path(argv[0]).parent)])
    sys.argv = list(argv)
    runpy.run_path(argv[0], run_name="__main__")
    return 0


def _new_interpreters(argv: list[str], envs: list[dict[str, str]], timeout: float) -> tuple[list[int], list[str]]:
    procs = [
        subprocess.Popen([sys.executable, *argv], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for env in envs
    ]
    try:
        outputs = [proc.communicate(timeout=timeout)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return [proc.returncode for proc in procs], outputs
