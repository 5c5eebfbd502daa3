"""Real servers for the transfer tests, each started on loopback (or inside a network namespace) and stopped
after: nginx (Debian's, HTTP byte ranges), OpenSSH's sshd with its sftp-server, and moto's S3 server (what
s3fs's own tests use). Each ``start`` waits until the server answers, bounded, and says what it logged when
it does not."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from ports import free_port

DEADLINE_S = 30.0
# nginx's access log: one line per request with the range asked and the body bytes sent (aborted ones too)
ACCESS_FORMAT = (
    "'$request_method $uri $status range=\"$http_range\" sent=$body_bytes_sent ended=$msec took=$request_time'"
)


def _in(netns: str | None, command: list[str]) -> list[str]:
    """``command`` run inside the network namespace ``netns`` (``ip netns exec`` execs it: its pid is the
    server's), or as it is."""
    return ["ip", "netns", "exec", netns, *command] if netns else command


def wait_for_port(host: str, port: int, process: subprocess.Popen, log: Path, netns: str | None = None) -> None:
    deadline = time.monotonic() + DEADLINE_S
    probe = _in(netns, ["bash", "-c", f"echo > /dev/tcp/{host}/{port}"])  # a connect from inside the namespace
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"{process.args[0]} exited: {log.read_text()[-2000:]}")
        if netns is None:
            with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1):
                return
        elif subprocess.run(probe, capture_output=True).returncode == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"{process.args[0]} did not listen on {host}:{port}: {log.read_text()[-2000:]}")


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@dataclass
class Nginx:
    url: str
    root: Path
    access_log: Path
    process: subprocess.Popen

    def requests(self) -> list[dict]:
        """The access log's lines: method, uri, status, range, sent (body bytes), ended (epoch s), took (s)."""
        out = []
        for line in self.access_log.read_text().splitlines():
            method, uri, status, rest = line.split(" ", 3)
            range_part, tail = rest.rsplit(" sent=", 1)
            sent, ended, took = tail.split(" ")
            out.append(
                {
                    "method": method,
                    "uri": uri,
                    "status": int(status),
                    "range": range_part.removeprefix('range="').removesuffix('"'),
                    "sent": int(sent),
                    "ended": float(ended.removeprefix("ended=")),
                    "took": float(took.removeprefix("took=")),
                }
            )
        return out

    def sent_bytes(self, uri: str) -> int:
        return sum(r["sent"] for r in self.requests() if r["uri"] == uri and r["method"] == "GET")


def start_nginx(
    tmp: Path,
    root: Path,
    rate: str | None = None,
    host: str = "127.0.0.1",
    netns: str | None = None,
    port: int | None = None,
) -> Nginx:
    """nginx serving ``root``; ``rate`` caps each connection (nginx's limit_rate, e.g. "2m")."""
    binary = shutil.which("nginx") or "/usr/sbin/nginx"
    port = port or free_port()
    prefix = tmp / "nginx"
    (prefix / "logs").mkdir(parents=True, exist_ok=True)
    limit = f"limit_rate {rate};" if rate else ""
    # workers run as root where the tests do: a pytest tmp folder is root's alone (0700)
    user = "user root;" if os.geteuid() == 0 else ""
    (prefix / "nginx.conf").write_text(f"""
{user}
worker_processes 2;
pid {prefix}/nginx.pid;
error_log {prefix}/logs/error.log warn;
events {{ worker_connections 256; }}
http {{
    access_log off;
    log_format ranges {ACCESS_FORMAT};
    client_body_temp_path {prefix}/body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    sendfile on;
    server {{
        listen {host}:{port};
        root {root};
        access_log {prefix}/logs/access.log ranges;
        {limit}
    }}
}}
""")
    command = _in(netns, [binary, "-p", str(prefix), "-c", str(prefix / "nginx.conf"), "-g", "daemon off;"])
    log = prefix / "logs" / "error.log"
    with (prefix / "logs" / "stderr.log").open("wb") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    wait_for_port(host, port, process, log, netns)
    return Nginx(f"http://{host}:{port}", root, prefix / "logs" / "access.log", process)


