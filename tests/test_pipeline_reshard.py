"""Changing a PipelineModule checkpoint's number of pipeline stages (issue 24), checked against DeepSpeed.

For each case ckptflow merges the fixture's pipeline stages into one (``--pp 1``) at a new data-parallel
size; then DeepSpeed builds the same ``PipelineModule`` (``pipe-toy``: a tied embedding on the first and
last layers) with one stage at that size (``tests.oracles.parallel_reshard``, the fixture writer's own
job), loads the output natively (``engine.load_checkpoint``, no universal checkpoint), and

- the fp32 weights, Adam moments and buffers it then holds equal the live engine's state at the source
  shape (``expected.safetensors``) bit for bit;
- saved again at that shape, it writes exactly ckptflow's files (layer files included).

And to another number of stages above one (``--pp 4``, ``--partition-method uniform``, the fixture's), checked the
same way; from ckptflow's pp4 (split by ``parameters``) and its pp2 out of pp3 and pp4, DeepSpeed trains one more
step to the loss its own checkpoint trains to, bit for bit. Stage counts the files do not determine are refused, as is ZeRO-0 kept at ZeRO-0, each in one line that says why
(Megatron-style pipelines: `tests/test_megatron_stages.py`).

A ZeRO-0 PipelineModule goes to ZeRO-1 at its own number of stages (issue 24; its tied module's key given,
which no ZeRO-0 file records), checked the same way on the 4-rank launch of the splits, and merged to one stage
in the same command, on the 2-rank launch of the merges; at other stage counts it writes what those two steps
write; stages that cannot be named are refused in one line. Trained in bf16 at ZeRO-0 (BF16_Optimizer, whose
checkpoint DeepSpeed cannot load back), its stages are named by its files and it goes to ZeRO-1 at pp2, pp1 and
pp4 (checked against DeepSpeed in the long mode; by default pure tests against its two-step route).
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from ckptflow.errors import UnsupportedCheckpointError
from ckptflow.formats.deepspeed import load_index
from ckptflow.formats.deepspeed.names import ALLOWED
from ckptflow.formats.torch.zipdir import open_archive
from ckptflow.reshard import reshard
from ckptflow.reshard.plan import plan_reshard
from ckptflow.reshard.shape import Target
from ckptflow.validate import validate
from tests.fixtures.replay import launch
from tests.fixtures.sets import SETS, ParallelFixture
from tests.sampling import sample
from tests.test_model_parallel_reshard import (
    check_loaded_state,
    check_same_files,
    deepspeed_round_robin,
    deepspeed_undone,
    launch_oracle,
    source_sections,
)
from tests.test_parallel_fixtures import STATES, universal_tensor
from tests.test_reshard import _differences, _plain

# (fixture, data-parallel size at one stage): pp2 x dp1 -> dp2 (same ranks), pp2 x dp2 -> dp3, bf16; and
# pp2 x dp2 trained with round_robin_gradients (`specs.pipe_round_robin`) -> dp3 (by default) and -> dp2.
RR = "pipe-pp2dp2-z1-fp32-rr"
CASES = sample((("pipe-pp2-z1-fp32", 2), ("pipe-pp2dp2-z1-fp32", 3), ("pipe-pp2-z1-bf16", 2), (RR, 3), (RR, 2)),
               keep=[("pipe-pp2-z1-fp32", 2), ("pipe-pp2dp2-z1-fp32", 3), ("pipe-pp2-z1-bf16", 2), (RR, 3)])


def case_id(case: tuple[str, int]) -> str:
    return f"{case[0]}-to-pp1-dp{case[1]}"


@pytest.fixture(scope="session")
def pipe_rr_fixtures() -> Mapping[str, ParallelFixture]:
    """`specs.pipe_round_robin`'s checkpoint (its own set: one 4-rank launch)."""
    return SETS["pipe-round-robin"].build()


