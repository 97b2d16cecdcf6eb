"""The bounded allow-list unpickler of torch archives: the one place checkpoint pickles become data.

Globals resolve through an allow-list: torch's tensor rebuilders and a few plain builtins always, plus
what the caller passes in `Allowed` (for DeepSpeed checkpoints, `formats.deepspeed.names.ALLOWED`):
records, kept as `PickledObject`s, and enums, read as their values. Any other global is refused with
`UnsafePickleError` before anything runs, unless `Allowed.inert` says to keep it as an inert record
(`formats.torch.inert`: a trainer's client state): then it becomes an `InertRecord` (module, name,
how it was made, what was applied to it), nothing imported or called, except the globals
`inert.refusal` names (code-execution primitives, names no module can have), which are refused all
the same. Unpickling is bounded: the pickle's size and opcode count, tuples nested at most
`MAX_DEPTH` deep while they are built (hashing a deeper one overflows the C stack), BUILD only on the
objects that take state, and the object tree it yields at most `MAX_DEPTH` deep and `MAX_OBJECTS`
nodes with shared references counted every time they are reached (so a "billion laughs" of shared
lists is refused, never expanded); shared references stay shared in the tree, and so do references
back to an object that holds them (a list holding itself, a record whose state holds it: a cycle,
which only a list, dict, set or record can close, since they exist before what they hold); inert
records count like any container, and may be dict keys and set members. Tensors come back as
`TensorRef`s, made by the archive the pickle belongs to (`PickleSource`).
"""

from __future__ import annotations

import io
import pickle
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Protocol

from ckptflow.errors import CorruptFileError, UnsafePickleError
from ckptflow.formats.torch.inert import InertBuild, InertGlobal, InertRecord, TorchDevice, TorchDtype, refusal
from ckptflow.formats.torch.pure_pickle import PyUnpickler, Stop, Unframer
from ckptflow.formats.torch.tensorref import DTYPE_SIZES, STORAGE_DTYPES, TensorRef
from ckptflow.plumbing.text import excerpt, one_line, plain


@dataclass(frozen=True)
class Allowed:
    """The globals a pickle may name beyond torch's tensors and plain containers: `records` are classes
    kept as `PickledObject`s (qualified name, arguments, state; nothing of theirs is imported or run),
    `enums` are enum classes read as their integer values. With `inert`, any other global becomes an
    `InertRecord` instead of a refusal, unless `inert.refusal` refuses it (code, not state)."""

    records: frozenset[str] = field(default_factory=frozenset)
    enums: frozenset[str] = field(default_factory=frozenset)
    inert: bool = False

    def record_classes(self) -> dict[str, type]:
        """A stand-in class per record, made anew for each archive so its records are told apart."""
        return {name: _record_class(name) for name in self.records}


TORCH_ONLY = Allowed()  # what `torch.load(weights_only=True)` reads: tensors and plain data


class PickleSource(Protocol):
    """What the unpickler needs of the archive whose pickle it reads."""

    uri: str
    allowed: Allowed
    records: dict[str, type]  # `allowed.record_classes()`, once per archive

    def storage_size(self, key: str) -> int | None:
        """Bytes of the archive's entry `data/<key>`, or None when it has none."""

    def tensor(self, record: TensorRecord) -> TensorRef:
        """The `TensorRef` of a tensor record, checked against the archive."""


# Bounds on what one pickle may cost. DeepSpeed's largest pickles (model states of a model with tens of
# thousands of tensors) are a few MB of a few hundred thousand opcodes, nest under ten levels and hold
# a few objects per tensor.
MAX_PICKLE_BYTES = 256 << 20


MAX_PICKLE_OPS = 20_000_000


MAX_DEPTH = 100


MAX_OBJECTS = 10_000_000


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


class _NestedName:
    """`builtins.getattr` where a record may be made (`Allowed.inert`): only ever called, by REDUCE, with
    a class named by the pickle and a name (protocol 2's spelling of a nested class, `Outer.Inner`)."""

    name = "builtins.getattr"


_NESTED_NAME = _NestedName()


