"""Test processes that do not pay for a new interpreter: forks of one server process that has imported the CLI,
PyTorch and Hugging Face's transformers, and has run nothing.

A new interpreter spends most of a second on two cores importing typer, rich and redline, 1.6 s of CPU importing
PyTorch and over 5 s importing a Hugging Face model's code, before a `redline` command answers in milliseconds
or a rank trains a two-layer model for a few steps. A fork pays for none of it. Each fork is still a process
of its own, made to look like a new one (its environment, folder, descriptors, ``sys.argv``, ``sys.path``,
Ctrl-C handling), because what a command or a rank changes in its process must not reach the next test.
Forking a process that imported PyTorch but ran nothing is what DataLoader workers do; forking the test process
itself (threads, a PyTorch thread pool that ran) is not safe.

``cli_fork`` runs `redline ARGS` this way, ``ranks`` a rank's script. Settings read as an interpreter or a native
library starts (``READ_AT_START``) cannot be given to a fork: those callers start a new interpreter instead.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

_context = multiprocessing.get_context("forkserver")
# importing a module the server lacks is left to the fork; a preload that fails is skipped by multiprocessing
_context.set_forkserver_preload(
    [
        "__main__",
        "forked",
        "cli_fork",
        "ranks",
        "redline.cli.main",
        "torch",
        "torch.distributed",
        "transformers.models.gpt2.modeling_gpt2",
        "transformers.models.llama.modeling_llama",
        "transformers.models.bert.modeling_bert",
    ]
)

# read by native libraries as they load (OpenMP, oneDNN, MKL, the dynamic linker) or by Python as it starts: a
# process given one of these must be a new interpreter to see it (PYTHONPATH is applied in the fork)
READ_AT_START = ("OMP_", "KMP_", "GOMP_", "MKL_", "ONEDNN_", "DNNL_", "LD_", "MALLOC_", "PYTHON")


def needs_new_interpreter(env: Mapping[str, str] | None) -> bool:
    """Whether ``env`` sets something only a new interpreter would see."""
    return any(name.startswith(READ_AT_START) and name != "PYTHONPATH" for name in env or {})


def start(target: Callable[..., int], *args: Any, status: Path) -> multiprocessing.process.BaseProcess:
    """Fork the server and run ``target(*args)`` there, in a session of its own; the exit code it returns (or
    raises with SystemExit) is written to ``status``. ``target`` is a module-level function (sent by name)."""
    process = _context.Process(target=_main, args=(target, args, str(status)))
    process.start()
    return process


def wait(process: multiprocessing.process.BaseProcess, status: Path, timeout: float, command: list[str]) -> int:
    """The exit code of a process ``start`` made. ``timeout`` only catches a hang: past it, the process and
    everything it started are killed and ``subprocess.TimeoutExpired`` is raised."""
    process.join(timeout)
    if process.is_alive():
        kill(process)
        raise subprocess.TimeoutExpired(command, timeout)
    # the process's own word for its exit code: Process.exitcode is 255 when two threads poll one process at
    # once (Process.start in one thread polls every child, and the other thread's read finds the server's
    # report already taken). Without a status file the process died before writing it.
    return int(status.read_text()) if status.exists() else process.exitcode  # type: ignore[return-value]


def kill(process: multiprocessing.process.BaseProcess) -> None:
    """Kill the process and all it started (it leads its own process group)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)  # type: ignore[arg-type]
    except ProcessLookupError:  # killed before it made its group
        process.kill()
    process.join()


def become(env: Mapping[str, str], cwd: str, *, stdin: str, stdout: str, stderr: str, path: Iterable[str]) -> None:
    """In the fork: take ``env`` as the whole environment, ``cwd`` as the folder, the three files as descriptors
    0-2 (stdout and stderr appended to, so one file can take both), and ``path`` then PYTHONPATH's folders at
    the front of ``sys.path``, as a new interpreter would."""
    os.environ.clear()
    os.environ.update(env)
    for fd, (name, flags) in enumerate(
        [(stdin, os.O_RDONLY), (stdout, os.O_WRONLY | os.O_APPEND), (stderr, os.O_WRONLY | os.O_APPEND)]
    ):
        opened = os.open(name, flags)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 (the process's stdin for its whole life)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a new interpreter
    os.chdir(cwd)
    sys.path[:0] = [*path, *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]


def _main(target: Callable[..., int], args: tuple[Any, ...], status: str) -> None:
    pid = os.getpid()
    os.setsid()
    code = 1
    try:
        code = target(*args)
    except SystemExit as exc:  # exits by itself
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # what an interpreter would print before exiting 1
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        if os.getpid() == pid:  # not a process the target forked that came back this way
            with contextlib.suppress(OSError):
                Path(status).write_text(str(code))
        os._exit(code)
