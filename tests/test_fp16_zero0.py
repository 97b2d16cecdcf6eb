"""An fp16 ZeRO-0 checkpoint at ZeRO-1, 2 and 3 (issue 24), its dynamic loss scale carried, against DeepSpeed.

The source (``specs.fp16_zero0``) was written by DeepSpeed's own fp16 code on CPU ranks with the CPU
accelerator's fp16 check lifted: FP16_Optimizer at ZeRO-0, its dynamic loss scale dropped by an overflow
and grown again. ckptflow writes it at ZeRO-1/2/3; DeepSpeed at the target (the same check lifted,
``tests.oracles.fp16_zero0``) loads the output natively and must hold the source's fp32 masters and Adam
moments bit for bit, its Adam step, and its loss scale state (``cur_scale``, ``cur_iter``,
``last_overflow_iter``, ``scale_factor``, ``scale_window``), and save exactly ckptflow's files. One more
step from the output at the source's world size (each rank its own batch, as the source trained) gives
the same loss as one more step of the source at ZeRO-0, bit for bit (the loss is computed from the
loaded fp16 weights, before any arithmetic of the step), and the same new scale: no overflow, and the
scale grows after ``loss_scale_window`` good steps either way. The updated weights are not compared:
DeepSpeed 0.19.8 applies the scale to the loss at ZeRO-1/2/3 but not at ZeRO-0
(``specs.fp16_zero0``), and reduces and clips in other orders.

Long mode only (a fixture launch and one oracle launch per target world size); the refusals and the
loss scaler record are pure tests in ``tests/test_zero0_stage.py``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from ckptflow.reshard import reshard
from tests.fixtures.cache import Fixture
from tests.fixtures.sets import SETS
from tests.sampling import sample
from tests.test_model_parallel_reshard import check_same_files, check_validates, launch_oracle

SOURCE = "zero0-fp16-llama-dp2"
# (source, target world size, tensor-parallel degree (kept), target ZeRO stage)
ALL_CASES = ((SOURCE, 2, None, 1), (SOURCE, 2, None, 2), (SOURCE, 2, None, 3), (SOURCE, 3, None, 3),
             (SOURCE, 3, None, 2))
CASES = sample(ALL_CASES, [])
TRAIN_STEPS = 1
SCALE = ("cur_scale", "cur_iter", "last_overflow_iter", "scale_factor", "scale_window")


def case_id(case: tuple) -> str:
    return f"{case[0]}-to{case[1]}-z{case[3]}"


@pytest.fixture(scope="session")
def fp16_fixture() -> Fixture:
    fixture: Fixture = SETS["fp16-zero0"].build([SOURCE])[SOURCE]
    return fixture


@pytest.fixture(scope="session")
def fp16_oracle(fp16_fixture: Fixture, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Reshard every case, then one launch per world size: DeepSpeed loads each output (and, at the source's
    world size, the source itself at ZeRO-0), saves it again, reports its state, and trains one more step
    where the world size is the source's."""
    root = tmp_path_factory.mktemp("fp16-zero0-oracle")
    spec = dict(fp16_fixture.spec)
    outs, resaved, results, states = {}, {}, {}, {}
    ws0 = fp16_fixture.world_size
    for world_size in sorted({case[1] for case in CASES}):
        jobs = []
        if world_size == ws0:
            results["source"], states["source"] = root / "source.json", root / "source.safetensors"
            jobs.append({"fixture": spec, "stage": 0, "load": str(fp16_fixture.dir), "train_steps": TRAIN_STEPS,
                         "result": str(results["source"]), "state": str(states["source"])})
        for case in (c for c in CASES if c[1] == world_size):
            name = case_id(case)
            outs[case], resaved[case] = root / "out" / name, root / "resaved" / name
            results[case], states[case] = root / f"{name}.json", root / f"{name}.safetensors"
            reshard(str(fp16_fixture.dir), str(outs[case]), world_size=world_size, stage=case[3])
            jobs.append({"fixture": spec, "stage": case[3], "load": str(outs[case]), "save": str(resaved[case]),
                         "result": str(results[case]), "state": str(states[case]),
                         **({"train_steps": TRAIN_STEPS} if world_size == ws0 else {})})
        launch_oracle(world_size, jobs, root, f"ws{world_size}", "tests.oracles.fp16_zero0")
    return {"outs": outs, "resaved": resaved, "results": results, "states": states}


def _result(oracle: Mapping[str, Any], key: Any) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(oracle["results"][key].read_text())
    return result


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_deepspeed_holds_the_source_state_and_loss_scale(fp16_oracle: dict[str, Any], case: tuple,
                                                         fp16_fixture: Fixture) -> None:
    expected = load_file(str(fp16_fixture.expected_path))
    held = load_file(str(fp16_oracle["states"][case]))
    assert sorted(held) == sorted(expected)
    differ = [key for key in expected if held[key].dtype != expected[key].dtype or held[key].shape != expected[key].shape
              or not torch.equal(held[key].contiguous().view(torch.int32), expected[key].contiguous().view(torch.int32))]
    assert differ == []
    result = _result(fp16_oracle, case)
    source = fp16_fixture.spec["loss_scale"]
    assert {k: result["loaded"][k] for k in (*SCALE, "skipped_steps")} == source
    assert result["step"] == fp16_fixture.spec["optimizer_step"]
    config = fp16_fixture.spec["ds_config"]["fp16"]
    assert result["scaler"] == {
        **{k: source[k] for k in SCALE}, "dynamic": True, "min_scale": 1, "delayed_shift": config["hysteresis"],
        "cur_hysteresis": config["hysteresis"], "consecutive_hysteresis": False, "raise_error_at_min_scale": True,
        "dtype": "torch.float16"}


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_deepspeed_writes_the_same_files(fp16_oracle: dict[str, Any], case: tuple) -> None:
    check_same_files(fp16_oracle, case)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_the_output_validates(fp16_oracle: dict[str, Any], case: tuple, fp16_fixture: Fixture) -> None:
    check_validates(fp16_oracle, case, fp16_fixture)  # type: ignore[arg-type]  # a ParallelFixture's fields


@pytest.mark.parametrize("case", [c for c in CASES if c[1] == 2], ids=case_id)
def test_one_more_step_gives_the_sources_loss_and_new_scale(fp16_oracle: dict[str, Any], case: tuple,
                                                             fp16_fixture: Fixture) -> None:
    ours, source = _result(fp16_oracle, case), _result(fp16_oracle, "source")
    assert ours["losses"] == source["losses"]
    assert {k: ours["after"][k] for k in SCALE} == {k: source["after"][k] for k in SCALE}
    before = fp16_fixture.spec["loss_scale"]
    # The step did not overflow, and the scale grew: it is the fourth good one since the overflow at step 1, a
    # multiple of loss_scale_window 2.
    assert (source["after"]["cur_iter"], source["after"]["skipped_steps"]) == (before["cur_iter"] + 1,
                                                                               before["skipped_steps"])
    assert source["after"]["cur_scale"] == 2 * before["cur_scale"]
