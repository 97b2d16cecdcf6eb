"""Torch zip archives (`torch.save` files), opened lazily and safely from any fsspec URI.

Opening an archive reads its zip directory, its pickle and the 30-byte local headers of its non-empty
storages, each by an exact byte range (no read-ahead into tensor data): on a bucket that is one size
request and four rounds of range requests per file. The pickle goes through the bounded unpickler
(`unpickler`) with the allow-list the caller passes; tensors come back as `TensorRef`s, and no tensor
byte is read until a caller reads a `TensorRef`'s byte range.

A DeepSpeed checkpoint repeats itself across ranks: every ZeRO-3 rank's model-states pickle is the
same bytes, and so are most optimizer pickles. An `ArchiveCache` shared by the opens of one checkpoint
unpickles each distinct pickle once; the other files get the same tree with their own `TensorRef`s
for non-empty storages, and share everything else (an empty storage's `TensorRef` keeps the first
file's URI: it names no bytes).
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import threading
import zipfile
from collections import OrderedDict
from dataclasses import replace
from typing import Any

from ckptflow.errors import CheckpointNotFoundError, CkptflowError, CorruptFileError, UnsafePickleError
from ckptflow.formats.torch.inert import InertRecord
from ckptflow.formats.torch.tensorref import TensorRef
from ckptflow.formats.torch.unpickler import (
    MAX_PICKLE_BYTES,
    TORCH_ONLY,
    Allowed,
    PickledObject,
    TensorRecord,
    Unpickler,
    check_storage,
    plain_tree,
    storage_key,
    why_unreadable,
)
from ckptflow.plumbing.files import check_regular
from ckptflow.plumbing.ranges import ShortRead, read_error, read_ranges
from ckptflow.plumbing.storage import open_fs
from ckptflow.plumbing.stores import store_for
from ckptflow.plumbing.stores.local import os_path
from ckptflow.plumbing.text import excerpt, one_line

_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")
_LOCAL_HEADER_MAGIC = b"PK\x03\x04"
_NOT_REGULAR_HINT = "put the file DeepSpeed saved in its place (copy it again from the training run)"


class Archive:
    """One torch zip archive: its plain-data object tree with `TensorRef`s in place of tensors."""

    def __init__(self, uri: str, allowed: Allowed = TORCH_ONLY, cache: ArchiveCache | None = None) -> None:
        self.uri = uri
        self.fs, self.path = open_fs(uri)
        self.cache = cache
        self._entries: dict[str, zipfile.ZipInfo] = {}
        self._data_offsets: dict[str, int] = {}
        self.allowed = allowed
        self.records = allowed.record_classes()
        self.size = 0
        self.obj: Any = None
        self.has_records = False  # whether its tree holds an `InertRecord` (a global outside the allow-list)
        self.has_cycles = False  # whether an object of its tree refers back to itself (through what it holds)

    # ---- opening ---------------------------------------------------------------------------------

    def open(self) -> "Archive":
        """Read the zip directory, the pickle and the storage headers; store errors become
        `SourceReadError`, damage becomes `CorruptFileError`."""
        try:
            return self._open()
        except CkptflowError:
            raise
        except OSError as exc:
            raise read_error(self.uri, exc) from exc

    def _open(self) -> "Archive":
        try:
            # A local FIFO, device or folder in a rank file's place is named as what it is, never opened.
            self.size = check_regular(self.uri, hint=_NOT_REGULAR_HINT) if os_path(self.uri) is not None else \
                self.fs.size(self.path)
        except (FileNotFoundError, CheckpointNotFoundError):
            raise CheckpointNotFoundError(
                f"{self.uri} does not exist", file=self.uri, hint="check the path and the tag"
            ) from None
        if not self.size:
            raise CorruptFileError(
                f"{self.uri} is empty (0 bytes)", file=self.uri,
                hint="the save was interrupted or the upload is incomplete; copy the file again",
            )
        try:
            prefix, names, data_pkl = self._read_exact()
        except _NotExact:  # not laid out as torch lays archives out: zipfile reads it its own way
            prefix, names, data_pkl = self._read_zip()
        self._entries = {
            name[len(prefix) + len("data/"):]: info
            for name, info in names.items()
            if name.startswith(prefix + "data/")
        }
        for info in self._entries.values():
            if info.compress_type != zipfile.ZIP_STORED:
                raise CorruptFileError(
                    f"{self.uri}: storage {info.filename} is compressed", file=self.uri,
                    hint="torch never compresses storages; the file was repacked by another tool",
                )
        self.obj = self._unpickle(data_pkl)
        return self

    def _read_exact(self) -> tuple[str, dict[str, zipfile.ZipInfo], bytes]:
        """The directory, pickle and byte order of an archive laid out as torch writes one, fetched as
        three exact ranges in turn: the end records, the central directory, and the small records
        before the first storage (pickle, versions, byte order). `_NotExact` when the file is laid out
        otherwise (or damaged): `_read_zip` then reads it, and reports damage, as zipfile does."""
        tail_start = max(0, self.size - _TAIL)
        pieces = _Pieces(self.size, {tail_start: self._fetch([(tail_start, self.size)])[0]})
        cd_start, cd_end = _central_directory(pieces)
        pieces.add(cd_start, self._fetch([(cd_start, cd_end)])[0])
        try:
            with zipfile.ZipFile(pieces) as zf:
                infos = zf.infolist()
                pkl = _pickle_info(infos)
                if pkl is None:
                    raise _NotExact
                prefix = pkl.filename[: -len("data.pkl")]
                names = {i.filename: i for i in infos}
                order = names.get(prefix + "byteorder")
                small = [pkl] + ([order] if order is not None else [])
                start = min(i.header_offset for i in small)
                storages = [i.header_offset for i in infos if i.filename.startswith(prefix + "data/")]
                end = min([o for o in storages if o > start] + [cd_start])  # up to the first storage after them
                if any(i.header_offset >= end for i in small) or start in storages:
                    raise _NotExact  # a storage among the small records: they are not one range
                if pkl.file_size > MAX_PICKLE_BYTES or end - start > MAX_PICKLE_BYTES + (1 << 20):
                    raise _NotExact  # `_read_zip` refuses the pickle by its size, reading nothing of it
                pieces.add(start, self._fetch([(start, end)])[0])
                if order is not None and zf.read(order).strip() != b"little":
                    raise CorruptFileError(
                        f"{self.uri} was written on a big-endian machine", file=self.uri,
                        hint="re-save it on a little-endian machine",
                    )
                return prefix, names, zf.read(pkl)
        except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, struct.error, ValueError, KeyError,
                NotImplementedError) as exc:  # zipfile: NotImplementedError for an unknown zip version or method
            if isinstance(exc, CorruptFileError):
                raise
            raise _NotExact from exc
        # (a read outside the fetched pieces raised _NotExact itself)

    def _fetch(self, ranges: list[tuple[int, int]]) -> list[bytes]:
        """Exact byte ranges of this file (one request each on a store, sent together)."""
        for start, end in ranges:
            if not 0 <= start <= end <= self.size:
                raise _NotExact
        try:
            blobs = read_ranges([(self.uri, start, end) for start, end in ranges])
        except EOFError:  # the file is shorter than its end records say
            raise _NotExact from None
        if any(len(b) != end - start for b, (start, end) in zip(blobs, ranges)):
            raise _NotExact
        return blobs

    def _read_zip(self) -> tuple[str, dict[str, zipfile.ZipInfo], bytes]:
        """The archive through zipfile over the file itself, for layouts `_read_exact` does not know;
        on a store each of zipfile's reads is one exact request (no read-ahead into tensor data)."""
        options = {} if store_for(self.fs).local else {"cache_type": "none"}
        try:
            with self.fs.open(self.path, "rb", block_size=1 << 16, **options) as fh:
                with zipfile.ZipFile(fh) as zf:
                    infos = zf.infolist()
                    pkl = _pickle_info(infos)
                    if pkl is None:
                        raise CorruptFileError(
                            f"{self.uri} is a zip file but not a torch archive (no data.pkl)", file=self.uri,
                            hint="pass a file written by torch.save / DeepSpeed",
                        )
                    prefix = pkl.filename[: -len("data.pkl")]
                    names = {i.filename: i for i in infos}
                    order = names.get(prefix + "byteorder")
                    if order is not None and zf.read(order).strip() != b"little":
                        raise CorruptFileError(
                            f"{self.uri} was written on a big-endian machine", file=self.uri,
                            hint="re-save it on a little-endian machine",
                        )
                    if pkl.file_size > MAX_PICKLE_BYTES:
                        raise CorruptFileError(
                            f"{self.uri}: its pickle is {pkl.file_size:,} bytes, more than a checkpoint's can be "
                            f"({MAX_PICKLE_BYTES:,} at most)", file=self.uri,
                            hint="the file is damaged or not a DeepSpeed checkpoint file",
                        )
                    data_pkl = zf.read(pkl)
        except (
            zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, struct.error, ValueError, NotImplementedError
        ) as exc:
            if isinstance(exc, CorruptFileError):
                raise
            if isinstance(exc.__context__, OSError):  # zipfile reports a failed read as "not a zip file"
                raise read_error(self.uri, exc.__context__) from exc.__context__
            raise CorruptFileError(
                f"{self.uri} is not a readable torch archive ({one_line(str(exc), 200)})", file=self.uri,
                hint="the file is truncated or not a checkpoint; copy it again from the training run",
            ) from None
        return prefix, names, data_pkl

    def _unpickle(self, data: bytes) -> Any:
        hit = self.cache.get(data) if self.cache is not None else None
        if hit is not None:
            return self._from_template(*hit)
        unpickler = Unpickler(data, self)
        try:
            obj = unpickler.load()
        except UnsafePickleError:
            raise
        except Exception as exc:  # any malformed pickle: never let it escape as a traceback
            raise self._pickle_error(exc) from None
        self._resolve_offsets(sorted(unpickler.storages))
        records: list[InertRecord] = []
        cycles: list[Any] = []
        tree = plain_tree(obj, self, records=records, cycles=cycles)
        self.has_records, self.has_cycles = bool(records), bool(cycles)
        if self.cache is not None and not cycles:  # `_rebase` copies trees, not graphs: a cycle is read again
            self.cache.put(data, tree, {k: (s.dtype, s.numel) for k, s in unpickler.storages.items()},
                           self.has_records)
        return tree

    def _pickle_error(self, exc: BaseException) -> CorruptFileError:
        return CorruptFileError(
            f"{self.uri}: cannot read its pickle ({why_unreadable(exc)})", file=self.uri,
            hint="the file is corrupt or truncated; copy it again from the training run",
        )

    def _from_template(self, template: Any, storages: dict[str, tuple[str, int]], has_records: bool) -> Any:
        """The tree of a pickle already unpickled from another file: its storages checked against
        this archive's records, and its non-empty tensors pointed at this file."""
        self.has_records = has_records
        try:
            for key, (dtype, numel) in storages.items():
                check_storage(self, key, dtype, numel)
        except pickle.UnpicklingError as exc:
            raise self._pickle_error(exc) from None
        self._resolve_offsets(sorted(storages))
        return _rebase(template, self, {})

    def storage_size(self, key: str) -> int | None:
        info = self._entries.get(key)
        return None if info is None else info.file_size

    def _resolve_offsets(self, keys: list[str]) -> None:
        """Read the local header of each non-empty storage entry (all at once) to find where its bytes
        start. An empty storage has no bytes to find: its offset is where they would start if its
        local header were as long as its central directory entry, and nothing ever reads there."""
        for key in keys:
            info = self._entries[key]
            if not info.file_size:
                self._data_offsets[key] = info.header_offset + _LOCAL_HEADER.size + len(info.orig_filename) + \
                    len(info.extra)
        keys = [k for k in keys if self._entries[k].file_size]
        if not keys:
            return
        infos = [self._entries[k] for k in keys]
        starts = [i.header_offset for i in infos]
        try:
            headers = read_ranges([(self.uri, s, s + _LOCAL_HEADER.size) for s in starts])
        except ShortRead as exc:
            key = keys[starts.index(exc.start)] if exc.start in starts else keys[-1]
            raise CorruptFileError(
                f"{self.uri}: storage {key} lies past the end of the file", file=self.uri,
                hint="the file is truncated; copy it again",
            ) from None
        for key, info, raw in zip(keys, infos, headers):
            fields = _LOCAL_HEADER.unpack(raw)
            if fields[0] != _LOCAL_HEADER_MAGIC:
                raise CorruptFileError(
                    f"{self.uri}: storage {key} has a damaged zip header", file=self.uri,
                    hint="the file is corrupt; copy it again",
                )
            offset = info.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10]
            if offset + info.file_size > self.size:
                raise CorruptFileError(
                    f"{self.uri}: storage {key} ends at byte {offset + info.file_size} but the file has "
                    f"{self.size}", file=self.uri, expected=offset + info.file_size, actual=self.size,
                    hint="the file is truncated; copy it again",
                )
            self._data_offsets[key] = offset

    def tensor(self, record: TensorRecord) -> TensorRef:
        """The `TensorRef` of a tensor record, checked as it is used: its storage reference as it ended
        up after the whole pickle ran (a BUILD cannot have changed it behind `persistent_load`'s
        check), every dimension at least 0, every element inside the storage."""
        storage = record.storage
        try:
            check_storage(self, storage.key, storage.dtype, storage.numel)
        except pickle.UnpicklingError as exc:
            raise CorruptFileError(
                f"{self.uri}: {exc}", file=self.uri, hint="the file is corrupt; copy it again"
            ) from None
        if any(d < 0 for d in record.shape):
            raise CorruptFileError(f"{self.uri}: a tensor of storage {storage_key(storage.key)} has the shape "
                                   f"{excerpt(list(record.shape), 120)}, with a negative dimension", file=self.uri,
                                   hint="the file is corrupt; copy it again")
        ref = TensorRef(
            uri=self.uri, key=storage.key, dtype=storage.dtype, shape=record.shape, stride=record.stride,
            storage_offset=record.offset, storage_numel=storage.numel, data_offset=self._data_offsets[storage.key],
        )
        if ref.numel:
            reach = [(d - 1) * s for d, s in zip(ref.shape, ref.stride)]
            first = record.offset + sum(r for r in reach if r < 0)
            last = record.offset + sum(r for r in reach if r > 0)
            if first < 0 or last >= storage.numel:
                raise CorruptFileError(
                    f"{self.uri}: a tensor reaches past its storage {storage_key(storage.key)}", file=self.uri,
                    hint="the file is corrupt; copy it again",
                )
        return ref


