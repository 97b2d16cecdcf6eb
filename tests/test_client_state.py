"""A trainer's client state (issue 25, item 1): read as inert records, never imported or run, listed by
`validate`, carried by `reshard` into every model-states file it writes, and loaded by DeepSpeed at the
new world size as the source held it.

- The unpickler (no DeepSpeed): what a record keeps, the rule of what is refused even as a record,
  strict pickle mode, nothing imported or run, records written back as the source pickled them; a
  client state that holds itself (cycles through an object's state, a list, a dict, a tuple, an object's
  constructor arguments), records as dict keys and set members, nested classes (protocols 2 and 4):
  read, written back and loaded by `torch.load` as the same object graph, markers left only there.
- Real checkpoints written by DeepSpeed on CPU (`tests.fixtures.specs.client_state`): a Megatron-DeepSpeed
  client state (`args`, an `argparse.Namespace`; numpy RNG state) at ZeRO-1, a Lightning-like one at
  ZeRO-3 with user classes that leave a marker file whenever they are rebuilt. No ckptflow command leaves
  a marker; DeepSpeed's own `load_checkpoint` after `ckptflow reshard`, at another world size and in a
  process that defines the user classes, returns a client state equal to the source's, with the weights
  and Adam moments the source's live engine held.

The hostile side (deep, wide, self-referencing, exploding client state; records where DeepSpeed's data
belongs; code inside a record) is in the corpus (`tests/hostile/kinds/client.py`) and the fuzzer's
`client-records` and `record-ops` families.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import enum
import functools
import json
import os
import pathlib
import pickle
import subprocess
import sys
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ckptflow.errors import UnsafePickleError
from ckptflow.formats.deepspeed.client_state import Misplaced, client_state, misplaced
from ckptflow.formats.deepspeed.names import ALLOWED, ALLOWED_STRICT, DEEPSPEED_MODEL_KEYS
from ckptflow.formats.torch.inert import InertRecord, TorchDevice, TorchDtype, refusal
from ckptflow.formats.torch.tensorref import TensorRef
from ckptflow.formats.torch.writer import SourceReader, write_archive
from ckptflow.formats.torch.zipdir import open_archive
from ckptflow.reshard.files import _Tree
from tests.fixtures.launch import launch
from tests.fixtures.models.client_state import (
    MARKER_ENV,
    MARKERS,
    AttributeDict,
    History,
    Phase,
    differences,
    leave_marker,
)
from tests.oracles.tensors import read_tensor

REPO = Path(__file__).resolve().parents[1]
MEGATRON, LIGHTNING = "client-megatron-z1-fp32-ws2", "client-lightning-z3-bf16-ws2"
TARGET_WORLD_SIZE = 3


def save(tmp_path: Path, obj: Any, name: str = "x.pt") -> str:
    path = tmp_path / name
    torch.save(obj, path)
    return str(path)


def plain(obj: Any) -> Any:
    """A tree read by ckptflow with records as (module, name, how, args, kwargs, ops) and tensors as bytes:
    what two reads must agree on for the objects to be rebuilt alike."""
    if isinstance(obj, InertRecord):
        return ("record", obj.module, obj.name, obj.how, plain(obj.args), plain(obj.kwargs),
                [(kind, plain(items)) for kind, items in obj.ops])
    if isinstance(obj, TensorRef):
        return ("tensor", obj.dtype, obj.shape, read_tensor(obj).reshape(-1).view(torch.uint8).numpy().tobytes())
    if isinstance(obj, TorchDtype | TorchDevice):
        return (type(obj).__name__, str(obj))
    if isinstance(obj, Mapping):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [plain(v) for v in obj]
    return obj


def run_cli(*args: str, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptflow.cli", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=300, env={**os.environ, "COLUMNS": "400", **(env or {})})


# ---- the unpickler -------------------------------------------------------------------------------------


def test_records_keep_how_each_object_was_made(tmp_path: Path) -> None:
    counts: collections.defaultdict[str, list[int]] = collections.defaultdict(list)
    counts["a"].append(1)
    state = {"args": argparse.Namespace(lr=0.1, params_dtype=torch.float16, dev=torch.device("cuda", 1)),
             "counts": counts, "history": History([1.0, 0.5], name="loss"), "phase": Phase.TRAIN,
             "hp": AttributeDict(lr=0.1), "partial": functools.partial(torch.optim.AdamW, lr=1e-3),
             "factory": collections.defaultdict(set), "t": torch.arange(3)}
    obj = open_archive(save(tmp_path, state), ALLOWED).obj
    args = obj["args"]
    assert (args.module, args.name, args.how, args.args) == ("argparse", "Namespace", "newobj", ())
    assert args.ops == (("build", {"lr": 0.1, "params_dtype": "float16", "dev": "cuda:1"}),)
    assert type(args.state["params_dtype"]) is TorchDtype and type(args.state["dev"]) is TorchDevice
    assert obj["counts"].how == "reduce" and obj["counts"].args[0].qualname == "builtins.list"
    assert obj["counts"].ops == (("setitems", (("a", [1]),)),)
    assert [kind for kind, _ in obj["history"].ops] == ["appends", "build"]
    assert obj["history"].ops[0][1] == (1.0, 0.5) and obj["history"].state == {"name": "loss"}
    assert (obj["phase"].qualname, obj["phase"].args) == ("tests.fixtures.models.client_state.Phase", ("train",))
    assert obj["hp"].ops == (("setitems", (("lr", 0.1),)),)
    assert obj["partial"].qualname == "functools.partial" and obj["partial"].args[0].how == "global"
    assert obj["factory"].args[0].qualname == "builtins.set"  # an allowed global named as a value: a record
    assert isinstance(obj["t"], TensorRef)


def test_nothing_is_imported_or_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Objects of a module that marks its import, its `__init__`, `__setstate__` and `__reduce__`
    function: reading them leaves no mark and does not import the module; `torch.load` does both."""
    name = f"ckptflow_probe_{uuid.uuid4().hex[:8]}"
    marks = tmp_path / "marks"
    (tmp_path / f"{name}.py").write_text(
        "import pathlib\n"
        f"MARKS = pathlib.Path({str(marks)!r})\n"
        "MARKS.mkdir(exist_ok=True)\n"
        "(MARKS / 'imported').touch()\n"
        "class Built:\n"
        "    def __init__(self, x): self.x = x\n"
        "    def __setstate__(self, s): (MARKS / 'setstate').touch(); self.__dict__.update(s)\n"
        "class Called:\n"
        "    def __init__(self, x): (MARKS / 'init').touch(); self.x = x\n"
        "    def __reduce__(self): return (Called, (self.x,))\n"
        "def rebuild(x): (MARKS / 'reduce').touch(); return x\n"
        "class Reduced:\n"
        "    def __reduce__(self): return (rebuild, (1,))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = __import__(name)
    path = save(tmp_path, {"objects": [module.Built(1), module.Called(2), module.Reduced()]})
    for mark in marks.iterdir():
        mark.unlink()
    del sys.modules[name]
    records = open_archive(path, ALLOWED).obj["objects"]
    assert [r.qualname for r in records] == [f"{name}.Built", f"{name}.Called", f"{name}.rebuild"]
    assert name not in sys.modules and list(marks.iterdir()) == []
    torch.load(path, weights_only=False)  # the control: these objects do run when loaded
    assert sorted(p.name for p in marks.iterdir()) == ["imported", "init", "reduce", "setstate"]


@pytest.mark.parametrize(("module", "name"), [
    ("argparse", "Namespace"), ("collections", "defaultdict"), ("numpy", "dtype"),
    ("numpy._core.multiarray", "_reconstruct"), ("builtins", "list"), ("functools", "partial"),
    ("pathlib", "PurePosixPath"), ("torch.optim.adamw", "AdamW"), ("__main__", "TrainerState"),
    ("copyreg", "_reconstructor"), ("datetime", "datetime"), ("omegaconf.dictconfig", "DictConfig"),
    ("mymod", "Outer.Inner"), ("lightning.pytorch.trainer.states", "TrainerFn.Kind.Deep"),
])
def test_state_classes_become_records(module: str, name: str) -> None:
    assert refusal(module, name) is None


@pytest.mark.parametrize(("module", "name", "why"), [
    ("posix", "system", "code"), ("os", "system", "code"), ("nt", "system", "code"),
    ("subprocess", "Popen", "code"), ("sys", "exit", "code"), ("shutil", "rmtree", "code"),
    ("socket", "socket", "code"), ("importlib", "import_module", "code"), ("runpy", "run_path", "code"),
    ("pty", "spawn", "code"), ("code", "interact", "code"), ("ctypes", "CDLL", "code"), ("pickle", "loads", "code"),
    ("_pickle", "loads", "code"), ("marshal", "loads", "code"), ("multiprocessing.util", "spawnv_passfds", "code"),
    ("builtins", "eval", "code"), ("builtins", "exec", "code"), ("builtins", "compile", "code"),
    ("builtins", "getattr", "code"), ("builtins", "setattr", "code"), ("builtins", "delattr", "code"),
    ("builtins", "open", "code"), ("builtins", "input", "code"), ("builtins", "breakpoint", "code"),
    ("builtins", "globals", "code"), ("builtins", "locals", "code"), ("builtins", "vars", "code"),
    ("builtins", "map", "code"), ("builtins", "type", "code"), ("torch", "load", "code"),
    ("torch.serialization", "load", "code"), ("torch.jit", "load", "code"), ("torch.hub", "load", "code"),
    ("numpy", "load", "code"), ("functools", "reduce", "code"), ("operator", "attrgetter", "code"),
    ("timeit", "timeit", "code"), ("torch.fx.graph_module", "reduce_graph_module", "code"),
    ("builtins", "__import__", "internals"), ("argparse", "__builtins__", "internals"),
    ("logging", "os.system", "dotted"), ("argparse", "_os.system", "dotted"), ("mymod", "np.load", "dotted"),
    ("logging", "Logger.os.system", "dotted"), ("argparse", "Namespace.__init__", "internals"),
    ("string", "Formatter.format", "code"), ("builtins", "Exception.with_traceback", "code"),
    ("os", "PathLike.Inner", "code"), ("mymod", "Outer.", "name"), ("mymod", "Outer.<locals>.f", "name"),
    ("posix\x1b[2J", "system", "name"), ("", "x", "name"), ("x", "", "name"), ("a b", "c", "name"),
    ("argparse", "Name space", "name"), ("ａrgparse", "Namespace", "name"), ("m" * 300, "x", "name"),
])
def test_code_is_refused_even_as_a_record(module: str, name: str, why: str) -> None:
    words = {"code": "code that runs", "internals": "internals", "dotted": "dotted name", "name": "no module"}
    found = refusal(module, name)
    assert found is not None and words[why] in found, found


class _Hook:
    def __init__(self, func: Any, *args: Any) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.func, self.args)


