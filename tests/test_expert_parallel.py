"""AutoEP and deepspeed.moe checkpoints (issue 11, expert-parallel half): the right diagnosis, the model's
own tensors, and a data-parallel reshard DeepSpeed loads natively, each checked against DeepSpeed.

Oracles, none of them ckptflow (`tests/fixtures/PARALLEL_LAYOUTS.md`):

- consolidate: the fp32 output equals, bit for bit, the full weights the writer gathered from the live
  engine (`expected.safetensors`); Hugging Face models load with `from_pretrained` with no missing,
  unexpected or mismatched keys and give the logits the writer recorded; bf16/fp16 are its casts;
- validate: every fixture is valid and named with its degrees; damaged copies get a message that names
  the file, rank or expert and the layout, never the wrong diagnosis issue 11 reported ("damaged or
  from another model", ranks missing that are not);
- reshard: DeepSpeed, launched at the new world size, loads the reshard with `engine.load_checkpoint`
  (no universal flag), the state it then holds equals the oracle bit for bit, and what it saves again
  equals our files field for field and byte for byte; our files' metadata is what DeepSpeed writes
  when it trains at that size (the matrix's other-size fixtures); deepspeed.moe ZeRO-0 is loaded as it
  is at another size.

Every test runs on the matrix's expert-parallel fixtures and on the held-out ones
(`tests/fixtures/specs/expert_holdout.py`).
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from ckptflow.consolidate import ConsolidateOptions, consolidate
from ckptflow.errors import UnsupportedCheckpointError
from ckptflow.formats.deepspeed import inspect, load_index
from ckptflow.formats.deepspeed.names import ALLOWED
from ckptflow.formats.deepspeed.partition import BF16
from ckptflow.formats.torch.tensorref import TensorRef
from ckptflow.formats.torch.unpickler import PickledObject
from ckptflow.formats.torch.zipdir import open_archive
from ckptflow.reshard import plan_reshard, reshard
from ckptflow.reshard.shape import Target
from ckptflow.validate import validate
from tests.fixtures.replay import launch
from tests.fixtures.sets import SETS, ParallelFixture, build_bf16_optimizer
from tests.fixtures.specs.bf16_experts import BF16_EXPERTS_MATRIX, BF16_EXPERTS_SPECS
from tests.fixtures.specs.bf16_optimizer import BF16_MATRIX, BF16_SPECS
from tests.fixtures.specs.expert_holdout import HOLDOUT_MATRIX
from tests.fixtures.specs.moe_zero0_16 import MOE_ZERO0_16_MATRIX, MOE_ZERO0_16_SPECS
from tests.fixtures.specs.parallel import AUTOEP, DSMOE, PARALLEL_MATRIX
from tests.fixtures.specs.round_robin import RR_MATRIX, RR_SPECS
from tests.fixtures.specs.round_robin_ignored import RR_IGNORED_MATRIX, RR_IGNORED_SPECS
from tests.oracles.tensors import read_tensor
from tests.sampling import long_mode, sample
from tests.test_model_parallel_reshard import deepspeed_round_robin, deepspeed_undone, source_sections
from tests.test_reshard import _differences

MATRIX = [spec.name for spec in PARALLEL_MATRIX if spec.layout in (AUTOEP, DSMOE)]
HOLDOUT = [spec.name for spec in HOLDOUT_MATRIX]
SPECS = {spec.name: spec for spec in (*PARALLEL_MATRIX, *HOLDOUT_MATRIX, *BF16_MATRIX, *RR_MATRIX,
                                     *RR_IGNORED_MATRIX, *BF16_EXPERTS_MATRIX, *MOE_ZERO0_16_MATRIX)}
WRONG = ("damaged", "another model", "corrupt")


@pytest.fixture(scope="session")
def expert_fixtures(request: pytest.FixtureRequest) -> Mapping[str, ParallelFixture]:
    """The matrix's expert-parallel fixtures, and the held-out, BF16_Optimizer, round-robin and ZeRO-2/3
    fp32-accumulation ones only when a test asks for them (the round-robin and fp32-accumulation ones one
    launch at a time)."""

    class Lazy(dict):
        def __missing__(self, name: str) -> ParallelFixture:
            for set_name, specs in (("round-robin", RR_SPECS), ("round-robin-ignored", RR_IGNORED_SPECS),
                                    ("bf16-experts", BF16_EXPERTS_SPECS), ("moe-zero0-16", MOE_ZERO0_16_SPECS)):
                if name in specs:
                    self.update(SETS[set_name].build([name]))
                    return self[name]
            if name in BF16_SPECS:
                self.update(build_bf16_optimizer([n for n in BF16_SPECS if SPECS[n].layout in (AUTOEP, DSMOE)]))
                return self[name]
            group = "parallel_holdout_fixtures" if name in HOLDOUT else "parallel_fixtures"
            self.update(request.getfixturevalue(group))
            return self[name]

    return Lazy()


def _fp32(fixture: ParallelFixture) -> dict[str, torch.Tensor]:
    return {k.removeprefix("fp32/"): v for k, v in load_file(fixture.expected_path).items() if k.startswith("fp32/")}


# ---- validate: the layout named, with its degrees --------------------------------------------------


@pytest.mark.parametrize("name", MATRIX + HOLDOUT)
def test_validate_names_the_layout_and_degrees(expert_fixtures, name: str) -> None:
    fixture = expert_fixtures[name]
    spec = SPECS[name]
    report = validate(str(fixture.dir), deep=True)
    assert report.problems == ()
    summary = report.summary()
    kind = "AutoEP" if spec.layout == AUTOEP else "deepspeed.moe"
    assert summary["layout"] == f"{kind} (expert-parallel; ep {spec.ep} x dp {spec.world_size}, ZeRO-{spec.stage})"
    assert summary["expert_parallel"] == spec.ep and summary["world_size"] == spec.world_size
    assert summary["experts"] == 8 and summary["step"] == spec.steps
    assert summary["numel"] == sum(torch.Size(shape).numel() for shape in fixture.spec["params"].values())


# ---- consolidate ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", MATRIX + HOLDOUT)
def test_consolidated_weights_are_the_live_engine_s(expert_fixtures, name: str, tmp_path: Path) -> None:
    fixture = expert_fixtures[name]
    out = tmp_path / "hf"
    consolidate(str(fixture.dir), str(out), options=ConsolidateOptions(dtype="fp32", workers=2))
    weights = load_file(out / "model.safetensors")
    expected = _fp32(fixture)
    buffers = load_file(fixture.buffers_path)
    assert set(weights) == set(expected) | set(buffers)
    for key, tensor in {**expected, **buffers}.items():
        assert weights[key].dtype == tensor.dtype and torch.equal(weights[key], tensor), key
    provenance = json.loads((out / "ckptflow_provenance.json").read_text())
    assert provenance["source"]["layout"] == load_index(str(fixture.dir)).layout
    if SPECS[name].is_hf:
        _check_hf_model(fixture, out)


def _check_hf_model(fixture: ParallelFixture, out: Path) -> None:
    """`from_pretrained` takes the folder with no missing, unexpected or mismatched key, and its logits
    are the oracle's: the consolidated folder is the model, under its own fused names."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert {key: value for key, value in info.items() if value} == {}
    assert type(model).__name__ == fixture.spec["hf_class"]
    logits = load_file(fixture.logits_path)
    with torch.no_grad():
        got = model.eval()(input_ids=logits["input_ids"]).logits
    torch.testing.assert_close(got, logits["logits"], rtol=0, atol=1e-6)
    assert set(load_file(fixture.reference_dir / "model.safetensors")) == set(load_file(out / "model.safetensors"))


