"""Torch zip archives (`torch.save` files), read lazily and safely from any fsspec URI.

This is the one module that turns checkpoint pickles into data. Its unpickler resolves globals
through an allow-list of the names real DeepSpeed checkpoints use, each mapped to plain data; any
other global is refused with `UnsafePickleError` before anything runs. Unpickling is bounded: the
pickle's size and opcode count, tuples nested at most `MAX_DEPTH` deep while they are built (hashing a
deeper one overflows the C stack), BUILD only on the objects that take state, and the object tree
it yields at most `MAX_DEPTH` deep and `MAX_OBJECTS` nodes with shared references counted every
time they are reached (so a "billion laughs" of shared lists is refused, never expanded); shared
references stay shared in what `Archive.obj` holds. Tensors come back as
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
import re
import struct
import threading
import zipfile
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ckptflow.errors import CheckpointNotFoundError, CkptflowError, CorruptFileError, SourceReadError, UnsafePickleError
from ckptflow.formats.deepspeed.names import ENUMS, RECORDS
from ckptflow.plumbing.files import check_regular
from ckptflow.plumbing.sizes import element_count
from ckptflow.plumbing.storage import READ_FLAGS, is_local, open_fs, read_ranges
from ckptflow.plumbing.text import excerpt, one_line, plain
from ckptflow.plumbing.redaction import describe

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

# Bounds on what one pickle may cost. DeepSpeed's largest pickles (model states of a model with tens of
# thousands of tensors) are a few MB of a few hundred thousand opcodes, nest under ten levels and hold
# a few objects per tensor.
MAX_PICKLE_BYTES = 256 << 20
MAX_PICKLE_OPS = 20_000_000
MAX_DEPTH = 100
MAX_OBJECTS = 10_000_000


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


class _Unpickler(pickle._Unpickler):  # the Python implementation: its loop and dispatch table can be bounded
    """The allow-list unpickler of one archive's pickle, with the bounds of the module docstring.

    The Python implementation rather than the C one: its memo is a dict (the C unpickler grows an
    array to the largest index a PUT names: a 5-byte opcode costs gigabytes), its loop counts
    opcodes, and its dispatch table lets the opcodes that build, hash and instantiate be checked.
    Its speed (about a microsecond an opcode) is no cost next to the files' sizes.

    Hashing is where a pickle can hurt while it loads: a tuple's hash recurses in C without a guard
    (one nested 100,000 deep crashes the interpreter) and is not cached (one made of shared tuples
    costs its whole expansion, every time it is hashed). So every tuple and frozenset is measured as
    it is built (how deep, how many nodes when expanded) and refused past `MAX_DEPTH` / `MAX_OBJECTS`,
    and every key or member hashed (SETITEM, SETITEMS, DICT, ADDITEMS, FROZENSET, the set, frozenset
    and OrderedDict constructors) is charged its expansion against a budget of `MAX_OBJECTS`."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, data: bytes, archive: "Archive") -> None:
        super().__init__(io.BytesIO(data))
        self.archive = archive
        self.storages: dict[str, _Storage] = {}
        self.sizes: dict[int, tuple[Any, int, int]] = {}  # id -> (tuple or frozenset, height, nodes expanded)
        self.hashed = 0  # nodes hashed so far

    def load(self) -> Any:  # pickle._Unpickler.load with an opcode budget
        self._unframer = pickle._Unframer(self._file_read, self._file_readline)
        self.read, self.readinto, self.readline = self._unframer.read, self._unframer.readinto, self._unframer.readline
        self.metastack, self.stack = [], []
        self.append = self.stack.append
        self.proto = 0
        read, dispatch = self.read, self.dispatch
        try:
            for _ in range(MAX_PICKLE_OPS):
                key = read(1)
                if not key:
                    raise EOFError("the pickle ends before its STOP opcode")
                dispatch[key[0]](self)
        except pickle._Stop as stop:
            return stop.value
        raise pickle.UnpicklingError(f"more than {MAX_PICKLE_OPS:,} opcodes")

    def find_class(self, module: str, name: str) -> Any:
        return self.archive._find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unknown persistent id ({_what(pid)}), where torch writes a storage tuple")
        _, stype, key, _location, numel = pid
        if not isinstance(stype, _StorageType) or not isinstance(key, str) or type(numel) is not int:
            raise pickle.UnpicklingError("malformed storage reference")
        _check_storage(self.archive, key, stype.dtype, numel)
        storage = self.storages.get(key)
        if storage is None:
            storage = self.storages[key] = _Storage(key, stype.dtype, numel)
        return storage

    # -- measuring what gets hashed ----------------------------------------------------------------

    def _nodes(self, item: Any) -> int:
        known = self.sizes.get(id(item))
        return known[2] if known is not None else 1

    def _measure(self, value: Any) -> None:
        """Record how deep and how large (expanded) a tuple or frozenset just built is."""
        if not value:
            return
        height, nodes = 0, 1
        for item in value:
            known = self.sizes.get(id(item))
            if known is not None:
                height, nodes = max(height, known[1]), nodes + known[2]
            else:
                nodes += 1
        if height + 1 > MAX_DEPTH:
            raise pickle.UnpicklingError(f"tuples or frozensets nested more than {MAX_DEPTH} deep")
        if nodes > MAX_OBJECTS:
            raise pickle.UnpicklingError(f"a tuple of shared references that expands to more than {MAX_OBJECTS:,} objects")
        self.sizes[id(value)] = (value, height + 1, nodes)

    def _charge(self, items: Any) -> None:
        """Count what hashing `items` costs against the budget."""
        if isinstance(items, dict):
            items = items.keys()
        elif not isinstance(items, list | tuple | set | frozenset):
            raise pickle.UnpicklingError(f"a set or dict built from {_what(items)}")
        self.hashed += sum(self._nodes(item) for item in items)
        if self.hashed > MAX_OBJECTS:
            raise pickle.UnpicklingError(f"its keys and set members expand to more than {MAX_OBJECTS:,} objects")

    def load_setitem(self) -> None:
        self._charge((self.stack[-2],))
        pickle._Unpickler.load_setitem(self)

    def load_setitems(self) -> None:
        self._charge(self.stack[::2])
        pickle._Unpickler.load_setitems(self)

    def load_dict(self) -> None:
        self._charge(self.stack[::2])
        pickle._Unpickler.load_dict(self)

    def load_additems(self) -> None:
        self._charge(self.stack)
        pickle._Unpickler.load_additems(self)

    def load_frozenset(self) -> None:
        self._charge(self.stack)
        pickle._Unpickler.load_frozenset(self)
        self._measure(self.stack[-1])

    def load_reduce(self) -> None:
        if len(self.stack) < 2 or not isinstance(self.stack[-1], tuple):
            raise pickle.UnpicklingError("REDUCE without a callable and an argument tuple")
        func, args = self.stack[-2], self.stack[-1]
        if func in (set, frozenset, OrderedDict):
            for arg in args:
                self._charge(arg)
        pickle._Unpickler.load_reduce(self)
        if type(self.stack[-1]) is frozenset:
            self._measure(self.stack[-1])

    def load_newobj(self) -> None:
        self._record_only(self.stack[-2] if len(self.stack) >= 2 else None)
        pickle._Unpickler.load_newobj(self)

    def load_newobj_ex(self) -> None:
        self._record_only(self.stack[-3] if len(self.stack) >= 3 else None)
        pickle._Unpickler.load_newobj_ex(self)

    def _instantiate(self, klass: Any, args: Any) -> None:  # INST and OBJ
        self._record_only(klass)
        pickle._Unpickler._instantiate(self, klass, args)

    def _record_only(self, cls: Any) -> None:
        """NEWOBJ, NEWOBJ_EX, INST and OBJ make instances of DeepSpeed's records only (the allowed
        builtins and torch names are built through REDUCE, as torch pickles them)."""
        if cls not in self.archive._records.values():
            raise pickle.UnpicklingError(f"an instance of {_what(cls)} made without REDUCE")

    def load_build(self) -> None:
        """BUILD only on DeepSpeed's records (their state is kept) and on dicts (torch's `_metadata`
        attribute of a state dict): never on a storage reference, a function or a type marker."""
        if len(self.stack) < 2:
            raise pickle.UnpicklingError("BUILD with nothing to build")
        state, inst = self.stack[-1], self.stack[-2]
        if type(inst) in self.archive._records.values() or (
            isinstance(inst, OrderedDict) and isinstance(state, dict) and all(type(k) is str for k in state)
        ):
            return pickle._Unpickler.load_build(self)
        raise pickle.UnpicklingError(f"BUILD gives {_what(inst)} a state it cannot take")