@pytest.fixture(scope="session")
def pipe_oracle(pipe_fixtures: Mapping[str, ParallelFixture],
                tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Reshard every case to pp1; one DeepSpeed launch per world size loads and re-saves them. The 2-rank
    launch also trains one step from `pipe-pp2-z1-fp32` as DeepSpeed saved it (`test_the_next_loss_at_four_
    stages_is_the_sources`' reference)."""
    root = tmp_path_factory.mktemp("pipe-reshard-oracle")
    outs, resaved, results = {}, {}, {}
    launches: dict[int, list[dict[str, Any]]] = {}
    for case in CASES:
        name, dp = case
        fixture = pipe_fixtures[name]
        spec = dataclasses.replace(fixture.parallel_spec, pp=1, world_size=dp)
        outs[case] = root / "out" / case_id(case)
        reshard(str(fixture.dir), str(outs[case]), world_size=dp, pp=1, workers=2)
        resaved[case] = root / "resaved" / case_id(case)
        results[case] = root / "results" / f"{case_id(case)}.json"
        results[case].parent.mkdir(parents=True, exist_ok=True)
        launches.setdefault(dp, []).append({
            "spec": spec.to_json(), "load": str(outs[case]), "save": str(resaved[case]),
            "expected": str(fixture.expected_path), "buffers": str(fixture.buffers_path), "result": str(results[case]),
            **source_sections(fixture)})
    name, dp, tied, _ = ZERO0_MERGED  # ZeRO-0 pp2 -> ZeRO-1 pp1 x dp2, riding the 2-rank launch
    fixture = pipe_fixtures[name]
    outs[ZERO0_MERGED] = root / "out" / zero0_id(ZERO0_MERGED)
    reshard(str(fixture.dir), str(outs[ZERO0_MERGED]), world_size=dp, pp=1, stage=1, tied_modules=tied, workers=2)
    resaved[ZERO0_MERGED] = root / "resaved" / zero0_id(ZERO0_MERGED)
    results[ZERO0_MERGED] = root / "results" / f"{zero0_id(ZERO0_MERGED)}.json"
    launches[dp].append({
        "spec": dataclasses.replace(fixture.parallel_spec, pp=1, stage=1, world_size=dp).to_json(),
        "source": fixture.parallel_spec.to_json(), "load": str(outs[ZERO0_MERGED]),
        "save": str(resaved[ZERO0_MERGED]), "expected": str(fixture.expected_path),
        "buffers": str(fixture.buffers_path), "result": str(results[ZERO0_MERGED]), **source_sections(fixture)})
    source = pipe_fixtures[PP2_SOURCE]
    source_result = root / "results" / f"{PP2_SOURCE}.json"
    launches[source.parallel_spec.world_size].append({
        "spec": source.parallel_spec.to_json(), "load": str(source.dir), "save": None, "expected": None,
        "result": str(source_result), "next_loss": True})
    for world_size, jobs in sorted(launches.items()):
        launch_oracle(world_size, jobs, root, f"{world_size}-pipe-pp1")
    return {"outs": outs, "resaved": resaved, "results": results, "source_result": source_result}


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_deepspeed_loads_the_merged_stages_holding_the_source_state(
        pipe_oracle: dict[str, Any], case: tuple[str, int], pipe_fixtures: Mapping[str, ParallelFixture]) -> None:
    check_loaded_state(pipe_oracle, case, pipe_fixtures[case[0]])


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_deepspeed_writes_the_same_files_at_one_stage(pipe_oracle: dict[str, Any], case: tuple[str, int]) -> None:
    check_same_files(pipe_oracle, case)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_the_merged_stages_validate(pipe_oracle: dict[str, Any], case: tuple[str, int],
                                    pipe_fixtures: Mapping[str, ParallelFixture]) -> None:
    report = validate(str(pipe_oracle["outs"][case]), deep=True)
    assert report.ok, [p.message for p in report.problems]
    summary, source = report.summary(), validate(str(pipe_fixtures[case[0]].dir)).summary()
    assert (summary["pp"], summary["world_size"]) == (1, case[1])
    assert {k: summary[k] for k in ("stage", "step", "params", "numel", "buffers", "param_groups")} == \
        {k: source[k] for k in ("stage", "step", "params", "numel", "buffers", "param_groups")}


def test_the_merged_stage_flattens_in_parameters_order(parallel_fixtures: Mapping[str, ParallelFixture]) -> None:
    """The one stage's groups hold every stage's parameters once, the tied module first, then by layer,
    each parameter's fp32 elements copied from the stage that trained it (pure: no byte read)."""
    index = load_index(str(parallel_fixtures["pipe-pp2dp2-z1-fp32"].dir))
    plan = plan_reshard(index, Target(world_size=3, pp=1))
    assert (str(plan.source_shape), str(plan.shape)) == ("ZeRO-1 pp2 x dp2 (4 ranks)", "ZeRO-1 dp3 (3 ranks)")
    (part,) = plan.parts
    decay = [name for name, _ in part.flat_shapes[0]]
    assert decay == ["tied_modules.embed.weight", "1.fc1.weight", "1.fc2.weight", "2.fc1.weight", "2.fc2.weight",
                     "3.fc1.weight", "3.fc2.weight"]
    assert [name for name, _ in part.flat_shapes[1]][-2:] == ["4.weight", "4.bias"]
    for g, shapes in enumerate(part.flat_shapes):
        numel = sum(part.index.param_by_name[n].numel for n, _ in shapes)
        assert sum(c.numel for u in part.units for c in u.flats[g].copies) == numel
    sources = {c.src_rank for u in part.units for f in u.flats for c in f.copies}
    assert sources == {0, 1, 2, 3}  # virtual rank stage * 2 + dp: both stages' partitions
    assert [u.optim_file for u in part.units] == [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(3)]
    assert set(plan.carried) == {f"layer_{i:02d}-model_states.pt" for i in range(5)}


def test_a_round_robin_source_s_stages_are_laid_out_again_round_robin(
        parallel_fixtures: Mapping[str, ParallelFixture], pipe_rr_fixtures: Mapping[str, ParallelFixture]) -> None:
    """pipe-toy at pp2 x dp2 trained with round_robin_gradients: DeepSpeed flattened each stage's groups
    round-robin over the stage's 2 data-parallel ranks, so undone over 2 they are the stage module's order
    (the same run without the setting, `pipe-pp2dp2-z1-fp32`, saves that order), and saved they are not. At
    the target each stage's groups are DeepSpeed's `_round_robin_reorder` of that order over the target's
    data-parallel ranks: over 3 at pp1 x dp3, over 1 (none) at pp4 x dp1, over 2 at pp3 x dp2 (pure: no byte
    read)."""
    index = load_index(str(pipe_rr_fixtures[RR].dir))
    plain = load_index(str(parallel_fixtures["pipe-pp2dp2-z1-fp32"].dir))
    moved = 0
    for rank, module in zip(index.ranks, plain.ranks):
        for group, listed in zip(rank.groups, module.groups):
            assert deepspeed_undone(group.params, 2) == list(listed.params)
            moved += list(group.params) != list(listed.params)
    assert moved  # the setting changed some stage's saved order
    for target, ranks in ((Target(world_size=3, pp=1), 3), (Target(world_size=4, pp=4, partition_method="uniform"), 1),
                          (Target(world_size=6, pp=3, partition_method="uniform"), 2)):
        ours, theirs = plan_reshard(index, target), plan_reshard(plain, target)
        assert [[[n for n, _ in g] for g in part.flat_shapes] for part in ours.parts] == [
            [deepspeed_round_robin([n for n, _ in g], ranks) for g in part.flat_shapes] for part in theirs.parts]


def test_other_stage_counts_are_refused(parallel_extra_fixtures: Mapping[str, ParallelFixture],
                                        tmp_path: Path) -> None:
    """A ZeRO-0 PipelineModule kept at ZeRO-0 with another stage count is refused, naming the shapes it writes
    with its tied module named; without it, the one thing every shape lacks, in the same line."""
    zero0 = parallel_extra_fixtures["pipe-pp2-z0-fp32"]
    refused = (r"to 2 ranks, pp1: a ZeRO-0 checkpoint's optimizer state is saved by position, and ckptflow writes it at "
               r"another shape only at another ZeRO stage, where it is named \(its weights can still be consolidated\); ")
    with pytest.raises(UnsupportedCheckpointError, match=refused + (
            r"shapes it can write at 2 ranks: ZeRO-1 dp2 \(2 ranks\), ZeRO-1 pp2 x dp1 \(2 ranks\)$")):
        reshard(str(zero0.dir), str(tmp_path / "out"), world_size=2, pp=1, tied_modules="embed=0")
    with pytest.raises(UnsupportedCheckpointError, match=refused + (
            r"ckptflow can write no shape of it at 2 ranks as things stand: its stages use a tied module held in "
            r"layer_00-model_states.pt, whose TiedLayerSpec key no ZeRO-0 file records: give it with `tied_modules` "
            r"KEY=0$")):
        reshard(str(zero0.dir), str(tmp_path / "out"), world_size=2, pp=1)
    assert not (tmp_path / "out").exists()


def test_declared_facts_a_reshard_has_no_use_for_are_refused(
        parallel_fixtures: Mapping[str, ParallelFixture], parallel_extra_fixtures: Mapping[str, ParallelFixture],
        tmp_path: Path) -> None:
    """Tied modules given for a checkpoint that records them, layer types for a reshard that keeps the stage
    count, or that contradict the files at pp1: refused in one line, not taken silently (nor naming a folder
    of their own in the Prefect form), and `--plan` says the same of those shapes."""
    from ckptflow.reshard.run import plan_shapes

    pipe = parallel_fixtures["pipe-pp2-z1-fp32"]
    tied = (r"`tied_modules` names the tied modules of a ZeRO-0 PipelineModule checkpoint, whose files do not record "
            r"them, and a PipelineModule .* checkpoint's have no use for them; leave `tied_modules` out")
    with pytest.raises(UnsupportedCheckpointError, match=r"global_step3: " + tied + "$"):
        reshard(str(pipe.dir), str(tmp_path / "out"), world_size=4, tied_modules="embed=0")
    kept = (r"`layer_types` weighs the layers of a PipelineModule cut into another number of pipeline stages, and "
            r"this keeps its 2; leave `layer_types` out, or give `pp`")
    with pytest.raises(UnsupportedCheckpointError, match=r"global_step3: " + kept + "$"):
        reshard(str(pipe.dir), str(tmp_path / "out"), world_size=4, partition_method="type:PipeBlock",
                layer_types=PIPE_TYPES)
    zero0 = parallel_extra_fixtures["pipe-pp2-z0-fp32"]
    with pytest.raises(UnsupportedCheckpointError, match="leave `layer_types` out"):
        reshard(str(zero0.dir), str(tmp_path / "out"), world_size=2, stage=1, tied_modules="embed=0",
                layer_types="A,B")
    assert not (tmp_path / "out").exists()
    contradicted = ("global_step3: layer 2 saved layer_02-model_states.pt, and `layer_types` names 2 layers (0-1); "
                    "give `layer_types` one name per entry of the model's layer list, in order")
    reasons = {str(o.shape): o.reason for o in plan_shapes(str(pipe.dir), 4, layer_types="A,B").options}
    assert reasons["ZeRO-1 pp2 x dp2 (4 ranks)"] == kept.replace("\\", "")
    assert (reasons["ZeRO-1 dp4 (4 ranks)"] or "").endswith(contradicted)  # at pp1 too, as the reshard says
    assert (reasons["ZeRO-1 pp4 x dp1 (4 ranks)"] or "").endswith(contradicted)
    reasons = {str(o.shape): o.reason for o in plan_shapes(str(pipe.dir), 4, tied_modules="embed=0").options}
    assert len(reasons) == 3 and all(re.fullmatch(tied, reason or "") for reason in reasons.values()), reasons


def test_tied_modules_come_first_in_the_order_the_stages_first_use_them() -> None:
    """Pure: stage 1 uses tied module b before a, but a was first used on stage 0; a layer's parameters
    keep their order, whatever the group."""
    from types import SimpleNamespace

    from ckptflow.reshard.pipeline import _group_key, _group_names, _merged

    def stage(*groups: list[str]) -> Any:
        out = [SimpleNamespace(index=g, hyper={"name": f"g{g}"}, params=tuple(names)) for g, names in enumerate(groups)]
        rank = SimpleNamespace(groups=out, params=[SimpleNamespace(name=n) for g in groups for n in g],
                               model_states=[{}])
        rank.in_optimizer_order = lambda: rank  # not round-robin: the saved order is the optimizer's
        return rank

    ranks = [stage(["tied_modules.a.weight", "1.fc.weight"], ["1.fc.bias"]),
             stage(["tied_modules.b.weight", "tied_modules.a.weight", "3.fc.weight", "10.fc.weight"],
                   ["tied_modules.b.bias", "3.fc.bias", "3.norm.weight", "4.weight"])]
    keys = [_group_key(g) for g in ranks[0].groups]
    assert _group_names(ranks, keys, _merged(ranks)) == [
        ["tied_modules.a.weight", "tied_modules.b.weight", "1.fc.weight", "3.fc.weight", "10.fc.weight"],
        ["tied_modules.b.bias", "1.fc.bias", "3.fc.bias", "3.norm.weight", "4.weight"],
    ]


def test_a_holdout_merged_to_one_stage_converts_to_the_source_state(
        holdout_fixtures: Mapping[str, ParallelFixture], tmp_path: Path) -> None:
    """A checkpoint no one looked at while this was written (bf16, pp2 x dp2, seed 1) merged to pp1 x dp3:
    DeepSpeed's own offline converter (ds_to_universal, one process) reads every parameter's fp32 master
    and Adam moments out of ckptflow's files equal to the live engine's at the source shape, and the step
    equal to the source's. (Split to pp4 it is loaded by DeepSpeed in `split_oracle`: ds_to_universal
    takes any PipelineModule's layer files for Megatron's and divides by zero on pipe-toy at pp4.)"""
    fixture = holdout_fixtures["holdout-pipe-pp2dp2-z1-bf16-s1"]
    out = tmp_path / "out"
    reshard(str(fixture.dir), str(out), world_size=3, pp=1, workers=2)
    tag = (out / "latest").read_text()
    subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(out / tag),
                    "--output_folder", str(tmp_path / "universal"), "--inject_missing_state"],
                   check=True, capture_output=True, timeout=600)
    expected = load_file(fixture.expected_path)
    compared = 0
    for name in fixture.spec["params"]:
        for state in STATES:
            got = universal_tensor(tmp_path / "universal" / "zero", name, state, fixture.spec["layout"])
            assert torch.equal(got.float().reshape(-1), expected[f"{state}/{name}"].reshape(-1)), (name, state)
            compared += 1
        source_step = Path(fixture.dir).parent / "universal" / tag / "zero" / name / "step.pt"
        assert torch.load(tmp_path / "universal" / "zero" / name / "step.pt", weights_only=True) == \
            torch.load(source_step, weights_only=True) == fixture.spec["global_steps"], name
    assert compared == len(expected) == 3 * len(fixture.spec["params"])


