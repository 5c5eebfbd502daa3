"""A signal as a request to stop a run at its next step boundary, after a checkpoint.

A spot instance's preemption notice is a SIGTERM, and so is torchrun stopping its workers; Ctrl-C is a
SIGINT. Without redline either ends the script at once, losing the steps since the last checkpoint. With a
checkpoint directory the run takes them as a request instead: this rank notes it (``StopSignals``), the ranks
learn of it in the step's small all-reduce, and every rank checkpoints at the same step boundary and exits
128 + the signal's number (``Stopped``), as a process ended by the signal would.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

log = logging.getLogger("redline.runtime")


class Stopped(SystemExit):
    """Asked to stop by a signal, the run checkpointed at a step boundary: exits 128 + the signal's number
    (SystemExit: no traceback, and the code after the user's loop does not run as if training had finished)."""


class StopSignals:
    """SIGTERM and SIGINT noted as a request to stop (``requested``) instead of ending the process.

    - A second SIGTERM is the same request again: one sent to a process group reaches the script directly
      and again through its launcher.
    - A second Ctrl-C acts as it would have without redline: the handler in place before, or the default.
    - A process forked from this one inherits the handler (a user's ``multiprocessing.Process``; DataLoader
      workers set their own SIGTERM handler): there a signal ends it as it would have.
    - Only the main thread can set handlers: ``install`` and ``restore`` elsewhere do nothing.

    ``install`` when the run starts, ``restore`` when it closes (the handlers that were there before).
    """

    def __init__(self, *, rank: int, steps_done: Callable[[], int]) -> None:
        self.requested: int | None = None  # the signal that asked this rank to stop, None until one does
        self._rank = rank
        self._steps_done = steps_done  # for the message: the request takes effect at the end of the next step
        self._previous: dict[int, Any] = {}  # the handlers installed over, to restore
        self._pid = os.getpid()  # the process that installed the handlers (a forked child has another)

    def install(self) -> None:
        """Take SIGTERM and SIGINT in this process (from the main thread; elsewhere nothing)."""
        if threading.current_thread() is not threading.main_thread():
            return
        self._pid = os.getpid()
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self.handle)

    def restore(self) -> None:
        """Put back the handlers ``install`` replaced (a no-op when it replaced none)."""
        if threading.current_thread() is not threading.main_thread():
            return  # close() from a garbage-collected generator in another thread: only the main thread may
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def handle(self, signum: int, frame: FrameType | None) -> None:
        """The signal handler: the first SIGTERM or SIGINT is a request, see the class docstring for the rest."""
        if os.getpid() != self._pid:  # a process forked from the run inherited the handler
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if self.requested is not None and signum == signal.SIGTERM:
            return  # the same request again
        if self.requested is not None:  # a second Ctrl-C: as if redline were not there
            previous = self._previous.get(signum, signal.SIG_DFL)
            self.restore()
            if callable(previous):
                previous(signum, frame)
            else:
                signal.raise_signal(signum)
            return
        self.requested = signum
        if self._rank == 0:
            log.warning(
                "%s: checkpointing at the end of step %d, then stopping (send it again to stop at once)",
                signal.Signals(signum).name,
                self._steps_done() + 1,
            )
