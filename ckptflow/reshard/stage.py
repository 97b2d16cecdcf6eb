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
  rank 0's model-states file with the whole module: its 16-bit copy of the trainable parameters, the
  fp32 masters cast as DeepSpeed casts them after every step (round to nearest even; for fp32
  training, the masters themselves), and the frozen ones joined from their pieces.

- BF16_Optimizer (bf16 ZeRO-1 with fp32 gradient accumulation) -> ZeRO-2/3: the same config gets
  DeepSpeed's ZeRO optimizers there; its flat groups (no alignment, padding on the last rank) are read
  through their fragments like any source, by the rules above, the module's bf16 copy its own. And
  back: ZeRO-2/3 -> ZeRO-1 where the recorded config gets BF16_Optimizer there
  (`flats.target_optimizer`), whichever optimizer wrote the source: its flat groups laid out as
  BF16_Optimizer's from the fragments, the module's bf16 copy the source's own (from ZeRO-3, cast from
  the masters), the optimizer state re-keyed as BF16_Optimizer saves it (`files._other_optimizer`);
  AutoTP per tensor-parallel rank too (`plan_model_parallel_stage`), and merged to tensor-parallel
  degree 1 or split to another (`tensor_parallel`).
- ZeRO-0 -> ZeRO-1/2/3 (`plan_zero0_stage`): the optimizer state, saved by position, named first
  (`readers.zero0.named_groups`); then each master is a partition of its own and the rules above
  apply, the ZeRO-1/2 module copy the source module's own weights. An AutoTP one with another
  tensor-parallel degree too: each rank so named and read as partitions (`zero0_partitioned`), then
  split or merged by `tensor_parallel`.
  A ZeRO-0 PipelineModule goes to ZeRO-1 stage by stage the same way, each stage's module rebuilt from
  its layer files first (`pipeline_zero0`).

