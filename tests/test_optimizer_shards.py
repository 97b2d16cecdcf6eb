"""Optimizer shards saved with torch.save (issue 25, item 2; seed 002): a folder of per-rank ZeRO-2
`optimizer.state_dict()` files, validated, resharded for another number of ranks and consolidated.

- Names (no DeepSpeed): which number in the names is the rank, the pattern written back, and the
  ambiguities refused in one line.
- Folders written by DeepSpeed on CPU (`tests.fixtures.specs.optimizer_shards`: the tiny Llama at ZeRO-2,
  fp32 on 4 ranks and bf16 on 2, each rank's `torch.save(engine.optimizer.state_dict())` and the model
  saved beside): what validate says, the refusals (a rank missing, two patterns, two numbers that vary,
  a rank named twice, a file that is not an optimizer state, shards of two world sizes).
- The oracle: seed 002's own loading code at M ranks (`tests.oracles.optimizer_shards`) on the resharded
  folder holds exactly the source's live state (`expected.safetensors`, read from the source engine
  through DeepSpeed's accessors): fp32 masters with `load_from_fp32_weights=True`, and with the default
  path the masters DeepSpeed refreshes from the model's weights; Adam moments, step, hyper-parameters
  and loss scale on both paths.
- Consolidation with the model beside the shards, with `--config`, and the refusal without either.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from ckptflow.cli import app
from ckptflow.formats.deepspeed.readers.optimizer_shards import name_ranks
from tests.fixtures import Fixture
from tests.fixtures.replay import launch
from tests.sampling import sample

FP32, BF16 = "shards-z2-fp32-ws4", "shards-z2-bf16-ws2"
PATTERN = "optimizer.{rank:02d}.pt"
SIDE_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
# (fixture, target world size): one DeepSpeed launch each; the default run keeps one, growing bf16.
RESHARDS = sample([(BF16, 3), (FP32, 2), (FP32, 3), (BF16, 1)], keep=[(BF16, 3)])


def cli(*args: str) -> Any:
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "400", "NO_COLOR": "1"})


def text(result: Any) -> str:
    return " ".join(result.output.split())


def copy_shards(fixture: Fixture, dest: Path, *, side: bool = True) -> Path:
    dest.mkdir(parents=True)
    for path in sorted(fixture.dir.iterdir()):
        if side or path.name.startswith("optimizer."):
            shutil.copyfile(path, dest / path.name)
    return dest


# ---- names ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("names", "pattern", "world_size", "renamed"), [
    ([f"optimizer.{r:02d}.pt" for r in range(4)], "optimizer.{rank:02d}.pt", 12, "optimizer.11.pt"),
    ([f"optim_rank{r}.bin" for r in range(3)], "optim_rank{rank}.bin", 2, "optim_rank1.bin"),
    ([f"shard-{r}-of-4.pt" for r in range(4)], "shard-{rank}-of-{world_size}.pt", 6, "shard-5-of-6.pt"),
    ([f"ckpt_v2_rank{r}.pt" for r in range(12)], "ckpt_v2_rank{rank}.pt", 2, "ckpt_v2_rank1.pt"),
    (["optimizer.00.pt"], "optimizer.{rank:02d}.pt", 3, "optimizer.02.pt"),
])
def test_the_number_that_varies_is_the_rank(names: list[str], pattern: str, world_size: int, renamed: str) -> None:
    naming, by_rank = name_ranks(names)
    naming = naming.with_count(len(names))
    assert naming.pattern == pattern
    assert by_rank == dict(enumerate(names))
    assert [naming.name(r, len(names)) for r in range(len(names))] == names
    assert naming.name(world_size - 1, world_size) == renamed


@pytest.mark.parametrize(("names", "message"), [
    (["optimizer.00.step5.pt", "optimizer.01.step6.pt"],
     "two numbers vary between the names (optimizer.00.step5.pt, optimizer.01.step6.pt), so they do not say which is "
     "the rank; rename the files so that only the rank differs"),
    (["optimizer.01.pt", "optimizer.1.pt", "optimizer.00.pt"],
     "optimizer.01.pt and optimizer.1.pt both name rank 1; remove the one left over from another save"),
    (["optimizer.00.pt", "optimizer.1.pt", "optimizer.2.pt"],
     "the names optimizer.00.pt, optimizer.1.pt, optimizer.2.pt mix zero-padded and unpadded rank numbers; they come "
     "from different saves"),
    (["opt_0_0.pt"], "the name opt_0_0.pt holds more than one 0 to take for rank 0"),
])
def test_ambiguous_names_are_refused(names: list[str], message: str) -> None:
    with pytest.raises(ValueError) as caught:
        name_ranks(names)
    assert str(caught.value) == message


# ---- validate and the refusals --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shards(optimizer_shard_fixtures: Mapping[str, Fixture]) -> Mapping[str, Fixture]:
    return optimizer_shard_fixtures


@pytest.mark.parametrize(("name", "summary"), [
    (FP32, "optimizer shards optimizer.{rank:02d}.pt, ZeRO-2, data-parallel 4, fp32, step 3, 20 params (77,568 "
           "elements, 0 frozen, 0 tied), 0 buffers, 2 param groups"),
    (BF16, "optimizer shards optimizer.{rank:02d}.pt, ZeRO-2, data-parallel 2, bf16, step 3, 20 params (77,568 "
           "elements, 0 frozen, 0 tied), 0 buffers, 2 param groups"),
])
def test_validate_says_what_it_found(shards: Mapping[str, Fixture], name: str, summary: str) -> None:
    fixture = shards[name]
    result = cli("validate", str(fixture.dir))
    assert result.exit_code == 0, result.output
    ranks = fixture.world_size
    assert text(result) == (f"valid {fixture.dir}: {summary} note: ranks 0-{ranks - 1}: optimizer.00.pt, "
                            f"optimizer.01.pt{' ...' if ranks > 2 else ''}; parameter shapes from model.safetensors")
    report = json.loads(cli("validate", str(fixture.dir), "--json").output)
    checkpoint = report["checkpoint"]
    assert (report["valid"], report["tag"], checkpoint["pattern"], checkpoint["files"], checkpoint["stage"]) == (
        True, "", PATTERN, [PATTERN.format(rank=r) for r in range(ranks)], 2)


def test_without_the_model_the_parameters_are_flat(shards: Mapping[str, Fixture], tmp_path: Path) -> None:
    bare = copy_shards(shards[FP32], tmp_path / "bare", side=False)
    result = cli("validate", str(bare))
    assert result.exit_code == 0, result.output
    assert "data-parallel 4, unknown, step 3, 20 params (77,568 elements" in text(result)
    assert text(result).endswith("no model weights beside the shards: parameters are known by size, not shape "
                                 "(enough to reshard; consolidate needs --config)")


def test_shapes_from_a_pytorch_model_bin(shards: Mapping[str, Fixture], tmp_path: Path) -> None:
    folder = copy_shards(shards[BF16], tmp_path / "ckpt", side=False)
    torch.save(load_file(str(shards[BF16].dir / "model.safetensors")), folder / "pytorch_model.bin")
    result = cli("validate", str(folder))
    assert result.exit_code == 0, result.output
    assert "data-parallel 2, bf16, step 3" in text(result)
    assert text(result).endswith("parameter shapes from pytorch_model.bin")


def test_a_count_in_the_names_is_rewritten(shards: Mapping[str, Fixture], tmp_path: Path) -> None:
    folder = copy_shards(shards[BF16], tmp_path / "ckpt", side=False)
    for rank in (0, 1):
        (folder / f"optimizer.0{rank}.pt").rename(folder / f"shard-{rank}-of-2.pt")
    result = cli("reshard", str(folder), str(tmp_path / "out"), "--world-size", "3")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [f"shard-{r}-of-3.pt" for r in range(3)]
    assert "optimizer shards shard-{rank}-of-{world_size}.pt, ZeRO-2, data-parallel 3" in text(
        cli("validate", str(tmp_path / "out")))


def refusal(folder: Path, command: str = "validate") -> str:
    args = [command, str(folder)] + ([str(folder.parent / "out"), "--world-size", "2"] if command == "reshard" else [])
    result = cli(*args)
    assert result.exit_code == 1, result.output
    assert not (folder.parent / "out").exists()
    return text(result)


def test_a_missing_rank_is_named(shards: Mapping[str, Fixture], tmp_path: Path) -> None:
    folder = copy_shards(shards[FP32], tmp_path / "ckpt")
    (folder / "optimizer.02.pt").unlink()
    assert refusal(folder) == (
        f"invalid {folder}: 1 problem rank-missing: rank 2 of 4 is missing: expected optimizer.02.pt in {folder} "
        "(optimizer.00.pt records 4 partitions); copy it from the save, or the save is incomplete")
    assert f"refusing to reshard {folder}: rank 2 of 4 is missing" in refusal(folder, "reshard")


def test_fewer_files_than_the_recorded_partition_count(shards: Mapping[str, Fixture], tmp_path: Path) -> None:
    folder = copy_shards(shards[FP32], tmp_path / "ckpt")
    for rank in (2, 3):
        (folder / f"optimizer.0{rank}.pt").unlink()
    said = refusal(folder)
    assert said.startswith(f"invalid {folder}: 2 problems rank-missing: rank 2 of 4 is missing")
    assert "rank-missing: rank 3 of 4 is missing: expected optimizer.03.pt" in said


def test_two_patterns_are_refused(shards: Mapping[str, Fixture], tmp_path: Path) -> None:
    folder = copy_shards(shards[BF16], tmp_path / "ckpt")
    shutil.copyfile(folder / "optimizer.00.pt", folder / "optim_rank0.bin")
    assert refusal(folder) == (
        f"invalid {folder}: 1 problem ambiguous-shards: {folder} holds optimizer states under 2 name patterns "
        "(optim_rank0.bin, optimizer.00.pt); keep the files of one save, one pattern, in the folder")


def test_two_numbers_that_vary_are_refused(shards: Mapping[str, Fixture], tmp_path: Path) -> None:
    folder = copy_shards(shards[BF16], tmp_path / "ckpt")
    for rank in (0, 1):
        (folder / f"optimizer.0{rank}.pt").rename(folder / f"optimizer.0{rank}.step{5 + rank}.pt")
    assert refusal(folder) == (
        f"invalid {folder}: 1 problem ambiguous-shards: {folder}: two numbers vary between the names "
        "(optimizer.00.step5.pt, optimizer.01.step6.pt), so they do not say which is the rank; rename the files so "
        "that only the rank differs")


def test_a_rank_named_twice_is_refused(shards: Mapping[str, Fixture], tmp_path: Path) -> None:
    folder = copy_shards(shards[BF16], tmp_path / "ckpt")
    shutil.copyfile(folder / "optimizer.01.pt", folder / "optimizer.1.pt")
    assert refusal(folder, "reshard") == (
        f"error: refusing to reshard {folder}: {folder}: optimizer.01.pt and optimizer.1.pt both name rank 1; remove "
        "the one left over from another save")


def test_a_file_that_is_not_an_optimizer_state(shards: Mapping[str, Fixture], tmp_path: Path) -> None:
    folder = copy_shards(shards[FP32], tmp_path / "ckpt")
    torch.save({"weight": torch.zeros(3)}, folder / "optimizer.01.pt")
    assert refusal(folder) == (
        f"invalid {folder}: 1 problem corrupt-file: rank 1: {folder}/optimizer.01.pt is a torch file but not a "
        "ZeRO-1/2 optimizer state (no base_optimizer_state, single_partition_of_fp32_groups, partition_count, "
        "param_slice_mappings); it was replaced or written by another tool")


def test_shards_of_two_world_sizes(shards: Mapping[str, Fixture], tmp_path: Path) -> None:
    folder = copy_shards(shards[BF16], tmp_path / "ckpt")
    shutil.copyfile(shards[FP32].dir / "optimizer.02.pt", folder / "optimizer.02.pt")
    assert refusal(folder) == (
        f"invalid {folder}: 1 problem world-size-mismatch: rank 2: {folder}/optimizer.02.pt records 4 partitions "
        f"but {folder}/optimizer.00.pt records 2; the folder mixes saves of different world sizes: keep the files of "
        "one save")


def test_another_stage_is_refused(shards: Mapping[str, Fixture], tmp_path: Path) -> None:
    result = cli("reshard", str(shards[BF16].dir), str(tmp_path / "out"), "--world-size", "2", "--zero-stage", "3")
    assert result.exit_code != 0
    assert ("to 2 ranks, ZeRO-3: optimizer shards are written for the same loading code at the same ZeRO stage "
            "only") in text(result)
    assert not (tmp_path / "out").exists()
    plan = text(cli("reshard", str(shards[BF16].dir), "--plan", "--world-size", "2"))
    assert plan.startswith(f"{shards[BF16].dir}: optimizer shards optimizer.{{rank:02d}}.pt, ZeRO-2, data-parallel 2")
    assert "ZeRO-2 dp2 (2 ranks) (now)" in plan and "not yet: optimizer shards are written" in plan


# ---- reshard, and seed 002's loading code at M ranks ------------------------------------------------------


@pytest.fixture(scope="module", params=RESHARDS, ids=[f"{n}-to-{m}" for n, m in RESHARDS])
def resharded(request: pytest.FixtureRequest, shards: Mapping[str, Fixture],
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Fixture, int, Path, Path]]:
    """(source fixture, M, OUT, oracle folder): the source resharded to M ranks by the CLI, then loaded by
    the seed's code at M ranks, once on each load path (`oracle/default`, `oracle/fp32`)."""
    name, world_size = request.param
    fixture = shards[name]
    work = tmp_path_factory.mktemp(f"{name}-to-{world_size}")
    out = work / "out"
    result = cli("reshard", str(fixture.dir), str(out), "--world-size", str(world_size))
    assert result.exit_code == 0, result.output
    jobs = [{"shards": str(out), "model": "tiny-llama", "seed": fixture.spec["seed"], "dtype": fixture.dtype,
             "pattern": PATTERN, "out": str(work / "oracle" / path), "fp32_weights": path == "fp32"}
            for path in ("default", "fp32")]
    (work / "jobs.json").write_text(json.dumps(jobs))
    launch("tests.oracles.optimizer_shards", world_size, ["--jobs", str(work / "jobs.json")])
    yield fixture, world_size, out, work / "oracle"


