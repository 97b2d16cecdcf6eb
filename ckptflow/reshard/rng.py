"""The Hugging Face Trainer's RNG files, renamed for the target world size. Pure.

A Trainer saves its random number generators' states beside the DeepSpeed files: `rng_state.pth`
when it ran as one process, `rng_state_{i}.pth` from each process `i` otherwise. On resume
(`transformers.Trainer._load_rng_state`) a run of one process reads `rng_state.pth` and process `i`
of several reads `rng_state_{i}.pth`; when its file is missing it logs "Didn't find an RNG file ...
reproducibility is not guaranteed" and goes on with fresh states. So the source's files, named for
its own world size, are never copied as they are: `plan_rng_files` says which file each target rank
gets, from which source file.

Target rank `r` of M takes the state of source rank `r mod N` (N the source's RNG files; at M = 1
that is rank 0's, the main process's). Ranks the source had keep their own state, so resharding to
a multiple of N and back changes nothing, and a new rank gets a copy of an existing rank's. Copying
is sound because the Trainer seeds every process with the same `args.seed` (`set_seed`, no rank
offset) and every data-parallel rank draws as many numbers per step, so the ranks' states are
normally equal (the Trainer-written test fixture's two files hold equal states); a state copied from
another rank is one the run could have had.

The CUDA entry of a file saved by a distributed run holds the states of every device the process saw
(`get_rng_state_all`); a run resumed on other devices may log that it could not set them back, as
the Trainer does for any checkpoint moved between machines. The CPU, Python and NumPy states load.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

SINGLE = "rng_state.pth"
_NAME = re.compile(r"rng_state(?:_(\d+))?\.pth")


@dataclass(frozen=True, kw_only=True)
class RngCopy:
    """One RNG file of the output: `target` (a name in OUT) is a copy of `source` (a name in SRC)."""

    rank: int  # the target rank that loads it (0 for the one-process `rng_state.pth`)
    target: str
    source: str
    source_rank: int | None  # None: the source's one-process `rng_state.pth`


def is_rng_file(name: str) -> bool:
    """True for the Trainer's `rng_state.pth` and `rng_state_{i}.pth`."""
    return _NAME.fullmatch(name) is not None


def rank_file(rank: int) -> str:
    return f"rng_state_{rank}.pth"


def plan_rng_files(names: Iterable[str], world_size: int) -> tuple[RngCopy, ...]:
    """The RNG files a checkpoint resharded to `world_size` ranks gets from the source folder's `names`.

    `rng_state.pth` at 1 rank, else `rng_state_{r}.pth` for every target rank r, each from source rank
    `r mod N` (the N per-rank files in rank order; the one-process file counts as rank 0's when there
    are no per-rank files). No RNG file in `names`: nothing.
    """
    if world_size < 1:
        raise ValueError(f"world size must be at least 1, got {world_size}")
    ranked = sorted((int(m.group(1)), n) for n in names if (m := _NAME.fullmatch(n)) and m.group(1) is not None)
    sources: list[tuple[int | None, str]] = list(ranked) or ([(None, SINGLE)] if SINGLE in set(names) else [])
    if not sources:
        return ()
    if world_size == 1:
        rank, name = sources[0]
        return (RngCopy(rank=0, target=SINGLE, source=name, source_rank=rank),)
    return tuple(
        RngCopy(rank=r, target=rank_file(r), source=sources[r % len(sources)][1],
                source_rank=sources[r % len(sources)][0])
        for r in range(world_size)
    )


def describe(copies: Iterable[RngCopy]) -> str:
    """One line saying which RNG file each target rank got, e.g. 'rng_state.pth from source rank 0
    (rng_state_0.pth)' or 'rng_state_0..2.pth from source ranks 0, 1, 0 (rank r takes r mod 2)'."""
    copies = tuple(copies)
    if not copies:
        return "no Trainer RNG files in the source"
    if len(copies) == 1 and copies[0].target == SINGLE:
        c = copies[0]
        if c.source == SINGLE:
            return f"{SINGLE} carried over"
        return f"{SINGLE} from source rank {c.source_rank} ({c.source})"
    last = copies[-1].rank
    names = f"rng_state_0..{last}.pth" if last > 1 else "rng_state_0.pth, rng_state_1.pth"
    if all(c.source_rank is None for c in copies):
        return f"{names}, each a copy of the source's {SINGLE}"
    used = sorted({c.source_rank for c in copies if c.source_rank is not None})
    ranks = ", ".join(str(c.source_rank) for c in copies[:8]) + (", ..." if len(copies) > 8 else "")
    rule = f"rank r takes r mod {len(used)}" if used == list(range(len(used))) else "in rank order, repeating"
    return f"{names} from source ranks {ranks} ({rule})"
