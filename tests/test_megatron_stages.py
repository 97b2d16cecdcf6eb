"""Megatron-style checkpoints at another number of pipeline stages, the tensor-parallel degree changing
with it or not (issue 24), checked against DeepSpeed itself.

The two act on different axes and compose in one plan (`reshard.megatron.plan_megatron_stages`): each
target stage holds the layers `PipelineModule` gives it at the target (weighed at the target degree),
each parameter at its shard's shape there, its fp32 masters and Adam moments copied out of the source
stage and tensor-parallel ranks that hold them; its layer files cut again at the target degree.

- DeepSpeed builds `megatron-toy` at the target shape (the fixture writer's own Megatron job), loads OUT
  natively (`engine.load_checkpoint`, no universal flag) and holds the source's fp32 weights and Adam
  moments bit for bit (`oracles.parallel_reshard`); saved again, it writes exactly ckptflow's files;
  `ds_to_universal` of that save equals `ds_to_universal` of the source in every fp32 weight, moment and
  step;
- Megatron-DeepSpeed's `GPTModelPipe` ties its embedding and head (`specs.megatron_tied`: one `TiedLayerSpec`
  on the first and the last layer): the tied word embedding is joined and cut as the vocabulary parameter it
  is, the tied learned position embeddings read whole as the replicated parameter they are, and both are
  held by every target stage that uses them, their masters and moments in each one's optimizer state, their
  layer file written once (layer 0's), as DeepSpeed at the target saves it;
- trained with `round_robin_gradients` (`specs.megatron_round_robin`: pp1 x tp2 x dp2 and pp2 x tp2 x dp2, each
  model-parallel rank's groups flattened round-robin over its data-parallel ranks), the order is undone per source
  rank and redone per target rank, each axis changing alone and both at once, under the same oracle run with the
  source's config (no `ds_to_universal` comparison: DeepSpeed's accessors read the wrong elements of such a run);
- what cannot move yet (a tied parameter neither vocabulary-parallel nor replicated, another ZeRO stage) is
  refused in one line, and `--plan` says so; tensor-parallel copies of a tied replicated parameter that differ
  are refused, naming it; the stages' copies may differ (a real `GPTModelPipe` at pp >= 2 lets the last
  stage's position embeddings drift): each target stage takes its own source stage's at the same stages,
  stage 0's at pp1, the last of 4 stage 1's.

The default run makes one 2-rank launch: pp2 x tp2 x dp1 -> pp1 x tp1 x dp2 (both degrees at once), for the
untied and the tied model. The long mode adds the pipeline alone (pp2 x tp2 -> pp1 x tp2), fused SwiGLU halves
merged the same way, and 4-rank launches cutting the stages again (pp2 x tp2 -> pp4 x tp1, "uniform" as the
writer builds it) and growing them (pp1 x tp2 x dp2 -> pp2 x tp1 x dp2, with Megatron-DeepSpeed's `args` and
its sizes); and for the tied model the degree alone (pp2 x tp2 -> pp2 x tp1 x dp2), the stages alone
(-> pp1 x tp2) and pp4 x tp1 (whose last stage holds the tied module alone; DeepSpeed's universal converter
cannot read that shape, DeepSpeed's own save included: the test pins that failure instead of comparing); and the
round-robin sources' six changes (four launches).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from ckptflow.errors import UnsupportedCheckpointError
from ckptflow.formats.deepspeed import load_index
from ckptflow.reshard import reshard, shapes_at
from ckptflow.reshard.plan import plan_reshard
from ckptflow.reshard.shape import Target
from ckptflow.validate import validate
from tests.fixtures.sets import SETS, ParallelFixture, build_megatron_tied
from tests.sampling import long_mode, sample
from tests.test_megatron_reshard import ARGS, PIPE, SWIGLU, _differences, check_same_universal
from tests.test_model_parallel_reshard import (
    check_loaded_state,
    check_same_files,
    deepspeed_round_robin,
    launch_oracle,
    source_sections,
)
from tests.test_reshard import _universal

TIED = "megatron-tied-pp2tp2-z1-fp32"  # `specs.megatron_tied`: GPTModelPipe's tied embedding and head
# (fixture, pp, tp, dp, partition method, layer list's length) at the target.
ALL_CASES = ((PIPE, 1, 1, 2, None, None), (PIPE, 1, 2, 1, None, None), (SWIGLU, 1, 1, 2, None, None),
             (PIPE, 4, 1, 1, "uniform", None), (ARGS, 2, 1, 2, "uniform", 6),
             (TIED, 1, 1, 2, None, None), (TIED, 2, 1, 2, None, None), (TIED, 1, 2, 1, None, None),
             (TIED, 4, 1, 1, "uniform", None))
# The tied case rides on the launch the first one makes (2 ranks, pp1 x tp1).
CASES = sample(ALL_CASES, [(PIPE, 1, 1, 2, None, None), (TIED, 1, 1, 2, None, None)])
# Targets DeepSpeed's universal converter cannot read, DeepSpeed's own save there included: the tied model's 5
# layer files at pp4 leave 3 transformer layers for 4 stages (`DeepSpeedCheckpoint._build_transformer_file_map`
# divides by their quotient, 0).
UNCONVERTIBLE = {(TIED, 4, 1, 1, "uniform", None)}


def case_id(case: tuple) -> str:
    return f"{case[0]}-to-pp{case[1]}-tp{case[2]}-dp{case[3]}"


@pytest.fixture(scope="session")
def stage_fixtures(parallel_fixtures: Mapping[str, ParallelFixture],
                   parallel_extra_fixtures: Mapping[str, ParallelFixture]) -> Mapping[str, ParallelFixture]:
    names = {case[0] for case in CASES} | {PIPE, TIED}
    everything = {**parallel_fixtures, **parallel_extra_fixtures, **build_megatron_tied()}
    return {name: everything[name] for name in names}


@pytest.fixture(scope="session")
def stage_oracle(stage_fixtures: Mapping[str, ParallelFixture], tmp_path_factory: pytest.TempPathFactory
                 ) -> dict[str, Any]:
    return run_stage_oracle(stage_fixtures, CASES, tmp_path_factory.mktemp("megatron-stages-oracle"))


def run_stage_oracle(fixtures: Mapping[str, ParallelFixture], cases: tuple, root: Path) -> dict[str, Any]:
    """Reshard every case; one DeepSpeed launch per target (world size, pp, tp) loads, checks and saves them (a
    source trained with round-robin gradients run so at the target, as its user would)."""
    outs, resaved, results = {}, {}, {}
    launches: dict[tuple[int, int, int], list[dict[str, Any]]] = {}
    for case in cases:
        name, pp, tp, dp, method, layers = case
        fixture = fixtures[name]
        spec = dataclasses.replace(fixture.parallel_spec, pp=pp, tp=tp, world_size=pp * tp * dp)
        outs[case] = root / "out" / case_id(case)
        reshard(str(fixture.dir), str(outs[case]), world_size=spec.world_size, pp=pp, tp=tp, partition_method=method,
                pipeline_layers=layers, workers=2)
        resaved[case] = root / "resaved" / case_id(case)
        results[case] = root / "results" / f"{case_id(case)}.json"
        results[case].parent.mkdir(parents=True, exist_ok=True)
        launches.setdefault((spec.world_size, pp, tp), []).append({
            "spec": spec.to_json(), "source": fixture.parallel_spec.to_json(), "load": str(outs[case]),
            "save": str(resaved[case]), "expected": str(fixture.expected_path), "buffers": str(fixture.buffers_path),
            "result": str(results[case]), **source_sections(fixture),
        })
    for (world_size, pp, tp), jobs in sorted(launches.items()):
        launch_oracle(world_size, jobs, root, f"{world_size}-pp{pp}-tp{tp}")
    return {"outs": outs, "resaved": resaved, "results": results}


def checked_output(oracle: dict[str, Any], case: tuple, fixture: ParallelFixture
                   ) -> tuple[dict[str, Any], dict[str, Any]]:
    """DeepSpeed at the target held the source's state and client state and saved ckptflow's files again, and
    ckptflow's output validates deep: its summary, and the source's."""
    check_loaded_state(oracle, case, fixture)
    assert json.loads(oracle["results"][case].read_text())["client_state_differ"] == []
    check_same_files(oracle, case)
    report = validate(str(oracle["outs"][case]), deep=True)
    assert report.ok, [p.message for p in report.problems]
    return report.summary(), validate(str(fixture.dir)).summary()


def check_stage_output(oracle: dict[str, Any], case: tuple, fixture: ParallelFixture) -> None:
    """`checked_output`, at the target shape with the source's step, parameters and groups."""
    summary, source = checked_output(oracle, case, fixture)
    assert (summary["pp"], summary.get("tp", 1), summary["world_size"]) == case[1:4]
    assert {k: summary[k] for k in ("stage", "step", "params", "numel", "param_groups")} == \
        {k: source[k] for k in ("stage", "step", "params", "numel", "param_groups")}


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_deepspeed_loads_the_stages_at_the_target_shape(stage_oracle: dict[str, Any], case: tuple,
                                                       stage_fixtures: Mapping[str, ParallelFixture],
                                                       tmp_path_factory: pytest.TempPathFactory) -> None:
    fixture = stage_fixtures[case[0]]
    check_stage_output(stage_oracle, case, fixture)
    if case in UNCONVERTIBLE:
        with pytest.raises(ZeroDivisionError):
            _universal(stage_oracle["resaved"][case], {}, tmp_path_factory.mktemp("universal"))
    else:
        check_same_universal(fixture, stage_oracle["resaved"][case], tmp_path_factory.mktemp("universal"))


