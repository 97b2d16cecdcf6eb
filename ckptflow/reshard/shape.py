"""Shapes: how many ranks a training run uses and how they split. Pure.

A `Shape` is what DeepSpeed runs a checkpoint at: `world_size` ranks (what the launcher starts),
split into tensor-parallel (`tp`) and pipeline (`pp`) degrees, the data parallelism what is left
(`dp = world_size / (tp * pp)`), an expert-parallel degree `ep` dividing the data-parallel ranks, and
the ZeRO `stage`. A `Target` is a shape as a user asks for it: the ranks, and only the degrees that
change (the rest are the source's).

- `source_shape(index)`: the shape a checkpoint was saved at.
- `resolve(index, target)`: the shape a target means for that checkpoint, or a one-line refusal that
  names the shapes that would work at that many ranks.
- `shapes_at(index, world_size)`: every shape DeepSpeed can run the checkpoint's model at on that many
  ranks, each with `reason` None when ckptflow can write it, else why not (yet).
- `memory(index, shape)`: per-GPU bytes of weights, gradients and optimizer state at a shape, after
  the ZeRO paper's formulas (stage 1 partitions the optimizer state over the data-parallel ranks,
  stage 2 the gradients too, stage 3 the weights too).

Which shapes a layout allows follows DeepSpeed 0.19.8: PipelineModule trains at ZeRO-0 or 1 only
(`PipelineEngine` asserts it); `deepspeed.moe` layers do not run under ZeRO-3; an expert-parallel
degree divides the number of experts and the data-parallel ranks; a tensor-parallel degree divides
the attention heads (when the model's `config.json` says how many). A Megatron-style checkpoint is
written at the tensor-parallel degrees its `universal_checkpoint_info` rules cut every parameter at
(`readers.pipeline.splits_at`; `why_not` names the first one they do not). A data-parallel or AutoTP
ZeRO-0 checkpoint goes to ZeRO-1/2/3 at its own tensor-parallel degree where its optimizer state can be
named (`readers.zero0.named_groups`), in fp32, bf16 and fp16, fp16's FP16_Optimizer loss scale carried
into the target's loss scaler (`readers.zero0.zero_loss_scaler`; checked against DeepSpeed on an fp16
ZeRO-0 checkpoint written by DeepSpeed's own fp16 code on CPU ranks with the CPU accelerator's fp16
check lifted, `tests/test_fp16_zero0.py`). A deepspeed.moe ZeRO-0 checkpoint (fp32, bf16, fp16: each expp_rank
file's loss scale, which must agree, carried alike) goes to ZeRO-1/2 at its own
expert-parallel degree or another (`readers.moe.zero0_index` names each expert-parallel rank's optimizer,
`experts.plan_moe_zero0` writes it). A ZeRO-0 PipelineModule (fp32) goes to ZeRO-1 at its own number of
stages or another, each stage's module rebuilt from its layer files (`pipeline_zero0`, which refuses what it
cannot name; `Target.tied_modules` names its tied modules, which no ZeRO-0 file records), and a Megatron-style
one at any tensor-parallel degree and stages, named per model-parallel rank and asked as the ZeRO-1 checkpoint it
then is (`megatron_zero0`, which `why_not` leaves it to).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

from ckptflow.errors import UnsupportedCheckpointError
from ckptflow.formats.deepspeed.qkv import check_layout
from ckptflow.formats.deepspeed.readers.moe import zero0_index
from ckptflow.formats.deepspeed.readers.pipeline import (
    BF16_ZERO0_LOAD,
    FUSED_QKV_WHY,
    TIED_WHY,
    Split,
    bf16_zero0,
    declare_qkv_layout,
    fused_qkv,
    splits_at,
    tied_module,
)
from ckptflow.formats.deepspeed.readers.zero0 import Zero0Checkpoint, named_groups, zero_loss_scaler
from ckptflow.reshard.moe_cut import plan_recut
from ckptflow.reshard.pipeline_layers import check_method, parse_layer_types
from ckptflow.reshard.pipeline_layers import tied_modules as parse_tied
from ckptflow.reshard.qkv import in_layout
from ckptflow.reshard.vocabulary import vocab_rows_at

STAGES = (1, 2, 3)  # the ZeRO stages a reshard writes


def is_positive(value: Any) -> bool:
    """Whether `value` is a whole number of at least 1 (not a bool): a count of ranks, layers or workers."""
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1


def check_world_size(world_size: Any) -> None:
    """`ValueError` unless `world_size` is a whole number of ranks, at least 1."""
    if not is_positive(world_size):
        raise ValueError(f"the world size must be a whole number of ranks, at least 1; got {world_size!r}")


@dataclass(frozen=True, kw_only=True, order=True)
class Shape:
    """A parallel shape: `world_size` ranks = tp x pp x dp, experts over `ep` of the dp ranks, ZeRO `stage`."""

    world_size: int
    stage: int
    tp: int = 1
    pp: int = 1
    ep: int = 1

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)

    @property
    def edp(self) -> int:
        """Ranks each expert is replicated on (its expert data-parallel group)."""
        return self.dp // self.ep

    def __str__(self) -> str:
        """E.g. "ZeRO-2 tp2 x dp2 (4 ranks)", "ZeRO-3 ep2 x edp2 (4 ranks)"."""
        axes = [f"{label}{n}" for label, n in (("pp", self.pp), ("tp", self.tp)) if n > 1]
        axes += [f"ep{self.ep}", f"edp{self.edp}"] if self.ep > 1 else [f"dp{self.dp}"]
        return f"ZeRO-{self.stage} {' x '.join(axes)} ({self.world_size} rank{'s' if self.world_size != 1 else ''})"

    @property
    def slug(self) -> str:
        """A name for folders and branches: "ws4", "ws4-z3", "ws4-tp2-z3" (degrees only where they are not 1)."""
        parts = [f"ws{self.world_size}"] + [f"{label}{n}" for label, n in (("pp", self.pp), ("tp", self.tp),
                                                                            ("ep", self.ep)) if n > 1]
        return "-".join(parts + [f"z{self.stage}"])


@dataclass(frozen=True, kw_only=True)
class Target:
    """A reshard target as asked for: `world_size` ranks, and any degree that changes (None keeps the
    source's; the data-parallel degree is always what is left)."""

    world_size: int
    stage: int | None = None
    tp: int | None = None
    pp: int | None = None
    ep: int | None = None
    partition_method: str | None = None  # PipelineModule's, for a new stage count (None: its default)
    pipeline_layers: int | None = None  # the length of a PipelineModule's layer list, when the files leave it open
    qkv_layout: str | None = None  # a fused query_key_value's, for a new tensor-parallel degree (`reshard.qkv`)
    tied_modules: str | None = None  # a ZeRO-0 PipelineModule's, "KEY=LAYER,...": `pipeline_layers.tied_modules`
    layer_types: str | None = None  # a PipelineModule's layer names, for a "type:" method (`parse_layer_types`)

    def __post_init__(self) -> None:
        check_world_size(self.world_size)
        check_layout(self.qkv_layout)
        if self.tied_modules is not None:
            parse_tied(self.tied_modules)
        if self.partition_method is not None:
            check_method(self.partition_method)
        if self.layer_types is not None:
            parse_layer_types(self.layer_types)
        if self.stage is not None and self.stage not in STAGES:
            raise ValueError(f"the ZeRO stage must be 1, 2 or 3; got {self.stage!r}")
        if self.pipeline_layers is not None and not is_positive(self.pipeline_layers):
            raise ValueError(f"a layer list's length must be a positive whole number; got {self.pipeline_layers!r}")
        for name in ("tp", "pp", "ep"):
            value = getattr(self, name)
            if value is not None and not is_positive(value):
                raise ValueError(f"the {_AXES[name]} degree must be a positive whole number; got {value!r}")

    @property
    def changes(self) -> str:
        """What was asked, in words: "4 ranks, ZeRO-3, tp1"."""
        asked = [f"{self.world_size} rank{'s' if self.world_size != 1 else ''}"]
        if self.stage is not None:
            asked.append(f"ZeRO-{self.stage}")
        asked += [f"{name}{getattr(self, name)}" for name in ("tp", "pp", "ep") if getattr(self, name) is not None]
        return ", ".join(asked)


_AXES = {"tp": "tensor-parallel", "pp": "pipeline-parallel", "ep": "expert-parallel"}


# ---- what a checkpoint is and allows ----------------------------------------------------------------


def kind_of(index: Any) -> str:
    """The layout kind of an index: "zero", "zero0", "autotp", "pipeline", "megatron", "tensor-parallel",
    "autoep" or "moe"."""
    kind = getattr(index, "kind", None)
    if isinstance(kind, str):
        return kind
    return "zero0" if index.stage == 0 else "zero"


def expert_counts(index: Any) -> tuple[int, ...]:
    """The experts of each MoE layer of an expert-parallel checkpoint (`num_experts` in its model states)."""
    zero = getattr(index, "zero", None)
    counts = zero.model_states[0].get("num_experts") if zero is not None else None
    if isinstance(counts, list) and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in counts):
        return tuple(counts)
    return ()


