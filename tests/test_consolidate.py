"""Consolidation into a Hugging Face model folder: planning, exactness on every fixture, the Hugging
Face layout, fp16, storage, atomicity and the error messages users read."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

import fsspec
import pytest
import torch
from fsspec.implementations.local import LocalFileSystem
from safetensors.torch import load_file, save

from ckptflow.consolidate import (
    ByteCopy,
    ConsolidateOptions,
    ConsolidationPlan,
    OutputTensor,
    Run,
    ShardUnit,
    committed_output,
    consolidate,
    finalize,
    plan_batches,
    plan_consolidation,
    prepare_output,
    run_unit,
)
from ckptflow.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptFileError,
    OutputError,
    SourceReadError,
    VerificationError,
)
from ckptflow.formats import hf
from ckptflow.formats.deepspeed import load_index
from ckptflow.formats.deepspeed.runs import check_coverage
from ckptflow.formats.hf import PROVENANCE_NAME
from ckptflow.formats.torch.tensorref import TensorRef
from ckptflow.plumbing.sizes import parse_size
from tests.fixtures import MATRIX, Fixture
from tests.fixtures.models.data_parallel import BIG_INT64, build_model
from tests.fixtures.specs.data_parallel import WRITER
from tests.oracles.tensors import storage_ranges, tensor_reads

WRITER_NAMES = [spec.name for spec in MATRIX if spec.launcher == WRITER]


# ---- helpers --------------------------------------------------------------------------------------


def deepspeed_state_dict(ckpt: Path) -> dict[str, torch.Tensor] | None:
    """DeepSpeed's own reconstruction (None where DeepSpeed cannot read the checkpoint)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            state = get_fp32_state_dict_from_zero_checkpoint(str(ckpt))
    except ValueError as exc:  # BF16_Optimizer files: "... is not a zero checkpoint"
        assert "not a zero checkpoint" in str(exc)
        return None
    return {k: v if isinstance(v, torch.Tensor) else v.contiguous() for k, v in state.items()}


