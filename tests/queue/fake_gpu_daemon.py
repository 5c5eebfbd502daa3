"""The queue's daemon on a machine of two fake H100s (the NVML fake; the product path reads the real NVML):

    python tests/queue/fake_gpu_daemon.py QUEUE_DIR [daemon options as JSON]

GPU 1 holds 21 GiB of a process the queue did not start (pid 4242)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the fakes

from fakes.fake_nvml import FakeNvml, FakeProcess, h100_sxm
from redline.hw.nvml.probe import probe_gpus
from redline.queue.daemon import Daemon
from redline.queue.placement import slots_from

GIB = 2**30


def fake_gpus(ours: set[int]):
    busy = h100_sxm(1, memory_used_mib=21 * 1024, processes=[FakeProcess(4242, 21 * GIB)])
    return slots_from(probe_gpus(FakeNvml([h100_sxm(0), busy])), ours)


if __name__ == "__main__":
    options = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    Daemon(Path(sys.argv[1]), gpus=fake_gpus, **options).serve()
