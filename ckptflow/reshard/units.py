"""What a reshard plan is made of: the target ranks' units, and the plans of each parallel shape. Pure data.

A plan says, for every target rank, which source partition elements make its files (`RankUnit`,
`TargetFlat`, `FrozenPiece`); `DataParallelPlan` is one data-parallel ZeRO checkpoint at its target
shape (of a model-parallel checkpoint, one model-parallel rank's files), `ModelParallelPlan` one such
plan per model-parallel rank. The planners that build them are `reshard.data_parallel` and the axes
(`reshard.tensor_parallel`, ...); `reshard.plan.plan_reshard` picks one; `reshard.files` and
`reshard.run` write any of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptflow.formats.deepspeed.model import ZeroCheckpoint
from ckptflow.formats.deepspeed.partition import Copy
from ckptflow.formats.deepspeed.runs import Run
from ckptflow.reshard.shape import Shape


@dataclass(frozen=True, kw_only=True)
class TargetFlat:
    """One flat fp32 partition of a target rank (a param group; a sub-group under ZeRO-3).

    `numel` counts its elements including padding, `saved` those DeepSpeed saves (ZeRO-1/2 drop the
    tail padding); `copies` fill it from source partitions of param group `group`, zeros elsewhere.
    """

    group: int
    numel: int
    saved: int
    copies: tuple[Copy, ...]


@dataclass(frozen=True, kw_only=True)
class FrozenPiece:
    """A target rank's piece of a frozen ZeRO-3 parameter, copied from the source ranks' pieces."""

    name: str
    numel: int
    copies: tuple[Copy, ...]


@dataclass(frozen=True, kw_only=True)
class TensorFile:
    """A file of whole tensors (a dict, as torch.save writes one), each of its own storage filled from
    runs of source tensors: AutoEP's per-expert files, rebuilt from ZeRO-3 pieces."""

    name: str
    tensors: tuple[tuple[str, tuple[int, ...], tuple[Run, ...]], ...]  # key, shape, runs (their dtype the tensor's)


@dataclass(frozen=True, kw_only=True)
class RankUnit:
    """Everything one target rank's files need: an independent unit of work."""

    rank: int
    meta_rank: int  # the source rank whose per-rank scalars (step, loss scaler, buffers) it copies
    optim_file: str
    model_file: str | None
    flats: tuple[TargetFlat, ...]
    group_paddings: tuple[int, ...] = ()
    slice_mappings: tuple[tuple[tuple[str, int, int], ...], ...] = ()  # per group: (name, start, numel)
    frozen: tuple[FrozenPiece, ...] = ()
    read_bytes: int = 0  # source bytes this unit copies: what `run_unit` reports as progress
    write_bytes: int = 0  # storage bytes of its files (zeros included), about their size
    mp_rank: int = 0  # the model-parallel rank whose files these are
    tensor_files: tuple[TensorFile, ...] = ()  # files of whole tensors it writes too

    @property
    def files(self) -> tuple[str, ...]:
        return ((self.optim_file,) + ((self.model_file,) if self.model_file else ())
                + tuple(f.name for f in self.tensor_files))


@dataclass(frozen=True, kw_only=True)
class DataParallelPlan:
    """How to turn the data-parallel ZeRO checkpoint `index` into the same checkpoint at `world_size` ranks
    (of a model-parallel checkpoint: one model-parallel rank's files, `mp_rank` in its units)."""

    root: str
    tag: str
    stage: int
    precision: str
    optimizer: str
    source_world_size: int
    world_size: int
    flat_shapes: tuple[tuple[tuple[str, tuple[int, ...]], ...], ...]  # `param_shapes`: params of each flat
    param_alignment_paddings: tuple[tuple[int, ...], ...]
    module: tuple[tuple[int, tuple[tuple[str, int], ...]], ...]  # ZeRO-1/2: 16-bit flat numel, param offsets
    units: tuple[RankUnit, ...]
    index: ZeroCheckpoint = field(repr=False, compare=False)
    carried: tuple[str, ...] = ()  # tag-folder files written as they are (none for data-parallel ZeRO)
    # ZeRO-1/2 module copies not saved whole in the source (a tensor-parallel merge): name -> runs of the
    # full tensor; the module file's view of that parameter is rebuilt from them, in the full shape.
    module_runs: Mapping[str, tuple[Run, ...]] = field(default_factory=dict, repr=False, compare=False)
    group_ep: tuple[int, ...] = ()  # per source param group: its expert-parallel degree (1: dense)
    source_optimizer: str = ""  # the optimizer that laid the source out, when not `optimizer` (a stage change)
    source_shape: Shape | None = None  # the whole checkpoint's shapes, set by `plan.plan_reshard`
    shape: Shape | None = None

    @property
    def src_optimizer(self) -> str:
        """The optimizer kind that wrote the source (`partition.ZERO`, `BF16`, `ZERO3`)."""
        return self.source_optimizer or self.optimizer

    def ep(self, group: int) -> int:
        """The expert-parallel degree of source param group `group` (1: partitioned over every rank)."""
        return self.group_ep[group] if group < len(self.group_ep) else 1

    @property
    def files(self) -> tuple[str, ...]:
        return tuple(name for unit in self.units for name in unit.files) + self.carried

    def part(self, unit: RankUnit) -> DataParallelPlan:
        """The data-parallel plan `unit` belongs to: this one."""
        return self

    @property
    def read_bytes(self) -> int:
        return sum(u.read_bytes for u in self.units)

    @property
    def write_bytes(self) -> int:
        return sum(u.write_bytes for u in self.units)


@dataclass(frozen=True, kw_only=True)
class ModelParallelPlan:
    """How to turn a model-parallel checkpoint into the same one at `world_size` data-parallel ranks:
    one `DataParallelPlan` per model-parallel rank (`parts`), their units side by side (`units`), and the
    tag-folder files that stay as they are (`carried`: PipelineModule layer files)."""

    root: str
    tag: str
    stage: int
    precision: str
    source_world_size: int
    world_size: int
    parts: tuple[DataParallelPlan, ...]
    carried: tuple[str, ...]
    index: Any = field(repr=False, compare=False)  # the ModelParallelCheckpoint
    source_shape: Shape | None = None
    shape: Shape | None = None
    padded_vocab: int | None = None  # Megatron-style: the vocabulary's padded rows at the target, padded again
    notes: tuple[str, ...] = ()  # what the user should know of the output (a padded vocabulary kept)

    @property
    def units(self) -> tuple[RankUnit, ...]:
        return tuple(unit for part in self.parts for unit in part.units)

    @property
    def files(self) -> tuple[str, ...]:
        return tuple(name for part in self.parts for name in part.files) + self.carried

    @property
    def read_bytes(self) -> int:
        return sum(part.read_bytes for part in self.parts)

    @property
    def write_bytes(self) -> int:
        return sum(part.write_bytes for part in self.parts)

    def part(self, unit: RankUnit) -> DataParallelPlan:
        """The data-parallel plan of `unit`'s model-parallel rank."""
        return self.parts[unit.mp_rank]


# The plan of any reshard: what `reshard.run` writes, one `RankUnit` at a time, each through the
# data-parallel plan it belongs to (`plan.part(unit)`).
ReshardPlan = DataParallelPlan | ModelParallelPlan


__all__ = ["DataParallelPlan", "FrozenPiece", "ModelParallelPlan", "RankUnit", "ReshardPlan", "TargetFlat",
           "TensorFile"]
