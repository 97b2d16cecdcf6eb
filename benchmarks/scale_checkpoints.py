"""Synthetic DeepSpeed ZeRO-3 checkpoints at real scale, for `benchmarks/scale.py`.

`generate(MODELS["405b"])` writes a ZeRO-3 bf16 checkpoint shaped like Llama-3-405B at 1024 ranks (or
Llama-3-70B at 512, or a `tiny` one) as DeepSpeed 0.19.8 writes one: `latest` and, per rank,
`zero_pp_rank_{r}_mp_rank_00_model_states.pt` and `bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt`,
with the key structure of a real DeepSpeed-written Llama (`check_structure` compares the two) and
the param groups of a Hugging Face Trainer (weights with decay, norms without).

The archives are real torch zip files: the pickles come from `ckptflow.formats.torch.pickler.dumps`, the zip
records are laid out as torch writes them, and every storage's bytes are a hole (the file has its
full size, but only its headers, pickle and central directory are on disk; the CRC-32s are those of
zeros). Checked on the `tiny` shape (`tests/test_scale_benchmark.py`): `torch.load` reads every
file, DeepSpeed's `get_fp32_state_dict_from_zero_checkpoint` rebuilds every parameter at its shape,
ckptflow indexes and plans it, and its key structure is the real fixture's. `torch.save` of what
`torch.load` returns gives the same records at nearly the same offsets (torch's pickler memoizes a
few small tuples ours writes again: the pickles differ by up to 3% in length, not in content). Each
rank's pickles are the same bytes (ZeRO-3 pads every rank's piece to one size), so they are made once.

Sizes: 70B/512 is 847 GB of logical size and 164 MiB on disk; 405B/1024 is 4.87 TB and 500 MiB.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import struct
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
DATA = REPO_ROOT / "benchmarks" / ".data" / "scale"
TAG = "global_step1000"
DS_VERSION = "0.19.8"


def formats_api() -> SimpleNamespace:
    """The torch-archive writer and reader: the one place they are imported here (they move to
    `ckptflow.formats` in phase 2)."""
    from ckptflow.formats.deepspeed.names import ALLOWED
    from ckptflow.formats.torch import pickler
    from ckptflow.formats.torch.tensorref import TensorRef
    from ckptflow.formats.torch.unpickler import PickledObject
    from ckptflow.formats.torch.zipdir import open_archive

    return SimpleNamespace(pickler=pickler, open_archive=open_archive, ALLOWED=ALLOWED, PickledObject=PickledObject,
                           TensorRef=TensorRef)


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
                    (f"{p}.mlp.gate_proj.weight", (self.intermediate, h)),
                    (f"{p}.mlp.up_proj.weight", (self.intermediate, h)),
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
    "1b": Llama("llama-1b", 2048, 8192, 8, 8, 64, 128256, 8),  # throughput through workers (scale_cluster.py)
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
        "module": OrderedDict((name, ts.OutTensor(ts.OutStorage("bfloat16", 0), 0, (0,)))
                              for name, _ in model.params()),
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
    `ckptflow.formats.torch.writer`) lay them out: 64-byte aligned data behind an `FB` extra field, sizes and
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
        return struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 0, _FLAGS, 0, 0, 0, 0, 0, 0, len(raw),
                           len(extra)) + raw + extra

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
    ts = formats_api().pickler
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
    """The shape of a tree as `ckptflow.formats.torchzip` reads it: keys and value types, with parameter
    names collapsed to `<param>`, list items and tensors by kind (dtype, rank)."""
    PickledObject, TensorRef = formats_api().PickledObject, formats_api().TensorRef

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
    if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == 2 and a[0] == b[0] and a[0] in ("dict",
                                                                                                   "OrderedDict"):
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
    api = formats_api()
    problems = []
    for name in ("zero_pp_rank_1_mp_rank_00_model_states.pt", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"):
        real = schema(api.open_archive(str(real_tag / name), api.ALLOWED).obj)
        ours = schema(api.open_archive(str(synthetic_tag / name), api.ALLOWED).obj)
        problems += [f"{name}{p}" for p in _diff(real, ours)]
    return problems
