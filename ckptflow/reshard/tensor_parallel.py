"""Changing an AutoTP checkpoint's tensor-parallel degree: tp N x dp D -> tp T x dp M. Pure.

AutoTP's affine maps say where every element of every parameter lives (`readers.autotp`), so the full
fp32 master weights and Adam moments are byte runs into the tensor-parallel ranks' flat partitions
(`flats.ModelRuns`, every tensor-parallel rank's data-parallel ranks as virtual ranks `mp * D + d`).

- Merged to T = 1 (`plan_tensor_parallel_merge`): what DeepSpeed writes for the same Hugging Face
  model trained without tensor parallelism at M data-parallel ranks, same ZeRO stage and precision:
  `mp_rank_00` files only, each param group flattened from the full parameters in the same order,
  partitioned over M ranks by DeepSpeed's arithmetic (`formats.deepspeed.partition`), the ZeRO-1/2
  16-bit module copy joined from the ranks' shards, no `universal_checkpoint_info`, `mp_world_size`
  1, `checkpoint_parallel_dimensions` tp 1, and the `tensor_parallel` section left out of the
  recorded config. Load it with the same model and a config without `tensor_parallel` at M ranks.
- Split to T > 1 (`plan_tensor_parallel_split`): what AutoTP writes at `autotp_size` T. Each
  parameter's layout is read from its saved map (`autotp_shards.shard_rule_of`: replicated, one block per
  rank along a dimension, or sub-parameters each split on their own) and checked against DeepSpeed's
  shard arithmetic at N (`autotp_shards.shard_sizes`, with the key/value heads of the model's
  `config.json` and the recorded `tp_grain_size`); the shards at T come from the same arithmetic.
  Tensor-parallel rank t's files are a data-parallel checkpoint of its shards (their elements copied
  from the source partitions that hold them), with `universal_checkpoint_info` rewritten at T (affine
  maps, `sub_param_shard_widths`), `mp_world_size` and `checkpoint_parallel_dimensions` T, and
  `tensor_parallel.autotp_size` T in the recorded config. A parameter whose map is none of those
  layouts, or disagrees with the arithmetic at N, is refused.

Both go from any of ZeRO-1, 2, 3 (and BF16_Optimizer's bf16 ZeRO-1) to any of ZeRO-1, 2, 3, the stage
changing with the degree as `stage` changes it alone: the target's optimizer the one DeepSpeed builds
at its stage (`target_optimizer`), its flat groups filled from the same source fragments, and a ZeRO-1/2
target's 16-bit module joined from the source's, or cast from the fp32 masters where a ZeRO-3 source
saved none (`_module_runs`).

With `round_robin_gradients`, DeepSpeedZeroOptimizer flattens each tensor-parallel rank's param groups
round-robin over that rank's data-parallel group (`real_dp_process_group`: D ranks). The joined source
lists each group in the optimizer's own order (`ZeroCheckpoint.optimizer_order` of tensor-parallel rank
0, the round-robin undone over its D ranks; the fragments say where each element is, whatever the
order); a ZeRO-1/2 target whose optimizer flattens round-robin with the recorded config
(`ZeroCheckpoint.flattens_round_robin`: not BF16_Optimizer) is flattened round-robin at its own M ranks
(`flats.zero12_flats`), a ZeRO-3 one takes the optimizer's order.

A ZeRO-0 source goes to ZeRO-1, 2 or 3 with the degree: each tensor-parallel rank's optimizer state,
saved by position, named on its own and read as partitions (`stage.zero0_partitioned`: fp32, the
module's weights as masters; bf16 and fp16, FP16_Optimizer's flat masters), the ranks' masters joined
by the same affine maps, the ZeRO-1/2 module joined from the ranks' own weights.

Refused: ZeRO-0 kept at ZeRO-0 (its files at another degree would be a torch optimizer's by position),
frozen parameters, scaled pieces (the reader refuses those already), and every layout but AutoTP.
"""

from __future__ import annotations