@pytest.mark.parametrize(("pp", "tp", "dp"), sample(((1, 1, 2), (4, 1, 1)), [(1, 1, 2)]))
def test_a_holdout_at_other_stages_converts_to_the_source_state(
        holdout_fixtures: Mapping[str, ParallelFixture], pp: int, tp: int, dp: int, tmp_path: Path) -> None:
    """A Megatron-style checkpoint no one looked at while this was written (pp2 x tp2, seed 1), its stages and
    degree changed at once: `ds_to_universal` of ckptflow's files equals `ds_to_universal` of the source in every
    fp32 weight, Adam moment and step (no launch: the converter runs in this process)."""
    fixture = holdout_fixtures["holdout-megatron-pp2tp2-z1-fp32-ucinfo-s1"]
    out = tmp_path / "out"
    reshard(str(fixture.dir), str(out), world_size=pp * tp * dp, pp=pp, tp=tp, partition_method="uniform", workers=2)
    check_same_universal(fixture, out, tmp_path / "universal")


# ---- without DeepSpeed ---------------------------------------------------------------------------------


def test_the_stages_merge_with_the_tensor_parallel_ranks(stage_fixtures: Mapping[str, ParallelFixture]) -> None:
    """pp2 x tp2 x dp1 -> pp1 x tp1 x dp2 in one plan: one model-parallel rank holding every layer at its full
    shape (the vocabulary's 38 padded rows kept: the source's args say nothing of the padding), its groups in
    `parameters()` order, every element copied from the source stage and tensor-parallel rank that trained it,
    and the six layer files cut again."""
    index = load_index(str(stage_fixtures[PIPE].dir))
    plan = plan_reshard(index, Target(world_size=2, pp=1, tp=1))
    assert (str(plan.source_shape), str(plan.shape)) == ("ZeRO-1 pp2 x tp2 x dp1 (4 ranks)", "ZeRO-1 dp2 (2 ranks)")
    (part,) = plan.parts
    assert part.flat_shapes[0] == (
        ("0.weight", (38, 16)), ("1.fc1.weight", (32, 16)), ("1.fc2.weight", (16, 32)), ("2.fc1.weight", (32, 16)),
        ("2.fc2.weight", (16, 32)), ("3.fc1.weight", (32, 16)), ("3.fc2.weight", (16, 32)), ("5.weight", (38, 16)))
    assert [name for name, _ in part.flat_shapes[1]][-2:] == ["4.weight", "4.bias"]
    copied = sum(c.numel for u in part.units for f in u.flats for c in f.copies)
    numel = sum(t.numel for t in index.tensors)  # the vocabulary's padding row is zeros, copied from nowhere
    assert copied == numel
    assert {c.src_rank for u in part.units for f in u.flats for c in f.copies} == {0, 1, 2, 3}
    assert [u.optim_file for u in part.units] == [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(2)]
    assert [f.name for f in part.units[0].tensor_files] == [f"layer_{i:02d}-model_00-model_states.pt"
                                                            for i in range(6)]
    assert plan.carried == () and plan.notes[0].startswith("the vocabulary parameters keep the source's 38 padded rows")


def test_the_stages_are_cut_again_at_the_target_degree(stage_fixtures: Mapping[str, ParallelFixture]) -> None:
    """pp2 x tp2 -> pp4 x tp1 ("uniform": layers 0-1 | 2-3 | 4 | 5), and pp2 x tp2 -> pp1 x tp2: the shards
    keep the source's shapes, each target rank's layer files its own."""
    index = load_index(str(stage_fixtures[PIPE].dir))
    plan = plan_reshard(index, Target(world_size=4, pp=4, tp=1, partition_method="uniform"))
    assert [[name for g in part.flat_shapes for name, _ in g] for part in plan.parts] == [
        ["0.weight", "1.fc1.weight", "1.fc2.weight", "1.norm.weight", "1.norm.bias", "1.fc1.bias", "1.fc2.bias"],
        ["2.fc1.weight", "2.fc2.weight", "3.fc1.weight", "3.fc2.weight", "2.norm.weight", "2.norm.bias",
         "2.fc1.bias", "2.fc2.bias", "3.norm.weight", "3.norm.bias", "3.fc1.bias", "3.fc2.bias"],
        ["4.weight", "4.bias"], ["5.weight"]]
    assert [[f.name for f in part.units[0].tensor_files] for part in plan.parts] == [
        ["layer_00-model_00-model_states.pt", "layer_01-model_00-model_states.pt"],
        ["layer_02-model_00-model_states.pt", "layer_03-model_00-model_states.pt"],
        ["layer_04-model_00-model_states.pt"], ["layer_05-model_00-model_states.pt"]]
    assert [part.units[0].model_file for part in plan.parts] == [f"mp_rank_{s:02d}_model_states.pt" for s in range(4)]
    kept = plan_reshard(index, Target(world_size=2, pp=1))
    assert [dict(part.flat_shapes[0])["0.weight"] for part in kept.parts] == [(19, 16), (19, 16)]
    assert [[f.name for f in part.units[0].tensor_files][-1] for part in kept.parts] == [
        "layer_05-model_00-model_states.pt", "layer_05-model_01-model_states.pt"]
    assert kept.notes == ()


