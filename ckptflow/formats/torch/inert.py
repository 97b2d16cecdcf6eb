"""Inert records: what the unpickler makes of a global outside the allow-list, and which globals it
refuses even so.

A trainer keeps its own state in a checkpoint: `engine.save_checkpoint(dir, client_state={...})`
pickles it into the model-states file beside DeepSpeed's keys (Megatron-DeepSpeed's `args`, an
`argparse.Namespace`; PyTorch Lightning's loops, callbacks and hyper-parameters; numpy RNG states).
ckptflow needs none of it, and must neither refuse the file for it nor run it. So a global outside
the allow-list becomes an `InertGlobal` (its module and name, nothing imported), and what the pickle
does with it becomes an `InertBuild` (how it is made, and in order what is applied to it afterwards),
never a call; `unpickler.plain_tree` turns both into frozen `InertRecord`s, and the reshard writer
writes a record back with the same opcodes (`pickler.Rebuilt`), so that whoever loads the output
rebuilds the user's objects in their own process, exactly as they would have from the source.

What a record keeps, after the opcodes that make it:

- `global`: the global itself, named and never called (a class or function stored as a value);
- `reduce` (REDUCE): `module.name(*args)`;
- `newobj` (NEWOBJ) and `newobj_ex` (NEWOBJ_EX): `cls.__new__(cls, *args, **kwargs)`;
- `obj` (OBJ and INST): `cls(*args)`, or `cls.__new__(cls)` without arguments;

then `ops`, in the order the pickle applies them: `appends` (APPEND, APPENDS: items a list subclass
extends itself with), `setitems` (SETITEM, SETITEMS: a dict subclass's items, as key/value pairs) and
`build` (BUILD: the state handed to `__setstate__` or set as attributes).

The rule for what is refused even as a record (`UnsafePickleError`, nothing imported or run),
`refusal(module, name)`; anything else outside the allow-list is a record:

1. a module or name that is not a plain dotted ASCII identifier (`os\\x1b[2J`, an empty name): no
   module can be named that, and it could not be imported where the file is loaded;
2. a dotted name other than a nested class's: the loader resolves `Outer.Inner` attribute by attribute,
   which through a module attribute reaches any module another module imports (`logging` + `os.system`,
   `mymod` + `np.load`). So every part but the last must name a class (start with a capital letter, as
   classes do); protocol 4 names a nested class so (STACK_GLOBAL `mymod` `Outer.Inner`), protocol 2
   (torch's) as `getattr(mymod.Outer, "Inner")`, which the unpickler reads as the same name, the one
   use of `getattr` it admits, and `pickler.Rebuilt` writes back. And a dunder part (`__builtins__`,
   `__dict__`): a module's or a class's internals, never a class or function it defines;
3. a module whose dotted prefix is in `CODE_MODULES`: modules that run commands or code, open files
   or sockets, load other pickles or native code, or reach the interpreter (`os`, `posix`, `nt`,
   `subprocess`, `sys`, `shutil`, `socket`, `importlib`, `runpy`, `pty`, `code`, `ctypes`, `pickle`,
   `marshal`, `multiprocessing`, ... and `torch.jit`, `torch.hub`, `numpy.testing`, ...);
4. a qualified name whose dotted prefix is in `CODE_NAMES` (`torch.load`, `numpy.load`,
   `functools.reduce`, `operator.attrgetter` ...);
5. in `builtins` (protocol 2's `__builtin__`), anything but the plain data types `DATA_BUILTINS`
   (`eval`, `exec`, `compile`, `__import__`, `getattr`, `setattr`, `delattr`, `open`, `input`,
   `breakpoint`, `globals`, `locals`, `vars`, `map`, `type` ... are refused).

A `functools.partial` is a record like any other: a partial of a refused function is refused by that
function's own name. Written back, a record runs exactly what the source file would have run in the
loading process; the rule keeps the well-known code-execution primitives out even so, and `validate`
lists every class a client state names, so a user sees what their loader will import.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Any

# Rule 3: whole modules (a dotted prefix of the module) that are never state.
CODE_MODULES = frozenset({
    "os", "posix", "nt", "posixpath", "ntpath", "subprocess", "_posixsubprocess", "sys", "shutil", "socket",
    "_socket", "ssl", "select", "selectors", "importlib", "imp", "zipimport", "pkgutil", "runpy", "pty", "tty",
    "termios", "fcntl", "resource", "signal", "code", "codeop", "ctypes", "_ctypes", "cffi", "pickle", "_pickle",
    "cPickle", "pickletools", "copy_reg", "shelve", "dbm", "marshal", "multiprocessing", "concurrent",
    "threading", "_thread", "asyncio", "io", "_io", "tempfile", "glob", "fileinput", "types", "inspect", "gc",
    "weakref", "_weakref", "timeit", "trace", "profile", "cProfile",
    "pstats", "pdb", "bdb", "doctest", "unittest", "pydoc", "webbrowser", "http", "urllib", "urllib2",
    "httplib", "ftplib", "smtplib", "poplib", "imaplib", "telnetlib", "xmlrpc", "socketserver", "platform",
    "sysconfig", "site", "venv", "ensurepip", "distutils", "setuptools", "pip", "lib2to3", "idlelib",
    "tkinter", "turtle", "atexit", "faulthandler", "readline", "rlcompleter", "ast", "dis", "compileall",
    "py_compile", "zipapp", "logging.config", "mailcap", "nturl2path", "_winapi", "msvcrt", "winreg",
    "_osx_support", "dill", "cloudpickle", "joblib", "jsonpickle", "yaml", "requests", "aiohttp", "httpx",
    "IPython", "jinja2", "torch.jit", "torch.hub", "torch.ops", "torch._C", "torch._ops", "torch.classes",
    "torch.library", "torch.package", "torch.serialization", "torch.utils.cpp_extension", "torch.utils.data",
    "torch.utils.hooks", "torch._dynamo", "torch._inductor", "torch.compiler", "torch.fx", "torch.export",
    "torch.distributed", "torch.multiprocessing", "torch.cuda", "torch.backends", "torch.testing",
    "numpy.testing", "numpy.f2py", "numpy.distutils", "numpy.ctypeslib", "numpy.lib.npyio", "numpy.lib.format",
    "deepspeed.launcher", "deepspeed.ops", "deepspeed.comm", "deepspeed.env_report",
})
# Rule 4: single callables (a dotted prefix of `module.name`) that load, compile or call what they are given.
CODE_NAMES = frozenset({
    "torch.load", "torch.compile", "torch.save", "torch.from_file", "torch.set_default_device",
    "numpy.load", "numpy.loadtxt", "numpy.genfromtxt", "numpy.fromfile", "numpy.memmap", "numpy.save",
    "numpy.vectorize", "numpy.frompyfunc", "numpy.piecewise", "numpy.apply_along_axis", "numpy.apply_over_axes",
    "functools.reduce", "functools.singledispatch", "operator.attrgetter", "operator.itemgetter",
    "operator.methodcaller", "operator.call", "_operator.attrgetter", "_operator.itemgetter",
    "_operator.methodcaller", "_operator.call", "itertools.starmap", "itertools.accumulate",
    "itertools.filterfalse", "itertools.takewhile", "itertools.dropwhile", "itertools.groupby",
    "copyreg.__reduce_ex__", "copyreg._reduce_ex", "copyreg.__newobj_ex__", "codecs.open", "codecs.decode",
    "_codecs.decode", "codecs.lookup", "copy.copy", "copy.deepcopy", "string.Formatter", "string.Template",
})
# Rule 5: what `builtins` may give a record: plain data types and constants.
DATA_BUILTINS = frozenset({
    "object", "bool", "int", "float", "complex", "str", "bytes", "bytearray", "list", "tuple", "dict", "set",
    "frozenset", "range", "slice", "Ellipsis", "NotImplemented",
})
BUILTINS = ("builtins", "__builtin__")

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
MAX_NAME = 200  # characters of a module or a name


@functools.lru_cache(maxsize=4096)  # a pickle names the same few globals again and again
def refusal(module: str, name: str) -> str | None:
    """Why the global `module.name` is refused even as an inert record (the rule of the module
    docstring), or None when it may be one."""
    if not (0 < len(module) <= MAX_NAME and 0 < len(name) <= MAX_NAME):
        return "a name no module can have"
    parts, names = module.split("."), name.split(".")
    if not all(_IDENTIFIER.fullmatch(p) for p in parts + names):
        return "a name no module can have"
    if any(n.startswith("__") and n.endswith("__") for n in names):
        return "a module's internals, not a class or function it defines"
    if not all(n[:1].isupper() for n in names[:-1]):
        return "a dotted name through a module attribute, which a loader resolves attribute by attribute"
    if module in BUILTINS:
        return None if name in DATA_BUILTINS else "code that runs when the file is loaded"
    prefixes = {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    if prefixes & CODE_MODULES:
        return "code that runs when the file is loaded"
    full = parts + names
    if {".".join(full[:i]) for i in range(1, len(full) + 1)} & CODE_NAMES:
        return "code that runs when the file is loaded"
    return None


# ---- while unpickling ---------------------------------------------------------------------------------


class InertGlobal:
    """A global outside the allow-list as the pickle names it: module and name, never imported."""

    __slots__ = ("module", "name")

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name


# How an `InertBuild` is made (see the module docstring).
HOW = ("global", "reduce", "newobj", "newobj_ex", "obj")


class InertBuild:
    """An object the pickle makes of an `InertGlobal`: how it is made, and the operations applied to it
    since, in order. It runs nothing: APPEND, SETITEM and BUILD only record what they hand it."""

    __slots__ = ("cls", "how", "args", "kwargs", "ops")

    def __init__(self, cls: InertGlobal, how: str, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> None:
        self.cls, self.how, self.args = cls, how, args
        self.kwargs: dict[str, Any] = kwargs if kwargs is not None else {}
        self.ops: list[tuple[str, list[Any]]] = []  # (kind, items); a build's items are [state]

    def _op(self, kind: str, items: list[Any]) -> None:
        if kind != "build" and self.ops and self.ops[-1][0] == kind:
            self.ops[-1][1].extend(items)
        else:
            self.ops.append((kind, items))

    # What PyUnpickler calls for APPEND, APPENDS, SETITEM and SETITEMS.
    def append(self, item: Any) -> None:
        self._op("appends", [item])

    def extend(self, items: list[Any]) -> None:
        self._op("appends", list(items))

    def __setitem__(self, key: Any, value: Any) -> None:
        self._op("setitems", [key, value])  # flat: key, value, key, value ...

    def build(self, state: Any) -> None:
        self._op("build", [state])

    def children(self) -> list[Any]:
        """What it holds, in a fixed order: args, kwargs (a dict, maybe empty), each op's items list."""
        return [self.args, self.kwargs, *(items for _, items in self.ops)]