class Unpickler(PyUnpickler):  # the Python implementation: its loop and dispatch table can be bounded
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

    dispatch = dict(PyUnpickler.dispatch)

    def __init__(self, data: bytes, archive: PickleSource) -> None:
        super().__init__(io.BytesIO(data))
        self.archive = archive
        self.storages: dict[str, _Storage] = {}
        self.sizes: dict[int, tuple[Any, int, int]] = {}  # id -> (tuple or frozenset, height, nodes expanded)
        self.hashed = 0  # nodes hashed so far

    def load(self) -> Any:  # pickle._Unpickler.load with an opcode budget
        self._unframer = Unframer(self._file_read, self._file_readline)
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
        except Stop as stop:
            return stop.value
        raise pickle.UnpicklingError(f"more than {MAX_PICKLE_OPS:,} opcodes")

    def find_class(self, module: str, name: str) -> Any:
        return find_class(module, name, self.archive)

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unknown persistent id ({_what(pid)}), where torch writes a storage tuple")
        _, stype, key, _location, numel = pid
        if not isinstance(stype, _StorageType) or not isinstance(key, str) or type(numel) is not int:
            raise pickle.UnpicklingError("malformed storage reference")
        check_storage(self.archive, key, stype.dtype, numel)
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
            raise pickle.UnpicklingError(
                f"a tuple of shared references that expands to more than {MAX_OBJECTS:,} objects"
            )
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
        PyUnpickler.load_setitem(self)

    def load_setitems(self) -> None:
        self._charge(self.stack[::2])
        PyUnpickler.load_setitems(self)

    def load_dict(self) -> None:
        self._charge(self.stack[::2])
        PyUnpickler.load_dict(self)

    def load_additems(self) -> None:
        self._charge(self.stack)
        PyUnpickler.load_additems(self)

    def load_frozenset(self) -> None:
        self._charge(self.stack)
        PyUnpickler.load_frozenset(self)
        self._measure(self.stack[-1])

    def load_reduce(self) -> None:
        func, args = self.stack[-2:] if len(self.stack) >= 2 else (None, None)
        if not isinstance(args, tuple):
            raise pickle.UnpicklingError("REDUCE without a callable and an argument tuple")
        if func is _NESTED_NAME:
            del self.stack[-2:]
            self.append(nested_class(args, self.archive))
            return
        if self._inert(func, "reduce", args):
            return
        if func in (set, frozenset, OrderedDict):
            for arg in args:
                self._charge(arg)
        PyUnpickler.load_reduce(self)
        if type(self.stack[-1]) is frozenset:
            self._measure(self.stack[-1])

    def load_newobj(self) -> None:
        cls, args = self.stack[-2:] if len(self.stack) >= 2 else (None, None)
        if isinstance(args, tuple) and self._inert(cls, "newobj", args):
            return
        self._record_only(cls)
        PyUnpickler.load_newobj(self)

    def load_newobj_ex(self) -> None:
        cls, args, kwargs = self.stack[-3:] if len(self.stack) >= 3 else (None, None, None)
        if (isinstance(args, tuple) and isinstance(kwargs, dict) and all(type(k) is str for k in kwargs)
                and self._inert(cls, "newobj_ex", args, kwargs)):
            return
        self._record_only(cls)
        PyUnpickler.load_newobj_ex(self)

    def _instantiate(self, klass: Any, args: Any) -> None:  # INST and OBJ
        if isinstance(klass, InertGlobal):
            self.append(InertBuild(klass, "obj", tuple(args)))
            return
        self._record_only(klass)
        PyUnpickler._instantiate(self, klass, args)

    def _inert(self, cls: Any, how: str, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> bool:
        """REDUCE, NEWOBJ and NEWOBJ_EX of a global outside the allow-list: the callable, its arguments
        (and keyword arguments) on the stack replaced by the record of the call; nothing is called.
        True when it was one; an object the pickle built is never called (`UnpicklingError`)."""
        if isinstance(cls, InertBuild):
            raise pickle.UnpicklingError(f"{how.upper()} calls an object the pickle built ({cls.cls.module}."
                                         f"{cls.cls.name}), where a class or function belongs")
        if not isinstance(cls, InertGlobal):
            return False
        made = InertBuild(cls, how, args, kwargs)
        del self.stack[-(3 if how == "newobj_ex" else 2):]
        self.append(made)
        return True

    def _record_only(self, cls: Any) -> None:
        """NEWOBJ, NEWOBJ_EX, INST and OBJ make instances of DeepSpeed's records only (the allowed
        builtins and torch names are built through REDUCE, as torch pickles them)."""
        if cls not in self.archive.records.values():
            raise pickle.UnpicklingError(f"an instance of {_what(cls)} made without REDUCE")

    def load_build(self) -> None:
        """BUILD only on DeepSpeed's records (their state is kept) and on dicts (torch's `_metadata`
        attribute of a state dict): never on a storage reference, a function or a type marker."""
        if len(self.stack) < 2:
            raise pickle.UnpicklingError("BUILD with nothing to build")
        state, inst = self.stack[-1], self.stack[-2]
        if type(inst) is InertBuild:
            inst.build(self.stack.pop())
            return
        if type(inst) in self.archive.records.values() or (
            isinstance(inst, OrderedDict) and isinstance(state, dict) and all(type(k) is str for k in state)
        ):
            PyUnpickler.load_build(self)
            return
        raise pickle.UnpicklingError(f"BUILD gives {_what(inst)} a state it cannot take")


def _measured(original: Any) -> Any:
    def load(self: Unpickler) -> None:
        original(self)
        self._measure(self.stack[-1])

    return load


for _op in (pickle.TUPLE, pickle.TUPLE1, pickle.TUPLE2, pickle.TUPLE3):
    Unpickler.dispatch[_op[0]] = _measured(PyUnpickler.dispatch[_op[0]])


for _op, _method in ((pickle.SETITEM, Unpickler.load_setitem), (pickle.SETITEMS, Unpickler.load_setitems),
                     (pickle.DICT, Unpickler.load_dict), (pickle.ADDITEMS, Unpickler.load_additems),
                     (pickle.FROZENSET, Unpickler.load_frozenset), (pickle.REDUCE, Unpickler.load_reduce),
                     (pickle.NEWOBJ, Unpickler.load_newobj), (pickle.NEWOBJ_EX, Unpickler.load_newobj_ex),
                     (pickle.BUILD, Unpickler.load_build)):
    Unpickler.dispatch[_op[0]] = _method


def check_storage(archive: PickleSource, key: Any, dtype: Any, numel: Any) -> None:
    """A storage reference names an entry of the archive that holds exactly its bytes."""
    size = archive.storage_size(key) if isinstance(key, str) else None
    if size is None:
        raise pickle.UnpicklingError(f"storage {storage_key(key)} is named in the pickle but missing from the archive")
    if dtype not in DTYPE_SIZES:
        raise pickle.UnpicklingError(f"storage {storage_key(key)} has an unknown dtype {excerpt(dtype)}")
    if type(numel) is not int or numel < 0:
        raise pickle.UnpicklingError(f"storage {storage_key(key)} has an element count of {excerpt(numel)}")
    expected = numel * DTYPE_SIZES[dtype]
    if size != expected:
        raise pickle.UnpicklingError(f"storage {storage_key(key)} holds {size} bytes, expected {excerpt(expected)}")


def _qualname(qual: str, limit: int = 120) -> str:
    """A global's dotted name for a message: as it is, control characters escaped, cut when long."""
    return plain(qual) if len(qual) <= limit else f"{plain(qual[:limit])}... ({len(qual):,} characters)"


def storage_key(key: Any) -> str:
    """A storage key for a message: as it is when it looks like one torch writes, else quoted."""
    return key if isinstance(key, str) and _PLAIN_KEY.fullmatch(key) else excerpt(key)


_PLAIN_KEY = re.compile(r"[A-Za-z0-9_.-]{1,40}")


def _what(obj: Any) -> str:
    """What an object from a pickle is, in a few words, whatever it holds."""
    if isinstance(obj, _Storage):
        return "a storage reference"
    if isinstance(obj, _StorageType):
        return "a storage type"
    if isinstance(obj, _Marker | _NestedName):
        return obj.name
    if isinstance(obj, InertGlobal):
        return f"{_qualname(obj.module + '.' + obj.name)} (named, never loaded)"
    if isinstance(obj, InertBuild):
        return f"an object of class {_qualname(obj.cls.module + '.' + obj.cls.name)} (never loaded)"
    if callable(obj) and not isinstance(obj, type):
        return f"the function {getattr(obj, '__name__', '?')}"
    return excerpt(obj) if isinstance(obj, str | bytes | int | float | bool | type(None)) else f"a {type(obj).__name__}"


def why_unreadable(exc: BaseException) -> str:
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


class TensorRecord:
    """A tensor as the pickle rebuilt it: storage, offset, shape, stride (a class the pickle cannot name)."""

    __slots__ = ("storage", "offset", "shape", "stride")

    def __init__(self, storage: "_Storage", offset: int, shape: tuple[int, ...], stride: tuple[int, ...]) -> None:
        self.storage, self.offset, self.shape, self.stride = storage, offset, shape, stride


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple | list) or len(value) > 64 or any(type(x) is not int for x in value):
        raise pickle.UnpicklingError(f"a tensor's {what} is {_what(value)}, not a tuple of integers")
    return tuple(value)