def test_the_plan_lists_the_stage_counts(stage_fixtures: Mapping[str, ParallelFixture],
                                        parallel_fixtures: Mapping[str, ParallelFixture]) -> None:
    """`--plan` offers every stage count and degree the planners write; a stage count whose layers DeepSpeed's
    default partition method leaves open (pipe-toy's, trained "uniform", at pp4) says so, and what would work."""
    from ckptflow.reshard.run import plan_shapes

    index = load_index(str(stage_fixtures[PIPE].dir))
    assert [str(s) for s, reason in shapes_at(index, 2) if reason is None] == [
        "ZeRO-1 dp2 (2 ranks)", "ZeRO-1 pp2 x dp1 (2 ranks)", "ZeRO-1 tp2 x dp1 (2 ranks)"]
    options = plan_shapes(str(stage_fixtures[PIPE].dir), 4).options
    assert [str(o.shape) for o in options if o.reason is None] == [
        "ZeRO-1 dp4 (4 ranks)", "ZeRO-1 pp2 x dp2 (4 ranks)", "ZeRO-1 pp4 x dp1 (4 ranks)", "ZeRO-1 tp2 x dp2 (4 ranks)",
        "ZeRO-1 pp2 x tp2 x dp1 (4 ranks)"]
    pipe = str(parallel_fixtures["pipe-pp2-z1-fp32"].dir)
    reasons = {str(o.shape): o.reason for o in plan_shapes(pipe, 4).options}
    assert reasons["ZeRO-1 pp2 x dp2 (4 ranks)"] is None
    assert reasons["ZeRO-1 pp4 x dp1 (4 ranks)"].startswith(
        f"cannot tell which layers each of 4 pipeline stages of {pipe}/global_step3 holds: layer lists the files allow")


WORD_EMBEDDINGS = "tied_modules.embed.word_embeddings.weight"
POSITION_EMBEDDINGS = "tied_modules.embed.position_embeddings.weight"


def test_the_tied_embedding_moves_with_the_stages(stage_fixtures: Mapping[str, ParallelFixture]) -> None:
    """GPTModelPipe's tied embedding (pp2 x tp2, on both stages: 19 of the word embedding's 38 padded rows per
    tensor-parallel rank, the 12 x 16 position embeddings whole on each): merged to pp1 x tp1 they are the one
    stage's first parameters (the `tied_modules` come first), whole, every element copied from stage 0's two
    tensor-parallel ranks, written once, in layer 0's file (the head, a `forward_fn` use, saves none); at pp2 x tp1
    both stages hold them first and stage 0 writes the file; cut "uniform" into 4 stages, the first holds them read
    from stage 0, the last holds them alone, read from stage 1 (the copy its optimizer trained), and writes no layer
    file."""
    index = load_index(str(stage_fixtures[TIED].dir))
    merged = plan_reshard(index, Target(world_size=2, pp=1, tp=1))
    (part,) = merged.parts
    tied = ((WORD_EMBEDDINGS, (38, 16)), (POSITION_EMBEDDINGS, (12, 16)))
    assert part.flat_shapes[0][:2] == tied
    files = part.units[0].tensor_files
    assert [f.name for f in files] == [f"layer_{i:02d}-model_00-model_states.pt" for i in range(5)]
    assert [(t[0], t[1]) for t in files[0].tensors] == [("word_embeddings.weight", (38, 16)),
                                                        ("position_embeddings.weight", (12, 16))]
    copied = sum(c.numel for u in part.units for f in u.flats for c in f.copies)
    assert copied == sum(t.numel for t in index.tensors)  # 37 rows of it: the padding row is zeros
    assert merged.notes[0].startswith("the vocabulary parameters keep the source's 38 padded rows")
    stages = plan_reshard(index, Target(world_size=4, pp=2, tp=1))
    assert [part.flat_shapes[0][:2] for part in stages.parts] == [tied] * 2
    assert [[f.name[:8] for f in part.units[0].tensor_files] for part in stages.parts] == [
        ["layer_00", "layer_01", "layer_02"], ["layer_03", "layer_04"]]
    cut = plan_reshard(index, Target(world_size=4, pp=4, tp=1, partition_method="uniform"))
    assert cut.parts[-1].flat_shapes == (tied,)
    assert cut.parts[-1].units[0].tensor_files == ()
    assert {c.src_rank for u in cut.parts[-1].units for f in u.flats for c in f.copies} == {2, 3}
    assert {c.src_rank for u in cut.parts[0].units for f in u.flats for c in f.copies} == {0, 1}


def test_the_plan_lists_the_tied_shapes(stage_fixtures: Mapping[str, ParallelFixture]) -> None:
    """`--plan` of the tied fixture at 4 ranks offers the tensor-parallel and stage changes it writes; pp4 is left
    open by the default partition method (its head saves no file), tp4 by the padded vocabulary's 38 rows."""
    from ckptflow.reshard.run import plan_shapes

    options = plan_shapes(str(stage_fixtures[TIED].dir), 4).options
    assert [str(o.shape) for o in options if o.reason is None] == [
        "ZeRO-1 dp4 (4 ranks)", "ZeRO-1 pp2 x dp2 (4 ranks)", "ZeRO-1 tp2 x dp2 (4 ranks)",
        "ZeRO-1 pp2 x tp2 x dp1 (4 ranks)"]
    reasons = {str(o.shape): o.reason for o in options}
    assert reasons["ZeRO-1 tp4 x dp1 (4 ranks)"] == (
        f"{WORD_EMBEDDINGS} does not split at tensor-parallel degree 4: the padded vocabulary's 38 rows do not split "
        "into 4 equal blocks")
    assert reasons["ZeRO-1 pp4 x dp1 (4 ranks)"].startswith("cannot tell which layers each of 4 pipeline stages")


def _tied(index: Any) -> Any:
    """`index` whose embedding is a tied module (renamed so in memory)."""
    for rank in index.ranks:
        params = tuple(dataclasses.replace(p, name=p.name.replace("0.weight", "tied_modules.embed.weight", 1)
                                           if p.name == "0.weight" else p.name) for p in rank.params)
        object.__setattr__(rank, "params", params)
    return index