import bisect
import copy
import re
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from ckptflow.errors import UnsupportedCheckpointError, option
from ckptflow.formats.deepspeed.autotp_shards import Meta, ShardRule, meta_of, recorded_widths, shard_rule_of
from ckptflow.formats.deepspeed.config import is_set, sub_group_size
from ckptflow.formats.deepspeed.model import Param, ParamGroup, ZeroCheckpoint
from ckptflow.formats.deepspeed.names import UC_INFO, model_file_name, optim_file_name
from ckptflow.formats.deepspeed.partition import BF16, ZERO0, ZERO3, Copy
from ckptflow.formats.deepspeed.readers.autotp import module_runs
from ckptflow.formats.deepspeed.readers.model_parallel import ModelParallelCheckpoint, Piece, stretches
from ckptflow.formats.deepspeed.runs import Run
from ckptflow.formats.torch.tensorref import DTYPE_SIZES
from ckptflow.plumbing.text import excerpt
from ckptflow.reshard.flats import (
    Copies,
    ModelRuns,
    append_copy,
    cast_runs,
    target_optimizer,
    zero3_flats,
    zero12_flats,
)
from ckptflow.reshard.shape import check_world_size
from ckptflow.reshard.stage import zero0_partitioned
from ckptflow.reshard.units import DataParallelPlan, ModelParallelPlan, RankUnit


def plan_tensor_parallel_merge(index: ModelParallelCheckpoint, world_size: int, tensor_parallel: int, *,
                               stage: int | None = None) -> DataParallelPlan:
    """The plan that turns the AutoTP checkpoint `index` into a `tensor_parallel` = 1 checkpoint at
    `world_size` data-parallel ranks, at ZeRO `stage` (None: the source's; a ZeRO-1/2 source may go to
    any of 1, 2, 3); reads nothing. `UnsupportedCheckpointError` for anything else."""
    if tensor_parallel != 1:
        raise UnsupportedCheckpointError(
            f"{index.root}/{index.tag}: a merge writes tensor-parallel degree 1, not {tensor_parallel}",
            uri=index.root, hint="split it with plan_tensor_parallel_split")
    joined, source, stage = _check_source(index, world_size, tensor_parallel, stage)
    kind = _source_optimizer(index, source)
    runs = ModelRuns(joined)
    if stage == 3:
        plan = _plan_zero3(joined, source, world_size, runs.copies)
    else:
        optimizer = target_optimizer(kind, index.stage, stage, source.ds_config)
        plan = plan_zero12(joined, source, world_size, optimizer, runs.copies, _module_runs(joined, source),
                           stage=stage)
    return replace(plan, stage=stage, source_optimizer=kind, source_world_size=index.world_size)


