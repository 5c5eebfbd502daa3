"""The queue's daemon on a machine of fake H100s (the NVML fake; the product path reads the real NVML):

    python tests/queue/fake_gpu_daemon.py [--gpus 2] --dir QUEUE_DIR [--faults FILE] [--kernel-log FILE]

Two GPUs (the default): GPU 1 holds 21 GiB of a process the queue did not start (pid 4242). More: an HGX board
of that many idle GPUs (benchmarks/queue_vs_peers.py's packing scenario). ``--faults``: a JSON file the test
writes while the daemon runs, {GPU index: {FakeGpu field: value}} (``{"0": {"lost": true}}``), applied to the
fake before every read. ``--kernel-log``: a file that stands for `dmesg` (the daemon's Xids). The daemon's
health samples every 0.2 s (the product's: 5 s)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the fakes

from fakes.fake_nvml import FakeNvml, FakeProcess, h100_sxm
from redline.hw.nvml.probe import probe_gpus
from redline.monitor.sampler import Sampler
from redline.queue.daemon import Daemon
from redline.queue.health import GpuHealth
from redline.queue.placement import slots_from

GIB = 2**30


def fake_nvml(count: int) -> FakeNvml:
    if count == 2:
        busy = h100_sxm(1, memory_used_mib=21 * 1024, processes=[FakeProcess(4242, 21 * GIB)])
        return FakeNvml([h100_sxm(0), busy])
    return FakeNvml([h100_sxm(i) for i in range(count)])


class Faulty:
    """The fake NVML with the faults file's fields applied first, at each read."""

    def __init__(self, nvml: FakeNvml, faults: Path | None) -> None:
        self.nvml = nvml
        self.faults = faults

    def apply(self) -> FakeNvml:
        if self.faults is not None and self.faults.exists():
            for index, fields in json.loads(self.faults.read_text()).items():
                for name, value in fields.items():
                    setattr(self.nvml.gpus[int(index)], name, value)
        return self.nvml


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--faults", type=Path)
    parser.add_argument("--kernel-log", type=Path)
    parser.add_argument("--retry-backoff", type=float, default=10.0)
    args = parser.parse_args()
    faulty = Faulty(fake_nvml(args.gpus), args.faults)

    def kernel_log() -> str | None:
        return args.kernel_log.read_text() if args.kernel_log is not None and args.kernel_log.exists() else None

    sampler = Sampler(nvml=faulty.nvml, host=None, kernel_log=kernel_log, xid_interval_s=0.0)

    def sample():
        faulty.apply()
        return sampler.sample()

    Daemon(
        args.dir,
        gpus=lambda ours: slots_from(probe_gpus(faulty.apply()), ours),
        health=GpuHealth(sample, kernel_log, interval_s=0.2),
        backoff_s=args.retry_backoff,
    ).serve()