def test_a_tied_parameter_neither_vocabulary_nor_replicated_is_refused_at_another_shape(
        stage_fixtures: Mapping[str, ParallelFixture]) -> None:
    """A tied module's parameter that the checkpoint's `universal_checkpoint_info` records neither as a vocabulary
    parameter nor as replicated (here the untied fixture's embedding renamed in memory, which its patterns then no
    longer name: split on dim 0 by default) is not moved to another tensor-parallel degree or stage count: the
    planners refuse it in one line and `--plan` says why; the source's own degrees are still offered."""
    fixture = stage_fixtures[PIPE]
    index = _tied(load_index(str(fixture.dir)))
    why = ("tied_modules.embed.weight is a tied module's parameter (a TiedLayerSpec its pipeline stages share) that is "
           "neither a vocabulary parameter nor a replicated one: ckptflow moves a tied vocabulary-parallel word "
           "embedding and a tied parameter its universal_checkpoint_info records as replicated over the "
           "tensor-parallel ranks (Megatron's GPT ties its embedding and head, and its learned position embeddings "
           "with them) to another tensor-parallel degree or number of pipeline stages of a Megatron-style checkpoint, "
           "not tied parameters split by other rules")
    for target in (Target(world_size=2, pp=1, tp=1), Target(world_size=2, pp=1), Target(world_size=2, tp=1)):
        with pytest.raises(UnsupportedCheckpointError) as refused:
            plan_reshard(index, target)
        assert str(refused.value) == (
            f"cannot reshard {fixture.dir}/global_step3 (ZeRO-1 pp2 x tp2 x dp1 (4 ranks)) to {target.changes}: "
            f"{why}; ckptflow can write no shape of it at 2 ranks (it can at 4)")
    reasons = {str(s): reason for s, reason in shapes_at(index, 4)}
    assert (reasons["ZeRO-1 dp4 (4 ranks)"], reasons["ZeRO-1 pp2 x tp2 x dp1 (4 ranks)"]) == (why, None)
    from ckptflow.reshard.megatron import plan_megatron_stages
    from ckptflow.reshard.shape import Shape

    with pytest.raises(UnsupportedCheckpointError) as refused:
        plan_megatron_stages(index, Shape(world_size=2, stage=1, pp=1, tp=1))
    assert str(refused.value) == (
        f"{fixture.dir}/global_step3: {why}; keep the tensor-parallel degree and the pipeline stages (leave `tp` "
        "and `pp` out) to change the data-parallel size only")
    assert refused.value.tensor == "tied_modules.embed.weight"


def test_differing_copies_of_a_tied_replicated_parameter_are_refused(
        stage_fixtures: Mapping[str, ParallelFixture], tmp_path: Path) -> None:
    """The tied position embeddings are read from one tensor-parallel rank of the lowest stage, the other copies
    checked as its replicas: one element of tensor-parallel rank 1's fp32 master changed, a tensor-parallel change
    refuses the checkpoint in one line naming the tensor, and writes nothing."""
    import shutil

    import torch

    from ckptflow.errors import CheckpointError

    src = tmp_path / "src"
    shutil.copytree(stage_fixtures[TIED].dir, src)
    optim = src / "global_step3" / "zero_pp_rank_0_mp_rank_01_optim_states.pt"
    state = torch.load(optim, weights_only=False)  # the test's own copy: trusted
    flat = state["optimizer_state_dict"]
    at = flat["param_slice_mappings"][0][POSITION_EMBEDDINGS].start
    with torch.no_grad():
        flat["single_partition_of_fp32_groups"][0][at + 3 * 16 + 5] += 1.0
    torch.save(state, optim)
    with pytest.raises(CheckpointError) as refused:
        reshard(str(src), str(tmp_path / "out"), world_size=2, pp=1, tp=1, workers=2)
    assert str(refused.value).startswith(
        f"refusing to reshard {src}: tensor {POSITION_EMBEDDINGS}: pipeline stage 0 of 2, tensor-parallel rank 0 of 2 "
        "and pipeline stage 0 of 2, tensor-parallel rank 1 of 2 hold different values for the same block")
    assert not (tmp_path / "out").exists()


def _drifted(fixture: ParallelFixture, dst: Path) -> Path:
    """A copy of the tied fixture whose last stage's position embeddings drifted from stage 0's, as a real
    `GPTModelPipe` at pp >= 2 lets them (its head never reads them: weight decay only): the fp32 master and
    both Adam moments of stage 1's two tensor-parallel ranks moved alike (the stage saves no layer file of the
    tied module)."""
    import shutil

    import torch

    shutil.copytree(fixture.dir, dst)
    for mp in (2, 3):
        optim = dst / "global_step3" / f"zero_pp_rank_0_mp_rank_{mp:02d}_optim_states.pt"
        state = torch.load(optim, weights_only=False)  # the test's own copy: trusted
        flat = state["optimizer_state_dict"]
        at = flat["param_slice_mappings"][0][POSITION_EMBEDDINGS]
        moments = flat["base_optimizer_state"]["state"][0]
        with torch.no_grad():
            for tensor, by in ((flat["single_partition_of_fp32_groups"][0], 1.0), (moments["exp_avg"], 0.5),
                               (moments["exp_avg_sq"], 0.25)):
                tensor[at.start:at.start + at.numel] += by * torch.arange(1, at.numel + 1)
        torch.save(state, optim)
    return dst


def _tied_state(folder: Path, mp: int, dp: int) -> list[Any]:
    """Model-parallel rank `mp`'s fp32 master, exp_avg and exp_avg_sq of the tied position embeddings, joined
    from its `dp` data-parallel ranks' optimizer files (trusted: the test's own copy or ckptflow's output)."""
    import torch

    pieces: list[list[Any]] = [[], [], []]
    for d in range(dp):
        state = torch.load(next(folder.glob(f"global_step3/zero_pp_rank_{d}_mp_rank_{mp:02d}_optim_states.pt")),
                           weights_only=False)["optimizer_state_dict"]
        at = state["param_slice_mappings"][0].get(POSITION_EMBEDDINGS)
        if at is None:
            continue
        moments = state["base_optimizer_state"]["state"][0]
        for k, tensor in enumerate((state["single_partition_of_fp32_groups"][0], moments["exp_avg"],
                                    moments["exp_avg_sq"])):
            pieces[k].append(tensor[at.start:at.start + at.numel])
    return [torch.cat(p) for p in pieces]


