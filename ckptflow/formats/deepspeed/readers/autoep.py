"""AutoEP checkpoints (`"expert_parallel": {"enabled": true, "autoep_size": N, "preset_model": ...}`) read
into the model's own Hugging Face tensors.

DeepSpeed 0.19.8 replaces each sparse MoE block `P` (e.g. `model.layers.L.mlp`) by an AutoEP layer and
saves it under its own names (`tests/fixtures/PARALLEL_LAYOUTS.md`, section 4):

| Hugging Face (`from_pretrained`)          | checkpoint                                                   |
|-------------------------------------------|--------------------------------------------------------------|
| `P.gate.weight [E, H]`                    | `P.router.gate.weight` (and an alias `P.gate.gate.weight` in `module`) |
| `P.experts.gate_up_proj [E, 2I, H]`       | `P.experts.w1 [E_local, I, H]` (gate rows) and `P.experts.w3` (up rows) |
| `P.experts.down_proj [E, H, I]`           | `P.experts.w2 [E_local, H, I]`                               |

`ds_autoep_layers` in the model states lists the layers: path, experts, expert-parallel degree and the
placement (expert-parallel rank -> its global experts, in local order). The expert params are one
optimizer param group `ep_size_N`, partitioned per expert-parallel rank over its expert data-parallel
group (`index`). ZeRO-2 also saves `layer_{L}_expert_{E}` files (module-dtype copies); ZeRO-3 saves
none, and records each rank's placement in its own model states and the partition ranks in
`ds_zero_partition_groups`. Everything is checked against DeepSpeed's default topology; a checkpoint
whose files do not determine where each expert is, or whose layers hold anything but the router and
the routed experts of the presets below, is refused with what is missing.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ckptflow.formats.deepspeed.config import section
from ckptflow.formats.deepspeed.inspection import Inspection, Listing
from ckptflow.formats.deepspeed.model import ModelTensor, ZeroCheckpoint
from ckptflow.formats.deepspeed.names import EXPERT_FILE_RE, UC_INFO, expert_file_name
from ckptflow.formats.deepspeed.readers.experts import (
    ExpertCheckpoint,
    check_expert_file,
    check_expert_files,
    open_files,
    ordered,
    rename_tied,
)
from ckptflow.formats.deepspeed.readers.zero import read_zero
from ckptflow.formats.deepspeed.runs import Run, check_coverage, slice_runs, whole_run
from ckptflow.formats.deepspeed.topology import Topology


@dataclass(frozen=True)
class Preset:
    """Where a Hugging Face MoE block keeps what AutoEP renames: the router (`P.{router}`), the experts
    module (`P.{experts}`), its fused `[E, 2I, H]` gate-and-up weight (`w1` rows first, then `w3`) and its
    down weight (`w2`)."""

    router: str = "gate"
    experts: str = "experts"
    gate_up: str = "gate_up_proj"
    down: str = "down_proj"


# AutoEP presets whose layers ckptflow maps back (`deepspeed/module_inject/auto_ep_presets`): router
# "gate", experts "experts", fused_3d storage with expert_w1 "gate_up_proj", expert_w2 "down_proj".
PRESETS = {"qwen3_moe": Preset(), "mixtral": Preset()}
ROUTER = "router.gate."  # AutoEP's router linear, under the layer's path
WEIGHTS = ("w1", "w2", "w3")
ZERO3_FORMAT = ("zero3_partitioned", 1)
PER_EXPERT_FORMAT = ("per_expert_files", None)
_REQUIRED = ("moe_layer_id", "module_path", "num_experts", "num_local_experts", "ep_size", "expert_key_prefix")


@dataclass(frozen=True)
class MoELayer:
    """One AutoEP layer as `ds_autoep_layers` records it (rank 0's copy)."""

    id: int
    path: str
    prefix: str  # expert_key_prefix: `{path}.experts`
    num_experts: int
    local: int  # experts per expert-parallel rank
    ep: int
    group: str  # ep_group_name
    placement: tuple[tuple[int, ...], ...]  # expert-parallel rank -> its global experts, in local order

    def ep_rank_of(self, expert: int) -> tuple[int, int]:
        """(expert-parallel rank, local index) holding global `expert`."""
        for rank, experts in enumerate(self.placement):
            if expert in experts:
                return rank, experts.index(expert)
        raise KeyError(expert)


def read_autoep(st: Inspection, listing: Listing, model0: dict[str, Any], topology: Topology) -> ExpertCheckpoint:
    """The index of an AutoEP checkpoint, checked cheapest first: the layer metadata and the file set
    from the listing, then the ZeRO files, then the per-rank placement and the expert files."""
    model0_uri = listing.model0_uri
    preset = _preset(st, model0, model0_uri)
    _check_topology(st, listing, model0, model0_uri)
    layers = parse_layers(st, model0.get("ds_autoep_layers"), model0_uri)
    st.stop_if_any()
    if listing.stage3:
        check_expert_files(st, listing, [], "AutoEP ZeRO-3 keeps experts in the ZeRO partitions, not in expert files")
    elif topology.stage == 0:
        st.add("unsupported-layout", f"{listing.tag_uri} is an AutoEP checkpoint without ZeRO optimizer files "
               "(ZeRO-0), which ckptflow does not read; convert it with DeepSpeed's universal converter",
               file=model0_uri)
    else:
        check_expert_files(st, listing, [layer.num_experts for layer in layers],
                           "AutoEP ZeRO-1/2 saves one file per MoE layer and global expert")
    st.stop_if_any()
    zero = _without_router_aliases(read_zero(st, listing, model0), layers, preset)
    _check_ranks(st, zero, layers)
    st.stop_if_any()
    if zero.stage != 3:
        _check_expert_files(st, zero, listing, layers)
    tensors = _tensors(st, zero, layers, preset)
    st.stop_if_any()
    rename = _renamer(layers, preset)
    return ExpertCheckpoint(
        root=zero.root, tag=zero.tag, kind="autoep", stage=zero.stage, world_size=zero.world_size,
        ep=layers[0].ep, precision=zero.precision, step=zero.step, ds_version=zero.ds_version, tensors=tensors,
        tied=rename_tied(zero.tied, rename), zero=zero,
        expert_files=tuple(expert_file_name(layer.id, e) for layer in layers for e in range(layer.num_experts))
        if zero.stage != 3 else (),
        experts=sum(layer.num_experts for layer in layers),
    )


# ---- metadata ---------------------------------------------------------------------------------------


def _preset(st: Inspection, model0: Mapping[str, Any], uri: str) -> Preset:
    config = model0.get("ds_config") or {}
    section = config.get("expert_parallel") if isinstance(config, Mapping) else None
    name = section.get("preset_model") if isinstance(section, Mapping) else None
    if name not in PRESETS:
        st.add("unsupported-layout", f"{uri} is an AutoEP checkpoint of preset {name!r}; ckptflow maps the layers of "
               f"the presets {', '.join(sorted(PRESETS))} back to Hugging Face names and no others yet: convert this "
               "one with DeepSpeed's universal converter (python -m deepspeed.checkpoint.ds_to_universal)", file=uri)
        return Preset()
    return PRESETS[name]


def _check_topology(st: Inspection, listing: Listing, model0: Mapping[str, Any], uri: str) -> None:
    """The default expert-parallel topology, expert parallelism alone: anything else places experts in
    ways the files do not record."""
    config = model0.get("ds_config") or {}
    if not isinstance(config, Mapping):
        return
    if config.get("use_data_before_expert_parallelism"):
        st.add("unsupported-layout", f"{uri} was trained with use_data_before_expert_parallelism, which puts "
               "expert-parallel ranks on strided ranks; the files do not record that placement, and ckptflow reads "
               "DeepSpeed's default topology only: convert it with DeepSpeed's universal converter", file=uri)
    tp = section(config, "tensor_parallel").get("autotp_size") or 1
    etp = section(config, "expert_parallel").get("expert_tensor_parallel_size") or 1
    mp_ranks = {m.group(2) for m in listing.model_names.values()} | {m.group(3) for m in listing.optim_names.values()}
    if (isinstance(tp, int) and tp > 1) or (isinstance(etp, int) and etp > 1) or mp_ranks - {"00"}:
        st.add("unsupported-layout", f"{uri} is AutoEP folded with tensor parallelism (autotp_size {tp}, "
               f"expert_tensor_parallel_size {etp}), which ckptflow does not read: convert it with DeepSpeed's "
               "universal converter", file=uri)


def parse_layers(st: Inspection, entries: Any, uri: str, *, rank: int = 0) -> list[MoELayer]:
    """`ds_autoep_layers` as `MoELayer`s, every field and the placement checked: each global expert on
    exactly one expert-parallel rank, `num_local_experts` on each."""
    where = f"rank {rank}: {uri}"
    if not isinstance(entries, list) or not entries:
        st.add("corrupt-file", f"{where} has no usable ds_autoep_layers ({type(entries).__name__}); the AutoEP "
               "metadata is damaged", file=uri, rank=rank)
        return []
    layers = []
    for i, entry in enumerate(entries):
        missing = [k for k in _REQUIRED if not isinstance(entry, Mapping) or k not in entry]
        if missing:
            st.add("corrupt-file", f"{where}: AutoEP layer entry {i} lacks {', '.join(missing)}; the metadata is "
                   "damaged", file=uri, rank=rank)
            continue
        path, num, local, ep = entry["module_path"], entry["num_experts"], entry["num_local_experts"], entry["ep_size"]
        label = f"{where}: MoE layer {i} ({path})"
        if entry["moe_layer_id"] != i:
            st.add("corrupt-file", f"{label} has moe_layer_id {entry['moe_layer_id']}, expected {i} (layers are "
                   "numbered in module order)", file=uri, rank=rank)
        if not all(isinstance(v, int) and v > 0 for v in (num, local, ep)) or local * ep != num:
            st.add("corrupt-file", f"{label} records {num} experts, {local} per rank on {ep} expert-parallel ranks; "
                   "those do not fit together", file=uri, rank=rank)
            continue
        if entry["expert_key_prefix"] != f"{path}.experts":
            st.add("corrupt-file", f"{label} has expert_key_prefix {entry['expert_key_prefix']!r}, expected "
                   f"{path + '.experts'!r}", file=uri, rank=rank)
        placement = _placement(st, entry, label, uri, rank)
        if placement is None:
            continue
        group = entry.get("ep_group_name", f"ep_size_{ep}")
        layers.append(MoELayer(i, path, entry["expert_key_prefix"], num, local, ep, group, placement))
    if len({layer.ep for layer in layers}) > 1:
        st.add("corrupt-file", f"{where}: AutoEP layers record several expert-parallel degrees "
               f"{sorted({layer.ep for layer in layers})}; DeepSpeed uses one", file=uri, rank=rank)
    return layers


def _placement(st: Inspection, entry: Mapping[str, Any], label: str, uri: str,
               rank: int) -> tuple[tuple[int, ...], ...] | None:
    num, local, ep = entry["num_experts"], entry["num_local_experts"], entry["ep_size"]
    descriptor = entry.get("expert_placement")
    if descriptor is None:  # DeepSpeed's legacy uniform placement
        return tuple(tuple(range(e * local, (e + 1) * local)) for e in range(ep))
    ranks = descriptor.get("ranks") if isinstance(descriptor, Mapping) else None
    if not isinstance(ranks, list) or (descriptor.get("num_experts"), descriptor.get("ep_size")) != (num, ep):
        st.add("corrupt-file", f"{label}: its expert_placement is not a placement of {num} experts on {ep} ranks",
               file=uri, rank=rank)
        return None
    by_rank: dict[int, tuple[int, ...]] = {}
    for item in ranks:
        r = item.get("rank") if isinstance(item, Mapping) else None
        experts = item.get("experts") if isinstance(item, Mapping) else None
        if not isinstance(r, int) or not 0 <= r < ep or r in by_rank or not isinstance(experts, list):
            st.add("corrupt-file", f"{label}: its expert_placement has a bad or repeated entry {item!r}", file=uri,
                   rank=rank)
            return None
        by_rank[r] = tuple(experts)
    problems = []
    for r in range(ep):
        if len(by_rank.get(r, ())) != local:
            problems.append(f"expert-parallel rank {r} holds {len(by_rank.get(r, ()))} experts, expected {local}")
    holders: dict[Any, list[int]] = {}
    for r, experts in by_rank.items():
        for expert in experts:
            holders.setdefault(expert, []).append(r)
    for expert in range(num):
        if len(holders.get(expert, [])) != 1:
            problems.append(f"expert {expert} is on expert-parallel ranks {holders.get(expert, [])}")
    problems += [f"expert {e!r} does not exist (the layer has {num})" for e in holders if e not in range(num)]
    if problems:
        st.add("placement-mismatch", f"{label}: its expert placement does not hold every expert exactly once "
               f"({'; '.join(problems[:4])}); the metadata is inconsistent, so ckptflow cannot tell where that "
               "layer's experts are", file=uri, rank=rank)
        return None
    return tuple(by_rank[r] for r in range(ep))


def _check_ranks(st: Inspection, zero: ZeroCheckpoint, layers: Sequence[MoELayer]) -> None:
    """The expert params sit in the layer's `ep_size_N` group, and each rank's own record of the layers
    (ZeRO-3: every rank's model states; ZeRO-1/2: rank 0's) says what that rank is at this world size."""
    groups = {p.name: zero.groups[p.group] for p in zero.params if p.group is not None and p.shard == 0}
    for layer in layers:
        for w in WEIGHTS:
            name = f"{layer.prefix}.{w}"
            group = groups.get(name)
            if group is None:
                st.add("corrupt-file", f"{zero.model_file(0)} records MoE layer {layer.id} ({layer.path}) but no "
                       f"trainable {name} in param_shapes; the files do not belong together", file=zero.model_file(0))
            elif group.ep != layer.ep or group.hyper.get("name") != layer.group:
                st.add("partition-mismatch", f"{name} is in param group {group.index} ({group.hyper.get('name')!r}, "
                       f"expert-parallel degree {group.ep}) but ds_autoep_layers puts MoE layer {layer.id} on "
                       f"{layer.group!r} ({layer.ep} ranks); the files do not belong together",
                       file=zero.files[0].optim)
    ranks = range(zero.world_size) if zero.stage == 3 else range(1)
    for rank in ranks:
        uri = zero.model_file(rank)
        entries = zero.model_states[rank].get("ds_autoep_layers")
        mine = parse_layers(st, entries, uri, rank=rank) if rank else layers
        uc = zero.model_states[rank].get(UC_INFO)
        if isinstance(uc, Mapping) and "ds_autoep_layers" in uc and uc["ds_autoep_layers"] != entries:
            st.add("ranks-disagree", f"rank {rank}: {uri} records other AutoEP layers in universal_checkpoint_info "
                   "than in ds_autoep_layers; the file is damaged", file=uri, rank=rank)
        for layer, own, entry in zip(layers, mine, entries if isinstance(entries, list) else []):
            if (own.path, own.num_experts, own.ep, own.placement) != (layer.path, layer.num_experts, layer.ep,
                                                                      layer.placement):
                st.add("ranks-disagree", f"rank {rank}: {uri} places the experts of MoE layer {layer.id} "
                       f"({layer.path}) otherwise than rank 0; the folder mixes saves: re-copy it from one save",
                       file=uri, rank=rank)
                continue
            ep_rank = rank % layer.ep
            want = {"ep_rank": ep_rank, "expert_data_parallel_rank": rank // layer.ep,
                    "expert_data_parallel_world_size": zero.world_size // layer.ep,
                    "global_expert_start": min(layer.placement[ep_rank]),
                    "global_expert_end": max(layer.placement[ep_rank]) + 1}
            have = {k: entry.get(k) for k in want}
            fmt = (entry.get("checkpoint_format"), entry.get("checkpoint_format_version"))
            if fmt != (ZERO3_FORMAT if zero.stage == 3 else PER_EXPERT_FORMAT):
                st.add("corrupt-file", f"rank {rank}: {uri} records MoE layer {layer.id} in checkpoint format {fmt}, "
                       f"which a ZeRO-{zero.stage} save does not write", file=uri, rank=rank)
            if have != want:
                st.add("placement-mismatch", f"rank {rank}: {uri} records MoE layer {layer.id} ({layer.path}) as "
                       f"{have}, but rank {rank} of {zero.world_size} with {layer.ep} expert-parallel ranks is {want} "
                       "in DeepSpeed's default topology; the files do not say where its experts are",
                       file=uri, rank=rank)


def _check_expert_files(st: Inspection, zero: ZeroCheckpoint, listing: Listing, layers: Sequence[MoELayer]) -> None:
    """Each expert file holds its expert's w1, w2, w3 under the global id, with the optimizer's shapes."""
    names = [expert_file_name(layer.id, e) for layer in layers for e in range(layer.num_experts)]
    objs = open_files(st, listing.tag_uri, names, lambda n: _expert_label(n))
    params = zero.param_by_name
    for layer in layers:
        for e in range(layer.num_experts):
            name = expert_file_name(layer.id, e)
            if name in objs:
                want = {f"{layer.prefix}.{w}.{e}": params[f"{layer.prefix}.{w}"].shape[1:] for w in WEIGHTS}
                check_expert_file(st, listing.tag_uri, name, objs[name], want, layer.id, e)


def _expert_label(name: str) -> str:
    m = EXPERT_FILE_RE.match(name)
    return f"expert {m.group(2)} of MoE layer {m.group(1)}" if m else name


# ---- the model's tensors ----------------------------------------------------------------------------


def _renamer(layers: Sequence[MoELayer], preset: Preset) -> Any:
    routers = {f"{layer.path}.{ROUTER}": f"{layer.path}.{preset.router}." for layer in layers}
    pattern = re.compile("^(" + "|".join(re.escape(k) for k in routers) + ")") if routers else None

    def rename(name: str) -> str:
        m = pattern.match(name) if pattern else None
        return routers[m.group(1)] + name[m.end():] if m else name

    return rename


def _router_aliases(layers: Sequence[MoELayer], preset: Preset) -> set[str]:
    """The module keys under which AutoEP saves each router a second time, by the preset's name
    (`{layer}.gate.gate.weight` beside `{layer}.router.gate.weight`), a copy of its own."""
    return {f"{layer.path}.{preset.router}.gate.{rest}" for layer in layers for rest in ("weight", "bias")}


def _without_router_aliases(zero: ZeroCheckpoint, layers: Sequence[MoELayer], preset: Preset) -> ZeroCheckpoint:
    """At ZeRO-1, which records no frozen-parameter list, the ZeRO reader takes every module tensor that is
    neither trainable nor a buffer as frozen: the router's copies under the preset's name are not."""
    aliases = _router_aliases(layers, preset)
    if not any(p.frozen and p.name in aliases for p in zero.params):
        return zero
    return replace(zero, params=tuple(p for p in zero.params if not (p.frozen and p.name in aliases)))


def _tensors(
    st: Inspection, zero: ZeroCheckpoint, layers: Sequence[MoELayer], preset: Preset
) -> tuple[ModelTensor, ...]:
    rename = _renamer(layers, preset)
    experts = {f"{layer.prefix}.{w}" for layer in layers for w in WEIGHTS}
    aliases = _router_aliases(layers, preset)
    owned = tuple(f"{layer.path}." for layer in layers)
    out: dict[str, ModelTensor] = {}
    for param in zero.params:
        if param.name in experts or param.shard:
            continue
        if param.name.startswith(owned) and not param.name.startswith(tuple(f"{p}{ROUTER}" for p in owned)):
            _refuse_unknown(st, zero, param.name, layers)
            continue
        runs = zero.param_runs(param)
        name = rename(param.name)
        out[name] = ModelTensor(name, param.shape, param.dtype if param.frozen else "float32",
                                "frozen" if param.frozen else "param", runs)
    for buffer in zero.buffers:
        if buffer.name.startswith(owned):
            _refuse_unknown(st, zero, buffer.name, layers)
            continue
        out[buffer.name] = ModelTensor(buffer.name, buffer.ref.shape, buffer.ref.dtype, "buffer",
                                       (whole_run(buffer.ref, buffer.name),))
    follow: dict[str, list[str]] = {}
    for layer in layers:
        fused = _fused(st, zero, layer, preset)
        for t in fused:
            out[t.name] = t
        follow[f"{layer.path}.{preset.router}.weight"] = [t.name for t in fused]
    module = [rename(n) for n in (zero.model_states[0].get("module") or {}) if n not in aliases]
    return ordered([n for n in module if n not in aliases], out, follow)


def _refuse_unknown(st: Inspection, zero: ZeroCheckpoint, name: str, layers: Sequence[MoELayer]) -> None:
    path = next(layer.path for layer in layers if name.startswith(f"{layer.path}."))
    st.add("unsupported-layout", f"{name} belongs to the AutoEP layer {path} but is neither its router nor its routed "
           "experts (a shared expert or a load-balancing buffer?); ckptflow does not know its Hugging Face name yet: "
           "convert this checkpoint with DeepSpeed's universal converter", file=zero.model_file(0))


def _fused(st: Inspection, zero: ZeroCheckpoint, layer: MoELayer, preset: Preset) -> list[ModelTensor]:
    """The layer's Hugging Face expert tensors from every expert-parallel rank's w1, w2, w3:
    `gate_up [E, 2I, H]` = per expert [w1 rows; w3 rows], `down [E, H, I]` = w2, placed by global id."""
    params = zero.param_by_key
    shards = {w: [params.get((e, f"{layer.prefix}.{w}")) for e in range(layer.ep)] for w in WEIGHTS}
    shapes = {w: {p.shape if p is not None else None for p in shards[w]} for w in WEIGHTS}
    if any(len(s) != 1 or None in s for s in shapes.values()):
        seen = {w: sorted(map(str, s)) for w, s in shapes.items()}
        st.add("corrupt-file", f"MoE layer {layer.id} ({layer.path}): its expert weights are not saved for every "
               f"one of {layer.ep} expert-parallel ranks with one shape ({seen})",
               file=zero.files[0].optim)
        return []
    saved = {w: [p for p in shards[w] if p is not None] for w in WEIGHTS}  # one per rank, checked above
    w1, w2, w3 = (saved[w][0].shape for w in WEIGHTS)  # one shape per weight, checked above
    if len(w1) != 3 or w3 != w1 or w2 != (w1[0], w1[2], w1[1]) or w1[0] != layer.local:
        st.add("corrupt-file", f"MoE layer {layer.id} ({layer.path}): expert weights w1 {list(w1)}, w2 {list(w2)}, "
               f"w3 {list(w3)} are not [{layer.local}, I, H], [{layer.local}, H, I], [{layer.local}, I, H] for its "
               f"{layer.local} local experts", file=zero.files[0].optim)
        return []
    _, inter, hidden = w1
    block = inter * hidden
    gate_up: list[Run] = []
    down: list[Run] = []
    for e in range(layer.ep):
        runs = {w: zero.trainable_runs(saved[w][e]) for w in WEIGHTS}
        for j, expert in enumerate(layer.placement[e]):
            gate_up += slice_runs(runs["w1"], j * block, block, expert * 2 * block)
            gate_up += slice_runs(runs["w3"], j * block, block, expert * 2 * block + block)
            down += slice_runs(runs["w2"], j * block, block, expert * block)
    base = f"{layer.path}.{preset.experts}"
    out = [ModelTensor(f"{base}.{preset.gate_up}", (layer.num_experts, 2 * inter, hidden), "float32", "param",
                       tuple(gate_up)),
           ModelTensor(f"{base}.{preset.down}", (layer.num_experts, hidden, inter), "float32", "param", tuple(down))]
    for t in out:
        check_coverage(t.name, t.numel, t.runs)
    return out


__all__ = ["PRESETS", "MoELayer", "Preset", "parse_layers", "read_autoep"]
