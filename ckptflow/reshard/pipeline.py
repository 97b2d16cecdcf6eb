"""Changing a PipelineModule checkpoint's number of pipeline stages: pp N x dp D -> pp M x dp E. Pure.

What DeepSpeed 0.19.8 saves for a PipelineModule (`runtime/pipe/module.py`, `runtime/engine.py`):
per layer `layer_{XX}-model_states.pt` (the layer's own state dict, independent of the stage count:
carried as they are), and per stage an ordinary data-parallel ZeRO-1 checkpoint
(`mp_rank_{stage:02d}_model_states.pt` with `module: None`, `zero_pp_rank_{dp}_mp_rank_{stage:02d}_optim_states.pt`)
whose param groups flatten the stage module's `parameters()`: the tied modules first (the
`tied_modules` ModuleDict is registered before the layers, each key where the stage first uses it),
then the layers `{layer}.{name}` in layer order, each split over the client's groups in that order.

A target stage's groups are rebuilt from the parameters it owns in that order, group by group (a
parameter keeps the group it had in the source; every stage must have the same groups), laid out by
DeepSpeed's ZeRO-1 arithmetic at E ranks; the fp32 masters and Adam moments are element copies out
of the source stages' partitions (a tied module's from the lowest stage that trains it, its copies
being equal). The model file of each stage records its own `buffer_names`, `param_shapes`,
`mp_world_size` (tp x pp) and `checkpoint_parallel_dimensions`. As in `tensor_parallel`, each target
stage is an ordinary `DataParallelPlan` over a virtual `ZeroCheckpoint` whose rank `s * D + d` is source
stage s's data-parallel rank d, so `reshard.files` writes it unchanged.

Which layers a target stage holds is what `PipelineModule._partition_layers` decides from the layer
list, which no file records: a layer that is a function, and a tied module's later uses with a
`forward_fn`, save nothing, so neither the number of layers nor their parameter counts (method
`parameters` counts a tied module at every use) can be read back. Merging every stage into one (pp1)
needs none of it, and is what ckptflow writes; other stage counts are refused (`shape.why_not`).
Megatron-style tensor parallelism inside the stages, ZeRO-0, frozen parameters and
`round_robin_gradients` are refused too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from ckptflow.errors import UnsupportedCheckpointError, option
from ckptflow.formats.deepspeed.config import is_set
from ckptflow.formats.deepspeed.model import Param, ParamGroup, ZeroCheckpoint
from ckptflow.formats.deepspeed.names import model_file_name, optim_file_name
from ckptflow.formats.deepspeed.partition import BF16, ZERO3
from ckptflow.formats.deepspeed.readers.model_parallel import ModelParallelCheckpoint
from ckptflow.reshard.data_parallel import plan_data_parallel
from ckptflow.reshard.flats import ModelRuns, zero12_flats
from ckptflow.reshard.shape import PIPELINE_STAGES, Shape
from ckptflow.reshard.units import DataParallelPlan, ModelParallelPlan, RankUnit

TIED = "tied_modules."

def plan_pipeline(index: Any, shape: Shape) -> ModelParallelPlan:
    """The plan that writes the PipelineModule checkpoint `index` at `shape` (pp1 x dp E); reads nothing.
    `UnsupportedCheckpointError`, in one line saying why and what would work, for anything else."""
    where = f"{index.root}/{index.tag}"
    if not isinstance(index, ModelParallelCheckpoint) or index.kind != "pipeline":
        kind = getattr(index, "layout", type(index).__name__)
        raise UnsupportedCheckpointError(
            f"{where} is a checkpoint in the {kind} layout; ckptflow changes the number of pipeline stages of plain "
            "PipelineModule checkpoints only (no tensor parallelism inside the stages)", code="unsupported-layout",
            uri=index.root, hint=f"keep the number of pipeline stages (leave {option('pp')} out)")
    if shape.pp != 1 or shape.tp != 1:
        raise UnsupportedCheckpointError(f"cannot write {where} at {shape}: {PIPELINE_STAGES}",
                                         code="unsupported-shape", uri=index.root, hint=f"use {option('pp')} 1")
    if index.stage != 1:
        raise UnsupportedCheckpointError(
            f"{where} is a ZeRO-{index.stage} PipelineModule checkpoint; ckptflow moves the optimizer state of ZeRO-1 "
            "ones between stages (a ZeRO-0 optimizer state names no parameter)", uri=index.root)
    ranks: Sequence[ZeroCheckpoint] = index.ranks
    for rank in ranks:  # the source's layout must be DeepSpeed's arithmetic at its size (refused otherwise)
        plan_data_parallel(rank, rank.world_size)
    _check_stages(index, ranks)
    names = _stage_order(ranks)
    source = _merged_source(index, ranks, names, shape)
    part = _plan_stage(index, source, shape.dp, mp_rank=0)
    return ModelParallelPlan(
        root=index.root, tag=index.tag, stage=index.stage, precision=index.precision,
        source_world_size=index.world_size, world_size=shape.dp, parts=(part,), carried=index.carried, index=index,
    )


# ---- the source stages ---------------------------------------------------------------------------------


def _check_stages(index: ModelParallelCheckpoint, ranks: Sequence[ZeroCheckpoint]) -> None:
    where = f"{index.root}/{index.tag}"
    first = ranks[0]
    frozen = [p.name for rank in ranks for p in rank.params if p.frozen]
    if frozen:
        raise UnsupportedCheckpointError(f"{where} has frozen parameters ({', '.join(frozen[:3])}), which ckptflow "
                                         "does not move between pipeline stages", uri=index.root,
                                         hint=f"keep the number of pipeline stages (leave {option('pp')} out)")
    if is_set(first.zero_config, "round_robin_gradients"):
        raise UnsupportedCheckpointError(f"{where} was trained with zero_optimization.round_robin_gradients, whose "
                                         "flattening order ckptflow does not rebuild for new stages", uri=index.root)
    if first.optimizer_kind == ZERO3:
        raise UnsupportedCheckpointError(f"{where}: a PipelineModule does not train at ZeRO-3", uri=index.root)
    hypers = [[{k: v for k, v in g.hyper.items() if k != "params"} for g in rank.groups] for rank in ranks]
    for s, hyper in enumerate(hypers[1:], start=1):
        if hyper != hypers[0]:
            raise UnsupportedCheckpointError(
                f"{where}: pipeline stage {s} has other optimizer param groups than stage 0 ({len(hyper)} vs "
                f"{len(hypers[0])} groups, or other hyper-parameters), so the stages' groups cannot be joined",
                uri=index.root, hint=f"keep the number of pipeline stages (leave {option('pp')} out)")
    owner: dict[str, int] = {}
    for rank in ranks:
        for p in rank.params:
            if owner.setdefault(p.name, -1 if p.group is None else p.group) != p.group:
                raise UnsupportedCheckpointError(
                    f"{where}: {p.name} sits in param group {owner[p.name]} on one pipeline stage and {p.group} on "
                    "another, so the stages' groups cannot be joined", uri=index.root, tensor=p.name)


def _layer_of(name: str) -> int:
    head = name.split(".", 1)[0]
    return int(head) if head.isdigit() else -1


def _stage_order(ranks: Sequence[ZeroCheckpoint]) -> list[list[str]]:
    """Per param group, the merged stage's parameters in `PipelineModule.parameters()` order: tied
    modules first (in the order the stages first use them: the first stage holding a key, its place in
    that stage's group, which holds every tied module of the group that stage uses), then the layers in
    layer order, a layer's parameters in the order its stage had them."""
    out = []
    for g in range(len(ranks[0].groups)):
        first_use: dict[str, tuple[int, int]] = {}
        for s, rank in enumerate(ranks):
            for pos, name in enumerate(rank.groups[g].params):
                if name.startswith(TIED):
                    first_use.setdefault(_tied_key(name), (s, pos))

        def place(name: str, first_use: dict[str, tuple[int, int]] = first_use) -> tuple[int, int, int]:
            return (0, *first_use[_tied_key(name)]) if name.startswith(TIED) else (1, _layer_of(name), 0)

        merged = list(dict.fromkeys(n for rank in ranks for n in rank.groups[g].params))
        out.append(sorted(merged, key=place))  # stable: a module's parameters keep their stage's order
    return out


def _tied_key(name: str) -> str:
    return name[len(TIED):].partition(".")[0]


def _buffer_names(ranks: Sequence[ZeroCheckpoint]) -> list[str]:
    """`buffer_names` as the merged stage's module records them: tied modules' first, then by layer."""
    names = dict.fromkeys(n for rank in ranks for n in rank.model_states[0].get("buffer_names") or []
                          if isinstance(n, str))
    return sorted(names, key=lambda n: (not n.startswith(TIED), _layer_of(n)))


def _stage_states(state: Mapping[str, Any], shape: Shape, buffers: list[str]) -> dict[str, Any]:
    out = dict(state)
    out["buffer_names"] = list(buffers)
    if "mp_world_size" in out:
        out["mp_world_size"] = shape.tp * shape.pp
    dims = out.get("checkpoint_parallel_dimensions")
    if isinstance(dims, Mapping):
        out["checkpoint_parallel_dimensions"] = {**dims, "pp_degree": shape.pp}
    return out


def _merged_source(index: ModelParallelCheckpoint, ranks: Sequence[ZeroCheckpoint], names: list[list[str]],
                   shape: Shape) -> ZeroCheckpoint:
    """A `ZeroCheckpoint` whose rank `s * D + d` is source stage s's data-parallel rank d, holding the
    merged stage's parameters and groups, and its model-file fields."""
    first = ranks[0]
    full = {t.name: t for t in index.tensors}
    dtype = {p.name: p.dtype for rank in ranks for p in rank.params}
    params = tuple(Param(n, full[n].shape, dtype[n], g) for g, group in enumerate(names) for n in group)
    groups = tuple(ParamGroup(g.index, g.hyper, tuple(names[g.index])) for g in first.groups)
    buffers = _buffer_names(ranks)
    return replace(
        first, params=params, groups=groups, tied={},
        buffers=tuple(b for rank in ranks for b in rank.buffers),
        partitions=tuple(part for rank in ranks for part in rank.partitions),
        files=tuple(f for rank in ranks for f in rank.files),
        model_states=tuple(_stage_states(m, shape, buffers) for rank in ranks for m in rank.model_states),
        optim_states=tuple(o for rank in ranks for o in rank.optim_states),
        module_order=tuple(n for group in names for n in group),
    )


# ---- one target stage ----------------------------------------------------------------------------------


def _plan_stage(index: ModelParallelCheckpoint, source: ZeroCheckpoint, world_size: int, *, mp_rank: int
                ) -> DataParallelPlan:
    """The target stage's ZeRO-1 files at `world_size` data-parallel ranks: each group flattened from its
    parameters in order, partitioned by DeepSpeed's arithmetic, filled by copies from the source stages."""
    by_name = source.param_by_name
    optimizer = source.optimizer_kind
    n_tensors = source.tensors_per_partition
    laid = zero12_flats([[by_name[n] for n in group.params] for group in source.groups], world_size,
                        ModelRuns(index).copies, aligned=is_set(source.zero_config, "parameter_alignment"),
                        bf16=optimizer == BF16)
    flats, paddings, slices = laid.flats, laid.paddings, laid.slices
    flat_shapes, param_paddings = laid.shapes, laid.param_paddings
    units = []
    for r in range(world_size):
        moved = sum(c.numel for f in flats[r] for c in f.copies)
        units.append(RankUnit(
            rank=r, meta_rank=min(r, index.world_size - 1), optim_file=optim_file_name(source.precision, r, mp_rank),
            model_file=model_file_name(source.stage, 0, mp_rank) if r == 0 else None, flats=tuple(flats[r]),
            group_paddings=tuple(paddings[r]), slice_mappings=tuple(slices[r]), mp_rank=mp_rank,
            read_bytes=4 * n_tensors * moved, write_bytes=4 * n_tensors * sum(f.numel for f in flats[r]),
        ))
    return DataParallelPlan(
        root=index.root, tag=index.tag, stage=source.stage, precision=source.precision, optimizer=optimizer,
        source_world_size=index.world_size, world_size=world_size, flat_shapes=tuple(flat_shapes),
        param_alignment_paddings=tuple(param_paddings), module=(), units=tuple(units), index=source,
    )


__all__ = ["plan_pipeline"]
