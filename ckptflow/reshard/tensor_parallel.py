"""Merging an AutoTP checkpoint's tensor parallelism away: tp N x dp D -> tp 1 x dp M. Pure.

AutoTP's affine maps say where every element of every parameter lives (`formats.deepspeed.autotp`), so
the full fp32 master weights and Adam moments are byte runs into the tensor-parallel ranks' flat
partitions. The output is what DeepSpeed writes for the same Hugging Face model trained without
tensor parallelism at M data-parallel ranks, same ZeRO stage and precision: `mp_rank_00` files only,
each param group flattened from the full parameters in the same order, partitioned over M ranks by
DeepSpeed's arithmetic (`formats.deepspeed.partition`), the ZeRO-1/2 16-bit module copy joined from the
ranks' shards, no `universal_checkpoint_info`, `mp_world_size` 1, `checkpoint_parallel_dimensions`
tp 1, and the `tensor_parallel` section left out of the recorded config. Load it with the same model
and a config without `tensor_parallel` at M ranks.

The plan is an ordinary `DataParallelPlan` whose source is a `ZeroCheckpoint` built over the tensor-parallel
ranks' partitions (virtual rank `mp * D + d`), so `reshard.files` writes it unchanged. Refused:
ZeRO-0 (its optimizer state names no parameter, so it cannot be joined), frozen parameters,
`round_robin_gradients`, scaled pieces (the reader refuses those already), target degrees other than 1,
and every layout but AutoTP.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from ckptflow.errors import UnsupportedCheckpointError
from ckptflow.formats.deepspeed.config import is_set, sub_group_size
from ckptflow.formats.deepspeed.model import Param, ParamGroup, ZeroCheckpoint
from ckptflow.formats.deepspeed.names import UC_INFO, model_file_name, optim_file_name
from ckptflow.formats.deepspeed.partition import BF16, ZERO, ZERO3
from ckptflow.formats.deepspeed.readers.autotp import module_runs
from ckptflow.formats.deepspeed.readers.model_parallel import ModelParallelCheckpoint
from ckptflow.formats.torch.tensorref import DTYPE_SIZES
from ckptflow.reshard.flats import ModelRuns, zero3_flats, zero12_flats
from ckptflow.reshard.shape import check_world_size
from ckptflow.reshard.units import DataParallelPlan, RankUnit


def plan_tensor_parallel_merge(index: Any, world_size: int, tensor_parallel: int, *, stage: int | None = None
                               ) -> DataParallelPlan:
    """The plan that turns the AutoTP checkpoint `index` into a `tensor_parallel` = 1 checkpoint at
    `world_size` data-parallel ranks, at ZeRO `stage` (None: the source's; a ZeRO-1/2 source may go to
    any of 1, 2, 3); reads nothing. `UnsupportedCheckpointError` for anything else."""
    where = f"{index.root}/{index.tag}"
    check_world_size(world_size)
    current = getattr(index, "tp", 1)
    if not isinstance(index, ModelParallelCheckpoint) or index.kind != "autotp":
        raise UnsupportedCheckpointError(
            f"{where} is a checkpoint in the {index.layout} layout; ckptflow changes the tensor-parallel degree of "
            "AutoTP checkpoints only", code="unsupported-layout", uri=index.root,
            hint="reshard it to another data-parallel size without --tensor-parallel")
    if tensor_parallel == current:
        raise UnsupportedCheckpointError(f"{where} already has tensor-parallel degree {current}", uri=index.root,
                                         hint="leave --tensor-parallel out to change the data-parallel size only")
    if tensor_parallel != 1:
        raise UnsupportedCheckpointError(
            f"{where} has tensor-parallel degree {current}; ckptflow can merge it to 1, not split it to "
            f"{tensor_parallel}: AutoTP decides a shard's layout when it builds the model", uri=index.root,
            hint="use --tensor-parallel 1, then let AutoTP split the model again")
    if index.stage == 0:
        raise UnsupportedCheckpointError(
            f"{where} is a checkpoint in the {index.layout} layout: its optimizer state is saved by index and names no "
            "parameter, so the tensor-parallel ranks' Adam moments cannot be joined", uri=index.root,
            hint="ZeRO-0 weights can still be consolidated (ckptflow consolidate)")
    frozen = [p.name for rank in index.ranks for p in rank.params if p.frozen]
    if frozen:
        raise UnsupportedCheckpointError(f"{where} has frozen parameters ({frozen[:3]}), whose tensor-parallel split "
                                         "ckptflow has not verified", uri=index.root)
    if is_set(index.ranks[0].zero_config, "round_robin_gradients"):
        raise UnsupportedCheckpointError(f"{where} was trained with zero_optimization.round_robin_gradients, which "
                                         "a tensor-parallel merge does not handle", uri=index.root)
    source = _merged_source(index)
    kind = source.optimizer_kind
    stage = index.stage if stage is None else stage
    if stage != index.stage and kind != ZERO:
        raise UnsupportedCheckpointError(
            f"{where}: ckptflow merges a ZeRO-{index.stage} AutoTP checkpoint's tensor parallelism at ZeRO-1, 2 or 3 "
            f"from ZeRO-1/2 only, not from this one to ZeRO-{stage}", uri=index.root,
            hint="merge it at its own stage, then change the stage")
    plan = _plan_zero3(index, source, world_size) if stage == 3 else _plan_zero12(index, source, world_size, kind)
    return replace(plan, stage=stage, source_optimizer=kind)


# ---- the source: every tensor-parallel rank's partitions as one data-parallel checkpoint -------------


def _without_tensor_parallel(state: Mapping[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in state.items() if k != UC_INFO}
    if "mp_world_size" in out:
        out["mp_world_size"] = 1
    dims = out.get("checkpoint_parallel_dimensions")
    if isinstance(dims, Mapping):
        out["checkpoint_parallel_dimensions"] = {**dims, "tp_degree": 1}
    config = out.get("ds_config")
    if isinstance(config, Mapping):
        out["ds_config"] = {k: copy.deepcopy(v) for k, v in config.items() if k != "tensor_parallel"}
    return out


def _merged_source(index: ModelParallelCheckpoint) -> ZeroCheckpoint:
    """A `ZeroCheckpoint` whose rank `mp * D + d` is tensor-parallel rank mp's data-parallel rank d, with
    the full parameters (names, shapes, groups) and tensor-parallel-free metadata."""
    ranks: Sequence[ZeroCheckpoint] = index.ranks
    first = ranks[0]
    full = {t.name: t for t in index.tensors}
    params = tuple(Param(p.name, full[p.name].shape, p.dtype, p.group) for p in first.params)
    groups = tuple(ParamGroup(g.index, g.hyper, g.params) for g in first.groups)
    return replace(
        first, params=params, groups=groups,
        partitions=tuple(part for rank in ranks for part in rank.partitions),
        files=tuple(f for rank in ranks for f in rank.files),
        model_states=tuple(_without_tensor_parallel(m) for rank in ranks for m in rank.model_states),
        optim_states=tuple(_without_tensor_parallel(o) for rank in ranks for o in rank.optim_states),
        tied=index.tied,
    )


def _meta(index: ModelParallelCheckpoint, rank: int) -> int:
    """The virtual rank whose per-rank scalars target rank `rank` copies: tensor-parallel rank 0's."""
    return min(rank, index.world_size - 1)


