"""What ckptflow knows about each kind of store, one module per backend (fsspec's `implementations/`).

A `Store` holds the traits of one backend, everything the steps ask of a store beyond fsspec's calls:

- `protocols`: the fsspec protocol names it serves; `local`: whether its paths are this machine's
  files (so that `os` calls, `preadv`, `O_DIRECT` and `rename` apply: `local.os_path`);
- `checksums(info)`: the content checksums an fsspec `info()` dict reports, preferred first, in the
  encodings `plumbing.checksums.Digests` compares; `written_checksum`: the one worth hashing while
  writing an object, and `one_put_bytes`: the size from which an object goes in parts, whose checksum
  the store does not report;
- `stamp_keys`: the `info()` keys that change whenever an object is rewritten (generation, ETag,
  mtime ...), which `stamp(info)` records and `plumbing.checksums.stamps_match` compares;
- `session_broke(target, exc)`: whether an error raised while writing `target` means its resumable
  upload session broke (the file starts over with a new one), rather than the store refusing the write;
- `connection_failures`: the store client's exception classes that mean a dropped connection or a
  timeout, by module (`plumbing.retry` retries them).

`store_for(fs_or_uri)` gives the traits of a filesystem or URI (`store_named(protocol)` of a protocol
name). A protocol that no backend module serves gets `OTHER`: every checksum and stamp key any backend
reports is read from its `info()`, none is computed while writing.

Adding a backend (Azure, the Hub's storage buckets) is one file: a module in this package, named
after it, that defines `STORE = Store(...)`. The package finds its modules when first asked
(`backends()`); nothing else lists them. A module whose name starts with `_` is not a backend.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import fsspec

from ckptflow.plumbing.checksums import Digests, StoreChecksum
from ckptflow.plumbing.failures import causes, status_code

Info = Mapping[str, Any]  # an fsspec `info()` dict, or one entry of a detailed listing


def no_checksums(info: Info) -> Iterable[StoreChecksum]:
    """For stores that report no content checksum (local files, memory): nothing."""
    return ()


def never_broken(target: Any, exc: BaseException) -> bool:
    """For stores without resumable upload sessions: no error means a broken one."""
    return False


@dataclass(frozen=True, kw_only=True)
class Store:
    """The traits of one kind of store (see the module docstring)."""

    name: str
    protocols: tuple[str, ...]
    local: bool = False
    checksums: Callable[[Info], Iterable[StoreChecksum]] = no_checksums
    written_checksum: str | None = None  # 'crc32c' or 'md5': reported for every object written in one go
    one_put_bytes: int | None = None  # objects of at least this size go in parts (no checksum reported)
    stamp_keys: tuple[str, ...] = ()
    session_broke: Callable[[Any, BaseException], bool] = never_broken
    connection_failures: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.written_checksum not in (None, "crc32c", "md5"):
            raise ValueError(f"written_checksum must be 'crc32c', 'md5' or None, got {self.written_checksum!r}")

    def checksum(self, info: Info) -> StoreChecksum | None:
        """The content checksum in `info`, the store's preferred one; None when it reports none."""
        return next(iter(self.checksums(info)), None)

    def stamp(self, info: Info) -> dict[str, str]:
        """What identifies this version of the object at the store: its size and `stamp_keys`.

        Equal stamps mean the object was not rewritten since the stamp was taken."""
        out = {"size": str(info.get("size"))}
        for key in self._stamped():
            if info.get(key) is not None:
                out[key] = str(info[key])
        return out

    def _stamped(self) -> tuple[str, ...]:
        return self.stamp_keys

    def digests(self, size: int) -> Digests | None:
        """Digests worth computing while writing `size` bytes here: those the store will report back.
        None where it reports none (local files, memory, an S3 object sent in parts)."""
        if self.written_checksum is None or (self.one_put_bytes is not None and size >= self.one_put_bytes):
            return None
        return Digests(sha256=False, crc32c=self.written_checksum == "crc32c", md5=self.written_checksum == "md5")

    @property
    def reports_md5(self) -> bool:
        """Whether the checksum the store reports for what is written is an md5 (S3's ETag)."""
        return self.written_checksum == "md5"


