"""Run `redline ARGS` without paying for a new interpreter: in a process forked from one that has already
imported the CLI and PyTorch.

A subprocess per command (``executable``) starts Python and imports typer, rich and redline each time,
and PyTorch for the commands that train or measure: most of a second on two cores, for commands that then
answer in milliseconds. A fork pays for neither. Each command still runs in a process of its own, because
commands change what a process holds (the environment, the folder, signal handlers, PyTorch's thread count,
threads and servers they start) and a test must not inherit another's. Its output goes through real
descriptors that are not a terminal, as in a pipe or a job log, and a command that outlives its timeout is
killed with everything it started.

The command goes through ``redline.cli.main.run``, the function behind the ``redline`` executable, so exit
codes and one-line errors are the executable's. What only the executable does (its early Ctrl-C handling,
``python -m redline``) is tested through ``executable`` (``run_executable`` in conftest).
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

# the forkserver imports these once; every command is a fork of it. Forking a process that has imported
# PyTorch but run nothing is what DataLoader workers do; forking the test process itself (threads, a PyTorch
# thread pool that ran) is not safe.
_context = multiprocessing.get_context("forkserver")
_context.set_forkserver_preload(["__main__", "cli_fork", "redline.cli.main", "torch"])


# read by native libraries as they load (OpenMP, oneDNN, MKL, the dynamic linker) or by Python as it starts: a
# command given one of these needs a new interpreter to see it (PYTHONPATH is applied in the fork)
READ_AT_START = ("OMP_", "KMP_", "GOMP_", "MKL_", "ONEDNN_", "DNNL_", "LD_", "MALLOC_", "PYTHON")


def cli(
    *args: str,
    stdin: str | None = None,
    timeout: float = 900,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    columns: int = 120,
) -> subprocess.CompletedProcess[str]:
    """Run `redline ARGS` as a user would: a process of its own, real exit code, real stdout and stderr off a
    TTY (no REDLINE_DEBUG, ``columns`` wide, empty stdin unless given), as ``executable`` runs it.

    ``timeout`` only catches a hang: it raises ``subprocess.TimeoutExpired`` after killing the command's process
    group. A command's time follows its work, and a loaded 2-core runner may take ten times as long as an idle
    one (a traced 1B model took over 120 s there)."""
    if any(name.startswith(READ_AT_START) and name != "PYTHONPATH" for name in env or {}):
        return executable(*args, stdin=stdin, timeout=timeout, env=env, cwd=cwd, columns=columns)
    env = _environment(env, columns)
    with tempfile.TemporaryDirectory(prefix="redline-cli-") as scratch:
        streams = [Path(scratch, name) for name in ("stdin", "stdout", "stderr")]
        for path, text in zip(streams, (stdin or "", "", ""), strict=True):
            path.write_text(text)
        status = Path(scratch, "status")
        process = _context.Process(
            target=_command, args=(list(args), env, str(cwd or Path.cwd()), list(map(str, streams)), str(status))
        )
        process.start()
        process.join(timeout)
        if process.is_alive():
            _kill_group(process)
            raise subprocess.TimeoutExpired(["redline", *args], timeout)
        stdout, stderr = (p.read_text(errors="replace") for p in streams[1:])
        # the command's own word for its exit code: Process.exitcode is 255 when two threads poll one process
        # at once (Process.start in one thread polls every child, and the other thread's read finds the
        # forkserver's report already taken). Without a status file the command died before writing it.
        code = int(status.read_text()) if status.exists() else process.exitcode
    return subprocess.CompletedProcess(["redline", *args], code, stdout, stderr)


def executable(
    *args: str,
    stdin: str | None = None,
    timeout: float = 900,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    columns: int = 120,
) -> subprocess.CompletedProcess[str]:
    """`python -m redline ARGS` in a new interpreter: for what only the executable does (its start, Ctrl-C
    while it imports) and for environments read as a process starts."""
    return subprocess.run(
        [sys.executable, "-m", "redline", *args],
        input=stdin,
        stdin=subprocess.DEVNULL if stdin is None else None,  # a command that reads stdin gets an empty one
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_environment(env, columns),
        cwd=cwd,
        check=False,
    )


def _environment(env: dict[str, str] | None, columns: int) -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "REDLINE_DEBUG"} | {"COLUMNS": str(columns)} | (env or {})


def _kill_group(process: multiprocessing.process.BaseProcess) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)  # the command leads its own group (setsid in _command)
    except ProcessLookupError:  # killed before it made its group
        process.kill()
    process.join()


def _command(argv: list[str], env: dict[str, str], cwd: str, streams: list[str], status: str) -> None:
    """In the forked process: become what a fresh `redline ARGV` would be, run it, exit with its code."""
    pid = os.getpid()
    os.setsid()
    os.environ.clear()
    os.environ.update(env)
    for fd, (path, flags) in enumerate(zip(streams, (os.O_RDONLY, os.O_WRONLY, os.O_WRONLY), strict=True)):
        opened = os.open(path, flags)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 (the process's stdin for its whole life)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a new interpreter
    code = 1
    try:
        os.chdir(cwd)
        # what `python -m` puts first on sys.path: the current folder, then PYTHONPATH's folders
        sys.path[:0] = [cwd, *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
        from redline.cli import main, ui

        importlib.reload(ui)  # its consoles, made again for this process's descriptors and COLUMNS
        code = main.run(argv)
    except SystemExit as exc:  # a command that exits by itself
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # what an interpreter would print before exiting 1 (REDLINE_DEBUG=1, a bug here)
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        if os.getpid() == pid:  # not a process the command forked that came back this way
            with contextlib.suppress(OSError):
                Path(status).write_text(str(code))
        os._exit(code)
