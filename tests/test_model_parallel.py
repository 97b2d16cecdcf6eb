"""Tensor- and pipeline-parallel checkpoints (issue 11) validate and consolidate, with oracles that are
not ckptflow.

For every AutoTP fixture (ZeRO-0/1/2/3, tp and tp x dp, tied, GLM's fused sub-parameters), every
PipelineModule one (pp, pp x dp, tied embedding, ZeRO-0 and 1), Megatron-style pp x tp with the
client's ``universal_checkpoint_info`` and data-parallel ZeRO-0:

- ``ckptflow validate --deep`` finds nothing wrong (replicas compared byte for byte);
- ``ckptflow consolidate`` writes exactly the live engine's gathered fp32 weights
  (``expected.safetensors``), cast as torch casts for bf16/fp16 outputs, and the buffers as saved;
- Hugging Face models load with ``from_pretrained`` (no missing or unexpected keys) and give the
  oracle logits exactly; pipelines give them through the fixture's reference forward;
- where DeepSpeed's ``ds_to_universal`` converts, its fp32 tensors equal ours.

Each wrong-diagnosis case is a test of its message.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Mapping
from pathlib import Path

import fsspec
import pytest
import torch
from safetensors.torch import load_file

from ckptflow.consolidate import ConsolidateOptions, consolidate
from ckptflow.errors import UnsupportedCheckpointError
from ckptflow.formats.deepspeed import inspect
from ckptflow.formats.deepspeed.readers.model_parallel import ModelParallelCheckpoint
from ckptflow.validate import validate
from tests.fixtures.models.parallel_extra import reference_logits
from tests.fixtures.sets import ParallelFixture
from tests.fixtures.specs.extra import EXTRA_MATRIX, UNLOADABLE
from tests.fixtures.specs.parallel import AUTOEP, DSMOE, PARALLEL_MATRIX
from tests.test_parallel_fixtures import load_pt, universal_tensor

MATRIX_NAMES = [s.name for s in PARALLEL_MATRIX if s.layout not in (AUTOEP, DSMOE) and not s.name.endswith("no-ucinfo")]
EXTRA_NAMES = [s.name for s in EXTRA_MATRIX if s.name not in UNLOADABLE]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# ZeRO-0 in bf16 names only its bf16 weights (its masters are unnamed): consolidated in bf16, exactly.
SIXTEEN_BIT_ZERO0 = {name for s in EXTRA_MATRIX if s.stage == 0 and s.dtype != "fp32"
                     and (name := s.name) in EXTRA_NAMES}


def output_dtype(fixture: ParallelFixture) -> str:
    """The dtype a consolidation of `fixture` writes by default here: fp32, or the training dtype where
    that is all the checkpoint names."""
    return fixture.spec["dtype"] if fixture.name in SIXTEEN_BIT_ZERO0 else "fp32"


def rounded(tensors: Mapping[str, torch.Tensor], dtype: str) -> dict[str, torch.Tensor]:
    """fp32 tensors rounded to `dtype` and back, as a 16-bit model computes in fp32."""
    return {name: t.to(DTYPES[dtype]).float() for name, t in tensors.items()}


@pytest.fixture(params=MATRIX_NAMES + EXTRA_NAMES)
def fixture(request: pytest.FixtureRequest, parallel_fixtures: Mapping[str, ParallelFixture],
            parallel_extra_fixtures: Mapping[str, ParallelFixture]) -> ParallelFixture:
    return {**parallel_fixtures, **parallel_extra_fixtures}[request.param]


def output_name(fixture: ParallelFixture, name: str) -> str:
    """The name ckptflow gives an oracle tensor: the same, except that a ZeRO-0 PipelineModule records no
    parameter names, so its tied embedding is named by the layer file holding it."""
    if fixture.layout == "pipe" and fixture.spec["stage"] == 0 and name == "tied_modules.embed.weight":
        return "0.weight"
    return name


def consolidated(fixture: ParallelFixture, out: Path, dtype: str = "fp32") -> dict[str, torch.Tensor]:
    consolidate(str(fixture.dir), str(out), options=ConsolidateOptions(dtype=dtype, workers=2))
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


def check_oracle(fixture: ParallelFixture, got: Mapping[str, torch.Tensor], dtype: str) -> None:
    expected = {k.removeprefix("fp32/"): v for k, v in load_file(fixture.expected_path).items()
                if k.startswith("fp32/")}
    buffers = load_file(fixture.buffers_path)
    names = {output_name(fixture, n) for n in expected} | set(buffers)
    assert set(got) == names
    for name, oracle in expected.items():
        tensor = got[output_name(fixture, name)]
        assert tensor.dtype == DTYPES[dtype], name
        assert torch.equal(tensor, oracle.to(DTYPES[dtype])), name
    for name, buffer in buffers.items():
        assert got[name].dtype == buffer.dtype and torch.equal(got[name], buffer), name


def test_validate_deep_finds_nothing_wrong(fixture: ParallelFixture) -> None:
    report = validate(str(fixture.dir), deep=True)
    assert report.ok, [p.message for p in report.problems]
    summary = report.summary()
    assert summary["step"] == fixture.spec["global_steps"]
    assert summary["world_size"] == fixture.spec["dp"]
    assert summary["stage"] == fixture.spec["stage"]
    index = report.index
    if fixture.spec["tp"] * fixture.spec["pp"] > 1:
        assert isinstance(index, ModelParallelCheckpoint)
        assert (index.tp, index.pp) == (fixture.spec["tp"], fixture.spec["pp"])
        # Replicated parameters and a pipeline's tied weight are held twice and were compared (a ZeRO-0
        # pipeline's only copy of each weight is its layer file).
        assert bool(index.replicas) != (fixture.layout == "pipe" and fixture.spec["stage"] == 0)
    if fixture.spec["stage"] == 0:
        assert any("names no parameter" in note or "maps an index" in note for note in summary["notes"])


def test_consolidate_equals_the_live_engine_bit_for_bit(fixture: ParallelFixture, tmp_path: Path) -> None:
    got = consolidated(fixture, tmp_path / "out", output_dtype(fixture))
    check_oracle(fixture, got, output_dtype(fixture))
    provenance = json.loads((tmp_path / "out" / "ckptflow_provenance.json").read_text())
    assert provenance["source"]["layout"] == validate(str(fixture.dir)).summary()["layout"]
    if fixture.layout in ("pipe", "megatron"):
        assert not (tmp_path / "out" / "config.json").exists()
        assert any("PipelineModule" in note for note in provenance["source"]["notes"])


@pytest.mark.parametrize("where,chunk_bytes", [("local", 100), ("local", 1000), ("memory", 700)])
def test_row_parallel_rows_cut_by_batches_and_partitions(where: str, chunk_bytes: int, tmp_path: Path,
                                                         parallel_fixtures: Mapping[str, ParallelFixture]) -> None:
    """A row-parallel tensor is one strided run per stretch of a rank's partition; here ZeRO partitions
    cut rows too, and batches of a few hundred bytes start and end mid-row. Written and `--verify`-ed
    from a local disk and from a store read by byte ranges, it is the live engine's tensor."""
    fixture = parallel_fixtures["autotp-tp2dp2-z1-fp32"]
    index, _, _ = inspect(str(fixture.dir))
    runs = [r for t in index.model_tensors() if t.name.endswith("down_proj.weight") for r in t.runs]
    row = max(r.row for r in runs if r.rows > 1)
    assert any(r.rows == 1 and r.numel % row for r in runs)  # a row cut by a partition boundary
    source = str(fixture.dir)
    if where == "memory":
        fs = fsspec.filesystem("memory")
        fs.put(source, "/row-parallel", recursive=True)
        source = "memory:///row-parallel"
    try:
        consolidate(source, str(tmp_path / "out"), options=ConsolidateOptions(
            dtype="bf16", chunk_bytes=chunk_bytes, max_shard_size="40KB", verify=True, workers=2))
    finally:
        if where == "memory":
            fs.rm("/row-parallel", recursive=True)
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted((tmp_path / "out").glob("*.safetensors")):
        tensors.update(load_file(shard))
    check_oracle(fixture, tensors, "bf16")