def test_each_stage_keeps_its_own_copy_of_tied_position_embeddings(
        stage_fixtures: Mapping[str, ParallelFixture], tmp_path: Path) -> None:
    """Stage 1's copy of the tied position embeddings drifted from stage 0's: the stages' copies are not compared,
    only each stage's tensor-parallel ranks. At the same stages (pp2 x tp2 -> pp2 x tp1 x dp2) each target stage
    holds its own source stage's masters and moments, bit for bit, and the output validates deep; merged to one
    stage (-> pp1 x tp1 x dp2) it holds stage 0's (cut into 4, the last stage reads stage 1's:
    `test_the_tied_embedding_moves_with_the_stages`)."""
    import torch

    src = _drifted(stage_fixtures[TIED], tmp_path / "src")
    source = [_tied_state(src, 0, 1), _tied_state(src, 2, 1)]
    assert not torch.equal(source[0][0], source[1][0])
    assert all(torch.equal(a, b) for a, b in zip(source[1], _tied_state(src, 3, 1)))
    reshard(str(src), str(tmp_path / "pp2"), world_size=4, pp=2, tp=1, workers=2)
    for stage in range(2):
        got = _tied_state(tmp_path / "pp2", stage, 2)
        assert all(torch.equal(a, b) for a, b in zip(got, source[stage])), stage
    report = validate(str(tmp_path / "pp2"), deep=True)
    assert report.ok, [p.message for p in report.problems]
    assert (report.index.stage_copies[(POSITION_EMBEDDINGS, 1)].shape, len(report.index.stage_copies)) == ((12, 16), 2)
    reshard(str(src), str(tmp_path / "pp1"), world_size=2, pp=1, tp=1, workers=2)
    assert all(torch.equal(a, b) for a, b in zip(_tied_state(tmp_path / "pp1", 0, 2), source[0]))


@pytest.mark.skipif(not long_mode(), reason="a DeepSpeed launch of its own: long mode (CKPTFLOW_LONG=1)")
def test_deepspeed_loads_each_stage_s_own_copy_natively(stage_fixtures: Mapping[str, ParallelFixture],
                                                        tmp_path: Path) -> None:
    """DeepSpeed at pp2 x tp1 x dp2 loads the drifted source resharded there natively (no universal flag) and,
    saved again, writes exactly ckptflow's files, each stage's optimizer holding its own source stage's masters
    and moments of the tied position embeddings (the fixture's oracle tensors hold stage 0's only, so nothing is
    gathered)."""
    import torch

    fixture = stage_fixtures[TIED]
    src = _drifted(fixture, tmp_path / "src")
    case = (TIED, 2, 1, 2, None, None)
    outs, resaved = {case: tmp_path / "out"}, {case: tmp_path / "resaved"}
    reshard(str(src), str(outs[case]), world_size=4, pp=2, tp=1, workers=2)
    spec = dataclasses.replace(fixture.parallel_spec, pp=2, tp=1, world_size=4)
    result = tmp_path / "result.json"
    launch_oracle(4, [{"spec": spec.to_json(), "source": fixture.parallel_spec.to_json(), "load": str(outs[case]),
                       "save": str(resaved[case]), "result": str(result)}], tmp_path, "drifted")
    assert json.loads(result.read_text())["client_state_differ"] == []
    check_same_files({"outs": outs, "resaved": resaved}, case)
    for stage in range(2):
        got, want = _tied_state(resaved[case], stage, 2), _tied_state(src, 2 * stage, 1)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), stage


def test_another_zero_stage_with_the_stages_is_refused(stage_fixtures: Mapping[str, ParallelFixture],
                                                      tmp_path: Path) -> None:
    fixture = stage_fixtures[PIPE]
    with pytest.raises(UnsupportedCheckpointError) as refused:
        reshard(str(fixture.dir), str(tmp_path / "out"), world_size=2, pp=1, tp=1, stage=2)
    assert str(refused.value) == (
        f"cannot reshard {fixture.dir}/global_step3 (ZeRO-1 pp2 x tp2 x dp1 (4 ranks)) to 2 ranks, ZeRO-2, tp1, pp1: "
        "DeepSpeed trains Megatron-style PipelineModule models at ZeRO stage 1 only; shapes it can write at 2 ranks: "
        "ZeRO-1 dp2 (2 ranks), ZeRO-1 pp2 x dp1 (2 ranks), ZeRO-1 tp2 x dp1 (2 ranks)")
    assert not (tmp_path / "out").exists()


# ---- round-robin gradients ----------------------------------------------------------------------------

# `specs.megatron_round_robin`: megatron-toy pp1 x tp2 x dp2 and pp2 x tp2 x dp2, ZeRO-1, each model-parallel rank's
# groups flattened round-robin over its 2 data-parallel ranks. (fixture, pp, tp, dp, partition method, layer list's
# length) at the target: from one stage, the degree alone (tp1 x dp2), the stages alone (pp2 x tp2 x dp1) and both
# (pp2 x tp1 x dp2), "uniform" as the writer builds it, of its 6 layers (one stage's files leave a trailing layer
# without parameters open); from two stages, both (pp1 x tp1 x dp2), the stages alone (pp1 x tp2 x dp2) and the
# degree alone (pp2 x tp1 x dp2). The oracle runs the target with the source's config and gathers the state from the
# flat partitions at DeepSpeed's own offsets (`writers.parallel_rr`: DeepSpeed's accessors, and so `ds_to_universal`,
# which fails on these sources, read the wrong elements of such a run). Four launches of their own: long mode.
MEGATRON_RR, STAGES_RR = "megatron-tp2dp2-z1-fp32-rr", "megatron-pp2tp2dp2-z1-fp32-rr"
ALL_RR_CASES = ((MEGATRON_RR, 1, 1, 2, None, None), (MEGATRON_RR, 2, 2, 1, "uniform", 6),
                (MEGATRON_RR, 2, 1, 2, "uniform", 6),
                (STAGES_RR, 1, 1, 2, None, None), (STAGES_RR, 1, 2, 2, None, None), (STAGES_RR, 2, 1, 2, None, None))
RR_CASES = sample(ALL_RR_CASES, [])


@pytest.fixture(scope="session")
def rr_fixtures() -> Mapping[str, ParallelFixture]:
    return SETS["megatron-round-robin"].build([MEGATRON_RR, STAGES_RR])


@pytest.fixture(scope="session")
def rr_oracle(rr_fixtures: Mapping[str, ParallelFixture], tmp_path_factory: pytest.TempPathFactory
              ) -> dict[str, Any]:
    return run_stage_oracle(rr_fixtures, RR_CASES, tmp_path_factory.mktemp("megatron-rr-oracle"))


@pytest.mark.parametrize("case", RR_CASES, ids=case_id)
def test_deepspeed_loads_a_round_robin_source_at_another_shape(rr_oracle: dict[str, Any], case: tuple,
                                                               rr_fixtures: Mapping[str, ParallelFixture]) -> None:
    check_stage_output(rr_oracle, case, rr_fixtures[case[0]])


