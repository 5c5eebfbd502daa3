"""redline.files: what a user names is read only when it is a regular file, never past a cap, never blocking."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import pytest

from redline.errors import BadInput
from redline.files import (
    check_trusted,
    disk_full,
    open_append,
    open_regular,
    read_user_bytes,
    read_user_file,
    refuse_non_folder,
    refuse_non_regular,
)


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


def test_a_folder_is_refused_where_a_folder_is_not_and_appends_never_block(tmp_path: Path) -> None:
    fifo = tmp_path / "steps.jsonl"
    os.mkfifo(fifo)
    assert refused(refuse_non_folder, fifo, "checkpoint folder") == f"checkpoint folder {fifo} is a FIFO, not a folder"
    (tmp_path / "file").write_text("x")
    assert refused(refuse_non_folder, tmp_path / "file", "output folder").endswith("is a regular file, not a folder")
    refuse_non_folder(tmp_path, "output folder")
    refuse_non_folder(tmp_path / "absent", "output folder")
    assert refused(open_append, fifo, "step metrics") == f"step metrics {fifo} is a FIFO, not a file"
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # with a reader the open succeeds: fstat still says no
    try:
        assert refused(open_append, fifo, "step metrics") == f"step metrics {fifo} is a FIFO, not a file"
    finally:
        os.close(reader)
    device = refused(open_append, "/dev/null", "step metrics")
    assert device == "step metrics /dev/null is a character device, not a file"
    fd = open_append(tmp_path / "new.jsonl", "step metrics")
    os.write(fd, b"one\n")
    os.close(fd)
    assert (tmp_path / "new.jsonl").read_bytes() == b"one\n"


def test_a_full_disk_or_quota_is_told_from_other_errors() -> None:
    assert disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert not disk_full(OSError(errno.EIO, "Input/output error"))
    assert not disk_full(ValueError("No space left on device"))  # only the kernel's word counts


# ------------------------------------------------------------------------------------------ trusted folders


def code_folder(parent: Path) -> Path:
    """A folder as a checkpoint or an artifact is: a file, and a folder holding one."""
    folder = parent / "ckpt"
    (folder / "step-1").mkdir(parents=True)
    (folder / "step-1" / ".metadata").write_bytes(b"pickle")
    (folder / "manifest.json").write_text("{}")
    for path in (folder, folder / "step-1"):
        path.chmod(0o755)
    return folder


def test_a_folder_only_this_user_could_write_is_trusted(tmp_path: Path) -> None:
    folder = code_folder(tmp_path)
    assert check_trusted(folder, "checkpoint folder").path == Path(os.path.realpath(folder))
    assert check_trusted(tmp_path / "absent", "checkpoint folder") is None  # nothing there: nothing to load
    sticky = tmp_path / "shared"
    sticky.mkdir()
    sticky.chmod(0o1777)  # as /tmp is: others add their own entries there, and cannot rename ours
    check_trusted(code_folder(sticky), "checkpoint folder")


@pytest.mark.parametrize(("where", "mode", "writers"), [
    (".", 0o775, "its group"), ("step-1", 0o757, "everyone"), ("step-1/.metadata", 0o666, "its group and everyone"),
])  # fmt: skip
def test_a_folder_or_file_others_may_write_is_refused(tmp_path: Path, where: str, mode: int, writers: str) -> None:
    folder = code_folder(tmp_path)
    (folder / where).chmod(mode)
    line = refused(check_trusted, folder, "checkpoint folder")
    named = "it" if where == "." else str(folder / where)
    assert line == (
        f"refusing checkpoint folder {folder}: {named} is writable by {writers} (mode {mode:04o}), and it runs as "
        f"code here: chmod -R go-w {folder}"
    )


def test_a_parent_anyone_may_write_without_the_sticky_bit_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    folder = code_folder(shared)
    assert refused(check_trusted, folder / "step-1", "checkpoint folder") == (
        f"refusing checkpoint folder {folder / 'step-1'}: the folder above it, {shared}, is writable by its group "
        f"and everyone without the sticky bit (mode 0777), so anyone could swap it for another: chmod go-w {shared}"
    )


def test_what_another_user_owns_is_refused_even_to_root(tmp_path: Path, stranger: int) -> None:
    folder = code_folder(tmp_path)
    os.chown(folder / "step-1" / ".metadata", stranger, stranger)
    line = refused(check_trusted, folder, "artifact")
    assert line.startswith(f"refusing artifact {folder}: {folder}/step-1/.metadata belongs to redline-stranger (uid ")
    assert line.endswith("not to you or root, and it runs as code here: copy what you trust into a folder of your own")
    os.chown(folder / "step-1" / ".metadata", 0, 0)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, stranger, stranger)  # their folder: they may rename ours inside it and put theirs there
    inside = code_folder(theirs)
    assert f"the folder above it, {theirs}, belongs to redline-stranger" in refused(check_trusted, inside, "artifact")
    elsewhere = tmp_path / "elsewhere.bin"
    elsewhere.write_bytes(b"weights")
    os.chown(elsewhere, stranger, stranger)
    (folder / "weights.pt").symlink_to(elsewhere)  # a link is judged by what it points to
    assert f"{elsewhere} belongs to redline-stranger" in refused(check_trusted, folder, "artifact")


def test_the_folder_checked_is_handed_back_and_a_link_repointed_since_changes_nothing(tmp_path: Path) -> None:
    """The caller loads from the path the check resolved, not from the one given: a symlink on it may point
    elsewhere by then. ``confirm`` says when that folder itself was replaced since."""
    folder = Path(os.path.realpath(code_folder(tmp_path)))
    link = tmp_path / "latest"
    link.symlink_to(folder)
    trusted = check_trusted(link, "checkpoint folder")
    link.unlink()
    link.symlink_to(tmp_path / "elsewhere")  # repointed after the check
    assert trusted.path == folder and trusted.confirm("checkpoint folder") == folder
    folder.rename(tmp_path / "old")
    code_folder(tmp_path)  # another folder under the same name
    assert refused(trusted.confirm, "checkpoint folder") == (
        f"checkpoint folder {folder} was replaced since it was checked: load it again"
    )


def test_a_symlink_on_the_way_another_user_owns_is_refused(tmp_path: Path, stranger: int) -> None:
    """Its owner may remove it and point it at their own folder once the check has passed."""
    folder = Path(os.path.realpath(code_folder(tmp_path)))
    link = tmp_path / "theirs"
    link.symlink_to(folder)
    os.lchown(link, stranger, stranger)
    assert refused(check_trusted, link, "checkpoint folder") == (
        f"refusing checkpoint folder {link}: {link}, a symlink on the way to it, belongs to redline-stranger "
        f"(uid {stranger}), who could point it elsewhere once it is checked: name {folder} instead"
    )
    above = tmp_path / "above"
    above.symlink_to(tmp_path)  # a link in the folders above it, not the last name
    os.lchown(above, stranger, stranger)
    assert f"{above}, a symlink on the way to it, belongs to redline-stranger" in refused(
        check_trusted, above / "ckpt" / "step-1", "checkpoint folder"
    )


def test_a_symlink_in_a_folder_others_may_swap_it_in_is_refused(tmp_path: Path) -> None:
    folder = Path(os.path.realpath(code_folder(tmp_path)))
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "ckpt").symlink_to(folder)
    shared.chmod(0o777)  # anyone may replace the link with one of their own
    assert refused(check_trusted, shared / "ckpt", "checkpoint folder") == (
        f"refusing checkpoint folder {shared / 'ckpt'}: a folder on the way to it, {shared}, is writable by its "
        f"group and everyone without the sticky bit (mode 0777), so anyone could swap it for another: "
        f"chmod go-w {shared}"
    )
    shared.chmod(0o1777)  # sticky: only its owner (this user) may remove the link
    assert check_trusted(shared / "ckpt", "checkpoint folder").path == folder


def test_a_link_inside_to_nothing_and_a_loop_of_links_are_refused(tmp_path: Path) -> None:
    """Whoever may make the missing name would choose what loads through the link; a loop is no folder."""
    folder = code_folder(tmp_path)
    (folder / "weights.pt").symlink_to(tmp_path / "missing")
    assert refused(check_trusted, folder, "artifact").endswith(
        f"{folder}/weights.pt points to {tmp_path}/missing, which is not there: remove the link, or make what it names"
    )
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    assert refused(check_trusted, tmp_path / "a", "artifact") == (
        f"cannot check {tmp_path / 'a'}: over 40 symlinks on the way to it (a loop?)"
    )
