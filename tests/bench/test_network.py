"""The network suite: its arithmetic, its wire protocol, bad hosts, loopback runs, and (as root) an emulated
200 ms / 0.1% loss / 100 Mbit/s link where it is compared with iperf3."""

from __future__ import annotations

import json
import random
import select
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

import pytest

from conftest import run_cli
from netem import EmulatedLink, LinkSpec, unavailable_reason
from netem.compare import compare, start_servers
from netem.forward import Shaper
from ports import free_port
from redline.bench import network
from redline.bench.context import BenchContext
from redline.bench.net import streams, tcpinfo, wire
from redline.bench.net.client import Client, Throughput, serve_in_thread
from redline.bench.net.streams import Received
from redline.bench.net.tcpinfo import SenderStats
from redline.errors import BadInput
from redline.units import KiB, MiB

pytestmark = pytest.mark.system

# ------------------------------------------------------------------------------------- arithmetic


def test_bdp_and_chunk_size():
    # 100 Mbit/s x 200 ms = 2.5 MB in flight; a request should carry 2x that, rounded up to 8 MiB
    assert network.bdp_bytes(100e6, 0.2) == pytest.approx(2.5e6)
    assert network.chunk_bytes(2.5e6) == 8 * MiB
    assert network.chunk_bytes(4 * MiB) == 8 * MiB
    assert network.chunk_bytes(0) == 64 * KiB


def test_streams_needed_is_the_smallest_count_within_ten_percent():
    assert network.streams_needed({1: 5.0, 4: 30.0, 8: 40.0, 16: 42.0}) == 8
    assert network.streams_needed({1: 90.0, 8: 95.0}) == 1
    assert network.streams_needed({1: 3.0, 8: 40.0, 16: 64.0}) == 16


def test_window_ceiling_from_buffer_maxima():
    # 4 MiB sender buffer, half of it payload, one 200 ms RTT: ~84 Mbit/s for one stream
    ceiling = network.window_ceiling_bits_per_s(4 * MiB, 32 * MiB, 0.2)
    assert ceiling == pytest.approx(4 * MiB * 0.5 * 8 / 0.2)
    assert network.window_ceiling_bits_per_s(None, None, 0.2) is None


def _throughput(count: int, mbit_s: float, cc: str = "cubic") -> Throughput:
    window_s = 10.0
    received = Received(bytes=int(mbit_s * 1e6 / 8 * window_s), window_s=window_s)
    sender = SenderStats(congestion_control=cc, streams=count, busy_us=10**7, rwnd_limited_us=0, sndbuf_limited_us=0)
    return Throughput(count, "up", 2.0, window_s, received, sender)


def test_advice_for_a_long_lossy_link_under_cubic():
    rates = {1: 4.0, 8: 40.0, 16: 64.0}
    tcp = {"available_congestion_control": ["reno", "cubic", "bbr"], "tcp_wmem_max_bytes": 4 * MiB}
    facts, advice = network.advise(rates, _throughput(1, 4.0), 0.2, tcp, {"tcp_rmem_max_bytes": 32 * MiB})
    assert facts["streams_needed"] == 16
    assert facts["chunk_bytes"] == 4 * MiB  # 64 Mbit/s x 200 ms = 1.6 MB; 2x -> 3.2 MB -> 4 MiB
    text = "\n".join(advice)
    assert "bbr" in text and "cubic" in text  # one CUBIC stream gets 6%: say why, and what to do
    assert "try more" in text  # 8 -> 16 still rose by 60%
    assert "socket buffers" not in text  # 4 MiB / 2 per 200 ms carries 84 Mbit/s > 64


