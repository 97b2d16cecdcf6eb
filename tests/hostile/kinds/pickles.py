"""Hostile pickles, one kind per opcode family: globals that run code (GLOBAL, STACK_GLOBAL, INST, OBJ,
NEWOBJ, NEWOBJ_EX, REDUCE, EXT), BUILD on what the allow-list hands out, persistent ids, memo bombs,
deep nesting and "billion laughs" shared references.

Each payload is added as one more entry (`payload`) of the top-level dict of a real rank file's
pickle (canonically rank 1's model states), so everything around it is what DeepSpeed wrote. A code
payload runs `touch MARKER`; the oracle checks the marker never appears.
"""

from __future__ import annotations

from tests.hostile import pickleasm as asm
from tests.hostile.corpus import Workspace, kind
from tests.hostile.torchfile import inject

REFUSED = r"refers to {}, which ckptflow does not load"
BAD_PICKLE = r"cannot read its pickle"


def _target(ws: Workspace):  # noqa: ANN202
    return ws.any_rank_file(ws.model_file(1))


def _payload(ws: Workspace, ops: bytes, key: str = "payload") -> None:
    path = _target(ws)
    inject(path, key, ops)
    ws.pin(str(path))


def _touch(ws: Workspace) -> bytes:
    return asm.string(f"touch {ws.marker}")


# -- globals that would run code -------------------------------------------------------------------------


@kind(expect=REFUSED.format(r"posix\.system"))
def reduce_global(ws: Workspace) -> None:
    """GLOBAL posix.system + REDUCE: os.system("touch MARKER")."""
    _payload(ws, asm.call(asm.glob("posix", "system"), _touch(ws)))


@kind(expect=REFUSED.format(r"builtins\.eval"))
def reduce_global_py2_builtins(ws: Workspace) -> None:
    """GLOBAL __builtin__.eval (protocol 2's spelling of builtins) + REDUCE."""
    code = f"__import__('os').system('touch {ws.marker}')"
    _payload(ws, asm.call(asm.glob("__builtin__", "eval"), asm.string(code)))


@kind(expect=REFUSED.format(r"builtins\.exec"))
def reduce_exec(ws: Workspace) -> None:
    """GLOBAL builtins.exec + REDUCE."""
    _payload(ws, asm.call(asm.glob("builtins", "exec"), asm.string(f"import os; os.system('touch {ws.marker}')")))


@kind(expect=REFUSED.format(r"os\.system"))
def stack_global(ws: Workspace) -> None:
    """STACK_GLOBAL os.system (protocol 4) + REDUCE."""
    _payload(ws, asm.call(asm.stack_global("os", "system"), _touch(ws)))


@kind(expect=REFUSED.format(r"subprocess\.Popen"))
def inst(ws: Workspace) -> None:
    """INST subprocess.Popen(["touch", MARKER])."""
    _payload(ws, asm.inst("subprocess", "Popen", asm.lst(asm.string("touch"), asm.string(str(ws.marker)))))


@kind(expect=REFUSED.format(r"posix\.system"))
def obj(ws: Workspace) -> None:
    """OBJ with posix.system as the class: cls(*args) runs it."""
    _payload(ws, asm.obj(asm.glob("posix", "system"), _touch(ws)))


@kind(expect=REFUSED.format(r"builtins\.getattr"))
def getattr_chain(ws: Workspace) -> None:
    """builtins.getattr(collections.OrderedDict, '__init_subclass__'): reaching code through attributes."""
    _payload(ws, asm.call(asm.glob("builtins", "getattr"), asm.glob("collections", "OrderedDict"),
                          asm.string("__init_subclass__")))


@kind(expect=REFUSED.format(r"torch\.load"))
def torch_load(ws: Workspace) -> None:
    """GLOBAL torch.load: a torch name outside the allow-list."""
    _payload(ws, asm.call(asm.glob("torch", "load"), asm.string("/dev/null")))


@kind(expect=BAD_PICKLE)
def newobj_on_a_function(ws: Workspace) -> None:
    """NEWOBJ with an allowed function (not a class) as the class."""
    _payload(ws, asm.newobj(asm.glob("torch._utils", "_rebuild_tensor_v2"), asm.integer(1)))


@kind(code=(0, 1))
def newobj_allowed_class(ws: Workspace) -> None:
    """NEWOBJ / NEWOBJ_EX of allowed classes with odd arguments: harmless data or a clean error."""
    ops = ws.pick("ordereddict", ["ordereddict", "set", "ex", "record"])
    payload = {
        "ordereddict": asm.newobj(asm.glob("collections", "OrderedDict"), asm.integer(5)),
        "set": asm.newobj(asm.glob("builtins", "set"), asm.lst(asm.integer(1))),
        "ex": asm.newobj_ex(asm.glob("builtins", "frozenset"), asm.tup(asm.lst()),
                            asm.dct((asm.string("x"), asm.none()))),
        "record": asm.newobj(asm.glob("deepspeed.runtime.fp16.loss_scaler", "LossScaler"), asm.integer(1)),
    }[ops]
    _payload(ws, payload)


