"""Changing a Megatron-style checkpoint's tensor-parallel degree: pp P x tp T x dp D -> pp P x tp T' x dp M. Pure.

A Megatron-style checkpoint (a PipelineModule whose layers split their parameters over a tensor-parallel
group, `readers.pipeline`) records how each parameter is split only in the client's
`universal_checkpoint_info` patterns. The reader joins the full tensors by those rules as DeepSpeed's
`ds_to_universal.merge_tp_slices` does (one copy of a replicated parameter, the others paired with it as
replicas; column- and vocabulary-parallel ones on dim 0, row-parallel ones on dim 1, the two halves of a
`parameter_with_2_sub_params_cat_dim_0` apart; the vocabulary cut to `original_vocab_size` rows). The
target's shards are cut from them as `universal_checkpoint.load_hp_checkpoint_state` slices a universal
checkpoint at degree T' (`readers.pipeline.shard_shapes`: `chunk` into T' equal blocks, the vocabulary
padded back with zero rows: to Megatron's padded size at T' where the run's `args` record
`make_vocab_size_divisible_by` (`reshard.vocabulary`; `padded_vocab_size` in `args` and in
`universal_checkpoint_info` then says T''s), else to the size the source's shards make, which the plan's
notes say), so what DeepSpeed at T' loads from OUT is what it loads through the universal route, without
the conversion.

Each target model-parallel rank (stage s, tensor-parallel rank t', `mp_rank_{s * T' + t'}`) writes:

- its ZeRO-1 files, as for an AutoTP split (`tensor_parallel.plan_zero12` over the virtual checkpoint
  whose rank `mp * D + d` is source model-parallel rank mp's data-parallel rank d, `flats.ModelRuns`
  copying the fp32 masters and Adam moments element by element), the per-rank scalars and model states
  from stage s's first tensor-parallel rank, `mp_world_size` T' x P and `checkpoint_parallel_dimensions`
  tp T', the client's `universal_checkpoint_info` kept (it names patterns, not degrees; the shard widths of
  `parameter_with_sub_params`, which only a merge to tp1 writes, become each sub-parameter's whole);
- its layer files `layer_{XX}-model_{t'}-model_states.pt`: each trained tensor cut the same way from the
  full module copy (the source's layer files joined by the same rules), buffers as tensor-parallel rank
  0 holds them.

Refused, naming the parameter: a parameter the patterns do not split at T' (averaged ones, which
`ds_to_universal` averages and ckptflow does not; `parameter_with_sub_params`, whose shard widths at T'
are not recorded; a dimension T' does not divide). Refused as well: ZeRO-0 (its optimizer state names no
parameter), frozen parameters, tied modules across stages, `round_robin_gradients`, and another number of
pipeline stages or ZeRO stage at the same time (a PipelineModule trains at ZeRO-0 and 1 only).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from ckptflow.errors import UnsupportedCheckpointError, option
from ckptflow.formats.deepspeed.model import ModelTensor, Param, ZeroCheckpoint
from ckptflow.formats.deepspeed.names import UC_INFO, layer_file_name
from ckptflow.formats.deepspeed.readers.model_parallel import Holding, ModelParallelCheckpoint, join
from ckptflow.formats.deepspeed.readers.pipeline import FUSED_QKV_WHY, Split, fused_qkv, split_pieces, splits_at
from ckptflow.formats.deepspeed.runs import Run, whole_run
from ckptflow.reshard.flats import ModelRuns
from ckptflow.reshard.shape import Shape
from ckptflow.reshard.tensor_parallel import at_degree, check_joinable, local_copies, local_runs, plan_zero12
from ckptflow.reshard.units import ModelParallelPlan, TensorFile
from ckptflow.reshard.vocabulary import PADDED_VOCAB, keep_note, vocab_rows_at

TIED = "tied_modules."


def plan_megatron_tensor_parallel(index: ModelParallelCheckpoint, shape: Shape) -> ModelParallelPlan:
    """The plan that writes the Megatron-style checkpoint `index` at `shape` (another tensor-parallel
    degree, the same pipeline stages and ZeRO stage); reads nothing. `UnsupportedCheckpointError`, in one
    line saying why, for anything else (see the module's docstring)."""
    _check_source(index, shape)
    try:
        vocab_rows = vocab_rows_at(index, shape.tp)
        splits = splits_at(index, shape.tp, vocab_rows)
    except UnsupportedCheckpointError as exc:
        raise UnsupportedCheckpointError(f"{index.root}/{index.tag}: {exc}",
                                         uri=index.root, tensor=exc.tensor) from None
    info = index.ranks[0].model_states[0].get(UC_INFO) or {}
    note = keep_note(index, shape.tp)
    runs = ModelRuns(index)
    kind = index.ranks[0].optimizer_kind
    parts = []
    for stage, stage_splits in enumerate(splits):
        module = _module_runs(index, stage, info)
        layers = _stage_layers(index, stage)
        for t in range(shape.tp):
            mp_rank = stage * shape.tp + t
            pieces = {name: split[1][t] for name, split in stage_splits.items()}
            source = _stage_source(index, stage, stage_splits, shape, t, _info_at(info, shape.tp, vocab_rows))
            plan = plan_zero12(index, source, shape.dp, kind, local_copies(pieces, runs.copies), {}, mp_rank=mp_rank,
                               meta_base=stage * index.tp * index.world_size)
            # the layer files take the place of the module copy plan_zero12 counts in rank 0's bytes
            files = tuple(_layer_file(index, layer, t, stage_splits, module) for layer in layers)
            first = replace(plan.units[0], tensor_files=files)
            parts.append(replace(plan, units=(first, *plan.units[1:]), module=(), source_optimizer=kind))
    return ModelParallelPlan(
        root=index.root, tag=index.tag, stage=index.stage, precision=index.precision,
        source_world_size=index.world_size, world_size=shape.dp, parts=tuple(parts), carried=(), index=index,
        padded_vocab=vocab_rows, notes=(note,) if note else (),
    )


def _check_source(index: ModelParallelCheckpoint, shape: Shape) -> None:
    where = f"{index.root}/{index.tag}"
    assert index.kind == "megatron", "reshard.plan.PLANNERS gives this planner Megatron-style checkpoints only"
    if shape.pp != index.pp or shape.stage != index.stage:
        raise UnsupportedCheckpointError(
            f"{where}: ckptflow changes a Megatron-style checkpoint's tensor-parallel degree at its own number of "
            f"pipeline stages ({index.pp}) and ZeRO stage ({index.stage}) only", uri=index.root,
            hint=f"leave {option('pp')} and {option('stage')} out")
    fused = fused_qkv(index) if shape.tp != index.tp else None
    if fused is not None:
        raise UnsupportedCheckpointError(f"{where}: {fused} {FUSED_QKV_WHY}", code="unsupported-shape", uri=index.root,
                                         tensor=fused,
                                         hint=f"keep the tensor-parallel degree ({index.tp}; leave {option('tp')} out)")
    check_joinable(index, shape.tp)
    ranks: Sequence[ZeroCheckpoint] = index.ranks
    tied = [p.name for rank in ranks for p in rank.params if p.name.startswith(TIED)]
    if tied:
        raise UnsupportedCheckpointError(f"{where}: {tied[0]} is a tied module, which ckptflow does not split again "
                                         "over tensor-parallel ranks", uri=index.root, tensor=tied[0])


def _info_at(info: Mapping[str, Any], tp: int, vocab_rows: int | None) -> dict[str, Any]:
    """The client's `universal_checkpoint_info` at degree `tp`: the same, but for `sub_param_shard_widths`,
    which at tp1 (the one degree `readers.pipeline.shard_shapes` gives sub-parameters) is each whole, and
    the `padded_vocab_size` Megatron-DeepSpeed records there, `vocab_rows` where the vocabulary is padded
    again."""
    out = dict(info)
    widths = info.get("sub_param_shard_widths")
    if tp == 1 and isinstance(widths, Mapping):
        out["sub_param_shard_widths"] = {k: [[sum(w)] for w in v] for k, v in widths.items()}
    if vocab_rows is not None and type(info.get(PADDED_VOCAB)) is int:
        out[PADDED_VOCAB] = vocab_rows
    return out


def _layer_of(name: str) -> int:
    return int(name.split(".", 1)[0])


def _stage_layers(index: ModelParallelCheckpoint, stage: int) -> list[int]:
    """The layers whose files stage `stage` writes: those of its parameters, and a layer without any (its
    buffers only) after the last one of the stage before it."""
    firsts = [min(_layer_of(p.name) for p in index.ranks[s * index.tp].params) for s in range(index.pp)]
    layers = sorted({layer for layer, _ in index.layers})
    return [layer for layer in layers if max((s for s in range(index.pp) if firsts[s] <= layer), default=0) == stage]


def _stage_source(index: ModelParallelCheckpoint, stage: int, splits: Mapping[str, Split], shape: Shape, t: int,
                  info: Mapping[str, Any]) -> ZeroCheckpoint:
    """Stage `stage`'s data-parallel checkpoint at tensor-parallel rank `t` of `shape.tp`: its parameters at
    their local shapes there, its model states at that degree (ZeRO-1 saves rank 0's only), every source
    rank's partitions and optimizer states (the virtual ranks `mp * D + d`)."""
    first: ZeroCheckpoint = index.ranks[stage * index.tp]
    states = [at_degree(m, shape.tp, info, tp_rank=t, mp_world_size=shape.tp * shape.pp) for m in first.model_states]
    return replace(
        first, params=tuple(Param(p.name, splits[p.name][0][t], p.dtype, p.group) for p in first.params),
        partitions=tuple(part for rank in index.ranks for part in rank.partitions),
        files=tuple(f for rank in index.ranks for f in rank.files),
        model_states=tuple(states),
        optim_states=tuple(o for rank in index.ranks for o in rank.optim_states),
    )


def _module_runs(index: ModelParallelCheckpoint, stage: int, info: Mapping[str, Any]) -> dict[str, tuple[Run, ...]]:
    """Stage `stage`'s full module copy of every trained parameter, joined from its layer files by the
    rules the masters are joined by (vocabulary padding cut): name -> runs."""
    ranks = range(stage * index.tp, (stage + 1) * index.tp)
    out = {}
    for param in index.ranks[stage * index.tp].params:
        layer, _, local = param.name.partition(".")
        refs = {mp: index.layers[(int(layer), mp % index.tp)][local] for mp in ranks}
        tensors = {mp: ModelTensor(param.name, ref.shape, ref.dtype, "param", (whole_run(ref, param.name),))
                   for mp, ref in refs.items()}
        full, pieces, rows = split_pieces(param.name, [refs[mp].shape for mp in ranks], info, index.tp, "param")
        holdings = [Holding(mp, param.name, tuple(p)) for mp, p in zip(ranks, pieces)]
        tensor, _ = join(param.name, full, "param", holdings, lambda mp, _name: tensors[mp], rows=rows)
        out[param.name] = tensor.runs
    return out


def _layer_file(index: ModelParallelCheckpoint, layer: int, t: int, splits: Mapping[str, Split],
                module: Mapping[str, tuple[Run, ...]]) -> TensorFile:
    """Layer `layer`'s file at tensor-parallel rank `t`: its tensors in the source's order, each trained one
    cut from the full module copy, the rest (buffers) as tensor-parallel rank 0 holds them."""
    tensors = []
    for local, ref in index.layers[(layer, 0)].items():
        name = f"{layer}.{local}"
        if name in splits:
            shapes, pieces = splits[name]
            tensors.append((local, shapes[t], local_runs(module[name], pieces[t])))
        else:
            tensors.append((local, tuple(ref.shape), (whole_run(ref, name),)))
    return TensorFile(name=layer_file_name(layer, t), tensors=tuple(tensors))


__all__ = ["plan_megatron_tensor_parallel"]
