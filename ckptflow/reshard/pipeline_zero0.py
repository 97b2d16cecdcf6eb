"""A ZeRO-0 PipelineModule checkpoint at ZeRO-1, at its own number of pipeline stages or another. Pure.

At ZeRO-0 a PipelineModule saves its weights in the layer files (`layer_XX-model_states.pt`, whole,
under each layer's local names) and each stage's optimizer in `mp_rank_{stage:02d}_model_states.pt` by
index, with `buffer_names` but no `param_shapes` (`readers.pipeline`). What ZeRO-1 needs of each stage,
its parameters named in the stage module's `parameters()` order, is rebuilt from those files: the stage
module is its tied modules first (`tied_modules.{key}.{name}`, the ModuleDict registered before the
layers, each key where the stage first uses it), then its own layers `{layer}.{name}` in layer order, a
layer's tensors in its file's order; the stages hold contiguous runs of the layer files that are not tied
modules. `stage_modules` tries every such assignment (each stage's run and the tied modules it uses) and
keeps those that give every stage exactly its `buffer_names`, as many trainable tensors as its
optimizer holds (frozen parameters are refused) and one naming of its optimizer state
(`readers.zero0.named_groups`: the Adam moments' shapes, in module order); it answers only when exactly
one assignment is left.

The keys of the tied modules (`TiedLayerSpec(key, ...)`) are recorded in no ZeRO-0 file, and ZeRO-1
records them in every stage's `param_shapes` and `param_slice_mappings`: the user names them, with the
layer whose file holds each (`pipeline_layers.tied_modules`, `--tied-modules embed=0`); a pipeline
without tied modules needs nothing. Each stage is then a ZeRO-0 checkpoint with a module and goes to
ZeRO-1 as a data-parallel one does (`stage.plan_zero0_stage`: the fp32 masters the layer files' weights,
the moments and step the stage's own), its model-states file keeping `module: None` as a PipelineModule
saves it; the layer files are carried as they are (ZeRO-1 saves the same ones).

A tied module's weights come from the one layer file DeepSpeed saved them in, on every stage that uses
it (DeepSpeed keeps the copies equal: their gradients are summed over the stages before each step); its
moments are each stage's own.

At another number of stages, the named stages are a virtual ZeRO-1 source (`virtual_source`: each stage
`stage.zero0_source`'s index, a master per virtual rank) regrouped by the ZeRO-1 pipeline planner's own
functions (`pipeline.check_stages`, `stages_at`, `stage_source`, `plan_stage`: the layers each target stage
holds, its groups in `parameters()` order, each parameter's masters and moments copied from the stage that
trained it), so it writes what ZeRO-1 at the source's stages, then `--pp`, writes.

Trained in bf16, a ZeRO-0 PipelineModule gets BF16_Optimizer, whose own files name every parameter (its
`param_slice_mappings`, tied modules' keys included): the reader reads its stages as BF16_Optimizer's ZeRO-1
partitions under a ZeRO-0 index (`readers.pipeline.bf16_zero0`), and `_from_bf16` regroups them as the ZeRO-1
planner does (at its own stages, each keeps what it holds; no `--tied-modules`), laid out for the optimizer the
same config gets at ZeRO-1 (DeepSpeedZeroOptimizer), the model-states files without the `optimizer` ZeRO-0
saved there.
A Megatron-style one is named the same way per tensor-parallel rank (`megatron_zero0`), and in bf16 read as
BF16_Optimizer's ZeRO-1 partitions per model-parallel rank too (`megatron_zero0.bf16_view`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

from ckptflow.errors import UnsupportedCheckpointError, option
from ckptflow.formats.deepspeed.model import ModelTensor, Partition, ZeroCheckpoint
from ckptflow.formats.deepspeed.names import layer_file_name
from ckptflow.formats.deepspeed.partition import ZERO0
from ckptflow.formats.deepspeed.readers.model_parallel import ModelParallelCheckpoint
from ckptflow.formats.deepspeed.readers.pipeline import TIED, bf16_zero0
from ckptflow.formats.deepspeed.readers.zero0 import Zero0Checkpoint, named_groups
from ckptflow.formats.deepspeed.runs import whole_run
from ckptflow.formats.torch.tensorref import DTYPE_SIZES, TensorRef
from ckptflow.reshard.flats import ModelRuns, target_optimizer
from ckptflow.reshard.pipeline import check_stages, own_stages, plan_stage, stage_source, stages_by
from ckptflow.reshard.pipeline_layers import tied_modules as parse_tied
from ckptflow.reshard.shape import Shape
from ckptflow.reshard.stage import plan_zero0_stage, zero0_source
from ckptflow.reshard.units import DataParallelPlan, ModelParallelPlan

MAX_TRIES = 20_000  # stage modules named (`named_groups`) before the search is refused


def plan_zero0_pipeline(index: ModelParallelCheckpoint, shape: Shape, tied: str | None = None, *,
                        partition_method: str | None = None, layers: int | None = None,
                        layer_types: str | None = None) -> ModelParallelPlan:
    """The plan that writes the ZeRO-0 PipelineModule checkpoint `index` at ZeRO-1 at `shape` (`tied`: its
    tied modules, "KEY=LAYER,...", which its files do not record); reads nothing. At its own number of
    stages each stage goes alone; at another, the stages named here are regrouped as `pipeline` regroups
    ZeRO-1 stages (`partition_method`, `layers`, `layer_types`: as `pipeline.plan_pipeline`'s), over a virtual ZeRO-1
    source (`virtual_source`). `UnsupportedCheckpointError` where its stages' optimizer state cannot be
    named, or the target's stages not told."""
    assert index.kind == "pipeline" and index.stage == 0, "reshard.plan.PLANNERS gives this planner these only"
    assert shape.tp == 1 and shape.stage == 1, "shape.why_not refuses other shapes"
    if bf16_zero0(index):
        return _from_bf16(index, shape, tied, partition_method, layers, layer_types)
    stages = stage_modules(index, parse_tied(tied) if tied else {})
    if isinstance(stages, str):
        guessed = why_not_stages_zero0(index, index.pp) if not tied else None  # the layer holding a tied module
        raise UnsupportedCheckpointError(f"{index.tag_uri}: {guessed or stages}", uri=index.root,
                                         hint=None if guessed else "consolidate its weights (`ckptflow consolidate`) "
                                         "and start the optimizer afresh, or resume it at ZeRO-0")
    if shape.pp != index.pp:
        return _regrouped(index, stages, parse_tied(tied) if tied else {}, shape, partition_method, layers,
                          layer_types)
    parts = tuple(at_zero1(stage, shape.dp) for stage in stages)
    return ModelParallelPlan(
        root=index.root, tag=index.tag, stage=1, precision=index.precision, source_world_size=index.world_size,
        world_size=shape.dp, parts=parts, carried=index.carried, index=index,
    )


def _from_bf16(index: ModelParallelCheckpoint, shape: Shape, tied: str | None, partition_method: str | None,
               layers: int | None, layer_types: str | None) -> ModelParallelPlan:
    """The ZeRO-0 BF16_Optimizer pipeline `index` (`readers.pipeline.bf16_zero0`) at ZeRO-1: its stages, named
    by its files, regrouped as ZeRO-1 stages are (`pipeline`; at its own number of stages each keeps what it
    holds), laid out for the optimizer the recorded config gets at ZeRO-1 (`flats.target_optimizer`:
    DeepSpeedZeroOptimizer, since a bf16 pipeline at ZeRO-0 accumulates its gradients in bf16), the model-states
    files as ZeRO-1 saves them (no `optimizer`; `shared_params` a mapping, `param_shapes` the target's)."""
    if (why := bf16_tied_why(index, tied)) is not None:
        raise UnsupportedCheckpointError(f"{index.tag_uri}: {why}", code="unsupported-shape", uri=index.root)
    groups = check_stages(index)
    targets = (own_stages(index) if shape.pp == index.pp
               else stages_by(index, shape.pp, partition_method, layers, layer_types))
    first = index.ranks[0]
    optimizer = target_optimizer(first.optimizer_kind, 0, 1, first.ds_config)
    runs = ModelRuns(index)
    parts = tuple(replace(plan_stage(index, stage_source(index, groups, target, shape, restate=zero1_states),
                                     shape.dp, mp_rank=t, runs=runs, optimizer=optimizer),
                          source_optimizer=first.optimizer_kind)
                  for t, target in enumerate(targets))
    return ModelParallelPlan(
        root=index.root, tag=index.tag, stage=1, precision=index.precision, source_world_size=index.world_size,
        world_size=shape.dp, parts=parts, carried=index.carried, index=index,
    )


def bf16_tied_why(index: ModelParallelCheckpoint, tied: str | None) -> str | None:
    """Why the tied modules the user gives (`tied`) are not those a BF16_Optimizer pipeline's files name, or None."""
    named = dict(index.tied_layers)
    if tied is None or parse_tied(tied) == named:
        return None
    return (f"its optimizer files name its tied modules ({tied_text(named) or 'none'}), and "
            f"{option('tied_modules')} gives {tied}; leave {option('tied_modules')} out")


def zero1_states(states: Mapping[str, Any]) -> dict[str, Any]:
    """A ZeRO-0 stage's model states as ZeRO-1 saves them: the optimizer in its own files, not here, and the
    tied aliases a mapping (a PipelineModule's stage module aliases none)."""
    return {**states, "optimizer": None, "shared_params": {}}


def at_zero1(stage: Zero0Checkpoint, world_size: int) -> DataParallelPlan:
    """One stage (a ZeRO-0 checkpoint whose module `stage_modules` rebuilt) at ZeRO-1, its model-states
    file with no module, as a PipelineModule saves it."""
    plan = plan_zero0_stage(stage, world_size, 1)
    index = plan.index
    states = tuple({**m, "module": None} for m in index.model_states)
    module = sum(p.numel * DTYPE_SIZES[p.dtype] for p in index.params) + index.buffer_bytes  # not written: none
    units = tuple(replace(u, read_bytes=u.read_bytes - module, write_bytes=u.write_bytes - module) if u.model_file
                  else u for u in plan.units)
    return replace(plan, index=replace(index, model_states=states), module=(), units=units)


def why_not_stages_zero0(index: ModelParallelCheckpoint, pp: int, tied: str | None = None,
                         partition_method: str | None = None, layers: int | None = None,
                         layer_types: str | None = None) -> str | None:
    """Why ckptflow cannot write the ZeRO-0 PipelineModule checkpoint `index` at ZeRO-1 with `pp` stages
    (`tied`: its tied modules as the user names them, "KEY=LAYER,...", or None), or None where it can, or
    cannot tell before writing (the planner then refuses what it cannot write): its stages not named with
    those tied modules (`stage_modules`), or the partition method (None: PipelineModule's default; `layers`,
    `layer_types`: as `pipeline.stages_by`'s) not saying which layers each of `pp` stages holds. Without
    `tied`, its stages are named as if it tied no module, or one whose file is any one layer file; where
    exactly one of those fits and it ties a module, the reason names that layer and asks for the module's
    key, which no ZeRO-0 file records. Trained in bf16 (`readers.pipeline.bf16_zero0`), its stages are
    those its files name, `tied` checked against them."""
    unchecked = pp == index.pp or (pp == 1 and layer_types is None)  # declared layer types are checked at pp1 too
    if bf16_zero0(index):
        if (why := bf16_tied_why(index, tied)) is not None or unchecked:
            return why
        try:
            stages_by(index, pp, partition_method, layers, layer_types)
        except UnsupportedCheckpointError as exc:
            return str(exc)
        return None
    if tied is not None:
        given = parse_tied(tied)
        named = stage_modules(index, given)
        if isinstance(named, str):
            return named
        found = [(given, named)]
    else:
        found = []
        for guess in [{}, *({"tied": layer} for (layer, t) in sorted(index.layers) if t == 0)]:
            stages = stage_modules(index, guess)
            if not isinstance(stages, str):
                found.append((guess, stages))
        if len(found) != 1:
            return None
        if found[0][0]:
            layer = found[0][0]["tied"]
            return (f"its stages use a tied module held in {layer_file_name(layer, None)}, whose TiedLayerSpec key no "
                    f"ZeRO-0 file records: give it with {option('tied_modules')} KEY={layer}")
    keys, stages = found[0]
    if unchecked:
        return None
    try:
        stages_by(virtual_source(index, stages, keys), pp, partition_method, layers, layer_types)
    except UnsupportedCheckpointError as exc:
        return str(exc)
    return None


def _regrouped(index: ModelParallelCheckpoint, stages: Sequence[Zero0Checkpoint], tied: Mapping[str, int],
               shape: Shape, partition_method: str | None, layers: int | None,
               layer_types: str | None = None) -> ModelParallelPlan:
    """The named `stages` regrouped at `shape.pp` stages by the ZeRO-1 pipeline planner's functions."""
    source = virtual_source(index, stages, tied)
    groups = check_stages(source)
    targets = stages_by(source, shape.pp, partition_method, layers, layer_types)
    runs = ModelRuns(source)
    parts = tuple(replace(plan_stage(source, replace(stage_source(source, groups, target, shape), stage=1), shape.dp,
                                     mp_rank=t, runs=runs), source_world_size=index.world_size, source_optimizer=ZERO0)
                  for t, target in enumerate(targets))
    return ModelParallelPlan(
        root=index.root, tag=index.tag, stage=1, precision=index.precision, source_world_size=index.world_size,
        world_size=shape.dp, parts=parts, carried=index.carried, index=index,
    )


def virtual_source(index: ModelParallelCheckpoint, stages: Sequence[Zero0Checkpoint],
                    tied: Mapping[str, int]) -> ModelParallelCheckpoint:
    """`index` as a ZeRO-0 pipeline whose stages are `stage.zero0_source`'s virtual data-parallel indexes
    (a master per virtual rank), each over as many virtual ranks as the largest has (a smaller one repeats its
    last, which no copy reads; its optimizer fields on every one, recording the ZeRO stage so that the
    regrouped stage is DeepSpeedZeroOptimizer's); the full tensors under the stage modules' names."""
    sources = []
    for stage in stages:
        named = named_groups(stage)
        assert not isinstance(named, str), "stage_modules named it"
        sources.append(zero0_source(replace(stage, model_states={**stage.model_states, "module": None}), *named))
    width = max(len(s.partitions) for s in sources)
    ranks = []
    for s in sources:
        partitions = s.partitions + (s.partitions[-1],) * (width - len(s.partitions))
        ranks.append(replace(s, world_size=width, partitions=partitions,
                             optim_states=tuple(_optim_state(s, part) for part in partitions),
                             files=s.files * width, model_states=s.model_states * width))
    tensors = {t.name: t for stage in stages for t in stage.tensors}
    return replace(index, world_size=width, ranks=tuple(ranks), tensors=tuple(tensors.values()), replicas=(),
                   tied_layers=tuple(sorted(tied.items())))


def _optim_state(source: ZeroCheckpoint, partitions: Sequence[Partition]) -> dict[str, Any]:
    """`source`'s optimizer file as a virtual rank holding `partitions` saves it: each group's state over
    its own master (the group's step), and the ZeRO stage DeepSpeedZeroOptimizer records."""
    optim = source.optim_states[0]
    osd = optim["optimizer_state_dict"]
    base = osd["base_optimizer_state"]
    state = {g: {k: base["state"][g].get(k) if k == "step" else v for k, v in part.state.items()}
             for g, part in enumerate(partitions) if g in base["state"]}
    return {**optim, "optimizer_state_dict": {**osd, "base_optimizer_state": {**base, "state": state},
                                              "zero_stage": 1}}


# ---- each stage's module -------------------------------------------------------------------------------


def stage_modules(index: ModelParallelCheckpoint, tied: Mapping[str, int]) -> tuple[Zero0Checkpoint, ...] | str:
    """Each stage of the ZeRO-0 PipelineModule checkpoint `index` with its module rebuilt from the layer
    files (`tied`: each tied module's key and the layer whose file holds it), or why not: no assignment of
    the layer files to its stages fits every stage's files, or more than one does (the module docstring)."""
    layers = {layer: content for (layer, t), content in index.layers.items() if t == 0}
    missing = sorted(layer for layer in tied.values() if layer not in layers)
    if missing:
        return (f"{layer_file_name(missing[0], None)} is missing, which the tied modules given "
                f"({tied_text(tied)}) say holds one of them")
    own = sorted(layer for layer in layers if layer not in tied.values())
    keys = sorted(tied, key=tied.__getitem__)
    uses = [perm for n in range(len(keys) + 1) for chosen in itertools.combinations(keys, n)
            for perm in itertools.permutations(chosen)]
    ranks: Sequence[Zero0Checkpoint] = index.ranks
    buffers = [frozenset(n for n in r.model_states.get("buffer_names") or () if isinstance(n, str)) for r in ranks]
    every_buffer = frozenset().union(*buffers)
    tries = 0
    fits: dict[tuple[int, int, int, tuple[str, ...]], Zero0Checkpoint | None] = {}

    def fit(s: int, first: int, last: int, use: tuple[str, ...]) -> Zero0Checkpoint | None:
        nonlocal tries
        key = (s, first, last, use)
        if key not in fits:
            module = {f"{TIED}{k}.{local}": ref for k in use for local, ref in layers[tied[k]].items()}
            module.update({f"{layer}.{local}": ref for layer in own[first:last]
                           for local, ref in layers[layer].items()})
            if tries >= MAX_TRIES:
                raise _TooMany
            tries += 1
            fits[key] = _named_stage(ranks[s], module, buffers[s], every_buffer)
        return fits[key]

    def assignments(s: int, first: int) -> Iterator[list[Zero0Checkpoint]]:
        if s == len(ranks):
            if first == len(own):
                yield []
            return
        ends = [len(own)] if s == len(ranks) - 1 else range(first, len(own) + 1)
        for last in ends:
            for use in uses:
                stage = fit(s, first, last, use)
                if stage is not None:
                    for rest in assignments(s + 1, last):
                        yield [stage, *rest]

    try:
        found = list(itertools.islice(assignments(0, 0), 2))
    except _TooMany:
        return (f"its {len(ranks)} pipeline stages' optimizer state could be named in too many ways to check (more "
                f"than {MAX_TRIES:,} stage modules tried)")
    given = f" with the tied modules given ({tied_text(tied)})" if tied else ""
    if not found:
        hint = "" if tied else (f"; if its PipelineModule ties modules (TiedLayerSpec), name each with "
                                f"{option('tied_modules')} KEY=LAYER (its key and the first layer that uses it), "
                                "which no ZeRO-0 file records")
        return (f"ZeRO-0 saves its pipeline stages' optimizer state by index and no parameter name, and no "
                f"assignment of its layer files to its {len(ranks)} stages{given} gives each stage its "
                f"buffer_names and the shapes of its Adam moments in module order, with no frozen parameter{hint}")
    if len(found) > 1:
        return (f"ZeRO-0 saves its pipeline stages' optimizer state by index and no parameter name, and more than "
                f"one assignment of its layer files to its {len(ranks)} stages{given} gives each stage its "
                "buffer_names and the shapes of its Adam moments in module order")
    return tuple(found[0])


class _TooMany(Exception):
    pass


def _named_stage(rank: Zero0Checkpoint, module: dict[str, TensorRef], buffers: frozenset[str],
                 every_buffer: frozenset[str]) -> Zero0Checkpoint | None:
    """`rank` with `module` as its module, if it fits: its buffers exactly the stage's `buffer_names`, as
    many trainable tensors as the optimizer holds (none frozen), and its optimizer state named one way."""
    if {n for n in module if n in every_buffer} != buffers or not buffers <= module.keys():
        return None
    weights = [n for n in module if n not in buffers]
    if rank.precision != "fp32" or len(weights) != rank.optimizer_params:
        return None
    tensors = tuple(ModelTensor(n, ref.shape, ref.dtype, "buffer" if n in buffers else "param", (whole_run(ref, n),))
                    for n, ref in module.items())
    stage = replace(rank, tensors=tensors, model_states={**rank.model_states, "module": module})
    named = named_groups(stage)
    return None if isinstance(named, str) or named[1] else stage


def tied_text(tied: Mapping[str, int]) -> str:
    return ",".join(f"{k}={layer}" for k, layer in tied.items())


__all__ = ["at_zero1", "bf16_tied_why", "plan_zero0_pipeline", "stage_modules", "tied_text", "virtual_source",
           "why_not_stages_zero0", "zero1_states"]