@pytest.mark.parametrize("name,dtype", [("autotp-tp2dp2-z1-fp32", "bf16"), ("autotp-glm-tp2-z3-fp32", "fp16"),
                                        ("autotp-tp2-z3-bf16", "bf16"), ("pipe-pp2dp2-z1-fp32", "bf16"),
                                        ("megatron-pp2tp2-z1-fp32-ucinfo", "fp16"), ("zero-dp2-z0-fp32", "bf16")])
def test_consolidate_casts_as_torch(name: str, dtype: str, tmp_path: Path,
                                    parallel_fixtures: Mapping[str, ParallelFixture],
                                    parallel_extra_fixtures: Mapping[str, ParallelFixture]) -> None:
    fixture = {**parallel_fixtures, **parallel_extra_fixtures}[name]
    check_oracle(fixture, consolidated(fixture, tmp_path / "out", dtype), dtype)
    if fixture.spec["layout"] == "autotp":
        config = json.loads((tmp_path / "out" / "config.json").read_text())
        assert config["dtype"] == config["torch_dtype"] == str(DTYPES[dtype]).removeprefix("torch.")


@pytest.mark.parametrize("name", [n for n in MATRIX_NAMES + EXTRA_NAMES if n.startswith(("autotp", "zero"))])
def test_from_pretrained_loads_it_and_gives_the_oracle_logits(
    name: str, tmp_path: Path, parallel_fixtures: Mapping[str, ParallelFixture],
    parallel_extra_fixtures: Mapping[str, ParallelFixture],
) -> None:
    from transformers import AutoModelForCausalLM

    fixture = {**parallel_fixtures, **parallel_extra_fixtures}[name]
    dtype = output_dtype(fixture)
    consolidate(str(fixture.dir), str(tmp_path / "out"), options=ConsolidateOptions(dtype=dtype, workers=2))
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32, output_loading_info=True)
    assert {key: value for key, value in info.items() if value} == {}
    tied = fixture.spec["model"] == "llama-tied"
    assert ("lm_head.weight" in load_file(tmp_path / "out" / "model.safetensors")) != tied  # left out, as saved
    logits = load_file(fixture.logits_path)
    with torch.no_grad():
        again = model.eval()(input_ids=logits["input_ids"]).logits
        if dtype == "fp32":
            assert torch.equal(again, logits["logits"])
        else:  # the reference model, its weights rounded as the training dtype rounds the masters
            reference = AutoModelForCausalLM.from_pretrained(fixture.reference_dir, dtype=torch.float32)
            reference.load_state_dict(rounded(reference.state_dict(), dtype))
            assert torch.equal(again, reference.eval()(input_ids=logits["input_ids"]).logits)