def _measured(original: Any) -> Any:
    def load(self: _Unpickler) -> None:
        original(self)
        self._measure(self.stack[-1])

    return load


for _op in (pickle.TUPLE, pickle.TUPLE1, pickle.TUPLE2, pickle.TUPLE3):
    _Unpickler.dispatch[_op[0]] = _measured(pickle._Unpickler.dispatch[_op[0]])
for _op, _method in ((pickle.SETITEM, _Unpickler.load_setitem), (pickle.SETITEMS, _Unpickler.load_setitems),
                     (pickle.DICT, _Unpickler.load_dict), (pickle.ADDITEMS, _Unpickler.load_additems),
                     (pickle.FROZENSET, _Unpickler.load_frozenset), (pickle.REDUCE, _Unpickler.load_reduce),
                     (pickle.NEWOBJ, _Unpickler.load_newobj), (pickle.NEWOBJ_EX, _Unpickler.load_newobj_ex),
                     (pickle.BUILD, _Unpickler.load_build)):
    _Unpickler.dispatch[_op[0]] = _method


def _check_storage(archive: "Archive", key: Any, dtype: Any, numel: Any) -> None:
    """A storage reference names an entry of the archive that holds exactly its bytes."""
    if not isinstance(key, str) or key not in archive._entries:
        raise pickle.UnpicklingError(f"storage {_key(key)} is named in the pickle but missing from the archive")
    if dtype not in DTYPE_SIZES:
        raise pickle.UnpicklingError(f"storage {_key(key)} has an unknown dtype {excerpt(dtype)}")
    if type(numel) is not int or numel < 0:
        raise pickle.UnpicklingError(f"storage {_key(key)} has an element count of {excerpt(numel)}")
    expected = numel * DTYPE_SIZES[dtype]
    if archive._entries[key].file_size != expected:
        raise pickle.UnpicklingError(
            f"storage {_key(key)} holds {archive._entries[key].file_size} bytes, expected {excerpt(expected)}")


