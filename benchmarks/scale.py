"""Benchmark (issue 12), part 1: planning at real scale, on synthetic ZeRO-3 checkpoints.

`generate` writes a ZeRO-3 bf16 checkpoint shaped like Llama-3-70B at 512 ranks or Llama-3-405B at
1024 ranks, as DeepSpeed 0.19.8 writes one: `latest` and, per rank,
`zero_pp_rank_{r}_mp_rank_00_model_states.pt` and `bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt`,
with the key structure of a real DeepSpeed-written Llama fixture (`check-structure` compares the two)
and the param groups of a Hugging Face Trainer (weights with decay, norms without). The archives are
real torch zip files: the pickles come from `ckptflow.torchsave.dumps`, the zip records are laid out
as torch writes them, and every storage's bytes are a hole (the file has its full size, but only its
headers, pickle and central directory are on disk; the CRC-32s are those of zeros). Checked on the
`tiny` shape: `torch.load` reads every file, DeepSpeed's `get_fp32_state_dict_from_zero_checkpoint`
rebuilds every parameter at its shape, and `torch.save` of what `torch.load` returned gives the same
records at nearly the same offsets (its pickler memoizes a few small tuples ours writes again: the
pickles differ by up to 3% in length, not in content). Each rank's pickles are the same bytes (ZeRO-3
pads every rank's piece to one size), so they are made once.

`plan` measures, each in a fresh subprocess (`ru_maxrss` of that process, Python and imports
included; the baseline after imports is reported beside it):
- `index`: `load_index` (the coordinator's read of every rank file's headers);
- `consolidate`: `load_index` + `plan_consolidation` (bf16 output, 5 GB shards): units, source
  bytes and range requests per unit (one per copy of `plan_batches`, what `run_unit` sends to a
  bucket), read amplification (bytes the plan reads / fp32 master bytes);
- `reshard`: `load_index` + `plan_reshard` to another world size: units, copies and bytes per unit;
- `ship`: what a unit weighs when it is pickled for a worker: today's `(plan, unit)` (what
  `run_unit(plan, unit, ...)` needs, the plan holding the index) against a unit carrying byte ranges
  only.
`profile` runs one of them under cProfile and tracemalloc and prints where time and memory go.

    .venv/bin/python -m benchmarks.scale generate --model 70b
    .venv/bin/python -m benchmarks.scale plan --model 70b [--reshard-to 384] [--write-results]
    .venv/bin/python -m benchmarks.scale profile --model 405b --what consolidate
    .venv/bin/python -m benchmarks.scale check-structure --model 70b --fixture <fixture>/ckpt/global_step3
    .venv/bin/python -m benchmarks.scale remove --model 405b

Checkpoints go to `benchmarks/.data/scale/` (git-ignored): 70B/512 is 847 GB of logical size, 405B/1024
4.87 TB, each a few hundred MB on disk.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import pickle
import platform
import resource
import shutil
import statistics
import struct
import subprocess
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
DATA = REPO_ROOT / "benchmarks" / ".data" / "scale"
SECTION = "## Scale: planning"
# What `plan` measures, each in its own process: step -> (measurement, filesystem).
STEPS = {
    "consolidate": ("consolidate", "local"),
    "reshard": ("reshard", "local"),
    "ship": ("ship", "local"),
    "ship-reshard": ("ship-reshard", "local"),
    "index-bucket": ("index", "simbucket"),
}
TAG = "global_step1000"
DS_VERSION = "0.19.8"


# ---- the ckptflow API used here: the one place it is imported (the modules move in phase 2) ----------


def torchsave_api() -> Any:
    """`dumps` and the pickle stand-ins of the torch-archive writer."""
    from ckptflow import torchsave

    return torchsave


def planning_api() -> SimpleNamespace:
    """The coordinator's public API: the index and the plans."""
    from ckptflow.consolidate import ConsolidateOptions, plan_batches, plan_consolidation
    from ckptflow.reshard import plan_reshard
    from ckptflow.zero import load_index

    return SimpleNamespace(load_index=load_index, plan_consolidation=plan_consolidation,
                           ConsolidateOptions=ConsolidateOptions, plan_batches=plan_batches, plan_reshard=plan_reshard)


# ---- model shapes ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Llama:
    """A Llama-3 shape (Hugging Face `LlamaForCausalLM`, untied embeddings) and its ZeRO-3 world size."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    kv_heads: int
    head_dim: int
    vocab: int
    world_size: int

    def params(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) in `named_parameters()` order."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        out = [("model.embed_tokens.weight", (self.vocab, h))]
        for i in range(self.layers):
            p = f"model.layers.{i}"
            out += [(f"{p}.self_attn.q_proj.weight", (h, h)), (f"{p}.self_attn.k_proj.weight", (kv, h)),
                    (f"{p}.self_attn.v_proj.weight", (kv, h)), (f"{p}.self_attn.o_proj.weight", (h, h)),
                    (f"{p}.mlp.gate_proj.weight", (self.intermediate, h)), (f"{p}.mlp.up_proj.weight", (self.intermediate, h)),
                    (f"{p}.mlp.down_proj.weight", (h, self.intermediate)),
                    (f"{p}.input_layernorm.weight", (h,)), (f"{p}.post_attention_layernorm.weight", (h,))]
        return out + [("model.norm.weight", (h,)), ("lm_head.weight", (self.vocab, h))]

    def groups(self) -> list[list[tuple[str, tuple[int, ...]]]]:
        """The Trainer's two param groups: weight decay for matrices, none for norms."""
        params = self.params()
        return [[p for p in params if len(p[1]) > 1], [p for p in params if len(p[1]) == 1]]

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for _, s in self.params())

    def piece_numel(self, group: int) -> int:
        """Elements of one rank's flat fp32 partition of `group` (ZeRO-3: each parameter's piece is
        ceil(numel / world size), padded)."""
        return sum(math.ceil(math.prod(s) / self.world_size) for _, s in self.groups()[group])

    @property
    def folder(self) -> Path:
        return DATA / f"{self.name}-ws{self.world_size}"


