"""The device mesh a plan's strategy lays the ranks out on (torchtitan's ``ParallelDims``).

The dimensions are ``pp``, ``dp_replicate``, ``dp_shard``, ``tp``, outermost first, so ranks are ordered
tensor-innermost as ``Strategy`` says (a tensor-parallel group is consecutive ranks: inside a node). A
dimension of size 1 is left out of the mesh; the data-parallel dimensions, whichever are there, are also
flattened into ``dp``: the group the data path splits batches over and FSDP2 shards over.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from redline.errors import BadInput
from redline.plan.strategy import Strategy


@dataclass(frozen=True)
class ParallelDims:
    """The degrees of a run, one per mesh dimension; their product is the world size."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1

    @classmethod
    def from_strategy(cls, strategy: Strategy, *, per_node: int) -> ParallelDims:
        """The strategy's degrees. Its data degree is sharded (ZeRO-2, FSDP), replicated (DDP, ZeRO-1), or
        for HSDP sharded within a node (``per_node`` ranks, of which a tensor group takes ``tensor``) and
        replicated across nodes."""
        data = strategy.data
        if strategy.sharding in ("ddp", "zero1"):
            replicate, shard = data, 1
        elif strategy.sharding == "hsdp":
            shard = max(1, min(data, per_node // strategy.tensor))
            if data % shard:
                raise BadInput(f"HSDP shards within a node: {shard} data ranks per node do not divide {data}")
            replicate = data // shard
        else:
            replicate, shard = 1, data
        return cls(pp=strategy.pipeline, dp_replicate=replicate, dp_shard=shard, tp=strategy.tensor)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp(self) -> int:
        """The data-parallel degree: ranks that load different batches."""
        return self.dp_replicate * self.dp_shard

    def sizes(self) -> dict[str, int]:
        """The mesh's dimensions and sizes, outermost first, those of size 1 left out."""
        named = {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "tp": self.tp}
        return {name: size for name, size in named.items() if size > 1}


@dataclass(frozen=True)
class RunMesh:
    """The mesh over every rank and the groups the runtime uses from it: ``dp`` (batches are split over it,
    FSDP2 shards over it), ``tp`` (what ``apply_tp`` shards the layers over) and ``pp`` (the ranks of one
    pipeline, a stage each); None where that degree is 1."""

    world: DeviceMesh
    dp: DeviceMesh | None
    tp: DeviceMesh | None
    pp: DeviceMesh | None = None

    def dp_rank_and_size(self) -> tuple[int, int]:
        """This rank's place in the data-parallel group and the group's size ((0, 1) without one: every rank
        loads the same batches)."""
        return (self.dp.get_local_rank(), self.dp.size()) if self.dp is not None else (0, 1)


def build_mesh(dims: ParallelDims, device_type: str) -> RunMesh:
    """The mesh over every rank of the process group (``init_device_mesh``; gloo on CPUs works), its
    data-parallel dimensions flattened into ``dp``."""
    sizes = dims.sizes() or {"dp": 1}
    mesh = init_device_mesh(device_type, tuple(sizes.values()), mesh_dim_names=tuple(sizes))
    data = tuple(name for name in ("dp_replicate", "dp_shard") if name in sizes)
    dp = mesh[data]._flatten("dp") if data else None
    pick = {name: mesh[name] if name in sizes else None for name in ("tp", "pp")}
    return RunMesh(world=mesh, dp=dp, **pick)


def lay_out_ranks(strategy: Strategy, *, world: int, device_type: str) -> RunMesh | None:
    """The plan's layout must be the running ranks. A tensor- or pipeline-parallel plan lays them out on a
    device mesh; the others keep the flat group (None)."""
    if strategy.gpus != world:
        layout = f" x tensor degree {strategy.tensor}" if strategy.tensor > 1 else ""
        raise BadInput(
            f"the plan is for {strategy.data} data-parallel ranks{layout} but {world} are running; "
            f"launch with `redline run --nproc-per-node {strategy.gpus}` or re-plan"
        )
    if strategy.tensor == 1 and strategy.pipeline == 1:
        return None
    dims = ParallelDims.from_strategy(strategy, per_node=int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    return build_mesh(dims, device_type)
