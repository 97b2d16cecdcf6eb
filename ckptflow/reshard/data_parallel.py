"""Planning a data-parallel reshard: a ZeRO-1/2/3 checkpoint's flat partitions re-cut for another
number of data-parallel ranks. Pure.

The plan is one `RankUnit` per target rank, each a list of element copies from the source ranks' flat
partitions (DeepSpeed's partition arithmetic is `formats.deepspeed.partition`), made after checking that
the source is laid out exactly as that arithmetic predicts for its own world size, and refusing layouts
ckptflow cannot convert. Nothing here reads a byte.

A model-parallel checkpoint (AutoTP, PipelineModule, Megatron-style) is one data-parallel checkpoint
per model-parallel rank: its plan (`ModelParallelPlan`) is one `DataParallelPlan` per model-parallel
rank, each writing that rank's `..._mp_rank_XX_...` files at the new data-parallel size, the units of
all of them side by side; everything model-parallel (split metadata, layer files) stays as it is.

Expert-parallel checkpoints (AutoEP, deepspeed.moe at ZeRO-1/2/3) keep their expert-parallel degree N:
dense groups are re-partitioned over the M ranks, each expert group's shards over the new expert
data-parallel groups (M / N ranks each; target rank r holds expert-parallel rank r % N's experts), so
every expert's optimizer state moves with it; the per-expert files are carried as they are. Another
expert-parallel degree is `reshard.experts`'s plan.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ckptflow.errors import CheckpointError, UnsupportedCheckpointError, option
from ckptflow.formats.deepspeed.config import is_set, sub_group_size
from ckptflow.formats.deepspeed.model import ZeroCheckpoint
from ckptflow.formats.deepspeed.names import model_file_name, optim_file_name
from ckptflow.formats.deepspeed.partition import (
    BF16,
    ZERO,
    ZERO3,
    Extent,
    moves,
    param_alignment,
    piece_offsets,
    recorded_slices,
    round_robin_order,
    zero3_moves,
    zero3_piece,
    zero3_sub_groups,
    zero12_fragments,
    zero12_layout,
)
from ckptflow.formats.deepspeed.readers.experts import ExpertCheckpoint
from ckptflow.formats.deepspeed.readers.model_parallel import ModelParallelCheckpoint
from ckptflow.formats.deepspeed.readers.optimizer_shards import OptimizerShards
from ckptflow.formats.torch.tensorref import DTYPE_SIZES
from ckptflow.reshard.shape import why_not_expert_stage
from ckptflow.reshard.units import DataParallelPlan, FrozenPiece, ModelParallelPlan, RankUnit, TargetFlat


def plan_model_parallel(index: ModelParallelCheckpoint, world_size: int) -> ModelParallelPlan:
    """One data-parallel plan per model-parallel rank; every rank's files carry its `mp_rank_XX`."""
    parts = tuple(plan_data_parallel(rank, world_size) for rank in index.ranks)
    return ModelParallelPlan(
        root=index.root, tag=index.tag, stage=index.stage, precision=index.precision,
        source_world_size=index.world_size, world_size=world_size, parts=parts, carried=index.carried, index=index,
    )


def plan_expert_parallel(source: ExpertCheckpoint, world_size: int, stage: int | None = None) -> DataParallelPlan:
    """The data-parallel plan of the ZeRO index under an AutoEP or deepspeed.moe checkpoint, its expert
    groups over the new expert data-parallel groups; the per-expert files carried as they are. With
    `stage`, at ZeRO-1 or ZeRO-2 from the other, for `DeepSpeedZeroOptimizer` sources (the same flat
    partitions, only the recorded stage changes; `plan._expert_degree` sends a stage change from or to
    BF16_Optimizer elsewhere)."""
    index = source.zero
    if index is None:  # ZeRO-0: `plan.plan_reshard` says there is nothing to reshard
        raise UnsupportedCheckpointError(f"{source.tag_uri} is a ZeRO-0 {source.layout} checkpoint", uri=source.root)
    degrees = sorted({g.ep for g in index.groups if g.ep > 1})
    if any(world_size % ep for ep in degrees):
        raise UnsupportedCheckpointError(
            f"{index.tag_uri} is a {source.layout} checkpoint; a data-parallel reshard keeps its expert-parallel "
            f"degree {degrees[-1]}, and {world_size} ranks are not a multiple of it", uri=index.tag_uri,
            expected=degrees[-1], actual=world_size, hint=f"choose a world size that is a multiple of {degrees[-1]}")
    plan = plan_data_parallel(index, world_size, expert_parallel=True)
    if stage is not None and stage != index.stage:
        check_expert_stage(source, stage)
        assert index.optimizer_kind == ZERO, "plan._expert_degree lays other optimizers' groups out again"
        plan = replace(plan, stage=stage)
    return replace(plan, carried=source.expert_files, group_ep=tuple(g.ep for g in index.groups))