MODELS = {
    "70b": Llama("llama3-70b", 8192, 28672, 80, 8, 128, 128256, 512),
    "405b": Llama("llama3-405b", 16384, 53248, 126, 8, 128, 128256, 1024),
    "tiny": Llama("tiny-llama", 64, 128, 2, 2, 16, 55, 4),  # for checking the generator against torch
}


# ---- generating --------------------------------------------------------------------------------------


def _ds_config(model: Llama) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": model.world_size,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-08}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": [1e-4, 1e-4],
                                                     "warmup_num_steps": 100}},
        "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}, "steps_per_print": 1000,
        "wall_clock_breakdown": False,
    }


def _step() -> int:
    return int(TAG.removeprefix("global_step"))


def model_states_tree(model: Llama, ts: Any) -> dict[str, Any]:
    """Rank r's `zero_pp_rank_{r}_mp_rank_00_model_states.pt` (the same on every rank: no frozen or
    tied parameters, no persistent buffers). ZeRO-3 saves every parameter as an empty bf16 tensor."""
    size = ts.Global("torch", "Size")
    step = _step()
    return {
        "module": OrderedDict((name, ts.OutTensor(ts.OutStorage("bfloat16", 0), 0, (0,))) for name, _ in model.params()),
        "buffer_names": [],
        "optimizer": None,
        "param_shapes": [OrderedDict((n, ts.Call(size, (s,))) for n, s in group) for group in model.groups()],
        "frozen_param_shapes": OrderedDict(),
        "shared_params": {},
        "frozen_param_fragments": OrderedDict(),
        "lr_scheduler": {"last_batch_iteration": step - 1},
        "data_sampler": None,
        "random_ltd": None,
        "skipped_steps": 0,
        "global_steps": step,
        "global_samples": step * model.world_size,
        "dp_world_size": model.world_size,
        "mp_world_size": 1,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "ds_config": _ds_config(model),
        "ds_version": DS_VERSION,
    }