@dataclass
class Sshd:
    port: int
    known_hosts: Path
    key_file: Path
    process: subprocess.Popen
    host: str = "127.0.0.1"

    def url(self, path: Path | str) -> str:
        return f"sftp://root@{self.host}:{self.port}{path}"


def start_sshd(tmp: Path, host: str = "127.0.0.1", netns: str | None = None, port: int | None = None) -> Sshd:
    """OpenSSH's sshd on ``host`` (loopback, or an address inside ``netns``), with its own host key, a client
    key authorised for root alone, and the sftp-server subsystem; a known_hosts file that trusts this host key."""
    folder = tmp / "sshd"
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    host_key, client_key = folder / "host_ed25519", folder / "client_ed25519"
    for key in (host_key, client_key):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    authorized = folder / "authorized_keys"
    shutil.copy(f"{client_key}.pub", authorized)
    os.chmod(authorized, 0o600)
    port = port or free_port()
    key_type, key = Path(f"{host_key}.pub").read_text().split(" ", 2)[:2]
    known_hosts = folder / "known_hosts"
    known_hosts.write_text(f"[{host}]:{port} {key_type} {key}\n")
    config = folder / "sshd_config"
    config.write_text(f"""Port {port}
ListenAddress {host}
HostKey {host_key}
PidFile {folder}/sshd.pid
AuthorizedKeysFile {authorized}
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
StrictModes no
UsePAM no
Subsystem sftp internal-sftp
""")
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
    log = folder / "sshd.log"
    process = subprocess.Popen(
        _in(netns, ["/usr/sbin/sshd", "-D", "-e", "-f", str(config)]),
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    wait_for_port(host, port, process, log, netns)
    return Sshd(port, known_hosts, client_key, process, host)


@dataclass
class S3:
    endpoint_url: str
    process: subprocess.Popen

    def client(self):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )


S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def start_s3(tmp: Path, host: str = "127.0.0.1", netns: str | None = None, port: int | None = None) -> S3:
    """moto's S3 server (``moto_server``) on ``host`` (loopback, or an address inside ``netns``)."""
    port = port or free_port()
    log = tmp / "moto.log"
    process = subprocess.Popen(
        _in(netns, [shutil.which("moto_server") or "moto_server", "-H", host, "-p", str(port)]),
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    wait_for_port(host, port, process, log, netns)
    return S3(f"http://{host}:{port}", process)


class SlowProxy:
    """A TCP forwarder on loopback that caps each connection's upstream rate and counts the bytes it carried
    upstream: what a client sent to the server, so a test can tell what a resumed upload sent again."""

    def __init__(self, target_port: int, bytes_per_s: float) -> None:
        import threading

        self.target_port, self.bytes_per_s = target_port, bytes_per_s
        self.upstream_bytes = 0
        self.open_pipes = 0  # directions still carrying: 0 once every connection has closed both ways
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import threading

        while not self._stop:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target_port))
            with self._lock:
                self.open_pipes += 2
            threading.Thread(target=self._pipe, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, False), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, upstream: bool) -> None:
        try:
            while data := source.recv(65536):
                if upstream:
                    with self._lock:
                        self.upstream_bytes += len(data)
                    time.sleep(len(data) / self.bytes_per_s)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            with self._lock:
                self.open_pipes -= 1

    def close(self) -> None:
        self._stop = True
        self._listener.close()


@dataclass
class Misbehaviour:
    """How ``HostileServer`` answers a GET of its one file; each field a way real servers go wrong."""

    ranges: bool = True  # honour Range (always ignoring If-Range, as S3 and some servers do); False: 200 whole
    etag: str | None = '"v1"'
    last_modified: str | None = "Mon, 01 Jan 2024 00:00:00 GMT"
    replace_after: int | None = None  # the file is replaced (new bytes, ETag, Last-Modified) after this many GETs
    length: str = "exact"  # "exact", "chunked" (no Content-Length), or a literal Content-Length to send instead
    redirect: str | None = None  # every GET answered 302 to this Location
    endless_redirect: bool = False  # the 302 carries a body of 1 TiB, sent until the client hangs up
    cut_first: int | None = None  # the first GET after the stat (the second) is cut after this many body bytes
    content_range: str | None = None  # a literal Content-Range to send with every 206 instead of the true one
    endless_ranges: bool = False  # every 206 claims a body of 1 TiB and sends it until the client hangs up