@kind(expect=BAD_PICKLE)
def ext_code(ws: Workspace) -> None:
    """EXT1/EXT2/EXT4: objects named by the copyreg extension registry."""
    _payload(ws, asm.ext(ws.param(1, lambda r: r.choice([1, 255, 256, 65535, 65536, 2**31 - 1]))))


@kind(code=(0, 1))
def build_on_allowed_objects(ws: Workspace) -> None:
    """BUILD on what the allow-list hands out: a DeepSpeed record, an OrderedDict (attributes through
    its __dict__ and slot state, even `__class__`), a type marker."""
    target = ws.pick("ordereddict-class", ["record", "ordereddict-dict", "ordereddict-class", "marker", "size"])
    state = {
        "record": asm.dct((asm.string("cur_scale"), asm.floating(float("nan")))),
        "ordereddict-dict": asm.dct((asm.string("__dict__"), asm.dct())),
        "ordereddict-class": asm.tup(asm.none(), asm.dct((asm.string("__class__"), asm.glob("builtins", "set")))),
        "marker": asm.dct((asm.string("name"), asm.integer(3))),
        "size": asm.dct((asm.string("x"), asm.integer(1))),
    }[target]
    obj = {
        "record": asm.call(asm.glob("deepspeed.runtime.fp16.loss_scaler", "LossScaler"), asm.floating(1.0)),
        "ordereddict-dict": asm.call(asm.glob("collections", "OrderedDict")),
        "ordereddict-class": asm.call(asm.glob("collections", "OrderedDict")),
        "marker": asm.glob("torch", "Tensor"),
        "size": asm.call(asm.glob("torch", "Size"), asm.lst(asm.integer(2))),
    }[target]
    _payload(ws, asm.build(obj, state))


# -- persistent ids --------------------------------------------------------------------------------------


def _storage_pid(dtype: bytes, key: str, numel: int, location: str = "cpu") -> bytes:
    return asm.tup(asm.string("storage"), dtype, asm.string(key), asm.string(location), asm.integer(numel))


def _tensor_of(pid_ops: bytes, size: int = 1) -> bytes:
    return asm.call(asm.glob("torch._utils", "_rebuild_tensor_v2"), asm.persid(pid_ops), asm.integer(0),
                    asm.tup(asm.integer(size)), asm.tup(asm.integer(1)), asm.boolean(False),
                    asm.call(asm.glob("collections", "OrderedDict")))


@kind(expect=BAD_PICKLE + r".*persistent id|" + BAD_PICKLE)
def persistent_id_text(ws: Workspace) -> None:
    """PERSID (a text persistent id, protocol 0) where torch writes a storage tuple."""
    _payload(ws, asm.text_persid(ws.param("storage", lambda r: r.choice(["storage", "", "x" * 200, "0", "[/]"]))))


@kind(expect=BAD_PICKLE)
def persistent_id_malformed(ws: Workspace) -> None:
    """BINPERSID of tuples that are not storage references: wrong length, wrong types."""
    pid = ws.pick("short", ["short", "types", "none", "nested"])
    ops = {
        "short": asm.tup(asm.string("storage"), asm.string("0")),
        "types": asm.tup(asm.string("storage"), asm.integer(1), asm.integer(2), asm.string("cpu"), asm.string("x")),
        "none": asm.none(),
        "nested": asm.tup(*(asm.tup(asm.string("storage")) for _ in range(5))),
    }[pid]
    _payload(ws, asm.persid(ops))


@kind(expect=r"missing from the archive|" + BAD_PICKLE)
def persistent_id_path_key(ws: Workspace) -> None:
    """A storage key that is a path out of the archive (`../../../etc/passwd`)."""
    key = ws.param("../../../etc/passwd", lambda r: r.choice(["../../../etc/passwd", "/etc/passwd", "", "0/../1",
                                                              "x" * 300]))
    _payload(ws, _tensor_of(_storage_pid(asm.glob("torch", "FloatStorage"), key, 1)))


@kind(expect=r"holds \d+ bytes, expected|" + BAD_PICKLE)
def persistent_id_numel(ws: Workspace) -> None:
    """A real storage key with an element count that does not match its bytes: huge, negative, zero."""
    numel = ws.param(2**62, lambda r: r.choice([2**62, -1, 0, 2**31, 10**30, -(2**63)]))
    _payload(ws, _tensor_of(_storage_pid(asm.glob("torch", "FloatStorage"), "0", numel)))