# ---- another number of stages above one ------------------------------------------------------------------

# (fixture, pp, dp, via, partition method, layers): pp2 -> pp4 (layer 4 alone on a stage, the tied head
# alone on the last: each keeps one param group), pp2 x dp2 -> pp4 x dp1, pp3 and pp4 (ckptflow's own
# pp2 x dp2 -> pp3, -> pp4) regrouped to pp2 x dp2 (from pp4 with the layer list's length given: a pp4
# source's last stage may hold a function before the head), all "uniform" as `pipe-toy` trains; bf16
# (BF16_Optimizer) pp2 -> pp4; and pp2 -> pp4 by "parameters" (DeepSpeed's default, which the source's stages
# fit too) with the layer list's length given, since the files leave it open there; and the holdout (bf16,
# pp2 x dp2, seed 1) to pp4. One 4-rank launch, which also trains one step from each regroup and from its
# source as DeepSpeed saved it, and from the pp4 split by "parameters" (`NEXT_LOSS_AT_PP4`). In the long mode
# also the round-robin source (`RR`) to pp4 x dp1, and through ckptflow's pp3 x dp1 back to pp2 x dp2 (each
# target stage flattened round-robin over its 2 ranks again), both loaded, not trained (a step from the
# regroup is the source's: the non-round-robin regroups' check).
ALL_SPLITS = (("pipe-pp2-z1-fp32", 4, 1, None, "uniform", None), ("pipe-pp2dp2-z1-fp32", 4, 1, None, "uniform", None),
              ("pipe-pp2dp2-z1-fp32", 2, 2, 3, "uniform", None), ("pipe-pp2dp2-z1-fp32", 2, 2, 4, "uniform", 6),
              ("pipe-pp2-z1-bf16", 4, 1, None, "uniform", None), ("pipe-pp2-z1-fp32", 4, 1, None, "parameters", 6),
              ("holdout-pipe-pp2dp2-z1-bf16-s1", 4, 1, None, "uniform", None), (RR, 4, 1, None, "uniform", None),
              (RR, 2, 2, 3, "uniform", None))
SPLITS = sample(ALL_SPLITS, keep=[case for case in ALL_SPLITS if case[0] != RR])
# The pp4 split DeepSpeed trains a step from: by "parameters" its stages hold layers 0-1 | 2 | 3 | 4-5, each
# both param groups (decayed matrices; biases and norms). By "uniform" (0-1 | 2-3 | 4 | 5) stage 2 holds
# only the norm's and stage 3 only the tied head's, and DeepSpeed 0.19.8 hangs in that step: it drops empty
# groups (`engine.py` `_configure_basic_optimizer`), and ZeRO-1/2's `scaled_global_norm` all-reduces each
# group's norm over the pipeline's model-parallel group (`stage_1_and_2.py` `get_grad_norm_direct` ->
# `_model_parallel_all_reduce`), so ranks 0-1 wait in a second all-reduce that ranks 2-3, past the step and
# broadcasting the loss (`pipe/engine.py` `_aggregate_total_loss`), never join (DeepSpeed issue #1522, open).
NEXT_LOSS_AT_PP4 = ("pipe-pp2-z1-fp32", 4, 1, None, "parameters", 6)
PP2_SOURCE = NEXT_LOSS_AT_PP4[0]


# A ZeRO-0 PipelineModule at ZeRO-1 at its own number of stages (fixture, data-parallel size, tied modules): its
# tied embedding's key, which no ZeRO-0 file records, given as the user would. Rides `split_oracle`'s launch.
ZERO0 = ("pipe-pp2-z0-fp32", 2, "embed=0")
# ... and merged to one stage at dp2 (fixture, dp, tied modules, "pp1"): rides `pipe_oracle`'s 2-rank launch.
ZERO0_MERGED = ("pipe-pp2-z0-fp32", 2, "embed=0", "pp1")


def zero0_id(case: tuple[str, ...]) -> str:
    return f"{case[0]}-to-z1-{case[3] if len(case) > 3 else 'pp2'}-dp{case[1]}"


def split_id(case: tuple[str, int, int, int | None, str, int | None]) -> str:
    name, pp, dp, via, method, layers = case
    return f"{name}{f'-via-pp{via}' if via else ''}-to-pp{pp}-dp{dp}-{method}{f'-{layers}' if layers else ''}"


@pytest.fixture(scope="session")
def pipe_fixtures(parallel_fixtures: Mapping[str, ParallelFixture], holdout_fixtures: Mapping[str, ParallelFixture],
                  pipe_rr_fixtures: Mapping[str, ParallelFixture],
                  parallel_extra_fixtures: Mapping[str, ParallelFixture]) -> Mapping[str, ParallelFixture]:
    return {**parallel_fixtures, **holdout_fixtures, **pipe_rr_fixtures, **parallel_extra_fixtures}


def stages_job(fixture: ParallelFixture, root: Path, label: str, pp: int, dp: int, method: str, *,
               next_loss: bool) -> tuple[Path, Path, Path, dict[str, Any]]:
    """Where ckptflow writes `fixture` at pp x dp under `root` (`label`), where DeepSpeed re-saves it and its
    findings, and the oracle job that loads it, built with `method`."""
    out, resaved, result = root / "out" / label, root / "resaved" / label, root / "results" / f"{label}.json"
    result.parent.mkdir(parents=True, exist_ok=True)
    spec = dataclasses.replace(fixture.parallel_spec, pp=pp, world_size=pp * dp)
    return out, resaved, result, {
        "spec": spec.to_json(), "source": fixture.parallel_spec.to_json(), "load": str(out), "save": str(resaved),
        "expected": str(fixture.expected_path), "buffers": str(fixture.buffers_path), "result": str(result),
        "partition_method": method, "next_loss": next_loss, **source_sections(fixture)}


