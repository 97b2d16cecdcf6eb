"""The reshard plan: any source shape to a target shape. Pure.

`plan_reshard(index, target)` resolves the `Target` (ranks, and the degrees that change) into the
`Shape` it means for this checkpoint (`reshard.shape.resolve`: refused in one line, naming the shapes
that would work, when it does not divide, the layout forbids it or ckptflow cannot write it yet), then
hands it to the planner of the axis that changes: the data-parallel planner (`data_parallel`: the data
parallelism and the ZeRO stage), the tensor-parallel one (`tensor_parallel`: merged to tp1 or split to
any degree), the pipeline one (`pipeline`: PipelineModule stages merged or cut again), the
expert-parallel one (`experts`: another expert-parallel degree, at any stage AutoEP trains at), the
Megatron-style one (`megatron`: another tensor-parallel degree by the client's
`universal_checkpoint_info`, another number of pipeline stages with it or alone; from ZeRO-0, named first:
`megatron_zero0`). Which one is one table,
`PLANNERS`: (the index's layout kind, the first axis that changes) -> planner, each entry naming the
reader's type its planner takes; a pair not in it is refused in one line. Every planner returns a
`ReshardPlan` (`units`) that `reshard.files` and `reshard.run` write. Nothing here reads a byte.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from ckptflow.errors import UnsupportedCheckpointError, option
from ckptflow.formats.deepspeed.model import Partitioned, ZeroCheckpoint
from ckptflow.formats.deepspeed.partition import BF16
from ckptflow.formats.deepspeed.readers.experts import ExpertCheckpoint
from ckptflow.formats.deepspeed.readers.model_parallel import ModelParallelCheckpoint
from ckptflow.formats.deepspeed.readers.optimizer_shards import OptimizerShards
from ckptflow.formats.deepspeed.readers.pipeline import BF16_ZERO0_LOAD, Split, bf16_zero0
from ckptflow.formats.deepspeed.readers.zero0 import Zero0Checkpoint
from ckptflow.reshard.data_parallel import (
    plan_data_parallel,
    plan_expert_parallel,
    plan_model_parallel,
    plan_shard_folder,
)
from ckptflow.reshard.experts import plan_expert_degree, plan_expert_from_zero3, plan_moe_zero0
from ckptflow.reshard.flats import target_optimizer
from ckptflow.reshard.megatron import megatron_stages, plan_megatron_stages, plan_megatron_tensor_parallel
from ckptflow.reshard.megatron_zero0 import named_view, plan_zero0_megatron, why_not_zero0_megatron
from ckptflow.reshard.pipeline import plan_pipeline, stages_by
from ckptflow.reshard.pipeline_zero0 import plan_zero0_pipeline, why_not_stages_zero0
from ckptflow.reshard.shape import (
    Shape,
    SplitsByDegree,
    Target,
    check_world_size,
    is_positive,
    resolve,
    source_shape,
    tensor_splits,
)
from ckptflow.reshard.stage import plan_expert_zero3, plan_model_parallel_stage, plan_stage_change, plan_zero0_stage
from ckptflow.reshard.tensor_parallel import plan_tensor_parallel_merge, plan_tensor_parallel_split
from ckptflow.reshard.units import ReshardPlan

# ---- options --------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ReshardOptions:
    """How to reshard.

    `world_size` is the number of ranks DeepSpeed runs the output at (what the launcher starts);
    `stage`, `tp`, `pp` and `ep` the ZeRO stage and parallel degrees that change (None: the source's),
    the data parallelism being what is left; `partition_method`, `pipeline_layers`, `layer_types` and
    `qkv_layout` what a new number of pipeline stages or tensor-parallel degree needs of some models,
    `tied_modules` what a ZeRO-0 PipelineModule at ZeRO-1 needs (`Target`). `workers`
    threads write at once (one per target rank while there are more ranks than workers, the rest sharing
    a rank's files: `reshard.run.write_threads`); `durable` flushes every file to disk before the commit;
    `strict_pickle` refuses a source whose pickles name any class outside DeepSpeed's allow-list
    (without it, a trainer's client state is carried as inert records).
    """

    world_size: int
    stage: int | None = None
    tp: int | None = None
    pp: int | None = None
    ep: int | None = None
    partition_method: str | None = None
    pipeline_layers: int | None = None
    qkv_layout: str | None = None
    tied_modules: str | None = None
    layer_types: str | None = None
    workers: int = 4
    durable: bool = True
    strict_pickle: bool = False

    def __post_init__(self) -> None:
        self.target  # noqa: B018 - checks the shape's fields
        if not is_positive(self.workers):
            raise ValueError(f"workers must be a positive integer, got {self.workers!r}")

    @property
    def target(self) -> Target:
        return Target(world_size=self.world_size, stage=self.stage, tp=self.tp, pp=self.pp, ep=self.ep,
                      partition_method=self.partition_method, pipeline_layers=self.pipeline_layers,
                      qkv_layout=self.qkv_layout, tied_modules=self.tied_modules, layer_types=self.layer_types)



# ---- the dispatcher ----------------------------------------------------------------------------------


def plan_reshard(index: Partitioned, target: Target | int, config: Mapping[str, Any] | None = None) -> ReshardPlan:
    """The plan that reshards `index` to `target` (a `Target`, or a number of ranks with every degree
    kept); reads nothing. `config`, the model's `config.json` when there is one, says which
    tensor-parallel degrees divide its attention heads.

    Raises `ValueError` for a world size below 1 and `UnsupportedCheckpointError` for shapes ckptflow
    cannot write, or a source whose recorded layout is not the one DeepSpeed's arithmetic predicts.
    """
    if not isinstance(target, Target):
        check_world_size(target)
        target = Target(world_size=target)
    source = source_shape(index)
    if source.stage == 0 and all(getattr(target, axis) in (None, getattr(source, axis))
                                 for axis in ("stage", "tp", "pp", "ep")):
        _nothing_to_do(index, target)
    shape = resolve(index, target, config,
                    stages=lambda shape: why_not_stages(index, shape, asked=target))
    if (why := declared_why(index, source, shape, target)) is not None:
        raise UnsupportedCheckpointError(f"{index.root}/{index.tag}: {why}", code="unsupported-shape", uri=index.root)
    plan = plan_shape(index, shape, config, partition_method=target.partition_method, layers=target.pipeline_layers,
                      qkv_layout=target.qkv_layout, tied_modules=target.tied_modules, layer_types=target.layer_types)
    return replace(plan, source_shape=source_shape(index), shape=shape)


def declared_why(index: Any, source: Shape, shape: Shape, asked: Target) -> str | None:
    """Why a fact the user declares (`asked`) has no use in writing `index` at `shape`, in one line saying
    what to do, or None: it is refused, not taken silently (nor names an output folder of its own). Tied
    modules but of an fp32 ZeRO-0 PipelineModule (plain or Megatron-style); layer types but of a plain
    PipelineModule cut into another number of stages."""
    if asked.tied_modules is not None and not (index.kind in ("pipeline", "megatron") and source.stage == 0):
        return (f"{option('tied_modules')} names the tied modules of a ZeRO-0 PipelineModule checkpoint, whose files "
                f"do not record them, and a {index.layout} checkpoint's have no use for them; leave "
                f"{option('tied_modules')} out")
    if asked.layer_types is not None and index.kind == "megatron":
        return (f"{option('layer_types')} declares a plain PipelineModule's layer names, and ckptflow knows a "
                f"Megatron-style checkpoint's transformer layers by their parameters; leave {option('layer_types')} "
                "out")
    if asked.layer_types is not None and shape.pp == source.pp:
        return (f"{option('layer_types')} weighs the layers of a PipelineModule cut into another number of pipeline "
                f"stages, and this keeps its {source.pp}; leave {option('layer_types')} out, or give {option('pp')}")
    return None


def plan_shape(index: Partitioned, shape: Shape, config: Mapping[str, Any] | None = None, *,
               partition_method: str | None = None, layers: int | None = None,
               qkv_layout: str | None = None, tied_modules: str | None = None,
               layer_types: str | None = None) -> ReshardPlan:
    """The plan that writes `index` at `shape`, which `resolve` accepted (`config`: the model's
    `config.json`, which a tensor-parallel split needs; `partition_method`: a PipelineModule's, which a
    new number of pipeline stages needs, None for its default; `layers`: its layer list's length, where
    the files leave it open; `qkv_layout`: the layout the user declares of a Megatron fused
    `query_key_value`, which a new tensor-parallel degree needs, `reshard.qkv`; `tied_modules`: a ZeRO-0
    PipelineModule's tied module keys, which ZeRO-1 needs, `pipeline_zero0`; `layer_types`: the names of a
    PipelineModule's layer list's entries the user declares, which a "type:" method needs): the planner
    `PLANNERS` names for the index's kind and the axis that changes (`changed_axis`)."""
    ask = Ask(source_shape(index), shape, config, partition_method, layers, qkv_layout, tied_modules, layer_types)
    axis = ask.changed_axis
    entry = PLANNERS.get((index.kind, axis))
    if entry is None:
        raise _refusal(index, axis)
    index_type, planner = entry
    if not isinstance(index, index_type):  # the table's edge: each planner takes its reader's own type
        raise TypeError(f"a {index.kind} index is a {index_type.__name__}, not a {type(index).__name__}")
    return planner(index, ask)


# ---- the table: (layout kind, the axis that changes) -> planner ---------------------------------------------

AXES = ("pp", "tp", "stage", "ep")  # in the order a change is planned by: the first that changes picks the planner


@dataclass(frozen=True)
class Ask:
    """What a planner is asked: the source's shape, the target's, and what a few planners need besides."""

    source: Shape
    shape: Shape
    config: Mapping[str, Any] | None = None
    partition_method: str | None = None
    layers: int | None = None
    qkv_layout: str | None = None
    tied_modules: str | None = None
    layer_types: str | None = None

    @property
    def changed_axis(self) -> str:
        """The first of `AXES` that differs between source and target; "dp" when none does (the
        data-parallel size alone changes, or nothing)."""
        return next((axis for axis in AXES if getattr(self.shape, axis) != getattr(self.source, axis)), "dp")


def _tensor_parallel(index: ModelParallelCheckpoint, ask: Ask) -> ReshardPlan:
    shape = ask.shape
    if shape.tp == 1:
        return plan_tensor_parallel_merge(index, shape.dp, shape.tp, stage=shape.stage)
    return plan_tensor_parallel_split(index, shape.dp, shape.tp, stage=shape.stage, config=ask.config)


def why_not_stages(index: Any, shape: Shape, *, splits: SplitsByDegree | None = None,
                   asked: Target | None = None) -> str | None:
    """Why the partition method `asked` gives (None, or none given: the model's own run's) does not say which
    layers each of `shape.pp` stages of `index` holds (the message of the planner's refusal, which says what
    would), or None: it does, or the number of stages is kept or one. `asked` is what the user declares
    besides (`Target`: the partition method, layer count and layer types; a ZeRO-0 PipelineModule's tied
    modules; a fused `query_key_value`'s layout). `reshard --plan` asks it of the shapes `shape.why_not`
    accepts, with the `splits` it computed for them (`shape.tensor_splits`), and a refusal of the shapes it
    names; of a ZeRO-0 PipelineModule, also why its stages cannot be named with the tied modules given
    (`pipeline_zero0.why_not_stages_zero0`); of a ZeRO-0 Megatron-style checkpoint, which `shape.why_not`
    leaves to its planner, first what `megatron_zero0.why_not_zero0_megatron` says (named with the tied modules
    given)."""
    asked = asked or Target(world_size=shape.world_size)
    method, layers, types = asked.partition_method, asked.pipeline_layers, asked.layer_types
    if (why := declared_why(index, source_shape(index), shape, asked)) is not None:
        return why
    if not isinstance(index, ModelParallelCheckpoint):
        return None
    if index.kind == "pipeline" and index.stage == 0:
        return why_not_stages_zero0(index, shape.pp, asked.tied_modules, method, layers, types)
    if index.kind == "megatron" and index.stage == 0:
        why = why_not_zero0_megatron(index, source_shape(index), shape, asked.qkv_layout, splits=splits,
                                     tied=asked.tied_modules)
        if why is not None or shape.pp in (1, index.pp):
            return why
        view = named_view(index, asked.tied_modules)  # asked of the ZeRO-1 checkpoint it is once named
        assert not isinstance(view, str), "why_not_zero0_megatron names it"
        index = view
    if shape.pp == index.pp or (shape.pp == 1 and types is None):  # declared layer types are checked at pp1 too
        return None
    try:
        if index.kind == "megatron":
            megatron_stages(index, shape, method, layers, splits=_named_splits(index, shape.tp, splits))
        else:
            stages_by(index, shape.pp, method, layers, types)
    except UnsupportedCheckpointError as exc:
        return str(exc)
    return None


def _named_splits(index: ModelParallelCheckpoint, tp: int, known: SplitsByDegree | None) -> dict[str, Split] | None:
    """Every parameter's split at another degree `tp`, from `known` (`shape.tensor_splits`), or None: the
    degree is the source's, or its rules do not split it there (`megatron_stages` then says why)."""
    stages = tensor_splits(index, tp, known) if tp != index.tp and known is not None else None
    return None if stages is None or isinstance(stages, str) else {n: s for stage in stages for n, s in stage.items()}


def _expert_stage(index: ExpertCheckpoint, ask: Ask) -> ReshardPlan:
    """The stage changes, and maybe the expert-parallel degree with it (from deepspeed.moe ZeRO-0 too: its
    optimizer state named first, `experts.plan_moe_zero0`)."""
    if ask.source.stage == 0:
        return plan_moe_zero0(index, ask.shape)
    if ask.shape.stage == 3:
        return plan_expert_zero3(index, ask.shape)
    if ask.source.stage == 3:
        return plan_expert_from_zero3(index, ask.shape)
    return _expert_degree(index, ask)


def _expert_degree(index: ExpertCheckpoint, ask: Ask) -> ReshardPlan:
    """The expert-parallel degree changes at the source's stage (ZeRO-3: rewritten at ZeRO-3), or the
    stage between ZeRO-1 and ZeRO-2: the same flat partitions where DeepSpeedZeroOptimizer saves both,
    laid out again (`plan_expert_degree`) where BF16_Optimizer is on either side (`flats.target_optimizer`)."""
    zero = index.zero
    relaid = (ask.shape.stage != ask.source.stage and zero is not None and BF16 in (
        zero.optimizer_kind, target_optimizer(zero.optimizer_kind, zero.stage, ask.shape.stage, zero.ds_config)))
    if ask.shape.ep == ask.source.ep and not relaid:
        return plan_expert_parallel(index, ask.shape.dp, ask.shape.stage)
    if ask.shape.stage == 3:
        return plan_expert_zero3(index, ask.shape)
    return plan_expert_degree(index, ask.shape)


Planner = Callable[[Any, Ask], ReshardPlan]


def _model_parallel(index: ModelParallelCheckpoint, ask: Ask) -> ReshardPlan:
    return plan_model_parallel(index, ask.shape.dp)


def _zero0_pipeline(index: ModelParallelCheckpoint, ask: Ask) -> ReshardPlan:
    return plan_zero0_pipeline(index, ask.shape, ask.tied_modules, partition_method=ask.partition_method,
                               layers=ask.layers, layer_types=ask.layer_types)


def _zero0_megatron(index: ModelParallelCheckpoint, ask: Ask) -> ReshardPlan:
    return plan_zero0_megatron(index, ask.shape, ask.tied_modules, partition_method=ask.partition_method,
                               layers=ask.layers, qkv_layout=ask.qkv_layout)


def _experts(index: ExpertCheckpoint, ask: Ask) -> ReshardPlan:
    return plan_expert_parallel(index, ask.shape.dp, ask.shape.stage)


PLANNERS: dict[tuple[str, str], tuple[type, Planner]] = {
    ("zero", "dp"): (ZeroCheckpoint, lambda index, ask: plan_data_parallel(index, ask.shape.dp)),
    ("zero", "stage"): (ZeroCheckpoint, lambda index, ask: plan_stage_change(index, ask.shape.dp, ask.shape.stage)),
    ("zero0", "stage"): (Zero0Checkpoint, lambda index, ask: plan_zero0_stage(index, ask.shape.dp, ask.shape.stage)),
    ("optimizer-shards", "dp"): (OptimizerShards, lambda index, ask: plan_shard_folder(index, ask.shape.dp)),
    ("autotp", "dp"): (ModelParallelCheckpoint, _model_parallel),
    ("autotp", "tp"): (ModelParallelCheckpoint, _tensor_parallel),
    ("autotp", "stage"): (ModelParallelCheckpoint,
                          lambda index, ask: plan_model_parallel_stage(index, ask.shape.dp, ask.shape.stage)),
    ("pipeline", "dp"): (ModelParallelCheckpoint, _model_parallel),
    ("pipeline", "stage"): (ModelParallelCheckpoint, _zero0_pipeline),  # from ZeRO-0 to ZeRO-1
    ("pipeline", "pp"): (ModelParallelCheckpoint,
                         lambda index, ask: _zero0_pipeline(index, ask) if index.stage == 0 else
                         plan_pipeline(index, ask.shape, ask.partition_method, ask.layers, ask.layer_types)),
    ("megatron", "dp"): (ModelParallelCheckpoint, _model_parallel),
    ("megatron", "stage"): (ModelParallelCheckpoint, _zero0_megatron),  # from ZeRO-0 to ZeRO-1
    ("megatron", "tp"): (ModelParallelCheckpoint,
                         lambda index, ask: _zero0_megatron(index, ask) if index.stage == 0 else
                         plan_megatron_tensor_parallel(index, ask.shape, ask.qkv_layout)),
    ("megatron", "pp"): (ModelParallelCheckpoint,  # the tensor-parallel degree may change with the stages
                         lambda index, ask: _megatron_layer_types(index) if ask.layer_types is not None else
                         _zero0_megatron(index, ask) if index.stage == 0 else
                         plan_megatron_stages(index, ask.shape, ask.partition_method, ask.layers, ask.qkv_layout)),
    **{(kind, axis): (ExpertCheckpoint, planner) for kind in ("autoep", "moe")
       for axis, planner in (("dp", _experts), ("stage", _expert_stage), ("ep", _expert_degree))},
}


def _megatron_layer_types(index: Partitioned) -> ReshardPlan:
    """A Megatron-style checkpoint's layer classes are known (`megatron.layer_facts`): declared ones are refused."""
    raise UnsupportedCheckpointError(
        f"{index.root}/{index.tag} is a Megatron-style checkpoint, whose transformer layers ckptflow knows by their "
        f"parameters; {option('layer_types')} declares a plain PipelineModule's layer names", code="unsupported-shape",
        uri=index.root, hint=f"leave {option('layer_types')} out")


def _refusal(index: Partitioned, axis: str) -> UnsupportedCheckpointError:
    """Why no planner writes `index` with `axis` changed, in one line."""
    where = f"{index.root}/{index.tag}"
    if index.kind == "optimizer-shards":
        return UnsupportedCheckpointError(
            f"{index.root} holds ZeRO-{index.stage} optimizer states saved one file per rank; ckptflow writes them "
            "for another number of ranks at the same ZeRO stage only, not another stage or parallel degree",
            uri=index.root, hint=f"give {option('world_size')} alone")
    if axis == "pp":
        return UnsupportedCheckpointError(
            f"{where} is a checkpoint in the {index.layout} layout; ckptflow changes the number of pipeline stages of "
            "PipelineModule checkpoints only (plain, or Megatron-style with universal_checkpoint_info)",
            code="unsupported-layout", uri=index.root,
            hint=f"keep the number of pipeline stages (leave {option('pp')} out)")
    if axis == "tp":
        return UnsupportedCheckpointError(
            f"{where} is a checkpoint in the {index.layout} layout; ckptflow changes the tensor-parallel degree of "
            "AutoTP checkpoints only", code="unsupported-layout", uri=index.root,
            hint=f"reshard it to another data-parallel size without {option('tp')}")
    return UnsupportedCheckpointError(
        f"{where} is a {index.layout} checkpoint; ckptflow reshards data-parallel ZeRO checkpoints only so far",
        uri=index.root,
        hint="convert it with DeepSpeed's universal converter (deepspeed.checkpoint.ds_to_universal) instead")


def _nothing_to_do(index: Partitioned, target: Target) -> None:
    """A ZeRO-0 checkpoint loads as it is at any data-parallel size: say so, and how to run it."""
    if index.kind in ("autoep", "moe"):
        ep = index.degrees.ep
        raise UnsupportedCheckpointError(
            f"{index.tag_uri} is a {index.layout} checkpoint; there is nothing to reshard: DeepSpeed loads a "
            "deepspeed.moe ZeRO-0 checkpoint natively at any data-parallel size that keeps its expert-parallel "
            f"degree ({ep}), since every rank reads the whole module, the expert files of its expert-parallel "
            "rank and that rank's expp_rank optimizer file", code="reshard-not-needed", uri=index.root,
            hint=f"load it as it is with any multiple of {ep} ranks")
    if bf16_zero0(index):
        raise UnsupportedCheckpointError(f"{index.root}/{index.tag} is a checkpoint in the {index.layout} layout: "
                                         f"{BF16_ZERO0_LOAD}", code="unsupported-shape", uri=index.root,
                                         hint=f"add {option('stage')} 1")
    mp = index.degrees.tp * index.degrees.pp
    ranks = (f"any multiple of its {mp} model-parallel ranks" if mp > 1 else
             f"{target.world_size} rank{'s' if target.world_size != 1 else ''}")
    raise UnsupportedCheckpointError(
        f"{index.root}/{index.tag} is a checkpoint in the {index.layout} layout: its files hold whole tensors and "
        "do not depend on the data-parallel size, and DeepSpeed loads it natively at any data-parallel size, "
        "so there is nothing to reshard", code="reshard-not-needed", uri=index.root,
        hint=f"point the run at {index.root} as it is, with {ranks}")


__all__ = ["AXES", "PLANNERS", "Ask", "Planner", "ReshardOptions", "check_world_size", "plan_reshard", "plan_shape",
           "why_not_stages"]
