"""A small training loop under ``redline.prepare()`` that reads tar shards over HTTP, either straight from the
server (each shard one GET, read as the loop needs it) or through ``Staged`` (the next shards fetched into a
local cache meanwhile). ``tests/transfer/test_stage.py`` runs it in the near namespace of an emulated long
link and compares the data wait the runtime's step metrics record.

The step is a tiny model plus a fixed sleep standing in for the device's step time (a GPU step is a wait on
the host too): the loop then consumes shards at a rate the machine's load does not change, so what the
comparison shows is the network's share of the wait, not the CPU's.

    python staged_training.py direct|staged BASE_URL SHARDS METRICS_PATH [--cache DIR] [--ahead N]
"""

from __future__ import annotations

import argparse
import tarfile
import time
import urllib.request

import torch
from torch import nn

import redline
from redline.transfer.stage import Staged

SAMPLES_PER_SHARD = 64
FEATURES = 4096  # 16 KiB of float32 per sample: 1 MiB shards
BATCH = 16
STEP_S = 0.2  # the emulated device step


def shard_urls(base: str, shards: int) -> list[str]:
    return [f"{base}/shard-{i:03d}.tar" for i in range(shards)]


def straight(urls: list[str]):
    """Each shard streamed from the server as the loop reads it (what a loader reading a remote URL does)."""
    for url in urls:
        with urllib.request.urlopen(url, timeout=120) as response, tarfile.open(fileobj=response, mode="r|") as tar:
            for info in tar:
                if info.isfile():
                    yield tar.extractfile(info).read()


def staged(urls: list[str], cache: str, ahead: int):
    for member in Staged(urls, cache, ahead=ahead).members():
        yield member.data


class Shards(torch.utils.data.IterableDataset):
    def __init__(self, mode: str, urls: list[str], cache: str | None, ahead: int) -> None:
        self.mode, self.urls, self.cache, self.ahead = mode, urls, cache, ahead

    def __iter__(self):
        samples = straight(self.urls) if self.mode == "direct" else staged(self.urls, self.cache, self.ahead)
        for data in samples:
            x = torch.frombuffer(bytearray(data), dtype=torch.float32)
            yield x, (x[0] > 0).long()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["direct", "staged"])
    parser.add_argument("base")
    parser.add_argument("shards", type=int)
    parser.add_argument("metrics")
    parser.add_argument("--cache")
    parser.add_argument("--ahead", type=int, default=4)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = nn.Linear(FEATURES, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    dataset = Shards(args.mode, shard_urls(args.base, args.shards), args.cache, args.ahead)
    loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH)
    # the stream shares itself out (Staged); no workers added between epochs: one epoch, as read
    run = redline.prepare(model, optimizer, loader, metrics_path=args.metrics, shard_stream=False, adapt_workers=False)
    for x, y in run.micro_batches():
        with run.accumulate():
            loss = nn.functional.cross_entropy(run.model(x), y)
            time.sleep(STEP_S)
            run.backward(loss)


if __name__ == "__main__":
    main()
