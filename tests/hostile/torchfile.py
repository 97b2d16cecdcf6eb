"""Editing torch zip archives (`torch.save` files) for the corpus: their zip structure, their pickle,
their tensors. Test code only, and only ever run on our own fixture files.

- `Archive.read(path)` / `.write(path)`: the entries in order, rewritten as stored (uncompressed) zip
  entries, so one entry (the pickle, a storage) can change and the rest stay as torch wrote them.
- `regions(path)`: byte ranges of the zip directory, the local headers, the pickle and the storage
  data, for byte flips aimed at one region.
- `inspect_pickle(data)`: the object tree with `TensorInfo` leaves (storage key, dtype, offset, size,
  stride), plus where in the pickle each storage's persistent id ends, so a BUILD can be spliced in
  right after it. A pure-Python unpickler with stand-ins for every global: nothing is executed.
- `inject(path, key, ops)`: add `key: <value built by ops>` to the top-level dict of a file's pickle.
- `resave(path, edit)`: `torch.load` a trusted fixture file, edit the object, `torch.save` it back
  (the way the original inline corpus changed one field). `Strided` saves a tensor record with any
  offset, size and stride, even ones torch itself refuses.
"""

from __future__ import annotations

import io
import pickle
import struct
import threading
import zipfile
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.hostile import pickleasm as asm


@dataclass
class Archive:
    """A zip archive's entries, in order: (ZipInfo, bytes)."""

    entries: list[tuple[zipfile.ZipInfo, bytes]]

    @classmethod
    def read(cls, path: Path) -> "Archive":
        with zipfile.ZipFile(path) as zf:
            return cls([(info, zf.read(info)) for info in zf.infolist()])

    def write(self, path: Path) -> None:
        tmp = path.with_name(path.name + ".rewrite")
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED) as zf:
            for info, data in self.entries:
                fresh = zipfile.ZipInfo(info.filename, date_time=info.date_time)
                fresh.compress_type = info.compress_type
                fresh.external_attr = info.external_attr
                zf.writestr(fresh, data)
        tmp.replace(path)

    @property
    def pickle_name(self) -> str:
        return next(i.filename for i, _ in self.entries if i.filename.endswith("data.pkl"))

    def get(self, name: str) -> bytes:
        return next(d for i, d in self.entries if i.filename == name)

    def set(self, name: str, data: bytes) -> None:
        self.entries = [(i, data if i.filename == name else d) for i, d in self.entries]

    def storage_names(self) -> list[str]:
        return [i.filename for i, _ in self.entries if "/data/" in i.filename]


def get_pickle(path: Path) -> bytes:
    archive = Archive.read(path)
    return archive.get(archive.pickle_name)


def set_pickle(path: Path, data: bytes) -> None:
    archive = Archive.read(path)
    archive.set(archive.pickle_name, data)
    archive.write(path)


def inject(path: Path, key: str, value_ops: bytes) -> None:
    """Add `key` -> (the object `value_ops` builds) to the top-level dict of `path`'s pickle."""
    data = get_pickle(path)
    assert data.endswith(asm.op("STOP")), "a pickle ends with STOP"
    set_pickle(path, data[:-1] + asm.string(key) + value_ops + asm.op("SETITEM") + asm.op("STOP"))


def splice(path: Path, position: int, ops: bytes) -> None:
    """Insert raw opcodes into `path`'s pickle at byte `position`."""
    data = get_pickle(path)
    set_pickle(path, data[:position] + ops + data[position:])


# ---- regions of the file -------------------------------------------------------------------------


@dataclass(frozen=True)
class Regions:
    """[start, end) byte ranges of a zip file's parts."""

    directory: tuple[int, int]  # central directory and end records
    headers: tuple[tuple[int, int], ...]  # each entry's local header (with its name and extra field)
    pickle: tuple[int, int]
    data: tuple[tuple[int, int], ...]  # each storage's bytes


def regions(path: Path) -> Regions:
    raw = path.read_bytes()
    headers, data, pkl = [], [], (0, 0)
    with zipfile.ZipFile(path) as zf:
        infos = zf.infolist()
        directory_start = min((zf.start_dir,), default=len(raw))
        for info in infos:
            start = info.header_offset
            name_len, extra_len = struct.unpack("<HH", raw[start + 26:start + 30])
            body = start + 30 + name_len + extra_len
            headers.append((start, body))
            span = (body, body + info.compress_size)
            if info.filename.endswith("data.pkl"):
                pkl = span
            elif "/data/" in info.filename:
                data.append(span)
    return Regions(directory=(directory_start, len(raw)), headers=tuple(headers), pickle=pkl, data=tuple(data))


# ---- reading a pickle without running it ---------------------------------------------------------


@dataclass(frozen=True)
class StorageInfo:
    key: str
    dtype: str  # the storage class name: FloatStorage, BFloat16Storage ...
    numel: int