def plan_tensor_parallel_split(index: ModelParallelCheckpoint, world_size: int, tensor_parallel: int, *,
                               stage: int | None = None, config: Mapping[str, Any] | None = None
                               ) -> ModelParallelPlan:
    """The plan that writes the AutoTP checkpoint `index` at `tensor_parallel` > 1 ranks per model
    replica and `world_size` data-parallel ranks, at ZeRO `stage` (None: the source's; a ZeRO-1/2
    source may go to any of 1, 2, 3), split as AutoTP splits the model at that degree. `config` is the
    model's `config.json` (its key/value heads decide the attention layers' split). Reads nothing;
    `UnsupportedCheckpointError` for anything it does not split (see the module's docstring)."""
    joined, merged, stage = _check_source(index, world_size, tensor_parallel, stage)
    where = f"{index.root}/{index.tag}"
    first = joined.ranks[0]
    head = first.model_states[0]
    info = head.get(UC_INFO)
    meta = meta_of(config, head.get("ds_config"))
    if not meta.num_kv_heads:
        raise UnsupportedCheckpointError(
            f"{where}: ckptflow needs the model's config.json (its key/value heads) to split the attention layers "
            f"as AutoTP does at tensor-parallel degree {tensor_parallel}, and the checkpoint folder has none",
            uri=index.root, hint="copy the model's config.json into the checkpoint folder")
    unsupported = info.get("autotp_unsupported_parameter_patterns") if isinstance(info, Mapping) else None
    if unsupported:
        pattern, reason = next(iter(unsupported.items()))
        raise UnsupportedCheckpointError(
            f"{where}: AutoTP recorded no split for {excerpt(pattern)} ({excerpt(reason)}); ckptflow does not guess "
            "one", uri=index.root)
    layouts = {p.name: _layout(joined, info, meta, p.name) for p in first.params}
    target_info = _info_at(info, layouts, meta, tensor_parallel, joined)
    kind = _source_optimizer(index, merged)
    optimizer = target_optimizer(kind, index.stage, stage, merged.ds_config)
    runs = ModelRuns(joined)
    full_module = _module_runs(joined, merged) if stage != 3 else {}
    parts = []
    for t in range(tensor_parallel):
        maps = target_info["affine_map"]["params"]
        pieces = {p.name: _pieces(maps[_pattern(p.name)]["ranks"][t]) for p in first.params}
        shapes = {name: tuple(maps[_pattern(name)]["ranks"][t]["shard_shape"]) for name in pieces}
        source = replace(
            merged, params=tuple(Param(p.name, shapes[p.name], p.dtype, p.group) for p in first.params),
            model_states=tuple(at_degree(m, tensor_parallel, target_info, tp_rank=t) for rank in joined.ranks
                               for m in rank.model_states),
            optim_states=tuple(at_degree(o, tensor_parallel, target_info) for rank in joined.ranks
                               for o in rank.optim_states))
        copies = local_copies(pieces, runs.copies)
        if stage == 3:
            plan = _plan_zero3(joined, source, world_size, copies, mp_rank=t)
        else:
            plan = plan_zero12(joined, source, world_size, optimizer, copies,
                               {n: local_runs(r, pieces[n]) for n, r in full_module.items()}, mp_rank=t, stage=stage)
        parts.append(replace(plan, stage=stage, source_optimizer=kind, source_world_size=index.world_size))
    return ModelParallelPlan(
        root=index.root, tag=index.tag, stage=stage, precision=index.precision, source_world_size=index.world_size,
        world_size=world_size, parts=tuple(parts), carried=index.carried, index=index,
    )


def _check_source(index: ModelParallelCheckpoint, world_size: int, tensor_parallel: int, stage: int | None
                  ) -> tuple[ModelParallelCheckpoint, ZeroCheckpoint, int]:
    """`index` with its tensor-parallel ranks' partitions (a ZeRO-0 one's named first, for another stage:
    `stage.zero0_partitioned`), those partitions as one data-parallel checkpoint, and the target stage;
    `UnsupportedCheckpointError` for a source or target no tensor-parallel change handles."""
    check_world_size(world_size)
    assert index.kind == "autotp", "reshard.plan.PLANNERS gives this planner AutoTP checkpoints only"
    stage = index.stage if stage is None else stage
    joined = zero0_partitioned(index) if index.stage == 0 and stage != 0 else index
    check_joinable(joined, tensor_parallel)
    return joined, _merged_source(joined), stage


def _source_optimizer(index: ModelParallelCheckpoint, merged: ZeroCheckpoint) -> str:
    """The optimizer that wrote `index` (`partition.ZERO0` for a ZeRO-0 one: a torch optimizer or
    FP16_Optimizer), as a plan records it."""
    return ZERO0 if index.stage == 0 else merged.optimizer_kind


def _module_runs(index: ModelParallelCheckpoint, merged: ZeroCheckpoint) -> dict[str, tuple[Run, ...]]:
    """The full 16-bit (module dtype) copy of every trained parameter for a ZeRO-1/2 target: the source
    module's (ZeRO-1/2, BF16_Optimizer), or, where ZeRO-3 saved none, the fp32 masters cast to the
    module's dtype as DeepSpeed casts them after every step (round to nearest even; fp32 training: the
    masters themselves), as `stage` writes ZeRO-3 at ZeRO-1/2."""
    if index.stage != 3:
        return module_runs(index)
    dtypes = {p.name: p.dtype for p in merged.params}
    return {t.name: cast_runs(t.runs, dtypes[t.name]) for t in index.tensors if t.name in dtypes}


