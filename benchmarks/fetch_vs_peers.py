"""redline fetch against aria2c, rclone and curl on one emulated long link, side by side.

    python benchmarks/fetch_vs_peers.py [--rounds 3] [--size 128M] [--cc cubic,bbr]
                                        [--rtt-ms 200] [--loss 0.001] [--rate-mbit 100] [--curl-max-s 40] [--json]

Needs root, iproute2, nginx, aria2, rclone and curl (Debian packages). It builds a link between two network
namespaces (tools/netem: 200 ms RTT, 0.1% loss each way, 100 Mbit/s, a one-BDP tail-drop queue), serves one
file with nginx on side a, and downloads it from side b with each tool in turn, alternating the order each
round, under each congestion control of the sender (nginx's side, where it decides the download's rate):

- redline: `redline fetch URL DEST` as a user runs it (streams and chunk size from the link it measures);
- aria2c: `-x16 -s16 -k1M` (16 connections to the server, the most aria2 allows, split in 1 MiB pieces);
- rclone: its HTTP backend with `--multi-thread-streams 16 --multi-thread-cutoff 1M`;
- curl: one stream, stopped after --curl-max-s (one loss-bound stream would take minutes); its rate is the
  bytes it got over that time.

Each figure is the file's bits over the command's wall time (start-up and the TCP ramp included), the median
of the rounds; printed with redline's ratio to each peer.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))  # the emulated link (tools/netem)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # nginx as the tests start it

from netem import EmulatedLink, LinkSpec, unavailable_reason
from netem.link import A_ADDR
from redline.units import parse_bytes
from transfer_servers import start_nginx

ROOT = Path(__file__).resolve().parents[1]
PORT = 8089
TOOLS = ("redline", "aria2c", "rclone", "curl")


def commands(url: str, out: Path, curl_max_s: float) -> dict[str, list[str]]:
    name = url.rsplit("/", 1)[1]
    return {
        "redline": [sys.executable, "-m", "redline", "fetch", url, str(out / "redline" / name), "--json"],
        "aria2c": [
            "aria2c",
            "-q",
            "-x16",
            "-s16",
            "-k1M",
            "--allow-overwrite=true",
            "--file-allocation=none",
            "-d",
            str(out / "aria2c"),
            "-o",
            name,
            url,
        ],
        "rclone": [
            "rclone",
            "copy",
            f":http:{name}",
            str(out / "rclone"),
            "--http-url",
            url.rsplit("/", 1)[0] + "/",
            "--multi-thread-streams",
            "16",
            "--multi-thread-cutoff",
            "1M",
            "--config",
            "/dev/null",
        ],
        "curl": ["curl", "-s", "-o", str(out / "curl" / name), "--max-time", str(curl_max_s), url],
    }


def measure(link: EmulatedLink, tool: str, argv: list[str], dest: Path, size: int, env: dict) -> dict:
    shutil.rmtree(dest.parent, ignore_errors=True)
    dest.parent.mkdir(parents=True)
    start = time.perf_counter()
    result = subprocess.run(link.argv("b", *argv), capture_output=True, text=True, env=env, timeout=1800)
    seconds = time.perf_counter() - start
    got = dest.stat().st_size if dest.exists() else 0
    if tool != "curl" and (result.returncode != 0 or got != size):
        raise RuntimeError(f"{tool} failed ({result.returncode}, {got} of {size} bytes): {result.stderr[-500:]}")
    out = {"seconds": seconds, "bytes": got, "mbit_s": got * 8 / seconds / 1e6}
    if tool == "redline":
        summary = json.loads(result.stdout)
        out |= {"streams": summary["streams"], "chunk_bytes": summary["chunk_bytes"], "own_mbit_s": summary["mbit_s"]}
    return out


ALLOWED = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control")


@contextlib.contextmanager
def allowed_congestion(names: list[str]):
    """A namespace may only make an algorithm its default when the host allows it to non-root users
    (net.ipv4.tcp_allowed_congestion_control): add those missing for the run, restore the list after."""
    before = ALLOWED.read_text().split()
    ALLOWED.write_text(" ".join(dict.fromkeys(before + names)))
    try:
        yield
    finally:
        ALLOWED.write_text(" ".join(before))


def run(args: argparse.Namespace) -> dict:
    size = parse_bytes(args.size)
    spec = LinkSpec(args.rtt_ms, args.loss, args.rate_mbit)
    rows: dict[str, dict[str, list[dict]]] = {cc: {tool: [] for tool in TOOLS} for cc in args.cc.split(",")}
    with allowed_congestion(list(rows)), tempfile.TemporaryDirectory() as tmp, EmulatedLink(spec) as link:
        work = Path(tmp)
        www = work / "www"
        www.mkdir()
        (www / "data.bin").write_bytes(os.urandom(size))
        server = start_nginx(work, www, host=A_ADDR, netns=link.namespaces["a"], port=PORT)
        url = f"http://{A_ADDR}:{PORT}/data.bin"
        argvs = commands(url, work / "out", args.curl_max_s)
        env = dict(os.environ, REDLINE_HOME=str(work / "home"), PYTHONPATH=str(ROOT / "src"))
        try:
            for round_ in range(args.rounds):
                for cc in rows:
                    link.set_congestion_control(cc)
                    order = TOOLS[round_ % len(TOOLS) :] + TOOLS[: round_ % len(TOOLS)]
                    for tool in order:
                        figure = measure(link, tool, argvs[tool], work / "out" / tool / "data.bin", size, env)
                        rows[cc][tool].append(figure)
                        print(f"  round {round_ + 1} {cc} {tool}: {figure['mbit_s']:.1f} Mbit/s", file=sys.stderr)
        finally:
            server.process.terminate()
    link_text = f"{link.backend}: {spec.rtt_ms:g} ms RTT, loss {spec.loss:g} each way, {spec.rate_mbit:g} Mbit/s"
    return {
        "link": link_text,
        "size_bytes": size,
        "rounds": args.rounds,
        "runs": rows,
        "median_mbit_s": {
            cc: {t: statistics.median(r["mbit_s"] for r in runs[t]) for t in TOOLS} for cc, runs in rows.items()
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--size", default="128M")
    parser.add_argument("--cc", default="cubic,bbr", help="the sender's congestion controls to compare under")
    parser.add_argument("--rtt-ms", type=float, default=200.0)
    parser.add_argument("--loss", type=float, default=0.001)
    parser.add_argument("--rate-mbit", type=float, default=100.0)
    parser.add_argument("--curl-max-s", type=float, default=40.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    missing = [tool for tool in ("nginx", "aria2c", "rclone", "curl") if not shutil.which(tool)]
    reason = unavailable_reason() or (f"needs {', '.join(missing)}" if missing else None)
    if reason:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    result = run(args)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(
        f"{result['size_bytes'] / 2**20:.0f} MiB over the emulated link ({result['link']}), "
        f"medians of {result['rounds']} rounds, Mbit/s:"
    )
    for cc, medians in result["median_mbit_s"].items():
        ours = medians["redline"]
        peers = ", ".join(f"{t} {medians[t]:.1f} (redline {ours / medians[t]:.2f}x)" for t in TOOLS[1:])
        print(f"  {cc} sender: redline {ours:.1f}; {peers}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
