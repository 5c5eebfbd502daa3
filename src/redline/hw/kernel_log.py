"""NVRM Xid events from the kernel log: the driver's record of what went wrong on a GPU.

NVML has no call for past Xids, yet they are the first thing to look at on a GPU server that misbehaves:
the driver writes one line per event, e.g.

    NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.

Some codes mean the application crashed the GPU (13, 31, 43), others mean the hardware needs attention
(``CRITICAL_XIDS``). The kernel ring buffer is finite, so counts cover only what it still holds.
"""

from __future__ import annotations

import re
import subprocess
from collections import Counter
from collections.abc import Iterator

XID_MEANINGS: dict[int, str] = {
    13: "graphics engine exception (usually the application)",
    31: "GPU memory page fault (usually the application)",
    43: "GPU stopped processing (usually the application)",
    48: "double-bit ECC error",
    63: "row remapping event (ECC page retirement recorded)",
    64: "row remapping failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
}

# codes that point at the hardware (or its firmware) rather than the application: drain and inspect
CRITICAL_XIDS: frozenset[int] = frozenset({48, 63, 64, 74, 79, 92, 94, 95, 119, 120})

# "NVRM: Xid (PCI:0000:3b:00): 79, ..."; old drivers omit "PCI:". NVSwitch errors are "SXid" and are not
# GPU Xids, hence the "NVRM: " anchor.
_XID_LINE = re.compile(r"NVRM: Xid \((?:PCI:)?(?P<pci>[0-9a-fA-F:.]+)\):\s*(?P<code>\d+)")


def iter_xids(text: str) -> Iterator[tuple[str, int]]:
    """(PCI address as the driver wrote it, lower-cased; Xid code) for each Xid line, in log order."""
    for match in _XID_LINE.finditer(text):
        yield match["pci"].lower(), int(match["code"])


def count_xids(text: str) -> dict[str, int]:
    """How many times each Xid code appears; keys are strings so the result is JSON as it stands."""
    return _by_code(Counter(str(code) for _, code in iter_xids(text)))


def count_xids_by_device(text: str) -> dict[str, dict[str, int]]:
    """The same counts per GPU: PCI address as the Xid line gives it ('0000:3b:00') -> code -> count.

    An Xid 79 on one GPU of eight means "drain that GPU", not "drain the server"; the address joins with
    ``Gpu.pci_bus_id`` by prefix (the line leaves out the function, '.0').
    """
    by_device: dict[str, Counter[str]] = {}
    for pci, code in iter_xids(text):
        by_device.setdefault(pci, Counter())[str(code)] += 1
    return {pci: _by_code(counts) for pci, counts in sorted(by_device.items())}


def device_xids(pci_bus_id: str, by_device: dict[str, dict[str, int]]) -> dict[str, int]:
    """One GPU's Xid counts (code -> count) from ``count_xids_by_device``'s, the GPU named by its Linux PCI
    address ('0000:3b:00.0'): the log names a device without its function ('0000:3b:00'; NVML's long domain,
    '00000000:3b:00', on some drivers), old drivers without the domain either ('3b:00')."""
    device = pci_bus_id.lower().rpartition(".")[0] or pci_bus_id.lower()  # '0000:3b:00'
    without_domain = device.partition(":")[2]
    found: Counter[str] = Counter()
    for pci, counts in by_device.items():
        domain, _, rest = pci.partition(":")
        key = f"{int(domain, 16):04x}:{rest}" if pci.count(":") == 2 and domain else pci
        if key in (device, without_domain):
            found.update(counts)
    return _by_code(found)


def _by_code(counts: Counter[str]) -> dict[str, int]:
    """Codes in numeric order ('13' before '119'), as a plain dict."""
    return dict(sorted(counts.items(), key=lambda item: int(item[0])))


def read_kernel_log(timeout_s: float = 5) -> str | None:
    """The kernel ring buffer as ``dmesg`` prints it; None where it cannot be read.

    Unprivileged users are refused where kernel.dmesg_restrict=1 (the default on many distributions),
    and minimal containers have no dmesg at all: both read as "not available", not as an error.
    """
    try:
        result = subprocess.run(["dmesg"], capture_output=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.SubprocessError):  # missing binary, not executable, timed out
        return None
    if result.returncode != 0:
        return None
    return result.stdout.decode("utf-8", errors="replace")
