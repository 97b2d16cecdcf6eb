"""DeepSpeed's size cut of expert param groups, at another expert-parallel degree. Pure.

DeepSpeed 0.19.8 builds a MoE model's optimizer groups with
`deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer` (the engine calls it with
the default `max_group_size`, 178,956,971): each original param group's expert parameters become a
group named `ep_size_N` (`moe: True`, the original's hyper-parameters), appended after the dense
groups, and that group is cut, in its parameters' order, wherever the running count of rank-local
elements would pass the limit (a parameter larger than the limit sits alone; when the first one is,
DeepSpeed makes an empty group before it). Rank-local sizes change with the degree (AutoEP's stacked
weights hold E/N experts; deepspeed.moe's group holds E/N local experts per layer), so the cut does too.

The limit is not recorded in the checkpoint. `recut` takes DeepSpeed's default when it reproduces the
source's cuts; otherwise the interval of limits that does (a caller of the function passed another
value), and cuts the target only where every limit in that interval cuts it alike. Pieces of one
original group are recognised as consecutive expert groups with the same hyper-parameters.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# `split_params_into_different_moe_groups_for_optimizer`'s default `max_group_size`.
MAX_MOE_GROUP_SIZE = 178_956_971

DSMOE_EXPERT = re.compile(r"^(?P<layer>.+\.deepspeed_moe\.experts\.deepspeed_experts)\.(?P<id>\d+)\.(?P<rest>.+)$")


def cut(numels: Sequence[int], limit: int | float) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """DeepSpeed's cut of one expert group whose parameters have `numels` elements, at `limit`: the
    parameter count of each piece (a leading 0: the empty group DeepSpeed makes when the first
    parameter alone passes the limit), and every running size it compared with the limit."""
    pieces, compared = [], []
    size = count = 0
    for n in numels:
        compared.append(size + n)
        if size + n <= limit:
            size, count = size + n, count + 1
        else:
            pieces.append(count)
            size, count = n, 1
    if count:
        pieces.append(count)
    return tuple(pieces), tuple(compared)


def is_expert(group: Any) -> bool:
    """An expert param group (`ep_size_N`, `moe: True`), at any degree, 1 included."""
    return bool(group.ep > 1 or group.hyper.get("moe"))


def _key(group: Any) -> str:
    return repr(sorted((k, repr(v)) for k, v in group.hyper.items() if k != "params"))


def expert_runs(zero: Any) -> tuple[tuple[int, ...], ...]:
    """The indices of the expert param groups of `zero`, one tuple per original group: consecutive
    expert groups with the same hyper-parameters are the pieces of one that DeepSpeed cut."""
    runs: list[list[int]] = []
    for g, group in enumerate(zero.groups):
        if not is_expert(group):
            continue
        if runs and runs[-1][-1] == g - 1 and _key(zero.groups[g - 1]) == _key(group):
            runs[-1].append(g)
        else:
            runs.append([g])
    return tuple(map(tuple, runs))


@dataclass(frozen=True)
class Recut:
    """The target's cut: per run (`expert_runs`), the parameter count of each target group; `limit`,
    the size limit it was cut at; `why`, set instead when ckptflow cannot tell the target's cut."""

    pieces: tuple[tuple[int, ...], ...] = ()
    limit: int | float = MAX_MOE_GROUP_SIZE
    why: str | None = None


