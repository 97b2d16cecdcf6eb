"""The model a checkpoint holds, as tensors and the byte runs that make them: what every reader gives.

Whatever the layout (data-parallel ZeRO, tensor-, expert- or pipeline-parallel), a reader describes
the full model as `ModelTensor`s: the name the model's own code uses (Hugging Face names for Hugging
Face models), the full shape, the dtype the values are stored in, and `Run`s: which elements of which
saved tensor land where in the full tensor, flat and row-major. The consolidate step plans over these
alone, so a new layout needs a reader and nothing else.

A source whose pieces are not contiguous in the full tensor (a column-parallel shard) is described by
one run per contiguous stretch; `check_coverage` proves the runs tile the tensor exactly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ckptflow.errors import CheckpointError
from ckptflow.formats.torchzip import TensorRef
from ckptflow.plumbing.sizes import element_count


@dataclass(frozen=True, slots=True)  # a split model has one per contiguous stretch: millions of them
class Run:
    """`numel` elements of the saved tensor `ref` from its element `start`, landing at element `offset`
    of a full (flat, row-major) model tensor."""

    ref: TensorRef
    start: int
    numel: int
    offset: int

    @property
    def byte_range(self) -> tuple[int, int]:
        return self.ref.element_range(self.start, self.numel)


@dataclass(frozen=True)
class ModelTensor:
    """One tensor of the full model: its name and shape, the dtype its runs are stored in (fp32 masters
    for trained parameters, the module's dtype for frozen ones, a buffer's own dtype), and its runs."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    kind: str  # "param", "frozen" or "buffer"
    runs: tuple[Run, ...]

    @property
    def numel(self) -> int:
        return element_count(self.shape)


class ModelSource(Protocol):
    """What the consolidate step needs of a checkpoint index, whatever its layout."""

    root: str
    tag: str
    step: int
    stage: int
    world_size: int
    precision: str
    ds_version: str

    @property
    def tied(self) -> Mapping[str, str]: ...

    @property
    def layout(self) -> str: ...

    def model_tensors(self) -> tuple[ModelTensor, ...]: ...

    def summary(self) -> dict[str, Any]: ...


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
    out = []
    for run in sorted(runs, key=lambda r: r.offset):
        lo, hi = max(start, run.offset), min(start + numel, run.offset + run.numel)
        if lo < hi:
            out.append(Run(run.ref, run.start + (lo - run.offset), hi - lo, offset + (lo - start)))
    return tuple(out)


def check_coverage(name: str, numel: int, runs: Sequence[Run]) -> None:
    """Runs must tile [0, numel) exactly: no gap (padding would leak in), no overlap."""
    pos = 0
    for run in sorted(runs, key=lambda r: r.offset):
        if run.offset != pos or run.numel <= 0 or run.start + run.numel > run.ref.numel:
            break
        pos += run.numel
    else:
        if pos == numel:
            return
    raise CheckpointError(
        f"{name}: its saved pieces do not add up to its {numel} elements", tensor=name, expected=numel,
        hint="the checkpoint's partition metadata is inconsistent; run `ckptflow validate` on it",
    )
