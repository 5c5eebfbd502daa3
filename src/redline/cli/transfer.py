"""`redline fetch SRC... DEST`: download files (HTTP(S) ranges, s3://, sftp://, paths, any fsspec URL) over
many streams sized to the link, resumably (kill it and run it again), verified, renamed into place.
`redline push SRC... DEST`: the same the other way, to s3://, sftp:// or a path."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from redline.cli import ui
from redline.cli.params import parsed
from redline.errors import BadInput
from redline.units import fmt_bytes, fmt_duration, parse_bytes

if TYPE_CHECKING:
    from redline.transfer.engine import Options, Summary
    from redline.transfer.source import Sockets

_SHA256 = re.compile(r"(?:sha256:)?([0-9a-fA-F]{64})")


STREAMS = typer.Option(
    None, "--streams", help="Chunks in flight at once (default: what the link needs; at most what the host runs)."
)
PER_ENDPOINT = typer.Option(16, "--per-endpoint", help="Connections to any one server at most.")
CHUNK_SIZE = typer.Option(None, "--chunk-size", help="Bytes per request or part: 16M (default: max(8M, 2 x BDP)).")
# a download's rate is the sender's congestion control: a receiver asking for BBR only paces its ACKs (measured
# on the emulated link: 44-50 Mbit/s against 55-58 with the system's), so fetch leaves it to the system
FETCH_CONGESTION = typer.Option(
    "system", "--congestion", help="Per-socket TCP congestion control (bbr...), or 'system'."
)
PUSH_CONGESTION = typer.Option("bbr", "--congestion", help="Per-socket TCP congestion control, or 'system'.")
RETRIES = typer.Option(10, "--retries", help="Tries again per chunk after a failure a retry may fix.")
READ_TIMEOUT = typer.Option(60.0, "--read-timeout", help="Seconds without a byte before a retry.")
ENDPOINT_URL = typer.Option(None, "--endpoint-url", help="The S3 API's endpoint (MinIO, R2, Ceph...).")
KNOWN_HOSTS = typer.Option(None, "--known-hosts", help="SFTP: a known_hosts file beside ~/.ssh's.")
SSH_KEY = typer.Option(None, "--ssh-key", help="SFTP: the private key (default: ssh's keys, the agent).")
JSON = typer.Option(False, "--json", help="The summary as JSON.")
COPY_LINKS = typer.Option(
    False, "--copy-links", "-L", help="Follow a folder's symlinks (default: skip them, and say so)."
)


def fetch(
    paths: list[str] = typer.Argument(
        ..., metavar="SRC... DEST", help="Sources (a URL or folder ending in / means every file below it), then DEST."
    ),
    streams: int | None = STREAMS,
    per_endpoint: int = PER_ENDPOINT,
    chunk_size: str | None = CHUNK_SIZE,
    checksum: str | None = typer.Option(
        None, "--checksum", help="The file's SHA-256 (sha256:HEX), checked before it lands."
    ),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="Replace a destination file that differs from the source (never a link or device)."
    ),
    copy_links: bool = COPY_LINKS,
    congestion: str = FETCH_CONGESTION,
    retries: int = RETRIES,
    read_timeout: float = READ_TIMEOUT,
    endpoint_url: str | None = ENDPOINT_URL,
    known_hosts: Path | None = KNOWN_HOSTS,
    ssh_key: Path | None = SSH_KEY,
    json_out: bool = JSON,
) -> None:
    """Download files over many streams sized to the link, resumably and verified.

    A kill or a dropped link loses at most the chunk each stream was fetching: run the same command again.
    """
    from redline import transfer

    sources, dest = _split(paths)
    options, sockets = _settings(
        streams, per_endpoint, chunk_size, retries, overwrite, copy_links, congestion, read_timeout
    )
    with ui.transfer_progress(not json_out) as progress:
        summary = transfer.fetch(
            sources,
            dest,  # a str: its trailing slash says "a folder"
            options,
            sha256=_sha256(checksum),
            sockets=sockets,
            endpoint_url=endpoint_url,
            known_hosts=known_hosts,
            key_file=ssh_key,
            progress=progress,
        )
    _done(summary, congestion, json_out)


def push(
    paths: list[str] = typer.Argument(
        ...,
        metavar="SRC... DEST",
        help="Local files or folders, then s3://bucket/key (or prefix/), sftp://... or a path.",
    ),
    streams: int | None = STREAMS,
    per_endpoint: int = PER_ENDPOINT,
    chunk_size: str | None = CHUNK_SIZE,
    copy_links: bool = COPY_LINKS,
    congestion: str = PUSH_CONGESTION,
    retries: int = RETRIES,
    read_timeout: float = READ_TIMEOUT,
    endpoint_url: str | None = ENDPOINT_URL,
    known_hosts: Path | None = KNOWN_HOSTS,
    ssh_key: Path | None = SSH_KEY,
    json_out: bool = JSON,
) -> None:
    """Upload files in parallel parts sized to the link, resumably: run the same command again after a kill.

    To S3, the store checks each part (Content-MD5) and keeps the file's SHA-256 in its metadata, which `redline
    fetch` checks the download against.
    """
    from redline import transfer

    sources, dest = _split(paths)
    options, sockets = _settings(
        streams, per_endpoint, chunk_size, retries, False, copy_links, congestion, read_timeout
    )
    with ui.transfer_progress(not json_out) as progress:
        summary = transfer.push(
            sources,
            dest,
            options,
            sockets=sockets,
            endpoint_url=endpoint_url,
            known_hosts=known_hosts,
            key_file=ssh_key,
            progress=progress,
        )
    _done(summary, congestion, json_out)


def _split(paths: list[str]) -> tuple[list[str], str]:
    if len(paths) < 2:
        raise BadInput("give at least one source and a destination")
    return paths[:-1], paths[-1]


def _settings(
    streams: int | None,
    per_endpoint: int,
    chunk_size: str | None,
    retries: int,
    overwrite: bool,
    copy_links: bool,
    congestion: str,
    read_timeout: float,
) -> tuple[Options, Sockets]:
    """The engine's options and the sockets' settings from the command line, each checked (Options checks
    its counts itself, against what this host can run)."""
    from redline import transfer

    options = transfer.Options(
        streams=streams,
        per_endpoint=per_endpoint,
        chunk_bytes=parsed(parse_bytes, "--chunk-size", chunk_size),
        retries=retries,
        overwrite=overwrite,
        copy_links=copy_links,
    )
    if not 0 < read_timeout <= 86400:
        raise BadInput("--read-timeout must be between 0 and 86400 seconds")
    return options, transfer.sockets_for(None if congestion == "system" else congestion, read_timeout)


def _done(summary: Summary, congestion: str, json_out: bool) -> None:
    if json_out:
        ui.print_json(summary.to_dict())
    else:
        report(summary, congestion)
    if summary.failed:
        raise typer.Exit(1)


def report(summary: Summary, asked_congestion: str) -> None:
    for f in summary.files:
        if f.status == "failed":
            ui.error(f.error or f"{f.dest}: failed")
        elif f.note:
            ui.warn(f"{f.dest}: {f.note}")
    counts = {s: sum(f.status == s for f in summary.files) for s in ("fetched", "pushed", "present", "failed")}
    moved = [f for f in summary.files if f.status in ("fetched", "pushed")]
    resumed = sum(f.resumed_bytes for f in moved)
    verified = sum(f.verified_against is not None for f in moved)
    parts = [f"{counts['pushed']} pushed" if counts["pushed"] else f"{counts['fetched']} fetched"]
    if counts["present"]:
        parts.append(f"{counts['present']} already there")
    if counts["failed"]:
        parts.append(f"{counts['failed']} failed")
    line = f"{', '.join(parts)}: {fmt_bytes(summary.moved_bytes)} in {fmt_duration(summary.seconds)}"
    line += f", {summary.bits_per_s / 1e6:.1f} Mbit/s"
    if summary.link.rate_bits_per_s:
        line += f" ({summary.bits_per_s / summary.link.rate_bits_per_s:.0%} of the link's measured rate)"
    ui.console.print(line, highlight=False)
    cc = summary.congestion or (
        "the system's" if asked_congestion == "system" else f"the system's ({asked_congestion} not allowed here)"
    )
    details = [f"{summary.streams} streams", f"{fmt_bytes(summary.chunk_bytes)} chunks", f"congestion control {cc}"]
    if resumed:
        details.append(f"{fmt_bytes(resumed)} kept from an earlier run")
    if verified:
        details.append(
            f"{verified} verified ({moved[0].verified_against})"
            if verified == len(moved)
            else f"{verified} of {len(moved)} verified"
        )
    if retries := sum(f.retries for f in summary.files):
        details.append(f"{retries} retries")
    ui.console.print(ui.dim(f"{'; '.join(details)}; link: {summary.link.describe()}"))


def _sha256(text: str | None) -> str | None:
    if text is None:
        return None
    match = _SHA256.fullmatch(text.strip())
    if not match:
        raise BadInput(f"--checksum: '{text}' is not a SHA-256 (64 hex digits, optionally after sha256:)")
    return match.group(1).lower()