@pytest.mark.parametrize("hidden", ["call", "partial", "value"])
def test_code_inside_client_state_refuses_the_file(tmp_path: Path, hidden: str) -> None:
    marker = tmp_path / "ran"
    value = {"call": _Hook(os.system, f"touch {marker}"), "partial": functools.partial(os.system, f"touch {marker}"),
             "value": os.system}[hidden]
    path = save(tmp_path, {"args": argparse.Namespace(hook=value)})
    with pytest.raises(UnsafePickleError) as info:
        open_archive(path, ALLOWED)
    assert str(info.value).startswith(f"{path} refers to posix.system, which ckptflow does not load; refused without "
                                      "running anything (code that runs when the file is loaded): ckptflow neither "
                                      "loads it nor writes it back")
    assert not marker.exists()


def test_strict_pickle_refuses_every_global_outside_the_allow_list(tmp_path: Path) -> None:
    path = save(tmp_path, {"args": argparse.Namespace(lr=0.1)})
    with pytest.raises(UnsafePickleError) as info:
        open_archive(path, ALLOWED_STRICT)
    assert str(info.value) == (
        f"{path} refers to argparse.Namespace, which ckptflow does not load; refused without running anything: in "
        "strict pickle mode only torch tensors and DeepSpeed's checkpoint classes are allowed; without it, an object "
        "of this class is kept as an inert record (never imported or run) and carried as it is")
    assert info.value.code == "unsafe-pickle"


def test_records_are_written_back_as_the_source_pickled_them(tmp_path: Path) -> None:
    """Read, converted by the reshard writer and written: `torch.load` rebuilds equal objects of the same
    classes, and ckptflow reads the same records back (same global, same construction, same arguments,
    the same APPENDS / SETITEMS / BUILD in the same order)."""
    counts: collections.defaultdict[str, list[int]] = collections.defaultdict(list)
    counts["skipped"].append(0)
    state = {"args": argparse.Namespace(lr=0.1, params_dtype=torch.bfloat16, dev=torch.device("cpu"), paths=["/a"]),
             "np": np.random.RandomState(3).get_state(), "counts": counts, "factory": collections.defaultdict(set),
             "history": History([0.9, 0.7], name="loss"), "hp": AttributeDict(lr=0.1, root=pathlib.PurePosixPath("/r")),
             "phase": Phase.WARMUP, "when": datetime.datetime(2026, 1, 2, 3, 4),
             "deque": collections.deque([1, 2], maxlen=4), "counter": collections.Counter("aab"),
             "rng": torch.Generator().manual_seed(3).get_state(), "shared": [b"\x00\xff"] * 2}
    state["again"] = state["args"]  # a shared reference stays one object
    source = save(tmp_path, state)
    ours = str(tmp_path / "ours.pt")
    write_archive(ours, _Tree().convert(open_archive(source, ALLOWED).obj), SourceReader())
    back = torch.load(ours, weights_only=False)
    assert differences({k: v for k, v in back.items() if k != "np"}, {k: v for k, v in state.items() if k != "np"}) == []
    assert back["np"][0] == "MT19937" and np.array_equal(back["np"][1], state["np"][1]) and back["np"][2:] == state["np"][2:]
    assert back["again"] is back["args"]
    assert plain(open_archive(ours, ALLOWED).obj) == plain(open_archive(source, ALLOWED).obj)


def test_strict_pickle_reaches_every_model_parallel_rank(parallel_fixtures: Mapping[str, Any], tmp_path: Path) -> None:
    """A client state in a file only a model-parallel rank's own reader opens (data-parallel rank 1 of
    tensor-parallel rank 1, ZeRO-3): carried by default, refused in strict pickle mode."""
    import shutil

    from ckptflow.validate import validate
    from tests.hostile import pickleasm as asm
    from tests.hostile.torchfile import inject

    fixture = parallel_fixtures["autotp-tp2dp2-z3-bf16"]
    src = tmp_path / "ckpt"
    shutil.copytree(fixture.dir, src)
    path = src / fixture.tag / "zero_pp_rank_1_mp_rank_01_model_states.pt"
    inject(path, "args", asm.build(asm.newobj(asm.glob("argparse", "Namespace")), asm.dct()))
    assert validate(str(src)).ok
    strict = validate(str(src), strict_pickle=True)
    assert [(p.code, p.file) for p in strict.problems] == [("unsafe-pickle", str(path))]


class Made:
    """Records how it was made: `new` the arguments `__new__` got, `init` those `__init__` got (if run)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> "Made":
        obj = super().__new__(cls)
        obj.new = (args, kwargs)
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.init = (args, kwargs)


def test_newobj_ex_and_obj_are_written_back_as_such(tmp_path: Path) -> None:
    """NEWOBJ_EX (`__new__` with keyword arguments, no `__init__`) and OBJ (`cls(*args)`), which torch's
    protocol 2 never writes but a pickle may hold, come back made the same way."""
    from tests.hostile import pickleasm as asm
    from tests.hostile.torchfile import set_pickle

    made = asm.glob(__name__, "Made")
    data = asm.pickle_of(asm.dct(
        (asm.string("ex"), asm.newobj_ex(made, asm.tup(asm.integer(1)), asm.dct((asm.string("k"), asm.integer(2))))),
        (asm.string("obj"), asm.obj(made, asm.integer(3)))))
    source = Path(save(tmp_path, {}))
    set_pickle(source, data)
    records = open_archive(str(source), ALLOWED).obj
    assert (records["ex"].how, records["ex"].args, records["ex"].kwargs) == ("newobj_ex", (1,), {"k": 2})
    assert (records["obj"].how, records["obj"].args) == ("obj", (3,))
    ours = str(tmp_path / "ours.pt")
    write_archive(ours, _Tree().convert(records), SourceReader())
    back = torch.load(ours, weights_only=False)
    assert back["ex"].new == ((1,), {"k": 2}) and not hasattr(back["ex"], "init")
    assert back["obj"].new == ((3,), {}) and back["obj"].init == ((3,), {})


# ---- self-referencing client state, nested classes, records as keys (issue 25) ---------------------------


class Looped:
    """Holds itself (an attribute, and a list of its own) and a tuple that holds itself through a list (a cycle
    entered at a tuple, inside a record's state); loading it runs `__setstate__` (a marker)."""

    def __init__(self, name: str) -> None:
        self.name, self.me, self.items = name, self, [self]
        self.pair: tuple[list[Any]] = ([],)
        self.pair[0].append(self.pair)

    def __setstate__(self, state: dict[str, Any]) -> None:
        leave_marker("setstate")
        self.__dict__.update(state)


class Held:
    """Pickled as REDUCE of the class with a list that holds the object itself (a cycle through its
    constructor's arguments, which the pickler writes by building it inside them); loading runs `__init__`."""

    def __init__(self, items: list[Any]) -> None:
        leave_marker("init")
        self.items = items

    def __reduce__(self) -> tuple[Any, ...]:
        return (Held, (self.items,))


class Tag:
    """Hashed by identity, as a user object is; pickled through a function (`make_tag`) that leaves a marker."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __reduce__(self) -> tuple[Any, ...]:
        return (make_tag, (self.name,))


def make_tag(name: str) -> Tag:
    leave_marker("reduce")
    return Tag(name)


class Stage(enum.Enum):
    FIT = "fit"
    VALIDATE = "validate"


class Outer:
    class Inner:  # a nested class: protocol 4 names it `Outer.Inner`, protocol 2 `getattr(Outer, "Inner")`
        def __init__(self, x: int) -> None:
            self.x = x


def looped_state() -> dict[str, Any]:
    """A client state holding itself in every way a pickle can (an object's state, a list, a dict, a tuple
    through a list, an object's constructor arguments), records as dict keys and set members (two equal
    user objects as two keys), and a nested class, built and named."""
    node = Looped("a")
    ring: list[Any] = [1]
    ring.append(ring)
    table: dict[str, Any] = {}
    table["table"] = table
    wrapped: tuple[list[Any]] = ([],)
    wrapped[0].append(wrapped)
    held = Held([])
    held.items.append(held)
    keyed = {Stage.FIT: 1, Tag("a"): 2, Tag("a"): 3, (Stage.VALIDATE, 1): 4}
    return {"node": node, "ring": ring, "table": table, "wrapped": wrapped, "held": held, "keyed": keyed,
            "inner": Outer.Inner(5), "inner_class": Outer.Inner, "members": {Stage.FIT, "x"}, "again": node}


def graph(obj: Any) -> Any:
    """A loaded object graph as data: every object numbered in the order first met, and met again as
    ("ref", n). Two graphs give the same data when they have the same values, classes, sharing and cycles."""
    numbers: dict[int, int] = {}
    kept: list[Any] = []

    def walk(x: Any) -> Any:
        if isinstance(x, str | bytes | int | float | bool | type(None)):
            return x
        if id(x) in numbers:
            return ("ref", numbers[id(x)])
        n = numbers[id(x)] = len(numbers)
        kept.append(x)  # alive, so that no id is reused
        if isinstance(x, type):
            return (n, "class", x.__module__, x.__qualname__)
        if isinstance(x, enum.Enum):
            return (n, "enum", type(x).__qualname__, x.name)
        if isinstance(x, dict):
            return (n, type(x).__qualname__, [(walk(k), walk(v)) for k, v in x.items()])
        if isinstance(x, list | tuple):
            return (n, type(x).__qualname__, [walk(v) for v in x])
        if isinstance(x, set | frozenset):
            return (n, type(x).__qualname__, sorted((walk(v) for v in x), key=repr))
        return (n, type(x).__module__, type(x).__qualname__, walk(vars(x)))

    return walk(obj)


@pytest.mark.parametrize("protocol", [2, 4])
def test_self_referencing_client_state_is_carried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  protocol: int) -> None:
    """Read (nothing run: no marker), written back by the reshard writer, and loaded by `torch.load` with
    the classes importable: the same object graph as the source's (`x.me is x`, the ring, the keys, the
    nested class), every marker left by the user's own process; read again, the same records."""
    source = tmp_path / "source.pt"
    torch.save({"looped": looped_state(), "t": torch.arange(3)}, source, pickle_protocol=protocol)
    markers = tmp_path / "markers"
    monkeypatch.setenv(MARKER_ENV, str(markers))  # from here on: `Held.__init__` ran building the source
    read = open_archive(str(source), ALLOWED).obj
    assert not markers.exists()
    looped = read["looped"]
    node = looped["node"]
    assert node.qualname == f"{__name__}.Looped" and node.state["me"] is node and node.state["items"][0] is node
    assert node.state["pair"][0][0] is node.state["pair"]
    assert looped["ring"][1] is looped["ring"] and looped["table"]["table"] is looped["table"]
    assert looped["wrapped"][0][0] is looped["wrapped"] and looped["again"] is node
    assert looped["held"].args[0][0] is looped["held"]
    assert (looped["inner"].qualname, looped["inner_class"].qualname) == (f"{__name__}.Outer.Inner",) * 2
    keys = list(looped["keyed"])
    assert [k.qualname if isinstance(k, InertRecord) else k[0].qualname for k in keys] == [
        f"{__name__}.Stage", f"{__name__}.make_tag", f"{__name__}.make_tag", f"{__name__}.Stage"]
    assert keys[1] != keys[2] and hash(keys[1]) != hash(keys[2])  # two objects, two keys: compared by identity
    assert {m.qualname if isinstance(m, InertRecord) else m for m in looped["members"]} == {f"{__name__}.Stage", "x"}
    assert keys[0] in looped["members"]  # the one Stage.FIT of the source, a key and a member
    ours = tmp_path / "ours.pt"
    write_archive(str(ours), _Tree().convert(read), SourceReader())
    assert not markers.exists()
    expected = graph(torch.load(source, weights_only=False)["looped"])
    for mark in markers.iterdir():
        mark.unlink()
    back = torch.load(ours, weights_only=False)
    assert graph(back["looped"]) == expected
    assert back["looped"]["node"].me is back["looped"]["node"] and back["looped"]["held"].items[0] is back["looped"]["held"]
    assert type(back["looped"]["inner"]) is Outer.Inner and len(back["looped"]["keyed"]) == 4
    assert sorted(p.name for p in markers.iterdir()) == sorted(MARKERS)
    again = open_archive(str(ours), ALLOWED).obj["looped"]
    assert again["node"].state["me"] is again["node"] and again["held"].args[0][0] is again["held"]
    assert again["inner"].qualname == f"{__name__}.Outer.Inner" and len(again["keyed"]) == 4


def test_walkers_stop_on_a_self_referencing_client_state(tmp_path: Path) -> None:
    """What ckptflow walks a client state with (validate's listing, the misplaced-record and cycle checks,
    the reshard writer) each visits an object once; a cycle where DeepSpeed's data belongs is named."""
    source = tmp_path / "source.pt"
    torch.save({"ds_config": {"train_batch_size": 2}, "looped": looped_state()}, source)
    archive = open_archive(str(source), ALLOWED)
    assert archive.has_cycles and archive.has_records
    [entry] = [e for e in client_state(archive.obj).entries if e.key == "looped"]
    assert entry.holds == "a dict of 10 items"
    assert entry.classes == tuple(sorted(f"{__name__}.{c}" for c in ("Held", "Looped", "Outer.Inner", "Stage",
                                                                     "make_tag")))
    assert misplaced(archive.obj, model_states=True) is None
    ring: list[Any] = []
    ring.append({"back": ring})
    torch.save({"ds_config": {"ring": ring}}, source)
    assert misplaced(open_archive(str(source), ALLOWED).obj, model_states=True) == Misplaced("ds_config/ring[0]/back")
    torch.save({"ds_config": {Tag("a"): 1}}, source)  # a record as a key is a record all the same
    found = misplaced(open_archive(str(source), ALLOWED).obj, model_states=True)
    assert found is not None and found.record is not None
    assert (found.where, found.record.qualname) == (f"ds_config/key {__name__}.make_tag", f"{__name__}.make_tag")


SIZES = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size", "world_size",
         "padded_vocab_size")


def self_holding(args: argparse.Namespace) -> argparse.Namespace:
    """`args` holding itself: directly, through a list, and through a dict in a list."""
    args.me, args.items, args.table = args, [args, 1], [{"args": args}]
    return args


@pytest.mark.parametrize("protocol", [2, 4])
def test_args_that_hold_themselves_are_rewritten_everywhere(tmp_path: Path, protocol: int) -> None:
    """Megatron's `args` set to a target shape (`reshard.files.args_at`) and written as `reshard.files.model_states`
    writes it (`_Tree.write_as`): loaded by `torch.load`, `args` holds itself as it did, directly, through a list
    and a dict, and so does the file's other reference to it, all with the target's sizes; a list `args` shares
    with the file stays one list, and the source record is left as it was read."""
    from ckptflow.reshard.files import args_at
    from ckptflow.reshard.shape import Shape

    shared = [1, 2]
    args = self_holding(argparse.Namespace(tensor_model_parallel_size=2, pipeline_model_parallel_size=1,
                                           data_parallel_size=2, world_size=4, padded_vocab_size=40, lr=0.5,
                                           shared=shared))
    source = tmp_path / "source.pt"
    torch.save({"args": args, "again": [args], "shared": shared}, source, pickle_protocol=protocol)
    read = open_archive(str(source), ALLOWED).obj
    new = args_at(read["args"], Shape(world_size=6, stage=1, tp=1, pp=3), padded_vocab=38)
    assert new is not read["args"] and read["args"].state["world_size"] == 4
    tree = _Tree()
    tree.write_as(read["args"], new)
    ours = tmp_path / "ours.pt"
    write_archive(str(ours), tree.convert(read), SourceReader())
    back = torch.load(ours, weights_only=False)  # our own file: trusted
    args = back["args"]
    assert args.me is args and args.items[0] is args and args.table[0]["args"] is args and back["again"][0] is args
    assert args.shared is back["shared"] and args.shared == [1, 2]
    assert {k: getattr(args, k) for k in SIZES} == {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 3,
                                                   "data_parallel_size": 2, "world_size": 6, "padded_vocab_size": 38}
    expected = torch.load(source, weights_only=False)
    vars(expected["args"]).update({k: getattr(args, k) for k in SIZES})
    assert graph(back) == graph(expected)  # the source's graph, sharing and cycles, at the target's sizes


@pytest.mark.parametrize(("value", "why"), [
    ("module", "refers to logging.Logger.os.system, which ckptflow does not load"),
    ("dunder", f"refers to {__name__}.Outer.__init__, which ckptflow does not load"),
    ("string", "refers to builtins.getattr, which ckptflow does not load"),
    ("value", "refers to builtins.getattr, which ckptflow does not load"),
])
def test_getattr_is_read_only_as_a_nested_class(tmp_path: Path, value: str, why: str) -> None:
    """protocol 2 names a nested class `getattr(Outer, "Inner")`: that is read as `Outer.Inner`; any other
    getattr is refused (and in strict pickle mode, every getattr), nothing imported or run."""
    from tests.hostile import pickleasm as asm
    from tests.hostile.torchfile import set_pickle

    getattr_ = asm.glob("builtins", "getattr")
    ops = {
        "module": asm.call(getattr_, asm.call(getattr_, asm.glob("logging", "Logger"), asm.string("os")),
                           asm.string("system")),
        "dunder": asm.call(getattr_, asm.glob(__name__, "Outer"), asm.string("__init__")),
        "string": asm.call(getattr_, asm.string("posix"), asm.string("system")),
        "value": asm.lst(getattr_),
    }[value]
    path = Path(save(tmp_path, {}))
    set_pickle(path, asm.pickle_of(asm.dct((asm.string("x"), ops))))
    with pytest.raises(UnsafePickleError) as info:
        open_archive(str(path), ALLOWED)
    assert str(info.value).startswith(f"{path} {why}")
    set_pickle(path, asm.pickle_of(asm.call(getattr_, asm.glob(__name__, "Outer"), asm.string("Inner"))))
    assert open_archive(str(path), ALLOWED).obj.qualname == f"{__name__}.Outer.Inner"
    with pytest.raises(UnsafePickleError, match="refers to builtins.getattr"):
        open_archive(str(path), ALLOWED_STRICT)


def test_a_cycle_is_bounded_and_refused_in_strict_mode(tmp_path: Path) -> None:
    """A chain of 200 lists whose last holds the first: past the depth bound, whichever way round it is walked;
    in strict pickle mode any cycle is refused, a list holding itself included (carried without it)."""
    from ckptflow.errors import CorruptFileError

    def refusal_of(path: str, why: str) -> str:
        return f"{path}: cannot read its pickle ({why}); the file is corrupt or was not written by DeepSpeed; copy it again"

    head: list[Any] = []
    chain = head
    for _ in range(199):
        chain.append([])
        chain = chain[0]
    chain.append(head)
    path = save(tmp_path, {"x": head})
    with pytest.raises(CorruptFileError) as info:
        open_archive(path, ALLOWED)
    assert str(info.value) == refusal_of(path, "it nests containers more than 100 deep")
    ring: list[Any] = []
    ring.append(ring)
    path = save(tmp_path, {"ring": ring}, "ring.pt")
    with pytest.raises(CorruptFileError) as info:
        open_archive(path, ALLOWED_STRICT)
    assert str(info.value) == refusal_of(path, "it holds a reference cycle")
    read = open_archive(path, ALLOWED).obj["ring"]
    assert read[0] is read


def test_writing_a_graph_deeper_than_the_recursion_limit_is_one_error() -> None:
    """The reader bounds depth along the way it walks; the writer walks recursively: should another way round
    a cycle be longer than Python's recursion limit, writing fails in one line, never with a RecursionError."""
    from ckptflow.errors import CheckpointError
    from ckptflow.formats.torch.pickler import dumps

    deep: list[Any] = []
    for _ in range(sys.getrecursionlimit() * 2):
        deep = [deep]
    with pytest.raises(CheckpointError, match="recursion limit deep"):
        _Tree().convert(deep)
    with pytest.raises(CheckpointError, match="more than Python's recursion limit deep"):
        dumps(deep)


def test_a_deepspeed_object_whose_arguments_hold_it_is_written_once() -> None:
    """An `Instance` (NEWOBJ) whose arguments hold it, as a cycle through a record's arguments can make it:
    written once, the arguments' reference pointing at it, not a second NEWOBJ."""
    from ckptflow.formats.torch.pickler import Global, Instance, dumps

    ring: list[Any] = []
    made = Instance(Global("argparse", "Namespace"), {"name": "x"}, args=(ring,))
    ring.append(made)
    data, _ = dumps({"x": made})
    read = pickle.loads(data)["x"]  # our own bytes, argparse's class: trusted
    assert isinstance(read, argparse.Namespace) and read.name == "x"


# ---- the real checkpoints --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(client_state_fixtures: Mapping[str, Any]) -> Mapping[str, Any]:
    return client_state_fixtures


def expected_client_state(fixture: Any) -> dict[str, Any]:
    return pickle.loads((fixture.root / "client_state.pkl").read_bytes())  # written by our own fixture writer


def test_validate_lists_the_client_state(client: Mapping[str, Any]) -> None:
    result = run_cli("validate", str(client[MEGATRON].dir))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[1] == "  client state: carried as it is; its classes are named here, never imported or run"
    assert lines[2:] == [
        "    args: an argparse.Namespace",
        "    checkpoint_version: a float",
        "    iteration: an int",
        "    rng_state: a list of 1 item, naming numpy._core.multiarray._reconstruct, numpy.dtype, numpy.ndarray",
    ]
    result = run_cli("validate", str(client[LIGHTNING].dir), "--json")
    report = json.loads(result.stdout)
    keys = {entry["key"]: entry for entry in report["client_state"]["keys"]}
    assert list(keys) == list(expected_client_state(client[LIGHTNING]))
    assert keys["hyper_parameters"]["holds"] == "a tests.fixtures.models.client_state.AttributeDict"
    assert keys["hyper_parameters"]["classes"] == [
        "pathlib.PurePosixPath", "tests.fixtures.models.client_state.Schedule",
        "tests.fixtures.models.client_state.rebuild_tokens"]
    assert keys["callbacks"]["classes"] == ["tests.fixtures.models.client_state.TrainerState"]


@pytest.mark.parametrize("command", ["validate", "consolidate", "reshard"])
def test_strict_pickle_refuses_client_state(client: Mapping[str, Any], tmp_path: Path, command: str) -> None:
    fixture = client[MEGATRON]
    args = {"validate": [], "consolidate": [str(tmp_path / "out")],
            "reshard": [str(tmp_path / "out"), "--world-size", str(TARGET_WORLD_SIZE)]}[command]
    result = run_cli(command, str(fixture.dir), *args, "--strict-pickle")
    assert result.returncode == 1
    model = fixture.tag_dir / "mp_rank_00_model_states.pt"
    assert f"{model} refers to argparse.Namespace, which ckptflow does not load" in " ".join(result.stdout.split()
                                                                                            + result.stderr.split())
    assert not (tmp_path / "out").exists()


def test_no_command_runs_the_client_state(client: Mapping[str, Any], tmp_path: Path) -> None:
    """validate, validate --deep, consolidate and reshard with the user classes importable from the
    working directory and `$CKPTFLOW_CLIENT_MARKER` set: no marker; `torch.load` of the same file, in
    the same environment, leaves all three (the marker classes work). The Lightning checkpoint's client
    state also holds `looped_state()` (cycles, records as keys, a nested class): the reshard's files, loaded
    by `torch.load`, hold the same object graph."""
    import shutil

    from tests.hostile.torchfile import resave

    looped = tmp_path / LIGHTNING
    shutil.copytree(client[LIGHTNING].dir, looped)
    for path in looped.glob("*/*model_states.pt"):
        resave(path, lambda obj: obj.update(looped=looped_state()))
    markers = tmp_path / "markers"
    env = {MARKER_ENV: str(markers)}
    for name in (MEGATRON, LIGHTNING):
        src = str(client[name].dir if name == MEGATRON else looped)
        for args in (["validate", src], ["validate", src, "--deep"],
                     ["consolidate", src, str(tmp_path / f"{name}-model")],
                     ["reshard", src, str(tmp_path / f"{name}-out"), "--world-size", str(TARGET_WORLD_SIZE)],
                     ["validate", str(tmp_path / f"{name}-out")]):
            result = run_cli(*args, env=env)
            assert result.returncode == 0, (args, result.stdout, result.stderr)
            assert not markers.exists(), (args, sorted(p.name for p in markers.iterdir()))
    model = client[LIGHTNING].tag_dir / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    control = subprocess.run([sys.executable, "-c", f"import torch; torch.load({str(model)!r}, weights_only=False)"],
                             cwd=REPO, env={**os.environ, **env}, capture_output=True, text=True, timeout=300)
    assert control.returncode == 0, control.stderr
    assert sorted(p.name for p in markers.iterdir()) == sorted(MARKERS)
    written = sorted((tmp_path / f"{LIGHTNING}-out").glob("*/*model_states.pt"))
    assert len(written) == TARGET_WORLD_SIZE
    check = ("import sys, torch\nfrom tests.test_client_state import graph, looped_state\n"
             "for path in sys.argv[1:]:\n"
             "    looped = torch.load(path, weights_only=False)['looped']\n"
             "    assert graph(looped) == graph(looped_state()), path\n"
             "    assert looped['node'].me is looped['node'] and looped['held'].items[0] is looped['held'], path\n")
    loaded = subprocess.run([sys.executable, "-c", check, *map(str, written)], cwd=REPO, capture_output=True,
                            text=True, timeout=300)
    assert loaded.returncode == 0, loaded.stderr


