"""A deepspeed.moe ZeRO-0 checkpoint trained in fp16 at ZeRO-1/2 (issue 24), its loss scale carried, against
DeepSpeed.

The source (``specs.moe_zero0_fp16``) was written by DeepSpeed's own fp16 code on CPU ranks with the CPU
accelerator's fp16 check lifted: FP16_Optimizer at ZeRO-0 in each expert-parallel rank's ``expp_rank`` file,
its dynamic loss scale dropped by an overflow and grown again. ckptflow writes it at ZeRO-1/2 at its own
expert-parallel degree and others (``readers.moe.zero0_index``); DeepSpeed at the target (the same check
lifted, ``tests.oracles.moe_zero0_fp16``) loads the output natively and must hold the source's fp32
masters and Adam moments bit for bit (experts placed by global id), the source's Adam step and loss scale
state (``cur_scale``, ``cur_iter``, ``last_overflow_iter``, ``scale_factor``, ``scale_window``,
``skipped_steps``), and save exactly ckptflow's files.

Long mode only (a fixture launch and one oracle launch per target world size); the refusals are pure tests
in ``tests/test_expert_parallel.py`` (``test_deepspeed_moe_zero0_refusals``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from ckptflow.reshard import reshard
from ckptflow.validate import validate
from tests.fixtures.replay import launch
from tests.fixtures.sets import SETS, ParallelFixture
from tests.sampling import long_mode, sample
from tests.test_expert_parallel import _compare_folders

SOURCE = "dsmoe-ep2-z0-fp16"
# (source, target world size, expert-parallel degree, ZeRO stage): ZeRO-1 at its own shape, ZeRO-2 ep1 on 2
# ranks, ZeRO-2 ep4 on 4 ranks.
ALL_CASES = ((SOURCE, 2, 2, 1), (SOURCE, 2, 1, 2), (SOURCE, 4, 4, 2))
CASES = sample(ALL_CASES, [])
SCALE = ("cur_scale", "cur_iter", "last_overflow_iter", "scale_factor", "scale_window")


def case_id(case: tuple[Any, ...]) -> str:
    return f"{case[0]}-to{case[1]}-ep{case[2]}-z{case[3]}"


@pytest.fixture(scope="session")
def fp16_moe() -> ParallelFixture:
    fixture: ParallelFixture = SETS["moe-zero0-fp16"].build([SOURCE])[SOURCE]
    return fixture


@pytest.fixture(scope="session")
def source_optimizer(fp16_moe: ParallelFixture) -> dict[str, Any]:
    """Expert-parallel rank 0's saved FP16_Optimizer (torch.load: an oracle on DeepSpeed's own file)."""
    saved: dict[str, Any] = torch.load(fp16_moe.tag_dir / "expp_rank_0_mp_rank_00_optim_states.pt",
                                       map_location="cpu", weights_only=False)["optimizer"]
    return saved


@pytest.fixture(scope="session")
def fp16_moe_oracle(fp16_moe: ParallelFixture, tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[Any, ...], Any]:
    """Reshard every case, then one launch per world size: DeepSpeed at each case's degree and stage loads
    its output, saves it again, and reports its state and loss scale."""
    root = tmp_path_factory.mktemp("moe-zero0-fp16-oracle")
    paths: dict[tuple[Any, ...], dict[str, Path]] = {}
    for world_size in sorted({case[1] for case in CASES}):
        jobs = []
        for case in (c for c in CASES if c[1] == world_size):
            name = case_id(case)
            paths[case] = {"out": root / "out" / name, "resaved": root / "resaved" / name,
                           "state": root / f"{name}.safetensors", "scale": root / f"{name}.json"}
            reshard(str(fp16_moe.dir), str(paths[case]["out"]), world_size=world_size, ep=case[2], stage=case[3])
            jobs.append({"spec": str(fp16_moe.root / "spec.json"), "ep": case[2], "stage": case[3],
                         "load": str(paths[case]["out"]), "save": str(paths[case]["resaved"]),
                         "state": str(paths[case]["state"]), "scale": str(paths[case]["scale"]), "hang_after": 300})
        jobs_file = root / f"jobs-ws{world_size}.json"
        jobs_file.write_text(json.dumps(jobs, indent=1))
        launch("tests.oracles.moe_zero0_fp16", world_size, ["--jobs", str(jobs_file)], log_dir=root / f"logs-ws{world_size}",
               timeout=900)
    return paths


@pytest.mark.skipif(not long_mode(), reason="the long mode's moe-zero0-fp16 set")
def test_the_fp16_source_validates(fp16_moe: ParallelFixture) -> None:
    assert fp16_moe.spec["optimizer"] == "FP16_Optimizer"
    report = validate(str(fp16_moe.dir), deep=True)
    assert report.problems == ()
    assert report.summary()["step"] == fp16_moe.spec["steps"]


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_deepspeed_holds_the_source_state_and_loss_scale(fp16_moe_oracle: dict[tuple[Any, ...], Any], case: tuple,
                                                         fp16_moe: ParallelFixture,
                                                         source_optimizer: dict[str, Any]) -> None:
    paths = fp16_moe_oracle[case]
    state = load_file(paths["state"])
    expected = load_file(fp16_moe.expected_path)
    buffers = load_file(fp16_moe.buffers_path)
    assert set(state) == set(expected) | {f"buffer/{k}" for k in buffers}
    assert [key for key, tensor in expected.items() if not torch.equal(state[key], tensor)] == []
    assert [key for key, tensor in buffers.items() if not torch.equal(state[f"buffer/{key}"], tensor)] == []
    result = json.loads(paths["scale"].read_text())
    assert result["optimizer"] == "DeepSpeedZeroOptimizer"
    source = {k: source_optimizer[k] for k in SCALE}
    assert source["last_overflow_iter"] == 1 and source["cur_iter"] == fp16_moe.spec["steps"]  # the scale moved
    assert {k: result["loaded"][k] for k in SCALE} == source
    assert result["loaded"]["skipped_steps"] == 1
    steps = [int(s["step"]) for s in source_optimizer["optimizer_state_dict"]["state"].values() if "step" in s]
    assert result["step"] == max(steps)  # the source's Adam step, carried
    hysteresis = fp16_moe.spec["ds_config"]["fp16"]["hysteresis"]
    assert result["scaler"] == {**source, "dynamic": True, "min_scale": 1, "delayed_shift": hysteresis,
                                "cur_hysteresis": hysteresis, "consecutive_hysteresis": False,
                                "raise_error_at_min_scale": True, "dtype": "torch.float16"}


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_deepspeed_saves_again_exactly_our_files(fp16_moe_oracle: dict[tuple[Any, ...], Any], case: tuple) -> None:
    paths = fp16_moe_oracle[case]
    tag = (paths["out"] / "latest").read_text()
    assert (paths["resaved"] / "latest").read_text() == tag
    _compare_folders(paths["out"] / tag, paths["resaved"] / tag)
