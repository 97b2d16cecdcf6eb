"""Torch's pickle of an object tree whose tensors are not in memory: `OutTensor` stand-ins, each over an
`OutStorage` that says which byte ranges of which source files fill it (zeros elsewhere).

`dumps(obj)` gives the pickle and its storages (small: byte ranges, not bytes), so that pickling and
writing (`writer.write_pickled`) can happen in different processes. The pickle is what `torch.save`
writes for the same tree (torch 2.x, checked against 2.13): `torch.load` reads it as its own.
"""

from __future__ import annotations

import io
import pickle
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, BinaryIO

from ckptflow.errors import CheckpointError
from ckptflow.formats.torch.inert import TorchDevice, TorchDtype
from ckptflow.formats.torch.pure_pickle import PyPickler
from ckptflow.formats.torch.tensorref import DTYPE_SIZES, STORAGE_DTYPES

STORAGE_CLASSES: dict[str, str] = {dtype: cls for cls, (dtype, _size) in STORAGE_DTYPES.items()}


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


class Rebuilt:
    """An object written back exactly as a source pickle made it (an `inert.InertRecord`, its contents
    converted): `cls` used `how` ("global": named only; "reduce": REDUCE `cls(*args)`; "newobj" and
    "newobj_ex": NEWOBJ / NEWOBJ_EX `cls.__new__(cls, *args, **kwargs)`; "obj": OBJ `cls(*args)`), then
    `ops` in order: ("appends", items) as APPENDS, ("setitems", ((key, value), ...)) as SETITEMS,
    ("build", state) as BUILD. Whoever loads the file runs what the source's loader would have."""

    __slots__ = ("cls", "how", "args", "kwargs", "ops")

    def __init__(self, cls: Global, how: str, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None,
                 ops: tuple[tuple[str, Any], ...] = ()) -> None:
        if how not in ("global", "reduce", "newobj", "newobj_ex", "obj"):
            raise ValueError(f"cannot write an object made by {how!r}")
        self.cls, self.how, self.args, self.kwargs, self.ops = cls, how, tuple(args), dict(kwargs or {}), tuple(ops)


REBUILD_TENSOR = Global("torch._utils", "_rebuild_tensor_v2")


_STORAGE_GLOBALS = {dtype: Global("torch", cls) for dtype, cls in STORAGE_CLASSES.items()}


class _Pickler(PyPickler):  # the Python implementation: its dispatch table can be extended
    dispatch = dict(PyPickler.dispatch)

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
        """A DeepSpeed object made by NEWOBJ; its arguments may hold it, as a rebuilt object's may."""
        self.save(obj.cls)
        self.save(obj.args)
        if self._saved_within(obj, pickle.POP * 2):
            return
        self.write(pickle.NEWOBJ)
        self.memoize(obj)
        self.save(obj.state)
        self.write(pickle.BUILD)

    def save_class(self, module: str, name: str) -> None:
        """The global `module.name` as protocol 2 names it: GLOBAL, or for a nested class (`Outer.Inner`)
        `getattr(module.Outer, "Inner")`, as pickle writes one below protocol 4 (whose loaders read no
        dotted GLOBAL)."""
        outer, _, last = name.rpartition(".")
        if not outer:
            module = "__builtin__" if module == "builtins" else module  # as protocol 2 spells it
            self.write(pickle.GLOBAL + f"{module}\n{name}\n".encode("utf-8"))
            return
        self.write(pickle.GLOBAL + b"__builtin__\ngetattr\n")
        self.save_class(module, outer)
        self.save(last)
        self.write(pickle.TUPLE2 + pickle.REDUCE)

    def save_rebuilt(self, obj: Rebuilt) -> None:
        """An object as its source pickle made it. Its arguments may hold it (a list among them that the
        source filled with it afterwards): saving them then saved it whole, and what is on the stack
        for this one is dropped for a reference to that one, nothing called twice."""
        if obj.how == "global":
            self.save_class(obj.cls.module, obj.cls.name)
        elif obj.how == "obj":
            self.write(pickle.MARK)
            self.save_class(obj.cls.module, obj.cls.name)
            for arg in obj.args:
                self.save(arg)
            if self._saved_within(obj, pickle.POP_MARK):
                return
            self.write(pickle.OBJ)
        else:
            self.save_class(obj.cls.module, obj.cls.name)
            self.save(obj.args)
            if obj.how == "newobj_ex":
                self.save(obj.kwargs)
            if self._saved_within(obj, pickle.POP * (3 if obj.how == "newobj_ex" else 2)):
                return
            self.write({"reduce": pickle.REDUCE, "newobj": pickle.NEWOBJ, "newobj_ex": pickle.NEWOBJ_EX}[obj.how])
        self.memoize(obj)
        for kind, items in obj.ops:
            if kind == "build":
                self.save(items)
                self.write(pickle.BUILD)
                continue
            self.write(pickle.MARK)
            for item in items:
                if kind == "setitems":
                    self.save(item[0])
                    self.save(item[1])
                else:
                    self.save(item)
            self.write(pickle.SETITEMS if kind == "setitems" else pickle.APPENDS)

    def _saved_within(self, obj: Rebuilt | Instance, drop: bytes) -> bool:
        """Whether saving `obj`'s arguments saved `obj` itself; if so, what they left on the stack dropped
        (`drop`) for a reference to it."""
        known = self.memo.get(id(obj))
        if known is None:
            return False
        self.write(drop + self.get(known[0]))
        return True

    def save_dtype(self, obj: TorchDtype) -> None:
        self.save_global_name(Global("torch", str(obj)))

    def save_device(self, obj: TorchDevice) -> None:
        self.save_call(Call(Global("torch", "device"), obj.args))

    def save_tensor(self, obj: OutTensor) -> None:
        self.save_call(Call(REBUILD_TENSOR, (obj.storage, obj.offset, obj.shape, obj.stride, False, OrderedDict())))

    dispatch[Global] = save_global_name
    dispatch[Call] = save_call
    dispatch[Instance] = save_instance
    dispatch[Rebuilt] = save_rebuilt
    dispatch[TorchDtype] = save_dtype
    dispatch[TorchDevice] = save_device
    dispatch[OutTensor] = save_tensor


def dumps(obj: Any) -> tuple[bytes, list[OutStorage]]:
    """The pickle of `obj` (protocol 2, as torch writes it) and its storages in key order.

    `obj` is plain data (dicts, lists, tuples, numbers, strings, OrderedDicts) with `OutTensor`,
    `Global`, `Call` and `Instance` stand-ins for everything torch or DeepSpeed would pickle, `Rebuilt`
    for the objects of a client state, and the torch dtypes and devices the reader gives back.
    """
    buf = io.BytesIO()
    pickler = _Pickler(buf)
    try:
        pickler.dump(obj)
    except RecursionError:  # a client state whose references back to itself make a path too long to write
        raise CheckpointError("cannot write an object tree that nests objects more than Python's recursion limit "
                              "deep (a client state holding long chains of references)") from None
    return buf.getvalue(), pickler.storages