@pytest.fixture(scope="session")
def split_oracle(pipe_fixtures: Mapping[str, ParallelFixture],
                 tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("pipe-split-oracle")
    outs, resaved, results, jobs = {}, {}, {}, []
    for case in SPLITS:
        name, pp, dp, via, method, layers = case
        fixture = pipe_fixtures[name]
        source = str(fixture.dir)
        if via:
            source = str(root / "via" / split_id(case))
            reshard(str(fixture.dir), source, world_size=via, pp=via, partition_method=method, workers=2)
        outs[case], resaved[case], results[case], job = stages_job(
            fixture, root, split_id(case), pp, dp, method, next_loss=(bool(via) and name != RR) or case == NEXT_LOSS_AT_PP4)
        reshard(source, str(outs[case]), world_size=pp * dp, pp=pp, partition_method=method, pipeline_layers=layers,
                workers=2)
        jobs.append(job)
    name, dp, tied = ZERO0  # ZeRO-0 -> ZeRO-1 at the source's own stages, riding this launch
    fixture = pipe_fixtures[name]
    spec = dataclasses.replace(fixture.parallel_spec, stage=1, world_size=fixture.parallel_spec.pp * dp)
    outs[ZERO0] = root / "out" / zero0_id(ZERO0)
    reshard(str(fixture.dir), str(outs[ZERO0]), world_size=spec.world_size, stage=1, tied_modules=tied, workers=2)
    resaved[ZERO0] = root / "resaved" / zero0_id(ZERO0)
    results[ZERO0] = root / "results" / f"{zero0_id(ZERO0)}.json"
    jobs.append({"spec": spec.to_json(), "source": fixture.parallel_spec.to_json(), "load": str(outs[ZERO0]),
                 "save": str(resaved[ZERO0]), "expected": str(fixture.expected_path),
                 "buffers": str(fixture.buffers_path), "result": str(results[ZERO0]), **source_sections(fixture)})
    regrouped = pipe_fixtures["pipe-pp2dp2-z1-fp32"]  # the source of the regroup, as DeepSpeed saved it
    jobs.append({"spec": regrouped.parallel_spec.to_json(), "load": str(regrouped.dir), "save": None,
                 "expected": str(regrouped.expected_path), "buffers": str(regrouped.buffers_path),
                 "result": str(root / "results" / "source.json"), "next_loss": True})
    jobs_file = root / "jobs-4-pipe-split.json"
    jobs_file.write_text(json.dumps(jobs, indent=1))
    launch("tests.oracles.parallel_reshard", 4, ["--jobs", str(jobs_file)], timeout=900, log_dir=root / "logs")
    return {"outs": outs, "resaved": resaved, "results": results, "source_result": root / "results" / "source.json"}


@pytest.mark.parametrize("case", SPLITS, ids=split_id)
def test_deepspeed_loads_the_new_stages_holding_the_source_state(
        split_oracle: dict[str, Any], case: tuple[str, int, int, int | None, str, int | None],
        pipe_fixtures: Mapping[str, ParallelFixture]) -> None:
    """DeepSpeed's PipelineModule at the target stage count loads the output natively and holds the
    source's fp32 weights, both Adam moments and buffers bit for bit, and saves exactly ckptflow's files."""
    check_loaded_state(split_oracle, case, pipe_fixtures[case[0]])
    check_same_files(split_oracle, case)
    report = validate(str(split_oracle["outs"][case]), deep=True)
    assert report.ok, [p.message for p in report.problems]
    assert (report.summary()["pp"], report.summary()["world_size"]) == (case[1], case[2])


@pytest.mark.parametrize("case", [case for case in SPLITS if case[3] and case[0] != RR], ids=split_id)
def test_the_next_loss_after_regrouped_stages_is_the_sources(
        split_oracle: dict[str, Any], case: tuple[str, int, int, int | None, str, int | None]) -> None:
    """DeepSpeed trains one more step from pipe-toy at pp2 x dp2 (its own checkpoint) and from ckptflow's
    pp2 x dp2 out of its pp3 and out of its pp4 (`SPLITS`' regroups) on the same batches: the same loss,
    bit for bit."""
    source = json.loads(split_oracle["source_result"].read_text())["next_loss"]
    assert isinstance(source, float)
    assert json.loads(split_oracle["results"][case].read_text())["next_loss"] == source


def test_the_next_loss_at_four_stages_is_the_sources(pipe_oracle: dict[str, Any],
                                                     split_oracle: dict[str, Any]) -> None:
    """DeepSpeed trains one more step from pipe-toy at pp2 (its own checkpoint, `pipe_oracle`'s 2-rank
    launch) and from ckptflow's pp4 out of it (`NEXT_LOSS_AT_PP4`, split by "parameters") on the same batches:
    the same loss, bit for bit. (By "uniform" DeepSpeed's ZeRO-1 step hangs at pp4, `NEXT_LOSS_AT_PP4`'s note.)"""
    source = json.loads(pipe_oracle["source_result"].read_text())["next_loss"]
    assert isinstance(source, float)
    assert json.loads(split_oracle["results"][NEXT_LOSS_AT_PP4].read_text())["next_loss"] == source


def test_the_stages_are_deepspeeds_partition() -> None:
    """Pure: the ports of `partition_uniform` and `partition_balanced` give DeepSpeed's own answers."""
    from deepspeed.runtime import utils

    from ckptflow.reshard.pipeline_layers import partition_balanced, partition_uniform

    for n, m in ((6, 4), (6, 2), (3, 4), (13, 5)):
        assert partition_uniform(n, m) == utils.partition_uniform(n, m)
    for weights in ([592, 1104, 1104, 1104, 32, 592], [0, 5, 0, 0, 7, 1, 1, 9, 0], [3, 3, 3, 3]):
        for m in (2, 3, 4):
            assert partition_balanced(weights, m) == [int(x) for x in utils.partition_balanced(weights, m)]
    draw = random.Random(24)  # ties and zero-weight layers (functions) where the split point is a choice
    for _ in range(300):
        weights = [draw.choice([0, 0, 1, 3, 16, 592, 1104]) for _ in range(draw.randint(1, 20))]
        m = draw.randint(1, 8)
        assert partition_balanced(weights, m) == [int(x) for x in utils.partition_balanced(weights, m)], (weights, m)


@pytest.mark.parametrize("method,source,target", [("uniform", 4, 2), ("uniform", 8, 3), ("parameters", 4, 8),
                                                   ("parameters", 8, 2)])
def test_the_files_of_a_gpt_like_pipeline_determine_its_stages(method: str, source: int, target: int) -> None:
    """Pure: a GPT-style layer list (a tied embedding, a function, 32 blocks, a function, a norm, the tied
    head with a forward_fn) saved at `source` stages says, through what its files record alone, which
    modules each of `target` stages holds: the same for every layer list that fits, and the true list's."""
    from ckptflow.reshard.pipeline_layers import Evidence, layer_lists, partition, target_stages

    true = [("embed", 1000), ("", 0), *[("", 500)] * 32, ("", 0), ("", 20), ("embed", 1000)]
    files = {0: true[0], **{i: layer for i, layer in enumerate(true) if not layer[0] and layer[1]}}
    parts = partition(method, true, source)
    spans = [range(a, b) for a, b in zip(parts, parts[1:])]
    evidence = Evidence(known=files, tied={"embed": 1000},
                        stage_layers=tuple(frozenset(i for i in span if i in files and i > 0) for span in spans),
                        stage_tied=tuple(frozenset(true[i][0] for i in span if true[i][0]) for span in spans))
    modules = frozenset(i for i in files if i > 0)
    found = list(layer_lists(evidence, method))
    assert true in found
    outcomes = {target_stages(layers, partition(method, layers, target), modules) for layers in found}
    assert outcomes == {target_stages(true, partition(method, true, target), modules)}


def test_a_stage_count_the_files_do_not_determine_is_refused(parallel_fixtures: Mapping[str, ParallelFixture],
                                                             tmp_path: Path) -> None:
    """`pipe-toy`'s tied head saves no file, so under `parameters` (DeepSpeed's default) the files allow
    several layer lists that put other layers on 4 stages; type:REGEX needs class names no file records."""
    pipe = parallel_fixtures["pipe-pp2-z1-fp32"]
    with pytest.raises(UnsupportedCheckpointError, match=(
            r"cannot tell which layers each of 4 pipeline stages of .*global_step3 holds: layer lists the files allow "
            r"\(0 embed, 1-4 module, 5 embed; or 0 embed, 1-4 module, 5-6 embed\) give the source's stages what they "
            r"hold under partition method 'parameters', and put other layers on the target's stages \(1\+embed \| 2 "
            r"\| 3 \| 4\+embed; or 1\+embed \| 2 \| 3\+4 \| embed\); give the length of the model's "
            r"layer list with `pipeline_layers`, keep the number of pipeline stages, or merge them \(pp 1\)$")):
        reshard(str(pipe.dir), str(tmp_path / "out"), world_size=4, pp=4)
    with pytest.raises(UnsupportedCheckpointError, match=(
            r"partition method 'type:Block' weighs the layers whose class name matches, and no file records a "
            r"layer's class; declare the class of each entry of its layer list with `layer_types` \(as "
            r"'Embed,Block\*3,LayerNorm'\), or use `parameters` or `uniform`$")):
        reshard(str(pipe.dir), str(tmp_path / "out"), world_size=4, pp=4, partition_method="type:Block")
    assert not (tmp_path / "out").exists()


# ---- ZeRO-0 at ZeRO-1 (issue 24) --------------------------------------------------------------------------


def test_deepspeed_loads_a_zero0_pipeline_at_zero1_holding_the_source_state(
        split_oracle: dict[str, Any], pipe_fixtures: Mapping[str, ParallelFixture]) -> None:
    """pipe-toy trained at ZeRO-0 on 2 stages, written by ckptflow at ZeRO-1 on 2 stages x 2 data-parallel
    ranks (its tied embedding's key given): DeepSpeed's PipelineEngine at that shape loads it natively and
    holds the source's fp32 weights, both Adam moments and buffers bit for bit, and saves exactly ckptflow's
    files (layer files, param_shapes and the step included)."""
    check_loaded_state(split_oracle, ZERO0, pipe_fixtures[ZERO0[0]])
    check_same_files(split_oracle, ZERO0)
    report = validate(str(split_oracle["outs"][ZERO0]), deep=True)
    assert report.ok, [p.message for p in report.problems]
    assert (report.summary()["stage"], report.summary()["pp"], report.summary()["world_size"]) == (1, 2, 2)


def test_a_zero0_pipeline_s_stages_are_named_from_its_layer_files(
        parallel_extra_fixtures: Mapping[str, ParallelFixture]) -> None:
    """Pure: each stage's module is its tied module first, then its layers; its groups DeepSpeed's ZeRO-1
    order (the fixture's ZeRO-1 twin, `pipe-pp2-z1-fp32`, records the same param_shapes); the layer
    files carried."""
    index = load_index(str(parallel_extra_fixtures["pipe-pp2-z0-fp32"].dir))
    plan = plan_reshard(index, Target(world_size=6, stage=1, tied_modules="embed=0"))
    assert (str(plan.source_shape), str(plan.shape)) == ("ZeRO-0 pp2 x dp1 (2 ranks)", "ZeRO-1 pp2 x dp3 (6 ranks)")
    assert [[[n for n, _ in g] for g in part.flat_shapes] for part in plan.parts] == [
        [["tied_modules.embed.weight", "1.fc1.weight", "1.fc2.weight", "2.fc1.weight", "2.fc2.weight"],
         ["1.norm.weight", "1.norm.bias", "1.fc1.bias", "1.fc2.bias", "2.norm.weight", "2.norm.bias", "2.fc1.bias",
          "2.fc2.bias"]],
        [["tied_modules.embed.weight", "3.fc1.weight", "3.fc2.weight"],
         ["3.norm.weight", "3.norm.bias", "3.fc1.bias", "3.fc2.bias", "4.weight", "4.bias"]]]
    assert [[u.optim_file for u in part.units] for part in plan.parts] == [
        [f"zero_pp_rank_{r}_mp_rank_{s:02d}_optim_states.pt" for r in range(3)] for s in range(2)]
    assert all(part.index.model_states[0]["module"] is None for part in plan.parts)
    assert set(plan.carried) == {f"layer_{i:02d}-model_states.pt" for i in range(5)}


def test_deepspeed_loads_a_zero0_pipeline_merged_at_zero1_holding_the_source_state(
        pipe_oracle: dict[str, Any], pipe_fixtures: Mapping[str, ParallelFixture]) -> None:
    """The same ZeRO-0 pp2 checkpoint at ZeRO-1 on one stage x 2 data-parallel ranks in one command (its stages
    named, then merged as ZeRO-1 stages are): DeepSpeed at that shape loads it natively holding the source's
    state bit for bit and saves exactly ckptflow's files."""
    check_loaded_state(pipe_oracle, ZERO0_MERGED, pipe_fixtures[ZERO0_MERGED[0]])
    check_same_files(pipe_oracle, ZERO0_MERGED)


@pytest.mark.parametrize("target", [{"world_size": 2, "pp": 1}, {"world_size": 3, "pp": 1},
                                    {"world_size": 4, "pp": 4, "partition_method": "uniform"},
                                    {"world_size": 3, "pp": 3, "partition_method": "type:PipeBlock",
                                     "layer_types": "PipeEmbed,PipeBlock*3,LayerNorm,PipeEmbed"}])
def test_a_zero0_pipeline_at_another_stage_count_is_its_zero1_regrouped(
        parallel_extra_fixtures: Mapping[str, ParallelFixture], tmp_path: Path, target: dict[str, Any]) -> None:
    """ZeRO-0 pp2 to ZeRO-1 at another stage count in one command writes the same files (object trees and tensor
    bytes) as the two steps DeepSpeed checks apart: ZeRO-1 at pp2 (`test_deepspeed_loads_a_zero0_pipeline_at_zero1_
    holding_the_source_state`), then that regrouped (the splits and merges above). No launch."""
    source = str(parallel_extra_fixtures["pipe-pp2-z0-fp32"].dir)
    reshard(source, str(tmp_path / "direct"), stage=1, tied_modules="embed=0", workers=2, **target)
    reshard(source, str(tmp_path / "z1"), world_size=2, stage=1, tied_modules="embed=0", workers=2)
    reshard(str(tmp_path / "z1"), str(tmp_path / "via"), workers=2, **target)
    tag = (tmp_path / "direct" / "latest").read_text()
    names = sorted(p.name for p in (tmp_path / "direct" / tag).iterdir())
    assert names == sorted(p.name for p in (tmp_path / "via" / tag).iterdir())
    assert sum(name.startswith("layer_") for name in names) == 5
    for name in names:
        diffs = _differences(_plain(open_archive(str(tmp_path / "direct" / tag / name), ALLOWED).obj),
                             _plain(open_archive(str(tmp_path / "via" / tag / name), ALLOWED).obj))
        assert not diffs, f"{name}: " + "; ".join(diffs[:5])


@pytest.mark.parametrize("tied,why", [
    # the stages fit one tied module held in layer 0's file, and nothing else: that layer named, its key asked for
    (None, r"its stages use a tied module held in layer_00-model_states.pt, whose TiedLayerSpec key no ZeRO-0 file "
           r"records: give it with `tied_modules` KEY=0$"),
    ("embed=1", r"no assignment of its layer files to its 2 stages with the tied modules given \(embed=1\) gives each "
                r"stage its buffer_names and the shapes of its Adam moments in module order, with no frozen parameter; "),
    ("embed=7", r"layer_07-model_states.pt is missing, which the tied modules given \(embed=7\) say holds one of them; "),
])
def test_a_zero0_pipeline_whose_stages_cannot_be_named_is_refused(
        parallel_extra_fixtures: Mapping[str, ParallelFixture], tmp_path: Path, tied: str | None, why: str) -> None:
    zero0 = parallel_extra_fixtures["pipe-pp2-z0-fp32"]
    with pytest.raises(UnsupportedCheckpointError, match=r"global_step3: (ZeRO-0 saves its pipeline stages' optimizer "
                       r"state by index and no parameter name, and )?" + why):
        reshard(str(zero0.dir), str(tmp_path / "out"), world_size=2, stage=1, tied_modules=tied)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("text", ["embed", "embed=0,embed=2", "embed=0,head=0", "em bed=0", "embed=-1",
                                  ",".join(f"k{i}={i}" for i in range(7))])  # more than MAX_TIED
def test_tied_modules_that_do_not_parse_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="tied modules"):
        Target(world_size=2, stage=1, tied_modules=text)


