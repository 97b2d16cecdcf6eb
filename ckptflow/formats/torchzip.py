"""Torch zip archives (`torch.save` files), read lazily and safely from any fsspec URI.

This is the one module that turns checkpoint pickles into data. Its unpickler resolves globals
through an allow-list of the names real DeepSpeed checkpoints use, each mapped to plain data; any
other global is refused with `UnsafePickleError` before anything runs. Tensors come back as
`TensorRef`s: dtype, shape, stride, storage offset and the exact byte range of their storage in the
file. Opening an archive reads its zip directory, its pickle and the 30-byte local headers of its
non-empty storages, each by an exact byte range (no read-ahead into tensor data): on a bucket that is
one size request and four rounds of range requests per file. No tensor byte is read until a caller
reads a `TensorRef`'s byte range.

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
from dataclasses import dataclass
from typing import Any

from ckptflow.errors import CheckpointNotFoundError, CkptflowError, CorruptFileError, SourceReadError, UnsafePickleError
from ckptflow.formats.deepspeed.names import ENUMS, RECORDS
from ckptflow.plumbing.sizes import element_count
from ckptflow.plumbing.storage import is_local, open_fs, read_ranges

# Storage class name -> (dtype name, item size in bytes).
STORAGE_DTYPES: dict[str, tuple[str, int]] = {
    "DoubleStorage": ("float64", 8),
    "FloatStorage": ("float32", 4),
    "HalfStorage": ("float16", 2),
    "BFloat16Storage": ("bfloat16", 2),
    "LongStorage": ("int64", 8),
    "IntStorage": ("int32", 4),
    "ShortStorage": ("int16", 2),
    "CharStorage": ("int8", 1),
    "ByteStorage": ("uint8", 1),
    "BoolStorage": ("bool", 1),
    "ComplexFloatStorage": ("complex64", 8),
    "ComplexDoubleStorage": ("complex128", 16),
}
DTYPE_SIZES: dict[str, int] = {name: size for name, size in STORAGE_DTYPES.values()}

_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")
_LOCAL_HEADER_MAGIC = b"PK\x03\x04"


@dataclass(frozen=True, slots=True)
class TensorRef:
    """Where a tensor's bytes are: everything needed to read exactly them, and nothing read yet."""

    uri: str
    key: str
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    storage_numel: int
    data_offset: int

    @property
    def numel(self) -> int:
        return element_count(self.shape)

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def is_contiguous(self) -> bool:
        expected = 1
        for dim, step in zip(reversed(self.shape), reversed(self.stride)):
            if dim != 1 and step != expected:
                return False
            expected *= dim
        return True

    @property
    def byte_range(self) -> tuple[int, int]:
        """[start, end) of this tensor's elements in the file; `CorruptFileError` for a strided tensor,
        whose elements are not one range (checkpoint tensors never are)."""
        if not self.is_contiguous:
            raise CorruptFileError(
                f"{self.uri}: storage {self.key} is read as a strided tensor (shape {list(self.shape)}, stride "
                f"{list(self.stride)}), which DeepSpeed never saves", file=self.uri,
                hint="the file is damaged or was written by another tool; copy it again from the training run",
            )
        start = self.data_offset + self.storage_offset * self.itemsize
        return start, start + self.nbytes

    def element_range(self, start: int, numel: int) -> tuple[int, int]:
        """[start, end) bytes of `numel` flat elements from element `start` of a contiguous tensor."""
        begin = self.byte_range[0] + start * self.itemsize
        return begin, begin + numel * self.itemsize


@dataclass(frozen=True)
class PickledObject:
    """A DeepSpeed object from the allow-list, kept as its qualified name and plain state."""

    qualname: str
    args: tuple[Any, ...]
    state: Any

    def get(self, name: str, default: Any = None) -> Any:
        if isinstance(self.state, dict):
            return self.state.get(name, default)
        return default


def _record_class(qualname: str) -> type:
    """A stand-in class for one allowed DeepSpeed global: it stores arguments and state, runs nothing."""

    class Record:
        def __init__(self, *args: Any) -> None:
            self.args = args
            self.state: Any = None

        def __new__(cls, *args: Any) -> "Record":
            obj = object.__new__(cls)
            obj.args = args
            obj.state = None
            return obj

        def __setstate__(self, state: Any) -> None:
            self.state = state

    Record.__qualname__ = Record.__name__ = qualname
    return Record


def _enum_value(value: Any) -> int:
    if not isinstance(value, int):
        raise pickle.UnpicklingError(f"enum value {value!r} is not an int")
    return value



class _Storage:
    """A storage reference from a pickle: its key, dtype and element count."""

    __slots__ = ("key", "dtype", "numel")

    def __init__(self, key: str, dtype: str, numel: int) -> None:
        self.key, self.dtype, self.numel = key, dtype, numel


