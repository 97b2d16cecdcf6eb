"""Resharding tensor- and pipeline-parallel checkpoints to another data-parallel size, checked against
DeepSpeed itself (issue 11).

For each case ckptflow reshards the fixture to the new data-parallel size, keeping its tensor and
pipeline degrees; then DeepSpeed builds the same model at that size (``tests.oracles.parallel_reshard``),
loads the reshard natively (``engine.load_checkpoint``, no universal checkpoint), and

- everything it holds, gathered the way the fixture writer gathered the oracle (fp32 weights, Adam
  moments, buffers of every parameter, joined over tensor parallelism), equals the live engine's
  state at the source size (``expected.safetensors``) bit for bit;
- saved again at that size, it writes exactly ckptflow's files: same names, same object trees,
  same tensor bytes (layer files and ``universal_checkpoint_info`` included).

ZeRO-0 needs no reshard: DeepSpeed loads it as it is at another data-parallel size (checked here
too), and ckptflow says so. At another ZeRO stage it does (issue 24): its optimizer state named
(`readers.zero0.named_groups`), data-parallel and AutoTP, fp32 and bf16, with the same oracle; an AutoTP one
with another tensor-parallel degree too (merged to tp1 by default, split to tp4 from ``specs.zero0_split`` in
the long mode).

The tensor-parallel degree itself can be merged away for AutoTP (``--tensor-parallel 1``): the same
oracle, with DeepSpeed building the model without tensor parallelism at the new data-parallel size.
And it can be split to another degree above 1 (``--tp 4``, issue 24), on models that AutoTP runs four
ways (``specs.split``: 4 key/value heads): DeepSpeed builds the model with AutoTP at the new degree, and
besides the checks above, ``ds_to_universal`` of its re-save equals ``ds_to_universal`` of the source in
every fp32 weight, Adam moment and step, bit for bit.

An AutoTP checkpoint trained with ``round_robin_gradients`` (``specs.autotp_round_robin``) changes its degree
(and stage) under the same oracle, which runs the target with the source's config and gathers the state
from DeepSpeed's flat partitions (its accessors read the wrong elements of such a run, so no
``ds_to_universal`` comparison there); so does one that AutoTP runs four ways (``specs.autotp_round_robin_split``),
split to tp4 (long mode). So does one saved at ZeRO-2/3 from a config that gets BF16_Optimizer at ZeRO-1,
written there as BF16_Optimizer's files: at its degree, merged to tp1, and split to tp4 (``specs.bf16_split``;
long mode).
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from ckptflow.errors import UnsupportedCheckpointError
from ckptflow.formats.deepspeed import inspect, load_index
from ckptflow.formats.deepspeed.autotp_shards import (
    Meta,
    ShardRule,
    contiguous_split_map,
    replicated_map,
    shard_rule_of,
    shard_sizes,
    sub_param_map,
)
from ckptflow.formats.deepspeed.names import ALLOWED, UC_INFO
from ckptflow.formats.deepspeed.partition import BF16, ZERO
from ckptflow.formats.torch.zipdir import open_archive
from ckptflow.reshard import plan_reshard, reshard
from ckptflow.reshard.shape import Target
from ckptflow.reshard.tensor_parallel import plan_tensor_parallel_split
from ckptflow.validate import validate
from tests.fixtures.replay import launch
from tests.fixtures.sets import SETS, ParallelFixture, build_bf16_optimizer, build_split
from tests.fixtures.specs.parallel import ParallelSpec
from tests.sampling import sample
from tests.test_reshard import _differences, _load_plain, _plain, _universal, _universal_tensor

ORACLE = "tests.oracles.parallel_reshard"
# (fixture, new data-parallel size)
ALL_CASES = (
    ("autotp-tp2-z2-fp32", 2), ("autotp-tp2-z3-fp32", 2), ("autotp-llama-tied-tp2-z1-fp32", 2),
    ("autotp-glm-tp2-z1-fp32", 2), ("autotp-glm-tp2-z3-fp32", 2),
    ("autotp-tp2dp2-z1-fp32", 1), ("autotp-tp2dp2-z3-bf16", 1),
    ("pipe-pp2-z1-fp32", 2), ("pipe-pp2-z1-bf16", 2), ("pipe-pp2dp2-z1-fp32", 1),
    ("megatron-pp2tp2-z1-fp32-ucinfo", 2),
)
# ZeRO-0: DeepSpeed loads the source itself at the new size (in bf16 too: FP16_Optimizer's flat masters).
NATIVE = (("autotp-tp2-z0-fp32", 2), ("autotp-tp2-z0-bf16", 2))
# AutoTP merged to tensor-parallel degree 1 at the new data-parallel size: (fixture, dp, 1).
ALL_MERGES = (
    ("autotp-tp2-z1-fp32", 2, 1), ("autotp-tp2-z2-fp32", 1, 1), ("autotp-tp2-z3-fp32", 2, 1),
    ("autotp-tp2-z1-bf16", 2, 1), ("autotp-tp2dp2-z1-fp32", 3, 1), ("autotp-tp2dp2-z3-bf16", 2, 1),
    ("autotp-llama-tied-tp2-z1-fp32", 2, 1), ("autotp-glm-tp2-z1-fp32", 2, 1), ("autotp-glm-tp2-z3-fp32", 1, 1),
)
# The default run samples them (`tests.sampling`; one DeepSpeed launch per world size, layout and
# tensor-parallel degree): AutoTP at ZeRO-1/2/3 (ZeRO-1 bf16 in a merge), fp32 and bf16, tied and GLM,
# growing and shrinking, one pipeline, two merges (the Megatron-style layout's 8-rank launch in the long
# mode). `CKPTFLOW_LONG=1` runs every case.
CASES = sample(ALL_CASES, [
    ("autotp-tp2-z2-fp32", 2), ("autotp-tp2-z3-fp32", 2), ("autotp-llama-tied-tp2-z1-fp32", 2),
    ("autotp-glm-tp2-z3-fp32", 2), ("autotp-tp2dp2-z3-bf16", 1), ("pipe-pp2-z1-fp32", 2)])
MERGES = sample(ALL_MERGES, [("autotp-tp2-z3-fp32", 2, 1), ("autotp-tp2-z1-bf16", 2, 1)])
# AutoTP at another ZeRO stage, per tensor-parallel rank (fixture, dp, None, stage), or merged to tp1 too
# (fixture, dp, 1, stage).
ALL_STAGES = (
    ("autotp-tp2-z1-fp32", 2, None, 3), ("autotp-tp2-z3-fp32", 1, None, 2), ("autotp-tp2dp2-z1-fp32", 1, None, 2),
    ("autotp-tp2-z1-bf16", 2, None, 3), ("autotp-llama-tied-tp2-z1-fp32", 2, None, 3),
    ("autotp-glm-tp2-z3-fp32", 2, None, 1), ("autotp-tp2dp2-z3-bf16", 1, None, 2),
    # three axes at once: the stage, the tensor parallelism merged, the data-parallel size
    ("autotp-tp2-z2-fp32", 3, 1, 3), ("autotp-tp2dp2-z1-fp32", 3, 1, 3), ("autotp-tp2-z1-bf16", 1, 1, 2),
    # from ZeRO-3: merged with the stage, the ZeRO-1/2 module cast from the fp32 masters (bf16 too)
    ("autotp-tp2-z3-fp32", 2, 1, 2), ("autotp-tp2dp2-z3-bf16", 3, 1, 1), ("autotp-glm-tp2-z3-fp32", 1, 1, 2),
    # ZeRO-0 to ZeRO-1/2/3 (issue 24): the optimizer state named, the masters the fp32 module's or
    # FP16_Optimizer's flat ones (bf16); data-parallel and AutoTP, a tied embedding
    ("autotp-tp2-z0-fp32", 1, None, 3), ("autotp-tp2-z0-bf16", 1, None, 2), ("zero-dp2-z0-fp32", 3, None, 1),
    ("zero-dp2-z0-bf16", 2, None, 3), ("zero-llama-tied-dp2-z0-fp32", 1, None, 3), ("zero-dp2-z0-fp32", 1, None, 2),
    # ZeRO-0 AutoTP merged to tp1 with the stage: each tensor-parallel rank's optimizer state named, the ranks'
    # masters joined by the affine maps (fp32: the module's weights; bf16: FP16_Optimizer's flat masters)
    ("autotp-tp2-z0-fp32", 2, 1, 1), ("autotp-tp2-z0-bf16", 3, 1, 2), ("autotp-tp2dp2-z0-fp32", 1, 1, 3),
    ("autotp-tp2-z0-bf16", 2, 1, 3),
)
# The ZeRO-0 cases ride on launches the others make already: (2 ranks, tp2) and (2 ranks, tp1); by default
# AutoTP fp32 and data-parallel bf16 (FP16_Optimizer's flat masters), both to ZeRO-3. So do the merges from
# ZeRO-3 with the stage: (2 ranks, tp1) and (3 ranks, tp1).
STAGES = sample(ALL_STAGES, [("autotp-tp2-z1-fp32", 2, None, 3), ("autotp-tp2-z3-fp32", 1, None, 2),
                             ("autotp-tp2-z2-fp32", 3, 1, 3), ("autotp-tp2dp2-z3-bf16", 1, None, 2),
                             ("autotp-tp2-z0-fp32", 1, None, 3), ("zero-dp2-z0-bf16", 2, None, 3),
                             ("autotp-tp2-z3-fp32", 2, 1, 2), ("autotp-tp2dp2-z3-bf16", 3, 1, 1),
                             ("autotp-tp2-z0-fp32", 2, 1, 1), ("autotp-tp2-z0-bf16", 3, 1, 2)])
# AutoTP trained with round_robin_gradients (`specs.autotp_round_robin`: tp2 x dp2 ZeRO-2, each tensor-parallel
# rank's groups flattened round-robin over its 2 data-parallel ranks): merged to tp1 at the same dp and others,
# at ZeRO-2, 1 and 3 (fixture, dp, 1[, stage]), and at tp2 (a dp change, a stage change). The oracle runs the
# target with the source's config and gathers the state from the flat partitions at DeepSpeed's own offsets
# (`writers.parallel_rr`: DeepSpeed's accessors, and so ds_to_universal, read the wrong elements of such a run).
# By default two, riding the (3 ranks, tp1) and (2 ranks, tp1) launches: the order undone over 2 ranks and
# redone over 3, and ZeRO-2 -> ZeRO-3 in the optimizer's order.
RR = "autotp-tp2dp2-z2-fp32-rr"
ALL_RR_RESHARDS = ((RR, 3, 1), (RR, 2, 1, 3), (RR, 2, 1), (RR, 2, 1, 1), (RR, 3, 1, 1), (RR, 1, 1, 3), (RR, 1),
                   (RR, 2, None, 3))
RR_RESHARDS = sample(ALL_RR_RESHARDS, ALL_RR_RESHARDS[:2])
RESHARDS = CASES + MERGES + STAGES + RR_RESHARDS
# AutoTP split to another degree above 1 (fixture of `specs.split`, dp, tp[, stage]). The default run makes
# one 4-rank launch at tp4: tp2 x dp2 -> tp4 x dp1, with ZeRO-1 -> 3, and GLM's sub-parameters at ZeRO-3.
ALL_SPLITS = (
    ("autotp-mha-tp2dp2-z1-fp32", 1, 4), ("autotp-mha-tp2-z1-fp32", 1, 4, 3), ("autotp-glm-mha-tp2-z3-fp32", 1, 4),
    ("autotp-mha-tp2-z1-fp32", 1, 4), ("autotp-mha-tp2-z1-bf16", 1, 4), ("autotp-llama-tied-mha-tp2-z1-fp32", 1, 4),
    ("autotp-llama-tied-mha-tp2-z1-fp32", 1, 4, 3),
    # tp4 x dp2 -> tp2: the vocabulary's 10 + 9 + 9 + 9 rows become 19 + 18; at dp2, or at dp1 with ZeRO-2 -> 3
    ("autotp-mha-tp4dp2-z2-fp32", 2, 2), ("autotp-mha-tp4dp2-z2-fp32", 1, 2, 3),
    # from ZeRO-3 with the stage: GLM's sub-parameters split again, the module cast from the masters
    ("autotp-glm-mha-tp2-z3-fp32", 1, 4, 1), ("autotp-glm-mha-tp2-z3-fp32", 1, 4, 2),
)
# By default, the 4-rank tp4 launch loads the first three and ZeRO-3 -> ZeRO-1 with the split.
SPLITS = sample(ALL_SPLITS, (*ALL_SPLITS[:3], ("autotp-glm-mha-tp2-z3-fp32", 1, 4, 1)))


# AutoTP with 4 key/value heads trained with round_robin_gradients (`specs.autotp_round_robin_split`: tp2 x dp2
# ZeRO-2) split to tp4 at dp1 (at ZeRO-2 and 3) and at dp2 (ZeRO-2 and 1: each target rank's groups flattened
# round-robin over its 2 data-parallel ranks again). Two launches of their own (4 and 8 ranks, the oracle with
# `models.split`'s models: `oracles.parallel_reshard_mha`): long mode.
RR_SPLIT = "autotp-mha-tp2dp2-z2-fp32-rr"
RR_SPLITS = sample(((RR_SPLIT, 1, 4), (RR_SPLIT, 1, 4, 3), (RR_SPLIT, 2, 4), (RR_SPLIT, 2, 4, 1)), [])
# ZeRO-0 AutoTP with 4 key/value heads (`specs.zero0_split`: tp2) split to tp4 with the stage: each tensor-parallel
# rank's optimizer state named, the masters joined and cut again at tp4. A fixture launch and a 4-rank oracle
# launch of their own: long mode.
Z0_SPLIT = "autotp-mha-tp2-z0-fp32"
Z0_SPLITS = sample(((Z0_SPLIT, 1, 4, 1), (Z0_SPLIT, 1, 4, 3), (Z0_SPLIT, 1, 4, 2)), [])


# From BF16_Optimizer (bf16 ZeRO-1 with fp32 gradient accumulation, `specs.bf16_optimizer`): merged to tp1 at
# ZeRO-2 and ZeRO-3, and ZeRO-3 per tensor-parallel rank. Its fixtures are launches of their own: long mode.
ALL_BF16_RESHARDS = (
    ("autotp-tp2-z1-bf16-fp32accum", 2, 1, 2), ("autotp-tp2-z1-bf16-fp32accum", 2, 1, 3),
    ("autotp-tp2-z1-bf16-fp32accum", 1, None, 3), ("autotp-tp2-z1-bf16-fp32accum", 1, None, 2),
)
BF16_RESHARDS = sample(ALL_BF16_RESHARDS, [])
# ... and back: DeepSpeed's own ZeRO-2 and ZeRO-3 re-saves of those at tp2 (DeepSpeedZeroOptimizer's and the
# ZeRO-3 optimizer's files of a run whose config gets BF16_Optimizer at ZeRO-1) written at ZeRO-1 at tp2, at
# their own and another data-parallel size, and merged to tp1: BF16_Optimizer's files. Three more launches:
# long mode.
BF16_CHAINED = {"autotp-tp2-z2-bf16-fp32accum*": ("autotp-tp2-z1-bf16-fp32accum", 1, None, 2),
                "autotp-tp2-z3-bf16-fp32accum*": ("autotp-tp2-z1-bf16-fp32accum", 1, None, 3)}
ALL_BF16_BACK = (("autotp-tp2-z2-bf16-fp32accum*", 1, None, 1), ("autotp-tp2-z3-bf16-fp32accum*", 2, None, 1),
                 ("autotp-tp2-z3-bf16-fp32accum*", 2, 1, 1))
BF16_BACK = sample(ALL_BF16_BACK, [])
# ... and split: AutoTP with 4 key/value heads saved by DeepSpeedZeroOptimizer (ZeRO-2) and the ZeRO-3 optimizer
# from a config that gets BF16_Optimizer at ZeRO-1 (`specs.bf16_split`), split tp2 -> tp4 at ZeRO-1:
# BF16_Optimizer's files. A fixture launch and a 4-rank oracle launch of their own: long mode.
ALL_BF16_SPLITS = (("autotp-mha-tp2-z2-bf16-fp32accum", 1, 4, 1), ("autotp-mha-tp2-z3-bf16-fp32accum", 1, 4, 1))
BF16_SPLITS = sample(ALL_BF16_SPLITS, [])


def case_id(case: tuple) -> str:
    return (f"{case[0].rstrip('*')}-to-dp{case[1]}" + (f"-tp{case[2]}" if len(case) > 2 and case[2] else "")
            + (f"-z{case[3]}" if len(case) > 3 else ""))


def target_spec(fixture: ParallelFixture, dp: int, tp: int | None = None, stage: int | None = None) -> ParallelSpec:
    spec = fixture.parallel_spec
    tp = spec.tp if tp is None else tp
    return dataclasses.replace(spec, tp=tp, stage=spec.stage if stage is None else stage, world_size=dp * tp * spec.pp)


def run_reshard_oracle(fixtures: Mapping[str, ParallelFixture], reshards: tuple, native: tuple,
                       root: Path, script: str = ORACLE) -> dict[str, Any]:
    """Reshard every case of `reshards` ((fixture, dp) or (fixture, dp, tp)); then one DeepSpeed launch per
    (world size, layout, tp degree) loads each reshard (and each `native` source as it is), checks what it
    holds against the fixture's oracle and saves it again."""
    outs, resaved, results = {}, {}, {}
    launches: dict[tuple[int, str, int], list[dict[str, Any]]] = {}
    for case in reshards + native:
        name, dp, tp, stage = (*case, None, None)[:4]
        fixture = fixtures[name]
        spec = target_spec(fixture, dp, tp, stage)
        load = fixture.dir
        if case in reshards:
            outs[case] = root / "out" / case_id(case)
            reshard(str(fixture.dir), str(outs[case]), world_size=spec.world_size, workers=2, tp=tp, stage=stage)
            load = outs[case]
            resaved[case] = root / "resaved" / case_id(case)
        results[case] = root / "results" / f"{case_id(case)}.json"
        results[case].parent.mkdir(parents=True, exist_ok=True)
        launches.setdefault((spec.world_size, spec.layout, spec.tp), []).append({
            "spec": spec.to_json(), "source": fixture.parallel_spec.to_json(), "load": str(load), "save": str(resaved[case]) if case in resaved else None,
            "expected": str(fixture.expected_path), "buffers": str(fixture.buffers_path), "result": str(results[case]),
            **source_sections(fixture),
        })
    for (world_size, layout, tp), jobs in sorted(launches.items()):
        launch_oracle(world_size, jobs, root, f"{world_size}-{layout}-tp{tp}", script)
    return {"outs": outs, "resaved": resaved, "results": results}


