"""Torch zip archives (`torch.save` files), written as a stream from byte ranges of other files.

`torch.save` needs every tensor in memory. Resharding writes files far larger than the memory it may
use, so this module writes the same format without ever holding a tensor: the object tree is pickled
with `OutTensor` stand-ins whose `OutStorage` says which byte ranges of which source files fill it
(zeros elsewhere), and each storage is then streamed into the archive in bounded chunks, front to
back or, for a local file, by several threads writing pieces in place.

The archive is what `torch.save` writes (torch 2.x, checked against 2.13): records `data.pkl`,
`.format_version`, `.storage_alignment`, `byteorder`, `data/<key>` for each storage in key order,
`version` and `.data/serialization_id` (derived from the records, as torch derives it:
`formats.serialization_id`), each stored uncompressed, data aligned to 64 bytes with an `FB` extra
field, sizes and CRC-32 in a data descriptor (flag bit 3) and zip64 end records. `torch.load` (and
DeepSpeed, which calls it) reads these files as its own. Nothing random goes in: the same object and
sources give the same bytes, whoever writes them.

Pickling and writing are two steps, so that they can happen in different processes: `dumps(obj)` gives
the pickle and its `OutStorage`s (byte ranges of source files, small), and `write_pickled` streams
them into an archive; `write_archive(uri, obj, ...)` does both.
"""

from __future__ import annotations

import io
import mmap
import os
import pickle
import queue
import struct
import threading
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, BinaryIO

from ckptflow.errors import CkptflowError, CorruptFileError, OutputError
from ckptflow.formats.serialization_id import serialization_id
from ckptflow.formats.torchzip import DTYPE_SIZES, STORAGE_DTYPES, read_error
from ckptflow.plumbing.direct import BLOCK, aligned_buffer, open_direct, pwrite_all
from ckptflow.plumbing.progress import Progress, Tally
from ckptflow.plumbing.storage import is_local, local_path, open_fs
from ckptflow.plumbing.redaction import describe

import numpy as np
from isal.isal_zlib import crc32, crc32_combine  # ISA-L's CRC-32 runs at several GB/s; zlib's at well under one

STORAGE_CLASSES: dict[str, str] = {dtype: cls for cls, (dtype, _size) in STORAGE_DTYPES.items()}
ALIGNMENT = 64
CHUNK_BYTES = 8 << 20
SEGMENT_BYTES = 64 << 20  # the unit of work when several threads write one archive
_MAX32 = 0xFFFFFFFF
_ZIP64_LIMIT = _MAX32  # sizes and offsets from here on go to zip64 fields (lowered by tests)
_FLAGS = 0x0808  # sizes in a data descriptor; UTF-8 names (what torch writes)

Advance = Callable[[int], None]  # inside the writer: source bytes just copied (from any thread)


@dataclass(frozen=True, slots=True)
class Span:
    """`length` bytes from byte `start` of the file at `uri`, placed at byte `dst` of a storage. With
    `rows` > 1 they are that many equal rows, row i placed at `dst + i * stride` (a row-parallel shard:
    its rows back to back in the source, a full row apart in the storage)."""

    uri: str
    start: int
    length: int
    dst: int
    rows: int = 1
    stride: int = 0

    @property
    def end(self) -> int:
        """One past the last storage byte it fills."""
        return self.dst + (self.rows - 1) * self.stride + self.length // self.rows


class OutStorage:
    """A storage to be written: its dtype, element count and the source spans that fill it.

    Plain spans must not overlap (checked). Strided spans interleave (rank 0's rows, then rank 1's,
    within each row of the storage); their rows come from runs whose coverage the checkpoint's index
    checked, so only their bounds are checked here, and `reach` (the furthest byte any span up to
    each one fills) lets a window find the spans it meets."""

    __slots__ = ("dtype", "numel", "spans", "strided", "reach", "gaps")

    def __init__(self, dtype: str, numel: int, spans: Iterable[Span] = ()) -> None:
        if dtype not in STORAGE_CLASSES:
            raise ValueError(f"no torch storage class for dtype {dtype!r}")
        self.dtype = dtype
        self.numel = numel
        self.spans = sorted(spans, key=lambda s: s.dst)
        self.strided = any(span.rows > 1 for span in self.spans)
        end = 0
        self.reach: list[int] = []
        for span in self.spans:
            assert span.length >= 0 and span.rows >= 1 and span.length % span.rows == 0, "a malformed span"
            assert span.rows == 1 or span.stride >= span.length // span.rows, "a span's rows overlap"
            assert self.strided or span.dst >= end, "overlapping spans in a storage"
            end = max(end, span.end)
            self.reach.append(end)
        assert end <= self.nbytes, "spans reach past the storage"
        filled = self.source_bytes
        assert filled <= self.nbytes, "overlapping spans in a storage"
        self.gaps = filled < self.nbytes  # some bytes are no span's: zeros

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_SIZES[self.dtype]

    @property
    def source_bytes(self) -> int:
        return sum(s.length for s in self.spans)


