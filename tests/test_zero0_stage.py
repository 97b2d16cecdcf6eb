"""A ZeRO-0 checkpoint at ZeRO-1, 2 or 3 (issue 24): naming its optimizer state, and the refusals.

ZeRO-0 saves its optimizer state by index; `readers.zero0.named_groups` names it by the one way the
module's parameters, in order, fit the param groups (by the shapes of the Adam moments in an fp32 run,
by the sizes of FP16_Optimizer's flat masters in bf16). Pure tests over made-up indexes here, and over
the extra fixtures' ZeRO-0 checkpoints without a DeepSpeed launch: the step each target group carries.
That DeepSpeed loads the output natively, holding the source's fp32 masters and moments bit for bit,
and saves the same files again, is `tests/test_model_parallel_reshard.py`'s (its ZeRO-0 stage cases).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from ckptflow.errors import UnsupportedCheckpointError
from ckptflow.formats.deepspeed import load_index
from ckptflow.formats.deepspeed.model import ModelTensor, ZeroCheckpoint
from ckptflow.formats.deepspeed.readers.zero0 import Zero0Checkpoint, named_groups
from ckptflow.formats.deepspeed.runs import whole_run
from ckptflow.formats.torch.tensorref import TensorRef
from ckptflow.reshard import Target, reshard, shapes_at
from ckptflow.reshard.plan import plan_reshard


def _ref(key: str, shape: tuple[int, ...], dtype: str = "float32") -> TensorRef:
    stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return TensorRef("mem://ckpt/global_step1/mp_rank_00_model_states.pt", key, dtype, shape, stride, 0,
                     math.prod(shape), 0)


def _zero0(weights: Sequence[tuple[str, tuple[int, ...]]], groups: Sequence[Sequence[str]], *,
           moments: Mapping[int, tuple[int, ...]] | None = None, precision: str = "fp32",
           config: Mapping[str, Any] | None = None) -> Zero0Checkpoint:
    """A ZeRO-0 index of `weights` whose optimizer's param groups held the weights named in `groups`.
    fp32: one state per index, numbered as torch numbers them (group by group), its moments of the
    weight's shape unless `moments` says otherwise; 16-bit: one flat master per group (FP16_Optimizer)."""
    dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[precision]
    module = {name: _ref(f"w{i}", shape, dtype) for i, (name, shape) in enumerate(weights)}
    shape_of = dict(weights)
    members = [shape_of[n] for group in groups for n in group]
    ids = [list(range(sum(map(len, groups[:g])), sum(map(len, groups[:g + 1])))) for g in range(len(groups))]
    if precision == "fp32":
        state = {i: {"step": 3, "exp_avg": _ref(f"m{i}", (moments or {}).get(i, members[i])),
                     "exp_avg_sq": _ref(f"v{i}", (moments or {}).get(i, members[i]))} for i in range(len(members))}
        optimizer: dict[str, Any] = {"state": state, "param_groups": [{"lr": 0.1, "params": g} for g in ids]}
    else:
        flat = [sum(math.prod(shape_of[n]) for n in group) for group in groups]
        state = {g: {"step": 4, "exp_avg": _ref(f"m{g}", (n,)), "exp_avg_sq": _ref(f"v{g}", (n,))}
                 for g, n in enumerate(flat)}
        optimizer = {"optimizer_state_dict": {"state": state, "param_groups": [{"lr": 0.1, "params": [g]}
                                                                             for g in range(len(flat))]},
                     "fp32_groups_flat": [_ref(f"flat{g}", (n,)) for g, n in enumerate(flat)], "clip_grad": 1.0}
    model_states = {"module": module, "optimizer": optimizer,
                    "ds_config": {"zero_optimization": {"stage": 0, **(config or {})}}, "ds_version": "0.19.8"}
    tensors = tuple(ModelTensor(n, ref.shape, ref.dtype, "param", (whole_run(ref, n),)) for n, ref in module.items())
    return Zero0Checkpoint(root="mem://ckpt", tag="global_step1", world_size=2, precision=precision, step=1,
                           ds_version="0.19.8", model_file="mem://ckpt/global_step1/mp_rank_00_model_states.pt",
                           tensors=tensors, tied={}, optimizer_params=len(members), optimizer_groups=len(groups),
                           optimizer_step=3, model_states=model_states)