def source_sections(fixture: ParallelFixture) -> dict[str, Any]:
    """The oracle job's keys for what of the source's config its user runs at the target too: a
    BF16_Optimizer source's fp32 gradient accumulation (`data_types`) and round-robin gradients."""
    config = fixture.spec.get("ds_config") or {}
    section = config.get("data_types")
    rr = bool((config.get("zero_optimization") or {}).get("round_robin_gradients"))
    return {**({"data_types": section} if section else {}), **({"round_robin": True} if rr else {})}


def deepspeed_round_robin(items: Sequence[str], ranks: int) -> list[str]:
    """`items` as DeepSpeed's `_round_robin_reorder` flattens them over `ranks` ranks."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    return list(DeepSpeedZeroOptimizer._round_robin_reorder(None, list(items), ranks)[0])


def deepspeed_undone(saved: Sequence[str], ranks: int) -> list[str]:
    """The list whose `deepspeed_round_robin` over `ranks` ranks is `saved`: the optimizer's own."""
    where = deepspeed_round_robin([str(i) for i in range(len(saved))], ranks)
    order = {int(i): name for i, name in zip(where, saved)}
    return [order[i] for i in range(len(saved))]


def launch_oracle(world_size: int, jobs: list[dict[str, Any]], root: Path, label: str, script: str = ORACLE) -> None:
    """One DeepSpeed launch of `script` (`tests.oracles.parallel_reshard`, or a rank script that runs its jobs) on
    `world_size` ranks running `jobs` (its jobs file and logs under `root`, named by `label`)."""
    jobs_file = root / f"jobs-{label}.json"
    jobs_file.write_text(json.dumps(jobs, indent=1))
    launch(script, world_size, ["--jobs", str(jobs_file)], timeout=900,
           log_dir=root / f"logs-{label}")