With `round_robin_gradients`, DeepSpeedZeroOptimizer flattens each group in round-robin order over its
ranks (an expert group's over its expert data-parallel group): ZeRO-3 takes the parameters in the
optimizer's own order (the round-robin undone, `ZeroCheckpoint.optimizer_order`), and a ZeRO-1/2
target flattens them round-robin at its own world size (`flats.zero12_flats`; an expert checkpoint's
groups each over its own target ranks, `flats.sharded_zero12_flats`; an AutoTP checkpoint's at another
tensor-parallel degree over the target's data-parallel ranks, each tensor-parallel rank's order undone
over its own, `tensor_parallel`).

Every target element is copied from the source fragments that hold it (`flats.fragment_copies`): the
parameter-relative ranges of both sides intersected, so each source element is read once. Sources with
ZeRO-3 sub-groups are refused, as are expert-parallel, pipeline and Megatron-style checkpoints. An
AutoTP checkpoint changes stage per tensor-parallel rank (`plan_model_parallel_stage`): each rank's
files are a data-parallel checkpoint of its shards; with another tensor-parallel degree too, from any
stage (BF16_Optimizer included), the tensor-parallel planner lays the target stage's flat groups out by
these rules over its shards (`tensor_parallel`: each target shard's elements copied from the source
fragments that hold them, the ZeRO-1/2 module from a ZeRO-3 source cast from the masters as above, the
target's optimizer `flats.target_optimizer`). AutoEP and deepspeed.moe checkpoints change between ZeRO-1
and ZeRO-2 in their own planners (`data_parallel.plan_expert_parallel`, `experts.plan_expert_degree`),
by the first rule, and from BF16_Optimizer (DeepSpeed builds it for MoE models too) to ZeRO-2 with the
flat groups laid out again (`experts.plan_expert_degree`); AutoEP moves from ZeRO-1/2 to ZeRO-3 by the
second, each expert-parallel rank's experts cut over its expert data-parallel group
(`plan_expert_zero3`), and back by the third with its per-expert files
(`experts.plan_expert_from_zero3`), at its own expert-parallel degree or another (`experts.at_degree`:
the source's index at the new degree, which ZeRO-3 -> ZeRO-3 at another degree goes through too);
`shape.why_not_expert_stage` says why not otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from ckptflow.errors import UnsupportedCheckpointError
from ckptflow.formats.deepspeed.config import is_set, sub_group_size
from ckptflow.formats.deepspeed.model import Buffer, Fragment, Param, ParamGroup, Partition, RankFiles, ZeroCheckpoint
from ckptflow.formats.deepspeed.names import model_file_name, optim_file_name
from ckptflow.formats.deepspeed.partition import BF16, ZERO, ZERO0, ZERO3, Copy, zero3_piece, zero3_real
from ckptflow.formats.deepspeed.readers.autotp import rejoined
from ckptflow.formats.deepspeed.readers.experts import ExpertCheckpoint
from ckptflow.formats.deepspeed.readers.model_parallel import ModelParallelCheckpoint
from ckptflow.formats.deepspeed.readers.zero0 import Zero0Checkpoint, Zero0Group, named_groups, zero_loss_scaler
from ckptflow.formats.deepspeed.runs import Run
from ckptflow.formats.torch.tensorref import DTYPE_SIZES, TensorRef, cast_view
from ckptflow.reshard.data_parallel import check_expert_stage, plan_data_parallel, plan_expert_parallel
from ckptflow.reshard.experts import at_degree
from ckptflow.reshard.flats import Copies, fragment_copies, frozen_copies, target_optimizer, zero3_flats, zero12_flats
from ckptflow.reshard.shape import Shape, why_not_zero0
from ckptflow.reshard.units import DataParallelPlan, FrozenPiece, ModelParallelPlan, RankUnit, TargetFlat


def plan_stage_change(index: ZeroCheckpoint, world_size: int, stage: int) -> DataParallelPlan:
    """The plan that writes the data-parallel ZeRO checkpoint `index` at ZeRO `stage` on `world_size`
    ranks; `UnsupportedCheckpointError` for what it does not convert (see the module's docstring)."""
    source = plan_data_parallel(index, index.world_size)  # the source checked against DeepSpeed's arithmetic
    optimizer = target_optimizer(source.optimizer, index.stage, stage, index.ds_config)
    if stage == 3:
        return _to_zero3(index, world_size)
    if source.optimizer == optimizer == ZERO:
        same = plan_data_parallel(index, world_size)
        return replace(same, stage=stage)
    # Laid out again from the fragments: the module's 16-bit copy the source's own, cast from the masters
    # from ZeRO-3 (which saves none).
    return _to_zero12(index, world_size, stage, optimizer=optimizer)


def plan_zero0_stage(index: Zero0Checkpoint, world_size: int, stage: int) -> DataParallelPlan:
    """The plan that writes the ZeRO-0 checkpoint `index` at ZeRO `stage` on `world_size` ranks: its
    optimizer state named (`readers.zero0.named_groups`; `UnsupportedCheckpointError` where it cannot
    be), then laid out as from a source whose every parameter is a partition of its own
    (`zero0_source`): the fp32 masters the module's weights (an fp32 run) or FP16_Optimizer's flat
    masters (bf16), the moments and each group's step the optimizer's. The module's own weights are
    the ZeRO-1/2 target's 16-bit (or fp32) copies."""
    _check_zero0(index)
    named = named_groups(index)
    assert not isinstance(named, str), "why_not_zero0 names them"
    source = zero0_source(index, *named)
    optimizer = target_optimizer(ZERO0, 0, stage, source.ds_config)  # the one the recorded config gets there
    plan = _to_zero3(source, world_size) if stage == 3 else _to_zero12(source, world_size, stage, optimizer=optimizer)
    return replace(plan, source_world_size=index.world_size, source_optimizer=ZERO0)


def zero0_partitioned(index: ModelParallelCheckpoint) -> ModelParallelCheckpoint:
    """The ZeRO-0 AutoTP checkpoint `index` as the tensor-parallel planners read a ZeRO-1/2/3 one: each
    tensor-parallel rank's optimizer state named (`UnsupportedCheckpointError` where it cannot be, as
    `plan_zero0_stage`), the rank the partitioned checkpoint `zero0_source` makes of it (one copy of
    the state: data-parallel size 1), the full tensors joined again from its masters
    (`readers.autotp.rejoined`). A plan made from it records the source's own data-parallel size and
    optimizer (`partition.ZERO0`)."""
    ranks = []
    for rank in index.ranks:
        _check_zero0(rank)
        named = named_groups(rank)
        assert not isinstance(named, str), "why_not_zero0 names them"
        ranks.append(zero0_source(rank, *named))
    return replace(rejoined(index, ranks), world_size=1)


def _check_zero0(index: Zero0Checkpoint) -> None:
    why = why_not_zero0(index)
    if why is not None:
        raise UnsupportedCheckpointError(f"{index.tag_uri}: {why}", uri=index.root,
                                         hint="consolidate its weights (`ckptflow consolidate`) and start the "
                                              "optimizer afresh, or resume it at ZeRO-0")


def zero0_source(index: Zero0Checkpoint, groups: Sequence[Zero0Group], frozen: Sequence[str]) -> ZeroCheckpoint:
    """`index` as a data-parallel ZeRO index at one rank, for the ZeRO-3 and ZeRO-1/2 layouts above: its
    masters are the partitions, virtual rank k's partition of group g the group's k-th master (a group
    with fewer repeats its last, which no copy reads), each parameter one fragment of its master
    (16-bit: of the group's flat master, end to end). The optimizer file is what DeepSpeedZeroOptimizer
    would save over it, less what `reshard.files` adds for any source that lacks it (the loss scaler, but
    for fp16: FP16_Optimizer's scale carried, `readers.zero0.zero_loss_scaler`):
    its base state's moments rank 0's, for their dtype, the step the group's; the model states
    ZeRO-1's (no `optimizer`, the tied aliases in model-parallel rank 0's `shared_params`)."""
    tensors = {t.name: t for t in index.tensors}
    module = index.model_states["module"]
    ranks = max(len(g.masters) for g in groups)
    partitions = tuple(tuple(Partition(rank=k, group=gi, numel=g.masters[min(k, len(g.masters) - 1)].numel,
                                       padding=0, fp32=g.masters[min(k, len(g.masters) - 1)],
                                       state=g.states[min(k, len(g.masters) - 1)])
                             for gi, g in enumerate(groups)) for k in range(ranks))
    params = []
    for gi, g in enumerate(groups):
        offset = 0
        for j, name in enumerate(g.params):
            t = tensors[name]
            flat = len(g.masters) == 1
            params.append(Param(name, t.shape, t.dtype, gi, (Fragment(rank=0 if flat else j, group=gi,
                                                                      offset=offset if flat else 0, numel=t.numel,
                                                                      param_offset=0),)))
            offset += t.numel
    params += [Param(n, tensors[n].shape, tensors[n].dtype, None, frozen_pieces=(module[n],)) for n in frozen]
    order = {t.name: i for i, t in enumerate(index.tensors)}
    params.sort(key=lambda p: order[p.name])
    base_state = {gi: {k: g.step if k == "step" else v for k, v in partitions[0][gi].state.items()}
                  for gi, g in enumerate(groups) if partitions[0][gi].state}
    model0 = index.model_states
    osd: dict[str, Any] = {  # the loss scaler and the rest `files` fills in
        "base_optimizer_state": {"state": base_state,
                                 "param_groups": [{**g.hyper, "params": [gi]} for gi, g in enumerate(groups)]},
        "ds_version": model0.get("ds_version"),
    }
    scaler = zero_loss_scaler(index)  # fp16: FP16_Optimizer's scale carried; else `files` writes a static 1
    assert not isinstance(scaler, str), "why_not_zero0 checks it"
    osd.update(scaler or {})
    optimizer = model0.get("optimizer")
    if isinstance(optimizer, Mapping) and "clip_grad" in optimizer:  # FP16_Optimizer's; else the recorded config's
        osd["clip_grad"] = optimizer["clip_grad"]
    # DeepSpeed records the tied aliases on global rank 0 only: in model-parallel rank 0's files.
    shared = dict(index.tied) if index.mp_rank == 0 else {}
    states = {k: None if k == "optimizer" else shared if k == "shared_params" else v for k, v in model0.items()}
    return ZeroCheckpoint(
        root=index.root, tag=index.tag, stage=0, world_size=1, precision=index.precision, step=index.step,
        ds_version=index.ds_version, files=(RankFiles(0, index.model_file, index.model_file),),
        params=tuple(params), buffers=tuple(Buffer(t.name, t.runs[0].ref) for t in index.tensors if t.kind == "buffer"),
        tied=index.tied, groups=tuple(ParamGroup(gi, g.hyper, g.params) for gi, g in enumerate(groups)),
        partitions=partitions, module_order=tuple(order), model_states=(states,),
        optim_states=({"optimizer_state_dict": osd, "ds_config": model0.get("ds_config"),
                       "ds_version": model0.get("ds_version")},),
        mp_rank=index.mp_rank,
    )


def plan_model_parallel_stage(index: ModelParallelCheckpoint, world_size: int, stage: int) -> ModelParallelPlan:
    """An AutoTP checkpoint at ZeRO `stage`: each tensor-parallel rank's data-parallel checkpoint changed
    alone (`plan_stage_change`), its `mp_rank_XX` files side by side; the split metadata carried."""
    parts = tuple(plan_zero0_stage(rank, world_size, stage) if rank.kind == "zero0"
                  else plan_stage_change(rank, world_size, stage) for rank in index.ranks)
    return ModelParallelPlan(
        root=index.root, tag=index.tag, stage=stage, precision=index.precision, source_world_size=index.world_size,
        world_size=world_size, parts=parts, carried=index.carried, index=index,
    )


def _copies(index: ZeroCheckpoint) -> Copies:
    """`flats.Copies` out of `index`'s fragments: every trainable parameter's, in parameter order."""
    return _copies_of([p for p in index.params if not p.frozen])


def _copies_of(params: Sequence[Param]) -> Copies:
    """`flats.Copies` out of the fragments of `params` (by name: one expert-parallel rank's copy of each)."""
    fragments = {p.name: sorted(p.fragments, key=lambda f: f.param_offset) for p in params}
    starts = {name: [f.param_offset for f in frags] for name, frags in fragments.items()}
    return lambda name, _group, first, last, dst: fragment_copies(fragments[name], first, last, dst, starts[name])


def _to_zero3(index: ZeroCheckpoint, world_size: int) -> DataParallelPlan:
    by_name = index.param_by_name
    groups = [[by_name[n] for n in index.optimizer_order(group)] for group in index.groups]
    per_rank, flat_shapes = zero3_flats(groups, world_size, _copies(index),
                                        sub_group_size=sub_group_size(index.zero_config))
    return _zero3_plan(index, world_size, per_rank, flat_shapes)


def plan_expert_zero3(source: ExpertCheckpoint, shape: Shape) -> DataParallelPlan:
    """The AutoEP checkpoint `source` (ZeRO-1/2, or ZeRO-3 at another expert-parallel degree) at ZeRO-3
    on `shape.world_size` ranks and expert-parallel degree `shape.ep`. As `DeepSpeedZeroOptimizer_Stage3`
    partitions an AutoEP model (`engine._resolve_zero3_param_placement`): a dense group over every
    rank, an expert group's copy of expert-parallel rank e over that rank's expert data-parallel group
    (M / N ranks), each cut into ZeRO-3 pieces; no per-expert files (`readers.autoep`: ZeRO-3 keeps the
    experts in the partitions). Another degree is the source's index at that degree
    (`experts.at_degree`), whose parameters name the source fragments that hold them."""
    zero = source.zero
    assert zero is not None and source.kind == "autoep", "the shape check refuses other sources"
    assert zero.stage in (1, 2) or shape.ep != source.ep, "a ZeRO-3 source at its own degree is a data-parallel reshard"
    check_expert_stage(source, 3)
    plan_expert_parallel(source, zero.world_size)  # the source checked against DeepSpeed's arithmetic
    index = at_degree(source, shape)
    world_size = shape.world_size
    by_key = index.param_by_key
    per_rank: list[list[TargetFlat]] = [[] for _ in range(world_size)]
    flat_shapes: list[tuple[tuple[str, tuple[int, ...]], ...]] = []
    for g, group in enumerate(index.groups):
        for shard in range(group.ep):
            params = [by_key[(shard, n)] for n in group.params]
            laid, shapes = zero3_flats([params], world_size // group.ep, _copies_of(params),
                                       sub_group_size=sub_group_size(index.zero_config))
            for part, r in enumerate(group.ranks(world_size, shard)):
                per_rank[r] += [replace(f, group=g) for f in laid[part]]
        flat_shapes += shapes  # the same shapes on every expert-parallel rank
    plan = _zero3_plan(index, world_size, tuple(map(tuple, per_rank)), tuple(flat_shapes))
    # A rank past the source's copies the scalars of one of the source's expert-parallel rank's.
    units = tuple(replace(u, meta_rank=u.rank if u.rank < zero.world_size else u.rank % source.ep)
                  for u in plan.units)
    return replace(plan, units=units, group_ep=tuple(g.ep for g in index.groups))


def _zero3_plan(index: ZeroCheckpoint, world_size: int, per_rank: Sequence[Sequence[TargetFlat]],
                flat_shapes: Sequence[tuple[tuple[str, tuple[int, ...]], ...]]) -> DataParallelPlan:
    """The ZeRO-3 plan of `index` at `world_size` whose ranks hold the flats `per_rank`: each rank's
    model-states file with its pieces of the frozen parameters."""
    n_tensors = index.tensors_per_partition
    frozen = [p for p in index.params if p.frozen]
    units = []
    for r in range(world_size):
        pieces = []
        for p in frozen:
            piece = zero3_piece(p.numel, world_size)
            lo = r * piece
            pieces.append(FrozenPiece(name=p.name, numel=piece, copies=tuple(frozen_copies(
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
        param_alignment_paddings=(), module=(), units=tuple(units), index=index,
        source_optimizer=index.optimizer_kind,
    )


def _to_zero12(index: ZeroCheckpoint, world_size: int, stage: int, *, optimizer: str = ZERO) -> DataParallelPlan:
    """`index`'s fragments to `optimizer`'s flat groups at `world_size` (`DeepSpeedZeroOptimizer`, or
    `BF16_Optimizer` at ZeRO-1: `flats.target_optimizer`); rank 0 writes the module, its trainable
    parameters cast from the masters from ZeRO-3 (which saves none), else the source module's own."""
    copies_of = _copies(index)
    by_name = index.param_by_name
    n_tensors = index.tensors_per_partition
    laid = zero12_flats([[by_name[n] for n in group.params] for group in index.groups], world_size, copies_of,
                        aligned=is_set(index.zero_config, "parameter_alignment"), bf16=optimizer == BF16,
                        round_robin=index.flattens_round_robin(optimizer))
    flats, paddings, slices = laid.flats, laid.paddings, laid.slices
    # The module's copy of every trainable parameter: the fp32 masters from the ranks' partitions, cast to
    # the training dtype on the way as DeepSpeed copies them after each step (`tensorref.cast_view`).
    def master(param: Param, c: Copy) -> TensorRef:
        ref = index.partitions[c.src_rank][c.src_flat].fp32
        return ref if param.dtype == "float32" else cast_view(ref, param.dtype)

    module_runs = {} if index.stage != 3 else {
        p.name: tuple(Run(ref=master(p, c), start=c.src_offset, numel=c.numel, offset=c.dst_offset)
                      for c in copies_of(p.name, g, 0, p.numel, 0))
        for g, group in enumerate(index.groups) for p in (by_name[n] for n in group.params)
    }
    frozen = [p for p in index.params if p.frozen]
    whole = tuple(FrozenPiece(name=p.name, numel=p.numel,
                              copies=tuple(frozen_copies(p, index.stage, index.world_size, 0, p.numel, 0)))
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
        root=index.root, tag=index.tag, stage=stage, precision=index.precision, optimizer=optimizer,
        source_world_size=index.world_size, world_size=world_size, flat_shapes=laid.shapes,
        param_alignment_paddings=laid.param_paddings, module=laid.module, units=tuple(units), index=index,
        module_runs=module_runs, source_optimizer=index.optimizer_kind,
    )


__all__ = ["plan_expert_zero3", "plan_model_parallel_stage", "plan_stage_change", "plan_zero0_stage",
           "zero0_partitioned", "zero0_source"]
