"""torchrun, with a short report when a worker fails: ``python -m redline.runtime.elastic TORCHRUN-ARGS...``.

torchrun's own ``main`` runs unchanged (rendezvous, restarts, elastic nodes). When workers fail for good it
raises ``ChildFailedError``, whose text is a table of every failed rank (86 lines for one ``BadInput`` in two
ranks, under each rank's own traceback). Each worker has already said what went wrong (a redline error is one
line, ``supervised``); this says which rank failed first and with what exit code, in one line, and exits with
that code. ``REDLINE_DEBUG=1`` shows torchrun's table.
"""

from __future__ import annotations

import os
import signal
import sys

from redline.env import REDLINE_DEBUG


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    try:
        torchrun(argv)
    except SignalException as exc:  # redline passed on a SIGTERM or SIGINT; torchrun stopped its workers
        if os.environ.get(REDLINE_DEBUG):
            raise
        return 128 + int(exc.sigval)
    except ChildFailedError as exc:
        if os.environ.get(REDLINE_DEBUG):
            raise
        rank, failure = exc.get_first_failure()
        code = failure.exitcode
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit {code}"
        others = len(exc.failures) - 1
        also = f"; {others} other process{'es' if others > 1 else ''} failed too" if others else ""
        print(f"redline: rank {rank} failed first ({how}){also}; its own output is above", file=sys.stderr)
        return 128 - code if code < 0 else code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
