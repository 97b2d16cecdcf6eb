"""Changing the expert-parallel degree of an AutoEP or deepspeed.moe checkpoint. Pure.

At expert-parallel degree N over M data-parallel ranks, DeepSpeed 0.19.8 (default topology,
`groups._create_expert_and_data_parallel`) makes rank r expert-parallel rank `r % N` and partition
`r // N` of its expert data-parallel group; expert-parallel rank e holds the layer's experts
`e * E/N ... (e + 1) * E/N - 1` in that order (AutoEP's `legacy_uniform_autoep_placement_descriptor`,
deepspeed.moe's `global = ep_rank * num_local_experts + local`). What that means in the files:

- AutoEP: each expert weight is one stacked parameter `{layer}.experts.w{1,2,3}` of shape
  `[E/N, ...]` in the `ep_size_N` param group; at N' its rows are the experts of the new
  expert-parallel rank, taken from whichever source rank held each.
- deepspeed.moe: each local expert is its own parameters `...deepspeed_experts.{local}.{name}`; at N'
  the group holds locals 0 .. E/N' - 1 of each layer, in the same order (layer, local, name).
- Both: the expert groups are named `ep_size_{N'}` and partitioned over M / N' ranks
  (`partition_count`); the per-expert files `layer_{L}_expert_{E}` name global experts and are
  carried as they are; AutoEP's `ds_autoep_layers` (and its copy in `universal_checkpoint_info`)
  record N', `num_local_experts`, the placement and its affine maps, the group name and rank 0's
  expert-parallel coordinates; `expert_parallel.autoep_size` in the recorded config is N'.
- Both: DeepSpeed cuts an expert group by its rank-local size (`moe_cut`), which changes with the
  degree: the pieces of each source group are joined, the whole rebuilt at N' and cut again as
  DeepSpeed cuts it there, each target group with its source group's hyper-parameters and optimizer
  scalars (`ParamGroup.index` names that group), its flat partitions, paddings and partition counts
  laid out by the stage's planner as for any group.

- Both, trained with `round_robin_gradients`: DeepSpeedZeroOptimizer flattens each group round-robin
  over the ranks that partition it, an expert group's over its expert data-parallel group (M / N; its
  `_configure_moe_settings` sets that group before the groups are flattened), a dense group's over all
  M. `at_degree` starts from the source with that order undone per group over the group's own
  source ranks (`ZeroCheckpoint.in_optimizer_order`); `_plan` flattens each group round-robin again
  over its target ranks (`flats.sharded_zero12_flats`), its `param_slice_mappings` in the optimizer's
  order (`partition.recorded_slices`), and ZeRO-3 (which ignores the setting) takes the optimizer's
  order.
  A ZeRO-3 or BF16_Optimizer source, which ignore it, is flattened round-robin at a ZeRO-1/2 target
  whose config asks for it, as DeepSpeed does.

The plan is an ordinary plan of the target stage over a virtual source (`at_degree`): the source's
ZeRO index at N', its expert parameters at their new shapes, each with the fragments of the source
ranks' fp32 partitions that hold its elements (`Param.fragments`, composed through the source
parameters its rows come from), and that metadata rewritten for N', so the stage planners and
`reshard.files` use it as any source. Before that the source is checked to be laid out as DeepSpeed's
arithmetic predicts (`data_parallel.plan_expert_parallel` at its own size). The stage planners:
`plan_expert_degree` here for ZeRO-1/2 (and the other of ZeRO-1 and ZeRO-2: the same flat partitions,
only the recorded stage differs, or laid out again where BF16_Optimizer saved the source or DeepSpeed
builds it at the target from the recorded config, `flats.target_optimizer`: it partitions each expert
group over its expert data-parallel group, as DeepSpeedZeroOptimizer does), `plan_expert_from_zero3`
from AutoEP ZeRO-3 to ZeRO-1/2 (each expert's own file written again, by the target expert-parallel rank
holding it; BF16_Optimizer's at ZeRO-1 where the recorded config gets it) and
`stage.plan_expert_zero3` to AutoEP ZeRO-3 (from ZeRO-1/2, or from ZeRO-3 at another degree), and
`plan_moe_zero0` from deepspeed.moe ZeRO-0 to ZeRO-1/2 (its optimizer state named first,
`readers.moe.zero0_index`: the virtual source whose partitions are its masters). Refused
in one line: `deepspeed.moe` at ZeRO-3 (DeepSpeed refuses it), a placement other than DeepSpeed's
uniform one, degrees that do not divide every layer's experts, and a source
whose cuts leave the size limit open where the limits they allow cut the target differently.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ckptflow.errors import UnsupportedCheckpointError
from ckptflow.formats.deepspeed.config import is_set
from ckptflow.formats.deepspeed.model import Fragment, Param, ParamGroup, ZeroCheckpoint
from ckptflow.formats.deepspeed.names import UC_INFO, expert_file_name, model_file_name, optim_file_name
from ckptflow.formats.deepspeed.partition import BF16, ZERO0, Copy
from ckptflow.formats.deepspeed.readers.autoep import ROUTER, WEIGHTS
from ckptflow.formats.deepspeed.readers.experts import ExpertCheckpoint
from ckptflow.formats.deepspeed.readers.moe import zero0_index
from ckptflow.formats.deepspeed.runs import Run, slice_runs
from ckptflow.formats.torch.tensorref import DTYPE_SIZES
from ckptflow.reshard.data_parallel import check_expert_stage, plan_expert_parallel
from ckptflow.reshard.flats import (
    Copies,
    cast_runs,
    fragment_copies,
    frozen_copies,
    sharded_zero12_flats,
    target_optimizer,
)
from ckptflow.reshard.moe_cut import DSMOE_EXPERT, expert_runs, is_expert, plan_recut
from ckptflow.reshard.shape import Shape, expert_counts
from ckptflow.reshard.units import DataParallelPlan, FrozenPiece, RankUnit, TensorFile

_AUTOEP_EXPERT = re.compile(r"^(?P<layer>.+\.experts)\.(?P<w>w[123])$")
_ROUTER_ALIAS = re.compile(r"^(?P<path>.+)\.gate\.gate\.(?P<rest>weight|bias)$")  # the presets' router name, "gate"


# ---- what the target holds -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Segment:
    """Elements [src_offset, src_offset + numel) of source parameter `src` land at `dst_offset` of a
    target parameter."""

    dst_offset: int
    src: Param
    src_offset: int
    numel: int


@dataclass(frozen=True)
class _TargetGroup:
    """One param group at the target degree `ep`: its parameters in flattening order, their shapes (the
    same on every expert-parallel rank), and where each (expert-parallel rank, name) comes from."""

    ep: int
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    segments: Mapping[tuple[int, str], tuple[_Segment, ...]]


def _refuse(source: ExpertCheckpoint, shape: Shape, why: str, hint: str) -> UnsupportedCheckpointError:
    return UnsupportedCheckpointError(
        f"cannot change the expert-parallel degree of {source.tag_uri} ({source.layout}) to {shape.ep}: {why}",
        code="unsupported-shape", uri=source.root, hint=hint)


def _numel(shape: Sequence[int]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def _autoep_group(zero: ZeroCheckpoint, run: Sequence[int], ep: int, counts: Sequence[int], source: ExpertCheckpoint,
                  shape: Shape) -> _TargetGroup:
    """An AutoEP `ep_size_N` group (the pieces `run` DeepSpeed cut it into, joined) at degree `ep`: each
    stacked weight holds that rank's experts."""
    g, src_ep, params = run[0], zero.groups[run[0]].ep, [n for i in run for n in zero.groups[i].params]
    by_key = zero.param_by_key
    layer_of = {}
    for entry in zero.model_states[0].get("ds_autoep_layers") or []:
        layer_of[f"{entry['expert_key_prefix']}"] = entry["moe_layer_id"]
    names, shapes, segments = [], [], {}
    for name in params:
        m = _AUTOEP_EXPERT.match(name)
        if m is None or m.group("layer") not in layer_of:
            raise _refuse(source, shape, f"{name} is in the expert param group {g} but is not an AutoEP routed expert "
                          "weight (`<layer>.experts.w1/w2/w3`)", "convert it with DeepSpeed's universal converter")
        experts = counts[layer_of[m.group("layer")]]
        src_local, dst_local = experts // src_ep, experts // ep
        first = by_key[(0, name)].shape
        block = _numel(first[1:])
        names.append(name)
        shapes.append((dst_local, *first[1:]))
        for e in range(ep):
            segs = []
            for j in range(dst_local):
                expert = e * dst_local + j
                segs.append(_Segment(j * block, by_key[(expert // src_local, name)], (expert % src_local) * block,
                                     block))
            segments[(e, name)] = tuple(segs)
    return _TargetGroup(ep, tuple(names), tuple(shapes), segments)


def _dsmoe_group(zero: ZeroCheckpoint, run: Sequence[int], ep: int, source: ExpertCheckpoint,
                 shape: Shape) -> _TargetGroup:
    """A deepspeed.moe `ep_size_N` group (the pieces `run` DeepSpeed cut it into, joined) at degree `ep`:
    locals 0 .. E/ep - 1 of each layer, in the source's order (layer, local expert, parameter)."""
    g, src_ep, params = run[0], zero.groups[run[0]].ep, [n for i in run for n in zero.groups[i].params]
    by_key = zero.param_by_key
    layers: dict[str, dict[int, list[str]]] = {}  # layer -> local id -> parameter names, in order
    order: list[tuple[str, int, str]] = []
    for name in params:
        m = DSMOE_EXPERT.match(name)
        if m is None:
            raise _refuse(source, shape, f"{name} is in the expert param group {g} but is not a deepspeed.moe expert "
                          "parameter", "convert it with DeepSpeed's universal converter")
        layers.setdefault(m.group("layer"), {}).setdefault(int(m.group("id")), []).append(m.group("rest"))
        order.append((m.group("layer"), int(m.group("id")), m.group("rest")))
    expected = [(layer, i, rest) for layer, local in layers.items() for i in range(len(local)) for rest in local[0]]
    if order != expected or any(local[i] != local[0] for local in layers.values() for i in local):
        label = zero.groups[g].hyper.get("name")
        raise _refuse(source, shape, f"param group {g} ({label!r}) does not list its experts "
                      "layer by layer, local expert by local expert, each with the same parameters, as deepspeed.moe's "
                      "split_params_into_different_moe_groups_for_optimizer does",
                      "convert it with DeepSpeed's universal converter")
    names, shapes, segments = [], [], {}
    for layer, local in layers.items():
        src_local = len(local)
        dst_local = src_local * src_ep // ep
        for j in range(dst_local):
            for rest in local[0]:
                names.append(f"{layer}.{j}.{rest}")
                shapes.append(by_key[(0, f"{layer}.0.{rest}")].shape)
        for e in range(ep):
            for j in range(dst_local):
                expert = e * dst_local + j
                for rest in local[0]:
                    src = by_key[(expert // src_local, f"{layer}.{expert % src_local}.{rest}")]
                    segments[(e, f"{layer}.{j}.{rest}")] = (_Segment(0, src, 0, src.numel),)
    return _TargetGroup(ep, tuple(names), tuple(shapes), segments)


_is_expert = is_expert


def _piece(group: _TargetGroup, start: int, count: int) -> _TargetGroup:
    """Parameters `start` .. `start + count - 1` of `group`: one of the groups DeepSpeed cuts it into."""
    names = group.names[start:start + count]
    return _TargetGroup(group.ep, names, group.shapes[start:start + count],
                        {key: segs for key, segs in group.segments.items() if key[1] in names})


def _dense_group(zero: ZeroCheckpoint, g: int) -> _TargetGroup:
    by_name = zero.param_by_name
    names = tuple(zero.groups[g].params)
    segments = {(0, n): (_Segment(0, by_name[n], 0, by_name[n].numel),) for n in names}
    return _TargetGroup(1, names, tuple(by_name[n].shape for n in names), segments)


# ---- the plan -----------------------------------------------------------------------------------------


def plan_expert_degree(source: ExpertCheckpoint, shape: Shape) -> DataParallelPlan:
    """The plan that writes the AutoEP or deepspeed.moe ZeRO-1/2 checkpoint `source` at `shape` (another
    expert-parallel degree, any data-parallel size it divides, and the other of ZeRO-1 and ZeRO-2 if
    asked); reads nothing."""
    zero = source.zero
    assert zero is not None and zero.stage in (1, 2), "ZeRO-3 sources go to plan_expert_from_zero3 or ZeRO-3's planner"
    if shape.tp != 1 or shape.pp != 1:
        raise _refuse(source, shape, "ckptflow does not change the expert-parallel degree together with other "
                      "degrees", "change one at a time")
    if shape.stage != zero.stage:
        check_expert_stage(source, shape.stage)
    plan_expert_parallel(source, zero.world_size)  # the source is laid out as DeepSpeed's arithmetic says, or refused
    return _plan(source, zero, at_degree(source, shape), shape)


def plan_moe_zero0(source: ExpertCheckpoint, shape: Shape) -> DataParallelPlan:
    """The plan that writes the deepspeed.moe ZeRO-0 checkpoint `source` at ZeRO-1 or ZeRO-2 (`shape.stage`),
    at its own expert-parallel degree or another, on any number of ranks it divides; reads nothing. Its
    optimizer state named (`readers.moe.zero0_index`: a virtual ZeRO index, every master a partition of
    its own), then laid out as from a ZeRO-1/2 source (`at_degree`, `_plan`): the module the source's,
    the optimizer files re-keyed as ZeRO-1/2 saves them (`files._other_optimizer`), the expert files
    carried. `UnsupportedCheckpointError` where the state cannot be named."""
    assert source.kind == "moe" and source.stage == 0 and shape.stage in (1, 2), "the shape check refuses the rest"
    if shape.tp != 1 or shape.pp != 1:
        raise _refuse(source, shape, "ckptflow does not change the expert-parallel degree together with other "
                      "degrees", "change one at a time")
    zero = zero0_index(source)
    if isinstance(zero, str):
        raise UnsupportedCheckpointError(f"cannot write {source.tag_uri} ({source.layout}) at ZeRO-{shape.stage}: "
                                         f"{zero}", code="unsupported-shape", uri=source.root,
                                         hint="consolidate its weights (`ckptflow consolidate`) and start the "
                                              "optimizer afresh, or resume it at ZeRO-0")
    virtual = replace(source, zero=zero)
    plan = _plan(virtual, zero, at_degree(virtual, shape), shape)
    return replace(plan, source_world_size=source.world_size, source_optimizer=ZERO0)


def at_degree(source: ExpertCheckpoint, shape: Shape) -> ZeroCheckpoint:
    """`source`'s ZeRO index as DeepSpeed records the checkpoint at expert-parallel degree `shape.ep`
    (the source's own at its degree): the target's parameters and param groups, each expert-group
    parameter's fragments composed of the source ranks' fragments that hold its elements (so a
    planner of the stage, `_plan` here or `stage.plan_expert_zero3`, copies them as from any
    source), and the metadata `reshard.files` copies into the new files; its partitions stay the
    source's. Each group lists its parameters in the optimizer's order (round-robin undone,
    `ZeroCheckpoint.in_optimizer_order`), at the source's degree too. Refused in one line where
    DeepSpeed's layout at `shape.ep` is not one ckptflow builds."""
    assert source.zero is not None, "a ZeRO-0 source has nothing to reshard"
    zero = source.zero.in_optimizer_order()  # round-robin undone: each group as the optimizer lists it
    if shape.ep == source.ep:
        return zero
    counts = expert_counts(source)
    bad = [n for n in counts if n % shape.ep]
    if not counts or bad:
        raise _refuse(source, shape, f"its MoE layers have {list(counts) or 'an unrecorded number of'} experts, which "
                      f"{shape.ep} expert-parallel ranks do not split evenly",
                      "choose a degree that divides every layer's experts")
    if source.kind == "autoep":
        _check_uniform_placement(source, shape)
    runs = expert_runs(zero)
    whole = {run: _autoep_group(zero, run, shape.ep, counts, source, shape) if source.kind == "autoep"
             else _dsmoe_group(zero, run, shape.ep, source, shape) for run in runs}
    cut = plan_recut(zero, shape.ep, [[_numel(s) for s in whole[run].shapes] for run in runs])
    if cut.why is not None:
        raise _refuse(source, shape, cut.why, "convert it with DeepSpeed's universal converter (ds_to_universal)")
    pieces = dict(zip(runs, cut.pieces))
    groups: list[tuple[_TargetGroup, int]] = []  # (the group at the target, the source group it carries)
    for g in range(len(zero.groups)):
        run = next((r for r in runs if g in r), None)
        if run is None:
            groups.append((_dense_group(zero, g), g))
        elif g == run[0]:
            start = 0
            for count in pieces[run]:
                groups.append((_piece(whole[run], start, count), g))
                start += count
    if len(groups) != len(zero.groups) and zero.stage == 3 and any(len(p) != len(zero.groups) for p in zero.partitions):
        raise _refuse(source, shape, "DeepSpeed cuts its expert param groups otherwise at that degree, and its ZeRO-3 "
                      "sub-groups (sub_group_size) are not one per param group", "keep its expert-parallel degree")
    return _virtual_source(zero, groups, shape.ep)


def plan_expert_from_zero3(source: ExpertCheckpoint, shape: Shape) -> DataParallelPlan:
    """The plan that writes the AutoEP ZeRO-3 checkpoint `source` at ZeRO-1 or ZeRO-2 (`shape.stage`), at
    its own expert-parallel degree or another (`at_degree`), on any number of ranks it divides; reads
    nothing. What DeepSpeed saves there: `DeepSpeedZeroOptimizer`'s flat groups (dense ones over every
    rank, each expert-parallel rank's experts over its expert data-parallel group) filled from the
    ZeRO-3 pieces; rank 0's module, every tensor its own 16-bit copy of the fp32 master (cast as
    DeepSpeed casts it after each step, the router's second copy as well), frozen parameters whole from
    their pieces; and one file per MoE layer and global expert, written by the target expert-parallel
    rank that holds it (`units.TensorFile`)."""
    zero = source.zero
    assert zero is not None and zero.stage == 3 and source.kind == "autoep", "the shape check refuses the rest"
    check_expert_stage(source, shape.stage)
    _check_uniform_placement(source, shape)
    plan_expert_parallel(source, zero.world_size)  # the source is laid out as DeepSpeed's arithmetic says, or refused
    plan = _plan(source, zero, at_degree(source, shape), shape)
    files = _expert_files(plan.index)
    # Rank 0's module and frozen records hold each frozen parameter whole, joined from its ZeRO-3 pieces.
    whole = tuple(FrozenPiece(name=p.name, numel=p.numel,
                              copies=tuple(frozen_copies(p, 3, zero.world_size, 0, p.numel, 0)))
                  for p in zero.params if p.frozen)
    units = tuple(replace(u, tensor_files=files.get(u.rank, ()), frozen=whole if u.rank == 0 else ())
                  for u in plan.units)
    runs, copies = _module_runs(zero)
    return replace(plan, units=units, module_runs=runs,
                   index=replace(plan.index, tied={**zero.tied, **copies}))


def _module_runs(zero: ZeroCheckpoint) -> tuple[dict[str, tuple[Run, ...]], dict[str, str]]:
    """Each module tensor's runs over the fp32 masters, in its dtype, and AutoEP's second copy of each
    router (the module key by the presets' name `gate`) -> its router, whose runs it reads. The experts
    are not in the module."""
    out = {p.name: cast_runs(zero.trainable_runs(p), p.dtype) for p in zero.params
           if not p.frozen and p.group is not None and not _is_expert(zero.groups[p.group])}
    copies = {}
    for name in zero.model_states[0].get("module") or {}:
        m = _ROUTER_ALIAS.match(name)
        owner = f"{m.group('path')}.{ROUTER}{m.group('rest')}" if m else ""
        if owner in out and name not in out:
            out[name], copies[name] = out[owner], owner
    return out, copies


def _expert_files(zero: ZeroCheckpoint) -> dict[int, tuple[TensorFile, ...]]:
    """Per target rank e < N: the files of expert-parallel rank e's experts, `{prefix}.w{1,2,3}.{global}`
    each, its rows of the stacked weights in the module's dtype (DeepSpeed's uniform placement, checked)."""
    out: dict[int, list[TensorFile]] = {}
    for entry in zero.model_states[0].get("ds_autoep_layers") or []:
        prefix, local, ep = entry["expert_key_prefix"], entry["num_local_experts"], entry["ep_size"]
        for e in range(ep):
            stacked = {w: zero.param_by_key[(e, f"{prefix}.{w}")] for w in WEIGHTS}
            runs = {w: cast_runs(zero.trainable_runs(p), p.dtype) for w, p in stacked.items()}
            for j in range(local):
                expert = e * local + j
                tensors = []
                for w, p in stacked.items():
                    block = _numel(p.shape[1:])
                    tensors.append((f"{prefix}.{w}.{expert}", tuple(p.shape[1:]),
                                    slice_runs(runs[w], j * block, block, 0)))
                out.setdefault(e, []).append(TensorFile(name=expert_file_name(entry["moe_layer_id"], expert),
                                                        tensors=tuple(tensors)))
    return {e: tuple(files) for e, files in out.items()}


def _check_uniform_placement(source: ExpertCheckpoint, shape: Shape) -> None:
    for entry in source.zero.model_states[0].get("ds_autoep_layers") or [] if source.zero else []:
        placement = entry.get("expert_placement")
        if placement is None:
            continue
        uniform = _placement(entry["num_experts"], entry["ep_size"])
        if [list(r.get("experts", [])) for r in placement.get("ranks", [])] != [r["experts"] for r in uniform["ranks"]]:
            raise _refuse(source, shape, f"MoE layer {entry['moe_layer_id']} ({entry['module_path']}) places its "
                          "experts otherwise than DeepSpeed's uniform placement, the only one DeepSpeed builds "
                          "at another degree", "convert it with DeepSpeed's universal converter")


def _plan(source: ExpertCheckpoint, zero: ZeroCheckpoint, virtual: ZeroCheckpoint, shape: Shape) -> DataParallelPlan:
    """`DeepSpeedZeroOptimizer`'s flat groups of `virtual` (`at_degree`: the source's index at the target
    degree, each group in the optimizer's order) on `shape.world_size` ranks, each flattened round-robin
    over the group's ranks where the config sets `round_robin_gradients` and filled from the source
    fragments its parameters name; rank 0 writes the model states."""
    world_size = shape.world_size
    optimizer = target_optimizer(zero.optimizer_kind, zero.stage, shape.stage, zero.ds_config)
    by_key = virtual.param_by_key
    ordered = {key: sorted(p.fragments, key=lambda f: f.param_offset) for key, p in by_key.items()}
    starts = {key: [f.param_offset for f in frags] for key, frags in ordered.items()}

    def copies(e: int) -> Copies:
        def of(name: str, _group: int, first: int, last: int, dst: int) -> list[Copy]:
            return fragment_copies(ordered[(e, name)], first, last, dst, starts[(e, name)])
        return of

    # `virtual` lists each group in the optimizer's order; round-robin flattens it over the group's ranks
    laid = sharded_zero12_flats([[by_key[(0, n)] for n in group.params] for group in virtual.groups],
                                [group.ep for group in virtual.groups], world_size, copies,
                                aligned=is_set(zero.zero_config, "parameter_alignment"), bf16=optimizer == BF16,
                                round_robin=zero.flattens_round_robin(optimizer))
    flats, paddings, slices = laid.flats, laid.paddings, laid.slices
    n_tensors = zero.tensors_per_partition
    module_bytes = sum(p.numel * DTYPE_SIZES[p.dtype] for p in zero.params if p.group is None or
                       not _is_expert(zero.groups[p.group])) + zero.buffer_bytes
    units = []
    for r in range(world_size):
        moved = sum(c.numel for f in flats[r] for c in f.copies)
        units.append(RankUnit(
            rank=r, meta_rank=min(r, zero.world_size - 1), optim_file=optim_file_name(zero.precision, r),
            model_file=model_file_name(shape.stage, 0) if r == 0 else None, flats=tuple(flats[r]),
            group_paddings=tuple(paddings[r]), slice_mappings=tuple(slices[r]),
            read_bytes=4 * n_tensors * moved + (module_bytes if r == 0 else 0),
            write_bytes=4 * n_tensors * sum(f.numel for f in flats[r]) + (module_bytes if r == 0 else 0),
        ))
    return DataParallelPlan(
        root=zero.root, tag=zero.tag, stage=shape.stage, precision=zero.precision, optimizer=optimizer,
        source_world_size=zero.world_size, world_size=world_size, flat_shapes=laid.shapes,
        param_alignment_paddings=laid.param_paddings, module=(), units=tuple(units),
        index=virtual, carried=source.expert_files, group_ep=tuple(group.ep for group in virtual.groups),
        source_optimizer=zero.optimizer_kind,
    )


# ---- the metadata at the new degree -------------------------------------------------------------------


def _placement(num_experts: int, ep: int) -> dict[str, Any]:
    """`legacy_uniform_autoep_placement_descriptor(num_experts, num_experts // ep, ep)`."""
    local = num_experts // ep
    return {"version": 1, "num_experts": num_experts, "ep_size": ep,
            "ranks": [{"rank": r, "experts": list(range(r * local, (r + 1) * local))} for r in range(ep)]}


def _strides(shape: Sequence[int]) -> list[int]:
    out = [1] * len(shape)
    for axis in range(len(shape) - 2, -1, -1):
        out[axis] = out[axis + 1] * shape[axis + 1]
    return out


def _affine_map(logical: Sequence[int], ep: int) -> dict[str, Any]:
    """`autoep_placement_to_affine_map(uniform placement, logical).to_dict()`: one piece per rank."""
    local = logical[0] // ep
    shard = [local, *logical[1:]]
    block = _numel(logical[1:])
    def piece(r: int) -> dict[str, Any]:
        return {"shape": list(shard), "source": [r * local * block, _strides(logical)], "dest": [0, _strides(shard)],
                "locations": [r]}

    return {"logical_shape": list(logical),
            "ranks": {r: {"shard_shape": list(shard), "pieces": [piece(r)]} for r in range(ep)}}


def _autoep_entry(entry: Any, ep: int) -> Any:
    """One `ds_autoep_layers` entry as DeepSpeed records it on rank 0 at degree `ep`."""
    if not isinstance(entry, Mapping):
        return entry
    out = dict(entry)
    num = entry["num_experts"]
    local = num // ep
    out.update(num_local_experts=local, ep_size=ep)
    if "expert_placement" in out:
        out["expert_placement"] = _placement(num, ep)
    maps = entry.get("affine_maps")
    if isinstance(maps, Mapping) and isinstance(maps.get("params"), Mapping):
        out["affine_maps"] = {**maps, "params": {name: _affine_map(m["logical_shape"], ep)
                                                 for name, m in maps["params"].items()}}
    out.update(ep_group_name=f"ep_size_{ep}", ep_rank=0, expert_data_parallel_rank=0, global_expert_start=0,
               global_expert_end=local)
    return out


def _config(config: Any, ep: int) -> Any:
    if not isinstance(config, Mapping) or not isinstance(config.get("expert_parallel"), Mapping):
        return config
    out = copy.deepcopy(dict(config))
    out["expert_parallel"]["autoep_size"] = ep
    return out


def _model_states(state: Mapping[str, Any], ep: int) -> dict[str, Any]:
    out = dict(state)
    if isinstance(out.get("ds_autoep_layers"), list):
        out["ds_autoep_layers"] = [_autoep_entry(e, ep) for e in out["ds_autoep_layers"]]
    uc = out.get(UC_INFO)
    if isinstance(uc, Mapping) and isinstance(uc.get("ds_autoep_layers"), list):
        out[UC_INFO] = {**uc, "ds_autoep_layers": [_autoep_entry(e, ep) for e in uc["ds_autoep_layers"]]}
    if "ds_config" in out:
        out["ds_config"] = _config(out["ds_config"], ep)
    return out


def _optim_states(state: Mapping[str, Any], ep: int, sources: Sequence[int] | None = None) -> dict[str, Any]:
    """An optimizer file's fields that name the expert groups, as at degree `ep`: the base optimizer's
    param groups (`base_optimizer_state` at ZeRO-1/2, `optimizer_state_dict` at ZeRO-3), ZeRO-3's
    `ds_zero_partition_groups` group names, and `autoep_size` in the recorded config. With `sources`
    (DeepSpeed cuts the expert groups otherwise at `ep`), one param group, optimizer state and
    partition-group entry per target group, each its source group's."""
    def regroup(items: Any) -> Any:
        if sources is None:
            return items
        if isinstance(items, Mapping):
            return {g: items[src] for g, src in enumerate(sources) if src in items}
        return [items[src] for src in sources]

    out = dict(state)
    osd = out.get("optimizer_state_dict")
    if isinstance(osd, Mapping):
        osd = dict(osd)
        for key in ("base_optimizer_state", "optimizer_state_dict"):
            base = osd.get(key)
            if isinstance(base, Mapping):
                groups = [{**g, "name": f"ep_size_{ep}"} if isinstance(g, Mapping) and g.get("moe") else g
                          for g in regroup(list(base.get("param_groups") or []))]
                osd[key] = {**base, "param_groups": groups}
                if isinstance(base.get("state"), Mapping):
                    osd[key]["state"] = regroup(base["state"])
        if isinstance(osd.get("ds_zero_partition_groups"), list):
            osd["ds_zero_partition_groups"] = [
                {**g, "group_names": [f"ep_size_{ep}" if str(n).startswith("ep_size_") else n
                                      for n in g["group_names"]]}
                if isinstance(g, Mapping) and isinstance(g.get("group_names"), list) else g
                for g in regroup(osd["ds_zero_partition_groups"])]
        out["optimizer_state_dict"] = osd
    if "ds_config" in out:
        out["ds_config"] = _config(out["ds_config"], ep)
    return out


def _fragments(segments: Sequence[_Segment]) -> tuple[Fragment, ...]:
    """A target parameter's fragments, in parameter order: where in the source ranks' flat partitions
    each of its elements is, through the source parameters its `segments` come from."""
    out = []
    for seg in segments:
        lo, hi = seg.src_offset, seg.src_offset + seg.numel
        for frag in sorted(seg.src.fragments, key=lambda f: f.param_offset):
            x, y = max(lo, frag.param_offset), min(hi, frag.param_offset + frag.numel)
            if x < y:
                out.append(Fragment(rank=frag.rank, group=frag.group, offset=frag.offset + x - frag.param_offset,
                                    numel=y - x, param_offset=seg.dst_offset + x - lo))
    return tuple(out)


def _virtual_source(zero: ZeroCheckpoint, groups: Sequence[tuple[_TargetGroup, int]], ep: int) -> ZeroCheckpoint:
    """The source's ZeRO index as DeepSpeed records the checkpoint at degree `ep`: the target's
    parameters and param groups (`groups`: each at the target, with the source group whose
    hyper-parameters and optimizer scalars it carries, which becomes its `ParamGroup.index`), and the
    metadata `reshard.files` copies into the new files, each param group's entry that of its source
    group; its partitions stay the source's (the copies' sources)."""
    sources = [src for _, src in groups]
    position = {src: g for g, src in enumerate(sources) if not _is_expert(zero.groups[src])}
    params: list[Param] = [p if p.group is None or position[p.group] == p.group else replace(p, group=position[p.group])
                           for p in zero.params if p.group is None or not _is_expert(zero.groups[p.group])]
    new_groups = []
    for g, (group, src) in enumerate(groups):
        old = zero.groups[src]
        if not _is_expert(old):
            new_groups.append(old)
            continue
        hyper = {**old.hyper, "name": f"ep_size_{ep}"} if "name" in old.hyper else old.hyper
        new_groups.append(ParamGroup(src, hyper, group.names, ep=group.ep))
        dtype = zero.param_by_name[old.params[0]].dtype
        params += [Param(name, shape, dtype, g, fragments=_fragments(group.segments[(e, name)]), shard=e)
                   for e in range(group.ep) for name, shape in zip(group.names, group.shapes)]
    regroup = None if sources == list(range(len(zero.groups))) else sources
    return replace(zero, params=tuple(params), groups=tuple(new_groups),
                   model_states=tuple(_model_states(m, ep) for m in zero.model_states),
                   optim_states=tuple(_optim_states(o, ep, regroup) for o in zero.optim_states))


__all__ = ["plan_expert_degree", "plan_expert_from_zero3", "plan_moe_zero0"]
