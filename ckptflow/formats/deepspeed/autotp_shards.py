"""AutoTP's shard arithmetic at any tensor-parallel degree, as pure functions over integers and dicts.

Each function mirrors one piece of DeepSpeed 0.19.8 and names it; nothing here reads a file:

- `shard_sizes` is `module_inject.tp_shard.get_shard_size_list`: a dimension split over `tp` ranks on
  key/value-head boundaries when the model's `num_kv_heads` divides it (attention layers), else in
  grains of `tp_grain_size` with the remainder on the last rank (MLP layers, `lm_head`);
- `meta_of` is `AutoTPMeta.from_model_config` (the key/value heads a `config.json` names) with the
  `tensor_parallel.tp_grain_size` of the DeepSpeed config;
- `replicated_map`, `contiguous_split_map`, `sub_param_map` are `checkpoint.affine`'s maps, as the
  plain dicts `ParamAffineMap.to_dict` saves in `universal_checkpoint_info.affine_map.params`.

`shard_rule_of` reads back which of the three a saved map is, and `resplit` gives the same layout at
another degree: the sizes always come from `shard_sizes` at the new degree, never from the old map.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# tp_shard._KV_HEAD_ATTRS: where a config names its key/value heads, in DeepSpeed's order.
KV_HEAD_KEYS = ("num_key_value_heads", "num_kv_heads", "multi_query_group_num", "n_head_kv", "kv_n_heads",
                "num_attention_heads", "n_heads", "attention_heads")
LAST_LINEAR = ("lm_head", "embed_out")  # get_shard_size's `last_linear`
MOE_MLP = ("gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")  # get_shard_size's `moe_mlp_layer`


@dataclass(frozen=True)
class Meta:
    """What AutoTP's split depends on besides the degree (`tp_shard.AutoTPMeta`)."""

    num_kv_heads: int | None
    tp_grain_size: int = 1


def meta_of(config: Mapping[str, Any] | None, ds_config: Mapping[str, Any] | None) -> Meta:
    """The `Meta` of a model with `config.json` `config` (its `text_config` already taken) trained with
    DeepSpeed config `ds_config`."""
    kv = None
    for key in KV_HEAD_KEYS:
        value = (config or {}).get(key)
        if value is not None:
            kv = value if isinstance(value, int) and not isinstance(value, bool) else None
            break
    section = (ds_config or {}).get("tensor_parallel")
    grain = section.get("tp_grain_size", 1) if isinstance(section, Mapping) else 1
    return Meta(num_kv_heads=kv, tp_grain_size=grain if isinstance(grain, int) and grain >= 1 else 1)


