"""Target ZeRO-1/2 flat groups filled from any source: what the planners of every axis share. Pure.

A planner that changes the tensor parallelism, the pipeline stages or the ZeRO stage knows where each
element of a full parameter sits in the source (tensor-parallel runs, pipeline stages' fragments,
ZeRO-3 pieces): a `Copies` function. `zero12_flats` lays the target's param groups out as
`DeepSpeedZeroOptimizer` (or `BF16_Optimizer`) does at the target world size
(`formats.deepspeed.partition.zero12_layout`) and asks that function for the copies of every target
partition; `fragment_copies` is such a function over a data-parallel index's fragments, `ModelRuns`
one over a model-parallel checkpoint's full tensors (every tensor-parallel rank or pipeline stage as
virtual data-parallel ranks). `sharded_zero12_flats` is the same layout with groups held apart by
expert-parallel ranks (`experts._plan`), each over its expert data-parallel group. `frozen_copies`
says where a frozen parameter's elements are (rank 0's whole tensor at ZeRO-1/2, the ranks' pieces at
ZeRO-3).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ckptflow.errors import UnsupportedCheckpointError
from ckptflow.formats.deepspeed.config import builds_bf16_optimizer
from ckptflow.formats.deepspeed.model import Fragment, Param
from ckptflow.formats.deepspeed.partition import (
    BF16,
    ZERO,
    ZERO3,
    Copy,
    original_order,
    param_alignment,
    piece_offsets,
    recorded_slices,
    round_robin_order,
    zero3_piece,
    zero3_real,
    zero3_sub_groups,
    zero12_layout,
)
from ckptflow.formats.deepspeed.readers.model_parallel import ModelParallelCheckpoint
from ckptflow.formats.deepspeed.runs import Run
from ckptflow.formats.torch.tensorref import DTYPE_SIZES, cast_view
from ckptflow.reshard.units import TargetFlat

# The copies that bring elements [first, last) of parameter `name` (of source param group `group`) to
# `dst` onwards of a target partition.
Copies = Callable[[str, int, int, int, int], Iterable[Copy]]


def target_optimizer(source: str, source_stage: int, stage: int, config: Any) -> str:
    """The optimizer DeepSpeed builds at ZeRO `stage` for the run whose optimizer `source` (`partition.ZERO`,
    `BF16`, `ZERO3`) saved it at ZeRO `source_stage` with the recorded `ds_config` `config`: the ZeRO-3
    optimizer at ZeRO-3; at ZeRO-1 `BF16_Optimizer` where the config gets it there (bf16 weights, fp32
    gradient accumulation: `config.builds_bf16_optimizer`), whichever optimizer wrote the source, and
    where the source's own was one at ZeRO-1; `DeepSpeedZeroOptimizer` otherwise."""
    if stage == 3:
        return ZERO3
    if stage == 1 and (builds_bf16_optimizer(config) or (source == BF16 and source_stage == 1)):
        return BF16
    return ZERO


def cast_runs(runs: Sequence[Run], dtype: str) -> tuple[Run, ...]:
    """fp32 master runs read as the module's `dtype`, cast on the way as DeepSpeed casts the masters into
    the module after every step (round to nearest even; fp32 training: the masters themselves)."""
    return tuple(runs) if dtype == "float32" else tuple(replace(r, ref=cast_view(r.ref, dtype)) for r in runs)


def append_copy(copies: list[Copy], c: Copy) -> None:
    """Append `c`, joined to the last copy when both are plain runs contiguous on both sides."""
    last = copies[-1] if copies else None
    if (last is not None and last.rows == c.rows == 1 and (last.src_rank, last.src_flat) == (c.src_rank, c.src_flat)
            and last.src_offset + last.numel == c.src_offset and last.dst_offset + last.numel == c.dst_offset):
        copies[-1] = replace(last, numel=last.numel + c.numel)
    else:
        copies.append(c)