@pytest.mark.skipif(not long_mode(), reason="a DeepSpeed launch of its own (the fixture): long mode (CKPTFLOW_LONG=1)")
def test_a_round_robin_source_is_flattened_again_per_target_rank(rr_fixtures: Mapping[str, ParallelFixture]) -> None:
    """Each model-parallel rank of the sources saved its groups round-robin over its 2 data-parallel ranks, the
    same order on both tensor-parallel ranks, not the module's. Undone (per stage of the pp2 source, whose stages'
    orders undone make the pp1 source's), a group is the module's order; at tp1 x dp2 each group is that order
    flattened round-robin over 2 ranks again, at pp2 x tp2 x dp1 each stage's share of it as it is (over one rank,
    round-robin is the identity), at pp2 x tp1 x dp2 each stage's share flattened round-robin over 2."""
    index = load_index(str(rr_fixtures[MEGATRON_RR].dir))
    saved = [[list(g.params) for g in rank.groups] for rank in index.ranks]
    assert saved[0] == saved[1]
    listed = [list(index.ranks[0].optimizer_order(g)) for g in index.ranks[0].groups]
    assert [deepspeed_round_robin(names, 2) for names in listed] == saved[0] != listed
    assert listed[0] == ["0.weight", *[f"{layer}.{w}.weight" for layer in (1, 2, 3) for w in ("fc1", "fc2")],
                         "5.weight"]
    layers = {1: (0, 1, 2), 2: (3, 4, 5)}  # "uniform" at pp2

    def share(stage: int, names: list[str]) -> list[str]:
        return [n for n in names if int(n.split(".")[0]) in layers[stage]]

    merged = plan_reshard(index, Target(world_size=2, pp=1, tp=1))
    assert [[n for n, _ in g] for g in merged.parts[0].flat_shapes] == [deepspeed_round_robin(n, 2) for n in listed]
    for tp, dp in ((2, 1), (1, 2)):
        plan = plan_reshard(index, Target(world_size=2 * tp * dp, pp=2, tp=tp, partition_method="uniform",
                                          pipeline_layers=6))
        assert [[[n for n, _ in g] for g in part.flat_shapes] for part in plan.parts] == [
            [deepspeed_round_robin(share(stage, names), dp) for names in listed]
            for stage in (1, 2) for _ in range(tp)]
    stages = load_index(str(rr_fixtures[STAGES_RR].dir))
    per_stage = [[list(stages.ranks[s * 2].optimizer_order(g)) for g in stages.ranks[s * 2].groups] for s in (0, 1)]
    assert [[list(g.params) for g in stages.ranks[s * 2].groups] for s in (0, 1)] == [
        [deepspeed_round_robin(names, 2) for names in groups] for groups in per_stage] != per_stage
    assert [first + second for first, second in zip(*per_stage)] == listed
    merged = plan_reshard(stages, Target(world_size=2, pp=1, tp=1))
    assert [[n for n, _ in g] for g in merged.parts[0].flat_shapes] == [deepspeed_round_robin(n, 2) for n in listed]


# ---- Megatron's learned position embeddings ------------------------------------------------------------

INFO = {"original_vocab_size": 37, "tp_replicated_parameter_patterns": [r"\d+\.norm\.weight"],
        "parameter_with_row_parallelism_patterns": [r"\d+\.fc2\.weight"], "vocabulary_parameter_patterns": []}


def test_unlisted_position_embeddings_are_read_as_replicated() -> None:
    """Megatron's learned position embeddings, which `universal_checkpoint_info` leaves out where the embedding is
    untied (`ds_to_universal` would concatenate them into 2 x 8 rows, which Megatron refuses): every
    tensor-parallel rank holds them whole, and ckptflow joins and cuts them so, with a note; listed in a category,
    the category's rule holds; another unlisted name is concatenated on dim 0 as before; copies of other shapes are
    refused, naming why."""
    from ckptflow.formats.deepspeed.readers.pipeline import position_note, shard_shapes, split_pieces

    name = "1.position_embeddings.weight"
    full, pieces, _ = split_pieces(name, [(8, 16), (8, 16)], INFO, 2, "param")
    assert full == (8, 16) and all(len(p) == 1 and p[0].shape == (8, 16) for p in pieces)
    assert shard_shapes(name, (8, 16), INFO, 4) == [(8, 16)] * 4
    assert split_pieces("1.other_embeddings.weight", [(8, 16), (8, 16)], INFO, 2, "param")[0] == (16, 16)
    rows = {**INFO, "parameter_with_row_parallelism_patterns": [r"\d+\.position_embeddings\.weight"]}
    assert split_pieces(name, [(8, 16), (8, 16)], rows, 2, "param")[0] == (8, 32)
    assert position_note(rows, [name]) is None
    assert position_note(INFO, [name, "2.fc1.weight", "tied_modules.embed.position_embeddings.weight"]) == (
        "1.position_embeddings.weight, tied_modules.embed.position_embeddings.weight are Megatron's learned position "
        "embeddings, which every tensor-parallel rank holds whole; the checkpoint's universal_checkpoint_info does "
        "not list them as replicated, so ckptflow reads them as replicated (the ranks' copies must agree) where "
        "DeepSpeed's universal converter would concatenate them")
    with pytest.raises(UnsupportedCheckpointError) as refused:
        split_pieces(name, [(8, 16), (4, 16)], INFO, 2, "param")
    assert str(refused.value) == ("it is Megatron's learned position embeddings, which every tensor-parallel rank "
                                  "holds whole, but its tensor-parallel copies have shapes [[8, 16], [4, 16]]")