def test_reshard_writes_the_files_under_the_same_names(resharded: tuple[Fixture, int, Path, Path]) -> None:
    fixture, world_size, out, _ = resharded
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted([PATTERN.format(rank=r) for r in range(world_size)] + list(SIDE_FILES))
    for name in SIDE_FILES:  # carried byte for byte
        assert (out / name).read_bytes() == (fixture.dir / name).read_bytes(), name
    result = cli("validate", str(out))
    assert result.exit_code == 0, result.output
    assert f"ZeRO-2, data-parallel {world_size}, {fixture.dtype}, step 3, 20 params" in text(result)


@pytest.mark.parametrize("path", ["default", "fp32"])
def test_the_seeds_loading_code_holds_the_sources_state(resharded: tuple[Fixture, int, Path, Path], path: str) -> None:
    fixture, _, out, oracle = resharded
    expected = load_file(str(fixture.expected_path))
    held = load_file(str(oracle / path / "state.safetensors"))
    assert set(held) == set(expected)
    weights = load_file(str(fixture.dir / "model.safetensors"))
    for key, value in expected.items():
        kind, _, name = key.partition("/")
        if kind == "fp32" and path == "default":
            # load_from_fp32_weights=False: DeepSpeed refreshes the masters from the model's own weights
            want = weights[name].float()
            assert torch.equal(held[key], want), key
            if fixture.dtype == "fp32":
                assert torch.equal(held[key], value), key
        else:
            assert torch.equal(held[key], value), key
    summary = json.loads((oracle / path / "optimizer.json").read_text())
    for key in ("steps", "param_groups", "loss_scale", "clip_grad"):
        assert summary[key] == fixture.spec[key], key
    assert summary["steps"] == [3.0, 3.0]


