"""Can the host keep the GPUs fed? CPU governor, quota and other processes' load, memory, swap, /dev/shm, NUMA."""

from __future__ import annotations

from collections.abc import Iterator

from redline.bench.suites import rerun_command
from redline.doctor.context import Audit, gpu_subject
from redline.doctor.engine import rule
from redline.doctor.model import Area, Finding, Severity
from redline.hw.host import SHM_MIN_BYTES
from redline.units import fmt_bytes

MIN_CORES_PER_GPU = 4
MAX_SWAPPINESS = 10


@rule("host.cpu-governor", Area.HOST, "CPU frequency governor is not 'performance'")
def cpu_governor(audit: Audit) -> Iterator[Finding]:
    governors = audit.snapshot.host.cpu_governors or {}
    slow = {g: n for g, n in governors.items() if g != "performance"}
    if slow:
        yield Finding(
            Severity.WARN,
            "CPU governor: " + ", ".join(f"{g} on {n} CPU(s)" for g, n in slow.items()),
            cost="CPUs ramp their clocks up late: slower data loading and kernel launches, jittery steps.",
            fix="cpupower frequency-set -g performance (or set it in the BIOS/tuned profile).",
            evidence=governors,
            command="cat /sys/devices/system/cpu/cpu*/cpufreq/scaling_governor | sort | uniq -c",
        )


@rule("host.swap", Area.HOST, "Swap in use with high swappiness")
def swap(audit: Audit) -> Iterator[Finding]:
    host = audit.snapshot.host
    if host.swap_used_bytes and host.swappiness is not None and host.swappiness > MAX_SWAPPINESS:
        yield Finding(
            Severity.WARN,
            f"{fmt_bytes(host.swap_used_bytes)} swapped out, vm.swappiness={host.swappiness}",
            cost="The kernel pages out pageable memory of running jobs (the Python heap, DataLoader buffers) "
            "and pays it back in stalls of seconds.",
            fix=f"sysctl -w vm.swappiness={MAX_SWAPPINESS} (or 1), or swapoff -a on a dedicated training node.",
            evidence={
                "swap_total_bytes": host.swap_total_bytes,
                "swap_used_bytes": host.swap_used_bytes,
                "swappiness": host.swappiness,
            },
            command="swapon --show; sysctl vm.swappiness",
        )


@rule("host.shm-small", Area.HOST, "/dev/shm too small for DataLoader workers")
def shm_small(audit: Audit) -> Iterator[Finding]:
    size = audit.snapshot.host.shm_total_bytes
    if size is not None and size < SHM_MIN_BYTES:
        yield Finding(
            Severity.FAIL,
            f"/dev/shm is only {fmt_bytes(size)}",
            cost="DataLoader workers pass batches through shared memory and crash with 'Bus error ... "
            "insufficient shared memory (shm)' once batches outgrow it.",
            fix="Start the container with --ipc=host or --shm-size=16g (Kubernetes: an emptyDir with "
            "medium: Memory mounted at /dev/shm).",
            evidence={"shm_total_bytes": size},
            command="df -h /dev/shm",
        )


@rule("host.cgroup-cpu", Area.HOST, "Container CPU quota below the cores it can see")
def cgroup_cpu(audit: Audit) -> Iterator[Finding]:
    host = audit.snapshot.host
    limit, visible = host.cgroup_cpu_limit_cores, host.process_cpu_count or host.cpu_logical_cores
    if limit is not None and visible and limit < visible:
        yield Finding(
            Severity.WARN,
            f"CPU quota of {limit:g} cores, but {visible} cores visible",
            cost="PyTorch, OpenMP and DataLoader size their thread pools from the visible cores: they "
            "oversubscribe the quota and get throttled by the kernel (CFS) in bursts.",
            fix=f"Set OMP_NUM_THREADS and num_workers from the quota ({limit:g}), or ask for a larger quota.",
            evidence={"cgroup_cpu_limit_cores": limit, "visible_cores": visible},
            command="cat /sys/fs/cgroup/cpu.max; nproc",
        )


