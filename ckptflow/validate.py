"""Validation: is a partitioned checkpoint complete, readable and consistent?

Every problem is collected into one report, cheapest checks first: the `latest` pointer, the file
set the world size implies, each file's archive and pickle, the metadata across ranks, the partition
arithmetic, the optimizer steps across ranks (all of them the reader's: `formats.deepspeed`), and with `deep=True` a bounded-memory scan of the fp32 weights and optimizer moments for
NaN and Inf.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ckptflow.formats.deepspeed.checkpoint import inspect
from ckptflow.formats.deepspeed.index import Problem, ZeroCheckpoint
from ckptflow.formats.deepspeed.tensors import ModelSource
from ckptflow.formats.casts import count_non_finite
from ckptflow.formats.deepspeed.layout import zero3_real
from ckptflow.formats.torchzip import TensorRef
from ckptflow.plumbing.progress import Progress, Tally
from ckptflow.plumbing.storage import read_ranges


@dataclass(frozen=True)
class ValidationReport:
    """What `validate` found. `ok` is True when there is no problem."""

    source: str
    root: str | None
    tag: str | None
    problems: tuple[Problem, ...]
    index: ModelSource | None = field(default=None, repr=False, compare=False)
    deep: bool = False

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> dict[str, Any]:
        """What the checkpoint is: layout, degrees, stage, precision, step, sizes ({} when unreadable)."""
        return self.index.summary() if self.index is not None else {}

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "root": self.root,
            "tag": self.tag,
            "valid": self.ok,
            "deep": self.deep,
            "checkpoint": self.summary(),
            "problems": [p.to_dict() for p in self.problems],
        }


def validate(source: str, *, tag: str | None = None, deep: bool = False, progress: Progress | None = None) -> ValidationReport:
    """Check the checkpoint at `source` (a folder holding `latest`, or a tag folder; any fsspec URI).

    Returns a report listing every problem found; raises only for errors of the caller's own making
    (e.g. an unsafe `tag` argument is reported, not raised).
    """
    index, problems, where = inspect(source, tag)
    root, resolved = where if where else (None, None)
    if isinstance(index, ZeroCheckpoint):
        if deep and not problems:
            problems = problems + _scan_finite(index, progress)
    elif index is not None and deep and not problems:
        problems = problems + _scan_model(index, progress)
    return ValidationReport(source, root, resolved, tuple(problems), index, deep)


def _scan_model(index: ModelSource, progress: Progress | None) -> list[Problem]:
    """NaN/Inf in the weights of any layout: every trained and frozen tensor's runs."""
    jobs = [(t.name, "weights", r.ref, r.start, r.numel, r.ref.uri) for t in index.model_tensors() if t.kind != "buffer"
            for r in t.runs]
    return _scan(jobs, progress)


def _scan_finite(index: ZeroCheckpoint, progress: Progress | None) -> list[Problem]:
    """NaN/Inf in any parameter's fp32 master weights or optimizer moments, one problem per tensor,
    read in bounded chunks and checked on the bits (no torch). Padding is never read: ZeRO-3 leaves it
    uninitialized, and garbage there is no sign of a diverged run."""
    jobs: list[tuple[str, str, TensorRef, int, int, str]] = []  # (name, what, tensor, first, count, file)
    for param in index.params:
        for frag in param.fragments:
            part = index.partitions[frag.rank][frag.group]
            file = index.files[frag.rank].optim
            jobs.append((param.name, "weights", part.fp32, frag.offset, frag.numel, file))
            for key in ("exp_avg", "exp_avg_sq"):
                if isinstance(part.state.get(key), TensorRef):
                    jobs.append((param.name, key, part.state[key], frag.offset, frag.numel, file))
        for rank, piece in enumerate(param.frozen_pieces):
            real = zero3_real(param.numel, index.world_size, rank) if index.stage == 3 else param.numel
            jobs.append((param.name, "weights", piece, 0, min(real, piece.numel),
                         index.files[rank].model or index.model_file()))
    return _scan(jobs, progress)


def _scan(jobs: list[tuple[str, str, TensorRef, int, int, str]], progress: Progress | None) -> list[Problem]:
    """Read each job's elements (name, what, tensor, first, count, file) in bounded chunks; one problem
    per tensor and kind that holds NaN or Inf."""
    tally = Tally(sum(count * ref.itemsize for _, _, ref, _, count, _ in jobs), progress)
    bad: dict[tuple[str, str], tuple[int, str]] = {}
    step = 64 << 20
    for i, (name, what, ref, first, count, file) in enumerate(jobs):
        if (name, what) in bad:
            continue
        per = max(1, step // ref.itemsize)
        for lo in range(0, count, per):
            n = min(per, count - lo)
            start, end = ref.element_range(first + lo, n)
            found = count_non_finite(read_ranges([(ref.uri, start, end)])[0], ref.dtype)
            tally.part(i)((lo + n) * ref.itemsize, count * ref.itemsize)
            if found:
                bad[(name, what)] = (found, file)
                break
    problems = []
    for (name, what), (count, file) in bad.items():
        label = "fp32 master weights" if what == "weights" else f"optimizer state {what}"
        problems.append(Problem(
            "non-finite",
            f"tensor {name}: its {label} in {file} hold {count} NaN/Inf value(s) in the first bad chunk; the run "
            "diverged before this save: use an earlier checkpoint",
            file,
        ))
    return problems


__all__ = ["ValidationReport", "validate"]
