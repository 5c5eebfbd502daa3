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
    from redline.transfer.cache import Added, Cache

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
    allow_evict: bool = typer.Option(
        False, "--allow-evict", help="Files over the cap together: fetch each in turn, the later evicting the earlier."
    ),
    json_out: bool = typer.Option(False, "--json", help="What was staged, as JSON."),
) -> None:
    """Fetch files into the cache now; those already there only count as used. Files that together are more
    than the cap are refused before any fetch, unless --allow-evict."""
    store = _open(cache, parsed(parse_bytes, "--max-size", max_size))
    try:
        with ui.transfer_progress(not json_out) as progress:
            added = store.add(urls, progress, allow_evict=allow_evict)
    finally:
        store.close()
    if json_out:
        ui.print_json({"cache": str(store.root), "staged": [a.to_dict() for a in added], **_usage(store)})
    else:
        _say_added(added, store)
    if not allow_evict and not all(a.kept for a in added):  # evicted under readers' pins, after all
        raise typer.Exit(1)


def _say_added(added: list[Added], store: Cache) -> None:
    """Each file as the cache holds it now: fetched or already there, or (said on stderr) not kept."""
    for a in added:
        size = fmt_bytes(a.entry.size_bytes)
        if a.kept:
            verb = "fetched" if a.fetched else "already staged"
            ui.console.print(f"{verb}: {a.entry.url} ({size})", highlight=False)
        else:
            ui.warn(f"not kept: {a.entry.url} ({size}): evicted to make room under the cap")
    if dropped := sum(not a.kept for a in added):
        ui.warn(
            f"{len(added) - dropped} of {len(added)} kept: the cache holds {fmt_bytes(store.max_bytes())}; "
            "raise it with --max-size"
        )


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
    from rich.table import Table

    now = time.time()
    table = Table(title="the stage cache, least recently used (evicted) first", title_justify="left")
    table.add_column("URL", overflow="fold")
    table.add_column("size", justify="right", no_wrap=True)
    table.add_column("used", justify="right", no_wrap=True)
    table.add_column("state", no_wrap=True)
    for e in entries:
        state = "in use" if e.in_use else ("ready" if e.state == "ready" else "partial")
        table.add_row(e.url, fmt_bytes(e.size_bytes), _ago(now - e.last_used), state)
    if entries:
        ui.print_table(table)
    usage = _usage(store)
    cap = fmt_bytes(usage["max_bytes"]) + ("" if usage["max_bytes_set"] else " (80% of its disk; --max-size sets it)")
    ui.console.print(ui.dim(f"{len(entries)} entries, {fmt_bytes(usage['used_bytes'])} of {cap}"))
    ui.console.print(ui.dim(f"cache: {store.root}"))


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