class OutTensor:
    """A tensor view of an `OutStorage`, pickled exactly as torch pickles a CPU tensor."""

    __slots__ = ("storage", "offset", "shape", "stride")

    def __init__(self, storage: OutStorage, offset: int = 0, shape: tuple[int, ...] | None = None,
                 stride: tuple[int, ...] | None = None) -> None:
        self.storage = storage
        self.offset = offset
        self.shape = tuple(shape) if shape is not None else (storage.numel,)
        self.stride = tuple(stride) if stride is not None else _contiguous_stride(self.shape)


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, step = [], 1
    for dim in reversed(shape):
        stride.append(step)
        step *= max(dim, 1)
    return tuple(reversed(stride))


class Global:
    """A module-level name (class, function, dtype) written into the pickle by name, never imported.

    Writing needs neither torch nor DeepSpeed in the process: the pickle only names them, and they are
    imported when the file is loaded.
    """

    __slots__ = ("module", "name")

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def __repr__(self) -> str:
        return f"Global({self.module}.{self.name})"


class Call:
    """`func(*args)` at load time, as pickle writes objects that reduce to a call (torch.Size, enums)."""

    __slots__ = ("func", "args")

    def __init__(self, func: Global, args: tuple[Any, ...]) -> None:
        self.func, self.args = func, tuple(args)


class Instance:
    """An instance of class `cls` restored from `state` without `__init__`, as pickle writes plain
    objects (`cls.__new__(cls, *args)`, then `__setstate__` or `__dict__.update(state)`)."""

    __slots__ = ("cls", "args", "state")

    def __init__(self, cls: Global, state: Any, args: tuple[Any, ...] = ()) -> None:
        self.cls, self.state, self.args = cls, state, tuple(args)


REBUILD_TENSOR = Global("torch._utils", "_rebuild_tensor_v2")
_STORAGE_GLOBALS = {dtype: Global("torch", cls) for dtype, cls in STORAGE_CLASSES.items()}


class _Pickler(pickle._Pickler):  # the Python implementation: its dispatch table can be extended
    dispatch = dict(pickle._Pickler.dispatch)

    def __init__(self, file: BinaryIO) -> None:
        super().__init__(file, protocol=2)
        self.storages: list[OutStorage] = []
        self.keys: dict[int, str] = {}

    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, OutStorage):
            return None
        key = self.keys.get(id(obj))
        if key is None:
            key = self.keys[id(obj)] = str(len(self.storages))
            self.storages.append(obj)
        return ("storage", _STORAGE_GLOBALS[obj.dtype], key, "cpu", obj.numel)

    def save_global_name(self, obj: Global) -> None:
        self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode("utf-8"))
        self.memoize(obj)

    def save_call(self, obj: Call) -> None:
        self.save(obj.func)
        self.save(obj.args)
        self.write(pickle.REDUCE)
        self.memoize(obj)

    def save_instance(self, obj: Instance) -> None:
        self.save(obj.cls)
        self.save(obj.args)
        self.write(pickle.NEWOBJ)
        self.memoize(obj)
        self.save(obj.state)
        self.write(pickle.BUILD)

    def save_tensor(self, obj: OutTensor) -> None:
        self.save_call(Call(REBUILD_TENSOR, (obj.storage, obj.offset, obj.shape, obj.stride, False, OrderedDict())))

    dispatch[Global] = save_global_name
    dispatch[Call] = save_call
    dispatch[Instance] = save_instance
    dispatch[OutTensor] = save_tensor


def dumps(obj: Any) -> tuple[bytes, list[OutStorage]]:
    """The pickle of `obj` (protocol 2, as torch writes it) and its storages in key order.

    `obj` is plain data (dicts, lists, tuples, numbers, strings, OrderedDicts) with `OutTensor`,
    `Global`, `Call` and `Instance` stand-ins for everything torch or DeepSpeed would pickle.
    """
    buf = io.BytesIO()
    pickler = _Pickler(buf)
    pickler.dump(obj)
    return buf.getvalue(), pickler.storages