def check_joinable(index: ModelParallelCheckpoint, tensor_parallel: int) -> None:
    """`UnsupportedCheckpointError` unless the tensor-parallel ranks' optimizer state of `index` can be joined
    and cut again at degree `tensor_parallel`: another degree, ZeRO-1/2/3, no frozen parameters."""
    where = f"{index.root}/{index.tag}"
    if tensor_parallel == index.tp:
        raise UnsupportedCheckpointError(f"{where} already has tensor-parallel degree {index.tp}", uri=index.root,
                                         hint=f"leave {option('tp')} out to change the data-parallel size only")
    if index.stage == 0 and not isinstance(index.ranks[0], ZeroCheckpoint):  # not named (`zero0_partitioned`)
        raise UnsupportedCheckpointError(
            f"{where} is a checkpoint in the {index.layout} layout: its optimizer state is saved by index, and "
            "ckptflow writes it at another tensor-parallel degree at ZeRO-1, 2 or 3 only, not at ZeRO-0",
            uri=index.root, hint=f"give {option('stage')} 1, 2 or 3 with it")
    frozen = [p.name for rank in index.ranks for p in rank.params if p.frozen]
    frozen += [t.name for t in index.tensors if t.kind == "frozen" and t.name not in frozen]
    if frozen:
        raise UnsupportedCheckpointError(f"{where} has frozen parameters ({frozen[:3]}), whose tensor-parallel split "
                                         "ckptflow has not verified", uri=index.root, tensor=frozen[0])


# ---- the source: every tensor-parallel rank's partitions as one data-parallel checkpoint -------------


def at_degree(state: Mapping[str, Any], tp: int, info: Mapping[str, Any] | None = None, *, tp_rank: int = 0,
              mp_world_size: int | None = None) -> dict[str, Any]:
    """A rank's saved state as DeepSpeed saves it at tensor-parallel degree `tp`, as tensor-parallel rank
    `tp_rank`: `universal_checkpoint_info` `info` (left out at tp 1), `mp_world_size` (tp unless given: a
    pipeline's is tp x pp) and `checkpoint_parallel_dimensions` tp, the recorded config's
    `tensor_parallel` section at `autotp_size` tp (left out at tp 1), and the tied aliases
    (`shared_params`, which DeepSpeed records on global rank 0 only) emptied on the other tensor-parallel ranks."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if key == "shared_params" and tp_rank > 0 and isinstance(value, dict):
            out[key] = type(value)()
        elif key == UC_INFO:
            if info is not None:
                out[key] = info
        elif key == "mp_world_size":
            out[key] = tp if mp_world_size is None else mp_world_size
        elif key == "checkpoint_parallel_dimensions" and isinstance(value, Mapping):
            out[key] = {**value, "tp_degree": tp}
        elif key == "ds_config" and isinstance(value, Mapping):
            out[key] = {k: copy.deepcopy(v) for k, v in value.items() if k != "tensor_parallel" or tp > 1}
            if tp > 1 and isinstance(out[key].get("tensor_parallel"), dict):
                out[key]["tensor_parallel"]["autotp_size"] = tp
        else:
            out[key] = value
    return out


def _merged_source(index: ModelParallelCheckpoint) -> ZeroCheckpoint:
    """A `ZeroCheckpoint` whose rank `mp * D + d` is tensor-parallel rank mp's data-parallel rank d, with
    the full parameters (names, shapes, groups) and tensor-parallel-free metadata. Each group lists its
    parameters in the optimizer's own order (`ZeroCheckpoint.optimizer_order`: a round-robin source's
    order undone over a tensor-parallel rank's own D data-parallel ranks; `optimizer_ordered`: nothing left
    to undo), what the target's layout starts from; its fragments stay where they are."""
    ranks: Sequence[ZeroCheckpoint] = index.ranks
    first = ranks[0]
    full = {t.name: t for t in index.tensors}
    params = tuple(Param(p.name, full[p.name].shape, p.dtype, p.group) for p in first.params)
    groups = tuple(ParamGroup(g.index, g.hyper, first.optimizer_order(g)) for g in first.groups)
    return replace(
        first, params=params, groups=groups, optimizer_ordered=True,
        partitions=tuple(part for rank in ranks for part in rank.partitions),
        files=tuple(f for rank in ranks for f in rank.files),
        model_states=tuple(at_degree(m, 1) for rank in ranks for m in rank.model_states),
        optim_states=tuple(at_degree(o, 1) for rank in ranks for o in rank.optim_states),
        tied=index.tied,
    )


