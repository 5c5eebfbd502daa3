"""Can data and gradients cross the network fast? NICs, InfiniBand/RoCE, NCCL transports, TCP on long links."""

from __future__ import annotations

from collections.abc import Iterator

from redline.doctor.context import Audit
from redline.doctor.engine import rule
from redline.doctor.model import Area, Finding, Severity
from redline.units import MiB

# Our users sit 150-250 ms from their data. One TCP stream carries at most window/RTT, so filling a
# 1 Gbit/s link at 200 ms needs a 25 MB window (the bandwidth-delay product).
LONG_RTT_S = 0.200
TARGET_LINK_BPS = 1e9
BDP_BYTES = int(TARGET_LINK_BPS / 8 * LONG_RTT_S)
RECOMMENDED_TCP_BUFFER_BYTES = 64 * MiB
SLOW_NIC_MBPS = 10_000
MODEST_NIC_MBPS = 25_000
TRANSPORT_KILLERS = {
    "NCCL_P2P_DISABLE": ("1", "GPU-to-GPU copies over NVLink/PCIe P2P are off"),
    "NCCL_SHM_DISABLE": ("1", "shared-memory transport between local GPUs is off"),
    "NCCL_P2P_LEVEL": ("LOC", "P2P is only allowed on the same GPU, i.e. never"),
}


def _fmt_mbps(bits_per_s: float) -> str:
    return f"{bits_per_s / 1e6:,.0f} Mbit/s"


@rule("network.slow-nic", Area.NETWORK, "Fastest network interface is slow for multi-node training or data")
def slow_nic(audit: Audit) -> Iterator[Finding]:
    if audit.ib_active:
        return
    up = [i for i in audit.snapshot.network.interfaces if i.kind == "physical" and i.operstate == "up" and i.speed_mbps]
    if not up:
        return
    fastest = max(up, key=lambda i: i.speed_mbps or 0)
    speed = fastest.speed_mbps or 0
    if speed >= MODEST_NIC_MBPS:
        return
    yield Finding(
        Severity.WARN if speed < SLOW_NIC_MBPS else Severity.INFO,
        f"Fastest NIC is {fastest.name} at {speed / 1000:g} Gbit/s, and there is no InfiniBand/RoCE",
        subject=fastest.name,
        cost="Multi-node all-reduce and remote data loading are capped by this link "
        "(a 7B-parameter bf16 gradient all-reduce moves ~28 GB per step per node).",
        fix="For multi-node training pick instances with 100+ Gbit/s networking (EFA, InfiniBand, RoCE); "
        "keep training within one node if you can.",
        evidence={i.name: i.speed_mbps for i in up},
        command=f"ethtool {fastest.name} | grep Speed",
    )


@rule("network.ib-port-down", Area.NETWORK, "InfiniBand/RoCE port cabled but without link")
def ib_port_down(audit: Audit) -> Iterator[Finding]:
    ports = [p for p in audit.snapshot.network.ib_ports if p.state and p.state != "ACTIVE"]
    # Polling: the port is enabled and looking for a peer (cable in, no link, or no subnet manager);
    # a Disabled/Sleep port is usually just not cabled, like the spare port of a dual-port NIC
    searching = [p for p in ports if p.phys_state in ("Polling", "LinkErrorRecovery") or p.state == "INIT"]
    idle = [p for p in ports if p not in searching]
    for severity, group, title, fix in (
        (
            Severity.WARN,
            searching,
            "without link",
            "Check the cable and switch port, and that a subnet manager "
            "runs (opensm or the switch's); state INIT means links are up but no subnet manager configured them.",
        ),
        (Severity.INFO, idle, "down (not cabled?)", "Nothing, if these ports are not meant to be cabled."),
    ):
        if group:
            yield Finding(
                severity,
                f"{len(group)} InfiniBand/RoCE port(s) {title}: " + ", ".join(f"{p.device}/{p.port}" for p in group),
                cost="NCCL uses only active ports: fewer rails, or TCP sockets instead of RDMA.",
                fix=fix,
                evidence={f"{p.device}/{p.port}": {"state": p.state, "phys_state": p.phys_state} for p in group},
                command="ibstat",
            )


@rule("network.ib-disabled", Area.NETWORK, "InfiniBand/RoCE is up but NCCL is told not to use it")
def ib_disabled(audit: Audit) -> Iterator[Finding]:
    if not audit.ib_active:
        return
    env = audit.env
    reasons = {}
    if env.get("NCCL_IB_DISABLE") == "1":
        reasons["NCCL_IB_DISABLE"] = "1"
    if env.get("NCCL_NET", "").lower() == "socket":
        reasons["NCCL_NET"] = env["NCCL_NET"]
    if reasons:
        rates = [p.rate_gbps for p in audit.snapshot.network.ib_ports if p.state == "ACTIVE" and p.rate_gbps]
        yield Finding(
            Severity.FAIL,
            "InfiniBand/RoCE is active but NCCL is forced onto TCP sockets",
            cost=f"Inter-node collectives run over sockets instead of {sum(rates):g} Gbit/s of RDMA.",
            fix="Unset " + " and ".join(reasons) + " (seen in the environment redline ran in; check your job's too).",
            evidence={"env": reasons, "active_ports": len(rates), "rate_gbps": rates},
            command="NCCL_DEBUG=INFO torchrun ... 2>&1 | grep 'NET/'",
        )


