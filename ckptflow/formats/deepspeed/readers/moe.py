"""deepspeed.moe checkpoints (`deepspeed.moe.layer.MoE(..., ep_size=N)` in a plain module) read into the
model's tensors under the module's names with **global** expert ids: the names of the same model at
`ep_size=1` (`tests/fixtures/PARALLEL_LAYOUTS.md`, section 5).

- ZeRO-1/2: `mp_rank_00_model_states.pt` (dense module weights), optimizer files per rank whose expert
  groups (`ep_size_N`, possibly two of that name: weights and biases) hold the experts of the rank's
  expert-parallel rank under **local** ids, partitioned over its expert data-parallel group (`index`),
  and `layer_{L}_expert_{E}` files (module-dtype weights, global ids).
- ZeRO-0: `module` holds the dense weights (fp32: the masters; bf16, fp16: their copies rounded), the
  expert files the experts, and `expp_rank_{e}` the whole optimizer of expert-parallel rank e (indices, no
  names; in bf16 and fp16 FP16_Optimizer's, the base optimizer's state inside `optimizer_state_dict` and
  one flat fp32 master per group, in fp16 with its loss scale; a reshard names it: `zero0_index`).

Nothing records the placement but the group names, `num_experts` and DeepSpeed's default topology:
local expert i of expert-parallel rank e in MoE layer L is global expert `e * num_experts[L] / N + i`,
and MoE layer L is the L-th `deepspeed_moe` module in module order (the order `save_checkpoint`
numbers them in); every expert file is opened to check that.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from ckptflow.formats.deepspeed.config import precision_of
from ckptflow.formats.deepspeed.inspection import Inspection, Listing
from ckptflow.formats.deepspeed.model import (
    Buffer,
    Fragment,
    ModelTensor,
    Param,
    ParamGroup,
    Partition,
    RankFiles,
    ZeroCheckpoint,
)
from ckptflow.formats.deepspeed.names import (
    EXPERT_FILE_RE,
    EXPP_FILE_RE,
    expert_file_name,
    expert_group_degree,
    expp_file_name,
    model_file_name,
)
from ckptflow.formats.deepspeed.readers.experts import (
    ExpertCheckpoint,
    check_expert_file,
    check_expert_files,
    open_files,
    ordered,
)
from ckptflow.formats.deepspeed.readers.zero import read_zero
from ckptflow.formats.deepspeed.readers.zero0 import Zero0Checkpoint, Zero0Group, named_groups, saved_loss_scaler
from ckptflow.formats.deepspeed.runs import whole_run
from ckptflow.formats.deepspeed.topology import Topology
from ckptflow.formats.torch.tensorref import TensorRef
from ckptflow.plumbing.sizes import element_count
from ckptflow.plumbing.storage import join

GATE_RE = re.compile(r"^(?P<layer>.+)\.deepspeed_moe\.gate\.wg\.weight$")  # one per MoE layer, in module order
EXPERT_RE = re.compile(r"^(?P<layer>.+)\.deepspeed_moe\.experts\.deepspeed_experts\.(?P<id>\d+)\.(?P<rest>.+)$")


def read_moe(st: Inspection, listing: Listing, model0: dict[str, Any], topology: Topology) -> ExpertCheckpoint:
    """The index of a deepspeed.moe checkpoint (ZeRO-0, or ZeRO-1/2), checked cheapest first."""
    uri = listing.model0_uri
    _check_topology(st, model0, uri)
    layers = _moe_layers(st, model0, uri)
    experts = _num_experts(st, model0, uri, len(layers))
    st.stop_if_any()
    if topology.stage == 0:
        return _read_zero0(st, listing, model0, layers, experts)
    expected = check_expert_files(st, listing, experts, "deepspeed.moe saves one file per MoE layer and global expert")
    for name in listing.names:
        if EXPP_FILE_RE.match(name):
            st.add("rank-extra", f"unexpected file {st.tag}/{name}: only ZeRO-0 saves expp_rank files and this "
                   "checkpoint has ZeRO optimizer files; it is left over from another save into the same tag folder",
                   file=join(listing.tag_uri, name))
    st.stop_if_any()
    zero = read_zero(st, listing, model0)
    if zero.stage == 3:  # DeepSpeed refuses deepspeed.moe at ZeRO-3; a folder saying so is not one save
        st.add("unsupported-layout", f"{listing.tag_uri} holds deepspeed.moe layers in a ZeRO-3 checkpoint, which "
               "DeepSpeed does not write", file=uri)
    st.stop_if_any()
    files = open_files(st, listing.tag_uri, expected, _expert_label)
    tensors = _zero_tensors(st, zero, layers, experts, files, listing.tag_uri)
    st.stop_if_any()
    return ExpertCheckpoint(
        root=zero.root, tag=zero.tag, kind="moe", stage=zero.stage, world_size=zero.world_size,
        ep=max(g.ep for g in zero.groups), precision=zero.precision, step=zero.step, ds_version=zero.ds_version,
        tensors=tensors, tied=dict(zero.tied), zero=zero, expert_files=tuple(expected), experts=sum(experts),
    )


# ---- metadata -----------------------------------------------------------------------------------------


def _check_topology(st: Inspection, model0: Mapping[str, Any], uri: str) -> None:
    config = model0.get("ds_config") or {}
    if isinstance(config, Mapping) and config.get("use_data_before_expert_parallelism"):
        st.add("unsupported-layout", f"{uri} was trained with use_data_before_expert_parallelism, which puts "
               "expert-parallel ranks on strided ranks; deepspeed.moe files record no placement, and ckptflow reads "
               "DeepSpeed's default topology only, so it cannot tell which rank's experts are which", file=uri)
    if (model0.get("mp_world_size") or 1) != 1:
        st.add("unsupported-layout", f"{uri} combines deepspeed.moe with model parallelism (mp_world_size "
               f"{model0.get('mp_world_size')}), which ckptflow does not read", file=uri)


def _moe_layers(st: Inspection, model0: Mapping[str, Any], uri: str) -> list[str]:
    """The module paths of the MoE layers, in module order: layer L is the L-th gate."""
    module = model0.get("module")
    if not isinstance(module, Mapping):
        st.add("corrupt-file", f"{uri} holds no module state dict; it is not deepspeed.moe model states", file=uri)
        return []
    layers = [m.group("layer") for name in module if (m := GATE_RE.match(name))]
    if not layers:
        st.add("unsupported-layout", f"{uri} records num_experts but its module has no deepspeed.moe gate "
               "(`<layer>.deepspeed_moe.gate.wg.weight`); ckptflow cannot tell which MoE layer is which", file=uri)
    return layers


def _num_experts(st: Inspection, model0: Mapping[str, Any], uri: str, layers: int) -> list[int]:
    experts = model0.get("num_experts")
    if not isinstance(experts, list) or len(experts) != layers or not all(
            isinstance(n, int) and n > 0 for n in experts):
        st.add("corrupt-file", f"{uri} records num_experts {experts!r} for {layers} deepspeed.moe layers (one count "
               "per layer expected); the file is damaged", file=uri)
        return []
    return experts


def _expert_label(name: str) -> str:
    m = EXPERT_FILE_RE.match(name)
    return f"expert {m.group(2)} of MoE layer {m.group(1)}" if m else name


def _file_tensors(st: Inspection, files: Mapping[str, Mapping[str, Any]], tag_uri: str, layers: Sequence[str],
                  experts: Sequence[int]) -> dict[tuple[int, int], dict[str, TensorRef]]:
    """Each expert file's tensors by (layer, expert), which must all be that expert's, under its global id."""
    out: dict[tuple[int, int], dict[str, TensorRef]] = {}
    for layer, count in enumerate(experts):
        for e in range(count):
            name = expert_file_name(layer, e)
            obj = files.get(name)
            if obj is None:
                continue
            prefix = f"{layers[layer]}.deepspeed_moe.experts.deepspeed_experts.{e}."
            wrong = [k for k, v in obj.items() if not k.startswith(prefix) or not isinstance(v, TensorRef)]
            if wrong or not obj:
                st.add("expert-mismatch", f"expert {e} of MoE layer {layer}: {join(tag_uri, name)} holds "
                       f"{', '.join(map(str, wrong[:3])) or 'nothing'} instead of {prefix}*; the file is damaged or "
                       "from another model", file=join(tag_uri, name))
                continue
            out[(layer, e)] = dict(obj)
    return out


# ---- ZeRO-1/2 ----------------------------------------------------------------------------------------


def _zero_tensors(st: Inspection, zero: ZeroCheckpoint, layers: Sequence[str], experts: Sequence[int],
                  files: Mapping[str, Mapping[str, Any]], tag_uri: str) -> tuple[ModelTensor, ...]:
    """Dense parameters from their fp32 fragments; each expert-parallel rank's local experts under their
    global names, from theirs; every global expert exactly once, matching its expert file."""
    index = {path: i for i, path in enumerate(layers)}
    out: dict[str, ModelTensor] = {}
    shapes: dict[tuple[int, int], dict[str, tuple[int, ...]]] = {}
    for param in zero.params:
        group = zero.groups[param.group] if param.group is not None else None
        m = EXPERT_RE.match(param.name)
        if group is None or (group.ep == 1 and not group.hyper.get("moe")):  # ep_size_1: every expert local
            if m:
                st.add("partition-mismatch", f"{param.name} is an expert parameter outside any ep_size_N param "
                       "group; ckptflow cannot tell which expert-parallel rank's expert it is",
                       file=zero.files[0].optim)
                continue
            out[param.name] = ModelTensor(param.name, param.shape, param.dtype if param.frozen else "float32",
                                          "frozen" if param.frozen else "param", zero.param_runs(param))
            continue
        if not m or m.group("layer") not in index:
            st.add("unsupported-layout", f"{param.name} is in the expert param group {group.index} "
                   f"({group.hyper.get('name')!r}) but is not a deepspeed.moe expert "
                   "(`<layer>.deepspeed_moe.experts.deepspeed_experts.<i>.<name>`); ckptflow cannot place it",
                   file=zero.files[0].optim)
            continue
        layer = index[m.group("layer")]
        local_count = experts[layer] // group.ep
        local = int(m.group("id"))
        if experts[layer] % group.ep or local >= local_count:
            st.add("placement-mismatch", f"{param.name} (expert-parallel rank {param.shard} of {group.ep}) is local "
                   f"expert {local}, but MoE layer {layer} has {experts[layer]} experts, {local_count} per rank; the "
                   "files do not belong together", file=zero.files[0].optim)
            continue
        expert = param.shard * local_count + local
        name = f"{m.group('layer')}.deepspeed_moe.experts.deepspeed_experts.{expert}.{m.group('rest')}"
        if name in out:
            st.add("placement-mismatch", f"{name} is held by two expert-parallel ranks' param groups; the files do "
                   "not belong together", file=zero.files[0].optim)
            continue
        out[name] = ModelTensor(name, param.shape, "float32", "param", zero.param_runs(param))
        shapes.setdefault((layer, expert), {})[name] = param.shape
    for (layer, expert), tensors in _file_tensors(st, files, tag_uri, layers, experts).items():
        check_expert_file(st, tag_uri, expert_file_name(layer, expert), tensors, shapes.get((layer, expert), {}),
                          layer, expert)
    for buffer in zero.buffers:
        out[buffer.name] = ModelTensor(buffer.name, buffer.ref.shape, buffer.ref.dtype, "buffer",
                                       (whole_run(buffer.ref, buffer.name),))
    return ordered(list(zero.model_states[0].get("module") or {}), out, _follow(layers, experts, out))


def _follow(layers: Sequence[str], experts: Sequence[int], tensors: Mapping[str, ModelTensor]) -> dict[str, list[str]]:
    """Each layer's experts right after its gate, by global id: the order of the model at ep_size=1."""
    follow = {}
    for layer, path in enumerate(layers):
        names = []
        for e in range(experts[layer]):
            prefix = f"{path}.deepspeed_moe.experts.deepspeed_experts.{e}."
            names += [n for n in tensors if n.startswith(prefix)]
        follow[f"{path}.deepspeed_moe.gate.wg.weight"] = names
    return follow