def _meta(index: ModelParallelCheckpoint, rank: int) -> int:
    """The virtual rank whose per-rank scalars target rank `rank` copies: tensor-parallel rank 0's."""
    return min(rank, index.world_size - 1)




# ---- the split: each parameter's layout, and the target ranks' shards ----------------------------------


def _pattern(name: str) -> str:
    return "^" + re.escape(name) + "$"


def _layout(index: ModelParallelCheckpoint, info: Any, meta: Meta, name: str) -> ShardRule:
    """How AutoTP split parameter `name` in `index`, read from its saved map and checked against the
    arithmetic at the source's degree; `UnsupportedCheckpointError` (one line, the parameter named) where
    the metadata does not say, or says something else than DeepSpeed's arithmetic."""
    where = f"{index.root}/{index.tag}"
    maps = info.get("affine_map", {}).get("params", {}) if isinstance(info, Mapping) else {}
    entry = maps.get(_pattern(name)) if isinstance(maps, Mapping) else None
    if not isinstance(entry, Mapping):
        raise UnsupportedCheckpointError(
            f"{where}: {name} has no affine map of its own in {UC_INFO}, so ckptflow does not know how AutoTP splits "
            "it; ckptflow does not guess", uri=index.root, tensor=name)
    widths = (info.get("sub_param_shard_widths") or {}).get(_pattern(name))
    dims = [e.get("partition_dim") for e in info.get("parameter_with_sub_params") or []
            if isinstance(e, Mapping) and _pattern(name) in (e.get("patterns") or [])]
    layout = shard_rule_of(entry, index.tp, widths, dims[0] if dims else None)
    if layout is None:
        raise UnsupportedCheckpointError(
            f"{where}: the affine map of {name} is none of the layouts ckptflow splits again (replicated, one block "
            "per rank, sub-parameters split one by one); ckptflow does not guess", uri=index.root, tensor=name)
    if layout.kind != "replicated":
        recorded, ours = recorded_widths(entry, layout), layout.widths(index.tp, meta, _layer(index, name))
        if recorded != ours:
            raise UnsupportedCheckpointError(
                f"{where}: {name} is split {recorded} over {index.tp} ranks, but DeepSpeed's arithmetic (key/value "
                f"heads {meta.num_kv_heads}, grain {meta.tp_grain_size}) gives {ours}; ckptflow does not know the rule "
                "this split followed, so it does not split it again", uri=index.root, tensor=name)
    return layout


def _layer(index: ModelParallelCheckpoint, name: str) -> str:
    """The layer name AutoTP's arithmetic saw for parameter `name`: its module, or for a tied vocabulary
    parameter the output head's (a tied embedding reuses `lm_head`'s split)."""
    aliases = [alias for alias, owner in index.tied.items() if owner == name]
    return (aliases[0] if aliases else name).rpartition(".")[0]


