"""Option values that several commands take, parsed one way: where to listen, which port."""

from __future__ import annotations

import ipaddress

from redline.errors import BadInput

EVERY_INTERFACE = "0.0.0.0"
LISTEN_HELP = "an IP address of this machine, 'localhost', or 'all' (every IPv4 interface; '::' for IPv6 too)"


def listen_address(option: str, value: str) -> str:
    """The address to bind for ``value``: an IP literal, 'localhost' or 'all'.

    Nothing else: socket libraries read '0', '', '*' or a hostname as "every interface" or resolve it in ways
    nobody meant, and a server that exposes a machine's telemetry must only do so when asked in plain words.
    """
    text = value.strip()
    if text == "all":
        return EVERY_INTERFACE
    if text == "localhost":
        return "127.0.0.1"
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        raise BadInput(f"{option} takes {LISTEN_HELP}, not {value!r}") from None


def tcp_port(option: str, value: int, *, allow_zero: bool = False) -> int:
    """A TCP port number, 1-65535 (0 too where the system may pick one)."""
    low = 0 if allow_zero else 1
    if not low <= value <= 65535:
        raise BadInput(f"{option} {value} is not a TCP port ({low}-65535)")
    return value