def expert_group_cut(index: Any, ep: int) -> str | None:
    """Why ckptflow cannot tell how DeepSpeed cuts `index`'s expert param groups by size at degree `ep`
    (None: it can, and `experts.at_degree` cuts them so; `moe_cut`)."""
    zero = getattr(index, "zero", None)
    return None if zero is None else plan_recut(zero.in_optimizer_order(), ep).why


def source_shape(index: Any) -> Shape:
    """The shape `index` was saved at."""
    d = index.degrees
    return Shape(world_size=d.ranks, stage=index.stage, tp=d.tp, pp=d.pp, ep=d.ep)


@dataclass(frozen=True)
class Model:
    """What limits the shapes of a checkpoint's model: its experts, layers and attention heads (0: unknown)."""

    experts: int = 0  # per MoE layer
    layers: int = 0  # pipeline layers (PipelineModule) or decoder layers
    heads: int = 0
    kv_heads: int = 0


def _model(index: Any, config: Mapping[str, Any] | None) -> Model:
    config = config or {}

    def count(*keys: str) -> int:
        for key in keys:
            value = config.get(key)
            if isinstance(value, int) and is_positive(value):
                return value
        return 0

    experts = count("num_local_experts", "num_experts", "n_routed_experts")
    heads = count("num_attention_heads", "n_head")
    return Model(experts=experts, layers=count("num_hidden_layers", "n_layer"), heads=heads,
                 kv_heads=count("num_key_value_heads") or heads)


