"""Validation: is a partitioned checkpoint complete, readable and consistent?

Every problem is collected into one report, cheapest checks first: the `latest` pointer, the file
set the world size implies, each file's archive and pickle, the metadata across ranks, the partition
arithmetic, the optimizer steps across ranks (all of them the reader's: `formats.deepspeed`), and with
`deep=True` a bounded-memory scan of the fp32 weights and optimizer moments for NaN and Inf. The report
also says what the trainer's client state holds (`formats.deepspeed.client_state`): its keys and the
classes they name, read as inert records, never imported or run (`strict_pickle=True` refuses them).
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field
from typing import Any

from ckptflow.formats.casts import count_non_finite
from ckptflow.formats.deepspeed import read, zero_index
from ckptflow.formats.deepspeed.client_state import ClientState
from ckptflow.formats.deepspeed.inspection import Problem
from ckptflow.formats.deepspeed.model import Partitioned, ZeroCheckpoint
from ckptflow.formats.deepspeed.names import ACCELERATE_FILE_RE
from ckptflow.formats.deepspeed.output_dir import Choice
from ckptflow.formats.deepspeed.partition import zero3_real
from ckptflow.formats.deepspeed.readers.model_parallel import ModelParallelCheckpoint, Replica
from ckptflow.formats.deepspeed.runs import plain_runs
from ckptflow.formats.torch.tensorref import TensorRef
from ckptflow.plumbing.progress import Progress, Tally
from ckptflow.plumbing.ranges import read_ranges
from ckptflow.plumbing.storage import open_fs


@dataclass(frozen=True)
class ValidationReport:
    """What `validate` found. `ok` is True when there is no problem."""

    source: str
    root: str | None
    tag: str | None
    problems: tuple[Problem, ...]
    index: Partitioned | None = field(default=None, repr=False, compare=False)
    deep: bool = False
    client_state: ClientState = field(default_factory=ClientState)  # rank 0's, read as inert records
    choice: Choice | None = None  # a Trainer output_dir's checkpoint-N folder taken, and those skipped
    accelerate_files: tuple[str, ...] = ()  # Accelerate's files beside the tag folder, by name (never opened)

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
            "client_state": self.client_state.to_dict(),
            "output_dir": self.choice.to_dict() if self.choice is not None else None,
            "accelerate_files": list(self.accelerate_files),
            "problems": [p.to_dict() for p in self.problems],
        }


def validate(source: str, *, tag: str | None = None, deep: bool = False, progress: Progress | None = None,
             strict_pickle: bool = False) -> ValidationReport:
    """Check the checkpoint at `source` (a folder holding `latest`, or a tag folder; any fsspec URI).

    Returns a report listing every problem found; raises only for errors of the caller's own making
    (e.g. an unsafe `tag` argument is reported, not raised). With `strict_pickle`, an object of any
    class outside DeepSpeed's allow-list (client state included) is a problem (`unsafe-pickle`).
    """
    reading = read(source, tag, strict_pickle=strict_pickle)
    index, problems, where = reading.index, reading.problems, reading.where
    root, resolved = where if where else (None, None)
    zero = zero_index(index)  # a data-parallel index, or the one under an expert-parallel checkpoint
    if zero is not None:
        if deep and not problems:
            problems = problems + _scan_finite(zero, progress)
    elif isinstance(index, ModelParallelCheckpoint):
        problems = problems + _check_model_parallel_steps(index)
        if deep and not problems:
            problems = problems + _scan_model(index, progress) + _compare_replicas(index.replicas, index, progress)
    elif index is not None and deep and not problems:
        problems = problems + _scan_model(index, progress)
    return ValidationReport(source, root, resolved, tuple(problems), index, deep, reading.client_state, reading.choice,
                            accelerate_files(root) if root else ())


def accelerate_files(root: str) -> tuple[str, ...]:
    """The names of Accelerate's own files in `root` (`names.ACCELERATE_FILE_RE`), sorted; listed, not opened."""
    fs, path = open_fs(root)
    try:
        listed = fs.ls(path, detail=False)
    except OSError:
        return ()
    names = (posixpath.basename(str(entry).rstrip("/")) for entry in listed)
    return tuple(sorted(name for name in names if ACCELERATE_FILE_RE.fullmatch(name)))