class SourceReader:
    """Reads byte ranges of source files, keeping local files open (one handle per file and thread, so
    threads may share a reader) and asking other stores for exactly each range (one request per
    chunk, no read-ahead past it); counts what it read."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES, depth: int = 3) -> None:
        self.chunk_bytes = chunk_bytes
        self.depth = depth
        self._local = threading.local()
        self._lock = threading.Lock()
        self._opened: list[BinaryIO] = []
        self.bytes_read = 0

    def _file(self, uri: str) -> BinaryIO:
        files = self._local.__dict__.setdefault("files", {})
        fh = files.get(uri)
        if fh is None:
            fh = open(local_path(uri), "rb", buffering=0)
            files[uri] = fh
            with self._lock:
                self._opened.append(fh)
        return fh

    def read_into(self, uri: str, start: int, view: memoryview) -> None:
        """Fill `view` with the bytes of `uri` from byte `start`; a failed read is a `SourceReadError`."""
        got = 0
        try:
            if is_local(uri):
                fh = self._file(uri)
                fh.seek(start)
                while got < len(view):
                    n = fh.readinto(view[got:])
                    if not n:
                        break
                    got += n
            elif len(view):
                fs, path = open_fs(uri)
                data = fs.cat_file(path, start=start, end=start + len(view))
                got = min(len(data), len(view))
                view[:got] = data[:got]
        except OSError as exc:
            raise read_error(uri, exc) from exc
        if got < len(view):
            raise _cut_short(uri, start, len(view), got)
        with self._lock:
            self.bytes_read += got

    def read_many(self, reads: Sequence[tuple[str, int, memoryview]]) -> None:
        """`read_into` for several (uri, start, view) at once: local files one after the other, those on
        a bucket in one round of concurrent requests per store (a window's rows from every rank)."""
        stores: dict[int, tuple[Any, list[tuple[str, str, int, memoryview]]]] = {}
        for uri, start, view in reads:
            if is_local(uri):
                self.read_into(uri, start, view)
            elif len(view):
                fs, path = open_fs(uri)
                stores.setdefault(id(fs), (fs, []))[1].append((uri, path, start, view))
        for fs, items in stores.values():
            try:
                blobs = fs.cat_ranges([i[1] for i in items], [i[2] for i in items],
                                      [i[2] + len(i[3]) for i in items], on_error="return")
            except OSError as exc:
                raise read_error(items[0][0], exc) from exc
            for (uri, _path, start, view), blob in zip(items, blobs):
                if isinstance(blob, OSError):
                    raise read_error(uri, blob) from blob
                if isinstance(blob, BaseException):
                    raise blob
                if len(blob) != len(view):
                    raise _cut_short(uri, start, len(view), min(len(blob), len(view)))
                view[:] = blob
            with self._lock:
                self.bytes_read += sum(len(i[3]) for i in items)

    def close(self) -> None:
        with self._lock:
            opened, self._opened = self._opened, []
            self._local = threading.local()
        for fh in opened:
            fh.close()


def _cut_short(uri: str, start: int, length: int, got: int) -> CorruptFileError:
    return CorruptFileError(f"{uri} ended at byte {start + got} while reading {length} bytes from byte {start}",
                            file=uri, hint="the file changed or was truncated while being read; copy it again")


@dataclass(frozen=True)
class _Window:
    """Bytes [at, at + length) of a storage with strided spans, filled whole (`_fill_window`)."""

    storage: OutStorage
    at: int
    length: int


class _ReadAhead:
    """Reads a sequence of jobs on a background thread, `depth` chunks ahead of the consumer, so that
    reading the source overlaps checksumming and writing the output (the GIL is released in both): a
    plain span is read in chunks, a window of a strided storage is filled whole (its spans' rows read
    and placed) in one chunk buffer."""

    def __init__(self, reader: SourceReader, jobs: Iterable[Span | _Window]) -> None:
        self.reader = reader
        self.free: queue.Queue[memoryview] = queue.Queue()
        for _ in range(reader.depth):
            self.free.put(memoryview(bytearray(reader.chunk_bytes)))
        self.ready: queue.Queue[Any] = queue.Queue()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(list(jobs),), name="ckptflow-read-ahead", daemon=True)
        self.thread.start()

    def _buffer(self) -> memoryview | None:
        """A free chunk buffer, or None once the consumer stopped."""
        while not self.stop.is_set():
            try:
                return self.free.get(timeout=0.1)
            except queue.Empty:
                continue
        return None

    def _run(self, jobs: list[Span | _Window]) -> None:
        try:
            for job in jobs:
                if isinstance(job, _Window):
                    buffer = self._buffer()
                    if buffer is None:
                        return
                    view = buffer[:job.length]
                    self.ready.put((buffer, view, _fill_window(job.storage, job.at, view, self.reader, None)))
                    continue
                for offset in range(0, job.length, self.reader.chunk_bytes):
                    buffer = self._buffer()
                    if buffer is None:
                        return
                    view = buffer[: min(self.reader.chunk_bytes, job.length - offset)]
                    self.reader.read_into(job.uri, job.start + offset, view)
                    self.ready.put((buffer, view, len(view)))
        except BaseException as exc:  # handed to the consumer, raised there
            self.ready.put(exc)

    def chunks(self, nbytes: int) -> Iterator[tuple[memoryview, int]]:
        """The next `nbytes` bytes the reader thread has read (a span's, or a strided storage's windows),
        as (chunk, source bytes in it); each chunk is valid until the next."""
        while nbytes:
            item = self.ready.get()
            if isinstance(item, BaseException):
                raise item
            buffer, view, read = item
            try:
                yield view, read
            finally:
                self.free.put(buffer)
            nbytes -= len(view)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