def check_expert_stage(source: ExpertCheckpoint, stage: int) -> None:
    """Refuse a ZeRO stage the expert-parallel checkpoint's layout does not train at
    (`reshard.shape.why_not_expert_stage` says why)."""
    why = why_not_expert_stage(source.kind, stage)
    if why is not None:
        raise UnsupportedCheckpointError(f"cannot write {source.tag_uri} ({source.layout}) at ZeRO-{stage}: {why}",
                                         code="unsupported-shape", uri=source.root,
                                         hint=f"keep its ZeRO stage (leave {option('stage')} out)")


def plan_data_parallel(index: ZeroCheckpoint, world_size: int, *, expert_parallel: bool = False) -> DataParallelPlan:
    """`index` at `world_size` data-parallel ranks, same ZeRO stage."""
    optimizer = index.optimizer_kind
    _check_supported(index, optimizer, expert_parallel=expert_parallel)
    if optimizer == ZERO3:
        return _plan_zero3(index, world_size)
    return _plan_zero12(index, world_size, optimizer, module=not expert_parallel)


def plan_shard_folder(index: OptimizerShards, world_size: int) -> DataParallelPlan:
    """A folder of per-rank optimizer states (`readers.optimizer_shards`) at `world_size` ranks: the
    ZeRO-1/2 plan, each rank's one file named as the source names its files (no model-states file)."""
    assert index.names is not None, "the reader names the shard files"
    plan = plan_data_parallel(index, world_size)
    n_tensors = index.tensors_per_partition
    units = tuple(replace(
        u, optim_file=index.names.name(u.rank, world_size), model_file=None,
        read_bytes=4 * n_tensors * sum(c.numel for f in u.flats for c in f.copies),
        write_bytes=4 * n_tensors * sum(f.numel for f in u.flats),
    ) for u in plan.units)
    return replace(plan, units=units, module=())


def _check_supported(index: ZeroCheckpoint, optimizer: str, *, expert_parallel: bool = False) -> None:
    zero = index.zero_config
    where = index.tag_uri
    for key in ("offload_optimizer", "offload_param"):
        section = zero.get(key)
        if isinstance(section, Mapping) and section.get("device") == "nvme":
            raise UnsupportedCheckpointError(
                f"{where} was trained with {key} on NVMe; its optimizer state lives in offloaded_tensors/, "
                "which ckptflow does not reshard", uri=where, hint="reshard a checkpoint saved without NVMe offload")
    model0 = index.model_states[0]
    if model0.get("num_experts") is not None and not expert_parallel:
        raise UnsupportedCheckpointError(f"{where} holds mixture-of-experts layers but was not read as an "
                                         "expert-parallel checkpoint", uri=where,
                                         hint="open it through formats.deepspeed.load_index")
    for rank, optim in enumerate(index.optim_states):
        osd = optim["optimizer_state_dict"]
        if optimizer == ZERO3:
            base = osd.get("optimizer_state_dict")
            if osd.get("ds_zero_partition_groups") is not None and not expert_parallel:
                raise UnsupportedCheckpointError(
                    f"rank {rank}: {index.files[rank].optim} records AutoEP partition groups but was not read as an "
                    "AutoEP checkpoint", uri=where, file=index.files[rank].optim, rank=rank)
        else:
            base = osd.get("base_optimizer_state")
            if isinstance(base, list):
                raise UnsupportedCheckpointError(
                    f"rank {rank}: {index.files[rank].optim} was saved with zero_optimization.elastic_checkpoint; "
                    "DeepSpeed already loads such checkpoints at any world size", uri=where,
                    file=index.files[rank].optim, rank=rank, hint="load it directly with elastic_checkpoint enabled")
        if not isinstance(base, Mapping) or not isinstance(base.get("param_groups"), list):
            raise CheckpointError(f"rank {rank}: {index.files[rank].optim} holds no base optimizer state dict",
                                  uri=where, file=index.files[rank].optim, rank=rank)
        if len(base["param_groups"]) != len(index.groups):
            raise UnsupportedCheckpointError(
                f"rank {rank}: {index.files[rank].optim} has {len(base['param_groups'])} optimizer param groups but "
                f"{len(index.groups)} flat groups; ZeRO-3 sub-groups (sub_group_size smaller than a rank's share of a "
                "group) are not supported", uri=where, file=index.files[rank].optim, rank=rank)
        if not expert_parallel and any(isinstance(g, Mapping) and g.get("moe") for g in base["param_groups"]):
            raise UnsupportedCheckpointError(f"{where} has mixture-of-experts param groups but was not read as an "
                                             "expert-parallel checkpoint", uri=where)


