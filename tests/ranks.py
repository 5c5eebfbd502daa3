"""Multi-rank tests: a script run as ``world`` gloo ranks in fresh processes (nothing of the test process's
state), meeting through a file rendezvous (no port to race for), every process gone on the way out.

The script reads ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` (what torchrun sets, so
``prepare()`` finds its place) and ``STORE``, the rendezvous file: ``init_process_group("gloo",
init_method="file://" + os.environ["STORE"], ...)``, or ``prepare()``'s own start, which reads the same
variables. It tears its group down itself, after a barrier: a gloo group torn down under a busy peer can abort it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

TESTS = Path(__file__).parent


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
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), *args],
            env=base | (env or {}) | {"RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world)
    ]
    try:
        outputs = [proc.communicate(timeout=timeout)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for rank, (proc, output) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, f"rank {rank} exited with {proc.returncode}:\n{output[-3000:]}"
    return outputs