@pytest.mark.parametrize("name", [n for n in MATRIX_NAMES + EXTRA_NAMES if n.startswith(("pipe", "megatron"))])
def test_pipeline_output_runs_the_reference_model(name: str, tmp_path: Path,
                                                  parallel_fixtures: Mapping[str, ParallelFixture],
                                                  parallel_extra_fixtures: Mapping[str, ParallelFixture]) -> None:
    fixture = {**parallel_fixtures, **parallel_extra_fixtures}[name]
    dtype = output_dtype(fixture)
    weights = consolidated(fixture, tmp_path / "out", dtype)
    if fixture.spec["stage"] == 0:
        weights["tied_modules.embed.weight"] = weights.pop("0.weight")
    forward = reference_logits(name)
    logits = load_file(fixture.logits_path)
    if dtype == "fp32":
        assert torch.equal(forward(weights, logits["input_ids"]).float(), logits["logits"])
    else:  # the reference forward on the oracle's masters rounded as the training dtype rounds them
        masters = {k.removeprefix("fp32/"): v for k, v in load_file(fixture.expected_path).items()
                   if k.startswith("fp32/")}
        want = forward({**load_file(fixture.buffers_path), **rounded(masters, dtype)}, logits["input_ids"])
        got = forward({name: t.float() if t.is_floating_point() else t for name, t in weights.items()},
                      logits["input_ids"])
        assert torch.equal(got.float(), want.float())


@pytest.mark.parametrize("name", [n for n in MATRIX_NAMES + EXTRA_NAMES if "-z0-" not in n])
def test_ds_to_universal_agrees(name: str, tmp_path: Path, parallel_fixtures: Mapping[str, ParallelFixture],
                                parallel_extra_fixtures: Mapping[str, ParallelFixture]) -> None:
    fixture = {**parallel_fixtures, **parallel_extra_fixtures}[name]
    assert fixture.universal_dir is not None
    got = consolidated(fixture, tmp_path / "out")
    for param in fixture.spec["params"]:
        universal = universal_tensor(fixture.universal_dir / "zero", param, "fp32", fixture.spec["layout"])
        assert torch.equal(got[param].reshape(-1), universal.float().reshape(-1)), param