def open_archive(uri: str, allowed: Allowed = TORCH_ONLY, *, cache: ArchiveCache | None = None) -> Archive:
    """Open the torch archive at `uri`: its directory, pickle and storage offsets, no tensor bytes.
    `allowed` names the globals its pickle may use beyond torch's. With `cache`, a pickle seen before
    (the same bytes in another file) is not unpickled again; a cache serves one allow-list only."""
    return Archive(uri, allowed, cache).open()


class ArchiveCache:
    """Trees of the pickles unpickled so far, by the pickle's bytes; safe to share between threads."""

    def __init__(self) -> None:
        self._trees: dict[bytes, tuple[Any, dict[str, tuple[str, int]], bool]] = {}
        self._lock = threading.Lock()

    def get(self, data: bytes) -> tuple[Any, dict[str, tuple[str, int]], bool] | None:
        with self._lock:
            return self._trees.get(data)

    def put(self, data: bytes, tree: Any, storages: dict[str, tuple[str, int]], has_records: bool = False) -> None:
        """Keep `tree` for `data`, with its storages as (dtype, element count) by key and whether it
        holds inert records."""
        with self._lock:
            self._trees.setdefault(data, (tree, storages, has_records))


def _rebase(obj: Any, archive: Archive, memo: dict[int, Any]) -> Any:
    """`obj` (a template tree) with each non-empty `TensorRef` pointing into `archive`; containers
    without such tensors are shared, not copied, and an object the template shares stays shared. The
    template passed `plain_tree`'s bounds (depth and nodes), so the recursion is bounded too."""
    key = id(obj)
    if key in memo:
        return memo[key]
    out = obj
    if isinstance(obj, TensorRef):
        if obj.storage_numel:
            out = TensorRef(archive.uri, obj.key, obj.dtype, obj.shape, obj.stride, obj.storage_offset,
                            obj.storage_numel, archive._data_offsets[obj.key])
    elif isinstance(obj, (list, tuple)):
        items = [_rebase(x, archive, memo) for x in obj]
        if not all(a is b for a, b in zip(items, obj)):
            out = items if isinstance(obj, list) else tuple(items)
    elif isinstance(obj, dict):
        values = [_rebase(v, archive, memo) for v in obj.values()]
        if not all(a is b for a, b in zip(values, obj.values())):
            out = type(obj)() if isinstance(obj, OrderedDict) else {}
            for k, v in zip(obj, values):
                out[k] = v
    elif isinstance(obj, PickledObject):
        args, state = _rebase(obj.args, archive, memo), _rebase(obj.state, archive, memo)
        if args is not obj.args or state is not obj.state:
            out = PickledObject(obj.qualname, args, state)
    elif isinstance(obj, InertRecord):
        args, kwargs = _rebase(obj.args, archive, memo), _rebase(obj.kwargs, archive, memo)
        ops = tuple((kind, _rebase(items, archive, memo)) for kind, items in obj.ops)
        if args is not obj.args or kwargs is not obj.kwargs or any(a[1] is not b[1] for a, b in zip(ops, obj.ops)):
            out = replace(obj, args=args, kwargs=kwargs, ops=ops)
    memo[key] = out
    return out


