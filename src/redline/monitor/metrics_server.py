"""A Prometheus metrics endpoint that answers a crowd of scrapers at once.

prometheus_client's ``start_http_server`` listens with socketserver's default backlog of 5: when more scrapers
connect at once than its accept loop has taken yet, the kernel drops their SYNs, and they retry a second or
more later or give up (200 simultaneous scrapes of the exporter were answered 53 to 126 times). The server here
is prometheus_client's own WSGI app and thread-per-request server, listening with a backlog of
``LISTEN_BACKLOG`` (the kernel cuts it to ``net.core.somaxconn``, 4096 on current kernels). The exporter of
``redline monitor`` serves through it; so can any other series redline exports (the queue's daemon).
"""

from __future__ import annotations

import socket
import threading
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import REGISTRY, CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

# connections the kernel completes and holds for the accept loop: past a Prometheus fleet's scrapes landing in
# one instant, far under what a machine's memory notices (a pending connection is a few hundred bytes)
LISTEN_BACKLOG = 1024


class _QuietHandler(WSGIRequestHandler):
    """No line on stderr per scrape: a monitor's terminal shows samples, not HTTP logs."""

    def log_message(self, format: str, *args: object) -> None:
        pass


def start_metrics_server(
    port: int, addr: str = "127.0.0.1", registry: CollectorRegistry = REGISTRY, *, backlog: int = LISTEN_BACKLOG
) -> tuple[WSGIServer, threading.Thread]:
    """Serve ``registry`` at ``http://ADDR:PORT/metrics`` (any path answers, as prometheus_client's does) from a
    daemon thread, a thread per request, listening with ``backlog`` pending connections: what
    ``prometheus_client.start_http_server(port, addr, registry)`` does, same arguments and return (the server,
    whose ``server_address`` holds the port bound for 0, and its thread), without its backlog of 5. Loopback
    unless ``addr`` says otherwise. OSError (socket.gaierror for a name) as binding raises it."""
    family, host = _family(addr, port)

    class Server(ThreadingWSGIServer):
        address_family = family
        request_queue_size = backlog  # what socketserver passes to listen()

    httpd = make_server(host, port, make_wsgi_app(registry), Server, handler_class=_QuietHandler)
    thread = threading.Thread(target=httpd.serve_forever, name=f"metrics-{httpd.server_address[1]}", daemon=True)
    thread.start()
    return httpd, thread


def _family(addr: str, port: int) -> tuple[socket.AddressFamily, str]:
    """The address family ``addr`` needs (IPv6 for '::'), and the address as the socket takes it."""
    family, _, _, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    return family, str(sockaddr[0])
