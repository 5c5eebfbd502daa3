"""How many streams this host can run, and the checks of a transfer's options in the words the command line
uses (``transfer.Options`` checks its own fields with them, so a library caller hears what a CLI user does).

A stream is a thread with a socket and, while it writes, the part file's descriptor: two descriptors. Half of
what the process may open goes to the streams; the other half to the files admitted ahead of them (their lock
and folder, ``fetcher._files_ahead``), Python's own, and the connections a pool keeps. Past 1,024 streams a
host runs out of sockets and threads, not bandwidth.
"""

from __future__ import annotations

import resource

from redline.errors import BadInput
from redline.hw.limits import task_cap
from redline.units import fmt_bytes

MAX_STREAMS = 1024
FDS_PER_STREAM = 2  # its socket, and the part file it writes
MAX_RETRIES = 100  # at the 30 s pause cap, most of an hour of one chunk failing: past that, nothing is cured
MIN_CHUNK_BYTES = 64 * 1024
MAX_CHUNK_BYTES = 1 << 30  # a failed chunk is fetched again whole


def host_streams() -> int:
    """The most streams this process can run: MAX_STREAMS, or fewer where its descriptor limit (or the tasks
    the kernel lets this user start: ``hw.limits.task_cap``) is lower."""
    return _host_limit()[0]


def _host_limit() -> tuple[int, str]:
    """(the cap, why it is that)."""
    cap, why = MAX_STREAMS, "past it a host runs out of sockets and threads, not bandwidth"
    files, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if files != resource.RLIM_INFINITY and files // 2 // FDS_PER_STREAM < cap:
        cap = max(1, files // 2 // FDS_PER_STREAM)
        why = f"this process may open {files} files (ulimit -n), {FDS_PER_STREAM} per stream, half for streams"
    tasks = task_cap()  # a stream is a thread: the kernel counts it against the user's tasks
    if tasks is not None and tasks.most // 2 < cap:
        cap = max(1, tasks.most // 2)
        why = f"this user may run {tasks.most} threads ({tasks.why}), half for streams"
    return cap, why


def check_count(option: str, value: int | None) -> None:
    """BadInput, one line, when a count of streams or connections is under 1 or over what the host runs."""
    if value is None:
        return
    cap, why = _host_limit()
    if not 1 <= value <= cap:
        raise BadInput(f"{option} must be between 1 and {cap} ({why})")


def check_retries(value: int) -> None:
    if not 0 <= value <= MAX_RETRIES:
        raise BadInput(f"--retries must be between 0 and {MAX_RETRIES}")


def check_chunk(value: int | None) -> None:
    if value is not None and not MIN_CHUNK_BYTES <= value <= MAX_CHUNK_BYTES:
        raise BadInput(f"--chunk-size must be between 64K and {fmt_bytes(MAX_CHUNK_BYTES)}")
