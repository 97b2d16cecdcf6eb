"""pickle's pure-Python implementation (CPython's `Lib/pickle.py`), with types for the internals that
`unpickler` and `pickler` build on: the opcode methods and dispatch tables, the frame reader, the STOP
signal.

typeshed declares only the public face of `pickle._Pickler` and `pickle._Unpickler` (and types their
`dispatch` tables as taking the C pickler and unpickler), so the names used here are declared once,
for the type checker only; at run time they are pickle's own objects.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:

    class Stop(Exception):
        """Raised by the STOP opcode; `value` is what the pickle built."""

        value: Any

    class Unframer:
        def __init__(self, file_read: Callable[[int], bytes], file_readline: Callable[[], bytes]) -> None: ...
        def read(self, n: int) -> bytes: ...
        def readinto(self, buf: bytearray | memoryview) -> int: ...
        def readline(self) -> bytes: ...

    class PyUnpickler(pickle._Unpickler):
        dispatch: ClassVar[dict[int, Callable[[Any], None]]]
        _file_read: Callable[[int], bytes]
        _file_readline: Callable[[], bytes]
        _unframer: Unframer
        read: Callable[[int], bytes]
        readinto: Callable[[bytearray | memoryview], int]
        readline: Callable[[], bytes]
        metastack: list[list[Any]]
        stack: list[Any]
        append: Callable[[Any], None]
        proto: int

        def load_setitem(self) -> None: ...
        def load_setitems(self) -> None: ...
        def load_dict(self) -> None: ...
        def load_additems(self) -> None: ...
        def load_frozenset(self) -> None: ...
        def load_reduce(self) -> None: ...
        def load_newobj(self) -> None: ...
        def load_newobj_ex(self) -> None: ...
        def load_build(self) -> None: ...
        def _instantiate(self, klass: Any, args: Any) -> None: ...

    class PyPickler(pickle._Pickler):
        dispatch: ClassVar[dict[type, Callable[[Any, Any], None]]]
        memo: dict[int, tuple[int, Any]]  # id(object) -> (memo index, object)

        def get(self, i: int) -> bytes: ...

        def write(self, data: bytes) -> Any: ...
        def save(self, obj: Any, save_persistent_id: bool = True) -> None: ...
        def memoize(self, obj: Any) -> None: ...

else:
    Stop = pickle._Stop
    Unframer = pickle._Unframer
    PyUnpickler = pickle._Unpickler
    PyPickler = pickle._Pickler