def check_loaded_state(oracle: Mapping[str, Any], case: tuple, fixture: ParallelFixture) -> None:
    result = json.loads(oracle["results"][case].read_text())
    assert result["differ"] == []
    assert result["tensors_equal"] == 3 * len(fixture.spec["params"])
    assert result["buffers_equal"] == len(fixture.spec["buffers"])


def check_same_files(oracle: Mapping[str, Any], case: tuple) -> None:
    ours, theirs = oracle["outs"][case], oracle["resaved"][case]
    tag = (ours / "latest").read_text()
    assert (theirs / "latest").read_text() == tag
    names = sorted(p.name for p in (ours / tag).iterdir())
    assert names == sorted(p.name for p in (theirs / tag).iterdir() if p.suffix == ".pt")
    for name in names:
        diffs = _differences(_plain(open_archive(str(ours / tag / name), ALLOWED).obj),
                             _plain(open_archive(str(theirs / tag / name), ALLOWED).obj))
        assert not diffs, f"{name}: " + "; ".join(diffs[:5])


def check_validates(oracle: Mapping[str, Any], case: tuple, fixture: ParallelFixture) -> None:
    report = validate(str(oracle["outs"][case]), deep=True)
    assert report.ok, [p.message for p in report.problems]
    source = validate(str(fixture.dir)).summary()
    summary = report.summary()
    assert summary["world_size"] == case[1]
    assert summary.get("tp", 1) == (case[2] if len(case) > 2 and case[2] else source.get("tp", 1))
    assert summary["stage"] == (case[3] if len(case) > 3 else source["stage"])
    assert {k: summary[k] for k in ("step", "params", "numel", "tied")} == \
        {k: source[k] for k in ("step", "params", "numel", "tied")}


