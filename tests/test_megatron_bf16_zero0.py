"""A Megatron-style checkpoint trained in bf16 at ZeRO-0 written at ZeRO-1 (issue 24), checked against DeepSpeed itself.

`specs.megatron_bf16_zero0`: `megatron-toy` (no tied module, `universal_checkpoint_info` saved) trained in bf16 at
ZeRO-0 on pp2 x tp2: DeepSpeed gives it BF16_Optimizer, whose checkpoint it cannot load back (the writer checked that
the load fails), and whose files name every parameter of each model-parallel rank (`param_slice_mappings`). ckptflow
reads each model-parallel rank by them, its tensor-parallel pieces joined as a ZeRO-1 checkpoint's
(`readers.pipeline.bf16_zero0`), and writes it at ZeRO-1 through the Megatron-style planners
(`megatron_zero0.bf16_view`), laid out for DeepSpeedZeroOptimizer, which the same config gets at ZeRO-1:

- DeepSpeed builds `megatron-toy` in bf16 at ZeRO-1 at the target, loads OUT natively (`engine.load_checkpoint`, no
  universal flag) and holds the source's fp32 masters, both Adam moments and buffers bit for bit
  (`oracles.parallel_reshard`); saved again, it writes exactly ckptflow's files. Targets: its own pp2 x tp2, tp1
  alone, pp1 alone, both (x dp2);
- the plan lists each model-parallel rank's groups as the fp32 ZeRO-0 source's named ranks list them;
- kept at ZeRO-0 it is refused saying DeepSpeed cannot load it back, and tied modules its files do not name are
  refused, in one line, writing nothing.

The fixture is a 4-rank launch and the oracle more (4 and 2 ranks): long mode (`CKPTFLOW_LONG=1`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ckptflow.formats.deepspeed import load_index
from ckptflow.formats.deepspeed.partition import BF16, ZERO
from ckptflow.formats.deepspeed.readers.pipeline import BF16_ZERO0_LOAD, BF16_ZERO0_NOTE
from ckptflow.reshard.plan import plan_reshard
from ckptflow.reshard.shape import Target
from ckptflow.validate import validate
from tests.fixtures.sets import SETS, ParallelFixture
from tests.sampling import long_mode
from tests.test_megatron_zero0 import case_id, check_refused, check_stage0_groups, check_zero0_output, run_zero0_oracle

pytestmark = pytest.mark.skipif(not long_mode(), reason="DeepSpeed launches of their own (the fixture, the oracle): "
                                "long mode (CKPTFLOW_LONG=1)")

ZERO0 = "megatron-pp2tp2-z0-bf16-ucinfo"
# (fixture, pp, tp, dp, partition method) at ZeRO-1: its own degree and stages; the degree alone, the stages alone,
# both at dp2.
CASES = ((ZERO0, 2, 2, 1, None), (ZERO0, 2, 1, 1, None), (ZERO0, 1, 2, 1, None), (ZERO0, 1, 1, 2, None))


@pytest.fixture(scope="module")
def bf16_fixture() -> ParallelFixture:
    fixture: ParallelFixture = SETS["megatron-bf16-zero0"].build([ZERO0])[ZERO0]
    return fixture


@pytest.fixture(scope="module")
def bf16_oracle(bf16_fixture: ParallelFixture, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_zero0_oracle(bf16_fixture, CASES, tmp_path_factory.mktemp("megatron-bf16-zero0-oracle"))


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_deepspeed_loads_a_bf16_zero0_megatron_checkpoint_at_zero1_holding_the_source_state(
        bf16_oracle: dict[str, Any], bf16_fixture: ParallelFixture, case: tuple) -> None:
    """DeepSpeed's PipelineEngine at ZeRO-1 at the target shape (the source's bf16 config: DeepSpeedZeroOptimizer
    there) loads ckptflow's output natively, holds the source's state bit for bit, the client state
    (`universal_checkpoint_info`) included, and saves exactly ckptflow's files."""
    check_zero0_output(bf16_oracle, case, bf16_fixture)


