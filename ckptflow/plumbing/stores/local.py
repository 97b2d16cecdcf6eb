"""Files on this machine: plain paths and `file://` URLs.

The one place that says whether a URI is a local file (`os_path`): where a step takes a local fast
path (`preadv`, `O_DIRECT`, `fsync`, a rename, `lstat` checks for links and FIFOs), it asks
`os_path(uri)` and gets the path `os` functions take, or None for a URI in a store. Local files report
no content checksum; their modification time and creation time change when they are rewritten.
"""

from __future__ import annotations

from ckptflow.plumbing.stores import Store

STORE = Store(name="local", protocols=("file", "local"), local=True, stamp_keys=("mtime", "created"))


def is_local(uri: str) -> bool:
    """True when `uri` is a plain path or a `file://` URL."""
    return "://" not in uri or uri.startswith("file://")


def local_path(uri: str) -> str:
    """The local path of a plain path or `file://` URL."""
    return uri[len("file://"):] if uri.startswith("file://") else uri


def os_path(uri: str) -> str | None:
    """The path `os` functions take for `uri` when it is a local file (a plain path or a `file://`
    URL), else None: the one test for a local fast path."""
    return local_path(uri) if is_local(uri) else None
