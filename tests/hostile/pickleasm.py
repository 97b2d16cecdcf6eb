"""A small pickle assembler: opcodes as bytes, so hostile pickles can be written op by op.

Every function returns the bytes of a run of opcodes that leaves one object on the unpickler's stack
(except `mark`, `put` and the raw `op`). The names follow `pickletools.opcodes`. Used to build
payloads no `pickle.dumps` would write: INST/OBJ/NEWOBJ calls, EXT codes, BUILD on a storage
reference, memo bombs, shared references that explode when copied.
"""

from __future__ import annotations

import pickle
import pickletools
import struct

OPS: dict[str, bytes] = {o.name: o.code.encode("latin-1") for o in pickletools.opcodes}


def op(name: str) -> bytes:
    return OPS[name]


def mark() -> bytes:
    return OPS["MARK"]


def string(text: str) -> bytes:
    raw = text.encode("utf-8", "surrogatepass")
    if len(raw) < 256:
        return OPS["SHORT_BINUNICODE"] + bytes([len(raw)]) + raw
    return OPS["BINUNICODE"] + struct.pack("<I", len(raw)) + raw


def binbytes(data: bytes) -> bytes:
    if len(data) < 256:
        return OPS["SHORT_BINBYTES"] + bytes([len(data)]) + data
    return OPS["BINBYTES"] + struct.pack("<I", len(data)) + data


def integer(n: int) -> bytes:
    if 0 <= n < 256:
        return OPS["BININT1"] + bytes([n])
    if 0 <= n < 65536:
        return OPS["BININT2"] + struct.pack("<H", n)
    if -(2**31) <= n < 2**31:
        return OPS["BININT"] + struct.pack("<i", n)
    raw = pickle.encode_long(n)  # type: ignore[attr-defined]
    if len(raw) < 256:
        return OPS["LONG1"] + bytes([len(raw)]) + raw
    return OPS["LONG4"] + struct.pack("<i", len(raw)) + raw


def floating(x: float) -> bytes:
    return OPS["BINFLOAT"] + struct.pack(">d", x)


def none() -> bytes:
    return OPS["NONE"]


def boolean(value: bool) -> bytes:
    return OPS["NEWTRUE" if value else "NEWFALSE"]


def glob(module: str, name: str) -> bytes:
    """GLOBAL module name (protocol 0-3 spelling)."""
    return OPS["GLOBAL"] + module.encode("utf-8") + b"\n" + name.encode("utf-8") + b"\n"


def stack_global(module: str, name: str) -> bytes:
    """STACK_GLOBAL (protocol 4 spelling): the two names as strings on the stack."""
    return string(module) + string(name) + OPS["STACK_GLOBAL"]


def tup(*items: bytes) -> bytes:
    if not items:
        return OPS["EMPTY_TUPLE"]
    return OPS["MARK"] + b"".join(items) + OPS["TUPLE"]


def lst(*items: bytes) -> bytes:
    return OPS["MARK"] + b"".join(items) + OPS["LIST"] if items else OPS["EMPTY_LIST"]


def dct(*pairs: tuple[bytes, bytes]) -> bytes:
    if not pairs:
        return OPS["EMPTY_DICT"]
    return OPS["EMPTY_DICT"] + OPS["MARK"] + b"".join(k + v for k, v in pairs) + OPS["SETITEMS"]


def call(func: bytes, *args: bytes) -> bytes:
    """REDUCE: func(*args)."""
    return func + tup(*args) + OPS["REDUCE"]


def inst(module: str, name: str, *args: bytes) -> bytes:
    """INST: MARK args INST module name -> module.name(*args)."""
    return OPS["MARK"] + b"".join(args) + OPS["INST"] + module.encode() + b"\n" + name.encode() + b"\n"


def obj(cls: bytes, *args: bytes) -> bytes:
    """OBJ: MARK cls args OBJ -> cls(*args) (or cls.__new__(cls) when there are none)."""
    return OPS["MARK"] + cls + b"".join(args) + OPS["OBJ"]


