"""A ZeRO-0 checkpoint at ZeRO-1, 2 or 3 (issue 24): naming its optimizer state, and the refusals.

ZeRO-0 saves its optimizer state by index; `readers.zero0.named_groups` names it by the one way the
module's parameters, in order, fit the param groups (by the shapes of the Adam moments in an fp32 run,
by the sizes of FP16_Optimizer's flat masters in 16 bits), and in fp16 the target's loss scaler carried
from FP16_Optimizer's (`readers.zero0.zero_loss_scaler`). Pure tests over made-up indexes here, and over
the extra fixtures' ZeRO-0 checkpoints without a DeepSpeed launch: the step each target group carries.
That DeepSpeed loads the output natively, holding the source's fp32 masters and moments bit for bit,
and saves the same files again, is `tests/test_model_parallel_reshard.py`'s (its ZeRO-0 stage cases), in fp16
with the loss scale too `tests/test_fp16_zero0.py`'s.
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
from ckptflow.formats.deepspeed.names import DYNAMIC_LOSS_SCALER, LOSS_SCALER
from ckptflow.formats.deepspeed.readers.zero0 import Zero0Checkpoint, named_groups
from ckptflow.formats.deepspeed.runs import whole_run
from ckptflow.formats.torch.tensorref import TensorRef
from ckptflow.formats.torch.unpickler import PickledObject
from ckptflow.reshard import Target, reshard, shapes_at
from ckptflow.reshard.plan import plan_reshard


def _ref(key: str, shape: tuple[int, ...], dtype: str = "float32") -> TensorRef:
    stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return TensorRef("mem://ckpt/global_step1/mp_rank_00_model_states.pt", key, dtype, shape, stride, 0,
                     math.prod(shape), 0)


def _zero0(weights: Sequence[tuple[str, tuple[int, ...]]], groups: Sequence[Sequence[str]], *,
           moments: Mapping[int, tuple[int, ...]] | None = None, precision: str = "fp32",
           config: Mapping[str, Any] | None = None, scale: Mapping[str, Any] | None = None,
           fp16: Mapping[str, Any] | None = None) -> Zero0Checkpoint:
    """A ZeRO-0 index of `weights` whose optimizer's param groups held the weights named in `groups`.
    fp32: one state per index, numbered as torch numbers them (group by group), its moments of the
    weight's shape unless `moments` says otherwise; 16-bit: one flat master per group (FP16_Optimizer),
    with the loss scale state `scale` (fp16; default `SCALE`) and the config's `fp16` section."""
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
        optimizer = {**(SCALE if scale is None else scale), **optimizer} if precision == "fp16" else optimizer
    ds_config: dict[str, Any] = {"zero_optimization": {"stage": 0, **(config or {})}}
    if precision != "fp32":
        ds_config[{"bf16": "bf16", "fp16": "fp16"}[precision]] = {"enabled": True, **(fp16 or {})}
    model_states = {"module": module, "optimizer": optimizer, "ds_config": ds_config, "ds_version": "0.19.8"}
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


def _on_disk(index: Zero0Checkpoint, folder: Path, masters: Sequence[Sequence[float]],
             weights: Mapping[str, Sequence[float]]) -> Zero0Checkpoint:
    """`index` (16-bit) with its flat masters and module weights in a file of `folder`, holding these values (the
    weights rounded to bf16)."""
    import numpy as np
    import torch

    path, blobs, offset = folder / "states.bin", [], 0
    module, flats = dict(index.model_states["module"]), []
    for values in masters:
        flats.append(TensorRef(str(path), f"f{len(flats)}", "float32", (len(values),), (1,), 0, len(values), offset))
        blobs.append(np.asarray(values, dtype=np.float32).tobytes())
        offset += 4 * len(values)
    for name, values in weights.items():
        module[name] = TensorRef(str(path), name, "bfloat16", module[name].shape, module[name].stride, 0,
                                 len(values), offset)
        blobs.append(torch.tensor(values, dtype=torch.bfloat16).view(torch.int16).numpy().tobytes())
        offset += 2 * len(values)
    path.write_bytes(b"".join(blobs))
    optimizer = {**index.model_states["optimizer"], "fp32_groups_flat": flats}
    return replace(index, model_states={**index.model_states, "module": module, "optimizer": optimizer})