class _ZipWriter:
    """The zip container torch uses, written front to back (the output need not be seekable). For
    records whose data other threads write in place (`_write_in_place`), `begin` writes the
    header, `skip` leaves room for the data and its descriptor, and `descriptor` gives that once the
    CRC is known."""

    def __init__(self, fh: BinaryIO, prefix: str) -> None:
        self.fh = fh
        self.prefix = prefix
        self.pos = 0
        self.entries: list[list[Any]] = []  # name, header offset, crc, size

    def _write(self, data: bytes | memoryview) -> None:
        self.fh.write(data)
        self.pos += len(data)

    def skip(self, nbytes: int) -> None:
        self.fh.seek(nbytes, os.SEEK_CUR)
        self.pos += nbytes

    def begin(self, name: str, size: int) -> int:
        """Write the local header of a `size`-byte record, whose data comes next; returns its entry."""
        raw_name = f"{self.prefix}/{name}".encode("utf-8")
        offset = self.pos
        if size >= _ZIP64_LIMIT:  # the zip64 extra fields miniz (torch's writer) puts in local headers
            extra = struct.pack("<HHQQ", 1, 16, size, size)
        elif offset >= _ZIP64_LIMIT:
            extra = struct.pack("<HHQ", 1, 8, offset)
        else:
            extra = b""
        pad = (-(offset + 30 + len(raw_name) + len(extra) + 4)) % ALIGNMENT
        extra += b"FB" + struct.pack("<H", pad) + b"Z" * pad
        self._write(struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 0, _FLAGS, 0, 0, 0, 0, 0, 0,
                                len(raw_name), len(extra)) + raw_name + extra)
        self.entries.append([raw_name, offset, 0, size])
        return len(self.entries) - 1

    def descriptor(self, entry: int, crc: int) -> bytes:
        """The data descriptor that follows `entry`'s data, recording its CRC-32 for the central directory."""
        _name, offset, _crc, size = self.entries[entry]
        self.entries[entry][2] = crc
        if size >= _ZIP64_LIMIT or offset >= _ZIP64_LIMIT:
            return struct.pack("<4sIQQ", b"PK\x07\x08", crc, size, size)
        return struct.pack("<4sIII", b"PK\x07\x08", crc, size, size)

    def record(self, name: str, chunks: Iterable[bytes | memoryview], size: int) -> None:
        entry = self.begin(name, size)
        crc, written = 0, 0
        for chunk in chunks:
            crc = crc32(chunk, crc)
            self._write(chunk)
            written += len(chunk)
        assert written == size, f"record {name}: wrote {written} bytes, planned {size}"
        self._write(self.descriptor(entry, crc))

    def close(self) -> None:
        start = self.pos
        for name, offset, crc, size in self.entries:
            fields, small_size, small_offset = [], size, offset
            if size >= _ZIP64_LIMIT:
                fields += [size, size]
                small_size = _MAX32
            if offset >= _ZIP64_LIMIT:
                fields.append(offset)
                small_offset = _MAX32
            extra = struct.pack(f"<HH{len(fields)}Q", 1, 8 * len(fields), *fields) if fields else b""
            self._write(struct.pack("<4sHHHHHHIIIHHHHHII", b"PK\x01\x02", 0, 0, _FLAGS, 0, 0, 0,
                                    crc, small_size, small_size, len(name), len(extra), 0, 0, 0, 0, small_offset)
                        + name + extra)
        end = self.pos
        count = len(self.entries)
        self._write(struct.pack("<4sQHHIIQQQQ", b"PK\x06\x06", 44, 0x031E, 45, 0, 0, count, count,
                                end - start, start))
        self._write(struct.pack("<4sIQI", b"PK\x06\x07", 0, end, 1))
        self._write(struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, min(count, 0xFFFF), min(count, 0xFFFF),
                                _MAX32 if end - start >= _ZIP64_LIMIT else end - start,
                                _MAX32 if start >= _ZIP64_LIMIT else start, 0))