def stages_allowed(kind: str) -> tuple[int, ...]:
    """The ZeRO stages DeepSpeed 0.19.8 trains a layout at (of those a reshard writes)."""
    if kind in ("pipeline", "megatron"):
        return (1,)
    if kind == "moe":
        return (1, 2)
    if kind == "autoep":
        return STAGES
    return STAGES


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# A Megatron-style checkpoint's splits at each tensor-parallel degree asked (`tensor_splits`), or why its rules
# do not split it there: one listing of shapes asks them of every shape at a degree, and computes them once.
SplitsByDegree = dict[int, list[dict[str, Split]] | str]


def tensor_splits(index: Any, tp: int, known: SplitsByDegree) -> list[dict[str, Split]] | str:
    """Every stage's splits of the Megatron-style checkpoint `index` at another tensor-parallel degree `tp`
    (`readers.pipeline.splits_at`, the vocabulary padded again as Megatron pads it there), or the message of
    the first parameter its rules do not split; from `known` (one listing's) where asked before, and kept there."""
    if tp not in known:
        try:
            known[tp] = splits_at(index, tp, vocab_rows_at(index, tp))
        except UnsupportedCheckpointError as exc:
            known[tp] = str(exc)
    return known[tp]


def shapes_at(index: Any, world_size: int, config: Mapping[str, Any] | None = None,
              qkv_layout: str | None = None, *, splits: SplitsByDegree | None = None) -> list[tuple[Shape, str | None]]:
    """Every shape the checkpoint's model runs at on `world_size` ranks, with None where ckptflow can
    write it from `index` and the reason where it cannot; the source's stage first, then by degrees
    (`qkv_layout`: the layout the user declares of a fused `query_key_value`, `reshard.qkv`; `splits`: the
    listing's `tensor_splits`, where its caller asks them again, else this call's own)."""
    kind = kind_of(index)
    source = source_shape(index)
    model = _model(index, config)
    known: SplitsByDegree = {} if splits is None else splits
    out = []
    for shape in _candidates(kind, source, world_size, model):
        out.append((shape, why_not(index, source, shape, qkv_layout, splits=known)))
    out.sort(key=lambda item: (item[0].stage != source.stage, item[0].stage, item[0].tp, item[0].pp, item[0].ep))
    return out


