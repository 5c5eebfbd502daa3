"""Records the residual stream as the runtime keeps it: ``prepare()`` wraps a tiny model under a strategy on the
CPU (one process, or ranks by ``spawn_ranks`` over gloo), runs one micro-batch, and writes what the model's second
block was given, as the block's forward saw it (after FSDP2 cast its inputs): dtype, bytes a value and bytes per
sample.

Environment: MODEL (``tp_worker.make_model``'s kinds), STRATEGY (JSON of Strategy fields), OUT (each rank writes
OUT.RANK.json).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import tp_worker


def main() -> None:
    from redline.plan.strategy import Strategy
    from redline.runtime.config import RunConfig
    from redline.runtime.prepare import prepare
    from redline.workload.structure import find_blocks

    if "STORE" in os.environ:
        torch.distributed.init_process_group(
            "gloo",
            init_method="file://" + os.environ["STORE"],
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
        )
    strategy = Strategy(**json.loads(os.environ["STRATEGY"]))
    model = tp_worker.make_model(os.environ["MODEL"], layers=2)
    block = find_blocks(model)[1][1]
    loader = torch.utils.data.DataLoader(tp_worker.dataset(), batch_size=strategy.micro_batch * strategy.data)
    run = prepare(model, lambda params: torch.optim.SGD(params, lr=0.1), loader, plan=RunConfig(strategy=strategy))
    seen: dict[str, Any] = {}

    def record(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        stream = args[0] if args else kwargs["hidden_states"]
        stream = stream.to_local() if hasattr(stream, "to_local") else stream
        seen.update(
            dtype=str(stream.dtype),
            bytes_per_value=stream.element_size(),
            bytes_per_sample=stream.numel() * stream.element_size() / stream.shape[0],
        )

    # registered after prepare(): FSDP2's own pre-forward hook (which casts the inputs) runs first
    block.register_forward_pre_hook(record, with_kwargs=True)
    for tokens, targets in run.micro_batches():
        with run.accumulate():
            run.backward(F.cross_entropy(tp_worker.logits(run.model, tokens).flatten(0, 1), targets.flatten()))
        break
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    Path(f"{os.environ['OUT']}.{rank}.json").write_text(json.dumps(seen))
    run.close()
    if torch.distributed.is_initialized():
        from ranks import leave_together

        leave_together()


if __name__ == "__main__":
    main()