_ZEROS = bytes(1 << 20)


def _storage_chunks(storage: OutStorage, source: _ReadAhead, progress: Advance | None) -> Iterator[memoryview | bytes]:
    if storage.strided:  # its windows, filled ahead on the reader thread
        for view, placed in source.chunks(storage.nbytes):
            yield view
            if progress is not None:
                progress(placed)
        return
    pos = 0
    for span in [*storage.spans, Span("", 0, 0, storage.nbytes)]:
        while pos < span.dst:
            n = min(span.dst - pos, len(_ZEROS))
            yield _ZEROS[:n]
            pos += n
        if span.length:
            for chunk, read in source.chunks(span.length):
                yield chunk
                if progress is not None:
                    progress(read)
            pos += span.length


def _read_jobs(storages: Sequence[OutStorage], chunk: int) -> Iterator[Span | _Window]:
    """What the read-ahead reads, in the order the archive is written: each plain span with bytes, each
    strided storage as windows of `chunk` bytes."""
    for storage in storages:
        if storage.strided:
            yield from (_Window(storage, a, min(chunk, storage.nbytes - a)) for a in range(0, storage.nbytes, chunk))
        else:
            yield from (span for span in storage.spans if span.length)


def _write_streamed(fh: BinaryIO, name: str, data: bytes, storages: list[OutStorage], reader: SourceReader,
                    progress: Advance | None) -> int:
    """The whole archive front to back, the source read a few chunks ahead on another thread."""
    zw = _ZipWriter(fh, name)
    _write_small_records(zw, data)
    source = _ReadAhead(reader, _read_jobs(storages, reader.chunk_bytes))
    try:
        for key, storage in enumerate(storages):
            zw.record(f"data/{key}", _storage_chunks(storage, source, progress), storage.nbytes)
    finally:
        source.close()
    _write_trailing_records(zw)
    zw.close()
    return zw.pos


def _write_small_records(zw: _ZipWriter, data: bytes) -> None:
    for record, content in (("data.pkl", data), (".format_version", b"1"),
                            (".storage_alignment", str(ALIGNMENT).encode()), ("byteorder", b"little")):
        zw.record(record, [content], len(content))


def _write_trailing_records(zw: _ZipWriter) -> None:
    zw.record("version", [b"3\n"], 2)
    records = [(name.decode("utf-8")[len(zw.prefix) + 1:], crc) for name, _offset, crc, _size in zw.entries]
    serial = serialization_id(records).encode()
    zw.record(".data/serialization_id", [serial], len(serial))


class _Layout:
    """Stands in for the file while `_ZipWriter` lays the archive out: keeps the small writes (headers,
    pickle, descriptors, central directory) with their offsets, to be written once the storages are."""

    def __init__(self) -> None:
        self.writes: list[tuple[int, bytes]] = []
        self.pos = 0

    def write(self, data: bytes | memoryview) -> int:
        self.writes.append((self.pos, bytes(data)))
        self.pos += len(data)
        return len(data)

    def seek(self, offset: int, whence: int) -> None:
        assert whence == os.SEEK_CUR
        self.pos += offset