def test_the_cli_names_a_zero0_pipeline_s_tied_modules(parallel_extra_fixtures: Mapping[str, ParallelFixture],
                                                     tmp_path: Path) -> None:
    """Without `--tied-modules` the refusal says, in one line, to give them; given, the stages are written; a
    value that does not parse is a usage error naming the flag."""
    from typer.testing import CliRunner

    from ckptflow.cli import app

    runner = CliRunner()
    src = str(parallel_extra_fixtures["pipe-pp2-z0-fp32"].dir)
    refused = runner.invoke(app, ["reshard", src, str(tmp_path / "out"), "--world-size", "4", "--zero-stage", "1"],
                            env={"COLUMNS": "400"})
    assert refused.exit_code == 1 and len(refused.output.strip().splitlines()) == 1, refused.output
    assert "held in layer_00-model_states.pt, whose TiedLayerSpec key no ZeRO-0 file records: give it with " \
           "--tied-modules KEY=0" in refused.output
    assert not (tmp_path / "out").exists()
    done = runner.invoke(app, ["reshard", src, str(tmp_path / "out"), "--world-size", "4", "--zero-stage", "1",
                               "--tied-modules", "embed=0"], env={"COLUMNS": "400"})
    assert done.exit_code == 0, done.output
    assert "ZeRO-0 pp2 x dp1 (2 ranks) -> ZeRO-1 pp2 x dp2 (4 ranks)" in done.output
    bad = runner.invoke(app, ["reshard", src, str(tmp_path / "bad"), "--world-size", "4", "--zero-stage", "1",
                              "--tied-modules", "embed"], env={"COLUMNS": "400"})
    assert bad.exit_code == 2 and "--tied-modules" in bad.output and not (tmp_path / "bad").exists()


def test_the_plan_tells_a_zero0_pipeline_s_stage_counts(parallel_extra_fixtures: Mapping[str, ParallelFixture]) -> None:
    """Pure: `--plan` of a ZeRO-0 pipeline whose stages fit one tied module (in layer 0's file) and nothing
    else asks for its key at every ZeRO-1 shape; with `--tied-modules`, it asks of the stage counts what it
    asks of a ZeRO-1 one's, so pp4 under the default method is refused as pipe-toy's ZeRO-1 checkpoint's is."""
    from ckptflow.reshard.plan import why_not_stages
    from ckptflow.reshard.shape import Shape

    index = load_index(str(parallel_extra_fixtures["pipe-pp2-z0-fp32"].dir))
    ask = ("its stages use a tied module held in layer_00-model_states.pt, whose TiedLayerSpec key no ZeRO-0 file "
           "records: give it with `tied_modules` KEY=0")
    for pp in (1, 2, 4):
        assert why_not_stages(index, Shape(world_size=4, stage=1, pp=pp)) == ask
    why = why_not_stages(index, Shape(world_size=4, stage=1, pp=4), asked=Target(world_size=4, tied_modules="embed=0"))
    assert why is not None and why.startswith("cannot tell which layers each of 4 pipeline stages of ")
    assert "(0 embed, 1-4 module, 5 embed; or 0 embed, 1-4 module, 5-6 embed)" in why
    for pp in (1, 2):
        assert why_not_stages(index, Shape(world_size=4, stage=1, pp=pp), asked=Target(world_size=4, tied_modules="embed=0")) is None
    assert why_not_stages(index, Shape(world_size=2, stage=1, pp=2), asked=Target(world_size=2, tied_modules="embed=1")).startswith(
        "ZeRO-0 saves its pipeline stages' optimizer state by index and no parameter name, and no assignment of its "
        "layer files to its 2 stages with the tied modules given (embed=1)")