@rule("network.nccl-env", Area.NETWORK, "NCCL environment variables that cripple its transports")
def nccl_env(audit: Audit) -> Iterator[Finding]:
    env = audit.env
    bad = {name: why for name, (value, why) in TRANSPORT_KILLERS.items() if env.get(name, "").upper() == value}
    ifname = env.get("NCCL_SOCKET_IFNAME", "")
    # "^lo,docker" excludes them (the recommended setting); "lo" or "=docker0" selects them
    names = [n for n in ifname.lstrip("=").split(",") if n]
    if names and not ifname.startswith("^") and all(n.startswith(("lo", "docker")) for n in names):
        bad["NCCL_SOCKET_IFNAME"] = f"'{ifname}' selects a loopback/bridge interface, not the real network"
    if bad:
        yield Finding(
            Severity.WARN,
            "NCCL transport disabled by environment: " + ", ".join(f"{k}={env[k]}" for k in bad),
            cost="; ".join(bad.values()) + ": collectives fall back to slower paths.",
            fix="Unset these unless you are working around a known hang; NCCL picks the fastest path itself. "
            "(Seen in the environment redline ran in: check your job's environment too.)",
            evidence={k: env[k] for k in bad},
            command="env | grep ^NCCL_",
        )


@rule("network.roce-mtu", Area.NETWORK, "RoCE interface with a 1500-byte MTU")
def roce_mtu(audit: Audit) -> Iterator[Finding]:
    mtus = {i.name: i.mtu for i in audit.snapshot.network.interfaces}
    small = {
        p.netdev: mtus[p.netdev]
        for p in audit.snapshot.network.ib_ports
        if p.link_layer == "Ethernet" and p.netdev in mtus and (mtus[p.netdev] or 0) <= 1500
    }
    if small:
        yield Finding(
            Severity.WARN,
            "RoCE on interfaces with MTU 1500: " + ", ".join(small),
            cost="RDMA messages are cut into 1 KB packets: lower throughput and more CPU/NIC overhead.",
            fix="Use jumbo frames end to end (ip link set DEV mtu 9000, and on the switch).",
            evidence=small,
            command="ip link show",
        )


@rule("network.tcp-buffers", Area.NETWORK, "TCP buffer ceilings too small for a long, fast link")
def tcp_buffers(audit: Audit) -> Iterator[Finding]:
    tcp = audit.snapshot.network.tcp
    ceilings = {
        "net.ipv4.tcp_rmem (max)": tcp.tcp_rmem_max_bytes,
        "net.ipv4.tcp_wmem (max)": tcp.tcp_wmem_max_bytes,
    }
    small = {k: v for k, v in ceilings.items() if v is not None and v < BDP_BYTES}
    if not small:
        return
    window = min(small.values())
    yield Finding(
        Severity.WARN,
        f"TCP window capped at {window / MiB:.0f} MiB: one stream carries at most "
        f"{_fmt_mbps(window * 8 / LONG_RTT_S)} at {LONG_RTT_S * 1000:.0f} ms RTT",
        cost=f"Filling a 1 Gbit/s link at {LONG_RTT_S * 1000:.0f} ms needs a {BDP_BYTES / 1e6:.0f} MB window "
        "(bandwidth x delay); downloads of data and checkpoints from far away crawl.",
        fix=f"sysctl -w net.core.rmem_max={RECOMMENDED_TCP_BUFFER_BYTES} net.core.wmem_max="
        f"{RECOMMENDED_TCP_BUFFER_BYTES} net.ipv4.tcp_rmem='4096 131072 {RECOMMENDED_TCP_BUFFER_BYTES}' "
        f"net.ipv4.tcp_wmem='4096 65536 {RECOMMENDED_TCP_BUFFER_BYTES}'; or use many parallel streams.",
        evidence={**small, "bdp_bytes_1gbit_200ms": BDP_BYTES, "net.core.rmem_max": tcp.rmem_max_bytes},
        command="sysctl net.ipv4.tcp_rmem net.ipv4.tcp_wmem net.core.rmem_max net.core.wmem_max",
    )


@rule("network.congestion-control", Area.NETWORK, "Loss-based TCP congestion control on long links")
def congestion_control(audit: Audit) -> Iterator[Finding]:
    tcp = audit.snapshot.network.tcp
    if not tcp.congestion_control or tcp.congestion_control == "bbr":
        return
    has_bbr = "bbr" in (tcp.available_congestion_control or [])
    yield Finding(
        Severity.INFO,
        f"TCP congestion control is {tcp.congestion_control}: it backs off on every loss",
        cost="On a 200 ms link with 0.1% loss a loss-based stream is limited to about MSS/RTT x 1.22/sqrt(p) "
        "~ 2 Mbit/s (Mathis et al.); BBR paces by measured bandwidth and keeps the link full.",
        fix=(
            "sysctl -w net.core.default_qdisc=fq net.ipv4.tcp_congestion_control=bbr"
            if has_bbr
            else "modprobe tcp_bbr, then sysctl -w net.ipv4.tcp_congestion_control=bbr"
        )
        + "; or use many parallel streams for transfers.",
        evidence={"congestion_control": tcp.congestion_control, "available": tcp.available_congestion_control},
        command="sysctl net.ipv4.tcp_congestion_control net.ipv4.tcp_available_congestion_control",
    )


@rule("network.slow-start-after-idle", Area.NETWORK, "TCP restarts slow start after every idle pause")
def slow_start_after_idle(audit: Audit) -> Iterator[Finding]:
    if audit.snapshot.network.tcp.slow_start_after_idle:
        yield Finding(
            Severity.INFO,
            "tcp_slow_start_after_idle=1: connections fall back to a small window after each pause",
            cost="Bursty transfers on long links (checkpoint uploads, sharded data fetches) restart from a "
            "small window each time: many round trips of 200 ms before full speed.",
            fix="sysctl -w net.ipv4.tcp_slow_start_after_idle=0",
            evidence={"tcp_slow_start_after_idle": 1},
            command="sysctl net.ipv4.tcp_slow_start_after_idle",
        )
