"""The corpus: kinds of hostile input, each a builder with the commands it applies to and the outcome a
user must get from each.

A kind is a function decorated with `@kind(...)` in a module of `tests/hostile/kinds/`. It receives
a `Workspace` whose `src` already holds a copy of a real fixture checkpoint (or of a model folder for
`push`), and damages it. The decorator says which commands read that input and what each must do:
by default exit 1 with one clean error whose text matches `expect`. `xfail` names the commands that
fail today, with the issue item that will fix them (strict: a fixed case fails until the mark goes).

Builders draw their parameters through `ws.param(canonical, chooser)`: the corpus run uses the
canonical value (the case with the pinned message), the fuzzer (`tests/hostile/fuzz.py`) a seeded random one.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import random
import re
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

# The commands that read their input, by the name the corpus uses.
VALIDATE, DEEP, CONSOLIDATE, RESHARD, PUSH, PUSH_HF = "validate", "deep", "consolidate", "reshard", "push", "push-hf"
CHECKPOINT_READERS = (VALIDATE, DEEP, CONSOLIDATE, RESHARD)
PUSHERS = (PUSH, PUSH_HF)
ALL_COMMANDS = (*CHECKPOINT_READERS, *PUSHERS)

# A push SRC built from fixture files (no checkpoint): what `push` is given in the corpus.
MODEL_FOLDER = "model-folder"
# The fixture a model folder is made of: its safetensors file, config and tokenizer.
MODEL_FOLDER_FIXTURE = "llama-z3-bf16-ws2"

HUB_ORG = "hostile"
# The time limit of a canonical case known to hang today: enough for the command when it is fixed
# (they answer in well under a second), short enough that the hang costs little.
HANG_SECONDS = 4.0


@dataclass(frozen=True)
class Outcome:
    """What one command must do with an input.

    `code`: the exit status (or the statuses) allowed. `expect`: a regex searched in the command's
    output with whitespace collapsed (for an error, the message; None: any clean error). `forbid`: a
    regex that must not appear. `xfail`: why this fails today (the test is marked strict xfail)."""

    code: int | tuple[int, ...] = 1
    expect: str | None = None
    forbid: str | None = None
    xfail: str | None = None

    def allows(self, code: int | None) -> bool:
        return code in (self.code if isinstance(self.code, tuple) else (self.code,))


@dataclass(frozen=True)
class Kind:
    name: str  # "<module>/<builder>", e.g. "pickles/deep-list"
    build: Callable[["Workspace"], None]
    source: str  # a fixture name or MODEL_FOLDER
    outcomes: Mapping[str, Outcome]  # command -> outcome, in the order the commands run
    issue: str | None  # the item of issue 14 this kind belongs to ("14.4"), for reports
    doc: str
    hangs: bool = False  # hangs today: its canonical case runs under HANG_SECONDS

    @property
    def commands(self) -> tuple[str, ...]:
        return tuple(self.outcomes)


KINDS: dict[str, Kind] = {}


def kind(
    *,
    source: str = "z3-bf16-ws2",
    commands: Sequence[str] = CHECKPOINT_READERS,
    expect: str | None = None,
    code: int | tuple[int, ...] = 1,
    forbid: str | None = None,
    xfail: str | Mapping[str, str] | None = None,
    issue: str | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    name: str | None = None,
    hangs: bool = False,
) -> Callable[[Callable[["Workspace"], None]], Callable[["Workspace"], None]]:
    """Register a builder as a kind of hostile input (see the module docstring)."""

    def register(fn: Callable[["Workspace"], None]) -> Callable[["Workspace"], None]:
        module = fn.__module__.rsplit(".", 1)[-1]
        full = f"{module}/{name or fn.__name__.replace('_', '-')}"
        outcomes = {}
        for command in commands:
            reason = xfail.get(command) if isinstance(xfail, Mapping) else xfail
            fields: dict[str, Any] = {"code": code, "expect": expect, "forbid": forbid, "xfail": reason}
            fields.update((overrides or {}).get(command, {}))
            outcomes[command] = Outcome(**fields)
        if full in KINDS:
            raise ValueError(f"two kinds named {full}")
        KINDS[full] = Kind(full, fn, source, outcomes, issue, (fn.__doc__ or "").strip().split("\n")[0], hangs)
        return fn

    return register


def all_kinds() -> dict[str, Kind]:
    """Every kind in tests/hostile/kinds/, by name (importing the modules registers them), with the
    failures of today (`tests/hostile/xfails.py`) merged into their outcomes."""
    from tests.hostile import kinds as package
    from tests.hostile.xfails import XFAIL

    if not _LOADED:
        for info in pkgutil.iter_modules(package.__path__):
            importlib.import_module(f"{package.__name__}.{info.name}")
        unknown = set(XFAIL) - set(KINDS)
        if unknown:
            raise ValueError(f"tests/hostile/xfails.py names kinds that do not exist: {sorted(unknown)}")
        for name, reasons in XFAIL.items():
            k = KINDS[name]
            by_command = reasons if isinstance(reasons, Mapping) else dict.fromkeys(k.outcomes, reasons)
            bad = set(by_command) - set(k.outcomes)
            if bad:
                raise ValueError(f"tests/hostile/xfails.py: {name} has no command {sorted(bad)}")
            outcomes = {c: (replace(o, xfail=by_command[c]) if c in by_command and not o.xfail else o)
                        for c, o in k.outcomes.items()}
            KINDS[name] = replace(k, outcomes=outcomes)
        _LOADED.append(True)
    return dict(sorted(KINDS.items()))


_LOADED: list[bool] = []


# ---- the workspace a builder damages ------------------------------------------------------------------


@dataclass
class Workspace:
    """One input and the places a command may write, in a folder of its own.

    `src`: the input (a checkpoint folder holding `latest`, or a folder to push). `out`: OUT/DEST of
    the writing commands, inside `out_parent`, which must hold nothing but OUT afterwards. `marker`:
    the file a code payload creates if it ever runs."""

    root: Path
    rng: random.Random | None = None
    fixture: Any = None  # tests.fixtures.Fixture of the source checkpoint, if any
    src_arg: str | None = None  # what SRC is on the command line, when not `src`
    extra_args: dict[str, list[str]] = field(default_factory=dict)  # command -> more arguments
    must_show: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)  # (literal text, commands)
    hooks: list[tuple[str, str]] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    seconds: float | None = None  # a time limit of its own (a kind known to hang costs the limit)
    src_may_change: bool = False  # the kind itself changes SRC during the run (a file truncated by a hook)
    dest_prepared: bool = False  # the kind put something at DEST (rebuilt before each command)

    @property
    def src(self) -> Path:
        return self.root / "src"

    @property
    def out_parent(self) -> Path:
        return self.root / "out-parent"

    @property
    def out(self) -> Path:
        return self.out_parent / "out"

    @property
    def marker(self) -> Path:
        return self.root / "PAYLOAD-RAN"

    @property
    def hub_repo(self) -> str:
        """A repo of its own on the local Hub (repo names allow letters, digits, `_`, `-`, `.`; no `--`)."""
        return f"{HUB_ORG}/{re.sub(r'[^A-Za-z0-9_]+', '_', self.root.name)[-90:].strip('_')}"

    # -- parameters ------------------------------------------------------------------------------

    def param(self, canonical: T, choose: Callable[[random.Random], T]) -> T:
        """`canonical` for the corpus case, `choose(rng)` when the fuzzer drew a seed."""
        return canonical if self.rng is None else choose(self.rng)

    def pick(self, canonical: T, options: Sequence[T]) -> T:
        return self.param(canonical, lambda r: r.choice(list(options)))

    # -- the checkpoint -----------------------------------------------------------------------------

    @property
    def tag(self) -> str:
        return str(self.fixture.tag) if self.fixture is not None else (self.src / "latest").read_text().strip()

    @property
    def tag_dir(self) -> Path:
        return self.src / self.tag

    @property
    def world_size(self) -> int:
        """The data-parallel world size (of each model-parallel rank, for a model-parallel fixture)."""
        return int(getattr(self.fixture, "world_size", None) or self.fixture.spec["dp"])

    @property
    def stage(self) -> int:
        stage = getattr(self.fixture, "stage", None)
        return int(self.fixture.spec["stage"] if stage is None else stage)

    def optim_file(self, rank: int = 0) -> Path:
        """Rank `rank`'s optimizer file (rank taken modulo the world size, so a builder written for
        two ranks also runs on a one-rank fixture in the fuzzer)."""
        prefix = "bf16_" if any(self.tag_dir.glob("bf16_zero_pp_rank_*")) else ""
        return self.tag_dir / f"{prefix}zero_pp_rank_{rank % self.world_size}_mp_rank_00_optim_states.pt"

    def model_file(self, rank: int = 0) -> Path:
        rank %= self.world_size
        name = f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt" if self.stage == 3 else "mp_rank_00_model_states.pt"
        return self.tag_dir / name

    def rank_files(self) -> list[Path]:
        return sorted(p for p in self.tag_dir.iterdir() if p.name.endswith(".pt"))

    def any_rank_file(self, canonical: Path) -> Path:
        return self.param(canonical, lambda r: r.choice(self.rank_files()))

    # -- writing ------------------------------------------------------------------------------------

    def write(self, rel: str | Path, data: bytes | str) -> Path:
        """Replace (never edit in place) the file `rel` under `src`."""
        path = self.src / rel
        if path.is_symlink() or path.exists():
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data.encode("utf-8", "surrogateescape") if isinstance(data, str) else data)
        return path

    def remove(self, rel: str | Path) -> Path:
        path = self.src / rel
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
        return path

    def fifo(self, rel: str | Path) -> Path:
        path = self.remove(rel)
        path.parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(path)
        return path

    def symlink(self, rel: str | Path, target: str | Path) -> Path:
        path = self.remove(rel)
        path.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(target, path)
        return path

    def directory(self, rel: str | Path) -> Path:
        path = self.remove(rel)
        path.mkdir(parents=True)
        (path / "inside.txt").write_text("a folder where a file belongs\n")
        return path

    def sparse(self, rel: str | Path, size: int, head: bytes = b"") -> Path:
        """A file of `size` bytes that takes no disk: `head`, then a hole."""
        path = self.remove(rel)
        with open(path, "wb") as fh:
            fh.write(head)
            fh.truncate(size)
        return path

    def write_dest(self, rel: str | Path, data: bytes | str) -> Path:
        """A file already at DEST (`out`) before the command runs (push resumes into DEST)."""
        self.dest_prepared = True
        path = self.out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data.encode("utf-8", "surrogateescape") if isinstance(data, str) else data)
        return path

    def show(self, text: str, *commands: str) -> None:
        """The output of `commands` (all when none) must contain `text` literally, whatever the
        parameters: input that a message quotes (markup, names) must appear as it is."""
        self.must_show.append((text, tuple(commands)))

    def pin(self, text: str, *commands: str) -> None:
        """Like `show`, for the canonical case only: a pinned message, which drawn parameters (another
        file, another fixture) may change."""
        if self.rng is None:
            self.show(text, *commands)

    # -- the command lines ---------------------------------------------------------------------------

    def argv(self, command: str, hub_url: str | None = None) -> list[str]:
        src = self.src_arg or str(self.src)
        if command == VALIDATE:
            args = ["validate", src]
        elif command == DEEP:
            args = ["validate", src, "--deep"]
        elif command == CONSOLIDATE:
            args = ["consolidate", src, str(self.out)]
        elif command == RESHARD:
            target = 3 if self.fixture is None or self.world_size != 3 else 2
            args = ["reshard", src, str(self.out), "--world-size", str(target)]
        elif command == PUSH:
            args = ["push", src, str(self.out)]
        elif command == PUSH_HF:
            args = ["push", src, f"hf://{self.hub_repo}"]
        else:
            raise ValueError(command)
        return args + self.extra_args.get(command, [])


def prepare(kind_: Kind, root: Path, fixtures: Mapping[str, Any], rng: random.Random | None = None) -> Workspace:
    """A fresh workspace at `root` with the kind's source copied in, then built by the kind."""
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    ws = Workspace(root=root, rng=rng)
    ws.out_parent.mkdir()
    if kind_.source == MODEL_FOLDER:
        fx = fixtures[MODEL_FOLDER_FIXTURE]
        ws.src.mkdir()
        shutil.copyfile(fx.expected_path, ws.src / "model.safetensors")
        for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(fx.dir / name, ws.src / name)
    else:
        ws.fixture = fixtures[kind_.source]
        shutil.copytree(ws.fixture.dir, ws.src, symlinks=True)
    kind_.build(ws)
    return ws


def load_fixtures(names: Sequence[str], progress: Any = None) -> dict[str, Any]:
    """The fixtures `names`, built or taken from the cache: data-parallel ones (`tests.fixtures.cache`)
    and model-parallel ones (`tests.fixtures.sets`) alike."""
    from tests.fixtures.cache import build
    from tests.fixtures.sets import build_parallel
    from tests.fixtures.specs.parallel import PARALLEL_SPECS

    parallel = sorted(n for n in set(names) if n in PARALLEL_SPECS)
    plain = sorted(n for n in set(names) if n not in PARALLEL_SPECS)
    out: dict[str, Any] = dict(build(plain, progress=progress)) if plain else {}
    if parallel:
        out.update(build_parallel(parallel, progress=progress))
    return out


def fixture_names() -> tuple[str, ...]:
    """Every fixture a kind uses as its source (MODEL_FOLDER is made of MODEL_FOLDER_FIXTURE)."""
    names = {k.source for k in all_kinds().values()} | {MODEL_FOLDER_FIXTURE}
    names.discard(MODEL_FOLDER)
    return tuple(sorted(names))