# ---- the right diagnosis -------------------------------------------------------------------------------


def copy_checkpoint(fixture: ParallelFixture, tmp_path: Path) -> Path:
    dest = tmp_path / "ckpt"
    shutil.copytree(fixture.dir, dest)
    return dest


def messages(path: Path, deep: bool = False) -> list[tuple[str, str]]:
    report = validate(str(path), deep=deep)
    return [(p.code, " ".join(p.message.split())) for p in report.problems]


def test_a_missing_tensor_parallel_rank_is_named(parallel_fixtures: Mapping[str, ParallelFixture],
                                                 tmp_path: Path) -> None:
    ckpt = copy_checkpoint(parallel_fixtures["autotp-tp2dp2-z1-fp32"], tmp_path)
    (ckpt / "global_step3" / "zero_pp_rank_1_mp_rank_01_optim_states.pt").unlink()
    (ckpt / "global_step3" / "mp_rank_01_model_states.pt").rename(ckpt / "global_step3" / "elsewhere.pt")
    assert messages(ckpt) == [(
        "rank-missing", "tensor-parallel rank 1 of 2 is missing: expected global_step3/mp_rank_01_model_states.pt "
        f"under {ckpt}; the upload may still be in progress, or the checkpoint was saved with fewer model-parallel "
        "ranks")]
    (ckpt / "global_step3" / "elsewhere.pt").rename(ckpt / "global_step3" / "mp_rank_01_model_states.pt")
    assert messages(ckpt) == [(
        "rank-missing", f"data-parallel rank 1 of 2 of tensor-parallel rank 1 of 2 is missing: expected "
        f"global_step3/zero_pp_rank_1_mp_rank_01_optim_states.pt under {ckpt}; the upload may still be in progress, "
        "or the checkpoint was saved with fewer ranks")]


def test_files_of_another_save_are_named(parallel_fixtures: Mapping[str, ParallelFixture], tmp_path: Path) -> None:
    ckpt = copy_checkpoint(parallel_fixtures["autotp-tp2-z1-fp32"], tmp_path)
    tag = ckpt / "global_step3"
    shutil.copy(tag / "mp_rank_01_model_states.pt", tag / "mp_rank_02_model_states.pt")
    shutil.copy(tag / "zero_pp_rank_0_mp_rank_01_optim_states.pt", tag / "zero_pp_rank_1_mp_rank_01_optim_states.pt")
    got = messages(ckpt)
    assert ("rank-extra", "unexpected file global_step3/mp_rank_02_model_states.pt: model-parallel rank 2 is beyond "
            "the 2 ranks of this AutoTP (tensor-parallel; tp 2 x dp 1) checkpoint; it is left over from another save "
            "into the same tag folder: remove it, or re-save the checkpoint into a fresh folder") in got
    assert ("rank-extra", "unexpected file global_step3/zero_pp_rank_1_mp_rank_01_optim_states.pt: data-parallel rank "
            "1 of tensor-parallel rank 1 of 2 is beyond the data-parallel world size 1 recorded in "
            "mp_rank_01_model_states.pt; it is left over from another save into the same tag folder: remove it, or "
            "re-save the checkpoint into a fresh folder") in got
    assert len(got) == 2


