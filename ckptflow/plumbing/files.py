"""Input files read safely: regular files only, bounded sizes, bounded JSON.

Every reader of a file that sits beside a checkpoint (`latest`, config and tokenizer files, the files
reshard carries over), of a folder to push and of what a push finds at DEST goes through here:

- `check_regular(uri)` / `open_regular(uri)`: the file must be a regular file. A FIFO (opening it
  would block), a device (`/dev/zero` never ends), a socket, a folder, a link to nothing, a link loop
  and, with `inside=ROOT`, a link that leads out of ROOT are refused with an `UnsafeInputError` that
  names the file and says what it is. Local files are opened with `O_NONBLOCK` and checked with
  `fstat` on the open descriptor, so a file swapped for a FIFO after the check still cannot hang.
- `read_regular(uri, limit=...)`: the whole file, refused (not read) when larger than `limit`.
- `copy_regular(src, dst)`: a regular file copied in bounded chunks; a failed read is a
  `SourceReadError`, a failed write (a full disk, a refused upload) an `OutputError`.
- `load_json(data)`: JSON nested at most `MAX_JSON_DEPTH` levels (json's own recursion would give
  a `RecursionError`; a structure that deep is never a config, manifest or header).

Objects in a bucket are always regular; there only the size limits and folders apply.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import posixpath
import stat
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any, cast

from ckptflow.errors import CheckpointNotFoundError, CkptflowError, OutputError, SourceReadError, UnsafeInputError
from ckptflow.plumbing.direct import BLOCK, BlockWriter, aligned_buffer, open_direct
from ckptflow.plumbing.redaction import describe
from ckptflow.plumbing.sizes import format_size
from ckptflow.plumbing.storage import open_fs
from ckptflow.plumbing.stores.local import os_path
from ckptflow.plumbing.text import excerpt

# JSON we parse (configs, provenance, manifests, safetensors headers) nests a handful of levels.
MAX_JSON_DEPTH = 64

_KINDS = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a folder"),
)


class JsonTooDeep(ValueError):
    """JSON nested deeper than the reader allows."""


def kind_of(mode: int) -> str:
    """What a file of `st_mode` is, in words ("a FIFO ...", "a folder", "a regular file")."""
    if stat.S_ISREG(mode):
        return "a regular file"
    return next((what for test, what in _KINDS if test(mode)), "not a regular file")


def _within(path: str, root: str) -> bool:
    return path == root or os.path.commonpath([path, root]) == root


def check_regular(uri: str, *, inside: str | None = None, hint: str | None = None) -> int:
    """The size of the regular file at `uri`; `UnsafeInputError` (or `CheckpointNotFoundError` when
    nothing is there) for anything else. With `inside`, a local link must resolve inside that folder (an
    `inside` in a store, where there are no links, is no constraint)."""
    hint = hint or "replace it with a regular file or remove it"
    path = os_path(uri)
    if path is None:
        fs, key = open_fs(uri)
        try:
            info = fs.info(key)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{uri} does not exist", file=uri, hint=hint) from None
        if info.get("type", "file") != "file":
            raise UnsafeInputError(f"{uri} is a folder, not a file", code="not-a-regular-file", file=uri, hint=hint)
        return int(info.get("size") or 0)
    try:
        link = os.lstat(path)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{uri} does not exist", file=uri, hint=hint) from None
    if stat.S_ISLNK(link.st_mode):
        target = os.readlink(path)
        try:
            st = os.stat(path)
        except OSError as exc:
            what = "a link loop" if exc.errno == errno.ELOOP else "nothing" if exc.errno == errno.ENOENT else \
                f"something unreadable ({exc.strerror})"
            raise UnsafeInputError(f"{uri} is a symbolic link to {what} ({excerpt(target, 120)})",
                                   code="not-a-regular-file", file=uri, hint=hint) from None
    else:
        st = link
    root = None if inside is None else os_path(inside)
    if root is not None and not _within(os.path.realpath(path), os.path.realpath(root)):
        raise UnsafeInputError(
            f"{uri} leads to {excerpt(os.path.realpath(path), 120)} through a symbolic link, outside {inside}",
            code="link-outside", file=uri, hint="copy the file into the folder or remove the link",
        )
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeInputError(f"{uri} is {kind_of(st.st_mode)}, not a regular file", code="not-a-regular-file",
                               file=uri, hint=hint)
    return st.st_size


@contextlib.contextmanager
def open_regular(uri: str, *, inside: str | None = None, hint: str | None = None) -> Iterator[IO[bytes]]:
    """The regular file at `uri` open for reading (see `check_regular`)."""
    check_regular(uri, inside=inside, hint=hint)
    path = os_path(uri)
    if path is None:
        fs, key = open_fs(uri)
        with fs.open(key, "rb") as fh:
            yield fh
        return
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):  # swapped after the check
            raise UnsafeInputError(f"{uri} is {kind_of(mode)}, not a regular file", code="not-a-regular-file",
                                   file=uri, hint=hint or "replace it with a regular file or remove it")
        os.set_blocking(fd, True)
        fh = os.fdopen(fd, "rb")
    except BaseException:  # cleanup, re-raised: the descriptor must not leak, whatever stopped us
        os.close(fd)
        raise
    with fh:
        yield fh


def read_regular(uri: str, *, limit: int, what: str = "file", inside: str | None = None,
                 hint: str | None = None) -> bytes:
    """The bytes of the regular file at `uri`, at most `limit` of them: a larger file is refused
    (`UnsafeInputError`, code `too-large`) without being read."""
    with open_regular(uri, inside=inside, hint=hint) as fh:
        size = os.fstat(fh.fileno()).st_size if os_path(uri) is not None else None
        data = fh.read(limit + 1) if size is None or size <= limit else b""
        if size is not None and size > limit or len(data) > limit:
            raise UnsafeInputError(
                f"{uri} holds {format_size(size) if size is not None else 'more than ' + format_size(limit)}, more "
                f"than a {what} can ({format_size(limit)} at most)", code="too-large", file=uri,
                hint=hint or "it is not the file its name says; replace or remove it",
            )
    return data


COPY_CHUNK = 8 << 20
COPY_THREADS = 4  # copies at once in `copy_all`
DIRECT_MIN = 1 << 20  # local copies this large or larger are written with direct I/O


def copy_regular(src: str, dst: str, *, inside: str | None = None, hint: str | None = None, durable: bool = False,
                 chunk: int = COPY_CHUNK) -> int:
    """Copy the regular file `src` (see `check_regular`) to `dst`, creating its folder; returns the bytes
    copied. With `durable`, a local `dst` is flushed to disk before returning. A local file of a megabyte
    or more copied to a local `dst` is written with direct I/O where the file system takes it
    (`_copy_direct`)."""
    dst_fs, dst_path = open_fs(dst)
    local_dst = os_path(dst)
    copied = 0
    with open_regular(src, inside=inside, hint=hint) as fin:
        try:
            dst_fs.makedirs(posixpath.dirname(dst_path), exist_ok=True)
            if os_path(src) is not None and local_dst is not None and os.fstat(fin.fileno()).st_size >= DIRECT_MIN:
                direct = _copy_direct(fin, src, local_dst, chunk, durable)
                if direct is not None:
                    return direct
            with dst_fs.open(dst_path, "wb") as fout:
                while data := _read(fin, src, chunk):
                    fout.write(data)
                    copied += len(data)
                if durable and local_dst is not None:
                    fout.flush()
                    os.fsync(fout.fileno())
        except CkptflowError:
            raise
        except OSError as exc:  # the write side: a full disk, a refused upload, a folder in the way
            raise _write_error(dst, exc) from exc
    return copied


def _copy_direct(fin: IO[bytes], src: str, path: str, chunk: int, durable: bool) -> int | None:
    """Copy `fin` to the local file `path` with direct I/O (`plumbing.direct`): the bytes go from one
    page-aligned buffer to the disk and never fill the page cache, so the file costs nothing to flush
    afterwards (buffered, the 805 MB of expert files a MoE reshard carries took as long again to
    fsync as to copy, here). None, with `path` left empty, where the file system refuses direct I/O."""
    with open(path, "wb") as fout:
        direct = open_direct(path)
        if direct < 0:
            return None
        buffer = aligned_buffer(chunk + BLOCK)
        try:
            with memoryview(buffer) as view:
                blocks, copied = BlockWriter(fout.fileno(), direct), 0
                while True:
                    place = BlockWriter.place(copied)
                    n = _read(fin, src, view[place:place + chunk])
                    if not n:
                        break
                    blocks.write(view, copied, n)
                    copied += n
                blocks.close()
            os.ftruncate(fout.fileno(), copied)  # the direct-I/O probe wrote a whole block
            if durable:
                os.fsync(fout.fileno())
        finally:
            os.close(direct)
            buffer.close()
    return copied


def copy_all(copies: Sequence[tuple[str, str]], *, inside: str | None = None, hint: str | None = None,
             threads: int = COPY_THREADS) -> int:
    """`copy_regular(src, dst)` for each pair, up to `threads` at once (each copy waits on a disk or a
    store); returns the bytes copied. The first failure is raised once the copies under way end; the
    queued ones are dropped. Nothing is flushed: the caller's commit fsyncs the staged files together
    (`plumbing.staging.commit`), which is what makes thousands of small files cheap. An fsync after
    each file costs a journal commit each: the 512 expert files of an AutoEP checkpoint took 1.2 to
    1.7 s one after another with an fsync each, 0.85 to 0.93 s on 4 threads and flushed together."""
    if len(copies) < 2 or threads < 2:
        return sum(copy_regular(src, dst, inside=inside, hint=hint) for src, dst in copies)
    pool = ThreadPoolExecutor(max_workers=min(threads, len(copies)), thread_name_prefix="ckptflow-copy")
    try:
        futures = [pool.submit(copy_regular, src, dst, inside=inside, hint=hint) for src, dst in copies]
        return sum(future.result() for future in futures)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _read(fh: IO[bytes], uri: str, size_or_view: int | memoryview) -> Any:
    """`fh.read(size)` (bytes) or `fh.readinto(view)` (a count); a failed read is a `SourceReadError`.
    Every file `open_regular` gives (a buffered local file, an fsspec file) reads into a buffer."""
    try:
        if isinstance(size_or_view, int):
            return fh.read(size_or_view)
        return cast(io.BufferedIOBase, fh).readinto(size_or_view) or 0
    except OSError as exc:
        raise SourceReadError(f"cannot read {uri} ({_reason(exc)})", file=uri,
                              hint="check the file and run again") from exc


def write_bytes(dst: str, data: bytes) -> None:
    """Write `data` as the file `dst`, whole or not at all: locally into a temporary sibling renamed
    over `dst` (so a reader never sees half of it, and a link or FIFO already at `dst` is replaced,
    never written through), elsewhere as one object. An `OutputError` when that fails."""
    fs, path = open_fs(dst)
    target = os_path(dst)
    try:
        if target is None:
            fs.pipe_file(path, data)
            return
        folder = os.path.dirname(os.path.abspath(target))
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(target)}.", suffix=".tmp", dir=folder)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            os.replace(tmp, target)
        except BaseException:  # cleanup, re-raised: no temporary file is left, whatever stopped us
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError as exc:
        raise _write_error(dst, exc) from exc


def _write_error(dst: str, exc: OSError) -> CkptflowError:
    return OutputError(f"cannot write {dst} ({_reason(exc)})", file=dst,
                       hint="check the destination is writable and has room, then run again")


def _reason(exc: OSError) -> str:
    return exc.strerror if exc.strerror else describe(exc)


def load_json(data: bytes | str, *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """`json.loads(data)`, refusing (`JsonTooDeep`, a `ValueError`) documents nested deeper than
    `max_depth`. Every other problem is the `ValueError` json raises (`UnicodeDecodeError` included)."""
    try:
        doc = json.loads(data)
    except RecursionError:
        raise JsonTooDeep(f"nested deeper than {max_depth} levels") from None
    if depth_of(doc, max_depth) > max_depth:
        raise JsonTooDeep(f"nested deeper than {max_depth} levels")
    return doc


def depth_of(doc: Any, stop: int) -> int:
    """How deeply lists and dicts nest in `doc` (a scalar is 0), counted without recursion; counting
    stops once it passes `stop`."""
    deepest = 0
    pending: list[tuple[Any, int]] = [(doc, 0)]
    while pending:
        node, depth = pending.pop()
        items: Iterable[Any]
        if isinstance(node, dict):
            items = node.values()
        elif isinstance(node, list):
            items = node
        else:
            continue
        depth += 1
        if depth > deepest:
            deepest = depth
            if deepest > stop:
                return deepest
        pending.extend((child, depth) for child in items if isinstance(child, dict | list))
    return deepest


__all__ = ["MAX_JSON_DEPTH", "JsonTooDeep", "check_regular", "copy_regular", "depth_of", "kind_of", "load_json",
           "open_regular", "read_regular", "write_bytes"]