@dataclass(frozen=True)
class _Zero12Group:
    """One ZeRO-1/2 param group at the target world size: what each rank holds of it, and what the
    model file records about it."""

    flats: tuple[TargetFlat, ...]  # per target rank
    group_paddings: tuple[int, ...]  # per target rank
    slices: tuple[tuple[tuple[str, int, int], ...], ...]  # per target rank: (name, start, numel)
    shapes: tuple[tuple[str, tuple[int, ...]], ...]
    param_paddings: tuple[int, ...]
    module: tuple[int, tuple[tuple[str, int], ...]]  # 16-bit flat numel, param offsets


def _plan_zero12(index: ZeroCheckpoint, world_size: int, optimizer: str, *, module: bool = True) -> DataParallelPlan:
    """`module`: rebuild the 16-bit flat buffers the module's tensors view (a data-parallel save); an
    expert-parallel save clones each module tensor, and its module is copied as it is."""
    groups = [_zero12_group(index, g, world_size, optimizer) for g in range(len(index.groups))]
    n_tensors = index.tensors_per_partition
    # Rank 0 also writes the model file: the 16-bit module copy, frozen parameters and buffers.
    module_bytes = sum(p.numel * DTYPE_SIZES[p.dtype] for p in index.params) + index.buffer_bytes
    units = []
    for r in range(world_size):
        flats = tuple(g.flats[r] for g in groups)
        moved = sum(c.numel for f in flats for c in f.copies)
        units.append(RankUnit(
            rank=r, meta_rank=_meta_rank(index, r), optim_file=optim_file_name(index.precision, r, index.mp_rank),
            model_file=model_file_name(index.stage, 0, index.mp_rank) if r == 0 else None, flats=flats,
            mp_rank=index.mp_rank,
            group_paddings=tuple(g.group_paddings[r] for g in groups),
            slice_mappings=tuple(g.slices[r] for g in groups),
            read_bytes=4 * n_tensors * moved + (module_bytes if r == 0 else 0),
            write_bytes=4 * n_tensors * sum(f.numel for f in flats) + (module_bytes if r == 0 else 0),
        ))
    return DataParallelPlan(
        root=index.root, tag=index.tag, stage=index.stage, precision=index.precision, optimizer=optimizer,
        source_world_size=index.world_size, world_size=world_size, flat_shapes=tuple(g.shapes for g in groups),
        param_alignment_paddings=tuple(g.param_paddings for g in groups),
        module=tuple(g.module for g in groups) if module else (), units=tuple(units), index=index,
    )


def _meta_rank(index: ZeroCheckpoint, rank: int) -> int:
    """The source rank whose per-rank state target `rank` copies: itself where it exists; past the
    source's ranks, the last one, or with expert groups one of the same expert-parallel rank."""
    if rank < index.world_size:
        return rank
    ep = max(g.ep for g in index.groups) if index.groups else 1
    return rank % ep if ep > 1 else index.world_size - 1


