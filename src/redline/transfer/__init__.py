"""Moving datasets and checkpoints across long, lossy links, resumably: ``redline fetch`` and ``redline push``.

    from redline import transfer
    summary = transfer.fetch(["https://host/shard-000.tar", "s3://bucket/prefix/"], "data/")

Parts: ``link`` (chunk size and streams from the link), ``source`` and one module per kind of endpoint
(``http``, ``s3``, ``sftp``, ``fs``), each registered with its traits in ``schemes``, ``journal`` (the resumable
state beside each destination), ``engine`` (the chunks, retries and verification), ``session`` (URLs to files),
``upload`` (push).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from redline.transfer.engine import Options, Progress, Summary
from redline.transfer.fetcher import Fetch
from redline.transfer.fs import local_path
from redline.transfer.link import Link, to_endpoint
from redline.transfer.session import Session, plan_items
from redline.transfer.source import Credentials, Remote, Sockets, congestion_allowed

__all__ = ["Credentials", "Link", "Options", "Progress", "Summary", "fetch", "push", "sockets_for"]


def sockets_for(congestion: str | None, read_timeout_s: float = 60.0) -> Sockets:
    """Sockets asking for ``congestion`` ("bbr") where the kernel allows this process to, else the system's."""
    if congestion and not congestion_allowed(congestion):
        congestion = None
    return Sockets(read_timeout_s=read_timeout_s, congestion=congestion)


def fetch(
    sources: list[str],
    dest: Path | str,
    options: Options | None = None,
    *,
    sha256: str | None = None,
    sockets: Sockets | None = None,
    endpoint_url: str | None = None,
    known_hosts: Path | None = None,
    key_file: Path | None = None,
    progress: Progress | None = None,
    link: Link | None = None,
    remote: Remote | None = None,
) -> Summary:
    """Fetch ``sources`` (files, or folders ending in /) to ``dest`` (a folder when it ends in /, as in rsync, or
    already is one; else the one file's name); see the package's parts. ``remote``: what
    a stat of the one source said moments ago (``redline stage`` stats before it admits), not asked again."""
    options = options or Options()
    sockets = sockets or Sockets()  # the system's congestion control: the sender's decides a download's rate
    credentials = Credentials(endpoint_url, known_hosts, key_file)
    session = Session(sockets, options.per_endpoint, credentials, options.copy_links)
    try:
        items = plan_items(session, sources, dest, sha256)
        if remote is not None:
            if len(items) != 1:
                raise ValueError("remote= describes one file, and this fetch has several")
            items = [dataclasses.replace(items[0], remote=remote)]
        _say_skipped(session.skipped, progress)
        summary = Fetch(items, options, link, sockets.congestion, progress).run()
        summary.skipped = session.skipped
        return summary
    finally:
        session.close()


def _say_skipped(skipped: list[str], progress: Progress | None) -> None:
    """One notice for a folder's entries left out (symlinks without --copy-links, FIFOs, devices)."""
    if skipped and progress is not None:
        shown = ", ".join(skipped[:3]) + (f" and {len(skipped) - 3} more" if len(skipped) > 3 else "")
        progress.note(f"skipped {len(skipped)} entries, not regular files (--copy-links follows symlinks): {shown}")


def push(
    sources: list[str],
    dest: str,
    options: Options | None = None,
    *,
    sockets: Sockets | None = None,
    endpoint_url: str | None = None,
    known_hosts: Path | None = None,
    key_file: Path | None = None,
    progress: Progress | None = None,
    link: Link | None = None,
) -> Summary:
    """Upload local files or folders to ``dest``: s3://bucket/key (or prefix/), sftp://host/path, or a path."""
    from redline.errors import BadInput
    from redline.transfer.schemes import find, push_targets
    from redline.transfer.session import check_url
    from redline.transfer.upload import Push, plan_uploads

    scheme = find(dest)
    if scheme is not None and scheme.local:  # a copy to a local or mounted path is a fetch from the source's path
        return fetch(sources, local_path(dest), options, sockets=sockets, progress=progress, link=link)
    if scheme is None or scheme.destination is None:
        raise BadInput(f"{dest}: redline push sends to {push_targets()}")
    options = options or Options()
    sockets = sockets or sockets_for("bbr")
    check_url(dest)
    uploads, skipped = plan_uploads(sources, dest, options.copy_links)
    _say_skipped(skipped, progress)
    session = Session(sockets, options.per_endpoint, Credentials(endpoint_url, known_hosts, key_file))
    try:
        destination = scheme.destination(session, dest)
        if link is None:
            link = to_endpoint(destination.endpoint, "up")
        summary = Push(uploads, destination, options, link, sockets.congestion, progress).run()
        summary.skipped = skipped
        return summary
    finally:
        session.close()
