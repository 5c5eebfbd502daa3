"""``redline push``: upload local files to an object store or an SFTP server in parallel parts, resumably.

- S3: a multipart upload whose parts go up as PUTs of presigned URLs over the transfer's own connections (their
  timeouts and congestion control), many at once. Each part's ETag (its MD5 on S3 and its kin) is checked
  against the bytes sent; the file's SHA-256 travels as the object's metadata (``x-amz-meta-redline-sha256``),
  which ``redline fetch`` checks the download against. A file smaller than one part is one PUT.
- SFTP: the parts are written at their offsets into ``DEST.redline-part`` over several SSH connections, then
  renamed over DEST.
- A path (local disk, NFS): the fetch engine copies it, with its journal beside the destination.

State lives in a journal under the data directory (``$REDLINE_HOME/transfer/push``), one per (file, destination):
the upload id and the parts done. A killed push run again resumes: the parts the store still holds (S3's
ListParts) or that the journal recorded are not sent again. A file changed since is uploaded anew.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import threading
import time
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from redline.env import State, state_dir
from redline.transfer.engine import FileResult, Options, Progress, Summary, retrying
from redline.transfer.journal import chunks, hash_range
from redline.transfer.link import Link
from redline.transfer.source import TransferError
from redline.units import MiB

if TYPE_CHECKING:
    from paramiko import SFTPClient

    from redline.transfer.http import Pools
    from redline.transfer.sftp import Address, SshPool

S3_MIN_PART_BYTES = 5 * MiB
S3_MAX_PARTS = 10_000
SHA256_META = "redline-sha256"


@dataclass
class Upload:
    """One local file going to one destination URL, and its progress on the way."""

    path: Path
    url: str
    size: int = 0
    mtime_ns: int = 0
    sha256: str | None = None
    part_bytes: int = 0
    upload_id: str | None = None
    done: dict[int, str] = field(default_factory=dict)  # part index -> its ETag (S3) or SHA-256 (SFTP)
    result: FileResult = field(init=False)  # what the push reports of it
    failed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.result = FileResult(str(self.path), self.url)

    def journal(self) -> Path:
        key = hashlib.sha256(f"{self.path.resolve()}\0{self.url}".encode()).hexdigest()[:24]
        return state_dir(State.PUSH) / f"{key}.jsonl"

    def spans(self) -> list[tuple[int, int]]:
        return chunks(self.size, self.part_bytes)


class Destination(ABC):
    """What a kind of destination does with an upload: begin (or resume) it, send a part, finish it."""

    endpoint: str
    min_part_bytes = 1
    checks_parts = False  # the store checks each part against a checksum sent with it

    @abstractmethod
    def begin(self, upload: Upload, resumed: bool) -> None:
        """Make ready for the parts: take up an earlier run's (``resumed``) where the destination still has it."""

    @abstractmethod
    def part(self, upload: Upload, index: int, data: bytes) -> str:
        """Send part ``index`` (``data``); the tag the journal records of it (its ETag, or its SHA-256)."""

    @abstractmethod
    def finish(self, upload: Upload) -> None:
        """Put the file in place once every part is there."""

    def abandon(self, upload: Upload) -> None:  # noqa: B027 - a hook: nothing to let go of by default
        """Give up on the upload; by default what was sent stays for a later run to resume."""