def _zero12_group(index: ZeroCheckpoint, g: int, world_size: int, optimizer: str) -> _Zero12Group:
    """Group `g` at `world_size`: each of its shards (one for a dense group; one per expert-parallel
    rank for an expert group) re-partitioned from its source ranks over its target ranks."""
    zero = index.zero_config
    group = index.groups[g]
    by_name = index.param_by_name
    bf16_opt = optimizer == BF16
    src_names = list(group.params)
    params = [by_name[n] for n in src_names]
    src_ws, dst_ws = index.world_size // group.ep, world_size // group.ep  # partitions per shard
    align = 1 if bf16_opt or not params else param_alignment(DTYPE_SIZES[params[0].dtype],
                                                             is_set(zero, "parameter_alignment"))
    if index.is_round_robin:
        # The saved order is the round-robin order for the source world size: undo it, redo it for M.
        original = list(index.optimizer_order(group))
        dst_names = [original[i] for i in round_robin_order(len(original), dst_ws)]
    else:
        original = dst_names = src_names
    numel = {p.name: p.numel for p in params}
    src = zero12_layout([numel[n] for n in src_names], src_ws, alignment=align, bf16_optimizer=bf16_opt)
    dst = zero12_layout([numel[n] for n in dst_names], dst_ws, alignment=align, bf16_optimizer=bf16_opt)
    recorded = index.optim_states[0]["optimizer_state_dict"].get("param_alignment_paddings")
    src_pos = {n: src.offsets[i] for i, n in enumerate(src_names)}
    dst_pos = {n: dst.offsets[i] for i, n in enumerate(dst_names)}
    extents = [Extent(numel=numel[n], src=src_pos[n], dst=dst_pos[n]) for n in dst_names]
    # param_slice_mappings follow the optimizer's original order, placed as DeepSpeed places them.
    dst_at = {n: i for i, n in enumerate(dst_names)}
    order = [dst_at[n] for n in original]
    flats: list[TargetFlat | None] = [None] * world_size
    paddings: list[int] = [0] * world_size
    slices: list[tuple[tuple[str, int, int], ...]] = [()] * world_size
    for shard in range(group.ep):
        src_ranks, dst_ranks = group.ranks(index.world_size, shard), group.ranks(world_size, shard)
        _check_zero12_source(index, g, shard, src_names, src, recorded, src_ranks)
        for part, r in enumerate(dst_ranks):
            copies = tuple(replace(c, src_rank=src_ranks[c.src_rank])
                           for c in moves(extents, src.partition, dst.partition, part, src_flat=g))
            flats[r] = TargetFlat(group=g, numel=dst.partition, saved=dst.saved[part], copies=copies)
            paddings[r] = dst.group_paddings[part]
            slices[r] = tuple((dst_names[i], start, k)
                              for i, start, k in recorded_slices(dst.numels, dst.offsets, dst.partition, part, order))
    assert all(f is not None for f in flats), "every target rank holds a partition of every group"
    return _Zero12Group(
        flats=tuple(f for f in flats if f is not None), group_paddings=tuple(paddings), slices=tuple(slices),
        shapes=tuple((n, by_name[n].shape) for n in dst_names), param_paddings=dst.param_paddings,
        module=(dst.flat_numel, tuple((n, dst_pos[n]) for n in dst_names)),
    )


def _check_zero12_source(index: ZeroCheckpoint, g: int, shard: int, names: Sequence[str], src: Any, recorded: Any,
                         ranks: Sequence[int]) -> None:
    """The source's recorded layout must be DeepSpeed's arithmetic at its world size, or we refuse."""
    problems = []
    if isinstance(recorded, list) and g < len(recorded) and list(recorded[g]) != list(src.param_paddings):
        problems.append(f"parameter alignment paddings {list(recorded[g])} instead of {list(src.param_paddings)}")
    for part, r in enumerate(ranks):
        have = index.partitions[r][g]
        if (have.fp32.numel != src.saved[part] or have.numel != src.partition
                or have.padding != src.group_paddings[part]):
            problems.append(f"rank {r} saved {have.fp32.numel} of {have.numel} fp32 elements with padding "
                            f"{have.padding} instead of {src.saved[part]} of {src.partition} with "
                            f"{src.group_paddings[part]}")
    by_key = index.param_by_key
    expected: dict[str, list[tuple[int, int, int, int]]] = {n: [] for n in names}
    for part, r in enumerate(ranks):
        for i, start, numel in zero12_fragments(src, part):
            offset = src.offsets[i]
            expected[names[i]].append((r, start, numel, part * src.partition + start - offset))
    for n in names:
        got = [(f.rank, f.offset, f.numel, f.param_offset) for f in by_key[(shard, n)].fragments]
        if got != expected[n]:
            problems.append(f"{n} at {got} instead of {expected[n]}")
    if problems:
        over = (f" (expert-parallel rank {shard}'s copy, over ranks {list(ranks)})"
                if len(ranks) < index.world_size else "")
        raise UnsupportedCheckpointError(
            f"param group {g}{over} of {index.tag_uri} is not laid out the way DeepSpeed lays out {len(ranks)} ranks "
            f"({'; '.join(problems[:3])}); it was saved with settings ckptflow does not know", uri=index.tag_uri,
            hint="check zero_optimization.round_robin_gradients / parameter_alignment in its ds_config")


