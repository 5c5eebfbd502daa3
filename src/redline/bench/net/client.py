"""`redline bench network --connect HOST`: the client that runs the measurements against a redline server.

Every failure the user can act on (no answer, refused, not a redline server, busy, lost mid-run) becomes a
BadInput of one line; the sockets are closed whatever happens.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from redline.bench.net import streams, tcpinfo, wire
from redline.bench.net.streams import Received
from redline.bench.net.tcpinfo import SenderStats
from redline.errors import BadInput

CONNECT_TIMEOUT_S = 3.0


@dataclass
class Throughput:
    streams: int
    direction: str  # "up": client -> server (iperf3's default); "down": server -> client (iperf3 -R)
    omit_s: float
    duration_s: float
    received: Received
    sender: SenderStats

    @property
    def mbit_s(self) -> float:
        return self.received.bits_per_s / 1e6


@dataclass
class UdpProbe:
    sent: int
    server_received: int
    echoed: int
    rtt_ms: list[float]

    @property
    def answered(self) -> bool:
        return self.echoed > 0 or self.server_received > 0

    @property
    def loss_per_traversal(self) -> float | None:
        """Lost / attempted crossings of the path, both directions pooled: a probe that reached the server
        crossed once, an echo that came back crossed twice. With per-direction loss p this estimates p."""
        attempts = self.sent + self.server_received
        if not self.answered or attempts == 0:
            return None
        lost = (self.sent - self.server_received) + (self.server_received - self.echoed)
        return max(0, lost) / attempts


class Client:
    def __init__(self, host: str, port: int = wire.DEFAULT_PORT, connect_timeout_s: float = CONNECT_TIMEOUT_S):
        self.where = f"{host}:{port}"
        self.port = port
        self.connect_timeout_s = connect_timeout_s
        try:
            self.sock = socket.create_connection((host, port), timeout=connect_timeout_s)
        except socket.gaierror as exc:
            raise BadInput(f"network bench: cannot resolve {host!r}: {exc.strerror}") from None
        except TimeoutError:
            raise BadInput(
                f"network bench: {self.where} did not answer within {connect_timeout_s:g} s "
                "(is the host up, and the port open in its firewall?)"
            ) from None
        except ConnectionRefusedError:
            raise BadInput(
                f"network bench: {self.where} refused the connection; run `redline bench network --serve "
                f"--port {port}` there first"
            ) from None
        except OSError as exc:
            raise BadInput(f"network bench: cannot reach {self.where}: {exc.strerror or exc}") from None
        try:
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            t0 = time.perf_counter()
            self.sock.sendall(wire.MAGIC + wire.encode({"op": "hello", "version": wire.PROTOCOL_VERSION}))
            wire.recv_magic(self.sock)
            hello = wire.recv_frame(self.sock)
            self.handshake_rtt_s = time.perf_counter() - t0
            if hello["op"] == "error":
                raise BadInput(f"network bench: {self.where} refused: {hello.get('reason', 'no reason given')}")
            if hello["op"] == "busy":
                raise BadInput(f"network bench: {self.where} is busy with another client; try again shortly")
            if hello["op"] != "hello" or hello.get("version") != wire.PROTOCOL_VERSION:
                raise wire.ProtocolError(f"protocol version {hello.get('version')!r}, need {wire.PROTOCOL_VERSION}")
        except TimeoutError:
            self.sock.close()
            raise BadInput(
                f"network bench: {self.where} accepted the connection but did not answer as a redline server "
                f"within {connect_timeout_s:g} s"
            ) from None
        except (OSError, wire.ProtocolError) as exc:
            self.sock.close()
            raise BadInput(f"network bench: {self.where} is not a redline network bench server ({exc})") from None
        except BaseException:
            self.sock.close()
            raise
        self.session = bytes.fromhex(hello["session"])
        self.server_tcp: dict[str, Any] = hello.get("tcp") or {}
        self.peer_ip = self.sock.getpeername()[0]
        self.sock.settimeout(30.0)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            wire.send_frame(self.sock, {"op": "bye"})
        self.sock.close()

    def _lost(self, exc: BaseException) -> BadInput:
        return BadInput(f"network bench: lost the server {self.where} mid-run ({exc or type(exc).__name__})")

    # ------------------------------------------------------------------------------------ measurements

    def ping(self, count: int) -> list[float]:
        """``count`` request/response round trips of a few bytes on the idle control connection, in ms."""
        samples = []
        try:
            for seq in range(count):
                t0 = time.perf_counter()
                wire.send_frame(self.sock, {"op": "ping", "seq": seq})
                wire.expect(self.sock, "pong")
                samples.append((time.perf_counter() - t0) * 1e3)
        except (OSError, wire.ProtocolError) as exc:
            raise self._lost(exc) from None
        return samples

    def udp_train(self, count: int, rate_per_s: float, linger_s: float) -> tuple[int, list[float]]:
        """Send ``count`` UDP probes at ``rate_per_s`` (a trickle that cannot congest the link, so what is
        lost is the path's own loss) and collect the echoes until ``linger_s`` after the last one.
        Returns (probes sent, RTT in ms of each distinct echo). Uses no control connection, so it can run
        on a thread while ``ping`` does."""
        echoed: dict[int, float] = {}
        sent = 0
        sock = socket.socket(socket.AF_INET6 if ":" in self.peer_ip else socket.AF_INET, socket.SOCK_DGRAM)
        try:
            sock.connect((self.peer_ip, self.port))
            sock.setblocking(False)
            start = time.monotonic()
            end = start + count / rate_per_s + linger_s
            while (now := time.monotonic()) < end:
                due = start + sent / rate_per_s
                if sent < count and now >= due:
                    # refused: an ICMP error for an earlier probe; the counts show the loss
                    with contextlib.suppress(BlockingIOError, ConnectionRefusedError):
                        sock.send(wire.PROBE.pack(wire.PROBE_MAGIC, self.session, sent, now))
                    sent += 1
                    continue
                wait = (due if sent < count else end) - now
                readable, _, _ = select.select([sock], [], [], max(0.0, wait))
                while readable:  # drain every echo that is waiting
                    try:
                        data = sock.recv(64)
                    except (BlockingIOError, ConnectionRefusedError):
                        break
                    if len(data) == wire.PROBE.size:
                        magic, token, seq, t_sent = wire.PROBE.unpack(data)
                        if magic == wire.PROBE_MAGIC and token == self.session and seq not in echoed:
                            echoed[seq] = (time.monotonic() - t_sent) * 1e3
        except OSError:
            pass  # no UDP path at all: the probe reads as unanswered, and loss falls back to TCP
        finally:
            sock.close()
        return sent, list(echoed.values())

    def udp_finish(self, train: tuple[int, list[float]] | None) -> UdpProbe:
        """The server's count of the probes it got, which splits the loss into the two directions."""
        sent, rtt_ms = train or (0, [])
        try:
            wire.send_frame(self.sock, {"op": "udp_count"})
            server_received = int(wire.expect(self.sock, "udp_count")["received"])
        except (OSError, wire.ProtocolError) as exc:
            raise self._lost(exc) from None
        return UdpProbe(sent=sent, server_received=server_received, echoed=len(rtt_ms), rtt_ms=rtt_ms)

    def throughput(
        self, count: int, direction: str, omit_s: float, duration_s: float, congestion: str | None = None
    ) -> Throughput:
        """``count`` parallel TCP streams for omit_s + duration_s; the receiver's bytes after omit_s count.
        ``congestion`` sets the senders' congestion control per socket (iperf3 -C), else the system's."""
        request = {"op": "tcp", "streams": count, "direction": direction, "omit_s": omit_s, "duration_s": duration_s}
        if congestion:
            request["congestion"] = congestion
            if direction == "up":  # the senders are ours: refuse an unknown or forbidden one before starting
                with socket.socket() as probe:
                    try:
                        streams.set_congestion_control([probe], congestion)
                    except OSError as exc:
                        raise BadInput(f"network bench: congestion control {congestion!r}: {exc.strerror}") from None
        socks: list[socket.socket] = []
        try:
            wire.send_frame(self.sock, request)
            test = wire.expect(self.sock, "ready")["test"]
            socks = streams.connect_all((self.peer_ip, self.port), count, timeout_s=10.0)
            if congestion and direction == "up":
                streams.set_congestion_control(socks, congestion)
            for index, sock in enumerate(socks):
                header = {"op": "data", "session": self.session.hex(), "test": test, "stream": index}
                sock.sendall(wire.MAGIC + wire.encode(header))
            wire.expect(self.sock, "started")
            self.sock.settimeout(omit_s + duration_s + 30.0)
            if direction == "up":
                sender = streams.Sender(socks)
                try:
                    result = wire.expect(self.sock, "result")
                finally:
                    sender.finish()
                stats = tcpinfo.sender_stats(socks)
                received = Received(**result["received"])
            else:
                received = streams.receive(socks, omit_s=omit_s, duration_s=duration_s)
                wire.send_frame(self.sock, {"op": "stop"})
                stats = SenderStats.from_dict(wire.expect(self.sock, "sender")["stats"])
            self.sock.settimeout(30.0)
        except (OSError, wire.ProtocolError) as exc:
            raise self._lost(exc) from None
        finally:
            streams.abort(socks)
        return Throughput(count, direction, omit_s, duration_s, received, stats)


def serve_in_thread(host: str = "127.0.0.1", port: int = 0) -> tuple[int, Any]:
    """A server on a thread of this process (the loopback sanity check); returns (port, stop())."""
    from redline.bench.net.server import Server

    server = Server(host, port, log=lambda line: None)
    stop = threading.Event()
    thread = threading.Thread(target=server.serve_forever, args=(stop,), name="redline-net-loopback", daemon=True)
    thread.start()

    def shutdown() -> None:
        stop.set()
        thread.join()
        server.close()

    return server.port, shutdown
