"""A Megatron-style checkpoint at ZeRO-0 written at ZeRO-1 (issue 24), checked against DeepSpeed itself.

`specs.megatron_zero0`: `megatron-toy` (no tied module) trained at ZeRO-0 on pp2 x tp2, its optimizer state saved
by position per model-parallel rank. Each tensor-parallel rank's stages are named from its own layer files
(`reshard.megatron_zero0`), then each model-parallel rank goes to ZeRO-1 alone:

- DeepSpeed builds `megatron-toy` at ZeRO-1 at the target (the fixture writer's own Megatron job), loads OUT
  natively (`engine.load_checkpoint`, no universal flag) and holds the source's fp32 weights, both Adam moments
  and buffers bit for bit (`oracles.parallel_reshard`); saved again, it writes exactly ckptflow's files. Targets:
  pp2 x tp2 x dp1 and x dp2 (each model-parallel rank alone), and, through the ZeRO-1 checkpoint the named ranks
  are (`megatron_zero0.zero1_view`), tp1 alone, pp1 alone, both (x dp2), and pp4 "uniform";
- the plan names each model-parallel rank's groups as DeepSpeed's ZeRO-1 lists them, at any data-parallel size,
  and `--plan` lists the ZeRO-1 shapes as from that ZeRO-1 checkpoint;
- what cannot move (ZeRO-2, another shape at ZeRO-0, a tied module its patterns do not split at another shape, a
  tied module's layer file that does not exist) is refused in one line; a tied module at another shape moves
  (`test_megatron_zero0_tied.py`).

The fixture is a 4-rank launch and the oracle five more (2, 4 and 8 ranks): long mode (`CKPTFLOW_LONG=1`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from ckptflow.errors import UnsupportedCheckpointError
from ckptflow.formats.deepspeed import load_index
from ckptflow.reshard import reshard
from ckptflow.reshard.plan import plan_reshard
from ckptflow.reshard.shape import Target
from tests.fixtures.sets import SETS, ParallelFixture
from tests.sampling import long_mode
from tests.test_megatron_stages import checked_output
from tests.test_model_parallel_reshard import launch_oracle, source_sections

pytestmark = pytest.mark.skipif(not long_mode(), reason="DeepSpeed launches of their own (the fixture, the oracle): "
                                "long mode (CKPTFLOW_LONG=1)")

ZERO0 = "megatron-pp2tp2-z0-fp32-ucinfo"
# (fixture, pp, tp, dp, partition method) at ZeRO-1: its own degree and stages (dp1, and dp2: 8 ranks); the degree
# alone, the stages alone and both; the stages cut again ("uniform", as the writer builds it).
CASES = ((ZERO0, 2, 2, 1, None), (ZERO0, 2, 2, 2, None), (ZERO0, 2, 1, 1, None), (ZERO0, 1, 2, 1, None),
         (ZERO0, 1, 1, 2, None), (ZERO0, 4, 1, 1, "uniform"))


def case_id(case: tuple) -> str:
    return f"to-pp{case[1]}-tp{case[2]}-dp{case[3]}"


@pytest.fixture(scope="module")
def zero0_fixture() -> ParallelFixture:
    return SETS["megatron-zero0"].build([ZERO0])[ZERO0]


@pytest.fixture(scope="module")
def zero0_oracle(zero0_fixture: ParallelFixture, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_zero0_oracle(zero0_fixture, CASES, tmp_path_factory.mktemp("megatron-zero0-oracle"))


def run_zero0_oracle(fixture: ParallelFixture, cases: tuple, root: Path, *, name: str | None = None,
                     tied_modules: str | None = None) -> dict[str, Any]:
    """ckptflow writes `fixture` at ZeRO-1 at each case (fixture, pp, tp, dp, partition method; `tied_modules` as the
    user gives them); one DeepSpeed launch per target (world size, pp, tp) loads, checks and saves it (the job the
    oracle builds for a spec of that `name`, the fixture's by default, and the client state it checks its writer's)."""
    source = dataclasses.replace(fixture.parallel_spec, name=name or fixture.parallel_spec.name)
    outs, resaved, results = {}, {}, {}
    launches: dict[tuple[int, int, int], list[dict[str, Any]]] = {}
    for case in cases:
        _, pp, tp, dp, method = case
        spec = dataclasses.replace(source, stage=1, pp=pp, tp=tp, world_size=pp * tp * dp)
        outs[case], resaved[case] = root / "out" / case_id(case), root / "resaved" / case_id(case)
        results[case] = root / "results" / f"{case_id(case)}.json"
        results[case].parent.mkdir(parents=True, exist_ok=True)
        reshard(str(fixture.dir), str(outs[case]), world_size=spec.world_size, stage=1, pp=pp, tp=tp,
                partition_method=method, tied_modules=tied_modules, workers=2)
        launches.setdefault((spec.world_size, pp, tp), []).append({
            "spec": spec.to_json(), "source": source.to_json(), "load": str(outs[case]),
            "save": str(resaved[case]), "expected": str(fixture.expected_path),
            "buffers": str(fixture.buffers_path), "result": str(results[case]), **source_sections(fixture),
            **({"partition_method": method} if method else {})})
    for (world_size, pp, tp), jobs in sorted(launches.items()):
        launch_oracle(world_size, jobs, root, f"{world_size}-pp{pp}-tp{tp}")
    return {"outs": outs, "resaved": resaved, "results": results}


def check_zero0_output(oracle: dict[str, Any], case: tuple, fixture: ParallelFixture, padding: int = 0) -> None:
    """DeepSpeed held the source's state and client state and saved ckptflow's files again; ckptflow's output
    validates at the target shape with the source's step and parameters (less the `padding` elements the source's
    index counts and the output's does not)."""
    summary, source = checked_output(oracle, case, fixture)
    assert (summary["stage"], summary["pp"], summary.get("tp", 1), summary["world_size"]) == \
        (1, case[1], case[2], case[3])
    assert (summary["step"], summary["params"], summary["numel"]) == (source["step"], source["params"],
                                                                      source["numel"] - padding)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_deepspeed_loads_a_zero0_megatron_checkpoint_at_zero1_holding_the_source_state(
        zero0_oracle: dict[str, Any], zero0_fixture: ParallelFixture, case: tuple) -> None:
    """DeepSpeed's PipelineEngine at ZeRO-1 at the target shape loads ckptflow's output natively, holds the source's
    state bit for bit, the client state (`universal_checkpoint_info`) included, and saves exactly ckptflow's files."""
    check_zero0_output(zero0_oracle, case, zero0_fixture)


