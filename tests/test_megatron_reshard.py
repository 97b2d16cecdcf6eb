"""Megatron-style checkpoints at another tensor-parallel degree (issue 24), checked against DeepSpeed itself.

A PipelineModule whose layers split their parameters over a tensor-parallel group records how only in
the client's `universal_checkpoint_info`. ckptflow merges the shards as `ds_to_universal` does and cuts
the target's as `load_hp_checkpoint_state` does at the new degree, and writes the target's own files:

- DeepSpeed builds the same model at the target degree (`writers.parallel`'s Megatron job at tp T'),
  loads OUT natively (`engine.load_checkpoint`, no universal flag), and holds the source's fp32 weights
  and Adam moments of every parameter bit for bit (`oracles.parallel_reshard`); saved again, it writes
  exactly ckptflow's files (layer files included); `ds_to_universal` of that save equals
  `ds_to_universal` of the source in every fp32 weight, moment and step;
- a merge and a split back give the source again, but for the vocabulary's padding rows, which hold
  zeros as the universal route pads them;
- what the recorded rules do not split at the target degree is refused, naming the parameter.

The default run makes one 2-rank launch (tp2 x dp2 -> tp1 x dp2); the long mode adds the pipelines
(pp2 x tp2 -> pp2 x tp1, fused SwiGLU halves among them) in the same launch, and a split (tp1 -> tp2,
from ckptflow's own merge) in a second one.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from ckptflow.errors import CheckpointError, UnsupportedCheckpointError
from ckptflow.formats.deepspeed import load_index
from ckptflow.formats.deepspeed.names import UC_INFO
from ckptflow.formats.deepspeed.runs import plain_runs
from ckptflow.reshard import reshard, shapes_at
from ckptflow.reshard.megatron import plan_megatron_stages, plan_megatron_tensor_parallel
from ckptflow.reshard.shape import Shape
from ckptflow.reshard.vocabulary import padded_vocab_size
from tests.fixtures.models.parallel import VOCAB as VOCAB_ROWS
from tests.fixtures.models.parallel_extra import padded_vocab
from tests.fixtures.sets import ParallelFixture
from tests.sampling import sample
from tests.test_model_parallel_reshard import (
    case_id,
    check_loaded_state,
    check_same_files,
    check_validates,
    run_reshard_oracle,
)
from tests.test_reshard import _load_plain, _universal, _universal_tensor

ARGS = "megatron-args-tp2dp2-z1-fp32"  # pp1 x tp2 x dp2, Megatron-DeepSpeed's whole client state
# The same, its vocabulary padded as Megatron pads it (make_vocab_size_divisible_by 2: 40 rows at tp2, 38 at tp1)
VOCAB = "megatron-vocab-tp2dp2-z1-fp32"
PIPE = "megatron-pp2tp2-z1-fp32-ucinfo"
SWIGLU = "megatron-swiglu-pp2tp2-z1-fp32"  # fc1: two sub-parameters concatenated on dim 0

# (fixture, dp, tp): every one a 2-rank launch at tp1.
ALL_MERGES = ((ARGS, 2, 1), (VOCAB, 2, 1), (PIPE, 1, 1), (SWIGLU, 1, 1))
MERGES = sample(ALL_MERGES, [(ARGS, 2, 1), (VOCAB, 2, 1)])
# (fixture, dp, tp) from ckptflow's merge of the fixture to tp1 x dp2: back to tp2 at dp1.
ALL_SPLITS = ((ARGS, 1, 2), (VOCAB, 1, 2))
SPLITS = sample(ALL_SPLITS, [])


@pytest.fixture(scope="session")
def megatron_fixtures(parallel_fixtures: Mapping[str, ParallelFixture],
                      parallel_extra_fixtures: Mapping[str, ParallelFixture]) -> Mapping[str, ParallelFixture]:
    return {name: {**parallel_fixtures, **parallel_extra_fixtures}[name] for name in (ARGS, VOCAB, PIPE, SWIGLU)}


@pytest.fixture(scope="session")
def merge_oracle(megatron_fixtures: Mapping[str, ParallelFixture], tmp_path_factory: pytest.TempPathFactory
                 ) -> dict[str, Any]:
    return run_reshard_oracle(megatron_fixtures, MERGES, (), tmp_path_factory.mktemp("megatron-merge-oracle"))


@pytest.fixture(scope="session")
def merged_fixtures(megatron_fixtures: Mapping[str, ParallelFixture], tmp_path_factory: pytest.TempPathFactory
                    ) -> Mapping[str, ParallelFixture]:
    """Each split's source: ckptflow's merge of the fixture to tp1 x dp2, with the fixture's oracles (the
    same training state) and spec (the client state it carries)."""
    out = {}
    for name in sorted({case[0] for case in SPLITS}):
        fixture = megatron_fixtures[name]
        root = tmp_path_factory.mktemp(f"merged-{name}")
        reshard(str(fixture.dir), str(root / "ckpt"), world_size=2, tp=1, workers=2)
        for oracle in (fixture.expected_path, fixture.buffers_path):
            shutil.copy(oracle, root / oracle.name)
        out[name] = ParallelFixture(name=name, root=root, spec=fixture.spec)
    return out


@pytest.fixture(scope="session")
def split_oracle(merged_fixtures: Mapping[str, ParallelFixture], tmp_path_factory: pytest.TempPathFactory
                 ) -> dict[str, Any]:
    return run_reshard_oracle(merged_fixtures, SPLITS, (), tmp_path_factory.mktemp("megatron-split-oracle"))


def check_target(oracle: Mapping[str, Any], case: tuple, fixture: ParallelFixture, source: ParallelFixture,
                 scratch: Path) -> None:
    """DeepSpeed at the target loaded the reshard of `fixture` holding the training state, saved exactly
    ckptflow's files, and `ds_to_universal` of that save equals that of the DeepSpeed-written `source`:
    every parameter's fp32 weight, Adam moments and step, with the converter's own metadata (cat_dim,
    vocab_tensor). (Its `optimizer_state.pt` records the data-parallel size, which a split changes.)"""
    check_loaded_state(oracle, case, fixture)
    assert json.loads(oracle["results"][case].read_text())["client_state_differ"] == []
    check_same_files(oracle, case)
    check_validates(oracle, case, fixture)
    check_same_universal(source, oracle["resaved"][case], scratch)


def check_same_universal(source: ParallelFixture, resaved: Path, scratch: Path) -> None:
    """`ds_to_universal` of `resaved` equals that of `source` in every parameter's fp32 weight, Adam moments
    and step, with the converter's own metadata."""
    cache: dict[Path, Path] = {}
    ours = _universal(source.dir, cache, scratch) / "zero"
    theirs = _universal(resaved, cache, scratch) / "zero"
    files = {f"{name}/{state}.pt" for name in source.spec["params"] for state in ("fp32", "exp_avg", "exp_avg_sq",
                                                                                   "step")}
    held = {str(p.relative_to(ours)) for p in ours.rglob("*.pt")}
    assert held == {str(p.relative_to(theirs)) for p in theirs.rglob("*.pt")}
    assert files <= held
    for name in sorted(files):
        assert _universal_tensor(_load_plain(ours / name)) == _universal_tensor(_load_plain(theirs / name)), name


