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

Another number of pipeline stages, P -> P', the degree changing with it or not (`plan_megatron_stages`):
the two act on different axes and compose. Which layers each target stage holds is what `PipelineModule`
decides at P' (`pipeline.stages_at`: merged to one, or cut by its partition method, each layer weighed
by its shards' elements at T', as `PipelineModule` counts the layers it builds; by default the method the run
itself uses, `default_partition_method`: Megatron-DeepSpeed's `GPTModelPipe` passes `type:transformer`, computed
from its transformer layers known by their parameters, `readers.pipeline.transformer_layers`, and its layer list
from its `args`, `layer_facts`); each target stage s'
and tensor-parallel rank t' is then a pipeline stage as `pipeline.plan_stage` writes it, over the same
virtual checkpoint, its parameters at their shapes at T' and each element copied out of the full tensor
(`local_copies` over `ModelRuns`) from whichever source stage and tensor-parallel rank trained it; its
model states at T' x P'; the layer files of its layers cut as above. At the source's own degree the
shards are the source's own (`splits_at`), whatever the rules say of other degrees.

A tied module (Megatron-DeepSpeed's `GPTModelPipe` ties its embedding and head: `TiedLayerSpec('embed', ...)`
on the first and the last layer, `tied_modules.embed.word_embeddings.weight` in the files) is trained by
every stage that uses it, each stage's copy in its own optimizer state (the `tied_modules` first in its
groups, as `PipelineModule.parameters()` lists them), and saved once, in the layer file of its first use
(a use with a `forward_fn`, the head, saves none). Its vocabulary-parallel word embedding is joined and cut
by the vocabulary rules as any vocabulary parameter, and a parameter its `universal_checkpoint_info` records
as replicated (`tp_replicated_parameter_patterns`: Megatron's GPT ties its learned position embeddings,
`tied_modules.embed.position_embeddings.weight`, with it) read whole from one tensor-parallel rank and
written whole on every target one, as any replicated parameter. Each stage keeps its own copy: a stage's
tensor-parallel copies are replicas, checked equal at a tensor-parallel change (`reshard.run`), but the
stages' copies may differ (Megatron-DeepSpeed's `GPTModelPipe` keeps only `word_embeddings_weight` equal
over the tie, and its head never reads the positions: at pp >= 2 the last stage's copy of the position
embeddings gets weight decay only and drifts from stage 0's; `readers.pipeline` keeps each later stage's
copy in `stage_copies`). It is written into every target stage that uses it (`pipeline.stages_at`: every
use at P' = 1, else the stages the cut gives a use of it, weighed at T' at each use as `PipelineModule`
counts a `TiedLayerSpec`), its masters and moments in each of those stages' optimizer state, taken from
(`_copies_from`): at the source's number of stages, each target stage's own source stage, so that the
state is exactly the source's; at another, the lowest source stage that trains it for the first target
stage holding the tie and any middle one, the highest for the last (the copy that stage's optimizer
trained). Its layer file is that of the layer of its first use, cut at T' (the lowest stage's copy: the
head's use saves none). Checked against
DeepSpeed's native load at the target (`tests/test_megatron_stages.py`) and, for Megatron-DeepSpeed's GPT
defaults at tp 2 -> 1, against Megatron's own resume (`tests/test_megatron_deepspeed.py`).

Megatron's fused attention projection (`...self_attention.query_key_value.weight` and `.bias`, column-parallel)
holds each rank's rows in an order that depends on the Megatron-DeepSpeed version and that no file records
(`readers.pipeline.FUSED_QKV_WHY`): at another degree it is joined and cut in the layout the user declares
(`qkv_layout`: "blocks", [q | k | v] of each rank's heads, since December 2024; "groups", key/value group by
group, before), its heads from the run's `args` (`reshard.qkv`): each target rank's pieces are other runs of
the source's ranks joined one after the other, which its masters, Adam moments and layer-file tensor
follow alike. Checked against Megatron-DeepSpeed's own load (`tests/test_megatron_deepspeed.py`).