# ---- ZeRO-0 --------------------------------------------------------------------------------------------


def _read_zero0(st: Inspection, listing: Listing, model0: dict[str, Any], layers: Sequence[str],
                experts: Sequence[int]) -> ExpertCheckpoint:
    """ZeRO-0: weights from `module` and the expert files; the optimizer, in `expp_rank_*` files per
    expert-parallel rank, is checked for presence and shape only (it names no parameter)."""
    uri = listing.model0_uri
    precision = precision_of(model0.get("ds_config"))
    recorded = _param_groups(model0.get("optimizer"), precision)
    # not a list: no eps, which stops the reading below
    groups: list[Any] = recorded if isinstance(recorded, list) else []
    eps = [expert_group_degree(g) for g in groups]
    if not eps or None in eps:
        st.add("corrupt-file", f"{uri} holds no optimizer param groups naming the expert-parallel degree (ep_size_N); "
               "ckptflow cannot tell which expp_rank files to expect", file=uri)
        st.stop_if_any()
    ep = max(e for e in eps if e is not None)
    world_size = model0.get("dp_world_size")
    if not isinstance(world_size, int) or world_size < 1 or world_size % ep:
        st.add("corrupt-file", f"{uri} records a data-parallel world size of {world_size!r}, which {ep} "
               "expert-parallel ranks cannot split; the file is damaged", file=uri)
        world_size = 0  # never used: the problem stops the reading before the index is built
    for name in listing.names:
        m = EXPP_FILE_RE.match(name)
        if m and int(m.group(1)) >= ep:
            st.add("rank-extra", f"unexpected file {st.tag}/{name}: the optimizer is split over {ep} expert-parallel "
                   "ranks; it is left over from another save into the same tag folder",
                   file=join(listing.tag_uri, name))
    for e in range(ep):
        name = expp_file_name(e)
        if name not in listing.names:
            st.add("rank-missing", f"expert-parallel rank {e} of {ep} is missing: expected {st.tag}/{name} under "
                   f"{st.root} (its optimizer state); the upload may still be in progress",
                   file=join(listing.tag_uri, name), rank=e)
    expected = check_expert_files(st, listing, experts, "deepspeed.moe saves one file per MoE layer and global expert")
    st.stop_if_any()
    expp = open_files(st, listing.tag_uri, [expp_file_name(e) for e in range(ep)], lambda n: n.split("_mp_")[0])
    for e in range(ep):
        name = expp_file_name(e)
        got = _param_groups(expp.get(name, {}).get("optimizer"), precision)
        if name in expp and (
                not isinstance(got, list) or [g.get("name") for g in got] != [g.get("name") for g in groups]):
            st.add("ranks-disagree", f"expert-parallel rank {e}: {join(listing.tag_uri, name)} holds optimizer param "
                   f"groups {[g.get('name') for g in got] if isinstance(got, list) else got!r}, rank 0's model states "
                   f"{[g.get('name') for g in groups]}; the folder mixes saves",
                   file=join(listing.tag_uri, name), rank=e)
    files = open_files(st, listing.tag_uri, expected, _expert_label)
    by_expert = _file_tensors(st, files, listing.tag_uri, layers, experts)
    st.stop_if_any()
    module = model0["module"]
    buffers = set(model0.get("buffer_names") or [])
    out: dict[str, ModelTensor] = {}
    for name, ref in module.items():
        if isinstance(ref, TensorRef):
            out[name] = ModelTensor(name, ref.shape, ref.dtype, "buffer" if name in buffers else "param",
                                    (whole_run(ref, name),))
    for tensors in by_expert.values():
        for name, ref in tensors.items():
            out[name] = ModelTensor(name, ref.shape, ref.dtype, "param", (whole_run(ref, name),))
    return ExpertCheckpoint(
        root=st.root, tag=st.tag, kind="moe", stage=0, world_size=world_size, ep=ep, precision=precision,
        step=model0.get("global_steps", 0), ds_version=str(model0.get("ds_version", "unknown")),
        tensors=ordered(list(module), out, _follow(layers, experts, out)), tied={}, zero=None,
        expert_files=tuple(expected), experts=sum(experts), model0=model0,
        expp=tuple(expp[expp_file_name(e)]["optimizer"] for e in range(ep)),
    )


