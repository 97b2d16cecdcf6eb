"""PipelineModule checkpoints, plain or with Megatron-style tensor parallelism inside each stage.

What DeepSpeed 0.19.8 writes (`tests/fixtures/PARALLEL_LAYOUTS.md`, sections 6 and 7):

- `layer_{XX}-model_states.pt` per layer (Megatron-style: `layer_{XX}-model_{TT}-model_states.pt` per
  layer and tensor-parallel rank): the layer's own state dict under local names, module dtype,
  buffers included. A `TiedLayerSpec` module is saved once, under the first layer that uses it; a
  layer that is a function saves nothing.
- `mp_rank_{MM}_model_states.pt` per model-parallel rank (MM = stage * tp + tensor-parallel rank) with
  `module: None`, and for each a data-parallel ZeRO-0/1 checkpoint whose `param_shapes` name the
  stage's parameters `{layer}.{name}` and `tied_modules.{key}.{name}`.

The fp32 master weights come from each stage's optimizer partitions (`index.read_zero`, with the
stage's layer-file tensors standing in for the `module` it did not save); buffers and frozen
parameters from the layer files. A tied module is trained on every stage that uses it: the lowest
stage's copy is read and the others are paired with it as replicas; in a Megatron-style one, each later
stage's copy is kept apart (`stage_copies`), its tensor-parallel ranks paired with one another only (the
stages' copies may differ: `_join_all`). Output names are the
PipelineModule's own (`{layer}.{name}`, `tied_modules.{key}.{name}`): there is no Hugging Face config.

Megatron-style tensor parallelism is split by rules only the client records, as
`universal_checkpoint_info` in `client_state` (Megatron-DeepSpeed does); without it the checkpoint
is refused. The rules are those of DeepSpeed's `ds_to_universal.merge_tp_slices`: replicated = one
copy (all must agree); row-parallel = concatenated on dim 1; `parameter_with_2_sub_params_cat_dim_0`
= each shard halved on dim 0 and the halves concatenated apart; `parameter_with_sub_params` with
recorded shard widths; every other parameter concatenated on dim 0 (that format's convention);
vocabulary parameters then cut to `original_vocab_size` rows (at tp1 too, where the client records
`universal_checkpoint_info`); averaged parameters are refused. Megatron's learned position embeddings
(`position_embeddings.weight`), which every rank holds whole, are read as replicated where no category
lists them (Megatron-DeepSpeed lists the tied one only; `POSITION_EMBEDDINGS`), with a note.

At ZeRO-0 no file names a parameter (no `param_shapes`): every tensor is read from its layer file and
named `{layer}.{name}`, a tied module under the first layer that uses it. Except in bf16: a PipelineModule
then gets DeepSpeed's BF16_Optimizer at ZeRO-0, which writes its own files (`bf16_zero_pp_rank_*`, each
naming the parameters its partition holds by `param_slice_mappings`; the model states' `optimizer` is
data-parallel rank 0's alone), and DeepSpeed 0.19.8 cannot load that checkpoint back. Each stage's
`param_shapes` is rebuilt from all its ranks' names (`_stage_mappings`) and the layer files' shapes
(`_named_head`), it is read as a ZeRO-1 BF16_Optimizer stage, and the index records ZeRO-0
(`bf16_zero0`: the reshard planner writes it at ZeRO-1, `reshard.pipeline_zero0`), with a note saying so.
A Megatron-style one is read the same way per model-parallel rank (`bf16_zero_pp_rank_{D}_mp_rank_{MM}`, the
shapes from the layer files of its tensor-parallel rank), its tensor-parallel pieces joined as ZeRO-1's are
(`reshard.megatron_zero0` writes it at ZeRO-1).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ckptflow.errors import CkptflowError, UnsupportedCheckpointError, option
from ckptflow.formats.deepspeed.client_state import namespace_state
from ckptflow.formats.deepspeed.inspection import Inspection, Listing, is_count, open_rank_file
from ckptflow.formats.deepspeed.model import ModelTensor
from ckptflow.formats.deepspeed.names import LAYER_FILE_RE, UC_INFO, layer_file_name, optim_file_name
from ckptflow.formats.deepspeed.qkv import Heads, check_degree, heads_from_args
from ckptflow.formats.deepspeed.readers.model_parallel import (
    MAX_PATTERN,
    Holding,
    ModelParallelCheckpoint,
    Piece,
    Replica,
    about,
    check_mp_files,
    concat_pieces,
    join,
    local_tensors,
    open_heads,
    read_ranks,
    row_major,
    stop_on_new,
)
from ckptflow.formats.deepspeed.readers.zero import zero0_bf16_optimizer
from ckptflow.formats.deepspeed.readers.zero0 import UNNAMED_OPTIMIZER, Zero0Checkpoint, masters_note
from ckptflow.formats.deepspeed.runs import whole_run
from ckptflow.formats.deepspeed.topology import Topology
from ckptflow.formats.torch.tensorref import TensorRef
from ckptflow.formats.torch.unpickler import PickledObject
from ckptflow.formats.torch.zipdir import open_archive
from ckptflow.plumbing.redaction import describe
from ckptflow.plumbing.storage import join as join_uri
from ckptflow.plumbing.text import excerpt

TIED = "tied_modules."

NAMES_NOTE = ("a PipelineModule has no Hugging Face config: the tensors keep its own names ({layer}.{name}, "
              "tied_modules.{key}.{name}), those of its state_dict; load them with safetensors.torch.load_file and "
              "load_state_dict on the same PipelineModule built as one stage, or rename them for your model")
BF16_ZERO0_NOTE = ("a PipelineModule trained in bf16 at ZeRO-0 gets DeepSpeed's BF16_Optimizer, whose checkpoint "
                   "DeepSpeed 0.19.8 cannot load back (its loader fails with KeyError 0); its optimizer files name "
                   "every parameter, so `ckptflow reshard SRC OUT --world-size N --zero-stage 1` writes it at ZeRO-1, "
                   "which DeepSpeed loads")
BF16_ZERO0_LOAD = ("its optimizer is DeepSpeed's BF16_Optimizer (what a PipelineModule trained in bf16 gets at "
                   "ZeRO-0), which DeepSpeed 0.19.8 cannot load back (its loader fails with KeyError 0); ckptflow "
                   "writes it at ZeRO-1, which DeepSpeed loads")
NO_UC_INFO = ("nothing in it says how each parameter is split over the {tp} tensor-parallel ranks, and ckptflow does "
              "not guess (DeepSpeed's universal converter does when told to inject the state it lacks, and writes "
              "wrong tensors for row-parallel, replicated and vocabulary-padded parameters); save the checkpoint with "
              "`client_state={{'universal_checkpoint_info': ...}}` as Megatron-DeepSpeed does, or convert it with "
              "your framework's own tools")


def read_pipeline(
    st: Inspection, listing: Listing, model0: dict[str, Any], topology: Topology
) -> ModelParallelCheckpoint:
    """The index of a PipelineModule checkpoint (`pipeline`, or `megatron` with tensor parallelism)."""
    megatron = topology.kind == "megatron"
    pp, tp = topology.pp, topology.tp if megatron else 1
    count = pp * tp

    def label(mp: int) -> str:
        stage = f"pipeline stage {mp // tp} of {pp}"
        return f"{stage}, tensor-parallel rank {mp % tp} of {tp}" if megatron else stage

    info: Mapping[str, Any] = {}
    if tp > 1:
        info = _uc_info(st, listing, model0, topology)
        st.stop_if_any()
    elif megatron and isinstance(model0.get(UC_INFO), Mapping):  # at tp1 it still says which rows are padding
        info = model0[UC_INFO]
    check_mp_files(st, listing, count, label, topology.description, layer_files=True)
    left_over = len(st.problems)  # files of other saves: reported, and the ranks are still read
    layer_names = _layer_files(st, listing, tp if megatron else None)
    heads = open_heads(st, listing, model0, count)
    stop_on_new(st, left_over)
    if info:
        for mp in range(1, count):
            if heads[mp].get(UC_INFO) != info:
                st.add("ranks-disagree", f"{label(mp)} records another {UC_INFO} than {label(0)} in "
                       f"{listing.model_uri(mp)}; every rank saves the same one: the folder mixes saves, re-copy it "
                       "from one save", file=listing.model_uri(mp))
    layers = _open_layers(st, listing, layer_names)
    stop_on_new(st, left_over)
    zero0 = topology.stage == 0
    bf16_zero0 = not zero0 and all(zero0_bf16_optimizer(head) for head in heads)
    if bf16_zero0:  # BF16_Optimizer at ZeRO-0: each model-parallel rank named by its ranks' param_slice_mappings
        mappings = [_stage_mappings(st, listing, mp, topology.dp) for mp in range(count)]
        heads = [_named_head(head, layers, mappings[mp], mappings, mp % tp) for mp, head in enumerate(heads)]
    plan = _StageModules(st, listing, heads, layers, tp, label) if not zero0 else None
    stop_on_new(st, left_over)
    ranks = read_ranks(st, listing, heads, topology.stage, label, plan.modules if plan else [{}] * count)
    if zero0:
        mp_locals, views = _layer_views(heads, layers, tp)
    else:
        assert plan is not None
        mp_locals = {mp: tensors for mp, tensors in enumerate(local_tensors(st, ranks, label))}
        for mp, leftovers in plan.frozen.items():  # layer-file tensors no stage trains: frozen parameters
            mp_locals.setdefault(mp, {}).update(leftovers)
        views = [[s * tp + t for t in range(tp)] for s in range(pp)]
    tensors, replicas, copies = _join_all(st, listing, mp_locals, views, info, tp, label,
                                          per_stage=megatron and not zero0)
    st.stop_if_any()
    first = ranks[0]
    notes: tuple[str, ...] = (NAMES_NOTE,)
    if zero0:
        assert isinstance(first, Zero0Checkpoint)  # read_ranks reads stage 0 with read_zero0
        notes = (f"{UNNAMED_OPTIMIZER}; at ZeRO-0 a PipelineModule records no parameter names either: tensors are "
                 "named by their layer file ({layer}.{name}), a tied module under the first layer that uses it (its "
                 "state_dict calls it tied_modules.{key}.{name}: rename it before load_state_dict)",
                 *([masters_note(first.precision)] if first.masters_unnamed else []))
    if bf16_zero0:
        notes += (BF16_ZERO0_NOTE,)
    note = position_note(info, [t.name for t in tensors]) if tp > 1 else None
    notes += (note,) if note else ()
    stage = 0 if bf16_zero0 else first.stage  # BF16_Optimizer's partitions, saved by a ZeRO-0 run
    return ModelParallelCheckpoint(
        root=st.root, tag=st.tag, stage=stage, world_size=first.world_size, precision=first.precision,
        step=first.step, ds_version=first.ds_version, kind=topology.kind,
        description=Topology(topology.kind, stage, topology.dp, tp=topology.tp, pp=pp).description, tp=tp, pp=pp,
        ranks=tuple(ranks), tensors=tuple(tensors), tied={}, replicas=tuple(replicas), stage_copies=copies,
        carried=tuple(sorted(layer_names.values())), notes=notes, layers=layers,
        tied_layers=tuple(sorted(plan.tied_owner.items())) if plan else (),
    )


def bf16_zero0(index: Any) -> bool:
    """Whether `index` is a PipelineModule checkpoint (plain or Megatron-style) saved at ZeRO-0 by BF16_Optimizer
    (trained in bf16): its model-parallel ranks hold BF16_Optimizer's partitions, named by its
    `param_slice_mappings` (`ZeroCheckpoint`s), not an optimizer saved by index (`Zero0Checkpoint`s)."""
    return (isinstance(index, ModelParallelCheckpoint) and index.kind in ("pipeline", "megatron") and index.stage == 0
            and not any(isinstance(rank, Zero0Checkpoint) for rank in index.ranks))


# ---- files -------------------------------------------------------------------------------------------


def _uc_info(st: Inspection, listing: Listing, model0: Mapping[str, Any], topology: Topology) -> Mapping[str, Any]:
    info = model0.get(UC_INFO)
    if not isinstance(info, Mapping):
        st.add("unsupported-layout", f"{listing.tag_uri} is a checkpoint in the {topology.description} layout without "
               f"`{UC_INFO}`: " + NO_UC_INFO.format(tp=topology.tp), file=listing.model0_uri)
        return {}
    return info


def _layer_files(st: Inspection, listing: Listing, tp: int | None) -> dict[tuple[int, int], str]:
    """(layer, tensor-parallel rank) -> file name; with Megatron-style TP every layer has one file per rank."""
    out: dict[tuple[int, int], str] = {}
    for name in listing.names:
        match = LAYER_FILE_RE.match(name)
        if not match:
            continue
        layer, rank = int(match.group(1)), match.group(2)
        if (rank is None) != (tp is None) or (rank is not None and tp is not None and int(rank) >= tp):
            why = ("has no tensor-parallel rank" if rank is None else f"is for tensor-parallel rank {int(rank)}")
            st.add("rank-extra", f"unexpected file {st.tag}/{name}: it {why}, but the checkpoint has "
                   f"{'no tensor parallelism' if tp is None else f'{tp} tensor-parallel ranks'}; it is left over from "
                   "another save into the same tag folder: remove it, or re-save the checkpoint into a fresh folder",
                   file=join_uri(listing.tag_uri, name))
            continue
        out[(layer, int(rank) if rank is not None else 0)] = name
    if tp is not None:
        for layer in sorted({layer for layer, _ in out}):
            for t in range(tp):
                if (layer, t) not in out:
                    name = layer_file_name(layer, t)
                    st.add("rank-missing", f"layer {layer} of tensor-parallel rank {t} of {tp} is missing: expected "
                           f"{st.tag}/{name} under {st.root}; the upload may still be in progress",
                           file=join_uri(listing.tag_uri, name))
    return out


def _open_layers(
    st: Inspection, listing: Listing, names: Mapping[tuple[int, int], str]
) -> dict[tuple[int, int], dict[str, TensorRef]]:
    out = {}
    for key, name in sorted(names.items()):
        uri = join_uri(listing.tag_uri, name)
        try:
            obj = open_archive(uri, st.allowed).obj
        except CkptflowError as exc:
            st.add(exc.code, f"layer file {name}: {exc}", file=uri)
            continue
        except OSError as exc:
            st.add("unreadable-file", f"cannot read {uri} ({describe(exc)}); check access to the store and retry",
                   file=uri)
            continue
        if not isinstance(obj, Mapping) or not all(
                isinstance(k, str) and isinstance(v, TensorRef) for k, v in obj.items()):
            st.add("corrupt-file", f"{uri} is not a PipelineModule layer state dict (names to tensors); the file is "
                   "damaged or was written by another tool", file=uri)
            continue
        out[key] = dict(obj)
    return out


# ---- which layer files each stage's parameters come from ---------------------------------------------


def _named_head(head: Mapping[str, Any], layers: Mapping[tuple[int, int], Mapping[str, TensorRef]],
                mappings: Sequence[Mapping[str, int]] | None,
                stages: Sequence[Sequence[Mapping[str, int]] | None], t: int = 0) -> dict[str, Any]:
    """A ZeRO-0 BF16_Optimizer model-parallel rank's model states (`readers.zero.zero0_bf16_optimizer`) with the
    `param_shapes` ZeRO-1 records: `mappings` (`_stage_mappings`: its ranks' `param_slice_mappings`) name each
    group's parameters in flattening order with their sizes, the layer files of its tensor-parallel rank `t` give
    their shapes (a tied module's: the one layer file no stage (`stages`) names that holds a tensor of its local
    name and size). A
    name no file gives a shape keeps its size alone, as a vector: `_StageModules` then names the file it misses,
    and `read_zero` checks every name against each optimizer file's own mappings."""
    if mappings is None:
        return dict(head)  # read_zero names what is missing
    owned = {layer for stage in stages for m in stage or () for n in m if (layer := layer_of(n)) is not None}

    def shape(name: str, numel: int) -> tuple[int, ...]:
        if name.startswith(TIED):
            local = name[len(TIED):].partition(".")[2]
            found = {tuple(content[local].shape) for (layer, u), content in layers.items()
                     if layer not in owned and u == t and local in content and content[local].numel == numel}
        else:
            layer, local = layer_of(name), name.partition(".")[2]
            ref = layers.get((layer, t), {}).get(local) if layer is not None else None
            found = {tuple(ref.shape)} if ref is not None and ref.numel == numel else set()
        return found.pop() if len(found) == 1 else (numel,)

    return {**head, "param_shapes": [{n: shape(n, numel) for n, numel in group.items()} for group in mappings]}


def _stage_mappings(st: Inspection, listing: Listing, mp: int, dp: int) -> list[dict[str, int]] | None:
    """Stage `mp`'s parameters by group in flattening order, each with its size: BF16_Optimizer's
    `param_slice_mappings` in its `dp` optimizer files, in rank order. Each file lists only the parameters its
    partition holds, with the size of the piece it holds; one spanning a partition boundary is listed by each
    rank that holds a piece, kept once at its first, its pieces' sizes added. None where a file is missing or
    unusable (`read_zero` reports it). The files are opened through `st.cache`, which `read_zero` shares, so
    their pickles are not unpickled again."""
    probe = Inspection(st.root, st.tag, explicit_tag=st.explicit_tag, allowed=st.allowed, cache=st.cache)
    groups: list[dict[str, int]] = []
    for d in range(dp):
        name = optim_file_name("bf16", d, mp)
        if name not in listing.optim_names:
            return None
        osd = open_rank_file(probe, join_uri(listing.tag_uri, name), d).get("optimizer_state_dict")
        mappings = _slice_mappings(osd) if isinstance(osd, Mapping) else None
        if mappings is None or (groups and len(mappings) != len(groups)):
            return None
        groups = groups or [{} for _ in mappings]
        for group, mapping in zip(groups, mappings):
            for n, addr in mapping.items():
                numel = addr.get("numel") if isinstance(addr, PickledObject) else None
                if not isinstance(n, str) or not isinstance(numel, int) or not is_count(numel):
                    return None
                group[n] = group.get(n, 0) + numel
    return groups


def _names(head: Mapping[str, Any]) -> list[str]:
    shapes = head.get("param_shapes") or []
    names = [n for group in shapes if isinstance(group, Mapping) for n in group]
    return names + [n for n in head.get("buffer_names") or [] if isinstance(n, str)]


def _slice_mappings(optimizer: Mapping[str, Any]) -> list[Mapping[str, Any]] | None:
    """The `param_slice_mappings` of a BF16_Optimizer state dict, or None."""
    mappings = optimizer.get("param_slice_mappings")
    if not isinstance(mappings, list) or not all(isinstance(m, Mapping) for m in mappings):
        return None
    return mappings


def layer_of(name: str) -> int | None:
    """The layer whose file holds the PipelineModule tensor `name` (`{layer}.{name}`), or None (a tied module's)."""
    head = name.split(".", 1)[0]
    return int(head) if head.isdigit() else None


class _StageModules:
    """Each model-parallel rank's `module` stand-in (its layers' tensors under `param_shapes` names, the
    tied modules' under `tied_modules.{key}.{name}`) and the layer-file tensors no stage trains."""

    def __init__(self, st: Inspection, listing: Listing, heads: Sequence[Mapping[str, Any]],
                 layers: Mapping[tuple[int, int], Mapping[str, TensorRef]], tp: int,
                 label: Callable[[int], str]) -> None:
        self.modules: list[dict[str, TensorRef]] = []
        self.frozen: dict[int, dict[str, ModelTensor]] = {}
        self.tied_owner: dict[str, int] = {}  # tied module key -> the layer whose file holds it
        owned = {layer for head in heads for n in _names(head) if (layer := layer_of(n)) is not None}
        tied_owner = self.tied_owner = self._tied_owners(st, heads, layers, owned)
        used: set[tuple[int, int, str]] = set()
        for mp, head in enumerate(heads):
            t = mp % tp
            module: dict[str, TensorRef] = {}
            for name in _names(head):
                layer = layer_of(name)
                if name.startswith(TIED):
                    key, _, local = name[len(TIED):].partition(".")
                    layer = tied_owner.get(key)
                else:
                    local = name.split(".", 1)[1] if "." in name else ""
                if layer is None:
                    if not name.startswith(TIED):
                        st.add("corrupt-file", f"{label(mp)} lists {name}, which names no layer",
                               file=listing.model_uri(mp))
                    continue
                content = layers.get((layer, t))
                if content is None or local not in content:
                    file = layer_file_name(layer, t if tp > 1 else None)
                    st.add("rank-missing", f"{label(mp)} trains {name} but {st.tag}/{file} under {st.root} "
                           f"{'is missing' if content is None else f'holds no {local}'}; the upload may still be in "
                           "progress, or the folder mixes saves", file=join_uri(listing.tag_uri, file))
                    continue
                module[name] = content[local]
                used.add((layer, t, local))
            self.modules.append(self._ordered(module))
        self._check_shapes(st, listing, heads, label)
        for (layer, t), content in layers.items():
            rest = {f"{layer}.{n}": ref for n, ref in content.items() if (layer, t, n) not in used}
            if rest:
                mp = self._stage_of(layer, heads, tp) * tp + t
                self.frozen.setdefault(mp, {}).update(
                    {n: ModelTensor(n, ref.shape, ref.dtype, "frozen", (whole_run(ref, n),))
                     for n, ref in rest.items()})

    @staticmethod
    def _ordered(module: dict[str, TensorRef]) -> dict[str, TensorRef]:
        """Layer order, tied modules where their layer is: the order a state dict would have."""
        return dict(sorted(module.items(), key=lambda kv: (layer_of(kv[0]) is None and not kv[0].startswith(TIED),
                                                           layer_of(kv[0]) or 0)))

    @staticmethod
    def _stage_of(layer: int, heads: Sequence[Mapping[str, Any]], tp: int) -> int:
        """The stage whose layers surround `layer` (stages hold contiguous layer ranges)."""
        stage = 0
        for mp in range(0, len(heads), tp):
            layers = [x for n in _names(heads[mp]) if (x := layer_of(n)) is not None]
            if layers and min(layers) <= layer:
                stage = mp // tp
        return stage

    @staticmethod
    def _tied_owners(st: Inspection, heads: Sequence[Mapping[str, Any]],
                     layers: Mapping[tuple[int, int], Mapping[str, TensorRef]], owned: set[int]) -> dict[str, int]:
        """Tied module key -> the layer whose file holds it: the one layer file no stage names whose tensors
        are exactly the tied module's (names and shapes)."""
        wanted: dict[str, dict[str, tuple[int, ...]]] = {}
        for head in heads:
            for group in head.get("param_shapes") or []:
                for name, shape in (group.items() if isinstance(group, Mapping) else ()):
                    if name.startswith(TIED):
                        key, _, local = name[len(TIED):].partition(".")
                        wanted.setdefault(key, {})[local] = tuple(shape)
        out = {}
        for key, params in wanted.items():
            found = sorted({layer for (layer, t), content in layers.items() if layer not in owned
                            and all(n in content and content[n].shape == s for n, s in params.items())
                            and t == 0})
            if len(found) != 1:
                recorded = excerpt(", ".join(f"{n} {list(s)}" for n, s in sorted(params.items())))
                why = (f"layer files {', '.join(f'layer_{x:02d}-model_00-model_states.pt' for x in found)} all could"
                       if found else "no layer file (layer_NN-model_00-model_states.pt) holds it")
                st.add("unsupported-layout", f"cannot tell which layer file holds tied module {excerpt(key)} with the "
                       f"shapes the stages' mp_rank_NN_model_states.pt record for it ({recorded}): {why}; the folder "
                       "mixes saves or a file is damaged: re-copy it from one save")
                continue
            out[key] = found[0]
        return out

    def _check_shapes(self, st: Inspection, listing: Listing, heads: Sequence[Mapping[str, Any]],
                      label: Callable[[int], str]) -> None:
        for mp, (head, module) in enumerate(zip(heads, self.modules)):
            for group in head.get("param_shapes") or []:
                for name, shape in (group.items() if isinstance(group, Mapping) else ()):
                    ref = module.get(name)
                    if ref is not None and tuple(ref.shape) != tuple(shape):
                        st.add("ranks-disagree", f"{label(mp)} trains {name} of shape {excerpt(list(shape))} but its "
                               f"layer file holds {list(ref.shape)}; the folder mixes saves: re-copy it from one save",
                               file=listing.model_uri(mp))


def _layer_views(heads: Sequence[Mapping[str, Any]], layers: Mapping[tuple[int, int], Mapping[str, TensorRef]],
                 tp: int) -> tuple[dict[int, dict[str, ModelTensor]], list[list[int]]]:
    """ZeRO-0: every tensor straight from its layer file, `{layer}.{name}`, one view over the tensor-parallel
    ranks (keyed by tensor-parallel rank)."""
    buffers = {n for head in heads for n in head.get("buffer_names") or []}
    out: dict[int, dict[str, ModelTensor]] = {t: {} for t in range(tp)}
    for (layer, t), content in sorted(layers.items()):
        for local, ref in content.items():
            name = f"{layer}.{local}"
            out[t][name] = ModelTensor(name, ref.shape, ref.dtype, "buffer" if name in buffers else "param",
                                       (whole_run(ref, name),))
    return out, [list(range(tp))]


# ---- joining ----------------------------------------------------------------------------------------


def _join_all(st: Inspection, listing: Listing, mp_locals: Mapping[int, Mapping[str, ModelTensor]],
              views: Sequence[Sequence[int]], info: Mapping[str, Any], tp: int,
              label: Callable[[int], str], *, per_stage: bool = False
              ) -> tuple[list[ModelTensor], list[Replica], dict[tuple[str, int], ModelTensor]]:
    """Every full tensor: per view (a stage's tensor-parallel ranks), the pieces each rank holds; a name
    several stages hold (a tied module) is read from the first and checked against the others. With
    `per_stage` (Megatron-style), each later stage's copy is joined on its own, its tensor-parallel ranks
    checked against one another only, and returned by (name, stage): Megatron-DeepSpeed's `GPTModelPipe`
    keeps only the word embedding of its tied module equal over the stages (`TiedLayerSpec`'s
    `tied_weight_attr`), and the last stage's copy of the position embeddings, which its head never reads,
    drifts from the first's under weight decay."""
    order: dict[str, None] = {}
    for view in views:
        for mp in view:
            order.update(dict.fromkeys(mp_locals.get(mp, {})))
    tensors: list[ModelTensor] = []
    replicas: list[Replica] = []
    copies: dict[tuple[str, int], ModelTensor] = {}
    for name in order:
        try:
            holdings: list[Holding] = []
            per_view: dict[int, list[Holding]] = {}
            shape: tuple[int, ...] | None = None
            rows = None
            kind = None
            for at, view in enumerate(views):
                held = [name in mp_locals.get(mp, {}) for mp in view]
                if not any(held):
                    continue
                if not all(held):
                    missing = [label(mp) for mp, h in zip(view, held) if not h]
                    raise UnsupportedCheckpointError(f"{missing[0]} does not hold it, as the other tensor-parallel "
                                                     "ranks of its stage do; the folder mixes saves")
                locals_ = [mp_locals[mp][name] for mp in view]
                kind = locals_[0].kind
                full, pieces, rows = split_pieces(name, [t.shape for t in locals_], info, tp, kind)
                if shape is not None and full != shape:
                    raise UnsupportedCheckpointError(f"stages hold it with different shapes {excerpt(list(shape))} and "
                                                     f"{excerpt(list(full))}")
                shape = full
                per_view[at] = [Holding(mp, name, tuple(p)) for mp, p in zip(view, pieces)]
                holdings.extend(per_view[at])
            assert shape is not None and kind is not None
            stages = list(per_view.items()) if per_stage else [(min(per_view), holdings)]
            joined = [(at, *join(name, shape, kind, held, lambda mp, n: mp_locals[mp][n], rows=rows))
                      for at, held in stages]
        except (CkptflowError, ValueError) as exc:
            st.add(getattr(exc, "code", "unsupported-layout"), about(name, exc), file=listing.model0_uri)
            continue
        tensors.append(joined[0][1])
        copies.update({(name, at): tensor for at, tensor, _ in joined[1:]})
        replicas.extend(pair for _, _, pairs in joined for pair in pairs)
    return tensors, replicas, copies


def split_pieces(name: str, shapes: Sequence[tuple[int, ...]], info: Mapping[str, Any], tp: int,
                 kind: str) -> tuple[tuple[int, ...], list[list[Piece]], int | None]:
    """Full shape (vocabulary padding included), per tensor-parallel rank the pieces it holds of its local
    tensor of `shapes[rank]`, and rows to keep (the vocabulary without its padding), by the client's
    rules. `UnsupportedCheckpointError` (or `ValueError`) where they do not say."""
    whole = [[Piece(s, 0, row_major(s), 0, row_major(s))] for s in shapes]
    rules = _Rules(info)
    if tp == 1 or kind == "buffer":
        if any(s != shapes[0] for s in shapes):
            raise UnsupportedCheckpointError(
                f"its tensor-parallel copies have different shapes {[list(s) for s in shapes]}"
            )
        return tuple(shapes[0]), whole, None if kind == "buffer" else _vocabulary_rows(name, shapes[0], rules, info)
    if rules.replicated(name):
        if any(s != shapes[0] for s in shapes):
            recorded = ("it is recorded as replicated" if rules.matches("tp_replicated_parameter_patterns", name) else
                        "it is Megatron's learned position embeddings, which every tensor-parallel rank holds whole,")
            raise UnsupportedCheckpointError(f"{recorded} but its tensor-parallel copies have shapes "
                                             f"{[list(s) for s in shapes]}")
        full, pieces = tuple(shapes[0]), whole
    elif rules.matches("parameter_to_average_patterns", name):
        raise UnsupportedCheckpointError("the checkpoint records it as averaged over the tensor-parallel ranks; "
                                         "ckptflow copies bytes and does not average: convert it with "
                                         "deepspeed.checkpoint.ds_to_universal")
    elif rules.matches("parameter_with_2_sub_params_cat_dim_0", name):
        full, pieces = _halves(shapes)
    elif (sub := rules.sub_params(name)) is not None:
        full, pieces = _sub_params(name, shapes, sub, info)
    elif rules.matches("parameter_with_row_parallelism_patterns", name):
        full, concat = concat_pieces(shapes, 1)
        pieces = [[p] for p in concat]
    else:
        full, concat = concat_pieces(shapes, 0)
        pieces = [[p] for p in concat]
    return tuple(full), pieces, _vocabulary_rows(name, full, rules, info)


def _vocabulary_rows(name: str, full: Sequence[int], rules: _Rules, info: Mapping[str, Any]) -> int | None:
    """The rows of vocabulary parameter `name` to keep (its padding cut), None for the whole tensor."""
    if not rules.matches("vocabulary_parameter_patterns", name):
        return None
    original = info.get("original_vocab_size")
    if not isinstance(original, int) or isinstance(original, bool):
        raise UnsupportedCheckpointError("it is a vocabulary parameter but the checkpoint records no "
                                         "original_vocab_size")
    return original if original != full[0] else None


def shard_shapes(name: str, full: Sequence[int], info: Mapping[str, Any], tp: int, kind: str = "param"
                 ) -> list[tuple[int, ...]]:
    """Every tensor-parallel rank's local shape of `name` (full shape `full`, vocabulary padding included)
    at degree `tp`: the inverse of `split_pieces`, as DeepSpeed's `load_hp_checkpoint_state` slices a
    universal checkpoint (`chunk` into `tp` equal blocks on dim 0, or on dim 1 for row-parallel
    parameters, each half of a `parameter_with_2_sub_params_cat_dim_0` on its own; replicated ones
    whole). `UnsupportedCheckpointError` where the rules do not say, or the blocks would not be equal."""
    full = tuple(int(d) for d in full)
    if tp == 1 or kind == "buffer":
        return [full] * tp
    rules = _Rules(info)
    if rules.replicated(name):
        return [full] * tp
    if rules.matches("parameter_to_average_patterns", name):
        raise UnsupportedCheckpointError("the checkpoint records it as averaged over the tensor-parallel ranks "
                                         "(parameter_to_average_patterns), and ckptflow copies bytes, it does not "
                                         "average")
    if rules.sub_params(name) is not None:
        raise UnsupportedCheckpointError("it is recorded as fused sub-parameters (parameter_with_sub_params), whose "
                                         "shard widths at that degree the checkpoint does not record; ckptflow does "
                                         "not guess them")
    halves = rules.matches("parameter_with_2_sub_params_cat_dim_0", name)
    dim = 1 if rules.matches("parameter_with_row_parallelism_patterns", name) and not halves else 0
    if len(full) <= dim:
        raise UnsupportedCheckpointError(f"it has shape {list(full)}, with no dimension {dim} to split")
    blocks = 2 * tp if halves else tp
    if full[dim] % blocks:
        if dim == 1:
            raise UnsupportedCheckpointError(f"its {full[1]} columns do not split into {tp} equal blocks")
        vocabulary = rules.matches("vocabulary_parameter_patterns", name)
        blocks_of = f"two halves of {tp} equal blocks each" if halves else f"{tp} equal blocks"
        rows = f"the padded vocabulary's {full[0]} rows" if vocabulary else f"its {full[0]} rows"
        raise UnsupportedCheckpointError(f"{rows} do not split into {blocks_of}")
    return [(*full[:dim], full[dim] // tp, *full[dim + 1:])] * tp


# One parameter's split at a tensor-parallel degree: per rank its local shape and the pieces of the full
# tensor (vocabulary padding included) it holds.
Split = tuple[list[tuple[int, ...]], list[list[Piece]]]


# Megatron-DeepSpeed's fused attention projection. Since its commit 676a482c (December 2024, the FPDT change)
# each tensor-parallel rank holds its rows as [q | k | v] of that rank's heads, and a model at tp1 reads all the
# q rows, then all k, then all v; before, each rank's rows went key/value group by group, which rank after rank
# keeps right. Nothing in the checkpoint says which (`checkpoint_version` is 3.0 in both, and
# `universal_checkpoint_info` does not name it), and `ds_to_universal` joins it rank after rank; the user says
# which (`reshard.qkv`).
FUSED_QKV = "query_key_value"


FUSED_QKV_WHY = ("is Megatron's fused attention projection, whose rows each tensor-parallel rank holds as [q | k | v] "
                 "of its own heads in Megatron-DeepSpeed since December 2024 and key/value group by group before; the "
                 "checkpoint does not record which, and joined or cut the wrong way the model loads and computes "
                 "something else")


def declare_qkv_layout() -> str:
    """What makes a fused attention projection joinable after all, as the reader of the message names the option."""
    return (f"declare the layout the checkpoint's Megatron-DeepSpeed wrote with {option('qkv_layout')} (blocks since "
            "December 2024, groups before)")


def fused_qkv(index: ModelParallelCheckpoint) -> str | None:
    """The first of the Megatron-style checkpoint `index`'s parameters that is a fused attention projection
    (`FUSED_QKV`), which a tensor-parallel change joins and cuts only in a layout the user declares
    (`FUSED_QKV_WHY`; `reshard.qkv`); None without one."""
    return next((p.name for p in index.ranks[0].params if FUSED_QKV in p.name), None)


# Megatron-DeepSpeed's transformer layer (`ParallelTransformerLayerPipe`, `megatron/model/transformer.py`), the class
# `GPTModelPipe`'s `partition_method='type:transformer'` weighs: known in a checkpoint by what it trains,
# Megatron's `self_attention.*` and `mlp.*` (with `input_layernorm` and `post_attention_layernorm`). Its embedding
# (`EmbeddingPipe`), final norm, head (`LMHeadPipe`, or the tied embedding's `forward_fn`) and functions train
# neither.
TRANSFORMER_LAYER = "ParallelTransformerLayerPipe"
TRANSFORMER_PARTS = ("self_attention", "mlp")


def transformer_layers(index: ModelParallelCheckpoint) -> frozenset[int]:
    """The layers of the Megatron-style checkpoint `index` that Megatron-DeepSpeed built as its transformer layer
    (`TRANSFORMER_LAYER`): those whose own parameters (`{layer}.{name}`) include `TRANSFORMER_PARTS`."""
    parts: dict[int, set[str]] = {}
    for rank in index.ranks:
        for p in rank.params:
            head, _, local = p.name.partition(".")
            if head.isdigit():
                parts.setdefault(int(head), set()).add(local.partition(".")[0])
    return frozenset(layer for layer, held in parts.items() if held.issuperset(TRANSFORMER_PARTS))


TIED_WHY = ("is a tied module's parameter (a TiedLayerSpec its pipeline stages share) that is neither a vocabulary "
            "parameter nor a replicated one: ckptflow moves a tied vocabulary-parallel word embedding and a tied "
            "parameter its universal_checkpoint_info records as replicated over the tensor-parallel ranks (Megatron's "
            "GPT ties its embedding and head, and its learned position embeddings with them) to another "
            "tensor-parallel degree or number of pipeline stages of a Megatron-style checkpoint, not tied parameters "
            "split by other rules")


def tied_module(index: ModelParallelCheckpoint, tp: int | None = None) -> str | None:
    """The first parameter of a tied module (`tied_modules.{key}.{name}`) of the Megatron-style checkpoint
    `index` that no tensor-parallel or pipeline change moves (`TIED_WHY`): one its `universal_checkpoint_info`
    records neither as a vocabulary parameter nor as replicated (`tp_replicated_parameter_patterns`); None
    without one, or where `index` and the target (`tp`) are both at tensor-parallel degree 1: each tied parameter
    is then whole in both and no rule splits it (Megatron-DeepSpeed records `tp_replicated_parameter_patterns`
    only above tp 1)."""
    if index.tp == 1 and tp == 1:
        return None
    rules = _Rules(index.ranks[0].model_states[0].get(UC_INFO) or {})
    return next((p.name for rank in index.ranks for p in rank.params
                 if p.name.startswith(TIED) and not rules.matches("vocabulary_parameter_patterns", p.name)
                 and not rules.matches("tp_replicated_parameter_patterns", p.name)), None)


def splits_at(index: ModelParallelCheckpoint, tp: int, vocab_rows: int | None = None) -> list[dict[str, Split]]:
    """Per pipeline stage of the Megatron-style checkpoint `index`, every parameter its stage trains,
    split at tensor-parallel degree `tp` by the rules its `universal_checkpoint_info` records (`shard_shapes`,
    then `split_pieces`, the same rules the reader joins the source's shards by); the vocabulary parameters
    padded to `vocab_rows` rows (None: the source's padded rows); at the source's own degree, its own
    shards. `UnsupportedCheckpointError` naming the first parameter the rules do not split at `tp`."""
    info = index.ranks[0].model_states[0].get(UC_INFO) or {}
    out = []
    for stage in range(index.pp):
        ranks = index.ranks[stage * index.tp:(stage + 1) * index.tp]
        splits: dict[str, Split] = {}
        for param in ranks[0].params:
            try:
                local = [rank.param_by_name[param.name].shape for rank in ranks]
                full, held, _ = split_pieces(param.name, local, info, index.tp, "param")
                if tp == index.tp and vocab_rows is None:  # its own degree: the source's shards
                    splits[param.name] = ([tuple(s) for s in local], held)
                    continue
                if vocab_rows is not None and _Rules(info).matches("vocabulary_parameter_patterns", param.name):
                    full = (vocab_rows, *full[1:])
                shapes = shard_shapes(param.name, full, info, tp)
                again, pieces, _ = split_pieces(param.name, shapes, info, tp, "param")
            except (CkptflowError, ValueError, KeyError) as exc:
                raise UnsupportedCheckpointError(f"{param.name} does not split at tensor-parallel degree {tp}: {exc}",
                                                 tensor=param.name) from None
            assert again == full, (param.name, again, full)
            splits[param.name] = (shapes, pieces)
        out.append(splits)
    return out


def vocabulary_rows(index: ModelParallelCheckpoint) -> dict[str, int]:
    """Each vocabulary parameter (`vocabulary_parameter_patterns`) of the Megatron-style checkpoint `index`
    with its rows, padding included, as its tensor-parallel shards make them."""
    info = index.ranks[0].model_states[0].get(UC_INFO) or {}
    rules = _Rules(info)
    out = {}
    for stage in range(index.pp):
        ranks = index.ranks[stage * index.tp:(stage + 1) * index.tp]
        for param in ranks[0].params:
            if rules.matches("vocabulary_parameter_patterns", param.name):
                local = [rank.param_by_name[param.name].shape for rank in ranks]
                out[param.name] = split_pieces(param.name, local, info, index.tp, "param")[0][0]
    return out


# Megatron's learned position embeddings: an `nn.Embedding` of `max_position_embeddings` rows that every
# tensor-parallel rank holds whole (`megatron.model.language_model.Embedding`). Megatron-DeepSpeed lists the tied
# one (`tied_modules.embed.position_embeddings.weight`) as replicated in `universal_checkpoint_info`, but not the
# untied one (`{layer}.position_embeddings.weight`, `--untie-embeddings-and-output-weights`), which
# `ds_to_universal` then concatenates as if split, and Megatron refuses the tensor it writes. A parameter of that
# name that no category lists is read as replicated: each rank's copy must have the same shape, and the reader
# pairs the copies as replicas, so a reshard refuses them where their values differ.
POSITION_EMBEDDINGS = re.compile(r"(?:^|\.)position_embeddings\.weight$")
CATEGORIES = ("tp_replicated_parameter_patterns", "parameter_to_average_patterns",
              "parameter_with_2_sub_params_cat_dim_0", "parameter_with_row_parallelism_patterns",
              "vocabulary_parameter_patterns")
POSITION_NOTE = ("{names} {are} Megatron's learned position embeddings, which every tensor-parallel rank holds "
                 "whole; the checkpoint's universal_checkpoint_info does not list {them} as replicated, so ckptflow "
                 "reads {them} as replicated (the ranks' copies must agree) where DeepSpeed's universal converter "
                 "would concatenate them")


def position_note(info: Mapping[str, Any], names: Sequence[str]) -> str | None:
    """What the reader says of those of `names` that `info` lists in no category and that it reads as
    replicated all the same, Megatron's learned position embeddings (`POSITION_EMBEDDINGS`); None: none."""
    rules = _Rules(info)
    found = [n for n in names if POSITION_EMBEDDINGS.search(n) and not rules.listed(n)]
    if not found:
        return None
    plural = len(found) > 1
    return POSITION_NOTE.format(names=", ".join(found), are="are" if plural else "is", them="them" if plural else "it")


class _Rules:
    """The category patterns of a client's `universal_checkpoint_info`, matched as DeepSpeed matches them
    (`re.match` on `{layer}.{name}`; two patterns of one category matching one name is an error)."""

    def __init__(self, info: Mapping[str, Any]) -> None:
        self.info = info

    def listed(self, name: str) -> bool:
        """Whether any category names `name`."""
        return any(self.matches(key, name) for key in CATEGORIES) or self.sub_params(name) is not None

    def replicated(self, name: str) -> bool:
        """Whether every tensor-parallel rank holds `name` whole: listed so, or Megatron's learned position
        embeddings listed in no category (`POSITION_EMBEDDINGS`)."""
        if self.matches("tp_replicated_parameter_patterns", name):
            return True
        return POSITION_EMBEDDINGS.search(name) is not None and not self.listed(name)

    def _patterns(self, key: str) -> list[str]:
        patterns = self.info.get(key) or []
        if not isinstance(patterns, list) or not all(isinstance(p, str) and len(p) <= MAX_PATTERN for p in patterns):
            raise UnsupportedCheckpointError(f"{UC_INFO}.{key} is not a list of patterns")
        return patterns

    def matches(self, key: str, name: str) -> bool:
        found = [p for p in self._patterns(key) if _match(p, name)]
        if len(found) > 1:
            raise UnsupportedCheckpointError(f"more than one pattern of {UC_INFO}.{key} matches it ({found[:3]})")
        return bool(found)

    def sub_params(self, name: str) -> tuple[str, Mapping[str, Any]] | None:
        for entry in self.info.get("parameter_with_sub_params") or []:
            if not isinstance(entry, Mapping):
                continue
            for pattern in entry.get("patterns") or []:
                if isinstance(pattern, str) and len(pattern) <= MAX_PATTERN and _match(pattern, name):
                    return pattern, entry
        return None


def _match(pattern: str, name: str) -> bool:
    try:
        return re.match(pattern, name) is not None
    except re.error as exc:
        raise UnsupportedCheckpointError(f"the recorded pattern {pattern[:80]!r} is not a regular expression "
                                         f"({exc})") from None


def _halves(shapes: Sequence[tuple[int, ...]]) -> tuple[tuple[int, ...], list[list[Piece]]]:
    """`parameter_with_2_sub_params_cat_dim_0`: each shard is `torch.chunk(shard, 2, 0)`; the full tensor is
    all first halves, then all second halves."""
    if any(len(s) < 1 or s[1:] != shapes[0][1:] for s in shapes):
        raise UnsupportedCheckpointError(f"shards of shapes {[list(s) for s in shapes]} do not stack on dim 0")
    row = row_major(shapes[0])[0] if len(shapes[0]) > 1 else 1
    halves = [((s[0] + 1) // 2, s[0] - (s[0] + 1) // 2) for s in shapes]
    first_total = sum(h[0] for h in halves)
    full = (sum(s[0] for s in shapes), *shapes[0][1:])
    strides = row_major(full)
    out, offsets = [], [0, first_total]
    for shape, (a, b) in zip(shapes, halves):
        pieces = []
        for k, rows in enumerate((a, b)):
            piece_shape = (rows, *shape[1:])
            pieces.append(Piece(piece_shape, offsets[k] * row, strides, (a * row if k else 0), row_major(piece_shape)))
            offsets[k] += rows
        out.append(pieces)
    return full, out


def _sub_params(name: str, shapes: Sequence[tuple[int, ...]], sub: tuple[str, Mapping[str, Any]],
                info: Mapping[str, Any]) -> tuple[tuple[int, ...], list[list[Piece]]]:
    """`parameter_with_sub_params` with `sub_param_shard_widths` (universal checkpoint 0.4): along
    `partition_dim`, sub-parameter `s` holds `widths[s][t]` slices on rank `t`, in sub-parameter order."""
    pattern, entry = sub
    dim = entry.get("partition_dim")
    widths = (info.get("sub_param_shard_widths") or {}).get(pattern)
    tp = len(shapes)
    if not isinstance(dim, int) or not isinstance(widths, list) or any(
            not isinstance(w, list) or len(w) != tp or not all(isinstance(x, int) and x >= 0 for x in w)
            for w in widths):
        raise UnsupportedCheckpointError("it is recorded as fused sub-parameters without their shard widths "
                                         "(sub_param_shard_widths, universal checkpoint 0.4); ckptflow does not guess")
    if any(not 0 <= dim < len(s) or s[dim] != sum(w[t] for w in widths) for t, s in enumerate(shapes)):
        raise UnsupportedCheckpointError(f"its shard widths {widths} do not add up to the shards' shapes "
                                         f"{[list(s) for s in shapes]}")
    full = list(shapes[0])
    full[dim] = sum(sum(w) for w in widths)
    full_strides = row_major(full)
    out = []
    for t, shape in enumerate(shapes):
        local_strides = row_major(shape)
        pieces, local_at, full_at = [], 0, 0
        for w in widths:
            piece_shape = list(shape)
            piece_shape[dim] = w[t]
            source = (full_at + sum(w[:t])) * full_strides[dim]
            pieces.append(Piece(tuple(piece_shape), source, full_strides, local_at * local_strides[dim], local_strides))
            local_at += w[t]
            full_at += sum(w)
        out.append(pieces)
    return tuple(full), out


def row_join_problem(index: ModelParallelCheckpoint, name: str) -> str | None:
    """Why the rules the Megatron-style checkpoint `index` records (`split_pieces`) do not join its
    tensor-parallel ranks' shards of parameter `name` one after the other on their rows, as a column-parallel
    parameter (None: they do), in words that do not name it."""
    info = index.ranks[0].model_states[0].get(UC_INFO) or {}
    for stage in range(index.pp):
        ranks = index.ranks[stage * index.tp:(stage + 1) * index.tp]
        if name in ranks[0].param_by_name:
            local = [rank.param_by_name[name].shape for rank in ranks]
            try:
                _, pieces, _ = split_pieces(name, local, info, index.tp, "param")
            except UnsupportedCheckpointError as exc:  # the rules' own reason
                return str(exc)
            except (ValueError, KeyError) as exc:  # rules that do not read as DeepSpeed writes them
                return f"its split rules in {UC_INFO} do not read ({exc})"
            if pieces != [[p] for p in concat_pieces(local, 0)[1]]:
                break
            return None
    return "the checkpoint does not record it as a column-parallel parameter, split on its rows"


def fused_heads(index: ModelParallelCheckpoint, name: str, rows: int) -> Heads:
    """The heads of the fused attention projection `name` (`rows` rows, its ranks joined) of the Megatron-style
    checkpoint `index`, from the run's `args`. `UnsupportedCheckpointError`, saying why without naming it,
    where its rules do not join it on its rows (`row_join_problem`), the `args` do not give its heads, or the
    source's degree does not divide them."""
    problem = row_join_problem(index, name)
    if problem is not None:
        raise UnsupportedCheckpointError(problem)
    heads = heads_from_args(namespace_state(index.ranks[0].model_states[0].get("args")), rows)
    check_degree(heads, index.tp)
    return heads


__all__ = ["BF16_ZERO0_LOAD", "FUSED_QKV", "FUSED_QKV_WHY", "POSITION_EMBEDDINGS", "TIED", "TIED_WHY",
           "TRANSFORMER_LAYER", "Split", "bf16_zero0", "declare_qkv_layout", "fused_heads", "fused_qkv", "layer_of",
           "position_note", "read_pipeline", "row_join_problem", "shard_shapes", "split_pieces", "splits_at",
           "tied_module", "transformer_layers", "vocabulary_rows"]