def test_measurements_are_named_and_carry_the_recommendation():
    from redline.bench.net.client import UdpProbe

    results = [_throughput(1, 5.0), _throughput(8, 40.0)]
    plan = network.Plan([1, 8], ("up",), 2.0, 10.0, pings=3, probes=100, probe_rate_per_s=100)
    udp = UdpProbe(sent=1000, server_received=999, echoed=998, rtt_ms=[200.0] * 998)
    out = network.build_measurements([200.0, 201.0, 202.0], udp, results, {}, {}, "to test", plan)
    by_name = {m.name: m for m in out}
    assert list(by_name) == ["rtt", "loss", "tcp_1_stream", "tcp_8_streams", "bdp", "streams_needed"]
    assert by_name["rtt"].value == 201.0 and by_name["rtt"].unit == "ms"
    assert by_name["loss"].value == pytest.approx(2 / 1999)  # 1 lost each way, of 1999 crossings
    assert by_name["tcp_8_streams"].unit == "Mbit/s" and by_name["tcp_8_streams"].value == pytest.approx(40.0)
    assert by_name["tcp_1_stream"].ratio == pytest.approx(5.0 / 40.0)  # against the best count
    assert by_name["streams_needed"].value == 8
    assert by_name["streams_needed"].extra["chunk_bytes"] == 2 * MiB  # 2 x 40 Mbit/s x 201 ms = 2.01 MB
    assert by_name["bdp"].value == pytest.approx(40e6 * 0.201 / 8 / MiB)


# ---------------------------------------------------------------------------------------- protocol


def test_frames_round_trip_and_reject_garbage():
    a, b = socket.socketpair()
    with a, b:
        wire.send_frame(a, {"op": "ping", "seq": 7})
        assert wire.recv_frame(b) == {"op": "ping", "seq": 7}
        a.sendall(b"\xff\xff\xff\xff")  # a 4 GiB frame: not this protocol
        with pytest.raises(wire.ProtocolError):
            wire.recv_frame(b)
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
        with pytest.raises(wire.ProtocolError):
            wire.recv_magic(b)
    a, b = socket.socketpair()
    with a, b:
        wire.send_frame(a, {"op": "error", "reason": "busy doing X"})
        with pytest.raises(BadInput, match="busy doing X"):
            wire.expect(b, "ready")


def test_shaper_caps_the_rate_drops_at_the_tail_and_loses_at_random():
    # 1 Mbit/s: a 1250-byte packet takes 10 ms; a 5000-byte queue holds 4 of a burst, the rest drop
    shaper = Shaper(delay_s=0.1, loss=0.0, rate_bits_per_s=1e6, queue_bytes=5000)
    fates = [shaper.admit(0.0, 1250) for _ in range(10)]
    assert fates[:4] == pytest.approx([0.11, 0.12, 0.13, 0.14])
    assert fates[4:] == [None] * 6 and shaper.dropped == 6
    # once the queue drained, packets pass again and leave at the serializer's pace
    assert shaper.admit(1.0, 1250) == pytest.approx(1.11)
    lossy = Shaper(delay_s=0.0, loss=0.1, rate_bits_per_s=None, queue_bytes=None, rng=random.Random(1))
    for _ in range(10_000):
        lossy.admit(0.0, 100)
    assert 850 < lossy.lost < 1150


def test_tcp_info_of_a_sender():
    with socket.create_server(("127.0.0.1", 0)) as listener:
        sender = socket.create_connection(listener.getsockname())
        receiver, _ = listener.accept()
        with sender, receiver:
            sender.sendall(bytes(256 * KiB))
            got = 0
            while got < 256 * KiB:
                got += len(receiver.recv(1 << 20))
            stats = tcpinfo.sender_stats([sender])
    assert stats.streams == 1 and stats.data_segs_out > 0 and stats.retransmits == 0
    assert stats.congestion_control  # e.g. "cubic" or "bbr"
    assert stats.to_dict()["retransmit_ratio"] == 0.0


# -------------------------------------------------------------------------------------- bad hosts


def test_refused_is_bad_input_at_once():
    t0 = time.monotonic()
    with pytest.raises(BadInput, match="refused"):
        Client("127.0.0.1", free_port())
    assert time.monotonic() - t0 < 2


def test_a_host_that_does_not_answer_is_bad_input_within_the_timeout():
    # a listener whose accept queue is full drops further SYNs: to a client, a host that does not answer
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        with socket.create_connection(listener.getsockname()):
            t0 = time.monotonic()
            with pytest.raises(BadInput, match="did not answer within 1 s"):
                Client("127.0.0.1", listener.getsockname()[1], connect_timeout_s=1.0)
            assert time.monotonic() - t0 < 3