def _param_groups(optimizer: Any, precision: str) -> Any:
    """The torch param groups of a saved ZeRO-0 optimizer: its own (fp32), or FP16_Optimizer's base
    optimizer's (`optimizer_state_dict`, bf16 and fp16); None where there are none."""
    sixteen = precision != "fp32" and isinstance(optimizer, Mapping)
    inner = optimizer.get("optimizer_state_dict") if sixteen else optimizer
    return inner.get("param_groups") if isinstance(inner, Mapping) else None


# ---- ZeRO-0's optimizer state named, as a ZeRO index ------------------------------------------------------


def zero0_index(source: ExpertCheckpoint) -> ZeroCheckpoint | str:
    """The deepspeed.moe ZeRO-0 checkpoint `source` as a virtual ZeRO index of its named optimizer state
    (what `reshard` lays out at ZeRO-1/2), or why its state cannot be named.

    DeepSpeed 0.19.8 saves at ZeRO-0 (`engine._save_moe_checkpoint`) each expert-parallel rank's
    `optimizer.state_dict()`: a torch optimizer over the groups
    `split_params_into_different_moe_groups_for_optimizer` built from the client's, each client group
    with its expert parameters taken out, then one `ep_size_N` group (`moe: True`) per client group with
    those, cut by size; the state keyed by position over all groups. In bf16 or fp16 (a model that is not
    a PipelineModule) the optimizer is FP16_Optimizer's: the base optimizer's state by group
    (`optimizer_state_dict`, one flat state per group) and one flat fp32 master per group
    (`fp32_groups_flat`), as for a dense model (`readers.zero0`). Rank e's expert parameters are its
    local experts `deepspeed_experts.{i}` (global expert `e * E/N + i`, the file holding it). So the
    premise of `readers.zero0.named_groups` (each group in the module's order) names them: the dense
    groups over the module's weights, the expert groups over rank e's local experts, apart (a dense and an
    expert parameter of one shape are never mistaken), by their Adam moments' shapes (fp32) or their flat
    masters' sizes (16-bit). The dense groups' state is the same on every rank (their gradients are
    averaged over all): rank 0's is taken.

    The index is as `reshard.stage` builds one from a data-parallel ZeRO-0 checkpoint: every master a
    partition of its own at one virtual rank k (a group with fewer repeats its last, which no copy
    reads; a 16-bit group's flat master holds its parameters end to end), each expert group with one copy
    per expert-parallel rank under local names (`Param.shard`), its optimizer file's base state rank 0's
    (the step the group's, FP16_Optimizer's `clip_grad` where it saved one; in fp16 the loss scaler every
    expp_rank file's FP16_Optimizer agrees on, as a ZeRO optimizer saves it: `_loss_scaler`), its model
    states the source's with no `optimizer`."""
    model0 = source.model0
    scaler = _loss_scaler(source)
    if isinstance(scaler, str):
        return scaler
    named = [_named_rank(source, e) for e in range(source.ep)]
    bad = next((n for n in named if isinstance(n, str)), None)
    if bad is not None:
        return bad
    ranks = [n for n in named if not isinstance(n, str)]
    first = ranks[0]
    if any([(g.hyper, g.params) for g in r] != [(g.hyper, g.params) for g in first] for r in ranks):
        return ("its expp_rank files' param groups differ in hyper-parameters or in which local experts they hold, "
                "which one deepspeed.moe run does not save")
    masters: list[list[tuple[int, Zero0Group, int]]] = []  # per group: (expert-parallel rank, group, position)
    for g, group in enumerate(first):
        shards = range(source.ep) if group.hyper.get("moe") else range(1)
        masters.append([(e, ranks[e][g], j) for e in shards for j in range(len(group.masters))])
    width = max(len(m) for m in masters)

    def partition(k: int, g: int) -> Partition:
        _, group, j = masters[g][min(k, len(masters[g]) - 1)]
        return Partition(rank=k, group=g, numel=group.masters[j].numel, padding=0, fp32=group.masters[j],
                         state=group.states[j])

    partitions = tuple(tuple(partition(k, g) for g in range(len(masters))) for k in range(width))
    shapes = {t.name: t.shape for t in source.tensors}
    local = {t.name: t.shape for t in _local_experts(source, 0)}
    params = []
    for g, m in enumerate(masters):
        for k, (e, group, j) in enumerate(m):
            offset = 0
            for name in group.params if len(group.masters) == 1 else group.params[j:j + 1]:  # 16-bit: end to end
                shape = local[name] if group.hyper.get("moe") else shapes[name]
                numel = element_count(shape)
                params.append(Param(name, shape, "float32", g, (Fragment(rank=k, group=g, offset=offset, numel=numel,
                                                                          param_offset=0),), shard=e))
                offset += numel
    order = {n: i for i, n in enumerate(model0["module"])}
    params.sort(key=lambda p: (p.shard, order.get(p.name, len(order))))
    base_state = {g: {k: group.step if k == "step" else v for k, v in partitions[0][g].state.items()}
                  for g, group in enumerate(first) if partitions[0][g].state}
    osd = {"base_optimizer_state": {"state": base_state,
                                    "param_groups": [{**group.hyper, "params": [g]} for g, group in enumerate(first)]},
           "ds_version": model0.get("ds_version")}
    osd.update(scaler or {})  # fp16: FP16_Optimizer's scale carried; else `reshard.files` writes a static 1
    if "clip_grad" in source.expp[0]:  # FP16_Optimizer's; else `reshard.files` takes the recorded config's
        osd["clip_grad"] = source.expp[0]["clip_grad"]
    buffers = set(model0.get("buffer_names") or [])
    uri = join(source.tag_uri, expp_file_name(0))
    return ZeroCheckpoint(
        root=source.root, tag=source.tag, stage=0, world_size=1, precision=source.precision, step=source.step,
        ds_version=source.ds_version, files=(RankFiles(0, uri, join(source.tag_uri, model_file_name(0, 0))),),
        params=tuple(params), buffers=tuple(Buffer(n, r) for n, r in model0["module"].items() if n in buffers),
        tied={}, groups=tuple(ParamGroup(g, group.hyper, group.params, ep=source.ep if group.hyper.get("moe") else 1)
                              for g, group in enumerate(first)),
        partitions=partitions, module_order=tuple(order),
        model_states=({k: None if k == "optimizer" else {} if k == "shared_params" else v for k, v in model0.items()},),
        optim_states=({"optimizer_state_dict": osd, "ds_config": model0.get("ds_config"),
                       "ds_version": model0.get("ds_version")},),
    )


