"""Memory bandwidth: on the GPU, host<->GPU over PCIe, GPU to GPU, and host memory.

Counting, as nvbandwidth and STREAM do (GB = 1e9 bytes):
- a copy within one memory (``device_copy``, ``host_copy``) reads every byte once and writes it once,
  so it moves 2 x size: GB/s = 2·size / t / 1e9, compared with the datasheet bandwidth;
- a copy across a link (``h2d_*``, ``d2h_*``, ``p2p_i_j``) moves size bytes in one direction:
  GB/s = size / t / 1e9, compared with the link's per-direction rate.

Buffers are large (>= 1 GiB on the GPU, >= 256 MiB across links) so caches and launch costs vanish.
Host->GPU copies are measured from pinned memory (what DMA needs, and what ``pin_memory=True`` gives a
DataLoader) and from pageable memory (what a plain tensor gives: the driver stages it through a pinned
bounce buffer, so the figure is bounded by the CPU's memcpy too). GPU copies are timed with CUDA events
on the stream that runs them, median of repeats, with the GPUs' clocks sampled during the run.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from redline.bench.compute import catalog_spec, cuda_indices, pci_address, require_torch, snapshot_gpu
from redline.bench.context import BenchContext
from redline.bench.model import Measurement, Spread
from redline.bench.timing import time_calls
from redline.errors import BadInput
from redline.units import GiB, MiB

if TYPE_CHECKING:
    from redline.hw.snapshot import Gpu
    from redline.specs.catalog import GpuSpec

SUITE = "memory"
# bytes per buffer: {quick: size}
DEVICE_COPY_BYTES = {False: 2 * GiB, True: 1 * GiB}
MIN_DEVICE_COPY_BYTES = 256 * MiB  # on a GPU someone else has filled; still far beyond any L2
LINK_COPY_BYTES = {False: 1 * GiB, True: 256 * MiB}
HOST_COPY_BYTES = {False: 1 * GiB, True: 256 * MiB}
# (warm-up calls, timed repeats)
TIMING = {False: (3, 20), True: (2, 8)}
CPU_TIMING = {False: (2, 10), True: (1, 5)}

# PCIe data rate per lane and direction in GB/s, after line encoding: Gen1/2 8b/10b at 2.5/5 GT/s,
# Gen3/4/5 128b/130b at 8/16/32 GT/s, Gen6 PAM4 64 GT/s with 242/256-byte FLITs. A x16 link: Gen3 15.75,
# Gen4 31.5, Gen5 63 GB/s per direction (datasheets' "64/128 GB/s" add both directions). Packet headers
# cost another 10-20%: Gen4 x16 copies top out near 26 GB/s, Gen5 x16 near 55.
PCIE_LANE_GBS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}


def copy_gbs(size_bytes: int, seconds: float, *, read_and_write: bool) -> float:
    """GB/s of one copy of ``size_bytes``: 2·size/t when both ends are the same memory (every byte is read
    and written there), size/t when the copy crosses a link (each byte crosses it once)."""
    return (2 if read_and_write else 1) * size_bytes / seconds / 1e9


def pcie_gbs(gen: int | None, width: int | None) -> float | None:
    """Theoretical one-direction rate of a PCIe link, or None when its generation or width is unknown."""
    if not gen or not width or gen not in PCIE_LANE_GBS:
        return None
    return PCIE_LANE_GBS[gen] * width


def run(ctx: BenchContext) -> list[Measurement]:
    """The host copy always (it bounds every pageable transfer), the GPU figures when there are GPUs."""
    require_torch(SUITE)
    indices = [] if ctx.device == "cpu" else cuda_indices(ctx.device)
    return [measure_host_copy(ctx), *measure_gpus(ctx, indices)]


# ------------------------------------------------------------------------------------------- host


def measure_host_copy(ctx: BenchContext, size_bytes: int | None = None) -> Measurement:
    """``dst.copy_(src)`` of a large host buffer: what the CPU's memory system gives torch (multi-threaded),
    and the ceiling of every pageable host->GPU copy."""
    import torch

    size = size_bytes or HOST_COPY_BYTES[ctx.quick]
    warmup, repeats = CPU_TIMING[ctx.quick]
    with ctx.task("memory: host copy", 1) as step:
        src = torch.empty(size, dtype=torch.uint8).fill_(1)  # fill: fault every page in before timing
        dst = torch.empty(size, dtype=torch.uint8).fill_(0)
        seconds = time_calls(functools.partial(dst.copy_, src), warmup=warmup, repeats=repeats)
        del src, dst
        step()
    spread = Spread.of([copy_gbs(size, s, read_and_write=True) for s in seconds])
    return Measurement(
        suite=SUITE,
        name="host_copy",
        value=spread.median,
        unit="GB/s",
        method=f"torch uint8 dst.copy_(src) of {size / MiB:.0f} MiB on the host, 2*size/t (read + write), "
        f"median of {repeats} after {warmup} warm-up; no catalog peak for host memory",
        device="cpu",
        size={"bytes": size},
        repeats=repeats,
        spread=spread,
        extra={"threads": torch.get_num_threads()},
    )


# -------------------------------------------------------------------------------------------- GPU


def measure_gpus(ctx: BenchContext, indices: list[int]) -> list[Measurement]:
    """Per GPU: device copy, H2D and D2H pinned and pageable; then every ordered pair peer to peer."""
    out = []
    for index in indices:
        out.extend(measure_gpu(ctx, index))
    if len(indices) > 1:
        out.extend(measure_p2p(ctx, indices))
    return out


def _state(ctx: BenchContext, indices: list[int]) -> list[int]:
    """NVML indices of these torch devices, for the sampler."""
    gpus = [snapshot_gpu(ctx, i) for i in indices]
    return [g.index for g in gpus if g is not None]


def measure_gpu(ctx: BenchContext, index: int) -> list[Measurement]:
    import torch

    from redline.bench.sampler import GpuSampler

    device = f"cuda:{index}"
    warmup, repeats = TIMING[ctx.quick]
    spec = catalog_spec(ctx, index)
    gpu = snapshot_gpu(ctx, index)
    out = []
    with torch.cuda.device(index), ctx.task(f"memory: {device}", 5) as step:
        # device to device: two buffers, each at most a quarter of the free memory
        free_bytes, _ = torch.cuda.mem_get_info(index)
        size = max(MIN_DEVICE_COPY_BYTES, min(DEVICE_COPY_BYTES[ctx.quick], free_bytes // 4 // MiB * MiB))
        with GpuSampler(_state(ctx, [index])) as sampler:
            src = _alloc(size, device).fill_(1)
            dst = _alloc(size, device)
            seconds = time_calls(functools.partial(dst.copy_, src), warmup=warmup, repeats=repeats, device=device)
            del src, dst
        peak = spec.memory_bandwidth_gbs if spec else None
        out.append(
            _link_measurement(
                "device_copy",
                device,
                size,
                seconds,
                read_and_write=True,
                how=f"torch dst.copy_(src) on {device}",
                repeats=repeats,
                warmup=warmup,
                peak=peak,
                peak_source=f"catalog {spec.key}: memory_bandwidth_gbs, the datasheet HBM/GDDR rate; a copy "
                "kernel reaches ~80-90% of it"
                if spec and peak
                else None,
                extra={"gpu_state": sampler.summary()},
            )
        )
        step()

        # host <-> device, pinned and pageable
        size = LINK_COPY_BYTES[ctx.quick]
        link_peak, link_source, link_extra = _pcie_peak(gpu)
        for pinned in (True, False):
            kind = "pinned" if pinned else "pageable"
            host = torch.empty(size, dtype=torch.uint8, pin_memory=pinned).fill_(1)
            on_gpu = _alloc(size, device)
            directions = {
                f"h2d_{kind}": (on_gpu, host, f"{kind} host -> {device}"),
                f"d2h_{kind}": (host, on_gpu, f"{device} -> {kind} host"),
            }
            for name, (dst, src, how) in directions.items():
                with GpuSampler(_state(ctx, [index])) as sampler:
                    seconds = time_calls(
                        functools.partial(dst.copy_, src, non_blocking=pinned),
                        warmup=warmup,
                        repeats=repeats,
                        device=device,
                    )
                out.append(
                    _link_measurement(
                        name,
                        device,
                        size,
                        seconds,
                        read_and_write=False,
                        how=f"torch copy_ {how}",
                        repeats=repeats,
                        warmup=warmup,
                        peak=link_peak,
                        peak_source=link_source,
                        extra={"gpu_state": sampler.summary(), **link_extra},
                    )
                )
                step()
            del host, on_gpu, directions, dst, src
    torch.cuda.empty_cache()
    return out


def _alloc(size: int, device: str) -> Any:
    """A GPU buffer, or a clear message when the GPU has no room (another tenant holding its memory)."""
    import torch

    try:
        return torch.empty(size, dtype=torch.uint8, device=device)
    except torch.cuda.OutOfMemoryError:
        free_bytes, total_bytes = torch.cuda.mem_get_info(device)
        raise BadInput(
            f"{device}: no room for a {size / MiB:.0f} MiB buffer ({free_bytes / GiB:.1f} of "
            f"{total_bytes / GiB:.1f} GiB free; see nvidia-smi for who holds the rest)"
        ) from None


def _pcie_peak(gpu: Gpu | None) -> tuple[float | None, str | None, dict[str, Any]]:
    """The link's theoretical per-direction rate, from the generation and width it can train to.

    The probe's *current* generation is useless here: an idle GPU drops its link to Gen1 to save power and
    retrains within microseconds of traffic, so the max the slot allows is what a copy runs at.
    """
    if gpu is None:
        return None, None, {"pcie": "this GPU is not in the probe's snapshot"}
    link = gpu.pcie
    peak = pcie_gbs(link.gen_max, link.width_max)
    extra = {
        "pcie": {
            "gen_max": link.gen_max,
            "width_max": link.width_max,
            "gen_current_at_probe": link.gen_current,
            "width_current_at_probe": link.width_current,
        }
    }
    if peak is None or link.gen_max is None:
        return None, None, extra
    source = (
        f"PCIe Gen{link.gen_max} x{link.width_max} per direction, {PCIE_LANE_GBS[link.gen_max]} GB/s per lane "
        "(the probe's gen_max/width_max: an idle link runs downshifted); packet overhead leaves ~85% usable"
    )
    return peak, source, extra


def measure_p2p(ctx: BenchContext, indices: list[int]) -> list[Measurement]:
    """``p2p_i_j``: GB/s of a copy from cuda:i into cuda:j, for every ordered pair.

    torch runs a cross-GPU copy on the source GPU's current stream, so the events are recorded there.
    Without peer access the driver bounces the data through host memory: that is the figure such a pair
    gives NCCL too.
    """
    import torch

    from redline.bench.sampler import GpuSampler

    size = LINK_COPY_BYTES[ctx.quick]
    warmup, repeats = TIMING[ctx.quick]
    gpus = {i: snapshot_gpu(ctx, i) for i in indices}
    spec = catalog_spec(ctx, indices[0])
    buffers = {i: _alloc(size, f"cuda:{i}").fill_(i) for i in indices}
    received = {i: _alloc(size, f"cuda:{i}") for i in indices}
    pairs = [(i, j) for i in indices for j in indices if i != j]
    out = []
    with ctx.task("memory: peer to peer", len(pairs)) as step:
        for i, j in pairs:
            src, dst = buffers[i], received[j]
            with torch.cuda.device(i), GpuSampler(_state(ctx, [i, j])) as sampler:
                seconds = time_calls(
                    functools.partial(dst.copy_, src), warmup=warmup, repeats=repeats, device=f"cuda:{i}"
                )
            peak, source, link = p2p_peak(spec, gpus[i], gpus[j], list(gpus.values()))
            out.append(
                _link_measurement(
                    f"p2p_{i}_{j}",
                    f"cuda:{i}",
                    size,
                    seconds,
                    read_and_write=False,
                    how=f"torch copy_ cuda:{i} -> cuda:{j} (on cuda:{i}'s stream)",
                    repeats=repeats,
                    warmup=warmup,
                    peak=peak,
                    peak_source=source,
                    extra={
                        "gpu_state": sampler.summary(),
                        "can_device_access_peer": torch.cuda.can_device_access_peer(i, j),
                        "link": link,
                        **_nvml_pair(ctx, gpus[i], gpus[j]),
                    },
                )
            )
            step()
    del buffers, received
    torch.cuda.empty_cache()
    return out


def p2p_peak(
    spec: GpuSpec | None, src: Gpu | None, dst: Gpu | None, all_gpus: list[Gpu | None]
) -> tuple[float | None, str | None, str]:
    """What a one-way copy from ``src`` to ``dst`` can reach: NVLink when active links join them (directly or
    through an NVSwitch), else the slower of the two PCIe links. Returns (GB/s, source, "nvlink"|"pcie").

    The catalog's nvlink_gbs counts every link of a GPU in both directions, so one direction of one link
    carries nvlink_gbs / nvlink_links / 2.
    """
    if src is None or dst is None:
        return None, None, "unknown"
    active = [link for link in src.nvlinks or [] if link.active and link.peer_pci_bus_id]
    if active and spec and spec.nvlink_gbs and spec.nvlink_links:
        gpu_addresses = {pci_address(g.pci_bus_id) for g in all_gpus if g is not None} - {None}
        peers = [pci_address(link.peer_pci_bus_id) for link in active]
        direct = [p for p in peers if p is not None and p == pci_address(dst.pci_bus_id)]
        switched = [p for p in peers if p is not None and p not in gpu_addresses]
        links = len(direct) or len(switched)
        if links:
            per_link = spec.nvlink_gbs / spec.nvlink_links / 2
            route = "direct" if direct else "through NVSwitch"
            return (
                links * per_link,
                f"catalog {spec.key}: nvlink_gbs {spec.nvlink_gbs:g} over {spec.nvlink_links} links, both "
                f"directions; one direction of {links} active link(s) {route}",
                "nvlink",
            )
    rates = [pcie_gbs(g.pcie.gen_max, g.pcie.width_max) for g in (src, dst)]
    if rates[0] is None or rates[1] is None:
        return None, None, "pcie"
    return min(rates[0], rates[1]), "PCIe per direction, the slower of the two GPUs' links (gen_max/width_max)", "pcie"


def _nvml_pair(ctx: BenchContext, src: Gpu | None, dst: Gpu | None) -> dict[str, Any]:
    """What NVML said about this pair at probe time: P2P read status and topology (PIX, NODE, SYS...)."""
    section = ctx.snapshot.gpu if ctx.snapshot else None
    if section is None or src is None or dst is None:
        return {}
    out: dict[str, Any] = {}
    for key, matrix in (("nvml_p2p", section.p2p), ("topology", section.topology)):
        try:
            out[key] = matrix[src.index][dst.index] if matrix else None
        except IndexError:
            out[key] = None
    return out


def _link_measurement(
    name: str,
    device: str,
    size: int,
    seconds: list[float],
    *,
    read_and_write: bool,
    how: str,
    repeats: int,
    warmup: int,
    peak: float | None,
    peak_source: str | None,
    extra: dict[str, Any],
) -> Measurement:
    spread = Spread.of([copy_gbs(size, s, read_and_write=read_and_write) for s in seconds])
    counted = "2*size/t (read + write)" if read_and_write else "size/t (one direction)"
    return Measurement(
        suite=SUITE,
        name=name,
        value=spread.median,
        unit="GB/s",
        method=f"{how}, {size / MiB:.0f} MiB, {counted}, median of {repeats} CUDA-event-timed copies after "
        f"{warmup} warm-up",
        device=device,
        size={"bytes": size},
        repeats=repeats,
        spread=spread,
        peak=peak,
        peak_source=peak_source,
        extra=extra,
    )
