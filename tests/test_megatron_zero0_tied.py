"""A Megatron-style checkpoint with tied modules at ZeRO-0 written at ZeRO-1 at its own shape and others (issue 24),
checked against DeepSpeed itself.

`specs.megatron_zero0_tied`: `writers.megatron_tied`'s model (GPTModelPipe's tied embedding and head, `embed` on both
stages, saved in layer 0's files only) trained at ZeRO-0 on pp2 x tp2. No file records the tied module's key, which
the user gives (`--tied-modules embed=0`); the named ranks are then the ZeRO-1 checkpoint they would be, the tied
module's parameters named `tied_modules.embed.*` on every stage that uses it (`megatron_zero0.zero1_view`), and the
Megatron-style planners move them:

- DeepSpeed builds the tied model at ZeRO-1 at the target (the fixture writer's own job), loads OUT natively
  (`engine.load_checkpoint`, no universal flag) and holds the source's fp32 weights, both Adam moments and buffers
  bit for bit (`oracles.parallel_reshard`); saved again, it writes exactly ckptflow's files. Targets: its own shape,
  pp2 x tp1 (the degree alone) and pp1 x tp1 x dp2 (the stages and the degree at once);
- the view names the tied module as a ZeRO-1 save of the same model does, each later stage's copy its own, read from
  that stage's optimizer state;
- the tied modules not given, or given wrong, are refused in one line.

The fixture is a 4-rank launch and the oracle three more (4 and 2 ranks): long mode (`CKPTFLOW_LONG=1`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ckptflow.formats.deepspeed import load_index
from ckptflow.reshard.megatron_zero0 import named_view
from ckptflow.reshard.plan import plan_reshard
from ckptflow.reshard.shape import Target
from tests.fixtures.models.megatron_tied import POSITION_EMBEDDINGS, TIED_FIXTURES, WORD_EMBEDDINGS
from tests.fixtures.sets import SETS, ParallelFixture
from tests.sampling import long_mode
from tests.test_megatron_zero0 import case_id, check_refused, check_zero0_output, run_zero0_oracle

pytestmark = pytest.mark.skipif(not long_mode(), reason="DeepSpeed launches of their own (the fixture, the oracle): "
                                "long mode (CKPTFLOW_LONG=1)")

ZERO0 = "megatron-tied-pp2tp2-z0-fp32"
TIED = "embed=0"
# (fixture, pp, tp, dp, partition method) at ZeRO-1: its own shape, the degree alone, the stages and the degree at once.
CASES = ((ZERO0, 2, 2, 1, None), (ZERO0, 2, 1, 1, None), (ZERO0, 1, 1, 2, None))
# The oracle builds the tied model for a spec named as the ZeRO-1 tied fixture (`oracles.parallel_reshard._job`).
(ORACLE_NAME,) = TIED_FIXTURES


@pytest.fixture(scope="module")
def tied_fixture() -> ParallelFixture:
    return SETS["megatron-zero0-tied"].build([ZERO0])[ZERO0]


@pytest.fixture(scope="module")
def tied_oracle(tied_fixture: ParallelFixture, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_zero0_oracle(tied_fixture, CASES, tmp_path_factory.mktemp("megatron-zero0-tied-oracle"),
                            name=ORACLE_NAME, tied_modules=TIED)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_deepspeed_loads_a_tied_zero0_megatron_checkpoint_at_zero1_holding_the_source_state(
        tied_oracle: dict[str, Any], tied_fixture: ParallelFixture, case: tuple) -> None:
    """DeepSpeed's PipelineEngine at ZeRO-1 at the target shape loads ckptflow's output natively, holds the source's
    state bit for bit (the tied module's on every stage that uses it), the client state included, and saves exactly
    ckptflow's files. The source's index counts the word embedding's padding row (at ZeRO-0 the reader names it
    `0.word_embeddings.weight`, which its vocabulary pattern does not name); the output's, named as the tied module,
    does not."""
    check_zero0_output(tied_oracle, case, tied_fixture, padding=16)


def test_the_view_names_the_tied_module_as_zero1_does(tied_fixture: ParallelFixture) -> None:
    """No launch: with the key given, the tied module's parameters are `tied_modules.embed.*`, joined again under those
    names (the word embedding's padding row cut, as its vocabulary pattern says; the position embeddings whole, their
    tensor-parallel copies paired), first in both stages' groups; stage 1's copy its own (`stage_copies`), its
    elements read from stage 1's ranks at another number of stages."""
    index = load_index(str(tied_fixture.dir))
    assert [(t.name, t.shape) for t in index.tensors][:2] == [("0.word_embeddings.weight", (38, 16)),
                                                              ("0.position_embeddings.weight", (12, 16))]
    view = named_view(index, TIED)
    assert not isinstance(view, str)
    assert [(t.name, t.shape) for t in view.tensors][:2] == [(WORD_EMBEDDINGS, (37, 16)), (POSITION_EMBEDDINGS, (12, 16))]
    assert not any(t.name.startswith("0.") for t in view.tensors)
    assert sorted(view.stage_copies) == [(POSITION_EMBEDDINGS, 1), (WORD_EMBEDDINGS, 1)]
    assert view.tied_layers == (("embed", 0),)
    assert [r.name for r in view.replicas if r.name.startswith("tied_modules.")] == [POSITION_EMBEDDINGS]
    assert [[p.name for p in rank.params][:2] for rank in view.ranks] == [[WORD_EMBEDDINGS, POSITION_EMBEDDINGS]] * 4
    plan = plan_reshard(index, Target(world_size=2, stage=1, tp=1, tied_modules=TIED))
    assert [part.flat_shapes[0][0] for part in plan.parts] == [(WORD_EMBEDDINGS, (38, 16))] * 2  # the padding kept
    # each target stage's copy of the tie read from its own source stage's ranks (virtual ranks mp * width on),
    # though both stages' bytes are layer 0's
    for stage, part in enumerate(plan.parts):
        copies = [c for u in part.units for f in u.flats for c in f.copies if f.group == 0 and c.dst_offset < 38 * 16]
        assert {c.src_rank // view.world_size // index.tp for c in copies} == {stage}


@pytest.mark.parametrize(("target", "why"), [
    ({"world_size": 2, "stage": 1, "tp": 1},
     "tensor-parallel rank 0 of 2: ZeRO-0 saves its pipeline stages' optimizer state by index and no parameter name, "
     "and no assignment of its layer files to its 2 stages gives each stage its buffer_names and the shapes of its "
     "Adam moments in module order, with no frozen parameter; if its PipelineModule ties modules (TiedLayerSpec), "
     "name each with `tied_modules` KEY=LAYER"),
    ({"world_size": 2, "stage": 1, "tp": 1, "tied_modules": "embed=1"},
     "tensor-parallel rank 0 of 2: ZeRO-0 saves its pipeline stages' optimizer state by index and no parameter name, "
     "and no assignment of its layer files to its 2 stages with the tied modules given (embed=1) gives each stage its "
     "buffer_names"),
])
def test_tied_modules_not_given_or_given_wrong_are_refused(tied_fixture: ParallelFixture, tmp_path: Path,
                                                           target: dict[str, Any], why: str) -> None:
    check_refused(tied_fixture, tmp_path, target, why)


def test_the_plan_lists_the_shapes_with_the_tied_modules_given(tied_fixture: ParallelFixture) -> None:
    """`reshard --plan --tied-modules embed=0` lists the ZeRO-1 shapes as from the ZeRO-1 checkpoint it is once named:
    pp4 left open by the default partition method (the tied module weighed at both its uses), tp4 refused by the
    ZeRO-1 planner (the padded vocabulary); without the key, another shape says why its stages are not named."""
    from ckptflow.reshard.run import plan_shapes

    options = {str(o.shape): o.reason for o in plan_shapes(str(tied_fixture.dir), 4, tied_modules=TIED).options
               if o.shape.stage == 1}
    assert [shape for shape, reason in options.items() if reason is None] == [
        "ZeRO-1 dp4 (4 ranks)", "ZeRO-1 pp2 x dp2 (4 ranks)", "ZeRO-1 tp2 x dp2 (4 ranks)",
        "ZeRO-1 pp2 x tp2 x dp1 (4 ranks)"]
    assert options["ZeRO-1 pp4 x dp1 (4 ranks)"].startswith("cannot tell which layers each of 4 pipeline stages")
    assert options["ZeRO-1 tp4 x dp1 (4 ranks)"] == (
        "tied_modules.embed.word_embeddings.weight does not split at tensor-parallel degree 4: the padded "
        "vocabulary's 38 rows do not split into 4 equal blocks")
    untied = {str(o.shape): o.reason for o in plan_shapes(str(tied_fixture.dir), 4).options}
    assert "if its PipelineModule ties modules (TiedLayerSpec), name each with `tied_modules` KEY=LAYER" in \
        untied["ZeRO-1 pp2 x dp2 (4 ranks)"]
