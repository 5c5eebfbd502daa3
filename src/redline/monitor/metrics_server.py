"""A Prometheus metrics endpoint that answers a crowd of scrapers at once.

prometheus_client's ``start_http_server`` listens with socketserver's default backlog of 5: when more scrapers
connect at once than its accept loop has taken yet, the kernel drops their SYNs, and they retry a second or
more later or give up (200 simultaneous scrapes of the exporter were answered 53 to 126 times). The server here
is prometheus_client's own WSGI app and thread-per-request server, listening with a backlog of
``LISTEN_BACKLOG`` (the kernel cuts it to ``net.core.somaxconn``, 4096 on current kernels). The exporter of
``redline monitor`` serves through it; so can any other series redline exports (the queue's daemon).

Any local user can connect to it, and a thread per connection would let one pile threads into the process (root's
queue daemon serves its metrics with it): 300 idle connections made 300 threads, kept for good. So a connection
silent for ``HANDLER_TIMEOUT_S`` is dropped, and at most ``MAX_REQUESTS`` are served at once; one past them is
closed as soon as it is accepted, without a thread (a scraper tries again at its next interval).
"""

from __future__ import annotations

import socket
import sys
import threading
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import REGISTRY, CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

# connections the kernel completes and holds for the accept loop: past a Prometheus fleet's scrapes landing in
# one instant, far under what a machine's memory notices (a pending connection is a few hundred bytes)
LISTEN_BACKLOG = 1024
# a scraper sends its request at once and reads the answer in milliseconds; a connection silent this long (for
# its request, or to take the answer) is one no scraper holds, and its thread is given back
HANDLER_TIMEOUT_S = 5.0
# requests served at once, a thread each: over the 200 scrapes landing in one instant the tests send, far under
# what the process's memory or the host's thread limits notice
MAX_REQUESTS = 256


class _QuietHandler(WSGIRequestHandler):
    """No line on stderr per scrape: a monitor's terminal shows samples, not HTTP logs."""

    timeout = HANDLER_TIMEOUT_S  # socketserver sets it on the connection: a silent one raises, and is closed

    def log_message(self, format: str, *args: object) -> None:
        pass


# what socketserver hands a server's hooks: a TCP server's request is its accepted socket
_Request = socket.socket | tuple[bytes, socket.socket]
_Address = Any


class _CappedServer(ThreadingWSGIServer):
    """A thread per request, at most ``slots`` of them at once: a connection past them is closed as soon as it is
    accepted, and a slot comes back when its request's thread ends."""

    slots: threading.BoundedSemaphore

    def process_request(self, request: _Request, client_address: _Address) -> None:
        if not self.slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread started: the slot is not taken (socketserver closes the connection)
            self.slots.release()
            raise

    def process_request_thread(self, request: _Request, client_address: _Address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def handle_error(self, request: _Request, client_address: _Address) -> None:
        """A client that went silent (timed out) or away is no error of the server's: no traceback on stderr."""
        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)


def start_metrics_server(
    port: int, addr: str = "127.0.0.1", registry: CollectorRegistry = REGISTRY, *, backlog: int = LISTEN_BACKLOG
) -> tuple[WSGIServer, threading.Thread]:
    """Serve ``registry`` at ``http://ADDR:PORT/metrics`` (any path answers, as prometheus_client's does) from a
    daemon thread, a thread per request (at most ``MAX_REQUESTS``, each dropped after ``HANDLER_TIMEOUT_S`` of
    silence), listening with ``backlog`` pending connections: what ``prometheus_client.start_http_server(port,
    addr, registry)`` does, same arguments and return (the server, whose ``server_address`` holds the port bound
    for 0, and its thread), without its backlog of 5. Loopback unless ``addr`` says otherwise. OSError
    (socket.gaierror for a name) as binding raises it."""
    family, host = _family(addr, port)

    class Server(_CappedServer):
        address_family = family
        request_queue_size = backlog  # what socketserver passes to listen()
        slots = threading.BoundedSemaphore(MAX_REQUESTS)

    httpd = make_server(host, port, make_wsgi_app(registry), Server, handler_class=_QuietHandler)
    thread = threading.Thread(target=httpd.serve_forever, name=f"metrics-{httpd.server_address[1]}", daemon=True)
    thread.start()
    return httpd, thread


def _family(addr: str, port: int) -> tuple[socket.AddressFamily, str]:
    """The address family ``addr`` needs (IPv6 for '::'), and the address as the socket takes it."""
    family, _, _, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    return family, str(sockaddr[0])