Refused, naming the parameter: a parameter the patterns do not split at T' (averaged ones, which
`ds_to_universal` averages and ckptflow does not; `parameter_with_sub_params`, whose shard widths at T'
are not recorded; a dimension T' does not divide), Megatron's fused `query_key_value` at another degree
without a declared layout (or with heads the run's `args` do not give, or T' does not divide),
and a tied module's parameter (`tied_modules.*`) neither vocabulary-parallel nor recorded as replicated
at any tensor-parallel or pipeline change (`readers.pipeline.TIED_WHY`: only those two rules have been
checked on a tied module), but a pipeline change from and to tp 1, where no rule splits a whole tensor.
Trained with `round_robin_gradients`, DeepSpeedZeroOptimizer flattens each model-parallel rank's groups
round-robin over that rank's data-parallel group (`real_dp_process_group`: D ranks). Each source rank's
groups are read in the optimizer's own order (`ZeroCheckpoint.in_optimizer_order`, the round-robin undone
over its D ranks: `_stage_source`, and `pipeline.stage_source` per source stage), and each target rank's
groups flattened round-robin again at its own data-parallel size (`tensor_parallel.plan_zero12`,
`pipeline.plan_stage`). Checked against DeepSpeed's native load at the target, from pp1 x tp2 x dp2 and
pp2 x tp2 x dp2 sources, each axis changing alone and both at once (`tests/test_megatron_stages.py`).

Refused as well: frozen parameters, and another ZeRO stage at the same time (a PipelineModule trains at ZeRO-0
and 1 only). A ZeRO-0 source's optimizer state names no parameter: `megatron_zero0` names it first (its tied
modules by the keys the user gives) and hands these planners the ZeRO-1 checkpoint it then is.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from ckptflow.errors import UnsupportedCheckpointError, option
from ckptflow.formats.deepspeed.client_state import namespace_state
from ckptflow.formats.deepspeed.model import ModelTensor, Param, ZeroCheckpoint
from ckptflow.formats.deepspeed.names import UC_INFO, layer_file_name
from ckptflow.formats.deepspeed.readers.model_parallel import Holding, ModelParallelCheckpoint, join
from ckptflow.formats.deepspeed.readers.pipeline import (
    FUSED_QKV_WHY,
    TIED_WHY,
    TRANSFORMER_LAYER,
    Split,
    declare_qkv_layout,
    fused_qkv,
    position_note,
    split_pieces,
    splits_at,
    tied_module,
    transformer_layers,
)
from ckptflow.formats.deepspeed.runs import Run, whole_run
from ckptflow.reshard.flats import Copies, ModelRuns
from ckptflow.reshard.pipeline import (
    DEFAULT_METHOD,
    TIED,
    LayerFacts,
    Weigh,
    check_stages,
    plan_stage,
    stage_source,
    stages_at,
)
from ckptflow.reshard.pipeline_layers import Layer, TargetStage
from ckptflow.reshard.qkv import in_layout
from ckptflow.reshard.shape import Shape
from ckptflow.reshard.tensor_parallel import at_degree, check_joinable, local_copies, local_runs, plan_zero12
from ckptflow.reshard.units import ModelParallelPlan, TensorFile
from ckptflow.reshard.vocabulary import PADDED_VOCAB, keep_note, vocab_rows_at

GPT_METHOD = "type:transformer"  # GPTModelPipe's partition_method (megatron/model/gpt_model.py)
PP_PARTITION_METHOD = "pp_partition_method"  # in BigScience Megatron-DeepSpeed's args: the method, None for GPT's


