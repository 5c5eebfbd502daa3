"""Run `redline ARGS` without paying for a new interpreter: in a process forked from one that has already
imported the CLI and PyTorch (``forked``).

Each command still runs in a process of its own, because commands change what a process holds (the
environment, the folder, signal handlers, PyTorch's thread count, threads and servers they start) and a test
must not inherit another's. Its output goes through real descriptors that are not a terminal, as in a pipe or a
job log, and a command that outlives its timeout is killed with everything it started.

The command goes through ``redline.cli.main.run``, the function behind the ``redline`` executable, so exit
codes and one-line errors are the executable's. What only the executable does (its early Ctrl-C handling,
``python -m redline``) is tested through ``executable`` (``run_executable`` in conftest).
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import forked

# what a command says on stderr of work still running after 2 s (ui.phase, ui.progress_bar off a terminal), before
# its answer or its error: "redline: profiling resnet50 ...", "redline: trial 2: repeat, mb=32 (1/16 done) ..."
PROGRESS = re.compile(r"redline: .+ \.\.\.")


def said(stderr: str) -> list[str]:
    """The lines of ``stderr`` other than progress lines: what the command said."""
    return [line for line in stderr.strip().splitlines() if not PROGRESS.fullmatch(line)]


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
    if forked.needs_new_interpreter(env):
        return executable(*args, stdin=stdin, timeout=timeout, env=env, cwd=cwd, columns=columns)
    env = _environment(env, columns)
    with tempfile.TemporaryDirectory(prefix="redline-cli-") as scratch:
        streams = [Path(scratch, name) for name in ("stdin", "stdout", "stderr")]
        for path, text in zip(streams, (stdin or "", "", ""), strict=True):
            path.write_text(text)
        status = Path(scratch, "status")
        process = forked.start(
            _command, list(args), env, str(cwd or Path.cwd()), list(map(str, streams)), status=status
        )
        code = forked.wait(process, status, timeout, ["redline", *args])
        stdout, stderr = (p.read_text(errors="replace") for p in streams[1:])
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


def _command(argv: list[str], env: dict[str, str], cwd: str, streams: list[str]) -> int:
    """In the fork: become what a fresh `redline ARGV` would be (`python -m` puts the current folder first on
    sys.path), run it, return its exit code."""
    stdin, stdout, stderr = streams
    forked.become(env, cwd, stdin=stdin, stdout=stdout, stderr=stderr, path=[cwd])
    from redline.cli import main, ui

    importlib.reload(ui)  # its consoles, made again for this process's descriptors and COLUMNS
    return main.run(argv)
