"""`ckptflow validate` on every real fixture, and on the corpus of hostile inputs (tests/hostile/kinds),
each with the message a user must read."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckptflow.formats.deepspeed import load_index
from ckptflow.validate import validate
from tests.hostile.corpus import DEEP, VALIDATE, all_kinds, prepare
from tests.hostile.plugin import corpus_params
from tests.oracles.tensors import read_elements, read_tensor

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "ckptflow.cli"]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "300"}
    return subprocess.run([*CLI, *args], capture_output=True, text=True, cwd=REPO, timeout=120, env=env)


def copy_checkpoint(fixture, tmp_path: Path) -> Path:
    dest = tmp_path / "ckpt"
    shutil.copytree(fixture.dir, dest)
    return dest


def tag_dir(root: Path) -> Path:
    return root / (root / "latest").read_text().strip()


def full_param(index, param, key: str = "fp32") -> torch.Tensor:
    """A parameter's fp32 value (or Adam moment `key`) assembled from the index's fragments."""
    if param.frozen:
        pieces = [read_tensor(p).reshape(-1) for p in param.frozen_pieces]
        return torch.cat(pieces)[: param.numel].view(param.shape)
    out = torch.empty(param.numel, dtype=torch.float32)
    for frag in param.fragments:
        part = index.partitions[frag.rank][frag.group]
        ref = part.fp32 if key == "fp32" else part.state[key]
        out[frag.param_offset : frag.param_offset + frag.numel] = read_elements(ref, frag.offset, frag.numel)
    return out.view(param.shape)


# ---- every fixture is valid and the index agrees with DeepSpeed's own view --------------------------


def test_every_fixture_validates_and_matches_deepspeed(ds_fixtures):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file

    assert len(ds_fixtures) >= 10
    for name, fx in ds_fixtures.items():
        report = validate(str(fx.dir), deep=True)
        assert report.ok, (name, [p.message for p in report.problems])
        index = report.index
        assert (index.stage, index.world_size) == (fx.stage, fx.world_size), name
        assert index.precision == fx.dtype, name
        assert index.tied, name  # every fixture model ties its output head to its embedding
        if fx.spec["model"] == "toy":
            assert any(p.frozen for p in index.params), name
            assert len(index.groups) >= 2, name
        # The live engine's fp32 weights and Adam moments, saved by the fixture writer.
        live = load_file(fx.expected_path)
        for param in index.params:
            if param.frozen:
                continue
            for key in ("fp32", "exp_avg", "exp_avg_sq"):
                assert torch.equal(full_param(index, param, key), live[f"{key}/{param.name}"]), (name, key, param.name)
        try:
            oracle = get_fp32_state_dict_from_zero_checkpoint(str(fx.dir))
        except ValueError as exc:
            # DeepSpeed's converter cannot read its own BF16_Optimizer checkpoints.
            assert fx.spec.get("grad_accum_dtype") == "fp32" and "is not a zero checkpoint" in str(exc), name
            continue
        for param in index.params:
            if param.name not in oracle:
                # DeepSpeed's reconstruction drops ZeRO-1's frozen parameters; ours keeps them.
                assert fx.stage == 1 and param.frozen, (name, param.name)
                continue
            expected = oracle[param.name]
            expected = expected.contiguous() if not torch.is_tensor(expected) else expected
            assert tuple(expected.shape) == param.shape, (name, param.name)
            assert torch.equal(full_param(index, param).to(expected.dtype), expected), (name, param.name)
        for alias, owner in index.tied.items():
            assert alias in oracle or fx.stage == 3, (name, alias)
            assert owner in index.param_by_name


def test_index_reads_no_tensor_bytes_and_records_byte_ranges(ds_fixtures):
    fx = ds_fixtures["z3-bf16-ws2"]
    index = load_index(str(fx.dir))
    for parts in index.partitions:
        for part in parts:
            start, end = part.fp32.byte_range
            size = os.path.getsize(part.fp32.uri)
            assert 0 < start < end <= size
            assert end - start == part.fp32.numel * 4


# ---- the corpus of hostile inputs (tests/hostile/kinds) --------------------------------------------
# Every kind that applies to `validate` / `validate --deep`, run as the CLI through the harness of
# tests/hostile (one forked child per run, bounded in time and memory), judged by its oracle and the
# message the kind pins. The other commands run the same corpus in tests/test_hostile.py.


@pytest.mark.parametrize(("kind_name", "command"), corpus_params((VALIDATE, DEEP)))
def test_corpus(kind_name: str, command: str, corpus_results) -> None:
    run = corpus_results.get(kind_name, command)
    assert run.ok, run.report()


def test_pickle_payload_is_refused_by_the_library_too(ds_fixtures, tmp_path) -> None:
    """The library raises what the CLI prints (a ValueError naming the global), and nothing runs."""
    kind = all_kinds()["checkpoint/pickle-that-tries-to-run-code"]
    ws = prepare(kind, tmp_path / "case", ds_fixtures)
    with pytest.raises(ValueError, match="posix.system"):
        load_index(str(ws.src))
    assert not ws.marker.exists()


@pytest.fixture
def z3(ds_fixtures, tmp_path):
    return copy_checkpoint(ds_fixtures["z3-bf16-ws2"], tmp_path)


def test_json_report(z3):
    (tag_dir(z3) / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    proc = run_cli("validate", str(z3), "--json")
    assert proc.returncode == 1
    report = json.loads(proc.stdout)
    assert report["valid"] is False
    assert [p["code"] for p in report["problems"]] == ["rank-missing"]
    assert report["problems"][0]["rank"] == 1
    proc = run_cli("validate", str(tag_dir(z3).parent), "--json", "--tag", tag_dir(z3).name)
    assert json.loads(proc.stdout)["problems"][0]["file"].endswith("bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")


def test_valid_checkpoint_json_summary(ds_fixtures):
    fx = ds_fixtures["z2-bf16-ws2"]
    proc = run_cli("validate", str(fx.dir), "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads(proc.stdout)["checkpoint"]
    assert summary["stage"] == 2 and summary["world_size"] == 2 and summary["precision"] == "bf16"


def test_deep_scan_reads_no_padding_of_frozen_zero3_pieces(z3):
    """ZeRO-3 pads each rank's piece of a frozen parameter and leaves the padding uninitialized: NaN
    there is garbage, not divergence. NaN in the parameter's own elements is."""
    from ckptflow.formats.deepspeed.partition import zero3_piece, zero3_real

    index = load_index(str(z3))
    ws = index.world_size
    param, rank = next((p, r) for p in index.params if p.frozen for r in range(ws)
                       if zero3_real(p.numel, ws, r) < zero3_piece(p.numel, ws))
    path = tag_dir(z3) / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
    real = zero3_real(param.numel, ws, rank)

    def poison(at: int) -> None:
        state = torch.load(path, weights_only=False)  # our own copy of a fixture, edited in place
        with torch.no_grad():
            state["frozen_param_fragments"][param.name].view(-1)[at] = float("nan")
        torch.save(state, path)

    poison(real)  # the first padding element
    assert validate(str(z3), deep=True).ok
    if real:
        poison(real - 1)  # the last real element
        report = validate(str(z3), deep=True)
        assert [p.code for p in report.problems] == ["non-finite"]
        assert f"tensor {param.name}" in report.problems[0].message and "NaN/Inf" in report.problems[0].message
