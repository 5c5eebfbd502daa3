"""redline.files: what a user names is read only when it is a regular file, never past a cap, never blocking."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from redline.errors import BadInput
from redline.files import open_regular, read_user_bytes, read_user_file, refuse_non_regular


def refused(call, *args, **kwargs) -> str:
    """The one line ``call`` refuses with; run on a thread so that a call that blocks fails the test instead of
    hanging it."""
    outcome: list[BaseException | object] = []
    thread = threading.Thread(target=lambda: outcome.append(_catch(call, *args, **kwargs)), daemon=True)
    thread.start()
    thread.join(timeout=30)
    assert outcome, f"{call.__name__}{args} blocked"
    assert isinstance(outcome[0], BadInput), outcome[0]
    message = str(outcome[0])
    assert "\n" not in message
    return message


def _catch(call, *args, **kwargs):
    try:
        return call(*args, **kwargs)
    except BaseException as exc:
        return exc


def test_a_fifo_a_device_and_a_folder_are_refused_without_reading_them(tmp_path: Path) -> None:
    fifo = tmp_path / "plan.yaml"
    os.mkfifo(fifo)  # no writer ever comes: a plain open would block for good
    assert refused(read_user_file, fifo, "plan file") == f"plan file {fifo} is a FIFO, not a file"
    assert refused(read_user_bytes, "/dev/zero", "model") == "model /dev/zero is a character device, not a file"
    assert refused(read_user_file, tmp_path, "config file") == f"config file {tmp_path} is a folder, not a file"
    assert refused(refuse_non_regular, fifo, "output") == f"output {fifo} is a FIFO, not a file"
    assert refused(refuse_non_regular, "/dev/null", "output") == "output /dev/null is a character device, not a file"
    refuse_non_regular(tmp_path / "absent", "output")  # a file still to be made is fine


def test_a_file_over_the_cap_is_refused_and_one_under_it_read(tmp_path: Path) -> None:
    big = tmp_path / "config.json"
    big.write_bytes(b"x" * 2048)
    assert "2.0 KiB: over the 1.0 KiB one may be" in refused(read_user_bytes, big, "config file", limit_bytes=1024)
    assert read_user_bytes(big, "config file", limit_bytes=2048) == b"x" * 2048
    assert refused(read_user_file, tmp_path / "none.yaml", "plan file") == f"no such plan file: {tmp_path}/none.yaml"
    (tmp_path / "binary").write_bytes(b"\xff\xfe")
    assert "not UTF-8 text" in refused(read_user_file, tmp_path / "binary", "plan file")


def test_a_symlink_is_not_followed_where_asked_and_the_owner_is_checked(tmp_path: Path) -> None:
    target = tmp_path / "secret"
    target.write_text("root's")
    link = tmp_path / "oom.json"
    link.symlink_to(target)
    assert refused(open_regular, link, "record", follow=False) == f"record {link} is a symlink: it is not followed here"
    assert read_user_bytes(link, "record") == b"root's"  # followed where the caller allows it
    other = os.getuid() + 1
    assert refused(open_regular, target, "record", owner=other) == (
        f"record {target} belongs to uid {os.getuid()}, not to uid {other}"
    )
    os.close(open_regular(target, "record", follow=False, owner=os.getuid()))


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_file_is_one_line(tmp_path: Path) -> None:
    locked = tmp_path / "plan.yaml"
    locked.write_text("x")
    locked.chmod(0)
    assert refused(read_user_file, locked, "plan file") == f"cannot read plan file {locked}: Permission denied"