def _candidates(kind: str, source: Shape, world_size: int, model: Model) -> Iterator[Shape]:
    tps = _divisors(world_size) if kind in ("autotp", "megatron", "tensor-parallel") else [1]
    pps = _divisors(world_size) if kind in ("pipeline", "megatron") else [1]
    for stage in ((0,) if source.stage == 0 else ()) + stages_allowed(kind):
        for tp in tps:
            if model.heads and (model.heads % tp or model.kv_heads % tp):
                continue
            for pp in pps:
                if world_size % (tp * pp) or (model.layers and pp > model.layers):
                    continue
                dp = world_size // (tp * pp)
                eps = [e for e in _divisors(dp) if not model.experts or model.experts % e == 0] \
                    if kind in ("autoep", "moe") else [1]
                for ep in eps:
                    yield Shape(world_size=world_size, stage=stage, tp=tp, pp=pp, ep=ep)


NAMES = {"zero": "data-parallel ZeRO", "zero0": "ZeRO-0", "autotp": "AutoTP", "pipeline": "PipelineModule",
         "megatron": "Megatron-style PipelineModule", "tensor-parallel": "model-parallel", "autoep": "AutoEP",
         "moe": "deepspeed.moe", "optimizer-shards": "optimizer-shard"}


def why_not(index: Any, source: Shape, shape: Shape, qkv_layout: str | None = None, *,
            splits: SplitsByDegree | None = None) -> str | None:
    """Why ckptflow cannot write `index` at `shape` (yet), or None when it can (`qkv_layout`, `splits`: as
    `shapes_at`)."""
    kind = kind_of(index)
    name = NAMES.get(kind, kind)
    if source.stage == 0:
        if shape.stage == 0 and bf16_zero0(index):
            return BF16_ZERO0_LOAD
        if (shape.stage, shape.tp, shape.pp, shape.ep) == (source.stage, source.tp, source.pp, source.ep):
            return "nothing to reshard: DeepSpeed loads a ZeRO-0 checkpoint as it is at any data-parallel size"
        if kind == "moe" and (shape.tp, shape.pp) == (source.tp, source.pp):
            return _why_not_moe_zero0(index, source, shape)
        if shape.stage == 0:
            return ("a ZeRO-0 checkpoint's optimizer state is saved by position, and ckptflow writes it at another "
                    "shape only at another ZeRO stage, where it is named (its weights can still be consolidated)")
        if kind == "megatron":  # named per model-parallel rank, then asked as ZeRO-1 (`megatron_zero0`, `--plan`)
            return None
        if kind == "pipeline" and shape.pp != source.pp:  # named, then regrouped: `pipeline_zero0`
            return _unfilled(index, shape.pp)
        if (shape.pp, shape.ep) != (source.pp, source.ep) or (shape.tp != source.tp and kind != "autotp"):
            return ("a ZeRO-0 checkpoint's optimizer state is saved by position and names no parameter; ckptflow "
                    "names it for another ZeRO stage, with another tensor-parallel degree for AutoTP ones, another "
                    "expert-parallel one for deepspeed.moe ones and another pipeline degree for PipelineModule ones, "
                    "not otherwise (its weights can still be consolidated)")
        if kind == "pipeline":  # each stage's state named from its layer files by the planner (`pipeline_zero0`)
            return None
        if kind not in ("zero0", "autotp"):
            return (f"ckptflow changes the ZeRO stage of ZeRO-0 checkpoints of data-parallel ZeRO, AutoTP, "
                    f"PipelineModule (plain or Megatron-style) and deepspeed.moe layouts, not of {name} ones yet")
        for rank in getattr(index, "ranks", None) or (index,):
            why = why_not_zero0(rank)
            if why is not None:
                return why
        if shape.tp == source.tp:
            return None
    if shape.tp != source.tp:
        if kind == "megatron":
            why = _why_not_megatron_tp(index, shape.tp, qkv_layout, {} if splits is None else splits)
            if why is not None:
                return why
        elif kind != "autotp":
            return (f"ckptflow changes the tensor-parallel degree of AutoTP and Megatron-style checkpoints only, not "
                    f"of {name} ones")
    if shape.pp != source.pp:
        if kind not in ("pipeline", "megatron"):
            return (f"ckptflow changes the number of pipeline stages of PipelineModule checkpoints only, "
                    f"not of {name} ones")
        if kind == "megatron" and (tied := tied_module(index, shape.tp)) is not None:
            return f"{tied} {TIED_WHY}"
        if (unfilled := _unfilled(index, shape.pp)) is not None:
            return unfilled
    if shape.ep != source.ep:
        if (why := _why_not_ep(index, kind, source, shape)) is not None:  # the stage with it too
            return why
    elif shape.stage != source.stage:
        if kind == "optimizer-shards":
            return ("optimizer shards are written for the same loading code at the same ZeRO stage only; another "
                    "stage loads through engine.load_checkpoint, and these files are not such a checkpoint")
        if kind in ("moe", "autoep") and (why := why_not_expert_stage(kind, shape.stage)) is not None:
            return why
        if kind not in ("zero", "autotp", "moe", "autoep"):
            return (f"ckptflow does not change the ZeRO stage of {name} checkpoints yet (of data-parallel ZeRO, AutoTP "
                    "and expert-parallel ones it does)")
    return None