def newobj(cls: bytes, *args: bytes) -> bytes:
    """NEWOBJ: cls.__new__(cls, *args)."""
    return cls + tup(*args) + OPS["NEWOBJ"]


def newobj_ex(cls: bytes, args: bytes, kwargs: bytes) -> bytes:
    return cls + args + kwargs + OPS["NEWOBJ_EX"]


def build(target: bytes, state: bytes) -> bytes:
    """BUILD: setstate(target, state); leaves target."""
    return target + state + OPS["BUILD"]


def ext(code: int) -> bytes:
    if code < 256:
        return OPS["EXT1"] + bytes([code])
    if code < 65536:
        return OPS["EXT2"] + struct.pack("<H", code)
    return OPS["EXT4"] + struct.pack("<i", code)


def put(index: int) -> bytes:
    """Memoize the top of the stack at `index` (leaves it on the stack)."""
    if index < 256:
        return OPS["BINPUT"] + bytes([index])
    return OPS["LONG_BINPUT"] + struct.pack("<I", index)


def get(index: int) -> bytes:
    if index < 256:
        return OPS["BINGET"] + bytes([index])
    return OPS["LONG_BINGET"] + struct.pack("<I", index)


def persid(pid: bytes) -> bytes:
    """BINPERSID: the persistent id `pid` (an object's ops) resolved by the unpickler."""
    return pid + OPS["BINPERSID"]


def text_persid(pid: str) -> bytes:
    """PERSID: a persistent id given as a line of text (protocol 0)."""
    return OPS["PERSID"] + pid.encode("utf-8") + b"\n"


def pickle_of(value: bytes, protocol: int = 2) -> bytes:
    """A whole pickle: PROTO, the value's ops, STOP."""
    return OPS["PROTO"] + bytes([protocol]) + value + OPS["STOP"]


# ---- structures that are small as pickles and huge as data ----------------------------------------


def nested(kind: str, depth: int) -> bytes:
    """`depth` containers nested in each other: [[[...]]], {'k': {'k': ...}}, ((((),),),)."""
    if kind == "list":
        return OPS["EMPTY_LIST"] * depth + OPS["APPEND"] * (depth - 1)
    if kind == "dict":
        key = string("k")
        return (OPS["EMPTY_DICT"] + key) * (depth - 1) + OPS["EMPTY_DICT"] + OPS["SETITEM"] * (depth - 1)
    if kind == "tuple":
        return OPS["EMPTY_TUPLE"] + OPS["TUPLE1"] * (depth - 1)
    if kind == "set":  # frozensets of frozensets, through the allowed builtins.frozenset
        inner = OPS["EMPTY_TUPLE"]
        for _ in range(depth - 1):
            inner = call(glob("builtins", "frozenset"), lst(inner))
        return inner
    raise ValueError(kind)


def laughs(kind: str, levels: int, memo_base: int = 1000, base: bytes | None = None) -> bytes:
    """A "billion laughs": level n holds level n-1 twice, by memo reference. A few hundred bytes;
    2**levels leaves for anything that copies it instead of keeping shared references shared.
    `base` is level 0 (an empty list by default; an atom makes a tuple laughs hashable)."""
    out = (OPS["EMPTY_LIST"] if base is None else base) + put(memo_base)
    for level in range(1, levels + 1):
        prev = get(memo_base + level - 1)
        if kind == "list":
            out += OPS["POP"] + lst(prev, prev)
        elif kind == "tuple":
            out += OPS["POP"] + tup(prev, prev)
        elif kind == "dict":
            out += OPS["POP"] + dct((string("a"), prev), (string("b"), prev))
        else:
            raise ValueError(kind)
        out += put(memo_base + level)
    return out


def memo_bomb(index: int) -> bytes:
    """One object memoized at a huge index: the C unpickler grows its memo array to reach it."""
    return none() + put(index)
