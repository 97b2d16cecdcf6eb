"""Megatron's fused `query_key_value`: which rows of its tensor-parallel ranks joined one after the other make
it at another degree, in the layout the user declares. Pure row arithmetic, no file read.

Each tensor-parallel rank holds the rows of its own attention heads, in an order that depends on the
Megatron-DeepSpeed version and that no file records (`readers.pipeline.FUSED_QKV_WHY`):

- "blocks" (Megatron-DeepSpeed since its commit 676a482c, December 2024): each rank's rows are
  [q of its heads | k of its key/value heads | v of its key/value heads], and a model at tp 1 reads
  all the q rows, then all k, then all v; joining ranks takes q of every rank, then k, then v;
- "groups" (before): each rank's rows are its key/value groups one after the other, each group [its q
  heads | k | v] (without grouped-query attention, per head [q | k | v]); ranks joined one after the
  other, and cut into contiguous blocks.

The readers join the source's ranks one after the other (as `ds_to_universal` does); `qkv_rows` maps each
rank's local rows at another degree to rows of that join, in runs: `reshard.qkv` cuts the projection with
them, `consolidate` joins it at degree 1 with them (`in_rows`). The head counts come from the run's `args`
(`num_attention_heads`, `num_key_value_heads` or `num_attention_heads_kv`, without either as many as the
attention heads; `kv_channels`, without it the rows the heads leave); Megatron builds the projection only
where both head counts divide by the degree.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckptflow.errors import UnsupportedCheckpointError
from ckptflow.formats.deepspeed.runs import Run

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


def in_rows(runs: Sequence[Run], row: int, moves: Sequence[tuple[int, int, int]]) -> tuple[Run, ...]:
    """`runs` of a tensor of `row` elements a row, its rows moved by `moves` ((row of `runs`' tensor, row of the
    tensor they make, rows) runs that cover every row once, as `qkv_rows` gives one rank's): the same source
    elements, each landing where its row moves to."""
    out = []
    for run in runs:
        for source, dest, count in moves:
            out += [dataclasses.replace(part, offset=part.offset + (dest - source) * row)
                    for part in run.within(source * row, (source + count) * row)]
    return tuple(sorted(out, key=lambda r: r.offset))


__all__ = ["KV_HEADS", "LAYOUTS", "Heads", "check_degree", "check_layout", "heads_from_args", "in_rows", "qkv_rows",
           "rank_rows"]
