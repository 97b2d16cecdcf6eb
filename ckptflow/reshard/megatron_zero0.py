"""A ZeRO-0 Megatron-style checkpoint at ZeRO-1, at its own tensor-parallel degree and stages or others. Pure.

A Megatron-style checkpoint (a PipelineModule whose layers split over a tensor-parallel group,
`readers.pipeline`) at ZeRO-0 saves each model-parallel rank's weights in the layer files of its
tensor-parallel rank (`layer_XX-model_{tp:02d}-model_states.pt`, whole shards under each layer's local
names) and its optimizer by index in `mp_rank_{MM}_model_states.pt`, with `buffer_names` but no
`param_shapes`, as a plain PipelineModule does stage by stage. So each tensor-parallel rank t is named
as a plain ZeRO-0 PipelineModule is (`pipeline_zero0.stage_modules` over its stages' model-states files
and its own layer files: the layer runs and tied modules that give every stage exactly its buffers and
the shapes of its Adam moments), every tensor-parallel rank's stages holding the same layers; then each
model-parallel rank goes to ZeRO-1 alone (`pipeline_zero0.at_zero1`: `stage.plan_zero0_stage`, its
model-states file with no module), its layer files carried as they are.

The client's `universal_checkpoint_info` is in every model-states file at ZeRO-0 too, and carried; its
patterns say how each parameter splits, not which keys the PipelineModule's tied modules have: those the
user names (`--tied-modules KEY=LAYER`), as for a plain PipelineModule; a model without tied modules needs
nothing.

At another tensor-parallel degree or number of stages, the named ranks are the ZeRO-1 checkpoint they would
be (`zero1_view`: each model-parallel rank `pipeline_zero0.virtual_source`'s, a master per virtual
data-parallel rank; the full tensors the reader's, joined over the tensor-parallel ranks), asked what
`shape.why_not` asks of a ZeRO-1 one (`why_not_zero0_megatron`: `shape.why_not` itself leaves a ZeRO-0
Megatron-style checkpoint to this module, which builds on it) and written by the Megatron-style planners
(`megatron.plan_megatron_tensor_parallel`, `plan_megatron_stages`): the same files as ZeRO-1 at the source's
shape, then resharded. A tied module there is named as the ZeRO-1 checkpoint names it (`zero1_view` with the user's
`--tied-modules`): at ZeRO-0 the reader names it by its layer file (`{layer}.{name}`, joined over the
tensor-parallel ranks by the patterns), the planners move `tied_modules.{key}.{name}`, joined again by the patterns
under that name (`tied_tensors`), each later stage that uses it holding a copy of its own (`stage_copies`: the same
layer file's bytes, DeepSpeed saving the module once, but that stage's optimizer state: `flats.ModelRuns` reads it
from that stage's ranks).

Trained in bf16, a Megatron-style checkpoint at ZeRO-0 gets BF16_Optimizer, which writes its own files per
model-parallel rank (`bf16_zero_pp_rank_{D}_mp_rank_{MM}`, DeepSpeed 0.19.8 cannot load them back) naming every
parameter: the reader names each model-parallel rank by them, as a plain PipelineModule's stages
(`readers.pipeline.bf16_zero0`), so it is the ZeRO-1 checkpoint `bf16_view` gives, written by the Megatron-style
planners at its own degree and stages or others (`_from_bf16`; no `--tied-modules` but those its files name).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from ckptflow.errors import CkptflowError, UnsupportedCheckpointError, option
from ckptflow.formats.deepspeed.model import ModelTensor
from ckptflow.formats.deepspeed.names import UC_INFO, layer_file_name
from ckptflow.formats.deepspeed.partition import ZERO0
from ckptflow.formats.deepspeed.readers.model_parallel import Holding, ModelParallelCheckpoint, Replica, about, join
from ckptflow.formats.deepspeed.readers.pipeline import TIED, bf16_zero0, layer_of, split_pieces
from ckptflow.formats.deepspeed.readers.zero0 import Zero0Checkpoint
from ckptflow.formats.deepspeed.runs import whole_run
from ckptflow.reshard.flats import target_optimizer
from ckptflow.reshard.megatron import plan_megatron_stages, plan_megatron_tensor_parallel
from ckptflow.reshard.pipeline_layers import tied_modules as parse_tied
from ckptflow.reshard.pipeline_zero0 import (
    at_zero1,
    bf16_tied_why,
    stage_modules,
    tied_text,
    virtual_source,
    zero1_states,
)
from ckptflow.reshard.shape import Shape, SplitsByDegree, source_shape, why_not
from ckptflow.reshard.units import ModelParallelPlan


def plan_zero0_megatron(index: ModelParallelCheckpoint, shape: Shape, tied: str | None = None, *,
                        partition_method: str | None = None, layers: int | None = None,
                        qkv_layout: str | None = None) -> ModelParallelPlan:
    """The plan that writes the ZeRO-0 Megatron-style checkpoint `index` at ZeRO-1 at `shape` (any
    tensor-parallel degree, stages and data-parallel size; `tied`: its tied modules, "KEY=LAYER,...", which
    its files do not record); reads nothing. At its own degree and stages each model-parallel rank goes
    alone; at another, the named ranks are a virtual ZeRO-1 source (`zero1_view`, its tied modules named as ZeRO-1
    names them) handed to the Megatron-style planners (`partition_method`, `layers`, `qkv_layout`: as theirs).
    `UnsupportedCheckpointError` where a model-parallel rank's optimizer state cannot be named, or the planners
    refuse the target."""
    assert index.kind == "megatron" and index.stage == 0, "reshard.plan.PLANNERS gives this planner these only"
    assert shape.stage == 1, "shape.why_not refuses other stages"
    if bf16_zero0(index):
        return _from_bf16(index, shape, tied, partition_method, layers, qkv_layout)
    if (shape.tp, shape.pp) != (index.tp, index.pp):
        why = why_not_zero0_megatron(index, source_shape(index), shape, qkv_layout, tied=tied)
        if why is not None:
            raise UnsupportedCheckpointError(f"cannot write {index.tag_uri} ({source_shape(index)}) at {shape}: {why}",
                                             code="unsupported-shape", uri=index.root)
        source = zero1_view(index, named_ranks(index, tied), parse_tied(tied) if tied else {})
        plan = (plan_megatron_stages(source, shape, partition_method, layers, qkv_layout) if shape.pp != index.pp
                else plan_megatron_tensor_parallel(source, shape, qkv_layout))
        parts = tuple(replace(part, stage=1, source_world_size=index.world_size, source_optimizer=ZERO0)
                      for part in plan.parts)
        return replace(plan, parts=parts, source_world_size=index.world_size, index=index)
    ranks = named_ranks(index, tied)
    return ModelParallelPlan(
        root=index.root, tag=index.tag, stage=1, precision=index.precision, source_world_size=index.world_size,
        world_size=shape.dp, parts=tuple(at_zero1(rank, shape.dp) for rank in ranks), carried=index.carried,
        index=index,
    )


def _from_bf16(index: ModelParallelCheckpoint, shape: Shape, tied: str | None, partition_method: str | None,
               layers: int | None, qkv_layout: str | None) -> ModelParallelPlan:
    """The bf16 ZeRO-0 Megatron-style checkpoint `index` (`readers.pipeline.bf16_zero0`) at ZeRO-1 at `shape`:
    the ZeRO-1 checkpoint it reads as (`bf16_view`) written by the Megatron-style planners, at its own degree and
    stages too (each model-parallel rank's layer files cut again at that degree: the same bytes), laid out for the
    optimizer the recorded config gets at ZeRO-1 (`flats.target_optimizer`: DeepSpeedZeroOptimizer, where the
    pipeline accumulates its gradients in bf16)."""
    why = why_not_zero0_megatron(index, source_shape(index), shape, qkv_layout, tied=tied)
    if why is not None:
        raise UnsupportedCheckpointError(f"cannot write {index.tag_uri} ({source_shape(index)}) at {shape}: {why}",
                                         code="unsupported-shape", uri=index.root)
    first = index.ranks[0]
    optimizer = target_optimizer(first.optimizer_kind, 0, 1, first.ds_config)
    view = bf16_view(index)
    plan = (plan_megatron_stages(view, shape, partition_method, layers, qkv_layout, optimizer=optimizer)
            if shape.pp != index.pp else plan_megatron_tensor_parallel(view, shape, qkv_layout, optimizer=optimizer))
    return replace(plan, index=index)


def bf16_view(index: ModelParallelCheckpoint) -> ModelParallelCheckpoint:
    """The bf16 ZeRO-0 Megatron-style checkpoint `index` as the ZeRO-1 one it reads as: its model-parallel ranks
    BF16_Optimizer's partitions, named by its files (`readers.pipeline`), each rank's model states as ZeRO-1
    saves them (`pipeline_zero0.zero1_states`: no `optimizer`)."""
    ranks = tuple(replace(rank, model_states=tuple(zero1_states(m) for m in rank.model_states))
                  for rank in index.ranks)
    return replace(index, stage=1, ranks=ranks)


def named_ranks(index: ModelParallelCheckpoint, tied: str | None = None) -> tuple[Zero0Checkpoint, ...]:
    """Each model-parallel rank of the ZeRO-0 Megatron-style checkpoint `index` with its module rebuilt from
    its tensor-parallel rank's layer files (`pipeline_zero0.stage_modules`), in model-parallel order;
    `UnsupportedCheckpointError` where a tensor-parallel rank's stages cannot be named one way, or two
    tensor-parallel ranks' stages hold other layers."""
    given = parse_tied(tied) if tied else {}
    per_rank = []
    for t in range(index.tp):
        missing = sorted(layer for layer in given.values() if (layer, t) not in index.layers)
        if missing:
            raise UnsupportedCheckpointError(
                f"{index.tag_uri}: {layer_file_name(missing[0], t)} is missing, which the tied modules given "
                f"({tied_text(given)}) say holds one of them", uri=index.root,
                hint=f"name each tied module with the first layer that uses it ({option('tied_modules')} KEY=LAYER), "
                     "or leave it out if the model ties none")
        view = replace(index, ranks=index.ranks[t::index.tp],
                       layers={(layer, 0): content for (layer, u), content in index.layers.items() if u == t})
        stages = stage_modules(view, given)
        if isinstance(stages, str):
            raise UnsupportedCheckpointError(
                f"{index.tag_uri}: tensor-parallel rank {t} of {index.tp}: {stages}", uri=index.root,
                hint="consolidate its weights (`ckptflow consolidate`) and start the optimizer afresh, or resume "
                     "it at ZeRO-0")
        per_rank.append(stages)
    for t, stages in enumerate(per_rank[1:], 1):
        for s, (stage, first) in enumerate(zip(stages, per_rank[0])):
            if _layers(stage) != _layers(first):
                raise UnsupportedCheckpointError(
                    f"{index.tag_uri}: pipeline stage {s} of {index.pp} holds layers {_text(_layers(stage))} on "
                    f"tensor-parallel rank {t} but {_text(_layers(first))} on rank 0, by the only assignment of "
                    "each rank's layer files to the stages that fits its optimizer state; every tensor-parallel "
                    "rank of a stage builds the same layers: the folder mixes saves, re-copy it from one save",
                    uri=index.root)
    return tuple(per_rank[t][s] for s in range(index.pp) for t in range(index.tp))


def zero1_view(index: ModelParallelCheckpoint, ranks: Sequence[Zero0Checkpoint],
               tied: Mapping[str, int] | None = None) -> ModelParallelCheckpoint:
    """`index` as a ZeRO-1 Megatron-style checkpoint whose model-parallel ranks are the named `ranks` (named with
    the tied modules `tied`, key -> the layer whose files hold it) as virtual data-parallel ones
    (`pipeline_zero0.virtual_source`: a master per virtual rank), its full tensors the reader's, joined over the
    tensor-parallel ranks, a tied module's under its stages' names (`tied_tensors`), with `tied_layers` and a
    `stage_copies` entry for each later stage that uses it, as the ZeRO-1 reader gives them."""
    tied = dict(tied or {})
    virtual = virtual_source(index, ranks, tied)
    tensors, replicas = tied_tensors(index, tied)
    uses = [_uses(ranks[s * index.tp]) for s in range(index.pp)]
    copies = {}
    for tensor in tensors:
        holders = [s for s, keys in enumerate(uses) if tensor.name.startswith(TIED) and _tied_key(tensor.name) in keys]
        copies.update({(tensor.name, s): tensor for s in holders[1:]})
    return replace(virtual, stage=1, tensors=tensors, replicas=replicas, stage_copies=copies)


def tied_tensors(index: ModelParallelCheckpoint, tied: Mapping[str, int]) -> tuple[tuple[ModelTensor, ...],
                                                                                   tuple[Replica, ...]]:
    """The ZeRO-0 Megatron-style checkpoint `index`'s full tensors and replicas with each tied module's (`tied`: key
    -> the layer whose files hold it) named `tied_modules.{key}.{name}` and joined over the tensor-parallel ranks
    again under that name, by the rules the reader joins by (`readers.pipeline.split_pieces`: the patterns name the
    tied module's parameters so); `UnsupportedCheckpointError` where they do not join."""
    if not tied:
        return index.tensors, index.replicas
    owned = {layer: key for key, layer in tied.items()}
    info = index.ranks[0].model_states.get(UC_INFO) or {}
    ranks = range(index.tp)
    tensors, replicas = [], [r for r in index.replicas if layer_of(r.name) not in owned]
    for old in index.tensors:
        layer = layer_of(old.name)
        if layer not in owned:
            tensors.append(old)
            continue
        local = old.name.split(".", 1)[1]
        name = f"{TIED}{owned[layer]}.{local}"
        refs = [index.layers[(layer, t)][local] for t in ranks]
        pieces = {t: ModelTensor(name, ref.shape, ref.dtype, old.kind, (whole_run(ref, name),))
                  for t, ref in zip(ranks, refs)}
        try:
            full, split, rows = split_pieces(name, [ref.shape for ref in refs], info, index.tp, old.kind)
            tensor, pairs = join(name, full, old.kind, [Holding(t, name, tuple(p)) for t, p in zip(ranks, split)],
                                 lambda t, _name: pieces[t], rows=rows)
        except (CkptflowError, ValueError) as exc:
            raise UnsupportedCheckpointError(f"{index.tag_uri}: {about(name, exc)}", uri=index.root,
                                             tensor=name) from None
        tensors.append(tensor)
        replicas.extend(pairs)
    return tuple(tensors), tuple(replicas)


def named_view(index: ModelParallelCheckpoint, tied: str | None = None) -> ModelParallelCheckpoint | str:
    """`zero1_view` of the ZeRO-0 Megatron-style checkpoint `index` named with the tied modules `tied`
    ("KEY=LAYER,...", as the user gives them; None: none), what another tensor-parallel degree or number of stages
    takes, or why it cannot be; in bf16, `bf16_view` (its tied modules those its files name)."""
    if bf16_zero0(index):
        why = bf16_tied_why(index, tied)
        return bf16_view(index) if why is None else why
    try:
        return zero1_view(index, named_ranks(index, tied), parse_tied(tied) if tied else {})
    except UnsupportedCheckpointError as exc:
        return str(exc)


def why_not_zero0_megatron(index: ModelParallelCheckpoint, source: Shape, shape: Shape, qkv_layout: str | None = None,
                           *, splits: SplitsByDegree | None = None, tied: str | None = None) -> str | None:
    """Why ckptflow cannot write the ZeRO-0 Megatron-style checkpoint `index` at ZeRO-1 at `shape`, or None: at
    its own degree and stages the planner names it (with the tied modules the user gives); at another, it is named
    with them (`tied`, "KEY=LAYER,...") and asked as the ZeRO-1 checkpoint it then is (`shape.why_not`). In bf16
    (`readers.pipeline.bf16_zero0`) its files name it: `tied` checked against them, and another degree or stages
    asked of `bf16_view`."""
    if bf16_zero0(index) and (shape.tp, shape.pp) == (source.tp, source.pp):
        return bf16_tied_why(index, tied)
    if (shape.tp, shape.pp) == (source.tp, source.pp):
        try:
            named_ranks(index, tied)  # what its planner names, with the tied modules given
        except UnsupportedCheckpointError as exc:
            return str(exc)
        return None
    view = named_view(index, tied)
    return view if isinstance(view, str) else why_not(view, replace(source, stage=1), shape, qkv_layout, splits=splits)


def _layers(stage: Zero0Checkpoint) -> tuple[str, ...]:
    """The layers (and tied module keys) a named stage's module holds."""
    return tuple(dict.fromkeys(
        ".".join(t.name.split(".", 2)[:2]) if t.name.startswith(TIED) else t.name.split(".", 1)[0]
        for t in stage.tensors))


def _tied_key(name: str) -> str:
    return name[len(TIED):].partition(".")[0]


def _uses(stage: Zero0Checkpoint) -> frozenset[str]:
    """The tied module keys a named stage's module holds."""
    return frozenset(_tied_key(t.name) for t in stage.tensors if t.name.startswith(TIED))


def _text(layers: tuple[str, ...]) -> str:
    return ", ".join(layers) or "none"


__all__ = ["bf16_view", "named_ranks", "named_view", "plan_zero0_megatron", "tied_tensors", "why_not_zero0_megatron",
           "zero1_view"]