def vocabulary_tensors(out: Path, tp: int) -> dict[str, torch.Tensor]:
    """The vocabulary parameters of `out` (the test's own output: torch.load is safe on it), padding included,
    their tensor-parallel shards joined on dim 0: from the layer files ("layer/0.weight"), and the fp32 masters
    and Adam moments from the optimizer files, each data-parallel rank's fragments in rank order
    ("fp32/0.weight", "exp_avg/0.weight", "exp_avg_sq/0.weight")."""
    tag = (out / "latest").read_text().strip()
    shards: dict[str, list[list[torch.Tensor]]] = {}
    for t in range(tp):
        for layer in (0, 5):
            weight = torch.load(out / tag / f"layer_{layer:02d}-model_{t:02d}-model_states.pt")["weight"]
            shards.setdefault(f"layer/{layer}.weight", []).append([weight.reshape(-1)])
        for path in sorted((out / tag).glob(f"zero_pp_rank_*_mp_rank_{t:02d}_optim_states.pt"),
                           key=lambda p: int(p.name.split("_")[3])):
            state = torch.load(path, weights_only=False)["optimizer_state_dict"]
            for g, mapping in enumerate(state["param_slice_mappings"]):
                flats = {"fp32": state["single_partition_of_fp32_groups"][g],
                         **{k: state["base_optimizer_state"]["state"][g][k] for k in ("exp_avg", "exp_avg_sq")}}
                for name in ("0.weight", "5.weight"):
                    if name in mapping:
                        for key, flat in flats.items():
                            pieces = shards.setdefault(f"{key}/{name}", [])
                            pieces.extend([] for _ in range(t + 1 - len(pieces)))
                            pieces[t].append(flat.narrow(0, mapping[name].start, mapping[name].numel))
    return {key: torch.cat([torch.cat(shard).view(-1, 16) for shard in shards[key]]) for key in sorted(shards)}


