"""Split metadata that lies: the `universal_checkpoint_info` an AutoTP checkpoint saves in every
tensor-parallel rank's model states, which says how each full tensor is made of the ranks' shards
(its affine map: pieces with shapes, offsets and strides on both sides; the vocabulary size), and
the `param_shapes` by which a PipelineModule stage names the tensors of its layer files.

Every rank is edited the same way (a rank that disagrees with the others is a test of its own), on a
tensor-parallel x data-parallel ZeRO-1 checkpoint whose row-parallel tensors are read as strided runs
cut by partition boundaries. The fuzzer's `splits` family draws the tensor, the rank, the field and
the value; `splits/any-field` puts a hostile value anywhere in the metadata.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from tests.hostile.corpus import Workspace, kind
from tests.hostile.torchfile import resave

AUTOTP = "autotp-tp2dp2-z1-fp32"
PIPELINE = "pipe-pp2-z1-fp32"
ROW_PARALLEL = r"^model\.layers\.0\.self_attn\.o_proj\.weight$"
HOSTILE_INTS = [0, -1, 1, 2, 10**12, -(10**12), 2**63, 10**5000]
HOSTILE_VALUES: list[Any] = [None, "0", 2.5, float("nan"), True, [], {}, [[0]], {"a": 1}]


def _edit_info(ws: Workspace, change: Callable[[dict], None]) -> None:
    """Apply `change` to the `universal_checkpoint_info` of every tensor-parallel rank's model states."""
    for path in sorted(ws.tag_dir.glob("mp_rank_*_model_states.pt")):
        resave(path, lambda o: change(o["universal_checkpoint_info"]))


def _entry(ws: Workspace) -> Callable[[dict], dict]:
    """The affine map entry of one parameter, the same in every rank: the row-parallel `o_proj` of
    layer 0, or one drawn once."""
    pick = ws.param(None, lambda r: r.random())

    def entry(info: dict) -> dict:
        params = info["affine_map"]["params"]
        return params[ROW_PARALLEL if pick is None else sorted(params)[int(pick * len(params))]]

    return entry


def _draw(rng: random.Random) -> Any:
    return rng.choice(HOSTILE_INTS + HOSTILE_VALUES)


@kind(source=AUTOTP, expect=r"model\.layers\.0\.self_attn\.o_proj\.weight: a piece that rank 1 holds does not fit: "
                            r"it reaches element \d+ of a tensor of 4096; the checkpoint's split metadata is "
                            r"inconsistent",
      forbid=r"weight: model\.layers")  # the tensor named once, not once per layer of the reader
def piece_past_the_tensor(ws: Workspace) -> None:
    """A piece of rank 1's shard reaches 10**12 elements into a 4096-element tensor."""
    entry = _entry(ws)
    rank = ws.param(1, lambda r: r.randrange(2))
    dim = ws.param(-1, lambda r: r.choice([0, -1]))  # the first or last: 1-d tensors have one
    value = ws.param(10**12, lambda r: r.choice(HOSTILE_INTS))

    def change(info: dict) -> None:
        piece = entry(info)["ranks"][rank]["pieces"][0]
        piece["shape"][dim] = value

    _edit_info(ws, change)


@kind(source=AUTOTP, expect=r"model\.layers\.0\.self_attn\.o_proj\.weight: the pieces held by rank 0 and rank 1 do not "
                            r"tile its 4096 elements \(they overlap or leave a gap\); the checkpoint's split metadata "
                            r"is inconsistent: the folder mixes saves or a file is damaged; re-copy it from one save")
def pieces_overlap(ws: Workspace) -> None:
    """Rank 1's shard of a row-parallel tensor claims rank 0's columns: two pieces on the same block,
    half the tensor covered by none."""
    entry = _entry(ws)
    rank = ws.param(1, lambda r: r.randrange(2))
    offset = ws.param(0, lambda r: r.choice([0, 1, 31, 33, 64, 4095]))

    def change(info: dict) -> None:
        entry(info)["ranks"][rank]["pieces"][0]["source"][0] = offset

    _edit_info(ws, change)


@kind(source=AUTOTP, expect=r"model\.layers\.0\.self_attn\.o_proj\.weight: the pieces held by rank 0 and rank 1 do not "
                            r"tile its 4096 elements")