class HostileServer:
    """A small HTTP/1.1 server on loopback (``host`` "::1" for IPv6) serving one file at any path, misbehaving
    as ``how`` says; ``gets`` counts the GETs it answered. Started by the constructor, stopped by ``close``."""

    def __init__(self, data: bytes, how: Misbehaviour, replacement: bytes | None = None, host: str = "127.0.0.1"):
        import http.server
        import threading

        self.data, self.how, self.replacement = data, how, replacement
        self.gets = 0
        self.endless_bytes = 0  # of the endless redirect bodies, what the clients took before hanging up
        self._lock = threading.Lock()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                server._answer(self)

            def log_message(self, *args) -> None:
                pass

        class Server(http.server.ThreadingHTTPServer):
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
            daemon_threads = True

        self._server = Server((host, 0), Handler)
        self.url = f"http://{'[' + host + ']' if ':' in host else host}:{self._server.server_address[1]}/file.bin"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _answer(self, handler) -> None:
        how = self.how
        with self._lock:
            self.gets += 1
            number = self.gets
        if how.redirect:
            handler.send_response(302)
            handler.send_header("Location", how.redirect)
            handler.send_header("Content-Length", str(1 << 40) if how.endless_redirect else "0")
            handler.end_headers()
            if how.endless_redirect:
                self._send_endless(handler)
            return
        replaced = how.replace_after is not None and number > how.replace_after
        data = self.replacement if replaced else self.data
        status, body, headers = 200, data, {}
        asked = handler.headers.get("Range")
        if how.ranges and asked:
            start, end = (int(x) for x in asked.removeprefix("bytes=").split("-"))
            status, body = 206, data[start : end + 1]
            headers["Content-Range"] = how.content_range or f"bytes {start}-{start + len(body) - 1}/{len(data)}"
        if how.etag:
            headers["ETag"] = '"v2"' if replaced else how.etag
        if how.endless_ranges and status == 206:
            handler.send_response(206)
            for name, value in (headers | {"Content-Length": str(1 << 40)}).items():
                handler.send_header(name, value)
            handler.end_headers()
            self._send_endless(handler)
            return
        if how.last_modified:
            headers["Last-Modified"] = "Tue, 02 Jan 2024 00:00:00 GMT" if replaced else how.last_modified
        self._send(handler, status, headers, body, cut=how.cut_first if number == 2 else None)

    def _send_endless(self, handler) -> None:
        piece = b"x" * 65536
        handler.close_connection = True
        with contextlib.suppress(OSError):  # the client hung up: the only way this ends
            while True:
                handler.wfile.write(piece)
                with self._lock:
                    self.endless_bytes += len(piece)

    def _send(self, handler, status: int, headers: dict[str, str], body: bytes, cut: int | None) -> None:
        how = self.how
        handler.send_response(status)
        for name, value in headers.items():
            handler.send_header(name, value)
        if how.length == "chunked":
            handler.send_header("Transfer-Encoding", "chunked")
        else:
            handler.send_header("Content-Length", str(len(body)) if how.length == "exact" else how.length)
            handler.close_connection = how.length != "exact" or cut is not None
        handler.end_headers()
        if how.length == "chunked":
            for offset in range(0, len(body), 100_000):
                piece = body[offset : offset + 100_000]
                handler.wfile.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
            handler.wfile.write(b"0\r\n\r\n")
        else:
            with contextlib.suppress(OSError):  # the client may hang up on a body it has refused
                handler.wfile.write(body[:cut] if cut is not None else body)
