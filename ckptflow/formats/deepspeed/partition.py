"""DeepSpeed's ZeRO partition arithmetic at any world size, as pure functions over integers.

Each function mirrors one piece of DeepSpeed 0.19.8 and names it; nothing here reads a file:

- ZeRO-1/2 (`DeepSpeedZeroOptimizer.__init__`): a param group's parameters, optionally reordered
  round-robin over the ranks (`round_robin_gradients`) and each followed by alignment padding
  (`parameter_alignment`, all but the last), are flattened and the whole padded to a multiple of
  2 * world_size elements, then cut into world_size equal partitions. A rank records as
  `group_paddings` the part of its partition past the parameters, and saves its fp32 partition
  without it.
- bf16 with fp32 gradient accumulation (`BF16_Optimizer`): the same flat group without per-parameter
  padding; ranks save their whole partition and the last rank records all the padding.
- ZeRO-3 (`partition_parameters._partition_param`, `stage3._create_fp16_sub_groups`): every
  parameter is cut into ceil(numel / world_size) pieces, the last ones zero-padded; a rank's flat
  group is its pieces of the group's parameters in order, split into sub-groups of about
  `sub_group_size` elements.

`moves` turns two layouts of the same parameters into the copies that build one target rank's
partition from the source ranks' partitions.

Expert parallelism (AutoEP, `deepspeed.moe`) partitions some param groups over a subset of the ranks:
a group named `ep_size_N` holds each expert-parallel rank's own experts, partitioned over that rank's
expert data-parallel group. `partition_ranks` names those ranks (DeepSpeed's default topology,
`groups._create_expert_and_data_parallel`: expert-parallel groups are consecutive ranks, so global rank
r is expert-parallel rank r % N and partition r // N).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# Which DeepSpeed optimizer laid a checkpoint's partitions out.
ZERO = "zero"  # DeepSpeedZeroOptimizer (ZeRO-1/2)
BF16 = "bf16"  # BF16_Optimizer (bf16 ZeRO-1 with fp32 gradient accumulation)
ZERO3 = "zero3"  # DeepSpeedZeroOptimizer_Stage3
ZERO0 = "zero0"  # a ZeRO-0 optimizer: a torch optimizer, or FP16_Optimizer in a 16-bit run

NCCL_START_ALIGNMENT = 2  # DeepSpeedZeroOptimizer.nccl_start_alignment_factor
DEFAULT_SUB_GROUP_SIZE = 1_000_000_000  # DeepSpeedZeroConfig.sub_group_size


@dataclass(frozen=True, kw_only=True, slots=True)
class Copy:
    """`numel` elements from offset `src_offset` of source rank `src_rank`'s flat partition `src_flat`
    to offset `dst_offset` of one target rank's flat partition. (A 1024 -> 768 reshard of a 405B
    ZeRO-3 checkpoint plans two million: slots halve what each weighs.) With `rows` > 1 the elements
    are that many equal rows, row i landing at `dst_offset + i * stride` (a row-parallel shard merged
    into its full tensor)."""

    src_rank: int
    src_flat: int
    src_offset: int
    dst_offset: int
    numel: int
    rows: int = 1
    stride: int = 0


@dataclass(frozen=True, kw_only=True)
class Extent:
    """Where one parameter's first element sits in the source and in the target ZeRO-1/2 flat group."""

    numel: int
    src: int
    dst: int


def partition_ranks(world_size: int, ep: int, ep_rank: int = 0) -> tuple[int, ...]:
    """The global ranks, in partition order, over which expert-parallel rank `ep_rank`'s copy of a param
    group is partitioned when the group is split over `ep` expert-parallel ranks (1: a dense group,
    partitioned over every rank)."""
    if ep < 1 or world_size % ep or not 0 <= ep_rank < ep:
        raise ValueError(f"{world_size} ranks do not split into {ep} expert-parallel ranks (rank {ep_rank})")
    return tuple(range(ep_rank, world_size, ep))


def round_robin_order(count: int, world_size: int) -> tuple[int, ...]:
    """`_round_robin_reorder`: the original index of the parameter at each flattened position."""
    return tuple(i for j in range(min(world_size, count)) for i in range(j, count, world_size))


def zero12_padded(numel: int, world_size: int) -> int:
    """A ZeRO-1/2 flat group of `numel` elements padded to a multiple of `NCCL_START_ALIGNMENT *
    world_size`, so it cuts into equal partitions whose starts stay aligned."""
    align = NCCL_START_ALIGNMENT * world_size
    return align * math.ceil(numel / align)