def _loss_scaler(source: ExpertCheckpoint) -> dict[str, Any] | str | None:
    """The fp16 source's loss scaler as a ZeRO optimizer saves it (`readers.zero0.saved_loss_scaler`), from
    every expp_rank file's FP16_Optimizer, which must agree (DeepSpeed reduces the overflow over all ranks,
    so one run's scales move together); None for fp32 and bf16, which keep none."""
    if source.precision != "fp16":
        return None
    scalers = [saved_loss_scaler(saved, source.model0.get("ds_config")) for saved in source.expp]
    for e, scaler in enumerate(scalers):
        if isinstance(scaler, str):
            return f"{expp_file_name(e)}: {scaler}"
        if scaler != scalers[0]:
            return (f"{expp_file_name(e)} holds another FP16_Optimizer loss scale state than {expp_file_name(0)} "
                    f"({_scale_state(scaler)}, not {_scale_state(scalers[0])}), which one deepspeed.moe run does "
                    "not save; the folder mixes saves")
    return scalers[0]


def _scale_state(scaler: Any) -> str:
    state = scaler["loss_scaler"].state
    return ", ".join(f"{k}={state[k]}" for k in ("cur_scale", "cur_iter", "last_overflow_iter") if k in state)


def _local_experts(source: ExpertCheckpoint, e: int) -> list[ModelTensor]:
    """Expert-parallel rank e's experts' tensors under their local names (`deepspeed_experts.{i}`), in order."""
    experts = source.model0["num_experts"]
    layers = [m.group("layer") for name in source.model0["module"] if (m := GATE_RE.match(name))]
    out = []
    for t in source.tensors:
        m = EXPERT_RE.match(t.name)
        if m is None:
            continue
        count = experts[layers.index(m.group("layer"))] // source.ep
        expert = int(m.group("id"))
        if e * count <= expert < (e + 1) * count:
            name = f"{m.group('layer')}.deepspeed_moe.experts.deepspeed_experts.{expert - e * count}.{m.group('rest')}"
            out.append(ModelTensor(name, t.shape, t.dtype, "param", t.runs))
    return out