def _why_not_megatron_tp(index: Any, tp: int, qkv_layout: str | None, known: SplitsByDegree) -> str | None:
    """Why the Megatron-style checkpoint `index`'s recorded split rules do not split it at another degree `tp`
    (None: they do), a fused `query_key_value` in the `qkv_layout` the user declares (None: refused)."""
    if qkv_layout is None and (fused := fused_qkv(index)) is not None:
        return f"{fused} {FUSED_QKV_WHY}; {declare_qkv_layout()}"
    if (tied := tied_module(index)) is not None:
        return f"{tied} {TIED_WHY}"
    splits = tensor_splits(index, tp, known)
    if isinstance(splits, str):
        return splits
    if qkv_layout is not None:
        try:
            in_layout(index, splits, tp, qkv_layout)
        except UnsupportedCheckpointError as exc:
            return str(exc)
    return None


def why_not_zero0(index: Zero0Checkpoint) -> str | None:
    """Why ckptflow cannot write the ZeRO-0 checkpoint (or model-parallel rank) `index` at ZeRO-1, 2 or 3,
    or None: its optimizer state must be named (`readers.zero0.named_groups`), and in fp16 its
    FP16_Optimizer's loss scale state be what DeepSpeed saves (`readers.zero0.zero_loss_scaler`)."""
    scaler = zero_loss_scaler(index)
    if isinstance(scaler, str):
        return scaler
    named = named_groups(index)
    return named if isinstance(named, str) else None


