"""A short description of the server, shared by the terminal and HTML reports and --json."""

from __future__ import annotations

from collections import Counter
from typing import Any

from redline.hw.snapshot import Snapshot
from redline.units import fmt_bytes


def server_summary(snapshot: Snapshot) -> dict[str, Any]:
    """Label -> value, in display order; values are short strings, 'n/a' where unknown."""
    host, gpu, sw = snapshot.host, snapshot.gpu, snapshot.software
    models = Counter(g.name or "unknown" for g in gpu.gpus)
    if gpu.gpus:
        gpus = ", ".join(f"{n} x {name}" for name, n in models.items())
        gpus += f" ({fmt_bytes(gpu.gpus[0].memory_total_bytes)} each)"
    else:
        gpus = f"none ({gpu.error})" if gpu.error else "none"
    ib = Counter(
        f"{p.rate_gbps:g} Gb/s {'RoCE' if p.link_layer == 'Ethernet' else 'InfiniBand'}"
        for p in snapshot.network.ib_ports
        if p.state == "ACTIVE" and p.rate_gbps
    )
    # IPoIB netdevs (ib0, ibp12s0) and RoCE netdevs are the RDMA ports above, not extra NICs
    rdma_netdevs = {p.netdev for p in snapshot.network.ib_ports if p.netdev}
    nics = Counter(
        f"{i.speed_mbps / 1000:g} Gb/s Ethernet"
        for i in snapshot.network.interfaces
        if i.kind == "physical"
        and i.speed_mbps
        and i.operstate == "up"
        and not i.name.startswith("ib")
        and i.name not in rdma_netdevs
    )
    network = ", ".join(f"{n} x {what}" for what, n in (ib + nics).most_common())
    torch = sw.torch
    torch_text = "not installed"
    if torch:
        torch_text = torch.version + (f" (CUDA {torch.cuda})" if torch.cuda else " (CPU build)")
    cores = host.cpu_logical_cores
    summary = {
        "host": host.hostname or "n/a",
        "taken": snapshot.taken_at or "n/a",
        "gpus": gpus,
        "driver": f"{gpu.driver_version or 'n/a'} (CUDA {gpu.cuda_driver_version or 'n/a'})",
        "cpu": f"{host.cpu_model or 'n/a'}, {cores if cores is not None else 'n/a'} logical cores",
        "memory": f"{fmt_bytes(host.memory_total_bytes)} RAM, {fmt_bytes(host.shm_total_bytes)} /dev/shm",
        "network": network or "n/a",
        "os": f"{host.os_name or 'n/a'}, kernel {host.kernel or 'n/a'}",
        "python": sw.python or "n/a",
        "torch": torch_text,
    }
    if host.cpu_busy is not None:  # a live probe's sample: what other processes took of our CPUs meanwhile
        busy = host.cpu_busy
        load = f", load {busy.load_1m:.1f}" if busy.load_1m is not None else ""
        summary["cpu use"] = f"others {busy.others_cores:.1f} of {busy.cpus} CPUs over {busy.sample_s:.1f} s{load}" + (
            " (busy)" if busy.busy else ""
        )
    return summary