def rows_overlap(ws: Workspace) -> None:
    """Rank 1's rows of a row-parallel tensor are recorded 16 elements apart while each is 32 long:
    its rows overlap in the full tensor (no longer one strided run) and leave the rest uncovered."""
    entry = _entry(ws)
    rank = ws.param(1, lambda r: r.randrange(2))
    stride = ws.param(16, lambda r: r.choice([0, 1, 16, 31, 33, 64, 65, -64]))

    def change(info: dict) -> None:
        entry(info)["ranks"][rank]["pieces"][0]["source"][1][0] = stride

    _edit_info(ws, change)


@kind(source=AUTOTP, expect=r"model\.layers\.0\.self_attn\.o_proj\.weight: its affine map entry for rank 1 in "
                            r"mp_rank_00_model_states\.pt is malformed; the file is damaged, or was written by a "
                            r"DeepSpeed whose affine maps ckptflow does not read")
def malformed_entry(ws: Workspace) -> None:
    """Rank 1's entry in a tensor's affine map is not a mapping of shard shape and pieces."""
    entry = _entry(ws)
    rank = ws.param(1, lambda r: r.randrange(2))
    value = ws.param(None, _draw)

    def change(info: dict) -> None:
        entry(info)["ranks"][rank] = value

    _edit_info(ws, change)


@kind(source=AUTOTP, expect=r"lm_head\.weight: the checkpoint records a vocabulary of -1 rows "
                            r"\(`original_vocab_size`\) but the tensor has 37; the checkpoint's metadata is "
                            r"inconsistent: the folder mixes saves")
def vocabulary_size(ws: Workspace) -> None:
    """The recorded vocabulary size (which cuts the padding rows off `lm_head`) is negative."""
    value = ws.param(-1, _draw)
    _edit_info(ws, lambda info: info.__setitem__("original_vocab_size", value))


@kind(source=AUTOTP, expect=r"lm_head\.weight: the checkpoint records a vocabulary of an integer of about 5001 digits "
                            r"rows")
def vocabulary_size_too_long_to_print(ws: Workspace) -> None:
    """A vocabulary size of 10**5000, which Python refuses to turn into digits (its message leaked
    through once, found by the fuzzer)."""
    value = ws.param(10**5000, _draw)
    _edit_info(ws, lambda info: info.__setitem__("original_vocab_size", value))


@kind(source=AUTOTP, expect=r"model\.norm\.weight: its affine map entry in mp_rank_00_model_states\.pt is malformed "
                            r"\(a dict of 1 item\)")
def malformed_tensor_entry(ws: Workspace) -> None:
    """A tensor's whole affine map entry is a mapping of something else (found by the fuzzer: the
    message named no file)."""
    name = ws.param(r"^model\.norm\.weight$", lambda r: r.choice([r"^model\.norm\.weight$", ROW_PARALLEL]))
    value = ws.param({"a": 1}, _draw)
    _edit_info(ws, lambda info: info["affine_map"]["params"].__setitem__(name, value))


@kind(source=AUTOTP, expect=r"records affine map format version '\[red\]0\.4; rm -rf /'")
def any_field(ws: Workspace) -> None:
    """A hostile value anywhere in the split metadata (drawn by the fuzzer; here the affine map's format
    version, a string with markup in it, which the message must quote as plain text)."""
    if ws.rng is None:
        _edit_info(ws, lambda info: info["affine_map"].__setitem__("version", "[red]0.4; rm -rf /"))
        return
    seed = ws.rng.random()

    def change(info: dict) -> None:
        rng = random.Random(seed)  # the same edit in every rank
        paths = list(_paths(info))
        path = rng.choice(paths)
        parent = info
        for key in path[:-1]:
            parent = parent[key]
        if isinstance(parent, dict) and rng.random() < 0.2:
            del parent[path[-1]]
        else:
            parent[path[-1]] = _draw(rng)

    _edit_info(ws, change)


@kind(source=PIPELINE, expect=r"rank 0: \S*/mp_rank_01_model_states\.pt records param_shapes as a list of 2 items, "
                              r"not what DeepSpeed writes there; the file is damaged")
def stage_shape_not_a_shape(ws: Workspace) -> None:
    """Pipeline stage 1 records the shape of the tied embedding (which the stages share, and which is
    looked for in the layer files before anything else) as 0.5."""
    value = ws.param(0.5, _draw)
    name = ws.param("tied_modules.embed.weight", lambda r: r.choice(["tied_modules.embed.weight", "2.weight"]))
    resave(ws.tag_dir / "mp_rank_01_model_states.pt", lambda o: o["param_shapes"][0].__setitem__(name, value))


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> Any:
    """Every path to a value inside `obj` (dict keys and list indexes)."""
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for key, value in items:
        yield (*prefix, key)
        yield from _paths(value, (*prefix, key))
