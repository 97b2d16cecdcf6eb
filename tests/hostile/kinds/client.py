"""Hostile client state (issue 25): objects of classes outside the allow-list, which ckptflow reads as
inert records (never imported or run) and carries; deep, wide, self-referencing and exploding ones;
records where DeepSpeed's data belongs; code hidden in a record; strict pickle mode.

A payload is one more entry of the top-level dict of a real rank file's pickle (rank 1's model states
unless said otherwise): there it is client state, carried. A code payload runs `touch MARKER`; the
oracle checks the marker never appears.
"""

from __future__ import annotations

import argparse

from tests.hostile import pickleasm as asm
from tests.hostile.corpus import CHECKPOINT_READERS, DEEP, RESHARD, VALIDATE, Workspace, kind
from tests.hostile.torchfile import inject, resave

REFUSED = r"refers to {}, which ckptflow does not load"
BAD_PICKLE = r"cannot read its pickle"
MISPLACED = r"holds an object of class {} \(never loaded\) in {}, where DeepSpeed writes tensors and plain data"
MEMO = 500_000  # memo indices of the payloads: far above any DeepSpeed's pickle uses

NAMESPACE = asm.glob("argparse", "Namespace")


def _payload(ws: Workspace, ops: bytes, *, pin: bool = True) -> None:
    """`ops` as the value of one more key of rank 1's model states (any rank file in the fuzzer); the
    file named in every message of the canonical case when `pin`."""
    path = ws.any_rank_file(ws.model_file(1))
    inject(path, "client_payload", ops)
    if pin:
        ws.pin(str(path))


def _namespace(**fields: bytes) -> bytes:
    """argparse.Namespace as torch pickles it: NEWOBJ, then BUILD with its __dict__."""
    return asm.build(asm.newobj(NAMESPACE), asm.dct(*((asm.string(k), v) for k, v in fields.items())))


def _touch(ws: Workspace) -> bytes:
    return asm.string(f"touch {ws.marker}")


# -- carried as it is ----------------------------------------------------------------------------------


@kind(code=0, overrides={VALIDATE: {"expect": r"client state: .*client_payload: an argparse\.Namespace"},
                         DEEP: {"expect": r"client_payload: an argparse\.Namespace"}})
def namespace_carried(ws: Workspace) -> None:
    """An argparse.Namespace in rank 0's and rank 1's client state: read as a record, listed, carried."""
    for rank in (0, 1):
        inject(ws.model_file(rank), "client_payload", _namespace(lr=asm.floating(0.1), layers=asm.integer(2)))


@kind(code=(0, 1))
def wide_record(ws: Workspace) -> None:
    """A dict subclass record with 10,000 SETITEMS items and a list subclass with 10,000 APPENDS (the
    bounded unpickler reads about a million opcodes a second: far wider ones take their time, bounded
    by its opcode budget, and reshard reads and writes them several times)."""
    count = ws.param(10_000, lambda r: r.choice([1, 1000, 10_000, 20_000]))
    items = asm.op("MARK") + b"".join(asm.integer(i) + asm.integer(i) for i in range(count)) + asm.op("SETITEMS")
    values = asm.op("MARK") + b"".join(asm.integer(i) for i in range(count)) + asm.op("APPENDS")
    dict_record = asm.call(asm.glob("collections", "defaultdict"), asm.glob("builtins", "list")) + items
    list_record = asm.newobj(asm.glob("collections", "UserList")) + values
    _payload(ws, asm.lst(dict_record, list_record), pin=False)


# -- bounds --------------------------------------------------------------------------------------------


