"""AutoTP checkpoints (`"tensor_parallel": {"autotp_size": N}`), read into one index of the full model.

Each tensor-parallel rank `t` writes `mp_rank_{t:02d}` files: a complete data-parallel ZeRO checkpoint
(stage 0-3) of its local shards under the model's Hugging Face names. How a parameter is split is
recorded in every model-states file's `universal_checkpoint_info` (version 0.4): `affine_map.params`
gives, for every trained parameter (keyed by the anchored pattern `^<escaped name>$`), its full
`logical_shape` and per rank the pieces of the full tensor it holds
(`tests/fixtures/PARALLEL_LAYOUTS.md`, section 3). The reader builds each full tensor from those
pieces alone; a parameter without a map is refused, never concatenated on a guessed dimension.

Refused as unverified: scaled pieces (a shard holding `full * scale`), maps of a format version
above 1. Vocabulary parameters are cut to `original_vocab_size` rows, as DeepSpeed's own converter
does (AutoTP 0.19.8 pads nothing, so nothing is cut there).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import replace
from posixpath import basename
from typing import Any

from ckptflow.errors import CkptflowError, UnsupportedCheckpointError
from ckptflow.formats.deepspeed.inspection import Inspection, Listing
from ckptflow.formats.deepspeed.model import ModelTensor
from ckptflow.formats.deepspeed.names import UC_INFO
from ckptflow.formats.deepspeed.readers.model_parallel import (
    MAX_PATTERN,
    Holding,
    ModelParallelCheckpoint,
    Piece,
    Replica,
    about,
    check_mp_files,
    join,
    local_tensors,
    open_heads,
    read_ranks,
    row_major,
    stop_on_new,
)
from ckptflow.formats.deepspeed.readers.zero0 import UNNAMED_OPTIMIZER, masters_note
from ckptflow.formats.deepspeed.runs import Run, whole_run
from ckptflow.formats.deepspeed.topology import Topology
from ckptflow.formats.torch.tensorref import TensorRef
from ckptflow.plumbing.text import excerpt

AFFINE_MAP_VERSION = 1  # deepspeed.checkpoint.affine.AFFINE_MAP_FORMAT_VERSION


def where(tp: int) -> Any:
    return lambda mp: f"tensor-parallel rank {mp} of {tp}"


def read_autotp(
    st: Inspection, listing: Listing, model0: dict[str, Any], topology: Topology
) -> ModelParallelCheckpoint:
    """The index of an AutoTP checkpoint; every problem goes to `st` (reading stops at each stage's)."""
    tp = topology.tp
    label = where(tp)
    check_mp_files(st, listing, tp, label, topology.description)
    left_over = len(st.problems)  # files of other saves: reported, and the ranks are still read
    heads = open_heads(st, listing, model0, tp)
    stop_on_new(st, left_over)
    info = _uc_info(st, listing, heads, label)
    stop_on_new(st, left_over)
    ranks = read_ranks(st, listing, heads, topology.stage, label)
    locals_ = local_tensors(st, ranks, label)
    for mp in range(1, tp):
        extra, missing = sorted(set(locals_[mp]) - set(locals_[0])), sorted(set(locals_[0]) - set(locals_[mp]))
        if extra or missing:
            st.add("ranks-disagree", f"{label(mp)} holds other tensors than {label(0)} (its own: "
                   f"{excerpt(', '.join(map(str, extra[:3])), 120)}, missing: "
                   f"{excerpt(', '.join(map(str, missing[:3])), 120)}); the folder mixes saves of different models: "
                   "re-copy it from one save",
                   file=listing.model_uri(mp))
    st.stop_if_any()
    tied = _tied(st, ranks, label)
    tensors: list[ModelTensor] = []
    replicas: list[Replica] = []
    maps = _MapLookup(info)
    for name, first in locals_[0].items():
        try:
            holdings, shape, rows = _holdings(name, first, locals_, maps, info, tp, basename(listing.model0_uri))
            tensor, pairs = join(name, shape, first.kind, holdings, lambda mp, n: locals_[mp][n], rows=rows)
        except (CkptflowError, ValueError) as exc:
            st.add(getattr(exc, "code", "unsupported-layout"), about(name, exc), file=listing.model0_uri)
            continue
        tensors.append(tensor)
        replicas.extend(pairs)
    st.stop_if_any()
    zero = ranks[0]
    return ModelParallelCheckpoint(
        root=st.root, tag=st.tag, stage=zero.stage, world_size=zero.world_size, precision=zero.precision,
        step=zero.step, ds_version=zero.ds_version, kind="autotp", description=_describe(topology, zero.stage), tp=tp,
        pp=1, ranks=tuple(ranks), tensors=tuple(tensors), tied=tied, replicas=tuple(replicas),
        notes=_notes(ranks),
    )


def module_runs(index: ModelParallelCheckpoint) -> dict[str, tuple[Run, ...]]:
    """The full 16-bit (module dtype) copy of every trained parameter, joined from each tensor-parallel
    rank's `module` by the same affine maps as the fp32 masters: name -> runs. ZeRO-0/1/2 only (ZeRO-3
    saves empty placeholders there); `UnsupportedCheckpointError` otherwise."""
    if index.kind != "autotp" or index.stage not in (0, 1, 2):
        raise UnsupportedCheckpointError(f"{index.layout}: no module weights to join")
    locals_: list[dict[str, ModelTensor]] = []
    for rank in index.ranks:
        module = rank.model_states[0].get("module") or {}
        params = {p.name for p in rank.params if not p.frozen}
        locals_.append({n: ModelTensor(n, ref.shape, ref.dtype, "param", (whole_run(ref, n),))
                        for n, ref in module.items() if n in params and isinstance(ref, TensorRef)})
    return {t.name: t.runs for t in _joined(index, locals_)}


def rejoined(index: ModelParallelCheckpoint, ranks: Sequence[Any]) -> ModelParallelCheckpoint:
    """`index` with `ranks` (a `ZeroCheckpoint` per tensor-parallel rank: its files read another way,
    e.g. a ZeRO-0 rank's named optimizer state as partitions, `reshard.stage.zero0_partitioned`) in place
    of its own, the full tensors joined again from theirs by the same affine maps."""
    joined = replace(index, ranks=tuple(ranks))
    return replace(joined, tensors=_joined(joined, [{t.name: t for t in rank.model_tensors()} for rank in ranks]))


def _joined(index: ModelParallelCheckpoint, locals_: Sequence[Mapping[str, ModelTensor]]) -> tuple[ModelTensor, ...]:
    """The full tensors the tensor-parallel ranks' `locals_` make by `index`'s affine maps."""
    info = index.ranks[0].model_states[0].get(UC_INFO) or {}
    maps = _MapLookup(info)
    out = []
    for name, first in locals_[0].items():
        holdings, shape, rows = _holdings(name, first, locals_, maps, info, index.tp,
                                          basename(index.ranks[0].model_file(0)))
        tensor, _ = join(name, shape, first.kind, holdings, lambda mp, n: locals_[mp][n], rows=rows)
        out.append(tensor)
    return tuple(out)


def _describe(topology: Topology, stage: int) -> str:
    return Topology(topology.kind, stage, topology.dp, tp=topology.tp, pp=topology.pp, ep=topology.ep).description


def _notes(ranks: Sequence[Any]) -> tuple[str, ...]:
    if ranks[0].stage != 0:
        return ()
    return (UNNAMED_OPTIMIZER, *([masters_note(ranks[0].precision)] if ranks[0].masters_unnamed else []))


def _uc_info(st: Inspection, listing: Listing, heads: Sequence[Mapping[str, Any]], label: Any) -> Mapping[str, Any]:
    """Rank 0's `universal_checkpoint_info`, which every tensor-parallel rank must record identically."""
    info = heads[0].get(UC_INFO)
    if not isinstance(info, Mapping) or not isinstance(info.get("affine_map"), Mapping) \
            or not isinstance(info["affine_map"].get("params"), Mapping):
        st.add("unsupported-layout", f"{listing.model0_uri} records no affine map in {UC_INFO}; ckptflow does not "
               "know how its parameters are split", file=listing.model0_uri)
        return {}
    version = info["affine_map"].get("version", AFFINE_MAP_VERSION)
    if not isinstance(version, int) or version > AFFINE_MAP_VERSION:
        st.add("unsupported-layout", f"{listing.model0_uri} records affine map format version {excerpt(version)}; "
               f"ckptflow reads version {AFFINE_MAP_VERSION}: convert it with the DeepSpeed that wrote it "
               "(deepspeed.checkpoint.ds_to_universal)", file=listing.model0_uri)
    for mp, head in enumerate(heads[1:], start=1):
        if head.get(UC_INFO) != info:
            st.add("ranks-disagree", f"{label(mp)} records another {UC_INFO} than {label(0)} in "
                   f"{listing.model_uri(mp)}; every tensor-parallel rank saves the same one: the folder mixes saves, "
                   "re-copy it from one save", file=listing.model_uri(mp))
    return info


class _MapLookup:
    """A parameter's affine-map entry: by its exact anchored pattern, else by matching the recorded
    patterns (as DeepSpeed does, `re.match`; more than one match is refused)."""

    def __init__(self, info: Mapping[str, Any]) -> None:
        self.params: Mapping[str, Any] = info["affine_map"]["params"]

    def __call__(self, name: str) -> Mapping[str, Any] | None:
        exact = self.params.get("^" + re.escape(name) + "$")
        if isinstance(exact, Mapping):
            return exact
        found = [p for p in self.params if isinstance(p, str) and _matches(p, name)]
        if len(found) > 1:
            raise ValueError(
                f"more than one affine map pattern matches it ({excerpt(', '.join(map(str, found[:3])), 120)})"
            )
        return self.params[found[0]] if found else None


def _matches(pattern: str, name: str) -> bool:
    if len(pattern) > MAX_PATTERN:
        raise ValueError(
            f"a recorded pattern is {len(pattern)} characters long; ckptflow matches at most {MAX_PATTERN}"
        )
    try:
        return re.match(pattern, name) is not None
    except re.error as exc:
        raise ValueError(f"the recorded pattern {excerpt(pattern, 80)} is not a regular expression ({exc})") from None


MALFORMED = ("the file is damaged, or was written by a DeepSpeed whose affine maps ckptflow does not read: convert "
             "it with that DeepSpeed (deepspeed.checkpoint.ds_to_universal)")


def _holdings(name: str, first: ModelTensor, locals_: Sequence[Mapping[str, ModelTensor]], maps: _MapLookup,
              info: Mapping[str, Any], tp: int, where: str) -> tuple[list[Holding], tuple[int, ...], int | None]:
    """Which pieces of `name` each rank holds (from its affine map, read from file `where`), its full
    shape, and the rows to keep."""
    entry = maps(name)
    if entry is None:
        if first.kind == "buffer" and all(loc[name].shape == first.shape for loc in locals_):
            whole = Piece(first.shape, 0, row_major(first.shape), 0, row_major(first.shape))
            return [Holding(mp, name, (whole,)) for mp in range(tp)], first.shape, None
        raise UnsupportedCheckpointError(
            f"the checkpoint does not say how it is split over the {tp} tensor-parallel ranks "
            f"(no entry in {UC_INFO}.affine_map of {where}); ckptflow does not guess"
        )
    try:
        shape = tuple(int(d) for d in entry["logical_shape"])
        ranks = {int(r): v for r, v in entry["ranks"].items()}
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as error:
        raise UnsupportedCheckpointError(f"its affine map entry in {where} is malformed ({excerpt(entry)})",
                                         hint=MALFORMED) from error
    if sorted(ranks) != list(range(tp)):
        raise UnsupportedCheckpointError(f"its affine map entry in {where} names tensor-parallel ranks "
                                         f"{excerpt(sorted(ranks))}, expected 0..{tp - 1}", hint=MALFORMED)
    holdings = []
    for mp in range(tp):
        local = locals_[mp][name]
        try:
            shard_shape = tuple(int(d) for d in ranks[mp]["shard_shape"])
            pieces = tuple(_piece(p) for p in ranks[mp]["pieces"])
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as error:
            raise UnsupportedCheckpointError(f"its affine map entry for rank {mp} in {where} is malformed",
                                             hint=MALFORMED) from error
        if shard_shape != local.shape:
            raise UnsupportedCheckpointError(
                f"its affine map gives tensor-parallel rank {mp} a shard of shape {excerpt(list(shard_shape), 120)} "
                f"but the rank saved {list(local.shape)}; the folder mixes saves: re-copy it from one save"
            )
        holdings.append(Holding(mp, name, pieces))
    rows = None
    vocab = info.get("vocabulary_parameter_patterns") or []
    if isinstance(vocab, list) and any(isinstance(p, str) and _matches(p, name) for p in vocab):
        original = info.get("original_vocab_size")
        if isinstance(original, int) and not isinstance(original, bool) and shape and original != shape[0]:
            rows = original
    return holdings, shape, rows


def _piece(raw: Mapping[str, Any]) -> Piece:
    scale = raw.get("scale", 1.0)
    if scale not in (None, 1, 1.0):
        raise UnsupportedCheckpointError(
            f"a piece holds the tensor scaled by {excerpt(scale)} (a replicated row-parallel bias divided by the "
            "world size); ckptflow has not verified reading scaled pieces: convert this checkpoint with "
            "deepspeed.checkpoint.ds_to_universal"
        )
    source_offset, source_strides = raw["source"]
    dest_offset, dest_strides = raw["dest"]
    return Piece(tuple(int(d) for d in raw["shape"]), int(source_offset), tuple(int(s) for s in source_strides),
                 int(dest_offset), tuple(int(s) for s in dest_strides))


def _tied(st: Inspection, ranks: Sequence[Any], label: Any) -> dict[str, str]:
    """Tied aliases (e.g. `lm_head.weight` -> `model.embed_tokens.weight`): DeepSpeed records them on global
    rank 0 only; other ranks show them as shared storage. Every rank must agree where it says anything."""
    tied = dict(ranks[0].tied)
    for mp, index in enumerate(ranks[1:], start=1):
        for alias, owner in index.tied.items():
            if tied.setdefault(alias, owner) != owner:
                st.add("ranks-disagree", f"{label(mp)} ties {excerpt(alias)} to {excerpt(owner)} but {label(0)} ties "
                       f"it to {excerpt(tied[alias])}; re-copy the tag folder from one save")
    return tied


__all__ = ["module_runs", "read_autotp", "rejoined"]