def check_padded(out: Path, tp: int, fixture: ParallelFixture) -> None:
    """`out` at degree `tp` holds the vocabulary parameters at Megatron's padded rows there, in its layer files,
    masters and moments: the original rows the source's, the padding rows zeros."""
    expected = load_file(fixture.expected_path)
    tag = (out / "latest").read_text().strip()
    head = torch.load(out / tag / "mp_rank_00_model_states.pt", weights_only=False)
    assert (head["args"].padded_vocab_size, head[UC_INFO]["padded_vocab_size"]) == (padded_vocab(tp),) * 2
    tensors = vocabulary_tensors(out, tp)
    assert sorted(tensors) == sorted(f"{k}/{n}" for k in ("layer", "fp32", "exp_avg", "exp_avg_sq")
                                     for n in ("0.weight", "5.weight"))
    for key, tensor in tensors.items():
        assert tensor.shape == (padded_vocab(tp), 16), key
        assert not tensor[VOCAB_ROWS:].any(), key
        assert torch.equal(tensor[:VOCAB_ROWS], expected[key.replace("layer/", "fp32/")]), key


@pytest.mark.parametrize("case", MERGES, ids=case_id)
def test_deepspeed_loads_a_merge_at_tp1(merge_oracle: dict[str, Any], case: tuple,
                                        megatron_fixtures: Mapping[str, ParallelFixture],
                                        tmp_path_factory: pytest.TempPathFactory) -> None:
    """(With the vocabulary padded as Megatron pads it: DeepSpeed's model at tp1 has 38 rows, not the source's
    40, and loads OUT.)"""
    fixture = megatron_fixtures[case[0]]
    check_target(merge_oracle, case, fixture, fixture, tmp_path_factory.mktemp("universal"))
    if case[0] == VOCAB:
        check_padded(merge_oracle["outs"][case], 1, fixture)


@pytest.mark.parametrize("case", SPLITS, ids=case_id)
def test_deepspeed_loads_a_split_at_tp2(split_oracle: dict[str, Any], case: tuple,
                                        merged_fixtures: Mapping[str, ParallelFixture],
                                        megatron_fixtures: Mapping[str, ParallelFixture],
                                        tmp_path_factory: pytest.TempPathFactory) -> None:
    check_target(split_oracle, case, merged_fixtures[case[0]], megatron_fixtures[case[0]],
                 tmp_path_factory.mktemp("universal"))
    if case[0] == VOCAB:
        check_padded(split_oracle["outs"][case], 2, megatron_fixtures[VOCAB])


# ---- without DeepSpeed ---------------------------------------------------------------------------------


def _differences(ours: Any, theirs: Any, path: str, out: dict[str, int]) -> None:
    """Every tensor of `ours` that differs from `theirs`: path -> elements that differ, each of them 0 in ours
    (a vocabulary padding row); anything else must be equal."""
    if isinstance(ours, torch.Tensor):
        assert ours.shape == theirs.shape and ours.dtype == theirs.dtype, path
        differ = ours != theirs
        if differ.any():
            assert not ours[differ].any(), f"{path}: differs where ckptflow does not write zeros"
            out[path] = int(differ.sum())
    elif isinstance(ours, Mapping):
        assert list(ours) == list(theirs), path
        for key in ours:
            _differences(ours[key], theirs[key], f"{path}/{key}", out)
    elif isinstance(ours, (list, tuple)):
        assert len(ours) == len(theirs), path
        for i, (a, b) in enumerate(zip(ours, theirs)):
            _differences(a, b, f"{path}/{i}", out)
    elif isinstance(ours, np.ndarray):
        assert np.array_equal(ours, theirs), path
    elif hasattr(ours, "__dict__") and not isinstance(ours, type):  # DeepSpeed's loss scaler, argparse's Namespace
        assert type(ours) is type(theirs) and vars(ours) == vars(theirs), path
    else:
        assert ours == theirs, path