# ---- a "type:" method over the layer types the user declares ----------------------------------------------

PIPE_TYPES = "PipeEmbed,PipeBlock*3,LayerNorm,PipeEmbed"  # `pipe_layer_specs`' classes, as DeepSpeed names them


@pytest.mark.parametrize("method,weights,pp,stages", [
    ("type:PipeBlock", [0, 1, 1, 1, 0, 0], 3, "1+embed | 2 | 3+4+embed"),
    ("type:PipeBlock", [0, 1, 1, 1, 0, 0], 4, "1+embed | 2 | 3+4 | embed"),
    ("type:^pipe", [1, 1, 1, 1, 0, 1], 3, "1+embed | 2+3+4 | embed"),  # the tied uses weigh 1 too
])
def test_a_type_method_cuts_the_stages_by_the_declared_layer_types(
        parallel_fixtures: Mapping[str, ParallelFixture], method: str, weights: list[int], pp: int, stages: str) -> None:
    """pipe-toy, trained "uniform" at pp2 (which both methods cut the same: 0-2 | 3-5), at `pp` stages by
    `method`: DeepSpeed's `partition_balanced` over weights 1 for the layers whose declared name it matches
    (a tied module's uses included), 0 for the rest (pure: no byte read). The plan's stages hold those
    layers' parameters; the names also give the list's length, which "parameters" needs (the same stages as
    `pipeline_layers` 6)."""
    from deepspeed.runtime import utils

    from ckptflow.reshard.pipeline import _stages_text, declared, stages_at
    from ckptflow.reshard.pipeline_layers import parse_layer_types

    index = load_index(str(parallel_fixtures["pipe-pp2-z1-fp32"].dir))
    count, facts = declared(index, pp, method, parse_layer_types(PIPE_TYPES))
    assert count == 6 and facts is not None and facts.typed == {i for i, w in enumerate(weights) if w}
    assert [int(x) for x in utils.partition_balanced(weights, 2)] == [0, 3, 6]
    found = stages_at(index, pp, method, count, facts=facts)
    assert _stages_text(found) == stages
    parts = [int(x) for x in utils.partition_balanced(weights, pp)]  # modules 1-4, embed at 0 and 5
    assert [s.layers for s in found] == [tuple(i for i in range(a, b) if 1 <= i <= 4) for a, b in zip(parts, parts[1:])]
    assert [s.tied for s in found] == [("embed",) if {0, 5} & set(range(a, b)) else () for a, b in zip(parts, parts[1:])]
    plan = plan_reshard(index, Target(world_size=pp, pp=pp, partition_method=method, layer_types=PIPE_TYPES))
    held = [sorted({n.split(".")[0] if not n.startswith("tied_") else "embed" for g in part.flat_shapes for n, _ in g})
            for part in plan.parts]
    assert held == [sorted([*map(str, s.layers), *s.tied]) for s in found]
    by_count = plan_reshard(index, Target(world_size=4, pp=4, pipeline_layers=6))
    by_names = plan_reshard(index, Target(world_size=4, pp=4, layer_types=PIPE_TYPES))
    assert [p.flat_shapes for p in by_names.parts] == [p.flat_shapes for p in by_count.parts]


def test_declared_layer_types_the_files_contradict_are_refused(parallel_fixtures: Mapping[str, ParallelFixture],
                                                               tmp_path: Path) -> None:
    pipe = parallel_fixtures["pipe-pp2-z1-fp32"]
    out = str(tmp_path / "out")
    with pytest.raises(UnsupportedCheckpointError, match=(
            r"^.*global_step3: layer 4 saved layer_04-model_states.pt, and `layer_types` names 4 layers \(0-3\); "
            r"give `layer_types` one name per entry of the model's layer list, in order$")):
        reshard(str(pipe.dir), out, world_size=3, pp=3, partition_method="type:PipeBlock",
                layer_types="PipeEmbed,PipeBlock*3")
    with pytest.raises(UnsupportedCheckpointError, match=(
            r"^`layer_types` names 6 layers and `pipeline_layers` gives 7; give one of `layer_types` and "
            r"`pipeline_layers`, or make them agree$")):
        reshard(str(pipe.dir), out, world_size=3, pp=3, partition_method="type:PipeBlock", layer_types=PIPE_TYPES,
                pipeline_layers=7)
    with pytest.raises(UnsupportedCheckpointError, match=(
            r"^cannot tell which layers each of 3 pipeline stages of .*global_step3 holds: partition method "
            r"'type:Attention' matches none of the 6 layer names `layer_types` gives \(DeepSpeed finds no layer to "
            r"partition\); give the `partition_method` the model was trained with, or check `layer_types`$")):
        reshard(str(pipe.dir), out, world_size=3, pp=3, partition_method="type:Attention", layer_types=PIPE_TYPES)
    with pytest.raises(UnsupportedCheckpointError, match=(
            r"^.*global_step3: no layer list of 6 layers the files allow gives its 2 pipeline stages the layers they "
            r"hold under partition method 'type:LayerNorm'")):
        reshard(str(pipe.dir), out, world_size=3, pp=3, partition_method="type:LayerNorm", layer_types=PIPE_TYPES)
    assert not (tmp_path / "out").exists()


# (fixture, pp, dp): pipe-toy split by type:PipeBlock over the declared layer types at pp3 (0-1 | 2 | 3-5, where
# "uniform" puts 0-1 | 2-3 | 4-5), fp32 and bf16 (BF16_Optimizer): DeepSpeed builds the PipelineModule with
# partition_method="type:PipeBlock" at 3 ranks, loads ckptflow's output natively, saves it again and (fp32)
# trains one step. Long mode only: one 3-rank launch.
TYPE_METHOD = "type:PipeBlock"
TYPE_SPLITS = sample((("pipe-pp2-z1-fp32", 3, 1), ("pipe-pp2-z1-bf16", 3, 1)), keep=())


def type_id(case: tuple[str, int, int]) -> str:
    return f"{case[0]}-to-pp{case[1]}-dp{case[2]}-type"