def _rebuild_tensor(storage: Any, offset: Any, size: Any, stride: Any, *_rest: Any) -> TensorRecord:
    if not isinstance(storage, _Storage):
        raise pickle.UnpicklingError("tensor without a storage")
    if type(offset) is not int:
        raise pickle.UnpicklingError(f"a tensor's storage offset is {_what(offset)}, not an integer")
    shape, strides = _ints(size, "shape"), _ints(stride, "stride")
    if len(shape) != len(strides):
        raise pickle.UnpicklingError(f"a tensor has {len(shape)} dimensions but {len(strides)} strides")
    return TensorRecord(storage, offset, shape, strides)


def _rebuild_parameter(data: Any, *_rest: Any) -> Any:
    return data


def _rebuild_from_type(func: Any, _new_type: Any, args: Any, _state: Any) -> Any:
    if func is not _rebuild_tensor and func is not _rebuild_parameter:
        raise pickle.UnpicklingError("tensor rebuilt through an unexpected function")
    return func(*args)


def _size(dims: Any = ()) -> tuple[int, ...]:  # named in messages: "the function _size"
    return _ints(dims, "shape")


def _device(kind: Any, index: Any = None) -> TorchDevice:
    if not isinstance(kind, str) or not kind.isidentifier() or not (index is None or type(index) is int):
        raise pickle.UnpicklingError("a device that is not a name and an index")
    return TorchDevice(f"{kind}:{index}" if index is not None else kind)


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