def test_a_replicated_tensor_the_info_leaves_out_reshards_as_if_listed(
        stage_fixtures: Mapping[str, ParallelFixture], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rule end to end on DeepSpeed's files: the fixture's `universal_checkpoint_info` rewritten without its
    replicated `norm.weight` pattern, and the rule's name pattern pointed at `norm.weight` (the fixture has no
    position embeddings): pp2 x tp2 -> pp1 x tp1 writes the same tensors as from the source that lists them, and
    says so; without the rule, the norms are concatenated as if split (2 x 16 elements), the file Megatron refuses."""
    import re
    import shutil

    import torch

    from ckptflow.formats.deepspeed.names import UC_INFO
    from ckptflow.formats.deepspeed.readers import pipeline as reader

    fixture = stage_fixtures[PIPE]
    src = tmp_path / "src"
    shutil.copytree(fixture.dir, src)
    tag = (src / "latest").read_text().strip()
    for path in sorted((src / tag).glob("mp_rank_*_model_states.pt")):  # the test's own copy: trusted
        state = torch.load(path, weights_only=False)
        info = state[UC_INFO]
        info["tp_replicated_parameter_patterns"] = [p for p in info["tp_replicated_parameter_patterns"]
                                                    if p != r"\d+\.norm\.weight"]
        torch.save(state, path)
    unruled = plan_reshard(load_index(str(src)), Target(world_size=2, pp=1, tp=1))
    assert dict(unruled.parts[0].flat_shapes[1])["1.norm.weight"] == (32,)
    monkeypatch.setattr(reader, "POSITION_EMBEDDINGS", re.compile(r"(?:^|\.)norm\.weight$"))
    index = load_index(str(src))
    assert any(note.startswith("1.norm.weight, 2.norm.weight, 3.norm.weight are Megatron's") for note in index.notes)
    ruled = plan_reshard(index, Target(world_size=2, pp=1, tp=1))
    assert dict(ruled.parts[0].flat_shapes[1])["1.norm.weight"] == (16,)
    assert ruled.notes[1].startswith("1.norm.weight, 2.norm.weight, 3.norm.weight are Megatron's")
    reshard(str(src), str(tmp_path / "ruled"), world_size=2, pp=1, tp=1, workers=2)
    reshard(str(fixture.dir), str(tmp_path / "listed"), world_size=2, pp=1, tp=1, workers=2)
    for path in sorted((tmp_path / "listed" / tag).iterdir()):
        ours, theirs = (torch.load(d / tag / path.name, weights_only=False) for d in (tmp_path / "ruled",
                                                                                       tmp_path / "listed"))
        for tree in (ours, theirs):
            if isinstance(tree, dict):
                tree.pop(UC_INFO, None)
        differ: dict[str, int] = {}
        _differences(ours, theirs, path.name, differ)
        assert differ == {}, path.name


# ---- Megatron-DeepSpeed's own partition method (pure) -----------------------------------------------------------

# A GPTModelPipe-like layer list, as `megatron/model/gpt_model.py` builds it: "fn" a function (`_to_float16`,
# `float16_to_fp32`), "embed" the tied `EmbeddingPipe`, "T" a `ParallelTransformerLayerPipe`, "norm" the final
# norm, "head" the tied embedding's `forward_fn` use, "lmhead" an untied `LMHeadPipe`.
T_PARAMS = ("input_layernorm.weight", "self_attention.query_key_value.weight", "self_attention.dense.weight",
            "post_attention_layernorm.weight", "mlp.dense_h_to_4h.weight", "mlp.dense_4h_to_h.weight")


def gpt_layers(blocks: int, *, tied: bool = True, half: bool = False) -> list[str]:
    return ["fn", "embed" if tied else "lmembed", *["T"] * blocks, "norm", "head" if tied else "lmhead",
            *(["fn"] if half else [])]


def deepspeed_parts(kinds: list[str], stages: int, method: str = "type:transformer") -> list[int]:
    """DeepSpeed 0.19.8's own `PipelineModule._partition_layers` over `LayerSpec`s of classes named as
    Megatron-DeepSpeed's, driven without a process group (the attributes it reads set by hand)."""
    import types

    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology
    from torch import nn

    classes = {name: type(name, (nn.Module,), {}) for name in
               ("EmbeddingPipe", "ParallelTransformerLayerPipe", "RMSNorm", "LMHeadPipe")}

    def _to_float16(inputs: Any) -> Any:
        return inputs

    def logits(embedding: Any, hidden: Any) -> Any:
        return hidden

    specs = {"fn": lambda: _to_float16, "embed": lambda: TiedLayerSpec("embed", classes["EmbeddingPipe"]),
             "lmembed": lambda: LayerSpec(classes["EmbeddingPipe"]),
             "T": lambda: LayerSpec(classes["ParallelTransformerLayerPipe"]), "norm": lambda: LayerSpec(classes["RMSNorm"]),
             "head": lambda: TiedLayerSpec("embed", classes["EmbeddingPipe"], forward_fn=logits),
             "lmhead": lambda: LayerSpec(classes["LMHeadPipe"])}
    module = types.SimpleNamespace(_layer_specs=[specs[kind]() for kind in kinds], num_stages=stages, global_rank=1,
                                   _topo=PipeDataParallelTopology(num_pp=stages, num_dp=2))
    module._find_layer_type = lambda name: PipelineModule._find_layer_type(module, name)
    module._set_bounds = lambda start, stop: None
    PipelineModule._partition_layers(module, method=method)
    return [int(p) for p in module.parts]


def megatron_index(kinds: list[str], stages: int, args: dict[str, Any] | None = None,
                   method: str = "type:transformer") -> Any:
    """What ckptflow reads of a Megatron-style checkpoint of `kinds` saved at `stages` stages (as DeepSpeed's
    `method` cuts them), tp 1: each stage's parameters, the layer files, the tied module's file."""
    import types

    from ckptflow.formats.deepspeed.model import Param
    from ckptflow.formats.torch.inert import InertRecord

    parts = deepspeed_parts(kinds, stages, method)
    embed = ("word_embeddings.weight", "position_embeddings.weight")
    ranks, files = [], []
    first_embed = kinds.index("embed") if "embed" in kinds else None
    for s in range(stages):
        names: list[str] = []
        span = range(parts[s], parts[s + 1])
        if any(kinds[i] in ("embed", "head") for i in span):
            names += [f"tied_modules.embed.{n}" for n in embed]
        for i in span:
            local = {"T": T_PARAMS, "norm": ("weight",), "lmembed": embed, "lmhead": ("weight",)}.get(kinds[i], ())
            names += [f"{i}.{n}" for n in local]
        state = {"buffer_names": []}
        if args is not None:
            state["args"] = InertRecord("argparse", "Namespace", "NEWOBJ", ops=(("build", dict(args)),))
        ranks.append(types.SimpleNamespace(params=tuple(Param(n, (4, 4), "float32", 0) for n in names),
                                           model_states=(state,)))
    files = [f"layer_{i:02d}-model_00-model_states.pt" for i, kind in enumerate(kinds)
             if kind in ("T", "norm", "lmembed", "lmhead") or i == first_embed]
    return types.SimpleNamespace(ranks=ranks, tp=1, pp=stages, root="mem://gpt", tag="global_step3", kind="megatron",
                                 carried=tuple(files), tied_layers=(("embed", first_embed),) if first_embed else ())


def deepspeed_stages(kinds: list[str], stages: int) -> list[tuple[tuple[int, ...], tuple[str, ...]]]:
    """Each stage's modules with parameters and tied modules, as DeepSpeed's `type:transformer` cuts `kinds`."""
    parts = deepspeed_parts(kinds, stages)
    return [(tuple(i for i in range(a, b) if kinds[i] in ("T", "norm", "lmembed", "lmhead")),
             ("embed",) if any(kinds[i] in ("embed", "head") for i in range(a, b)) else ()) for a, b in zip(parts, parts[1:])]


GPT_ARGS = {"num_layers": 0, "untie_embeddings_and_output_weights": False, "fp16": False, "bf16": False,
            "num_experts": [1]}


# (transformer layers, tied embedding, fp16, source stages); the long mode takes them all.
ALL_GPT_CUTS = tuple((blocks, tied, half, source) for blocks, tied, half in (
    (2, True, False), (4, True, False), (6, True, True), (5, False, False), (8, True, False), (3, False, True))
    for source in (2, 3) if source <= blocks)
GPT_CUTS = sample(ALL_GPT_CUTS, [(4, True, False, 2), (3, False, True, 3)])


