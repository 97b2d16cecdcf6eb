"""The checks behind `consolidate --verify` and `verify_model`: they pass on a good output and name
the tensor when something is off."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckptflow.consolidate import ConsolidateOptions, consolidate, plan_consolidation, prepare_output, run_unit
from ckptflow.errors import VerificationError
from ckptflow.formats import hf
from ckptflow.formats.deepspeed import load_index
from ckptflow.formats.shard_check import verify_shard
from ckptflow.verify import read_source, verify_model
from tests.fixtures import Fixture


@pytest.fixture()
def written(ds_fixtures: Mapping[str, Fixture], tmp_path: Path) -> tuple[Path, tuple, str]:
    """One bf16 shard of the toy model written without verification: (path, its tensors, sha256)."""
    index = load_index(str(ds_fixtures["z3-bf16-ws2"].dir))
    plan = plan_consolidation(index, ConsolidateOptions(dtype="bf16", verify=False))
    staging = prepare_output(plan, str(tmp_path / "out"))
    result = run_unit(plan, plan.units[0], staging)
    return Path(staging.uri) / result.filename, plan.units[0].tensors, result.sha256


def test_verify_shard_passes_on_a_good_shard(written: tuple[Path, tuple, str]) -> None:
    path, tensors, sha256 = written
    assert sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    check = verify_shard(str(path), tensors, sha256=sha256, chunk_bytes=64)
    assert (check.tensors, check.size) == (len(tensors), path.stat().st_size)


def test_verify_shard_names_a_changed_tensor(written: tuple[Path, tuple, str]) -> None:
    path, tensors, _ = written
    layout = hf.safetensors_file([(t.name, t.dtype, t.shape) for t in tensors], {"format": "pt"})
    slot = next(s for s in layout.slots if s.name == "proj.weight")
    raw = bytearray(path.read_bytes())
    raw[layout.data_start + slot.begin + 2 * 5] ^= 0x01  # element 5 of proj.weight, low bit
    path.write_bytes(bytes(raw))
    with pytest.raises(VerificationError, match=r"^tensor proj.weight in .*model.safetensors differs from the "
                                                r"source at element 5: the file holds .*, the source gives ") as caught:
        verify_shard(str(path), tensors)
    assert caught.value.tensor == "proj.weight"


def test_verify_shard_checks_size_header_and_hash(written: tuple[Path, tuple, str]) -> None:
    path, tensors, sha256 = written
    good = path.read_bytes()
    path.write_bytes(good[:-3])
    with pytest.raises(VerificationError, match=r"holds \d+ bytes, expected \d+; the write was cut short"):
        verify_shard(str(path), tensors)
    path.write_bytes(good)
    scale = next(t for t in tensors if t.name == "scale")
    with pytest.raises(VerificationError, match=r"model.safetensors holds tensor scale, which is not in the plan$"):
        verify_shard(str(path), [t for t in tensors if t is not scale])
    with pytest.raises(VerificationError, match=r"model.safetensors lacks tensor zz$"):
        verify_shard(str(path), [*tensors, scale.__class__("zz", "bfloat16", (7,), scale.runs, "buffer")])
    with pytest.raises(VerificationError, match="hashes to .*, but 00 was recorded"):
        verify_shard(str(path), tensors, sha256="00")


class SlowWriter:
    """Writes `data` to `path` in pieces on a thread of its own; `written(n)` waits for n bytes."""

    def __init__(self, path: Path, data: bytes, piece: int, stop_at: int | None = None) -> None:
        self.path, self.data, self.piece, self.stop_at = path, data, piece, stop_at
        self.cond = threading.Condition()
        self.done, self.stopped = 0, False
        self.thread = threading.Thread(target=self.run)

    def run(self) -> None:
        with open(self.path, "wb") as fh:
            for pos in range(0, len(self.data), self.piece):
                if self.stop_at is not None and pos >= self.stop_at:
                    break
                fh.write(self.data[pos:pos + self.piece])
                fh.flush()
                with self.cond:
                    self.done = pos + len(self.data[pos:pos + self.piece])
                    self.cond.notify_all()
        with self.cond:
            self.stopped = True
            self.cond.notify_all()

    def written(self, n: int) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.done >= n or self.stopped)
            if self.done < n:
                raise RuntimeError(f"the writer stopped before byte {n}")


def test_verify_shard_while_the_file_is_written(written: tuple[Path, tuple, str]) -> None:
    path, tensors, sha256 = written
    good = path.read_bytes()
    layout = hf.safetensors_file([(t.name, t.dtype, t.shape) for t in tensors], {"format": "pt"})
    slot = next(s for s in layout.slots if s.name == "proj.weight")
    for data, error in (
        (good, None),
        (good[:layout.data_start + slot.begin + 10] + bytes([good[layout.data_start + slot.begin + 10] ^ 1])
         + good[layout.data_start + slot.begin + 11:],
         r"^tensor proj.weight in .* differs from the source at element 5"),
        (good[:9] + b"x" + good[10:], r"has no readable safetensors header"),  # the header is checked last
    ):
        path.unlink()
        writer = SlowWriter(path, data, piece=100)
        writer.thread.start()
        try:
            if error is None:
                check = verify_shard(str(path), tensors, sha256=sha256, chunk_bytes=64, written=writer.written)
                assert check.size == len(good)
            else:
                with pytest.raises(VerificationError, match=error):
                    verify_shard(str(path), tensors, chunk_bytes=64, written=writer.written)
        finally:
            writer.thread.join()
    path.unlink()
    writer = SlowWriter(path, good, piece=100, stop_at=300)
    writer.thread.start()
    with pytest.raises(RuntimeError, match="the writer stopped before byte"):
        verify_shard(str(path), tensors, chunk_bytes=64, written=writer.written)
    writer.thread.join()


def test_read_source_casts_like_torch(ds_fixtures: Mapping[str, Fixture]) -> None:
    fixture = ds_fixtures["z2-fp32-ws2"]
    plan = plan_consolidation(load_index(str(fixture.dir)), ConsolidateOptions(dtype="fp16"))
    tensor = next(t for u in plan.units for t in u.tensors if t.name == "proj.weight")
    engine = load_file(fixture.expected_path)
    assert torch.equal(read_source(tensor).view(tensor.shape), engine["fp32/proj.weight"].half())
    assert torch.equal(read_source(tensor, "float32", 3, 40), engine["fp32/proj.weight"].flatten()[3:40])


def test_verify_model_on_the_trainer_checkpoint(llama_trainer_ckpt: Fixture, tmp_path: Path) -> None:
    out = tmp_path / "model"
    consolidate(str(llama_trainer_ckpt.dir), str(out), options=ConsolidateOptions(dtype="bf16", max_shard_size="50KB"))
    check = verify_model(str(out), source=str(llama_trainer_ckpt.dir))
    assert (check.model_class, check.device, check.dtype, check.compared_to_source) == (
        "LlamaForCausalLM", "cpu", "bfloat16", True)
    assert check.logits_shape == (1, 16, 55) and check.tensors_compared == 21  # 20 saved, lm_head.weight tied
    assert verify_model(str(out)).tensors_compared == 0


def test_verify_model_names_a_tensor_that_differs(llama_trainer_ckpt: Fixture, tmp_path: Path) -> None:
    out = tmp_path / "model"
    consolidate(str(llama_trainer_ckpt.dir), str(out))
    weights = load_file(out / hf.SAFE_WEIGHTS_NAME)
    weights["model.layers.1.mlp.up_proj.weight"][0, 0] += 1e-3
    save_file(weights, out / hf.SAFE_WEIGHTS_NAME, metadata={"format": "pt"})
    with pytest.raises(VerificationError, match=r"model.layers.1.mlp.up_proj.weight differs from the source .*max abs "
                                                r"difference 0.001") as caught:
        verify_model(str(out), source=str(llama_trainer_ckpt.dir))
    assert caught.value.tensor == "model.layers.1.mlp.up_proj.weight"


def test_verify_model_reports_missing_keys(llama_trainer_ckpt: Fixture, tmp_path: Path) -> None:
    out = tmp_path / "model"
    consolidate(str(llama_trainer_ckpt.dir), str(out))
    weights = load_file(out / hf.SAFE_WEIGHTS_NAME)
    del weights["model.norm.weight"]
    save_file(weights, out / hf.SAFE_WEIGHTS_NAME, metadata={"format": "pt"})
    with pytest.raises(VerificationError, match="reports missing keys: model.norm.weight"):
        verify_model(str(out))


def test_verify_model_reads_a_bucket(llama_trainer_ckpt: Fixture, tmp_path: Path) -> None:
    import fsspec

    consolidate(str(llama_trainer_ckpt.dir), "memory:///verify/model")
    try:
        check = verify_model("memory:///verify/model", source=str(llama_trainer_ckpt.dir))
        assert check.out == "memory:///verify/model" and check.tensors_compared == 21
    finally:
        fsspec.filesystem("memory").rm("/verify", recursive=True)


def test_verify_model_without_config(ds_fixtures: Mapping[str, Fixture], tmp_path: Path) -> None:
    consolidate(str(ds_fixtures["z1-fp32-ws2"].dir), str(tmp_path / "toy"))
    with pytest.raises(VerificationError, match=r"transformers cannot read .*toy/config.json"):
        verify_model(str(tmp_path / "toy"))