class _StorageType:
    __slots__ = ("dtype",)

    def __init__(self, dtype: str) -> None:
        self.dtype = dtype


class _Marker:
    """A class named by the pickle only as a type tag (torch.Tensor, Parameter): never instantiated."""

    def __init__(self, name: str) -> None:
        self.name = name


class Archive:
    """One torch zip archive: its plain-data object tree with `TensorRef`s in place of tensors."""

    def __init__(self, uri: str, cache: "ArchiveCache | None" = None) -> None:
        self.uri = uri
        self.fs, self.path = open_fs(uri)
        self.cache = cache
        self._entries: dict[str, zipfile.ZipInfo] = {}
        self._data_offsets: dict[str, int] = {}
        self._records: dict[str, type] = {name: _record_class(name) for name in RECORDS}
        self.size = 0
        self.obj: Any = None

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
            self.size = self.fs.size(self.path)
        except FileNotFoundError:
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
                pieces.add(start, self._fetch([(start, end)])[0])
                if order is not None and zf.read(order).strip() != b"little":
                    raise CorruptFileError(
                        f"{self.uri} was written on a big-endian machine", file=self.uri,
                        hint="re-save it on a little-endian machine",
                    )
                return prefix, names, zf.read(pkl)
        except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, struct.error, ValueError, KeyError) as exc:
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
        options = {} if is_local(self.uri) else {"cache_type": "none"}
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
                    data_pkl = zf.read(pkl)
        except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, struct.error, ValueError) as exc:
            if isinstance(exc, CorruptFileError):
                raise
            if isinstance(exc.__context__, OSError):  # zipfile reports a failed read as "not a zip file"
                raise read_error(self.uri, exc.__context__) from exc.__context__
            raise CorruptFileError(
                f"{self.uri} is not a readable torch archive ({exc})", file=self.uri,
                hint="the file is truncated or not a checkpoint; copy it again from the training run",
            ) from None
        return prefix, names, data_pkl

    def _unpickle(self, data: bytes) -> Any:
        hit = self.cache.get(data) if self.cache is not None else None
        if hit is not None:
            return self._from_template(*hit)
        storages: dict[str, _Storage] = {}
        archive = self

        class Unpickler(pickle.Unpickler):
            def find_class(self, module: str, name: str) -> Any:
                return archive._find_class(module, name)

            def persistent_load(self, pid: Any) -> Any:
                if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
                    raise pickle.UnpicklingError(f"unknown persistent id {pid!r:.80}")
                _, stype, key, _location, numel = pid
                if not isinstance(stype, _StorageType) or not isinstance(key, str) or not isinstance(numel, int):
                    raise pickle.UnpicklingError(f"malformed storage reference {pid!r:.80}")
                archive._check_storage(key, numel * DTYPE_SIZES[stype.dtype])
                storage = storages.get(key)
                if storage is None:
                    storage = storages[key] = _Storage(key, stype.dtype, numel)
                return storage

        try:
            obj = Unpickler(io.BytesIO(data)).load()
        except UnsafePickleError:
            raise
        except Exception as exc:  # any malformed pickle: never let it escape as a traceback
            raise self._pickle_error(exc) from None
        self._resolve_offsets(sorted(storages))
        plain = _to_plain(obj, self)
        if self.cache is not None:
            self.cache.put(data, plain, {k: s.numel * DTYPE_SIZES[s.dtype] for k, s in storages.items()})
        return plain

    def _check_storage(self, key: str, expected: int) -> None:
        if key not in self._entries:
            raise pickle.UnpicklingError(f"storage {key} is named in the pickle but missing from the archive")
        if self._entries[key].file_size != expected:
            raise pickle.UnpicklingError(f"storage {key} holds {self._entries[key].file_size} bytes, expected {expected}")

    def _pickle_error(self, exc: BaseException) -> CorruptFileError:
        return CorruptFileError(
            f"{self.uri}: cannot read its pickle ({type(exc).__name__}: {exc})", file=self.uri,
            hint="the file is corrupt or truncated; copy it again from the training run",
        )

    def _from_template(self, template: Any, sizes: dict[str, int]) -> Any:
        """The tree of a pickle already unpickled from another file: its storages checked against
        this archive's records, and its non-empty tensors pointed at this file."""
        try:
            for key, nbytes in sizes.items():
                self._check_storage(key, nbytes)
        except pickle.UnpicklingError as exc:
            raise self._pickle_error(exc) from None
        self._resolve_offsets(sorted(sizes))
        return _rebase(template, self)

    def _find_class(self, module: str, name: str) -> Any:
        if module == "__builtin__":  # protocol-2 pickles use Python 2's module name
            module = "builtins"
        qual = f"{module}.{name}"
        if module == "torch" and name in STORAGE_DTYPES:
            return _StorageType(STORAGE_DTYPES[name][0])
        if qual in _SAFE_GLOBALS:
            return _SAFE_GLOBALS[qual]
        if qual in self._records:
            return self._records[qual]
        if qual in ENUMS:
            return _enum_value
        if module == "torch" and name in DTYPE_SIZES:
            return name
        raise UnsafePickleError(
            f"{self.uri} refers to {qual}, which ckptflow does not load", file=self.uri, actual=qual,
            hint="refused without running anything; only torch tensors and DeepSpeed's checkpoint "
            "classes are allowed; if this file is yours, re-save it without custom objects",
        )

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
        headers = self.fs.cat_ranges([self.path] * len(infos), starts, [s + _LOCAL_HEADER.size for s in starts],
                                     on_error="return") if not is_local(self.uri) else \
            _local_ranges(self.uri, [(s, s + _LOCAL_HEADER.size) for s in starts])
        for key, info, raw in zip(keys, infos, headers):
            if isinstance(raw, OSError):
                raise raw
            if isinstance(raw, BaseException) or len(raw) != _LOCAL_HEADER.size:
                raise CorruptFileError(
                    f"{self.uri}: storage {key} lies past the end of the file", file=self.uri,
                    hint="the file is truncated; copy it again",
                )
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

    def tensor(self, storage: _Storage, offset: int, shape: tuple[int, ...], stride: tuple[int, ...]) -> TensorRef:
        ref = TensorRef(
            uri=self.uri, key=storage.key, dtype=storage.dtype, shape=tuple(shape), stride=tuple(stride),
            storage_offset=offset, storage_numel=storage.numel, data_offset=self._data_offsets[storage.key],
        )
        if ref.numel:
            last = offset + sum((d - 1) * s for d, s in zip(ref.shape, ref.stride))
            if offset < 0 or last >= storage.numel:
                raise CorruptFileError(
                    f"{self.uri}: a tensor reaches past its storage {storage.key}", file=self.uri,
                    hint="the file is corrupt; copy it again",
                )
        return ref