def test_an_earlier_commit_is_taken_only_for_the_same_plan(shards: Mapping[str, Fixture], tmp_path: Path) -> None:
    from ckptflow.errors import OutputError
    from ckptflow.reshard import committed_output, plan_output

    src, out = str(shards[BF16].dir), str(tmp_path / "out")
    assert cli("reshard", src, out, "--world-size", "3").exit_code == 0
    results, _ = committed_output(plan_output(src, out, target=3), out)
    assert [r.files for r in results] == [(PATTERN.format(rank=r),) for r in range(3)]
    with pytest.raises(OutputError, match="does not hold this output: its optimizer.00.pt is missing or not the"):
        committed_output(plan_output(src, out, target=2), out)


# ---- consolidate ----------------------------------------------------------------------------------------------


def consolidated_matches(out: Path, fixture: Fixture) -> None:
    from transformers import AutoModelForCausalLM

    expected = load_file(str(fixture.expected_path))
    written = load_file(str(out / "model.safetensors"))
    assert set(written) == {k.partition("/")[2] for k in expected if k.startswith("fp32/")}
    for name, tensor in written.items():
        assert torch.equal(tensor, expected[f"fp32/{name}"]), name
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    state = model.state_dict()
    for name, tensor in written.items():
        assert torch.equal(state[name], tensor), name


