"""Per-process RNG files (the Hugging Face Trainer's, Accelerate's), renamed for the target world size. Pure.

Two trainers save their random number generators' states beside the DeepSpeed files, one file per
process, and a resumed process reads the file named for its own index, so the source's files, named
for its own world size, are never copied as they are: `plan_rng_files` says which file each target
rank gets, from which source file. Each way of naming them is an `RngFamily`:

- The Hugging Face Trainer (`TRAINER`) saves `rng_state.pth` when it ran as one process,
  `rng_state_{i}.pth` from each process `i` otherwise. On resume (`transformers.Trainer._load_rng_state`)
  a run of one process reads `rng_state.pth` and process `i` of several reads `rng_state_{i}.pth`;
  when its file is missing it logs "Didn't find an RNG file ... reproducibility is not guaranteed" and
  goes on with fresh states.
- Accelerate (`ACCELERATE`): `Accelerator.save_state` (`accelerate.checkpointing.save_accelerator_state`)
  saves `random_states_{i}.pkl` from every process `i`, a single process included (`random_states_0.pkl`),
  and `load_accelerator_state` reads `random_states_{process_index}.pkl`; a missing or unreadable file
  is logged at INFO as "Could not load random states" and the run goes on with fresh states.
  Its other files (`scheduler.bin`, `sampler.bin`, `custom_checkpoint_{i}.pkl`) are per object, not per
  process, and are carried as they are.

Target rank `r` of M takes the state of source rank `r mod N` (N the source's RNG files of that
family; at M = 1 that is rank 0's, the main process's). Ranks the source had keep their own state, so
resharding to a multiple of N and back changes nothing, and a new rank gets a copy of an existing
rank's. Copying is sound because both seed every process with the same seed (`set_seed`, no rank
offset by default) and every data-parallel rank draws as many numbers per step, so the ranks' states
are normally equal (the Trainer-written test fixture's two files hold equal states); a state copied
from another rank is one the run could have had. The files are pickles from the source: they are
copied byte for byte, never read.

The CUDA entry of a file saved by a distributed run holds the states of every device the process saw
(`get_rng_state_all`); a run resumed on other devices may log that it could not set them back, as
the Trainer does for any checkpoint moved between machines. The CPU, Python and NumPy states load.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class RngFamily:
    """One way of naming per-process RNG files: `{stem}_{i}{suffix}` from process i, and `single`, the
    name a run of one process writes and reads instead (None: it uses rank 0's name)."""

    label: str  # what the command line calls them: "Trainer", "Accelerate"
    stem: str
    suffix: str
    single: str | None = None
    pattern: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "pattern", re.compile(rf"{re.escape(self.stem)}_(\d+){re.escape(self.suffix)}"))

    def rank_file(self, rank: int) -> str:
        return f"{self.stem}_{rank}{self.suffix}"

    def file_rank(self, name: str) -> int | None:
        """The process index in `name` when it is one of this family's per-rank files, else None."""
        m = self.pattern.fullmatch(name)
        return int(m.group(1)) if m else None

    def target(self, rank: int, world_size: int) -> str:
        """The name target rank `rank` of `world_size` reads."""
        return self.single if world_size == 1 and self.single is not None else self.rank_file(rank)


TRAINER = RngFamily(label="Trainer", stem="rng_state", suffix=".pth", single="rng_state.pth")
ACCELERATE = RngFamily(label="Accelerate", stem="random_states", suffix=".pkl")
FAMILIES = (TRAINER, ACCELERATE)
SINGLE = "rng_state.pth"  # the Trainer's one-process file (`TRAINER.single`)


@dataclass(frozen=True, kw_only=True)
class RngCopy:
    """One RNG file of the output: `target` (a name in OUT) is a copy of `source` (a name in SRC)."""

    rank: int  # the target rank that loads it (0 for the one-process `rng_state.pth`)
    target: str
    source: str
    source_rank: int | None  # None: the source's one-process file (`rng_state.pth`)
    family: RngFamily = TRAINER