def plan_megatron_tensor_parallel(index: ModelParallelCheckpoint, shape: Shape, qkv_layout: str | None = None, *,
                                  optimizer: str | None = None) -> ModelParallelPlan:
    """The plan that writes the Megatron-style checkpoint `index` at `shape` (another tensor-parallel
    degree, the same pipeline stages and ZeRO stage; a fused `query_key_value` joined and cut in the
    `qkv_layout` the user declares, `reshard.qkv`); reads nothing. `optimizer`: the one the target runs
    (`partition.ZERO`, `BF16`), where it is not the source's. `UnsupportedCheckpointError`, in one
    line saying why, for anything else (see the module's docstring)."""
    _check_source(index, shape, qkv_layout=qkv_layout)
    vocab_rows, splits = _splits(index, shape.tp, qkv_layout)
    info = index.ranks[0].model_states[0].get(UC_INFO) or {}
    kind = index.ranks[0].optimizer_kind
    parts = []
    for stage, stage_splits in enumerate(splits):
        module = _module_runs(index, stage, info)
        layers = _stage_layers(index, stage)
        runs = ModelRuns(index, _copies_from(index, stage))
        for t in range(shape.tp):
            mp_rank = stage * shape.tp + t
            pieces = {name: split[1][t] for name, split in stage_splits.items()}
            source = _stage_source(index, stage, stage_splits, shape, t, _info_at(info, shape.tp, vocab_rows))
            plan = plan_zero12(index, source, shape.dp, optimizer or kind, local_copies(pieces, runs.copies), {},
                               mp_rank=mp_rank,
                               meta_base=stage * index.tp * index.world_size)
            # the layer files take the place of the module copy plan_zero12 counts in rank 0's bytes
            files = tuple(_layer_file(index, layer, t, stage_splits, module) for layer in layers)
            first = replace(plan.units[0], tensor_files=files)
            parts.append(replace(plan, units=(first, *plan.units[1:]), module=(), source_optimizer=kind))
    return ModelParallelPlan(
        root=index.root, tag=index.tag, stage=index.stage, precision=index.precision,
        source_world_size=index.world_size, world_size=shape.dp, parts=tuple(parts), carried=(), index=index,
        padded_vocab=vocab_rows, notes=_notes(index, shape.tp),
    )


def plan_megatron_stages(index: ModelParallelCheckpoint, shape: Shape, partition_method: str | None = None,
                         layers: int | None = None, qkv_layout: str | None = None, *,
                         optimizer: str | None = None) -> ModelParallelPlan:
    """The plan that writes the Megatron-style checkpoint `index` at `shape`: another number of pipeline
    stages, and the same or another tensor-parallel degree; reads nothing. The two act on different axes
    and compose: each target stage's parameters are those `pipeline.stages_at` gives it (weighed at the
    target degree, as `PipelineModule` counts the shards it builds), each at its shard's shape at the
    target degree (`splits_at`); the stage's ZeRO-1 files are laid out as `pipeline.plan_stage` lays
    them, each element copied out of the full tensor (`local_copies`) from the source stage and
    tensor-parallel ranks that hold it; the layer files of its layers cut as `plan_megatron_tensor_parallel`
    cuts them (a fused `query_key_value` in the `qkv_layout` the user declares; `optimizer`: as its).
    `UnsupportedCheckpointError`, in one line saying why, for anything else."""
    _check_source(index, shape, stages=True, qkv_layout=qkv_layout)
    vocab_rows, stage_splits = _splits(index, shape.tp, qkv_layout)
    splits = {name: split for stage in stage_splits for name, split in stage.items()}
    info = index.ranks[0].model_states[0].get(UC_INFO) or {}
    info_at = _info_at(info, shape.tp, vocab_rows)
    groups = check_stages(index)
    stages = megatron_stages(index, shape, partition_method, layers, splits)
    module: dict[str, tuple[Run, ...]] = {}
    for source_stage in range(index.pp):
        module.update(_module_runs(index, source_stage, info))
    owners = _layer_owners(index, stages)
    parts = []
    runs: dict[tuple[tuple[str, int], ...], ModelRuns] = {}  # one per tied copies read: the same for every rank t
    for at, stage in enumerate(stages):
        copy_from = _copies_from(index, at, stages)
        key = tuple(sorted(copy_from.items()))
        if key not in runs:
            runs[key] = ModelRuns(index, copy_from)
        for t in range(shape.tp):
            pieces = {name: split[1][t] for name, split in splits.items()}
            shapes = {name: split[0][t] for name, split in splits.items()}

            def restate(state: Mapping[str, Any], t: int = t) -> Mapping[str, Any]:
                return at_degree(state, shape.tp, info_at, tp_rank=t, mp_world_size=shape.tp * shape.pp)

            def local(full: Copies, pieces: Mapping[str, Any] = pieces) -> Copies:
                return local_copies(pieces, full)

            source = stage_source(index, groups, stage, shape, shapes=shapes, restate=restate)
            plan = plan_stage(index, source, shape.dp, mp_rank=at * shape.tp + t, local=local, runs=runs[key],
                              optimizer=optimizer)
            files = tuple(_layer_file(index, layer, t, splits, module)
                          for layer, owner in owners.items() if owner == at)
            first = replace(plan.units[0], tensor_files=files)
            parts.append(replace(plan, units=(first, *plan.units[1:]),
                                 source_optimizer=index.ranks[0].optimizer_kind if optimizer else ""))
    return ModelParallelPlan(
        root=index.root, tag=index.tag, stage=index.stage, precision=index.precision,
        source_world_size=index.world_size, world_size=shape.dp, parts=tuple(parts), carried=(), index=index,
        padded_vocab=vocab_rows, notes=_notes(index, shape.tp),
    )