@kind(expect=BAD_PICKLE + r".*nests containers more than 100 deep", issue="25.1")
def deep_records(ws: Workspace) -> None:
    """Records nested 1,000 deep (each Namespace's state holds the next; the fuzzer's last may hold the first,
    a cycle): refused past the depth bound."""
    depth = ws.param(1000, lambda r: r.choice([10, 30, 40, 1000, 10_000]))
    inner = ws.pick("none", ["none", "cycle"])  # the innermost holds None, or the outermost (a cycle)
    # _namespace(child=...) nested `depth` times, written as its prefixes and suffixes (not rebuilt per level)
    prefix = asm.newobj(NAMESPACE) + asm.op("EMPTY_DICT") + asm.op("MARK") + asm.string("child")
    first = prefix.replace(asm.newobj(NAMESPACE), asm.newobj(NAMESPACE) + asm.put(MEMO), 1)
    last = asm.none() if inner == "none" else asm.get(MEMO)
    _payload(ws, first + prefix * (depth - 1) + last + (asm.op("SETITEMS") + asm.op("BUILD")) * depth)


@kind(code=0, overrides={VALIDATE: {"expect": r"client_payload: an? "}})
def self_referencing_record(ws: Workspace) -> None:
    """A client state that refers back to itself (a memo reference to an object being built): a
    Namespace whose state holds it, a record whose arguments hold a list that holds it, a dict and a list
    subclass holding themselves, a plain list and dict holding themselves: carried with the cycle."""
    how = ws.pick("state", ["state", "args", "setitems", "appends", "list", "dict"])
    me = asm.get(MEMO)
    ops = {
        "state": asm.build(asm.newobj(NAMESPACE) + asm.put(MEMO), asm.dct((asm.string("me"), me))),
        "args": asm.call(asm.glob("collections", "deque"), asm.lst()) + asm.put(MEMO) + asm.op("POP")
        + asm.call(asm.glob("collections", "deque"), asm.lst(me)) + asm.put(MEMO + 1) + asm.op("POP")
        + asm.build(asm.get(MEMO), asm.dct((asm.string("x"), asm.get(MEMO + 1)))),
        "setitems": asm.call(asm.glob("collections", "defaultdict")) + asm.put(MEMO)
        + asm.op("MARK") + asm.string("me") + me + asm.op("SETITEMS"),
        "appends": asm.newobj(asm.glob("collections", "UserList")) + asm.put(MEMO) + asm.op("MARK") + me
        + asm.op("APPENDS"),
        "list": asm.lst() + asm.put(MEMO) + asm.op("MARK") + me + me + asm.op("APPENDS"),
        "dict": asm.dct() + asm.put(MEMO) + asm.string("me") + me + asm.op("SETITEM"),
    }[how]
    _payload(ws, ops, pin=False)


@kind(code=(0, 1), commands=(DEEP, RESHARD))
def wide_cycles(ws: Workspace) -> None:
    """2,000 Namespaces each holding the list that holds them all, and a chain of 90 lists each holding the
    next and the last holding the first: carried (within the depth bound), or refused in one line."""
    count = ws.param(2000, lambda r: r.choice([1, 100, 2000, 10_000]))
    chain = ws.param(90, lambda r: r.choice([2, 50, 90, 99, 100, 101, 1000]))
    members = asm.lst() + asm.put(MEMO) + asm.op("MARK") + asm.build(
        asm.newobj(NAMESPACE), asm.dct((asm.string("all"), asm.get(MEMO)))) * count + asm.op("APPENDS")
    # lists MEMO+1 ... MEMO+chain, each appended to the one before, the last holding the first
    links = b"".join(asm.lst() + asm.put(MEMO + 1 + i) + asm.op("POP") for i in range(chain))
    links += b"".join(asm.get(MEMO + 1 + i) + asm.get(MEMO + 2 + i) + asm.op("APPEND") + asm.op("POP")
                      for i in range(chain - 1))
    links += asm.get(MEMO + chain) + asm.get(MEMO + 1) + asm.op("APPEND")
    _payload(ws, asm.tup(members, links), pin=False)


@kind(expect=r"holds an object that refers back to itself in ds_config/self, where DeepSpeed writes tensors and plain "
             r"data", commands=(VALIDATE, RESHARD), issue="25.1")