def param_alignment(element_size: int, enabled: bool) -> int:
    """Elements each parameter is aligned to inside a ZeRO-1/2 flat group (`parameter_alignment`)."""
    return 16 // math.gcd(16, element_size) if enabled else 1


@dataclass(frozen=True, kw_only=True)
class Zero12Layout:
    """One ZeRO-1/2 param group at one world size, parameters in flattening order."""

    world_size: int
    numels: tuple[int, ...]
    offsets: tuple[int, ...]
    param_paddings: tuple[int, ...]
    flat_numel: int
    group_paddings: tuple[int, ...]
    saved: tuple[int, ...]

    @property
    def partition(self) -> int:
        return self.flat_numel // self.world_size


def zero12_layout(numels: Sequence[int], world_size: int, *, alignment: int = 1,
                  bf16_optimizer: bool = False) -> Zero12Layout:
    """The flat group DeepSpeed builds from parameters of `numels` elements (in flattening order)."""
    if world_size < 1:
        raise ValueError(f"world size must be at least 1, got {world_size}")
    offsets, paddings, pos = [], [], 0
    for i, numel in enumerate(numels):
        offsets.append(pos)
        pos += numel
        pad = 0 if i == len(numels) - 1 or bf16_optimizer else (-pos) % alignment
        paddings.append(pad)
        pos += pad
    padded = pos
    flat = zero12_padded(padded, world_size)
    part = flat // world_size
    if bf16_optimizer:
        group_paddings = tuple(flat - sum(numels) if r == world_size - 1 else 0 for r in range(world_size))
        saved = (part,) * world_size
    else:
        group_paddings = tuple(
            part if padded <= r * part else (r + 1) * part - padded if padded < (r + 1) * part else 0
            for r in range(world_size)
        )
        saved = tuple(part - p for p in group_paddings)
    return Zero12Layout(world_size=world_size, numels=tuple(numels), offsets=tuple(offsets),
                        param_paddings=tuple(paddings), flat_numel=flat, group_paddings=group_paddings, saved=saved)


def zero12_fragments(layout: Zero12Layout, rank: int) -> tuple[tuple[int, int, int], ...]:
    """(parameter index, start in the rank's partition, numel) for each parameter overlapping `rank`'s
    partition, in flattening order (DeepSpeed's `param_slice_mappings`)."""
    lo, hi = rank * layout.partition, (rank + 1) * layout.partition
    out = []
    for i, (off, numel) in enumerate(zip(layout.offsets, layout.numels)):
        a, b = max(off, lo), min(off + numel, hi)
        if a < b:
            out.append((i, a - lo, b - a))
    return tuple(out)


def recorded_slices(numels: Sequence[int], offsets: Sequence[int], partition: int, rank: int,
                    order: Sequence[int] | None = None) -> tuple[tuple[int, int, int], ...]:
    """DeepSpeed 0.19.8's `param_slice_mappings` of `rank`'s partition of a ZeRO-1/2 flat group whose
    parameters (in flattening order) have `numels` elements and start at `offsets`: (parameter
    position, start in the partition, numel) for each parameter it places there, in the optimizer's
    original order `order` (flattening positions; None: the flattening order itself). It places a
    parameter at its real offset when some parameter is padded, and otherwise at the running sum of
    the sizes in the original order, which with `round_robin_gradients` (flattened in another order,
    `round_robin_order`) is not where its elements are: the fragment addresses it records then point
    elsewhere (`_init_lp_to_hp_mapping`); checkpoints record them so, and loading does not use them."""
    order = range(len(numels)) if order is None else order
    padded = any(off != sum(numels[:i]) for i, off in enumerate(offsets))
    lo, hi = rank * partition, (rank + 1) * partition
    out, running = [], 0
    for pos in order:
        at = offsets[pos] if padded else running
        running += numels[pos]
        a, b = max(at, lo), min(at + numels[pos], hi)
        if a < b:
            out.append((pos, a - lo, b - a))
    return tuple(out)


def original_order(count: int, world_size: int, round_robin: bool) -> tuple[int, ...]:
    """The flattening positions of a ZeRO-1/2 group's `count` parameters in the optimizer's original
    order: with `round_robin` the inverse of `round_robin_order` at `world_size`, else 0, 1, 2, ..."""
    if not round_robin:
        return tuple(range(count))
    where = {i: pos for pos, i in enumerate(round_robin_order(count, world_size))}
    return tuple(where[i] for i in range(count))


def zero3_piece(numel: int, world_size: int) -> int:
    """Elements of each rank's piece of a ZeRO-3 parameter (`_aligned_size // world_size`)."""
    return math.ceil(numel / world_size)