@pytest.fixture(scope="session")
def type_oracle(pipe_fixtures: Mapping[str, ParallelFixture],
                tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("pipe-type-oracle")
    outs, resaved, results, jobs = {}, {}, {}, []
    for case in TYPE_SPLITS:
        name, pp, dp = case
        fixture = pipe_fixtures[name]
        outs[case], resaved[case], results[case], job = stages_job(fixture, root, type_id(case), pp, dp, TYPE_METHOD,
                                                                   next_loss=name == PP2_SOURCE)
        reshard(str(fixture.dir), str(outs[case]), world_size=pp * dp, pp=pp, partition_method=TYPE_METHOD,
                layer_types=PIPE_TYPES, workers=2)
        jobs.append(job)
    launch_oracle(3, jobs, root, "3-pipe-type")
    return {"outs": outs, "resaved": resaved, "results": results}


@pytest.mark.parametrize("case", TYPE_SPLITS, ids=type_id)
def test_deepspeed_loads_the_stages_a_type_method_cuts_holding_the_source_state(
        type_oracle: dict[str, Any], case: tuple[str, int, int],
        pipe_fixtures: Mapping[str, ParallelFixture]) -> None:
    """DeepSpeed's PipelineModule(partition_method="type:PipeBlock") at pp3 loads ckptflow's output natively,
    holding the source's fp32 weights, moments and buffers bit for bit, and saves the same files again."""
    check_loaded_state(type_oracle, case, pipe_fixtures[case[0]])
    check_same_files(type_oracle, case)
    report = validate(str(type_oracle["outs"][case]), deep=True)
    assert report.ok, [p.message for p in report.problems]


@pytest.mark.skipif(not any(case[0] == PP2_SOURCE for case in TYPE_SPLITS), reason="long mode")
def test_the_next_loss_at_three_stages_by_type_is_the_sources(pipe_oracle: dict[str, Any],
                                                              type_oracle: dict[str, Any]) -> None:
    """One more step from pipe-toy at pp2 (`pipe_oracle`'s 2-rank launch) and from ckptflow's pp3 split by
    type:PipeBlock out of it, on the same batches: the same loss, bit for bit."""
    source = json.loads(pipe_oracle["source_result"].read_text())["next_loss"]
    assert isinstance(source, float)
    assert json.loads(type_oracle["results"][(PP2_SOURCE, 3, 1)].read_text())["next_loss"] == source


def test_the_form_takes_the_tied_modules_and_names_the_folder_by_them() -> None:
    """The Prefect reshard form carries a ZeRO-0 PipelineModule's declared tied modules to its target, the
    folder named by them (another declaration, another folder), and refuses a malformed one in one line."""
    from flows import paths
    from flows.params import ReshardForm

    [target] = ReshardForm(world_sizes=[2], zero_stage="1", tied_modules="embed=0").targets()
    assert target == Target(world_size=2, stage=1, tied_modules="embed=0")
    name = paths.reshard_name(target)
    assert name.startswith("zero-ws2-z1-tied-") and len(name) == len("zero-ws2-z1-tied-") + 8
    assert paths.reshard_name(Target(world_size=2, stage=1, tied_modules="embed=5")) != name
    assert paths.reshard_name(Target(world_size=2, stage=1)) == "zero-ws2-z1"
    with pytest.raises(ValueError, match=r"the tied modules must be KEY=LAYER\[,KEY=LAYER\.\.\.\]"):
        ReshardForm(world_sizes=[2], tied_modules="embed")


# ---- a bf16 ZeRO-0 PipelineModule (BF16_Optimizer) at ZeRO-1 (issue 24) -----------------------------------

# pipe-toy trained in bf16 at ZeRO-0 on 2 stages gets BF16_Optimizer, whose checkpoint DeepSpeed 0.19.8 cannot load
# back (`specs.extra`, its writer checks that the load fails); its optimizer files name every parameter. Written at
# ZeRO-1 (pp, dp, partition method): at its own 2 stages, and merged to one in the same command, both on one 2-rank
# launch; at pp2 x dp2 and split to pp4 on one 4-rank launch. Long mode only (no default launch left to ride with
# this key): the pure tests below pin what each writes against its own two-step route.
BF16_ZERO0 = "pipe-pp2-z0-bf16"
ALL_BF16_ZERO0 = ((2, 1, None), (1, 2, None), (2, 2, None), (4, 1, "uniform"))
BF16_ZERO0_CASES = sample(ALL_BF16_ZERO0, keep=())


def bf16_zero0_id(case: tuple[int, int, str | None]) -> str:
    pp, dp, method = case
    return f"{BF16_ZERO0}-to-z1-pp{pp}-dp{dp}{f'-{method}' if method else ''}"


@pytest.fixture(scope="session")
def bf16_zero0_oracle(parallel_extra_fixtures: Mapping[str, ParallelFixture],
                      tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """ckptflow writes the bf16 ZeRO-0 pipeline at each of `BF16_ZERO0_CASES`; one DeepSpeed launch per world
    size builds pipe-toy there at ZeRO-1 with the source's bf16 config, loads each natively and saves it again."""
    return run_bf16_zero0_oracle(parallel_extra_fixtures[BF16_ZERO0], BF16_ZERO0_CASES, bf16_zero0_id,
                                 tmp_path_factory.mktemp("pipe-bf16-zero0-oracle"))


def run_bf16_zero0_oracle(fixture: ParallelFixture, cases: Sequence[tuple[int, int, str | None]],
                          label: Callable[[tuple[int, int, str | None]], str], root: Path) -> dict[str, Any]:
    """ckptflow writes the bf16 ZeRO-0 pipeline `fixture` at ZeRO-1 at each of `cases` (pp, dp, partition
    method); one DeepSpeed launch per world size loads each natively and saves it again."""
    outs, resaved, results = {}, {}, {}
    launches: dict[int, list[dict[str, Any]]] = {}
    for case in cases:
        pp, dp, method = case
        outs[case], resaved[case], results[case], job = stages_job(
            fixture, root, label(case), pp, dp, method or "uniform", next_loss=False)
        job["spec"] = dataclasses.replace(fixture.parallel_spec, pp=pp, stage=1, world_size=pp * dp).to_json()
        reshard(str(fixture.dir), str(outs[case]), world_size=pp * dp, pp=pp, stage=1, partition_method=method,
                workers=2)
        launches.setdefault(pp * dp, []).append(job)
    for world_size, jobs in sorted(launches.items()):
        launch_oracle(world_size, jobs, root, f"{world_size}-{fixture.name}")
    return {"outs": outs, "resaved": resaved, "results": results}


@pytest.mark.parametrize("case", BF16_ZERO0_CASES, ids=bf16_zero0_id)
def test_deepspeed_loads_a_bf16_zero0_pipeline_at_zero1_holding_the_source_state(
        bf16_zero0_oracle: dict[str, Any], case: tuple[int, int, str | None],
        parallel_extra_fixtures: Mapping[str, ParallelFixture]) -> None:
    """DeepSpeed's PipelineEngine at ZeRO-1 (the source's bf16 config: DeepSpeedZeroOptimizer there) loads
    ckptflow's output natively, holds the source's fp32 masters, both Adam moments and buffers bit for bit, and
    saves exactly ckptflow's files (the step included); the output validates at its shape."""
    check_zero1_output(bf16_zero0_oracle, case, parallel_extra_fixtures[BF16_ZERO0])


def check_zero1_output(oracle: Mapping[str, Any], case: tuple[int, int, str | None], fixture: ParallelFixture) -> None:
    """DeepSpeed loaded the ZeRO-1 output of `case` (pp, dp, method) holding `fixture`'s state and saved the same
    files; the output validates at pp x dp, ZeRO-1."""
    check_loaded_state(oracle, case, fixture)
    check_same_files(oracle, case)
    report = validate(str(oracle["outs"][case]), deep=True)
    assert report.ok, [p.message for p in report.problems]
    assert (report.summary()["stage"], report.summary()["pp"], report.summary()["world_size"]) == (1, case[0], case[1])


def check_fp32_masters(fixture: ParallelFixture, tmp_path: Path) -> None:
    """`fixture` consolidated in fp32 holds every parameter's master as the live engine held it
    (`expected.safetensors`), bit for bit."""
    from ckptflow.consolidate import ConsolidateOptions, consolidate

    consolidate(str(fixture.dir), str(tmp_path / "fp32"), options=ConsolidateOptions(dtype="fp32"))
    expected = load_file(fixture.expected_path)
    weights = load_file(tmp_path / "fp32" / "model.safetensors")
    params = [name for name in weights if f"fp32/{name}" in expected]
    assert sorted(params) == sorted(fixture.spec["params"])
    assert all(torch.equal(weights[name], expected[f"fp32/{name}"]) for name in params)


def test_a_bf16_zero0_pipeline_is_read_from_its_optimizer_s_names(
        parallel_extra_fixtures: Mapping[str, ParallelFixture], parallel_fixtures: Mapping[str, ParallelFixture],
        tmp_path: Path) -> None:
    """Pure: the bf16 ZeRO-0 pipeline reads as ZeRO-0 holding BF16_Optimizer's partitions, named by its
    param_slice_mappings (its tied module's file found by them): the plan at ZeRO-1 lays each stage's groups out
    as DeepSpeed's own ZeRO-1 bf16 pipe-toy checkpoint records them (`pipe-pp2-z1-bf16`: the same param_shapes,
    DeepSpeedZeroOptimizer's files), with no `optimizer` in the model states. Its fp32 masters consolidate to the
    live engine's (`expected.safetensors`) bit for bit."""
    from ckptflow.formats.deepspeed.partition import BF16, ZERO

    fixture = parallel_extra_fixtures[BF16_ZERO0]
    index = load_index(str(fixture.dir))
    assert (index.stage, [rank.optimizer_kind for rank in index.ranks]) == (0, [BF16, BF16])
    assert index.tied_layers == (("embed", 0),)
    plan = plan_reshard(index, Target(world_size=4, stage=1))
    assert (str(plan.source_shape), str(plan.shape)) == ("ZeRO-0 pp2 x dp1 (2 ranks)", "ZeRO-1 pp2 x dp2 (4 ranks)")
    twin = load_index(str(parallel_fixtures["pipe-pp2-z1-bf16"].dir))
    assert [[[n for n, _ in g] for g in part.flat_shapes] for part in plan.parts] == [
        [list(g) for g in rank.model_states[0]["param_shapes"]] for rank in twin.ranks]
    assert [(part.optimizer, part.src_optimizer) for part in plan.parts] == [(ZERO, BF16)] * 2
    assert [[u.optim_file for u in part.units] for part in plan.parts] == [
        [f"bf16_zero_pp_rank_{r}_mp_rank_{s:02d}_optim_states.pt" for r in range(2)] for s in range(2)]
    assert all(part.index.model_states[0]["optimizer"] is None for part in plan.parts)
    check_fp32_masters(fixture, tmp_path)


@pytest.mark.parametrize("target", [{"world_size": 2, "pp": 1}, {"world_size": 4, "pp": 4, "partition_method": "uniform"}])
def test_a_bf16_zero0_pipeline_at_another_stage_count_is_its_zero1_regrouped(
        parallel_extra_fixtures: Mapping[str, ParallelFixture], tmp_path: Path, target: dict[str, Any]) -> None:
    """Pure: the bf16 ZeRO-0 pp2 at ZeRO-1 at another stage count in one command writes the same files (object
    trees and tensor bytes) as ZeRO-1 at pp2 first, then that regrouped as a ZeRO-1 checkpoint. No launch."""
    source = str(parallel_extra_fixtures[BF16_ZERO0].dir)
    reshard(source, str(tmp_path / "direct"), stage=1, workers=2, **target)
    reshard(source, str(tmp_path / "z1"), world_size=2, stage=1, workers=2)
    reshard(str(tmp_path / "z1"), str(tmp_path / "via"), workers=2, **target)
    tag = (tmp_path / "direct" / "latest").read_text()
    names = sorted(p.name for p in (tmp_path / "direct" / tag).iterdir())
    assert names == sorted(p.name for p in (tmp_path / "via" / tag).iterdir())
    for name in names:
        diffs = _differences(_plain(open_archive(str(tmp_path / "direct" / tag / name), ALLOWED).obj),
                             _plain(open_archive(str(tmp_path / "via" / tag / name), ALLOWED).obj))
        assert not diffs, f"{name}: " + "; ".join(diffs[:5])


def test_a_bf16_zero0_pipeline_s_refusals(parallel_extra_fixtures: Mapping[str, ParallelFixture],
                                          tmp_path: Path) -> None:
    """Pure: kept at ZeRO-0 it is refused in one line saying DeepSpeed cannot load it and to add --zero-stage 1
    (not "nothing to reshard"), as `--plan` says of every ZeRO-0 shape; ZeRO-1 at its own stages and merged
    are written, pp4 by the default method is refused as pipe-toy's ZeRO-1 checkpoint's is; tied modules other
    than those its files name are refused, writing nothing."""
    from typer.testing import CliRunner

    from ckptflow.cli import app
    from ckptflow.formats.deepspeed.readers.pipeline import BF16_ZERO0_LOAD
    from ckptflow.reshard.run import plan_shapes

    src = str(parallel_extra_fixtures[BF16_ZERO0].dir)
    runner = CliRunner()
    refused = runner.invoke(app, ["reshard", src, str(tmp_path / "out"), "--world-size", "4"], env={"COLUMNS": "400"})
    assert refused.exit_code == 1 and len(refused.output.strip().splitlines()) == 1, refused.output
    assert f"ZeRO-0) layout: {BF16_ZERO0_LOAD}; add --zero-stage 1" in refused.output
    assert not (tmp_path / "out").exists()
    reasons = {str(o.shape): o.reason for o in plan_shapes(src, 4).options}
    assert {shape: why for shape, why in reasons.items() if shape.startswith("ZeRO-0")} == {
        "ZeRO-0 dp4 (4 ranks)": BF16_ZERO0_LOAD, "ZeRO-0 pp2 x dp2 (4 ranks)": BF16_ZERO0_LOAD,
        "ZeRO-0 pp4 x dp1 (4 ranks)": BF16_ZERO0_LOAD}
    assert reasons["ZeRO-1 dp4 (4 ranks)"] is None and reasons["ZeRO-1 pp2 x dp2 (4 ranks)"] is None
    pp4 = reasons["ZeRO-1 pp4 x dp1 (4 ranks)"]
    assert pp4 is not None and pp4.startswith("cannot tell which layers each of 4 pipeline stages of ")
    with pytest.raises(UnsupportedCheckpointError, match=r"global_step3: its optimizer files name its tied modules "
                       r"\(embed=0\), and `tied_modules` gives embed=1; leave `tied_modules` out"):
        reshard(src, str(tmp_path / "out"), world_size=2, stage=1, tied_modules="embed=1")
    assert not (tmp_path / "out").exists()


# The same model trained so over two data-parallel ranks (`specs.pipe_bf16_zero0_dp`, its own 4-rank launch): each
# stage's BF16_Optimizer partitions over its two ranks, and the model states hold rank 0's optimizer alone, which names
# only the parameters rank 0's partition holds; ckptflow names each stage by all its ranks' optimizer files. Written
# at ZeRO-1 at its own pp2 x dp2 and merged to pp1 x dp2 (one launch per world size). Long mode only.
BF16_ZERO0_DP = "pipe-pp2dp2-z0-bf16"
BF16_ZERO0_DP_CASES = sample(((2, 2, None), (1, 2, None)), keep=())


def bf16_zero0_dp_id(case: tuple[int, int, str | None]) -> str:
    pp, dp, _ = case
    return f"{BF16_ZERO0_DP}-to-z1-pp{pp}-dp{dp}"


@pytest.fixture(scope="session")
def bf16_zero0_dp_fixture() -> ParallelFixture:
    fixture: ParallelFixture = SETS["pipe-bf16-zero0-dp"].build([BF16_ZERO0_DP])[BF16_ZERO0_DP]
    return fixture


@pytest.fixture(scope="session")
def bf16_zero0_dp_oracle(bf16_zero0_dp_fixture: ParallelFixture,
                         tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_bf16_zero0_oracle(bf16_zero0_dp_fixture, BF16_ZERO0_DP_CASES, bf16_zero0_dp_id,
                                 tmp_path_factory.mktemp("pipe-bf16-zero0-dp-oracle"))


@pytest.mark.parametrize("case", BF16_ZERO0_DP_CASES, ids=bf16_zero0_dp_id)
def test_deepspeed_loads_a_bf16_zero0_pipeline_saved_at_dp2_at_zero1_holding_the_source_state(
        bf16_zero0_dp_oracle: dict[str, Any], case: tuple[int, int, str | None],
        bf16_zero0_dp_fixture: ParallelFixture) -> None:
    """Saved at pp2 x dp2, the bf16 ZeRO-0 pipeline's stages are named by both ranks' optimizer files: DeepSpeed's
    PipelineEngine at ZeRO-1 loads ckptflow's output natively, holds the source's fp32 masters, both Adam moments
    and buffers bit for bit, and saves exactly ckptflow's files; the output validates at its shape."""
    check_zero1_output(bf16_zero0_dp_oracle, case, bf16_zero0_dp_fixture)


@pytest.mark.parametrize("name", sample([BF16_ZERO0_DP], keep=()))
def test_a_bf16_zero0_pipeline_saved_at_dp2_is_read_from_all_its_ranks_names(
        bf16_zero0_dp_fixture: ParallelFixture, tmp_path: Path, name: str) -> None:
    """Saved at pp2 x dp2 (DeepSpeed cannot load it back: the writer checked), the bf16 ZeRO-0 pipeline validates
    as ZeRO-0 pp2 x dp2 with the note saying how to resume it, a parameter spanning the ranks' partitions named once,
    and its fp32 masters consolidate to the live engine's (`expected.safetensors`) bit for bit."""
    from ckptflow.formats.deepspeed.readers.pipeline import BF16_ZERO0_NOTE

    fixture = bf16_zero0_dp_fixture
    assert fixture.spec["checks"]["reload"]["deepspeed_load_error"] == "KeyError: 0"
    first = [set(open_archive(str(fixture.tag_dir / f"bf16_zero_pp_rank_{d}_mp_rank_00_optim_states.pt"),
                              ALLOWED).obj["optimizer_state_dict"]["param_slice_mappings"][0]) for d in range(2)]
    assert first[0] & first[1], "no parameter spans stage 0's two partitions"
    report = validate(str(fixture.dir), deep=True)
    assert report.ok, [p.message for p in report.problems]
    summary = report.summary()
    assert (summary["stage"], summary["pp"], summary["world_size"]) == (0, 2, 2)
    assert BF16_ZERO0_NOTE in summary["notes"]
    check_fp32_masters(fixture, tmp_path)


def test_the_plan_asks_the_stage_counts_of_the_method_given(parallel_fixtures: Mapping[str, ParallelFixture]) -> None:
    """Pure: `--plan` (`plan_shapes`) answers for the partition method and layer types the user gives, as the
    reshard would: pipe-toy's pp4 is open under its default method, written under `uniform`, and pp3 under
    `type:PipeBlock` with its layer types declared."""
    from ckptflow.reshard.run import plan_shapes

    src = str(parallel_fixtures["pipe-pp2-z1-fp32"].dir)

    def reason(world_size: int, pp: int, **declared: Any) -> str | None:
        [option] = [o for o in plan_shapes(src, world_size, **declared).options if o.shape.pp == pp]
        return option.reason

    assert (reason(4, 4) or "").startswith("cannot tell which layers each of 4 pipeline stages of ")
    assert reason(4, 4, partition_method="uniform") is None
    assert (reason(3, 3) or "").startswith("cannot tell which layers each of 3 pipeline stages of ")
    assert reason(3, 3, partition_method="type:PipeBlock", layer_types=PIPE_TYPES) is None
