"""Planning a ZeRO stage change: a data-parallel ZeRO checkpoint rewritten at another stage. Pure.

The stages differ in how they cut the same fp32 master weights and optimizer moments, and in what the
model-states files hold (`formats.deepspeed.partition` for the arithmetic):

- ZeRO-1 <-> ZeRO-2 (`DeepSpeedZeroOptimizer` both): the same flat partitions; only the recorded stage
  (`zero_stage` in the optimizer files, `zero_optimization.stage` in the recorded config) changes.
- ZeRO-1/2 -> ZeRO-3 (`DeepSpeedZeroOptimizer_Stage3`): every parameter cut into equal pieces, one per
  rank, each rank's flat group its pieces in order (split into sub-groups of `sub_group_size`); one
  model-states file per rank holding the buffers, the parameters as empty tensors, its pieces of the
  frozen parameters, and the shapes; rank 0's lists the tied aliases (`shared_params`).
- ZeRO-3 -> ZeRO-1/2: the flat groups of `DeepSpeedZeroOptimizer` rebuilt at the new world size, and
  rank 0's model-states file with the whole module: its 16-bit copy of the trainable parameters (for
  fp32 training, the fp32 masters themselves) and the frozen ones joined from their pieces. A bf16 or
  fp16 run's 16-bit copy would have to be cast from the masters, which this byte-copying writer does
  not do: refused for now.

Every target element is copied from the source fragments that hold it (`fragment_copies`): the
parameter-relative ranges of both sides intersected, so each source element is read once. Sources
saved by `BF16_Optimizer` (bf16 ZeRO-1 with fp32 gradient accumulation), with round-robin gradients or
with ZeRO-3 sub-groups are refused, as are expert-parallel, pipeline and Megatron-style checkpoints. An
AutoTP checkpoint changes stage per tensor-parallel rank (`plan_model_parallel_stage`): each rank's
files are a data-parallel checkpoint of its shards.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import replace

from ckptflow.errors import UnsupportedCheckpointError
from ckptflow.formats.deepspeed.config import is_set, sub_group_size
from ckptflow.formats.deepspeed.model import Fragment, Param, ZeroCheckpoint
from ckptflow.formats.deepspeed.names import model_file_name, optim_file_name
from ckptflow.formats.deepspeed.partition import (
    BF16,
    ZERO,
    ZERO3,
    Copy,
    param_alignment,
    piece_offsets,
    zero3_piece,
    zero3_real,
    zero3_sub_groups,
    zero12_layout,
)
from ckptflow.formats.deepspeed.readers.model_parallel import ModelParallelCheckpoint
from ckptflow.formats.deepspeed.runs import Run
from ckptflow.formats.torch.tensorref import DTYPE_SIZES
from ckptflow.reshard.data_parallel import plan_data_parallel
from ckptflow.reshard.units import DataParallelPlan, FrozenPiece, ModelParallelPlan, RankUnit, TargetFlat


def plan_stage_change(index: ZeroCheckpoint, world_size: int, stage: int) -> DataParallelPlan:
    """The plan that writes the data-parallel ZeRO checkpoint `index` at ZeRO `stage` on `world_size`
    ranks; `UnsupportedCheckpointError` for what it does not convert (see the module's docstring)."""
    source = plan_data_parallel(index, index.world_size)  # the source checked against DeepSpeed's arithmetic
    where = index.tag_uri
    if source.optimizer == BF16:
        raise UnsupportedCheckpointError(
            f"{where} was saved by DeepSpeed's BF16_Optimizer (bf16 ZeRO-1 with fp32 gradient accumulation), whose "
            f"flat groups ckptflow does not move to ZeRO-{stage} yet", uri=where,
            hint="reshard it at ZeRO-1 (leave --zero-stage out)")
    if is_set(index.zero_config, "round_robin_gradients"):
        raise UnsupportedCheckpointError(
            f"{where} was trained with zero_optimization.round_robin_gradients, whose flattening order ckptflow does "
            "not carry across a stage change yet", uri=where, hint="reshard it at its own stage")
    if source.optimizer == ZERO and stage in (1, 2):
        same = plan_data_parallel(index, world_size)
        return replace(same, stage=stage)
    if stage == 3:
        return _to_zero3(index, world_size)
    if index.precision != "fp32":
        raise UnsupportedCheckpointError(
            f"{where} is a {index.precision} ZeRO-3 checkpoint: at ZeRO-{stage} its module holds a {index.precision} "
            "copy of every weight, which ckptflow would have to cast from the fp32 masters; it copies bytes only, "
            "so this is not written yet", uri=where, hint="reshard it at ZeRO-3, or consolidate its weights")
    return _to_zero12(index, world_size, stage)


def plan_model_parallel_stage(index: ModelParallelCheckpoint, world_size: int, stage: int) -> ModelParallelPlan:
    """An AutoTP checkpoint at ZeRO `stage`: each tensor-parallel rank's data-parallel checkpoint changed
    alone (`plan_stage_change`), its `mp_rank_XX` files side by side; the split metadata carried."""
    parts = tuple(plan_stage_change(rank, world_size, stage) for rank in index.ranks)
    return ModelParallelPlan(
        root=index.root, tag=index.tag, stage=stage, precision=index.precision, source_world_size=index.world_size,
        world_size=world_size, parts=parts, carried=index.carried, index=index,
    )


def fragment_copies(fragments: Sequence[Fragment], starts: Sequence[int], lo: int, hi: int, dst: int) -> list[Copy]:
    """Copies of parameter elements [lo, hi) (to `dst` onwards) from the source `fragments` that hold
    them, sorted by `param_offset` (`starts`: their param offsets, for bisection)."""
    out: list[Copy] = []
    i = max(0, bisect.bisect_right(starts, lo) - 1)
    while i < len(fragments) and fragments[i].param_offset < hi:
        f = fragments[i]
        a, b = max(lo, f.param_offset), min(hi, f.param_offset + f.numel)
        if a < b:
            out.append(Copy(src_rank=f.rank, src_flat=f.group, src_offset=f.offset + a - f.param_offset,
                            dst_offset=dst + a - lo, numel=b - a))
        i += 1
    return out


class _Sources:
    """Each trainable parameter's source fragments in parameter order, bisectable."""

    def __init__(self, index: ZeroCheckpoint) -> None:
        self.by_name = index.param_by_name
        self._fragments: dict[str, tuple[list[Fragment], list[int]]] = {}

    def copies(self, name: str, lo: int, hi: int, dst: int) -> list[Copy]:
        hit = self._fragments.get(name)
        if hit is None:
            frags = sorted(self.by_name[name].fragments, key=lambda f: f.param_offset)
            hit = self._fragments[name] = (frags, [f.param_offset for f in frags])
        return fragment_copies(hit[0], hit[1], lo, hi, dst)


def _merged(copies: list[Copy]) -> tuple[Copy, ...]:
    """`copies` with neighbours contiguous on both sides joined."""
    out: list[Copy] = []
    for c in copies:
        prev = out[-1] if out else None
        if (prev is not None and prev.src_rank == c.src_rank and prev.src_flat == c.src_flat
                and prev.src_offset + prev.numel == c.src_offset and prev.dst_offset + prev.numel == c.dst_offset):
            out[-1] = replace(prev, numel=prev.numel + c.numel)
        else:
            out.append(c)
    return tuple(out)


def _frozen_piece_copies(param: Param, source_stage: int, source_ws: int, lo: int, hi: int, dst: int) -> list[Copy]:
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


def _to_zero3(index: ZeroCheckpoint, world_size: int) -> DataParallelPlan:
    group_size = sub_group_size(index.zero_config)
    sources = _Sources(index)
    by_name = index.param_by_name
    n_tensors = index.tensors_per_partition
    per_rank: list[list[TargetFlat]] = [[] for _ in range(world_size)]
    flat_shapes = []
    for g, group in enumerate(index.groups):
        names = list(group.params)
        numels = [by_name[n].numel for n in names]
        for sub in zero3_sub_groups([zero3_piece(n, world_size) for n in numels], group_size):
            offsets = piece_offsets([numels[i] for i in sub], world_size)
            size = sum(zero3_piece(numels[i], world_size) for i in sub)
            for r in range(world_size):
                copies: list[Copy] = []
                for i, off in zip(sub, offsets):
                    piece = zero3_piece(numels[i], world_size)
                    lo, hi = r * piece, r * piece + zero3_real(numels[i], world_size, r)
                    copies += sources.copies(names[i], lo, hi, off)
                per_rank[r].append(TargetFlat(group=g, numel=size, saved=size, copies=_merged(copies)))
            flat_shapes.append(tuple((names[i], by_name[names[i]].shape) for i in sub))
    frozen = [p for p in index.params if p.frozen]
    units = []
    for r in range(world_size):
        pieces = []
        for p in frozen:
            piece = zero3_piece(p.numel, world_size)
            lo = r * piece
            pieces.append(FrozenPiece(name=p.name, numel=piece, copies=tuple(_frozen_piece_copies(
                p, index.stage, index.world_size, lo, lo + zero3_real(p.numel, world_size, r), 0))))
        flats = tuple(per_rank[r])
        frozen_bytes = sum(c.numel * DTYPE_SIZES[p.dtype] for p, piece in zip(frozen, pieces) for c in piece.copies)
        frozen_bytes += index.buffer_bytes
        units.append(RankUnit(
            rank=r, meta_rank=min(r, index.world_size - 1),
            optim_file=optim_file_name(index.precision, r, index.mp_rank),
            model_file=model_file_name(3, r, index.mp_rank), flats=flats, frozen=tuple(pieces), mp_rank=index.mp_rank,
            read_bytes=4 * n_tensors * sum(c.numel for f in flats for c in f.copies) + frozen_bytes,
            write_bytes=4 * n_tensors * sum(f.numel for f in flats) + frozen_bytes,
        ))
    return DataParallelPlan(
        root=index.root, tag=index.tag, stage=3, precision=index.precision, optimizer=ZERO3,
        source_world_size=index.world_size, world_size=world_size, flat_shapes=tuple(flat_shapes),
        param_alignment_paddings=(), module=(), units=tuple(units), index=index, source_optimizer=ZERO,
    )


def _to_zero12(index: ZeroCheckpoint, world_size: int, stage: int) -> DataParallelPlan:
    """ZeRO-3 (fp32) to `DeepSpeedZeroOptimizer`'s flat groups at `world_size`; rank 0 writes the module."""
    sources = _Sources(index)
    by_name = index.param_by_name
    n_tensors = index.tensors_per_partition
    align_on = is_set(index.zero_config, "parameter_alignment")
    flats: list[list[TargetFlat]] = [[] for _ in range(world_size)]
    paddings: list[list[int]] = [[] for _ in range(world_size)]
    slices: list[list[tuple[tuple[str, int, int], ...]]] = [[] for _ in range(world_size)]
    shapes, param_paddings, module = [], [], []
    module_runs: dict[str, tuple[Run, ...]] = {}
    for g, group in enumerate(index.groups):
        names = list(group.params)
        params = [by_name[n] for n in names]
        align = param_alignment(DTYPE_SIZES[params[0].dtype], align_on) if params else 1
        dst = zero12_layout([p.numel for p in params], world_size, alignment=align)
        pos = dict(zip(names, dst.offsets))
        # param_slice_mappings: like DeepSpeed, real offsets only when some parameter is padded.
        mapping = list(dst.offsets) if any(dst.param_paddings) else [sum(p.numel for p in params[:i])
                                                                     for i in range(len(params))]
        for r in range(world_size):
            lo, hi = r * dst.partition, (r + 1) * dst.partition
            copies: list[Copy] = []
            mine = []
            for p, off, moff in zip(params, dst.offsets, mapping):
                a, b = max(off, lo), min(off + p.numel, hi)
                if a < b:
                    copies += sources.copies(p.name, a - off, b - off, a - lo)
                ma, mb = max(moff, lo), min(moff + p.numel, hi)
                if ma < mb:
                    mine.append((p.name, ma - lo, mb - ma))
            flats[r].append(TargetFlat(group=g, numel=dst.partition, saved=dst.saved[r], copies=_merged(copies)))
            paddings[r].append(dst.group_paddings[r])
            slices[r].append(tuple(mine))
        shapes.append(tuple((p.name, p.shape) for p in params))
        param_paddings.append(dst.param_paddings)
        module.append((dst.flat_numel, tuple((n, pos[n]) for n in names)))
        for p in params:  # the module's copy: the fp32 masters, from the ranks' partitions
            module_runs[p.name] = tuple(
                Run(ref=index.partitions[c.src_rank][c.src_flat].fp32, start=c.src_offset, numel=c.numel,
                    offset=c.dst_offset)
                for c in sources.copies(p.name, 0, p.numel, 0))
    frozen = [p for p in index.params if p.frozen]
    whole = tuple(FrozenPiece(name=p.name, numel=p.numel,
                              copies=tuple(_frozen_piece_copies(p, 3, index.world_size, 0, p.numel, 0)))
                  for p in frozen)
    module_bytes = sum(p.numel * DTYPE_SIZES[p.dtype] for p in index.params) + index.buffer_bytes
    units = []
    for r in range(world_size):
        moved = sum(c.numel for f in flats[r] for c in f.copies)
        units.append(RankUnit(
            rank=r, meta_rank=min(r, index.world_size - 1),
            optim_file=optim_file_name(index.precision, r, index.mp_rank),
            model_file=model_file_name(stage, 0, index.mp_rank) if r == 0 else None, flats=tuple(flats[r]),
            group_paddings=tuple(paddings[r]), slice_mappings=tuple(slices[r]), frozen=whole if r == 0 else (),
            mp_rank=index.mp_rank,
            read_bytes=4 * n_tensors * moved + (module_bytes if r == 0 else 0),
            write_bytes=4 * n_tensors * sum(f.numel for f in flats[r]) + (module_bytes if r == 0 else 0),
        ))
    return DataParallelPlan(
        root=index.root, tag=index.tag, stage=stage, precision=index.precision, optimizer=ZERO,
        source_world_size=index.world_size, world_size=world_size, flat_shapes=tuple(shapes),
        param_alignment_paddings=tuple(param_paddings), module=tuple(module), units=tuple(units), index=index,
        module_runs=module_runs, source_optimizer=ZERO3,
    )


__all__ = ["fragment_copies", "plan_model_parallel_stage", "plan_stage_change"]