def _copies_from(index: ModelParallelCheckpoint, at: int, stages: Sequence[TargetStage] | None = None
                ) -> dict[str, int]:
    """The source stage whose copy of each tied parameter target stage `at` of `stages` (None: the source's
    own stages) takes, where it is not the lowest stage's (`ModelParallelCheckpoint.stage_copies`): at the
    source's number of stages, its own; at another, the last target stage holding the tie takes the highest
    source stage's copy (the one that stage's optimizer trained), the first and any middle one the lowest's."""
    out = {}
    for name, stage in index.stage_copies:
        if stages is None or len(stages) == index.pp:
            if stage == at:
                out[name] = stage
            continue
        holders = [s for s, target in enumerate(stages) if _tied_key(name) in target.tied]
        if len(holders) > 1 and at == holders[-1]:
            out[name] = max(stage, out.get(name, stage))
    return out


def _notes(index: ModelParallelCheckpoint, tp: int) -> tuple[str, ...]:
    """What a change to degree `tp` says: the source's padded vocabulary kept, position embeddings read as
    replicated (`readers.pipeline.position_note`); nothing at the source's own degree."""
    if tp == index.tp:
        return ()
    info = index.ranks[0].model_states[0].get(UC_INFO) or {}
    notes = (keep_note(index, tp), position_note(info, [t.name for t in index.tensors]))
    return tuple(note for note in notes if note)


def megatron_stages(index: ModelParallelCheckpoint, shape: Shape, partition_method: str | None = None,
                    layers: int | None = None, splits: Mapping[str, Split] | None = None) -> tuple[TargetStage, ...]:
    """What each of `shape.pp` target stages of the Megatron-style checkpoint `index` holds at `shape.tp`
    (`pipeline.stages_at`, the layers weighed at that degree; `splits`: every parameter's there), cut by
    `partition_method` (None: the one its own run uses, `default_partition_method`)."""
    facts = layer_facts(index)
    method = partition_method or default_partition_method(index, facts)
    if shape.tp == index.tp:
        return stages_at(index, shape.pp, method, layers, facts=facts)
    if splits is None:
        splits = {name: split for stage in _splits(index, shape.tp)[1] for name, split in stage.items()}
    return stages_at(index, shape.pp, method, layers, _weigh(splits), facts)


def default_partition_method(index: ModelParallelCheckpoint, facts: LayerFacts | None = None) -> str:
    """The partition method the Megatron-style checkpoint `index`'s own run cuts its stages by: `pp_partition_method`
    in its `args` where set (BigScience's Megatron-DeepSpeed reads it; microsoft/Megatron-DeepSpeed has none), else
    `GPTModelPipe`'s `type:transformer` where it has Megatron's transformer layers, else `PipelineModule`'s own
    default (`facts`: its `layer_facts`, where the caller has them)."""
    method = _args(index).get(PP_PARTITION_METHOD)
    if isinstance(method, str) and method:
        return method
    return GPT_METHOD if (facts or layer_facts(index)).typed else DEFAULT_METHOD


def _args(index: ModelParallelCheckpoint) -> Mapping[str, Any]:
    """The attributes of the run's Megatron `args` (an `argparse.Namespace` record), {} without them."""
    return namespace_state(index.ranks[0].model_states[0].get("args")) or {}