def optim_states_tree(model: Llama, ts: Any) -> dict[str, Any]:
    """Rank r's `bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt` (the same layout on every rank)."""
    from collections import OrderedDict as OD

    step = _step()
    betas = [0.9, 0.95]  # one list object for both groups, as the optimizer shares it
    numels = [model.piece_numel(g) for g in range(2)]
    ids = {name: i for i, (name, _) in enumerate(model.params())}
    state = {g: {"step": step,
                 "exp_avg": ts.OutTensor(ts.OutStorage("float32", numels[g]), 0, (numels[g],)),
                 "exp_avg_sq": ts.OutTensor(ts.OutStorage("float32", numels[g]), 0, (numels[g],))}
             for g in range(2)}
    groups = [{"weight_decay": wd, "lr": 1e-4, "bias_correction": True, "betas": betas, "eps": 1e-08, "step": 0,
               "params": [g]} for g, wd in enumerate((0.1, 0.0))]
    from_type, tensor = ts.Global("torch._tensor", "_rebuild_from_type_v2"), ts.Global("torch", "Tensor")
    flats = []
    for g, group in enumerate(model.groups()):
        storage = ts.OutStorage("float32", numels[g])
        args = (storage, 0, (numels[g],), (1,), True, OD())
        flats.append(ts.Call(from_type, (ts.REBUILD_TENSOR, tensor, args,
                                         {"ds_id": f"{ids[group[0][0]]}_{ids[group[-1][0]]}"})))
    return {
        "optimizer_state_dict": {
            "zero_stage": ts.Call(ts.Global("deepspeed.runtime.zero.config", "ZeroStageEnum"), (3,)),
            "loss_scaler": ts.Instance(ts.Global("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
                                       {"cur_scale": 1.0, "dynamic": False}),
            "dynamic_loss_scale": False,
            "overflow": False,
            "partition_count": model.world_size,
            "optimizer_state_dict": {"state": state, "param_groups": groups},
            "fp32_flat_groups": flats,
        },
        "ds_config": _ds_config(model),
        "ds_version": DS_VERSION,
    }


_ZIP64_LIMIT = 0xFFFFFFFF
_FLAGS = 0x0808


def _crc_zeros(nbytes: int, _cache: dict[int, int] = {}) -> int:  # noqa: B006 - a deliberate memo
    """CRC-32 of `nbytes` zero bytes, from CRCs of 1 MiB blocks combined (no 1.6 GB buffer)."""
    import zlib

    from isal.isal_zlib import crc32_combine

    block = 1 << 20
    if not _cache:
        _cache[block] = zlib.crc32(bytes(block))
    whole, rest = divmod(nbytes, block)
    crc, power, length = 0, 1, block
    doubled = {block: _cache[block]}
    while power <= whole:  # crc of 2^k blocks
        if whole & power:
            crc = crc32_combine(crc, doubled[length], length)
        doubled[2 * length] = crc32_combine(doubled[length], doubled[length], length)
        power, length = power * 2, length * 2
    return crc32_combine(crc, zlib.crc32(bytes(rest)), rest) if rest else crc


class SparseArchive:
    """A torch zip archive written front to back, the records laid out as `torch.save` (and
    `ckptflow.torchsave`) lay them out: 64-byte aligned data behind an `FB` extra field, sizes and
    CRC-32 in data descriptors, zip64 extra fields and end records. `hole(name, nbytes)` records a
    storage of zeros without writing it: the file system keeps a hole."""

    def __init__(self, path: Path, prefix: str) -> None:
        self.fh = open(path, "wb")
        self.prefix = prefix
        self.pos = 0
        self.entries: list[tuple[bytes, int, int, int]] = []

    def _write(self, data: bytes) -> None:
        self.fh.write(data)
        self.pos += len(data)

    def _header(self, name: str, size: int) -> bytes:
        raw = f"{self.prefix}/{name}".encode()
        offset = self.pos
        if size >= _ZIP64_LIMIT:
            extra = struct.pack("<HHQQ", 1, 16, size, size)
        elif offset >= _ZIP64_LIMIT:
            extra = struct.pack("<HHQ", 1, 8, offset)
        else:
            extra = b""
        pad = (-(offset + 30 + len(raw) + len(extra) + 4)) % 64
        extra += b"FB" + struct.pack("<H", pad) + b"Z" * pad
        return struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 0, _FLAGS, 0, 0, 0, 0, 0, 0, len(raw), len(extra)) + raw + extra

    def _descriptor(self, offset: int, crc: int, size: int) -> bytes:
        if size >= _ZIP64_LIMIT or offset >= _ZIP64_LIMIT:
            return struct.pack("<4sIQQ", b"PK\x07\x08", crc, size, size)
        return struct.pack("<4sIII", b"PK\x07\x08", crc, size, size)

    def record(self, name: str, data: bytes) -> None:
        import zlib

        offset = self.pos
        self._write(self._header(name, len(data)))
        self._write(data)
        crc = zlib.crc32(data)
        self._write(self._descriptor(offset, crc, len(data)))
        self.entries.append((f"{self.prefix}/{name}".encode(), offset, crc, len(data)))

    def hole(self, name: str, nbytes: int) -> None:
        offset = self.pos
        self._write(self._header(name, nbytes))
        self.fh.seek(nbytes, os.SEEK_CUR)
        self.pos += nbytes
        crc = _crc_zeros(nbytes)
        self._write(self._descriptor(offset, crc, nbytes))
        self.entries.append((f"{self.prefix}/{name}".encode(), offset, crc, nbytes))

    def close(self) -> None:
        start = self.pos
        for name, offset, crc, size in self.entries:
            fields, small_size, small_offset = [], size, offset
            if size >= _ZIP64_LIMIT:
                fields += [size, size]
                small_size = _ZIP64_LIMIT
            if offset >= _ZIP64_LIMIT:
                fields.append(offset)
                small_offset = _ZIP64_LIMIT
            extra = struct.pack(f"<HH{len(fields)}Q", 1, 8 * len(fields), *fields) if fields else b""
            self._write(struct.pack("<4sHHHHHHIIIHHHHHII", b"PK\x01\x02", 0, 0, _FLAGS, 0, 0, 0, crc, small_size,
                                    small_size, len(name), len(extra), 0, 0, 0, 0, small_offset) + name + extra)
        end, count = self.pos, len(self.entries)
        self._write(struct.pack("<4sQHHIIQQQQ", b"PK\x06\x06", 44, 0x031E, 45, 0, 0, count, count, end - start, start))
        self._write(struct.pack("<4sIQI", b"PK\x06\x07", 0, end, 1))
        self._write(struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, min(count, 0xFFFF), min(count, 0xFFFF),
                                _ZIP64_LIMIT if end - start >= _ZIP64_LIMIT else end - start,
                                _ZIP64_LIMIT if start >= _ZIP64_LIMIT else start, 0))
        self.fh.close()


def write_sparse(path: Path, data: bytes, storages: list[Any]) -> int:
    """`path` as torch.save writes the tree `data` was pickled from, every storage a hole."""
    prefix = path.name.removesuffix(".pt")
    archive = SparseArchive(path, prefix)
    for record, content in (("data.pkl", data), (".format_version", b"1"), (".storage_alignment", b"64"),
                            ("byteorder", b"little")):
        archive.record(record, content)
    for key, storage in enumerate(storages):
        archive.hole(f"data/{key}", storage.nbytes)
    archive.record("version", b"3\n")
    serial = str(int(hashlib.sha256(path.name.encode()).hexdigest(), 16)).rjust(40, "0")[:40]
    archive.record(".data/serialization_id", serial.encode())
    archive.close()
    return archive.pos