@pytest.mark.parametrize("name", ["autoep-qwen3-moe-ep2dp2-z2-fp32", "autoep-mixtral-ep2-z3-fp32", "dsmoe-ep2-z2-bf16",
                                  "dsmoe-ep2dp2-z0-fp32"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_16_bit_outputs_are_casts_of_the_fp32_masters(expert_fixtures, name: str, dtype: str, tmp_path: Path) -> None:
    fixture = expert_fixtures[name]
    out = tmp_path / "hf"
    consolidate(str(fixture.dir), str(out), options=ConsolidateOptions(dtype=dtype, max_shard_size="8KB", workers=3))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    weights: dict[str, torch.Tensor] = {}
    for shard in set(index["weight_map"].values()):
        weights.update(load_file(out / shard))
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    for key, tensor in _fp32(fixture).items():
        assert torch.equal(weights[key], tensor.to(torch_dtype)), key


# ---- the right diagnosis ---------------------------------------------------------------------------------


def _copy(fixture: ParallelFixture, tmp_path: Path) -> Path:
    shutil.copytree(fixture.dir, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def _rewrite(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """Load a checkpoint file with torch (test code only), change it, save it back."""
    obj = torch.load(path, map_location="cpu", weights_only=False)
    change(obj)
    torch.save(obj, path)


def _problems(ckpt: Path) -> list[tuple[str, str]]:
    report = validate(str(ckpt))
    for problem in report.problems:
        assert not any(word in problem.message for word in WRONG), problem.message
    return [(p.code, " ".join(p.message.split())) for p in report.problems]


def test_a_missing_expert_file_is_named(expert_fixtures, tmp_path: Path) -> None:
    ckpt = _copy(expert_fixtures["autoep-qwen3-moe-ep2dp2-z2-fp32"], tmp_path)
    (ckpt / "global_step3" / "layer_1_expert_3_mp_rank_00_model_states.pt").unlink()
    assert _problems(ckpt) == [(
        "expert-missing",
        f"expert 3 of MoE layer 1 is missing: expected global_step3/layer_1_expert_3_mp_rank_00_model_states.pt "
        f"under {ckpt} (AutoEP ZeRO-1/2 saves one file per MoE layer and global expert); the upload may still be in "
        "progress, or the folder was copied in part",
    )]


@pytest.mark.parametrize("name, label", [
    ("layer_1_expert_2_mp_rank_00_model_states.pt", "expert 2 of MoE layer 1: "),
    ("zero_pp_rank_1_mp_rank_00_optim_states.pt", "rank 1: "),
])
def test_a_folder_device_or_fifo_in_a_files_place_is_named_as_what_it_is(expert_fixtures, tmp_path: Path, name: str,
                                                                        label: str) -> None:
    """Not "empty, copy it again" nor "check access to the store": what is there, and never opened (a
    FIFO would block the open, a device would never end)."""
    import os

    from typer.testing import CliRunner

    from ckptflow.cli import app

    ckpt = _copy(expert_fixtures["autoep-qwen3-moe-ep2-z2-fp32"], tmp_path)
    path = ckpt / "global_step3" / name
    hint = "; put the file DeepSpeed saved in its place (copy it again from the training run)"
    for make, what in ((Path.mkdir, "a folder"), (lambda p: p.symlink_to("/dev/zero"), "a character device"),
                       (os.mkfifo, "a FIFO (named pipe)")):
        path.unlink() if not path.is_dir() or path.is_symlink() else path.rmdir()
        make(path)
        message = f"{path} is {what}, not a regular file{hint}"
        problems = _problems(ckpt)
        assert problems == [("not-a-regular-file", label + message)], problems
        result = CliRunner().invoke(app, ["consolidate", str(ckpt), str(tmp_path / "out")])
        assert result.exit_code == 1 and " ".join(result.output.split()) == f"error: {label}{message}"
        assert not (tmp_path / "out").exists()


def test_a_missing_rank_is_named_and_only_then(expert_fixtures, tmp_path: Path) -> None:
    ckpt = _copy(expert_fixtures["autoep-mixtral-ep2dp2-z3-fp32"], tmp_path)
    (ckpt / "global_step3" / "zero_pp_rank_2_mp_rank_00_optim_states.pt").unlink()
    problems = _problems(ckpt)
    assert [code for code, _ in problems] == ["rank-missing"]
    assert problems[0][1].startswith("rank 2 of 4 is missing: expected "
                                     "global_step3/zero_pp_rank_2_mp_rank_00_optim_states.pt")


def test_an_extra_expert_file_is_named(expert_fixtures, tmp_path: Path) -> None:
    ckpt = _copy(expert_fixtures["dsmoe-ep2-z2-fp32"], tmp_path)
    tag = ckpt / "global_step3"
    shutil.copy(tag / "layer_0_expert_3_mp_rank_00_model_states.pt",
                tag / "layer_0_expert_4_mp_rank_00_model_states.pt")
    assert _problems(ckpt) == [(
        "expert-extra",
        "unexpected file global_step3/layer_0_expert_4_mp_rank_00_model_states.pt: MoE layer 0 has 4 experts "
        "(deepspeed.moe saves one file per MoE layer and global expert); it is left over from another save into the "
        "same tag folder: remove it, or re-save the checkpoint into a fresh folder",
    )]


def test_an_expert_placed_twice_is_named(expert_fixtures, tmp_path: Path) -> None:
    ckpt = _copy(expert_fixtures["autoep-qwen3-moe-ep2-z2-fp32"], tmp_path)
    model = ckpt / "global_step3" / "mp_rank_00_model_states.pt"

    def place_expert_1_twice(obj: dict[str, Any]) -> None:
        obj["ds_autoep_layers"][1]["expert_placement"]["ranks"][1]["experts"] = [1, 3]

    _rewrite(model, place_expert_1_twice)
    assert _problems(ckpt) == [(
        "placement-mismatch",
        f"rank 0: {model}: MoE layer 1 (model.layers.1.mlp): its expert placement does not hold every expert exactly "
        "once (expert 1 is on expert-parallel ranks [0, 1]; expert 2 is on expert-parallel ranks []); the metadata is "
        "inconsistent, so ckptflow cannot tell where that layer's experts are",
    )]


def test_another_expert_parallel_topology_is_refused(expert_fixtures, tmp_path: Path) -> None:
    ckpt = _copy(expert_fixtures["autoep-mixtral-ep2dp2-z3-fp32"], tmp_path)
    optim = ckpt / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"

    def strided(obj: dict[str, Any]) -> None:  # what use_data_before_expert_parallelism would give rank 1
        obj["optimizer_state_dict"]["ds_zero_partition_groups"][2]["partition_ranks"] = [0, 1]
        obj["optimizer_state_dict"]["ds_zero_partition_groups"][2]["partition_rank"] = 1

    _rewrite(optim, strided)
    assert _problems(ckpt) == [(
        "partition-mismatch",
        f"rank 1: {optim} records sub-group 2 ('ep_size_2') as {{'partition_count': 2, 'partition_rank': 1, "
        "'partition_ranks': [0, 1]}, but at 4 ranks over 2 expert-parallel ranks DeepSpeed's default topology gives "
        "{'partition_count': 2, 'partition_rank': 0, 'partition_ranks': [1, 3]}; the checkpoint was saved with "
        "another expert-parallel topology, which ckptflow cannot place",
    )]


@pytest.mark.parametrize("name", ["autoep-qwen3-moe-ep2dp2-z2-fp32", "dsmoe-ep2dp2-z2-fp32"])
def test_data_before_expert_parallelism_is_refused(expert_fixtures, name: str, tmp_path: Path) -> None:
    ckpt = _copy(expert_fixtures[name], tmp_path)
    model = ckpt / "global_step3" / "mp_rank_00_model_states.pt"
    _rewrite(model, lambda obj: obj["ds_config"].update(use_data_before_expert_parallelism=True))
    (code, message), = _problems(ckpt)
    assert code == "unsupported-layout"
    assert message.startswith(f"{model} was trained with use_data_before_expert_parallelism, which puts "
                              "expert-parallel ranks on strided ranks")


def test_an_autoep_preset_without_a_known_mapping_is_refused(expert_fixtures, tmp_path: Path) -> None:
    ckpt = _copy(expert_fixtures["autoep-mixtral-ep2-z2-fp32"], tmp_path)
    model = ckpt / "global_step3" / "mp_rank_00_model_states.pt"
    _rewrite(model, lambda obj: obj["ds_config"]["expert_parallel"].update(preset_model="deepseek_v3"))
    assert _problems(ckpt) == [(
        "unsupported-layout",
        f"{model} is an AutoEP checkpoint of preset 'deepseek_v3'; ckptflow maps the layers of the presets mixtral, "
        "qwen3_moe back to Hugging Face names and no others yet: convert this one with DeepSpeed's universal "
        "converter (python -m deepspeed.checkpoint.ds_to_universal)",
    )]


def test_a_missing_expp_file_is_named(expert_fixtures, tmp_path: Path) -> None:
    ckpt = _copy(expert_fixtures["dsmoe-ep2dp2-z0-fp32"], tmp_path)
    (ckpt / "global_step3" / "expp_rank_1_mp_rank_00_optim_states.pt").unlink()
    assert _problems(ckpt) == [(
        "rank-missing",
        f"expert-parallel rank 1 of 2 is missing: expected global_step3/expp_rank_1_mp_rank_00_optim_states.pt under "
        f"{ckpt} (its optimizer state); the upload may still be in progress",
    )]


def test_the_cli_names_the_layout(expert_fixtures) -> None:
    from typer.testing import CliRunner

    from ckptflow.cli import app

    fixture = expert_fixtures["autoep-mixtral-ep2dp2-z3-fp32"]
    result = CliRunner().invoke(app, ["validate", str(fixture.dir)])
    assert result.exit_code == 0
    assert " ".join(result.output.split()) == (
        f"valid {fixture.dir}/global_step3: AutoEP (expert-parallel; ep 2 x dp 4, ZeRO-3), fp32, step 3, 21 params "
        "(67,008 elements, 0 frozen, 0 tied), 0 buffers, 3 param groups")


# ---- reshard: DeepSpeed loads it natively at the new size ----------------------------------------------

# (source fixture, new world size). The expert-parallel degree is kept: dense groups move to the new
# world size, expert groups to the new expert data-parallel size.
ALL_RESHARDS = (
    ("autoep-qwen3-moe-ep2-z2-fp32", 4), ("autoep-qwen3-moe-ep2-z2-bf16", 4), ("autoep-mixtral-ep2-z2-fp32", 4),
    ("autoep-mixtral-ep2-z3-fp32", 4), ("autoep-qwen3-moe-ep2dp2-z2-fp32", 2), ("autoep-mixtral-ep2dp2-z3-fp32", 2),
    ("dsmoe-ep2-z2-fp32", 4), ("dsmoe-ep2-z2-bf16", 4), ("dsmoe-ep2dp2-z2-fp32", 2),
    ("autoep-qwen3-moe-ep2dp3-z3-bf16-s1", 2), ("autoep-qwen3-moe-ep2dp3-z3-bf16-s1", 4),
    ("autoep-mixtral-ep4-z2-fp32-s2", 8), ("dsmoe-ep2dp3-z1-bf16-s1", 2), ("dsmoe-ep2dp3-z1-bf16-s1", 4),
)
# deepspeed.moe ZeRO-0 needs no reshard: DeepSpeed loads the source itself at another size.
ALL_NATIVE = (("dsmoe-ep2-z0-fp32", 4), ("dsmoe-ep2dp2-z0-fp32", 2), ("dsmoe-ep2dp3-z0-fp32-s1", 2),
          ("dsmoe-ep2dp3-z0-fp32-s1", 4))
# The default run samples them (`tests.sampling`; one DeepSpeed launch per world size and layout):
# AutoEP ZeRO-2 and ZeRO-3 growing, bf16 with a held-out seed; deepspeed.moe ZeRO-1 and ZeRO-2 and the
# native ZeRO-0 load, all in one 4-rank launch. `CKPTFLOW_LONG=1` runs every case (shrinking to 2 ranks,
# the Mixtral preset and the 8-rank launch included).
# By default deepspeed.moe's data-parallel change at ZeRO-1 and 2 (AutoEP's ZeRO-2 and ZeRO-3 writers are
# loaded by the stage cases below, ZeRO-3 -> ZeRO-3 among them; the held-out AutoEP ZeRO-3 bf16 checkpoint's
# data-parallel change, one 4-rank launch of its own, is in the long mode).
RESHARDS = sample(ALL_RESHARDS, [("dsmoe-ep2-z2-bf16", 4), ("dsmoe-ep2dp3-z1-bf16-s1", 4)])
NATIVE = sample(ALL_NATIVE, [("dsmoe-ep2-z0-fp32", 4)])
# The matrix holds each of these layouts at both sizes, written by DeepSpeed training there: a reshard's
# metadata must be what DeepSpeed writes at the new size (values differ: other data per replica).
WRITTEN_AT = {("autoep-qwen3-moe-ep2-z2-fp32", 4): "autoep-qwen3-moe-ep2dp2-z2-fp32",
              ("autoep-qwen3-moe-ep2dp2-z2-fp32", 2): "autoep-qwen3-moe-ep2-z2-fp32",
              ("autoep-mixtral-ep2-z3-fp32", 4): "autoep-mixtral-ep2dp2-z3-fp32",
              ("autoep-mixtral-ep2dp2-z3-fp32", 2): "autoep-mixtral-ep2-z3-fp32",
              ("dsmoe-ep2-z2-fp32", 4): "dsmoe-ep2dp2-z2-fp32",
              ("dsmoe-ep2dp2-z2-fp32", 2): "dsmoe-ep2-z2-fp32"}


def _case_id(case: tuple[str, int]) -> str:
    return f"{case[0]}-to{case[1]}"


class Oracle:
    """Reshards every case of one set (the matrix's or the held-out fixtures), then has DeepSpeed load
    each at its new size, gather its state the way the writer gathered the oracle, and save it again;
    and has DeepSpeed train the same model from scratch at that size and save it (`written`), to compare
    metadata with. One launch per (world size, layout), run when a test first asks for a case of that set."""

    def __init__(self, fixtures: Mapping[str, ParallelFixture], root: Path) -> None:
        self.fixtures, self.root = fixtures, root
        self.done: set[bool] = set()

    def __call__(self, case: tuple[str, int]) -> dict[str, Path]:
        held_out = case[0] in HOLDOUT
        if held_out not in self.done:
            self._run(held_out)
            self.done.add(held_out)
        name = _case_id(case)
        return {"out": self.root / "out" / name, "resaved": self.root / "resaved" / name,
                "state": self.root / "state" / f"{name}.safetensors", "written": self.root / "written" / name}

    def _run(self, held_out: bool) -> None:
        jobs: dict[tuple[int, str], list[dict[str, Any]]] = {}
        for case in (*RESHARDS, *NATIVE):
            if (case[0] in HOLDOUT) != held_out:
                continue
            fixture = self.fixtures[case[0]]
            paths = {"out": self.root / "out" / _case_id(case), "resaved": self.root / "resaved" / _case_id(case),
                     "state": self.root / "state" / f"{_case_id(case)}.safetensors"}
            paths["state"].parent.mkdir(parents=True, exist_ok=True)
            load = fixture.dir
            if case in RESHARDS:
                reshard(str(fixture.dir), str(paths["out"]), world_size=case[1])
                load = paths["out"]
            jobs.setdefault((case[1], fixture.layout), []).append(
                {"spec": str(fixture.root / "spec.json"), "load": str(load), "save": str(paths["resaved"]),
                 "state": str(paths["state"]), "hang_after": 300})
            if case in RESHARDS:
                jobs[(case[1], fixture.layout)].append({"spec": str(fixture.root / "spec.json"),
                                                        "write": str(self.root / "written" / _case_id(case))})
        for (world_size, layout), items in sorted(jobs.items()):
            jobs_file = self.root / f"jobs-{world_size}-{layout}-{held_out}.json"
            jobs_file.write_text(json.dumps(items, indent=1))
            launch("tests.oracles.expert_reshard", world_size, ["--jobs", str(jobs_file)],
                   log_dir=self.root / f"logs-{world_size}-{layout}-{held_out}", timeout=900)


@pytest.fixture(scope="session")
def oracle(expert_fixtures, tmp_path_factory) -> Oracle:
    return Oracle(expert_fixtures, tmp_path_factory.mktemp("expert-reshard-oracle"))


def _tree(obj: Any, *, values: bool = True) -> Any:
    """A checkpoint file's object tree as plain data: tensors as (dtype, shape, bytes), DeepSpeed records
    as (class, state); without `values`, tensors as (dtype, shape) only."""
    if isinstance(obj, TensorRef):
        data = (read_tensor(obj).contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if obj.numel and values
                else b"")
        return ("tensor", obj.dtype, obj.shape, data)
    if isinstance(obj, PickledObject):
        return ("object", obj.qualname, _tree(obj.args, values=values), _tree(obj.state, values=values))
    if isinstance(obj, Mapping):
        return {k: _tree(v, values=values) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_tree(v, values=values) for v in obj]
    return obj


STEP_DIFF = re.compile(r"^/optimizer_state_dict/base_optimizer_state/state/\d+/step: (\d+) != (\d+)$")


def _compare_folders(ours: Path, theirs: Path, *, values: bool = True, ignore: tuple[str, ...] = (),
                     step_more: int = 0) -> None:
    """The same files, keys and (with `values`) values; `step_more`: our Adam steps that many more than theirs."""
    names = sorted(p.name for p in ours.iterdir())
    assert names == sorted(p.name for p in theirs.iterdir() if p.suffix == ".pt")
    for name in names:
        a, b = (_tree(open_archive(str(folder / name), ALLOWED).obj, values=values) for folder in (ours, theirs))
        for key in ignore:
            a.pop(key, None), b.pop(key, None)
        diffs = [d for d in _differences(a, b)
                 if not (step_more and (m := STEP_DIFF.match(d)) and int(m.group(1)) == int(m.group(2)) + step_more)]
        assert not diffs, f"{name}: " + "; ".join(diffs[:5])


def _shape_types(folder: Path) -> dict[str, list[str]]:
    """Per model-states file, the Python types of its recorded shapes (`param_shapes`, `frozen_param_shapes`),
    which the archive reader gives as tuples either way: DeepSpeed's MoE save writes plain tuples, where
    other saves write torch.Size. Read with torch.load: these are trusted files, DeepSpeed's or ours."""
    out = {}
    for path in sorted(folder.glob("*model_states.pt")):
        state = torch.load(path, map_location="cpu", weights_only=False)
        shapes = [v for group in state.get("param_shapes") or [] for v in group.values()]
        shapes += list((state.get("frozen_param_shapes") or {}).values())
        if shapes:
            out[path.name] = sorted({type(v).__name__ for v in shapes})
    return out


@pytest.mark.parametrize("case", RESHARDS + NATIVE, ids=_case_id)
def test_deepspeed_holds_exactly_the_source_state(expert_fixtures, oracle, case) -> None:
    """Loaded natively at the new world size (no universal flag), DeepSpeed holds the oracle's fp32
    weights and Adam moments of every parameter, experts placed by global id, bit for bit."""
    fixture = expert_fixtures[case[0]]
    state = load_file(oracle(case)["state"])
    expected = load_file(fixture.expected_path)
    buffers = load_file(fixture.buffers_path)
    assert set(state) == set(expected) | {f"buffer/{k}" for k in buffers}
    for key, tensor in expected.items():
        assert torch.equal(state[key], tensor), key
    for key, tensor in buffers.items():
        assert torch.equal(state[f"buffer/{key}"], tensor), key


@pytest.mark.parametrize("case", RESHARDS, ids=_case_id)
def test_deepspeed_saves_again_exactly_our_files(expert_fixtures, oracle, case) -> None:
    """What DeepSpeed saves after loading the reshard equals it field for field and byte for byte:
    partitions, moments, partition counts, ds_zero_partition_groups, ds_autoep_layers, expert files."""
    paths = oracle(case)
    tag = (paths["out"] / "latest").read_text()
    assert (paths["resaved"] / "latest").read_text() == tag
    _compare_folders(paths["out"] / tag, paths["resaved"] / tag)


@pytest.mark.parametrize("case", RESHARDS, ids=_case_id)
def test_deepspeed_training_at_that_size_writes_the_same_metadata(oracle, case) -> None:
    """The same model trained from scratch and saved by DeepSpeed at the new size has the same files,
    keys, shapes and metadata (every field but the tensors' values and the samples seen, the run's own)."""
    paths = oracle(case)
    tag = (paths["out"] / "latest").read_text()
    _compare_folders(paths["out"] / tag, paths["written"] / tag, values=False, ignore=("global_samples",))


@pytest.mark.parametrize("case", sorted(WRITTEN_AT), ids=_case_id)
def test_the_metadata_is_what_deepspeed_writes_at_that_size(expert_fixtures, case, tmp_path: Path) -> None:
    """The matrix's fixture of the same layout at the new size, trained and saved there by DeepSpeed,
    has the same files, keys, shapes and metadata (every field but the tensors' values and the samples
    seen, which are the run's)."""
    out = tmp_path / "out"
    reshard(str(expert_fixtures[case[0]].dir), str(out), world_size=case[1])
    written = expert_fixtures[WRITTEN_AT[case]]
    _compare_folders(out / "global_step3", written.tag_dir, values=False, ignore=("global_samples",))


def test_reshard_refusals(expert_fixtures, tmp_path: Path) -> None:
    zero0 = load_index(str(expert_fixtures["dsmoe-ep2-z0-fp32"].dir))
    with pytest.raises(UnsupportedCheckpointError) as refused:
        plan_reshard(zero0, 4)
    assert refused.value.code == "reshard-not-needed"
    assert "DeepSpeed loads a deepspeed.moe ZeRO-0 checkpoint natively at any data-parallel size" in str(refused.value)
    with pytest.raises(UnsupportedCheckpointError, match=r"to 3 ranks: an expert-parallel degree of 2 does not divide "
                                                         r"the 3 data-parallel ranks left at tp1 x pp1; shapes it can "
                                                         r"write at 3 ranks: ZeRO-2 dp3 \(3 ranks\), ZeRO-1 dp3 "
                                                         r"\(3 ranks\), ZeRO-3 dp3 \(3 ranks\)$"):
        plan_reshard(load_index(str(expert_fixtures["autoep-qwen3-moe-ep2-z2-fp32"].dir)), 3)
    index, problems, _ = inspect(str(expert_fixtures["autoep-qwen3-moe-ep2-z2-fp32"].dir))
    plan = plan_reshard(index, 4)
    assert plan.carried == index.expert_files  # copied as they are
    assert [unit.meta_rank for unit in plan.units] == [0, 1, 0, 1]  # a new rank copies its expert-parallel rank's


# ---- reshard: another expert-parallel degree (issue 24) ---------------------------------------------------

# (source fixture, world size, new expert-parallel degree). DeepSpeed launched at that shape loads the
# output natively and holds the source's per-expert weights and Adam moments (the fixture's oracle),
# saves exactly our files again, and trained from scratch at that shape writes the same metadata.
ALL_EP_RESHARDS = (
    ("autoep-qwen3-moe-ep2-z2-fp32", 4, 4), ("dsmoe-ep2-z2-fp32", 4, 4),
    ("autoep-qwen3-moe-ep2dp2-z2-fp32", 4, 4), ("autoep-qwen3-moe-ep2dp2-z2-fp32", 4, 1),
    ("dsmoe-ep2dp2-z2-fp32", 4, 1), ("dsmoe-ep2-z2-bf16", 4, 4), ("autoep-mixtral-ep2-z2-fp32", 4, 4),
    ("autoep-qwen3-moe-ep2-z2-bf16", 4, 4),
)
# One launch per (layout, world size, degree), all in the long mode (`CKPTFLOW_LONG=1`): AutoEP ZeRO-2 growing
# from ep2 x edp1 to ep4 x edp1, deepspeed.moe alone, ep2 x edp2 -> ep4, -> ep1 (dense), bf16, Mixtral. By
# default the degree changes are loaded by DeepSpeed through the stage cases below (deepspeed.moe ep2 -> ep4
# at ZeRO-1, AutoEP ZeRO-2 ep2 x edp2 -> ZeRO-3 ep4, ZeRO-3 ep2 x edp2 -> ep4) and the cut case (AutoEP
# ZeRO-2 ep2 -> ep1).
EP_RESHARDS = sample(ALL_EP_RESHARDS, [])

# (source fixture, world size, degree, ZeRO stage): deepspeed.moe and AutoEP between ZeRO-1 and ZeRO-2,
# alone or with another degree or size, and AutoEP between ZeRO-1/2 and ZeRO-3 at its own degree or
# another; DeepSpeed launched at the target stage and degree loads it natively. By default three launches
# (deepspeed.moe ZeRO-2 -> ZeRO-1 with ep2 -> ep4 on 4 ranks, AutoEP ZeRO-2 -> ZeRO-3 on the source's 2
# ranks, AutoEP at ZeRO-3 ep4 on 4 ranks);
# `CKPTFLOW_LONG=1` adds deepspeed.moe at its own degree, edp2, bf16, the held-out ZeRO-1 -> ZeRO-2,
# AutoEP (Qwen3-MoE and Mixtral presets) at ZeRO-1, ZeRO-3 on more ranks (ep2 x edp2) and fewer
# (ep2 x edp2 -> ep2 x edp1), Mixtral and bf16, and ZeRO-3 -> ZeRO-2 and ZeRO-1 (fewer ranks, more ranks,
# the held-out bf16 ep2 x edp3).
RR_RESHARDS = (
    ("autoep-qwen3-moe-ep2dp2-z2-fp32-rr", 4, 4, 2), ("autoep-qwen3-moe-ep2dp2-z2-fp32-rr", 4, 1, 1),
    ("autoep-qwen3-moe-ep2dp2-z2-fp32-rr", 4, 2, 3), ("autoep-qwen3-moe-ep2dp2-z2-fp32-rr", 4, 4, 3),
    ("autoep-qwen3-moe-ep2dp2-z2-fp32-rr", 2, 2, 2),
    ("dsmoe-ep2dp2-z1-fp32-rr", 4, 4, 1), ("dsmoe-ep2dp2-z1-fp32-rr", 4, 1, 2), ("dsmoe-ep2dp2-z1-fp32-rr", 2, 1, 1),
)
ZERO0_RESHARDS = (
    ("dsmoe-ep2-z0-fp32", 4, 4, 1), ("dsmoe-ep2-z0-fp32", 2, 2, 2), ("dsmoe-ep2dp2-z0-fp32", 4, 2, 1),
    ("dsmoe-ep2dp2-z0-fp32", 2, 1, 2), ("dsmoe-ep2dp3-z0-fp32-s1", 2, 2, 1),
    # Trained in bf16 (FP16_Optimizer's flat masters per group, `specs.moe_zero0_16`): ZeRO-1 at its own shape,
    # ZeRO-2 ep4 on 4 ranks, ZeRO-1 ep1 on 2 ranks, ZeRO-2 ep2 x edp2 on 4 ranks; ep2 x edp2 -> ZeRO-1 ep4 x edp1,
    # -> ZeRO-2 ep1 on 2 ranks.
    ("dsmoe-ep2-z0-bf16", 2, 2, 1), ("dsmoe-ep2-z0-bf16", 4, 4, 2), ("dsmoe-ep2-z0-bf16", 2, 1, 1),
    ("dsmoe-ep2-z0-bf16", 4, 2, 2), ("dsmoe-ep2dp2-z0-bf16", 4, 4, 1), ("dsmoe-ep2dp2-z0-bf16", 2, 1, 2),
)
RR_IGNORED_RESHARDS = (
    ("autoep-qwen3-moe-ep2-z3-fp32-rr", 2, 1, 2), ("autoep-qwen3-moe-ep2-z3-fp32-rr", 4, 2, 2),
    ("autoep-qwen3-moe-ep2-z1-bf16-fp32accum-rr", 2, 1, 2), ("dsmoe-ep2-z1-bf16-fp32accum-rr", 4, 1, 2),
)
BF16_BACK = (
    ("dsmoe-ep2-z2-bf16-fp32accum", 2, 2, 1), ("dsmoe-ep2-z2-bf16-fp32accum", 4, 4, 1),
    ("autoep-qwen3-moe-ep2-z2-bf16-fp32accum", 2, 2, 1), ("autoep-qwen3-moe-ep2-z3-bf16-fp32accum", 2, 2, 1),
    ("autoep-qwen3-moe-ep2-z3-bf16-fp32accum", 4, 2, 1),
)
ALL_STAGE_RESHARDS = (
    ("dsmoe-ep2-z2-fp32", 2, 2, 1), ("dsmoe-ep2-z2-fp32", 4, 4, 1), ("dsmoe-ep2dp2-z2-fp32", 4, 2, 1),
    ("dsmoe-ep2-z2-bf16", 2, 2, 1), ("dsmoe-ep2dp3-z1-bf16-s1", 4, 2, 2), ("dsmoe-ep2dp3-z1-bf16-s1", 2, 1, 2),
    ("autoep-qwen3-moe-ep2-z2-fp32", 2, 2, 1), ("autoep-qwen3-moe-ep2-z2-fp32", 4, 4, 1),
    ("autoep-qwen3-moe-ep2dp2-z2-fp32", 4, 2, 1), ("autoep-mixtral-ep2-z2-fp32", 2, 2, 1),
    ("autoep-qwen3-moe-ep2-z2-fp32", 2, 2, 3), ("autoep-qwen3-moe-ep2-z2-fp32", 4, 2, 3),
    ("autoep-qwen3-moe-ep2dp2-z2-fp32", 2, 2, 3), ("autoep-mixtral-ep2-z2-fp32", 4, 2, 3),
    ("autoep-qwen3-moe-ep2-z2-bf16", 2, 2, 3),
    ("autoep-qwen3-moe-ep2-z3-fp32", 2, 2, 2), ("autoep-mixtral-ep2dp2-z3-fp32", 2, 2, 2),
    ("autoep-mixtral-ep2-z3-fp32", 4, 2, 1), ("autoep-qwen3-moe-ep2dp3-z3-bf16-s1", 4, 2, 2),
    # AutoEP's expert-parallel degree with ZeRO-3 on either side: ZeRO-2 ep2 x edp2 -> ZeRO-3 ep4 (stage,
    # degree and expert data parallelism at once), ZeRO-3 -> ZeRO-3 ep4 and ep1, ZeRO-3 -> ZeRO-2 ep4 and
    # ep1, ZeRO-1 ep4 from the held-out bf16 ep2 x edp3, and ZeRO-2 ep2 -> ZeRO-3 ep1.
    ("autoep-qwen3-moe-ep2dp2-z2-fp32", 4, 4, 3), ("autoep-mixtral-ep2dp2-z3-fp32", 4, 4, 3),
    ("autoep-mixtral-ep2dp2-z3-fp32", 4, 4, 2), ("autoep-qwen3-moe-ep2-z3-fp32", 2, 1, 3),
    ("autoep-qwen3-moe-ep2-z2-fp32", 2, 1, 3), ("autoep-mixtral-ep2-z3-fp32", 4, 1, 2),
    ("autoep-qwen3-moe-ep2dp3-z3-bf16-s1", 4, 4, 1), ("autoep-qwen3-moe-ep2dp3-z3-bf16-s1", 4, 4, 3),
    # From BF16_Optimizer (bf16 ZeRO-1, fp32 gradient accumulation, `specs.bf16_optimizer`; the target runs the
    # same config): deepspeed.moe to ZeRO-2 at its degree and at ep1, AutoEP to ZeRO-2 and ZeRO-3.
    ("dsmoe-ep2-z1-bf16-fp32accum", 2, 2, 2), ("dsmoe-ep2-z1-bf16-fp32accum", 2, 1, 2),
    ("autoep-qwen3-moe-ep2-z1-bf16-fp32accum", 2, 2, 2), ("autoep-qwen3-moe-ep2-z1-bf16-fp32accum", 2, 2, 3),
    # ... and back: saved at ZeRO-2 (DeepSpeedZeroOptimizer) and ZeRO-3 from that config (`specs.bf16_experts`),
    # to ZeRO-1, where DeepSpeed builds BF16_Optimizer from it (each expert group over its expert data-parallel
    # group): BF16_Optimizer's files. deepspeed.moe at its degree and to ep4 on 4 ranks; AutoEP from ZeRO-2 and
    # ZeRO-3 at its degree, and from ZeRO-3 to ep2 x edp2 on 4 ranks.
    *BF16_BACK,
    # Trained with round_robin_gradients (`specs.round_robin`; the target runs the same config): each group's
    # saved order undone over its own ranks (an expert group's expert data-parallel group of 2) and redone
    # over the target's. AutoEP ZeRO-2 ep2 x edp2 -> ep4 and ep1 (ZeRO-1), -> ZeRO-3 at ep2 and ep4, -> ep2
    # x edp1 on 2 ranks; deepspeed.moe ZeRO-1 ep2 x edp2 -> ep4, -> ZeRO-2 ep1, -> ep1 on 2 ranks.
    *RR_RESHARDS,
    # Whose config sets round_robin_gradients that its optimizer ignores (`specs.round_robin_ignored`: AutoEP
    # ZeRO-3, BF16_Optimizer), to a ZeRO-2 target built from that config, which DeepSpeed flattens round-robin:
    # AutoEP ZeRO-3 ep2 -> ep1 on 2 ranks and ep2 x edp2 on 4; AutoEP BF16_Optimizer -> ep1; deepspeed.moe
    # BF16_Optimizer -> ep1 on 4 ranks.
    *RR_IGNORED_RESHARDS,
    # deepspeed.moe ZeRO-0 (its expp_rank optimizers named by position, `readers.moe.zero0_index`) to ZeRO-1/2: ep2 ->
    # ZeRO-1 ep4 on 4 ranks, ZeRO-2 at its own shape, ep2 x edp2 -> ZeRO-1 ep2 x edp2 and -> ZeRO-2 ep1 on 2 ranks,
    # the held-out ep2 x edp3 -> ZeRO-1 ep2 on 2 ranks.
    *ZERO0_RESHARDS,
)
# By default one launch for AutoEP ZeRO-3 at another degree: ep4 at ZeRO-3 from ZeRO-2 ep2 x edp2 and from
# ZeRO-3 ep2 x edp2 (ZeRO-3 -> ZeRO-2 ep4 is checked against DeepSpeed's own ep4 save without a launch).
# deepspeed.moe ZeRO-0 -> ZeRO-1 ep4 rides the launch of deepspeed.moe ZeRO-2 -> ZeRO-1 ep4 (the same shape).
STAGE_RESHARDS = sample(ALL_STAGE_RESHARDS, [
    ("dsmoe-ep2-z2-fp32", 4, 4, 1), ("dsmoe-ep2-z0-fp32", 4, 4, 1), ("autoep-qwen3-moe-ep2-z2-fp32", 2, 2, 3),
    ("autoep-qwen3-moe-ep2dp2-z2-fp32", 4, 4, 3), ("autoep-mixtral-ep2dp2-z3-fp32", 4, 4, 3),
])


def _ep_case_id(case: tuple[Any, ...]) -> str:
    stage = f"-z{case[3]}" if len(case) > 3 else ""
    return f"{case[0]}-to{case[1]}-ep{case[2]}{stage}"


class EpOracle:
    """Reshards the cases of `cases` ((fixture, world size, degree[, ZeRO stage])) to their shapes, then
    per (layout, world size, degree, stage) launches DeepSpeed at that shape once, when a test first asks
    for a case of it: it loads each output, gathers its state and saves it again, and trains the same
    model from scratch and saves it (`written`)."""

    def __init__(self, fixtures: Mapping[str, ParallelFixture], root: Path, cases: tuple[tuple[Any, ...], ...]) -> None:
        self.fixtures, self.root, self.cases = fixtures, root, cases
        self.ran: set[tuple[str, int, int, int]] = set()

    def _launch_of(self, case: tuple[Any, ...]) -> tuple[str, int, int, int]:
        return (SPECS[case[0]].layout, case[1], case[2], case[3] if len(case) > 3 else SPECS[case[0]].stage)

    def paths(self, case: tuple[Any, ...]) -> dict[str, Path]:
        name = _ep_case_id(case)
        return {"out": self.root / "out" / name, "resaved": self.root / "resaved" / name,
                "state": self.root / "state" / f"{name}.safetensors", "written": self.root / "written" / name}

    def __call__(self, case: tuple[Any, ...]) -> dict[str, Path]:
        key = self._launch_of(case)
        if key not in self.ran:
            self.ran.add(key)
            self._run(key)
        return self.paths(case)

    def _run(self, key: tuple[str, int, int, int]) -> None:
        items: list[dict[str, Any]] = []
        (self.root / "state").mkdir(parents=True, exist_ok=True)
        layout, world_size, ep, stage = key
        for case in (c for c in self.cases if self._launch_of(c) == key):
            fixture = self.fixtures[case[0]]
            paths = self.paths(case)
            reshard(str(fixture.dir), str(paths["out"]), world_size=world_size, ep=ep, stage=stage)
            shape = {"spec": str(fixture.root / "spec.json"), "ep": ep, "stage": stage, **source_sections(fixture)}
            items.append({**shape, "load": str(paths["out"]), "save": str(paths["resaved"]),
                          "state": str(paths["state"]), "hang_after": 300})
            items.append({**shape, "write": str(paths["written"])})
        name = f"{layout}-{world_size}-ep{ep}-z{stage}"
        jobs_file = self.root / f"jobs-{name}.json"
        jobs_file.write_text(json.dumps(items, indent=1))
        launch("tests.oracles.expert_reshard", world_size, ["--jobs", str(jobs_file)],
               log_dir=self.root / f"logs-{name}", timeout=900)


@pytest.fixture(scope="session")
def ep_oracle(expert_fixtures, tmp_path_factory) -> EpOracle:
    return EpOracle(expert_fixtures, tmp_path_factory.mktemp("expert-degree-oracle"), EP_RESHARDS + STAGE_RESHARDS)


@pytest.mark.parametrize("case", EP_RESHARDS + STAGE_RESHARDS, ids=_ep_case_id)
def test_deepspeed_at_the_new_degree_holds_exactly_the_source_state(expert_fixtures, ep_oracle, case) -> None:
    """Loaded natively at the new expert-parallel degree or ZeRO stage, DeepSpeed holds the oracle's fp32
    weights and Adam moments of every parameter, experts placed by global id, bit for bit."""
    fixture = expert_fixtures[case[0]]
    state = load_file(ep_oracle(case)["state"])
    expected = load_file(fixture.expected_path)
    buffers = load_file(fixture.buffers_path)
    assert set(state) == set(expected) | {f"buffer/{k}" for k in buffers}
    for key, tensor in expected.items():
        assert torch.equal(state[key], tensor), key
    for key, tensor in buffers.items():
        assert torch.equal(state[f"buffer/{key}"], tensor), key


@pytest.mark.parametrize("case", EP_RESHARDS + STAGE_RESHARDS, ids=_ep_case_id)
def test_deepspeed_at_the_new_degree_saves_again_exactly_our_files(ep_oracle, case) -> None:
    paths = ep_oracle(case)
    tag = (paths["out"] / "latest").read_text()
    assert (paths["resaved"] / "latest").read_text() == tag
    _compare_folders(paths["out"] / tag, paths["resaved"] / tag)


@pytest.mark.parametrize("case", EP_RESHARDS + STAGE_RESHARDS, ids=_ep_case_id)
def test_deepspeed_training_at_the_new_degree_writes_the_same_metadata(expert_fixtures, ep_oracle, case) -> None:
    """Every file, key, shape and metadata field (ep_size_N groups, partition counts, ds_autoep_layers with
    its placement and affine maps, autoep_size, zero_stage) is what DeepSpeed writes training at that shape.
    But the Adam step of a source FP16_Optimizer trained (a 16-bit ZeRO-0 one): its base optimizer steps once
    more when it is built, and the target carries the source's step (one more than training there counts)."""
    paths = ep_oracle(case)
    tag = (paths["out"] / "latest").read_text()
    more = 1 if expert_fixtures[case[0]].spec["optimizer"] == "FP16_Optimizer" else 0
    _compare_folders(paths["out"] / tag, paths["written"] / tag, values=False, ignore=("global_samples",),
                     step_more=more)
    assert _shape_types(paths["out"] / tag) == _shape_types(paths["written"] / tag)


@pytest.mark.parametrize("case", [case for case in STAGE_RESHARDS if case in BF16_BACK], ids=_ep_case_id)
def test_a_zero23_source_whose_config_gets_bf16_optimizer_is_written_as_its_files_at_zero1(
        expert_fixtures, ep_oracle, case) -> None:
    """The sources are DeepSpeedZeroOptimizer's and the ZeRO-3 optimizer's files; ckptflow's at ZeRO-1 are
    BF16_Optimizer's (DeepSpeed's load of them, its re-save and its own training there: the tests above)."""
    paths = ep_oracle(case)
    assert expert_fixtures[case[0]].spec["optimizer"] != "BF16_Optimizer"
    assert load_index(str(expert_fixtures[case[0]].dir)).zero.optimizer_kind != BF16
    assert load_index(str(paths["out"])).zero.optimizer_kind == BF16


def test_the_expert_degree_plan_moves_each_expert_to_its_new_rank(expert_fixtures) -> None:
    """ep2 x edp1 -> ep4 x edp1: target rank r holds global experts r of each layer, one row of each
    stacked weight, copied from the source rank that held it (rank r // 2, row r % 2)."""
    index = load_index(str(expert_fixtures["autoep-qwen3-moe-ep2-z2-fp32"].dir))
    plan = plan_reshard(index, Target(world_size=4, ep=4))
    assert plan.group_ep == (1, 1, 4) and plan.carried == index.expert_files
    assert dict(plan.flat_shapes[2])["model.layers.0.mlp.experts.w1"] == (1, 24, 64)
    block = 24 * 64
    for unit in plan.units:
        first = unit.flats[2].copies[0]  # layer 0's w1: global expert `unit.rank`
        assert (first.src_rank, first.src_offset, first.dst_offset, first.numel) == (
            unit.rank // 2, (unit.rank % 2) * block, 0, block)
        assert {c.src_rank for c in unit.flats[2].copies} == {unit.rank // 2}
    groups = plan.index.optim_states[0]["optimizer_state_dict"]["base_optimizer_state"]["param_groups"]
    assert [g["name"] for g in groups] == ["decay", "no_decay", "ep_size_4"]
    layer = plan.index.model_states[0]["ds_autoep_layers"][0]
    assert (layer["ep_size"], layer["num_local_experts"], layer["ep_group_name"], layer["global_expert_end"]) == (
        4, 1, "ep_size_4", 1)
    assert layer["expert_placement"]["ranks"] == [{"rank": r, "experts": [r]} for r in range(4)]


def test_expert_degree_refusals(expert_fixtures) -> None:
    autoep = load_index(str(expert_fixtures["autoep-qwen3-moe-ep2-z2-fp32"].dir))
    with pytest.raises(UnsupportedCheckpointError, match=r"to 3 ranks, ep3: 3 expert-parallel ranks do not split the "
                                                         r"4/4 experts of its MoE layers; shapes it can write at 3 "
                                                         r"ranks: ZeRO-2 dp3 \(3 ranks\), ZeRO-1 dp3 \(3 ranks\), "
                                                         r"ZeRO-3 dp3 \(3 ranks\)$"):
        plan_reshard(autoep, Target(world_size=3, ep=3))
    zero3 = load_index(str(expert_fixtures["autoep-mixtral-ep2-z3-fp32"].dir))
    with pytest.raises(UnsupportedCheckpointError, match=r"\(ZeRO-3 ep2 x edp1 \(2 ranks\)\) to 6 ranks, ZeRO-2, ep3: 3 "
                                                         r"expert-parallel ranks do not split the 4/4 experts of its "
                                                         r"MoE layers; shapes it can write at 6 ranks: ZeRO-3 dp6 "):
        plan_reshard(zero3, Target(world_size=6, stage=2, ep=3))


# AutoEP ZeRO-3 with frozen parameters (a 2-D projection and a norm, both cut into ZeRO-3 pieces): a source
# DeepSpeed writes in the test (the oracle's "frozen"), resharded on 2 ranks to (ZeRO stage, degree).
# Long mode only: two launches, the source's and the targets'.
FROZEN = ["model.layers.0.self_attn.q_proj.weight", "model.norm.weight"]
FROZEN_TARGETS = [(2, 2), (1, 1), (3, 1)]


class SourceOracle:
    """Launches DeepSpeed once on `world_size` ranks to train and save the model of fixture `name` with the
    oracle's job `options` (and gather its state), reshards it to every (stage, degree) of `targets` on as
    many ranks, then launches DeepSpeed once there with the same options to load each target natively at
    its stage and degree, gather its state and save it again, and to train the same model from scratch
    there and save it."""

    def __init__(self, fixtures: Mapping[str, ParallelFixture], root: Path, name: str, options: Mapping[str, Any],
                 targets: Sequence[tuple[int, int]], world_size: int = 2) -> None:
        self.fixtures, self.root, self.ran = fixtures, root, False
        self.name, self.options, self.targets = name, dict(options), tuple(targets)
        self.world_size = world_size

    def __call__(self) -> Path:
        if not self.ran:
            self.ran = True
            self._run()
        return self.root

    def _run(self) -> None:
        spec = str(self.fixtures[self.name].root / "spec.json")
        (self.root / "state").mkdir(parents=True)
        source = {"spec": spec, **self.options, "write": str(self.root / "source"),
                  "state": str(self.root / "state" / "source.safetensors")}
        (self.root / "source.json").write_text(json.dumps([source]))
        launch("tests.oracles.expert_reshard", self.world_size, ["--jobs", str(self.root / "source.json")],
               log_dir=self.root / "logs-source", timeout=900)
        items: list[dict[str, Any]] = []
        for stage, ep in self.targets:
            name = f"z{stage}-ep{ep}"
            reshard(str(self.root / "source"), str(self.root / "out" / name), world_size=self.world_size, stage=stage,
                    ep=ep)
            shape = {"spec": spec, **self.options, "stage": stage, "ep": ep}
            items.append({**shape, "load": str(self.root / "out" / name), "save": str(self.root / "resaved" / name),
                          "state": str(self.root / "state" / f"{name}.safetensors"), "hang_after": 300})
            items.append({**shape, "write": str(self.root / "written" / name)})
        (self.root / "targets.json").write_text(json.dumps(items))
        launch("tests.oracles.expert_reshard", self.world_size, ["--jobs", str(self.root / "targets.json")],
               log_dir=self.root / "logs-targets", timeout=900)

    def check(self, stage: int, ep: int) -> tuple[dict[str, torch.Tensor], Path]:
        """DeepSpeed at ZeRO-`stage` and degree `ep` holds the source's gathered state bit for bit, saves our
        files again exactly, and trained there writes the same files, keys, shapes and metadata. The source's
        state and the target's tag folder."""
        root, name = self(), f"z{stage}-ep{ep}"
        state, source = (load_file(root / "state" / f"{n}.safetensors") for n in (name, "source"))
        assert set(state) == set(source)
        for key, tensor in source.items():
            assert torch.equal(state[key], tensor), key
        tag = (root / "out" / name / "latest").read_text()
        _compare_folders(root / "out" / name / tag, root / "resaved" / name / tag)
        _compare_folders(root / "out" / name / tag, root / "written" / name / tag, values=False,
                         ignore=("global_samples",))
        return source, root / "out" / name / tag


@pytest.fixture(scope="session")
def frozen_oracle(expert_fixtures, tmp_path_factory) -> SourceOracle:
    """AutoEP ZeRO-3 ep2 trained with `FROZEN` frozen, and its targets."""
    return SourceOracle(expert_fixtures, tmp_path_factory.mktemp("expert-frozen-oracle"),
                        "autoep-qwen3-moe-ep2-z3-fp32", {"frozen": FROZEN}, FROZEN_TARGETS)


@pytest.mark.skipif(not long_mode(), reason="two DeepSpeed launches of their own: long mode (CKPTFLOW_LONG=1)")
@pytest.mark.parametrize(("stage", "ep"), FROZEN_TARGETS)
def test_autoep_zero3_with_frozen_parameters_moves_to_any_stage_and_degree(frozen_oracle, stage: int,
                                                                         ep: int) -> None:
    """DeepSpeed at ZeRO-`stage` and degree `ep` loads the reshard natively and holds the source's state bit
    for bit (every trainable parameter's fp32 weights and moments, each frozen one's value), saves exactly
    our files again, and trained there from scratch writes the same files, keys, shapes and metadata
    (frozen records: the whole tensors at ZeRO-2, each its own copy; None at ZeRO-1; pieces at ZeRO-3)."""
    source, out = frozen_oracle.check(stage, ep)
    assert {f"fp32/{n}" for n in FROZEN} <= set(source)
    written = frozen_oracle() / "written" / f"z{stage}-ep{ep}" / out.name
    assert _shape_types(out) == _shape_types(written)
    assert _frozen_storages(out) == _frozen_storages(written)


def _frozen_storages(folder: Path) -> dict[str, bool]:
    """Per frozen record of rank 0's model states, whether it shares its storage with the module's tensor
    (torch.load: trusted files)."""
    path = next(folder / name for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")
                if (folder / name).exists())
    state = torch.load(path, map_location="cpu", weights_only=False)
    module = state["module"]
    return {name: tensor.untyped_storage().data_ptr() == module[name].untyped_storage().data_ptr()
            for name, tensor in (state.get("frozen_param_fragments") or {}).items()}


def test_a_deepspeed_moe_stage_change_keeps_the_partitions_and_records_the_stage(expert_fixtures) -> None:
    """deepspeed.moe ZeRO-2 -> ZeRO-1 (DeepSpeedZeroOptimizer both): every partition copied as the same-stage
    reshard copies it, alone or with another degree; only the recorded stage differs."""
    index = load_index(str(expert_fixtures["dsmoe-ep2-z2-fp32"].dir))
    for target in (Target(world_size=4), Target(world_size=4, ep=4)):
        same = plan_reshard(index, target)
        plan = plan_reshard(index, replace(target, stage=1))
        assert (same.stage, plan.stage, plan.optimizer) == (2, 1, same.optimizer)
        assert [u.flats for u in plan.units] == [u.flats for u in same.units]
        assert [u.model_file for u in plan.units] == [u.model_file for u in same.units]
        assert plan.group_ep == same.group_ep


@pytest.mark.parametrize("name", ["dsmoe-ep2-z2-fp32", "autoep-qwen3-moe-ep2-z2-fp32"])
def test_zero2_to_zero1_and_back_gives_the_source_s_files(expert_fixtures, name: str, tmp_path: Path) -> None:
    """ZeRO-2 -> ZeRO-1 -> ZeRO-2 writes DeepSpeed's ZeRO-2 files back field for field and byte for byte
    (ZeRO-1's frozen-parameter records are None, ZeRO-2's empty; AutoEP's second router copy is no frozen
    parameter at ZeRO-1, which records no frozen list)."""
    source = expert_fixtures[name]
    reshard(str(source.dir), str(tmp_path / "z1"), world_size=2, stage=1)
    assert load_index(str(tmp_path / "z1")).stage == 1
    reshard(str(tmp_path / "z1"), str(tmp_path / "z2"), world_size=2, stage=2)
    _compare_folders(tmp_path / "z2" / "global_step3", source.tag_dir)


@pytest.mark.skipif(not long_mode(), reason="fixtures of the long mode's bf16-optimizer set")
@pytest.mark.parametrize(("name", "world_size", "ep", "stage"), [
    ("dsmoe-ep2-z1-bf16-fp32accum", 2, 2, 2), ("dsmoe-ep2-z1-bf16-fp32accum", 2, 1, 2),
    ("dsmoe-ep2-z1-bf16-fp32accum", 4, 4, 2), ("autoep-qwen3-moe-ep2-z1-bf16-fp32accum", 2, 2, 2),
    ("autoep-qwen3-moe-ep2-z1-bf16-fp32accum", 4, 4, 2), ("autoep-qwen3-moe-ep2-z1-bf16-fp32accum", 2, 1, 3),
])
def test_bf16_optimizer_to_zero23_and_back_at_zero1_gives_its_files(expert_fixtures, name: str, world_size: int,
                                                                     ep: int, stage: int, tmp_path: Path) -> None:
    """BF16_Optimizer's expert checkpoint written at ZeRO-2 or 3 (another degree too), and that written back
    at ZeRO-1 at the source's shape, where its config gets BF16_Optimizer again: the source's files, field for
    field and byte for byte."""
    source = expert_fixtures[name]
    reshard(str(source.dir), str(tmp_path / "other"), world_size=world_size, ep=ep, stage=stage)
    assert load_index(str(tmp_path / "other")).zero.optimizer_kind != BF16
    reshard(str(tmp_path / "other"), str(tmp_path / "back"), world_size=2, ep=2, stage=1)
    _compare_folders(tmp_path / "back" / "global_step3", source.tag_dir)


def test_expert_stage_refusals(expert_fixtures) -> None:
    """deepspeed.moe at ZeRO-3 is refused as DeepSpeed refuses it, naming what it would write instead."""
    moe = load_index(str(expert_fixtures["dsmoe-ep2-z2-fp32"].dir))
    with pytest.raises(UnsupportedCheckpointError, match=r"to 2 ranks, ZeRO-3: DeepSpeed refuses deepspeed.moe layers "
                                                         r"at ZeRO-3 \(\"Native DeepSpeed MoE is not supported with "
                                                         r"ZeRO Stage 3. Use AutoEP or choose ZeRO stage 1/2.\"\), so "
                                                         r"a deepspeed.moe checkpoint is written at ZeRO-1 or ZeRO-2 "
                                                         r"only; shapes it can write at 2 ranks: ZeRO-2 dp2 \(2 ranks\), "
                                                         r"ZeRO-2 ep2 x edp1 \(2 ranks\), ZeRO-1 dp2 \(2 ranks\), "
                                                         r"ZeRO-1 ep2 x edp1 \(2 ranks\)$"):
        plan_reshard(moe, Target(world_size=2, stage=3))


# (source, world size, ZeRO stage, DeepSpeed's own save of the same model at that shape).
STAGE_TWINS = [
    ("autoep-qwen3-moe-ep2-z2-fp32", 2, 3, "autoep-qwen3-moe-ep2-z3-fp32"),
    ("autoep-mixtral-ep2-z2-fp32", 4, 3, "autoep-mixtral-ep2dp2-z3-fp32"),
    ("autoep-qwen3-moe-ep2-z3-fp32", 2, 2, "autoep-qwen3-moe-ep2-z2-fp32"),
    ("autoep-mixtral-ep2dp2-z3-fp32", 2, 2, "autoep-mixtral-ep2-z2-fp32"),
]


@pytest.mark.parametrize(("name", "world_size", "stage", "theirs"), STAGE_TWINS)
def test_autoep_at_another_stage_is_what_deepspeed_writes_there(expert_fixtures, name: str, world_size: int,
                                                                stage: int, theirs: str, tmp_path: Path) -> None:
    """AutoEP ZeRO-2 -> ZeRO-3 and ZeRO-3 -> ZeRO-2 at its own expert-parallel degree, on as many ranks, twice
    as many or half: every file, key, shape and metadata field (ZeRO-3: ds_zero_partition_groups, each rank's
    zero3_partitioned ds_autoep_layers, no expert files; ZeRO-2: one file per MoE layer and global expert,
    rank 0's module) is what DeepSpeed saves training the same model at that shape, and the weights
    consolidated from it are the source's live engine's, bit for bit."""
    source = expert_fixtures[name]
    reshard(str(source.dir), str(tmp_path / "out"), world_size=world_size, stage=stage)
    _compare_folders(tmp_path / "out" / "global_step3", expert_fixtures[theirs].tag_dir, values=False,
                     ignore=("global_samples",))
    assert _shape_types(tmp_path / "out" / "global_step3") == _shape_types(expert_fixtures[theirs].tag_dir)
    consolidate(str(tmp_path / "out"), str(tmp_path / "hf"), options=ConsolidateOptions(dtype="fp32", workers=2))
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    for key, tensor in _fp32(source).items():
        assert torch.equal(weights[key], tensor), key


def test_autoep_zero1_to_zero3_writes_the_bytes_zero2_to_zero3_writes(expert_fixtures, tmp_path: Path) -> None:
    """ZeRO-1 (here written from the ZeRO-2 fixture) and ZeRO-2 hold the same flat partitions, so both go to
    the same ZeRO-3 files, byte for byte (ZeRO-1's frozen-parameter records are None, ZeRO-3's empty)."""
    source = expert_fixtures["autoep-qwen3-moe-ep2-z2-fp32"]
    reshard(str(source.dir), str(tmp_path / "z1"), world_size=2, stage=1)
    reshard(str(tmp_path / "z1"), str(tmp_path / "from-z1"), world_size=4, stage=3)
    reshard(str(source.dir), str(tmp_path / "from-z2"), world_size=4, stage=3)
    names = sorted(p.name for p in (tmp_path / "from-z2" / "global_step3").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "from-z1" / "global_step3").iterdir()) and len(names) == 8
    for name in names:
        assert (tmp_path / "from-z1" / "global_step3" / name).read_bytes() == (
            tmp_path / "from-z2" / "global_step3" / name).read_bytes(), name


@pytest.mark.parametrize(("name", "world_size"), [("autoep-qwen3-moe-ep2-z2-fp32", 2), ("autoep-mixtral-ep2-z2-fp32", 4),
                                                 ("autoep-qwen3-moe-ep2-z2-bf16", 4)])
def test_autoep_zero2_to_zero3_and_back_gives_the_source_s_files(expert_fixtures, name: str, world_size: int,
                                                                tmp_path: Path) -> None:
    """ZeRO-2 -> ZeRO-3 (on `world_size` ranks) -> ZeRO-2 on the source's ranks writes DeepSpeed's ZeRO-2 files
    back field for field and byte for byte: the flat partitions and moments, rank 0's module (each tensor
    its own clone of the fp32 masters, cast to bf16 as DeepSpeed casts them; the router's second copy too),
    and every expert's own file, rebuilt from the ZeRO-3 pieces."""
    source = expert_fixtures[name]
    reshard(str(source.dir), str(tmp_path / "z3"), world_size=world_size, stage=3)
    reshard(str(tmp_path / "z3"), str(tmp_path / "z2"), world_size=2, stage=2)
    _compare_folders(tmp_path / "z2" / "global_step3", source.tag_dir)


# (source, ranks and degree on the way, ranks back): an expert-parallel degree change at ZeRO-3 and back
# (ZeRO-2 -> ZeRO-3 ep4 -> ZeRO-2 ep2; ZeRO-3 -> ZeRO-3 ep4 or ep1 -> ZeRO-3 ep2) gives the source's files.
DEGREE_ROUND_TRIPS = [
    ("autoep-qwen3-moe-ep2-z2-fp32", 3, 4, 4), ("autoep-qwen3-moe-ep2-z2-bf16", 3, 4, 4),
    ("autoep-mixtral-ep2dp2-z3-fp32", 3, 4, 4), ("autoep-qwen3-moe-ep2-z3-fp32", 3, 2, 1),
    ("autoep-qwen3-moe-ep2-z3-fp32", 2, 4, 4),
]


@pytest.mark.parametrize(("name", "stage", "world_size", "ep"), DEGREE_ROUND_TRIPS)
def test_an_expert_degree_change_at_zero3_and_back_gives_the_source_s_files(expert_fixtures, name: str, stage: int,
                                                                            world_size: int, ep: int,
                                                                            tmp_path: Path) -> None:
    """Out to ZeRO-`stage` at degree `ep` on `world_size` ranks and back to the source's stage, ranks and
    degree: DeepSpeed's files of the source field for field and byte for byte (flat partitions, moments,
    ds_zero_partition_groups, each rank's ds_autoep_layers, the module, every expert's own file), so
    every element went to the rank that owns it at `ep` and came back."""
    source = expert_fixtures[name]
    index = load_index(str(source.dir))
    reshard(str(source.dir), str(tmp_path / "out"), world_size=world_size, stage=stage, ep=ep)
    there = load_index(str(tmp_path / "out"))
    assert (there.stage, there.ep, there.world_size) == (stage, ep, world_size)
    reshard(str(tmp_path / "out"), str(tmp_path / "back"), world_size=index.world_size, stage=index.stage, ep=index.ep)
    _compare_folders(tmp_path / "back" / "global_step3", source.tag_dir)


def test_the_zero3_degree_plan_names_the_source_fragments_of_each_new_expert(expert_fixtures) -> None:
    """ZeRO-3 ep2 x edp2 -> ZeRO-3 ep4 x edp1 on 4 ranks: rank r holds global expert r of each layer (one
    row of each stacked weight, its whole ZeRO-3 piece, no expert data parallelism left), read from the
    two source ranks of expert-parallel rank r // 2 that hold row r % 2's halves."""
    index = load_index(str(expert_fixtures["autoep-mixtral-ep2dp2-z3-fp32"].dir))
    plan = plan_reshard(index, Target(world_size=4, ep=4))
    assert (plan.stage, plan.group_ep, plan.carried) == (3, (1, 1, 4), ())
    w1 = index.zero.param_by_key[(0, "model.layers.0.mlp.experts.w1")]
    row = w1.numel // w1.shape[0]
    for unit in plan.units:
        experts = unit.flats[2]
        held = {(c.src_rank, c.src_flat) for c in experts.copies}
        assert {rank for rank, _ in held} <= {unit.rank // 2, unit.rank // 2 + 2}, held
        first = sum(min(c.dst_offset + c.numel, row) - c.dst_offset for c in experts.copies if c.dst_offset < row)
        assert first == row  # layer 0's w1 leads the group: the whole of expert `unit.rank`'s row
    osd = plan.index.optim_states[0]["optimizer_state_dict"]
    assert [g["name"] for g in osd["optimizer_state_dict"]["param_groups"]] == ["decay", "no_decay", "ep_size_4"]
    assert [g["group_names"] for g in osd["ds_zero_partition_groups"]] == [["replicated"], ["replicated"],
                                                                         ["ep_size_4"]]


def test_autoep_zero3_at_another_degree_is_what_deepspeed_writes_at_zero2_there(expert_fixtures,
                                                                                tmp_path: Path) -> None:
    """AutoEP ZeRO-3 ep2 x edp2 -> ZeRO-2 ep4 on 4 ranks has the files, keys, shapes and metadata of the
    held-out ZeRO-2 ep4 checkpoint DeepSpeed wrote (another seed: values aside), and the source's weights."""
    source = expert_fixtures["autoep-mixtral-ep2dp2-z3-fp32"]
    reshard(str(source.dir), str(tmp_path / "out"), world_size=4, stage=2, ep=4)
    theirs = expert_fixtures["autoep-mixtral-ep4-z2-fp32-s2"].tag_dir
    _compare_folders(tmp_path / "out" / "global_step3", theirs, values=False, ignore=("global_samples",))
    assert _shape_types(tmp_path / "out" / "global_step3") == _shape_types(theirs) == {
        "mp_rank_00_model_states.pt": ["tuple"]}
    consolidate(str(tmp_path / "out"), str(tmp_path / "hf"), options=ConsolidateOptions(dtype="fp32", workers=2))
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    for key, tensor in _fp32(source).items():
        assert torch.equal(weights[key], tensor), key


RR = "autoep-qwen3-moe-ep2dp2-z2-fp32-rr"


def test_a_round_robin_source_is_laid_out_again_over_each_group_s_target_ranks(expert_fixtures) -> None:
    """AutoEP ZeRO-2 ep2 x edp2 trained with round_robin_gradients: DeepSpeed flattened its expert group
    round-robin over the 2 ranks of its expert data-parallel group and its dense groups over all 4
    (`_configure_moe_settings` sets the expert group's ranks before the groups are flattened). At the
    target each group is flattened as DeepSpeed's `_round_robin_reorder` orders the optimizer's list over
    the group's ranks there: over 4 at ep1 (ZeRO-1), over 1 at ep4; ZeRO-3 takes the optimizer's list."""
    index = load_index(str(expert_fixtures[RR].dir))
    saved = [list(g.params) for g in index.zero.groups]
    # The optimizer's list: the one whose round-robin over the source's ranks is what the source saved.
    listed = [deepspeed_undone(names, ranks) for names, ranks in zip(saved, (4, 4, 2))]
    # The expert group undone over its 2 ranks is the model's order (each layer's w1, w2, w3); saved, it is not.
    assert listed[2] == [f"model.layers.{layer}.mlp.experts.{w}" for layer in (0, 1) for w in ("w1", "w2", "w3")]
    assert saved[2] != listed[2]
    for target, ranks in ((Target(world_size=4, ep=1, stage=1), (4, 4, 4)), (Target(world_size=4, ep=4), (4, 4, 1)),
                          (Target(world_size=2), (2, 2, 1))):
        plan = plan_reshard(index, target)
        assert [[n for n, _ in g] for g in plan.flat_shapes] == [
            deepspeed_round_robin(names, n) for names, n in zip(listed, ranks)], target
    for target in (Target(world_size=4, stage=3), Target(world_size=4, ep=4, stage=3)):
        assert [[n for n, _ in g] for g in plan_reshard(index, target).flat_shapes] == listed, target


@pytest.mark.parametrize(("stage", "world_size", "ep"), [(1, 4, 1), (2, 4, 4), (3, 4, 4), (3, 2, 2)])
def test_a_round_robin_source_to_another_degree_and_stage_and_back_gives_its_files(expert_fixtures, stage: int,
                                                                                   world_size: int, ep: int,
                                                                                   tmp_path: Path) -> None:
    """The round-robin source out to ZeRO-`stage` ep`ep` on `world_size` ranks and back: DeepSpeed's files of
    the source field for field and byte for byte (flat partitions in its round-robin order, moments,
    param_slice_mappings, the module, every expert's own file)."""
    source = expert_fixtures[RR]
    reshard(str(source.dir), str(tmp_path / "out"), world_size=world_size, stage=stage, ep=ep)
    there = load_index(str(tmp_path / "out"))
    assert (there.stage, there.ep, there.world_size) == (stage, ep, world_size)
    reshard(str(tmp_path / "out"), str(tmp_path / "back"), world_size=4, stage=2, ep=2)
    _compare_folders(tmp_path / "back" / "global_step3", source.tag_dir)


@pytest.mark.skipif(not long_mode(), reason="fixtures of the long mode's round-robin-ignored set")
@pytest.mark.parametrize(("name", "target", "ranks"), [
    ("autoep-qwen3-moe-ep2-z3-fp32-rr", Target(world_size=2, ep=1, stage=2), (2, 2, 2)),
    ("autoep-qwen3-moe-ep2-z3-fp32-rr", Target(world_size=4, stage=2), (4, 4, 2)),
    ("autoep-qwen3-moe-ep2-z3-fp32-rr", Target(world_size=4, stage=1), (4, 4, 2)),
    ("autoep-qwen3-moe-ep2-z1-bf16-fp32accum-rr", Target(world_size=2, ep=1, stage=2), (2, 2, 2)),
    ("autoep-qwen3-moe-ep2-z1-bf16-fp32accum-rr", Target(world_size=2, stage=2), (2, 2, 1)),
    ("dsmoe-ep2-z1-bf16-fp32accum-rr", Target(world_size=4, ep=1, stage=2), (4, 4, 4, 4)),
])
def test_a_source_that_ignored_round_robin_is_laid_out_round_robin_at_a_zero12_target(
        expert_fixtures, name: str, target: Target, ranks: tuple[int, ...]) -> None:
    """AutoEP ZeRO-3 and BF16_Optimizer ignore the round_robin_gradients their config sets: the source is
    saved in the optimizer's own order (`is_round_robin` false), and at a ZeRO-1/2 target, which DeepSpeed
    builds from that config with DeepSpeedZeroOptimizer, each group is flattened as `_round_robin_reorder`
    orders the optimizer's list over the group's target ranks."""
    index = load_index(str(expert_fixtures[name].dir))
    assert index.zero.zero_config.get("round_robin_gradients") is True and not index.zero.is_round_robin
    listed = [list(g.params) for g in index.zero.groups]
    plan = plan_reshard(index, target)
    assert plan.optimizer == "zero" and plan.stage == target.stage
    # at ep1 the expert group holds both expert-parallel ranks' experts, listed in the optimizer's order
    order = listed if target.ep is None else [list(g.params) for g in plan.index.groups]
    assert [[n for n, _ in g] for g in plan.flat_shapes] == [
        deepspeed_round_robin(names, n) for names, n in zip(order, ranks)]
    assert any(deepspeed_round_robin(names, n) != names for names, n in zip(order, ranks))


@pytest.mark.skipif(not long_mode(), reason="fixtures of the long mode's round-robin-ignored set")
@pytest.mark.parametrize(("world_size", "ep"), [(2, 1), (4, 2), (4, 4)])
def test_a_zero3_source_that_ignored_round_robin_to_a_round_robin_zero2_and_back_gives_its_files(
        expert_fixtures, world_size: int, ep: int, tmp_path: Path) -> None:
    """AutoEP ZeRO-3 (round_robin_gradients set, ignored) out to a round-robin ZeRO-2 at ep`ep` on
    `world_size` ranks and back to ZeRO-3 ep2 on 2 ranks: DeepSpeed's files of the source field for field
    and byte for byte, so the round-robin order written is the one read back."""
    source = expert_fixtures["autoep-qwen3-moe-ep2-z3-fp32-rr"]
    reshard(str(source.dir), str(tmp_path / "out"), world_size=world_size, stage=2, ep=ep)
    there = load_index(str(tmp_path / "out"))
    assert (there.stage, there.ep, there.world_size, there.zero.is_round_robin) == (2, ep, world_size, True)
    reshard(str(tmp_path / "out"), str(tmp_path / "back"), world_size=2, stage=3, ep=2)
    _compare_folders(tmp_path / "back" / "global_step3", source.tag_dir)


def test_the_zero3_plan_cuts_each_expert_rank_s_experts_over_its_expert_data_parallel_group(expert_fixtures) -> None:
    """ep2 x edp1 ZeRO-2 -> ep2 x edp2 ZeRO-3: rank r holds half (piece r // 2) of expert-parallel rank r % 2's
    stacked expert weights, copied from the source rank that held them; the dense groups are cut over all 4."""
    index = load_index(str(expert_fixtures["autoep-qwen3-moe-ep2-z2-fp32"].dir))
    plan = plan_reshard(index, Target(world_size=4, stage=3))
    assert (plan.stage, plan.group_ep, plan.carried) == (3, (1, 1, 2), ())
    for unit in plan.units:
        experts = unit.flats[2]
        assert {c.src_rank for c in experts.copies} == {unit.rank % 2}
        w1 = index.zero.param_by_key[(unit.rank % 2, "model.layers.0.mlp.experts.w1")]
        first = experts.copies[0]  # layer 0's w1 leads the group: the piece of it this rank's partition holds
        assert (first.dst_offset, first.src_offset - w1.fragments[0].offset) == (0, unit.rank // 2 * w1.numel // 2)
        assert {c.src_rank for f in unit.flats[:2] for c in f.copies} <= {0, 1}
    assert sum(f.numel for u in plan.units for f in u.flats[:2]) == sum(
        p.numel for p in index.zero.params if p.group in (0, 1) and not p.frozen)


# ---- DeepSpeed's size cut of expert param groups at another degree --------------------------------------
# DeepSpeed cuts an expert param group into several past 178,956,971 rank-local elements
# (`split_params_into_different_moe_groups_for_optimizer`), so a real-size MoE model's groups differ with
# the expert-parallel degree (the 0.49B AutoEP benchmark model's ep_size_2 group is cut in two, its ep4 one
# is not). The fixtures' groups are far smaller: these tests lower the limit, DeepSpeed's default patched
# in the oracle's launch ("max_group_size") and ckptflow's assumed default (`moe_cut.MAX_MOE_GROUP_SIZE`)
# alike where the test means "DeepSpeed's default", or DeepSpeed's alone where ckptflow must infer it.

# The autoep-qwen3-moe-ep2-z2-fp32 expert group: 6 stacked weights of 3,072 elements at ep2 (18,432 in
# all), 6,144 each at ep1. At a limit of 20,000 ep2 is not cut and ep1 is cut in two (3 + 3).
LIMIT = 20_000


@pytest.mark.parametrize(("numels", "limit"), [
    ((5, 5, 5), 10), ((5, 5, 5), 15), ((3, 9, 2, 2, 11, 1), 10), ((12, 3, 4), 10), ((4, 12, 3), 10), ((7,), 7),
])
def test_the_cut_is_deepspeed_s(numels: tuple[int, ...], limit: int) -> None:
    """`moe_cut.cut` against DeepSpeed's own function on parameters of those sizes: the same pieces, the
    empty group DeepSpeed makes when the first parameter alone passes the limit included."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    from ckptflow.reshard.moe_cut import cut

    params = []
    for n in numels:
        param = torch.nn.Parameter(torch.zeros(n))
        param.allreduce, param.group_name = False, "ep_size_2"  # what deepspeed.moe marks its experts with
        params.append(param)
    groups = split_params_into_different_moe_groups_for_optimizer({"name": "decay", "params": params}, limit)
    assert cut(numels, limit)[0] == tuple(len(g["params"]) for g in groups[1:])
    assert all(g["name"] == "ep_size_2" and g["moe"] for g in groups[1:])


def test_the_limit_is_inferred_from_the_source_s_cuts() -> None:
    """DeepSpeed's default where it reproduces the source's cuts; else the range of limits that does, and
    a target cut only where the whole range cuts it alike."""
    from ckptflow.reshard.moe_cut import MAX_MOE_GROUP_SIZE, recut

    cut_at_10000 = [[[3072] * 3, [3072] * 3]]  # 6 x 3,072 cut at 10,000: any limit from 9,216 to 12,287
    assert recut(cut_at_10000, [[6144] * 6], 1).pieces == ((1,) * 6,)
    assert recut(cut_at_10000, [[1536] * 6], 4).pieces == ((6,),)
    assert recut(cut_at_10000, [[1536] * 6], 4).limit == 9216
    unknown = recut(cut_at_10000, [[2048] * 9], 3)  # 10,240 is in the range
    assert unknown.pieces == () and unknown.why == (
        f"its expert param groups were cut at a size limit from 9,216 to 12,287 elements, not DeepSpeed's default size "
        f"limit of an expert param group ({MAX_MOE_GROUP_SIZE:,} elements), which the checkpoint does not record, and "
        f"the limits in that range cut them differently at ep3")
    assert recut([[[10] * 3]], [[20] * 3], 1).pieces == ((3,),)  # DeepSpeed's default: nothing cut
    big = MAX_MOE_GROUP_SIZE  # uncut past the default: built with a larger limit or none
    assert recut([[[big, 1]]], [[big // 4] * 4], 4).pieces == ((4,),)
    assert "hold up to 178,956,972 elements uncut" in str(recut([[[big, 1]]], [[big, big, 2]], 1).why)
    assert recut([[[5], [5, 5]]], [[5] * 3], 1).why == (
        "its expert param groups are not cut as DeepSpeed's split_params_into_different_moe_groups_for_optimizer "
        "cuts them at any size limit")  # 5 + 5 fits wherever the second piece's 10 does
    assert "where DeepSpeed makes an empty param group" in str(recut([[[4], [4]]], [[16]], 1).why)


def test_a_cut_target_is_planned_as_deepspeed_groups_it(expert_fixtures, monkeypatch) -> None:
    """ep2 -> ep1 at a limit of 20,000: the expert group becomes two, each with its source group's
    hyper-parameters and name, and each parameter's elements copied from the source rank that held them;
    `--plan` offers the shape, and the other degrees whose cut it cannot tell are refused there."""
    from ckptflow.reshard import moe_cut
    from ckptflow.reshard.shape import shapes_at

    index = load_index(str(expert_fixtures["autoep-qwen3-moe-ep2-z2-fp32"].dir))
    monkeypatch.setattr(moe_cut, "MAX_MOE_GROUP_SIZE", LIMIT)
    plan = plan_reshard(index, Target(world_size=2, ep=1))
    assert plan.group_ep == (1, 1, 1, 1)
    assert [len(shapes) for shapes in plan.flat_shapes] == [12, 9, 3, 3]
    groups = plan.index.optim_states[0]["optimizer_state_dict"]["base_optimizer_state"]["param_groups"]
    source = index.zero.optim_states[0]["optimizer_state_dict"]["base_optimizer_state"]["param_groups"]
    assert groups[2:] == [{**source[2], "name": "ep_size_1"}] * 2
    assert [g.index for g in plan.index.groups] == [0, 1, 2, 2]
    for unit in plan.units:  # expert data-parallel 2: each rank half of each group, from both source ranks
        assert [f.numel for f in unit.flats[2:]] == [3 * 6144 // 2] * 2
    assert {s.ep: why for s, why in shapes_at(index, 2) if s.stage == 2}[1] is None
    monkeypatch.setattr(moe_cut, "MAX_MOE_GROUP_SIZE", 10_000)
    assert "cut them differently at ep1" in str({s.ep: why for s, why in shapes_at(index, 2) if s.stage == 2}[1])


def test_a_degree_whose_cut_is_unknown_is_refused(expert_fixtures, monkeypatch, tmp_path: Path) -> None:
    """At a default of 10,000 the source (18,432 elements, uncut) was built with another limit, 18,432 or
    more, and at ep1 those limits cut its 6 x 6,144 differently: refused in one line, nothing written."""
    from ckptflow.reshard import moe_cut

    source = expert_fixtures["autoep-qwen3-moe-ep2-z2-fp32"]
    monkeypatch.setattr(moe_cut, "MAX_MOE_GROUP_SIZE", 10_000)
    with pytest.raises(UnsupportedCheckpointError, match=r"to 4 ranks, ep1: its expert param groups hold up to 18,432 "
                                                         r"elements uncut, past DeepSpeed's default size limit of an "
                                                         r"expert param group \(10,000 elements\), so they were built "
                                                         r"with a larger limit or none, which the checkpoint does not "
                                                         r"record, and the limits in that range cut them differently "
                                                         r"at ep1; shapes it can write at 4 ranks: ZeRO-2 ep2 x edp2"):
        reshard(str(source.dir), str(tmp_path / "out"), world_size=4, ep=1)
    assert not (tmp_path / "out").exists()
    plan = plan_reshard(load_index(str(source.dir)), Target(world_size=4, ep=4))  # 9,216 at ep4: no cut at any
    assert plan.group_ep == (1, 1, 4)


@pytest.mark.parametrize(("name", "stage", "limit"), [
    ("autoep-qwen3-moe-ep2-z2-fp32", 2, LIMIT), ("autoep-qwen3-moe-ep2-z3-fp32", 3, LIMIT),
    ("autoep-qwen3-moe-ep2-z3-fp32", 2, LIMIT), ("dsmoe-ep2-z2-fp32", 1, 4000),
])
def test_a_cut_degree_change_and_back_gives_the_source_s_files(expert_fixtures, monkeypatch, name: str, stage: int,
                                                               limit: int, tmp_path: Path) -> None:
    """To ep1 on 2 ranks at ZeRO-`stage` (the expert group cut in two at `limit`, ckptflow assuming it as
    DeepSpeed's default) and back to the source's stage and ep2, where the two join again: the source's
    files field for field and byte for byte. On the way back ckptflow assumes DeepSpeed's real default,
    which the ep1 cut rules out, and infers the limit from the cut (AutoEP: 3 + 3 weights of 6,144, any
    limit from 18,432 to 24,575; deepspeed.moe: 10 + 6 of 384, from 3,840 to 4,223)."""
    from ckptflow.reshard import moe_cut

    source = expert_fixtures[name]
    index = load_index(str(source.dir))
    monkeypatch.setattr(moe_cut, "MAX_MOE_GROUP_SIZE", limit)
    reshard(str(source.dir), str(tmp_path / "out"), world_size=2, stage=stage, ep=1)
    there = load_index(str(tmp_path / "out"))
    assert len(there.zero.groups) == len(index.zero.groups) + 1
    monkeypatch.setattr(moe_cut, "MAX_MOE_GROUP_SIZE", 178_956_971)  # the cut alone tells the limit now
    reshard(str(tmp_path / "out"), str(tmp_path / "back"), world_size=index.world_size, stage=index.stage, ep=index.ep)
    _compare_folders(tmp_path / "back" / "global_step3", source.tag_dir)


# (source fixture, world size, degree, ZeRO stage, DeepSpeed's limit, ckptflow's assumed default or None):
# the source resharded to a degree DeepSpeed cuts otherwise, then DeepSpeed launched at that shape with
# that limit loads it natively. By default one launch, AutoEP ZeRO-2 ep2 (uncut) -> ZeRO-2 ep1 (cut in
# two); `CKPTFLOW_LONG=1` adds ZeRO-3 ep1 and deepspeed.moe (ep2 -> ep1: 16 x 384 cut at 4,000 into
# 10 + 6 parameters, the bias group not cut).
ALL_CUT_RESHARDS = (
    ("autoep-qwen3-moe-ep2-z2-fp32", 2, 1, 2, LIMIT), ("autoep-qwen3-moe-ep2-z2-fp32", 2, 1, 3, LIMIT),
    ("dsmoe-ep2-z2-fp32", 2, 1, 2, 4000),
)
CUT_RESHARDS = sample(ALL_CUT_RESHARDS, [("autoep-qwen3-moe-ep2-z2-fp32", 2, 1, 2, LIMIT)])


def _cut_case_id(case: tuple[Any, ...]) -> str:
    return f"{case[0]}-to{case[1]}-ep{case[2]}-z{case[3]}-limit{case[4]}"


class CutOracle:
    """Reshards every case (ckptflow assuming the case's limit as DeepSpeed's default), then launches
    DeepSpeed once on 2 ranks with each case's limit: it loads each output, gathers its state and saves
    it again, and trains the same model from scratch at that shape and saves it (`written`)."""

    def __init__(self, fixtures: Mapping[str, ParallelFixture], root: Path) -> None:
        self.fixtures, self.root, self.ran = fixtures, root, False

    def paths(self, case: tuple[Any, ...]) -> dict[str, Path]:
        name = _cut_case_id(case)
        return {"out": self.root / "out" / name, "resaved": self.root / "resaved" / name,
                "state": self.root / "state" / f"{name}.safetensors", "written": self.root / "written" / name}

    def __call__(self, case: tuple[Any, ...]) -> dict[str, Path]:
        if not self.ran:
            self.ran = True
            self._run()
        return self.paths(case)

    def _run(self) -> None:
        from ckptflow.reshard import moe_cut

        (self.root / "state").mkdir(parents=True)
        items: list[dict[str, Any]] = []
        for case in CUT_RESHARDS:
            name, world_size, ep, stage, limit = case
            fixture, paths = self.fixtures[name], self.paths(case)
            default, moe_cut.MAX_MOE_GROUP_SIZE = moe_cut.MAX_MOE_GROUP_SIZE, limit
            try:
                reshard(str(fixture.dir), str(paths["out"]), world_size=world_size, ep=ep, stage=stage)
            finally:
                moe_cut.MAX_MOE_GROUP_SIZE = default
            shape = {"spec": str(fixture.root / "spec.json"), "ep": ep, "stage": stage, "max_group_size": limit}
            items.append({**shape, "load": str(paths["out"]), "save": str(paths["resaved"]),
                          "state": str(paths["state"]), "hang_after": 300})
            items.append({**shape, "write": str(paths["written"])})
        (self.root / "jobs.json").write_text(json.dumps(items, indent=1))
        launch("tests.oracles.expert_reshard", 2, ["--jobs", str(self.root / "jobs.json")],
               log_dir=self.root / "logs", timeout=900)


@pytest.fixture(scope="session")
def cut_oracle(expert_fixtures, tmp_path_factory) -> CutOracle:
    return CutOracle(expert_fixtures, tmp_path_factory.mktemp("expert-cut-oracle"))


@pytest.mark.parametrize("case", CUT_RESHARDS, ids=_cut_case_id)
def test_deepspeed_loads_expert_groups_cut_at_the_new_degree(expert_fixtures, cut_oracle, case) -> None:
    """DeepSpeed, cutting the expert groups at the case's limit, loads the output natively and holds the
    source's fp32 weights and Adam moments bit for bit, saves exactly our files again, and trained from
    scratch at that shape writes the same files, groups and metadata (more groups than the source's)."""
    fixture = expert_fixtures[case[0]]
    paths = cut_oracle(case)
    state, expected = load_file(paths["state"]), load_file(fixture.expected_path)
    buffers = load_file(fixture.buffers_path)
    assert set(state) == set(expected) | {f"buffer/{k}" for k in buffers}
    for key, tensor in expected.items():
        assert torch.equal(state[key], tensor), key
    tag = (paths["out"] / "latest").read_text()
    _compare_folders(paths["out"] / tag, paths["resaved"] / tag)
    _compare_folders(paths["out"] / tag, paths["written"] / tag, values=False, ignore=("global_samples",))
    source_groups = len(load_index(str(fixture.dir)).zero.groups)
    assert len(load_index(str(paths["out"])).zero.groups) == source_groups + 1


# A source DeepSpeed cut (AutoEP ZeRO-2 ep2, 2 ranks, limit 10,000: the expert group in 3 + 3), written in
# the test; ckptflow, assuming nothing, infers the limit (9,216 to 12,287) and writes ep1 (6 groups of one
# weight) at ZeRO-2 and ZeRO-3, and DeepSpeed at that limit loads both. Long mode only: two launches.
CUT_SOURCE_TARGETS = [(2, 1), (3, 1)]


@pytest.fixture(scope="session")
def cut_source_oracle(expert_fixtures, tmp_path_factory) -> SourceOracle:
    """AutoEP ZeRO-2 ep2 trained with its expert group cut at 10,000 elements, and its targets."""
    return SourceOracle(expert_fixtures, tmp_path_factory.mktemp("expert-cut-source-oracle"),
                        "autoep-qwen3-moe-ep2-z2-fp32", {"max_group_size": 10_000}, CUT_SOURCE_TARGETS)


@pytest.mark.skipif(not long_mode(), reason="two DeepSpeed launches of their own: long mode (CKPTFLOW_LONG=1)")
@pytest.mark.parametrize(("stage", "ep"), CUT_SOURCE_TARGETS)
def test_a_source_deepspeed_cut_is_recut_at_the_limit_its_cuts_imply(cut_source_oracle, stage: int, ep: int) -> None:
    """The source's group, cut in two (3 + 3 weights), becomes six at ep1, the limit inferred from the cut
    (not DeepSpeed's default, which would cut nothing); DeepSpeed holds the source's state bit for bit,
    saves exactly our files again, and trained there writes the same files and metadata."""
    _, out = cut_source_oracle.check(stage, ep)
    assert len(load_index(str(cut_source_oracle() / "source")).zero.groups) == 4
    assert len(load_index(str(out.parent)).zero.groups) == 8


# A round-robin source DeepSpeed cut (deepspeed.moe ZeRO-1 ep2 x edp2 on 4 ranks, round_robin_gradients, limit
# 2,000: the expert weight group's 8 x 384 in 5 + 3, each piece flattened round-robin over its 2 expert
# data-parallel ranks), written in the test; ckptflow infers the limit (1,920 to 2,303), undoes each piece's
# order over its source ranks and writes ep4 (one uncut group of 4, over 1 rank) at ZeRO-2 and ep1 (16 in
# 5 + 5 + 5 + 1, each piece round-robin over 4 ranks) at ZeRO-1, and DeepSpeed at that limit loads both.
# Long mode only: two launches on 4 ranks.
RR_CUT_LIMIT = 2000
RR_CUT_TARGETS = [(2, 4), (1, 1)]


@pytest.fixture(scope="session")
def rr_cut_oracle(expert_fixtures, tmp_path_factory) -> SourceOracle:
    """deepspeed.moe ZeRO-1 ep2 x edp2 trained with round-robin gradients and its expert groups cut at 2,000
    elements, and its targets."""
    return SourceOracle(expert_fixtures, tmp_path_factory.mktemp("expert-rr-cut-oracle"), "dsmoe-ep2dp2-z1-fp32-rr",
                        {"round_robin": True, "max_group_size": RR_CUT_LIMIT}, RR_CUT_TARGETS, world_size=4)


def _cut_groups(index: Any) -> list[tuple[int, ...]]:
    """Per expert param group: (parameters, ranks it is flattened over, whether that order is not the
    optimizer's)."""
    zero = index.zero
    listed = zero.in_optimizer_order()
    return [(len(g.params), zero.world_size // g.ep, int(g.params != o.params))
            for g, o in zip(zero.groups, listed.groups) if g.ep > 1 or g.hyper.get("moe")]


@pytest.mark.skipif(not long_mode(), reason="two DeepSpeed launches of their own: long mode (CKPTFLOW_LONG=1)")
@pytest.mark.parametrize(("stage", "ep"), RR_CUT_TARGETS)
def test_a_round_robin_source_cut_otherwise_is_laid_out_per_cut_group(rr_cut_oracle, stage: int, ep: int) -> None:
    """Each cut group flattened round-robin on its own: undone per source piece, the groups cut again at the
    target's degree and each flattened round-robin over its target ranks. DeepSpeed at that degree and limit
    holds the source's state bit for bit, saves exactly our files again, and trained there writes the same
    files, groups and metadata."""
    _, out = rr_cut_oracle.check(stage, ep)
    # the source: weights 5 + 3 (each reordered over 2 ranks), biases 8 uncut (reordered)
    assert _cut_groups(load_index(str(rr_cut_oracle() / "source"))) == [(5, 2, 1), (3, 2, 1), (8, 2, 1)]
    assert _cut_groups(load_index(str(out.parent))) == {
        4: [(4, 1, 0), (4, 1, 0)], 1: [(5, 4, 1), (5, 4, 1), (5, 4, 1), (1, 4, 0), (16, 4, 1)]}[ep]


@pytest.mark.skipif(not long_mode(), reason="two DeepSpeed launches of their own: long mode (CKPTFLOW_LONG=1)")
@pytest.mark.parametrize(("stage", "ep", "limit"), [(2, 4, RR_CUT_LIMIT), (1, 1, None)])
def test_a_round_robin_source_cut_otherwise_and_back_gives_its_files(rr_cut_oracle, monkeypatch, stage: int, ep: int,
                                                                     limit: int | None, tmp_path: Path) -> None:
    """The targets of the round-robin cut source back to ep2 x edp2 at ZeRO-1: its files field for field and
    byte for byte, each piece flattened round-robin over its 2 ranks again. From ep4 (uncut, so the limit is
    not in it) ckptflow assumes 2,000 as DeepSpeed's default; from ep1 it infers it from the cut."""
    from ckptflow.reshard import moe_cut

    root = rr_cut_oracle()
    if limit is not None:
        monkeypatch.setattr(moe_cut, "MAX_MOE_GROUP_SIZE", limit)
    reshard(str(root / "out" / f"z{stage}-ep{ep}"), str(tmp_path / "back"), world_size=4, stage=1, ep=2)
    tag = (root / "source" / "latest").read_text()
    _compare_folders(tmp_path / "back" / tag, root / "source" / tag)


@pytest.mark.skipif(not long_mode(), reason="fixtures of the long mode's bf16-optimizer set")
@pytest.mark.parametrize("name", ["dsmoe-ep2-z1-bf16-fp32accum", "autoep-qwen3-moe-ep2-z1-bf16-fp32accum"])
def test_zero1_with_another_expert_degree_where_the_config_gets_bf16_optimizer_is_its_files(
        name: str, tmp_path: Path) -> None:
    """BF16_Optimizer's run written at ZeRO-2 (DeepSpeedZeroOptimizer's files), then asked back at ZeRO-1 with
    another expert-parallel degree, where the same config gets BF16_Optimizer: the files ckptflow writes from
    the BF16_Optimizer source at that degree, field for field and byte for byte."""
    [fixture] = build_bf16_optimizer([name]).values()
    reshard(str(fixture.dir), str(tmp_path / "z2"), world_size=2, stage=2)
    reshard(str(tmp_path / "z2"), str(tmp_path / "back"), world_size=2, stage=1, ep=1)
    reshard(str(fixture.dir), str(tmp_path / "direct"), world_size=2, ep=1)
    assert load_index(str(tmp_path / "back")).zero.optimizer_kind == BF16
    _compare_folders(tmp_path / "back" / "global_step3", tmp_path / "direct" / "global_step3")


# ---- deepspeed.moe ZeRO-0 -> ZeRO-1/2 (issue 24): pure checks; DeepSpeed's load is ZERO0_RESHARDS above -----------

DSMOE_EXPERT_NAME = re.compile(r"^(moe\d+)\.deepspeed_moe\.experts\.deepspeed_experts\.(\d+)\.(.+)$")


def _gathered_state(folder: Path, world_size: int, ep: int) -> dict[str, torch.Tensor]:
    """Each parameter's fp32 master and Adam moments out of a ZeRO-1/2 deepspeed.moe folder written at `world_size`
    ranks and degree `ep`, read with torch (our output: trusted) and joined by DeepSpeed's own records: each rank's
    `param_slice_mappings`, in rank order, over the ranks of its group (an expert group's: those of its
    expert-parallel rank `r % ep`, its experts' local ids made global)."""
    pieces: dict[str, list[torch.Tensor]] = {}
    experts = torch.load(folder / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["num_experts"]
    for r in range(world_size):
        name = f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"  # a bf16 run's: `bf16_` before it
        osd = torch.load(folder / name if (folder / name).exists() else folder / f"bf16_{name}", map_location="cpu",
                         weights_only=False)["optimizer_state_dict"]
        base = osd["base_optimizer_state"]
        for g, mapping in enumerate(osd["param_slice_mappings"]):
            moe = base["param_groups"][g].get("moe")
            flats = {"fp32": osd["single_partition_of_fp32_groups"][g],
                     **{k: v for k, v in base["state"][g].items() if k != "step"}}
            for name, where in mapping.items():
                if moe:
                    layer, local, rest = DSMOE_EXPERT_NAME.match(name).groups()
                    count = experts[int(layer[len("moe"):])] // ep
                    name = f"{layer}.deepspeed_moe.experts.deepspeed_experts.{(r % ep) * count + int(local)}.{rest}"
                for kind, flat in flats.items():
                    pieces.setdefault(f"{kind}/{name}", []).append(flat.narrow(0, where.start, where.numel))
    return {key: torch.cat(parts) for key, parts in pieces.items()}



@pytest.mark.parametrize(("name", "world_size", "ep", "stage"), sample([
    ("dsmoe-ep2-z0-fp32", 4, 2, 2), ("dsmoe-ep2-z0-fp32", 4, 4, 1), ("dsmoe-ep2dp2-z0-fp32", 2, 1, 1),
    ("dsmoe-ep2-z0-bf16", 2, 2, 2), ("dsmoe-ep2-z0-bf16", 4, 4, 1), ("dsmoe-ep2-z0-bf16", 2, 1, 2),
    ("dsmoe-ep2dp2-z0-bf16", 2, 2, 1), ("dsmoe-ep2dp2-z0-bf16", 4, 1, 2)],
    [("dsmoe-ep2-z0-fp32", 4, 2, 2), ("dsmoe-ep2-z0-fp32", 4, 4, 1), ("dsmoe-ep2dp2-z0-fp32", 2, 1, 1)]))
def test_a_deepspeed_moe_zero0_reshard_holds_each_parameter_s_master_and_moments(
        expert_fixtures, name: str, world_size: int, ep: int, stage: int, tmp_path: Path) -> None:
    """Every parameter's fp32 master and Adam moments in the ZeRO-1/2 files, joined by DeepSpeed's own
    `param_slice_mappings`, are the live engine's the writer gathered (each expert-parallel rank's named from its
    expp_rank optimizer by position), at the source's degree and another."""
    fixture = expert_fixtures[name]
    reshard(str(fixture.dir), str(tmp_path / "out"), world_size=world_size, ep=ep, stage=stage)
    state = _gathered_state(tmp_path / "out" / "global_step3", world_size, ep)
    expected = load_file(fixture.expected_path)
    assert set(state) == set(expected)
    for key, tensor in expected.items():
        assert torch.equal(state[key], tensor.reshape(-1)), key


@pytest.mark.skipif(not long_mode(), reason="fixtures of the long mode's moe-zero0-16 set")
@pytest.mark.parametrize("name", ["dsmoe-ep2-z0-bf16", "dsmoe-ep2dp2-z0-bf16"])
def test_a_bf16_deepspeed_moe_zero0_checkpoint_validates_and_consolidates_in_bf16(expert_fixtures, name: str,
                                                                                  tmp_path: Path) -> None:
    """Its files hold FP16_Optimizer's entry (the param groups inside `optimizer_state_dict`): valid, and its bf16
    weights are the live engine's fp32 masters rounded as DeepSpeed rounds them."""
    fixture = expert_fixtures[name]
    assert fixture.spec["optimizer"] == "FP16_Optimizer"
    assert validate(str(fixture.dir), deep=True).problems == ()
    consolidate(str(fixture.dir), str(tmp_path / "hf"), options=ConsolidateOptions(dtype="bf16", workers=2))
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    for key, tensor in _fp32(fixture).items():
        assert torch.equal(weights[key], tensor.to(torch.bfloat16)), key


def test_a_deepspeed_moe_zero0_reshard_is_what_deepspeed_writes_at_zero2(expert_fixtures, tmp_path: Path) -> None:
    """ZeRO-0 -> ZeRO-2 at the source's shape has the files, keys, shapes and metadata of DeepSpeed's own ZeRO-2
    save of the same model at that shape (every field but the tensors' values and the samples seen)."""
    reshard(str(expert_fixtures["dsmoe-ep2-z0-fp32"].dir), str(tmp_path / "out"), world_size=2, stage=2)
    _compare_folders(tmp_path / "out" / "global_step3", expert_fixtures["dsmoe-ep2-z2-fp32"].tag_dir, values=False,
                     ignore=("global_samples",))


def test_deepspeed_moe_zero0_refusals(expert_fixtures, tmp_path: Path) -> None:
    index = load_index(str(expert_fixtures["dsmoe-ep2-z0-fp32"].dir))
    with pytest.raises(UnsupportedCheckpointError, match=r"to 4 ranks, ep4: ckptflow writes a deepspeed.moe ZeRO-0 "
                                                         r"checkpoint at ZeRO-1 or ZeRO-2 at another expert-parallel "
                                                         r"degree, not at ZeRO-0, whose expp_rank files it does not "
                                                         r"write; shapes it can write at 4 ranks: ZeRO-1 dp4 \(4 ranks\), "
                                                         r"ZeRO-1 ep2 x edp2 \(4 ranks\), ZeRO-1 ep4 x edp1 \(4 "
                                                         r"ranks\), ZeRO-2 dp4 \(4 ranks\), ZeRO-2 ep2 x edp2 \(4 "
                                                         r"ranks\), ZeRO-2 ep4 x edp1 \(4 ranks\)$"):
        plan_reshard(index, Target(world_size=4, ep=4))
    with pytest.raises(UnsupportedCheckpointError, match="DeepSpeed refuses deepspeed.moe layers at ZeRO-3"):
        plan_reshard(index, Target(world_size=2, stage=3))
    # fp16: each expp_rank file's FP16_Optimizer loss scale, carried where all agree (long mode: tests/test_moe_zero0_fp16.py)
    with pytest.raises(UnsupportedCheckpointError, match=r"to 2 ranks, ZeRO-1: expp_rank_0_mp_rank_00_optim_states.pt: "
                                                         r"its FP16_Optimizer's loss scale state is not what DeepSpeed "
                                                         r"0.19.8 saves \(dynamic_loss_scale=None, cur_scale=None, "
                                                         r"cur_iter=None\), so the target's loss scaler cannot be "
                                                         r"carried; ckptflow can write no shape of it at 2 ranks$"):
        plan_reshard(replace(index, precision="fp16"), Target(world_size=2, stage=1))  # fp32 files called fp16
    scale = {"dynamic_loss_scale": True, "cur_scale": 256.0, "cur_iter": 4, "last_overflow_iter": 1,
             "scale_factor": 2.0, "scale_window": 2}
    with pytest.raises(UnsupportedCheckpointError, match=r"to 2 ranks, ZeRO-1: expp_rank_1_mp_rank_00_optim_states.pt "
                                                         r"holds another FP16_Optimizer loss scale state than "
                                                         r"expp_rank_0_mp_rank_00_optim_states.pt \(cur_scale=128.0, "
                                                         r"cur_iter=4, last_overflow_iter=1, not cur_scale=256.0, "
                                                         r"cur_iter=4, last_overflow_iter=1\), which one deepspeed.moe "
                                                         r"run does not save; the folder mixes saves"):
        plan_reshard(replace(index, precision="fp16", expp=({**index.expp[0], **scale},
                                                            {**index.expp[1], **scale, "cur_scale": 128.0})),
                     Target(world_size=2, stage=1))
    with pytest.raises(UnsupportedCheckpointError, match=r"to 2 ranks, ZeRO-1: expp_rank_0_mp_rank_00_optim_states.pt "
                                                         r"holds no torch optimizer state dict inside FP16_Optimizer's "
                                                         r"`optimizer_state_dict`"):  # the scales agree: named next
        plan_reshard(replace(index, precision="fp16", expp=tuple({**e, **scale} for e in index.expp)),
                     Target(world_size=2, stage=1))
    with pytest.raises(UnsupportedCheckpointError, match=r"to 2 ranks, ZeRO-1: expp_rank_0_mp_rank_00_optim_states.pt "
                                                         r"holds no torch optimizer state dict inside FP16_Optimizer's "
                                                         r"`optimizer_state_dict`"):
        plan_reshard(replace(index, precision="bf16"), Target(world_size=2, stage=1))  # fp32 files called bf16
    ckpt = _copy(expert_fixtures["dsmoe-ep2-z0-fp32"], tmp_path)

    def drop_one_state(obj: dict[str, Any]) -> None:  # the state of position 12: a layer-0 expert weight
        del obj["optimizer"]["state"][12]

    _rewrite(ckpt / "global_step3" / "expp_rank_1_mp_rank_00_optim_states.pt", drop_one_state)
    with pytest.raises(UnsupportedCheckpointError, match=r"expert-parallel rank 1's expert parameters: "
                                                         r"moe0\.deepspeed_moe\.experts\.deepspeed_experts\.1\.fc1\."
                                                         r"weight has no optimizer state while the rest of its param "
                                                         r"group has"):
        reshard(str(ckpt), str(tmp_path / "out"), world_size=2, stage=1)
    assert not (tmp_path / "out").exists()