def _qualname(qual: str, limit: int = 120) -> str:
    """A global's dotted name for a message: as it is, control characters escaped, cut when long."""
    return plain(qual) if len(qual) <= limit else f"{plain(qual[:limit])}... ({len(qual):,} characters)"


def _key(key: Any) -> str:
    """A storage key for a message: as it is when it looks like one torch writes, else quoted."""
    return key if isinstance(key, str) and _PLAIN_KEY.fullmatch(key) else excerpt(key)


_PLAIN_KEY = re.compile(r"[A-Za-z0-9_.-]{1,40}")


def _what(obj: Any) -> str:
    """What an object from a pickle is, in a few words, whatever it holds."""
    if isinstance(obj, _Storage):
        return "a storage reference"
    if isinstance(obj, _StorageType):
        return "a storage type"
    if isinstance(obj, _Marker):
        return obj.name
    if callable(obj) and not isinstance(obj, type):
        return f"the function {getattr(obj, '__name__', '?')}"
    return excerpt(obj) if isinstance(obj, str | bytes | int | float | bool | type(None)) else f"a {type(obj).__name__}"


def _why(exc: BaseException) -> str:
    """The reason a pickle could not be read, in words a user can act on."""
    if isinstance(exc, pickle.UnpicklingError):
        return one_line(str(exc), 300)
    if isinstance(exc, RecursionError):
        return f"it nests objects more than {MAX_DEPTH} deep"
    if isinstance(exc, MemoryError):
        return "it needs more memory than any checkpoint pickle"
    if isinstance(exc, EOFError):
        return "it is truncated"
    if isinstance(exc, OverflowError):
        return f"a number out of range: {one_line(str(exc), 200)}"
    return f"{type(exc).__name__}: {one_line(str(exc), 200)}"


