"""Google Cloud Storage through gcsfs (`gs://`, `gcs://`).

GCS reports a crc32c for every object (composite ones included) and an md5 for those uploaded whole,
both base64 as `info()` gives them (`crc32c`, `md5Hash`); crc32c is the one hashed while writing. An
object's `generation` changes on every rewrite.

A write goes through a resumable upload session (gcsfs keeps its URL in `location`). GCS answers a
chunk resent after its response was lost with 400 "Invalid Content-Range start: expected N" (gcsfs
resends a chunk as it was, without asking the store where the session stands) and an expired or
unknown session with 404 or 410: the session broke, and the file starts over with a new one.
"""

from __future__ import annotations

from collections.abc import Iterator

from ckptflow.plumbing.checksums import StoreChecksum
from ckptflow.plumbing.stores import Info, Store, broken_session_rule


def checksums(info: Info) -> Iterator[StoreChecksum]:
    """crc32c, then md5Hash, where `info` has them."""
    if isinstance(info.get("crc32c"), str):
        yield StoreChecksum("crc32c", info["crc32c"])
    if isinstance(info.get("md5Hash"), str):
        yield StoreChecksum("md5-base64", info["md5Hash"])


STORE = Store(
    name="gcs",
    protocols=("gs", "gcs"),
    checksums=checksums,
    written_checksum="crc32c",
    stamp_keys=("generation", "crc32c", "md5Hash", "etag", "mtime"),
    session_broke=broken_session_rule(session=("location",), statuses=frozenset({400, 404, 410})),
)
