"""StopSignals in process: a signal noted as a request, the handlers put back as they were.

The whole path (a SIGTERM to ``redline run``, a checkpoint at the next step, exit 143 and a bit-identical
resume) is test_launch.py's; the request's edge cases with a real run are in test_data.py.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

import pytest

from redline.runtime.stop import StopSignals


@pytest.fixture
def handlers() -> Any:
    """SIGTERM's and SIGINT's handlers as a test found them, put back after it."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield saved
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def test_install_takes_both_signals_and_restore_puts_back_the_previous_handlers(handlers) -> None:
    stop = StopSignals(rank=0, steps_done=lambda: 3)
    stop.install()
    assert signal.getsignal(signal.SIGTERM) == stop.handle and signal.getsignal(signal.SIGINT) == stop.handle
    stop.restore()
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers
    stop.restore()  # a second close: nothing left to put back


def test_the_first_signal_is_a_request_said_with_the_step_it_takes_effect_at(handlers, caplog) -> None:
    stop = StopSignals(rank=0, steps_done=lambda: 3)
    stop.install()
    with caplog.at_level("WARNING", logger="redline.runtime"):
        stop.handle(signal.SIGINT, None)
    assert stop.requested == signal.SIGINT
    assert "SIGINT: checkpointing at the end of step 4" in caplog.text
    stop.restore()


def test_a_second_ctrl_c_goes_to_the_handler_that_was_there_before(handlers) -> None:
    taken: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: taken.append(signum))
    stop = StopSignals(rank=1, steps_done=lambda: 0)
    stop.install()
    stop.handle(signal.SIGINT, None)
    assert taken == [] and stop.requested == signal.SIGINT
    stop.handle(signal.SIGINT, None)
    assert taken == [signal.SIGINT]
    assert signal.getsignal(signal.SIGINT) != stop.handle  # restored: a third one is the old handler's directly


def test_outside_the_main_thread_nothing_is_installed(handlers) -> None:
    stop = StopSignals(rank=0, steps_done=lambda: 0)
    thread = threading.Thread(target=stop.install)
    thread.start()
    thread.join()
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers
