"""A seeded fuzzer over the real fixture checkpoints: every command that reads the input, on thousands
of hostile variations of it, each run bounded in time and memory.

A case is (family, seed). The seed decides everything: which fixture, which file, which bytes or
opcodes, which parameters of a corpus kind. `case(family, seed)` returns the kind to build; the
runner (`tests.hostile.run.Runner`) builds it with `random.Random(seed)`, runs each of its commands
in a forked child of the harness's zygote and judges the run with the oracle (`tests.hostile.oracle`):
exit 0, or exit 1 with one clean error line naming a file, rank or tensor (2 for usage errors); no
traceback, hang, signal, memory blow-up, payload marker or leftover output. With random parameters
no message is pinned: the corpus (tests/hostile/kinds) pins those.

Families:

- zip-directory, zip-headers, zip-data: byte flips in one region of a torch zip archive (the central
  directory and end records, the local headers, the tensor data) of a random rank file of a random
  fixture; zip-pickle: flips inside the pickle (the entry rewritten so its CRC holds);
- truncation: a random rank file cut at a random point (mostly inside a chosen region);
- pickle-ops: the pickle parsed into opcodes and mutated op by op (arguments replaced by hostile
  integers and strings, opcodes deleted, duplicated, swapped, replaced, hostile runs inserted);
- parallel-zip, parallel-pickle-ops: the same flips, cuts and op-level mutations in any file of a
  model-parallel fixture (AutoTP, AutoEP, deepspeed.moe, PipelineModule, Megatron-style): expert,
  layer and per-model-parallel-rank files included;
- pickles, records, counts, latest, markup, sidefiles, pushsrc, manifests, checkpoint, splits: the corpus
  kinds of that module with their parameters drawn from the seed;
- client-records: the corpus kinds of `kinds/client.py` (inert records: deep, wide, self-referencing,
  exploding, misplaced, nested classes, records as keys, code inside) with drawn parameters;
- record-ops: op-level mutations whose globals and insertions are classes outside the allow-list
  (inert records where DeepSpeed's data belongs, built, called, appended to, set into, holding
  themselves, used as dict keys, nested classes named through getattr), on any fixture and any rank file.

Replay one case (it prints the workspace and every run's output):

    CKPTFLOW_FIXTURE_CACHE=... python -m tests.hostile.fuzz replay FAMILY SEED [--command C] [--keep DIR]

Run a family by hand: `python -m tests.hostile.fuzz run FAMILY --count 50 [--start 1000]`.
"""

from __future__ import annotations

import argparse
import dataclasses
import pickletools
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from tests.hostile import pickleasm as asm
from tests.hostile.corpus import CHECKPOINT_READERS, Kind, Outcome, Workspace, all_kinds
from tests.hostile.run import CaseRun, Runner
from tests.hostile.torchfile import get_pickle, set_pickle

# Fixtures a generic mutation may start from: every stage, precision and world size in the matrix.
SOURCES = (
    "z1-bf16-ws2", "z1-fp32-ws1", "z1-bf16-ws2-fp32accum", "z2-fp32-ws2", "z2-bf16-ws3",
    "z3-bf16-ws2", "z3-fp32-ws3", "llama-z3-bf16-ws2",
)
# Model-parallel fixtures (AutoTP, AutoEP, deepspeed.moe, PipelineModule, Megatron-style): the
# `parallel-*` families damage their files (expert, layer and per-model-parallel-rank files included).
PARALLEL_SOURCES = (
    "autotp-tp2-z0-fp32", "autotp-tp2-z1-bf16", "autotp-tp2-z2-fp32", "autotp-tp2-z3-fp32", "autotp-tp2dp2-z1-fp32",
    "autotp-glm-tp2-z1-fp32", "autotp-llama-tied-tp2-z1-fp32", "autoep-qwen3-moe-ep2-z2-bf16",
    "autoep-mixtral-ep2-z3-fp32", "autoep-qwen3-moe-ep2dp2-z2-fp32", "dsmoe-ep2-z0-fp32", "dsmoe-ep2-z2-bf16",
    "dsmoe-ep2dp2-z2-fp32", "pipe-pp2-z1-bf16", "pipe-pp2dp2-z1-fp32", "megatron-pp2tp2-z1-fp32-ucinfo",
)
ALL_SOURCES = SOURCES + PARALLEL_SOURCES
# Any clean outcome: success, a clean error, or a usage error.
GENERIC = Outcome(code=(0, 1, 2))


# ---- op-level pickle mutation -------------------------------------------------------------------------


HOSTILE_INTS = [0, 1, -1, 2, 255, 256, 2**31 - 1, 2**31, -(2**31), 2**32, 2**62, 2**63, -(2**63), 10**18, 10**30,
                10**5000]
HOSTILE_STRINGS = ["", "[/]", "[red]x", ":x:", "../../x", "/etc/passwd", "\x00", "\x1b[2J", "x" * 1000, "global_step3",
                   "storage", "cpu", "0", "999", "posix", "system", "\udcff"]
HOSTILE_GLOBALS = [("posix", "system"), ("builtins", "eval"), ("torch", "load"), ("collections", "OrderedDict"),
                   ("torch._utils", "_rebuild_tensor_v2"), ("torch", "FloatStorage"), ("torch", "Size"),
                   ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"), ("builtins", "set"), ("_codecs", "encode"),
                   ("torch", "Tensor"), ("deepspeed.runtime.zero.config", "ZeroStageEnum")]
# Globals outside the allow-list that the unpickler keeps as inert records (client state), and code it refuses.
RECORD_GLOBALS = [("argparse", "Namespace"), ("collections", "defaultdict"), ("collections", "UserList"),
                  ("numpy", "dtype"), ("numpy._core.multiarray", "_reconstruct"), ("builtins", "list"),
                  ("functools", "partial"), ("datetime", "datetime"), ("enum", "Enum"), ("torch", "float8_e4m3fn"),
                  ("__main__", "TrainerState"), ("posix", "system"), ("logging", "os.system"),
                  ("argparse", "Namespace.Inner"), ("argparse", "Namespace.__init__")]
NO_ARG_OPS = ["POP", "DUP", "MARK", "EMPTY_LIST", "EMPTY_DICT", "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3",
              "LIST", "DICT", "APPEND", "APPENDS", "SETITEM", "SETITEMS", "REDUCE", "BUILD", "NEWOBJ", "STOP", "NONE",
              "BINPERSID", "POP_MARK", "STACK_GLOBAL", "MEMOIZE", "NEWTRUE", "EMPTY_SET", "ADDITEMS", "FROZENSET"]


def _insertion(r: random.Random, marker: Path) -> bytes:
    choice = r.randrange(7)
    if choice == 0:
        return asm.call(asm.glob("posix", "system"), asm.string(f"touch {marker}"))
    if choice == 1:
        return asm.memo_bomb(r.choice([2**16, 2**20, 2**26]))
    if choice == 2:
        return asm.get(r.randrange(300))
    if choice == 3:
        return asm.nested(r.choice(["list", "dict", "tuple"]), r.choice([10, 500, 5000]))
    if choice == 4:
        return asm.laughs(r.choice(["list", "tuple", "dict"]), r.randrange(4, 28))
    if choice == 5:
        return asm.glob(*r.choice(HOSTILE_GLOBALS))
    return asm.op(r.choice(NO_ARG_OPS))


def _replacement(r: random.Random, opcode: pickletools.OpcodeInfo, arg: object, marker: Path) -> bytes | None:
    if opcode.name in ("GLOBAL", "INST"):
        module, name = r.choice(HOSTILE_GLOBALS)
        return asm.op(opcode.name) + module.encode() + b"\n" + name.encode() + b"\n"
    if isinstance(arg, bool) or arg is None:
        return None
    if isinstance(arg, int):
        if opcode.name in ("BINGET", "LONG_BINGET", "BINPUT", "LONG_BINPUT", "GET", "PUT"):
            index = r.choice([arg + 1, arg - 1 if arg else 0, 255, 256, 2**20, 2**27])
            return (asm.get if "GET" in opcode.name else asm.put)(max(0, index))
        return asm.integer(r.choice([*HOSTILE_INTS, arg + 1, arg - 1, arg * 2**20, -arg]))
    if isinstance(arg, str):
        return asm.string(r.choice([*HOSTILE_STRINGS, arg + "x", arg[::-1], arg * 3]))
    if isinstance(arg, float):
        return asm.floating(r.choice([float("nan"), float("inf"), -0.0, 1e308]))
    if isinstance(arg, bytes):
        return asm.binbytes(r.randbytes(len(arg)))
    return None


def _record_insertion(r: random.Random, marker: Path) -> bytes:
    """A record built, called, extended, set into or referenced, holding itself (its state, or a list that
    holds it), used as a dict key, its class named through getattr: what a client state's pickle does."""
    module, name = r.choice(RECORD_GLOBALS)
    cls = asm.glob(module, name)
    me = 900_000 + r.randrange(1000)  # far above the memo indices of the pickle mutated
    choice = r.randrange(11)
    if choice == 7:
        return asm.build(asm.newobj(cls) + asm.put(me), asm.dct((asm.string("me"), asm.get(me))))
    if choice == 8:
        return asm.lst() + asm.put(me) + asm.op("MARK") + asm.newobj(cls, asm.get(me)) + asm.get(me) + asm.op("APPENDS")
    if choice == 9:
        return asm.dct((asm.newobj(cls), asm.integer(1)))
    if choice == 10:
        return asm.call(asm.glob("builtins", "getattr"), asm.glob(module, name.partition(".")[0]),
                        asm.string(r.choice(["Inner", "__init__", "os"])))
    if choice == 0:
        return asm.newobj(cls)
    if choice == 1:
        return asm.build(asm.newobj(cls), asm.dct((asm.string("x"), asm.integer(1))))
    if choice == 2:
        return asm.call(cls, asm.string(f"touch {marker}"))
    if choice == 3:
        return asm.newobj(cls) + asm.op("MARK") + asm.integer(1) + asm.op("APPENDS")
    if choice == 4:
        return asm.newobj(cls) + asm.op("MARK") + asm.string("k") + asm.integer(1) + asm.op("SETITEMS")
    if choice == 5:
        return asm.obj(cls, asm.integer(r.randrange(3)))
    return cls


def mutate_pickle(data: bytes, r: random.Random, marker: Path, *, records: bool = False) -> bytes:
    """`data` with 1 to 5 op-level mutations (see the module docstring); with `records`, globals and
    insertions drawn from `RECORD_GLOBALS` and `_record_insertion`."""
    ops = list(pickletools.genops(data))
    segments = [data[pos:(ops[i + 1][2] if i + 1 < len(ops) else len(data))] for i, (_, _, pos) in enumerate(ops)]
    for _ in range(r.choice([1, 1, 1, 2, 3, 5])):
        i = r.randrange(1, len(segments) - 1)  # keep PROTO and the final STOP
        opcode, arg, _ = ops[i] if i < len(ops) else (None, None, 0)
        how = r.choice(["arg", "arg", "arg", "delete", "duplicate", "swap", "opcode", "insert"])
        if how == "arg" and opcode is not None:
            new = (asm.op(opcode.name) + "\n".join(r.choice(RECORD_GLOBALS)).encode() + b"\n"
                   if records and opcode.name in ("GLOBAL", "INST") else _replacement(r, opcode, arg, marker))
            if new is not None:
                segments[i] = new
                continue
            how = "insert"
        if how == "delete":
            segments.pop(i)
            ops.pop(i) if i < len(ops) else None
        elif how == "duplicate":
            segments.insert(i, segments[i])
            ops.insert(i, ops[i])
        elif how == "swap" and i + 1 < len(segments) - 1:
            segments[i], segments[i + 1] = segments[i + 1], segments[i]
        elif how == "opcode":
            segments[i] = asm.op(r.choice(NO_ARG_OPS))
        else:
            segments.insert(i, _record_insertion(r, marker) if records else _insertion(r, marker))
            ops.insert(i, (None, None, 0))  # type: ignore[arg-type]
    return b"".join(segments)


def _pickle_ops(ws: Workspace) -> None:
    """The pickle of a random rank file, mutated opcode by opcode."""
    assert ws.rng is not None
    path = ws.rng.choice(ws.rank_files())
    set_pickle(path, mutate_pickle(get_pickle(path), ws.rng, ws.marker))


def _record_ops(ws: Workspace) -> None:
    """The pickle of a random rank file, mutated opcode by opcode with records of classes outside the allow-list."""
    assert ws.rng is not None
    path = ws.rng.choice(ws.rank_files())
    set_pickle(path, mutate_pickle(get_pickle(path), ws.rng, ws.marker, records=True))


# ---- families -----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    kinds: tuple[str, ...]  # corpus kinds drawn from (by name prefix), or () for `build`
    any_source: bool = False  # draw the fixture from `sources` instead of the kind's own
    build: object = None  # a builder of its own (the op-level pickle mutator)
    doc: str = ""
    sources: tuple[str, ...] = SOURCES  # what `any_source` and `build` draw the fixture from


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("zip-directory", ("zipfiles/directory-flip", "zipfiles/directory-offset-past-end"), any_source=True,
           doc="byte flips in the central directory and end records"),
    Family("zip-headers", ("zipfiles/local-header-flip", "zipfiles/local-header-name-length"), any_source=True,
           doc="byte flips in local file headers"),
    Family("zip-pickle", ("zipfiles/pickle-flip", "zipfiles/pickle-truncated"), any_source=True,
           doc="byte flips and cuts inside the pickle"),
    Family("zip-data", ("zipfiles/data-flip", "zipfiles/storage-shorter-than-recorded"), any_source=True,
           doc="byte flips in tensor data, storages cut short"),
    Family("truncation", ("zipfiles/truncated-in-region", "checkpoint/garbage-file"), any_source=True,
           doc="rank files cut at random points, replaced by random bytes"),
    Family("pickle-ops", (), any_source=True, build=_pickle_ops, doc="op-level pickle mutations"),
    Family("pickles", ("pickles/",), doc="hostile pickles of every opcode family, bombs, nesting"),
    Family("records", ("records/",), doc="tensor records: strides, offsets, sizes, BUILD after a storage"),
    Family("counts", ("counts/",), doc="absurd sizes and counts in the metadata"),
    Family("latest", ("latest/",), doc="bad `latest` pointers"),
    Family("markup", ("markup/",), doc="rich markup in what messages quote"),
    Family("sidefiles", ("sidefiles/",), doc="config and root files for consolidate and reshard"),
    Family("pushsrc", ("pushsrc/",), doc="special files, safetensors headers, model-card inputs for push"),
    Family("manifests", ("manifests/",), doc="bad manifests and partial records at DEST"),
    Family("checkpoint", ("checkpoint/",), doc="broken checkpoints a user meets, with drawn parameters"),
    Family("splits", ("splits/",), doc="an AutoTP checkpoint's split metadata (affine maps, vocabulary size)"),
    Family("parallel-zip", ("zipfiles/directory-flip", "zipfiles/local-header-flip", "zipfiles/pickle-flip",
                            "zipfiles/data-flip", "zipfiles/truncated-in-region"), any_source=True,
           sources=PARALLEL_SOURCES, doc="byte flips and cuts in any file of a model-parallel checkpoint"),
    Family("parallel-pickle-ops", (), build=_pickle_ops, sources=PARALLEL_SOURCES,
           doc="op-level mutations of the pickle of any file of a model-parallel checkpoint"),
    Family("client-records", ("client/",), doc="client state as inert records: deep, wide, cyclic, misplaced, code"),
    Family("record-ops", (), build=_record_ops, sources=ALL_SOURCES,
           doc="op-level mutations with records of classes outside the allow-list, in any rank file"),
)}

# Seeds per family: the default run (`make test`) and the long mode (`--long`, CKPTFLOW_FUZZ_LONG=1).
DEFAULT_SEEDS = {
    "zip-directory": 2, "zip-headers": 2, "zip-pickle": 3, "zip-data": 2, "truncation": 3, "pickle-ops": 5,
    "pickles": 3, "records": 2, "counts": 2, "latest": 2, "markup": 2, "sidefiles": 2, "pushsrc": 2,
    "manifests": 2, "checkpoint": 2, "splits": 2, "parallel-zip": 2, "parallel-pickle-ops": 2,
    "client-records": 3, "record-ops": 4,
}
LONG_SEEDS = {  # 4,500 cases: the 3,200 of before the default was cut, splits, the parallel and client families
    "zip-directory": 200, "zip-headers": 200, "zip-pickle": 250, "zip-data": 150, "truncation": 250,
    "pickle-ops": 500, "pickles": 250, "records": 200, "counts": 150, "latest": 200, "markup": 150,
    "sidefiles": 150, "pushsrc": 250, "manifests": 150, "checkpoint": 150, "splits": 200, "parallel-zip": 300,
    "parallel-pickle-ops": 300, "client-records": 200, "record-ops": 300,
}


def case(family: str, seed: int) -> Kind:
    """The kind fuzz case (family, seed) builds: a corpus kind (maybe on another fixture) or a mutator."""
    fam = FAMILIES[family]
    pick = random.Random(f"{family}:{seed}")  # independent of the builder's own Random(seed)
    if fam.build is not None:
        source = pick.choice(fam.sources)
        return Kind(f"fuzz/{family}", fam.build, source, dict.fromkeys(CHECKPOINT_READERS, GENERIC), None,  # type: ignore[arg-type]
                    fam.doc)
    kinds = [k for n, k in all_kinds().items() if any(n == p or (p.endswith("/") and n.startswith(p))
                                                      for p in fam.kinds)]
    chosen = pick.choice(kinds)
    source = pick.choice(fam.sources) if fam.any_source else chosen.source
    return dataclasses.replace(chosen, source=source, outcomes=dict.fromkeys(chosen.outcomes, GENERIC), hangs=False)


def label(family: str, seed: int) -> str:
    return f"fuzz--{family}--{seed}"


def run_family(runner: Runner, family: str, seeds: Sequence[int],
               commands: Sequence[str] | None = None) -> list[CaseRun]:
    jobs = [(case(family, s), commands, s, label(family, s)) for s in seeds]
    return runner.run_many(jobs)


def replay_line(run: CaseRun) -> str:
    family, seed = run.label.split("--")[1:3]
    return f"python -m tests.hostile.fuzz replay {family} {seed} --command {run.command}"


def report(runs: Sequence[CaseRun]) -> str:
    out = []
    for run in runs:
        out.append(f"{run.report()}\n  replay: CKPTFLOW_FIXTURE_CACHE=<cache> {replay_line(run)}")
    return "\n\n".join(out)


# ---- command line -------------------------------------------------------------------------------------


def _runner(keep: Path | None, workers: int, seconds: float) -> tuple[Runner, object]:
    from tests.hostile.corpus import fixture_names, load_fixtures
    from tests.hostile.harness import Harness, Limits
    from tests.servers.hub import HubServer

    fixtures = load_fixtures(sorted(set(fixture_names()) | set(ALL_SOURCES)))
    hub = HubServer().start()
    workdir = keep or Path(tempfile.mkdtemp(prefix="ckptflow-fuzz-"))
    workdir.mkdir(parents=True, exist_ok=True)
    harness = Harness(workers=workers, limits=Limits(seconds=seconds))
    return Runner(harness=harness, fixtures=fixtures, workdir=workdir, hub=hub, limits=harness.limits,
                  keep=keep is not None), hub


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.hostile.fuzz", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    replay = sub.add_parser("replay", help="run one case and print every run")
    replay.add_argument("family", choices=sorted(FAMILIES))
    replay.add_argument("seed", type=int)
    run = sub.add_parser("run", help="run seeds of families and summarize")
    run.add_argument("families", nargs="*", default=sorted(FAMILIES))
    run.add_argument("--count", type=int)
    run.add_argument("--start", type=int, default=0)
    run.add_argument("--long", action="store_true")
    for p in (replay, run):
        p.add_argument("--command", action="append", default=[])
        p.add_argument("--keep", type=Path)
        p.add_argument("--workers", type=int, default=2)
        p.add_argument("--seconds", type=float, default=8.0)
    args = parser.parse_args(argv)
    runner, hub = _runner(args.keep, args.workers, args.seconds)
    runner.stop_after_hang = args.what == "run" and not args.long  # as the default test run does
    started = time.monotonic()
    try:
        if args.what == "replay":
            kind = case(args.family, args.seed)
            print(f"{args.family} {args.seed}: {kind.name} on {kind.source} ({kind.doc})")
            runs = run_family(runner, args.family, [args.seed], args.command or None)
            for r in runs:
                print(("ok   " if r.ok else "FAIL ") + r.report())
            return 0 if all(r.ok for r in runs) else 1
        failed = 0
        total = 0
        for family in args.families:
            count = args.count or (LONG_SEEDS if args.long else DEFAULT_SEEDS)[family]
            t0 = time.monotonic()
            runs = run_family(runner, family, range(args.start, args.start + count), args.command or None)
            bad = [r for r in runs if not r.ok]
            failed += len(bad)
            total += len(runs)
            print(f"{family:14s} {count:5d} cases {len(runs):5d} runs {len(bad):4d} failing  "
                  f"{time.monotonic() - t0:6.1f}s",
                  flush=True)
            for r in bad:
                first = r.violations[0].splitlines()[0][:160] if r.violations else ""
                print(f"    {r.command:11s} {replay_line(r).split('replay ')[1]:28s} {first}")
        print(f"{total} runs, {failed} failing, {time.monotonic() - started:.1f}s; workspaces in {runner.workdir}")
        return 1 if failed else 0
    finally:
        runner.harness.close()
        hub.stop()  # type: ignore[attr-defined]


if __name__ == "__main__":
    sys.exit(main())
