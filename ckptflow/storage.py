"""URIs in, fsspec filesystems out.

URIs stay strings everywhere in ckptflow; this module is the one place that turns them into an fsspec
filesystem, through `fsspec.core.url_to_fs`, so the user's fsspec configuration (FSSPEC_GCS_TOKEN,
FSSPEC_S3_ENDPOINT_URL, config files) applies to `gs://`, `s3://`, `memory://` and local paths alike.
"""

from __future__ import annotations

import os
from typing import Any

import fsspec
from fsspec.core import url_to_fs

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


def open_fs(uri: str, **storage_options: Any) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem for `uri` and the path inside it (no trailing slash)."""
    fs, path = url_to_fs(uri, **storage_options)
    return fs, path.rstrip("/") or path


def join(uri: str, *parts: str) -> str:
    """`uri` with `parts` appended by '/', keeping its protocol."""
    out = uri.rstrip("/")
    for part in parts:
        out = f"{out}/{part.strip('/')}"
    return out


def is_local(uri: str) -> bool:
    """True when `uri` is a plain path or a `file://` URL."""
    return "://" not in uri or uri.startswith("file://")


def local_path(uri: str) -> str:
    """The local path of a plain path or `file://` URL."""
    return uri[len("file://"):] if uri.startswith("file://") else uri


def protocol(fs: fsspec.AbstractFileSystem) -> str:
    """The filesystem's main protocol name ('file', 'gs', 's3', 'memory', ...)."""
    proto = fs.protocol
    return proto[0] if isinstance(proto, (tuple, list)) else proto


def unstrip(fs: fsspec.AbstractFileSystem, path: str) -> str:
    """A URI for `path` inside `fs`, usable with `open_fs` again."""
    proto = protocol(fs)
    if proto == "file":
        return path
    return f"{proto}://{path.lstrip('/')}" if proto != "memory" else f"memory://{path}"
