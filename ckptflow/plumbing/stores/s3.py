"""Amazon S3 and S3-compatible stores through s3fs (`s3://`, `s3a://`).

S3 reports no checksum of its own in `info()`, but the ETag of an object sent in one PUT is the md5 of
its content (hex, quoted). s3fs sends an object smaller than its block size (50 MiB by default) as one
PUT; a larger one goes in parts, whose ETag (`<md5 of the parts' md5s>-<count>`) is not the content's.
An object's ETag, `VersionId` (on a versioned bucket) and `LastModified` change on every rewrite.

A multipart write keeps its upload in `mpu`; S3 answers a part or a completion for a finished or
aborted multipart upload with 404 NoSuchUpload: the upload broke, and the file starts over.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from ckptflow.plumbing.checksums import StoreChecksum
from ckptflow.plumbing.stores import Info, Store, broken_session_rule

_SINGLE_PART_ETAG = re.compile(r'^"?([0-9a-fA-F]{32})"?$')

ONE_PUT_BYTES = 50 * 2**20  # s3fs's default block size


def checksums(info: Info) -> Iterator[StoreChecksum]:
    """The md5 in a single-part object's ETag, where `info` has one."""
    match = _SINGLE_PART_ETAG.match(str(info.get("ETag", "")))
    if match:
        yield StoreChecksum("md5-hex", match.group(1))


STORE = Store(
    name="s3",
    protocols=("s3", "s3a"),
    checksums=checksums,
    written_checksum="md5",
    one_put_bytes=ONE_PUT_BYTES,
    stamp_keys=("ETag", "VersionId", "LastModified"),
    # 404 is S3's answer; 400 and 410 stay broken as for GCS (ckptflow judged both stores by one rule).
    session_broke=broken_session_rule(session=("mpu",), statuses=frozenset({400, 404, 410})),
    connection_failures={"botocore.exceptions": ("HTTPClientError", "ConnectionError")},
)
