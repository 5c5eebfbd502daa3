"""redline's storage bench against fio, side by side on the same file, the same patterns, the same jobs.

    python benchmarks/storage_vs_fio.py [--path DIR] [--rounds 7] [--file-mib 1024] [--jobs 4] [--limit-s 2]

Each round runs every pattern once with fio and once with redline's reader, alternating which goes
first, so drift in a shared machine's load (or a hypervisor's cache) hits both alike. fio runs the job
``redline.bench.storage.fio_args`` builds: ``--ioengine=psync`` (one blocking pread per job, iodepth 1,
which is what each of redline's reader threads does), the same block size, ``--numjobs``, per-job slice
(``--size`` + ``--offset_increment``), random map, time limit, and ``--direct=1`` exactly when redline reads
with O_DIRECT. The small-files row has fio read the very files redline wrote (``--filename_format``).
Printed: the median of the rounds for each tool, and redline/fio (target: within 10%).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile

from redline.bench import storage
from redline.bench.model import Spread
from redline.bench.storage import MiB, Rate


def _figure(name: str, rate: Rate) -> float:
    """The figure each row compares: IOPS for 4 KiB random reads, files/s for small files, else MB/s."""
    if name in ("rand_read_4k", "small_files"):
        return rate.ops_per_s
    return rate.mb_per_s


def _unit(name: str) -> str:
    return {"rand_read_4k": "IOPS", "small_files": "files/s"}.get(name, "MB/s")


def compare(directory: str, *, rounds: int, file_bytes: int, jobs: int, limit_s: float, small: int) -> dict:
    """{pattern: {"redline": [figures], "fio": [figures]}}, every round of every pattern."""
    results: dict[str, dict[str, list[float]]] = {}

    def record(name: str, tool: str, rate: Rate) -> None:
        results.setdefault(name, {"redline": [], "fio": []})[tool].append(_figure(name, rate))

    with storage.test_file(directory, file_bytes) as tf:
        for r in range(rounds):
            for pattern in storage.PATTERNS:
                runs = [
                    ("fio", lambda p=pattern: storage.run_fio(storage.fio_args(tf, p, jobs, limit_s))),
                    ("redline", lambda p=pattern: storage.read_pass(tf, p, jobs, limit_s)),
                ]
                for tool, fn in runs if r % 2 == 0 else runs[::-1]:
                    record(pattern.name, tool, fn())
    with storage.small_files(directory, small, 100 * 1024, jobs) as files:
        for r in range(rounds):
            runs = [
                ("fio", lambda: storage.run_fio(storage.fio_small_files_args(files, limit_s))),
                ("redline", lambda: storage.small_files_pass(files, limit_s)),
            ]
            for tool, fn in runs if r % 2 == 0 else runs[::-1]:
                record("small_files", tool, fn())
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", default=None, help="directory on the filesystem to test (default: a temp dir)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--file-mib", type=int, default=1024)
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument("--limit-s", type=float, default=2.0, help="time limit of one pass")
    parser.add_argument("--small-files", type=int, default=2000)
    args = parser.parse_args()
    if shutil.which("fio") is None:
        print("fio is not installed (Debian/Ubuntu: apt-get install -y fio)", file=sys.stderr)
        return 2
    version = subprocess.run(["fio", "--version"], capture_output=True, text=True, check=False).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="redline-vs-fio-", dir=args.path) as directory:
        where = storage.filesystem_of(directory)
        print(
            f"{version}, {where['fstype']} at {where['mountpoint']} ({where['source']}), {args.jobs} jobs, "
            f"{args.file_mib} MiB file, {args.small_files} x 100 KiB files, "
            f"{args.rounds} rounds of <= {args.limit_s:g} s"
        )
        results = compare(
            directory,
            rounds=args.rounds,
            file_bytes=args.file_mib * MiB,
            jobs=args.jobs,
            limit_s=args.limit_s,
            small=args.small_files,
        )
    print(f"{'pattern':<16}{'unit':>8}{'redline':>12}{'fio':>12}{'redline/fio':>13}   redline p10-p90 | fio p10-p90")
    for name, by_tool in results.items():
        ours, theirs = statistics.median(by_tool["redline"]), statistics.median(by_tool["fio"])
        print(
            f"{name:<16}{_unit(name):>8}{ours:>12.0f}{theirs:>12.0f}{ours / theirs:>13.3f}   "
            f"{_p10_p90(by_tool['redline'])} | {_p10_p90(by_tool['fio'])}"
        )
    return 0


def _p10_p90(samples: list[float]) -> str:
    spread = Spread.of(samples)
    return f"{spread.p10:.0f}-{spread.p90:.0f}"


if __name__ == "__main__":
    sys.exit(main())