def _why_not_moe_zero0(index: Any, source: Shape, shape: Shape) -> str | None:
    """Why ckptflow cannot write the deepspeed.moe ZeRO-0 checkpoint `index` at `shape` (ZeRO-1 or 2, its own
    expert-parallel degree or another), or None: its optimizer state named (`readers.moe.zero0_index`),
    then as a ZeRO-1/2 source's (`experts.plan_moe_zero0`)."""
    if shape.stage == 0:
        return ("ckptflow writes a deepspeed.moe ZeRO-0 checkpoint at ZeRO-1 or ZeRO-2 at another expert-parallel "
                "degree, not at ZeRO-0, whose expp_rank files it does not write")
    if (why := why_not_expert_stage("moe", shape.stage)) is not None:
        return why
    zero = zero0_index(index)
    if isinstance(zero, str):
        return zero
    return _why_not_ep(replace(index, zero=zero), "moe", source, shape) if shape.ep != source.ep else None


def _why_not_ep(index: Any, kind: str, source: Shape, shape: Shape) -> str | None:
    """Why ckptflow cannot move `index`'s experts to `shape.ep` expert-parallel ranks, or None: the
    degree changes at any stage AutoEP trains at, together with the stage (`experts.at_degree`, then
    the stage's planner)."""
    if shape.stage != source.stage:
        why = why_not_expert_stage(kind, shape.stage)
        if why is not None:
            return why
    counts = expert_counts(index)
    if not counts:
        return "the checkpoint does not record how many experts each MoE layer has (num_experts)"
    if any(n % shape.ep for n in counts):
        experts = "/".join(map(str, counts))
        return f"{shape.ep} expert-parallel ranks do not split the {experts} experts of its MoE layers"
    return expert_group_cut(index, shape.ep)


def _unfilled(index: Any, pp: int) -> str | None:
    """Why `pp` pipeline stages cannot each hold a layer of the PipelineModule `index`, or None."""
    layers = pipeline_layers(index)
    return f"its {layers} layers that save a file do not fill {pp} pipeline stages" if layers and pp > layers else None


def pipeline_layers(index: Any) -> int:
    """How many layers of a PipelineModule checkpoint saved a file (0: not known); a Megatron-style one
    saves one per tensor-parallel rank."""
    return len(getattr(index, "carried", ()) or ()) // getattr(index, "tp", 1)


def why_not_expert_stage(kind: str, target: int) -> str | None:
    """Why ckptflow cannot write an expert-parallel checkpoint (`kind` "moe" or "autoep") at ZeRO `target`,
    or None when it can: at any stage DeepSpeed trains the layout at. Between ZeRO-1 and ZeRO-2 of
    `DeepSpeedZeroOptimizer` the flat partitions stay and only the recorded stage changes; BF16_Optimizer's
    (bf16 ZeRO-1, fp32 gradient accumulation) are laid out again as DeepSpeedZeroOptimizer's, and
    DeepSpeedZeroOptimizer's and ZeRO-3's as BF16_Optimizer's at a ZeRO-1 target whose recorded config gets
    it (`flats.target_optimizer`: each expert group over its expert data-parallel group, as BF16_Optimizer's
    `real_dp_process_group` partitions it; `experts.plan_expert_degree`, `experts.plan_expert_from_zero3`);
    AutoEP moves between those and ZeRO-3 (`stage.plan_expert_zero3`)."""
    if target not in stages_allowed(kind):
        return _forbidden_stage(kind, target)
    return None