class Push:
    """The upload engine: the parts of every file through one pool of streams, each part retried alone."""

    def __init__(
        self,
        uploads: list[Upload],
        destination: Destination,
        options: Options,
        link: Link,
        congestion: str | None,
        progress: Progress | None = None,
    ) -> None:
        self.uploads, self.destination, self.options = uploads, destination, options
        self.link, self.congestion = link, congestion
        self.progress = progress or Progress()
        self.streams = options.streams or link.streams(options.per_endpoint)
        self.part_bytes = options.chunk_bytes or link.chunk_bytes()

    def run(self) -> Summary:
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=self.streams, thread_name_prefix="push") as pool:
            list(pool.map(self._prepare, self.uploads))
            tasks = [(u, i) for u in self.uploads if not u.failed for i in range(len(u.spans())) if i not in u.done]
            list(pool.map(lambda task: self._part(*task), tasks))
            list(pool.map(self._finish, [u for u in self.uploads if not u.failed]))
        return Summary(
            [u.result for u in self.uploads],
            time.perf_counter() - start,
            self.streams,
            self.part_bytes,
            self.link,
            self.congestion,
        )

    def _prepare(self, upload: Upload) -> None:
        try:
            info = upload.path.stat()
            upload.size, upload.mtime_ns = info.st_size, info.st_mtime_ns
            upload.result.size = upload.size
            with open(upload.path, "rb") as f:
                upload.sha256 = upload.result.sha256 = hash_range(f.fileno(), 0, upload.size)
            resumed = self._resume(upload)
            retrying(
                lambda: self.destination.begin(upload, resumed),
                self.options.retries,
                upload.result,
                lambda: False,
            )
            self._save(upload)
        except TransferError as exc:
            self._fail(upload, str(exc))
            return
        except OSError as exc:
            self._fail(upload, f"{upload.path}: {exc.strerror or exc}")
            return
        spans = upload.spans()
        upload.result.resumed_bytes = sum(spans[i][1] - spans[i][0] for i in upload.done)
        self.progress.add_total(upload.size)
        self.progress.advance(upload.result.resumed_bytes)

    def _resume(self, upload: Upload) -> bool:
        """Take up an earlier run's upload of this same file (size, mtime, hash), or start anew."""
        upload.part_bytes = self._part_bytes(upload.size)
        try:
            lines = upload.journal().read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            return False
        records = []
        for line in lines:
            with contextlib.suppress(json.JSONDecodeError):
                records.append(json.loads(line))
        header = records[0] if records and isinstance(records[0], dict) else {}
        same = (header.get("size"), header.get("mtime_ns"), header.get("sha256")) == (
            upload.size,
            upload.mtime_ns,
            upload.sha256,
        )
        if not same:
            upload.result.note = "started anew: the file changed since the earlier run"
            return False
        upload.part_bytes, upload.upload_id = int(header["part_bytes"]), header.get("upload_id")
        upload.done = {int(r["part"]): str(r["tag"]) for r in records[1:] if isinstance(r, dict) and "part" in r}
        return True

    def _part_bytes(self, size: int) -> int:
        return max(self.part_bytes, -(-size // S3_MAX_PARTS), self.destination.min_part_bytes)

    def _save(self, upload: Upload) -> None:
        """Write the journal's header (and the parts already done) anew."""
        path = upload.journal()
        path.parent.mkdir(parents=True, exist_ok=True)
        header = {
            "version": 1,
            "path": str(upload.path),
            "url": upload.url,
            "size": upload.size,
            "mtime_ns": upload.mtime_ns,
            "sha256": upload.sha256,
            "part_bytes": upload.part_bytes,
            "upload_id": upload.upload_id,
        }
        lines = [json.dumps(header)] + [json.dumps({"part": i, "tag": tag}) for i, tag in sorted(upload.done.items())]
        tmp = path.with_suffix(".tmp")
        tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
        os.replace(tmp, path)

    def _part(self, upload: Upload, index: int) -> None:
        if upload.failed:
            return
        start, end = upload.spans()[index]

        def send() -> str:
            with open(upload.path, "rb") as f:
                data = os.pread(f.fileno(), end - start, start)
            if len(data) != end - start or os.stat(upload.path).st_mtime_ns != upload.mtime_ns:
                raise TransferError(f"{upload.path}: changed while it was being uploaded; run again")
            tag = self.destination.part(upload, index, data)
            with upload.lock:
                upload.result.moved_bytes += len(data)
            return tag

        try:
            tag = retrying(send, self.options.retries, upload.result, lambda: upload.failed)
        except TransferError as exc:
            self._fail(upload, str(exc))
            return
        with upload.lock:
            upload.done[index] = tag
            with open(upload.journal(), "a", encoding="utf-8") as log:
                log.write(json.dumps({"part": index, "tag": tag}) + "\n")
        self.progress.advance(end - start)

    def _finish(self, upload: Upload) -> None:
        try:
            retrying(
                lambda: self.destination.finish(upload),
                self.options.retries,
                upload.result,
                lambda: False,
            )
        except TransferError as exc:
            self._fail(upload, str(exc))
            return
        upload.journal().unlink(missing_ok=True)
        upload.result.status = "pushed"
        if self.destination.checks_parts:
            upload.result.verified_against = "each part's MD5, checked by the store"
        self.progress.finished(upload.result)

    def _fail(self, upload: Upload, message: str) -> None:
        with upload.lock:
            if upload.failed:
                return
            upload.failed = True
        upload.result.status, upload.result.error = "failed", message
        self.progress.finished(upload.result)


class S3Destination(Destination):
    min_part_bytes = S3_MIN_PART_BYTES  # S3's smallest part but the last
    checks_parts = True  # Content-MD5: the store refuses a part whose bytes do not match

    def __init__(self, s3: Any, pools: Pools) -> None:
        from redline.transfer.http import endpoint_of

        self.s3, self.pools = s3, pools
        self.endpoint = endpoint_of(s3.meta.endpoint_url)

    def _target(self, upload: Upload) -> tuple[str, str]:
        from redline.transfer.s3 import parse

        return parse(upload.url)

    def begin(self, upload: Upload, resumed: bool) -> None:
        from redline.transfer import s3

        bucket, key = self._target(upload)
        if not key:
            raise TransferError(f"{upload.url}: names a bucket, not an object")
        if upload.size == 0:  # no part to send: the empty object is made here
            try:
                self.s3.put_object(Bucket=bucket, Key=key, Body=b"", Metadata={SHA256_META: upload.sha256})
            except s3.errors() as exc:
                raise s3.describe(exc, upload.url) or OSError(f"{upload.url}: {exc}") from None
            upload.upload_id, upload.done = None, {}
            return
        if resumed and upload.upload_id:
            try:
                held = {
                    p["PartNumber"] - 1: p["ETag"]
                    for page in self.s3.get_paginator("list_parts").paginate(
                        Bucket=bucket, Key=key, UploadId=upload.upload_id
                    )
                    for p in page.get("Parts", [])
                }
                upload.done = {i: tag for i, tag in upload.done.items() if held.get(i) == tag}
                return
            except s3.errors() as exc:
                if s3.describe(exc, upload.url) is None:
                    raise OSError(f"{upload.url}: {exc}") from None
                upload.result.note = "started anew: the store no longer holds the earlier run's upload"
        try:
            answer = self.s3.create_multipart_upload(Bucket=bucket, Key=key, Metadata={SHA256_META: upload.sha256})
        except s3.errors() as exc:
            raise s3.describe(exc, upload.url) or OSError(f"{upload.url}: {exc}") from None
        upload.upload_id, upload.done = answer["UploadId"], {}

    def part(self, upload: Upload, index: int, data: bytes) -> str:
        from redline.transfer.http import check_status

        bucket, key = self._target(upload)
        md5 = base64.b64encode(hashlib.md5(data).digest()).decode()
        headers = {"Content-Length": str(len(data)), "Content-MD5": md5}
        params = {"Bucket": bucket, "Key": key, "UploadId": upload.upload_id, "PartNumber": index + 1}
        url = self.s3.generate_presigned_url("upload_part", Params=params, ExpiresIn=3600)
        response = self.pools.request("PUT", url, headers, body=data)
        try:
            response.read()
            check_status(response, upload.url)
            tag = response.headers.get("ETag")
        finally:
            response.release_conn()
        if not tag:
            raise OSError(f"{upload.url}: the store answered part {index + 1} without an ETag")
        return tag

    def finish(self, upload: Upload) -> None:
        from redline.transfer import s3

        if upload.upload_id is None:
            return
        bucket, key = self._target(upload)
        parts = [{"PartNumber": i + 1, "ETag": tag} for i, tag in sorted(upload.done.items())]
        try:
            self.s3.complete_multipart_upload(
                Bucket=bucket, Key=key, UploadId=upload.upload_id, MultipartUpload={"Parts": parts}
            )
        except s3.errors() as exc:
            raise s3.describe(exc, upload.url) or OSError(f"{upload.url}: {exc}") from None


class SftpDestination(Destination):
    def __init__(self, pool: SshPool, address: Address) -> None:
        self.pool, self.endpoint = pool, address.endpoint

    def _path(self, upload: Upload) -> str:
        from redline.transfer.sftp import Address

        return Address.parse(upload.url).path

    def begin(self, upload: Upload, resumed: bool) -> None:
        from redline.transfer.sftp import Address

        session = self.pool.sftp(Address.parse(upload.url))
        part = self._path(upload) + ".redline-part"
        try:
            if resumed and session.stat(part).st_size == upload.size:
                return
        except FileNotFoundError:
            pass
        upload.done = {}
        _mkdirs(session, os.path.dirname(part))
        with session.open(part, "wb") as f:
            f.truncate(upload.size)

    def part(self, upload: Upload, index: int, data: bytes) -> str:
        from redline.transfer.sftp import Address

        session = self.pool.sftp(Address.parse(upload.url))
        with session.open(self._path(upload) + ".redline-part", "r+b") as f:
            f.set_pipelined(True)
            f.seek(upload.spans()[index][0])
            f.write(data)
        return hashlib.sha256(data).hexdigest()

    def finish(self, upload: Upload) -> None:
        from redline.transfer.sftp import Address

        session = self.pool.sftp(Address.parse(upload.url))
        path = self._path(upload)
        session.utime(path + ".redline-part", (upload.mtime_ns / 1e9, upload.mtime_ns / 1e9))
        session.posix_rename(path + ".redline-part", path)


def _mkdirs(session: SFTPClient, folder: str) -> None:
    missing = []
    while folder and folder != "/":
        try:
            session.stat(folder)
            break
        except FileNotFoundError:
            missing.append(folder)
            folder = os.path.dirname(folder)
    for path in reversed(missing):
        session.mkdir(path)


def plan_uploads(sources: list[str], dest: str, follow: bool = False) -> tuple[list[Upload], list[str]]:
    """Local files and folders to upload, each with its destination URL: one file to a URL not ending in /
    goes to that URL; anything else lands below ``dest`` by name (a folder's files by their path in it). The
    entries of a folder left out (symlinks unless ``follow``), each with why."""
    from redline.errors import BadInput
    from redline.files import refuse_non_regular
    from redline.transfer.fs import walk_local

    into_folder = len(sources) > 1 or dest.endswith("/") or any(Path(s).is_dir() for s in sources)
    base = dest.rstrip("/")
    uploads, skipped = [], []
    for source in sources:
        path = Path(source)
        if path.is_dir():
            files, left_out = walk_local(path, follow)
            skipped += [str(path / name) for name in left_out]
            if not files:
                raise BadInput(f"{path}: holds no files")
            uploads += [Upload(p, f"{base}/{name}") for p, name in files]
        elif path.exists():
            refuse_non_regular(path, "source")
            uploads.append(Upload(path, f"{base}/{path.name}" if into_folder else dest))
        else:
            raise BadInput(f"{path}: no such file or folder")
    return uploads, skipped
