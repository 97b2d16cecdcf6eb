"""Torch zip archives (`torch.save` files), written as a stream from byte ranges of other files.

`torch.save` needs every tensor in memory. Resharding writes files far larger than the memory it may
use, so this module writes the same format without ever holding a tensor: the pickle comes from
`pickler.dumps` with `OutStorage`s that say which byte ranges of which source files fill each storage
(zeros elsewhere), and each storage is then streamed into the archive in bounded chunks, front to back
or, for a local file, by several threads writing pieces in place.

The archive is what `torch.save` writes (torch 2.x, checked against 2.13): records `data.pkl`,
`.format_version`, `.storage_alignment`, `byteorder`, `data/<key>` for each storage in key order,
`version` and `.data/serialization_id` (derived from the records, as torch derives it:
`serialization_id`), each stored uncompressed, data aligned to 64 bytes with an `FB` extra field,
sizes and CRC-32 in a data descriptor (flag bit 3) and zip64 end records. `torch.load` (and DeepSpeed,
which calls it) reads these files as its own. Nothing random goes in: the same object and sources give
the same bytes, whoever writes them. `write_archive(uri, obj, ...)` pickles and writes in one call.
"""

from __future__ import annotations

import io
import mmap
import os
import queue
import struct
import threading
from bisect import bisect_right
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, BinaryIO, Protocol

import numpy as np
from isal.isal_zlib import crc32, crc32_combine  # ISA-L's CRC-32 runs at several GB/s; zlib's at well under one

from ckptflow.errors import CkptflowError, OutputError
from ckptflow.formats.casts import as_array, fp32_to_bf16, fp32_to_fp16
from ckptflow.formats.torch.pickler import OutStorage, Span, dumps
from ckptflow.formats.torch.serialization_id import serialization_id
from ckptflow.formats.torch.tensorref import parse_cast
from ckptflow.plumbing.direct import BLOCK, aligned_buffer, open_direct, pwrite_all
from ckptflow.plumbing.progress import Progress, Tally
from ckptflow.plumbing.ranges import RangeReader, read_error
from ckptflow.plumbing.redaction import describe
from ckptflow.plumbing.storage import open_fs
from ckptflow.plumbing.stores.local import local_path, os_path

ALIGNMENT = 64
CHUNK_BYTES = 8 << 20
SEGMENT_BYTES = 64 << 20  # the unit of work when several threads write one archive
_MAX32 = 0xFFFFFFFF
_ZIP64_LIMIT = _MAX32  # sizes and offsets from here on go to zip64 fields (lowered by tests)
_FLAGS = 0x0808  # sizes in a data descriptor; UTF-8 names (what torch writes)


Advance = Callable[[int], None]  # inside the writer: source bytes just copied (from any thread)


class SourceReader(RangeReader):
    """The reader an archive's storages are streamed through: `plumbing.ranges` with the chunk size and
    read-ahead depth of the writer, and a store's error as the `SourceReadError` a user reads (a short
    read is a `ShortRead`, whoever reads)."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES, depth: int = 3) -> None:
        super().__init__()
        self.chunk_bytes = chunk_bytes
        self.depth = depth

    def read_into(self, uri: str, start: int, view: memoryview) -> None:
        """Fill `view` with the bytes of `uri` from byte `start`."""
        self.read_many([(uri, start, view)])

    def read_many(self, reads: Sequence[tuple[str, int, memoryview]]) -> None:
        """`read_into` for several (uri, start, view) at once: local files one after the other, those on
        a bucket in one round of concurrent requests per store (a window's rows from every rank). A
        `tensorref.cast_view` stream is read as its float32 bytes and cast into the view."""
        casts = []
        plain = []
        for uri, start, view in reads:
            cast = parse_cast(uri)
            if cast is None:
                plain.append((uri, start, view))
            else:
                raw = memoryview(bytearray(2 * len(view)))
                plain.append((cast[1], 2 * start, raw))
                casts.append((cast[0], raw, view))
        self._fill(plain)
        for dtype, raw, view in casts:
            cast_to = fp32_to_bf16 if dtype == "bfloat16" else fp32_to_fp16
            cast_to(as_array(raw, np.uint32), as_array(view.cast("B"), np.uint16))

    def _fill(self, reads: Sequence[tuple[str, int, memoryview]]) -> None:
        try:
            self.fill(reads)
        except OSError as exc:
            uri = next((u for u, _s, _v in reads if getattr(exc, "filename", None) == local_path(u)), reads[0][0])
            raise read_error(uri, exc) from exc


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


class _Sink(Protocol):
    """Where `_ZipWriter` writes: a binary file, `_Hashed` over one, or `_Placement`. `skip` seeks."""

    def write(self, data: bytes | memoryview, /) -> object: ...

    def seek(self, offset: int, whence: int, /) -> object: ...


class _ZipWriter:
    """The zip container torch uses, written front to back (the output need not be seekable). For
    records whose data other threads write in place (`_write_in_place`), `begin` writes the
    header, `skip` leaves room for the data and its descriptor, and `descriptor` gives that once the
    CRC is known."""

    def __init__(self, fh: _Sink, prefix: str) -> None:
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


def _write_streamed(fh: _Sink, name: str, data: bytes, storages: list[OutStorage], reader: SourceReader,
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


class _Placement:
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
    placement = _Placement()
    zw = _ZipWriter(placement, name)
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
            placement.writes.append((descriptor_at, zw.descriptor(entry, crc)))
        _write_trailing_records(zw)
        zw.close()
        for offset, chunk in placement.writes + edges:
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
            error = future.exception() if future.done() else None
            if error is not None:
                stop.set()
                for other in futures:
                    other.cancel()
                raise error
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
    zw = _ZipWriter(_Placement(), os.path.splitext(name.rstrip("/").rsplit("/", 1)[-1])[0] or "archive")
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

    def seek(self, offset: int, whence: int) -> int:
        raise io.UnsupportedOperation("a hashed stream is written front to back")


def _write_archive(uri: str, data: bytes, storages: list[OutStorage], reader: SourceReader,
                   progress: Progress | None, durable: bool, threads: int, digests: Any) -> int:
    if progress is not None:
        tally = Tally(sum(span.length for storage in storages for span in storage.spans), progress)
        tally.start()
        advance: Advance | None = lambda nbytes: tally.add(uri, nbytes)  # noqa: E731
    else:
        advance = None
    name = os.path.splitext(uri.rstrip("/").rsplit("/", 1)[-1])[0] or "archive"
    local = os_path(uri)
    if local is not None and hasattr(os, "pwrite") and digests is None:
        size = _write_in_place(local, name, data, storages, reader, advance, threads)
        if durable:
            fd = os.open(local, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        return size
    if local is not None:
        fh: BinaryIO = open(local, "wb")
    else:
        fs, path = open_fs(uri)
        fh = fs.open(path, "wb")
    try:
        sink: _Sink = fh if digests is None else _Hashed(fh, digests)
        size = _write_streamed(sink, name, data, storages, reader, advance)
        if durable and local is not None:
            fh.flush()
            os.fsync(fh.fileno())
    finally:
        fh.close()
    return size