@pytest.mark.parametrize("reply", [None, b"SSH-2.0-OpenSSH_9.2\r\n"])
def test_a_server_that_is_not_redline_is_bad_input(reply):
    with socket.create_server(("127.0.0.1", 0)) as listener:

        def answer():
            conn, _ = listener.accept()
            with conn:
                if reply:
                    conn.sendall(reply)
                conn.recv(1024)
                time.sleep(2)

        threading.Thread(target=answer, daemon=True).start()
        t0 = time.monotonic()
        with pytest.raises(BadInput, match="redline"):
            Client("127.0.0.1", listener.getsockname()[1], connect_timeout_s=1.0)
        assert time.monotonic() - t0 < 3


def test_serve_and_connect_together_is_bad_input():
    with pytest.raises(BadInput, match="exclude"):
        network.run(BenchContext(serve=True, connect="example.org"))


# ------------------------------------------------------------------------------------------ loopback


def test_loopback_run_measures_everything_and_leaves_nothing():
    before = {t.name for t in threading.enumerate()}
    out = network.run(BenchContext(quick=True, streams=[1, 2], duration_s=1.0))
    names = [m.name for m in out]
    assert names == ["rtt", "loss", "tcp_1_stream", "tcp_2_streams", "bdp", "streams_needed"]
    by_name = {m.name: m for m in out}
    assert "loopback" in by_name["rtt"].method
    assert by_name["tcp_1_stream"].value > 10  # Mbit/s; loopback does gigabits
    assert by_name["loss"].value == 0.0 and by_name["loss"].extra["probes_echoed"] == 500
    assert by_name["streams_needed"].value in (1, 2)
    leftover = {t.name for t in threading.enumerate()} - before
    assert not {n for n in leftover if n.startswith("redline-net")}


def test_reverse_direction_and_busy_server():
    port, stop = serve_in_thread()
    try:
        with Client("127.0.0.1", port) as client:
            with pytest.raises(BadInput, match="busy"):
                Client("127.0.0.1", port)
            down = client.throughput(2, "down", omit_s=0.2, duration_s=0.5)
        assert down.mbit_s > 10 and down.sender.streams == 2 and down.sender.data_segs_out > 0
        assert down.received.window_s == pytest.approx(0.5, abs=0.1)
        assert len(down.received.stream_bytes) == 2
    finally:
        stop()
    with pytest.raises(BadInput, match="refused"):  # the server's port is closed again
        Client("127.0.0.1", port)


def test_receiver_counts_only_after_the_warm_up():
    a, b = socket.socketpair()
    stop = threading.Event()
    sender = threading.Thread(target=streams.send, args=([a], stop))
    sender.start()
    try:
        got = streams.receive([b], omit_s=0.3, duration_s=0.6, interval_s=0.2)
    finally:
        stop.set()
        sender.join()
        a.close()
        b.close()
    assert got.window_s == pytest.approx(0.6, abs=0.05)
    assert len(got.interval_bits_per_s) == 3
    assert got.bytes == sum(got.stream_bytes) and got.bits_per_s > 0


def test_cli_serve_and_connect_over_loopback():
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "redline", "bench", "network", "--serve", "--listen", "127.0.0.1", "--port", str(port)],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # the CLI probes the machine first: a generous bound, that only a hung start reaches on a loaded host
        ready, _, _ = select.select([server.stderr], [], [], 300)
        assert ready and f"serving on 127.0.0.1, port {port}" in server.stderr.readline()
        result = run_cli(
            "bench", "network", "--connect", "127.0.0.1", "--port", str(port), "--streams", "1", "--quick", "--json"
        )
        assert result.returncode == 0, result.stderr
        names = [m["name"] for m in json.loads(result.stdout)["measurements"]]
        assert names == ["rtt", "loss", "tcp_1_stream", "bdp", "streams_needed"]
    finally:
        server.send_signal(signal.SIGINT)
        assert server.wait(timeout=120) == 130  # Ctrl-C: "interrupted"
        server.stderr.close()
    with socket.socket() as probe:  # the server let go of its port
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("127.0.0.1", port))


