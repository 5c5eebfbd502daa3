"""`redline stage add` says what it cannot keep: files that together are more than the cache's cap are refused
before any fetch (sizes, cap and the ways out in one line), or with --allow-evict fetched in turn and each one a
later file evicted said as not kept, never as "fetched". Local files as the sources: no server needed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import run_cli
from redline.transfer.cache import Cache, NotStageable
from tables import WIDTHS, assert_whole

KIB = 1 << 10


@pytest.fixture
def shards(tmp_path: Path) -> list[str]:
    """Four 300 KiB files: 1.2 MiB in all, three of them under a 1 MiB cap."""
    folder = tmp_path / "src"
    folder.mkdir()
    for name in "abcd":
        (folder / name).write_bytes(os.urandom(300 * KIB))
    return [str(folder / name) for name in "abcd"]


@pytest.fixture
def home(tmp_path: Path) -> dict[str, str]:
    return {"REDLINE_HOME": str(tmp_path / "home")}


def test_files_over_the_cap_together_are_refused_before_any_fetch(shards: list[str], home: dict[str, str]) -> None:
    """On main all four were said "fetched" and two were gone when the command ended."""
    result = run_cli("stage", "add", *shards, "--max-size", "1M", env=home)
    assert result.returncode == 2 and result.stdout == ""
    (line,) = result.stderr.strip().splitlines()
    assert "the 4 files asked are 1.2 MiB in all and the cache holds 1.0 MiB" in line
    assert "nothing was fetched; raise --max-size to 1.2 MiB or more" in line and "--allow-evict" in line
    assert json.loads(run_cli("stage", "ls", "--json", env=home).stdout)["entries"] == []


def test_with_allow_evict_what_was_not_kept_is_said_as_such(shards: list[str], home: dict[str, str]) -> None:
    result = run_cli("stage", "add", *shards, "--max-size", "1M", "--allow-evict", env=home)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [f"fetched: {url} (300.0 KiB)" for url in shards[1:]]
    assert f"not kept: {shards[0]} (300.0 KiB): evicted to make room under the cap" in result.stderr
    assert "3 of 4 kept: the cache holds 1.0 MiB; raise it with --max-size" in result.stderr
    again = run_cli("stage", "add", *shards[1:], "--json", env=home)
    report = json.loads(again.stdout)
    assert [(s["fetched"], s["kept"]) for s in report["staged"]] == [(False, True)] * 3


def test_what_fits_is_staged_once_and_a_url_named_twice_counts_once(shards: list[str], tmp_path: Path) -> None:
    cache = Cache(tmp_path / "cache", max_bytes=700 * KIB)
    added = cache.add([shards[0], shards[1], shards[0]])
    assert [(a.entry.url, a.fetched, a.kept) for a in added] == [(shards[0], True, True), (shards[1], True, True)]
    with pytest.raises(NotStageable, match=r"the 3 files asked are 900\.0 KiB in all and the cache holds 700\.0 KiB"):
        cache.add(shards[:3])  # the two staged count too: they must stay
    assert [e.url for e in cache.entries()] == shards[:2]


@pytest.mark.parametrize("width", WIDTHS)
def test_stage_ls_is_a_table_whole_at_any_width(shards: list[str], home: dict[str, str], width: int) -> None:
    assert run_cli("stage", "add", *shards[:2], env=home).returncode == 0
    listed = run_cli("stage", "ls", env=home, columns=width)
    assert listed.returncode == 0, listed.stderr
    assert_whole(listed.stdout, "300.0 KiB", "2 entries", width=width)
    for url in shards[:2]:  # a path longer than the line is its own line, unbroken where it fits
        assert url in listed.stdout.replace("\n", "") or len(url) > width
