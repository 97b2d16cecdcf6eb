"""Megatron's fused `query_key_value` joined and cut in the layout the user declares (`reshard.qkv`). Pure.

Each case builds the whole projection a model at tp 1 holds, each rank's rows at a degree as
Megatron-DeepSpeed lays them out (written here from its attention code, not from `reshard.qkv`), the
source's ranks joined one after the other (as the reader joins them), and checks that the pieces
`qkv_pieces` gives each target rank copy out exactly Megatron's rows at the target degree.
`tests/test_megatron_deepspeed.py` checks the "blocks" layout against Megatron-DeepSpeed itself.
"""

from __future__ import annotations

import pytest
import torch

from ckptflow.errors import UnsupportedCheckpointError
from ckptflow.formats.deepspeed.qkv import Heads, heads_from_args, qkv_rows
from ckptflow.reshard.qkv import qkv_pieces
from ckptflow.reshard.shape import Target

MHA = Heads(q=4, kv=4, dim=2)
GQA = Heads(q=8, kv=4, dim=3)
DEGREES = [(2, 1), (1, 2), (4, 1), (1, 4), (2, 4), (4, 2), (2, 2)]


def _whole(heads: Heads, columns: int | None) -> torch.Tensor:
    shape = (heads.rows,) if columns is None else (heads.rows, columns)
    return torch.arange(heads.rows * (columns or 1), dtype=torch.float64).reshape(shape)


def _megatron(layout: str, heads: Heads, whole: torch.Tensor, tp: int) -> list[torch.Tensor]:
    """Each rank's rows at degree `tp`: "blocks", the tp-1 rows [all q | all k | all v] and each rank
    [its q | its k | its v]; "groups", the tp-1 rows group by group ([q heads of the group | k | v]) and
    each rank its groups."""
    q, kv = heads.q * heads.dim, heads.kv * heads.dim
    if layout == "blocks":
        parts = [whole[:q].chunk(tp), whole[q:q + kv].chunk(tp), whole[q + kv:].chunk(tp)]
        return [torch.cat([part[r] for part in parts]) for r in range(tp)]
    group = heads.rows // heads.kv
    groups = [whole[g * group:(g + 1) * group] for g in range(heads.kv)]
    per = heads.kv // tp
    return [torch.cat(groups[r * per:(r + 1) * per]) for r in range(tp)]


def _cut(layout: str, heads: Heads, joined: torch.Tensor, source_tp: int, tp: int) -> list[torch.Tensor]:
    """Each target rank's local tensor, copied piece by piece out of the source's ranks joined one after
    the other (`joined`)."""
    flat = joined.reshape(-1)
    out = []
    for pieces in qkv_pieces(layout, heads, source_tp, joined.shape, tp):
        local = torch.full((joined.shape[0] // tp, *joined.shape[1:]), float("nan"), dtype=joined.dtype)
        for p in pieces:
            local.as_strided(p.shape, p.dest_strides, p.dest).copy_(flat.as_strided(p.shape, p.source_strides,
                                                                                     p.source))
        out.append(local)
    return out


@pytest.mark.parametrize("columns", [5, None], ids=["weight", "bias"])
@pytest.mark.parametrize("heads", [MHA, GQA], ids=["mha", "gqa"])
@pytest.mark.parametrize("layout", ["blocks", "groups"])
@pytest.mark.parametrize(("source_tp", "tp"), DEGREES, ids=[f"tp{a}-tp{b}" for a, b in DEGREES])
def test_each_target_rank_holds_megatrons_rows(layout: str, heads: Heads, columns: int | None, source_tp: int,
                                               tp: int) -> None:
    whole = _whole(heads, columns)
    joined = torch.cat(_megatron(layout, heads, whole, source_tp))
    for ours, theirs in zip(_cut(layout, heads, joined, source_tp, tp), _megatron(layout, heads, whole, tp),
                            strict=True):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("heads", [MHA, GQA], ids=["mha", "gqa"])
@pytest.mark.parametrize("layout", ["blocks", "groups"])
@pytest.mark.parametrize(("source_tp", "tp"), DEGREES, ids=[f"tp{a}-tp{b}" for a, b in DEGREES])
def test_there_and_back_is_the_identity(layout: str, heads: Heads, source_tp: int, tp: int) -> None:
    whole = _whole(heads, 3)
    source = _megatron(layout, heads, whole, source_tp)
    there = _cut(layout, heads, torch.cat(source), source_tp, tp)
    back = _cut(layout, heads, torch.cat(there), tp, source_tp)
    assert all(torch.equal(a, b) for a, b in zip(back, source, strict=True))


def test_the_layouts_differ_where_megatron_said_they_do() -> None:
    """tp 2 -> 1, two heads: "blocks" reads [q0 q1 k0 k1 v0 v1] out of [q0 k0 v0 | q1 k1 v1]; "groups" (and the
    same degree in either) keeps the rows as they are, one run per rank."""
    heads = Heads(q=2, kv=2, dim=1)
    assert qkv_rows("blocks", heads, 2, 1) == [[(0, 0, 1), (3, 1, 1), (1, 2, 1), (4, 3, 1), (2, 4, 1), (5, 5, 1)]]
    assert qkv_rows("groups", heads, 2, 1) == [[(0, 0, 6)]]
    assert qkv_rows("blocks", heads, 2, 2) == [[(0, 0, 3)], [(3, 0, 3)]]


def test_the_heads_come_from_the_runs_args() -> None:
    assert heads_from_args({"num_attention_heads": 2, "kv_channels": 8, "num_key_value_heads": 2}, 48) == \
        Heads(2, 2, 8)
    assert heads_from_args({"num_attention_heads": 8, "num_attention_heads_kv": 2}, 36) == Heads(8, 2, 3)
    assert heads_from_args({"num_attention_heads": 4, "num_key_value_heads": None}, 24) == Heads(4, 4, 2)


@pytest.mark.parametrize(("args", "rows", "message"), [
    (None, 48, "the checkpoint's args record no num_attention_heads, so its rows cannot be told apart by head"),
    ({"num_attention_heads": 4, "num_key_value_heads": 3}, 48, "its args record 3 key/value heads for 4 attention "
                                                              "heads"),
    ({"num_attention_heads": 4}, 50, "its 50 rows are not 4 attention and 8 key/value heads of equal size (args "
                                     "record no kv_channels)"),
    ({"num_attention_heads": 2, "kv_channels": 4}, 48, "its 48 rows are not the (2 + 2 x 2) heads x 4 rows its args "
                                                       "record (num_attention_heads, key/value heads, kv_channels)"),
])
def test_heads_the_args_do_not_give_are_refused(args: dict[str, object] | None, rows: int, message: str) -> None:
    with pytest.raises(UnsupportedCheckpointError) as refused:
        heads_from_args(args, rows)
    assert str(refused.value) == message


def test_a_degree_that_does_not_divide_the_heads_is_refused() -> None:
    with pytest.raises(UnsupportedCheckpointError, match="its 8 attention and 2 key/value heads do not split over 4"):
        qkv_rows("blocks", Heads(q=8, kv=2, dim=3), 2, 4)


def test_a_layout_is_blocks_or_groups() -> None:
    assert Target(world_size=2, tp=1, qkv_layout="blocks").qkv_layout == "blocks"
    with pytest.raises(ValueError, match="the query_key_value layout must be blocks or groups; got 'rows'"):
        Target(world_size=2, tp=1, qkv_layout="rows")
