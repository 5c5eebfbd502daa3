"""A destination ending in a slash is a folder, as rsync reads it: `redline fetch FILE data/` puts FILE in
``data/`` (made if missing), never writes a file called ``data``. A local file as the source: no server needed."""

from __future__ import annotations

from pathlib import Path

from conftest import run_cli
from redline import transfer


def test_fetch_into_a_missing_folder_makes_it_and_lands_the_file_inside(tmp_path: Path) -> None:
    source = tmp_path / "shard-000.bin"
    source.write_bytes(b"tokens" * 1000)
    result = run_cli("fetch", str(source), str(tmp_path / "data") + "/", env={"REDLINE_HOME": str(tmp_path / "h")})
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "data").is_dir()
    assert (tmp_path / "data" / "shard-000.bin").read_bytes() == source.read_bytes()


def test_the_library_reads_the_slash_of_a_str_destination_as_a_folder(tmp_path: Path) -> None:
    source = tmp_path / "a.txt"
    source.write_text("a")
    transfer.fetch([str(source)], f"{tmp_path}/out/")
    transfer.fetch([str(source)], tmp_path / "named.txt")  # no slash: the file's own name
    assert (tmp_path / "out" / "a.txt").read_text() == "a"
    assert (tmp_path / "named.txt").read_text() == "a"