@rule("host.cores-per-gpu", Area.HOST, "Too few CPU cores per GPU")
def cores_per_gpu(audit: Audit) -> Iterator[Finding]:
    host, n = audit.snapshot.host, len(audit.gpus)
    candidates = [c for c in (host.cgroup_cpu_limit_cores, host.process_cpu_count, host.cpu_logical_cores) if c]
    if not n or not candidates:
        return
    cores = min(candidates)
    if cores / n < MIN_CORES_PER_GPU:
        yield Finding(
            Severity.WARN,
            f"{cores:g} usable CPU cores for {n} GPU(s): {cores / n:.1f} per GPU",
            cost="Decoding, augmentation and the training loop itself compete for cores: input-bound steps.",
            fix=f"Aim for at least {MIN_CORES_PER_GPU}-8 cores per GPU; move preprocessing offline or onto the GPU.",
            evidence={"usable_cores": cores, "gpus": n},
            command="nproc; nvidia-smi -L",
        )


@rule("host.memory-vs-gpu", Area.HOST, "Host memory (or its cgroup limit) smaller than total GPU memory")
def memory_vs_gpu(audit: Audit) -> Iterator[Finding]:
    host = audit.snapshot.host
    gpu_total = sum(g.memory_total_bytes or 0 for g in audit.gpus)
    limits = [m for m in (host.cgroup_memory_limit_bytes, host.memory_total_bytes) if m]
    if not gpu_total or not limits or min(limits) >= gpu_total:
        return
    usable = min(limits)
    limited_by = "cgroup limit" if usable == host.cgroup_memory_limit_bytes else "RAM"
    yield Finding(
        Severity.WARN,
        f"Host memory ({limited_by}) {fmt_bytes(usable)} is less than GPU memory {fmt_bytes(gpu_total)}",
        cost="Loading or saving a checkpoint that fills the GPUs goes through host RAM: the job is OOM-killed; "
        "pinned buffers and DataLoader workers compete for what is left.",
        fix="Load checkpoints sharded or with mmap (torch.load(mmap=True)), or ask for more memory.",
        evidence={"usable_host_bytes": usable, "gpu_total_bytes": gpu_total},
        command="free -g; cat /sys/fs/cgroup/memory.max",
    )


@rule("host.numa-balancing", Area.HOST, "Automatic NUMA balancing on a multi-socket server")
def numa_balancing(audit: Audit) -> Iterator[Finding]:
    host = audit.snapshot.host
    if host.numa_balancing and len(host.numa_nodes or []) > 1:
        yield Finding(
            Severity.INFO,
            f"kernel.numa_balancing=1 on {len(host.numa_nodes or [])} NUMA nodes",
            cost="The kernel migrates pages of running processes between nodes: periodic stalls; "
            "recommended off on AMD MI300X servers.",
            fix="sysctl -w kernel.numa_balancing=0; pin ranks to their GPU's NUMA node.",
            evidence={"numa_nodes": len(host.numa_nodes or [])},
            command="sysctl kernel.numa_balancing; numactl -H",
        )


@rule("host.gpu-nic-numa", Area.HOST, "GPUs on a NUMA node without a local active RDMA NIC")
def gpu_nic_numa(audit: Audit) -> Iterator[Finding]:
    nic_nodes = {
        p.numa_node for p in audit.snapshot.network.ib_ports if p.state == "ACTIVE" and p.numa_node is not None
    }
    if not nic_nodes:
        return
    far = [g for g in audit.gpus if g.numa_node is not None and g.numa_node not in nic_nodes]
    if far:
        far_nodes = sorted({g.numa_node for g in far if g.numa_node is not None})
        yield Finding(
            Severity.INFO,
            f"GPUs on NUMA node(s) {far_nodes} have no active RDMA NIC on their node",
            subject=gpu_subject(far),
            cost="Their inter-node traffic crosses the CPU socket link to reach a NIC: lower GPUDirect RDMA bandwidth.",
            fix="Expected on servers with NICs on one socket; otherwise check NIC placement and cabling.",
            evidence={"gpu_numa": {g.index: g.numa_node for g in far}, "nic_numa": sorted(nic_nodes)},
            command="nvidia-smi topo -m",
        )