def _rebuild_tensor(storage: Any, offset: Any, size: Any, stride: Any, *_rest: Any) -> tuple:
    if not isinstance(storage, _Storage):
        raise pickle.UnpicklingError("tensor without a storage")
    return ("__tensor__", storage, int(offset), tuple(int(x) for x in size), tuple(int(x) for x in stride))


def _rebuild_parameter(data: Any, *_rest: Any) -> Any:
    return data


def _rebuild_from_type(func: Any, _new_type: Any, args: Any, _state: Any) -> Any:
    if func is not _rebuild_tensor and func is not _rebuild_parameter:
        raise pickle.UnpicklingError("tensor rebuilt through an unexpected function")
    return func(*args)


def _size(dims: Any = ()) -> tuple[int, ...]:
    return tuple(int(d) for d in dims)


def _device(kind: Any, index: Any = None) -> str:
    return f"{kind}:{index}" if index is not None else str(kind)


def _codecs_encode(text: Any, encoding: str = "utf-8") -> bytes:
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1", "utf-8"):
        raise pickle.UnpicklingError("unexpected _codecs.encode call")
    return text.encode(encoding)


_SAFE_GLOBALS: dict[str, Any] = {
    "torch._utils._rebuild_tensor_v2": _rebuild_tensor,
    "torch._utils._rebuild_tensor": _rebuild_tensor,
    "torch._utils._rebuild_parameter": _rebuild_parameter,
    "torch._utils._rebuild_parameter_with_state": _rebuild_parameter,
    "torch._tensor._rebuild_from_type_v2": _rebuild_from_type,
    "torch.Tensor": _Marker("torch.Tensor"),
    "torch.nn.parameter.Parameter": _Marker("torch.nn.parameter.Parameter"),
    "torch.Size": _size,
    "torch.device": _device,
    "collections.OrderedDict": OrderedDict,
    "builtins.set": set,
    "builtins.frozenset": frozenset,
    "builtins.complex": complex,
    "builtins.slice": slice,
    "_codecs.encode": _codecs_encode,
}


def _to_plain(obj: Any, archive: Archive) -> Any:
    """Replace tensor tuples by `TensorRef`s and stand-in records by `PickledObject`s, recursively."""
    if isinstance(obj, tuple):
        if len(obj) == 5 and obj[0] == "__tensor__" and isinstance(obj[1], _Storage):
            return archive.tensor(obj[1], obj[2], obj[3], obj[4])
        return tuple(_to_plain(x, archive) for x in obj)
    if isinstance(obj, list):
        return [_to_plain(x, archive) for x in obj]
    if isinstance(obj, dict):
        out = type(obj)() if isinstance(obj, OrderedDict) else {}
        for k, v in obj.items():
            out[k] = _to_plain(v, archive)
        return out
    if type(obj).__name__ in archive._records and type(obj) is archive._records[type(obj).__name__]:
        return PickledObject(type(obj).__name__, _to_plain(obj.args, archive), _to_plain(obj.state, archive))
    if isinstance(obj, (_Storage, _StorageType, _Marker)):
        raise CorruptFileError(f"{archive.uri}: a bare storage in the pickle", file=archive.uri)
    return obj


