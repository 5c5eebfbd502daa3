"""A loopback TCP port nothing listens on, for servers and launchers the tests start."""

import socket


def free_port() -> int:
    """A port the kernel just handed out on 127.0.0.1 (free now; a server that loses a race retries)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