@pytest.fixture(scope="session")
def both_fixtures(parallel_fixtures: Mapping[str, ParallelFixture],
                  parallel_extra_fixtures: Mapping[str, ParallelFixture]) -> Mapping[str, ParallelFixture]:
    """The matrix's and the extra fixtures, and the round-robin one (`specs.autotp_round_robin`)."""
    return {**parallel_fixtures, **parallel_extra_fixtures, **SETS["autotp-round-robin"].build([RR])}


@pytest.fixture(scope="session")
def mp_oracle(both_fixtures: Mapping[str, ParallelFixture], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_reshard_oracle(both_fixtures, RESHARDS, NATIVE, tmp_path_factory.mktemp("mp-reshard-oracle"))


@pytest.fixture(scope="session")
def split_fixtures(request: pytest.FixtureRequest) -> Mapping[str, ParallelFixture]:
    return build_split(sorted({case[0] for case in SPLITS}))


@pytest.fixture(scope="session")
def split_oracle(split_fixtures: Mapping[str, ParallelFixture], tmp_path_factory: pytest.TempPathFactory
                 ) -> dict[str, Any]:
    return run_reshard_oracle(split_fixtures, SPLITS, (), tmp_path_factory.mktemp("tp-split-oracle"))


@pytest.fixture(scope="session")
def bf16_oracle(tmp_path_factory: pytest.TempPathFactory) -> tuple[Mapping[str, ParallelFixture], dict[str, Any]]:
    fixtures = build_bf16_optimizer(sorted({case[0] for case in BF16_RESHARDS}))
    return fixtures, run_reshard_oracle(fixtures, BF16_RESHARDS, (), tmp_path_factory.mktemp("bf16-oracle"))


def resaved_fixture(fixture: ParallelFixture, case: tuple, resaved: Path, root: Path) -> ParallelFixture:
    """DeepSpeed's re-save `resaved` of `case` (a reshard of `fixture`) as a fixture of its own under `root`:
    the same trained state (`fixture`'s oracle files), its spec at the case's shape and stage."""
    root.mkdir(parents=True)
    for item in fixture.root.iterdir():
        if item.name not in ("ckpt", "spec.json"):
            (root / item.name).symlink_to(item)
    (root / "ckpt").symlink_to(resaved)
    spec = target_spec(fixture, *case[1:])
    (root / "spec.json").write_text(json.dumps({**fixture.spec, **spec.to_json()}))
    return ParallelFixture.load(root)


@pytest.fixture(scope="session")
def bf16_back_oracle(bf16_oracle: tuple[Mapping[str, ParallelFixture], dict[str, Any]],
                     tmp_path_factory: pytest.TempPathFactory) -> tuple[Mapping[str, ParallelFixture], dict[str, Any]]:
    fixtures, first = bf16_oracle
    root = tmp_path_factory.mktemp("bf16-back-oracle")
    chained = {alias: resaved_fixture(fixtures[case[0]], case, first["resaved"][case], root / "sources" / alias.rstrip("*"))
               for alias, case in BF16_CHAINED.items() if any(back[0] == alias for back in BF16_BACK)}
    return chained, run_reshard_oracle(chained, BF16_BACK, (), root)


@pytest.mark.parametrize("case", BF16_BACK, ids=case_id)
def test_a_zero23_checkpoint_whose_config_gets_bf16_optimizer_is_written_as_its_files_at_zero1(
        bf16_back_oracle: tuple[Mapping[str, ParallelFixture], dict[str, Any]], case: tuple) -> None:
    """AutoTP tp2 saved by DeepSpeedZeroOptimizer (ZeRO-2) or the ZeRO-3 optimizer from a config that gets
    BF16_Optimizer at ZeRO-1: at ZeRO-1 (tp2, or merged to tp1) DeepSpeed builds BF16_Optimizer from that
    config, loads ckptflow's BF16_Optimizer files natively holding the trained state bit for bit, and saves
    exactly ckptflow's files."""
    fixtures, oracle = bf16_back_oracle
    check_loaded_state(oracle, case, fixtures[case[0]])
    check_same_files(oracle, case)
    check_validates(oracle, case, fixtures[case[0]])
    written = load_index(str(oracle["outs"][case]))  # merged to tp1: a data-parallel checkpoint
    assert load_index(str(fixtures[case[0]].dir)).ranks[0].optimizer_kind != BF16
    assert getattr(written, "ranks", (written,))[0].optimizer_kind == BF16


@pytest.fixture(scope="session")
def bf16_split_oracle(tmp_path_factory: pytest.TempPathFactory) -> tuple[Mapping[str, ParallelFixture], dict[str, Any]]:
    fixtures = SETS["bf16-split"].build(sorted({case[0] for case in BF16_SPLITS}))
    return fixtures, run_reshard_oracle(fixtures, BF16_SPLITS, (), tmp_path_factory.mktemp("bf16-split-oracle"),
                                        "tests.oracles.parallel_reshard_mha")


@pytest.mark.parametrize("case", BF16_SPLITS, ids=case_id)
def test_a_zero23_checkpoint_whose_config_gets_bf16_optimizer_splits_to_its_files_at_zero1(
        bf16_split_oracle: tuple[Mapping[str, ParallelFixture], dict[str, Any]], case: tuple) -> None:
    """AutoTP tp2 saved by DeepSpeedZeroOptimizer (ZeRO-2) or the ZeRO-3 optimizer from a config that gets
    BF16_Optimizer at ZeRO-1, split to tp4 at ZeRO-1: DeepSpeed with AutoTP at tp4 builds BF16_Optimizer from
    that config, loads ckptflow's BF16_Optimizer files natively holding the trained state bit for bit, and
    saves exactly ckptflow's files."""
    fixtures, oracle = bf16_split_oracle
    check_loaded_state(oracle, case, fixtures[case[0]])
    check_same_files(oracle, case)
    check_validates(oracle, case, fixtures[case[0]])
    assert fixtures[case[0]].spec["optimizer"] != "BF16_Optimizer"
    assert load_index(str(fixtures[case[0]].dir)).ranks[0].optimizer_kind != BF16
    assert load_index(str(oracle["outs"][case])).ranks[0].optimizer_kind == BF16


@pytest.mark.parametrize("case", BF16_RESHARDS, ids=case_id)
def test_a_bf16_optimizer_checkpoint_changes_its_degree_and_stage_at_once(
        bf16_oracle: tuple[Mapping[str, ParallelFixture], dict[str, Any]], case: tuple) -> None:
    """AutoTP trained by BF16_Optimizer at tp2: DeepSpeed at the target (tp1 or tp2, ZeRO-2 or ZeRO-3, the
    source's config: DeepSpeedZeroOptimizer or the ZeRO-3 optimizer there) loads the reshard natively,
    holding the source's state bit for bit, and saves exactly ckptflow's files again."""
    fixtures, oracle = bf16_oracle
    check_loaded_state(oracle, case, fixtures[case[0]])
    check_same_files(oracle, case)
    check_validates(oracle, case, fixtures[case[0]])


@pytest.fixture(scope="session")
def rr_split_fixtures() -> Mapping[str, ParallelFixture]:
    return SETS["autotp-round-robin-split"].build([RR_SPLIT])


@pytest.fixture(scope="session")
def rr_split_oracle(rr_split_fixtures: Mapping[str, ParallelFixture], tmp_path_factory: pytest.TempPathFactory
                    ) -> dict[str, Any]:
    return run_reshard_oracle(rr_split_fixtures, RR_SPLITS, (), tmp_path_factory.mktemp("rr-split-oracle"),
                              "tests.oracles.parallel_reshard_mha")


@pytest.mark.parametrize("case", RR_SPLITS, ids=case_id)
def test_a_round_robin_source_splits_to_another_degree(rr_split_oracle: dict[str, Any], case: tuple,
                                                       rr_split_fixtures: Mapping[str, ParallelFixture]) -> None:
    """AutoTP tp2 x dp2 trained with round_robin_gradients, split to tp4: DeepSpeed with AutoTP at tp4 and the
    source's config loads the split natively, holding the source's state (gathered from the flat partitions),
    and saves exactly ckptflow's files."""
    check_loaded_state(rr_split_oracle, case, rr_split_fixtures[case[0]])
    check_same_files(rr_split_oracle, case)
    check_validates(rr_split_oracle, case, rr_split_fixtures[case[0]])


@pytest.fixture(scope="session")
def zero0_split_oracle(tmp_path_factory: pytest.TempPathFactory) -> tuple[Mapping[str, ParallelFixture], dict[str, Any]]:
    fixtures = SETS["zero0-split"].build([Z0_SPLIT])
    return fixtures, run_reshard_oracle(fixtures, Z0_SPLITS, (), tmp_path_factory.mktemp("zero0-split-oracle"),
                                        "tests.oracles.parallel_reshard_mha")


@pytest.mark.parametrize("case", Z0_SPLITS, ids=case_id)
def test_a_zero0_source_splits_to_another_degree_at_another_stage(
        zero0_split_oracle: tuple[Mapping[str, ParallelFixture], dict[str, Any]], case: tuple) -> None:
    """AutoTP tp2 at ZeRO-0 split to tp4 at ZeRO-1, 2 or 3: DeepSpeed with AutoTP at tp4 loads the split
    natively, holding the source's fp32 weights and Adam moments bit for bit, and saves exactly ckptflow's
    files."""
    fixtures, oracle = zero0_split_oracle
    check_loaded_state(oracle, case, fixtures[case[0]])
    check_same_files(oracle, case)
    check_validates(oracle, case, fixtures[case[0]])


@pytest.mark.parametrize("case", SPLITS, ids=case_id)
def test_a_split_loads_in_deepspeed_at_the_new_degree(split_oracle: dict[str, Any], case: tuple,
                                                      split_fixtures: Mapping[str, ParallelFixture]) -> None:
    """DeepSpeed with AutoTP at the target degree loads the split natively, holding the source's state,
    and saves exactly ckptflow's files (`universal_checkpoint_info` and its affine maps included)."""
    check_loaded_state(split_oracle, case, split_fixtures[case[0]])
    check_same_files(split_oracle, case)
    check_validates(split_oracle, case, split_fixtures[case[0]])


@pytest.mark.parametrize("case", SPLITS, ids=case_id)
def test_a_split_converts_to_the_source_universal_checkpoint(split_oracle: dict[str, Any], case: tuple,
                                                             split_fixtures: Mapping[str, ParallelFixture],
                                                             tmp_path_factory: pytest.TempPathFactory) -> None:
    """`ds_to_universal` of DeepSpeed's re-save at the target equals that of the source: every trained
    parameter's fp32 weight, Adam moments and step, bit for bit. (A tied alias's files are left out: the
    converter writes `lm_head.weight` tied to a vocabulary-parallel embedding as one rank's rows.)"""
    scratch = tmp_path_factory.mktemp("universal")
    cache: dict[Path, Path] = {}
    ours = _universal(split_fixtures[case[0]].dir, cache, scratch) / "zero"
    theirs = _universal(split_oracle["resaved"][case], cache, scratch) / "zero"
    params = split_fixtures[case[0]].spec["params"]
    files = {f"{name}/{state}.pt" for name in params for state in ("fp32", "exp_avg", "exp_avg_sq", "step")}
    held = {str(p.relative_to(ours)) for p in ours.rglob("*.pt")} & files
    other = {str(p.relative_to(theirs)) for p in theirs.rglob("*.pt")} & files
    weights = {f for f in files if not f.endswith("/step.pt")}  # step.pt: written at ZeRO-1/2 only
    assert weights <= held and weights <= other
    for name in sorted(held & other):
        assert _universal_tensor(_load_plain(ours / name)) == _universal_tensor(_load_plain(theirs / name)), name


@pytest.mark.parametrize("case", RESHARDS + NATIVE, ids=case_id)
def test_deepspeed_loads_it_holding_the_source_state(mp_oracle: dict[str, Any], case: tuple,
                                                     both_fixtures: Mapping[str, ParallelFixture]) -> None:
    check_loaded_state(mp_oracle, case, both_fixtures[case[0]])


@pytest.mark.parametrize("case", RESHARDS, ids=case_id)
def test_deepspeed_writes_the_same_files(mp_oracle: dict[str, Any], case: tuple) -> None:
    check_same_files(mp_oracle, case)


@pytest.mark.parametrize("case", RESHARDS, ids=case_id)
def test_the_reshard_validates_at_the_new_size(mp_oracle: dict[str, Any], case: tuple,
                                               both_fixtures: Mapping[str, ParallelFixture]) -> None:
    check_validates(mp_oracle, case, both_fixtures[case[0]])


def test_the_tensor_parallel_degree_can_only_be_merged_to_one(parallel_fixtures: Mapping[str, ParallelFixture],
                                                              tmp_path: Path) -> None:
    source = parallel_fixtures["autotp-tp2-z1-fp32"]
    with pytest.raises(UnsupportedCheckpointError, match=r"\(ZeRO-1 tp2 x dp1 \(2 ranks\)\) to 4 ranks, tp4: the model does "
                                                         r"not split into ZeRO-1 tp4 x dp1 \(4 ranks\) \(its attention "
                                                         r"heads, layers or experts do not divide\); shapes it can write "
                                                         r"at 4 ranks: ZeRO-1 dp4 \(4 ranks\), ZeRO-1 tp2 x dp2 "
                                                         r"\(4 ranks\), ZeRO-2 dp4 \(4 ranks\)"):
        reshard(str(source.dir), str(tmp_path / "out"), world_size=4, tp=4)  # its config.json: 2 KV heads
    pipe = parallel_fixtures["pipe-pp2-z1-fp32"]
    with pytest.raises(UnsupportedCheckpointError, match=r"to 4 ranks, tp2: a PipelineModule checkpoint has no tensor "
                                                         r"parallelism to give a degree of 2; shapes it can write at 4 "
                                                         r"ranks: ZeRO-1 dp4 \(4 ranks\), ZeRO-1 pp2 x dp2 \(4 ranks\)$"):
        # (not pp4: the default partition method leaves its stages open, as `--plan` says)
        reshard(str(pipe.dir), str(tmp_path / "out"), world_size=4, tp=2)
    zero0 = parallel_fixtures["autotp-tp2-z0-fp32"]
    with pytest.raises(UnsupportedCheckpointError, match=r"to 1 rank, tp1: a ZeRO-0 checkpoint's optimizer state is "
                                                         r"saved by position, and ckptflow writes it at another shape "
                                                         r"only at another ZeRO stage, where it is named \(its weights "
                                                         r"can still be consolidated\); shapes it can write at 1 rank: ZeRO-1 dp1 "
                                                         r"\(1 rank\), ZeRO-2 dp1 \(1 rank\), ZeRO-3 dp1 \(1 rank\)$"):
        reshard(str(zero0.dir), str(tmp_path / "out"), world_size=1, tp=1)
    assert not (tmp_path / "out").exists()


def test_world_size_counts_every_rank(parallel_fixtures: Mapping[str, ParallelFixture], tmp_path: Path) -> None:
    """--world-size is the ranks DeepSpeed runs at: a tp2 source at 4 ranks is tp2 x dp2; a pp2 source at 3
    ranks keeping pp2 is refused, naming the shapes that work (one stage: at three the default partition
    method leaves the stages open, as `--plan` says)."""
    source = parallel_fixtures["pipe-pp2-z1-fp32"]
    with pytest.raises(UnsupportedCheckpointError, match=r"to 3 ranks: 3 ranks do not split into tp1 x pp2 \(2 ranks per "
                                                         r"model replica\); shapes it can write at 3 ranks: ZeRO-1 dp3 "
                                                         r"\(3 ranks\)$"):
        reshard(str(source.dir), str(tmp_path / "out"), world_size=3)
    result = reshard(str(parallel_fixtures["autotp-tp2-z1-fp32"].dir), str(tmp_path / "out"), world_size=4)
    assert (str(result.source_shape), str(result.shape)) == ("ZeRO-1 tp2 x dp1 (2 ranks)", "ZeRO-1 tp2 x dp2 (4 ranks)")
    assert result.world_size == 2  # the data-parallel ranks


@pytest.mark.parametrize("name,dp", [("autotp-tp2dp2-z0-fp32", 2), ("autotp-tp2-z0-bf16", 1)])
def test_zero0_is_not_resharded_and_says_why(name: str, dp: int, both_fixtures: Mapping[str, ParallelFixture],
                                             tmp_path: Path) -> None:
    fixture = both_fixtures[name]
    with pytest.raises(UnsupportedCheckpointError) as info:
        reshard(str(fixture.dir), str(tmp_path / "out"), world_size=1)
    assert info.value.code == "reshard-not-needed"
    assert str(info.value) == (
        f"{fixture.dir}/global_step3 is a checkpoint in the AutoTP (tensor-parallel; tp 2 x dp {dp}, ZeRO-0) layout: "
        "its files hold whole tensors and do not depend on the data-parallel size, and DeepSpeed loads it natively at "
        f"any data-parallel size, so there is nothing to reshard; point the run at {fixture.dir} as it is, with any "
        "multiple of its 2 model-parallel ranks")
    assert not (tmp_path / "out").exists()


def test_trainer_rng_files_are_named_for_every_rank(parallel_fixtures: Mapping[str, ParallelFixture],
                                                    tmp_path: Path) -> None:
    """A Trainer runs one process per rank (tp x pp x dp) and each reads its own `rng_state_{i}.pth`: a tp2 x dp1
    source's two files become four at tp2 x dp2, from process i mod 2."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(parallel_fixtures["autotp-tp2-z1-fp32"].dir, src)
    for i in range(2):
        (src / f"rng_state_{i}.pth").write_bytes(f"state of process {i}".encode())
    result = reshard(str(src), str(tmp_path / "out"), world_size=4)
    assert str(result.shape) == "ZeRO-1 tp2 x dp2 (4 ranks)"
    assert {c.target: c.source for c in result.rng_files} == {f"rng_state_{i}.pth": f"rng_state_{i % 2}.pth"
                                                              for i in range(4)}
    assert (tmp_path / "out" / "rng_state_3.pth").read_bytes() == b"state of process 1"


# ---- the split's arithmetic and its refusals -----------------------------------------------------------


@pytest.mark.parametrize("total,tp,kv,grain,name", [
    (37, 4, 4, 1, "lm_head"), (37, 4, None, 64, "lm_head"), (64, 4, 4, 1, "model.layers.0.self_attn.q_proj"),
    (48, 3, 8, 1, "model.layers.0.self_attn.k_proj"), (96, 4, 4, 1, "model.layers.0.mlp.down_proj"),
    (200, 3, 8, 64, "model.layers.0.mlp.up_proj"), (40, 3, 8, 1, "model.layers.0.self_attn.v_proj"),
])
def test_shard_sizes_are_deepspeeds(total: int, tp: int, kv: int | None, grain: int, name: str) -> None:
    from deepspeed.module_inject.tp_shard import AutoTPMeta, get_shard_size_list

    assert shard_sizes(total, tp, Meta(kv, grain), name) == \
        get_shard_size_list(total, tp, AutoTPMeta(num_kv_heads=kv, tp_grain_size=grain), name)


def test_affine_maps_are_deepspeeds() -> None:
    from deepspeed.checkpoint import affine

    widths = [[18, 18, 12], [18, 18, 12]]
    assert replicated_map([37, 64], 4) == affine.replicated_map((37, 64), 4).to_dict()
    assert contiguous_split_map([64, 96], [24, 24, 24, 24], 1) == \
        affine.contiguous_split_map((64, 96), [24, 24, 24, 24], 1).to_dict()
    assert sub_param_map([96, 64], widths, 0) == affine.sub_param_map((96, 64), [48, 48], widths, 0).to_dict()
    assert shard_rule_of(sub_param_map([96, 64], widths, 0), 3, widths, 0) == ShardRule("sub", 0, (48, 48))
    assert shard_rule_of(contiguous_split_map([64, 96], [30, 66], 1), 2, None, None) == ShardRule("split", 1, (96,))
    assert shard_rule_of(replicated_map([64], 2), 2, None, None) == ShardRule("replicated")


def _llama_tp2(parallel_fixtures: Mapping[str, ParallelFixture]) -> Any:
    index, problems, _ = inspect(str(parallel_fixtures["autotp-tp2-z1-fp32"].dir))
    assert index is not None and not problems
    return index


@pytest.mark.parametrize("kv,message", [
    (2, "at tensor-parallel degree 4 AutoTP would give some ranks none of model.layers.0.self_attn.q_proj.weight "
        "(split [[32, 32, 0, 0]]); choose a degree that divides its key/value heads (2)"),
    (1, "model.layers.0.self_attn.q_proj.weight is split [[32, 32]] over 2 ranks, but DeepSpeed's arithmetic "
        "(key/value heads 1, grain 1) gives [[64, 0]]; ckptflow does not know the rule this split followed, so it "
        "does not split it again"),
])
def test_a_split_follows_deepspeeds_arithmetic_or_is_refused(kv: int, message: str,
                                                              parallel_fixtures: Mapping[str, ParallelFixture]
                                                              ) -> None:
    """The planner itself (`resolve` never offers these shapes): a degree above the key/value heads leaves
    ranks without a shard; a config whose heads do not give the recorded split is not followed."""
    index = _llama_tp2(parallel_fixtures)
    with pytest.raises(UnsupportedCheckpointError) as info:
        plan_tensor_parallel_split(index, 1, 4, config={"num_key_value_heads": kv})
    assert str(info.value) == f"{index.root}/{index.tag}: {message}"


def _without_norm_map(params: dict[str, Any]) -> None:
    del params[r"^model\.norm\.weight$"]


def _ranks_swapped(params: dict[str, Any]) -> None:
    ranks = params[r"^model\.layers\.0\.self_attn\.q_proj\.weight$"]["ranks"]
    ranks[0], ranks[1] = ranks[1], ranks[0]  # each rank's piece where the other's is


@pytest.mark.parametrize("damage,message", [
    (_without_norm_map, "model.norm.weight has no affine map of its own in universal_checkpoint_info, so ckptflow "
                        "does not know how AutoTP splits it; ckptflow does not guess"),
    (_ranks_swapped, "the affine map of model.layers.0.self_attn.q_proj.weight is none of the layouts ckptflow splits "
                     "again (replicated, one block per rank, sub-parameters split one by one); ckptflow does not guess"),
])
def test_a_parameter_whose_split_is_not_recorded_is_refused(damage: Any, message: str,
                                                             parallel_fixtures: Mapping[str, ParallelFixture]) -> None:
    index = _llama_tp2(parallel_fixtures)
    head = index.ranks[0].model_states[0]
    head[UC_INFO] = copy.deepcopy(head[UC_INFO])  # this index's own copy, damaged
    damage(head[UC_INFO]["affine_map"]["params"])
    with pytest.raises(UnsupportedCheckpointError) as refused:
        plan_tensor_parallel_split(index, 1, 4, config={"num_key_value_heads": 4})
    assert str(refused.value) == f"{index.root}/{index.tag}: {message}"


def test_a_split_without_the_models_config_is_refused(tmp_path: Path) -> None:
    """Without config.json nothing says how many key/value heads the attention layers split on."""
    import shutil

    source = build_split(["autotp-mha-tp2-z1-fp32"])["autotp-mha-tp2-z1-fp32"]
    src = tmp_path / "src"
    shutil.copytree(source.dir, src)
    (src / "config.json").unlink()
    with pytest.raises(UnsupportedCheckpointError) as info:
        reshard(str(src), str(tmp_path / "out"), world_size=4, tp=4)
    assert str(info.value) == (
        f"{src}/global_step3: ckptflow needs the model's config.json (its key/value heads) to split the attention "
        "layers as AutoTP does at tensor-parallel degree 4, and the checkpoint folder has none; copy the model's "
        "config.json into the checkpoint folder")
    assert not (tmp_path / "out").exists()


# ---- round-robin gradients ------------------------------------------------------------------------------


def test_a_round_robin_source_is_laid_out_again_at_the_target_s_data_parallel_size(
        both_fixtures: Mapping[str, ParallelFixture]) -> None:
    """AutoTP tp2 x dp2 ZeRO-2 trained with round_robin_gradients: DeepSpeed flattened each tensor-parallel
    rank's groups round-robin over its 2 data-parallel ranks (`real_dp_process_group`: world / tp), so the
    saved order is not the model's. Merged to tp1, a ZeRO-1/2 target flattens the optimizer's list as
    DeepSpeed's `_round_robin_reorder` orders it over the target's data-parallel ranks; ZeRO-3 takes the list."""
    index = load_index(str(both_fixtures[RR].dir))
    saved = [list(g.params) for g in index.ranks[0].groups]
    assert [[list(g.params) for g in rank.groups] for rank in index.ranks] == [saved] * 2
    listed = [deepspeed_undone(names, 2) for names in saved]  # the optimizer's list
    ordered = index.ranks[0].in_optimizer_order()
    assert [list(g.params) for g in ordered.groups] == listed
    assert ordered.in_optimizer_order() is ordered and not ordered.is_round_robin  # nothing left to undo
    module = index.ranks[0].module_order
    assert listed == [sorted(names, key=module.index) for names in saved] != saved  # the model's order, undone
    for target, ranks in ((Target(world_size=3, tp=1), 3), (Target(world_size=2, tp=1, stage=1), 2)):
        plan = plan_reshard(index, target)
        assert [[n for n, _ in g] for g in plan.flat_shapes] == [deepspeed_round_robin(n, ranks) for n in listed]
    assert [[n for n, _ in g] for g in plan_reshard(index, Target(world_size=2, tp=1, stage=3)).flat_shapes] == listed


def test_a_round_robin_source_split_again_is_laid_out_round_robin(both_fixtures: Mapping[str, ParallelFixture]) -> None:
    """The same source split to tp4 (the plan only: its toy's 2 key/value heads do not split four ways, so
    the config given claims 4): each target tensor-parallel rank's groups are the optimizer's list
    flattened over the target's data-parallel ranks as DeepSpeed's `_round_robin_reorder` does (ZeRO-1/2),
    or that list (ZeRO-3)."""
    index = load_index(str(both_fixtures[RR].dir))
    listed = [deepspeed_undone(g.params, 2) for g in index.ranks[0].groups]
    for dp, stage in ((2, None), (3, 1), (2, 3)):
        plan = plan_tensor_parallel_split(index, dp, 4, stage=stage, config={"num_key_value_heads": 4})
        # The split renames nothing: each rank's groups list the same parameters, shards of them.
        expected = listed if stage == 3 else [deepspeed_round_robin(names, dp) for names in listed]
        assert [[[n for n, _ in g] for g in part.flat_shapes] for part in plan.parts] == [expected] * 4, (dp, stage)


def _round_robin_config(index: Any) -> Any:
    """`index` as if its recorded config set round_robin_gradients."""
    def with_it(state: Mapping[str, Any]) -> dict[str, Any]:
        config = dict(state["ds_config"])
        return {**state, "ds_config": {**config, "zero_optimization": {**config["zero_optimization"],
                                                                       "round_robin_gradients": True}}}

    return dataclasses.replace(index, ranks=tuple(dataclasses.replace(r, model_states=tuple(map(with_it, r.model_states)))
                                                  for r in index.ranks))


def test_a_zero3_source_that_ignored_round_robin_is_flattened_round_robin_at_zero2(
        parallel_fixtures: Mapping[str, ParallelFixture]) -> None:
    """A ZeRO-3 AutoTP run whose config sets round_robin_gradients (ZeRO-3 ignores it: its files are in the
    optimizer's order): merged to tp1 at ZeRO-3 the plan is the one without the setting; at ZeRO-2 over
    3 ranks, whose DeepSpeedZeroOptimizer honours it, each group is that plan's flattened round-robin."""
    plain = load_index(str(parallel_fixtures["autotp-tp2-z3-fp32"].dir))
    index = _round_robin_config(plain)
    assert not index.ranks[0].is_round_robin and index.ranks[0].flattens_round_robin(ZERO)

    def names(i: Any, target: Target) -> list[list[str]]:
        return [[n for n, _ in g] for g in plan_reshard(i, target).flat_shapes]

    assert names(index, Target(world_size=2, tp=1)) == names(plain, Target(world_size=2, tp=1))
    target = Target(world_size=3, tp=1, stage=2)
    assert names(index, target) == [deepspeed_round_robin(g, 3) for g in names(plain, target)] != names(plain, target)