_NOT_REGULAR_HINT = "put the file DeepSpeed saved in its place (copy it again from the training run)"


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
            # A local FIFO, device or folder in a rank file's place is named as what it is, never opened.
            self.size = check_regular(self.uri, hint=_NOT_REGULAR_HINT) if is_local(self.uri) else \
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
                    if pkl.file_size > MAX_PICKLE_BYTES:
                        raise CorruptFileError(
                            f"{self.uri}: its pickle is {pkl.file_size:,} bytes, more than a checkpoint's can be "
                            f"({MAX_PICKLE_BYTES:,} at most)", file=self.uri,
                            hint="the file is damaged or not a DeepSpeed checkpoint file",
                        )
                    data_pkl = zf.read(pkl)
        except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, struct.error, ValueError, NotImplementedError) as exc:
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
        unpickler = _Unpickler(data, self)
        try:
            obj = unpickler.load()
        except UnsafePickleError:
            raise
        except Exception as exc:  # any malformed pickle: never let it escape as a traceback
            raise self._pickle_error(exc) from None
        self._resolve_offsets(sorted(unpickler.storages))
        tree = _to_plain(obj, self)
        if self.cache is not None:
            self.cache.put(data, tree, {k: (s.dtype, s.numel) for k, s in unpickler.storages.items()})
        return tree

    def _pickle_error(self, exc: BaseException) -> CorruptFileError:
        return CorruptFileError(
            f"{self.uri}: cannot read its pickle ({_why(exc)})", file=self.uri,
            hint="the file is corrupt or truncated; copy it again from the training run",
        )

    def _from_template(self, template: Any, storages: dict[str, tuple[str, int]]) -> Any:
        """The tree of a pickle already unpickled from another file: its storages checked against
        this archive's records, and its non-empty tensors pointed at this file."""
        try:
            for key, (dtype, numel) in storages.items():
                _check_storage(self, key, dtype, numel)
        except pickle.UnpicklingError as exc:
            raise self._pickle_error(exc) from None
        self._resolve_offsets(sorted(storages))
        return _rebase(template, self, {})

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
            f"{self.uri} refers to {_qualname(qual)}, which ckptflow does not load", file=self.uri, actual=qual,
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

    def tensor(self, record: _TensorRecord) -> TensorRef:
        """The `TensorRef` of a tensor record, checked as it is used: its storage reference as it ended
        up after the whole pickle ran (a BUILD cannot have changed it behind `persistent_load`'s
        check), every dimension at least 0, every element inside the storage."""
        storage = record.storage
        try:
            _check_storage(self, storage.key, storage.dtype, storage.numel)
        except pickle.UnpicklingError as exc:
            raise CorruptFileError(f"{self.uri}: {exc}", file=self.uri, hint="the file is corrupt; copy it again") from None
        if any(d < 0 for d in record.shape):
            raise CorruptFileError(f"{self.uri}: a tensor of storage {_key(storage.key)} has the shape "
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
                    f"{self.uri}: a tensor reaches past its storage {_key(storage.key)}", file=self.uri,
                    hint="the file is corrupt; copy it again",
                )
        return ref