@dataclass(frozen=True)
class TensorInfo:
    storage: StorageInfo
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


class Stand:
    """A stand-in for any global the pickle names: keeps its name, arguments and state."""

    qualname = "?"
    args: tuple[Any, ...] = ()
    state: Any = None

    def __repr__(self) -> str:
        return f"Stand({self.qualname}, args={self.args!r}, state={self.state!r})"


@dataclass
class PickleMap:
    obj: Any
    persid_ends: dict[str, list[int]] = field(default_factory=dict)  # storage key -> byte after each BINPERSID

    def tensors(self) -> list[tuple[tuple[Any, ...], TensorInfo]]:
        """(path in the object tree, tensor) for every tensor, in tree order."""
        out: list[tuple[tuple[Any, ...], TensorInfo]] = []

        def walk(node: Any, path: tuple[Any, ...]) -> None:
            if isinstance(node, TensorInfo):
                out.append((path, node))
            elif isinstance(node, dict):
                for k, v in node.items():
                    walk(v, (*path, k))
            elif isinstance(node, (list, tuple)):
                for i, v in enumerate(node):
                    walk(v, (*path, i))
            elif isinstance(node, Stand):
                walk(node.state, (*path, "<state>"))

        walk(self.obj, ())
        return out


def inspect_pickle(data: bytes) -> PickleMap:
    stream = io.BytesIO(data)
    ends: dict[str, list[int]] = {}

    class Reader(pickle._Unpickler):  # type: ignore[name-defined, misc]
        def find_class(self, module: str, name: str) -> Any:
            qual = f"{module}.{name}"
            if qual in ("torch._utils._rebuild_tensor_v2", "torch._utils._rebuild_tensor"):
                return lambda storage, offset, size, stride, *rest: TensorInfo(storage, offset, tuple(size),
                                                                               tuple(stride))
            if qual in ("torch._utils._rebuild_parameter", "torch._utils._rebuild_parameter_with_state"):
                return lambda data, *rest: data
            if qual == "torch._tensor._rebuild_from_type_v2":
                return lambda func, new_type, args, state: func(*args)
            if qual in ("torch.Tensor", "torch.nn.parameter.Parameter", "torch.Size"):
                return qual if qual != "torch.Size" else tuple
            if qual == "collections.OrderedDict":
                return OrderedDict
            if module == "torch" and name.endswith("Storage"):
                return name

            class AnyGlobal(Stand):
                qualname = qual

                def __init__(self, *args: Any) -> None:
                    self.args = args

                def __setstate__(self, state: Any) -> None:
                    self.state = state

            return AnyGlobal

        def persistent_load(self, pid: Any) -> Any:
            _, storage_type, key, _location, numel = pid
            ends.setdefault(key, []).append(stream.tell())
            return StorageInfo(key, storage_type, numel)

    return PickleMap(Reader(stream).load(), ends)


def tensor_at(path: Path, *keys: Any) -> TensorInfo:
    """The tensor record at `keys` in the object tree of `path`."""
    node = inspect_pickle(get_pickle(path)).obj
    for key in keys:
        node = node[key]
    assert isinstance(node, TensorInfo), (path, keys, type(node))
    return node


# ---- re-saving through torch -----------------------------------------------------------------------


_LOAD_LOCK = threading.Lock()


def load(path: Path) -> Any:
    """`torch.load` of our own fixture file (never a checkpoint from outside). One at a time: the
    first load imports deepspeed (its classes are in the pickles), and two threads importing it at
    once deadlock on its module locks."""
    import torch

    with _LOAD_LOCK:
        return torch.load(path, weights_only=False)


def resave(path: Path, edit: Callable[[Any], Any]) -> None:
    """Rewrite a trusted fixture file with `edit(obj)` applied (an edit may also return a new object)."""
    import torch

    obj = load(path)
    new = edit(obj)
    torch.save(obj if new is None else new, path)


class Strided:
    """Pickles as `_rebuild_tensor_v2(storage of tensor, offset, size, stride)`: any record at all."""

    def __init__(self, tensor: Any, offset: int, size: tuple[int, ...], stride: tuple[int, ...]) -> None:
        self.tensor, self.offset, self.size, self.stride = tensor, offset, size, stride

    def __reduce__(self) -> tuple[Any, ...]:
        import torch
        from torch._utils import _rebuild_tensor_v2

        storage = torch.storage.TypedStorage(wrap_storage=self.tensor.untyped_storage(), dtype=self.tensor.dtype,
                                             _internal=True)
        return (_rebuild_tensor_v2, (storage, self.offset, tuple(self.size), tuple(self.stride), False, OrderedDict()))


class Payload:
    """Pickles as a call of any function: `Payload(os.system, "touch x")` is REDUCE posix.system."""

    def __init__(self, func: Callable[..., Any], *args: Any) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.func, self.args)