def read_error(uri: str, exc: OSError) -> SourceReadError:
    detail = " ".join(str(exc).split()) or type(exc).__name__
    return SourceReadError(
        f"cannot read {uri} ({detail})", file=uri,
        hint="check access to the store (credentials, permissions, network) and retry",
    )


def open_archive(uri: str, cache: ArchiveCache | None = None) -> Archive:
    """Open the torch archive at `uri`: its directory, pickle and storage offsets, no tensor bytes.
    With `cache`, a pickle seen before (the same bytes in another file) is not unpickled again."""
    return Archive(uri, cache).open()


class ArchiveCache:
    """Trees of the pickles unpickled so far, by the pickle's bytes; safe to share between threads."""

    def __init__(self) -> None:
        self._trees: dict[bytes, tuple[Any, dict[str, int]]] = {}
        self._lock = threading.Lock()

    def get(self, data: bytes) -> tuple[Any, dict[str, int]] | None:
        with self._lock:
            return self._trees.get(data)

    def put(self, data: bytes, tree: Any, sizes: dict[str, int]) -> None:
        with self._lock:
            self._trees.setdefault(data, (tree, sizes))


def _rebase(obj: Any, archive: Archive) -> Any:
    """`obj` (a template tree) with each non-empty `TensorRef` pointing into `archive`; containers
    without such tensors are shared, not copied."""
    if isinstance(obj, TensorRef):
        if not obj.storage_numel:
            return obj
        return TensorRef(archive.uri, obj.key, obj.dtype, obj.shape, obj.stride, obj.storage_offset,
                         obj.storage_numel, archive._data_offsets[obj.key])
    if isinstance(obj, (list, tuple)):
        items = [_rebase(x, archive) for x in obj]
        if all(a is b for a, b in zip(items, obj)):
            return obj
        return items if isinstance(obj, list) else tuple(items)
    if isinstance(obj, dict):
        values = [_rebase(v, archive) for v in obj.values()]
        if all(a is b for a, b in zip(values, obj.values())):
            return obj
        out = type(obj)() if isinstance(obj, OrderedDict) else {}
        for k, v in zip(obj, values):
            out[k] = v
        return out
    if isinstance(obj, PickledObject):
        args, state = _rebase(obj.args, archive), _rebase(obj.state, archive)
        return obj if args is obj.args and state is obj.state else PickledObject(obj.qualname, args, state)
    return obj


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


def _local_ranges(uri: str, ranges: list[tuple[int, int]]) -> list[bytes]:
    """Byte ranges of a local file through one descriptor (short at the end of the file)."""
    fd = os.open(uri[len("file://"):] if uri.startswith("file://") else uri, os.O_RDONLY)
    try:
        return [os.pread(fd, end - start, start) for start, end in ranges]
    finally:
        os.close(fd)


_SCALAR_FORMATS = {"float64": "<d", "float32": "<f", "float16": "<e", "int64": "<q", "int32": "<i", "int16": "<h",
                   "int8": "<b", "uint8": "<B", "bool": "<?"}


def read_scalar(ref: TensorRef) -> float | int | bool:
    """The value of a one-element tensor (an optimizer step, a loss scale), read without torch."""
    if ref.numel != 1:
        raise ValueError(f"{ref.uri}: storage {ref.key} holds {ref.numel} elements, not one")
    fs, path = open_fs(ref.uri)
    start = ref.data_offset + ref.storage_offset * ref.itemsize
    raw = fs.cat_file(path, start=start, end=start + ref.itemsize)
    check_length(ref, raw, ref.itemsize)
    if ref.dtype == "bfloat16":  # the upper half of a float32
        return struct.unpack("<f", b"\x00\x00" + raw)[0]
    if ref.dtype not in _SCALAR_FORMATS:
        raise ValueError(f"{ref.uri}: cannot read a {ref.dtype} scalar")
    return struct.unpack(_SCALAR_FORMATS[ref.dtype], raw)[0]


def check_length(ref: TensorRef, raw: bytes, expected: int) -> None:
    if len(raw) != expected:
        raise CorruptFileError(
            f"{ref.uri}: read {len(raw)} bytes of storage {ref.key}, expected {expected}", file=ref.uri,
            expected=expected, actual=len(raw), hint="the file changed or was truncated while being read",
        )
