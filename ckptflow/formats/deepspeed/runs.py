"""The byte runs that make a model's tensors out of the tensors a checkpoint saved.

Whatever the layout (data-parallel ZeRO, tensor-, expert- or pipeline-parallel), a reader describes
the full model as `ModelTensor`s: the name the model's own code uses (Hugging Face names for Hugging
Face models), the full shape, the dtype the values are stored in, and `Run`s: which elements of which
saved tensor land where in the full tensor, flat and row-major. The consolidate step plans over these
alone, so a new layout needs a reader and nothing else.

A source whose pieces are not contiguous in the full tensor (a row-parallel shard, split on its last
dimension) is described by strided runs: the shard's rows are back to back in the saved tensor and land
a full row apart, so one `Run` with `rows` and `stride` stands for all of them (a Llama-3-70B layer at
tensor-parallel degree 8 would otherwise need 65,536 runs for its two row-parallel tensors).
`check_coverage` proves the runs tile the tensor exactly.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from ckptflow.errors import CheckpointError
from ckptflow.formats.torch.tensorref import TensorRef


@dataclass(frozen=True, slots=True)
class Run:
    """`numel` elements of the saved tensor `ref` from its element `start`, landing at element `offset`
    of a full (flat, row-major) model tensor.

    With `rows` > 1 the elements land as that many rows of `numel // rows` elements, row i at
    `offset + i * stride` (a row-parallel shard: back to back in the saved tensor, a full row apart in
    the full tensor). The saved side is always one contiguous stretch, so `byte_range` is one read."""

    ref: TensorRef
    start: int
    numel: int
    offset: int
    rows: int = 1
    stride: int = 0

    def __post_init__(self) -> None:
        assert self.rows == 1 or (self.rows > 1 and self.numel > 0 and self.numel % self.rows == 0
                                  and self.stride >= self.numel // self.rows)

    @property
    def byte_range(self) -> tuple[int, int]:
        return self.ref.element_range(self.start, self.numel)

    @property
    def row(self) -> int:
        """Elements per row (all of them for a plain run)."""
        return self.numel // self.rows

    @property
    def end(self) -> int:
        """One past the last element of the full tensor this run fills."""
        return self.offset + (self.rows - 1) * self.stride + self.row

    def within(self, lo: int, hi: int) -> list[Run]:
        """The parts of this run that land in elements [lo, hi) of the full tensor, in order: plain runs
        for rows cut by the bounds, one strided run for the whole rows between them."""
        if self.rows == 1:
            a, b = max(lo, self.offset), min(hi, self.offset + self.numel)
            if a >= b:
                return []
            if (a, b) == (self.offset, self.offset + self.numel):
                return [self]
            return [Run(self.ref, self.start + a - self.offset, b - a, a)]
        row, stride = self.row, self.stride
        first = max(0, (lo - self.offset - row) // stride + 1)  # the first row ending after lo
        last = min(self.rows, -(-(hi - self.offset) // stride))  # one past the last row starting before hi
        out: list[Run] = []
        whole_from = first
        if first < last and self.offset + first * stride < lo:  # row `first` is cut at its start
            out += self._row(first).within(lo, hi)
            whole_from += 1
        whole_to = last
        if whole_to > whole_from and self.offset + (last - 1) * stride + row > hi:  # the last row is cut at its end
            whole_to -= 1
        if whole_to > whole_from:
            n = whole_to - whole_from
            out.append(Run(self.ref, self.start + whole_from * row, n * row, self.offset + whole_from * stride,
                           n, stride if n > 1 else 0))
        if whole_to < last and whole_to >= whole_from:
            out += self._row(whole_to).within(lo, hi)
        return out

    def plain(self) -> Iterator[Run]:
        """This run as plain runs, one per row."""
        if self.rows == 1:
            yield self
            return
        for i in range(self.rows):
            yield self._row(i)

    def moved(self, shift: int) -> Run:
        """This run landing `shift` elements further on."""
        return Run(self.ref, self.start, self.numel, self.offset + shift, self.rows, self.stride)

    def _row(self, i: int) -> Run:
        return Run(self.ref, self.start + i * self.row, self.row, self.offset + i * self.stride)


def contiguous(ref: TensorRef, name: str) -> TensorRef:
    """`ref`, which must be contiguous: checkpoints are read by byte range."""
    if not ref.is_contiguous:
        raise CheckpointError(
            f"{name}: its saved tensor in {ref.uri} is a strided view", file=ref.uri, tensor=name,
            hint="ckptflow reads contiguous tensors by byte range; re-save the checkpoint with DeepSpeed",
        )
    return ref


def whole_run(ref: TensorRef, name: str) -> Run:
    return Run(contiguous(ref, name), 0, ref.numel, 0)


def slice_runs(runs: Sequence[Run], start: int, numel: int, offset: int) -> tuple[Run, ...]:
    """The part of `runs` (which tile a tensor) that holds its elements [start, start + numel), moved to
    land at element `offset` of another tensor: an expert's rows of a stacked expert parameter, say."""
    return tuple(part.moved(offset - start) for run in sorted(runs, key=lambda r: r.offset)
                 for part in run.within(start, start + numel))


def plain_runs(runs: Sequence[Run]) -> list[Run]:
    """`runs` with every strided run written out row by row, sorted by where they land: for the few
    consumers that walk a tensor element by element (a tensor-parallel merge on reshard)."""
    return sorted((row for run in runs for row in run.plain()), key=lambda r: r.offset)


MAX_ROWS = 1 << 22  # rows of strided runs per tensor: a row-parallel 1T model has well under a million


def check_coverage(name: str, numel: int, runs: Sequence[Run]) -> None:
    """Runs must tile [0, numel) exactly: no gap (padding would leak in), no overlap, each within its
    saved tensor."""
    if all(run.rows == 1 for run in runs):
        pos = 0
        for run in sorted(runs, key=lambda r: r.offset):
            if run.offset != pos or run.numel <= 0 or run.start + run.numel > run.ref.numel:
                break
            pos += run.numel
        else:
            if pos == numel:
                return
    elif _strided_coverage(numel, runs):
        return
    raise CheckpointError(
        f"{name}: its saved pieces do not add up to its {numel} elements", tensor=name, expected=numel,
        hint="the checkpoint's partition metadata is inconsistent; run `ckptflow validate` on it",
    )


def _strided_coverage(numel: int, runs: Sequence[Run]) -> bool:
    """Whether runs, some strided, tile [0, numel): every row laid out and sorted (bounded: `MAX_ROWS`)."""
    if sum(run.rows for run in runs) > MAX_ROWS or sum(run.numel for run in runs) != numel:
        return False
    if any(run.numel <= 0 or run.start + run.numel > run.ref.numel for run in runs):
        return False
    starts = np.concatenate([run.offset + np.arange(run.rows, dtype=np.int64) * run.stride for run in runs])
    lengths = np.concatenate([np.full(run.rows, run.row, dtype=np.int64) for run in runs])
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], starts[order] + lengths[order]
    return bool(starts[0] == 0 and ends[-1] == numel and np.array_equal(starts[1:], ends[:-1]))
