"""Megatron's fused `query_key_value` at another tensor-parallel degree, in the layout the user declares. Pure.

Each tensor-parallel rank holds the rows of its own attention heads, in an order that depends on the
Megatron-DeepSpeed version and that no file records (`readers.pipeline.FUSED_QKV_WHY`):

- "blocks" (Megatron-DeepSpeed since its commit 676a482c, December 2024): each rank's rows are
  [q of its heads | k of its key/value heads | v of its key/value heads], and a model at tp 1 reads
  all the q rows, then all k, then all v; joining ranks takes q of every rank, then k, then v;
- "groups" (before): each rank's rows are its key/value groups one after the other, each group [its q
  heads | k | v] (without grouped-query attention, per head [q | k | v]); ranks joined one after the
  other, and cut into contiguous blocks.

The reader joins the source's ranks one after the other (as `ds_to_universal` does); `qkv_rows` maps
each target rank's local rows to rows of that join, in runs, which the planner copies element by element
as it copies any other split (the weight, its bias, their fp32 masters and Adam moments alike). The head
counts come from the run's `args` (`num_attention_heads`, `num_key_value_heads` or
`num_attention_heads_kv`, without either as many as the attention heads; `kv_channels`, without it the
rows the heads leave); Megatron builds the projection only where both head counts divide by the degree.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckptflow.errors import UnsupportedCheckpointError
from ckptflow.formats.deepspeed.client_state import namespace_state
from ckptflow.formats.deepspeed.readers.model_parallel import ModelParallelCheckpoint, Piece, row_major
from ckptflow.formats.deepspeed.readers.pipeline import FUSED_QKV, Split

LAYOUTS = ("blocks", "groups")
KV_HEADS = ("num_key_value_heads", "num_attention_heads_kv")  # Megatron-DeepSpeed's, and other forks'


@dataclass(frozen=True)
class Heads:
    """A fused projection's heads: `q` attention heads, `kv` key/value heads, `dim` rows each."""

    q: int
    kv: int
    dim: int

    @property
    def rows(self) -> int:
        return (self.q + 2 * self.kv) * self.dim


def check_layout(layout: str | None) -> None:
    """`ValueError` unless `layout` is None or one of `LAYOUTS`."""
    if layout is not None and layout not in LAYOUTS:
        raise ValueError(f"the query_key_value layout must be {' or '.join(LAYOUTS)}; got {layout!r}")


def heads_from_args(args: Mapping[str, Any] | None, rows: int) -> Heads:
    """The heads of a fused projection of `rows` rows (all tensor-parallel ranks together), from the run's
    `args` (None: none recorded). `UnsupportedCheckpointError`, in one line, where they do not say or do
    not make `rows`."""
    args = args or {}
    q = args.get("num_attention_heads")
    if type(q) is not int or q < 1:
        raise UnsupportedCheckpointError("the checkpoint's args record no num_attention_heads, so its rows cannot be "
                                         "told apart by head")
    kv = next((args[k] for k in KV_HEADS if args.get(k) is not None), q)
    if type(kv) is not int or kv < 1 or q % kv:
        raise UnsupportedCheckpointError(f"its args record {kv!r} key/value heads for {q} attention heads")
    dim = args.get("kv_channels")
    if dim is None:
        if rows % (q + 2 * kv):
            raise UnsupportedCheckpointError(f"its {rows} rows are not {q} attention and {2 * kv} key/value heads of "
                                             "equal size (args record no kv_channels)")
        dim = rows // (q + 2 * kv)
    if type(dim) is not int or dim < 1 or Heads(q, kv, dim).rows != rows:
        raise UnsupportedCheckpointError(f"its {rows} rows are not the ({q} + 2 x {kv}) heads x {dim!r} rows its args "
                                         "record (num_attention_heads, key/value heads, kv_channels)")
    return Heads(q, kv, dim)


def rank_rows(layout: str, heads: Heads, tp: int, rank: int) -> list[tuple[int, int]]:
    """The rows of the whole projection (as a model at tp 1 holds them in `layout`) that tensor-parallel rank
    `rank` of `tp` holds, in its local order: (first row, rows) runs."""
    check_degree(heads, tp)
    q, kv = heads.q // tp * heads.dim, heads.kv // tp * heads.dim
    if layout == "groups":
        return [(rank * (q + 2 * kv), q + 2 * kv)]
    return [(rank * q, q), (heads.q * heads.dim + rank * kv, kv), ((heads.q + heads.kv) * heads.dim + rank * kv, kv)]