def _write_in_place(path: str, name: str, data: bytes, storages: list[OutStorage], reader: SourceReader,
                    progress: Advance | None, threads: int) -> int:
    """The archive laid out first, its storages then filled in place by `threads` threads in
    `SEGMENT_BYTES` pieces, the rest written last.

    Whole blocks of storage data go out with O_DIRECT where the file system takes it: no copy into
    the page cache, which on large checkpoints costs more than reading the source. Everything else
    (headers, pickle, descriptors, the partial blocks at the ends of each storage, the central
    directory) is written through the page cache only after every direct write has finished, so the
    two never meet in one page. A record's CRC-32 is its pieces' CRCs combined.
    """
    layout = _Layout()
    zw = _ZipWriter(layout, name)  # type: ignore[arg-type]
    _write_small_records(zw, data)
    places = []  # (entry, storage, data offset in the file, descriptor offset)
    for key, storage in enumerate(storages):
        entry = zw.begin(f"data/{key}", storage.nbytes)
        at = zw.pos
        zw.skip(storage.nbytes)
        places.append((entry, storage, at, zw.pos))
        zw.skip(len(zw.descriptor(entry, 0)))
    data_end = zw.pos
    jobs = [(storage, at, x, y) for _entry, storage, at, _ in places for x, y in _piece_bounds(at, storage.nbytes)]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        os.ftruncate(fd, data_end)  # direct writes then stay inside the file
        direct = open_direct(path) if jobs else -1
        try:
            results = _fill_pieces(jobs, direct if direct >= 0 else fd, reader, progress, threads)
        finally:
            if direct >= 0:
                os.close(direct)
        edges: list[tuple[int, bytes]] = []
        crcs = iter(results)
        for entry, storage, at, descriptor_at in places:
            crc = 0
            for x, y in _piece_bounds(at, storage.nbytes):
                piece_crc, piece_edges = next(crcs)
                crc = crc32_combine(crc, piece_crc, y - x)
                edges += piece_edges
            layout.writes.append((descriptor_at, zw.descriptor(entry, crc)))
        _write_trailing_records(zw)
        zw.close()
        for offset, chunk in layout.writes + edges:
            pwrite_all(fd, chunk, offset)
        os.ftruncate(fd, zw.pos)  # the direct-I/O probe may have written past the end of a small file
    finally:
        os.close(fd)
    return zw.pos


