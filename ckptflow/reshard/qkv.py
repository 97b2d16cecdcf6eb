"""Megatron's fused `query_key_value` at another tensor-parallel degree, in the layout the user declares. Pure.

Which rows of the source's ranks joined one after the other each target rank holds, per layout ("blocks" or
"groups") and from the heads the run's `args` record, is `formats.deepspeed.qkv`'s row arithmetic (`qkv_rows`),
shared with `consolidate`; here those row runs become each target rank's pieces, which the planner copies
element by element as it copies any other split (the weight, its bias, their fp32 masters and Adam moments
alike).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ckptflow.errors import UnsupportedCheckpointError
from ckptflow.formats.deepspeed.qkv import Heads, qkv_rows
from ckptflow.formats.deepspeed.readers.model_parallel import ModelParallelCheckpoint, Piece, row_major
from ckptflow.formats.deepspeed.readers.pipeline import FUSED_QKV, Split, fused_heads


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
    shapes, _ = split
    full = (sum(s[0] for s in shapes), *shapes[0][1:])
    try:
        return shapes, qkv_pieces(layout, fused_heads(index, name, full[0]), index.tp, full, tp)
    except UnsupportedCheckpointError as exc:
        raise UnsupportedCheckpointError(f"{name} cannot be joined and cut in the {layout} layout: {exc}",
                                         tensor=name) from None


__all__ = ["in_layout", "qkv_pieces"]
