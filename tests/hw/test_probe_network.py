"""probe_network against fake /sys/class/net, /sys/class/infiniband and /proc/sys/net, and this machine."""

from __future__ import annotations

from pathlib import Path

import pytest

from redline.hw.network import probe_network
from redline.hw.snapshot import IbPort, NetInterface
from redline.hw.sysfs import SysFs
from sysroot import SysRoot


@pytest.fixture
def root(tmp_path: Path) -> SysRoot:
    return SysRoot(tmp_path)


def by_name(interfaces: list[NetInterface]) -> dict[str, NetInterface]:
    return {interface.name: interface for interface in interfaces}


def test_interfaces(root: SysRoot) -> None:
    root.add_nic("ens1f0np0", speed=100000, mtu=9000, numa_node=1, driver="mlx5_core")
    root.add_nic("eno1", operstate="down", speed=None, numa_node=0, driver="ixgbe")
    root.unreadable("/sys/class/net/eno1/speed")  # a down link answers EINVAL
    root.add_nic("eno2", operstate="down", speed=-1, driver="igb")
    root.add_nic("veth1a2b3c", physical=False, speed=10000)
    root.add_nic("docker0", physical=False, operstate="down", speed=None)
    root.add_nic("lo", physical=False, operstate="unknown", speed=None, mtu=65536)

    fs = root.sysfs()
    nics = by_name(probe_network(fs).interfaces)

    assert sorted(nics) == ["docker0", "eno1", "eno2", "ens1f0np0", "lo", "veth1a2b3c"]
    assert nics["ens1f0np0"] == NetInterface(
        name="ens1f0np0",
        kind="physical",
        operstate="up",
        speed_mbps=100000,
        mtu=9000,
        numa_node=1,
        driver="mlx5_core",
    )
    assert (nics["eno1"].kind, nics["eno1"].operstate, nics["eno1"].speed_mbps) == ("physical", "down", None)
    assert (nics["eno1"].numa_node, nics["eno1"].driver) == (0, "ixgbe")
    assert (nics["eno2"].speed_mbps, nics["eno2"].numa_node) == (None, None)  # -1 and -1: unknown
    veth = nics["veth1a2b3c"]
    assert (veth.kind, veth.speed_mbps, veth.driver) == ("virtual", 10000, None)
    assert nics["docker0"].kind == "virtual"
    assert (nics["lo"].kind, nics["lo"].mtu) == ("loopback", 65536)
    assert fs.errors == []  # an unreadable or unknown speed is absence, not garbage


def test_garbage_speed_is_none_and_noted(root: SysRoot) -> None:
    root.add_nic("eth0", speed="fast")
    fs = root.sysfs()
    (nic,) = probe_network(fs).interfaces
    assert nic.speed_mbps is None
    assert fs.errors == ["/sys/class/net/eth0/speed: 'fast' is not a number"]


def test_ib_and_roce_ports(root: SysRoot) -> None:
    root.add_ib_port("mlx5_0", 1, rate="400 Gb/sec (4X NDR)", numa_node=0)
    root.add_ib_port(
        "mlx5_1",
        1,
        rate="200 Gb/sec (2X NDR)",
        link_layer="Ethernet",
        numa_node=1,
        netdev="ens2f0np0",
    )
    root.add_ib_port("mlx5_2", 1, state="1: DOWN", phys_state="3: Disabled", rate="10 Gb/sec (4X SDR)", numa_node=-1)

    ports = {port.device: port for port in probe_network(root.sysfs()).ib_ports}

    ib, roce, down = ports["mlx5_0"], ports["mlx5_1"], ports["mlx5_2"]
    assert ib == IbPort(
        device="mlx5_0",
        port=1,
        state="ACTIVE",
        phys_state="LinkUp",
        rate_gbps=400.0,
        link_layer="InfiniBand",
        numa_node=0,
        netdev=None,
    )
    assert (roce.link_layer, roce.netdev, roce.numa_node, roce.rate_gbps) == ("Ethernet", "ens2f0np0", 1, 200.0)
    assert (down.state, down.phys_state, down.numa_node) == ("DOWN", "Disabled", None)


def test_ports_sort_by_number(root: SysRoot) -> None:
    for port in (10, 2, 1):
        root.add_ib_port("qib0", port)
    assert [port.port for port in probe_network(root.sysfs()).ib_ports] == [1, 2, 10]


def test_tcp_settings(root: SysRoot) -> None:
    root.write("/proc/sys/net/ipv4/tcp_congestion_control", "cubic")
    root.write("/proc/sys/net/ipv4/tcp_available_congestion_control", "reno cubic bbr")
    root.write("/proc/sys/net/core/rmem_max", 212992)
    root.write("/proc/sys/net/core/wmem_max", 212992)
    root.write("/proc/sys/net/ipv4/tcp_rmem", "4096\t131072\t6291456")
    root.write("/proc/sys/net/ipv4/tcp_wmem", "4096\t16384\t4194304")
    root.write("/proc/sys/net/ipv4/tcp_window_scaling", 1)
    root.write("/proc/sys/net/ipv4/tcp_slow_start_after_idle", 0)
    root.write("/proc/sys/net/core/default_qdisc", "fq_codel")

    tcp = probe_network(root.sysfs()).tcp

    assert tcp.congestion_control == "cubic"
    assert tcp.available_congestion_control == ["reno", "cubic", "bbr"]
    assert (tcp.rmem_max_bytes, tcp.wmem_max_bytes) == (212992, 212992)
    assert (tcp.tcp_rmem_max_bytes, tcp.tcp_wmem_max_bytes) == (6291456, 4194304)
    assert (tcp.window_scaling, tcp.slow_start_after_idle) == (True, False)
    assert tcp.default_qdisc == "fq_codel"


def test_malformed_tcp_rmem_is_noted(root: SysRoot) -> None:
    root.write("/proc/sys/net/ipv4/tcp_rmem", "4096 131072")
    fs = root.sysfs()
    assert probe_network(fs).tcp.tcp_rmem_max_bytes is None
    assert len(fs.errors) == 1 and "tcp_rmem" in fs.errors[0]


def test_an_empty_tree(root: SysRoot) -> None:
    fs = root.sysfs()
    info = probe_network(fs)
    assert (info.interfaces, info.ib_ports) == ([], [])
    assert info.tcp.congestion_control is None and info.tcp.available_congestion_control is None
    assert fs.errors == []


def test_this_machine() -> None:
    fs = SysFs("/")
    info = probe_network(fs)
    nics = by_name(info.interfaces)
    assert nics["lo"].kind == "loopback"
    assert all(nic.speed_mbps is None or nic.speed_mbps > 0 for nic in info.interfaces)
    assert info.tcp.congestion_control is None or info.tcp.congestion_control in (
        info.tcp.available_congestion_control or [info.tcp.congestion_control]
    )
    assert fs.errors == []