def broken_session_rule(*, session: tuple[str, ...], statuses: frozenset[int]) -> Callable[[Any, BaseException], bool]:
    """`session_broke` for a store whose open upload keeps its session in one of the attributes
    `session` (gcsfs `location`, s3fs `mpu`): `exc` broke it when it carries one of `statuses` or is a
    `FileNotFoundError`, and only once a session exists (a 404 when starting one is a missing bucket,
    which stays permanent), never for 401 or 403."""

    def session_broke(target: Any, exc: BaseException) -> bool:
        if all(getattr(target, name, None) is None for name in session):
            return False
        codes = {status_code(link) for link in causes(exc)} - {None}
        if codes & {401, 403}:
            return False
        return bool(codes & statuses) or any(isinstance(link, FileNotFoundError) for link in causes(exc))

    return session_broke


def protocol(fs: fsspec.AbstractFileSystem) -> str:
    """The filesystem's main protocol name ('file', 'gs', 's3', 'memory', ...)."""
    proto = fs.protocol
    return str(proto[0] if isinstance(proto, (tuple, list)) else proto)


@functools.cache
def backends() -> tuple[Store, ...]:
    """The `STORE` of every backend module in this package, by module name."""
    found = []
    for module in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if not module.name.startswith("_"):
            found.append(importlib.import_module(f"{__name__}.{module.name}").STORE)
    return tuple(found)


@functools.cache
def _by_protocol() -> dict[str, Store]:
    out: dict[str, Store] = {}
    for store in backends():
        for name in store.protocols:
            if name in out:
                raise RuntimeError(f"stores {out[name].name} and {store.name} both claim the protocol {name!r}")
            out[name] = store
    return out


def store_named(name: str) -> Store:
    """The store that serves the fsspec protocol `name` ('gs', 's3', 'file' ...), else `OTHER`."""
    return _by_protocol().get(name, OTHER)


def store_for(where: fsspec.AbstractFileSystem | str) -> Store:
    """The store of an fsspec filesystem, or of a URI: a plain path or a `file://` URL is a local
    file; any other URL's store is its protocol's."""
    if not isinstance(where, str):
        return store_named(protocol(where))
    scheme, sep, _ = where.partition("://")
    return store_named(scheme if sep and scheme != "file" else "file")


def digests_for(protocol_name: str, size: int) -> Digests | None:
    """`Store.digests(size)` of the store serving `protocol_name`."""
    return store_named(protocol_name).digests(size)


def _any_checksum(info: Info) -> Iterable[StoreChecksum]:
    for store in backends():
        yield from store.checksums(info)


def _all_stamp_keys() -> tuple[str, ...]:
    # The order of the stamps ckptflow wrote before it knew stores apart; any other key after them.
    known = ("generation", "crc32c", "md5Hash", "ETag", "etag", "VersionId", "mtime", "LastModified", "created")
    keys = {key for store in backends() for key in store.stamp_keys}
    return tuple(k for k in known if k in keys) + tuple(sorted(keys - set(known)))


class _Other(Store):
    """A store no backend module serves: every checksum and stamp key a backend knows is read, none is
    computed while writing, and a write that holds any known kind of upload session can break it."""

    def checksum(self, info: Info) -> StoreChecksum | None:
        return next(iter(_any_checksum(info)), None)

    def _stamped(self) -> tuple[str, ...]:
        return _all_stamp_keys()


def _other_session_broke(target: Any, exc: BaseException) -> bool:
    return any(store.session_broke(target, exc) for store in backends())


OTHER: Store = _Other(name="other", protocols=(), session_broke=_other_session_broke)

__all__ = [
    "OTHER",
    "Info",
    "Store",
    "backends",
    "broken_session_rule",
    "digests_for",
    "never_broken",
    "no_checksums",
    "protocol",
    "store_for",
    "store_named",
]