def test_the_cli_counts_the_problems(parallel_fixtures: Mapping[str, ParallelFixture], tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from ckptflow.cli import app

    ckpt = copy_checkpoint(parallel_fixtures["autotp-tp2-z1-fp32"], tmp_path)
    tag = ckpt / "global_step3"
    shutil.copy(tag / "mp_rank_01_model_states.pt", tag / "mp_rank_02_model_states.pt")
    one = CliRunner().invoke(app, ["validate", str(ckpt)])
    assert one.exit_code == 1 and one.output.startswith(f"invalid {tag}: 1 problem\n")
    shutil.copy(tag / "zero_pp_rank_0_mp_rank_01_optim_states.pt", tag / "zero_pp_rank_1_mp_rank_01_optim_states.pt")
    two = CliRunner().invoke(app, ["validate", str(ckpt)])
    assert two.exit_code == 1 and two.output.startswith(f"invalid {tag}: 2 problems\n")


def rewrite(path: Path, change: object) -> None:
    """Load a checkpoint file with torch (tests only), let `change` edit it, save it back."""
    state = load_pt(path)
    change(state)  # type: ignore[operator]
    torch.save(state, path)


def test_a_parameter_without_split_metadata_is_refused_not_guessed(parallel_fixtures: Mapping[str, ParallelFixture],
                                                                   tmp_path: Path) -> None:
    ckpt = copy_checkpoint(parallel_fixtures["autotp-tp2-z1-fp32"], tmp_path)
    for tp in range(2):
        rewrite(ckpt / "global_step3" / f"mp_rank_{tp:02d}_model_states.pt", lambda s: s["universal_checkpoint_info"]
                ["affine_map"]["params"].pop(r"^model\.layers\.0\.self_attn\.o_proj\.weight$"))
    assert messages(ckpt) == [(
        "unsupported-layout", "model.layers.0.self_attn.o_proj.weight: the checkpoint does not say how it is split "
        "over the 2 tensor-parallel ranks (no entry in universal_checkpoint_info.affine_map of "
        "mp_rank_00_model_states.pt); ckptflow does not guess")]


def test_split_metadata_must_agree_across_ranks(parallel_fixtures: Mapping[str, ParallelFixture],
                                                tmp_path: Path) -> None:
    ckpt = copy_checkpoint(parallel_fixtures["autotp-tp2-z2-fp32"], tmp_path)
    rewrite(ckpt / "global_step3" / "mp_rank_01_model_states.pt",
            lambda s: s["universal_checkpoint_info"].update(original_vocab_size=38))
    assert messages(ckpt) == [(
        "ranks-disagree", f"tensor-parallel rank 1 of 2 records another universal_checkpoint_info than tensor-parallel "
        f"rank 0 of 2 in {ckpt}/global_step3/mp_rank_01_model_states.pt; every tensor-parallel rank saves the same "
        "one: the folder mixes saves, re-copy it from one save")]


def test_a_shard_of_the_wrong_shape_is_named(parallel_fixtures: Mapping[str, ParallelFixture], tmp_path: Path) -> None:
    ckpt = copy_checkpoint(parallel_fixtures["autotp-tp2-z0-fp32"], tmp_path)
    name = r"^model\.layers\.1\.mlp\.down_proj\.weight$"

    def swap(state: dict) -> None:
        entry = state["universal_checkpoint_info"]["affine_map"]["params"][name]
        entry["ranks"][1]["shard_shape"] = [48, 64]

    for tp in range(2):
        rewrite(ckpt / "global_step3" / f"mp_rank_{tp:02d}_model_states.pt", swap)
    assert messages(ckpt) == [(
        "unsupported-layout", "model.layers.1.mlp.down_proj.weight: its affine map gives tensor-parallel rank 1 a "
        "shard of shape [48, 64] but the rank saved [64, 48]; the folder mixes saves: re-copy it from one save")]


@pytest.mark.parametrize("name,tensor,holders", [
    ("autotp-tp2-z1-fp32", "model.norm.weight", "tensor-parallel rank 0 of 2 and tensor-parallel rank 1 of 2"),
    ("pipe-pp2dp2-z1-fp32", "tied_modules.embed.weight", "pipeline stage 0 of 2 and pipeline stage 1 of 2"),
])
def test_replicas_that_drifted_apart_are_found_by_deep(name: str, tensor: str, holders: str, tmp_path: Path,
                                                       parallel_fixtures: Mapping[str, ParallelFixture]) -> None:
    ckpt = copy_checkpoint(parallel_fixtures[name], tmp_path)
    index, problems, _ = inspect(str(ckpt))
    assert not problems and isinstance(index, ModelParallelCheckpoint)
    replica = next(r for r in index.replicas if r.name == tensor)
    run = replica.other[0]  # the second holder's copy, not the one consolidation reads
    start, _ = run.ref.element_range(run.start, 1)
    with open(run.ref.uri, "r+b") as handle:
        handle.seek(start)
        byte = handle.read(1)
        handle.seek(start)
        handle.write(bytes([byte[0] ^ 0x40]))
    assert messages(ckpt) == []  # headers agree: the cheap checks cannot see it
    assert messages(ckpt, deep=True) == [(
        "replicas-differ", f"tensor {tensor}: {holders} hold different values for the same block (from element "
        f"{run.offset} of the full tensor), which they must hold identically; the ranks drifted apart or a file is "
        "damaged: use an earlier checkpoint")]


def test_a_missing_layer_file_is_named(parallel_fixtures: Mapping[str, ParallelFixture], tmp_path: Path) -> None:
    ckpt = copy_checkpoint(parallel_fixtures["pipe-pp2dp2-z1-fp32"], tmp_path)
    (ckpt / "global_step3" / "layer_04-model_states.pt").unlink()
    got = messages(ckpt)
    assert got[0] == ("rank-missing", "pipeline stage 1 of 2 trains 4.weight but "
                                      "global_step3/layer_04-model_states.pt "
                      f"under {ckpt} is missing; the upload may still be in progress, or the folder mixes saves")
    assert {code for code, _ in got} == {"rank-missing"} and len(got) == 2  # 4.weight and 4.bias


def test_megatron_without_universal_checkpoint_info_is_refused(parallel_fixtures: Mapping[str,
                                                                                          ParallelFixture]) -> None:
    fixture = parallel_fixtures["megatron-pp2tp2-z1-fp32-no-ucinfo"]
    assert messages(fixture.dir) == [(
        "unsupported-layout", f"{fixture.tag_dir} is a checkpoint in the PipelineModule (pipeline-parallel with "
        "Megatron-style tensor parallelism; pp 2 x tp 2 x dp 1) layout without `universal_checkpoint_info`: nothing in "
        "it says how each parameter is split over the 2 tensor-parallel ranks, and ckptflow does not guess "
        "(DeepSpeed's universal converter does when told to inject the state it lacks, and writes wrong tensors for "
        "row-parallel, replicated and vocabulary-padded parameters); save the checkpoint with "
        "`client_state={'universal_checkpoint_info': ...}` as Megatron-DeepSpeed does, or convert it with your "
        "framework's own tools")]


def test_megatron_rules_that_average_are_refused(parallel_fixtures: Mapping[str, ParallelFixture],
                                                 tmp_path: Path) -> None:
    ckpt = copy_checkpoint(parallel_fixtures["megatron-pp2tp2-z1-fp32-ucinfo"], tmp_path)

    def average(state: dict) -> None:
        info = state["universal_checkpoint_info"]
        info["parameter_to_average_patterns"] = [r"\d+\.fc1\.bias"]

    for mp in range(4):
        rewrite(ckpt / "global_step3" / f"mp_rank_{mp:02d}_model_states.pt", average)
    got = messages(ckpt)
    assert got[0] == ("unsupported-layout", "1.fc1.bias: the checkpoint records it as averaged over the "
                                            "tensor-parallel "
                      "ranks; ckptflow copies bytes and does not average: convert it with "
                      "deepspeed.checkpoint.ds_to_universal")
    assert [name for _, message in got for name in [message.split(":")[0]]] == ["1.fc1.bias", "2.fc1.bias",
                                                                                "3.fc1.bias"]


@pytest.mark.parametrize("name", sorted(SIXTEEN_BIT_ZERO0))
def test_zero0_in_bf16_is_written_in_bf16_only(name: str, parallel_extra_fixtures: Mapping[str, ParallelFixture],
                                               tmp_path: Path) -> None:
    """bf16 ZeRO-0 (DeepSpeed's FP16_Optimizer) names its bf16 weights only; the fp32 masters sit unnamed in
    `fp32_groups_flat` (formats/deepspeed/zero0.py). The bf16 model is exact (the tests above: every
    weight is the live engine's master rounded to bf16); an fp32 model is refused in one line, nothing
    written."""
    from typer.testing import CliRunner

    from ckptflow.cli import app
    from ckptflow.formats.deepspeed.readers.zero0 import masters_note

    fixture = parallel_extra_fixtures[name]
    assert fixture.spec["optimizer"] == "FP16_Optimizer"
    summary = validate(str(fixture.dir)).summary()
    assert (summary["precision"], summary["frozen"]) == ("bf16", 0)
    assert masters_note("bf16") in summary["notes"]
    out = tmp_path / "out"
    refused = CliRunner().invoke(app, ["consolidate", str(fixture.dir), str(out), "--dtype", "fp32"])
    assert refused.exit_code == 1 and "\n" not in refused.output.strip(), refused.output
    assert " ".join(refused.output.split()) == (
        f"error: {fixture.dir}/global_step3 is a {summary['layout']} checkpoint trained in bf16: it names its weights "
        "in bf16 only (its fp32 masters sit in the optimizer state with no parameter names), so a fp32 model made from "
        "it would not hold the masters; consolidate with --dtype bf16: bit for bit the weights DeepSpeed trained "
        "with; or train with ZeRO-1 or higher for named fp32 masters")
    assert not out.exists()
    with pytest.raises(UnsupportedCheckpointError) as again:
        consolidate(str(fixture.dir), str(out), options=ConsolidateOptions(dtype="fp16"))
    assert again.value.code == "unsupported-precision" and not out.exists()


def test_a_zero0_pipeline_in_bf16_is_read_by_its_optimizer_s_names(
        parallel_extra_fixtures: Mapping[str, ParallelFixture], tmp_path: Path) -> None:
    """A PipelineModule trained in bf16 at ZeRO-0 gets DeepSpeed's BF16_Optimizer, whose ZeRO-0 checkpoint
    DeepSpeed 0.19.8 cannot load back (the writer checked that its load fails). Its optimizer names every
    parameter (`param_slice_mappings`): ckptflow reads it as ZeRO-0 holding BF16_Optimizer's partitions, says
    so and how to resume it (`ckptflow reshard --zero-stage 1`, `tests/test_pipeline_reshard.py`), and
    consolidates its masters in bf16 (rounded as the training rounds them) and in fp32 (the masters). A stage
    whose optimizer file names none is refused in one line that names the layout and what to do, writing nothing."""
    from typer.testing import CliRunner

    from ckptflow.cli import app
    from ckptflow.formats.deepspeed.readers.pipeline import BF16_ZERO0_NOTE

    fixture = parallel_extra_fixtures["pipe-pp2-z0-bf16"]
    assert fixture.spec["optimizer"] == "BF16_Optimizer"
    assert fixture.spec["checks"]["reload"]["deepspeed_load_error"] == "KeyError: 0"
    report = validate(str(fixture.dir), deep=True)
    assert report.ok, [p.message for p in report.problems]
    summary = report.summary()
    assert (summary["stage"], summary["pp"], summary["precision"]) == (0, 2, "bf16")
    assert BF16_ZERO0_NOTE in summary["notes"]
    masters = {k.removeprefix("fp32/"): v for k, v in load_file(fixture.expected_path).items() if k.startswith("fp32/")}
    assert len(masters) == len(fixture.spec["params"])
    for dtype in ("bf16", "fp32"):
        done = CliRunner().invoke(app, ["consolidate", str(fixture.dir), str(tmp_path / dtype), "--dtype", dtype])
        assert done.exit_code == 0, done.output
        got = load_file(tmp_path / dtype / "model.safetensors")
        assert set(got) == set(masters) | set(fixture.spec["buffers"])
        assert all(torch.equal(got[name], master.to(DTYPES[dtype])) for name, master in masters.items())

    ckpt = copy_checkpoint(fixture, tmp_path)
    model = ckpt / "global_step3" / "mp_rank_01_model_states.pt"
    rewrite(ckpt / "global_step3" / "bf16_zero_pp_rank_0_mp_rank_01_optim_states.pt",
            lambda state: state["optimizer_state_dict"].pop("param_slice_mappings"))
    message = (f"{model} (pipeline stage 1 of 2) is a ZeRO-0 checkpoint whose optimizer is DeepSpeed's BF16_Optimizer "
               "(what a PipelineModule trained in bf16 gets at ZeRO-0), which DeepSpeed 0.19.8 cannot load back (its "
               "loader fails with KeyError 0); ckptflow reads that layout where its optimizer files name a "
               "PipelineModule's parameters, plain or Megatron-style (param_slice_mappings), not here: train with "
               "ZeRO-1, whose "
               "BF16_Optimizer files ckptflow reads, or save the 16-bit weights with `engine.save_16bit_model()`")
    assert messages(ckpt) == [("unsupported-layout", message)]
    out = tmp_path / "out"
    refused = CliRunner().invoke(app, ["consolidate", str(ckpt), str(out), "--dtype", "bf16"])
    assert refused.exit_code == 1 and "\n" not in refused.output.strip(), refused.output
    assert message in " ".join(refused.output.split()), refused.output
    assert not out.exists()


def test_zero0_masters_that_do_not_fit_the_weights_are_named(parallel_extra_fixtures: Mapping[str, ParallelFixture],
                                                             tmp_path: Path) -> None:
    ckpt = copy_checkpoint(parallel_extra_fixtures["zero-dp2-z0-bf16"], tmp_path)
    model = ckpt / "global_step3" / "mp_rank_00_model_states.pt"

    held = []

    def grow(state: dict) -> None:
        state["optimizer"]["fp32_groups_flat"][0] = torch.zeros(10**6)
        held.append(sum(flat.numel() for flat in state["optimizer"]["fp32_groups_flat"]))

    rewrite(model, grow)
    weights = sum(math.prod(shape) for shape in parallel_extra_fixtures["zero-dp2-z0-bf16"].spec["params"].values())
    assert messages(ckpt) == [(
        "corrupt-file", f"{model} holds {held[0]} fp32 master elements for {weights} weight elements; the optimizer "
        "state is from another model: re-save the checkpoint")]

    def drop(state: dict) -> None:
        del state["optimizer"]["fp32_groups_flat"]

    rewrite(model, drop)
    assert messages(ckpt) == [(
        "corrupt-file", f"{model} is a ZeRO-0 checkpoint trained in bf16, but its optimizer holds no flat fp32 master "
        "per param group (`fp32_groups_flat`, 2 expected); the file is damaged or was written by another tool")]


# ---- the piece arithmetic, against torch ---------------------------------------------------------------


def _check_pieces(full: torch.Tensor, locals_: list[torch.Tensor], pieces: list[list]) -> None:
    """Every piece's stretches copy elements of the local tensors to where they are in `full`, and
    together they cover `full` exactly once."""
    from ckptflow.formats.deepspeed.readers.model_parallel import stretches

    flat, seen = full.reshape(-1), torch.zeros(full.numel(), dtype=torch.int64)
    for local, rank_pieces in zip(locals_, pieces):
        local = local.reshape(-1)
        for piece in rank_pieces:
            for dest, source, n, rows, stride in stretches(piece):
                for i in range(rows):
                    at = source + i * stride
                    assert torch.equal(local[dest + i * n:dest + (i + 1) * n], flat[at:at + n])
                    seen[at:at + n] += 1
    assert bool(torch.all(seen == 1))


def test_pieces_of_affine_maps_and_megatron_rules_match_torch() -> None:
    from ckptflow.formats.deepspeed.readers.model_parallel import Piece, concat_pieces
    from ckptflow.formats.deepspeed.readers.pipeline import _halves, _sub_params

    full = torch.arange(6 * 10, dtype=torch.float32).reshape(6, 10)
    # Row-parallel (columns split 4 + 6): one stretch per row, strided in the full tensor.
    shards = [full[:, :4].contiguous(), full[:, 4:].contiguous()]
    shape, pieces = concat_pieces([tuple(s.shape) for s in shards], 1)
    assert shape == (6, 10)
    _check_pieces(full, shards, [[p] for p in pieces])
    # The same as DeepSpeed's affine map writes it for rank 1.
    assert pieces[1] == Piece((6, 6), 4, (10, 1), 0, (6, 1))
    # Two sub-parameters halved on dim 0 (Megatron's parameter_with_2_sub_params_cat_dim_0).
    gate, up = full[:3], full[3:]
    shards = [torch.cat([gate[:2], up[:2]]), torch.cat([gate[2:], up[2:]])]
    assert [list(c.shape) for s in shards for c in torch.chunk(s, 2, 0)] == [[2, 10], [2, 10], [1, 10], [1, 10]]
    shape, pieces = _halves([tuple(s.shape) for s in shards])
    assert shape == (6, 10)
    _check_pieces(full, shards, pieces)
    # Sub-parameters of uneven widths on dim 0 ([4, 2] rows: 3 + 1 and 1 + 1 per rank).
    shards = [torch.cat([full[0:3], full[4:5]]), torch.cat([full[3:4], full[5:6]])]
    shape, pieces = _sub_params("p", [tuple(s.shape) for s in shards],
                                ("p", {"partition_dim": 0}), {"sub_param_shard_widths": {"p": [[3, 1], [1, 1]]}})
    assert shape == (6, 10)
    _check_pieces(full, shards, pieces)
