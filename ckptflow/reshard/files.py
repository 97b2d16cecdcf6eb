"""The files DeepSpeed writes for one data-parallel rank, rebuilt for a new world size from a plan.

`optim_states` and `model_states` return the object trees of one target rank's optimizer file and
model-states file, ready for `formats.torch.writer.write_archive`: the source rank's plain data (as
`formats.torch.zipdir` read it) with every field that depends on the world size rewritten, tensors as
`OutTensor`s whose storages name the source byte ranges that fill them, and DeepSpeed's objects
(loss scaler, fragment addresses, ZeRO stage) as the pickle stand-ins `formats.torch.pickler` writes by name.

Which fields are rewritten, after DeepSpeed 0.19.8's `state_dict` methods and the engine's
`_save_checkpoint`:

- optimizer file, ZeRO-1/2 (`DeepSpeedZeroOptimizer`, `BF16_Optimizer`): the flat fp32 partitions
  (`single_partition_of_fp32_groups`, saved without tail padding by the former, whole by the latter),
  the base optimizer's moments over them, `group_paddings`, `param_alignment_paddings`,
  `partition_count`, `param_slice_mappings`;
- optimizer file, ZeRO-3: `fp32_flat_groups` (one per sub-group), the moments, the optimizer's
  param groups' flat ids, `partition_count`;
- model states: `dp_world_size`, `param_shapes` (one entry per flat), the ZeRO-1/2 16-bit module copy
  (one flat buffer per group at the new alignment), ZeRO-3 `frozen_param_fragments` pieces and
  `shared_params` (recorded by rank 0 only), and `train_batch_size` in `ds_config` (same per-rank
  batch at the new world size).
- optimizer shards (`readers.optimizer_shards`: `optimizer.state_dict()` saved with torch.save per rank):
  the optimizer file's `optimizer_state_dict` alone, under the source's file names, no model states;
- expert parallelism (AutoEP, deepspeed.moe): `partition_count` per group (the expert groups' is the
  expert data-parallel size M / N), ZeRO-3's `ds_zero_partition_groups` (each sub-group's partition
  count, rank and ranks; from ZeRO-1/2, each group's placement family as well), and in AutoEP model
  states `ds_autoep_layers` (and its copy in `universal_checkpoint_info`): each layer's
  `expert_data_parallel_rank` and `expert_data_parallel_world_size` (ZeRO-1/2 record rank 0's; ZeRO-3
  every rank its own, with its expert-parallel rank, experts and the `zero3_partitioned` format). The module
  of an expert-parallel save holds cloned tensors, copied as they are (from ZeRO-3: each its own
  storage, filled from the plan's `module_runs`; frozen records a copy of their own); DeepSpeed's MoE
  save clones the whole state, so its shapes are plain tuples, not `torch.Size`; the per-expert files
  are carried whole, or from ZeRO-3 written by `tensor_file` (`RankUnit.tensor_files`).

Everything else (scheduler, steps, samples, loss scaler, clip_grad, buffers, frozen ZeRO-1/2 tensors,
client state) is copied from the source rank the unit names as `meta_rank`: every key of the source's
model states DeepSpeed does not own (the trainer's `client_state`: Megatron-DeepSpeed's `args`,
Lightning's loops and callbacks) goes into every model-states file written, its objects written back
opcode for opcode as the source pickled them (`formats.torch.inert`), never loaded here.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from ckptflow.errors import CheckpointError, UnsupportedCheckpointError
from ckptflow.formats.deepspeed.client_state import namespace_state
from ckptflow.formats.deepspeed.model import Param, ZeroCheckpoint
from ckptflow.formats.deepspeed.names import FRAGMENT_ADDRESS, LOSS_SCALER, RECORDS, UC_INFO, ZERO_STAGE_ENUM
from ckptflow.formats.deepspeed.partition import BF16, ZERO, ZERO3, Copy, partition_ranks
from ckptflow.formats.deepspeed.readers.autoep import PER_EXPERT_FORMAT, ZERO3_FORMAT
from ckptflow.formats.deepspeed.runs import Run
from ckptflow.formats.torch.inert import InertRecord
from ckptflow.formats.torch.pickler import Call, Global, Instance, OutStorage, OutTensor, Rebuilt, Span
from ckptflow.formats.torch.tensorref import DTYPE_SIZES, TensorRef
from ckptflow.formats.torch.unpickler import PickledObject
from ckptflow.reshard.units import DataParallelPlan, ModelParallelPlan, RankUnit, ReshardPlan, TensorFile
from ckptflow.reshard.vocabulary import PADDED_VOCAB

# Where `_Tree.remap` sends a source tensor: (rebuilt storage, element offset, shape or None for the source's).
Remapped = tuple[OutStorage, int, tuple[int, ...] | None]


class _Tree:
    """Turns the reader's plain data back into picklable objects for one output file.

    Tensors are copied verbatim (storages shared as in the source), except those `remap` sends into
    a rebuilt storage; DeepSpeed's records become DeepSpeed objects again, and a client state's inert
    records the same opcodes that made them (`pickler.Rebuilt`). An object the source
    shares (the reader keeps shared references shared) is converted once and stays shared, so a
    pickle of shared references ("billion laughs") is never expanded here.
    """

    def __init__(self, remap: Mapping[tuple[str, str, int], Remapped] | None = None) -> None:
        self.storages: dict[tuple[str, str], OutStorage] = {}
        self.remap = dict(remap or {})
        self.remapped_keys = {(uri, key) for uri, key, _ in self.remap}
        self._converted: dict[int, tuple[Any, Any]] = {}  # id(source object) -> (source object, converted)
        self._written_as: dict[int, tuple[Any, Any]] = {}  # id(source object) -> (source object, what is written)

    def write_as(self, source: Any, new: Any) -> None:
        """Write `new` wherever the tree holds `source` (a record the file rewrites, as `args_at` does), `new`'s
        own contents included: a record that held itself holds `new`, shared and cycles kept as they were.
        Before any `convert` of this tree, so that no reference to `source` is written as it was."""
        assert not self._converted, "write_as after convert"
        self._written_as[id(source)] = (source, new)

    def tensor(self, ref: TensorRef) -> OutTensor:
        hit = self.remap.get((ref.uri, ref.key, ref.storage_offset))
        if hit is not None:
            storage, offset, shape = hit
            return OutTensor(storage, offset, shape if shape is not None else ref.shape)
        if (ref.uri, ref.key) in self.remapped_keys:
            raise CheckpointError(f"{ref.uri}: a module tensor views a flattened param group at element "
                                  f"{ref.storage_offset}, where no parameter starts", file=ref.uri)
        saved = self.storages.get((ref.uri, ref.key))
        if saved is None:
            nbytes = ref.storage_numel * ref.itemsize
            spans = [Span(ref.uri, ref.data_offset, nbytes, 0)] if nbytes else []
            saved = OutStorage(ref.dtype, ref.storage_numel, spans)
            self.storages[(ref.uri, ref.key)] = saved
        return OutTensor(saved, ref.storage_offset, ref.shape, ref.stride)

    def convert(self, obj: Any) -> Any:
        """`obj` as the pickler writes it. What exists before its contents in a pickle (a list, dict, set,
        record, DeepSpeed object) is made empty and remembered before them, so that what refers back to
        it (a client state's cycle) gets it; a tuple or frozenset is made of its converted items, unless
        converting them made it already (it is in a cycle)."""
        try:
            return self._convert(obj)
        except RecursionError:  # a cycle walked another way round than the reader measured it: a long path
            raise CheckpointError("cannot write back a client state whose references lead more than Python's "
                                  "recursion limit deep") from None

    def _convert(self, obj: Any) -> Any:
        if not isinstance(obj, (TensorRef, PickledObject, InertRecord, dict, list, tuple, set, frozenset)):
            return obj  # plain data, and the torch dtypes and devices the pickler names again
        swap = self._written_as.get(id(obj))
        if swap is not None and swap[0] is obj:
            obj = swap[1]
        seen = self._converted.get(id(obj))
        if seen is not None and seen[0] is obj:
            return seen[1]
        if isinstance(obj, TensorRef):
            return self._keep(obj, self.tensor(obj))
        if isinstance(obj, PickledObject):
            return _deepspeed_object(obj, self)
        if isinstance(obj, InertRecord):  # a client state's object, written back as its pickle made it
            out = self._keep(obj, Rebuilt(Global(obj.module, obj.name), obj.how))
            out.args, out.kwargs = self._convert(obj.args), self._convert(obj.kwargs)
            out.ops = tuple((kind, self._convert(items)) for kind, items in obj.ops)
        elif isinstance(obj, dict):
            out = self._keep(obj, OrderedDict() if isinstance(obj, OrderedDict) else {})
            for k, v in obj.items():
                out[self._convert(k)] = self._convert(v)
        elif isinstance(obj, list):
            out = self._keep(obj, [])
            out.extend(self._convert(v) for v in obj)
        elif isinstance(obj, set):
            out = self._keep(obj, set())
            out.update(self._convert(v) for v in obj)
        else:
            items = [self._convert(v) for v in obj]
            seen = self._converted.get(id(obj))
            if seen is not None and seen[0] is obj:
                return seen[1]
            out = self._keep(obj, frozenset(items) if isinstance(obj, frozenset) else tuple(items))
        return out

    def _keep(self, obj: Any, out: Any) -> Any:
        """Remember `out` as the conversion of `obj` (kept alive with it: its id is not reused)."""
        self._converted[id(obj)] = (obj, out)
        return out


def _global(qualname: str) -> Global:
    module, _, name = qualname.rpartition(".")
    return Global(module, name)


def _deepspeed_object(record: PickledObject, tree: _Tree) -> Instance:
    """The DeepSpeed object `record` stands for, written back the way pickle wrote it (made, and kept by
    `tree`, before its state and arguments, which may refer back to it)."""
    if record.qualname not in RECORDS:
        raise CheckpointError(f"cannot write a {record.qualname} back")
    out: Instance = tree._keep(record, Instance(_global(record.qualname), None))
    state = record.state
    if isinstance(state, dict):
        # The reader keeps torch dtypes (DynamicLossScaler.dtype) as their names.
        state = {k: Global("torch", v) if k == "dtype" and isinstance(v, str) and v in DTYPE_SIZES else tree.convert(v)
                 for k, v in state.items()}
    else:
        state = tree.convert(state)
    out.state, out.args = state, tree.convert(record.args)
    return out


def _zero_stage(value: int) -> Call:
    return Call(_global(ZERO_STAGE_ENUM), (int(value),))


def _fragment_address(start: int, numel: int) -> Instance:
    return Instance(_global(FRAGMENT_ADDRESS), {"numel": numel, "start": start})


def _torch_size(shape: Sequence[int]) -> Call:
    return Call(Global("torch", "Size"), (tuple(int(d) for d in shape),))


def _gathered(numel: int, copies: Sequence[Copy], refs: Callable[[int, int], TensorRef], dtype: str) -> OutStorage:
    """A storage of `numel` elements filled by `copies` from source tensors `refs(rank, flat)`."""
    size = DTYPE_SIZES[dtype]
    spans = []
    for c in copies:
        ref = refs(c.src_rank, c.src_flat)
        if ref.dtype != dtype or c.src_offset + c.numel > ref.numel:
            raise CheckpointError(f"{ref.uri}: a partition holds {ref.numel} {ref.dtype} elements, too few for the "
                                  f"layout ({c.src_offset}+{c.numel} {dtype})", file=ref.uri, rank=c.src_rank)
        start, end = ref.element_range(c.src_offset, c.numel)
        spans.append(Span(ref.uri, start, end - start, c.dst_offset * size, c.rows, c.stride * size))
    return OutStorage(dtype, numel, spans)


def _target_config(config: Any, src_ws: int, dst_ws: int, stage: int | None = None) -> Any:
    """The ds_config as the run at the new world size records it: same per-rank batch; the new ZeRO
    `stage` when it changes."""
    if not isinstance(config, dict):
        return config
    out = copy.deepcopy(config)
    zero = out.get("zero_optimization")
    if stage is not None and isinstance(zero, dict) and zero.get("stage") != stage:
        zero["stage"] = stage
    tbs = out.get("train_batch_size")
    if isinstance(tbs, int) and not isinstance(tbs, bool) and tbs % src_ws == 0:
        out["train_batch_size"] = tbs // src_ws * dst_ws
    return out


def _base_state(plan: DataParallelPlan, rank: int) -> Mapping[str, Any]:
    osd = plan.index.optim_states[rank]["optimizer_state_dict"]
    key = "optimizer_state_dict" if plan.src_optimizer == ZERO3 else "base_optimizer_state"
    base: Mapping[str, Any] = osd[key]
    return base


def _partition_tensor(index: ZeroCheckpoint, moment: str | None = None) -> Callable[[int, int], TensorRef]:
    """Source rank r's fp32 partition of flat f (`moment` None), or the optimizer moment over it."""
    def ref(rank: int, flat: int) -> TensorRef:
        part = index.partitions[rank][flat]
        return part.fp32 if moment is None else part.state[moment]
    return ref


def _frozen_piece(param: Param) -> Callable[[int, int], TensorRef]:
    """Source rank r's saved piece of the frozen ZeRO-3 parameter `param`."""
    return lambda rank, _flat: param.frozen_pieces[rank]


def _flat_states(plan: DataParallelPlan, unit: RankUnit, tree: _Tree
                 ) -> tuple[list[OutTensor], dict[int, dict[str, Any]]]:
    """The unit's fp32 flat partitions and the base optimizer's state for each, both resharded."""
    ix = plan.index
    meta_state = _base_state(plan, unit.meta_rank).get("state") or {}
    fp32, states = [], {}
    for i, flat in enumerate(unit.flats):
        storage = _gathered(flat.numel, flat.copies, _partition_tensor(ix), "float32")
        fp32.append(OutTensor(storage, 0, (flat.saved,)))
        if flat.group not in meta_state:  # the optimizer has not stepped: no state, as in the source
            continue
        part = ix.partitions[unit.meta_rank][ix.groups[flat.group].index]  # the source group the state is from
        state = {}
        for key, value in meta_state[flat.group].items():
            if part.is_moment(value):
                state[key] = OutTensor(_gathered(flat.numel, flat.copies, _partition_tensor(ix, key), value.dtype))
            else:
                state[key] = tree.convert(value)
        states[i] = state
    return fp32, states


def optim_states(whole: ReshardPlan, unit: RankUnit) -> dict[str, Any]:
    """The object tree of target rank `unit.rank`'s optimizer file, ready for `write_archive`."""
    plan = whole.part(unit)  # of a model-parallel plan, the data-parallel plan of the unit's mp rank
    ix = plan.index
    source = ix.optim_states[unit.meta_rank]
    osd = source["optimizer_state_dict"]
    tree = _Tree()
    fp32, states = _flat_states(plan, unit, tree)
    n_groups = len(ix.groups)
    out: dict[str, Any] = {}
    if plan.src_optimizer != plan.optimizer:  # a stage change: the target optimizer's own fields, in its order
        osd = _other_optimizer(plan, osd, source)
    for key, value in osd.items():
        if key in ("base_optimizer_state", "optimizer_state_dict") and isinstance(value, Mapping):
            groups = []
            for g, group in enumerate(value.get("param_groups") or []):
                params = [i for i, f in enumerate(unit.flats) if f.group == g]
                groups.append({k: (params if k == "params" else tree.convert(v)) for k, v in group.items()})
            out[key] = {"state": states, "param_groups": groups}
        elif key in ("single_partition_of_fp32_groups", "fp32_flat_groups"):
            out[key] = fp32
        elif key == "group_paddings":
            out[key] = list(unit.group_paddings)
        elif key == "param_alignment_paddings":
            out[key] = [list(p) for p in plan.param_alignment_paddings]
        elif key == "partition_count":
            out[key] = plan.world_size if plan.optimizer == ZERO3 else [plan.world_size // plan.ep(g)
                                                                        for g in range(n_groups)]
        elif key == "ds_zero_partition_groups" and isinstance(value, list):
            out[key] = _partition_groups(plan, unit, value)
        elif key == "param_slice_mappings":
            out[key] = [OrderedDict((n, _fragment_address(s, k)) for n, s, k in group) for group in unit.slice_mappings]
        elif key == "zero_stage":
            out[key] = _zero_stage(plan.stage)
        else:
            out[key] = tree.convert(value)
    if (plan.optimizer == ZERO and "param_alignment_paddings" not in out
            and any(map(any, plan.param_alignment_paddings))):
        out["param_alignment_paddings"] = [list(p) for p in plan.param_alignment_paddings]
    if ix.kind == "optimizer-shards":  # a torch.save'd `optimizer.state_dict()`: the optimizer's dict alone
        return out
    top: dict[str, Any] = {}
    for key, value in source.items():
        if key == "optimizer_state_dict":
            top[key] = out
        elif key == "ds_config":
            top[key] = _target_config(value, plan.source_world_size, plan.world_size, plan.stage)
        else:
            top[key] = tree.convert(value)
    return top


# What `state_dict()` of each ZeRO optimizer holds, in its order (DeepSpeed 0.19.8), for a stage change.
_ZERO12_KEYS = ("loss_scaler", "dynamic_loss_scale", "overflow", "clip_grad", "base_optimizer_state",
                "single_partition_of_fp32_groups", "zero_stage", "group_paddings", "param_alignment_paddings",
                "partition_count", "ds_version", "param_slice_mappings")
_ZERO3_KEYS = ("zero_stage", "loss_scaler", "dynamic_loss_scale", "overflow", "partition_count",
               "ds_zero_partition_groups", "optimizer_state_dict", "fp32_flat_groups")
_BF16_KEYS = ("clip_grad", "base_optimizer_state", "single_partition_of_fp32_groups", "group_paddings",
              "partition_count", "ds_version", "param_slice_mappings", UC_INFO)  # AutoTP's split info, if any
_KEYS = {ZERO: _ZERO12_KEYS, ZERO3: _ZERO3_KEYS, BF16: _BF16_KEYS}


def _other_optimizer(plan: DataParallelPlan, osd: Mapping[str, Any], source: Mapping[str, Any]) -> dict[str, Any]:
    """The source optimizer's state dict re-keyed as the target stage's optimizer saves it (`_KEYS`;
    BF16_Optimizer's holds no loss scaler and no ZeRO stage): the loss scaler's fields carried (an fp16
    ZeRO-0 source's FP16_Optimizer scale among them, which `stage.zero0_source` puts there; a static
    scale of 1 where the source keeps none: BF16_Optimizer, ZeRO-0 in fp32 or bf16), the base state
    under its new key, placeholders for what `optim_states` rewrites anyway; `clip_grad` (which ZeRO-3
    does not save) from the recorded `gradient_clipping`."""
    base = osd.get("optimizer_state_dict" if plan.src_optimizer == ZERO3 else "base_optimizer_state")
    keys = _KEYS[plan.optimizer]
    config = source.get("ds_config")
    clip = config.get("gradient_clipping", 0.0) if isinstance(config, Mapping) else 0.0
    carried = {"clip_grad": osd.get("clip_grad", clip), "ds_version": osd.get("ds_version", source.get("ds_version")),
               # BF16_Optimizer and fp32/bf16 ZeRO-0 keep none: what DeepSpeed's ZeRO optimizers build without fp16
               "loss_scaler": PickledObject(LOSS_SCALER, (), {"cur_scale": 1.0, "dynamic": False}),
               "dynamic_loss_scale": False, "overflow": False}
    out: dict[str, Any] = {}
    for key in keys:
        if key in ("base_optimizer_state", "optimizer_state_dict"):
            out[key] = base
        elif key in osd:
            out[key] = osd[key]
        elif key == UC_INFO:  # saved by AutoTP runs only
            continue
        elif key == "ds_zero_partition_groups":
            if "ds_autoep_layers" in plan.index.model_states[0]:  # DeepSpeed records them with AutoEP experts only
                out[key] = _placement_families(plan)
        else:
            out[key] = carried.get(key)
    return out


def _placement_families(plan: DataParallelPlan) -> list[dict[str, Any]]:
    """Per param group, the ZeRO-3 placement family and partition group name of its parameters (AutoEP's
    experts `autoep_expert` over their `ep_size_N` group, the rest `replicated`): what
    `_partition_groups` completes into `ds_zero_partition_groups`, in DeepSpeed's key order."""
    out = []
    for group in plan.index.groups:
        expert = group.ep > 1 or bool(group.hyper.get("moe"))
        name = str(group.hyper.get("name", f"ep_size_{group.ep}")) if expert else "replicated"
        out.append({"sub_group": None, "partition_count": None, "partition_rank": None, "partition_ranks": None,
                    "families": ["autoep_expert" if expert else "replicated"], "group_names": [name]})
    return out


def model_states(whole: ReshardPlan, unit: RankUnit) -> dict[str, Any]:
    """The object tree of target rank `unit.rank`'s model-states file, ready for `write_archive`.

    A PipelineModule saves no `module` there (its weights are in the layer files): nothing to remap."""
    plan = whole.part(unit)  # of a model-parallel plan, the data-parallel plan of the unit's mp rank
    ix = plan.index
    source = ix.model_states[unit.meta_rank if ix.stage == 3 else 0]
    module = source.get("module")
    tree = _Tree(_module_remap(plan, module) if plan.stage != 3 and module is not None else None)
    frozen = _whole_frozen(plan, unit) if plan.stage != 3 and ix.stage == 3 else {}
    moe = _is_moe_save(ix)
    # A MoE save clones every tensor on its own (`clone_tensors_for_torch_save`): the frozen records hold
    # copies of their own, not the module's storages.
    frozen_records = _whole_frozen(plan, unit) if frozen and moe else frozen
    shape = _plain_shape if moe else _torch_size
    args = source.get("args")
    if whole.shape is not None and args is not None:  # the shape's fields set, wherever the file holds `args`
        padded = whole.padded_vocab if isinstance(whole, ModelParallelPlan) else None
        tree.write_as(args, args_at(args, whole.shape, padded_vocab=padded))
    out: dict[str, Any] = {}
    for key, value in source.items():
        if key == "param_shapes":
            out[key] = [OrderedDict((n, shape(s)) for n, s in flat) for flat in plan.flat_shapes]
        elif key in ("frozen_param_shapes", "frozen_param_fragments") and plan.stage == 1:
            out[key] = None  # DeepSpeed saves them from ZeRO-2 on (`save_frozen_param`)
        elif key in ("frozen_param_shapes", "frozen_param_fragments") and value is None and plan.stage == 2:
            out[key] = _frozen_at_zero2(ix, key, module, tree)
        elif key == "frozen_param_shapes" and isinstance(value, Mapping):
            out[key] = OrderedDict((n, shape(s)) for n, s in value.items())
        elif key == "frozen_param_shapes" and plan.stage == 3:  # a ZeRO-1 source records none
            out[key] = OrderedDict((p.name, shape(p.shape)) for p in ix.params if p.frozen)
        elif key == "frozen_param_fragments" and plan.stage == 3:
            out[key] = _frozen_fragments(plan, unit, value if isinstance(value, Mapping) else
                                         {p.name: None for p in unit.frozen})
        elif key == "frozen_param_fragments" and frozen:  # ZeRO-3 -> 1/2: the whole tensors, as in the module
            out[key] = OrderedDict((n, frozen_records[n]) for n in (value if isinstance(value, Mapping) else frozen))
        elif key == "module" and isinstance(value, Mapping) and plan.stage != ix.stage:
            out[key] = _module_at_stage(plan, value, tree, frozen)
        elif key == "shared_params" and plan.stage == 3:  # DeepSpeed fills it on global rank 0 only
            shared = ix.model_states[0].get(key)
            empty = type(shared)() if isinstance(shared, dict) else shared
            out[key] = tree.convert(shared) if unit.rank == 0 else empty
        elif key == "dp_world_size":
            out[key] = plan.world_size
        elif key == "ds_autoep_layers" and isinstance(value, list):
            out[key] = _autoep_layers(plan, unit, value)
        elif key == UC_INFO and isinstance(value, Mapping) and isinstance(
                value.get("ds_autoep_layers"), list):
            out[key] = {k: _autoep_layers(plan, unit, v) if k == "ds_autoep_layers" else tree.convert(v)
                        for k, v in value.items()}
        elif key == "ds_config":
            out[key] = _target_config(value, plan.source_world_size, plan.world_size, plan.stage)
        else:
            out[key] = tree.convert(value)
    return out


# Megatron-DeepSpeed keeps its command line, `args` (an `argparse.Namespace`), in every model-states file,
# and its loader compares the tensor- and pipeline-parallel sizes there with its own run's
# (`checkpointing.check_checkpoint_args`): at another shape, the fields that say the shape say the target's.
# `padded_vocab_size` is not the shape's: it says the target's where a Megatron-style tensor-parallel change
# pads the vocabulary again (`reshard.vocabulary`), as Megatron at the target computes it.
# Every other field (batch sizes, samples consumed, paths...) is the training's, carried as it is.
ARGS_SHAPE = {"tensor_model_parallel_size": "tp", "pipeline_model_parallel_size": "pp", "data_parallel_size": "dp",
              "world_size": "world_size", "zero_stage": "stage"}


def args_at(value: Any, shape: Any, *, padded_vocab: int | None = None) -> Any:
    """`value`, when it is an `argparse.Namespace` record whose state holds the `ARGS_SHAPE` fields as
    ints, with those fields set to `shape`'s, and `padded_vocab_size` (an int there too) to `padded_vocab`
    when given; else `value` itself. The new record's state holds what `value`'s held, `value` too where
    it held itself: `_Tree.write_as` writes the new record in its place."""
    state = namespace_state(value)
    if state is None:
        return value
    moved = {k: getattr(shape, ARGS_SHAPE[k]) for k, v in state.items() if k in ARGS_SHAPE and type(v) is int}
    if padded_vocab is not None and type(state.get(PADDED_VOCAB)) is int:
        moved[PADDED_VOCAB] = padded_vocab
    if all(state[k] == v for k, v in moved.items()):
        return value
    last = max(i for i, (kind, _) in enumerate(value.ops) if kind == "build")
    ops = tuple(("build", {**state, **moved}) if i == last else op for i, op in enumerate(value.ops))
    return replace(value, ops=ops)


def _is_moe_save(ix: Any) -> bool:
    """Whether DeepSpeed saves this checkpoint's model states through its MoE path (AutoEP,
    deepspeed.moe: `num_experts` recorded), which clones the whole state before saving: every tensor
    its own storage, and every `torch.Size` (a tuple) a plain tuple."""
    return "num_experts" in ix.model_states[0]


def _plain_shape(shape: Sequence[int]) -> tuple[int, ...]:
    return tuple(int(d) for d in shape)


def _frozen_at_zero2(ix: Any, key: str, module: Any, tree: _Tree) -> OrderedDict[str, Any]:
    """ZeRO-1 -> ZeRO-2: what a ZeRO-1 source records as None, as ZeRO-2 saves it: each frozen
    parameter's shape, or (`frozen_param_fragments`) its whole tensor, the module's."""
    frozen = [p for p in ix.params if p.frozen]
    if key == "frozen_param_shapes":
        shape = _plain_shape if _is_moe_save(ix) else _torch_size
        return OrderedDict((p.name, shape(p.shape)) for p in frozen)
    return OrderedDict((p.name, tree.convert(module[p.name])) for p in frozen)


def _whole_frozen(plan: DataParallelPlan, unit: RankUnit) -> dict[str, OutTensor]:
    """ZeRO-3 -> 1/2: each frozen parameter whole, joined from the source ranks' pieces (rank 0's unit)."""
    by_name = plan.index.param_by_name
    out = {}
    for piece in unit.frozen:
        param = by_name[piece.name]
        dtype = param.frozen_pieces[0].dtype
        out[piece.name] = OutTensor(_gathered(piece.numel, piece.copies, _frozen_piece(param), dtype), 0, param.shape)
    return out


def _module_at_stage(plan: DataParallelPlan, module: Mapping[str, Any], tree: _Tree,
                     frozen: Mapping[str, OutTensor]) -> OrderedDict[str, Any]:
    """The module state dict at another ZeRO stage. To ZeRO-3: buffers as they are, every parameter
    (frozen and tied aliases too) an empty tensor of its dtype, as ZeRO-3 saves them. To ZeRO-1/2: the
    trainable parameters as views of the rebuilt 16-bit flat groups (`_module_remap`, through `tree`),
    tied aliases the same views as their owners, frozen parameters whole."""
    ix = plan.index
    buffers = {b.name for b in ix.buffers}
    out: OrderedDict[str, Any] = OrderedDict()
    for name, ref in module.items():
        if name in buffers or not isinstance(ref, TensorRef):
            out[name] = tree.convert(ref)
        elif plan.stage == 3:
            out[name] = OutTensor(OutStorage(ref.dtype, 0, []), 0, (0,))
        elif name in frozen:
            out[name] = frozen[name]
        elif not plan.module and name in plan.module_runs:  # an expert-parallel save: each tensor its own clone
            out[name] = _from_runs(plan.module_runs[name], ix.param_by_name[ix.tied.get(name, name)].shape)
        else:
            owner = ix.tied.get(name, name)
            out[name] = tree.convert(module.get(owner, ref))
    return out


def _partition_groups(plan: DataParallelPlan, unit: RankUnit, source: Sequence[Any]) -> list[dict[str, Any]]:
    """ZeRO-3 `ds_zero_partition_groups` of the target rank: one entry per flat (sub-group), over the
    ranks its param group is partitioned over at the new world size (`stage3._zero3_partition_group_metadata`).
    Families and group names are the source's for the same param group."""
    by_group = {g: source[g] for g in range(len(source))}
    out = []
    for i, flat in enumerate(unit.flats):
        entry = by_group.get(flat.group)
        if not isinstance(entry, Mapping):
            raise CheckpointError(f"{plan.index.files[unit.meta_rank].optim}: ds_zero_partition_groups has no entry "
                                  f"for param group {flat.group}", file=plan.index.files[unit.meta_rank].optim)
        ep = plan.ep(flat.group)
        ranks = list(partition_ranks(plan.world_size, ep, unit.rank % ep))
        out.append({**copy.deepcopy(dict(entry)), "sub_group": i, "partition_count": len(ranks),
                    "partition_rank": ranks.index(unit.rank), "partition_ranks": ranks})
    return out


def _autoep_layers(plan: DataParallelPlan, unit: RankUnit, source: Sequence[Any]) -> list[Any]:
    """`ds_autoep_layers` as the writing rank records it at the new world size: the meta rank's entries
    (the same expert-parallel rank) with that rank's expert data-parallel rank and size. ZeRO-1/2 keep
    rank 0's, as DeepSpeed writes the file from rank 0. At ZeRO-3 every rank records its own
    expert-parallel rank and experts (`ep_rank * num_local_experts` on, as `engine._save_checkpoint`
    computes them) and the `zero3_partitioned` format, whichever stage the source was saved at."""
    out = []
    for entry in source:
        entry = copy.deepcopy(entry)
        if isinstance(entry, dict) and isinstance(entry.get("ep_size"), int) and entry["ep_size"] > 0:
            ep = entry["ep_size"]
            entry["expert_data_parallel_rank"] = unit.rank // ep
            entry["expert_data_parallel_world_size"] = plan.world_size // ep
            local = entry.get("num_local_experts")
            if plan.stage == 3 and isinstance(local, int):
                entry.update(checkpoint_format=ZERO3_FORMAT[0], checkpoint_format_version=ZERO3_FORMAT[1],
                             ep_rank=unit.rank % ep, global_expert_start=unit.rank % ep * local,
                             global_expert_end=(unit.rank % ep + 1) * local)
            elif "checkpoint_format" in entry:
                entry.update(checkpoint_format=PER_EXPERT_FORMAT[0], checkpoint_format_version=PER_EXPERT_FORMAT[1])
        out.append(entry)
    return out


def _module_remap(plan: DataParallelPlan, module: Mapping[str, Any]
                  ) -> dict[tuple[str, str, int], tuple[OutStorage, int, tuple[int, ...] | None]]:
    """ZeRO-1/2 module tensors of trainable parameters view one flat 16-bit buffer per param group;
    rebuild each buffer at the new world size and send every view (tied aliases too) into it. A
    parameter in `plan.module_runs` is filled from those runs and viewed in its full shape."""
    remap: dict[tuple[str, str, int], tuple[OutStorage, int, tuple[int, ...] | None]] = {}
    for flat_numel, offsets in plan.module:
        spans: list[Span] = []
        dtype = None
        placed = []
        for name, offset in offsets:
            ref = module.get(name)
            param = plan.index.param_by_name[name]
            runs = plan.module_runs.get(name)
            if not isinstance(ref, TensorRef) or not ref.is_contiguous or (runs is None and ref.numel != param.numel):
                raise CheckpointError(f"{plan.index.model_file()}: module tensor {name} is missing or not a contiguous "
                                      "view of its parameter", file=plan.index.model_file(), tensor=name)
            dtype = dtype or ref.dtype
            if ref.dtype != dtype or any(r.ref.dtype != dtype for r in runs or ()):
                raise UnsupportedCheckpointError(f"param group holding {name} mixes dtypes {dtype} and {ref.dtype}",
                                                 tensor=name)
            size = ref.itemsize
            pieces = ([(r.ref.uri, *r.byte_range, (offset + r.offset) * size, r.rows, r.stride * size) for r in runs]
                      if runs is not None else [(ref.uri, *ref.byte_range, offset * size, 1, 0)])
            for uri, start, end, dst, rows, stride in pieces:
                last = spans[-1] if spans else None
                if rows == 1 and last is not None and last.rows == 1 and last.uri == uri and \
                        last.start + last.length == start and last.dst + last.length == dst:
                    spans[-1] = Span(last.uri, last.start, last.length + end - start, last.dst)
                else:
                    spans.append(Span(uri, start, end - start, dst, rows, stride))
            placed.append((ref, offset, param.shape if runs is not None else None))
        if dtype is None:
            continue
        storage = OutStorage(dtype, flat_numel, spans)
        for ref, offset, shape in placed:
            remap[(ref.uri, ref.key, ref.storage_offset)] = (storage, offset, shape)
    return remap


def _from_runs(runs: Sequence[Run], shape: tuple[int, ...]) -> OutTensor:
    """A tensor of its own storage, `shape`, filled by `runs` (all of one dtype, the tensor's)."""
    dtype = runs[0].ref.dtype
    size = DTYPE_SIZES[dtype]
    spans = [Span(r.ref.uri, *_span(r.byte_range), r.offset * size, r.rows, r.stride * size) for r in runs]
    numel = 1
    for d in shape:
        numel *= d
    return OutTensor(OutStorage(dtype, numel, spans), 0, shape)


def _span(byte_range: tuple[int, int]) -> tuple[int, int]:
    start, end = byte_range
    return start, end - start


def tensor_file(tensors: TensorFile) -> dict[str, OutTensor]:
    """The object tree of a file of whole tensors (`units.TensorFile`), ready for `write_archive`."""
    return {key: _from_runs(runs, shape) for key, shape, runs in tensors.tensors}


def _frozen_fragments(plan: DataParallelPlan, unit: RankUnit, source: Mapping[str, Any]) -> OrderedDict[str, OutTensor]:
    by_name = plan.index.param_by_name
    pieces = {p.name: p for p in unit.frozen}
    out: OrderedDict[str, OutTensor] = OrderedDict()
    for name in source:
        param = by_name[name]
        piece = pieces[name]
        dtype = param.frozen_pieces[0].dtype
        out[name] = OutTensor(_gathered(piece.numel, piece.copies, _frozen_piece(param), dtype))
    return out


__all__ = ["model_states", "optim_states", "tensor_file"]
