"""The queue's daemon on a machine of fake H100s (the NVML fake; the product path reads the real NVML):

    python tests/queue/fake_gpu_daemon.py [--gpus 2] --dir QUEUE_DIR

Two GPUs (the default): GPU 1 holds 21 GiB of a process the queue did not start (pid 4242). More: an HGX board
of that many idle GPUs (benchmarks/queue_vs_peers.py's packing scenario)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the fakes

from fakes.fake_nvml import FakeNvml, FakeProcess, h100_sxm
from redline.hw.nvml.probe import probe_gpus
from redline.queue.daemon import Daemon
from redline.queue.placement import slots_from

GIB = 2**30


def fake_nvml(count: int) -> FakeNvml:
    if count == 2:
        busy = h100_sxm(1, memory_used_mib=21 * 1024, processes=[FakeProcess(4242, 21 * GIB)])
        return FakeNvml([h100_sxm(0), busy])
    return FakeNvml([h100_sxm(i) for i in range(count)])


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--dir", type=Path, required=True)
    args = parser.parse_args()
    nvml = fake_nvml(args.gpus)
    Daemon(args.dir, gpus=lambda ours: slots_from(probe_gpus(nvml), ours)).serve()