class _TensorRecord:
    """A tensor as the pickle rebuilt it: storage, offset, shape, stride (a class the pickle cannot name)."""

    __slots__ = ("storage", "offset", "shape", "stride")

    def __init__(self, storage: "_Storage", offset: int, shape: tuple[int, ...], stride: tuple[int, ...]) -> None:
        self.storage, self.offset, self.shape, self.stride = storage, offset, shape, stride


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple | list) or len(value) > 64 or any(type(x) is not int for x in value):
        raise pickle.UnpicklingError(f"a tensor's {what} is {_what(value)}, not a tuple of integers")
    return tuple(value)


def _rebuild_tensor(storage: Any, offset: Any, size: Any, stride: Any, *_rest: Any) -> _TensorRecord:
    if not isinstance(storage, _Storage):
        raise pickle.UnpicklingError("tensor without a storage")
    if type(offset) is not int:
        raise pickle.UnpicklingError(f"a tensor's storage offset is {_what(offset)}, not an integer")
    shape, strides = _ints(size, "shape"), _ints(stride, "stride")
    if len(shape) != len(strides):
        raise pickle.UnpicklingError(f"a tensor has {len(shape)} dimensions but {len(strides)} strides")
    return _TensorRecord(storage, offset, shape, strides)


def _rebuild_parameter(data: Any, *_rest: Any) -> Any:
    return data


def _rebuild_from_type(func: Any, _new_type: Any, args: Any, _state: Any) -> Any:
    if func is not _rebuild_tensor and func is not _rebuild_parameter:
        raise pickle.UnpicklingError("tensor rebuilt through an unexpected function")
    return func(*args)


def _size(dims: Any = ()) -> tuple[int, ...]:
    return _ints(dims, "shape")


def _device(kind: Any, index: Any = None) -> str:
    if not isinstance(kind, str) or not (index is None or type(index) is int):
        raise pickle.UnpicklingError("a device that is not a name and an index")
    return f"{kind}:{index}" if index is not None else kind


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


def _to_plain(root: Any, archive: Archive) -> Any:
    """The unpickled tree as plain data: tensor records become `TensorRef`s, DeepSpeed records
    `PickledObject`s, containers are rebuilt around them.

    Without recursion, each object once: an object reached twice (a shared reference) becomes one
    plain object reached twice, so a "billion laughs" costs its size in the pickle, not its expansion.
    The tree is refused (`CorruptFileError`) when it nests more than `MAX_DEPTH` deep, holds a
    reference cycle, or would hold more than `MAX_OBJECTS` nodes were every shared reference copied:
    whatever walks it later stays bounded too."""
    done: dict[int, tuple[Any, int]] = {}  # id -> (plain object, nodes it stands for when expanded)
    path: set[int] = set()  # the objects being rebuilt: the ancestors of the one on top of the stack
    seen: set[int] = set()  # tuples and frozensets already checked as keys or set members
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        obj, ready = stack.pop()
        key = id(obj)
        if ready:
            path.discard(key)
            done[key] = _rebuilt(obj, done, archive)
            continue
        if key in done:
            continue
        kids = _children(obj, archive, seen)
        if kids is None:
            done[key] = (_leaf(obj, archive, seen), 1)
            continue
        if len(path) >= MAX_DEPTH:
            raise _tree_error(archive, f"it nests containers more than {MAX_DEPTH} deep")
        path.add(key)
        stack.append((obj, True))
        for kid in kids:
            if id(kid) in path:
                raise _tree_error(archive, "it holds a reference cycle")
            if id(kid) not in done:
                stack.append((kid, False))
    return done[id(root)][0]


def _tree_error(archive: Archive, why: str) -> CorruptFileError:
    return CorruptFileError(f"{archive.uri}: cannot read its pickle ({why})", file=archive.uri,
                            hint="the file is corrupt or was not written by DeepSpeed; copy it again")


def _is_record(obj: Any, archive: Archive) -> bool:
    return type(obj).__name__ in archive._records and type(obj) is archive._records[type(obj).__name__]