def fragment_copies(fragments: Sequence[Fragment], first: int, last: int, dst: int,
                    starts: Sequence[int] | None = None) -> list[Copy]:
    """Copies of parameter elements [first, last) to `dst` onwards, out of the source ranks' flat
    partitions that hold them (`fragments`: the parameter's, in parameter order; `starts`, their
    `param_offset`s, lets it skip to the first one that matters: a 1024-rank parameter has 1024)."""
    out: list[Copy] = []
    i = max(0, bisect.bisect_right(starts, first) - 1) if starts is not None else 0
    for j in range(i, len(fragments)):
        f = fragments[j]
        if f.param_offset >= last:
            break
        a, b = max(first, f.param_offset), min(last, f.param_offset + f.numel)
        if a < b:
            append_copy(out, Copy(src_rank=f.rank, src_flat=f.group, src_offset=f.offset + a - f.param_offset,
                                  dst_offset=dst + a - first, numel=b - a))
    return out


def frozen_copies(param: Param, source_stage: int, source_ws: int, lo: int, hi: int, dst: int) -> list[Copy]:
    """Copies of frozen `param`'s elements [lo, hi): from rank 0's whole tensor (ZeRO-1/2) or from the
    ranks' pieces (ZeRO-3); `src_flat` -1 names the frozen pieces (`Param.frozen_pieces`)."""
    if source_stage != 3:
        return [Copy(src_rank=0, src_flat=-1, src_offset=lo, dst_offset=dst, numel=hi - lo)] if lo < hi else []
    piece = zero3_piece(param.numel, source_ws)
    out = []
    for r in range(lo // piece, -(-hi // piece)) if lo < hi else ():
        a, b = max(lo, r * piece), min(hi, (r + 1) * piece)
        out.append(Copy(src_rank=r, src_flat=-1, src_offset=a - r * piece, dst_offset=dst + a - lo, numel=b - a))
    return out


def _partitions_of(index: ModelParallelCheckpoint, stage: int | None = None
                   ) -> dict[tuple[str, str, int], tuple[int, int]]:
    """Each fp32 partition tensor -> (virtual rank, param group): the ranks' partitions numbered on, as
    `tensor_parallel` joins them (a ZeRO-0 rank's, `stage.zero0_partitioned`, may repeat a tensor: the
    first holds it; with `stage`, that pipeline stage's ranks first: a ZeRO-0 pipeline's tied module is
    every stage's master, read from one layer file, and each stage's optimizer state its own)."""
    bases = list(itertools.accumulate((len(rank.partitions) for rank in index.ranks), initial=0))
    order = sorted(range(len(index.ranks)), key=lambda mp: stage is None or mp // max(index.tp, 1) != stage)
    out: dict[tuple[str, str, int], tuple[int, int]] = {}
    for mp in order:
        for d, parts in enumerate(index.ranks[mp].partitions):
            for part in parts:
                out.setdefault((part.fp32.uri, part.fp32.key, part.fp32.storage_offset), (bases[mp] + d, part.group))
    return out


class ModelRuns:
    """A full parameter's fp32 runs, by element, as copies out of the virtual ranks' partitions. A
    row-parallel shard's rows stay one strided run, and become strided copies: the writer reads them
    as one range and places them a full row apart (`formats.torch.pickler.Span`). `stages`: the source
    stage whose copy of a tied parameter is read (`ModelParallelCheckpoint.stage_copies`; by default, and
    for any other parameter, the lowest stage's)."""

    def __init__(self, index: ModelParallelCheckpoint, stages: Mapping[str, int] | None = None) -> None:
        self.stages: Mapping[str, int] = dict(stages or {})
        self.sources = _partitions_of(index)
        self.runs = {t.name: t.runs for t in index.tensors}
        self.own: dict[str, Mapping[tuple[str, str, int], tuple[int, int]]] = {}  # a stage copy's: its stage first
        by_stage: dict[int, Mapping[tuple[str, str, int], tuple[int, int]]] = {}
        for name, stage in self.stages.items():
            copy = index.stage_copies.get((name, stage))
            if copy is not None:
                self.runs[name] = copy.runs
                if stage not in by_stage:
                    by_stage[stage] = _partitions_of(index, stage)
                self.own[name] = by_stage[stage]
        # The furthest element each run up to this one reaches: strided runs interleave, so a window
        # [first, last) starts its search at the first run reaching past `first`.
        self.reach = {name: list(itertools.accumulate((r.end for r in runs), max)) for name, runs in self.runs.items()}

    def copies(self, name: str, group: int, first: int, last: int, dst: int) -> list[Copy]:
        """Copies of elements [first, last) of parameter `name` to `dst` onwards of a target flat, in
        the order of the parameter's runs."""
        runs = self.runs[name]
        out: list[Copy] = []
        for run in runs[bisect.bisect_right(self.reach[name], first):]:
            if run.offset >= last:
                break
            for part in run.within(first, last):
                rank, g = self.own.get(name, self.sources)[(part.ref.uri, part.ref.key, part.ref.storage_offset)]
                if g != group:
                    raise UnsupportedCheckpointError(
                        f"{name}: its tensor-parallel shards sit in different param groups")
                append_copy(out, Copy(src_rank=rank, src_flat=g, src_offset=part.start,
                                  dst_offset=dst + part.offset - first, numel=part.numel, rows=part.rows,
                                  stride=part.stride))
        return out


@dataclass(frozen=True, kw_only=True)
class Zero12Flats:
    """A checkpoint's ZeRO-1/2 param groups at a world size: per target rank its flats, group paddings
    and `param_slice_mappings`; per group its parameter shapes, alignment paddings and the 16-bit flat
    buffer the module's tensors view (numel, each parameter's offset)."""

    flats: tuple[tuple[TargetFlat, ...], ...]
    paddings: tuple[tuple[int, ...], ...]
    slices: tuple[tuple[tuple[tuple[str, int, int], ...], ...], ...]
    shapes: tuple[tuple[tuple[str, tuple[int, ...]], ...], ...]
    param_paddings: tuple[tuple[int, ...], ...]
    module: tuple[tuple[int, tuple[tuple[str, int], ...]], ...]


def zero12_flats(groups: Sequence[Sequence[Param]], world_size: int, copies: Copies, *, aligned: bool,
                 bf16: bool, round_robin: bool = False) -> Zero12Flats:
    """`groups` (each its parameters in the optimizer's order) laid out at `world_size` ranks, each
    target partition filled by `copies`. `aligned`: `zero_optimization.parameter_alignment`; `bf16`:
    the layout of `BF16_Optimizer` (no per-parameter padding); `round_robin`:
    `zero_optimization.round_robin_gradients`, each group flattened in `round_robin_order` (not with
    BF16_Optimizer, which ignores it), its `param_slice_mappings` still in the optimizer's order."""
    return sharded_zero12_flats(groups, [1] * len(groups), world_size, lambda _shard: copies, aligned=aligned,
                                bf16=bf16, round_robin=round_robin)


def sharded_zero12_flats(groups: Sequence[Sequence[Param]], group_ep: Sequence[int], world_size: int,
                         copies: Callable[[int], Copies], *, aligned: bool, bf16: bool,
                         round_robin: bool = False) -> Zero12Flats:
    """`zero12_flats` where group g is held apart by `group_ep[g]` expert-parallel ranks (1: a dense
    group): partitioned, and flattened round-robin, over the `world_size // group_ep[g]` ranks of an
    expert data-parallel group, target rank r partition `r // group_ep[g]` of shard `r % group_ep[g]`
    (DeepSpeed's default topology), filled by `copies(shard)`. `groups` lists each group's parameters
    as one shard holds them (every shard the same names and shapes)."""
    flats: list[list[TargetFlat]] = [[] for _ in range(world_size)]
    paddings: list[list[int]] = [[] for _ in range(world_size)]
    slices: list[list[tuple[tuple[str, int, int], ...]]] = [[] for _ in range(world_size)]
    shapes, param_paddings, module = [], [], []
    rr = round_robin and not bf16
    for g, (given, ep) in enumerate(zip(groups, group_ep)):
        parts = world_size // ep
        params = [given[i] for i in round_robin_order(len(given), parts)] if rr else list(given)
        order = original_order(len(given), parts, rr)
        align = 1 if bf16 or not params else param_alignment(DTYPE_SIZES[params[0].dtype], aligned)
        numels = [p.numel for p in params]
        dst = zero12_layout(numels, parts, alignment=align, bf16_optimizer=bf16)
        for r in range(world_size):
            shard, part = r % ep, r // ep
            fill = copies(shard)
            lo, hi = part * dst.partition, (part + 1) * dst.partition
            out: list[Copy] = []
            for p, off in zip(params, dst.offsets):
                a, b = max(off, lo), min(off + p.numel, hi)
                if a < b:
                    for c in fill(p.name, g, a - off, b - off, a - lo):
                        append_copy(out, c)
            flats[r].append(TargetFlat(group=g, numel=dst.partition, saved=dst.saved[part], copies=tuple(out)))
            paddings[r].append(dst.group_paddings[part])
            slices[r].append(tuple((params[i].name, start, k)
                                   for i, start, k in recorded_slices(numels, dst.offsets, dst.partition, part, order)))
        shapes.append(tuple((p.name, p.shape) for p in params))
        param_paddings.append(dst.param_paddings)
        module.append((dst.flat_numel, tuple((p.name, off) for p, off in zip(params, dst.offsets))))
    return Zero12Flats(flats=tuple(map(tuple, flats)), paddings=tuple(map(tuple, paddings)),
                       slices=tuple(map(tuple, slices)), shapes=tuple(shapes), param_paddings=tuple(param_paddings),
                       module=tuple(module))


def zero3_flats(groups: Sequence[Sequence[Param]], world_size: int, copies: Copies, *, sub_group_size: int
                ) -> tuple[tuple[tuple[TargetFlat, ...], ...], tuple[tuple[tuple[str, tuple[int, ...]], ...], ...]]:
    """`groups` laid out as `DeepSpeedZeroOptimizer_Stage3` does at `world_size` ranks: every parameter
    cut into equal pieces, a rank's flat its pieces in order, split into sub-groups of `sub_group_size`;
    each piece filled by `copies`. Per target rank its flats, and per flat its parameters' shapes."""
    flats: list[list[TargetFlat]] = [[] for _ in range(world_size)]
    shapes = []
    for g, params in enumerate(groups):
        for sub in zero3_sub_groups([zero3_piece(p.numel, world_size) for p in params], sub_group_size):
            members = [params[i] for i in sub]
            offsets = piece_offsets([p.numel for p in members], world_size)
            size = sum(zero3_piece(p.numel, world_size) for p in members)
            for r in range(world_size):
                out: list[Copy] = []
                for p, off in zip(members, offsets):
                    first = r * zero3_piece(p.numel, world_size)
                    last = first + zero3_real(p.numel, world_size, r)
                    if first < last:
                        for c in copies(p.name, g, first, last, off):
                            append_copy(out, c)
                flats[r].append(TargetFlat(group=g, numel=size, saved=size, copies=tuple(out)))
            shapes.append(tuple((p.name, p.shape) for p in members))
    return tuple(map(tuple, flats)), tuple(shapes)


__all__ = ["Copies", "ModelRuns", "Zero12Flats", "append_copy", "fragment_copies", "sharded_zero12_flats",
           "zero3_flats", "zero12_flats"]