def _check_model_parallel_steps(index: ModelParallelCheckpoint) -> list[Problem]:
    """Every model-parallel rank at the same optimizer step (the reader checks the data-parallel ranks
    within each: `index.read_zero`)."""
    problems = []
    steps = {mp: index.rank_step(mp) for mp in range(index.mp_world_size)}
    first = steps[0]
    for mp, step in steps.items():
        if step is not None and first is not None and step != first:
            problems.append(Problem(
                "ranks-disagree", f"{index.rank_label(mp)}'s optimizer is at step {step:g} but {index.rank_label(0)}'s "
                f"is at {first:g}; the tag folder mixes files from different saves: re-copy it from one save",
                index.rank_model_file(mp)))
    return problems


def replica_problems(index: ModelParallelCheckpoint, progress: Progress | None = None) -> list[Problem]:
    """`index.replicas` compared (`_compare_replicas`): what `validate --deep` reports of them, and what a
    tensor-parallel change that keeps one copy of a replicated parameter checks first."""
    return _compare_replicas(index.replicas, index, progress)


def _compare_replicas(replicas: tuple[Replica, ...], index: ModelParallelCheckpoint,
                      progress: Progress | None) -> list[Problem]:
    """Blocks held by two model-parallel ranks (replicated parameters, a pipeline's tied weight) must hold
    the same bytes: both copies read in bounded chunks and compared. One problem per tensor."""
    tally = Tally(2 * sum(r.numel * r.ref.itemsize for rep in replicas for r in rep.runs), progress)
    differ: dict[str, tuple[int, int, int]] = {}
    for rep in replicas:
        if rep.name in differ:
            continue
        segments = _aligned(rep.runs, rep.other)
        batch: list[tuple[int, Any, int, Any, int, int]] = []
        size = 0
        for seg in segments + [None]:
            if seg is not None:
                batch.append(seg)
                size += seg[5] * seg[1].itemsize
            if batch and (seg is None or size >= 64 << 20):
                ranges = [(ref.uri, *ref.element_range(start, n)) for _, ref, start, _, _, n in batch]
                ranges += [(ref.uri, *ref.element_range(start, n)) for _, _, _, ref, start, n in batch]
                blobs = read_ranges(ranges)
                half = len(batch)
                for k, (offset, _, _, _, _, _) in enumerate(batch):
                    if blobs[k] != blobs[half + k]:
                        differ[rep.name] = (rep.mp_rank, rep.other_mp_rank, offset)
                        break
                tally.add("replicas", 2 * size)
                batch, size = [], 0
                if rep.name in differ:
                    break
    return [Problem("replicas-differ",
                    f"tensor {name}: {index.rank_label(a)} and {index.rank_label(b)} hold different values for the "
                    f"same block (from element {offset} of the full tensor), which they must hold identically; the "
                    "ranks drifted apart or a file is damaged: use an earlier checkpoint", index.tag_uri)
            for name, (a, b, offset) in differ.items()]


def _aligned(runs: tuple[Any, ...], other: tuple[Any, ...]) -> list[tuple[int, Any, int, Any, int, int]]:
    """(full offset, ref, start, other ref, other start, numel) segments where two run lists that cover
    the same elements of a tensor line up."""
    a, b = plain_runs(runs), plain_runs(other)
    out, i, j, ia, jb = [], 0, 0, 0, 0  # ia / jb: elements of a[i] / b[j] already used
    while i < len(a) and j < len(b):
        ra, rb = a[i], b[j]
        pa, pb = ra.offset + ia, rb.offset + jb
        if pa != pb:
            raise ValueError(f"replica runs of {ra.ref.uri} and {rb.ref.uri} do not line up")
        n = min(ra.numel - ia, rb.numel - jb)
        out.append((pa, ra.ref, ra.start + ia, rb.ref, rb.start + jb, n))
        ia, jb = ia + n, jb + n
        if ia == ra.numel:
            i, ia = i + 1, 0
        if jb == rb.numel:
            j, jb = j + 1, 0
    return out


def _scan_model(index: Partitioned, progress: Progress | None) -> list[Problem]:
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


__all__ = ["ValidationReport", "replica_problems", "validate"]