def cycle_in_a_deepspeed_field(ws: Workspace) -> None:
    """Rank 0's `ds_config` (a DeepSpeed field) made a dict that holds itself: corrupt, one line naming the field."""
    def edit(obj: dict) -> None:
        obj["ds_config"]["self"] = obj["ds_config"]

    resave(ws.model_file(0), edit)
    ws.pin(f"rank 0: {ws.model_file(0)} holds an object that refers back to itself in ds_config/self")


@kind(code=0, overrides={VALIDATE: {"expect": r"client_payload: a list of 3 items, naming argparse\.Namespace\.Inner"}})
def nested_class(ws: Workspace) -> None:
    """A class nested in another (`argparse.Namespace.Inner`), as protocol 4 names it (STACK_GLOBAL) and as
    protocol 2 does (getattr of the outer class and a name), built and named: read as records, carried."""
    nested = ws.pick("stack-global", ["stack-global", "getattr"])
    cls = (asm.stack_global("argparse", "Namespace.Inner") if nested == "stack-global"
           else asm.call(asm.glob("builtins", "getattr"), NAMESPACE, asm.string("Inner")))
    _payload(ws, asm.lst(asm.build(asm.newobj(cls), asm.dct((asm.string("x"), asm.integer(1)))), cls,
                         asm.call(cls, asm.integer(2))), pin=False)


@kind(code=0, overrides={VALIDATE: {"expect": r"client_payload: a dict of 3 items, naming argparse\.Namespace, enum\.Enum"}})
def records_as_keys(ws: Workspace) -> None:
    """Records as dict keys and set members (an enum member, a user object, a tuple holding a record), as a
    trainer's state keyed by its enum holds them: carried, each key its own object."""
    member = asm.call(asm.glob("enum", "Enum"), asm.integer(1)) + asm.put(MEMO)
    user = asm.build(asm.newobj(NAMESPACE), asm.dct((asm.string("k"), asm.integer(1))))
    members = asm.call(asm.glob("builtins", "set"), asm.lst(asm.get(MEMO), asm.string("x")))
    _payload(ws, asm.dct((member, asm.integer(1)), (user, members), (asm.tup(asm.get(MEMO), asm.integer(3)),
                                                                       asm.integer(2))), pin=False)


@kind(expect=BAD_PICKLE + r".*shared references expand to more than", issue="25.1")
def record_laughs(ws: Workspace) -> None:
    """A "billion laughs" of records: each level a record whose arguments hold the level below twice."""
    levels = ws.param(40, lambda r: r.randrange(24, 64))
    out = asm.newobj(NAMESPACE) + asm.put(MEMO)
    for level in range(1, levels + 1):
        prev = asm.get(MEMO + level - 1)
        out += asm.op("POP") + asm.call(NAMESPACE, prev, prev) + asm.put(MEMO + level)
    _payload(ws, out)


# -- records that do more than hold state ----------------------------------------------------------------


@kind(expect=BAD_PICKLE + r".*calls an object the pickle built", issue="25.1")
def record_called(ws: Workspace) -> None:
    """REDUCE whose callable is a record the pickle built (a Namespace called with an argument)."""
    _payload(ws, asm.call(asm.newobj(NAMESPACE), _touch(ws)))


@kind(expect=BAD_PICKLE + r".*BUILD gives argparse\.Namespace \(named, never loaded\) a state", issue="25.1")
def build_on_a_class(ws: Workspace) -> None:
    """BUILD on a global itself (it would set attributes on the class where the file is loaded)."""
    _payload(ws, asm.build(NAMESPACE, asm.dct((asm.string("__init__"), asm.none()))))