@rule("host.iommu", Area.HOST, "IOMMU translating DMA on a multi-GPU server")
def iommu(audit: Audit) -> Iterator[Finding]:
    host = audit.snapshot.host
    if len(audit.gpus) < 2:
        return
    if host.iommu_mode is not None:
        translated = host.iommu_mode == "translated"
    else:  # no /sys/kernel/iommu_groups reading: judge by the boot options
        args = (host.kernel_cmdline or "").split()
        passthrough = "iommu=pt" in args or "iommu.passthrough=1" in args
        translated = "intel_iommu=on" in args and not passthrough
    if translated:
        yield Finding(
            Severity.WARN,
            "IOMMU translates device DMA (not in passthrough)",
            cost="Every GPU-to-GPU and NIC-to-GPU transfer goes through address translation: P2P is slow "
            "or fails, NCCL hangs are common.",
            fix="Add iommu=pt to the kernel command line (or disable the IOMMU) and reboot.",
            evidence={"iommu_mode": host.iommu_mode, "kernel_cmdline": host.kernel_cmdline},
            command="cat /sys/kernel/iommu_groups/*/type | sort | uniq -c; cat /proc/cmdline",
        )


@rule("host.cpu-busy", Area.HOST, "Other processes keep the CPUs busy")
def cpu_busy(audit: Audit) -> Iterator[Finding]:
    busy = audit.snapshot.host.cpu_busy
    if busy is None or not busy.busy:
        return
    threads = max(1, int(busy.usable_cores - min(busy.others_cores, busy.usable_cores)))
    yield Finding(
        Severity.WARN,
        f"Other processes used {busy.others_cores:.1f} of {busy.cpus} CPUs over {busy.sample_s:.1f} s: "
        f"{busy.taken_ratio:.0%} of the {busy.usable_cores:g} cores a job here may use",
        cost="A job gets the CPU time they leave: its threads queue behind theirs, and torch's default of a "
        "thread per core makes it worse (on 2 busy cores a training step took 7.6x longer with the default "
        "threads than with one). `redline bench` figures taken now understate this machine.",
        fix=f"Run with fewer threads (`redline run --cpu-threads {threads}`, OMP_NUM_THREADS={threads}), wait for "
        "the busiest processes listed to finish, or use another machine; save bench results once it is idle.",
        evidence={
            "others_cores": busy.others_cores,
            "cpus": busy.cpus,
            "usable_cores": busy.usable_cores,
            "load_1m": busy.load_1m,
            "sample_s": busy.sample_s,
            # none listed: the busy processes live outside this PID namespace (other containers on the host)
            "busiest": [f"{p.pid} {p.name or '?'} ({p.user or '?'}) {p.cpu_cores:g} cores" for p in busy.top]
            or ["none visible from here: processes of other containers or of the host"],
        },
        command="ps -eo pid,user,comm,%cpu --sort=-%cpu | head",
    )


@rule("host.bench-on-busy-host", Area.HOST, "Saved bench figures were measured while the host was busy")
def bench_on_busy_host(audit: Audit) -> Iterator[Finding]:
    marked = [m for m in audit.bench.measurements if m.busy_host] if audit.bench else []
    if marked:
        names = sorted({f"{m.suite} {m.name}" for m in marked})
        command = rerun_command(marked)  # these suites only, with the --path/--dataset they were measured at
        figures = "1 saved bench figure was" if len(marked) == 1 else f"{len(marked)} saved bench figures were"
        yield Finding(
            Severity.INFO,
            f"{figures} measured while other processes kept the CPUs busy",
            cost="They understate this machine: the doctor's verdicts on them and the planner's ceilings from them "
            "are too pessimistic.",
            fix=f"Measure them again once the host is idle (`redline doctor` stops reporting host.cpu-busy): "
            f"`{command}`; the new figures replace these.",
            evidence={"figures": names, "while": sorted({str(m.extra["host_cpu"].get("summary")) for m in marked})},
            command=command,
        )
