"""Tensor records that lie: a BUILD after a storage reference that changes its key, size or dtype once
it was checked; strides of 0 or -1 and non-contiguous views on flat partitions, moments and frozen
fragments; offsets and sizes outside the storage.

Records are written two ways: `Strided` makes torch.save write any (offset, size, stride), and a
BUILD is spliced into the pickle right after the storage's persistent id (`PickleMap.persid_ends`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tests.hostile import pickleasm as asm
from tests.hostile.corpus import RESHARD, Workspace, kind
from tests.hostile.torchfile import Strided, get_pickle, inspect_pickle, resave, splice

STRIDED = r"(?i)strided|contiguous|stride"

Z2 = "z2-fp32-ws2"


def _flat_key(ws: Workspace) -> str:
    return "fp32_flat_groups" if ws.stage == 3 else "single_partition_of_fp32_groups"


def _edit_partition(ws: Workspace, make: Callable[[Any], Any], which: str = "fp32") -> None:
    """Replace rank 0's fp32 flat partition of group 0 (or a moment of it) with `make(tensor)`."""
    path = ws.optim_file(ws.param(0, lambda r: r.randrange(ws.world_size)))
    group = ws.param(0, lambda r: r.randrange(2))

    def edit(o: dict) -> None:
        osd = o["optimizer_state_dict"]
        if which == "fp32":
            osd[_flat_key(ws)][group] = make(osd[_flat_key(ws)][group])
        else:
            base = osd["optimizer_state_dict"] if ws.stage == 3 else osd["base_optimizer_state"]
            base["state"][group][which] = make(base["state"][group][which])

    resave(path, edit)
    ws.pin(str(path))


def _stride(ws: Workspace, canonical: int) -> int:
    return ws.param(canonical, lambda r: r.choice([0, -1, 2, -2, 3, 10**12, -(10**12)]))


def _strided_view(t: Any, stride: int) -> Strided:
    """A view of `t.numel()` elements with `stride` over a storage big enough to hold it."""
    import torch

    n = t.numel()
    if stride == 0:
        return Strided(t.clone(), 0, (n,), (0,))
    if abs(stride) > 64:  # wider than any real storage: the record lies about its storage
        return Strided(t.clone(), 0 if stride > 0 else n - 1, (n,), (stride,))
    if stride < 0:
        return Strided(torch.cat([t] * -stride), n * -stride - 1, (n,), (stride,))
    return Strided(torch.cat([t] * stride), 0, (n,), (stride,))


@kind(expect=STRIDED, issue="14.5")
def partition_stride_zero(ws: Workspace) -> None:
    """Rank 0's fp32 flat partition (ZeRO-3) saved with stride 0: one element repeated."""
    stride = _stride(ws, 0)
    _edit_partition(ws, lambda t: _strided_view(t, stride))


@kind(expect=STRIDED, issue="14.5")
def partition_stride_negative(ws: Workspace) -> None:
    """Rank 0's fp32 flat partition (ZeRO-3) with stride -1: the storage read backwards."""
    stride = _stride(ws, -1)
    _edit_partition(ws, lambda t: _strided_view(t, stride))


@kind(source=Z2, expect=STRIDED, issue="14.5")
def partition_non_contiguous_zero2(ws: Workspace) -> None:
    """ZeRO-2: rank 0's fp32 partition every other element of a storage twice its size."""
    stride = _stride(ws, 2)
    _edit_partition(ws, lambda t: _strided_view(t, stride))


@kind(expect=STRIDED, issue="14.5")
def moment_stride_zero(ws: Workspace) -> None:
    """Rank 0's exp_avg_sq saved with stride 0."""
    stride = _stride(ws, 0)
    _edit_partition(ws, lambda t: _strided_view(t, stride), which=ws.pick("exp_avg_sq", ["exp_avg", "exp_avg_sq"]))


@kind(expect=STRIDED, issue="14.5")
def frozen_fragment_strided(ws: Workspace) -> None:
    """A frozen parameter's fragment (ZeRO-3 model states) saved with stride 0."""
    path = ws.model_file(ws.param(0, lambda r: r.randrange(ws.world_size)))
    stride = _stride(ws, 0)

    def edit(o: dict) -> None:
        frags = o["frozen_param_fragments"]
        name = ws.pick(next(iter(frags)), list(frags))
        frags[name] = _strided_view(frags[name], stride)

    resave(path, edit)
    ws.pin(str(path))


@kind(expect=r"reaches past its storage", issue="14.5")
def partition_offset_negative(ws: Workspace) -> None:
    """Rank 0's fp32 partition starts at element -1 of its storage."""
    offset = ws.param(-1, lambda r: r.choice([-1, -(2**40), -(2**63)]))
    _edit_partition(ws, lambda t: Strided(t.clone(), offset, (t.numel(),), (1,)))