@pytest.mark.parametrize(("name", "padding"), [(ARGS, 1), (SWIGLU, 1), (VOCAB, 3)])
def test_a_merge_and_a_split_give_the_source_back(name: str, padding: int,
                                                  megatron_fixtures: Mapping[str, ParallelFixture],
                                                  tmp_path: Path) -> None:
    """tp2 -> tp1 -> tp2 writes the source's files again, every field and tensor, but for the vocabulary's
    `padding` rows (per vocabulary-parallel parameter, on the last rank), which the universal route pads with
    zeros (`load_hp_checkpoint_state`): in the layer files and in the fp32 masters; the moments are zero there
    in the source too. Padded as Megatron pads it (40 rows at tp2, 38 at tp1), `args` says 40 again."""
    fixture = megatron_fixtures[name]
    spec = fixture.parallel_spec
    reshard(str(fixture.dir), str(tmp_path / "tp1"), world_size=spec.world_size // spec.tp, tp=1, workers=2)
    reshard(str(tmp_path / "tp1"), str(tmp_path / "tp2"), world_size=spec.world_size, tp=2, workers=2)
    tag = (fixture.dir / "latest").read_text().strip()
    source, again = fixture.dir / tag, tmp_path / "tp2" / tag
    assert sorted(p.name for p in again.iterdir()) == sorted(p.name for p in source.iterdir() if p.suffix == ".pt")
    differ: dict[str, int] = {}
    for path in sorted(again.iterdir()):
        _differences(torch.load(path, weights_only=False), torch.load(source / path.name, weights_only=False),
                     path.name, differ)
    hidden = 16
    layers = {p: n for p, n in differ.items() if p.startswith("layer_")}
    assert layers == {"layer_00-model_01-model_states.pt/weight": padding * hidden,
                      "layer_05-model_01-model_states.pt/weight": padding * hidden}
    masters = {p: n for p, n in differ.items() if not p.startswith("layer_")}
    last = [f"mp_rank_{stage * 2 + 1:02d}" for stage in range(spec.pp)]  # each stage's last tensor-parallel rank
    assert all("single_partition_of_fp32_groups" in p and any(m in p for m in last) for p in masters), masters
    assert sum(masters.values()) == 2 * padding * hidden


def _plan(src: Path, tp: int, damage: Any) -> Any:
    index = load_index(str(src))
    head = index.ranks[0].model_states[0]
    head[UC_INFO] = copy.deepcopy(head[UC_INFO])  # this index's own copy, damaged
    damage(head[UC_INFO])
    return plan_megatron_tensor_parallel(index, Shape(world_size=2 * tp, stage=1, tp=tp))


def _averaged(info: dict[str, Any]) -> None:
    info["parameter_to_average_patterns"] = [r"\d+\.fc1\.bias"]


def _sub_params(info: dict[str, Any]) -> None:
    info["parameter_with_sub_params"] = [{"patterns": [r"\d+\.fc1\.weight"], "shape": [[8, 8], 16],
                                          "partition_dim": 0}]
    info["sub_param_shard_widths"] = {r"\d+\.fc1\.weight": [[8, 8], [8, 8]]}


def test_a_parameter_the_rules_do_not_split_is_refused(megatron_fixtures: Mapping[str, ParallelFixture],
                                                       tmp_path: Path) -> None:
    """The planner itself, on a recorded `universal_checkpoint_info` changed in memory: an averaged parameter
    (which `ds_to_universal` averages) at any degree; fused sub-parameters merged to tp1, but not split again
    from there, their widths at tp2 being nowhere."""
    fixture = megatron_fixtures[ARGS]
    with pytest.raises(UnsupportedCheckpointError) as refused:
        _plan(fixture.dir, 1, _averaged)
    assert str(refused.value) == (
        f"{fixture.dir}/global_step3: 1.fc1.bias does not split at tensor-parallel degree 1: the checkpoint records it "
        "as averaged over the tensor-parallel ranks; ckptflow copies bytes and does not average: convert it with "
        "deepspeed.checkpoint.ds_to_universal")
    merged = _plan(fixture.dir, 1, _sub_params)
    assert merged.parts[0].flat_shapes[0][1] == ("1.fc1.weight", (32, 16))
    reshard(str(fixture.dir), str(tmp_path / "tp1"), world_size=2, tp=1, workers=2)
    with pytest.raises(UnsupportedCheckpointError) as refused:
        _plan(tmp_path / "tp1", 2, _sub_params)
    assert str(refused.value) == (
        f"{tmp_path}/tp1/global_step3: 1.fc1.weight does not split at tensor-parallel degree 2: it is recorded as "
        "fused sub-parameters (parameter_with_sub_params), whose shard widths at that degree the checkpoint does not "
        "record; ckptflow does not guess them")


def test_a_fused_attention_projection_is_refused_at_another_degree(
        megatron_fixtures: Mapping[str, ParallelFixture]) -> None:
    """Megatron's `query_key_value` (renamed so in memory): its rows' layout per tensor-parallel rank changed in
    Megatron-DeepSpeed in December 2024 and no file says which a checkpoint holds, so a tp change is refused
    (the planner and `--plan`); the same degree is still offered. `tests/test_megatron_deepspeed.py` shows a
    merge rank after rank loads in Megatron-DeepSpeed and computes other logits."""
    fixture = megatron_fixtures[ARGS]
    index = _fused(load_index(str(fixture.dir)))
    with pytest.raises(UnsupportedCheckpointError) as refused:
        plan_megatron_tensor_parallel(index, Shape(world_size=2, stage=1, tp=1))
    assert str(refused.value) == (
        f"{fixture.dir}/global_step3: 1.self_attention.query_key_value.weight is Megatron's fused attention "
        "projection, whose rows each tensor-parallel rank holds as [q | k | v] of its own heads in Megatron-DeepSpeed "
        "since December 2024 and key/value group by group before; the checkpoint does not record which, and joined "
        "or cut the wrong way the model loads and computes something else; keep the tensor-parallel degree (2; "
        "leave `tp` out), or declare the layout the checkpoint's Megatron-DeepSpeed wrote with `qkv_layout` (blocks "
        "since December 2024, groups before)")
    assert refused.value.tensor == "1.self_attention.query_key_value.weight"
    reasons = {str(s): why for s, why in shapes_at(index, 4)}
    assert reasons["ZeRO-1 dp4 (4 ranks)"].startswith("1.self_attention.query_key_value.weight is Megatron's")
    assert reasons["ZeRO-1 dp4 (4 ranks)"].endswith("declare the layout the checkpoint's Megatron-DeepSpeed wrote "
                                                    "with `qkv_layout` (blocks since December 2024, groups before)")
    assert reasons["ZeRO-1 tp2 x dp2 (4 ranks)"] is None


def test_one_listing_splits_each_tensor_parallel_degree_once(megatron_fixtures: Mapping[str, ParallelFixture]) -> None:
    """`reshard --plan` asks every shape at a tensor-parallel degree for that degree's splits: one listing keeps them
    (`shape.tensor_splits`), once per other degree it asks, and `plan.why_not_stages` reads them there; each shape's
    reason is the one it gets asked alone."""
    from ckptflow.reshard.plan import why_not_stages
    from ckptflow.reshard.shape import SplitsByDegree

    index = load_index(str(megatron_fixtures[PIPE].dir))
    known: SplitsByDegree = {}
    listed = shapes_at(index, 8, splits=known)
    assert listed == shapes_at(index, 8)
    assert set(known) == {s.tp for s, _ in listed if s.tp != index.tp} == {1, 4, 8}
    kept = dict(known)
    staged = [s for s, why in listed if why is None and s.pp not in (1, index.pp)]
    assert {s.tp for s in staged} - {index.tp}, listed  # some shape reads a listed degree's splits
    for shape in staged:
        assert why_not_stages(index, shape, splits=known) == why_not_stages(index, shape), shape
    assert all(known[tp] is kept[tp] for tp in kept) and known.keys() == kept.keys()


def test_a_fused_attention_projection_in_a_declared_layout(megatron_fixtures: Mapping[str, ParallelFixture]) -> None:
    """Declared (`qkv_layout`), the fused projection is joined in that layout from the heads the run's `args`
    record, the fp32 masters and Adam moments by the same row runs as the weight (`tests/test_megatron_qkv.py`
    checks the runs, `tests/test_megatron_deepspeed.py` the "blocks" layout against Megatron-DeepSpeed); without
    heads in its `args` it is refused, naming it."""
    fixture = megatron_fixtures[ARGS]
    index = _fused(load_index(str(fixture.dir)))
    _args(index, num_attention_heads=None)
    with pytest.raises(UnsupportedCheckpointError) as refused:
        plan_megatron_tensor_parallel(index, Shape(world_size=2, stage=1, tp=1), "blocks")
    assert str(refused.value) == (
        f"{fixture.dir}/global_step3: 1.self_attention.query_key_value.weight cannot be joined and cut in the blocks "
        "layout: the checkpoint's args record no num_attention_heads, so its rows cannot be told apart by head")
    reasons = {str(s): why for s, why in shapes_at(index, 4, qkv_layout="groups")}
    assert reasons["ZeRO-1 dp4 (4 ranks)"] == str(refused.value).split(": ", 1)[1].replace("blocks", "groups")
    _args(index, num_attention_heads=4, num_key_value_heads=2, kv_channels=4)  # fc1: 32 rows, 16 a rank
    assert {str(s): why for s, why in shapes_at(index, 4, qkv_layout="groups")}["ZeRO-1 dp4 (4 ranks)"] is None
    target = Shape(world_size=2, stage=1, tp=1)
    plans = {layout: plan_megatron_tensor_parallel(index, target, layout) for layout in ("blocks", "groups")}
    plain = plan_megatron_tensor_parallel(load_index(str(fixture.dir)), target)  # fc1: joined rank after rank
    copies = {layout: _copies(plan) for layout, plan in plans.items()}
    assert copies["groups"] == _copies(plain)  # "groups" at tp1: the ranks one after the other
    assert copies["blocks"] != copies["groups"]  # the same elements, in another order
    assert _elements(copies["blocks"]) == _elements(copies["groups"])
    files = {layout: _file_runs(plan) for layout, plan in plans.items()}
    assert files["blocks"] != files["groups"] and files["groups"] == _file_runs(plain)
    staged = Shape(world_size=2, stage=1, tp=1, pp=2)  # with another number of stages: the same splits
    with pytest.raises(UnsupportedCheckpointError, match="query_key_value.weight is Megatron's fused attention"):
        plan_megatron_stages(index, staged)
    stages = {layout: _copies(plan_megatron_stages(index, staged, qkv_layout=layout)) for layout in ("blocks", "groups")}
    assert stages["blocks"] != stages["groups"] and _elements(stages["blocks"]) == _elements(stages["groups"])


def _fused(index: Any) -> Any:
    """`index` with its `fc1` named as Megatron's fused `query_key_value` (in memory: its own copy)."""
    def name(text: str) -> str:
        return text.replace("fc1", "self_attention.query_key_value")

    for rank in index.ranks:
        object.__setattr__(rank, "params", tuple(dataclasses.replace(p, name=name(p.name)) for p in rank.params))
        object.__setattr__(rank, "groups", tuple(dataclasses.replace(g, params=tuple(map(name, g.params)))
                                                 for g in rank.groups))
    object.__setattr__(index, "tensors", tuple(dataclasses.replace(t, name=name(t.name)) for t in index.tensors))
    object.__setattr__(index, "layers", {key: {name(k): v for k, v in content.items()}
                                         for key, content in index.layers.items()})
    return index


def _copies(plan: Any) -> list[Any]:
    """Every copy of the plan's flats (the fp32 masters and each Adam moment copied by them alike)."""
    return [(unit.rank, flat.group, copy) for part in plan.parts for unit in part.units for flat in unit.flats
            for copy in flat.copies]


def _file_runs(plan: Any) -> list[Any]:
    """Every layer file's tensors' shapes and runs, their names left out."""
    return [(f.name, [(shape, runs) for _, shape, runs in f.tensors])
            for part in plan.parts for unit in part.units for f in unit.tensor_files]


def _elements(copies: list[Any]) -> set[tuple[int, ...]]:
    """The source elements the target's flats copy (a copy's are contiguous in the source's, rows or not)."""
    return {(copy.src_rank, copy.src_flat, copy.src_offset + i) for _, _, copy in copies for i in range(copy.numel)}


def _divisible_by(index: Any, divisor: int) -> Any:
    """`index` whose `args` record `make_vocab_size_divisible_by` `divisor` (in memory: this index's own copy)."""
    return _args(index, make_vocab_size_divisible_by=divisor)


def _args(index: Any, **fields: Any) -> Any:
    """`index` whose `args` record `fields` (in memory: this index's own copy)."""
    head = index.ranks[0].model_states[0]
    args = head["args"]
    last = max(i for i, (kind, _) in enumerate(args.ops) if kind == "build")
    state = {**args.state, **fields}
    head["args"] = dataclasses.replace(args, ops=tuple(("build", state) if i == last else op
                                                       for i, op in enumerate(args.ops)))
    return index


def test_the_vocabulary_is_padded_as_megatron_pads_it() -> None:
    """Megatron-DeepSpeed's `_vocab_size_with_padding`: GPT-2's 50257 rows are 50304 at tp1, 50432 at tp2."""
    assert [padded_vocab_size(50257, 128, tp) for tp in (1, 2, 4, 8)] == [50304, 50432, 50688, 51200]
    assert [padded_vocab_size(37, 2, tp) for tp in (1, 2, 4)] == [padded_vocab(tp) for tp in (1, 2, 4)] == [38, 40, 40]
    assert padded_vocab_size(40, 2, 2) == 40 and padded_vocab_size(37, 1, 1) == 37


def test_the_target_pads_the_vocabulary_by_the_args_rule(megatron_fixtures: Mapping[str, ParallelFixture]) -> None:
    """The planner on a recorded `args` changed in memory: 38 rows at tp2 are Megatron's padding of 37 with
    `make_vocab_size_divisible_by` 1, so at tp1 the vocabulary has its 37 rows and at tp4 40 (10 per rank), a
    degree the source's 38 rows do not split into; without the field, the source's 38 rows, and a note."""
    fixture = megatron_fixtures[ARGS]
    index = _divisible_by(load_index(str(fixture.dir)), 1)
    merged = plan_megatron_tensor_parallel(index, Shape(world_size=2, stage=1, tp=1))
    assert (merged.padded_vocab, merged.notes) == (37, ())
    assert ("0.weight", (37, 16)) in merged.parts[0].flat_shapes[0]
    split = plan_megatron_tensor_parallel(index, Shape(world_size=4, stage=1, tp=4))
    assert split.padded_vocab == 40
    assert [dict(part.flat_shapes[0]).get("0.weight") for part in split.parts] == [(10, 16)] * 4
    assert [str(s) for s, reason in shapes_at(index, 4) if reason is None and s.pp == 1] == [
        "ZeRO-1 dp4 (4 ranks)", "ZeRO-1 tp2 x dp2 (4 ranks)", "ZeRO-1 tp4 x dp1 (4 ranks)"]
    kept = plan_megatron_tensor_parallel(load_index(str(fixture.dir)), Shape(world_size=2, stage=1, tp=1))
    assert kept.padded_vocab is None
    assert ("0.weight", (38, 16)) in kept.parts[0].flat_shapes[0]
    assert kept.notes == (
        "the vocabulary parameters keep the source's 38 padded rows at tensor-parallel degree 1: the checkpoint's "
        "args record no make_vocab_size_divisible_by, so ckptflow does not pad them as Megatron would at that "
        "degree; build the model at the target with that padded vocabulary size",)
    assert plan_megatron_tensor_parallel(load_index(str(megatron_fixtures[VOCAB].dir)),
                                         Shape(world_size=2, stage=1, tp=1)).notes == ()


def test_reshard_says_the_padded_vocabulary_is_kept(megatron_fixtures: Mapping[str, ParallelFixture],
                                                     tmp_path: Path) -> None:
    """Without `make_vocab_size_divisible_by`, `ckptflow reshard` says in a note that the target keeps the source's
    padded rows; padded again, it says nothing of them."""
    from typer.testing import CliRunner

    from ckptflow.cli import app

    def run(name: str, out: str) -> str:
        result = CliRunner().invoke(app, ["reshard", str(megatron_fixtures[name].dir), str(tmp_path / out),
                                          "--world-size", "2", "--tp", "1"], env={"COLUMNS": "400", "NO_COLOR": "1"})
        assert result.exit_code == 0, result.output
        return " ".join(result.output.split())

    assert ("note: the vocabulary parameters keep the source's 38 padded rows at tensor-parallel degree 1: the "
            "checkpoint's args record no make_vocab_size_divisible_by") in run(ARGS, "kept")
    assert "note:" not in run(VOCAB, "padded")


def test_a_padding_the_rule_does_not_give_is_refused(megatron_fixtures: Mapping[str, ParallelFixture]) -> None:
    """38 rows at tp2 are not Megatron's padding with `make_vocab_size_divisible_by` 2 (40): refused, naming the
    numbers, and `--plan` says why for every other degree; a divisor of 0 pads nothing."""
    fixture = megatron_fixtures[ARGS]
    index = _divisible_by(load_index(str(fixture.dir)), 2)
    with pytest.raises(UnsupportedCheckpointError) as refused:
        plan_megatron_tensor_parallel(index, Shape(world_size=2, stage=1, tp=1))
    why = ("0.weight has 38 rows, but Megatron pads its vocabulary of 37 rows (original_vocab_size) to 40 at "
           "tensor-parallel degree 2 (make_vocab_size_divisible_by 2 in its args); ckptflow does not know the rule "
           "that padded it, so it does not pad it at another degree")
    assert str(refused.value) == f"{fixture.dir}/global_step3: {why}"
    assert refused.value.tensor == "0.weight"
    assert [reason for s, reason in shapes_at(index, 2) if s.tp == 1 and s.pp == 1] == [why]
    with pytest.raises(UnsupportedCheckpointError) as refused:
        plan_megatron_tensor_parallel(_divisible_by(load_index(str(fixture.dir)), 0),
                                      Shape(world_size=2, stage=1, tp=1))
    assert str(refused.value) == (f"{fixture.dir}/global_step3: its args record make_vocab_size_divisible_by 0, "
                                  "which pads no vocabulary")


def test_shapes_the_rules_do_not_reach_are_refused_in_one_line(megatron_fixtures: Mapping[str, ParallelFixture],
                                                               tmp_path: Path) -> None:
    fixture = megatron_fixtures[ARGS]
    with pytest.raises(UnsupportedCheckpointError) as refused:
        reshard(str(fixture.dir), str(tmp_path / "out"), world_size=4, tp=4)
    assert str(refused.value) == (
        f"cannot reshard {fixture.dir}/global_step3 (ZeRO-1 tp2 x dp2 (4 ranks)) to 4 ranks, tp4: 0.weight does not "
        "split at tensor-parallel degree 4: the padded vocabulary's 38 rows do not split into 4 equal blocks; shapes "
        "it can write at 4 ranks: ZeRO-1 dp4 (4 ranks), ZeRO-1 pp2 x dp2 (4 ranks), ZeRO-1 pp4 x dp1 (4 ranks), "
        "ZeRO-1 tp2 x dp2 (4 ranks), ZeRO-1 pp2 x tp2 x dp1 (4 ranks)")
    assert not (tmp_path / "out").exists()


def test_replicated_copies_that_differ_are_refused(megatron_fixtures: Mapping[str, ParallelFixture],
                                                   tmp_path: Path) -> None:
    """A replicated parameter is taken once, as `ds_to_universal` takes it, and like it ckptflow refuses a
    source whose tensor-parallel ranks hold different values for it."""
    src = tmp_path / "src"
    shutil.copytree(megatron_fixtures[ARGS].dir, src)
    index = load_index(str(src))
    replica = next(r for r in index.replicas if r.name == "1.norm.weight")
    run = plain_runs(replica.other)[0]
    start, _ = run.ref.element_range(run.start, 1)
    path = Path(run.ref.uri)
    data = bytearray(path.read_bytes())
    data[start:start + 4] = torch.tensor([1234.5]).numpy().tobytes()
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as refused:
        reshard(str(src), str(tmp_path / "out"), world_size=2, tp=1)
    assert str(refused.value).startswith(
        f"refusing to reshard {src}: tensor 1.norm.weight: tensor-parallel rank 0 of 2 and tensor-parallel rank 1 of 2 "
        "hold different values for the same block")
    assert not (tmp_path / "out").exists()
    reshard(str(src), str(tmp_path / "same"), world_size=2)  # the data-parallel reshard copies both as they are


def test_the_plan_lists_the_degrees_the_rules_split(megatron_fixtures: Mapping[str, ParallelFixture]) -> None:
    index = load_index(str(megatron_fixtures[ARGS].dir))
    assert [(str(s), reason) for s, reason in shapes_at(index, 4) if s.pp == 1] == [
        ("ZeRO-1 dp4 (4 ranks)", None), ("ZeRO-1 tp2 x dp2 (4 ranks)", None),
        ("ZeRO-1 tp4 x dp1 (4 ranks)", "0.weight does not split at tensor-parallel degree 4: the padded vocabulary's "
                                       "38 rows do not split into 4 equal blocks")]
    result = json.dumps([str(s) for s, reason in shapes_at(load_index(str(megatron_fixtures[PIPE].dir)), 2)
                         if reason is None])
    assert result == '["ZeRO-1 dp2 (2 ranks)", "ZeRO-1 pp2 x dp1 (2 ranks)", "ZeRO-1 tp2 x dp1 (2 ranks)"]'