# ---- ZeRO-1/2 --------------------------------------------------------------------------------------


def _plan_zero12(index: ModelParallelCheckpoint, source: ZeroCheckpoint, world_size: int, optimizer: str
                 ) -> DataParallelPlan:
    by_name = source.param_by_name
    n_tensors = source.tensors_per_partition
    laid = zero12_flats([[by_name[n] for n in group.params] for group in source.groups], world_size,
                        ModelRuns(index).copies, aligned=is_set(source.zero_config, "parameter_alignment"),
                        bf16=optimizer == BF16)
    flats, paddings, slices = laid.flats, laid.paddings, laid.slices
    flat_shapes, param_paddings, module = laid.shapes, laid.param_paddings, laid.module
    module_bytes = sum(p.numel * DTYPE_SIZES[p.dtype] for p in source.params) + source.buffer_bytes
    units = []
    for r in range(world_size):
        moved = sum(c.numel for f in flats[r] for c in f.copies)
        units.append(RankUnit(
            rank=r, meta_rank=_meta(index, r), optim_file=optim_file_name(source.precision, r),
            model_file=model_file_name(source.stage, 0) if r == 0 else None, flats=tuple(flats[r]),
            group_paddings=tuple(paddings[r]), slice_mappings=tuple(slices[r]),
            read_bytes=4 * n_tensors * moved + (module_bytes if r == 0 else 0),
            write_bytes=4 * n_tensors * sum(f.numel for f in flats[r]) + (module_bytes if r == 0 else 0),
        ))
    return DataParallelPlan(
        root=index.root, tag=index.tag, stage=source.stage, precision=source.precision, optimizer=optimizer,
        source_world_size=index.world_size, world_size=world_size, flat_shapes=tuple(flat_shapes),
        param_alignment_paddings=tuple(param_paddings), module=tuple(module), units=tuple(units), index=source,
        module_runs=module_runs(index),
    )


# ---- ZeRO-3 -----------------------------------------------------------------------------------------


def _plan_zero3(index: ModelParallelCheckpoint, source: ZeroCheckpoint, world_size: int) -> DataParallelPlan:
    by_name = source.param_by_name
    n_tensors = source.tensors_per_partition
    flats, flat_shapes = zero3_flats([[by_name[n] for n in group.params] for group in source.groups], world_size,
                                     ModelRuns(index).copies, sub_group_size=sub_group_size(source.zero_config))
    units = []
    for r in range(world_size):
        moved = sum(c.numel for f in flats[r] for c in f.copies)
        units.append(RankUnit(
            rank=r, meta_rank=_meta(index, r), optim_file=optim_file_name(source.precision, r),
            model_file=model_file_name(3, r), flats=tuple(flats[r]),
            read_bytes=4 * n_tensors * moved + source.buffer_bytes,
            write_bytes=4 * n_tensors * sum(f.numel for f in flats[r]) + source.buffer_bytes,
        ))
    return DataParallelPlan(
        root=index.root, tag=index.tag, stage=3, precision=source.precision, optimizer=ZERO3,
        source_world_size=index.world_size, world_size=world_size, flat_shapes=tuple(flat_shapes),
        param_alignment_paddings=(), module=(), units=tuple(units), index=source,
    )


__all__ = ["plan_tensor_parallel_merge"]