def recut(source: Sequence[Sequence[Sequence[int]]], target: Sequence[Sequence[int]], ep: int) -> Recut:
    """How DeepSpeed cuts the target's expert groups: `source` per run the element counts of each piece's
    parameters as saved, `target` per run the element counts of its parameters at degree `ep`, in order."""
    lo: int = 0
    hi: int | float = float("inf")
    for pieces in source:
        if not pieces or not pieces[0]:
            continue
        lo = max(lo, pieces[0][0])
        for i, piece in enumerate(pieces):
            if len(piece) > 1:
                lo = max(lo, sum(piece))
            if i + 1 < len(pieces) and pieces[i + 1]:
                hi = min(hi, sum(piece) + pieces[i + 1][0] - 1)
    saved = tuple(tuple(len(p) for p in pieces) for pieces in source)
    if lo > hi or any(cut([n for p in pieces for n in p], lo)[0] != counts for pieces, counts in zip(source, saved)):
        return Recut(why="its expert param groups are not cut as DeepSpeed's "
                         "split_params_into_different_moe_groups_for_optimizer cuts them at any size limit")
    if lo <= MAX_MOE_GROUP_SIZE <= hi:
        lo = hi = MAX_MOE_GROUP_SIZE
    out = []
    for numels in target:
        counts, compared = cut(numels, lo)
        if any(lo < v <= hi for v in compared):
            return Recut(why=_unknown(lo, hi, ep))
        if counts and counts[0] == 0:
            return Recut(why=f"at ep{ep} its first expert parameter alone ({numels[0]:,} elements) passes the size "
                             f"limit of an expert param group ({lo:,}), where DeepSpeed makes an empty param group")
        out.append(counts)
    return Recut(pieces=tuple(out), limit=lo)


def _unknown(lo: int, hi: int | float, ep: int) -> str:
    """Why the target's cut is unknown: the source's cuts leave the limit in [lo, hi], which is not
    DeepSpeed's default, and limits in that range cut the target differently."""
    default = f"DeepSpeed's default size limit of an expert param group ({MAX_MOE_GROUP_SIZE:,} elements)"
    if hi == float("inf"):
        known = (f"its expert param groups hold up to {lo:,} elements uncut, past {default}, so they were built with "
                 f"a larger limit or none")
    else:
        known = f"its expert param groups were cut at a size limit from {lo:,} to {int(hi):,} elements, not {default}"
    return f"{known}, which the checkpoint does not record, and the limits in that range cut them differently at ep{ep}"


def target_numels(zero: Any, run: Sequence[int], ep: int) -> tuple[int, ...] | None:
    """The element counts of the parameters of the expert groups `run` of `zero` at degree `ep`, in
    DeepSpeed's order (None where they are not AutoEP's stacked weights or deepspeed.moe's local
    experts, which `experts.at_degree` refuses): AutoEP's stacked weights hold E/ep experts each;
    deepspeed.moe's group holds locals 0 .. E/ep - 1 of each layer, each with local 0's parameters."""
    by_name = zero.param_by_name
    names = [n for g in run for n in zero.groups[g].params]
    src_ep = zero.groups[run[0]].ep
    matches = [DSMOE_EXPERT.match(n) for n in names]
    if names and all(m is not None for m in matches):
        layers: dict[str, dict[int, list[int]]] = {}
        for m, name in zip(matches, names):
            assert m is not None
            layers.setdefault(m.group("layer"), {}).setdefault(int(m.group("id")), []).append(by_name[name].numel)
        out: list[int] = []
        for local in layers.values():
            first = local.get(0, [])
            out += first * (len(local) * src_ep // ep)
        return tuple(out)
    numels = [by_name[n].numel * src_ep for n in names]
    if any(n % ep for n in numels):
        return None
    return tuple(n // ep for n in numels)


def plan_recut(zero: Any, ep: int, target: Sequence[Sequence[int]] | None = None) -> Recut:
    """The cut of `zero`'s expert groups at degree `ep` (`recut`), from the sizes as saved and `target`
    (per run, its parameters' element counts at `ep`; by default `target_numels`'). Nothing to say
    (no pieces, no `why`) where the target's sizes are unknown: `experts.at_degree` refuses those."""
    runs = expert_runs(zero)
    by_name = zero.param_by_name
    source = [[[by_name[n].numel for n in zero.groups[g].params] for g in run] for run in runs]
    numels = list(target) if target is not None else [target_numels(zero, run, ep) for run in runs]
    known = [n for n in numels if n is not None]
    if len(known) != len(runs):
        return Recut()
    return recut(source, known, ep)


__all__ = ["MAX_MOE_GROUP_SIZE", "Recut", "cut", "expert_runs", "plan_recut", "recut", "target_numels"]
