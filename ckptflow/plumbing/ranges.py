"""The one byte-range reader: exact ranges of files on any store, with one meaning of a short read.

Local files are read with `os.preadv` straight into the caller's buffers, never memory-mapped: a mapped
file that another process truncates kills the reader with SIGBUS when it touches a page past the new
end, while a read past the end simply comes back short. Other stores get one `fs.cat_ranges` call per
filesystem for a batch, so a batch of ranges costs one round of concurrent requests on a bucket, and
never a byte of read-ahead past a range.

A range that ends past the end of its file raises `ShortRead`, whoever reads it: a `CorruptFileError`
(the file is shorter than the index made of it says: it changed or was truncated) that is also an
`EOFError`. A store's own error propagates as raised; `read_error` turns one into the
`SourceReadError` a user reads.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence

import fsspec

from ckptflow.errors import CorruptFileError, SourceReadError
from ckptflow.plumbing.redaction import describe
from ckptflow.plumbing.storage import open_fs
from ckptflow.plumbing.stores.local import os_path

# A local source is opened without blocking, so that a FIFO swapped in for a checked file cannot hang
# the open (a read from it then fails); for a regular file the flag changes nothing.
READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0)

Read = tuple[str, int, memoryview]  # (uri, first byte, a writable view of the bytes to fill)


class ShortRead(CorruptFileError, EOFError):
    """A byte range ends past the end of its file: the file is shorter than the reader was told."""

    def __init__(self, uri: str, start: int, end: int, got: int) -> None:
        self.start, self.end, self.got = start, end, got
        super().__init__(f"{uri} ended at byte {start + got} while reading {end - start} bytes from byte {start}",
                         file=uri, uri=uri, expected=end - start, actual=got,
                         hint="the file changed or was truncated while being read; copy it again")


def read_error(uri: str, exc: OSError) -> SourceReadError:
    """A store's error while reading `uri`, as the one line a user reads."""
    return SourceReadError(f"cannot read {uri} ({describe(exc)})", file=uri,
                           hint="check access to the store (credentials, permissions, network) and retry")


class RangeReader:
    """Reads byte ranges into buffers; local files stay open while the reader lives (one descriptor
    per file and thread, so threads may share a reader), other stores are asked for exactly each
    range. Counts the bytes it read. Use as a context manager, or `close` it."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._lock = threading.Lock()
        self._opened: list[int] = []
        self.bytes_read = 0

    def __enter__(self) -> RangeReader:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def _fd(self, path: str) -> int:
        fds: dict[str, int] = self._local.__dict__.setdefault("fds", {})
        fd = fds.get(path)
        if fd is None:
            fd = fds[path] = os.open(path, READ_FLAGS)
            with self._lock:
                self._opened.append(fd)
        return fd

    def fill(self, reads: Sequence[Read]) -> None:
        """Fill each view with the bytes of its file from its first byte: local files one after the
        other, those on a store in one round of concurrent requests per filesystem. `ShortRead` when a
        file ends early; a store's error as raised."""
        done = 0
        remote: list[tuple[str, int, memoryview]] = []
        for uri, start, view in reads:
            if not len(view):
                continue
            path = os_path(uri)
            if path is None:
                remote.append((uri, start, view))
                continue
            fd, pos = self._fd(path), 0
            while pos < len(view):
                n = os.preadv(fd, [view[pos:]], start + pos)
                if n <= 0:
                    raise ShortRead(uri, start, start + len(view), pos)
                pos += n
            done += pos
        blobs = _cat_ranges([(uri, start, start + len(view)) for uri, start, view in remote])
        for (_uri, _start, view), blob in zip(remote, blobs):
            view[:] = blob
            done += len(view)
        self._count(done)

    def fetch(self, ranges: Sequence[tuple[str, int, int]]) -> list[bytes]:
        """The bytes of each (uri, start, end), read as `fill` reads them."""
        out: list[bytes] = [b""] * len(ranges)
        remote = []
        for i, (uri, start, end) in enumerate(ranges):
            path = os_path(uri)
            if path is None:
                remote.append(i)
            elif end > start:
                out[i] = os.pread(self._fd(path), end - start, start)
                if len(out[i]) != end - start:
                    raise ShortRead(uri, start, end, len(out[i]))
        for i, blob in zip(remote, _cat_ranges([ranges[i] for i in remote])):
            out[i] = blob
        self._count(sum(len(b) for b in out))
        return out

    def _count(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_read += nbytes

    def close(self) -> None:
        with self._lock:
            opened, self._opened = self._opened, []
            self._local = threading.local()
        for fd in opened:
            os.close(fd)


def read_into(reads: Sequence[tuple[str, int, int, memoryview]]) -> None:
    """Fill buffers from byte ranges: each read is (uri, start, end, a writable view of end - start
    bytes); local descriptors are closed on return."""
    with RangeReader() as reader:
        reader.fill([(uri, start, view[:end - start]) for uri, start, end, view in reads])


def read_ranges(ranges: Sequence[tuple[str, int, int]]) -> list[bytes]:
    """The bytes of each (uri, start, end); local descriptors are closed on return."""
    with RangeReader() as reader:
        return reader.fetch(ranges)


def _cat_ranges(ranges: Sequence[tuple[str, int, int]]) -> list[bytes]:
    """The bytes of each (uri, start, end) on a store: one `cat_ranges` call per filesystem."""
    out: list[bytes] = [b""] * len(ranges)
    groups: dict[int, tuple[fsspec.AbstractFileSystem, list[tuple[int, str]]]] = {}
    for i, (uri, start, end) in enumerate(ranges):
        if end > start:
            fs, path = open_fs(uri)
            groups.setdefault(id(fs), (fs, []))[1].append((i, path))
    for fs, items in groups.values():
        blobs = fs.cat_ranges([p for _, p in items], [ranges[i][1] for i, _ in items],
                              [ranges[i][2] for i, _ in items], on_error="return")
        for (i, _path), blob in zip(items, blobs):
            if isinstance(blob, BaseException):
                raise blob
            uri, start, end = ranges[i]
            if len(blob) != end - start:
                raise ShortRead(uri, start, end, min(len(blob), end - start))
            out[i] = blob
    return out