def plain_tree(root: Any, archive: PickleSource, *, records: list[InertRecord] | None = None,
               cycles: list[Any] | None = None) -> Any:
    """The unpickled tree as plain data: tensor records become `TensorRef`s, DeepSpeed records
    `PickledObject`s, inert builds and globals `InertRecord`s (each one made is added to `records`,
    when given), containers are rebuilt around them, dict keys and set members included.

    Without recursion, each object once: an object reached twice (a shared reference) becomes one
    plain object reached twice, so a "billion laughs" costs its size in the pickle, not its expansion;
    an object reached again from within itself (a cycle) is the same plain object too, the object it
    refers back to added to `cycles` when given. The tree is refused (`CorruptFileError`) when it nests
    more than `MAX_DEPTH` containers deep along any path (a reference back along a cycle aside), or
    would hold more than `MAX_OBJECTS` nodes were every shared reference copied (a cycle counted once
    round): whatever walks it later, remembering what it visited, stays bounded too.

    Depth first: a container that exists before its contents in the pickle (a list, dict, set or
    record: only they can close a cycle) is made empty when first met, and filled, as a tuple or
    frozenset is made, once everything under it is made. What refers back to a tuple still being made
    (a cycle entered at a tuple) waits for the end, where the tuples are made from their members (those
    a tuple holds first) and then what waited is filled."""
    nodes: dict[int, _Node] = {}  # containers and leaves other than plain atoms, by id
    waiting: list[_Node] = []  # containers left to make or fill at the end, in the order they were finished
    path: set[int] = set()  # the containers being read: the ancestors of the one on top of the stack
    seen: set[int] = set()  # tuples and frozensets already checked as keys or set members
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        obj, ready = stack.pop()
        key = id(obj)
        if ready:
            node = nodes[key]
            if not _finish(node, nodes, path, archive, cycles):
                waiting.append(node)
            path.discard(key)
            continue
        if key in nodes:
            continue
        kids = _children(obj, archive, seen)
        if kids is None:
            nodes[key] = _Node(obj, None, _leaf(obj, archive, seen))
            continue
        if len(path) >= MAX_DEPTH:
            raise _tree_error(archive, f"it nests containers more than {MAX_DEPTH} deep")
        nodes[key] = _Node(obj, kids, _shell(obj, archive))
        path.add(key)
        stack.append((obj, True))
        stack.extend([(kid, False) for kid in reversed(kids) if type(kid) not in _ATOM_TYPES and id(kid) not in nodes])
    for node in waiting:
        if node.plain is _UNMADE:
            _make_frozen(node, nodes, archive)
    for node in waiting:
        if not isinstance(node.obj, tuple | frozenset):
            _make(node, [_plain_of(kid, nodes) for kid in node.kids or ()], archive)
    if records is not None:
        records.extend(node.plain for node in nodes.values() if type(node.plain) is InertRecord)
    return _plain_of(root, nodes)