def _piece_bounds(at: int, nbytes: int) -> list[tuple[int, int]]:
    """The pieces [x, y) of a storage whose data is at [at, at + nbytes) of the file: cut at each
    multiple of SEGMENT_BYTES, so that only a storage's two ends can fall inside a block."""
    cuts = [at, *range((at // SEGMENT_BYTES + 1) * SEGMENT_BYTES, at + nbytes, SEGMENT_BYTES), at + nbytes]
    return [(x, y) for x, y in zip(cuts, cuts[1:]) if y > x]


def _fill_pieces(jobs: list[tuple[OutStorage, int, int, int]], fd: int, reader: SourceReader,
                 progress: Advance | None, threads: int) -> list[tuple[int, list[tuple[int, bytes]]]]:
    """Run `_fill_piece` on every job with `threads` threads, each with its own block-aligned buffer;
    stops the others at the first error and raises it."""
    chunk = max(BLOCK, reader.chunk_bytes // BLOCK * BLOCK)
    buffers: queue.SimpleQueue[mmap.mmap] = queue.SimpleQueue()
    for _ in range(min(threads, len(jobs))):
        buffers.put(aligned_buffer(chunk + BLOCK))  # page-aligned memory, as direct I/O needs
    stop = threading.Event()

    def fill(job: tuple[OutStorage, int, int, int]) -> tuple[int, list[tuple[int, bytes]]]:
        buffer = buffers.get()
        try:
            return _fill_piece(fd, *job, reader, memoryview(buffer), chunk, stop, progress)
        finally:
            buffers.put(buffer)

    with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="ckptflow-write") as pool:
        futures = [pool.submit(fill, job) for job in jobs]
        wait(futures, return_when=FIRST_EXCEPTION)
        for future in futures:
            if future.done() and future.exception() is not None:
                stop.set()
                for other in futures:
                    other.cancel()
                raise future.exception()  # type: ignore[misc]
    return [future.result() for future in futures]


def _span_end(span: Span) -> int:
    return span.dst + span.length


def _sources(storage: OutStorage, a: int, b: int) -> Iterator[tuple[Span | None, int, int]]:
    """(span, storage offset, length) covering bytes [a, b) of `storage` in order; span None for zeros."""
    spans = storage.spans
    i = bisect_right(spans, a, key=_span_end)  # the first span ending after a
    pos = a
    while pos < b:
        span = spans[i] if i < len(spans) else None
        if span is None or span.dst >= b:
            yield None, pos, b - pos
            return
        if span.dst > pos:
            yield None, pos, span.dst - pos
            pos = span.dst
            continue
        end = min(b, span.dst + span.length)
        if end > pos:
            yield span, pos, end - pos
            pos = end
        i += 1


def _fill_plain(storage: OutStorage, a: int, view: memoryview, reader: SourceReader, progress: Advance | None) -> None:
    """Bytes [a, a + len(view)) of a storage of plain spans into `view`, zeros where no span lands."""
    for span, pos, length in _sources(storage, a, a + len(view)):
        part = view[pos - a:pos - a + length]
        if span is None:
            _zero(part)
        else:
            reader.read_into(span.uri, span.start + (pos - span.dst), part)
            if progress is not None:
                progress(length)


def _zero(view: memoryview) -> None:
    for i in range(0, len(view), len(_ZEROS)):
        view[i:i + len(_ZEROS)] = _ZEROS[:min(len(_ZEROS), len(view) - i)]


_scratch = threading.local()


def _fill_window(storage: OutStorage, a: int, view: memoryview, reader: SourceReader, progress: Advance | None) -> int:
    """Bytes [a, a + len(view)) of a storage with strided spans into `view`: zeros where no span lands;
    each span's rows in the window read as one range (rows cut by the window's ends are read whole),
    every span's at once (`SourceReader.read_many`: concurrent requests on a bucket), then placed with
    one strided numpy copy each. Returns the source bytes placed (also told to `progress`)."""
    b = a + len(view)
    if storage.gaps:  # zeros first, the spans over them
        _zero(view)
    pieces = []  # (span, first row, one past the last row, row bytes, stride) of each span in the window
    for span in storage.spans[bisect_right(storage.reach, a):]:
        if span.dst >= b:
            break
        if span.end <= a or not span.length:
            continue
        row = span.length // span.rows
        stride = span.stride if span.rows > 1 else row
        first = max(0, (a - span.dst - row) // stride + 1)  # the first row ending after a
        last = min(span.rows, -(-(b - span.dst) // stride))  # one past the last row starting before b
        if first < last:
            pieces.append((span, first, last, row, stride))
    need = sum((last - first) * row for span, first, last, row, _ in pieces if span.rows > 1)
    scratch = getattr(_scratch, "buffer", None)
    if scratch is None or len(scratch) < need:
        scratch = _scratch.buffer = bytearray(max(need, 1 << 20))
    reads, at = [], 0
    for span, first, last, row, _ in pieces:
        if span.rows == 1:  # a plain span: straight into the window
            lo, hi = max(a, span.dst), min(b, span.dst + span.length)
            reads.append((span.uri, span.start + lo - span.dst, view[lo - a:hi - a]))
        else:
            reads.append((span.uri, span.start + first * row, memoryview(scratch)[at:at + (last - first) * row]))
            at += (last - first) * row
    reader.read_many(reads)
    out = np.frombuffer(view, dtype=np.uint8)
    total = 0
    for (span, first, last, row, stride), (_, _, raw) in zip(pieces, reads):
        if span.rows == 1:
            placed = len(raw)
        else:
            placed = _place_rows(out, a, np.frombuffer(raw, dtype=np.uint8).reshape(last - first, row), span, first,
                                 stride)
        total += placed
        if progress is not None:
            progress(placed)
    return total


def _place_rows(out: np.ndarray, a: int, rows: np.ndarray, span: Span, first: int, stride: int) -> int:
    """Rows `first`... of `span` (`rows`, back to back) into the window `out` of the storage at byte `a`:
    the rows wholly inside with one strided copy, the one or two cut by the window's ends by hand.
    Returns the bytes placed."""
    b = a + len(out)
    n, row = rows.shape
    last = first + n
    whole_from = first + (span.dst + first * stride < a)  # rows wholly inside the window
    whole_to = last - (span.dst + (last - 1) * stride + row > b)
    cut = ({first} if whole_from > first else set()) | ({last - 1} if whole_to < last else set())
    placed = 0
    if whole_to > whole_from:
        k = whole_to - whole_from
        at = span.dst + whole_from * stride - a
        target = np.lib.stride_tricks.as_strided(out[at:], shape=(k, row), strides=(stride, 1))
        target[...] = rows[whole_from - first:whole_to - first]
        placed += k * row
    for i in cut:
        at = span.dst + i * stride
        lo, hi = max(a, at), min(b, at + row)
        if lo < hi:
            out[lo - a:hi - a] = rows[i - first, lo - at:hi - at]
            placed += hi - lo
    return placed


def _fill_piece(fd: int, storage: OutStorage, at: int, x: int, y: int, reader: SourceReader, buffer: memoryview,
                chunk: int, stop: threading.Event, progress: Advance | None) -> tuple[int, list[tuple[int, bytes]]]:
    """Write bytes [x, y) of the file, which hold `storage` from byte `at` on: whole blocks now (with
    `fd`), partial blocks returned as (offset, bytes) for later. Returns the CRC-32 of [x, y) too.

    Each chunk sits in `buffer` at the same place within a block as in the file, so that its whole
    blocks start at block-aligned memory."""
    crc, edges, c = 0, [], x
    while c < y:
        if stop.is_set():
            return 0, []
        d = min(y, c - c % BLOCK + chunk)
        view = buffer[c % BLOCK:c % BLOCK + d - c]
        (_fill_window if storage.strided else _fill_plain)(storage, c - at, view, reader, progress)
        crc = crc32(view, crc)
        head = min(len(view), -c % BLOCK)
        whole = (len(view) - head) // BLOCK * BLOCK
        if head:
            edges.append((c, bytes(view[:head])))
        if whole:
            pwrite_all(fd, view[head:head + whole], c + head)
        if head + whole < len(view):
            edges.append((c + head + whole, bytes(view[head + whole:])))
        c = d
    return crc, edges


def archive_size(name: str, data: bytes, storages: Sequence[OutStorage]) -> int:
    """The size of the file `write_pickled` writes for pickle `data` and `storages` under the file
    name `name`, worked out without writing it."""
    zw = _ZipWriter(_Layout(), os.path.splitext(name.rstrip("/").rsplit("/", 1)[-1])[0] or "archive")  # type: ignore[arg-type]
    _write_small_records(zw, data)
    for key, storage in enumerate(storages):
        entry = zw.begin(f"data/{key}", storage.nbytes)
        zw.skip(storage.nbytes)
        zw.skip(len(zw.descriptor(entry, 0)))
    _write_trailing_records(zw)
    zw.close()
    return zw.pos


def write_archive(uri: str, obj: Any, reader: SourceReader, *, progress: Progress | None = None,
                  durable: bool = True, threads: int = 1, digests: Any = None) -> int:
    """Write `obj` (see `dumps`) to `uri` as torch.save would: `write_pickled(uri, *dumps(obj), ...)`."""
    data, storages = dumps(obj)
    return write_pickled(uri, data, storages, reader, progress=progress, durable=durable, threads=threads,
                         digests=digests)


def write_pickled(uri: str, data: bytes, storages: Sequence[OutStorage], reader: SourceReader, *,
                  progress: Progress | None = None, durable: bool = True, threads: int = 1,
                  digests: Any = None) -> int:
    """Write the archive of pickle `data` and its `storages` (what `dumps` gave) to `uri`.

    `progress(done, total)` counts the source bytes copied into the archive's storages.

    Storage bytes are streamed from their spans and nothing larger than a few chunks is held. A local
    file is filled in place by `threads` threads, each with one chunk, its storage blocks written
    with direct I/O where possible (`_write_in_place`); elsewhere one thread writes front to back
    while another reads `reader.depth` chunks ahead, and `digests` (a `plumbing.checksums.Digests`),
    when given, hashes every byte written, in order. Returns the file size. With `durable`, a local
    file is fsynced before returning.
    """
    try:
        return _write_archive(uri, data, list(storages), reader, progress, durable, threads, digests)
    except CkptflowError:
        raise
    except OSError as exc:  # reading errors are SourceReadErrors by now: this one is the output's
        raise OutputError(f"cannot write {uri} ({describe(exc)})", uri=uri,
                          hint="check the destination is writable and has room, then run again") from exc


class _Hashed:
    """A write-only file that also feeds every byte written to `digests`."""

    def __init__(self, fh: BinaryIO, digests: Any) -> None:
        self.fh, self.digests = fh, digests

    def write(self, data: bytes | memoryview) -> int:
        self.digests.update(data)
        return self.fh.write(data)


def _write_archive(uri: str, data: bytes, storages: list[OutStorage], reader: SourceReader,
                   progress: Progress | None, durable: bool, threads: int, digests: Any) -> int:
    if progress is not None:
        tally = Tally(sum(span.length for storage in storages for span in storage.spans), progress)
        tally.start()
        advance: Advance | None = lambda nbytes: tally.add(uri, nbytes)  # noqa: E731
    else:
        advance = None
    name = os.path.splitext(uri.rstrip("/").rsplit("/", 1)[-1])[0] or "archive"
    if is_local(uri) and hasattr(os, "pwrite") and digests is None:
        size = _write_in_place(local_path(uri), name, data, storages, reader, advance, threads)
        if durable:
            fd = os.open(local_path(uri), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        return size
    if is_local(uri):
        fh: BinaryIO = open(local_path(uri), "wb")
    else:
        fs, path = open_fs(uri)
        fh = fs.open(path, "wb")
    try:
        size = _write_streamed(fh if digests is None else _Hashed(fh, digests), name, data, storages, reader,  # type: ignore[arg-type]
                               advance)
        if durable and is_local(uri):
            fh.flush()
            os.fsync(fh.fileno())
    finally:
        fh.close()
    return size
