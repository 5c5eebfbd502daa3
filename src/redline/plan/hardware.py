"""The machine a plan runs on: per-GPU memory and ceilings, links, node count and price.

Ceilings come from the catalog by default, scaled by the efficiencies below, and from this machine's
``redline bench --save`` figures when planning for ``local`` (each ceiling says which it used).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from redline.errors import BadInput
from redline.plan.comm import Link
from redline.plan.gemm import GemmDevice, wave_efficiency
from redline.plan.messages import check_integral, refuse
from redline.specs.catalog import GpuSpec, find_gpu

if TYPE_CHECKING:
    from redline.bench.model import BenchRun, Measurement
    from redline.hw.snapshot import Snapshot
    from redline.specs.instances import InstanceSpec

# What a job can allocate of the nominal size: NVML shows an "80GB" H100 as 81559 MiB of 81920, an H200 as
# 143771 of 144384 (99.6%); 99.5% keeps the planner on the safe side where the catalog is all it has.
USABLE_MEMORY = 0.995
# Fractions of a datasheet figure that well-written code reaches; used only when nothing was measured.
# A full wave's share of the datasheet matmul peak in a training step's GEMMs (``plan.gemm`` adds what each
# shape loses to its last wave and its tiles' output writes). Fitted on Narayanan et al.'s three 175B runs
# (Table 2, 384-1536 A100, as they ran: no sequence parallelism, attention unfused; benchmarks/plan_vs_published.py,
# role "fit"): 0.71 minimises their squared log error.
# It sits below what one large GEMM reaches alone (about 0.8-0.86 in MAMF-finder's A100 and H100 sweeps) because
# it also carries what a real step loses around its GEMMs and the model does not name. On ``local`` a GPU's
# measured rate replaces it.
MATMUL_EFFICIENCY = 0.71
HBM_EFFICIENCY = 0.85  # a device-to-device copy reaches about 85-90% of the datasheet bandwidth
NVLINK_EFFICIENCY = 0.8  # all-reduce busbw over NVSwitch vs the per-direction NVLink rate (nccl-tests)
PCIE_EFFICIENCY = 0.7  # without NVLink, NCCL rings cross PCIe (and often the CPU)
NETWORK_EFFICIENCY = 0.9  # Calculon's InfiniBand efficiency
# alpha per collective (Calculon, systems/a100_80g.json): 10 us over NVLink, 20 us over InfiniBand
NVLINK_LATENCY_S = 10e-6
PCIE_LATENCY_S = 15e-6
NETWORK_LATENCY_S = 20e-6
# per-direction PCIe x16 bandwidth by generation, GB/s (PCI-SIG: 8, 16, 32 GT/s per lane, 128b/130b)
PCIE_X16_GBS = {3: 15.75, 4: 31.5, 5: 63.0, 6: 121.0}
# the largest NVLink domain of one server (HGX/DGX boards); more GPUs are more nodes
MAX_GPUS_PER_NODE = 8
# the largest training clusters published (Llama 3: 16k H100s; xAI: ~100k) fit in 16384 nodes of 8; past it the
# planner's search, linear in the GPU count, would run for hours on a typo
MAX_NODES = 16384
# inter-node bandwidth when the hardware names GPUs but not a network: a 400 Gbit/s NIC per node
DEFAULT_NETWORK_GBPS = 400.0


@dataclass(frozen=True)
class Ceiling:
    """A rate the plan divides by, and where it came from."""

    value: float  # FLOP/s or bytes/s
    source: str


@dataclass(frozen=True)
class Cluster:
    """Identical nodes of identical devices."""

    name: str  # as the user asked for it: "8xH100-SXM", "p5.48xlarge", "local"
    device: str  # "NVIDIA H100 SXM5 80GB", or the CPU model
    gpus_per_node: int
    nodes: int
    memory_bytes: int  # per device, what the job may allocate at most (before the CUDA context); a CPU's: its RAM
    peak_flops: dict[str, float]  # dense datasheet peak per precision (empty for a CPU): MFU's denominator
    matmul: dict[str, Ceiling]  # achievable dense matmul FLOP/s per precision
    memory_bandwidth: Ceiling  # bytes/s for memory-bound work
    intra: Link
    inter: Link | None
    price_usd_per_node_hour: float | None = None
    price_source: str | None = None
    gpu: GpuSpec | None = None
    notes: tuple[str, ...] = field(default=())
    network_assumed: bool = False  # the inter-node figure is DEFAULT_NETWORK_GBPS, not the machine's
    # a CPU's matmul rate by size per precision, as ``redline bench compute`` measured it: (square side, FLOP/s)
    # pairs by increasing side; empty on a GPU, whose rate by shape comes from its SM count (``plan.gemm``)
    matmul_sweep: dict[str, tuple[tuple[int, float], ...]] = field(default_factory=dict)

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def on_cpu(self) -> bool:
        """The job runs on this machine's CPU (``local`` without a GPU, the only cluster without a GPU spec): one
        process in RAM, with no CUDA context, NCCL or cuBLAS."""
        return self.gpu is None

    def gemm_device(self, precision: str) -> GemmDevice:
        """What sets a GEMM's time here in ``precision``: on a GPU its waves of ``sm_count`` tiles at the matmul
        ceiling; on a CPU the measured sweep (a bench saved without one gives a single point: one rate)."""
        ceiling = self.matmul[precision].value
        sweep = self.matmul_sweep.get(precision, ())
        if self.on_cpu and not sweep:
            sweep = ((1, ceiling),)
        sm_count = self.gpu.sm_count if self.gpu is not None else None
        element_bytes = ELEMENT_BYTES.get(precision, 2)
        return GemmDevice(ceiling, self.memory_bandwidth.value, element_bytes, sm_count, sweep)

    def with_nodes(self, nodes: int) -> Cluster:
        _check_nodes(nodes)
        if nodes > 1 and self.inter is None:
            raise refuse("{name}: no inter-node network is known; pass {network_gbps}", name=self.name)
        notes = self.notes
        if nodes > 1 and self.network_assumed:
            notes += (f"inter-node network assumed {DEFAULT_NETWORK_GBPS:g} Gbit/s per node (set --network-gbps)",)
        return replace(self, nodes=nodes, notes=notes)

    def with_network(self, gbps: float) -> Cluster:
        _check_network(gbps)
        return replace(self, inter=network_link(gbps, f"--network-gbps {gbps:g}"), network_assumed=False)


# bytes per element of a GEMM's operands in each precision (fp32 matmuls on TF32 tensor cores read fp32)
ELEMENT_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


def _check_nodes(nodes: int) -> None:
    check_integral("nodes", nodes)
    if not 1 <= nodes <= MAX_NODES:
        raise refuse("{nodes} must be between 1 and {most}, not {value}", most=MAX_NODES, value=nodes)


def _check_network(gbps: float | None) -> None:
    if gbps is not None and not gbps > 0:  # NaN too
        raise refuse("{network_gbps} must be positive, not {value}", value=gbps)


@dataclass(frozen=True)
class ClusterChoice:
    """The hardware a plan is for, as the user names it (``redline plan --hardware --nodes --network-gbps``);
    checked as it is made, resolved into a ``Cluster`` by ``cluster()``."""

    hardware: str = "local"  # COUNTxGPU (8xh100-sxm), a GPU (one), a cloud instance (p5.48xlarge), or local
    nodes: int = 1  # identical nodes, 1 to MAX_NODES
    network_gbps: float | None = None  # inter-node bandwidth per node; None: the instance's, else assumed

    def __post_init__(self) -> None:
        if not isinstance(self.hardware, str) or not self.hardware.strip():
            raise refuse("{hardware} is empty: give COUNTxGPU (8xh100-sxm), a cloud instance or local")
        _check_nodes(self.nodes)
        _check_network(self.network_gbps)

    def cluster(self) -> Cluster:
        """The cluster named: ``local`` probes this machine (with its saved ``redline bench`` figures)."""
        base = this_machine() if self.hardware.strip().lower() == "local" else parse_hardware(self.hardware)
        if self.network_gbps is not None:
            base = base.with_network(self.network_gbps)
        return base.with_nodes(self.nodes)


def network_link(gbps: float, source: str) -> Link:
    return Link(gbps / 8 * 1e9 * NETWORK_EFFICIENCY, NETWORK_LATENCY_S, f"{source} x {NETWORK_EFFICIENCY}")


# NVLink bridges on PCIe cards join this many of them (H200 NVL: 4-way; A100/H100 PCIe, RTX: pairs)
BRIDGE_GPUS = {"h200-nvl": 4}


def intra_node_link(gpu: GpuSpec, gpus_per_node: int, link_gbs: float | None = None) -> Link:
    """GPU-to-GPU inside a node: NVLink on SXM/OAM boards (an NVSwitch or full mesh joins all of them) and
    on PCIe cards whose bridges join every GPU of the node; else PCIe of the GPU's generation, which
    bounds a ring as soon as one hop crosses it. ``nvlink_gbs`` counts both directions."""
    both_ways = link_gbs if link_gbs is not None else gpu.nvlink_gbs
    bridged = gpus_per_node <= BRIDGE_GPUS.get(gpu.key, 2)
    if both_ways and (gpu.form_factor.upper().startswith(("SXM", "OAM")) or bridged):
        return Link(
            both_ways / 2 * 1e9 * NVLINK_EFFICIENCY,
            NVLINK_LATENCY_S,
            f"catalog: {both_ways:g} GB/s NVLink / 2 directions x {NVLINK_EFFICIENCY}",
        )
    per_direction = PCIE_X16_GBS.get(gpu.pcie_gen, 15.75)
    return Link(
        per_direction * 1e9 * PCIE_EFFICIENCY,
        PCIE_LATENCY_S,
        f"catalog: PCIe Gen{gpu.pcie_gen} x16 {per_direction:g} GB/s x {PCIE_EFFICIENCY}",
    )


def catalog_cluster(gpu: GpuSpec, gpus_per_node: int, *, name: str, network_gbps: float | None = None) -> Cluster:
    """Ceilings from the datasheet, scaled by the efficiencies above."""
    matmul = {
        precision: Ceiling(peak * 1e12 * MATMUL_EFFICIENCY, f"catalog {peak:g} TFLOP/s x {MATMUL_EFFICIENCY}")
        for precision, peak in gpu.peak_tflops.items()
        if precision in ("fp32", "tf32", "bf16", "fp16", "fp8")
    }
    if "tf32" in matmul:  # fp32 training runs its matmuls on TF32 tensor cores when allowed (redline's runtime does)
        matmul["fp32"] = matmul.pop("tf32")
    assumed = network_gbps is None
    if network_gbps is None:
        network_gbps = DEFAULT_NETWORK_GBPS
    return Cluster(
        name=name,
        device=gpu.name,
        gpus_per_node=gpus_per_node,
        nodes=1,
        memory_bytes=int(gpu.memory_bytes * USABLE_MEMORY),
        peak_flops={p: v * 1e12 for p, v in gpu.peak_tflops.items()},
        matmul=matmul,
        memory_bandwidth=Ceiling(
            gpu.memory_bandwidth_gbs * 1e9 * HBM_EFFICIENCY,
            f"catalog {gpu.memory_bandwidth_gbs:g} GB/s x {HBM_EFFICIENCY}",
        ),
        intra=intra_node_link(gpu, gpus_per_node),
        inter=network_link(network_gbps, f"{network_gbps:g} Gbit/s"),
        gpu=gpu,
        network_assumed=assumed,
    )


_COUNT_X_GPU = re.compile(r"\s*(\d+)\s*[x×*]\s*(.+)", re.IGNORECASE)


def parse_hardware(text: str) -> Cluster:
    """``8xH100-SXM`` / ``h100-sxm`` (one GPU) / a cloud instance name (``p5.48xlarge``). ``local`` is
    handled by ``local_cluster`` because it probes the machine."""
    match = _COUNT_X_GPU.fullmatch(text)
    count, gpu_name = (int(match.group(1)), match.group(2)) if match else (1, text)
    if count < 1:
        raise refuse("{hardware} {text}: the GPU count must be at least 1", text=text)
    if count > MAX_GPUS_PER_NODE:
        raise refuse(
            "{hardware} {text}: a node holds at most {most} GPUs; give the node and {nodes}, e.g. {node} {nodes} {n}",
            text=text,
            most=MAX_GPUS_PER_NODE,
            node=f"{MAX_GPUS_PER_NODE}x{gpu_name.strip()}",
            n=-(-count // MAX_GPUS_PER_NODE),
        )
    try:
        gpu = find_gpu(gpu_name.strip())
    except BadInput as gpu_error:
        if match:
            raise
        from redline.specs.instances import find_instance

        try:
            instance = find_instance(text)
        except BadInput:
            raise refuse(
                "{hardware} {text}: not a GPU (COUNTxGPU, e.g. 8xh100-sxm) nor a cloud instance; {why}; "
                "instances: redline catalog instances",
                text=text,
                why=gpu_error,
            ) from None
        return instance_cluster(instance)
    return catalog_cluster(gpu, count, name=text)


def instance_cluster(instance: InstanceSpec) -> Cluster:
    """A cloud instance: its GPUs from the catalog, its links and network from the instance catalog."""
    if instance.whole_gpus < 1:
        raise BadInput(
            f"{instance.name} has {instance.gpu_count:g} of a GPU (a partition); training plans need whole GPUs"
        )
    cluster = catalog_cluster(instance.gpu, instance.whole_gpus, name=instance.name, network_gbps=instance.network_gbps)
    if instance.network_gbps is None:  # not verified: plan this instance as a single node only
        cluster = replace(cluster, inter=None, notes=(f"{instance.name}: network not in the catalog; one node only",))
    intra = cluster.intra
    if instance.gpu_link_gbs and instance.gpu_interconnect in ("nvswitch", "nvlink"):
        intra = intra_node_link(instance.gpu, instance.whole_gpus, instance.gpu_link_gbs)
    elif instance.gpu_link_gbs and instance.gpu_interconnect == "pcie":  # the catalog's figure counts both directions
        per_direction = instance.gpu_link_gbs / 2
        intra = Link(
            per_direction * 1e9 * PCIE_EFFICIENCY,
            PCIE_LATENCY_S,
            f"{instance.name}: PCIe {per_direction:g} GB/s x {PCIE_EFFICIENCY}",
        )
    return replace(
        cluster,
        intra=intra,
        memory_bytes=min(cluster.memory_bytes, int(instance.gpu_memory_gb * 2**30 * USABLE_MEMORY)),
        price_usd_per_node_hour=instance.price_usd_per_hour,
        price_source=f"{instance.provider} on-demand {instance.region}, {instance.price_date}",
    )


# ---------------------------------------------------------------------------------------------- local


def this_machine() -> Cluster:
    """This machine as probed now, with the ceilings its latest ``redline bench --save`` measured."""
    from redline.bench import store
    from redline.hw.probe import take_snapshot

    snapshot = take_snapshot()
    return local_cluster(snapshot, store.latest(store.fingerprint(snapshot)[0]))


def local_cluster(snapshot: Snapshot, bench: BenchRun | None) -> Cluster:
    """This machine: its GPUs as probed (or its CPU), with measured ceilings where bench saved them."""
    from redline.specs.catalog import match_gpu

    gpus = snapshot.gpus
    if not gpus:
        return _cpu_cluster(snapshot, bench)
    first = gpus[0]
    spec = match_gpu(first.name, first.memory_total_bytes)
    if spec is None:
        raise BadInput(f"local GPU '{first.name}' is not in the catalog; plan with --hardware COUNTxGPU")
    if first.multiprocessor_count:  # a MIG instance: its share of the SMs fills a GEMM's waves
        spec = replace(spec, sm_count=first.multiprocessor_count)
    cluster = catalog_cluster(spec, len(gpus), name="local")
    if first.memory_total_bytes:
        cluster = replace(cluster, memory_bytes=first.memory_total_bytes, device=first.name or spec.name)
    if bench is not None:
        cluster = _with_measurements(cluster, bench, device_prefix="cuda")
    return cluster


def _cpu_cluster(snapshot: Snapshot, bench: BenchRun | None) -> Cluster:
    measured = {m.name: m for m in (bench.measurements if bench else []) if m.device == "cpu"}
    matmul = {
        name.removeprefix("matmul_"): Ceiling(m.value * 1e12, f"bench {m.name} {m.value:.3g} TFLOP/s")
        for name, m in measured.items()
        if name.startswith("matmul_") and m.suite == "compute"
    }
    copy = measured.get("host_copy")
    if not matmul or copy is None:
        raise BadInput(
            "this machine has no GPU, and planning for its CPU needs measured ceilings: run "
            "`redline bench compute memory --save` first, or plan for a named GPU (--hardware 8xh100-sxm)"
        )
    host = snapshot.host
    memory = min((b for b in (host.memory_total_bytes, host.cgroup_memory_limit_bytes) if b), default=0)
    cluster = Cluster(
        name="local",
        device=host.cpu_model or "CPU",
        gpus_per_node=1,
        nodes=1,
        memory_bytes=memory,
        peak_flops={},
        matmul=matmul,
        memory_bandwidth=Ceiling(copy.value * 1e9, f"bench host_copy {copy.value:.3g} GB/s"),
        intra=Link(1e9, 1e-4, "gloo (one rank: unused)"),
        inter=None,
        notes=("CPU: no datasheet peak, so no MFU; ceilings are this machine's bench figures",),
        matmul_sweep={
            name.removeprefix("matmul_"): sweep
            for name, m in measured.items()
            if name.startswith("matmul_") and m.suite == "compute" and (sweep := measured_sweep(m))
        },
    )
    return cluster


def measured_sweep(measurement: Measurement) -> tuple[tuple[int, float], ...]:
    """The (square side, FLOP/s) pairs a CPU matmul measurement swept, by increasing side, with its main size; a
    bench saved before the sweep existed gives its one size (a single rate for every shape)."""
    points = {int(side): tflops * 1e12 for side, tflops in measurement.extra.get("sweep", [])}
    if "m" in measurement.size:
        points[int(measurement.size["m"])] = measurement.value * 1e12
    return tuple(sorted(points.items()))


def _measured_side(bench: BenchRun, precision: str, device_prefix: str) -> int | None:
    names = (f"matmul_{precision}", "matmul_tf32") if precision == "fp32" else (f"matmul_{precision}",)
    for m in bench.measurements:
        if m.suite == "compute" and m.name in names and m.device.startswith(device_prefix) and "m" in m.size:
            return int(m.size["m"])
    return None


def _with_measurements(cluster: Cluster, bench: BenchRun, device_prefix: str) -> Cluster:
    """Replace catalog ceilings by what bench measured on this machine's devices (median over devices)."""
    import statistics

    def values(suite: str, name: str) -> list[float]:
        return [
            m.value
            for m in bench.measurements
            if m.suite == suite and m.name == name and m.device.startswith(device_prefix)
        ]

    matmul = dict(cluster.matmul)
    for precision in list(matmul):
        found = values("compute", f"matmul_{precision}" if precision != "fp32" else "matmul_tf32") or values(
            "compute", f"matmul_{precision}"
        )
        if found:
            # what one full wave runs at: the measured square product's own last wave was partly empty
            side = _measured_side(bench, precision, device_prefix)
            sms = cluster.gpu.sm_count if cluster.gpu else None
            filled = wave_efficiency(side, side, 1, sms) if side and sms else 1.0
            tflops = statistics.median(found) / filled
            matmul[precision] = Ceiling(
                tflops * 1e12, f"bench {bench.taken_at[:10]} {tflops:.4g} TFLOP/s per full wave ({filled:.3f} filled)"
            )
    memory_bandwidth = cluster.memory_bandwidth
    if found := values("memory", "device_copy"):
        gbs = statistics.median(found)
        memory_bandwidth = Ceiling(gbs * 1e9, f"bench {bench.taken_at[:10]} device_copy {gbs:.4g} GB/s")
    intra = cluster.intra
    all_reduce = [
        m
        for m in bench.measurements
        if m.suite == "collective" and m.name == "all_reduce" and m.device.startswith(device_prefix)
    ]
    if all_reduce:
        gbs = all_reduce[-1].value
        intra = Link(gbs * 1e9, intra.latency_s, f"bench {bench.taken_at[:10]} all_reduce busbw {gbs:.4g} GB/s")
    return replace(cluster, matmul=matmul, memory_bandwidth=memory_bandwidth, intra=intra)