def shard_size(total: int, tp: int, meta: Meta, name: str, rank: int) -> int:
    """`tp_shard.get_shard_size` for tensor-parallel rank `rank` of layer `name`."""
    kv = meta.num_kv_heads
    if kv and total % kv == 0 and "mlp" not in name and name not in LAST_LINEAR \
            and not any(s in name for s in MOE_MLP):
        return total * (kv // tp + (1 if rank < kv % tp else 0)) // kv
    grain = meta.tp_grain_size
    if total >= grain:
        grains, remainder = divmod(total, grain)
        size = (grains // tp + (1 if rank < grains % tp else 0)) * grain
        return size + remainder if rank == tp - 1 else size
    return total // tp + (1 if rank < total % tp else 0)


def shard_sizes(total: int, tp: int, meta: Meta, name: str) -> list[int]:
    """`tp_shard.get_shard_size_list`: every rank's share of a dimension of `total`."""
    return [shard_size(total, tp, meta, name, r) for r in range(tp)]


def _strides(shape: Sequence[int]) -> list[int]:
    out = [1] * len(shape)
    for axis in range(len(shape) - 2, -1, -1):
        out[axis] = out[axis + 1] * shape[axis + 1]
    return out


def _piece(shape: Sequence[int], source: int, source_strides: Sequence[int], dest: int,
           dest_strides: Sequence[int], locations: Sequence[int]) -> dict[str, Any]:
    return {"shape": list(shape), "source": [source, list(source_strides)], "dest": [dest, list(dest_strides)],
            "locations": sorted(locations)}


def replicated_map(shape: Sequence[int], tp: int) -> dict[str, Any]:
    """`affine.replicated_map(shape, tp).to_dict()`: every rank holds the whole tensor."""
    strides = _strides(shape)
    piece = _piece(shape, 0, strides, 0, strides, range(tp))
    return {"logical_shape": list(shape),
            "ranks": {r: {"shard_shape": list(shape), "pieces": [dict(piece)]} for r in range(tp)}}


def contiguous_split_map(shape: Sequence[int], sizes: Sequence[int], dim: int) -> dict[str, Any]:
    """`affine.contiguous_split_map(shape, sizes, dim).to_dict()`: rank r one block of `sizes[r]` along `dim`."""
    strides = _strides(shape)
    ranks, start = {}, 0
    for rank, size in enumerate(sizes):
        shard = [*shape[:dim], size, *shape[dim + 1:]]
        ranks[rank] = {"shard_shape": shard,
                       "pieces": [_piece(shard, start * strides[dim], strides, 0, _strides(shard), [rank])]}
        start += size
    return {"logical_shape": list(shape), "ranks": ranks}


def sub_param_map(shape: Sequence[int], widths: Sequence[Sequence[int]], dim: int) -> dict[str, Any]:
    """`affine.sub_param_map(shape, [sum(w) for w in widths], widths, dim).to_dict()`: sub-parameters
    concatenated along `dim`, each split over the ranks by its own `widths[i]`; a rank's shard holds its
    piece of each in turn."""
    strides = _strides(shape)
    tp = len(widths[0])
    shards = {r: [*shape[:dim], sum(w[r] for w in widths), *shape[dim + 1:]] for r in range(tp)}
    pieces: dict[int, list[dict[str, Any]]] = {r: [] for r in range(tp)}
    filled = dict.fromkeys(range(tp), 0)
    start = 0
    for sub in widths:
        source = start
        for r in range(tp):
            dest_strides = _strides(shards[r])
            pieces[r].append(_piece([*shape[:dim], sub[r], *shape[dim + 1:]], source * strides[dim], strides,
                                    filled[r] * dest_strides[dim], dest_strides, [r]))
            source += sub[r]
            filled[r] += sub[r]
        start += sum(sub)
    return {"logical_shape": list(shape), "ranks": {r: {"shard_shape": shards[r], "pieces": pieces[r]}
                                                    for r in range(tp)}}


@dataclass(frozen=True)
class ShardRule:
    """How AutoTP splits one parameter: "replicated", "split" (one block per rank along `dim`) or
    "sub" (sub-parameters of `sizes` along `dim`, each split on its own)."""

    kind: str
    dim: int = 0
    sizes: tuple[int, ...] = ()

    def widths(self, tp: int, meta: Meta, name: str) -> list[list[int]]:
        """Every sub-parameter's (for "split": the dimension's) per-rank widths at degree `tp`."""
        return [shard_sizes(size, tp, meta, name) for size in self.sizes]

    def affine_map(self, shape: Sequence[int], tp: int, meta: Meta, name: str) -> dict[str, Any]:
        """The map DeepSpeed records for this layout at degree `tp`."""
        if self.kind == "replicated":
            return replicated_map(shape, tp)
        widths = self.widths(tp, meta, name)
        if self.kind == "split":
            return contiguous_split_map(shape, widths[0], self.dim)
        return sub_param_map(shape, widths, self.dim)


def _plain(entry: Any) -> Any:
    """A saved map with its rank keys as ints and its tuples as lists, to compare with the builders'."""
    if isinstance(entry, Mapping):
        return {(int(k) if isinstance(k, str) and k.isdigit() else k): _plain(v) for k, v in entry.items()}
    if isinstance(entry, (list, tuple)):
        return [_plain(v) for v in entry]
    return entry


def shard_rule_of(entry: Mapping[str, Any], tp: int, widths: Sequence[Sequence[int]] | None,
              sub_dim: int | None) -> ShardRule | None:
    """Which layout the saved map `entry` of a degree-`tp` checkpoint is, exactly as DeepSpeed's builders
    write it, or None. `widths`/`sub_dim`: the parameter's `sub_param_shard_widths` and its
    `parameter_with_sub_params` partition dim, when recorded."""
    saved = _plain(entry)
    shape = saved.get("logical_shape")
    ranks = saved.get("ranks")
    if not isinstance(shape, list) or not isinstance(ranks, Mapping) or sorted(ranks) != list(range(tp)):
        return None
    if saved == replicated_map(shape, tp):
        return ShardRule("replicated")
    if widths is not None and sub_dim is not None:
        widths = [list(w) for w in widths]
        if saved == sub_param_map(shape, widths, sub_dim):
            return ShardRule("sub", sub_dim, tuple(sum(w) for w in widths))
        return None
    for dim in range(len(shape)):
        try:
            sizes = [ranks[r]["shard_shape"][dim] for r in range(tp)]
        except (KeyError, IndexError, TypeError):
            return None
        if sum(sizes) == shape[dim] and saved == contiguous_split_map(shape, sizes, dim):
            return ShardRule("split", dim, (shape[dim],))
    return None


def recorded_widths(saved: Mapping[str, Any], layout: ShardRule) -> list[list[int]]:
    """The per-rank widths the saved map `saved` of `layout` records (what `layout.widths` must give)."""
    ranks = _plain(saved)["ranks"]
    if layout.kind == "split":
        return [[ranks[r]["shard_shape"][layout.dim] for r in sorted(ranks)]]
    per_rank = [[p["shape"][layout.dim] for p in ranks[r]["pieces"]] for r in sorted(ranks)]
    return [list(w) for w in zip(*per_rank)]


__all__ = ["ShardRule", "Meta", "contiguous_split_map", "shard_rule_of", "meta_of", "recorded_widths", "replicated_map",
           "shard_sizes", "sub_param_map"]