def resolve(index: Any, target: Target, config: Mapping[str, Any] | None = None, *,
            stages: Callable[[Shape], str | None] | None = None) -> Shape:
    """The shape `target` means for `index`: every degree not given is the source's, the data-parallel
    degree what is left. `UnsupportedCheckpointError`, naming the shapes ckptflow can write at that many
    ranks, when the shape does not divide, the layout forbids it, or ckptflow cannot write it yet (the
    shapes named those `stages` does not refuse too: `plan.why_not_stages`, which `--plan` asks)."""
    source = source_shape(index)
    shape = Shape(world_size=target.world_size,
                  stage=target.stage if target.stage is not None else source.stage,
                  tp=target.tp if target.tp is not None else source.tp,
                  pp=target.pp if target.pp is not None else source.pp,
                  ep=target.ep if target.ep is not None else source.ep)
    where = f"{index.root}/{index.tag}" if index.tag else index.root  # optimizer shards: no tag
    allowed = shapes_at(index, target.world_size, config, target.qkv_layout)
    writable = [s for s, reason in allowed if reason is None]
    problem = _divides(shape, source)
    if problem is None and shape not in [s for s, _ in allowed]:
        problem = _forbidden(index, shape)
    if problem is None:
        problem = dict(allowed).get(shape)
    if problem is not None:
        staged = {s: stages(s) if stages is not None else None for s in writable}
        writable = [s for s, why in staged.items() if why is None]
        common = set(staged.values())  # one reason refuses every shape the layout allows: it says what to give
        if not writable and len(common) == 1 and None not in common:
            why = common.pop()
            listing = (f"ckptflow can write no shape of it at {target.world_size} ranks as things stand"
                       + ("" if why == problem else f": {why}"))
        else:
            nearby = [] if writable else _nearby(index, target.world_size, config, target.qkv_layout, stages)
            listing = _listing(writable, target.world_size, nearby)
        raise UnsupportedCheckpointError(
            f"cannot reshard {where} ({source}) to {target.changes}: {problem}; {listing}",
            code="unsupported-shape", uri=index.root, expected=[str(s) for s in writable], actual=str(shape))
    return shape


def _divides(shape: Shape, source: Shape) -> str | None:
    mp = shape.tp * shape.pp
    if shape.world_size % mp:
        return f"{shape.world_size} ranks do not split into tp{shape.tp} x pp{shape.pp} ({mp} ranks per model replica)"
    if shape.dp % shape.ep:
        return (f"an expert-parallel degree of {shape.ep} does not divide the {shape.dp} data-parallel ranks "
                f"left at tp{shape.tp} x pp{shape.pp}")
    return None


def _forbidden(index: Any, shape: Shape) -> str:
    kind = kind_of(index)
    name = NAMES.get(kind, kind)
    if shape.stage not in stages_allowed(kind):
        return _forbidden_stage(kind, shape.stage)
    if shape.tp > 1 and kind not in ("autotp", "megatron", "tensor-parallel"):
        if kind in ("zero", "zero0"):  # a model AutoTP could run: what is missing is how it would split it
            return (f"a {name} checkpoint records no tensor-parallel split (AutoTP writes its affine maps only when "
                    f"it trains tensor-parallel), so ckptflow cannot tell how AutoTP would split it at tp{shape.tp}")
        return f"a {name} checkpoint has no tensor parallelism to give a degree of {shape.tp}"
    if shape.pp > 1 and kind not in ("pipeline", "megatron"):
        return f"a {name} checkpoint is not a PipelineModule; it has no pipeline stages to split into {shape.pp}"
    if shape.ep > 1 and kind not in ("autoep", "moe"):
        return f"a {name} checkpoint has no experts to spread over {shape.ep} ranks"
    return f"the model does not split into {shape} (its attention heads, layers or experts do not divide)"


def _forbidden_stage(kind: str, stage: int) -> str:
    """Why DeepSpeed 0.19.8 does not train a `kind` model at ZeRO `stage`, and what does."""
    if kind == "moe" and stage == 3:
        return ("DeepSpeed refuses deepspeed.moe layers at ZeRO-3 (\"Native DeepSpeed MoE is not supported with ZeRO "
                "Stage 3. Use AutoEP or choose ZeRO stage 1/2.\"), so a deepspeed.moe checkpoint is written at ZeRO-1 "
                "or ZeRO-2 only")
    name = NAMES.get(kind, kind)
    stages = ", ".join(map(str, stages_allowed(kind)))
    return f"DeepSpeed trains {name} models at ZeRO stage {stages} only"