def layer_facts(index: ModelParallelCheckpoint) -> LayerFacts:
    """What Megatron-DeepSpeed's code says of `index`'s layer list: its transformer layers (`type:transformer`), and
    where its run's `args` build `GPTModelPipe` (as many transformer layers as `num_layers`, no experts), each
    layer's tied key as `GPTModelPipe.__init__` lists the layers: `_to_float16`, the embedding (`TiedLayerSpec('embed')`
    unless `untie_embeddings_and_output_weights`), the transformer layers, the final norm, the head (the tied
    embedding's `forward_fn`, or `LMHeadPipe`), `float16_to_fp32` under fp16 or bf16."""
    typed = transformer_layers(index)
    args = _args(index)
    num_layers, untied, experts = (args.get(k) for k in ("num_layers", "untie_embeddings_and_output_weights",
                                                          "num_experts"))
    half = [args.get(k) for k in ("fp16", "bf16")]
    keys = None
    plain = experts is None or (isinstance(experts, list) and all(e == 1 for e in experts))
    if (typed and type(num_layers) is int and num_layers == len(typed) and type(untied) is bool and plain
            and all(type(h) is bool for h in half)):
        embed = "" if untied else "embed"
        keys = ("", embed, *[""] * num_layers, "", embed, *[""] * any(half))
    return LayerFacts(method=GPT_METHOD, cls=TRANSFORMER_LAYER, typed=typed, keys=keys)


def _splits(index: ModelParallelCheckpoint, tp: int, qkv_layout: str | None = None
            ) -> tuple[int | None, list[dict[str, Split]]]:
    """The vocabulary's padded rows at degree `tp` (None: the source's, kept at its own degree) and every
    stage's splits there, a fused `query_key_value`'s in `qkv_layout` (None: cut as any column-parallel
    parameter, which only the weighing of the layers uses)."""
    try:
        vocab_rows = vocab_rows_at(index, tp) if tp != index.tp else None
        splits = splits_at(index, tp, vocab_rows)
        if qkv_layout is not None and tp != index.tp:
            splits = in_layout(index, splits, tp, qkv_layout)
        return vocab_rows, splits
    except UnsupportedCheckpointError as exc:
        raise UnsupportedCheckpointError(f"{index.root}/{index.tag}: {exc}",
                                         uri=index.root, tensor=exc.tensor) from None


def _weigh(splits: Mapping[str, Split]) -> Weigh:
    """A layer list's weights at the target degree: each layer's parameters' elements on a tensor-parallel
    rank there (every rank holds equal shards: `shard_shapes`), a tied module's at each of its uses."""
    counts: dict[int | str, int] = {}
    for name, (shapes, _) in splits.items():
        at = _tied_key(name) if name.startswith(TIED) else _layer_of(name)
        counts[at] = counts.get(at, 0) + math.prod(shapes[0])

    def weigh(layers: Sequence[Layer]) -> list[Layer]:
        return [(key, counts.get(key or i, 0)) for i, (key, _) in enumerate(layers)]

    return weigh


def _layer_owners(index: ModelParallelCheckpoint, stages: Sequence[TargetStage]) -> dict[int, int]:
    """Each layer file's layer -> the target stage that writes it: the stage holding it; a layer without
    parameters or buffers, the last stage starting before it."""
    firsts = [min(stage.layers) if stage.layers else None for stage in stages]
    out = {}
    for layer in sorted({layer for layer, _ in index.layers}):
        out[layer] = next((s for s, stage in enumerate(stages) if layer in stage.layers),
                          max((s for s, first in enumerate(firsts) if first is not None and first <= layer), default=0))
    return out