_UNMADE: Any = object()  # a tuple's or frozenset's plain copy before its members are made
_ATOMS = (str, bytes, int, float, complex, bool, type(None))
_ATOM_TYPES = frozenset(_ATOMS)  # plain as they are: no node


class _Node:
    """One object of the unpickled tree: its children (None for a leaf), its plain copy (`_UNMADE`
    until made), whether that copy holds its contents yet, how deep it nests containers (-1 until it is
    finished) and how many nodes it expands to."""

    __slots__ = ("obj", "kids", "plain", "complete", "height", "nodes")

    def __init__(self, obj: Any, kids: list[Any] | None, plain: Any) -> None:
        self.obj, self.kids, self.plain, self.complete = obj, kids, plain, kids is None
        self.height, self.nodes = (-1, 0) if kids is not None else (0, 1)


def _plain_of(obj: Any, nodes: dict[int, _Node]) -> Any:
    node = nodes.get(id(obj))
    return obj if node is None else node.plain


def _finish(node: _Node, nodes: dict[int, _Node], path: set[int], archive: PickleSource,
            cycles: list[Any] | None) -> bool:
    """Measure a container once everything under it is read, and make or fill it when all it holds is
    complete (else False: it waits). A child not finished yet is one of its ancestors (on `path`), which
    it refers back to (a cycle: counted as one node, no depth; enough that it exists, empty)."""
    height, count, made = 0, 1, True
    plains = []
    for kid in node.kids or ():
        known = nodes.get(id(kid))
        if known is None:  # a plain atom
            count += 1
            plains.append(kid)
            continue
        if known.height < 0:
            assert id(kid) in path, "a child neither read nor an ancestor"
            if not archive.allowed.inert:  # torch's own data and DeepSpeed's are trees; a client state may not be
                raise _tree_error(archive, "it holds a reference cycle")
            if cycles is not None:
                cycles.append(known.plain)
            count += 1
            made = made and known.plain is not _UNMADE
        else:
            height, count = max(height, known.height), count + known.nodes
            made = made and known.complete
        plains.append(known.plain)
    if height + 1 > MAX_DEPTH:
        raise _tree_error(archive, f"it nests containers more than {MAX_DEPTH} deep")
    if count > MAX_OBJECTS:
        raise _tree_error(archive, f"its shared references expand to more than {MAX_OBJECTS:,} objects")
    node.height, node.nodes = height + 1, count
    if made:
        _make(node, plains, archive)
    return made


def _shell(obj: Any, archive: PickleSource) -> Any:
    """The empty plain copy of a container that exists before its contents (`_make` fills it), or
    `_UNMADE` for a tuple or frozenset (made whole by `_make`)."""
    if isinstance(obj, dict):
        return OrderedDict() if isinstance(obj, OrderedDict) else {}
    if isinstance(obj, list):
        return []
    if isinstance(obj, set):
        return set()
    if type(obj) is InertBuild:
        return InertRecord.shell(obj.cls.module, obj.cls.name, obj.how)
    if _is_record(obj, archive):
        return PickledObject(type(obj).__name__, (), None)
    return _UNMADE


