"""What the kernel knows about a TCP sender: retransmits, RTT, and what limited it (Linux TCP_INFO).

Offsets are those of ``struct tcp_info`` in include/uapi/linux/tcp.h; the fields after tcpi_total_retrans
arrived over the years (busy/rwnd/sndbuf-limited times in Linux 4.10, bytes_sent in 4.19), so each is read
only when the kernel's answer is long enough. ``ss -ti`` prints the same counters.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import asdict, dataclass

# (name, struct format, byte offset) in struct tcp_info
_FIELDS = (
    ("snd_mss", "I", 16),
    ("rtt_us", "I", 68),  # smoothed RTT
    ("snd_cwnd", "I", 80),  # segments
    ("total_retrans", "I", 100),  # segments retransmitted over the connection's life
    ("min_rtt_us", "I", 148),
    ("data_segs_out", "I", 156),
    ("busy_us", "Q", 168),  # time with data in flight
    ("rwnd_limited_us", "Q", 176),  # ...of which stalled by the receiver's window
    ("sndbuf_limited_us", "Q", 184),  # ...of which stalled by our send buffer
    ("bytes_sent", "Q", 200),
)
_READ_BYTES = 232


@dataclass
class SenderStats:
    """TCP_INFO of a test's sending sockets, summed (counters) or combined (RTTs) over its streams. The
    counters cover each connection's whole life, warm-up included; the RTTs are the values at the end."""

    congestion_control: str | None = None
    streams: int = 0
    retransmits: int = 0
    data_segs_out: int = 0
    busy_us: int = 0
    rwnd_limited_us: int = 0
    sndbuf_limited_us: int = 0
    srtt_ms_mean: float | None = None
    min_rtt_ms: float | None = None

    @property
    def retransmit_ratio(self) -> float | None:
        """Retransmitted / sent data segments: the loss TCP saw, random plus what queues dropped."""
        return self.retransmits / self.data_segs_out if self.data_segs_out else None

    @property
    def rwnd_limited_share(self) -> float | None:
        """Share of the busy time the receiver's window (its tcp_rmem ceiling) held the sender back."""
        return self.rwnd_limited_us / self.busy_us if self.busy_us else None

    @property
    def sndbuf_limited_share(self) -> float | None:
        """Share of the busy time the sender's own buffer (its tcp_wmem ceiling) held it back."""
        return self.sndbuf_limited_us / self.busy_us if self.busy_us else None

    def to_dict(self) -> dict:
        return asdict(self) | {
            "retransmit_ratio": self.retransmit_ratio,
            "rwnd_limited_share": self.rwnd_limited_share,
            "sndbuf_limited_share": self.sndbuf_limited_share,
        }

    @classmethod
    def from_dict(cls, data: dict) -> SenderStats:
        names = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in names})


def read(sock: socket.socket) -> dict[str, int]:
    """The TCP_INFO fields this kernel reports, by name; empty where TCP_INFO is unavailable."""
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _READ_BYTES)
    except (OSError, AttributeError):
        return {}
    return {
        name: struct.unpack_from(fmt, raw, offset)[0]
        for name, fmt, offset in _FIELDS
        if offset + struct.calcsize(fmt) <= len(raw)
    }


def congestion_control(sock: socket.socket) -> str | None:
    try:
        return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\0").decode() or None
    except (OSError, AttributeError):
        return None


def sender_stats(socks: list[socket.socket]) -> SenderStats:
    infos = [read(s) for s in socks]
    rtts = [i["rtt_us"] for i in infos if i.get("rtt_us")]
    min_rtts = [i["min_rtt_us"] for i in infos if i.get("min_rtt_us")]
    return SenderStats(
        congestion_control=congestion_control(socks[0]) if socks else None,
        streams=len(socks),
        retransmits=sum(i.get("total_retrans", 0) for i in infos),
        data_segs_out=sum(i.get("data_segs_out", 0) for i in infos),
        busy_us=sum(i.get("busy_us", 0) for i in infos),
        rwnd_limited_us=sum(i.get("rwnd_limited_us", 0) for i in infos),
        sndbuf_limited_us=sum(i.get("sndbuf_limited_us", 0) for i in infos),
        srtt_ms_mean=sum(rtts) / len(rtts) / 1e3 if rtts else None,
        min_rtt_ms=min(min_rtts) / 1e3 if min_rtts else None,
    )