def test_consolidate_with_the_model_beside(shards: Mapping[str, Fixture], tmp_path: Path) -> None:
    fixture = shards[BF16]
    result = cli("consolidate", str(fixture.dir), str(tmp_path / "hf"))
    assert result.exit_code == 0, result.output
    consolidated_matches(tmp_path / "hf", fixture)


def test_consolidate_without_shapes_says_what_it_needs(shards: Mapping[str, Fixture], tmp_path: Path) -> None:
    bare = copy_shards(shards[FP32], tmp_path / "bare", side=False)
    result = cli("consolidate", str(bare), str(tmp_path / "hf"))
    assert result.exit_code == 1
    assert text(result) == (
        f"error: {bare} holds optimizer shards that give each parameter's size but not its shape, and no model "
        "weights beside them; a model folder needs the shapes; give the trained model's config with --config (a "
        "folder or a Hub repo ORG/NAME), or save the model beside the shards (save_pretrained)")
    assert not (tmp_path / "hf").exists()
    config = tmp_path / "config"
    config.mkdir()
    shutil.copyfile(shards[FP32].dir / "config.json", config / "config.json")
    result = cli("consolidate", str(bare), str(tmp_path / "hf"), "--config", str(config))
    assert result.exit_code == 0, result.output
    assert f"parameter shapes from config.json of {config}" in text(result)
    consolidated_matches(tmp_path / "hf", shards[FP32])


def test_consolidate_with_a_config_of_another_size(shards: Mapping[str, Fixture], tmp_path: Path) -> None:
    bare = copy_shards(shards[FP32], tmp_path / "bare", side=False)
    config = json.loads((shards[FP32].dir / "config.json").read_text())
    config["intermediate_size"] *= 2
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "config.json").write_text(json.dumps(config))
    result = cli("consolidate", str(bare), str(tmp_path / "hf"), "--config", str(tmp_path / "config"))
    assert result.exit_code == 1
    assert f"config.json of {tmp_path / 'config'} gives model.layers.0.mlp.gate_proj.weight the shape" in text(result)
    assert not (tmp_path / "hf").exists()