def _named_rank(source: ExpertCheckpoint, e: int) -> tuple[Zero0Group, ...] | str:
    """Expert-parallel rank e's param groups named, in the optimizer's order (`zero0_index`)."""
    model0 = source.model0
    sixteen = source.precision != "fp32"
    saved = source.expp[e]
    optimizer = saved.get("optimizer_state_dict") if sixteen else saved
    groups = optimizer.get("param_groups") if isinstance(optimizer, Mapping) else None
    state = (optimizer.get("state") or {}) if isinstance(optimizer, Mapping) else None
    if not isinstance(state, Mapping) or not isinstance(groups, list) or not all(
            isinstance(g, Mapping) and isinstance(g.get("params"), list) for g in groups):
        inside = " inside FP16_Optimizer's `optimizer_state_dict`" if sixteen else ""
        return (f"{expp_file_name(e)} holds no torch optimizer state dict{inside} (`state` by position, param groups "
                "listing their positions); the file is damaged or was written by another tool")
    flats: Any = saved.get("fp32_groups_flat") if sixteen else []
    if sixteen and (not isinstance(flats, list) or len(flats) != len(groups) or not all(
            isinstance(f, TensorRef) and f.dtype == "float32" and len(f.shape) == 1 for f in flats)):
        return (f"{expp_file_name(e)} was saved in {source.precision}, but holds no flat fp32 master per param group "
                f"(FP16_Optimizer's `fp32_groups_flat`, {len(groups)} expected); the file is damaged or was written "
                "by another tool")
    buffers = set(model0.get("buffer_names") or [])
    dense = [t for t in source.tensors if t.name in model0["module"] and t.name not in buffers]
    mine = _local_experts(source, e)
    out: dict[int, Zero0Group] = {}
    for moe, tensors in ((False, dense), (True, mine)):
        picked = [g for g, group in enumerate(groups) if bool(group.get("moe")) == moe]
        picked_state: Mapping[Any, Any] = state
        if sixteen:  # FP16_Optimizer's base state: group g's one flat tensor at its own position; named by group
            picked_state = {i: state.get(groups[g]["params"][0]) if groups[g]["params"] else None
                            for i, g in enumerate(picked)}
        saved_view: Mapping[str, Any] = {"state": picked_state, "param_groups": [groups[g] for g in picked]}
        if sixteen:  # FP16_Optimizer's entry, as `readers.zero0` reads it
            saved_view = {"optimizer_state_dict": saved_view, "fp32_groups_flat": [flats[g] for g in picked]}
        view = Zero0Checkpoint(
            root=source.root, tag=source.tag, world_size=source.world_size, precision=source.precision,
            step=source.step, ds_version=source.ds_version, model_file=join(source.tag_uri, expp_file_name(e)),
            tensors=tuple(tensors), tied={}, optimizer_params=sum(len(groups[g]["params"]) for g in picked),
            optimizer_groups=len(picked), optimizer_step=0,
            model_states={"module": {t.name: t.runs[0].ref for t in tensors},
                          "optimizer": saved_view})
        named = named_groups(view)
        what = "expert" if moe else "dense"
        if isinstance(named, str):
            return f"expert-parallel rank {e}'s {what} parameters: {named}"
        if named[1]:
            return (f"{named[1][0]} is in none of expert-parallel rank {e}'s param groups (frozen); ckptflow does not "
                    "write a deepspeed.moe ZeRO-0 checkpoint with frozen parameters at another stage yet")
        out.update(zip(picked, named[0]))
    return tuple(out[g] for g in range(len(groups)))


__all__ = ["read_moe", "zero0_index"]
