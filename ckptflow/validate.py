"""Validation: is a partitioned checkpoint complete, readable and consistent?

Every problem is collected into one report, cheapest checks first: the `latest` pointer, the file
set the world size implies, each file's archive and pickle, the metadata across ranks, the partition
arithmetic, and with `deep=True` a bounded-memory scan of the fp32 weights and optimizer moments for
NaN and Inf.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ckptflow.errors import CkptflowError
from ckptflow.torchzip import TensorRef, iter_chunks, read_elements, read_scalar
from ckptflow.zero import Problem, ZeroCheckpoint, inspect

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class ValidationReport:
    """What `validate` found. `ok` is True when there is no problem."""

    source: str
    root: str | None
    tag: str | None
    problems: tuple[Problem, ...]
    index: ZeroCheckpoint | None = field(default=None, repr=False, compare=False)
    deep: bool = False

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> dict[str, Any]:
        ix = self.index
        if ix is None:
            return {}
        return {
            "stage": ix.stage,
            "world_size": ix.world_size,
            "precision": ix.precision,
            "step": ix.step,
            "ds_version": ix.ds_version,
            "params": len(ix.params),
            "numel": ix.numel,
            "frozen": sum(p.frozen for p in ix.params),
            "tied": len(ix.tied),
            "buffers": len(ix.buffers),
            "param_groups": len(ix.groups),
        }

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

    def render(self, console: Any) -> None:
        """Print the report on a rich console: a summary line, then one line per problem."""
        if self.ok:
            s = self.summary()
            console.print(
                f"[green]valid[/green] {self.root}/{self.tag}: ZeRO-{s['stage']}, {s['world_size']} ranks, "
                f"{s['precision']}, step {s['step']}, {s['params']} params ({s['numel']:,} elements, "
                f"{s['frozen']} frozen, {s['tied']} tied), {s['buffers']} buffers, {s['param_groups']} param groups"
                + (", no NaN/Inf" if self.deep else ""),
                soft_wrap=True,
            )
            return
        where = f"{self.root}/{self.tag}" if self.tag else self.source
        console.print(f"[red]invalid[/red] {where}: {len(self.problems)} problem(s)")
        for p in self.problems:
            console.print(f"  [red]{p.code}[/red]: {p.message}", soft_wrap=True)


def validate(source: str, *, tag: str | None = None, deep: bool = False, progress: Progress | None = None) -> ValidationReport:
    """Check the checkpoint at `source` (a folder holding `latest`, or a tag folder; any fsspec URI).

    Returns a report listing every problem found; raises only for errors of the caller's own making
    (e.g. an unsafe `tag` argument is reported, not raised).
    """
    index, problems, where = inspect(source, tag)
    root, resolved = where if where else (None, None)
    if index is not None:
        problems = problems + _check_optimizer_steps(index)
        if deep and not problems:
            problems = problems + _scan_finite(index, progress)
    return ValidationReport(source, root, resolved, tuple(problems), index, deep)


def _check_optimizer_steps(index: ZeroCheckpoint) -> list[Problem]:
    """Every rank's optimizer must be at the same step (4 bytes read per rank and group)."""
    problems = []
    steps: dict[int, float] = {}
    for rank, parts in enumerate(index.partitions):
        for part in parts:
            step = part.state.get("step")
            try:
                if isinstance(step, TensorRef):
                    step = float(read_scalar(step))
            except (CkptflowError, OSError, ValueError) as exc:
                problems.append(Problem("unreadable-file", f"rank {rank}: cannot read the optimizer step ({exc})",
                                        index.files[rank].optim, rank))
                break
            if isinstance(step, (int, float)):
                steps.setdefault(rank, float(step))
                break
    if steps and len(set(steps.values())) > 1:
        first = steps[min(steps)]
        for rank, value in steps.items():
            if value != first:
                problems.append(Problem(
                    "ranks-disagree",
                    f"rank {rank}'s optimizer in {index.files[rank].optim} is at step {value:g} but rank 0's is at "
                    f"{first:g}; the tag folder mixes files from different saves: re-copy it from one save",
                    index.files[rank].optim, rank,
                ))
    return problems


def _scan_finite(index: ZeroCheckpoint, progress: Progress | None) -> list[Problem]:
    """NaN/Inf in any parameter's fp32 master weights or optimizer moments, one problem per tensor."""
    import torch

    jobs = []
    for param in index.params:
        for frag in param.fragments:
            part = index.partitions[frag.rank][frag.group]
            jobs.append((param.name, "weights", frag, part.fp32, index.files[frag.rank].optim))
            for key in ("exp_avg", "exp_avg_sq"):
                if isinstance(part.state.get(key), TensorRef):
                    jobs.append((param.name, key, frag, part.state[key], index.files[frag.rank].optim))
        for rank, piece in enumerate(param.frozen_pieces):
            jobs.append((param.name, "weights", None, piece, (index.files[rank].model or index.model_file())))
    total = sum((f.numel if f else ref.numel) * ref.itemsize for _, _, f, ref, _ in jobs)
    done = 0
    bad: dict[tuple[str, str], tuple[int, str]] = {}
    chunk = 64 << 20
    for name, what, frag, ref, file in jobs:
        if (name, what) in bad:
            continue
        if frag is None:
            chunks = iter_chunks(ref, chunk)
        else:
            step = max(1, chunk // ref.itemsize)
            chunks = (
                read_elements(ref, frag.offset + s, min(step, frag.numel - s)) for s in range(0, frag.numel, step)
            )
        for values in chunks:
            done += values.numel() * ref.itemsize
            finite = torch.isfinite(values)
            if not bool(finite.all()):
                count = int((~finite).sum())
                bad[(name, what)] = (count, file)
                break
            if progress:
                progress(done, total)
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