# ---- in the plain tree --------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class InertRecord:
    """An object of a class outside the allow-list, kept as the pickle built it (see the module
    docstring): `module.name` made `how` from `args` (and `kwargs`, NEWOBJ_EX's), then `ops` applied in order,
    each ("appends", items), ("setitems", ((key, value), ...)) or ("build", state). Nothing of it
    was imported or run.

    Compared and hashed by identity: two records are equal only when they are one. So a record can be
    a dict key or a set member (an enum member, a user object), as the pickle's own object was, and a
    dict keeps as many keys as the source's: two objects the source held apart stay apart whatever
    they hold (the source's classes decide their equality, and ckptflow runs none of them). A
    structural hash could not be one anyway: a record's state may hold lists, dicts and itself.

    A record may refer to itself (its state, items or arguments holding it, directly or through other
    objects), as the pickle's object did: `unpickler.plain_tree` makes it first (`shell`) and gives it
    its contents once they are made (`fill`), so whatever walks records must remember what it visited."""

    module: str
    name: str
    how: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    ops: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def shell(cls, module: str, name: str, how: str) -> InertRecord:
        """A record without its contents yet, for what refers back to it while they are made (`fill`)."""
        return cls(module, name, how)

    def fill(self, args: tuple[Any, ...], kwargs: dict[str, Any], ops: tuple[tuple[str, Any], ...]) -> None:
        """Give a `shell` its contents, once; only the reader that made it calls this."""
        assert not (self.args or self.kwargs or self.ops), "a record filled twice"
        object.__setattr__(self, "args", args)
        object.__setattr__(self, "kwargs", kwargs)
        object.__setattr__(self, "ops", ops)

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.name}"

    @property
    def state(self) -> Any:
        """The state its last BUILD handed it (None without one)."""
        builds = [items for kind, items in self.ops if kind == "build"]
        return builds[-1] if builds else None


class TorchDtype(str):
    """A torch dtype as the pickle names it (`torch.float16`): its name, which readers compare as a
    string, written back as the dtype (`pickler` names the global again)."""

    __slots__ = ()


class TorchDevice(str):
    """A `torch.device` as the pickle builds it: "cpu" or "cuda:0", written back as the device."""

    __slots__ = ()

    @property
    def args(self) -> tuple[str] | tuple[str, int]:
        """The arguments torch pickles a device with: (type,) or (type, index)."""
        kind, _, index = str(self).partition(":")
        return (kind, int(index)) if index else (kind,)
