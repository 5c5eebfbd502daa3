"""What the queue's clients and its daemon say to each other over the daemon's unix socket.

One connection carries one request and one answer, each a line of JSON. Every request names the protocol it
speaks (``"v"``) and its operation (``"op"``, an ``Op``); every answer carries the daemon's protocol, ``"ok"``,
and either the operation's fields or ``"error"``, one line for the user. A client and a daemon of different
protocols refuse each other in one line naming both (task-spooler's ``PROTOCOL_VERSION``), so an upgrade that
left the old daemon running says so instead of failing on a missing field.

The answer to ``log`` carries the log's open descriptor (SCM_RIGHTS): the daemon checks that the asker may
read it and opens it; the client reads it without needing to reach the queue's private folders.
"""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Any

from redline.errors import BadInput

# 1: the queue's first protocol (no "v"); 2: "v", the "job" operation, logs passed as descriptors
PROTOCOL_VERSION = 2
MAX_REQUEST_BYTES = 1 << 20  # a submit carries the user's environment: a few KiB, a MiB at the most
MAX_ANSWER_BYTES = 256 << 20  # `jobs --all` of a long-lived queue: some KiB a job
REQUEST_READ_S = 10.0  # a client that has not sent its whole request by then is dropped
ANSWER_WRITE_S = 10.0  # ... and one that does not take its answer
CLIENT_WAIT_S = 60.0  # a client gives up on a daemon that has not answered by then (a status reads NVML)
CONNECTIONS_PER_USER = 32  # open at once from one uid; a CLI uses one at a time


class Op(StrEnum):
    SUBMIT = "submit"
    JOBS = "jobs"  # the live jobs and the latest ended ones ("all": every job)
    JOB = "job"  # one job, as `jobs` shows it
    CANCEL = "cancel"
    HOLD = "hold"
    RELEASE = "release"
    LOG = "log"  # a job's log: its descriptor rides with the answer
    STATUS = "status"


def request_line(op: Op, **fields: Any) -> bytes:
    return json.dumps({"v": PROTOCOL_VERSION, "op": op.value, **fields}).encode() + b"\n"


def answer_line(fields: dict[str, Any]) -> bytes:
    return json.dumps({"v": PROTOCOL_VERSION, **fields}).encode() + b"\n"


def parse_request(line: bytes) -> tuple[Op, dict[str, Any]]:
    """The operation and fields of a request line; BadInput, one line, for a malformed one or another
    protocol's."""
    try:
        request = json.loads(line)
    except ValueError as exc:
        raise BadInput(f"a malformed request: {exc}") from None
    if not isinstance(request, dict):
        raise BadInput("a malformed request: not a JSON object")
    version = request.get("v", 1)
    if version != PROTOCOL_VERSION:
        raise BadInput(
            f"this queue daemon speaks queue protocol {PROTOCOL_VERSION}, the client {version}: "
            "use the redline the daemon runs, or restart the daemon with yours"
        )
    op = request.get("op")
    if not isinstance(op, str):  # null, a number, a list: no operation's name either
        raise BadInput(f"unknown request {op!r}")
    try:
        return Op(op), request
    except ValueError:
        raise BadInput(f"unknown request {op!r}") from None


def check_answer(answer: Any, where: str) -> dict[str, Any]:
    """The fields of a daemon's answer; BadInput with the daemon's one line when it refused, and one naming
    both protocols when it speaks another."""
    if not isinstance(answer, dict):
        raise BadInput(f"the queue daemon at {where} sent a malformed answer")
    version = answer.get("v", 1)
    if version != PROTOCOL_VERSION:
        raise BadInput(
            f"the queue daemon at {where} speaks queue protocol {version}, this redline {PROTOCOL_VERSION}: "
            "restart it with this redline (the machine's: `systemctl restart redline-queue`)"
        )
    if not answer.get("ok"):
        raise BadInput(str(answer.get("error") or "the queue daemon refused without saying why"))
    return {k: v for k, v in answer.items() if k not in ("v", "ok")}