@pytest.fixture(scope="module")
def resharded(client: Mapping[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from ckptflow.reshard import reshard

    root = tmp_path_factory.mktemp("client-reshard")
    outs = {}
    for name in (MEGATRON, LIGHTNING):
        outs[name] = root / name
        reshard(str(client[name].dir), str(outs[name]), world_size=TARGET_WORLD_SIZE)
    return outs


def test_reshard_carries_the_client_state_into_every_model_states_file(client: Mapping[str, Any],
                                                                       resharded: dict[str, Path]) -> None:
    for name, out in resharded.items():
        fixture = client[name]
        source = open_archive(str(next(fixture.tag_dir.glob("*model_states.pt"))), ALLOWED).obj
        keys = [k for k in source if k not in DEEPSPEED_MODEL_KEYS]
        assert keys == list(expected_client_state(fixture))
        models = sorted((out / fixture.tag).glob("*model_states.pt"))
        assert len(models) == (TARGET_WORLD_SIZE if fixture.stage == 3 else 1), models
        for path in models:
            written = open_archive(str(path), ALLOWED).obj
            assert [k for k in written if k not in DEEPSPEED_MODEL_KEYS] == keys, path
            want = plain({k: source[k] for k in keys})
            if "args" in want:  # Megatron's args say the target's shape (`reshard.files.args_at`): dp 3 of 3 ranks
                want["args"] = shaped(want["args"], data_parallel_size=TARGET_WORLD_SIZE, world_size=TARGET_WORLD_SIZE)
            assert plain({k: written[k] for k in keys}) == want, path


def shaped(args: Any, **fields: int) -> Any:
    """A `plain` Namespace record with `fields` set in its BUILD state (its one op)."""
    [(kind, state)] = args[-1]
    assert kind == "build" and set(fields) <= set(state), args
    return (*args[:-1], [(kind, {**state, **fields})])


def test_deepspeed_loads_the_client_state_after_reshard(client: Mapping[str, Any], resharded: dict[str, Path],
                                                        tmp_path: Path) -> None:
    """DeepSpeed's own `load_checkpoint` at the new world size, in processes that define the user
    classes: every rank's client state equals the source's, the engine's fp32 weights and Adam moments
    equal the source's live engine's (the fixture's expected.safetensors)."""
    from safetensors.torch import load_file

    jobs = []
    for name, out in resharded.items():
        fixture = client[name]
        jobs.append({"spec": str(fixture.root / "spec.json"), "ckpt": str(out),
                     "expected": str(fixture.root / "client_state.pkl"), "out": str(tmp_path / name)})
    jobs_file = tmp_path / "jobs.json"
    jobs_file.write_text(json.dumps(jobs, indent=1))
    markers = tmp_path / "markers"
    launch("tests.oracles.client_state", TARGET_WORLD_SIZE, ["--jobs", str(jobs_file)], timeout=600,
           log_dir=tmp_path / "logs", env={MARKER_ENV: str(markers)})
    for name in resharded:
        for rank in range(TARGET_WORLD_SIZE):
            report = json.loads((tmp_path / name / f"rank{rank}.json").read_text())
            assert report == {"rank": rank, "missing": [], "extra": [], "differences": []}, (name, report)
        expected = load_file(client[name].expected_path)
        loaded = load_file(tmp_path / name / "state.safetensors")
        assert loaded.keys() == expected.keys()
        assert [k for k in expected if not torch.equal(loaded[k], expected[k])] == [], name
    assert sorted(p.name for p in markers.iterdir()) == sorted(MARKERS)  # the user's process rebuilt them


# ---- Megatron-DeepSpeed: `args` beside `universal_checkpoint_info`, tensor parallelism -------------------

# pp1 x tp2 x dp2, saved with Megatron-DeepSpeed's whole client state (`tests.fixtures.specs.extra`)
MEGATRON_PIPE = "megatron-args-tp2dp2-z1-fp32"
MEGATRON_CASE = (MEGATRON_PIPE, 1)  # resharded to dp1: tp2 x dp1, 2 ranks
MEGATRON_KEYS = ["args", "checkpoint_version", "iteration", "rng_state", "universal_checkpoint_info"]
MEGATRON_CLIENT_KEYS = MEGATRON_KEYS[:-1]  # ckptflow reads `universal_checkpoint_info` itself (DEEPSPEED_MODEL_KEYS)


@pytest.fixture(scope="module")
def megatron_pipe() -> Any:
    from tests.fixtures.sets import build_extra

    return build_extra([MEGATRON_PIPE])[MEGATRON_PIPE]


def model_states(folder: Path) -> list[Path]:
    """The model-states files of a Megatron-style tag folder: one per tensor-parallel rank."""
    return sorted(folder.glob("mp_rank_*_model_states.pt"))


def test_megatron_deepspeed_args_are_listed_and_match_the_run(megatron_pipe: Any) -> None:
    """The fixture is what Megatron-DeepSpeed saves: every model-states file holds `args` (sizes those of the
    run) and `universal_checkpoint_info`; `validate` lists the client state and reads the layout."""
    files = model_states(megatron_pipe.tag_dir)
    assert len(files) == 2
    for path in files:
        obj = open_archive(str(path), ALLOWED).obj
        assert [k for k in obj if k not in DEEPSPEED_MODEL_KEYS] == MEGATRON_CLIENT_KEYS, path
        assert "universal_checkpoint_info" in obj, path
        args = obj["args"]
        assert (args.module, args.name) == ("argparse", "Namespace")
        sizes = {k: args.state[k] for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                            "data_parallel_size", "world_size")}
        assert sizes == {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1, "data_parallel_size": 2,
                         "world_size": 4}
    result = run_cli("validate", str(megatron_pipe.dir))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "Megatron-style tensor parallelism; tp 2 x dp 2, ZeRO-1" in lines[0]
    assert lines[-5:] == [
        "  client state: carried as it is; its classes are named here, never imported or run",
        "    args: an argparse.Namespace",
        "    checkpoint_version: a float",
        "    iteration: an int",
        "    rng_state: a list of 1 item, naming numpy._core.multiarray._reconstruct, numpy.dtype, numpy.ndarray",
    ]


def test_megatron_deepspeed_consolidates_under_the_pipeline_names(megatron_pipe: Any, tmp_path: Path) -> None:
    """No config needed: the tensors under the PipelineModule's `{layer}.{name}`, the live engine's fp32 weights
    bit for bit (the vocabulary's padding row cut off), and the last line says no config came with them."""
    from safetensors.torch import load_file

    out = tmp_path / "model"
    result = run_cli("consolidate", str(megatron_pipe.dir), str(out))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1].startswith(f"not loadable: {out} has no config.json")
    got = load_file(out / "model.safetensors")
    expected = {k.removeprefix("fp32/"): v for k, v in load_file(megatron_pipe.expected_path).items()
                if k.startswith("fp32/")}
    assert got.keys() == expected.keys()
    assert [k for k in expected if not torch.equal(got[k], expected[k])] == []
    assert got["0.weight"].shape == (37, 16)