def test_each_model_parallel_rank_is_named_from_its_own_layer_files(zero0_fixture: ParallelFixture) -> None:
    """No launch: every model-parallel rank's groups list its stage's layers in module order (weights, then the
    biases and norms), the same names on both tensor-parallel ranks, at any data-parallel size; the layer files
    of both tensor-parallel ranks carried."""
    index = load_index(str(zero0_fixture.dir))
    assert "universal_checkpoint_info" in index.ranks[0].model_states
    plan = plan_reshard(index, Target(world_size=12, stage=1))
    assert (str(plan.source_shape), str(plan.shape)) == ("ZeRO-0 pp2 x tp2 x dp1 (4 ranks)",
                                                         "ZeRO-1 pp2 x tp2 x dp3 (12 ranks)")
    check_stage0_groups(plan)
    assert [[u.optim_file for u in part.units] for part in plan.parts] == [
        [f"zero_pp_rank_{r}_mp_rank_{mp:02d}_optim_states.pt" for r in range(3)] for mp in range(4)]
    assert all(part.index.model_states[0]["module"] is None for part in plan.parts)
    assert set(plan.carried) == {f"layer_{i:02d}-model_{t:02d}-model_states.pt" for i in range(6) for t in range(2)}


def check_stage0_groups(plan: Any) -> None:
    """Every model-parallel rank's groups list its stage's layers in module order (weights, then the biases and
    norms), the same names on both tensor-parallel ranks: `megatron-toy` at pp2 x tp2."""
    names = [[[n for n, _ in g] for g in part.flat_shapes] for part in plan.parts]
    assert names[0] == names[1] and names[2] == names[3]
    assert names[0] == [["0.weight", "1.fc1.weight", "1.fc2.weight", "2.fc1.weight", "2.fc2.weight"],
                        ["1.norm.weight", "1.norm.bias", "1.fc1.bias", "1.fc2.bias", "2.norm.weight", "2.norm.bias",
                         "2.fc1.bias", "2.fc2.bias"]]