def generate(model: Llama, root: Path | None = None) -> Path:
    """Write the synthetic checkpoint (folder with `latest`) and return its path; kept once complete."""
    root = root or model.folder
    done = root / "done.json"
    if done.exists():
        return root
    shutil.rmtree(root, ignore_errors=True)
    tag = root / TAG
    tag.mkdir(parents=True)
    ts = torchsave_api()
    started = time.monotonic()
    model_pkl, model_storages = ts.dumps(model_states_tree(model, ts))
    optim_pkl, optim_storages = ts.dumps(optim_states_tree(model, ts))
    logical = 0
    for rank in range(model.world_size):
        logical += write_sparse(tag / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt", model_pkl, model_storages)
        logical += write_sparse(tag / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt", optim_pkl, optim_storages)
    (root / "latest").write_text(TAG)
    (root / "config.json").write_text(json.dumps(_hf_config(model), indent=2) + "\n")
    seconds = time.monotonic() - started
    done.write_text(json.dumps({"model": model.name, "world_size": model.world_size, "params": model.numel,
                                "logical_bytes": logical, "model_pickle": len(model_pkl),
                                "optim_pickle": len(optim_pkl), "seconds": round(seconds, 1)}) + "\n")
    return root


def _hf_config(model: Llama) -> dict[str, Any]:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": model.hidden,
            "intermediate_size": model.intermediate, "num_hidden_layers": model.layers,
            "num_attention_heads": model.hidden // model.head_dim, "num_key_value_heads": model.kv_heads,
            "head_dim": model.head_dim, "vocab_size": model.vocab, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16"}


def disk_usage(root: Path) -> dict[str, int]:
    """Logical (`ls -l`) and allocated (`du`) bytes of every file under `root`."""
    logical = allocated = files = 0
    for path in root.rglob("*"):
        if path.is_file():
            st = path.stat()
            logical += st.st_size
            allocated += st.st_blocks * 512
            files += 1
    return {"files": files, "logical": logical, "allocated": allocated}


# ---- the structure check against a real checkpoint ---------------------------------------------------


def schema(obj: Any) -> Any:
    """The shape of a tree as `ckptflow.torchzip` reads it: keys and value types, with parameter
    names collapsed to `<param>`, list items and tensors by kind (dtype, rank)."""
    from ckptflow.torchzip import PickledObject, TensorRef  # a reader import: same module family as planning

    if isinstance(obj, dict):
        out: dict[Any, Any] = {}
        for key, value in obj.items():
            k = "<param>" if isinstance(key, str) and (key.startswith("model.") or key.startswith("lm_head")) else \
                "<int>" if isinstance(key, int) else key
            out.setdefault(k, schema(value))
        return (type(obj).__name__, tuple(out.items()))
    if isinstance(obj, (list, tuple)):
        items = []
        for value in obj:
            s = schema(value)
            if s not in items:
                items.append(s)
        return (type(obj).__name__, tuple(items))
    if isinstance(obj, TensorRef):
        return ("tensor", obj.dtype, len(obj.shape))
    if isinstance(obj, PickledObject):
        return ("object", obj.qualname, schema(obj.state))
    return type(obj).__name__


def _diff(a: Any, b: Any, path: str = "") -> list[str]:
    if a == b:
        return []
    if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == 2 and a[0] == b[0] and a[0] in ("dict", "OrderedDict"):
        da, db = dict(a[1]), dict(b[1])
        out = [f"{path}/{k}: only in the real file" for k in da if k not in db]
        out += [f"{path}/{k}: only in the synthetic file" for k in db if k not in da]
        if [k for k in da if k in db] != [k for k in db if k in da]:
            out.append(f"{path}: keys in another order")
        for k in da:
            if k in db:
                out += _diff(da[k], db[k], f"{path}/{k}")
        return out
    return [f"{path}: {a!r:.200} in the real file, {b!r:.200} in the synthetic one"]


def check_structure(real_tag: Path, synthetic_tag: Path) -> list[str]:
    """Differences in key structure between rank 1's files of a real ZeRO-3 bf16 checkpoint and ours."""
    from ckptflow.torchzip import open_archive

    problems = []
    for name in ("zero_pp_rank_1_mp_rank_00_model_states.pt", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"):
        real = schema(open_archive(str(real_tag / name)).obj)
        ours = schema(open_archive(str(synthetic_tag / name)).obj)
        problems += [f"{name}{p}" for p in _diff(real, ours)]
    return problems


# ---- measuring (in a fresh process each) ----------------------------------------------------------------


def _rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _io() -> dict[str, int]:
    with open("/proc/self/io") as fh:
        return {k: int(v) for k, v in (line.split(": ") for line in fh)}


def _fp32_bytes(index: Any) -> int:
    return sum(4 * p.numel for p in index.params if not p.frozen)


def _measure(what: str, root: str, to: int, chunk_bytes: int) -> dict[str, Any]:
    api = planning_api()
    out: dict[str, Any] = {"what": what, "rss_after_imports": _rss()}
    io0, t0, c0 = _io(), time.perf_counter(), time.process_time()
    index = api.load_index(root)
    out["index_seconds"] = time.perf_counter() - t0
    out["index_cpu_seconds"] = time.process_time() - c0
    io1 = _io()
    out["index_read_bytes"] = io1["rchar"] - io0["rchar"]
    out["index_read_calls"] = io1["syscr"] - io0["syscr"]
    out["rss_after_index"] = _rss()
    out["params"] = len(index.params)
    out["numel"] = index.numel
    out["fp32_bytes"] = _fp32_bytes(index)
    out["world_size"] = index.world_size
    if what == "consolidate" or what == "ship":
        t1, c1 = time.perf_counter(), time.process_time()
        plan = api.plan_consolidation(index, api.ConsolidateOptions(dtype="bf16", chunk_bytes=chunk_bytes))
        out["plan_seconds"] = time.perf_counter() - t1
        out["plan_cpu_seconds"] = time.process_time() - c1
        out["rss_after_plan"] = _rss()
        out["units"] = len(plan.units)
        out["source_bytes"] = plan.source_bytes
        out["output_bytes"] = plan.total_size
        if what == "consolidate":
            t2 = time.perf_counter()
            per_unit = []
            for unit in plan.units:
                layout = unit.layout()
                by_name = {t.name: t for t in unit.tensors}
                batches = api.plan_batches([(s.dtype, s.begin, by_name[s.name].runs) for s in layout.slots], chunk_bytes)
                per_unit.append({"tensors": len(unit.tensors), "source_bytes": unit.source_bytes,
                                 "out_bytes": unit.nbytes, "batches": len(batches),
                                 "requests": sum(len(b.copies) for b in batches),
                                 "runs": sum(len(t.runs) for t in unit.tensors)})
            out["batches_seconds"] = time.perf_counter() - t2
            out["per_unit"] = per_unit
            out["rss_after_batches"] = _rss()
        else:
            out.update(_ship(plan, api, chunk_bytes))
    elif what in ("reshard", "ship-reshard"):
        t1, c1 = time.perf_counter(), time.process_time()
        plan = api.plan_reshard(index, to)
        out["plan_seconds"] = time.perf_counter() - t1
        out["plan_cpu_seconds"] = time.process_time() - c1
        out["rss_after_plan"] = _rss()
        if what == "ship-reshard":
            unit = plan.units[len(plan.units) // 2]
            t = time.perf_counter()
            today = pickle.dumps((plan, unit), protocol=pickle.HIGHEST_PROTOCOL)
            out["today_pickle_seconds"] = time.perf_counter() - t
            out["today_pickle_bytes"] = len(today)
            out["rss_after_today_pickle"] = _rss()
            t = time.perf_counter()
            pickle.loads(today)
            out["today_unpickle_seconds"] = time.perf_counter() - t
            del today
            out["unit_only_pickle_bytes"] = len(pickle.dumps(unit, protocol=pickle.HIGHEST_PROTOCOL))
            out["index_pickle_bytes"] = len(pickle.dumps(index, protocol=pickle.HIGHEST_PROTOCOL))
            out["units"] = len(plan.units)
            out["rss_peak"] = _rss()
            return out
        out["units"] = len(plan.units)
        out["read_bytes"] = plan.read_bytes
        out["write_bytes"] = plan.write_bytes
        chunk = 8 << 20  # torchsave.CHUNK_BYTES: SourceReader's read size
        out["per_unit"] = [{"copies": sum(len(f.copies) for f in u.flats),
                            "spans": 3 * sum(len(f.copies) for f in u.flats),
                            "requests": 3 * sum(math.ceil(4 * c.numel / chunk) for f in u.flats for c in f.copies),
                            "read_bytes": u.read_bytes, "write_bytes": u.write_bytes} for u in plan.units]
    out["rss_peak"] = _rss()
    return out


def _small_unit(plan: Any, unit: Any, api: Any, chunk_bytes: int) -> tuple[Any, ...]:
    """What a consolidation unit would carry if it held byte ranges only: its file name, the
    safetensors header, the source files it reads, and per batch (file offset, length, copies as
    (file, start, end, dest) integers); dtypes once per unit."""
    layout = unit.layout()
    by_name = {t.name: t for t in unit.tensors}
    batches = api.plan_batches([(s.dtype, s.begin, by_name[s.name].runs) for s in layout.slots], chunk_bytes)
    files: dict[str, int] = {}
    packed = []
    for b in batches:
        packed.append((b.file_start, b.out_nbytes, tuple(
            (files.setdefault(c.uri.rsplit("/", 1)[-1], len(files)), c.start, c.end, c.dest) for c in b.copies)))
    return (unit.filename, layout.header, plan.root, plan.tag, tuple(files), "float32", plan.dtype, tuple(packed))


def _ship(plan: Any, api: Any, chunk_bytes: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    unit = plan.units[len(plan.units) // 2]
    t = time.perf_counter()
    today = pickle.dumps((plan, unit), protocol=pickle.HIGHEST_PROTOCOL)
    out["today_pickle_seconds"] = time.perf_counter() - t
    out["today_pickle_bytes"] = len(today)
    out["rss_after_today_pickle"] = _rss()
    t = time.perf_counter()
    pickle.loads(today)
    out["today_unpickle_seconds"] = time.perf_counter() - t
    out["rss_after_today_unpickle"] = _rss()
    del today
    out["unit_only_pickle_bytes"] = len(pickle.dumps(unit, protocol=pickle.HIGHEST_PROTOCOL))
    t = time.perf_counter()
    small = [pickle.dumps(_small_unit(plan, u, api, chunk_bytes), protocol=pickle.HIGHEST_PROTOCOL) for u in plan.units]
    out["small_all_units_seconds"] = time.perf_counter() - t
    out["small_pickle_bytes"] = [len(s) for s in small]
    out["rss_after_small_all"] = _rss()
    return out


def _register_sim_bucket() -> None:
    """`simbucket:///path`: the local files as an object store client sees them, counting requests.

    Reads go through fsspec's `AbstractBufferedFile` (read-ahead cache of the block size the caller
    asks for), as gcsfs and s3fs files do; `cat_file` with a range is one request, and `cat_ranges`
    is one request per range (what gcsfs and s3fs send, concurrently). `info`/`ls` count as metadata
    requests. Only the number and size of requests are meaningful here, not the time (no latency)."""
    import fsspec
    from fsspec.spec import AbstractBufferedFile, AbstractFileSystem

    class SimFile(AbstractBufferedFile):
        def _fetch_range(self, start: int, end: int) -> bytes:
            return self.fs._read(self.path, start, end)

    class SimBucket(AbstractFileSystem):
        protocol = "simbucket"
        counts = {"range_requests": 0, "range_bytes": 0, "metadata_requests": 0}  # over every instance

        @classmethod
        def _strip_protocol(cls, path: str) -> str:
            path = path[len("simbucket://"):] if path.startswith("simbucket://") else path
            return "/" + path.strip("/")

        def _read(self, path: str, start: int, end: int) -> bytes:
            with open(self._strip_protocol(path), "rb") as fh:
                fh.seek(start)
                data = fh.read(max(0, end - start))
            self.counts["range_requests"] += 1
            self.counts["range_bytes"] += len(data)
            return data

        def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
            self.counts["metadata_requests"] += 1
            local = self._strip_protocol(path)
            if os.path.isdir(local):
                return {"name": local, "size": 0, "type": "directory"}
            if os.path.isfile(local):
                return {"name": local, "size": os.path.getsize(local), "type": "file"}
            raise FileNotFoundError(path)

        def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
            self.counts["metadata_requests"] += 1
            local = self._strip_protocol(path)
            names = sorted(os.path.join(local, n) for n in os.listdir(local))
            if not detail:
                return names
            return [{"name": n, "size": os.path.getsize(n), "type": "directory" if os.path.isdir(n) else "file"}
                    for n in names]

        def _open(self, path: str, mode: str = "rb", block_size: Any = None, **kwargs: Any) -> Any:
            return SimFile(self, path, mode, block_size=block_size or (1 << 20), cache_type="readahead",
                           size=os.path.getsize(self._strip_protocol(path)))

        def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
            size = os.path.getsize(self._strip_protocol(path))
            start = 0 if start is None else start if start >= 0 else size + start
            end = size if end is None else end if end >= 0 else size + end
            return self._read(path, start, end)

    fsspec.register_implementation("simbucket", SimBucket, clobber=True)


def _child(args: argparse.Namespace) -> None:
    if args.via == "simbucket":
        _register_sim_bucket()
        args.root = "simbucket://" + os.path.abspath(args.root)
    if args.limit_gb:
        limit = int(args.limit_gb * (1 << 30))
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    result = _measure(args.what, args.root, args.to, args.chunk_bytes)
    if args.via == "simbucket":
        import fsspec

        result["bucket"] = dict(fsspec.get_filesystem_class("simbucket").counts)
    print("RESULT=" + json.dumps(result))


def measure(model: Llama, what: str, *, to: int = 0, chunk_bytes: int = 32 << 20, limit_gb: float = 12.0,
            via: str = "local") -> dict[str, Any]:
    """Run one measurement in a fresh `nice` subprocess; its JSON result (or the error it died of)."""
    command = ["nice", "-n", "10", sys.executable, "-m", "benchmarks.scale", "_child", "--what", what,
               "--root", str(model.folder), "--to", str(to), "--chunk-bytes", str(chunk_bytes), "--limit-gb", str(limit_gb),
               "--via", via]
    started = time.monotonic()
    proc = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    wall = time.monotonic() - started
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT="):
            return {**json.loads(line[len("RESULT="):]), "process_seconds": wall}
    return {"what": what, "error": (proc.stdout + proc.stderr)[-3000:], "process_seconds": wall}


# ---- profiling -------------------------------------------------------------------------------------------


def profile(model: Llama, what: str, to: int, top: int) -> None:
    """cProfile (time) then, in a second pass, tracemalloc (memory by line) of index + plan."""
    import cProfile
    import io
    import pstats
    import tracemalloc

    api = planning_api()

    def work() -> Any:
        index = api.load_index(str(model.folder))
        if what == "consolidate":
            return index, api.plan_consolidation(index, api.ConsolidateOptions(dtype="bf16"))
        if what == "reshard":
            return index, api.plan_reshard(index, to)
        return index, None

    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    result = work()
    prof.disable()
    print(f"## {model.name} ws{model.world_size}: {what} under cProfile: {time.perf_counter() - t:.1f} s")
    for sort in ("cumulative", "tottime"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(sort).print_stats(top)
        print(f"### by {sort}\n" + "\n".join(line for line in buf.getvalue().splitlines() if line.strip())[-6000:])
    del result, prof
    import gc

    gc.collect()
    tracemalloc.start(1)
    t = time.perf_counter()
    index, plan = work()
    current, peak = tracemalloc.get_traced_memory()
    snapshot = tracemalloc.take_snapshot()
    print(f"## tracemalloc ({time.perf_counter() - t:.1f} s): {current / 2**20:.0f} MiB held, {peak / 2**20:.0f} MiB peak")
    for stat in snapshot.statistics("lineno")[:top]:
        frame = stat.traceback[0]
        print(f"{stat.size / 2**20:9.1f} MiB {stat.count:>10} blocks  {frame.filename.replace(str(REPO_ROOT) + '/', '')}:{frame.lineno}")
    print("## the index, part by part (tracemalloc bytes of objects reachable from each)")
    for name, part in (("model_states", index.model_states), ("optim_states", index.optim_states),
                       ("params", index.params), ("partitions", index.partitions)):
        print(f"{name:>14}: {_deep_size(part) / 2**20:9.1f} MiB")
    if plan is not None:
        units = getattr(plan, "units", ())
        print(f"{'plan.units':>14}: {_deep_size(units) / 2**20:9.1f} MiB")


def _deep_size(obj: Any) -> int:
    """Bytes of the objects reachable from `obj` (each counted once), by sys.getsizeof."""
    seen: set[int] = set()
    stack, total = [obj], 0
    while stack:
        o = stack.pop()
        if id(o) in seen or isinstance(o, (type, type(len))):
            continue
        seen.add(id(o))
        total += sys.getsizeof(o)
        if isinstance(o, dict):
            stack.extend(o.keys())
            stack.extend(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            stack.extend(o)
        elif hasattr(o, "__dict__"):
            stack.append(vars(o))
        elif hasattr(o, "__slots__"):
            stack.extend(getattr(o, s) for s in o.__slots__ if hasattr(o, s))
    return total


# ---- reporting -------------------------------------------------------------------------------------------


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def _gb(n: float) -> str:
    return f"{n / 1e9:,.1f} GB"


def _spread(values: list[float], fmt: Any = str) -> str:
    return f"{fmt(min(values))} / {fmt(statistics.median(values))} / {fmt(max(values))}"


def report(model: Llama, results: dict[str, dict[str, Any]], disk: dict[str, int], reshard_to: int) -> list[str]:
    lines = [f"**{model.name}, ZeRO-3 bf16, {model.world_size} ranks** ({model.numel / 1e9:.1f}B parameters; "
             f"{disk['files']} files, {_gb(disk['logical'])} logical, {_mib(disk['allocated'])} on disk)", ""]
    ix = results.get("index", {})
    if "error" in ix:
        return lines + [f"index failed: `{ix['error'][-500:]}`", ""]
    lines += ["| step | time | peak RSS (process) | RSS after imports |", "|---|---:|---:|---:|"]
    lines.append(f"| load_index | {ix['index_seconds']:.1f} s | {_mib(ix['rss_peak'])} | {_mib(ix['rss_after_imports'])} |")
    for key, label in (("consolidate", "load_index + plan_consolidation"), ("reshard", f"load_index + plan_reshard -> {reshard_to}")):
        r = results.get(key, {})
        if "error" in r:
            lines.append(f"| {label} | failed | `{r['error'].strip().splitlines()[-1][:160]}` | |")
        elif r:
            lines.append(f"| {label} | {r['index_seconds'] + r['plan_seconds']:.1f} s ({r['plan_seconds']:.1f} s plan) | "
                         f"{_mib(r['rss_after_plan'])} | {_mib(r['rss_after_imports'])} |")
    lines += ["", f"Index from a local disk: read {_mib(ix['index_read_bytes'])} in {ix['index_read_calls']:,} read calls "
              f"({ix['index_read_bytes'] / (2 * model.world_size) / 1024:.0f} KiB per file)."]
    b = results.get("index-bucket", {})
    if b and "error" not in b:
        n = b["bucket"]
        lines[-1] += (f" From a bucket (`simbucket`: the same files through fsspec's buffered remote file, counting "
                      f"requests): {n['range_requests']:,} range requests ({n['range_requests'] / (2 * model.world_size):,.0f} "
                      f"per file) for {_mib(n['range_bytes'])}, and {n['metadata_requests']:,} metadata requests.")
    lines.append("")
    c = results.get("consolidate", {})
    if c and "error" not in c:
        pu = c["per_unit"]
        lines += [f"Consolidation (bf16, 5 GB shards, {32} MiB batches): {c['units']} units; per unit (min / median / max): "
                  f"{_spread([u['source_bytes'] for u in pu], _gb)} read, {_spread([u['requests'] for u in pu], lambda v: f'{v:,.0f}')} "
                  f"range requests ({_spread([u['source_bytes'] / u['requests'] for u in pu], _mib)} each), "
                  f"{_spread([u['tensors'] for u in pu])} tensors. "
                  f"Read amplification {c['source_bytes'] / c['fp32_bytes']:.4f} (tensor bytes / fp32 master bytes); "
                  f"{(c['source_bytes'] + ix['index_read_bytes']) / c['fp32_bytes']:.4f} with the index's reads.", ""]
    r = results.get("reshard", {})
    if r and "error" not in r:
        pu = r["per_unit"]
        lines += [f"Reshard {model.world_size} -> {reshard_to}: {r['units']} units; per unit (min / median / max): "
                  f"{_spread([u['read_bytes'] for u in pu], _gb)} read, {_spread([u['copies'] for u in pu], lambda v: f'{v:,.0f}')} copies "
                  f"({_spread([u['requests'] for u in pu], lambda v: f'{v:,.0f}')} reads of at most 8 MiB). "
                  f"Read amplification {r['read_bytes'] / (3 * r['fp32_bytes']):.4f} (bytes read / fp32 weights and two moments).", ""]
    s = results.get("ship", {})
    if s and "error" not in s:
        small = s["small_pickle_bytes"]
        lines += [f"A unit shipped to a worker: today `(plan, unit)` pickles to {_mib(s['today_pickle_bytes'])} "
                  f"({s['today_pickle_seconds']:.1f} s to pickle, {s['today_unpickle_seconds']:.1f} s to unpickle; the process "
                  f"went from {_mib(s['rss_after_plan'])} to {_mib(s['rss_after_today_pickle'])} pickling it); "
                  f"x {s['units']} units = {_gb(s['today_pickle_bytes'] * s['units'])} sent. The unit alone: "
                  f"{_mib(s['unit_only_pickle_bytes'])}. Byte ranges only: {_spread(small, lambda v: f'{v / 1024:,.0f} KiB')} per unit, "
                  f"all {len(small)} made in {s['small_all_units_seconds']:.1f} s.", ""]
    s = results.get("ship-reshard", {})
    if s and "error" not in s:
        lines += [f"A reshard unit shipped to a worker: today `(plan, unit)` (the plan holds the index) pickles to "
                  f"{_mib(s['today_pickle_bytes'])} ({s['today_pickle_seconds']:.1f} s to pickle, "
                  f"{s['today_unpickle_seconds']:.1f} s to unpickle), x {s['units']} units = "
                  f"{_gb(s['today_pickle_bytes'] * s['units'])} sent; the index alone pickles to "
                  f"{_mib(s['index_pickle_bytes'])}, the unit alone to {s['unit_only_pickle_bytes'] / 1024:,.0f} KiB.", ""]
    return lines


def _machine() -> str:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return (f"Machine: {platform.machine()}, {os.cpu_count()} cores, {mem / 2**30:.0f} GiB RAM, Python "
            f"{platform.python_version()}, load average at start {' / '.join(f'{x:.1f}' for x in os.getloadavg())} "
            "(shared machine). Each figure is one fresh process (`nice`), its peak RSS from `ru_maxrss`.")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("generate", "plan", "profile", "remove", "check-structure"):
        p = sub.add_parser(name)
        p.add_argument("--model", choices=sorted(MODELS), required=True)
    child = sub.add_parser("_child")
    for p in (sub.choices["plan"], sub.choices["profile"]):
        p.add_argument("--reshard-to", type=int, default=0, help="target world size (default: 3/4 of the source)")
    sub.choices["plan"].add_argument("--skip", nargs="*", default=[], choices=list(STEPS))
    sub.choices["plan"].add_argument("--write-results", action="store_true")
    sub.choices["plan"].add_argument("--limit-gb", type=float, default=12.0, help="address-space cap per process")
    sub.choices["profile"].add_argument("--what", choices=["index", "consolidate", "reshard"], default="consolidate")
    sub.choices["profile"].add_argument("--top", type=int, default=25)
    sub.choices["check-structure"].add_argument("--fixture", type=Path, required=True,
                                                help="tag folder of a real ZeRO-3 bf16 checkpoint with >= 2 ranks")
    child.add_argument("--what", required=True)
    child.add_argument("--root", required=True)
    child.add_argument("--to", type=int, default=0)
    child.add_argument("--chunk-bytes", type=int, default=32 << 20)
    child.add_argument("--limit-gb", type=float, default=0)
    child.add_argument("--via", choices=["local", "simbucket"], default="local")
    args = parser.parse_args(argv)
    if args.command == "_child":
        _child(args)
        return
    model = MODELS[args.model]
    if args.command == "remove":
        shutil.rmtree(model.folder, ignore_errors=True)
        return
    if args.command == "generate":
        started = time.monotonic()
        generate(model)
        usage = disk_usage(model.folder)
        print(json.dumps({**json.loads((model.folder / "done.json").read_text()), **usage,
                          "seconds_this_call": round(time.monotonic() - started, 1)}))
        return
    if args.command == "check-structure":
        problems = check_structure(args.fixture, generate(model) / TAG)
        print("\n".join(problems) if problems else "same key structure as the real checkpoint")
        sys.exit(1 if problems else 0)
    to = args.reshard_to or model.world_size * 3 // 4
    if args.command == "profile":
        profile(model, args.what, to, args.top)
        return
    generate(model)
    disk = disk_usage(model.folder)
    out = DATA / f"results-{model.name}-ws{model.world_size}.json"
    saved = json.loads(out.read_text())["results"] if out.exists() else {}
    results = {"index": measure(model, "index", limit_gb=args.limit_gb)}
    for step, (what, via) in STEPS.items():
        if step in args.skip:
            results[step] = saved.get(step, {})
        elif "error" not in results["index"]:
            results[step] = measure(model, what, to=to, limit_gb=args.limit_gb, via=via)
    out.write_text(json.dumps({"disk": disk, "results": results, "reshard_to": to}, indent=1) + "\n")
    lines = report(model, results, disk, to)
    print("\n".join(lines))
    print(f"(raw figures: {out})")
    if args.write_results:
        _write_results()


def _write_results() -> None:
    """The RESULTS.md section from every results-*.json present."""
    sys.path.insert(0, str(REPO_ROOT))
    from benchmarks.results import write_section

    lines = [SECTION, "", _machine(), "", "Command: `.venv/bin/python -m benchmarks.scale plan --model {70b,405b} "
             "--write-results`. Synthetic ZeRO-3 checkpoints (real headers and pickles, tensor bytes as holes; see "
             "`benchmarks/scale.py`). Targets (issue 12): 405B indexed and planned in under 60 s and 2 GB; "
             "read amplification <= 1.01.", ""]
    for name in ("70b", "405b"):
        model = MODELS[name]
        path = DATA / f"results-{model.name}-ws{model.world_size}.json"
        if path.exists():
            saved = json.loads(path.read_text())
            lines += report(model, saved["results"], saved["disk"], saved["reshard_to"])
    write_section(SECTION, lines)


if __name__ == "__main__":
    main()