def test_megatron_deepspeed_reshard_writes_the_client_state_back(megatron_pipe: Any, tmp_path: Path) -> None:
    """`reshard --world-size 2` (dp2 -> dp1, tp2 kept): both model-states files hold the source's client state,
    record for record, `universal_checkpoint_info` included; `args` too, but for the fields that say the shape
    (`reshard.files.ARGS_SHAPE`), which say the target's: dp 1 of 2 ranks."""
    out = tmp_path / "out"
    result = run_cli("reshard", str(megatron_pipe.dir), str(out), "--world-size", "2")
    assert result.returncode == 0, result.stderr
    assert "tp2 x dp2 (4 ranks) -> ZeRO-1 tp2 x dp1 (2 ranks)" in result.stdout
    source = open_archive(str(model_states(megatron_pipe.tag_dir)[0]), ALLOWED).obj
    written = model_states(out / megatron_pipe.tag)
    assert [p.name for p in written] == ["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"]
    for path in written:
        obj = open_archive(str(path), ALLOWED).obj
        assert [k for k in obj if k not in DEEPSPEED_MODEL_KEYS] == MEGATRON_CLIENT_KEYS, path
        others = [k for k in MEGATRON_KEYS if k != "args"]
        assert plain({k: obj[k] for k in others}) == plain({k: source[k] for k in others}), path
        args, was = plain(obj["args"]), plain(source["args"])
        assert args[:-1] == was[:-1] and [kind for kind, _ in args[-1]] == ["build"], path
        state, before = args[-1][0][1], was[-1][0][1]
        changed = {k: (before[k], state[k]) for k in before if state[k] != before[k]}
        assert changed == {"data_parallel_size": (2, 1), "world_size": (4, 2)}, path
        assert list(state) == list(before), path


def test_megatron_deepspeed_args_that_hold_themselves_say_the_target_shape(megatron_pipe: Any, tmp_path: Path) -> None:
    """The Megatron-style checkpoint with `args` made to hold itself (`self_holding`) and held by a second client
    key: `reshard --world-size 2` (dp2 -> dp1) writes model-states files where, loaded by `torch.load`, every
    reference is to one `args` with the target's sizes."""
    import shutil

    from tests.hostile.torchfile import resave

    src = tmp_path / "src"
    shutil.copytree(megatron_pipe.dir, src)
    for path in model_states(src / megatron_pipe.tag):
        resave(path, lambda obj: obj.update(args=self_holding(obj["args"]), again={"args": obj["args"]}))
    out = tmp_path / "out"
    result = run_cli("reshard", str(src), str(out), "--world-size", "2")
    assert result.returncode == 0, result.stderr
    written = model_states(out / megatron_pipe.tag)
    assert len(written) == 2
    for path in written:
        obj = torch.load(path, weights_only=False)  # our own file: trusted
        args = obj["args"]
        assert args.me is args and args.items[0] is args and args.table[0]["args"] is args, path
        assert obj["again"]["args"] is args, path
        assert {k: getattr(args, k) for k in SIZES[:4]} == {
            "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1, "data_parallel_size": 1,
            "world_size": 2}, path


def test_megatron_deepspeed_loads_the_reshard_with_its_client_state(megatron_pipe: Any, tmp_path: Path) -> None:
    """DeepSpeed builds the model at tp2 x dp1 and loads the reshard natively (`tests.oracles.parallel_reshard`,
    one 2-rank launch): the client state it returns on each rank equals the source's (`args` field by field as
    a Namespace, RNG states, `universal_checkpoint_info`); the fp32 masters and Adam moments equal the source's
    live engine's bit for bit; re-saved at that size it writes exactly ckptflow's files."""
    from tests.test_model_parallel_reshard import (
        check_loaded_state,
        check_same_files,
        check_validates,
        run_reshard_oracle,
    )

    oracle = run_reshard_oracle({MEGATRON_PIPE: megatron_pipe}, (MEGATRON_CASE,), (), tmp_path)
    result = json.loads(oracle["results"][MEGATRON_CASE].read_text())
    assert result["client_state_keys"] == MEGATRON_KEYS
    assert result["client_state_differ"] == []
    check_loaded_state(oracle, MEGATRON_CASE, megatron_pipe)
    check_same_files(oracle, MEGATRON_CASE)
    check_validates(oracle, MEGATRON_CASE, megatron_pipe)
