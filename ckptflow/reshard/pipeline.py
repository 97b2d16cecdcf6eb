"""Changing a PipelineModule checkpoint's number of pipeline stages: pp N x dp D -> pp M x dp E. Pure.

What DeepSpeed 0.19.8 saves for a PipelineModule (`runtime/pipe/module.py`, `runtime/engine.py`):
per layer `layer_{XX}-model_states.pt` (the layer's own state dict under its global index, independent of
the stage count: carried as they are), and per stage an ordinary data-parallel ZeRO-1 checkpoint
(`mp_rank_{stage:02d}_model_states.pt` with `module: None`, `zero_pp_rank_{dp}_mp_rank_{stage:02d}_optim_states.pt`)
whose param groups flatten the stage module's `parameters()`: the tied modules first (the
`tied_modules` ModuleDict is registered before the layers, each key where the stage first uses it),
then the layers `{layer}.{name}` in layer order, each split over the client's groups in that order; a
group left with no parameter on a stage is dropped there (DeepSpeed's optimizer keeps none).

Which layers a target stage holds is what `PipelineModule._partition_layers` decides at M from the layer
list, which no file records; `pipeline_layers` rebuilds the lists the files allow, keeps those whose
partition at N gives each source stage what it holds (`--partition-method`, DeepSpeed's default
"parameters", or "uniform"; a "type:" one where the caller knows the layers of its class, `LayerFacts`:
from the names of the layer list's entries the user declares, `declared`, or Megatron's known layers),
and answers only when all give every target stage the same layers and tied modules. Merging every stage
into one (pp1) needs none of it.

A target stage's groups are rebuilt from the parameters it owns in that order (a parameter keeps the
group it had in the source, groups known by their hyper-parameters), laid out by DeepSpeed's ZeRO-1
arithmetic at E ranks; the fp32 masters and Adam moments are element copies out of the source stages'
partitions (a tied module's from the lowest stage that trains it, its copies being equal). Each target
stage is an ordinary `DataParallelPlan` over a virtual `ZeroCheckpoint` whose rank `s * D + d` is
source stage s's data-parallel rank d, and whose ranks `N * D + d` hold the optimizer fields of rank d
re-indexed to the target stage's groups (what `reshard.files` copies from a unit's `meta_rank`), so
`reshard.files` writes it unchanged. The model file of each stage records its own `buffer_names`,
`param_shapes`, `mp_world_size` (tp x pp) and `checkpoint_parallel_dimensions`.

Trained with `round_robin_gradients`, DeepSpeedZeroOptimizer flattens each stage's groups round-robin over
the stage's data-parallel group (`_round_robin_reorder` at the size of `real_dp_process_group`, the stage's
D ranks): each source stage's saved order is undone over its own D ranks (`ZeroCheckpoint.in_optimizer_order`)
before the target stages' parameters are listed, and each target stage's groups are flattened round-robin
again over its E ranks (`flats.zero12_flats`), where the target runs the optimizer that does so
(`ZeroCheckpoint.flattens_round_robin` of the optimizer the stage keeps: BF16_Optimizer ignores the
setting). The stage's virtual source lists its groups in the optimizer's order (`optimizer_ordered`).
Frozen parameters are refused; a ZeRO-0 source is named stage by stage first (`pipeline_zero0`). A
Megatron-style checkpoint (tensor parallelism inside the stages) is regrouped by the same functions, one
target tensor-parallel rank at a time (`megatron.plan_megatron_stages`, round-robin sources included).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ckptflow.errors import UnsupportedCheckpointError, option
from ckptflow.formats.deepspeed.config import is_set
from ckptflow.formats.deepspeed.model import Param, ParamGroup, ZeroCheckpoint
from ckptflow.formats.deepspeed.names import LAYER_FILE_RE, model_file_name, optim_file_name
from ckptflow.formats.deepspeed.partition import BF16, ZERO3, Copy
from ckptflow.formats.deepspeed.readers.model_parallel import ModelParallelCheckpoint
from ckptflow.plumbing.text import excerpt
from ckptflow.reshard.data_parallel import plan_data_parallel
from ckptflow.reshard.flats import Copies, ModelRuns, zero12_flats
from ckptflow.reshard.pipeline_layers import (
    METHODS,
    TYPE,
    Evidence,
    Layer,
    TargetStage,
    describe,
    layer_lists,
    parse_layer_types,
    partition,
    target_stages,
    typed_layers,
)
from ckptflow.reshard.shape import Shape
from ckptflow.reshard.units import DataParallelPlan, ModelParallelPlan, RankUnit

TIED = "tied_modules."
DEFAULT_METHOD = "parameters"  # PipelineModule's own default


def plan_pipeline(index: ModelParallelCheckpoint, shape: Shape, partition_method: str | None = None,
                  layers: int | None = None, layer_types: str | None = None) -> ModelParallelPlan:
    """The plan that writes the PipelineModule checkpoint `index` at `shape` (pp M x dp E), its layers
    assigned to the M stages as `PipelineModule(partition_method=...)` would (`layers`: the length of its
    layer list, when the user knows it; None: what the files allow; `layer_types`: its entries' class or
    function names as the user declares them, `pipeline_layers.parse_layer_types`, which a "type:" method
    weighs by, `declared`); reads nothing.
    `UnsupportedCheckpointError`, in one line saying why and what would work, for anything else."""
    where = f"{index.root}/{index.tag}"
    assert index.kind == "pipeline", "reshard.plan.PLANNERS gives this planner plain PipelineModule checkpoints only"
    if shape.tp != 1:
        raise UnsupportedCheckpointError(f"cannot write {where} at {shape}: a PipelineModule checkpoint has no "
                                         "tensor parallelism", code="unsupported-shape", uri=index.root)
    assert index.stage == 1, "PipelineEngine trains at ZeRO-0 and 1; a ZeRO-0 source goes to `pipeline_zero0`"
    groups = check_stages(index)
    stages = stages_by(index, shape.pp, partition_method, layers, layer_types)
    runs = ModelRuns(index)
    parts = tuple(plan_stage(index, stage_source(index, groups, stage, shape), shape.dp, mp_rank=t, runs=runs)
                  for t, stage in enumerate(stages))
    return ModelParallelPlan(
        root=index.root, tag=index.tag, stage=index.stage, precision=index.precision,
        source_world_size=index.world_size, world_size=shape.dp, parts=parts, carried=index.carried, index=index,
    )


def stages_by(index: ModelParallelCheckpoint, pp: int, partition_method: str | None, layers: int | None,
              layer_types: str | None) -> tuple[TargetStage, ...]:
    """What each of `pp` target stages of `index` holds (`stages_at`), a "type:" method weighing the
    `layer_types` the user declares (`declared`; None: none)."""
    facts = None
    if layer_types is not None:
        layers, facts = declared(index, pp, partition_method, parse_layer_types(layer_types), layers)
    return stages_at(index, pp, partition_method, layers, facts=facts)


# ---- the source stages ---------------------------------------------------------------------------------


def _group_key(group: Any) -> str:
    return repr(sorted((k, repr(v)) for k, v in group.hyper.items() if k != "params"))


def check_stages(index: ModelParallelCheckpoint) -> list[str]:
    """Every param group of `index`'s model-parallel ranks (known by their hyper-parameters), in the
    client's order; `UnsupportedCheckpointError` where its stages' optimizer state cannot be regrouped
    (frozen parameters, ZeRO-3, groups in another order or a parameter in two)."""
    where = f"{index.root}/{index.tag}"
    ranks: Sequence[ZeroCheckpoint] = index.ranks
    for rank in ranks:  # the source's layout must be DeepSpeed's arithmetic at its size (refused otherwise)
        if rank.stage != 0:  # a ZeRO-0 stage's virtual source (`pipeline_zero0`) holds a master per virtual rank
            plan_data_parallel(rank, rank.world_size)
    first = ranks[0]
    frozen = [p.name for rank in ranks for p in rank.params if p.frozen]
    if frozen:
        raise UnsupportedCheckpointError(f"{where} has frozen parameters ({', '.join(frozen[:3])}), which ckptflow "
                                         "does not move between pipeline stages", uri=index.root,
                                         hint=f"keep the number of pipeline stages (leave {option('pp')} out)")
    if first.optimizer_kind == ZERO3:
        raise UnsupportedCheckpointError(f"{where}: a PipelineModule does not train at ZeRO-3", uri=index.root)
    order: list[str] = []
    for s, rank in enumerate(ranks):  # each stage holds the client's groups that kept a parameter, in order
        keys = [_group_key(g) for g in rank.groups]
        at = 0
        for key in keys:
            if key in order:
                if order.index(key) < at:
                    raise UnsupportedCheckpointError(
                        f"{where}: pipeline stage {s} orders its optimizer param groups otherwise than stage 0, so "
                        "the stages' groups cannot be joined", uri=index.root,
                        hint=f"keep the number of pipeline stages (leave {option('pp')} out)")
                at = order.index(key) + 1
            else:
                order.insert(at, key)
                at += 1
    owner: dict[str, str] = {}
    for rank in ranks:
        keys = [_group_key(g) for g in rank.groups]
        for p in rank.params:
            key = keys[p.group] if p.group is not None else ""
            if owner.setdefault(p.name, key) != key:
                raise UnsupportedCheckpointError(
                    f"{where}: {p.name} sits in one param group on one pipeline stage and another on another, so "
                    "the stages' groups cannot be joined", uri=index.root, tensor=p.name)
    return order


def _layer_of(name: str) -> int:
    head = name.split(".", 1)[0]
    return int(head) if head.isdigit() else -1


def _tied_key(name: str) -> str:
    return name[len(TIED):].partition(".")[0]


def _merged(ranks: Sequence[ZeroCheckpoint]) -> TargetStage:
    """One stage holding every layer and tied module, the tied modules in the order the stages first use
    them (the first stage holding a key, its place in that stage's parameters, in module order whatever
    order the optimizer flattened them in)."""
    first_use: dict[str, tuple[int, int]] = {}
    layers: set[int] = set()
    for s, rank in enumerate(ranks):
        for pos, p in enumerate(rank.params):
            if p.name.startswith(TIED):
                first_use.setdefault(_tied_key(p.name), (s, pos))
        layers.update(_named_layers(rank))
    return TargetStage(tuple(sorted(layers)), tuple(sorted(first_use, key=first_use.__getitem__)))


def own_stages(index: ModelParallelCheckpoint) -> tuple[TargetStage, ...]:
    """Each stage of `index` as a target stage: the layers and tied modules it holds."""
    return tuple(_merged([rank]) for rank in index.ranks)


def _named_layers(rank: ZeroCheckpoint) -> set[int]:
    names = [p.name for p in rank.params] + [n for n in rank.model_states[0].get("buffer_names") or []
                                             if isinstance(n, str)]
    return {layer for n in names if (layer := _layer_of(n)) >= 0}


# ---- which layers each target stage holds --------------------------------------------------------------


def evidence(index: ModelParallelCheckpoint, typed: frozenset[int] | None = None) -> Evidence:
    """What `index`'s files say about its layer list (`pipeline_layers.Evidence`), at its own
    tensor-parallel degree (each stage's first tensor-parallel rank); with `typed`, the layers a "type:"
    method's class matches, each layer weighing 1 if it is one of them, else 0, as that method weighs them."""
    ranks: Sequence[ZeroCheckpoint] = index.ranks[::index.tp]
    tied = dict(index.tied_layers)
    counts: dict[int, int] = {}
    sizes: dict[str, int] = {}
    for rank in ranks:
        for p in rank.params:
            if p.name.startswith(TIED):
                sizes.setdefault(_tied_key(p.name), 0)
        for p in rank.params:
            if not p.name.startswith(TIED):
                counts[_layer_of(p.name)] = counts.get(_layer_of(p.name), 0) + p.numel
    for key in sizes:  # a tied module's elements, on the first stage that uses it
        first = next(r for r in ranks if any(q.name.startswith(TIED) and _tied_key(q.name) == key for q in r.params))
        sizes[key] = sum(p.numel for p in first.params if p.name.startswith(TIED) and _tied_key(p.name) == key)
    files = {int(m.group(1)) for name in index.carried if (m := LAYER_FILE_RE.match(name))}
    if typed is not None:
        counts = {layer: int(layer in typed) for layer in files}
        sizes = dict.fromkeys(sizes, 0)
    known = {layer: ("", counts.get(layer, 0)) for layer in files}
    for key, layer in tied.items():
        known[layer] = (key, sizes.get(key, 0))
    return Evidence(known=known, stage_layers=tuple(frozenset(_named_layers(r)) for r in ranks),
                    stage_tied=tuple(frozenset(_tied_key(p.name) for p in r.params if p.name.startswith(TIED))
                                     for r in ranks),
                    tied=sizes, typed=typed)


# A layer list's weights at the target (`PipelineModule` counts the parameters of each layer as built on
# the rank, so at another tensor-parallel degree they are the shards' there).
Weigh = Callable[[Sequence[Layer]], list[Layer]]


@dataclass(frozen=True)
class LayerFacts:
    """What the model's own code says of its layer list where no file does: the one "type:" partition method
    ckptflow computes for it (`method`, as the model passes it, matching class `cls`; `typed`, the layers of
    that class), and each layer's tied module key, or "" for any other, as its own arguments build the list
    (`keys`; None: the files alone decide)."""

    method: str
    cls: str
    typed: frozenset[int]
    keys: tuple[str, ...] | None = None


def declared(index: ModelParallelCheckpoint, pp: int, method: str | None, names: Sequence[str],
             count: int | None = None) -> tuple[int, LayerFacts | None]:
    """What the layer list's `names` the user declares (one per entry, `PipelineModule._find_layer_type`'s)
    tell of `index`'s layers: its length, and for a "type:" `method` the layers it weighs (`LayerFacts`,
    for `stages_at` at `pp` stages). `UnsupportedCheckpointError` where they disagree with `count` (the
    length the user gives besides) or with the files (a layer that saved a file past their end), or where
    the method matches none of them (DeepSpeed builds no such PipelineModule)."""
    where = f"{index.root}/{index.tag}"
    hint = f"give {option('layer_types')} one name per entry of the model's layer list, in order"
    if count is not None and count != len(names):
        raise UnsupportedCheckpointError(
            f"{option('layer_types')} names {len(names)} layers and {option('pipeline_layers')} gives {count}",
            code="unsupported-shape", uri=index.root, hint=f"give one of {option('layer_types')} and "
                                                           f"{option('pipeline_layers')}, or make them agree")
    files = {int(m.group(1)): name for name in index.carried if (m := LAYER_FILE_RE.match(name))}
    past = sorted(i for i in {*files, *(i for r in index.ranks for i in _named_layers(r))} if i >= len(names))
    if past:
        saved = f"saved {files[past[0]]}" if past[0] in files else "holds parameters"
        raise UnsupportedCheckpointError(
            f"{where}: layer {past[0]} {saved}, and {option('layer_types')} names {len(names)} layers "
            f"(0-{len(names) - 1})", code="unsupported-shape", uri=index.root, hint=hint)
    if method is None or not method.lower().startswith(TYPE):
        return len(names), None
    try:
        typed = typed_layers(method, names)
    except ValueError as exc:
        raise UnsupportedCheckpointError(f"cannot tell which layers each of {pp} pipeline stages of {where} holds: "
                                         f"{exc}", code="unsupported-shape", uri=index.root,
                                         hint=f"give the {option('partition_method')} the model was trained with")
    if not typed:
        raise UnsupportedCheckpointError(
            f"cannot tell which layers each of {pp} pipeline stages of {where} holds: partition method "
            f"{excerpt(method)} matches none of the {len(names)} layer names {option('layer_types')} gives "
            "(DeepSpeed finds no layer to partition)", code="unsupported-shape", uri=index.root,
            hint=f"give the {option('partition_method')} the model was trained with, or check {option('layer_types')}")
    return len(names), LayerFacts(method=method.lower(), cls=method.lower().split(":")[1], typed=typed)


def stages_at(index: ModelParallelCheckpoint, pp: int, partition_method: str | None = None,
              count: int | None = None, weigh: Weigh | None = None,
              facts: LayerFacts | None = None) -> tuple[TargetStage, ...]:
    """What each of `pp` target stages of `index` holds: every layer and tied module at pp1, else as
    `PipelineModule(partition_method=...)` (None: its default) cuts the layer lists the files allow
    (`count` layers, when given; `facts`: what the model's code adds), weighed at the target by `weigh`
    (None: as the source weighs them; a "type:" method weighs the same at any degree);
    `UnsupportedCheckpointError` where that is not one answer."""
    ranks: Sequence[ZeroCheckpoint] = index.ranks
    if pp == 1:
        return (_merged(ranks),)
    return _split(index, ranks, pp, partition_method or DEFAULT_METHOD, count, weigh, facts)


def _split(index: ModelParallelCheckpoint, ranks: Sequence[ZeroCheckpoint], pp: int, method: str,
           count: int | None, weigh: Weigh | None = None, facts: LayerFacts | None = None) -> tuple[TargetStage, ...]:
    where = f"{index.root}/{index.tag}"
    hint = f"give the {option('partition_method')} the model was trained with"
    methods = METHODS + ((facts.method,) if facts is not None else ())
    computable = [m for m in methods if facts is None or m != facts.method or facts.typed]
    given, method = method, method.lower()  # as PipelineModule lowers it (a "type:" regex matches ignoring case)
    if method not in methods:
        if not method.startswith(TYPE):
            what = "is not one of PipelineModule's partition methods"
        elif facts is None:
            what = "weighs the layers whose class name matches, and no file records a layer's class"
        else:
            what = (f"weighs the layers whose class name matches, and ckptflow knows one class of its layers, "
                    f"{facts.cls} (partition method {facts.method!r})")
        raise UnsupportedCheckpointError(
            f"cannot tell which layers each of {pp} pipeline stages of {where} holds: partition method "
            f"{excerpt(given)} {what}", code="unsupported-shape", uri=index.root,
            hint=(f"declare the class of each entry of its layer list with {option('layer_types')} (as "
                  f"'Embed,Block*3,LayerNorm'), or use " if facts is None and method.startswith(TYPE) else "use ")
            + ", ".join(f"`{m}`" for m in computable[:-1]) + f" or `{computable[-1]}`")
    if facts is not None and method == facts.method and not facts.typed:
        raise UnsupportedCheckpointError(
            f"cannot tell which layers each of {pp} pipeline stages of {where} holds: partition method "
            f"{excerpt(given)} weighs its {facts.cls} layers, and it has none (DeepSpeed finds no layer to partition)",
            code="unsupported-shape", uri=index.root, hint=hint)
    found = _fitting(index, method, count, facts)
    if not found:
        other = [m for m in computable if m != method and _fitting(index, m, count, facts)]
        of = f" of {count} layers" if count is not None else ""
        raise UnsupportedCheckpointError(
            f"{where}: no layer list{of} the files allow gives its {index.pp} pipeline stages the layers they hold "
            f"under partition method {excerpt(given)}" + (f"; {other[0]!r} does" if other else ""),
            code="unsupported-shape", uri=index.root,
            hint=f"pass {option('partition_method')} {other[0]}" if other else hint)
    modules = frozenset().union(*(_named_layers(r) for r in ranks))
    outcomes: dict[tuple[TargetStage, ...], list[Any]] = {}
    for layers in found:
        weights = weigh(layers) if weigh is not None and not method.startswith(TYPE) else layers
        outcomes.setdefault(target_stages(layers, partition(method, weights, pp), modules), layers)
    if len(outcomes) > 1:
        (a, one), (b, two) = list(outcomes.items())[:2]
        raise UnsupportedCheckpointError(
            f"cannot tell which layers each of {pp} pipeline stages of {where} holds: layer lists the files allow "
            f"({describe(one)}; or {describe(two)}) give the source's stages what they hold under partition method "
            f"{method!r}, and put other layers on the target's stages ({_stages_text(a)}; or {_stages_text(b)})",
            code="unsupported-shape", uri=index.root,
            hint=f"give the length of the model's layer list with {option('pipeline_layers')}, keep the number of "
                 "pipeline stages, or merge them (pp 1)")
    (stages,) = outcomes
    empty = [t for t, stage in enumerate(stages) if not stage.layers and not stage.tied]
    if empty:
        raise UnsupportedCheckpointError(
            f"cannot write {where} at {pp} pipeline stages: stage {empty[0]} would hold no parameter "
            f"({_stages_text(stages)})", code="unsupported-shape", uri=index.root, hint="use fewer pipeline stages")
    return stages


def _fitting(index: ModelParallelCheckpoint, method: str, count: int | None,
             facts: LayerFacts | None = None) -> list[Any]:
    """The layer lists the files allow under `method` (of `count` layers, when given), those whose tied
    modules sit where the model's arguments put them where `facts` says (and `count` does not say otherwise)."""
    keys = facts.keys if facts is not None and (count is None or facts.keys is None or count == len(facts.keys)) \
        else None
    typed = facts.typed if facts is not None and method == facts.method else None
    try:
        lists = layer_lists(evidence(index, typed), method, len(keys) if keys is not None else count)
        return [layers for layers in lists if keys is None or tuple(key for key, _ in layers) == keys]
    except ValueError as exc:
        raise UnsupportedCheckpointError(
            f"cannot tell which layers each pipeline stage of {index.root}/{index.tag} holds: {exc}",
            code="unsupported-shape", uri=index.root,
            hint=f"give the length of the model's layer list with {option('pipeline_layers')}, keep the number of "
                 "pipeline stages, or merge them (pp 1)") from None


def _stages_text(stages: Sequence[TargetStage]) -> str:
    def one(stage: TargetStage) -> str:
        return "+".join([*map(str, stage.layers), *stage.tied]) or "nothing"
    return " | ".join(map(one, stages))


# ---- the virtual source of one target stage ------------------------------------------------------------


def _group_names(ranks: Sequence[ZeroCheckpoint], groups: list[str], stage: TargetStage) -> list[list[str]]:
    """Per group (of `groups`), the target stage's parameters in `PipelineModule.parameters()` order: its
    tied modules first, in `stage.tied` order, then its layers in layer order, a module's parameters in
    the order its source stage's optimizer lists them (round-robin undone over that stage's data-parallel
    ranks, `ZeroCheckpoint.in_optimizer_order`)."""
    tied = {key: i for i, key in enumerate(stage.tied)}
    layers = set(stage.layers)
    listed = [rank.in_optimizer_order() for rank in ranks]
    out = []
    for key in groups:
        names: dict[str, None] = {}
        for rank in listed:
            for g in rank.groups:
                if _group_key(g) == key:
                    names.update(dict.fromkeys(n for n in g.params if (
                        _tied_key(n) in tied if n.startswith(TIED) else _layer_of(n) in layers)))

        def place(name: str) -> tuple[int, int]:
            return (0, tied[_tied_key(name)]) if name.startswith(TIED) else (1, _layer_of(name))

        out.append(sorted(names, key=place))  # stable: a module's parameters keep their stage's order
    return out


def _buffer_names(ranks: Sequence[ZeroCheckpoint], stage: TargetStage) -> list[str]:
    """`buffer_names` as the target stage's module records them: tied modules' first, then by layer."""
    tied = {key: i for i, key in enumerate(stage.tied)}
    names = [n for rank in ranks for n in rank.model_states[0].get("buffer_names") or [] if isinstance(n, str)
             and (_tied_key(n) in tied if n.startswith(TIED) else _layer_of(n) in stage.layers)]
    return sorted(dict.fromkeys(names), key=lambda n: (0, tied[_tied_key(n)]) if n.startswith(TIED)
                  else (1, _layer_of(n)))


def _stage_states(state: Mapping[str, Any], shape: Shape, buffers: list[str]) -> dict[str, Any]:
    out = dict(state)
    out["buffer_names"] = list(buffers)
    if "mp_world_size" in out:
        out["mp_world_size"] = shape.tp * shape.pp
    dims = out.get("checkpoint_parallel_dimensions")
    if isinstance(dims, Mapping):
        out["checkpoint_parallel_dimensions"] = {**dims, "pp_degree": shape.pp}
    return out


def _meta(ranks: Sequence[ZeroCheckpoint], groups: list[str], d: int) -> tuple[Any, Any, Any]:
    """Data-parallel rank d's optimizer fields re-indexed to `groups`: its optimizer file's tree (the base
    optimizer's `state` and `param_groups`), its partitions and file names, each group from the first
    source stage holding it."""
    first = ranks[0]
    states, hypers, partitions = {}, [], []
    for t, key in enumerate(groups):
        rank = next(r for r in ranks if any(_group_key(g) == key for g in r.groups))
        g = next(g.index for g in rank.groups if _group_key(g) == key)
        base = rank.optim_states[d]["optimizer_state_dict"]["base_optimizer_state"]
        if g in (base.get("state") or {}):
            states[t] = base["state"][g]
        hypers.append(base["param_groups"][g])
        partitions.append(replace(rank.partitions[d][g], group=t))
    optim = dict(first.optim_states[d])
    osd = dict(optim["optimizer_state_dict"])
    osd["base_optimizer_state"] = {**osd["base_optimizer_state"], "state": states, "param_groups": hypers}
    optim["optimizer_state_dict"] = osd
    return optim, tuple(partitions), first.files[d]


def stage_source(index: ModelParallelCheckpoint, groups: list[str], stage: TargetStage, shape: Shape, *,
                 shapes: Mapping[str, tuple[int, ...]] | None = None,
                 restate: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None) -> ZeroCheckpoint:
    """A `ZeroCheckpoint` whose rank `s * D + d` is source model-parallel rank s's data-parallel rank d and
    rank `N * D + d` rank d's optimizer fields for the target stage's groups (`groups`: `check_stages`),
    holding the target stage's parameters and groups, and its model-file fields. `shapes`: each
    parameter's shape at the target (None: the full tensor's); `restate`: what else changes in the
    model states (a tensor-parallel rank's fields)."""
    ranks: Sequence[ZeroCheckpoint] = index.ranks
    first = ranks[0]
    full = {t.name: t.shape for t in index.tensors} if shapes is None else shapes
    dtype = {p.name: p.dtype for rank in ranks for p in rank.params}
    names = _group_names(ranks, groups, stage)
    kept = [(key, group) for key, group in zip(groups, names) if group]  # DeepSpeed drops an empty group
    hyper = {_group_key(g): g.hyper for rank in ranks for g in rank.groups}
    params = tuple(Param(n, tuple(full[n]), dtype[n], g) for g, (_, group) in enumerate(kept) for n in group)
    out_groups = tuple(ParamGroup(g, hyper[key], tuple(group)) for g, (key, group) in enumerate(kept))
    buffers = _buffer_names(ranks, stage)
    metas = [_meta(ranks, [key for key, _ in kept], d) for d in range(first.world_size)]
    states = restate or dict
    return replace(
        first, params=params, groups=out_groups, tied={}, optimizer_ordered=True,
        buffers=tuple(b for rank in ranks for b in rank.buffers if b.name in buffers),
        partitions=tuple(part for rank in ranks for part in rank.partitions) + tuple(m[1] for m in metas),
        files=tuple(f for rank in ranks for f in rank.files) + tuple(m[2] for m in metas),
        model_states=tuple(_stage_states(states(m), shape, buffers) for rank in ranks for m in rank.model_states)
        + tuple(_stage_states(states(first.model_states[0]), shape, buffers) for _ in range(first.world_size)),
        optim_states=tuple(o for rank in ranks for o in rank.optim_states) + tuple(m[0] for m in metas),
        module_order=tuple(n for _, group in kept for n in group),
    )


# ---- one target stage ----------------------------------------------------------------------------------


def plan_stage(index: ModelParallelCheckpoint, source: ZeroCheckpoint, world_size: int, *, mp_rank: int,
               local: Callable[[Copies], Copies] | None = None, runs: ModelRuns | None = None,
               optimizer: str | None = None) -> DataParallelPlan:
    """The target stage's ZeRO-1 files (`source`: `stage_source`) at `world_size` data-parallel ranks: each
    group flattened from its parameters in order, partitioned by DeepSpeed's arithmetic, filled by copies
    from the source stages (of the full tensors; `local` turns those into copies of a target shard's). A
    tied parameter is read from the lowest source stage that trains it, or from the one `runs.stages` names
    (a Megatron-style checkpoint's stages keep their own copies: `flats.ModelRuns`; None: `ModelRuns(index)`,
    which its caller builds once for every stage and tensor-parallel rank that reads alike). `optimizer`: the
    one the target stage runs (`partition.ZERO`, `BF16`), where it is not the source's."""
    by_name = source.param_by_name
    optimizer = source.optimizer_kind if optimizer is None else optimizer
    n_tensors = source.tensors_per_partition
    runs = ModelRuns(index) if runs is None else runs
    held: dict[str, int] = {}  # a parameter's group in the source stage it is read from
    for rank in reversed(index.ranks):
        held.update({p.name: p.group for p in rank.params if p.group is not None})
    for name, at in runs.stages.items():
        held[name] = index.ranks[at * index.tp].param_by_name[name].group

    def copies(name: str, _group: int, first: int, last: int, dst: int) -> list[Copy]:
        return runs.copies(name, held[name], first, last, dst)

    laid = zero12_flats([[by_name[n] for n in group.params] for group in source.groups], world_size,
                        local(copies) if local is not None else copies,
                        aligned=is_set(source.zero_config, "parameter_alignment"), bf16=optimizer == BF16,
                        round_robin=source.flattens_round_robin(optimizer))
    flats, paddings, slices = laid.flats, laid.paddings, laid.slices
    flat_shapes, param_paddings = laid.shapes, laid.param_paddings
    meta = len(index.ranks) * index.world_size  # the virtual ranks holding the stage's optimizer fields
    units = []
    for r in range(world_size):
        moved = sum(c.numel for f in flats[r] for c in f.copies)
        units.append(RankUnit(
            rank=r, meta_rank=meta + min(r, index.world_size - 1),
            optim_file=optim_file_name(source.precision, r, mp_rank),
            model_file=model_file_name(source.stage, 0, mp_rank) if r == 0 else None, flats=tuple(flats[r]),
            group_paddings=tuple(paddings[r]), slice_mappings=tuple(slices[r]), mp_rank=mp_rank,
            read_bytes=4 * n_tensors * moved, write_bytes=4 * n_tensors * sum(f.numel for f in flats[r]),
        ))
    return DataParallelPlan(
        root=index.root, tag=index.tag, stage=source.stage, precision=source.precision, optimizer=optimizer,
        source_world_size=index.world_size, world_size=world_size, flat_shapes=tuple(flat_shapes),
        param_alignment_paddings=tuple(param_paddings), module=(), units=tuple(units), index=source,
    )


__all__ = ["TIED", "LayerFacts", "Weigh", "check_stages", "declared", "evidence", "own_stages", "plan_pipeline",
           "plan_stage", "stage_source", "stages_at", "stages_by"]