# A decoder block's parameters in module order: matrices decayed, norms not (the usual two groups).
BLOCK = [("embed", (8, 4)), ("q", (4, 4)), ("norm1", (4,)), ("up", (6, 4)), ("norm2", (4,)), ("head", (8, 4))]
DECAY = [["embed", "q", "up", "head"], ["norm1", "norm2"]]


def test_the_decay_split_is_named_by_the_moments_shapes() -> None:
    index = _zero0(BLOCK, DECAY)
    named = named_groups(index)
    assert not isinstance(named, str), named
    groups, frozen = named
    assert [g.params for g in groups] == [("embed", "q", "up", "head"), ("norm1", "norm2")]
    assert frozen == () and [g.step for g in groups] == [3, 3]
    assert [m.shape for m in groups[0].masters] == [(32,), (16,), (24,), (32,)]  # the module's weights, 1-D


def test_bf16_groups_are_named_by_the_sizes_of_their_flat_masters() -> None:
    index = _zero0(BLOCK, DECAY, precision="bf16")
    named = named_groups(index)
    assert not isinstance(named, str), named
    assert [g.params for g in named[0]] == [("embed", "q", "up", "head"), ("norm1", "norm2")]


@pytest.mark.parametrize("weights,groups,kwargs,why", [
    # two 4x4 matrices, one per group: either could be either
    ([("a", (4, 4)), ("b", (4, 4))], [["a"], ["b"]], {},
     "taking them in the module's order fits them in more than one way (the shapes of its Adam moments, 0 left out)"),
    # a moment whose shape no parameter has
    (BLOCK, DECAY, {"moments": {1: (5, 5)}},
     "taking them in the module's order fits none of them (the shapes of its Adam moments, 0 left out)"),
    # flat masters of sizes several choices of parameters add up to
    ([("a", (4,)), ("b", (4,)), ("c", (8,))], [["a", "b"], ["c"]], {"precision": "bf16"},
     "taking them in the module's order fits them in more than one way (the sizes of its flat fp32 masters, 0 left out)"),
])
def test_an_optimizer_state_that_does_not_name_one_way_is_refused(weights: Any, groups: Any, kwargs: Any,
                                                                  why: str) -> None:
    index = _zero0(weights, groups, **kwargs)
    assert named_groups(index) == f"ZeRO-0 saves which parameters each of its 2 param groups holds nowhere, and {why}"
    with pytest.raises(UnsupportedCheckpointError) as info:
        plan_reshard(index, Target(world_size=2, stage=2))
    assert str(info.value).startswith(
        f"cannot reshard mem://ckpt/global_step1 (ZeRO-0 dp2 (2 ranks)) to 2 ranks, ZeRO-2: ZeRO-0 saves which "
        f"parameters each of its 2 param groups holds nowhere, and {why}; ckptflow can write no shape of it at 2 ranks")


def test_a_parameter_left_out_of_every_group_is_frozen() -> None:
    """One weight fewer in the optimizer than in the module: the one that fits is frozen at the target."""
    named = named_groups(_zero0(BLOCK, [["embed", "q", "up"], ["norm1", "norm2"]]))
    assert not isinstance(named, str), named
    assert named[1] == ("head",)


