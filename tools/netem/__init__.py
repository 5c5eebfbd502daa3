"""Emulated links for testing what a slow, lossy, far-away network does to redline (and to its peers).

``EmulatedLink`` builds a link between two network namespaces (200 ms RTT, 0.1% loss, 100 Mbit/s by
default) with the kernel's netem where it exists and a user-space TUN forwarder where it does not.
``PYTHONPATH=tools python -m netem --rtt-ms 200 --loss 0.001 --rate-mbit 100`` holds one open until Ctrl-C.
"""

from netem.link import A_ADDR, B_ADDR, EmulatedLink, LinkSpec, LinkUnavailable, unavailable_reason

__all__ = ["A_ADDR", "B_ADDR", "EmulatedLink", "LinkSpec", "LinkUnavailable", "unavailable_reason"]