def _make(node: _Node, kids: list[Any], archive: PickleSource) -> None:
    """Make a tuple or frozenset of its members made plain, or fill an empty container (`_shell`)."""
    obj, plain = node.obj, node.plain
    node.complete = True
    if isinstance(obj, tuple):
        node.plain = tuple(kids)
    elif isinstance(obj, list):
        plain.extend(kids)
    elif isinstance(obj, dict):
        half = len(kids) // 2
        for k, v in zip(kids[:half], kids[half:]):
            plain[k] = v
    elif isinstance(obj, frozenset):
        node.plain = frozenset(kids)
    elif isinstance(obj, set):
        plain.update(kids)
    elif type(obj) is InertBuild:
        _fill_record(obj, plain, kids)
    elif _is_record(obj, archive):
        object.__setattr__(plain, "args", kids[0])  # a frozen dataclass made before its contents (`_shell`)
        object.__setattr__(plain, "state", kids[1])


def _make_frozen(node: _Node, nodes: dict[int, _Node], archive: PickleSource) -> None:
    """Make a tuple or frozenset that waited, the ones it holds first. They hold only what existed before
    them in the pickle, so no tuple is reached again from within itself but through a list, dict, set
    or record, which exist already (empty): a tuple reached again is a pickle no unpickler could build."""
    making: set[int] = set()
    stack = [(node, False)]
    while stack:
        at, ready = stack.pop()
        if at.plain is not _UNMADE:
            continue
        if ready:
            _make(at, [_plain_of(kid, nodes) for kid in at.kids or ()], archive)
            continue
        if id(at.obj) in making:
            raise _tree_error(archive, "it holds a tuple that holds itself")
        making.add(id(at.obj))
        stack.append((at, True))
        stack.extend((kid, False) for kid in (nodes.get(id(k)) for k in at.kids or ())
                     if kid is not None and kid.plain is _UNMADE)


def _tree_error(archive: PickleSource, why: str) -> CorruptFileError:
    return CorruptFileError(f"{archive.uri}: cannot read its pickle ({why})", file=archive.uri,
                            hint="the file is corrupt or was not written by DeepSpeed; copy it again")


def _is_record(obj: Any, archive: PickleSource) -> bool:
    return type(obj).__name__ in archive.records and type(obj) is archive.records[type(obj).__name__]


def _children(obj: Any, archive: PickleSource, seen: set[int]) -> list[Any] | None:
    """What a container holds (None for a leaf): a dict's keys, then its values."""
    if isinstance(obj, tuple | list):
        return list(obj)
    if isinstance(obj, dict):
        for k in obj:
            _check_hashable(k, archive, "a dict key", seen)
        return [*obj, *obj.values()]
    if isinstance(obj, set | frozenset):
        for member in obj:
            _check_hashable(member, archive, "a set member", seen)
        return list(obj)
    if _is_record(obj, archive):
        return [obj.args, obj.state]
    if type(obj) is InertBuild:
        return obj.children()
    return None