def _nearby(index: Any, world_size: int, config: Mapping[str, Any] | None, qkv_layout: str | None,
            stages: Callable[[Shape], str | None] | None = None) -> list[int]:
    """The world sizes closest to `world_size` (at most twice it) at which ckptflow writes some shape of `index`
    (that `stages`, where given, does not refuse either)."""
    sizes = sorted(range(1, 2 * world_size + 1), key=lambda n: (abs(n - world_size), n))
    found: list[int] = []
    for n in sizes[1:]:
        if any(reason is None and (stages is None or stages(shape) is None)
               for shape, reason in shapes_at(index, n, config, qkv_layout)):
            found.append(n)
            if len(found) == 2:
                break
    return sorted(found)


def _listing(shapes: list[Shape], world_size: int, nearby: list[int]) -> str:
    if not shapes:
        sizes = f" (it can at {' or '.join(map(str, nearby))})" if nearby else ""
        return f"ckptflow can write no shape of it at {world_size} rank{'s' if world_size != 1 else ''}{sizes}"
    names = [str(s) for s in shapes]
    more = f" (and {len(names) - 6} more)" if len(names) > 6 else ""
    return f"shapes it can write at {world_size} rank{'s' if world_size != 1 else ''}: {', '.join(names[:6])}{more}"


# ---- memory per GPU -----------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Memory:
    """Bytes one GPU holds at a shape for the model's training state (activations and buffers left out)."""

    weights: int
    gradients: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer


def parameter_counts(index: Any) -> tuple[int, int]:
    """(dense, expert) trainable elements of the whole model: expert parameters are those of
    expert-parallel param groups, counted over every expert."""
    zero = getattr(index, "zero", None)
    expert = 0
    if zero is not None:
        expert_groups = {g.index for g in zero.groups if g.ep > 1}
        expert = sum(p.numel for p in zero.params if p.group in expert_groups)
    total = sum(t.numel for t in index.model_tensors() if t.kind == "param")
    return max(total - expert, 0), expert


def memory(index: Any, shape: Shape, moments: int | None = None) -> Memory:
    """Per-GPU bytes at `shape` for `index`'s model (the ZeRO formulas): Psi parameters per model-parallel
    rank in `precision` (2 bytes for bf16/fp16, 4 for fp32), as many gradients, and the optimizer's fp32
    master copy (mixed precision only) and `moments` fp32 moments per parameter (Adam: 2); stage 1
    divides the optimizer state by the data-parallel ranks, stage 2 the gradients too, stage 3 the
    weights too. Expert parameters divide by the expert-parallel degree and replicate over edp ranks."""
    dense, expert = parameter_counts(index)
    mp = shape.tp * shape.pp
    per_rank_dense, per_rank_expert = dense / mp, expert / (mp * shape.ep)
    if moments is None:
        moments = _moments(index)
    width = 4 if index.precision == "fp32" else 2
    optimizer_width = 4 * moments + (0 if index.precision == "fp32" else 4)

    def held(numel: float, dp: int, partitioned: bool) -> float:
        return numel / dp if partitioned else numel

    def part(per_element: int, dense_dp: int, expert_dp: int, partitioned: bool) -> int:
        return round(per_element * (held(per_rank_dense, dense_dp, partitioned)
                                    + held(per_rank_expert, expert_dp, partitioned)))

    return Memory(
        weights=part(width, shape.dp, shape.edp, shape.stage >= 3),
        gradients=part(width, shape.dp, shape.edp, shape.stage >= 2),
        optimizer=part(optimizer_width, shape.dp, shape.edp, shape.stage >= 1),
    )


def _moments(index: Any) -> int:
    for zero in (index, getattr(index, "zero", None), *(getattr(index, "ranks", ()) or ())[:1]):
        count = getattr(zero, "tensors_per_partition", None) if zero is not None else None
        if isinstance(count, int):
            return count
    return 2


__all__ = ["STAGES", "Memory", "Shape", "SplitsByDegree", "Target", "check_world_size", "expert_counts", "is_positive",
           "kind_of", "memory", "parameter_counts", "resolve", "shapes_at", "source_shape", "stages_allowed",
           "tensor_splits", "why_not", "why_not_expert_stage", "why_not_zero0"]