def test_serve_takes_only_addresses_to_listen_on():
    """'0', '*' or a name would bind every interface, or something nobody meant: only addresses and 'all'."""
    for value in ("*", "0", "", "example.org"):
        bad = run_cli("bench", "network", "--serve", "--listen", value)
        assert bad.returncode == 2 and "--listen takes an IP address" in bad.stderr, bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1


def test_cli_bad_host_is_one_line_and_exit_2():
    result = run_cli("bench", "network", "--connect", "127.0.0.1", "--port", str(free_port()), "--quick")
    assert result.returncode == 2
    assert "refused" in result.stderr and "Traceback" not in result.stderr


# ------------------------------------------------------------------------------- the emulated link

_skip_reason = unavailable_reason()
needs_link = pytest.mark.skipif(_skip_reason is not None, reason=f"emulated link: {_skip_reason}")


@pytest.fixture(scope="module")
def link():
    if shutil.which("iperf3") is None:
        pytest.skip("iperf3 is not installed (apt-get install iperf3)")
    with EmulatedLink(LinkSpec(rtt_ms=200, loss=0.001, rate_mbit=100, seed=1)) as made:
        namespaces = list(made.namespaces.values())
        start_servers(made)
        yield made
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert not any(ns in listed for ns in namespaces), "namespaces left behind"


@needs_link
def test_bench_sees_the_emulated_link(link):
    argv = [sys.executable, "-m", "redline.bench.network", "--connect", link.address["a"], "--port", "5211"]
    result = link.run("b", *argv, "--streams", "1", "--duration", "2", "--omit", "1", timeout=60)
    by_name = {m["name"]: m for m in json.loads(result.stdout)}
    assert 195 <= by_name["rtt"]["value"] <= 260  # 200 ms of delay, plus a busy machine's scheduling
    assert by_name["loss"]["value"] < 0.01  # 0.1% per crossing; 1000 crossings see 0-5 losses
    assert 0 < by_name["tcp_1_stream"]["value"] <= 105  # never above the 100 Mbit/s cap
    assert by_name["bdp"]["value"] > 0


@pytest.mark.slow
@needs_link
def test_redline_throughput_matches_iperf3(link):
    """The short version of benchmarks/network_vs_iperf3.py: BBR, 1 and 8 streams, 3 alternating rounds of
    3 s after 1 s warm-up. The benchmark's target is 10%; this run is far shorter and shares 2 cores
    with the forwarder and both tools, so one round can move 20-40% on its own (BBR's probing phases,
    forwarder scheduling). With 2 rounds, two of four clean-clone CI runs in one day failed the old bounds
    (8 streams at 0.685; both counts together at 0.79) where quiet reruns passed. Each count's median ratio
    must be within 0.6-1.5 and both counts together within 0.7-1.3: a real bias (counting sender bytes, a
    wrong window, a receiver that cannot keep up at all) shows far outside that. How close the two are is
    the benchmark's to say."""
    results = compare(link, congestion_controls=["bbr"], streams=[1, 8], rounds=3, duration_s=3, omit_s=1)
    totals = {"iperf3": 0.0, "redline": 0.0}
    for (_, count), runs in results.items():
        peer, ours = statistics.median(runs["iperf3"]), statistics.median(runs["redline"])
        totals["iperf3"] += peer
        totals["redline"] += ours
        assert 0.6 <= ours / peer <= 1.5, f"{count} streams: redline {runs['redline']} vs iperf3 {runs['iperf3']}"
    assert 0.7 <= totals["redline"] / totals["iperf3"] <= 1.3, results


@needs_link
def test_link_teardown_kills_what_runs_inside():
    with EmulatedLink(LinkSpec(rtt_ms=10, loss=0, rate_mbit=None)) as small:
        sleeper = small.popen("a", "sleep", "60")
        stray = subprocess.Popen(small.argv("b", "sleep", "60"))  # not tracked: found by `ip netns pids`
        names = list(small.namespaces.values())
    assert sleeper.poll() is not None
    assert stray.wait(timeout=5) is not None
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert not any(n in listed for n in names)