def _info_at(info: Mapping[str, Any], layouts: Mapping[str, ShardRule], meta: Meta, tp: int,
             index: ModelParallelCheckpoint) -> dict[str, Any]:
    """`universal_checkpoint_info` as AutoTP records it at degree `tp`: the affine maps and sub-parameter
    widths at `tp`, every other field (the pattern lists, the vocabulary) as the source's."""
    where = f"{index.root}/{index.tag}"
    shapes = {t.name: t.shape for t in index.tensors}
    maps = {}
    for name, layout in layouts.items():
        if layout.kind != "replicated":
            widths = layout.widths(tp, meta, _layer(index, name))
            if any(0 in w for w in widths):
                raise UnsupportedCheckpointError(
                    f"{where}: at tensor-parallel degree {tp} AutoTP would give some ranks none of {name} (split "
                    f"{widths}); choose a degree that divides its key/value heads ({meta.num_kv_heads})",
                    uri=index.root, tensor=name)
        maps[_pattern(name)] = layout.affine_map(shapes[name], tp, meta, _layer(index, name))
    source_maps = info["affine_map"]["params"]
    other = [pattern for pattern in source_maps if pattern not in maps]
    if other:
        raise UnsupportedCheckpointError(
            f"{where}: {UC_INFO} records a split for {excerpt(other[0])}, which names no trained parameter of the "
            "checkpoint; ckptflow does not know where it goes at another degree", uri=index.root)
    out = copy.deepcopy({k: v for k, v in info.items() if k != "affine_map"})
    if "sub_param_shard_widths" in info:
        names = {_pattern(name): name for name in layouts}
        out["sub_param_shard_widths"] = {
            pattern: layouts[names[pattern]].widths(tp, meta, _layer(index, names[pattern])) if pattern in names
            else widths for pattern, widths in info["sub_param_shard_widths"].items()}
    out["affine_map"] = {**info["affine_map"], "params": {pattern: maps[pattern] for pattern in source_maps}}
    return {k: out[k] for k in [*info, *(k for k in out if k not in info)]}


def _pieces(rank: Mapping[str, Any]) -> list[Piece]:
    """A target rank's pieces of one parameter (its affine-map entry), as the readers' `Piece`s."""
    return [Piece(tuple(p["shape"]), p["source"][0], tuple(p["source"][1]), p["dest"][0], tuple(p["dest"][1]))
            for p in rank["pieces"]]


def _rows(pieces: Sequence[Piece]) -> list[tuple[int, int, int]]:
    """(local start, full start, elements) of every stretch of the local shard that is contiguous on both
    sides, in local order: one per piece of a column split, one per row of a row split."""
    out = []
    for piece in pieces:
        for dest, source, row, rows, stride in stretches(piece):
            if rows == 1 or stride == row:
                out.append((dest, source, row * rows))
            else:
                out.extend((dest + i * row, source + i * stride, row) for i in range(rows))
    return sorted(out)


def local_copies(pieces: Mapping[str, Sequence[Piece]], full: Copies) -> Copies:
    """`flats.Copies` of the target shards: elements [first, last) of a shard are full-tensor stretches,
    each copied by `full` from the source partitions that hold it."""
    rows = {name: _rows(p) for name, p in pieces.items()}
    starts = {name: [r[0] for r in stretch] for name, stretch in rows.items()}

    def copies(name: str, group: int, first: int, last: int, dst: int) -> list[Copy]:
        out: list[Copy] = []
        stretch = rows[name]
        for local, at, numel in stretch[max(0, bisect.bisect_right(starts[name], first) - 1):]:
            if local >= last:
                break
            a, b = max(first, local), min(last, local + numel)
            if a < b:
                for c in full(name, group, at + a - local, at + b - local, dst + a - first):
                    append_copy(out, c)
        return out

    return copies


def local_runs(runs: Sequence[Run], pieces: Sequence[Piece]) -> tuple[Run, ...]:
    """The runs of a target shard (offsets in the shard) made of `runs` of the full tensor."""
    out = []
    for local, at, numel in _rows(pieces):
        for run in runs:
            for part in run.within(at, at + numel):
                out.append(replace(part, offset=part.offset - at + local))
    return tuple(sorted(out, key=lambda r: r.offset))


# ---- ZeRO-1/2 --------------------------------------------------------------------------------------