def test_each_model_parallel_rank_is_named_by_its_optimizer_files(bf16_fixture: ParallelFixture) -> None:
    """No launch: DeepSpeed could not load it back; it validates as ZeRO-0 pp2 x tp2 holding BF16_Optimizer's
    partitions, with the note saying how to resume it; at ZeRO-1 every model-parallel rank's groups list its stage's
    layers in module order, the same names on both tensor-parallel ranks, laid out for DeepSpeedZeroOptimizer in
    the bf16 files ZeRO-1 writes, with no `optimizer` in the model states."""
    assert bf16_fixture.spec["checks"]["reload"]["deepspeed_load_error"] == "KeyError: 0"
    report = validate(str(bf16_fixture.dir), deep=True)
    assert report.ok, [p.message for p in report.problems]
    summary = report.summary()
    assert (summary["stage"], summary["pp"], summary["tp"], summary["precision"]) == (0, 2, 2, "bf16")
    assert BF16_ZERO0_NOTE in summary["notes"]
    index = load_index(str(bf16_fixture.dir))
    assert [rank.optimizer_kind for rank in index.ranks] == [BF16] * 4
    plan = plan_reshard(index, Target(world_size=12, stage=1))
    assert (str(plan.source_shape), str(plan.shape)) == ("ZeRO-0 pp2 x tp2 x dp1 (4 ranks)",
                                                         "ZeRO-1 pp2 x tp2 x dp3 (12 ranks)")
    check_stage0_groups(plan)
    assert [(part.optimizer, part.src_optimizer) for part in plan.parts] == [(ZERO, BF16)] * 4
    assert [[u.optim_file for u in part.units] for part in plan.parts] == [
        [f"bf16_zero_pp_rank_{r}_mp_rank_{mp:02d}_optim_states.pt" for r in range(3)] for mp in range(4)]
    assert all(part.index.model_states[0]["optimizer"] is None for part in plan.parts)


def test_kept_at_zero0_or_given_other_tied_modules_it_is_refused(bf16_fixture: ParallelFixture,
                                                                  tmp_path: Path) -> None:
    """Kept at ZeRO-0 it is refused saying DeepSpeed cannot load it back (not "nothing to reshard"), as `--plan`
    says of every ZeRO-0 shape, and lists the ZeRO-1 shapes the fp32 source's named ranks allow (tp4: the padded
    vocabulary does not split four ways); tied modules its files do not name are refused; each writing nothing."""
    from ckptflow.reshard.run import plan_shapes

    check_refused(bf16_fixture, tmp_path, {"world_size": 4}, BF16_ZERO0_LOAD)
    options = {str(o.shape): o.reason for o in plan_shapes(str(bf16_fixture.dir), 4).options}
    assert {why for shape, why in options.items() if shape.startswith("ZeRO-0")} == {BF16_ZERO0_LOAD}
    assert {shape: why for shape, why in options.items() if shape.startswith("ZeRO-1")} == {
        "ZeRO-1 dp4 (4 ranks)": None, "ZeRO-1 pp2 x dp2 (4 ranks)": None, "ZeRO-1 pp4 x dp1 (4 ranks)": None,
        "ZeRO-1 tp2 x dp2 (4 ranks)": None, "ZeRO-1 pp2 x tp2 x dp1 (4 ranks)": None,
        "ZeRO-1 tp4 x dp1 (4 ranks)": "0.weight does not split at tensor-parallel degree 4: the padded vocabulary's "
                                      "38 rows do not split into 4 equal blocks"}
    check_refused(bf16_fixture, tmp_path, {"world_size": 4, "stage": 1, "tied_modules": "embed=0"},
                  "its optimizer files name its tied modules (none), and `tied_modules` gives embed=0; leave "
                  "`tied_modules` out")