def test_bf16_sizes_that_fit_several_ways_are_told_apart_by_the_weights(tmp_path: Path) -> None:
    """Flat masters of 8 and 8 elements take (a, b | c) or (c | a, b) by size; the masters, rounded to bf16, are
    the module's weights in one of them only (FP16_Optimizer copies them so after every step). Where the values
    do not tell either (all zero), it is refused in one line."""
    index = _zero0([("a", (4,)), ("b", (4,)), ("c", (8,))], [["a", "b"], ["c"]], precision="bf16")
    a, b, c = [1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [9.0 + i for i in range(8)]
    named = named_groups(_on_disk(index, tmp_path, [a + b, c], {"a": a, "b": b, "c": c}))
    assert not isinstance(named, str), named
    assert [g.params for g in named[0]] == [("a", "b"), ("c",)]
    named = named_groups(_on_disk(index, tmp_path, [c, a + b], {"a": a, "b": b, "c": c}))
    assert not isinstance(named, str), named
    assert [g.params for g in named[0]] == [("c",), ("a", "b")]
    zero = [0.0] * 8
    assert named_groups(_on_disk(index, tmp_path, [zero, zero], {"a": zero[:4], "b": zero[:4], "c": zero})) == (
        "ZeRO-0 saves which parameters each of its 2 param groups holds nowhere, and taking them in the module's "
        "order fits them in more than one way (the sizes of its flat fp32 masters, and their first 64 elements at "
        "each place rounded to bf16 against the weights, 0 left out)")


def test_a_parameter_left_out_of_every_group_is_frozen() -> None:
    """One weight fewer in the optimizer than in the module: the one that fits is frozen at the target."""
    named = named_groups(_zero0(BLOCK, [["embed", "q", "up"], ["norm1", "norm2"]]))
    assert not isinstance(named, str), named
    assert named[1] == ("head",)


# FP16_Optimizer's loss scale state as DeepSpeed 0.19.8 saves it: an overflow at step 8, the last one.
SCALE = {"dynamic_loss_scale": True, "cur_scale": 128.0, "cur_iter": 9, "last_overflow_iter": 8, "scale_factor": 2.0,
         "scale_window": 4}


def _target_scaler(index: Zero0Checkpoint, stage: int) -> dict[str, Any]:
    """What the target optimizer files of `index` at ZeRO `stage` hold of the loss scaler."""
    plan = plan_reshard(index, Target(world_size=2, stage=stage))
    osd = plan.index.optim_states[0]["optimizer_state_dict"]
    return {k: osd[k] for k in ("loss_scaler", "dynamic_loss_scale", "overflow") if k in osd}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fp16_carries_its_dynamic_loss_scale(stage: int) -> None:
    """The target's DynamicLossScaler: FP16_Optimizer's saved fields as they are, the rest from the recorded
    fp16 section (DeepSpeed's defaults where it leaves them out), a whole hysteresis, `overflow` whether
    the last step overflowed."""
    index = _zero0(BLOCK, DECAY, precision="fp16")
    assert all(reason is None for s, reason in shapes_at(index, 2) if s.stage in (1, 2, 3))
    assert _target_scaler(index, stage) == {
        "loss_scaler": PickledObject(DYNAMIC_LOSS_SCALER, (), {
            "cur_scale": 128.0, "dynamic": True, "cur_iter": 9, "last_overflow_iter": 8, "scale_factor": 2.0,
            "scale_window": 4, "min_scale": 1, "delayed_shift": 2, "cur_hysteresis": 2,
            "consecutive_hysteresis": False, "raise_error_at_min_scale": True, "dtype": "float16"}),
        "dynamic_loss_scale": True, "overflow": True}
    configured = _zero0(BLOCK, DECAY, precision="fp16", scale={**SCALE, "last_overflow_iter": 3},
                        fp16={"hysteresis": 3, "min_loss_scale": 0.5, "consecutive_hysteresis": True})
    carried = _target_scaler(configured, stage)
    assert {k: carried["loss_scaler"].state[k] for k in ("last_overflow_iter", "min_scale", "delayed_shift",
                                                          "cur_hysteresis", "consecutive_hysteresis")} == {
        "last_overflow_iter": 3, "min_scale": 0.5, "delayed_shift": 3, "cur_hysteresis": 3,
        "consecutive_hysteresis": True}
    assert carried["overflow"] is False


def test_a_static_fp16_scale_is_a_loss_scaler_with_its_scale() -> None:
    index = _zero0(BLOCK, DECAY, precision="fp16", scale={"dynamic_loss_scale": False, "cur_scale": 64.0,
                                                           "cur_iter": 9})
    assert _target_scaler(index, 2) == {"loss_scaler": PickledObject(LOSS_SCALER, (), {"cur_scale": 64.0,
                                                                                       "dynamic": False}),
                                        "dynamic_loss_scale": False, "overflow": False}


def test_bf16_keeps_no_loss_scale() -> None:
    """bf16 FP16_Optimizer saves no scale: `files` writes the static scale of 1 DeepSpeed builds without fp16."""
    assert _target_scaler(_zero0(BLOCK, DECAY, precision="bf16"), 2) == {}


@pytest.mark.parametrize("scale,fp16,why", [
    ({}, None, "its FP16_Optimizer's loss scale state is not what DeepSpeed 0.19.8 saves (dynamic_loss_scale=None, "
               "cur_scale=None, cur_iter=None), so the target's loss scaler cannot be carried"),
    ({**SCALE, "scale_window": 0, "last_overflow_iter": None}, None,
     "its FP16_Optimizer's loss scale state is not what DeepSpeed 0.19.8 saves (last_overflow_iter=None, "
     "scale_window=0), so the target's loss scaler cannot be carried"),
    (SCALE, {"hysteresis": 0}, "its recorded config's fp16 section sets hysteresis=0, min_loss_scale=1, which "
                               "DeepSpeed 0.19.8 would not build a loss scaler from"),
])
def test_an_fp16_scale_state_that_is_not_deepspeeds_is_refused(scale: Any, fp16: Any, why: str) -> None:
    index = _zero0(BLOCK, DECAY, precision="fp16", scale=scale, fp16=fp16)
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


def test_an_autotp_zero0_checkpoint_changes_its_degree_with_the_stage(
        parallel_fixtures: Mapping[str, Any], tmp_path: Path) -> None:
    """AutoTP at ZeRO-0 goes to another tensor-parallel degree at ZeRO-1, 2 or 3 (each rank's optimizer
    state named, the ranks' masters joined), not at ZeRO-0, whose files would be a torch optimizer's by
    position: `--plan` lists both, the refusal says so in one line and writes nothing. (DeepSpeed's load
    of the output: `tests/test_model_parallel_reshard.py`'s ZeRO-0 merges and splits.)"""
    fixture = parallel_fixtures["autotp-tp2-z0-fp32"]
    index = load_index(str(fixture.dir))
    assert [(str(s), reason) for s, reason in shapes_at(index, 2) if s.tp == 1] == [
        ("ZeRO-0 dp2 (2 ranks)", "a ZeRO-0 checkpoint's optimizer state is saved by position, and ckptflow writes it "
                                 "at another shape only at another ZeRO stage, where it is named (its weights can still be consolidated)"),
        ("ZeRO-1 dp2 (2 ranks)", None), ("ZeRO-2 dp2 (2 ranks)", None), ("ZeRO-3 dp2 (2 ranks)", None)]
    plan = plan_reshard(load_index(str(parallel_fixtures["autotp-tp2dp2-z0-fp32"].dir)),
                        Target(world_size=3, tp=1, stage=2))
    assert (str(plan.source_shape), str(plan.shape)) == ("ZeRO-0 tp2 x dp2 (4 ranks)", "ZeRO-2 dp3 (3 ranks)")
    assert plan.source_world_size == 2 and plan.src_optimizer == "zero0"  # the source's own, not the named view's
    with pytest.raises(UnsupportedCheckpointError, match=r"to 2 ranks, tp1: a ZeRO-0 checkpoint's optimizer state is "
                                                         r"saved by position, .*; shapes it can write at 2 ranks: "
                                                         r"ZeRO-1 dp2 \(2 ranks\), ZeRO-1 tp2 x dp1 \(2 ranks\), "):
        reshard(str(fixture.dir), str(tmp_path / "out"), world_size=2, tp=1)
    assert not (tmp_path / "out").exists()
