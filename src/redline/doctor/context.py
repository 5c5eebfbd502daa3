"""What a rule sees: the snapshot, plus lookups every rule would otherwise redo (catalog matches)."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

from redline.hw.snapshot import Gpu, Snapshot
from redline.specs.catalog import GpuSpec, match_gpu

if TYPE_CHECKING:
    from redline.bench.model import BenchRun, Measurement


@dataclass
class Audit:
    snapshot: Snapshot
    # measurements from `redline bench --save`, when the user asked for `doctor --bench`
    bench: BenchRun | None = None
    _specs: dict[int, GpuSpec | None] = field(default_factory=dict, repr=False)

    @cached_property
    def gpus(self) -> list[Gpu]:
        """GPUs that answered NVML; a lost GPU has its own rule and no readable fields."""
        return [g for g in self.snapshot.gpus if not g.lost]

    def spec(self, gpu: Gpu) -> GpuSpec | None:
        """The catalog row for this GPU, matched by NVML name and memory size; None if unknown."""
        if gpu.index not in self._specs:
            self._specs[gpu.index] = match_gpu(gpu.name, gpu.memory_total_bytes) if gpu.name else None
        return self._specs[gpu.index]

    def measurements(self, suite: str) -> list[Measurement]:
        return [m for m in self.bench.measurements if m.suite == suite] if self.bench else []

    @property
    def env(self) -> dict[str, str]:
        return self.snapshot.software.env

    @cached_property
    def ib_active(self) -> bool:
        """An InfiniBand or RoCE port is up: NCCL should be using it across nodes."""
        return any(p.state == "ACTIVE" for p in self.snapshot.network.ib_ports)


def gpu_subject(gpus: list[Gpu]) -> str:
    """'GPU 3' or 'GPUs 0-3,5': one finding covers every GPU with the same fault."""
    from redline.units import fmt_index_list

    indices = [g.index for g in gpus]
    return f"GPU {indices[0]}" if len(indices) == 1 else f"GPUs {fmt_index_list(indices)}"
