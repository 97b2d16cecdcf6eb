"""Torch zip archives (`torch.save` files), written as a stream from byte ranges of other files.

`torch.save` needs every tensor in memory. Resharding writes files far larger than the memory it may
use, so this module writes the same format without ever holding a tensor: the object tree is pickled
with `OutTensor` stand-ins whose `OutStorage` says which byte ranges of which source files fill it
(zeros elsewhere), and each storage is then streamed into the archive in bounded chunks.

The archive is what `torch.save` writes (torch 2.x, checked against 2.13): records `data.pkl`,
`.format_version`, `.storage_alignment`, `byteorder`, `data/<key>` for each storage in key order,
`version` and `.data/serialization_id`, each stored uncompressed, data aligned to 64 bytes with an
`FB` extra field, sizes and CRC-32 in a data descriptor (flag bit 3) and zip64 end records.
`torch.load` (and DeepSpeed, which calls it) reads these files as its own.
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

from ckptflow.storage import is_local, local_path, open_fs
from ckptflow.torchzip import DTYPE_SIZES, STORAGE_DTYPES

try:  # ISA-L's CRC-32 runs at several GB/s; zlib's at well under one.
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - isal is a dependency, zlib is the fallback
    from zlib import crc32

STORAGE_CLASSES: dict[str, str] = {dtype: cls for cls, (dtype, _size) in STORAGE_DTYPES.items()}
ALIGNMENT = 64
CHUNK_BYTES = 16 << 20
_MAX32 = 0xFFFFFFFF
_ZIP64_LIMIT = _MAX32  # sizes and offsets from here on go to zip64 fields (lowered by tests)
_FLAGS = 0x0808  # sizes in a data descriptor; UTF-8 names (what torch writes)

Progress = Callable[[int], None]  # bytes of storage data just written


@dataclass(frozen=True, slots=True)
class Span:
    """`length` bytes from byte `start` of the file at `uri`, placed at byte `dst` of a storage."""

    uri: str
    start: int
    length: int
    dst: int


class OutStorage:
    """A storage to be written: its dtype, element count and the source spans that fill it."""

    __slots__ = ("dtype", "numel", "spans")

    def __init__(self, dtype: str, numel: int, spans: Iterable[Span] = ()) -> None:
        if dtype not in STORAGE_CLASSES:
            raise ValueError(f"no torch storage class for dtype {dtype!r}")
        self.dtype = dtype
        self.numel = numel
        self.spans = sorted(spans, key=lambda s: s.dst)
        end = 0
        for span in self.spans:
            assert span.dst >= end and span.length >= 0, "overlapping spans in a storage"
            end = span.dst + span.length
        assert end <= self.nbytes, "spans reach past the storage"

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

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        import torch._utils

        return (torch._utils._rebuild_tensor_v2,
                (self.storage, self.offset, self.shape, self.stride, False, OrderedDict()))


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, step = [], 1
    for dim in reversed(shape):
        stride.append(step)
        step *= max(dim, 1)
    return tuple(reversed(stride))


def dumps(obj: Any) -> tuple[bytes, list[OutStorage]]:
    """The pickle of `obj` (protocol 2, as torch writes it) and its storages in key order."""
    import torch

    storages: list[OutStorage] = []
    keys: dict[int, str] = {}

    class Pickler(pickle.Pickler):
        def persistent_id(self, item: Any) -> Any:
            if not isinstance(item, OutStorage):
                return None
            key = keys.get(id(item))
            if key is None:
                key = keys[id(item)] = str(len(storages))
                storages.append(item)
            return ("storage", getattr(torch, STORAGE_CLASSES[item.dtype]), key, "cpu", item.numel)

    buf = io.BytesIO()
    Pickler(buf, protocol=2).dump(obj)
    return buf.getvalue(), storages


class SourceReader:
    """Reads byte ranges of source files into one reusable buffer, keeping the files open."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.buffer = memoryview(bytearray(chunk_bytes))
        self._files: dict[str, BinaryIO] = {}
        self.bytes_read = 0

    def _file(self, uri: str) -> BinaryIO:
        fh = self._files.get(uri)
        if fh is None:
            if is_local(uri):
                fh = open(local_path(uri), "rb", buffering=0)
            else:
                fs, path = open_fs(uri)
                fh = fs.open(path, "rb", block_size=CHUNK_BYTES)
            self._files[uri] = fh
        return fh

    def chunks(self, span: Span) -> Iterator[memoryview]:
        """The span's bytes in chunks that stay valid until the next chunk is asked for."""
        fh = self._file(span.uri)
        fh.seek(span.start)
        left = span.length
        while left:
            view = self.buffer[: min(left, len(self.buffer))]
            got = 0
            while got < len(view):
                n = fh.readinto(view[got:])
                if not n:
                    from ckptflow.errors import CorruptFileError

                    raise CorruptFileError(
                        f"{span.uri} ended at byte {span.start + span.length - left + got} while reading "
                        f"{span.length} bytes from byte {span.start}", file=span.uri,
                        hint="the file changed or was truncated while being read; copy it again",
                    )
                got += n
            self.bytes_read += got
            left -= got
            yield view

    def close(self) -> None:
        for fh in self._files.values():
            fh.close()
        self._files.clear()