@kind(expect=r"reaches past its storage", issue="14.5")
def partition_offset_past_end(ws: Workspace) -> None:
    """Rank 0's fp32 partition starts past the end of its storage."""
    _edit_partition(ws, lambda t: Strided(t.clone(), ws.param(t.numel(), lambda r: r.choice([1, t.numel(), 2**62])),
                                          (t.numel(),), (1,)))


@kind(expect=r"(?i)reaches past its storage|negative|size|partition", issue="14.5")
def partition_size_negative(ws: Workspace) -> None:
    """Rank 0's fp32 partition has a negative size (its element count comes out negative)."""
    size = ws.param(-5, lambda r: r.choice([-1, -5, -(2**40)]))
    _edit_partition(ws, lambda t: Strided(t.clone(), 0, (size,), (1,)))


@kind(expect=r"(?i)reaches past its storage|partition|size", issue="14.5")
def partition_size_huge_stride_zero(ws: Workspace) -> None:
    """Rank 0's fp32 partition claims 10**15 elements, all one element (stride 0)."""
    size = ws.param(10**15, lambda r: r.choice([10**9, 10**15, 2**62]))
    _edit_partition(ws, lambda t: Strided(t.clone(), 0, (size,), (0,)))


# -- BUILD after the storage reference ------------------------------------------------------------------


def _build_after_storage(ws: Workspace, slot: str, value: bytes) -> None:
    """Splice `BUILD (None, {slot: value})` right after the persistent id of rank 0's fp32 partition."""
    path = ws.optim_file(0)
    pmap = inspect_pickle(get_pickle(path))
    node: Any = pmap.obj["optimizer_state_dict"][_flat_key(ws)][0]
    key = node.storage.key
    state = asm.tup(asm.none(), asm.dct((asm.string(slot), value)))
    splice(path, pmap.persid_ends[key][0], state + asm.op("BUILD"))
    ws.pin(str(path))


@kind(expect=r"storage|" + r"cannot read its pickle", issue="14.5")
def build_changes_storage_key(ws: Workspace) -> None:
    """BUILD after the fp32 partition's storage reference changes its key to one not in the archive."""
    _build_after_storage(ws, "key", asm.string(ws.param("no-such-storage",
                                                        lambda r: r.choice(["no-such-storage", "1", "../x", ""]))))


@kind(expect=r"(?i)storage|dtype|cannot read its pickle", issue="14.5")
def build_changes_storage_dtype(ws: Workspace) -> None:
    """BUILD changes the partition's storage dtype after its size was checked: to float64 (twice the
    bytes: it would read past its entry) or to a dtype that does not exist."""
    _build_after_storage(ws, "dtype", asm.string(ws.param("float64",
                                                          lambda r: r.choice(["float64", "evil", "int8", "complex128",
                                                                              ""]))))


@kind(expect=r"(?i)storage|cannot read its pickle|reaches past", issue="14.5")
def build_changes_storage_size(ws: Workspace) -> None:
    """BUILD changes the partition's storage element count after it was checked against the archive."""
    _build_after_storage(ws, "numel", asm.integer(ws.param(10**12, lambda r: r.choice([0, -1, 10**12, 2**63]))))


@kind(expect=r"(?i)cannot read its pickle|storage|dtype", issue="14.5")
def build_on_storage_type(ws: Workspace) -> None:
    """BUILD on the storage class right where torch names it (and memoizes it for every later storage):
    its dtype becomes one that does not exist."""
    path = ws.optim_file(0)
    data = get_pickle(path)
    name = b"ctorch\nFloatStorage\n"
    at = data.index(name) + len(name)
    dtype = ws.param("evil", lambda r: r.choice(["evil", "float64", "bfloat16", ""]))
    state = asm.tup(asm.none(), asm.dct((asm.string("dtype"), asm.string(dtype))))
    splice(path, at, state + asm.op("BUILD"))
    ws.pin(str(path))


@kind(source="z1-bf16-ws2", code=(0, 1), expect=r"(?i)exp_avg|optimizer state|moment",
      overrides={RESHARD: {"code": 1}}, issue="new")
def optimizer_state_of_an_unknown_group(ws: Workspace) -> None:
    """Rank 0's Adam moments of param group 1 are filed under group 76 (a one-byte change in the pickle,
    found by the fuzzer as zip-pickle 1038): validate does not miss them, reshard needs them."""
    group = ws.param(76, lambda r: r.choice([2, 76, -1, 10**9]))

    def edit(o: dict) -> None:
        state = o["optimizer_state_dict"]["base_optimizer_state"]["state"]
        state[group] = state.pop(1)

    resave(ws.optim_file(0), edit)
    ws.pin(str(ws.optim_file(0)), RESHARD)