def _plan_zero3(index: ZeroCheckpoint, world_size: int) -> DataParallelPlan:
    zero = index.zero_config
    src_ws = index.world_size
    group_size = sub_group_size(zero)
    by_name = index.param_by_name
    n_tensors = index.tensors_per_partition
    per_rank_flats: list[list[TargetFlat]] = [[] for _ in range(world_size)]
    flat_shapes = []
    for g, group in enumerate(index.groups):
        names = list(group.params)
        numels = [by_name[n].numel for n in names]
        src_count, dst_count = src_ws // group.ep, world_size // group.ep  # partitions per shard
        src_offsets = piece_offsets(numels, src_count)
        if len(zero3_sub_groups([zero3_piece(n, src_count) for n in numels], group_size)) > 1:
            raise UnsupportedCheckpointError(
                f"param group {g} of {index.tag_uri} is split into ZeRO-3 sub-groups at {src_ws} ranks, which "
                "ckptflow does not read", uri=index.tag_uri)
        for shard in range(group.ep):
            _check_zero3_source(index, g, shard, names, numels, src_offsets, group.ranks(src_ws, shard))
        for sub in zero3_sub_groups([zero3_piece(n, dst_count) for n in numels], group_size):
            sub_numels = [numels[i] for i in sub]
            dst_offsets = piece_offsets(sub_numels, dst_count)
            size = sum(zero3_piece(n, dst_count) for n in sub_numels)
            for shard in range(group.ep):
                src_ranks = group.ranks(src_ws, shard)
                for part, r in enumerate(group.ranks(world_size, shard)):
                    copies = zero3_moves(sub_numels, src_count, dst_count, part,
                                         src_offsets=[src_offsets[i] for i in sub], dst_offsets=dst_offsets,
                                         src_flat=g)
                    copies = tuple(replace(c, src_rank=src_ranks[c.src_rank]) for c in copies)
                    per_rank_flats[r].append(TargetFlat(group=g, numel=size, saved=size, copies=copies))
            flat_shapes.append(tuple((names[i], by_name[names[i]].shape) for i in sub))
    frozen = [p for p in index.params if p.frozen]
    units = []
    for r in range(world_size):
        pieces = tuple(
            FrozenPiece(name=p.name, numel=zero3_piece(p.numel, world_size),
                        copies=zero3_moves([p.numel], src_ws, world_size, r, src_offsets=[0], dst_offsets=[0],
                                           src_flat=-1))
            for p in frozen
        )
        flats = tuple(per_rank_flats[r])
        frozen_bytes = sum(c.numel * DTYPE_SIZES[p.dtype] for p, piece in zip(frozen, pieces) for c in piece.copies)
        frozen_bytes += index.buffer_bytes
        units.append(RankUnit(
            rank=r, meta_rank=_meta_rank(index, r), optim_file=optim_file_name(index.precision, r, index.mp_rank),
            model_file=model_file_name(3, r, index.mp_rank), flats=flats, frozen=pieces, mp_rank=index.mp_rank,
            read_bytes=4 * n_tensors * sum(c.numel for f in flats for c in f.copies) + frozen_bytes,
            write_bytes=4 * n_tensors * sum(f.numel for f in flats) + frozen_bytes,
        ))
    return DataParallelPlan(
        root=index.root, tag=index.tag, stage=3, precision=index.precision, optimizer=ZERO3,
        source_world_size=src_ws, world_size=world_size, flat_shapes=tuple(flat_shapes),
        param_alignment_paddings=(), module=(), units=tuple(units), index=index,
    )


def _check_zero3_source(index: ZeroCheckpoint, g: int, shard: int, names: Sequence[str], numels: Sequence[int],
                        offsets: Sequence[int], ranks: Sequence[int]) -> None:
    by_key = index.param_by_key
    count = len(ranks)
    for n, numel, off in zip(names, numels, offsets):
        piece = zero3_piece(numel, count)
        want = [(r, off, min(piece, numel - part * piece), part * piece) for part, r in enumerate(ranks)
                if numel > part * piece]
        got = [(f.rank, f.offset, f.numel, f.param_offset) for f in by_key[(shard, n)].fragments]
        if got != want:
            raise UnsupportedCheckpointError(
                f"{n} in param group {g} of {index.tag_uri} sits at {got}, not where DeepSpeed's ZeRO-3 partitioning "
                f"at {count} ranks puts it ({want})", uri=index.tag_uri, tensor=n)


__all__ = ["plan_data_parallel", "plan_expert_parallel", "plan_model_parallel", "plan_shard_folder"]