@pytest.mark.parametrize(("target", "why"), [
    ({"world_size": 4, "stage": 2}, "DeepSpeed trains Megatron-style PipelineModule models at ZeRO stage 1 only"),
    ({"world_size": 2, "tp": 1}, "a ZeRO-0 checkpoint's optimizer state is saved by position, and ckptflow writes it "
     "at another shape only at another ZeRO stage, where it is named (its weights can still be consolidated)"),
    ({"world_size": 2, "stage": 1, "tp": 1, "tied_modules": "embed=0"},  # named so, the embedding is the tie's
     "at ZeRO-1 pp2 x dp1 (2 ranks): tied_modules.embed.weight is a tied module's parameter (a TiedLayerSpec its "
     "pipeline stages share) that is neither a vocabulary parameter nor a replicated one"),
])
def test_what_cannot_move_with_the_stage_is_refused(zero0_fixture: ParallelFixture, tmp_path: Path,
                                                    target: Mapping[str, Any], why: str) -> None:
    check_refused(zero0_fixture, tmp_path, target, why)


def check_refused(fixture: ParallelFixture, tmp_path: Path, target: Mapping[str, Any], why: str) -> None:
    """`reshard` of `fixture` at `target` is refused saying `why`, and writes nothing."""
    with pytest.raises(UnsupportedCheckpointError) as refused:
        reshard(str(fixture.dir), str(tmp_path / "out"), **target)
    assert why in str(refused.value)
    assert not (tmp_path / "out").exists()


def test_a_tied_module_key_that_names_no_layer_file_is_refused(zero0_fixture: ParallelFixture,
                                                               tmp_path: Path) -> None:
    with pytest.raises(UnsupportedCheckpointError) as refused:
        reshard(str(zero0_fixture.dir), str(tmp_path / "out"), world_size=4, stage=1, tied_modules="embed=9")
    assert str(refused.value) == (
        f"{zero0_fixture.dir}/global_step3: layer_09-model_00-model_states.pt is missing, which "
        "the tied modules given (embed=9) say holds one of them; name each tied module with the first layer that uses "
        "it (`tied_modules` KEY=LAYER), or leave it out if the model ties none")
    assert not (tmp_path / "out").exists()


def test_the_plan_lists_the_zero1_shapes_it_writes(zero0_fixture: ParallelFixture, tmp_path: Path) -> None:
    """`reshard --plan`: every ZeRO-1 shape at 4 ranks is written, as from the ZeRO-1 checkpoint it is once named,
    but tp4, whose padded vocabulary does not split four ways (the ZeRO-1 planner's own refusal)."""
    from ckptflow.reshard.run import plan_shapes

    options = {str(o.shape): o.reason for o in plan_shapes(str(zero0_fixture.dir), 4).options if o.shape.stage == 1}
    assert options == {
        "ZeRO-1 dp4 (4 ranks)": None, "ZeRO-1 pp2 x dp2 (4 ranks)": None, "ZeRO-1 pp4 x dp1 (4 ranks)": None,
        "ZeRO-1 tp2 x dp2 (4 ranks)": None, "ZeRO-1 pp2 x tp2 x dp1 (4 ranks)": None,
        "ZeRO-1 tp4 x dp1 (4 ranks)": "0.weight does not split at tensor-parallel degree 4: the padded vocabulary's "
                                      "38 rows do not split into 4 equal blocks"}
    with pytest.raises(UnsupportedCheckpointError, match=r"0\.weight does not split at tensor-parallel degree 4"):
        reshard(str(zero0_fixture.dir), str(tmp_path / "out"), world_size=4, stage=1, tp=4, pp=1)
    assert not (tmp_path / "out").exists()
