"""S3-compatible object stores (AWS, MinIO, Ceph RGW, R2...): boto3 for what needs the API (stat, listing,
multipart uploads), and plain ranged HTTP for the bytes.

Each range is a GET of a URL boto3 presigns (SigV4, signed locally, no round trip), so the bytes go through the
same connection pools as any HTTP source, with their timeouts and per-socket congestion control; the range
header is not part of the signature. The endpoint is ``--endpoint-url`` or boto3's own configuration
(``AWS_ENDPOINT_URL``, ``~/.aws/config``), credentials are boto3's.

The whole-file checksum is the object's SHA-256 where the store keeps a full-object one (uploaded with
``ChecksumAlgorithm=SHA256`` in one part, or ``ChecksumType=FULL_OBJECT``); a multipart composite checksum
(a hash of the parts' hashes) is not a file hash, so it is left out.
"""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from redline.capability import is_available
from redline.transfer.http import HttpSource, Pools, pools
from redline.transfer.source import Changed, Remote, Sink, TransferError

if TYPE_CHECKING:
    from botocore.exceptions import BotoCoreError, ClientError

    from redline.transfer.session import Session
    from redline.transfer.upload import S3Destination

PRESIGN_S = 3600


def parse(url: str) -> tuple[str, str]:
    parts = urlsplit(url)
    if parts.scheme != "s3" or not parts.netloc:
        raise TransferError(f"{url}: not an s3://bucket/key URL")
    return parts.netloc, parts.path.lstrip("/")


def client(endpoint_url: str | None, per_endpoint: int) -> Any:
    """A boto3 S3 client (of a class botocore makes at run time) for the store at ``endpoint_url``."""
    if not is_available("boto3"):
        raise TransferError("s3:// URLs need boto3 (pip install boto3, the s3 extra)")
    import boto3
    from botocore.config import Config

    config = Config(max_pool_connections=per_endpoint, retries={"mode": "standard", "max_attempts": 5})
    return boto3.client("s3", endpoint_url=endpoint_url, config=config)


def errors() -> tuple[type[ClientError], type[BotoCoreError]]:
    """The botocore exceptions a call may raise, for the callers' except clauses."""
    from botocore.exceptions import BotoCoreError, ClientError

    return ClientError, BotoCoreError


def describe(exc: BaseException, url: str) -> TransferError | None:
    """A TransferError for an answer a retry cannot change (no bucket, no key, denied), else None."""
    client_error, _ = errors()
    if isinstance(exc, client_error):
        code = str(exc.response.get("Error", {}).get("Code"))
        if code in (
            "404",
            "NoSuchKey",
            "NoSuchBucket",
            "403",
            "AccessDenied",
            "InvalidAccessKeyId",
            "SignatureDoesNotMatch",
            "NoSuchUpload",
        ):
            return TransferError(f"{url}: {code} ({exc.response.get('Error', {}).get('Message') or 'refused'})")
    return None


def full_object_sha256(head: dict) -> str | None:
    value = head.get("ChecksumSHA256")
    if not value or "-" in value or head.get("ChecksumType") == "COMPOSITE":
        return None
    return base64.b64decode(value).hex()


class S3Source(HttpSource):
    def __init__(self, url: str, s3: Any, pools: Pools) -> None:
        self.s3 = s3
        self.bucket, self.key = parse(url)
        super().__init__(self.request_url(), pools, display=url)
        self.url = url

    def request_url(self, remote: Remote | None = None) -> str:
        params = {"Bucket": self.bucket, "Key": self.key}
        if remote is not None and remote.version:
            params["VersionId"] = remote.version  # that version's bytes, whatever is put over the key meanwhile
        return self.s3.generate_presigned_url("get_object", Params=params, ExpiresIn=PRESIGN_S)

    def pinned(self, remote: Remote) -> dict[str, str]:
        """If-Match with the ETag the fetch began on: S3 ignores If-Range, so without it a range of an object
        replaced mid-fetch would come back as a 206 of the new one; with it, a 412."""
        return {"If-Match": remote.etag} if remote.etag else {}

    def stat(self) -> Remote:
        try:
            head = self.s3.head_object(Bucket=self.bucket, Key=self.key, ChecksumMode="ENABLED")
        except errors() as exc:
            raise describe(exc, self.display) or OSError(f"{self.display}: {exc}") from None
        # the store's own full-object checksum, else the one redline push left in the object's metadata
        sha = full_object_sha256(head) or head.get("Metadata", {}).get("redline-sha256")
        return Remote(
            self.display,
            int(head["ContentLength"]),
            etag=head.get("ETag"),
            last_modified=head["LastModified"].timestamp() if head.get("LastModified") else None,
            checksum=("sha256", sha) if sha else None,
            version=head.get("VersionId") if head.get("VersionId") not in (None, "null") else None,
            ranged=True,
        )

    def read(self, remote: Remote, start: int, end: int | None, sink: Sink) -> None:
        try:
            super().read(remote, start, end, sink)
        except Changed:
            raise Changed(
                f"{self.display}: the object was replaced during the fetch; nothing of the new one was kept: "
                "run again to fetch it anew"
            ) from None


def listing(s3: Any, url: str) -> list[tuple[str, str]]:
    """Every object under the prefix ``url`` ends with: (its URL, its path below the prefix)."""
    bucket, prefix = parse(url)
    out = []
    try:
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for item in page.get("Contents", []):
                if not item["Key"].endswith("/"):
                    out.append((f"s3://{bucket}/{item['Key']}", item["Key"][len(prefix) :]))
    except errors() as exc:
        raise describe(exc, url) or TransferError(f"{url}: cannot list: {exc}") from None
    return out


def shared_client(session: Session) -> Any:
    """The transfer's boto3 client (of a class botocore makes at run time), for the store at the session's
    ``endpoint_url`` (boto3's own when None)."""
    return session.shared("s3", lambda: client(session.credentials.endpoint_url, session.per_endpoint))


def open_source(session: Session, url: str) -> S3Source:
    return S3Source(url, shared_client(session), pools(session))


def open_listing(session: Session, url: str) -> list[tuple[str, str]]:
    return listing(shared_client(session), url)


def open_destination(session: Session, url: str) -> S3Destination:
    from redline.transfer.upload import S3Destination

    return S3Destination(shared_client(session), pools(session))