def check_degree(heads: Heads, tp: int) -> None:
    """`UnsupportedCheckpointError` unless Megatron builds the projection of `heads` at degree `tp`."""
    if heads.q % tp or heads.kv % tp:
        raise UnsupportedCheckpointError(f"its {heads.q} attention and {heads.kv} key/value heads do not split "
                                         f"over {tp} tensor-parallel ranks")


def qkv_rows(layout: str, heads: Heads, source_tp: int, tp: int) -> list[list[tuple[int, int, int]]]:
    """Per tensor-parallel rank at degree `tp`, its local rows as (row of the source's ranks joined one after
    the other at `source_tp`, local row, rows) runs, in local order."""
    check_layout(layout)
    held = []  # the whole projection's runs, each with the joined row it starts at
    for rank in range(source_tp):
        at = rank * (heads.rows // source_tp)
        for first, count in rank_rows(layout, heads, source_tp, rank):
            held.append((first, count, at))
            at += count
    held.sort()
    out = []
    for rank in range(tp):
        runs: list[tuple[int, int, int]] = []
        local = 0
        for first, count in rank_rows(layout, heads, tp, rank):
            for start, length, at in held:
                lo, hi = max(first, start), min(first + count, start + length)
                if lo >= hi:
                    continue
                source, dest = at + lo - start, local + lo - first
                if runs and runs[-1][0] + runs[-1][2] == source and runs[-1][1] + runs[-1][2] == dest:
                    runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + hi - lo)
                else:
                    runs.append((source, dest, hi - lo))
            local += count
        out.append(runs)
    return out


def qkv_pieces(layout: str, heads: Heads, source_tp: int, full: Sequence[int], tp: int) -> list[list[Piece]]:
    """Per tensor-parallel rank at degree `tp`, the pieces of the source's ranks joined one after the other
    (shape `full`: rows first) that its local tensor holds, as `qkv_rows` maps the rows."""
    full = tuple(full)
    local = (full[0] // tp, *full[1:])
    strides, local_strides = row_major(full), row_major(local)
    row = strides[0] if len(full) > 1 else 1
    return [[Piece((count, *full[1:]), source * row, strides, dest * row, local_strides)
             for source, dest, count in runs]
            for runs in qkv_rows(layout, heads, source_tp, tp)]


def in_layout(index: ModelParallelCheckpoint, splits: Sequence[Mapping[str, Split]], tp: int, layout: str
              ) -> list[dict[str, Split]]:
    """Every stage's `splits` at degree `tp` (`readers.pipeline.splits_at`) of the Megatron-style checkpoint
    `index`, each fused attention projection's rows in `layout`. `UnsupportedCheckpointError` naming the
    first one that cannot be."""
    return [{name: _split(index, name, split, tp, layout) if FUSED_QKV in name else split
             for name, split in stage.items()} for stage in splits]


def _split(index: ModelParallelCheckpoint, name: str, split: Split, tp: int, layout: str) -> Split:
    """Fused attention projection `name`'s split at degree `tp` (`split`: as a column-parallel parameter)
    with its rows in `layout` (`reshard.qkv`); `UnsupportedCheckpointError` naming it where the rules do
    not split it as a column-parallel parameter or the run's `args` do not give its heads."""
    shapes, pieces = split
    full = (sum(s[0] for s in shapes), *shapes[0][1:])
    try:
        rows = [[Piece(s, r * math.prod(s), row_major(full), 0, row_major(s))] for r, s in enumerate(shapes)]
        if pieces != rows:
            raise UnsupportedCheckpointError("the checkpoint does not record it as a column-parallel parameter, "
                                             "split on its rows")
        heads = heads_from_args(namespace_state(index.ranks[0].model_states[0].get("args")), full[0])
        check_degree(heads, index.tp)
        return shapes, qkv_pieces(layout, heads, index.tp, full, tp)
    except UnsupportedCheckpointError as exc:
        raise UnsupportedCheckpointError(f"{name} cannot be joined and cut in the {layout} layout: {exc}",
                                         tensor=name) from None


__all__ = ["KV_HEADS", "LAYOUTS", "Heads", "check_degree", "check_layout", "heads_from_args", "in_layout", "qkv_pieces",
           "qkv_rows", "rank_rows"]