class _NotExact(Exception):
    """The archive is not laid out as the exact-range reader expects; read it through zipfile."""


# End of central directory (22 bytes, no comment), zip64 locator (20) and zip64 end record (56).
_TAIL = 22 + 20 + 56


class _Pieces(io.RawIOBase):
    """A read-only view of a `size`-byte file of which only some ranges were fetched; reading
    elsewhere raises `_NotExact`."""

    def __init__(self, size: int, pieces: dict[int, bytes]) -> None:
        super().__init__()
        self.size, self.pos = size, 0
        self.pieces = dict(pieces)

    def add(self, start: int, data: bytes) -> None:
        self.pieces[start] = data

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self.pos = {os.SEEK_SET: 0, os.SEEK_CUR: self.pos, os.SEEK_END: self.size}[whence] + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int | None = -1) -> bytes:
        end = self.size if n is None or n < 0 else min(self.size, self.pos + n)
        for start, data in self.pieces.items():
            if start <= self.pos and end <= start + len(data):
                out = data[self.pos - start:end - start]
                self.pos = end
                return out
        raise _NotExact


def _central_directory(pieces: _Pieces) -> tuple[int, int]:
    """[start, end) of the central directory, from the end records in `pieces` (no comment)."""
    pieces.seek(-22, os.SEEK_END)
    sig, _disk, _cd_disk, _n_disk, count, size, offset, comment = struct.unpack("<4sHHHHIIH", pieces.read(22))
    if sig != b"PK\x05\x06" or comment:
        raise _NotExact
    if 0xFFFFFFFF in (size, offset) or count == 0xFFFF:
        pieces.seek(-42, os.SEEK_END)
        sig, _disk, end64, _total = struct.unpack("<4sIQI", pieces.read(20))
        if sig != b"PK\x06\x07":
            raise _NotExact
        pieces.seek(end64)
        fields = struct.unpack("<4sQHHIIQQQQ", pieces.read(56))
        if fields[0] != b"PK\x06\x06":
            raise _NotExact
        size, offset = fields[8], fields[9]
    if offset + size > pieces.size - 22:
        raise _NotExact
    return offset, offset + size


def _pickle_info(infos: list[zipfile.ZipInfo]) -> zipfile.ZipInfo | None:
    return next((i for i in infos if i.filename.endswith("/data.pkl") or i.filename == "data.pkl"), None)