@kind(expect=REFUSED.format(r"posix\.system"), issue="25.1")
def code_inside_a_record(ws: Workspace) -> None:
    """posix.system inside a Namespace's state: named, not called, refused all the same (written back,
    it would be a callable in the user's process)."""
    how = ws.pick("bare", ["bare", "partial", "reduce-arg"])
    system = asm.glob("posix", "system")
    value = {
        "bare": system,
        "partial": asm.call(asm.glob("functools", "partial"), system, _touch(ws)),
        "reduce-arg": asm.call(asm.glob("collections", "defaultdict"), system),
    }[how]
    _payload(ws, _namespace(hook=value))


@kind(expect=r"refers to .*, which ckptflow does not load", issue="25.1")
def globals_no_module_can_have(ws: Workspace) -> None:
    """Globals a record may never name: a dotted name reaching os through another module, a module's
    internals, a code-loading function, builtins that run code."""
    module, name = ws.pick(("logging", "os.system"), [
        ("logging", "os.system"), ("argparse", "_os.system"), ("argparse", "__builtins__"), ("torch", "load"),
        ("numpy", "load"), ("builtins", "getattr"), ("builtins", "__import__"), ("functools", "reduce"),
        ("operator", "attrgetter"), ("timeit", "timeit"), ("torch.jit", "load"), ("importlib", "import_module"),
        ("arg parse", "Namespace"), ("", "x"), ("argparse", ""), ("torch.fx.graph_module", "reduce_graph_module"),
        ("logging", "Logger.os.system"), ("argparse", "Namespace.__init__"), ("string", "Formatter.format"),
    ])
    _payload(ws, asm.call(asm.stack_global(module, name), _touch(ws)))


# -- records where DeepSpeed's data belongs ----------------------------------------------------------------


@kind(expect=MISPLACED.format(r"argparse\.Namespace", r"optimizer_state_dict/fp32_flat_groups\[0\]"), issue="25.1")
def record_where_a_tensor_belongs(ws: Workspace) -> None:
    """Rank 0's first flat fp32 partition replaced by an argparse.Namespace."""
    def edit(obj: dict) -> None:
        obj["optimizer_state_dict"]["fp32_flat_groups"][0] = argparse.Namespace(numel=8)

    resave(ws.optim_file(0), edit)
    ws.pin(f"rank 0: {ws.optim_file(0)} holds an object of class argparse.Namespace (never loaded) in "
           "optimizer_state_dict/fp32_flat_groups[0]")
    ws.pin("corrupt-file", VALIDATE, DEEP)


@kind(expect=MISPLACED.format(r"argparse\.Namespace", r"(param_shapes|ds_config|buffer_names)"), issue="25.1")
def record_in_a_deepspeed_field(ws: Workspace) -> None:
    """A DeepSpeed field of rank 0's model states (param_shapes, ds_config, buffer_names) made a Namespace."""
    field = ws.pick("param_shapes", ["param_shapes", "ds_config", "buffer_names"])

    def edit(obj: dict) -> None:
        obj[field] = argparse.Namespace(value=obj[field] if field != "param_shapes" else None)

    resave(ws.model_file(0), edit)
    ws.pin(f"in {field}, where DeepSpeed writes tensors and plain data")


# -- strict pickle mode --------------------------------------------------------------------------------


@kind(expect=REFUSED.format(r"argparse\.Namespace") + r".*strict pickle mode", issue="25.1")
def strict_pickle(ws: Workspace) -> None:
    """`--strict-pickle`: the Namespace of a Megatron-DeepSpeed client state is refused, as before (and, drawn by
    the fuzzer, a plain list that holds itself: a cycle, refused in that mode)."""
    what = ws.pick("namespace", ["namespace", "cycle"])
    inject(ws.model_file(0), "args", _namespace(lr=asm.floating(0.1)) if what == "namespace"
           else asm.lst() + asm.put(MEMO) + asm.op("MARK") + asm.get(MEMO) + asm.op("APPENDS"))
    for command in CHECKPOINT_READERS:
        ws.extra_args[command] = ["--strict-pickle"]
    ws.pin("unsafe-pickle", VALIDATE, DEEP)