class _ZipWriter:
    """The zip container torch uses, written front to back (the output need not be seekable)."""

    def __init__(self, fh: BinaryIO, prefix: str) -> None:
        self.fh = fh
        self.prefix = prefix
        self.pos = 0
        self.entries: list[tuple[bytes, int, int, int]] = []  # name, header offset, crc, size

    def _write(self, data: bytes | memoryview) -> None:
        self.fh.write(data)
        self.pos += len(data)

    def record(self, name: str, chunks: Iterable[bytes | memoryview], size: int) -> None:
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
        crc, written = 0, 0
        for chunk in chunks:
            crc = crc32(chunk, crc)
            self._write(chunk)
            written += len(chunk)
        assert written == size, f"record {name}: wrote {written} bytes, planned {size}"
        if size >= _ZIP64_LIMIT or offset >= _ZIP64_LIMIT:
            self._write(struct.pack("<4sIQQ", b"PK\x07\x08", crc, size, size))
        else:
            self._write(struct.pack("<4sIII", b"PK\x07\x08", crc, size, size))
        self.entries.append((raw_name, offset, crc, size))

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


def _storage_chunks(storage: OutStorage, reader: SourceReader, progress: Progress | None) -> Iterator[memoryview | bytes]:
    pos = 0
    for span in [*storage.spans, Span("", 0, 0, storage.nbytes)]:
        while pos < span.dst:
            n = min(span.dst - pos, len(_ZEROS))
            yield _ZEROS[:n]
            pos += n
        if span.length:
            for chunk in reader.chunks(span):
                yield chunk
                if progress is not None:
                    progress(len(chunk))
            pos += span.length


def write_archive(uri: str, obj: Any, reader: SourceReader, *, progress: Progress | None = None,
                  durable: bool = True) -> int:
    """Write `obj` (plain data, `OutTensor`s, picklable objects) to `uri` as torch.save would.

    Storage bytes are streamed from their spans through `reader`'s buffer; nothing larger than one
    chunk is held. Returns the file size. With `durable`, a local file is fsynced before returning.
    """
    data, storages = dumps(obj)
    name = os.path.splitext(uri.rstrip("/").rsplit("/", 1)[-1])[0] or "archive"
    if is_local(uri):
        fh: BinaryIO = open(local_path(uri), "wb")
    else:
        fs, path = open_fs(uri)
        fh = fs.open(path, "wb")
    try:
        zw = _ZipWriter(fh, name)
        zw.record("data.pkl", [data], len(data))
        zw.record(".format_version", [b"1"], 1)
        zw.record(".storage_alignment", [str(ALIGNMENT).encode()], len(str(ALIGNMENT)))
        zw.record("byteorder", [b"little"], 6)
        for key, storage in enumerate(storages):
            zw.record(f"data/{key}", _storage_chunks(storage, reader, progress), storage.nbytes)
        zw.record("version", [b"3\n"], 2)
        serial = str(uuid.uuid4().int).rjust(40, "0")[:40].encode()
        zw.record(".data/serialization_id", [serial], len(serial))
        zw.close()
        if durable and is_local(uri):
            fh.flush()
            os.fsync(fh.fileno())
    finally:
        fh.close()
    return zw.pos
