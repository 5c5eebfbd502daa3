"""An emulated cross-border link between two network namespaces, made and torn down in one ``with``.

Side "a" is 10.77.0.1/30, side "b" 10.77.0.2/30, each in a namespace of its own; no other interface is
touched, so test traffic goes nowhere else. Each direction gets a one-way delay of rtt/2, random loss, a
rate cap and a tail-drop queue (one bandwidth-delay product by default).

Two ways to build it, as the kernel allows:
- "netem": a veth pair with a netem qdisc on each end (``tc qdisc add ... netem delay loss rate limit``);
- "tun": where the kernel has no sch_netem, a TUN device in each namespace and a user-space forwarder
  (netem.forward) that applies the same delay, loss, rate and queue.

``close()`` (also on errors and when the ``with`` body raises) stops every process it started or that
still runs in the namespaces, stops the forwarder and deletes both namespaces.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import math
import os
import re
import secrets
import select
import shutil
import signal
import struct
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

A_ADDR = "10.77.0.1"
B_ADDR = "10.77.0.2"
PREFIX_LEN = 30
DEVICE = "rl0"
MTU = 1500
NS_PREFIX = "rlnet-"
_NS_PATTERN = re.compile(rf"^{NS_PREFIX}(\d+)-[0-9a-f]+-[ab]$")

# linux/if_tun.h
_TUNSETIFF = 0x400454CA
_IFF_TUN = 0x0001
_IFF_NO_PI = 0x1000
# linux/sched.h
_CLONE_NEWNET = 0x40000000


class LinkUnavailable(RuntimeError):
    """This machine cannot build the link (not root, no iproute2, no /dev/net/tun...)."""


@dataclass
class LinkSpec:
    rtt_ms: float = 200.0
    loss: float = 0.001  # per direction
    rate_mbit: float | None = 100.0  # per direction
    queue_bytes: int | None = None  # tail-drop queue ahead of the rate cap; None: one BDP
    seed: int | None = None

    @property
    def bdp_bytes(self) -> int | None:
        return int(self.rate_mbit * 1e6 * self.rtt_ms / 1e3 / 8) if self.rate_mbit else None

    @property
    def effective_queue_bytes(self) -> int | None:
        return self.queue_bytes if self.queue_bytes is not None else self.bdp_bytes

    def netem_limit_packets(self) -> int:
        """netem's ``limit`` counts every packet it holds, the ones in the delay line too: the one-way
        bytes in flight at the rate cap plus the queue, in full-size packets."""
        if not self.rate_mbit:
            return 100_000
        in_delay_line = self.rate_mbit * 1e6 * self.rtt_ms / 2e3 / 8
        return math.ceil((in_delay_line + (self.effective_queue_bytes or 0)) / MTU) + 16


def unavailable_reason() -> str | None:
    """Why an emulated link cannot be built here, or None when it can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    if shutil.which("ip") is None:
        return "needs iproute2 (the `ip` command)"
    try:
        subprocess.run(["ip", "netns", "list"], capture_output=True, check=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"`ip netns` does not work here: {exc}"
    if not os.path.exists("/dev/net/tun") and not kernel_has_netem():
        return "needs /dev/net/tun or the kernel's sch_netem"
    return None


def kernel_has_netem() -> bool:
    """Whether `tc qdisc ... netem` would work: the module is loaded or can be (a listed kernel module)."""
    if os.path.exists("/sys/module/sch_netem"):
        return True
    release = os.uname().release
    for name in ("modules.builtin", "modules.dep"):
        with contextlib.suppress(OSError), open(f"/lib/modules/{release}/{name}", encoding="utf-8") as f:
            if "sch_netem" in f.read():
                return True
    return False


def _run(*argv: str, timeout: float = 20, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    if check and result.returncode != 0:
        raise LinkUnavailable(f"`{' '.join(argv)}` failed: {(result.stderr or result.stdout).strip()}")
    return result


def cleanup_stale() -> None:
    """Delete namespaces a previous run left behind when it was killed (its pid is gone)."""
    listing = _run("ip", "netns", "list", check=False).stdout
    for line in listing.splitlines():
        name = line.split()[0] if line.split() else ""
        match = _NS_PATTERN.match(name)
        if match and not _alive(int(match.group(1))):
            _delete_namespace(name)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _delete_namespace(name: str) -> None:
    """Kill whatever still runs inside (it would keep the namespace alive), then delete it."""
    for pid in _run("ip", "netns", "pids", name, check=False).stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    _run("ip", "netns", "del", name, check=False)


class EmulatedLink:
    """``with EmulatedLink(LinkSpec(rtt_ms=200, loss=0.001, rate_mbit=100)) as link: link.run("b", ...)``"""

    def __init__(self, spec: LinkSpec | None = None, backend: str = "auto") -> None:
        if backend not in ("auto", "netem", "tun"):
            raise ValueError(f"backend auto, netem or tun, not {backend!r}")
        self.spec = spec or LinkSpec()
        self.requested_backend = backend
        self.backend: str | None = None
        self.namespaces: dict[str, str] = {}
        self.address = {"a": A_ADDR, "b": B_ADDR}
        self.forwarder: subprocess.Popen[str] | None = None
        self.forwarder_counters: dict[str, Any] | None = None
        self._procs: list[subprocess.Popen[Any]] = []

    def __enter__(self) -> EmulatedLink:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------ setup

    def open(self) -> None:
        reason = unavailable_reason()
        if reason:
            raise LinkUnavailable(reason)
        cleanup_stale()
        tag = f"{NS_PREFIX}{os.getpid()}-{secrets.token_hex(3)}"
        try:
            for side in ("a", "b"):
                name = f"{tag}-{side}"
                _run("ip", "netns", "add", name)
                self.namespaces[side] = name
                self.run(side, "ip", "link", "set", "lo", "up")
                # no IPv6 chatter (router solicitations, MLD) through the emulated link
                self.run(side, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1", check=False)
                # every connection starts cold: no ssthresh/RTT remembered from the run before (another
                # tool's, in a comparison) through the per-destination TCP metrics cache
                self.run(side, "sysctl", "-qw", "net.ipv4.tcp_no_metrics_save=1", check=False)
            if self.requested_backend in ("auto", "netem") and self._open_netem():
                self.backend = "netem"
            elif self.requested_backend == "netem":
                raise LinkUnavailable("the kernel has no sch_netem (`tc qdisc add ... netem` fails)")
            else:
                self._open_tun()
                self.backend = "tun"
            for side in ("a", "b"):
                self.run(side, "ip", "addr", "add", f"{self.address[side]}/{PREFIX_LEN}", "dev", DEVICE)
                # a long device queue: packets wait there while the forwarder is off the CPU, instead of
                # being dropped (the emulated queue is the forwarder's, not this one)
                self.run(side, "ip", "link", "set", DEVICE, "up", "mtu", str(MTU), "txqueuelen", "10000")
        except BaseException:
            self.close()
            raise

    def _open_netem(self) -> bool:
        a, b = self.namespaces["a"], self.namespaces["b"]
        if _run("ip", "link", "add", DEVICE, "netns", a, "type", "veth", "peer", "name", DEVICE, "netns", b,
                check=False).returncode != 0:  # fmt: skip
            return False
        spec = self.spec
        qdisc = ["netem", "delay", f"{spec.rtt_ms / 2:g}ms", "limit", str(spec.netem_limit_packets())]
        if spec.loss:
            qdisc += ["loss", f"{spec.loss * 100:g}%"]
        if spec.rate_mbit:
            qdisc += ["rate", f"{spec.rate_mbit:g}mbit"]
        for side in ("a", "b"):
            if self.run(side, "tc", "qdisc", "add", "dev", DEVICE, "root", *qdisc, check=False).returncode != 0:
                self.run("a", "ip", "link", "del", DEVICE, check=False)
                return False
        return True

    def _open_tun(self) -> None:
        fds = [_tun_in_namespace(self.namespaces[side]) for side in ("a", "b")]
        spec = self.spec
        # by its path: the forwarder needs only the standard library, so it runs whatever sys.path the caller has
        argv = [sys.executable, str(Path(__file__).with_name("forward.py")), "--fds", f"{fds[0]},{fds[1]}"]
        argv += ["--delay-ms", f"{spec.rtt_ms / 2}", "--loss", f"{spec.loss}"]
        if spec.rate_mbit:
            argv += ["--rate-mbit", f"{spec.rate_mbit}"]
        if spec.effective_queue_bytes is not None:
            argv += ["--queue-bytes", str(spec.effective_queue_bytes)]
        if spec.seed is not None:
            argv += ["--seed", str(spec.seed)]
        try:
            self.forwarder = subprocess.Popen(argv, pass_fds=fds, stdout=subprocess.PIPE, text=True)
        finally:
            for fd in fds:  # the forwarder holds them now; the devices live as long as it does
                os.close(fd)
        ready, _, _ = select.select([self.forwarder.stdout], [], [], 15)
        if not ready or self.forwarder.stdout.readline().strip() != "ready":
            raise LinkUnavailable("the TUN forwarder did not start")

    # ------------------------------------------------------------------------------------------- use

    def argv(self, side: str, *command: str) -> list[str]:
        """``command`` as run inside side ``a`` or ``b`` of the link."""
        return ["ip", "netns", "exec", self.namespaces[side], *command]

    def run(self, side: str, *command: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
        return _run(*self.argv(side, *command), timeout=timeout, check=check)

    def popen(self, side: str, *command: str, **kwargs: Any) -> subprocess.Popen[Any]:
        """A process inside the link, stopped by close() if still running."""
        proc = subprocess.Popen(self.argv(side, *command), **kwargs)
        self._procs.append(proc)
        return proc

    def set_congestion_control(self, name: str) -> None:
        """The default TCP congestion control in both namespaces (each has its own sysctl). A namespace
        other than the host's may only pick one listed in net.ipv4.tcp_allowed_congestion_control; for the
        others set it per socket (iperf3 -C, redline's --congestion)."""
        for side in ("a", "b"):
            self.run(side, "sysctl", "-qw", f"net.ipv4.tcp_congestion_control={name}")

    # -------------------------------------------------------------------------------------- teardown

    def close(self) -> None:
        for proc in reversed(self._procs):
            _stop(proc)
        self._procs.clear()
        if self.forwarder is not None:
            _stop(self.forwarder)
            out = self.forwarder.stdout.read() if self.forwarder.stdout else ""
            lines = out.strip().splitlines()
            with contextlib.suppress(ValueError, IndexError):
                self.forwarder_counters = json.loads(lines[-1])
            if self.forwarder.stdout:
                self.forwarder.stdout.close()
            self.forwarder = None
        for name in self.namespaces.values():
            _delete_namespace(name)
        self.namespaces.clear()


def _stop(proc: subprocess.Popen[Any], grace_s: float = 3.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _tun_in_namespace(namespace: str) -> int:
    """A TUN device named DEVICE inside ``namespace``; returns its file descriptor.

    A device is created in the network namespace of the thread that asks for it, so a short-lived
    thread enters the namespace (setns(2), which Python 3.11's os lacks) and opens it; the rest of this
    process never leaves its own namespace.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    result: dict[str, Any] = {}

    def work() -> None:
        target = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
        try:
            if libc.setns(target, _CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns into {namespace}: {os.strerror(err)}")
            fd = os.open("/dev/net/tun", os.O_RDWR)
            try:
                fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", DEVICE.encode(), _IFF_TUN | _IFF_NO_PI))
            except OSError:
                os.close(fd)
                raise
            result["fd"] = fd
        except OSError as exc:
            result["error"] = exc
        finally:
            os.close(target)

    thread = threading.Thread(target=work, name="redline-netem-setns")
    thread.start()
    thread.join()
    if "error" in result:
        raise LinkUnavailable(f"cannot create a TUN device in {namespace}: {result['error']}")
    return result["fd"]