def _check_source(index: ModelParallelCheckpoint, shape: Shape, *, stages: bool = False,
                  qkv_layout: str | None = None) -> None:
    """`UnsupportedCheckpointError` unless ckptflow writes the Megatron-style checkpoint `index` at `shape`:
    another tensor-parallel degree, and another number of pipeline stages where `stages` (a fused
    `query_key_value` at another degree only in a `qkv_layout` the user declares)."""
    where = f"{index.root}/{index.tag}"
    assert index.kind == "megatron", "reshard.plan.PLANNERS gives these planners Megatron-style checkpoints only"
    if (shape.pp != index.pp and not stages) or shape.stage != index.stage:
        raise UnsupportedCheckpointError(
            f"{where}: ckptflow changes a Megatron-style checkpoint's tensor-parallel degree at its own number of "
            f"pipeline stages ({index.pp}) and ZeRO stage ({index.stage}) only", uri=index.root,
            hint=f"leave {option('pp')} and {option('stage')} out")
    if shape.pp != index.pp and index.stage != 1:
        raise UnsupportedCheckpointError(
            f"{where} is a ZeRO-{index.stage} Megatron-style checkpoint; ckptflow moves the optimizer state of ZeRO-1 "
            "ones only (a ZeRO-0 optimizer state names no parameter)", uri=index.root)
    fused = fused_qkv(index) if shape.tp != index.tp and qkv_layout is None else None
    if fused is not None:
        raise UnsupportedCheckpointError(f"{where}: {fused} {FUSED_QKV_WHY}", code="unsupported-shape", uri=index.root,
                                         tensor=fused, hint=_fused_hint(index.tp))
    if shape.tp != index.tp:
        check_joinable(index, shape.tp)
    tied = tied_module(index, shape.tp) if (shape.tp, shape.pp) != (index.tp, index.pp) else None
    if tied is not None:
        raise UnsupportedCheckpointError(
            f"{where}: {tied} {TIED_WHY}", code="unsupported-shape", uri=index.root, tensor=tied,
            hint=f"keep the tensor-parallel degree and the pipeline stages (leave {option('tp')} and {option('pp')} "
                 "out) to change the data-parallel size only")


def _fused_hint(tp: int) -> str:
    return f"keep the tensor-parallel degree ({tp}; leave {option('tp')} out), or {declare_qkv_layout()}"


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


def _tied_key(name: str) -> str:
    return name[len(TIED):].partition(".")[0]


def _file_of(name: str, files: Mapping[str, int]) -> tuple[int, str]:
    """The layer whose files hold parameter `name` (a tied module's: `files`, key -> layer) and its name there."""
    if name.startswith(TIED):
        key, _, local = name[len(TIED):].partition(".")
        return files[key], local
    layer, _, local = name.partition(".")
    return int(layer), local


def _stage_layers(index: ModelParallelCheckpoint, stage: int) -> list[int]:
    """The layers whose files stage `stage` writes: those of its parameters, and a layer without any (its
    buffers only, or a tied module's file) after the last one of the stage before it."""
    firsts = [min((_layer_of(p.name) for p in index.ranks[s * index.tp].params if not p.name.startswith(TIED)),
                  default=math.inf) for s in range(index.pp)]
    layers = sorted({layer for layer, _ in index.layers})
    return [layer for layer in layers if max((s for s in range(index.pp) if firsts[s] <= layer), default=0) == stage]


def _stage_source(index: ModelParallelCheckpoint, stage: int, splits: Mapping[str, Split], shape: Shape, t: int,
                  info: Mapping[str, Any]) -> ZeroCheckpoint:
    """Stage `stage`'s data-parallel checkpoint at tensor-parallel rank `t` of `shape.tp`: its parameters at
    their local shapes there, its model states at that degree (ZeRO-1 saves rank 0's only), every source
    rank's partitions and optimizer states (the virtual ranks `mp * D + d`)."""
    first: ZeroCheckpoint = index.ranks[stage * index.tp].in_optimizer_order()
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
    files = {key: layer for key, layer in index.tied_layers}
    out = {}
    for param in index.ranks[stage * index.tp].params:
        layer, local = _file_of(param.name, files)
        refs = {mp: index.layers[(layer, mp % index.tp)][local] for mp in ranks}
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
    cut from the full module copy (a tied module's file, under the layer that first uses it, holds the tied
    module's `tied_modules.{key}.{name}`), the rest (buffers) as tensor-parallel rank 0 holds them."""
    tied = {at: key for key, at in index.tied_layers}
    prefix = f"{TIED}{tied[layer]}." if layer in tied else f"{layer}."
    tensors = []
    for local, ref in index.layers[(layer, 0)].items():
        name = prefix + local
        if name in splits:
            shapes, pieces = splits[name]
            tensors.append((local, shapes[t], local_runs(module[name], pieces[t])))
        else:
            tensors.append((local, tuple(ref.shape), (whole_run(ref, name),)))
    return TensorFile(name=layer_file_name(layer, t), tensors=tuple(tensors))


__all__ = ["GPT_METHOD", "default_partition_method", "layer_facts", "megatron_stages", "plan_megatron_stages",
           "plan_megatron_tensor_parallel"]
