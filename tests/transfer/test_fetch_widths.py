"""`redline fetch`'s report readable at 80 and 120 columns: its figures and words whole on a line, no line past
the width (a local file as the source: no server needed)."""

from __future__ import annotations

import os
from pathlib import Path

from conftest import run_cli
from tables import WIDTHS, assert_whole


def test_the_fetch_report_is_whole_at_any_width(tmp_path: Path) -> None:
    source = tmp_path / "shard.bin"
    source.write_bytes(os.urandom(300 << 10))
    for width in WIDTHS:
        result = run_cli(
            "fetch",
            str(source),
            str(tmp_path / f"out{width}") + "/",
            env={"REDLINE_HOME": str(tmp_path)},
            columns=width,
        )
        assert result.returncode == 0, result.stderr
        assert_whole(result.stdout, "1 fetched: 300.0 KiB", "Mbit/s", "4 streams", "8.0 MiB chunks", width=width)
        assert_whole(result.stdout, "congestion control the system's", width=width)