def plan_zero12(index: ModelParallelCheckpoint, source: ZeroCheckpoint, world_size: int, optimizer: str,
                copies: Copies, module: Mapping[str, tuple[Run, ...]], *, mp_rank: int = 0, meta_base: int = 0,
                stage: int | None = None) -> DataParallelPlan:
    """Model-parallel rank `mp_rank`'s ZeRO-1/2 files at `world_size` data-parallel ranks, written by
    `optimizer` at ZeRO `stage` (None: the source's): `source`'s param groups (the virtual checkpoint
    whose rank `mp * D + d` is model-parallel rank mp's data-parallel rank d; each group in the optimizer's
    order) laid out by DeepSpeed's arithmetic, flattened round-robin at `world_size` where `optimizer` does
    so with the recorded config (`ZeroCheckpoint.flattens_round_robin`), filled by `copies`; the 16-bit
    module from `module`'s runs. Each target rank copies its
    per-rank scalars from virtual rank `meta_base` + its own (the source's last data-parallel rank
    beyond them)."""
    stage = source.stage if stage is None else stage
    by_name = source.param_by_name
    n_tensors = source.tensors_per_partition
    laid = zero12_flats([[by_name[n] for n in group.params] for group in source.groups], world_size, copies,
                        aligned=is_set(source.zero_config, "parameter_alignment"), bf16=optimizer == BF16,
                        round_robin=source.flattens_round_robin(optimizer))
    flats, paddings, slices = laid.flats, laid.paddings, laid.slices
    module_bytes = sum(p.numel * DTYPE_SIZES[p.dtype] for p in source.params) + source.buffer_bytes
    units = []
    for r in range(world_size):
        moved = sum(c.numel for f in flats[r] for c in f.copies)
        units.append(RankUnit(
            rank=r, meta_rank=meta_base + _meta(index, r), optim_file=optim_file_name(source.precision, r, mp_rank),
            model_file=model_file_name(stage, 0, mp_rank) if r == 0 else None, flats=tuple(flats[r]),
            group_paddings=tuple(paddings[r]), slice_mappings=tuple(slices[r]), mp_rank=mp_rank,
            read_bytes=4 * n_tensors * moved + (module_bytes if r == 0 else 0),
            write_bytes=4 * n_tensors * sum(f.numel for f in flats[r]) + (module_bytes if r == 0 else 0),
        ))
    return DataParallelPlan(
        root=index.root, tag=index.tag, stage=stage, precision=source.precision, optimizer=optimizer,
        source_world_size=index.world_size, world_size=world_size, flat_shapes=laid.shapes,
        param_alignment_paddings=laid.param_paddings, module=laid.module, units=tuple(units), index=source,
        module_runs=module,
    )


# ---- ZeRO-3 -----------------------------------------------------------------------------------------


def _plan_zero3(index: ModelParallelCheckpoint, source: ZeroCheckpoint, world_size: int, copies: Copies, *,
                mp_rank: int = 0) -> DataParallelPlan:
    by_name = source.param_by_name
    n_tensors = source.tensors_per_partition
    flats, flat_shapes = zero3_flats([[by_name[n] for n in group.params] for group in source.groups], world_size,
                                     copies, sub_group_size=sub_group_size(source.zero_config))
    units = []
    for r in range(world_size):
        moved = sum(c.numel for f in flats[r] for c in f.copies)
        units.append(RankUnit(
            rank=r, meta_rank=_meta(index, r), optim_file=optim_file_name(source.precision, r, mp_rank),
            model_file=model_file_name(3, r, mp_rank), flats=tuple(flats[r]), mp_rank=mp_rank,
            read_bytes=4 * n_tensors * moved + source.buffer_bytes,
            write_bytes=4 * n_tensors * sum(f.numel for f in flats[r]) + source.buffer_bytes,
        ))
    return DataParallelPlan(
        root=index.root, tag=index.tag, stage=3, precision=source.precision, optimizer=ZERO3,
        source_world_size=index.world_size, world_size=world_size, flat_shapes=tuple(flat_shapes),
        param_alignment_paddings=(), module=(), units=tuple(units), index=source,
    )


__all__ = ["at_degree", "check_joinable", "local_copies", "local_runs", "plan_tensor_parallel_merge",
           "plan_tensor_parallel_split", "plan_zero12"]