@pytest.mark.parametrize(("blocks", "tied", "half", "source"), GPT_CUTS)
def test_type_transformer_cuts_the_stages_as_deepspeed_does(blocks: int, tied: bool, half: bool, source: int) -> None:
    """Pure: a GPTModelPipe-like model saved at `source` stages by DeepSpeed's `type:transformer` (its
    `ParallelTransformerLayerPipe` layers weighing 1, the rest 0, functions 0) is cut again at 2, 3 and 4 stages as
    DeepSpeed's own `PipelineModule._partition_layers` cuts the same `LayerSpec`s: ckptflow knows its transformer
    layers by their parameters, its layer list by its `args` or, from two stages or more, by its files alone."""
    from ckptflow.reshard import megatron
    from ckptflow.reshard.shape import Shape

    kinds = gpt_layers(blocks, tied=tied, half=half)
    index = megatron_index(kinds, source, {**GPT_ARGS, "num_layers": blocks, "untie_embeddings_and_output_weights":
                                           not tied, "fp16": half})
    assert megatron.default_partition_method(index) == "type:transformer"
    bare = megatron_index(kinds, source, method="type:transformer")  # no args: the files alone
    for target in (2, 3, 4):
        if target > blocks:
            continue
        shape = Shape(world_size=target, stage=1, tp=1, pp=target)
        expected = deepspeed_stages(kinds, target)
        assert [(s.layers, s.tied) for s in megatron.megatron_stages(index, shape)] == expected, (source, target)
        assert [(s.layers, s.tied) for s in megatron.megatron_stages(bare, shape)] == expected, (source, target)


@pytest.mark.parametrize("blocks", sample((3, 4, 7), [4]))
def test_type_transformer_from_one_stage(blocks: int) -> None:
    """Pure: from one stage (nothing in the files says where the tied head sits), the run's `args` give the layer
    list, and the stages are DeepSpeed's; without them, the files leave the tied head open and ckptflow refuses."""
    from ckptflow.reshard import megatron
    from ckptflow.reshard.shape import Shape

    kinds = gpt_layers(blocks)
    index = megatron_index(kinds, 1, {**GPT_ARGS, "num_layers": blocks})
    for target in (2, 3, 4):
        stages = megatron.megatron_stages(index, Shape(world_size=target, stage=1, tp=1, pp=target))
        assert [(s.layers, s.tied) for s in stages] == deepspeed_stages(kinds, target)
    bare = megatron_index(kinds, 1)
    with pytest.raises(UnsupportedCheckpointError, match=(
            r"cannot tell which layers each of 2 pipeline stages of mem://gpt/global_step3 holds: layer lists the files "
            r"allow .* under partition method 'type:transformer'")):
        megatron.megatron_stages(bare, Shape(world_size=2, stage=1, tp=1, pp=2))


def test_the_default_partition_method_is_the_runs_own() -> None:
    """Pure: `pp_partition_method` in the run's `args` where set (BigScience's Megatron-DeepSpeed), else GPTModelPipe's
    `type:transformer` for a model with Megatron's transformer layers, else PipelineModule's `parameters`; the user's
    `--partition-method` wins."""
    from ckptflow.reshard import megatron
    from ckptflow.reshard.shape import Shape

    kinds = gpt_layers(4)
    assert megatron.default_partition_method(megatron_index(kinds, 2, {**GPT_ARGS, "num_layers": 4})) == \
        "type:transformer"
    assert megatron.default_partition_method(megatron_index(kinds, 2, {**GPT_ARGS, "pp_partition_method": None})) == \
        "type:transformer"
    index = megatron_index(kinds, 2, {**GPT_ARGS, "num_layers": 4, "pp_partition_method": "uniform"})
    assert megatron.default_partition_method(index) == "uniform"
    toy = megatron_index(["lmembed", "norm", "norm", "lmhead"], 2, method="uniform")
    assert megatron.default_partition_method(toy) == "parameters"
    shape = Shape(world_size=4, stage=1, tp=1, pp=4)
    by_uniform = [(s.layers, s.tied) for s in megatron.megatron_stages(index, shape)]
    assert by_uniform != deepspeed_stages(kinds, 4)
    assert [(s.layers, s.tied) for s in megatron.megatron_stages(index, shape, "type:transformer")] == \
        deepspeed_stages(kinds, 4)


def test_other_type_methods_are_refused() -> None:
    """Pure: another `type:REGEX` is refused, naming the one ckptflow computes; `type:transformer` of a model without
    Megatron's transformer layers is refused as DeepSpeed refuses it."""
    from ckptflow.reshard import megatron
    from ckptflow.reshard.shape import Shape

    shape = Shape(world_size=2, stage=1, tp=1, pp=2)
    index = megatron_index(gpt_layers(4), 2, {**GPT_ARGS, "num_layers": 4})
    with pytest.raises(UnsupportedCheckpointError, match=(
            r"^cannot tell which layers each of 2 pipeline stages of mem://gpt/global_step3 holds: partition method "
            r"'type:embedding' weighs the layers whose class name matches, and ckptflow knows one class of its layers, "
            r"ParallelTransformerLayerPipe \(partition method 'type:transformer'\); "
            r"use `parameters`, `uniform` or `type:transformer`$")):
        megatron.megatron_stages(index, shape, "type:embedding")
    toy = megatron_index(["lmembed", "norm", "norm", "lmhead"], 2, method="uniform")
    with pytest.raises(RuntimeError, match="Partitioning 'transformer' found no valid layers to partition"):
        deepspeed_parts(["lmembed", "norm", "norm", "lmhead"], 2)
    with pytest.raises(UnsupportedCheckpointError, match=(
            r"partition method 'type:transformer' weighs its ParallelTransformerLayerPipe layers, and it has none "
            r"\(DeepSpeed finds no layer to partition\); give the `partition_method` the model was trained with$")):
        megatron.megatron_stages(toy, shape, "type:transformer")
    hostile = megatron_index(gpt_layers(4), 2, {**GPT_ARGS, "num_layers": 4, "pp_partition_method": "type:" + "x" * 5000})
    with pytest.raises(UnsupportedCheckpointError) as refused:  # a method from the checkpoint's args, quoted short
        megatron.megatron_stages(hostile, shape)
    assert "partition method 'type:xxx" in str(refused.value) and len(str(refused.value)) < 600
    # DeepSpeed matches class names ignoring case; the hint names only methods ckptflow then computes
    assert megatron.megatron_stages(index, shape, "type:Transformer") == megatron.megatron_stages(index, shape,
                                                                                                 "type:transformer")
    with pytest.raises(UnsupportedCheckpointError) as refused:
        megatron.megatron_stages(toy, shape, "type:embedding")
    assert refused.value.hint == "use `parameters` or `uniform`"


def test_a_tied_module_without_split_rules_moves_between_stages_at_tp1_only() -> None:
    """Pure: Megatron-DeepSpeed records `tp_replicated_parameter_patterns` above tp 1 only, so a tp 1 GPT's tied
    position embeddings have no rule; between tp 1 checkpoints every tied parameter is whole and moves as it is,
    while a change to another degree (whose split needs the rule) is refused naming it."""
    from ckptflow.formats.deepspeed.readers.pipeline import tied_module

    index = megatron_index(gpt_layers(4), 2, {**GPT_ARGS, "num_layers": 4})
    assert tied_module(index, 1) is None
    assert tied_module(index, 2) == "tied_modules.embed.word_embeddings.weight"
    assert tied_module(index) == "tied_modules.embed.word_embeddings.weight"  # the degree not said: refused