def _check_hashable(value: Any, archive: PickleSource, what: str, seen: set[int]) -> None:
    """A dict key or set member must be plain data or an inert record (hashed by identity, as the
    pickle's object was: `InertRecord`): atoms, records, and tuples and frozensets of them (each
    looked into once, `seen` remembering which)."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, tuple | frozenset):
            if id(item) not in seen:
                seen.add(id(item))
                pending.extend(item)
        elif not isinstance(item, _ATOMS) and type(item) not in (InertBuild, InertGlobal):
            raise _tree_error(archive, f"{what} is {_what(item)}, not plain data")


def _leaf(obj: Any, archive: PickleSource, seen: set[int]) -> Any:
    if isinstance(obj, TensorRecord):
        return archive.tensor(obj)
    if isinstance(obj, _ATOMS):
        return obj
    if type(obj) is InertGlobal:
        return InertRecord(obj.module, obj.name, "global")
    if obj is _NESTED_NAME:  # getattr itself as a value, never called: what it would be written back as
        raise refused(archive, "builtins.getattr", "code that runs when the file is loaded")
    if archive.allowed.inert:  # an allowed global named as a value (`defaultdict(set)`): a record, never called
        named = _named_global(obj, archive)
        if named is not None:
            return named
    if isinstance(obj, slice) and all(isinstance(x, _ATOMS) for x in (obj.start, obj.stop, obj.step)):
        return obj
    raise _tree_error(archive, f"it holds {_what(obj)} where data belongs")


def _fill_record(obj: InertBuild, record: InertRecord, kids: list[Any]) -> None:
    """Fill the record of `obj` from its children made plain (`InertBuild.children` order)."""
    args, kwargs, *items = kids
    ops: list[tuple[str, Any]] = []
    for (kind, _), got in zip(obj.ops, items):
        if kind == "appends":
            ops.append((kind, tuple(got)))
        elif kind == "setitems":
            ops.append((kind, tuple(zip(got[::2], got[1::2]))))
        else:
            ops.append((kind, got[0]))
    record.fill(args, kwargs, tuple(ops))


_GLOBAL_NAMES = {id(value): qual for qual, value in _SAFE_GLOBALS.items() if not isinstance(value, _Marker)}


def _named_global(obj: Any, archive: PickleSource) -> InertRecord | None:
    """The record of an allowed global the pickle names as a value (a class, a function, a type marker),
    or None when `obj` is not one."""
    if isinstance(obj, _Marker):
        qual = obj.name
    elif isinstance(obj, type) and _is_record_class(obj, archive):
        qual = obj.__name__
    else:
        found = _GLOBAL_NAMES.get(id(obj))
        if found is None or _SAFE_GLOBALS[found] is not obj:
            return None
        qual = found
    module, _, name = qual.rpartition(".")
    return InertRecord(module, name, "global")


def _is_record_class(cls: type, archive: PickleSource) -> bool:
    return archive.records.get(cls.__name__) is cls


def find_class(module: str, name: str, archive: PickleSource) -> Any:
    """What a global named by the pickle stands for: an allowed torch name or builtin, a record, an
    enum's value reader, or with `allowed.inert` an `InertGlobal`; `UnsafePickleError` for anything
    else (and for what `inert.refusal` refuses), before anything is imported or run."""
    if module == "__builtin__":  # protocol-2 pickles use Python 2's module name
        module = "builtins"
    qual = f"{module}.{name}"
    if module == "torch" and name in STORAGE_DTYPES:
        return _StorageType(STORAGE_DTYPES[name][0])
    if qual in _SAFE_GLOBALS:
        return _SAFE_GLOBALS[qual]
    if qual in archive.records:
        return archive.records[qual]
    if qual in archive.allowed.enums:
        return _enum_value
    if module == "torch" and name in DTYPE_SIZES:
        return TorchDtype(name)
    if archive.allowed.inert and qual == "builtins.getattr":
        return _NESTED_NAME  # refused unless REDUCE calls it with a class and a name (`nested_class`)
    why = refusal(module, name) if archive.allowed.inert else None
    if archive.allowed.inert and why is None:
        return InertGlobal(module, name)
    raise refused(archive, qual, why)


def nested_class(args: tuple[Any, ...], archive: PickleSource) -> InertGlobal:
    """`getattr(cls, name)` as protocol 2 pickles a nested class (`Outer.Inner`): the `InertGlobal` of that
    qualified name, refused as `inert.refusal` refuses it, and refused as `getattr` with anything else."""
    if len(args) == 2 and type(args[0]) is InertGlobal and type(args[1]) is str:
        cls, attr = args
        why = refusal(cls.module, f"{cls.name}.{attr}")
        if why is None:
            return InertGlobal(cls.module, f"{cls.name}.{attr}")
        raise refused(archive, f"{cls.module}.{cls.name}.{attr}", why)
    raise refused(archive, "builtins.getattr", "code that runs when the file is loaded; only a nested class's name "
                  "(getattr of a class and a name) is read")


def refused(archive: PickleSource, qual: str, why: str | None) -> UnsafePickleError:
    """The refusal of the global `qual`: `why` it is refused even as a record, or (None) that only the
    allow-list is read."""
    if why is not None:
        hint = (f"refused without running anything ({why}): ckptflow neither loads it nor writes it back; if "
                "this file is yours, re-save it without that object")
    elif archive.allowed.records:
        hint = ("refused without running anything: in strict pickle mode only torch tensors and DeepSpeed's "
                "checkpoint classes are allowed; without it, an object of this class is kept as an inert record "
                "(never imported or run) and carried as it is")
    else:
        hint = ("refused without running anything; only torch tensors and DeepSpeed's checkpoint classes are "
                "allowed; if this file is yours, re-save it without custom objects")
    return UnsafePickleError(
        f"{archive.uri} refers to {_qualname(qual)}, which ckptflow does not load", file=archive.uri, actual=qual,
        hint=hint,
    )
