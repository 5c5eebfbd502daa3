"""Xid counting on real-looking kernel logs, and reading dmesg where it is missing, refused or hangs."""

from __future__ import annotations

from pathlib import Path

import pytest

from redline.hw.kernel_log import (
    CRITICAL_XIDS,
    XID_MEANINGS,
    count_xids,
    count_xids_by_device,
    iter_xids,
    read_kernel_log,
)

DMESG = """\
[    4.112233] nvidia: loading out-of-tree module taints kernel.
[    5.201120] NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024
[ 8123.456789] NVRM: Xid (PCI:0000:3b:00): 13, pid=48211, name=python3, Graphics Exception: ESR 0x514648=0x1
[ 9001.000001] NVRM: Xid (PCI:0000:3b:00): 31, pid=48211, name=python3, Ch 00000008, intr 10000000. MMU Fault
[12011.734001] NVRM: Xid (PCI:0000:5D:00): 48, pid='<unknown>', name=<unknown>, An uncorrectable double bit error
[12011.734100] NVRM: Xid (PCI:0000:5d:00): 94, pid=50123, name=torchrun, Contained: SM (0x1). RST: No, D-RST: No
[12011.734300] NVRM: Xid (PCI:0000:5d:00): 94, pid=50124, name=torchrun, Contained: SM (0x1). RST: No, D-RST: No
[13000.100000] NVRM: GPU at PCI:0000:9a:00: GPU-3c5e9b21-04d8-4f6a-b2c7-000000000004
[13000.100010] NVRM: GPU Board Serial Number: 1652922001234
[13000.100020] NVRM: Xid (PCI:0000:9a:00): 79, pid=0, name=swapper/0, GPU has fallen off the bus.
[13000.100030] NVRM: GPU 0000:9a:00.0: GPU has fallen off the bus.
[13500.000000] nvidia-nvswitch2: SXid (PCI:0000:07:00.0): 12028, Non-fatal, Link 36 egress non-posted PRIV error
[14000.000000] NVRM: Xid (0000:ab:00): 119, Timeout after 6s of waiting for RPC response from GPU0 GSP!
"""


def test_xid_codes_are_counted_and_nothing_else_is() -> None:
    assert count_xids(DMESG) == {"13": 1, "31": 1, "48": 1, "79": 1, "94": 2, "119": 1}


def test_each_xid_keeps_the_gpu_it_happened_on() -> None:
    events = list(iter_xids(DMESG))
    assert events[2:4] == [("0000:5d:00", 48), ("0000:5d:00", 94)]
    assert ("0000:9a:00", 79) in events
    assert events[-1] == ("0000:ab:00", 119)  # older drivers leave out "PCI:"


def test_xids_are_counted_per_gpu() -> None:
    """Keyed by the address as the line gives it, lower-cased: 0000:5D:00 and 0000:5d:00 are one GPU."""
    assert count_xids_by_device(DMESG) == {
        "0000:3b:00": {"13": 1, "31": 1},
        "0000:5d:00": {"48": 1, "94": 2},
        "0000:9a:00": {"79": 1},
        "0000:ab:00": {"119": 1},
    }


def test_per_gpu_codes_are_in_numeric_order() -> None:
    log = "NVRM: Xid (PCI:0000:3b:00): 119, x\nNVRM: Xid (PCI:0000:3b:00): 13, x\n"
    assert list(count_xids_by_device(log)["0000:3b:00"]) == ["13", "119"]


def test_a_quiet_log_has_no_xids() -> None:
    assert count_xids("") == {}
    assert count_xids_by_device("") == {}
    assert count_xids("[    5.2] NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.54.15\n") == {}


def test_every_critical_xid_has_a_meaning_and_the_application_ones_are_not_critical() -> None:
    assert set(XID_MEANINGS) >= CRITICAL_XIDS
    assert CRITICAL_XIDS.isdisjoint({13, 31, 43})
    assert "fallen off the bus" in XID_MEANINGS[79]


def _fake_dmesg(directory: Path, script: str) -> None:
    dmesg = directory / "dmesg"
    dmesg.write_text("#!/bin/sh\n" + script + "\n")
    dmesg.chmod(0o755)


def test_read_kernel_log_returns_what_dmesg_prints(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "log.txt").write_text(DMESG)
    _fake_dmesg(tmp_path, f"cat {tmp_path / 'log.txt'}")
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")  # ahead of the real dmesg; cat still found

    text = read_kernel_log()
    assert text == DMESG
    assert count_xids(text)["94"] == 2


def test_read_kernel_log_without_dmesg_is_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no dmesg anywhere
    assert read_kernel_log() is None


def test_read_kernel_log_refused_is_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # what dmesg does for a normal user under kernel.dmesg_restrict=1
    _fake_dmesg(tmp_path, "echo 'dmesg: read kernel buffer failed: Operation not permitted' >&2; exit 1")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert read_kernel_log() is None


def test_read_kernel_log_that_hangs_is_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_dmesg(tmp_path, "exec sleep 10")
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")  # sleep itself must still be found
    assert read_kernel_log(timeout_s=0.3) is None