def family_of(name: str) -> RngFamily | None:
    """The family `name` is an RNG file of, or None."""
    for family in FAMILIES:
        if name == family.single or family.file_rank(name) is not None:
            return family
    return None


def is_rng_file(name: str) -> bool:
    """True for a per-process RNG file of any family (`rng_state.pth`, `rng_state_{i}.pth`,
    `random_states_{i}.pkl`)."""
    return family_of(name) is not None


def rank_file(rank: int) -> str:
    return TRAINER.rank_file(rank)


def plan_rng_files(names: Iterable[str], world_size: int) -> tuple[RngCopy, ...]:
    """The RNG files a checkpoint resharded to `world_size` ranks gets from the source folder's `names`,
    for each family found there (Trainer first, then Accelerate).

    Within a family: the one-process name (`rng_state.pth`) at 1 rank when the family has one, else the
    per-rank name for every target rank r, each from source rank `r mod N` (the N per-rank files in
    rank order; the one-process file counts as rank 0's when there are no per-rank files). No RNG file
    in `names`: nothing.
    """
    if world_size < 1:
        raise ValueError(f"world size must be at least 1, got {world_size}")
    names = list(names)
    return tuple(c for family in FAMILIES for c in _plan_family(family, names, world_size))


def _plan_family(family: RngFamily, names: list[str], world_size: int) -> tuple[RngCopy, ...]:
    ranked = sorted((rank, n) for n in names if (rank := family.file_rank(n)) is not None)
    sources: list[tuple[int | None, str]] = list(ranked)
    if not sources and family.single is not None and family.single in names:
        sources = [(None, family.single)]
    if not sources:
        return ()
    return tuple(
        RngCopy(rank=r, target=family.target(r, world_size), source=sources[r % len(sources)][1],
                source_rank=sources[r % len(sources)][0], family=family)
        for r in range(world_size)
    )


def describe(copies: Iterable[RngCopy]) -> str:
    """One line saying which RNG file each target rank got, e.g. 'rng_state.pth from source rank 0
    (rng_state_0.pth)' or 'rng_state_0..2.pth from source ranks 0, 1, 0 (rank r takes r mod 2)'.
    Files of several families: each family's line after its label, joined by '; '."""
    copies = tuple(copies)
    if not copies:
        return "no Trainer RNG files in the source"
    lines = describe_families(copies)
    if len(lines) == 1:
        return lines[0][1]
    return "; ".join(f"{label}: {text}" for label, text in lines)


def describe_families(copies: Iterable[RngCopy]) -> tuple[tuple[str, str], ...]:
    """(label, line) for each family among `copies`, in `FAMILIES` order: what the command line prints
    as '{label} RNG files: {line}'."""
    copies = tuple(copies)
    return tuple((f.label, _describe_family(f, group)) for f in FAMILIES
                 if (group := tuple(c for c in copies if c.family == f)))


def _describe_family(family: RngFamily, copies: tuple[RngCopy, ...]) -> str:
    if len(copies) == 1:
        c = copies[0]
        if c.source == c.target:
            return f"{c.target} carried over" if c.source_rank is None else f"{c.target} from source rank 0"
        return f"{c.target} from source rank {c.source_rank} ({c.source})"
    last = copies[-1].rank
    first, second = family.rank_file(0), family.rank_file(1)
    names = f"{family.stem}_0..{last}{family.suffix}" if last > 1 else f"{first}, {second}"
    if all(c.source_rank is None for c in copies):
        return f"{names}, each a copy of the source's {copies[0].source}"
    used = sorted({c.source_rank for c in copies if c.source_rank is not None})
    ranks = ", ".join(str(c.source_rank) for c in copies[:8]) + (", ..." if len(copies) > 8 else "")
    rule = f"rank r takes r mod {len(used)}" if used == list(range(len(used))) else "in rank order, repeating"
    return f"{names} from source ranks {ranks} ({rule})"