def zero3_real(numel: int, world_size: int, rank: int) -> int:
    """Elements of rank `rank`'s ZeRO-3 piece of a parameter that belong to it; the rest is padding."""
    piece = zero3_piece(numel, world_size)
    return max(0, min(piece, numel - rank * piece))


def zero3_sub_groups(
    pieces: Sequence[int], sub_group_size: int = DEFAULT_SUB_GROUP_SIZE
) -> tuple[tuple[int, ...], ...]:
    """`_create_fp16_sub_groups`: parameter indices of each sub-group, from per-rank piece sizes."""
    if sub_group_size is None or sub_group_size >= sum(pieces):
        return (tuple(range(len(pieces))),)
    groups, current, size = [], [], 0
    for i, piece in enumerate(pieces):
        current.append(i)
        size += piece
        if size >= sub_group_size or i == len(pieces) - 1:
            groups.append(tuple(current))
            current, size = [], 0
    return tuple(groups)


def moves(extents: Sequence[Extent], src_partition: int, dst_partition: int, dst_rank: int,
          src_flat: int = 0) -> tuple[Copy, ...]:
    """The copies that fill target rank `dst_rank`'s partition (`dst_partition` elements, positions
    [dst_rank * dst_partition, ...)) from source partitions of `src_partition` elements each.

    Adjacent copies that are contiguous on both sides are merged, so an unchanged parameter order
    costs one copy per source partition a target partition overlaps.
    """
    lo, hi = dst_rank * dst_partition, (dst_rank + 1) * dst_partition
    out: list[Copy] = []
    for ext in sorted(extents, key=lambda e: e.dst):
        a, b = max(ext.dst, lo), min(ext.dst + ext.numel, hi)
        while a < b:
            src = ext.src + (a - ext.dst)
            rank, offset = divmod(src, src_partition)
            take = min(b - a, src_partition - offset)
            prev = out[-1] if out else None
            if (prev is not None and prev.src_rank == rank and prev.src_offset + prev.numel == offset
                    and prev.dst_offset + prev.numel == a - lo):
                out[-1] = Copy(src_rank=rank, src_flat=src_flat, src_offset=prev.src_offset,
                               dst_offset=prev.dst_offset, numel=prev.numel + take)
            else:
                out.append(Copy(src_rank=rank, src_flat=src_flat, src_offset=offset, dst_offset=a - lo, numel=take))
            a += take
    return tuple(out)


def zero3_moves(numels: Sequence[int], src_world_size: int, dst_world_size: int, dst_rank: int,
                *, src_offsets: Sequence[int], dst_offsets: Sequence[int], src_flat: int = 0) -> tuple[Copy, ...]:
    """The copies that fill target rank `dst_rank`'s flat group from the source ranks' flat groups.

    Parameter i has `numels[i]` elements; its piece starts at `src_offsets[i]` in every source rank's
    flat group and at `dst_offsets[i]` in every target rank's. Padding is left out (zero). Copies
    contiguous on both sides are merged. (Planning a whole reshard calls this once per target rank
    and sub-group over every parameter, millions of steps at 405B: it works on plain integers.)
    """
    moves: list[list[int]] = []  # [src_rank, src_offset, dst_offset, numel]
    last: list[int] | None = None
    for numel, s_off, d_off in zip(numels, src_offsets, dst_offsets):
        sp, dp = -(-numel // src_world_size), -(-numel // dst_world_size)  # zero3_piece
        a = dst_rank * dp
        b = min(numel, a + dp)
        base = d_off - a
        while a < b:
            rank, within = divmod(a, sp)
            take = min(b - a, sp - within)
            src = s_off + within
            if last is not None and last[0] == rank and last[1] + last[3] == src and last[2] + last[3] == base + a:
                last[3] += take
            else:
                last = [rank, src, base + a, take]
                moves.append(last)
            a += take
    return tuple(Copy(src_rank=r, src_flat=src_flat, src_offset=s, dst_offset=d, numel=n) for r, s, d, n in moves)


def piece_offsets(numels: Sequence[int], world_size: int) -> tuple[int, ...]:
    """Start of each parameter's piece in a ZeRO-3 rank's flat group of these parameters."""
    out, pos = [], 0
    for numel in numels:
        out.append(pos)
        pos += zero3_piece(numel, world_size)
    return tuple(out)


__all__ = [
    "BF16", "ZERO", "ZERO0", "ZERO3", "Copy", "Extent", "Zero12Layout", "moves", "param_alignment", "partition_ranks",
    "original_order", "piece_offsets", "recorded_slices", "round_robin_order", "zero12_fragments", "zero12_layout",
    "zero12_padded", "zero3_moves",
    "zero3_piece", "zero3_real", "zero3_sub_groups",
]
