"""Processes of a job die with the process that launched them.

torchrun starts each worker in a session of its own, and nothing ties either to redline: a ``kill -9`` of
``redline run`` (or of its process group) used to leave torchrun and every worker training, unsupervised, to
the end. Linux's parent-death signal (``prctl(PR_SET_PDEATHSIG)``) asks the kernel to kill a process when its
parent ends, however the parent ends. redline sets it on the process it starts (the script, or torchrun), and
torchrun's workers, and a single process, run the script through this module, which sets it on itself first,
and turns an error of redline's own (``RedlineError``: a plan that does not fit the launch) into one line (naming
the rank under torchrun)::

    python -m redline.runtime.supervised SCRIPT ARGS...   # then SCRIPT runs as `python SCRIPT ARGS` would
"""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys

from redline.env import REDLINE_DEBUG

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


# resolved at import: die_with_parent runs between fork and exec (preexec_fn), where loading a library is unsafe
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when its parent ends; ``parent`` is the pid it should still have (if the parent
    ended before the request, the process was already handed to another and leaves now). Not Linux: nothing."""
    if _prctl is None:
        return
    if _prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        return  # a kernel or sandbox that refuses it: the job runs unsupervised, as without redline
    if os.getppid() != parent:
        os._exit(128 + signal.SIGKILL)


def main() -> None:
    die_with_parent(os.getppid())
    if len(sys.argv) < 2:
        sys.exit("usage: python -m redline.runtime.supervised SCRIPT [ARGS...]")
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    # as `python SCRIPT` sets it: the script's own folder first, in place of the one `-m` put there (none
    # under -P / PYTHONSAFEPATH)
    if sys.path and sys.path[0] in ("", os.getcwd()):
        del sys.path[0]
    sys.path.insert(0, os.path.dirname(os.path.realpath(script)))
    from redline.errors import RedlineError

    try:
        runpy.run_path(script, run_name="__main__")
    except RedlineError as exc:  # redline's own errors (a plan that does not fit this launch): one line per rank
        if os.environ.get(REDLINE_DEBUG):
            raise
        rank = os.environ.get("RANK")  # torchrun's workers have one; a single process is no rank of a group
        print(f"redline: rank {rank}: {exc}" if rank is not None else f"redline: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)


if __name__ == "__main__":
    main()