@kind(expect=BAD_PICKLE)
def persistent_id_storage_type(ws: Workspace) -> None:
    """A storage reference whose type is not a storage class (an allowed function; a dtype name)."""
    dtype = ws.pick("function", ["function", "dtype", "string"])
    ops = {"function": asm.glob("torch._utils", "_rebuild_tensor_v2"), "dtype": asm.glob("torch", "float32"),
           "string": asm.string("FloatStorage")}[dtype]
    _payload(ws, _tensor_of(_storage_pid(ops, "0", 1)))


@kind(expect=BAD_PICKLE, issue="14.4", hangs=True)
def persistent_id_shared_bomb(ws: Workspace) -> None:
    """A persistent id that is a 550-byte "billion laughs": the error message formats its repr."""
    levels = ws.param(30, lambda r: r.randrange(10, 40))
    _payload(ws, asm.persid(asm.laughs("list", levels)))


# -- bombs ------------------------------------------------------------------------------------------------


@kind(code=(0, 1), issue="14.4")
def memo_index_huge(ws: Workspace) -> None:
    """A 5-byte LONG_BINPUT at index 2**27: the unpickler's memo array grows to reach it (2 GB)."""
    _payload(ws, asm.memo_bomb(ws.param(2**27, lambda r: r.choice([2**20, 2**26, 2**27, 2**28, 2**31, 2**32 - 1]))))


def _nesting(container: str):  # noqa: ANN202
    def build(ws: Workspace) -> None:
        depth = ws.param(1000, lambda r: r.choice([50, 500, 990, 1000, 3000, 100_000]))
        _payload(ws, asm.nested(container, depth))
    build.__doc__ = f"{container}s nested 1,000 deep in a rank file's pickle."
    return build


for _container in ("list", "dict", "tuple", "set"):
    kind(name=f"deep-{_container}", code=(0, 1), issue="14.4")(_nesting(_container))


def _laughs(container: str):  # noqa: ANN202
    def build(ws: Workspace) -> None:
        _payload(ws, asm.laughs(container, ws.param(30, lambda r: r.randrange(8, 40))))
    build.__doc__ = f"\"Billion laughs\": {container}s of shared references, 550 bytes, 2**30 leaves when copied."
    return build


for _container in ("list", "tuple", "dict"):
    kind(name=f"billion-laughs-{_container}", code=(0, 1), issue="14.4", hangs=True)(_laughs(_container))


@kind(code=(0, 1), issue="14.4")
def deep_tuple_as_key(ws: Workspace) -> None:
    """A tuple nested 100,000 deep used as a dict key: its hash recurses in C without a guard (the
    C unpickler crashed with SIGSEGV)."""
    depth = ws.param(100_000, lambda r: r.choice([200, 1000, 100_000]))
    _payload(ws, asm.dct((asm.nested("tuple", depth), asm.none())))


@kind(code=(0, 1), issue="14.4")
def shared_tuples_as_keys(ws: Workspace) -> None:
    """A "billion laughs" of tuples over a string (hashable) used as dict keys, again and again: a
    tuple's hash is not cached, so each insertion walks every copy."""
    levels = ws.param(60, lambda r: r.randrange(20, 90))
    keys = asm.laughs("tuple", levels, base=asm.string("x"))
    again = asm.get(1000 + levels)
    _payload(ws, keys + asm.op("POP") + asm.dct(*((again, asm.integer(i))
                                                  for i in range(ws.param(50, lambda r: r.randrange(1, 200))))))


@kind(expect=BAD_PICKLE)
def memo_get_unset(ws: Workspace) -> None:
    """BINGET of a memo index never set."""
    _payload(ws, asm.get(ws.param(250, lambda r: r.randrange(2**32))))


@kind(expect=BAD_PICKLE + r"|refers to")
def global_not_utf8(ws: Workspace) -> None:
    """A GLOBAL whose module name is not UTF-8."""
    _payload(ws, asm.op("GLOBAL") + b"\xff\xfe\n" + b"x\n")


@kind(code=(0, 1))
def huge_integer(ws: Workspace) -> None:
    """A LONG4 integer of a million digits as a value nobody reads."""
    _payload(ws, asm.integer(ws.param(10**4400, lambda r: r.choice([10**4400, -(10**5000), 2**64]))))


@kind(expect=REFUSED.format(r"posix.*system"), issue="14.2")
def global_with_control_characters(ws: Workspace) -> None:
    """A GLOBAL whose module name carries terminal escape sequences: the refusal quotes it raw (found by
    the fuzzer, zip-pickle 1025)."""
    module = ws.param("posix\x1b[2J\x1b]0;owned\x07", lambda r: "posix"
                      + "".join(chr(r.randrange(1, 32)) for _ in range(5)))
    _payload(ws, asm.call(asm.glob(module, "system"), _touch(ws)))
