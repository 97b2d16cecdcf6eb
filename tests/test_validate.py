"""`ckptflow validate` on every real fixture, and on a corpus of broken checkpoints, each with the
message a user must read."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.tensors import read_elements, read_tensor
from ckptflow.validate import validate
from ckptflow.formats.deepspeed.checkpoint import load_index

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


def resave(path: Path, edit) -> None:
    """Rewrite a trusted fixture file with one field changed (test code only; the reader never does this)."""
    obj = torch.load(path, weights_only=False)
    edit(obj)
    torch.save(obj, path)


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


# ---- the corpus of broken checkpoints --------------------------------------------------------------


def problems_of(root: Path, *args: str) -> tuple[int, str]:
    proc = run_cli("validate", str(root), *args)
    assert "Traceback" not in proc.stderr + proc.stdout
    return proc.returncode, proc.stdout + proc.stderr


@pytest.fixture
def z3(ds_fixtures, tmp_path):
    return copy_checkpoint(ds_fixtures["z3-bf16-ws2"], tmp_path)


@pytest.fixture
def z2(ds_fixtures, tmp_path):
    return copy_checkpoint(ds_fixtures["z2-bf16-ws2"], tmp_path)


def test_missing_rank_file(z3):
    (tag_dir(z3) / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    code, text = problems_of(z3)
    assert code == 1
    assert (
        f"rank 1 of 2 is missing: expected {tag_dir(z3).name}/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt under "
        f"{z3}; the upload may still be in progress, or the checkpoint was saved with fewer ranks"
    ) in " ".join(text.split())


def test_extra_rank_file(z2):
    shutil.copy(tag_dir(z2) / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
                tag_dir(z2) / "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt")
    code, text = problems_of(z2)
    assert code == 1
    assert "rank-extra" in text and "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt" in text
    assert "rank 2 is beyond the world size 2" in " ".join(text.split())


def test_truncated_file(z3):
    path = tag_dir(z3) / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    code, text = problems_of(z3)
    assert code == 1
    assert "corrupt-file" in text and str(path) in " ".join(text.split())
    assert "is not a readable torch archive" in text and "copy it again" in " ".join(text.split())


def test_zero_byte_file(z3):
    path = tag_dir(z3) / "zero_pp_rank_1_mp_rank_00_model_states.pt"
    path.write_bytes(b"")
    code, text = problems_of(z3)
    assert code == 1
    assert f"rank 1: {path} is empty (0 bytes)" in " ".join(text.split())


def test_garbage_file(z2):
    path = tag_dir(z2) / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    path.write_bytes(os.urandom(4096))
    code, text = problems_of(z2)
    assert code == 1
    assert f"rank 1: {path} is not a readable torch archive" in " ".join(text.split())


def test_latest_names_missing_tag(z3):
    (z3 / "latest").write_text("global_step999")
    code, text = problems_of(z3)
    assert code == 1
    assert f"tag folder {z3}/global_step999 does not exist" in " ".join(text.split())


@pytest.mark.parametrize("tag", ["../../etc", "global_step1/../x", "/etc/passwd", "a/b"])
def test_latest_with_path_tricks(z3, tag):
    (z3 / "latest").write_text(tag)
    code, text = problems_of(z3)
    assert code == 1
    assert "latest-unsafe" in text and "not a plain folder name" in " ".join(text.split())


def test_missing_latest(z3):
    (z3 / "latest").unlink()
    code, text = problems_of(z3)
    assert code == 1
    assert f"no `latest` file in {z3}" in " ".join(text.split())
    # A tag folder itself is accepted without `latest`.
    assert problems_of(tag_dir_of_missing_latest(z3))[0] == 0


def tag_dir_of_missing_latest(root: Path) -> Path:
    return next(p for p in root.iterdir() if p.is_dir() and p.name.startswith("global_step"))


def test_ranks_from_different_steps(z3):
    path = tag_dir(z3) / "zero_pp_rank_1_mp_rank_00_model_states.pt"
    resave(path, lambda o: o.__setitem__("global_steps", o["global_steps"] + 5))
    code, text = problems_of(z3)
    assert code == 1
    assert "ranks-disagree" in text and "rank 1 records global step" in " ".join(text.split())


def test_optimizer_steps_differ_between_ranks(z2):
    path = tag_dir(z2) / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"

    def bump(o):
        for state in o["optimizer_state_dict"]["base_optimizer_state"]["state"].values():
            state["step"] = state["step"] + 3  # an int or a tensor, depending on the optimizer

    resave(path, bump)
    code, text = problems_of(z2)
    assert code == 1
    assert "rank 1's optimizer" in text and "mixes files from different saves" in " ".join(text.split())


def test_mismatched_world_size_in_metadata(z2):
    path = tag_dir(z2) / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"

    def grow(o):
        count = o["optimizer_state_dict"]["partition_count"]
        o["optimizer_state_dict"]["partition_count"] = [c + 1 for c in count] if isinstance(count, list) else count + 1

    resave(path, grow)
    code, text = problems_of(z2)
    assert code == 1
    assert "world-size-mismatch" in text
    assert "was saved with 3 partitions but" in " ".join(text.split())


def test_partition_sizes_that_do_not_add_up(z3):
    path = tag_dir(z3) / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"

    def trim(o):
        osd = o["optimizer_state_dict"]
        osd["fp32_flat_groups"][0] = osd["fp32_flat_groups"][0][:-1].clone()
        for key in ("exp_avg", "exp_avg_sq"):
            osd["optimizer_state_dict"]["state"][0][key] = osd["optimizer_state_dict"]["state"][0][key][:-1].clone()

    resave(path, trim)
    code, text = problems_of(z3)
    assert code == 1
    assert "partition-mismatch" in text and "its parameters need" in " ".join(text.split())


def test_nan_in_weights_found_by_deep(z3):
    path = tag_dir(z3) / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"

    def poison(o):
        with torch.no_grad():
            o["optimizer_state_dict"]["fp32_flat_groups"][0][1] = math.nan

    resave(path, poison)
    assert problems_of(z3)[0] == 0  # cheap validation does not scan values
    code, text = problems_of(z3, "--deep")
    assert code == 1
    assert "non-finite" in text and "hold 1 NaN/Inf value(s)" in " ".join(text.split())


class Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_pickle_that_tries_to_run_code(z3, tmp_path):
    marker = tmp_path / "pwned"
    path = tag_dir(z3) / "zero_pp_rank_1_mp_rank_00_model_states.pt"
    obj = torch.load(path, weights_only=False)
    obj["payload"] = Evil(str(marker))
    torch.save(obj, path)
    assert not marker.exists()
    code, text = problems_of(z3)
    assert code == 1
    assert not marker.exists()
    assert "unsafe-pickle" in text
    assert f"{path} refers to posix.system, which ckptflow does not load" in " ".join(text.split())
    # The library raises the same, and still nothing ran.
    with pytest.raises(ValueError, match="posix.system"):
        load_index(str(z3))
    assert not marker.exists()


def test_zip_that_is_not_a_torch_archive(z3):
    import zipfile

    path = tag_dir(z3) / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    path.unlink()
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("hello.txt", "hi")
    code, text = problems_of(z3)
    assert code == 1
    assert "is a zip file but not a torch archive" in text


def test_unsafe_tag_argument_is_a_usage_error(z3):
    code, text = problems_of(z3, "--tag", "../x")
    assert code == 2
    assert "not a plain folder name" in " ".join(text.split())


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
    from ckptflow.formats.deepspeed.layout import zero3_piece, zero3_real

    index = load_index(str(z3))
    ws = index.world_size
    param, rank = next((p, r) for p in index.params if p.frozen for r in range(ws)
                       if zero3_real(p.numel, ws, r) < zero3_piece(p.numel, ws))
    path = tag_dir(z3) / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
    real = zero3_real(param.numel, ws, rank)

    def poison(at: int):
        def edit(o):
            with torch.no_grad():
                o["frozen_param_fragments"][param.name].view(-1)[at] = math.nan
        return edit

    resave(path, poison(real))  # the first padding element
    assert problems_of(z3, "--deep")[0] == 0
    if real:
        resave(path, poison(real - 1))  # the last real element
        code, text = problems_of(z3, "--deep")
        assert code == 1 and f"tensor {param.name}" in text and "NaN/Inf" in text