def test_fp16_zero0_is_refused() -> None:
    index = _zero0(BLOCK, DECAY, precision="fp16")
    why = ("it was trained in fp16, and ckptflow does not carry FP16_Optimizer's dynamic loss scaler to another stage "
           "yet")
    listed = dict(shapes_at(index, 2))
    assert [listed[s] for s in listed if s.stage in (1, 2, 3)] == [why] * 3
    with pytest.raises(UnsupportedCheckpointError) as info:
        plan_reshard(index, Target(world_size=2, stage=3))
    assert f"to 2 ranks, ZeRO-3: {why}; ckptflow can write no shape of it at 2 ranks" in str(info.value)


def test_round_robin_gradients_flatten_the_zero0_groups_round_robin() -> None:
    """With `round_robin_gradients` DeepSpeedZeroOptimizer flattens each group round-robin over the ranks,
    and records the fragment addresses in the optimizer's own order (`partition.recorded_slices`)."""
    plan = plan_reshard(_zero0(BLOCK, DECAY, config={"round_robin_gradients": True}), Target(world_size=2, stage=2))
    assert [[n for n, _ in flat] for flat in plan.flat_shapes] == [["embed", "up", "q", "head"], ["norm1", "norm2"]]
    # 104 elements in group 0: flat 104, partitions of 52 (embed 0-32, up 32-56 | q 56-72, head 72-104);
    # the addresses run embed 0-32, q 32-48, up 48-72, head 72-104 as DeepSpeed records them.
    assert [u.slice_mappings[0] for u in plan.units] == [
        (("embed", 0, 32), ("q", 32, 16), ("up", 48, 4)), (("up", 0, 20), ("head", 20, 32))]
    assert [[(c.src_rank, c.src_offset, c.dst_offset, c.numel) for c in u.flats[0].copies] for u in plan.units] == [
        [(0, 0, 0, 32), (2, 0, 32, 20)], [(2, 20, 0, 4), (1, 0, 4, 16), (3, 0, 20, 32)]]


def _steps(index: ZeroCheckpoint) -> list[Any]:
    osd = index.optim_states[0]["optimizer_state_dict"]
    base = osd.get("base_optimizer_state") or osd["optimizer_state_dict"]
    return [base["state"][g]["step"] for g in sorted(base["state"])]


@pytest.mark.parametrize("name,stage,step", [("zero-dp2-z0-fp32", 3, 3), ("zero-dp2-z0-bf16", 1, 4)])
def test_each_group_carries_the_source_step(name: str, stage: int, step: int, tmp_path: Path,
                                            parallel_extra_fixtures: Mapping[str, Any]) -> None:
    """FusedAdam advances only the step of a group's last parameter at ZeRO-0 (fp32: 3 trained steps);
    FP16_Optimizer's base optimizer steps once more when it is built (bf16: 4). Each target group has it."""
    fixture = parallel_extra_fixtures[name]
    result = reshard(str(fixture.dir), str(tmp_path / "out"), world_size=3, stage=stage, workers=2)
    assert (str(result.source_shape), str(result.shape)) == ("ZeRO-0 dp2 (2 ranks)", f"ZeRO-{stage} dp3 (3 ranks)")
    out = load_index(str(tmp_path / "out"))
    assert isinstance(out, ZeroCheckpoint) and out.stage == stage
    assert [_steps(replace(out, optim_states=(out.optim_states[r],))) for r in range(3)] == [[step, step]] * 3


def test_the_shapes_of_a_zero0_checkpoint(parallel_extra_fixtures: Mapping[str, Any]) -> None:
    index = load_index(str(parallel_extra_fixtures["zero-dp2-z0-fp32"].dir))
    assert [(str(s), reason) for s, reason in shapes_at(index, 4)] == [
        ("ZeRO-0 dp4 (4 ranks)", "nothing to reshard: DeepSpeed loads a ZeRO-0 checkpoint as it is at any "
                                 "data-parallel size"),
        ("ZeRO-1 dp4 (4 ranks)", None), ("ZeRO-2 dp4 (4 ranks)", None), ("ZeRO-3 dp4 (4 ranks)", None)]
