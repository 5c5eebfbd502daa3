"""Network interfaces, InfiniBand/RoCE ports and the TCP settings that cap multi-node training.

Everything is read from /sys/class/net, /sys/class/infiniband and /proc/sys/net through the ``SysFs``
passed in. A down link cannot report its speed (the read fails with EINVAL): that is ``None``.
"""

from __future__ import annotations

from redline.hw.snapshot import IbPort, NetInterface, NetworkInfo, TcpSettings
from redline.hw.sysfs import SysFs

# ethtool's SPEED_UNKNOWN is -1; a few drivers print it unsigned.
_SPEED_UNKNOWN = (-1, 0xFFFFFFFF)


def probe_network(fs: SysFs) -> NetworkInfo:
    """Every network interface, every InfiniBand (or RoCE) port, and the kernel's TCP tuning."""
    return NetworkInfo(
        interfaces=[_interface(fs, name) for name in fs.listdir("/sys/class/net")],
        ib_ports=[
            _ib_port(fs, device, port)
            for device in fs.listdir("/sys/class/infiniband")
            for port in _port_numbers(fs, device)
        ],
        tcp=_tcp_settings(fs),
    )


# ---------------------------------------------------------------------------------- interfaces


def _interface(fs: SysFs, name: str) -> NetInterface:
    base = f"/sys/class/net/{name}"
    return NetInterface(
        name=name,
        kind=_interface_kind(fs, name),
        operstate=fs.read(f"{base}/operstate") or None,
        speed_mbps=_speed_mbps(fs, f"{base}/speed"),
        mtu=fs.read_int(f"{base}/mtu"),
        numa_node=_numa_node(fs, f"{base}/device/numa_node"),
        driver=fs.link_name(f"{base}/device/driver"),
    )


def _interface_kind(fs: SysFs, name: str) -> str:
    """loopback | virtual | physical. Only real hardware has a 'device' link (veth, bridges, docker0,
    tun and bonds do not), so the absence of one marks a software interface."""
    if name == "lo":
        return "loopback"
    return "physical" if fs.exists(f"/sys/class/net/{name}/device") else "virtual"


def _speed_mbps(fs: SysFs, path: str) -> int | None:
    """Link speed in Mb/s; None for unknown (-1), a down link (EINVAL) or garbage (noted by SysFs)."""
    speed = fs.read_int(path)
    return None if speed is None or speed <= 0 or speed in _SPEED_UNKNOWN else speed


def _numa_node(fs: SysFs, path: str) -> int | None:
    """The device's NUMA node; -1 means the platform did not say (single-socket boxes, most VMs)."""
    node = fs.read_int(path)
    return None if node is None or node < 0 else node


# -------------------------------------------------------------------------------- InfiniBand


def _port_numbers(fs: SysFs, device: str) -> list[int]:
    ports = fs.listdir(f"/sys/class/infiniband/{device}/ports")
    return sorted(int(port) for port in ports if port.isdigit())


def _ib_port(fs: SysFs, device: str, port: int) -> IbPort:
    base = f"/sys/class/infiniband/{device}/ports/{port}"
    link_layer = fs.read(f"{base}/link_layer") or None
    return IbPort(
        device=device,
        port=port,
        state=_after_colon(fs.read(f"{base}/state")),
        phys_state=_after_colon(fs.read(f"{base}/phys_state")),
        rate_gbps=fs.read_float(f"{base}/rate"),  # '400 Gb/sec (4X NDR)'
        link_layer=link_layer,
        numa_node=_numa_node(fs, f"/sys/class/infiniband/{device}/device/numa_node"),
        netdev=_roce_netdev(fs, device) if link_layer == "Ethernet" else None,
    )


def _after_colon(text: str | None) -> str | None:
    """'4: ACTIVE' -> 'ACTIVE', '5: LinkUp' -> 'LinkUp' (the number is the same state, as an enum)."""
    if not text:
        return None
    return text.partition(":")[2].strip() or text


def _roce_netdev(fs: SysFs, device: str) -> str | None:
    """The Ethernet interface behind a RoCE port, so its MTU and speed can be checked too."""
    names = fs.listdir(f"/sys/class/infiniband/{device}/device/net")
    return names[0] if names else None


# ---------------------------------------------------------------------------------------- TCP


def _tcp_settings(fs: SysFs) -> TcpSettings:
    """Congestion control, socket buffer ceilings and the rest of what caps one TCP stream's throughput
    (NCCL's socket transport, checkpoint uploads, dataset downloads)."""
    available = fs.read("/proc/sys/net/ipv4/tcp_available_congestion_control")
    return TcpSettings(
        congestion_control=fs.read("/proc/sys/net/ipv4/tcp_congestion_control") or None,
        available_congestion_control=available.split() if available is not None else None,
        rmem_max_bytes=fs.read_int("/proc/sys/net/core/rmem_max"),
        wmem_max_bytes=fs.read_int("/proc/sys/net/core/wmem_max"),
        tcp_rmem_max_bytes=_third_field(fs, "/proc/sys/net/ipv4/tcp_rmem"),
        tcp_wmem_max_bytes=_third_field(fs, "/proc/sys/net/ipv4/tcp_wmem"),
        window_scaling=_flag(fs, "/proc/sys/net/ipv4/tcp_window_scaling"),
        slow_start_after_idle=_flag(fs, "/proc/sys/net/ipv4/tcp_slow_start_after_idle"),
        default_qdisc=fs.read("/proc/sys/net/core/default_qdisc") or None,
    )


def _third_field(fs: SysFs, path: str) -> int | None:
    """The autotuning ceiling: tcp_rmem and tcp_wmem read 'min default max'."""
    fields = (fs.read(path) or "").split()
    if len(fields) != 3:
        if fields:
            fs.errors.append(f"{path}: {' '.join(fields)[:40]!r} is not 'min default max'")
        return None
    try:
        return int(fields[2])
    except ValueError:
        fs.errors.append(f"{path}: {fields[2][:40]!r} is not a number")
        return None


def _flag(fs: SysFs, path: str) -> bool | None:
    value = fs.read_int(path)
    return None if value is None else value != 0
