"""The daemon's side of its socket: connections read, bounded and answered without ever holding up the loop.

Each connection carries one request line and gets one answer (``protocol``). The kernel says who is asking
(SO_PEERCRED). No client can make the daemon wait for it or run it out of descriptors. The daemon accepts
connections one at a time in its own loop (asyncio's server would accept a backlog's worth before any of
them could be judged), and one that would take a uid past ``CONNECTIONS_PER_USER``, or the daemon past what
its descriptors allow, is answered with one line and closed at once. A request must arrive whole within
``REQUEST_READ_S`` and under ``MAX_REQUEST_BYTES``; an answer must be taken within ``ANSWER_WRITE_S``. So one
user's thousands of idle connections leave everyone else served.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import resource
import socket
import struct
import sys
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from redline.errors import BadInput
from redline.queue.protocol import (
    ANSWER_WRITE_S,
    CONNECTIONS_PER_USER,
    MAX_REQUEST_BYTES,
    REQUEST_READ_S,
    Op,
    answer_line,
    parse_request,
)

BACKLOG = 512  # connections the kernel holds for the daemon to accept
RESERVED_DESCRIPTORS = 128  # kept from clients: the store, the attempts' locks and logs, the metrics server
ACCEPT_PAUSE_S = 0.1  # after the process ran out of descriptors all the same (another part of it holds many)


@dataclass
class Answer:
    fields: dict[str, Any] = field(default_factory=dict)
    fd: int | None = None  # a descriptor handed to the client with the answer (closed here once sent)


Handler = Callable[[Op, dict[str, Any], int], Answer]


class Server:
    """Serves ``handler`` on a unix socket at ``path``; ``on_request`` runs after each answered request (the
    daemon's wake-up). ``start`` in a running event loop, ``close`` to stop."""

    def __init__(self, handler: Handler, on_request: Callable[[], None]) -> None:
        self.handler = handler
        self.on_request = on_request
        self.open: Counter[int] = Counter()  # connections being served, per uid
        self.most = _descriptor_room()  # connections served at once, whoever asks
        self._listener: socket.socket | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self, path: str) -> None:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(BACKLOG)
        listener.setblocking(False)
        self._listener = listener
        self._spawn(self._accept())

    def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._listener is not None:
            self._listener.close()

    def _spawn(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._listener is not None
        while True:
            try:
                conn, _ = await loop.sock_accept(self._listener)
            except OSError as exc:
                if exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    raise
                await asyncio.sleep(ACCEPT_PAUSE_S)  # the kernel keeps the connection waiting meanwhile
                continue
            uid = _peer_uid(conn)
            if self.open[uid] >= CONNECTIONS_PER_USER:
                _refuse_now(
                    conn,
                    f"uid {uid} has {CONNECTIONS_PER_USER} connections open to the queue already: "
                    "close some, or wait for them to end",
                )
            elif self.open.total() >= self.most:
                _refuse_now(conn, f"the queue daemon serves {self.most} connections already: try again shortly")
            else:
                self.open[uid] += 1
                self._spawn(self._serve(conn, uid))

    async def _serve(self, conn: socket.socket, uid: int) -> None:
        try:
            conn.setblocking(False)
            answer = await self._answer(conn, uid)
            await self._send(conn, answer)
        finally:
            conn.close()
            self.open[uid] -= 1
            if not self.open[uid]:
                del self.open[uid]
        self.on_request()

    async def _answer(self, conn: socket.socket, uid: int) -> Answer:
        try:
            line = await asyncio.wait_for(_read_line(conn), REQUEST_READ_S)
        except TimeoutError:
            return _refusal(f"no whole request within {REQUEST_READ_S:g} s")
        except BadInput as exc:  # over the size a request may be
            return _refusal(str(exc))
        except OSError as exc:
            return _refusal(f"the request could not be read: {exc.strerror or exc}")
        op: Op | None = None
        try:
            op, request = parse_request(line)
            answer = self.handler(op, request, uid)
            answer.fields = {"ok": True, **answer.fields}
            return answer
        except BadInput as exc:
            return _refusal(str(exc))
        except (ValueError, KeyError, TypeError) as exc:
            return _refusal(f"a malformed request: {exc}")
        except Exception as exc:  # a bug of ours: said to the client and logged, and the daemon serves on
            say(f"a {op or 'malformed'} request from uid {uid} failed:\n{traceback.format_exc()}")
            return _refusal(f"the queue's daemon failed on this request: {exc!r}")

    async def _send(self, conn: socket.socket, answer: Answer) -> None:
        data = answer_line(answer.fields)
        try:
            if answer.fd is not None:  # the answer's first bytes carry the descriptor
                data = data[socket.send_fds(conn, [data], [answer.fd]) :]
            await asyncio.wait_for(asyncio.get_running_loop().sock_sendall(conn, data), ANSWER_WRITE_S)
        except (OSError, TimeoutError):  # the client left, or does not read: its loss alone
            pass
        finally:
            if answer.fd is not None:
                os.close(answer.fd)


async def _read_line(conn: socket.socket) -> bytes:
    """The request line, up to MAX_REQUEST_BYTES (a longer one is answered as such)."""
    loop = asyncio.get_running_loop()
    data = bytearray()
    while b"\n" not in data:
        if len(data) > MAX_REQUEST_BYTES:
            raise BadInput(f"a request over {MAX_REQUEST_BYTES} bytes")
        chunk = await loop.sock_recv(conn, 1 << 16)
        if not chunk:
            break
        data += chunk
    return bytes(data.partition(b"\n")[0])


def _peer_uid(conn: socket.socket) -> int:
    _, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return uid


def _refusal(why: str) -> Answer:
    return Answer({"ok": False, "error": why})


def _refuse_now(conn: socket.socket, why: str) -> None:
    """One line to a connection that will not be served, without waiting on it, and its descriptor freed."""
    with contextlib.suppress(OSError):
        conn.setblocking(False)
        conn.send(answer_line({"ok": False, "error": why}))
    conn.close()


def _descriptor_room() -> int:
    """Connections the daemon may serve at once: its descriptors (the soft limit raised to the hard one) less
    those it keeps for its own work."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    if soft == resource.RLIM_INFINITY:
        return 1 << 20
    return max(16, soft - RESERVED_DESCRIPTORS)


def say(message: str) -> None:
    """A line for the daemon's log (its stderr): never an error of its own, also on a full disk."""
    with contextlib.suppress(OSError, ValueError):
        print(message, file=sys.stderr, flush=True)