def _children(obj: Any, archive: Archive, seen: set[int]) -> Any:
    """What a container holds (None for a leaf)."""
    if isinstance(obj, tuple | list):
        return obj
    if isinstance(obj, dict):
        for k in obj:
            _check_hashable(k, archive, "a dict key", seen)
        return list(obj.values())
    if _is_record(obj, archive):
        return (obj.args, obj.state)
    return None


_ATOMS = (str, bytes, int, float, complex, bool, type(None))


def _check_hashable(value: Any, archive: Archive, what: str, seen: set[int]) -> None:
    """A dict key or set member must be plain data: atoms, and tuples and frozensets of them (each
    looked into once, `seen` remembering which)."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, tuple | frozenset):
            if id(item) not in seen:
                seen.add(id(item))
                pending.extend(item)
        elif not isinstance(item, _ATOMS):
            raise _tree_error(archive, f"{what} is {_what(item)}, not plain data")


def _leaf(obj: Any, archive: Archive, seen: set[int]) -> Any:
    if isinstance(obj, _TensorRecord):
        return archive.tensor(obj)
    if isinstance(obj, _ATOMS):
        return obj
    if isinstance(obj, slice) and all(isinstance(x, _ATOMS) for x in (obj.start, obj.stop, obj.step)):
        return obj
    if isinstance(obj, set | frozenset):
        for member in obj:
            _check_hashable(member, archive, "a set member", seen)
        return obj
    raise _tree_error(archive, f"it holds {_what(obj)} where data belongs")


def _rebuilt(obj: Any, done: dict[int, tuple[Any, int]], archive: Archive) -> tuple[Any, int]:
    """(plain copy of `obj` made of its children's, the nodes it stands for when expanded)."""
    if isinstance(obj, dict):
        kids = [done[id(v)] for v in obj.values()]
        plain: Any = OrderedDict() if isinstance(obj, OrderedDict) else {}
        for k, kid in zip(obj, kids):
            plain[k] = kid[0]
    elif _is_record(obj, archive):
        kids = [done[id(obj.args)], done[id(obj.state)]]
        plain = PickledObject(type(obj).__name__, kids[0][0], kids[1][0])
    else:
        kids = [done[id(v)] for v in obj]
        plain = [kid[0] for kid in kids] if isinstance(obj, list) else tuple(kid[0] for kid in kids)
    nodes = 1 + sum(kid[1] for kid in kids)
    if nodes > MAX_OBJECTS:
        raise _tree_error(archive, f"its shared references expand to more than {MAX_OBJECTS:,} objects")
    return plain, nodes


def read_error(uri: str, exc: OSError) -> SourceReadError:
    detail = describe(exc)
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
        self._trees: dict[bytes, tuple[Any, dict[str, tuple[str, int]]]] = {}
        self._lock = threading.Lock()

    def get(self, data: bytes) -> tuple[Any, dict[str, tuple[str, int]]] | None:
        with self._lock:
            return self._trees.get(data)

    def put(self, data: bytes, tree: Any, storages: dict[str, tuple[str, int]]) -> None:
        """Keep `tree` for `data`, with its storages as (dtype, element count) by key."""
        with self._lock:
            self._trees.setdefault(data, (tree, storages))


def _rebase(obj: Any, archive: Archive, memo: dict[int, Any]) -> Any:
    """`obj` (a template tree) with each non-empty `TensorRef` pointing into `archive`; containers
    without such tensors are shared, not copied, and an object the template shares stays shared. The
    template passed `_to_plain`'s bounds (depth and nodes), so the recursion is bounded too."""
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


def _local_ranges(uri: str, ranges: list[tuple[int, int]]) -> list[bytes]:
    """Byte ranges of a local file through one descriptor (short at the end of the file)."""
    fd = os.open(uri[len("file://"):] if uri.startswith("file://") else uri, READ_FLAGS)
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