def read_output(out: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(out.glob("*.safetensors")):
        part = load_file(path)
        assert not set(part) & set(tensors), f"{path.name} repeats a tensor"
        tensors.update(part)
    return tensors


def model_keys(fixture: Fixture) -> tuple[list[str], dict[str, str]]:
    """The model's own state-dict names (tied aliases left out) and its tied aliases -> owner."""
    model = build_model(fixture.spec["model"])
    names, seen, tied = [], {}, {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        key = (tensor.data_ptr(), tuple(tensor.shape))
        if key in seen and tensor.numel():
            tied[name] = seen[key]
            continue
        seen[key] = name
        names.append(name)
    return names, tied


def check_against_sources(fixture: Fixture, out: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The output equals DeepSpeed's reconstruction (cast), buffers equal the real buffers, frozen
    ZeRO-1 parameters (which DeepSpeed drops) equal the module copy, and every trained parameter
    equals the live engine's fp32 master weights (cast)."""
    got = read_output(out)
    names, tied = model_keys(fixture)
    assert list(got) != [] and set(got) == set(names), set(got) ^ set(names)
    assert not set(tied) & set(got)
    reference = deepspeed_state_dict(fixture.dir)
    buffers = load_file(fixture.buffers_path)
    engine = load_file(fixture.expected_path)
    for name, tensor in got.items():
        if name in buffers:
            assert tensor.dtype == buffers[name].dtype and torch.equal(tensor, buffers[name]), name
            continue
        assert tensor.dtype == dtype, name
        if f"fp32/{name}" in engine:
            assert torch.equal(tensor, engine[f"fp32/{name}"].to(dtype)), name
        if reference is not None and name in reference:
            assert torch.equal(tensor, reference[name].to(dtype)), name
        else:
            assert reference is None or fixture.stage == 1, f"DeepSpeed dropped {name}"
            want = engine.get(f"frozen/{name}", engine.get(f"fp32/{name}"))
            assert want is not None and torch.equal(tensor, want.to(dtype)), name
    if "big" in got:
        assert got["big"].dtype == torch.int64 and got["big"].tolist() == [BIG_INT64]
    return got


# ---- planning with plain numbers ------------------------------------------------------------------


def ref(uri: str, numel: int, dtype: str = "float32", data_offset: int = 0, storage_offset: int = 0) -> TensorRef:
    return TensorRef(uri, "0", dtype, (numel,), (1,), storage_offset, storage_offset + numel, data_offset)


@pytest.mark.parametrize("sizes, limit", [
    ([6, 6, 2, 6, 2, 2], 10),
    ([11, 3, 4, 12, 1, 9, 9, 9, 30, 1], 10),
    ([5] * 7, 5),
    ([1], 100),
])
def test_pack_shards_is_huggingface_hub_packing(sizes: list[int], limit: int) -> None:
    from huggingface_hub.serialization._base import split_state_dict_into_shards_factory

    names = [f"t{i}" for i in range(len(sizes))]
    hub = split_state_dict_into_shards_factory(
        dict(zip(names, sizes)), get_storage_size=lambda size: size, filename_pattern="model{suffix}.safetensors",
        max_shard_size=limit,
    )
    ours = hf.pack_shards(list(zip(names, sizes)), limit)
    assert list(hub.filename_to_tensors.values()) == ours
    assert list(hub.filename_to_tensors) == [hf.shard_filename(i, len(ours)) for i in range(len(ours))]


def test_safetensors_layout_is_byte_identical_to_safetensors() -> None:
    tensors = {
        "b": torch.arange(3, dtype=torch.bfloat16), "a.big": torch.tensor([BIG_INT64]), "z": torch.zeros(0),
        "w": torch.randn(2, 3), "m": torch.tensor([True, False]), "h": torch.ones(5, dtype=torch.float16),
        "i": torch.arange(3, dtype=torch.int32), "é": torch.ones(1, dtype=torch.float64),
    }
    layout = hf.safetensors_file([(k, str(v.dtype)[6:], tuple(v.shape)) for k, v in tensors.items()], {"format": "pt"})
    data = b"".join(tensors[s.name].contiguous().view(torch.uint8).numpy().tobytes() for s in layout.slots)
    assert layout.header + data == save(tensors, metadata={"format": "pt"})


def test_plan_batches_bounds_merges_and_covers() -> None:
    # Three output tensors in file order: fp32 -> bf16 (cast), bf16 -> bf16, an int64 buffer.
    a = (Run(ref("r0", 100, data_offset=1000), 10, 60, 0), Run(ref("r1", 100, data_offset=5000), 0, 40, 60))
    b = (Run(ref("m", 50, "bfloat16", data_offset=64), 0, 50, 0),)
    c = (Run(ref("m", 1, "int64", data_offset=8), 0, 1, 0),)
    slots = [("bfloat16", 0, a), ("bfloat16", 200, b), ("int64", 300, c)]
    batches = plan_batches(slots, chunk_bytes=128)
    assert len(batches) == 4 and all(bt.out_nbytes <= 128 and bt.src_nbytes <= 128 for bt in batches)
    assert [bt.file_start for bt in batches] == [sum(x.out_nbytes for x in batches[:i]) for i in range(len(batches))]
    assert sum(bt.out_nbytes for bt in batches) == 308
    for bt in batches:
        assert bt.src_nbytes == sum(cp.end - cp.start for cp in bt.copies)
        for cp in bt.copies:
            sizes = {"int64": 8, "float32": 4, "bfloat16": 2}
            assert cp.dest + (cp.end - cp.start) // sizes[cp.dtype] * sizes[cp.out_dtype] <= bt.out_nbytes
    copies = [cp for bt in batches for cp in bt.copies]
    assert sum(cp.end - cp.start for cp in copies if cp.dtype == "float32") == 400  # 100 fp32 elements
    assert (copies[0].uri, copies[0].start) == ("r0", 1040)  # element 10 of r0
    assert sum(cp.end - cp.start for cp in copies if cp.dtype == "bfloat16") == 100
    assert copies[-1] == ByteCopy("m", 8, 16, "int64", copies[-1].dest, "int64")
    # One big batch: each run is one copy, adjacent pieces merged.
    (whole,) = plan_batches(slots, 1 << 20)
    assert whole.copies == (ByteCopy("r0", 1040, 1280, "float32", 0, "bfloat16"), ByteCopy("r1", 5000, 5160, "float32", 120,
                            "bfloat16"), ByteCopy("m", 64, 164, "bfloat16", 200, "bfloat16"), ByteCopy("m", 8, 16, "int64", 300,
                            "int64"))


def test_coverage_rejects_gaps_and_overlaps() -> None:
    source = ref("x", 10)
    check_coverage("w", 10, (Run(source, 5, 5, 5), Run(source, 0, 5, 0)))
    for runs in [(Run(source, 0, 4, 0), Run(source, 5, 5, 5)), (Run(source, 0, 6, 0), Run(source, 5, 5, 5)),
                 (Run(source, 0, 9, 0),)]:
        with pytest.raises(CheckpointError, match="w: its saved pieces do not add up to its 10 elements"):
            check_coverage("w", 10, runs)


def test_options_are_validated() -> None:
    assert ConsolidateOptions(dtype="bfloat16", max_shard_size="2MB").dtype == "bf16"
    assert ConsolidateOptions(max_shard_size="2MB").max_shard_size == 2_000_000
    assert ConsolidateOptions(max_shard_size="1GiB").max_shard_size == 2**30
    with pytest.raises(ValueError, match="dtype must be one of fp32, bf16, fp16, got 'int8'"):
        ConsolidateOptions(dtype="int8")
    with pytest.raises(ValueError, match="cannot read '5XB' as a size"):
        ConsolidateOptions(max_shard_size="5XB")
    with pytest.raises(ValueError, match="workers must be a positive integer"):
        ConsolidateOptions(workers=0)


@pytest.mark.parametrize("kind", ["megatron", "autotp"])
def test_megatron_fused_qkv_is_refused_at_tp_above_1(kind: str) -> None:
    """A Megatron-style index (constructed) at tp 2 holding `query_key_value`: without a declared layout, refused
    in the one line `reshard` gives a tensor-parallel change of it (`readers.pipeline.FUSED_QKV_WHY`), its hint
    naming `qkv_layout`, nothing planned; at tp 1, and for an AutoTP checkpoint (whose own maps say how its ranks
    join), that check passes (the index holds no tensors, which is what is refused next)."""
    from types import SimpleNamespace

    from ckptflow.errors import UnsupportedCheckpointError
    from ckptflow.formats.deepspeed.readers.model_parallel import ModelParallelCheckpoint

    qkv = "1.self_attention.query_key_value.weight"
    rank = SimpleNamespace(params=(SimpleNamespace(name="1.input_layernorm.weight"), SimpleNamespace(name=qkv)))
    index = ModelParallelCheckpoint(root="/runs/gpt", tag="global_step3", stage=1, world_size=2, precision="fp32",
                                    step=3, ds_version="0.19.8", kind=kind, description="Megatron-style", tp=2, pp=1,
                                    ranks=(rank, rank), tensors=(), tied={}, replicas=())
    if kind == "megatron":
        with pytest.raises(UnsupportedCheckpointError) as refused:
            plan_consolidation(index)
        assert str(refused.value) == (
            f"/runs/gpt/global_step3: {qkv} is Megatron's fused attention projection, whose rows each "
            "tensor-parallel rank holds as [q | k | v] of its own heads in Megatron-DeepSpeed since December 2024 and "
            "key/value group by group before; the checkpoint does not record which, and joined or cut the wrong way "
            "the model loads and computes something else; declare the layout the checkpoint's Megatron-DeepSpeed "
            "wrote with `qkv_layout` (blocks since December 2024, groups before), or join its 2 tensor-parallel "
            "ranks with the Megatron-DeepSpeed version that saved it")
        assert (refused.value.code, refused.value.tensor) == ("unsupported-shape", qkv)
    for joinable in ([replace(index, tp=1, ranks=(rank,))] if kind == "megatron" else [index]):
        with pytest.raises(CheckpointError, match="has nothing to write"):
            plan_consolidation(joinable)


QKV = "3.self_attention.query_key_value"


def _fused_index(heads: tuple[int, int, int], tp: int, args: dict[str, Any] | None) -> tuple[Any, dict[str, Any]]:
    """A Megatron-style index (constructed) at tensor-parallel degree `tp` whose one layer holds a fused
    `query_key_value` weight (3 columns) and bias of `heads` (attention heads, key/value heads, rows each), its
    run's `args` `args`; each rank's rows saved as fp32 masters cut mid-row into two flat fragments (as a ZeRO
    partition cuts them), every element a distinct value. With the saved values by uri."""
    from types import SimpleNamespace

    import numpy as np

    from ckptflow.formats.deepspeed.model import ModelTensor
    from ckptflow.formats.deepspeed.readers.model_parallel import ModelParallelCheckpoint
    from ckptflow.formats.deepspeed.runs import Run
    from ckptflow.formats.torch.inert import InertRecord

    q, kv, dim = heads
    rows = (q + 2 * kv) * dim
    saved: dict[str, Any] = {}
    tensors = []
    for name, shape in ((f"{QKV}.weight", (rows, 3)), (f"{QKV}.bias", (rows,))):
        local = rows // tp * (shape[1] if len(shape) > 1 else 1)
        runs = []
        for r in range(tp):
            cut = local // 2 + 1
            for part, (start, count) in enumerate(((0, cut), (cut, local - cut))):
                uri = f"/runs/gpt/{name}.{r}.{part}"
                saved[uri] = np.arange(count, dtype=np.float32) + len(saved) * 1000
                runs.append(Run(ref(uri, count), 0, count, r * local + start))
        tensors.append(ModelTensor(name, shape, "float32", "param", tuple(runs)))
    record = InertRecord("argparse", "Namespace", "reduce", ops=(("build", args),)) if args is not None else None
    ranks = tuple(SimpleNamespace(
        params=tuple(SimpleNamespace(name=t.name) for t in tensors),
        param_by_name={t.name: SimpleNamespace(shape=(t.shape[0] // tp, *t.shape[1:])) for t in tensors},
        model_states=[{"args": record}]) for _ in range(tp))
    index = ModelParallelCheckpoint(root="/runs/gpt", tag="global_step3", stage=1, world_size=tp, precision="fp32",
                                    step=3, ds_version="0.19.8", kind="megatron", description="Megatron-style", tp=tp,
                                    pp=1, ranks=ranks, tensors=tuple(tensors), tied={}, replicas=())
    return index, saved


def _values(t: OutputTensor, saved: Mapping[str, Any]) -> Any:
    """The output tensor its runs make of the `saved` values (NaN where no run lands)."""
    import numpy as np

    out = np.full(t.numel, np.nan, dtype=np.float32)
    for run in t.runs:
        for i in range(run.rows):
            at = run.offset + i * run.stride
            out[at:at + run.row] = saved[run.ref.uri][run.start + i * run.row:run.start + (i + 1) * run.row]
    return out.reshape(t.shape)


@pytest.mark.parametrize("heads, tp", [((4, 4, 2), 2), ((8, 2, 2), 2), ((4, 4, 1), 4)],
                         ids=["mha-tp2", "gqa-tp2", "mha-tp4"])
@pytest.mark.parametrize("layout", ["blocks", "groups"])
def test_a_declared_qkv_layout_joins_the_rows_as_a_tp1_reshard_cuts_them(heads: tuple[int, int, int], tp: int,
                                                                         layout: str) -> None:
    """`qkv_layout`: the fused projection's weight and bias, whose fp32 masters are fragments cut mid-row, come
    out with the rows of the ranks joined one after the other where `reshard --tp 1` puts them in that layout
    (`formats.deepspeed.qkv.qkv_rows` applied to the joined rows: the same bytes); for "blocks", all q rows of every rank,
    then all k, then all v (as Megatron-DeepSpeed's model at tp 1 reads them); for "groups", the ranks one after
    the other, as without a layout at tp 1."""
    import numpy as np

    from ckptflow.formats.deepspeed.qkv import Heads, qkv_rows

    q, kv, dim = heads
    index, saved = _fused_index(heads, tp, {"num_attention_heads": q, "num_key_value_heads": kv, "kv_channels": dim})
    plan = plan_consolidation(index, ConsolidateOptions(qkv_layout=layout))
    made = {t.name: t for u in plan.units for t in u.tensors}
    assert sorted(made) == [f"{QKV}.bias", f"{QKV}.weight"]
    for source in index.tensors:
        check_coverage(source.name, source.numel, made[source.name].runs)
        joined = _values(OutputTensor(source.name, "float32", source.shape, source.runs, "param"), saved)
        got = _values(made[source.name], saved)
        expected = np.empty_like(joined)
        for start, dest, count in qkv_rows(layout, Heads(q, kv, dim), tp, 1)[0]:
            expected[dest:dest + count] = joined[start:start + count]
        assert got.tobytes() == expected.tobytes()
        ranks = np.split(joined, tp)
        if layout == "blocks":  # written from Megatron's attention code, not from the mapping
            qr, kvr = q // tp * dim, kv // tp * dim
            megatron = np.concatenate([r[:qr] for r in ranks] + [r[qr:qr + kvr] for r in ranks]
                                      + [r[qr + kvr:] for r in ranks])
            assert got.tobytes() == megatron.tobytes() and got.tobytes() != joined.tobytes()
        else:
            assert got.tobytes() == joined.tobytes()
    at_tp1 = plan_consolidation(replace(index, tp=1, ranks=index.ranks[:1]), ConsolidateOptions(qkv_layout=layout))
    assert {t.name: t.runs for u in at_tp1.units for t in u.tensors} == {t.name: t.runs for t in index.tensors}


@pytest.mark.parametrize("args, why", [
    (None, "the checkpoint's args record no num_attention_heads, so its rows cannot be told apart by head"),
    ({"num_attention_heads": 3}, "its 24 rows are not 3 attention and 6 key/value heads of equal size (args record "
                                 "no kv_channels)"),
    ({"num_attention_heads": 4, "num_key_value_heads": 1}, "its 4 attention and 1 key/value heads do not split over "
                                                           "2 tensor-parallel ranks"),
])
def test_a_declared_qkv_layout_without_the_heads_is_refused(args: dict[str, Any] | None, why: str) -> None:
    from ckptflow.errors import UnsupportedCheckpointError

    index, _ = _fused_index((4, 4, 2), 2, args)
    if args is not None and args.get("num_key_value_heads") == 1:
        index, _ = _fused_index((4, 1, 4), 2, args)
    with pytest.raises(UnsupportedCheckpointError) as refused:
        plan_consolidation(index, ConsolidateOptions(qkv_layout="blocks"))
    assert str(refused.value) == (f"/runs/gpt/global_step3: {QKV}.weight cannot be joined in the blocks layout: "
                                  f"{why}; join its 2 tensor-parallel ranks with the Megatron-DeepSpeed version that "
                                  "saved it")
    assert (refused.value.code, refused.value.tensor) == ("unsupported-shape", f"{QKV}.weight")
    with pytest.raises(ValueError, match="the query_key_value layout must be blocks or groups; got 'rows'"):
        ConsolidateOptions(qkv_layout="rows")



@pytest.mark.parametrize("rules, why", [
    ({"parameter_to_average_patterns": [r".*query_key_value"]},
     "the checkpoint records it as averaged over the tensor-parallel ranks; ckptflow copies bytes and does not "
     "average: convert it with deepspeed.checkpoint.ds_to_universal"),
    ({"parameter_with_row_parallelism_patterns": [r".*query_key_value\.weight"]},
     "the checkpoint does not record it as a column-parallel parameter, split on its rows"),
    ({"parameter_with_row_parallelism_patterns": ["("]},
     "the recorded pattern '(' is not a regular expression (missing ), unterminated subpattern at position 0)"),
])
def test_a_fused_projection_the_rules_do_not_join_on_rows_is_refused_with_their_reason(
        rules: dict[str, Any], why: str) -> None:
    """The refusal says what the checkpoint's own split rules say of the projection, not a guess."""
    from ckptflow.errors import UnsupportedCheckpointError
    from ckptflow.formats.deepspeed.names import UC_INFO

    index, _ = _fused_index((4, 4, 2), 2, {"num_attention_heads": 4, "kv_channels": 2})
    for rank in index.ranks:
        rank.model_states[0][UC_INFO] = rules
    with pytest.raises(UnsupportedCheckpointError) as refused:
        plan_consolidation(index, ConsolidateOptions(qkv_layout="blocks"))
    assert f"{QKV}.weight cannot be joined in the blocks layout: {why}; " in str(refused.value)

# ---- every fixture --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", WRITER_NAMES)
def test_equals_deepspeed_and_real_buffers(name: str, ds_fixtures: Mapping[str, Fixture], tmp_path: Path) -> None:
    fixture = ds_fixtures[name]
    # fp32 in small shards: bit for bit the fp32 master weights.
    result = consolidate(str(fixture.dir), str(tmp_path / "fp32"),
                         options=ConsolidateOptions(max_shard_size="2KB", workers=3))
    assert len(result.shards) > 1 and result.verified
    check_against_sources(fixture, tmp_path / "fp32", torch.float32)
    index = json.loads((tmp_path / "fp32" / hf.SAFE_WEIGHTS_INDEX_NAME).read_text())
    got = read_output(tmp_path / "fp32")
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in got.values())
    assert set(index["weight_map"]) == set(got)
    # bf16 in one file: the fp32 masters cast with torch's rounding.
    consolidate(str(fixture.dir), str(tmp_path / "bf16"), options=ConsolidateOptions(dtype="bf16"))
    assert sorted(p.name for p in (tmp_path / "bf16").glob("model*")) == [hf.SAFE_WEIGHTS_NAME]
    assert (tmp_path / "bf16" / PROVENANCE_NAME).exists()
    check_against_sources(fixture, tmp_path / "bf16", torch.bfloat16)


def test_tied_frozen_and_provenance(ds_fixtures: Mapping[str, Fixture], tmp_path: Path) -> None:
    fixture = ds_fixtures["z3-bf16-ws2"]
    result = consolidate(str(fixture.dir), str(tmp_path / "out"), options=ConsolidateOptions(exclude_frozen=True))
    got = read_output(tmp_path / "out")
    assert "emb.weight" in got and "head.weight" not in got
    assert not any(name.startswith("frozen.") for name in got)
    record = json.loads((tmp_path / "out" / PROVENANCE_NAME).read_text())
    assert record["output"]["excluded"] == ["frozen.weight", "frozen.bias"]
    assert record["output"]["tied"] == {"head.weight": "emb.weight"}
    import hashlib

    shard = tmp_path / "out" / hf.SAFE_WEIGHTS_NAME
    assert record["shards"] == {hf.SAFE_WEIGHTS_NAME: {"sha256": hashlib.sha256(shard.read_bytes()).hexdigest(),
                                                       "size": shard.stat().st_size}}
    assert record["source"] == {
        "uri": f"{fixture.dir}/{fixture.tag}", "root": str(fixture.dir), "tag": fixture.tag, "step": 3,
        "zero_stage": 3, "world_size": 2, "precision": "bf16", "deepspeed_version": "0.19.8",
        "layout": "ZeRO-3, data-parallel 2",
    }
    assert record["output"]["dtype"] == "float32" and record["ckptflow_version"]
    assert result.files[-1] == hf.SAFE_WEIGHTS_NAME


# ---- Hugging Face ---------------------------------------------------------------------------------


def test_trainer_checkpoint_loads_in_transformers(llama_trainer_ckpt: Fixture, tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "model"
    result = consolidate(str(llama_trainer_ckpt.dir), str(out), options=ConsolidateOptions(dtype="fp32"))
    assert set(result.side_files) >= {"config.json", "generation_config.json", "tokenizer.json",
                                      "tokenizer_config.json"}
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert info == {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set(), "error_msgs": []}
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer("the quick brown fox jumps over the lazy dog", return_tensors="pt").input_ids
    assert ids.shape[1] == 9 and tokenizer.unk_token_id not in ids[0].tolist()
    reference = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(llama_trainer_ckpt.dir))
    reference.load_state_dict(deepspeed_state_dict(llama_trainer_ckpt.dir), strict=True)
    with torch.no_grad():
        assert torch.equal(model.eval()(ids).logits, reference.eval()(ids).logits)


def test_same_files_as_save_pretrained(llama_trainer_ckpt: Fixture, tmp_path: Path) -> None:
    """Small shards: the same file names, index and shard bytes as `save_pretrained` gives for the model
    built from DeepSpeed's reconstruction; transformers loads them; the config follows --dtype."""
    from transformers import AutoConfig, AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(llama_trainer_ckpt.dir))
    reference.load_state_dict(deepspeed_state_dict(llama_trainer_ckpt.dir), strict=True)
    reference.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    consolidate(str(llama_trainer_ckpt.dir), str(tmp_path / "ours"), options=ConsolidateOptions(max_shard_size="40KB"))
    theirs = sorted(p.name for p in (tmp_path / "hf").glob("model*"))
    assert len(theirs) > 3 and theirs == sorted(p.name for p in (tmp_path / "ours").glob("model*"))
    for name in theirs:
        assert (tmp_path / "hf" / name).read_bytes() == (tmp_path / "ours" / name).read_bytes(), name
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]

    consolidate(str(llama_trainer_ckpt.dir), str(tmp_path / "bf16"), options=ConsolidateOptions(dtype="bf16"))
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert config["torch_dtype"] == config["dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype="auto")
    assert model.dtype == torch.bfloat16


# ---- fp16 (no GPU here: a rewritten fp32 checkpoint, and DeepSpeed's fp16 path run on CPU) ---------


def make_fp16_checkpoint(fixture: Fixture, dest: Path) -> Path:
    """The fixture re-saved as DeepSpeed's fp16 mode saves: ds_config fp16 enabled, a dynamic loss
    scaler, the module copy and frozen parameters in fp16, file names without `bf16_`. The module copy
    of trainable parameters is poisoned, to prove it is never read. (Test-only use of torch.load on
    our own fixture.)"""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    assert fixture.dtype == "fp32"
    shutil.copytree(fixture.dir, dest)
    tag = dest / fixture.tag
    for path in sorted(tag.glob("*.pt")):
        state = torch.load(path, weights_only=False)
        if "module" in state:
            buffers = set(state.get("buffer_names") or ())
            state["module"] = {
                k: v if k in buffers or not v.is_floating_point() else torch.full_like(v, 1e4, dtype=torch.float16)
                for k, v in state["module"].items()
            }
            state["frozen_param_fragments"] = {k: v.half() for k, v in (state.get("frozen_param_fragments")
                                                                        or {}).items()}
            state["ds_config"] = {**state["ds_config"], "fp16": {"enabled": True, "loss_scale": 0,
                                                                 "initial_scale_power": 16}}
        else:
            osd = state["optimizer_state_dict"]
            osd["loss_scaler"] = DynamicLossScaler(init_scale=2.0**16, scale_window=1000, min_scale=1,
                                                   delayed_shift=2, consecutive_hysteresis=False)
            osd["dynamic_loss_scale"] = True
        torch.save(state, path)
    return dest


@pytest.mark.parametrize("name", ["z2-fp32-ws2", "z3-fp32-ws3"])
def test_fp16_training_checkpoint(name: str, ds_fixtures: Mapping[str, Fixture], tmp_path: Path) -> None:
    fixture = ds_fixtures[name]
    ckpt = make_fp16_checkpoint(fixture, tmp_path / "fp16-ckpt")
    index = load_index(str(ckpt))
    assert index.precision == "fp16" and all(p.dtype == "float16" for p in index.params)
    engine = load_file(fixture.expected_path)
    reference = deepspeed_state_dict(ckpt)
    for dtype, torch_dtype in (("fp32", torch.float32), ("fp16", torch.float16)):
        out = tmp_path / dtype
        consolidate(str(ckpt), str(out), options=ConsolidateOptions(dtype=dtype))
        got = read_output(out)
        for pname, tensor in got.items():
            if f"fp32/{pname}" in engine:  # the fp32 master, never the poisoned 16-bit copy
                assert torch.equal(tensor, engine[f"fp32/{pname}"].to(torch_dtype)), pname
                assert torch.equal(tensor, reference[pname].to(torch_dtype)), pname
        assert torch.equal(got["frozen.weight"], engine["frozen/frozen.weight"].half().to(torch_dtype))
        assert got["big"].tolist() == [BIG_INT64]


@pytest.fixture(scope="session")
def fp16_checkpoints() -> dict[int, Path]:
    """Real fp16 checkpoints of the toy model (ZeRO-1, 2 and 3, 2 ranks, 3 steps, dynamic loss scaler),
    written by DeepSpeed's own fp16 path on CPU with its "fp16 not supported" device gate lifted (the
    reshard tests' rank script, tests/oracles/reshard.py). Cached in .cache/ by a hash of the scripts."""
    import hashlib
    import tempfile

    import deepspeed

    from tests.fixtures.launch import REPO_ROOT, launch

    digest = hashlib.sha256(f"{torch.__version__} {deepspeed.__version__}".encode())
    for script in ("tests/oracles/reshard.py", "tests/fixtures/models/data_parallel.py"):
        digest.update((REPO_ROOT / script).read_bytes())
    root = REPO_ROOT / ".cache" / "consolidate-fp16" / digest.hexdigest()[:16]
    if not (root / "done").exists():
        root.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root.parent))
        try:
            jobs = [{"model": "toy", "stage": stage, "dtype": "fp16", "write": str(tmp / f"z{stage}"), "steps": 3}
                    for stage in (1, 2, 3)]
            (tmp / "jobs.json").write_text(json.dumps(jobs))
            launch("tests.oracles.reshard", 2, ["--jobs", str(tmp / "jobs.json")])
            (tmp / "done").write_text("")
            shutil.rmtree(root, ignore_errors=True)
            os.rename(tmp, root)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return {stage: root / f"z{stage}" for stage in (1, 2, 3)}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_real_fp16_checkpoint(stage: int, fp16_checkpoints: dict[int, Path], tmp_path: Path) -> None:
    ckpt = fp16_checkpoints[stage]
    index = load_index(str(ckpt))
    assert (index.stage, index.precision, index.world_size) == (stage, "fp16", 2)
    assert not list(ckpt.glob("*/bf16_*")) and all(p.dtype == "float16" for p in index.params)
    reference = deepspeed_state_dict(ckpt)
    names, tied = model_keys(Fixture(name="fp16", root=ckpt, dir=ckpt, stage=stage, dtype="fp16", world_size=2,
                                     offload=False, spec={"model": "toy"}, buffers_path=ckpt, expected_path=ckpt))
    for dtype, torch_dtype in (("fp32", torch.float32), ("fp16", torch.float16)):
        consolidate(str(ckpt), str(tmp_path / dtype), options=ConsolidateOptions(dtype=dtype, max_shard_size="1KB"))
        got = read_output(tmp_path / dtype)
        assert set(got) == set(names) and not set(tied) & set(got)
        for name, tensor in got.items():
            if name in index.param_by_name and name in reference:
                assert tensor.dtype == torch_dtype and torch.equal(tensor, reference[name].to(torch_dtype)), name
            elif name in index.param_by_name:  # ZeRO-1 frozen: DeepSpeed drops them; the module copy is all there is
                assert stage == 1
                module = torch.load(ckpt / index.tag / "mp_rank_00_model_states.pt", weights_only=False)["module"]
                assert torch.equal(tensor, module[name].to(torch_dtype)), name
            else:  # buffers keep the dtype they were saved in (DeepSpeed's reader turns floats into fp32)
                assert torch.equal(tensor.to(reference[name].dtype), reference[name]), name
        assert got["big"].dtype == torch.int64 and got["big"].tolist() == [BIG_INT64]


# ---- storage: buckets, byte ranges, no optimizer moments -----------------------------------------


class RecordingFileSystem(LocalFileSystem):
    """A local filesystem under `recording://` that logs every byte range read by cat_file."""

    protocol = "recording"
    ranges: ClassVar[list[tuple[str, int | None, int | None]]] = []

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        return super()._strip_protocol(str(path).removeprefix("recording://"))

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        self.ranges.append((self._strip_protocol(path), start, end))
        return super().cat_file(path, start=start, end=end, **kwargs)


class FailingFileSystem(LocalFileSystem):
    """A local filesystem under `failing://` whose byte-range reads of one span of one file fail
    (`mode="error"`) or come back short (`mode="short"`)."""

    protocol = "failing"
    target: ClassVar[tuple[str, int, int] | None] = None
    mode: ClassVar[str] = "error"

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        return super()._strip_protocol(str(path).removeprefix("failing://"))

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        path = self._strip_protocol(path)
        if self.target and path == self.target[0] and start is not None and end is not None \
                and start < self.target[2] and end > self.target[1]:
            if self.mode == "error":
                raise OSError(5, "Input/output error (injected)")
            return super().cat_file(path, start=start, end=end - 1, **kwargs)
        return super().cat_file(path, start=start, end=end, **kwargs)


class _FlipOneByte:
    """A file being written whose byte `at` is flipped on the way to the disk."""

    def __init__(self, inner: Any, at: int) -> None:
        self.inner, self.at, self.pos = inner, at, 0

    def write(self, data: Any) -> int:
        raw = bytearray(data)
        if self.pos <= self.at < self.pos + len(raw):
            raw[self.at - self.pos] ^= 0xFF
        self.pos += len(raw)
        return self.inner.write(bytes(raw))

    def __enter__(self) -> "_FlipOneByte":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.inner.close()


class CorruptingFileSystem(LocalFileSystem):
    """A local filesystem under `corrupting://` that flips the last byte of every shard written
    through it and logs the order in which files are copied into place."""

    protocol = "corrupting"
    flip: ClassVar[bool] = True
    moves: ClassVar[list[str]] = []

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        return super()._strip_protocol(str(path).removeprefix("corrupting://"))

    def open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        inner = super().open(path, mode, **kwargs)
        if self.flip and "w" in mode and str(path).endswith(".safetensors"):
            return _FlipOneByte(inner, at=self.size_hint[self._strip_protocol(path).rsplit("/", 1)[-1]] - 1)
        return inner

    size_hint: ClassVar[dict[str, int]] = {}

    def copy(self, path1: str, path2: str, **kwargs: Any) -> None:
        self.moves.append(str(path2).rsplit("/", 1)[-1])
        super().copy(path1, path2, **kwargs)


fsspec.register_implementation("recording", RecordingFileSystem, clobber=True)
fsspec.register_implementation("failing", FailingFileSystem, clobber=True)
fsspec.register_implementation("corrupting", CorruptingFileSystem, clobber=True)


def test_reads_fp32_masters_by_byte_range_only(ds_fixtures: Mapping[str, Fixture], tmp_path: Path) -> None:
    fixture = ds_fixtures["z2-bf16-ws3"]
    index = load_index(str(fixture.dir))
    RecordingFileSystem.ranges.clear()
    consolidate(f"recording://{fixture.dir}", str(tmp_path / "out"), options=ConsolidateOptions(verify=False))
    assert [p for p, s, e in RecordingFileSystem.ranges if s is None or e is None] == []  # byte ranges only
    assert [(s, e) for p, s, e in RecordingFileSystem.ranges if p.endswith("/latest")] == [(0, 4097)]
    reads = [(p, s, e) for p, s, e in RecordingFileSystem.ranges
             if s is not None and e is not None and e - s > 64 and not p.endswith("/latest")]
    moments = [(ref.uri, *ref.byte_range) for row in index.partitions for part in row for key, ref in part.state.items()
               if key != "step"]
    for path, start, end in reads:
        for uri, m_start, m_end in moments:
            assert not (uri == path and start < m_end and end > m_start), f"read optimizer moments of {uri}"
    masters = sum(part.fp32.nbytes for row in index.partitions for part in row)
    files = {p for p, _, _ in reads}
    data = tensor_reads(reads, {p: storage_ranges(p) for p in files if p.endswith(".pt")})
    assert masters <= data <= masters + 4096  # the masters, and of the rest only headers and pickles


def test_memory_filesystem_source_and_output(ds_fixtures: Mapping[str, Fixture], tmp_path: Path) -> None:
    fixture = ds_fixtures["z3-bf16-ws2"]
    fs = fsspec.filesystem("memory")
    fs.put(str(fixture.dir), "/ckpt-src", recursive=True)
    try:
        result = consolidate("memory:///ckpt-src", "memory:///models/toy",
                             options=ConsolidateOptions(max_shard_size="1KB", dtype="bf16"))
        names = sorted(p.rsplit("/", 1)[1] for p in fs.ls("/models/toy", detail=False))
        assert names == sorted(result.files) and hf.SAFE_WEIGHTS_INDEX_NAME in names
        assert [p for p in fs.ls("/models", detail=False) if "partial" in p] == []
        local = tmp_path / "copy"
        fs.get("/models/toy/", str(local) + "/", recursive=True)
        check_against_sources(fixture, local, torch.bfloat16)
    finally:
        fs.rm("/ckpt-src", recursive=True)
        if fs.exists("/models"):
            fs.rm("/models", recursive=True)


# ---- failures: nothing half-written, clear messages -----------------------------------------------


def assert_nothing_left(parent: Path, out: Path) -> None:
    assert not out.exists()
    assert [p.name for p in parent.iterdir() if "partial" in p.name] == []


@pytest.mark.parametrize("mode", ["error", "short"])
def test_source_breaking_midway_leaves_no_output(mode: str, ds_fixtures: Mapping[str, Fixture], tmp_path: Path) -> None:
    fixture = ds_fixtures["z3-fp32-ws2"]
    index = load_index(str(fixture.dir))
    fp32 = index.partitions[1][0].fp32
    start, end = fp32.byte_range
    FailingFileSystem.target = (fp32.uri, (start + end) // 2, end)  # the second half of rank 1's group 0
    FailingFileSystem.mode = mode
    out = tmp_path / "out"
    try:
        expected = SourceReadError if mode == "error" else CorruptFileError
        with pytest.raises(expected) as caught:
            consolidate(f"failing://{fixture.dir}", str(out),
                        options=ConsolidateOptions(max_shard_size="1KB", workers=1))
    finally:
        FailingFileSystem.target = None
    if mode == "error":
        assert str(caught.value).startswith("cannot read the checkpoint: OSError: [Errno 5] Input/output error "
                                            "(injected) (reading failing://")
        assert str(caught.value).endswith("; check access to the store and run again; nothing was written to OUT")
    else:
        assert "the file is shorter than its own index says" in str(caught.value)
    assert_nothing_left(tmp_path, out)


def test_truncated_rank_file(ds_fixtures: Mapping[str, Fixture], tmp_path: Path) -> None:
    fixture = ds_fixtures["z2-bf16-ws2"]
    ckpt = tmp_path / "ckpt"
    shutil.copytree(fixture.dir, ckpt)
    victim = ckpt / fixture.tag / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    os.truncate(victim, victim.stat().st_size // 2)
    with pytest.raises(CheckpointError) as caught:
        consolidate(str(ckpt), str(tmp_path / "out"))
    assert str(caught.value) == (
        f"rank 1: {victim} is not a readable torch archive (File is not a zip file); the file is truncated or not a "
        "checkpoint; copy it again from the training run"
    )
    assert_nothing_left(tmp_path, tmp_path / "out")


def test_refuses_a_non_empty_output(ds_fixtures: Mapping[str, Fixture], tmp_path: Path) -> None:
    fixture = ds_fixtures["z1-fp32-ws2"]
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(OutputError, match=r"out already exists and is not empty; choose a new folder, or remove this"):
        consolidate(str(fixture.dir), str(tmp_path / "out"))
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]
    (tmp_path / "empty").mkdir()
    consolidate(str(fixture.dir), str(tmp_path / "empty"))
    assert (tmp_path / "empty" / hf.SAFE_WEIGHTS_NAME).exists()


def test_a_committed_model_is_taken_only_when_it_is_this_plans(ds_fixtures: Mapping[str, Fixture],
                                                                 tmp_path: Path) -> None:
    """`committed_output`: what the Prefect step takes when its cached result is gone but its folder is
    there. The same plan gets the folder's shards back (no byte read, nothing written); another plan,
    a shard gone or cut, or a folder ckptflow did not write is refused saying what differs."""
    fixture = ds_fixtures["z2-fp32-ws4"]
    index = load_index(str(fixture.dir))
    out = tmp_path / "out"
    plan = plan_consolidation(index, ConsolidateOptions(dtype="bf16", max_shard_size="1KB"))
    assert committed_output(plan, str(out)) is None
    made = consolidate(str(fixture.dir), str(out), options=ConsolidateOptions(dtype="bf16", max_shard_size="1KB"))
    stamps = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.iterdir()}
    found = committed_output(plan, str(out))
    assert found is not None and found.shards == tuple(replace(s, written=None) for s in made.shards)
    assert (found.files, found.side_files, found.verified) == (made.files, made.side_files, True)
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.iterdir()} == stamps

    def refused(other: ConsolidationPlan, why: str) -> None:
        with pytest.raises(OutputError, match=rf"^{out} already exists and does not hold this output: {why}; "
                                              r"remove it, or choose another folder$"):
            committed_output(other, str(out))

    refused(plan_consolidation(index, ConsolidateOptions(dtype="fp32", max_shard_size="1KB")),
            "it was made with output dtype 'bfloat16', this run asks for 'float32'")
    refused(plan_consolidation(index, ConsolidateOptions(dtype="bf16")),
            "it was made with output max_shard_size 1000, this run asks for 5000000000")
    unverified = tmp_path / "unverified"
    consolidate(str(fixture.dir), str(unverified), options=ConsolidateOptions(dtype="bf16", verify=False))
    with pytest.raises(OutputError, match="its shards were written without `verify`, this run verifies them"):
        committed_output(plan_consolidation(index, ConsolidateOptions(dtype="bf16")), str(unverified))
    assert committed_output(plan_consolidation(index, ConsolidateOptions(dtype="bf16", verify=False)),
                            str(unverified)) is not None
    (out / "junk.bin").write_bytes(b"x")
    refused(plan, r"it holds junk\.bin, which this run does not write")
    (out / "junk.bin").unlink()
    index = out / hf.SAFE_WEIGHTS_INDEX_NAME
    original = index.read_bytes()
    index.write_bytes(original.replace(b"model-00001", b"model-00002", 1))
    refused(plan, rf"its {hf.SAFE_WEIGHTS_INDEX_NAME} is not the index of this model")
    index.write_bytes(b"{}")
    refused(plan, rf"its {hf.SAFE_WEIGHTS_INDEX_NAME} is missing or not the {len(original)} bytes this run writes")
    index.write_bytes(original)
    shard = sorted(out.glob("model-*.safetensors"))[0]
    with shard.open("r+b") as fh:
        fh.truncate(shard.stat().st_size - 1)
    refused(plan, rf"its {shard.name} is missing, is not {shard.stat().st_size + 1} bytes or has no sha256")
    shard.unlink()
    refused(plan, rf"its {shard.name} is missing, is not \d+ bytes or has no sha256")
    (out / PROVENANCE_NAME).write_text("[]")
    refused(plan, f"its {PROVENANCE_NAME} is not a ckptflow provenance record")
    (out / PROVENANCE_NAME).unlink()
    refused(plan, f"it has no {PROVENANCE_NAME}, so ckptflow did not write it")


def test_fails_early_without_disk_space(tmp_path: Path) -> None:
    huge = OutputTensor("w", "float32", (10**15,), (Run(ref("x", 10**15), 0, 10**15, 0),), "param")
    plan = ConsolidationPlan(root=str(tmp_path), tag="t", step=1, stage=3, world_size=1, precision="fp32",
                             ds_version="0.19.8", options=ConsolidateOptions(),
                             units=(ShardUnit(0, hf.SAFE_WEIGHTS_NAME, (huge,)),), tied={}, excluded=())
    with pytest.raises(OutputError, match=r"^not enough free space for .*/out: the output needs 4000\.0 TB but "
                                          r"/\S* has [\d.]+ [KMGT]?B free; free some space or choose another OUT$"):
        prepare_output(plan, str(tmp_path / "out"))
    assert list(tmp_path.iterdir()) == []


def test_units_run_one_by_one_then_finalize(ds_fixtures: Mapping[str, Fixture], tmp_path: Path) -> None:
    """The Prefect layer's path: plan, prepare, one unit at a time (in any order), finalize."""
    fixture = ds_fixtures["z2-fp32-ws4"]
    plan = plan_consolidation(load_index(str(fixture.dir)), ConsolidateOptions(max_shard_size="1KB"))
    assert len(plan.units) > 2
    staging = prepare_output(plan, str(tmp_path / "out"))
    seen: list[tuple[int, int]] = []
    results = [run_unit(plan, unit, staging, progress=lambda d, t: seen.append((d, t)))
               for unit in reversed(plan.units)]
    with pytest.raises(OutputError, match="shard model-00001-of-"):
        finalize(plan, results[:-1], staging)
    assert not (tmp_path / "out").exists()
    finalize(plan, results, staging)
    check_against_sources(fixture, tmp_path / "out", torch.float32)
    assert seen[-1][0] == seen[-1][1] and all(d <= t for d, t in seen)
    assert_nothing_left(tmp_path, tmp_path / "nothing")


@pytest.mark.parametrize("verify", [True, False])
def test_direct_io_and_page_cache_write_the_same_shards(verify: bool, ds_fixtures: Mapping[str, Fixture],
                                                        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Shards go out with O_DIRECT where the file system takes it (whole blocks from aligned memory,
    partial ones through the page cache, the check reading back from the disk) and through the page
    cache where it does not: the same bytes either way. Batches of 5,000 bytes start and end at odd
    places within the 4 KiB blocks, and tensors smaller than a block sit between them (headers longer than
a block: tests/test_direct.py)."""
    from ckptflow.consolidate import write
    from ckptflow.plumbing import direct

    fixture = ds_fixtures["llama-z3-bf16-ws2"]
    options = ConsolidateOptions(max_shard_size="40KB", dtype="bf16", chunk_bytes=5000, verify=verify)
    opened: list[int] = []
    monkeypatch.setattr(write, "open_direct", lambda path: opened.append(direct.open_direct(path)) or opened[-1])
    consolidate(str(fixture.dir), str(tmp_path / "direct"), options=options)
    probe = tmp_path / "probe"
    probe.touch()
    if direct.open_direct(str(probe)) >= 0:  # this file system takes direct I/O: every shard used it
        assert len(opened) > 2 and all(fd >= 0 for fd in opened)
    monkeypatch.setattr(direct, "O_DIRECT", 0)
    consolidate(str(fixture.dir), str(tmp_path / "page-cache"), options=options)
    shards = sorted(p.name for p in (tmp_path / "direct").glob("*.safetensors"))
    assert len(shards) > 2 and shards == sorted(p.name for p in (tmp_path / "page-cache").glob("*.safetensors"))
    for name in shards:
        assert (tmp_path / "direct" / name).read_bytes() == (tmp_path / "page-cache" / name).read_bytes(), name
    check_against_sources(fixture, tmp_path / "direct", torch.bfloat16)


# ---- the command line -----------------------------------------------------------------------------


def test_cli(ds_fixtures: Mapping[str, Fixture], tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from ckptflow.cli import app

    fixture = ds_fixtures["z3-bf16-ws2"]
    runner = CliRunner()
    result = runner.invoke(app, ["consolidate", str(fixture.dir), str(tmp_path / "out"), "--dtype", "bf16",
                                 "--max-shard-size", "1KB", "--workers", "2", "--exclude-frozen"])
    assert result.exit_code == 0, result.output
    assert "consolidated" in result.output and "bfloat16, verified" in result.output
    got = read_output(tmp_path / "out")
    assert got["emb.weight"].dtype == torch.bfloat16 and "frozen.weight" not in got
    again = runner.invoke(app, ["consolidate", str(fixture.dir), str(tmp_path / "out")])
    assert again.exit_code == 1 and "already exists and is not empty" in again.output
    assert "Traceback" not in again.output
    bad = runner.invoke(app, ["consolidate", str(fixture.dir), str(tmp_path / "x"), "--dtype", "int4"])
    assert bad.exit_code == 2 and "Invalid value for '--dtype'" in " ".join(bad.output.split())
    assert "'int4' is not one of 'fp32', 'bf16', 'fp16'" in " ".join(bad.output.replace("│", " ").split())


def test_verify_catches_a_bad_write_and_publishes_index_last(ds_fixtures: Mapping[str, Fixture],
                                                               tmp_path: Path) -> None:
    fixture = ds_fixtures["z2-fp32-ws2"]
    options = ConsolidateOptions(max_shard_size="1KB", workers=2)
    plan = plan_consolidation(load_index(str(fixture.dir)), options)
    CorruptingFileSystem.size_hint = {u.filename: u.file().file_size for u in plan.units}
    CorruptingFileSystem.flip = True
    with pytest.raises(VerificationError, match=r"^tensor \S+ in corrupting://.*model-000\d\d-of-000\d\d.safetensors "
                                                r"differs from the source at element \d+"):
        consolidate(str(fixture.dir), f"corrupting://{tmp_path}/out", options=options)
    assert_nothing_left(tmp_path, tmp_path / "out")
    CorruptingFileSystem.flip = False
    CorruptingFileSystem.moves.clear()
    consolidate(str(fixture.dir), f"corrupting://{tmp_path}/out", options=options)
    assert CorruptingFileSystem.moves[-1] == hf.SAFE_WEIGHTS_INDEX_NAME
    assert CorruptingFileSystem.moves[:len(plan.units)] == [u.filename for u in plan.units]
    check_against_sources(fixture, tmp_path / "out", torch.float32)
    assert_nothing_left(tmp_path, tmp_path / "nothing")


def test_config_rewrite_and_sizes() -> None:
    raw = json.dumps({"architectures": ["X"], "dtype": "float32", "vocab_size": 3}).encode()
    assert json.loads(hf.rewrite_config(raw, "bfloat16")) == {
        "architectures": ["X"], "dtype": "bfloat16", "vocab_size": 3, "torch_dtype": "bfloat16"}
    assert json.loads(hf.rewrite_config(b'{"torch_dtype": "float32"}', "float16")) == {"torch_dtype": "float16"}
    with pytest.raises(CheckpointError, match="config.json does not hold a JSON object"):
        hf.rewrite_config(b"[]", "float16")
    assert [parse_size(v) for v in ("5GB", "500MB", "2GiB", "1.5KB", 7, " 10 kb ")] == [
        5 * 10**9, 5 * 10**8, 2 * 2**30, 1500, 7, 10_000]
    for bad in ("", "GB", "-1MB", "5 XB", 0):
        with pytest.raises(ValueError):
            parse_size(bad)



def test_source_as_tag_folder_or_tag_option(ds_fixtures: Mapping[str, Fixture], tmp_path: Path) -> None:
    fixture = ds_fixtures["z3-fp32-ws3"]
    a = consolidate(str(fixture.tag_dir), str(tmp_path / "a"))
    b = consolidate(str(fixture.dir), str(tmp_path / "b"), tag=fixture.tag)
    assert (a.plan.root, a.plan.tag) == (b.plan.root, b.plan.tag) == (str(fixture.dir), fixture.tag)
    assert (tmp_path / "a" / hf.SAFE_WEIGHTS_NAME).read_bytes() == (tmp_path / "b" / hf.SAFE_WEIGHTS_NAME).read_bytes()
    with pytest.raises(CheckpointNotFoundError, match="global_step9 does not exist"):
        consolidate(str(fixture.dir), str(tmp_path / "c"), tag="global_step9")
    assert_nothing_left(tmp_path, tmp_path / "c")


def test_gcs_bucket_to_bucket(ds_fixtures: Mapping[str, Fixture], gcs: Any, tmp_path: Path) -> None:
    """The GCS emulator through gcsfs: the output written to the bucket and equal to the sources;
    retried 503s are absorbed, a permanent 403 on reads ends in a clear error and no OUT."""
    fixture = ds_fixtures["z2-bf16-ws3"]
    fs, _ = fsspec.core.url_to_fs(gcs.url)
    src, out = f"{gcs.url}/ckpt", f"{gcs.url}/model"
    fs.put(str(fixture.dir) + "/", src + "/", recursive=True)
    consolidate(src, out, options=ConsolidateOptions(dtype="bf16", max_shard_size="2KB"))
    fs.get(out + "/", str(tmp_path / "copy") + "/", recursive=True)
    check_against_sources(fixture, tmp_path / "copy", torch.bfloat16)

    gcs.proxy.configure(rate=0.3, kinds=("503",), seed=3, max_faults=2, only_paths=("optim_states",))
    consolidate(src, out + "-retried", options=ConsolidateOptions(max_shard_size="2KB"))
    assert sum(gcs.proxy.faults.values()) == 2

    # A 403 on rank 2's file once the index is read: the requests an index read makes (listings are
    # cached by now) are let through, the next one, a data range, is refused.
    gcs.proxy.configure(only_paths=("zero_pp_rank_2",))
    load_index(src)
    gcs.proxy.configure(status=403, only_paths=("zero_pp_rank_2",), spare_first=gcs.proxy.counters.targeted)
    with pytest.raises(SourceReadError) as caught:
        consolidate(src, out + "-refused", options=ConsolidateOptions(max_shard_size="2KB"))
    assert str(caught.value).startswith("cannot read the checkpoint: ") and "zero_pp_rank_2" in str(caught.value)
    assert str(caught.value).endswith("check access to the store and run again; nothing was written to OUT")
    gcs.proxy.reset()
    assert not fs.exists(out + "-refused") and not [p for p in fs.ls(gcs.url, detail=False) if "partial" in p]
