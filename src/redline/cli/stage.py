"""`redline stage`: the local cache that training reads remote shards through (`redline.transfer.stage`).

`add` fetches files into it now (resumably, verified, each URL once however many jobs ask); `ls` shows what
it holds against its cap; `evict` and `clear` remove entries no reader holds.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from redline.cli import ui
from redline.cli.params import parsed
from redline.errors import BadInput
from redline.units import fmt_bytes, parse_bytes

if TYPE_CHECKING:
    from redline.transfer.cache import Cache

app = typer.Typer(
    help="The local cache (NVMe) that training reads remote shards through: add, ls, evict, clear.",
    no_args_is_help=True,
)

CACHE_HELP = "The cache's folder (default: $REDLINE_HOME/cache)."


@app.command("add")
def add(
    urls: list[str] = typer.Argument(..., metavar="URL...", help="Files to stage: http(s)://, s3://, sftp://, paths."),
    cache: str | None = typer.Option(None, "--cache", help=CACHE_HELP),
    max_size: str | None = typer.Option(
        None, "--max-size", help="Cap the cache at this size, kept for later runs: 200G (default: 80% of its disk)."
    ),
    json_out: bool = typer.Option(False, "--json", help="What was staged, as JSON."),
) -> None:
    """Fetch files into the cache now; those already there only count as used."""
    store = _open(cache, parsed(parse_bytes, "--max-size", max_size))
    staged = []
    try:
        with ui.transfer_progress(not json_out) as progress:
            for url in urls:
                with store.get(url, progress) as pinned:
                    staged.append(pinned.entry.to_dict() | {"fetched": pinned.fetched})
                    if not json_out:
                        verb = "fetched" if pinned.fetched else "already staged"
                        ui.console.print(f"{verb}: {pinned.url} ({fmt_bytes(pinned.size_bytes)})", highlight=False)
    finally:
        store.close()
    if json_out:
        ui.print_json({"cache": str(store.root), "staged": staged, **_usage(store)})


@app.command("ls")
def ls(
    cache: str | None = typer.Option(None, "--cache", help=CACHE_HELP),
    json_out: bool = typer.Option(False, "--json", help="Every entry and the totals, as JSON."),
) -> None:
    """What the cache holds, least recently used first (evicted first), and its total against the cap."""
    store = _open(cache)
    entries = store.entries(look_in_use=True)
    if json_out:
        ui.print_json({"cache": str(store.root), "entries": [e.to_dict() for e in entries], **_usage(store)})
        return
    now = time.time()
    for e in entries:
        state = "in use" if e.in_use else ("" if e.state == "ready" else "partial")
        ago = _ago(now - e.last_used)
        ui.console.print(f"{fmt_bytes(e.size_bytes):>10}  {ago:>9}  {state:<7} {e.url}", highlight=False)
    usage = _usage(store)
    cap = fmt_bytes(usage["max_bytes"]) + ("" if usage["max_bytes_set"] else " (80% of its disk; --max-size sets it)")
    ui.console.print(ui.dim(f"{store.root}: {len(entries)} entries, {fmt_bytes(usage['used_bytes'])} of {cap}"))


@app.command("evict")
def evict(
    urls: list[str] = typer.Argument(..., metavar="URL...", help="The entries to remove, by the URL staged."),
    cache: str | None = typer.Option(None, "--cache", help=CACHE_HELP),
    json_out: bool = typer.Option(False, "--json", help="What became of each, as JSON."),
) -> None:
    """Remove entries now; one a reader holds stays (exit 1)."""
    store = _open(cache)
    outcome = {url: store.evict(url) for url in urls}
    if json_out:
        ui.print_json({"cache": str(store.root), "evicted": outcome, **_usage(store)})
    else:
        for url, what in outcome.items():
            if what == "in use":
                ui.error(f"{url}: in use by a reader, kept")
            else:
                ui.console.print(f"{what if what == 'evicted' else 'not in the cache'}: {url}", highlight=False)
    if "in use" in outcome.values():
        raise typer.Exit(1)


@app.command("clear")
def clear(
    cache: str | None = typer.Option(None, "--cache", help=CACHE_HELP),
    json_out: bool = typer.Option(False, "--json", help="What was removed and kept, as JSON."),
) -> None:
    """Remove every entry no reader holds."""
    store = _open(cache)
    removed, kept = store.clear()
    if json_out:
        ui.print_json(
            {"cache": str(store.root), "removed": [e.url for e in removed], "kept_in_use": [e.url for e in kept]}
        )
        return
    line = f"removed {len(removed)} entries ({fmt_bytes(sum(e.size_bytes for e in removed))})"
    if kept:
        line += f"; kept {len(kept)} in use by readers"
    ui.console.print(line, highlight=False)


def _open(cache: str | None, max_bytes: int | None = None) -> Cache:
    from redline.transfer.cache import Cache

    if cache is not None and not cache.strip():
        raise BadInput("--cache: an empty path")
    return Cache(Path(cache) if cache is not None else None, max_bytes)


def _usage(store: Cache) -> dict[str, int | bool]:
    return {
        "used_bytes": sum(e.size_bytes for e in store.entries()),
        "max_bytes": store.max_bytes(),
        "max_bytes_set": store.cap_is_set(),
    }


def _ago(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit} ago"
    return f"{max(0, seconds):.0f} s ago"
