"""The Hugging Face model folder: safetensors shards, their index, and the files that travel with them.

Everything here that decides a layout is a pure function of names, dtypes, shapes and sizes:

- `pack_shards` splits tensors into shards exactly as `huggingface_hub.split_torch_state_dict_into_shards`
  (and so `save_pretrained`) does: in state-dict order, a new shard whenever the next tensor would
  overflow `max_shard_size`, and a tensor larger than the limit alone in a shard of its own;
- `safetensors_file` lays a shard out byte for byte as `safetensors.torch.save` would (tensors sorted
  by dtype alignment, then name; a compact JSON header padded with spaces to 8 bytes), so a shard can
  be streamed to any store with its header written first;
- `index_json` is the `model.safetensors.index.json` that `save_pretrained` writes.

The I/O helpers at the end find and carry over `config.json`, `generation_config.json` and the
tokenizer files of a Hugging Face Trainer checkpoint, or write those a config source gave
(`write_side_files`; where they come from is `ckptflow.consolidate.config`), with the config's dtype
set to the output's. `side_kind` sorts them into the kinds that travel whole.
"""

from __future__ import annotations

import json
import posixpath
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ckptflow.errors import CheckpointError, CorruptFileError
from ckptflow.plumbing.files import check_regular, copy_regular, load_json, open_regular, read_regular, write_bytes
from ckptflow.plumbing.sizes import element_count
from ckptflow.plumbing.storage import join, open_fs
from ckptflow.plumbing.text import excerpt, one_line

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
# The record ckptflow writes beside a consolidated model: source, tag, step, layout, shard hashes.
PROVENANCE_NAME = "ckptflow_provenance.json"

# torch dtype name -> (safetensors code, item size). The order is safetensors' own: its writer puts
# tensors of a larger alignment first, in this order (checked against `safetensors.torch.save`).
SAFETENSORS_DTYPES: dict[str, tuple[str, int]] = {
    "uint64": ("U64", 8),
    "int64": ("I64", 8),
    "float64": ("F64", 8),
    "complex64": ("C64", 8),
    "float32": ("F32", 4),
    "uint32": ("U32", 4),
    "int32": ("I32", 4),
    "bfloat16": ("BF16", 2),
    "float16": ("F16", 2),
    "uint16": ("U16", 2),
    "int16": ("I16", 2),
    "int8": ("I8", 1),
    "uint8": ("U8", 1),
    "bool": ("BOOL", 1),
}
_DTYPE_RANK = {name: i for i, name in enumerate(SAFETENSORS_DTYPES)}

# Output dtype names as users type them -> torch dtype names.
OUTPUT_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}

# Files of a Hugging Face Trainer checkpoint that belong with the model (not the training state).
CONFIG_NAME = "config.json"
SIDE_FILES = (
    CONFIG_NAME,
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "chat_template.jinja",
    "chat_template.json",
)
GENERATION_CONFIG_NAME = "generation_config.json"


def side_kind(name: str) -> str:
    """What a side file is: "config", "generation config" or "tokenizer". A kind travels whole: a model
    folder never mixes one kind's files from two places (a tokenizer.json beside another's vocab.json)."""
    if name == CONFIG_NAME:
        return "config"
    return "generation config" if name == GENERATION_CONFIG_NAME else "tokenizer"


# ---- shards ---------------------------------------------------------------------------------------


def pack_shards(sizes: Sequence[tuple[str, int]], max_shard_size: int) -> list[list[str]]:
    """Names per shard, packed as `huggingface_hub.split_state_dict_into_shards_factory` packs them.

    `sizes` is (name, bytes) in state-dict order. A tensor larger than `max_shard_size` is put in a
    shard of its own at once, ahead of the shard still being filled; the others fill shards in order.
    """
    shards: list[list[str]] = []
    current: list[str] = []
    current_size = 0
    for name, size in sizes:
        if size > max_shard_size:
            shards.append([name])
            continue
        if current_size + size > max_shard_size:
            shards.append(current)
            current, current_size = [], 0
        current.append(name)
        current_size += size
    if current:
        shards.append(current)
    return shards


def shard_filename(index: int, count: int) -> str:
    """The file name of shard `index` (0-based) of `count`, as `save_pretrained` names it."""
    return SAFE_WEIGHTS_NAME if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def index_json(weight_map: Mapping[str, str], *, total_size: int, total_parameters: int) -> str:
    """`model.safetensors.index.json` as `save_pretrained` writes it (sorted keys, indent 2)."""
    index = {
        "metadata": {"total_parameters": total_parameters, "total_size": total_size},
        "weight_map": dict(weight_map),
    }
    return json.dumps(index, indent=2, sort_keys=True) + "\n"


# ---- safetensors layout ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor's bytes go in a safetensors file: [begin, end) after the header."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class SafetensorsFile:
    """A safetensors file before any tensor byte is written: its header and each tensor's slot."""

    header: bytes
    slots: tuple[TensorSlot, ...]

    @property
    def data_start(self) -> int:
        return len(self.header)

    @property
    def file_size(self) -> int:
        return len(self.header) + (self.slots[-1].end if self.slots else 0)


def itemsize(dtype: str) -> int:
    try:
        return SAFETENSORS_DTYPES[dtype][1]
    except KeyError:
        raise CheckpointError(
            f"dtype {dtype} cannot be stored in safetensors", actual=dtype,
            hint="safetensors holds bool, integer and float tensors (complex128 and others are not supported)",
        ) from None


def safetensors_file(
    tensors: Sequence[tuple[str, str, tuple[int, ...]]], metadata: Mapping[str, str] | None = None
) -> SafetensorsFile:
    """The layout `safetensors.torch.save` gives `tensors` ((name, torch dtype name, shape) each)."""
    for _name, dtype, _shape in tensors:
        itemsize(dtype)
    ordered = sorted(tensors, key=lambda t: (_DTYPE_RANK[t[1]], t[0]))
    slots = []
    offset = 0
    for name, dtype, shape in ordered:
        size = element_count(shape) * SAFETENSORS_DTYPES[dtype][1]
        slots.append(TensorSlot(name, dtype, tuple(shape), offset, offset + size))
        offset += size
    head: dict[str, object] = {}
    if metadata:
        head["__metadata__"] = dict(metadata)
    for slot in slots:
        head[slot.name] = {
            "dtype": SAFETENSORS_DTYPES[slot.dtype][0],
            "shape": list(slot.shape),
            "data_offsets": [slot.begin, slot.end],
        }
    text = json.dumps(head, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return SafetensorsFile(struct.pack("<Q", len(text)) + text, tuple(slots))


def read_header(raw_prefix: bytes) -> tuple[int, dict[str, object]]:
    """(header length including the 8-byte size, parsed header) from the first bytes of a file."""
    if len(raw_prefix) < 8:
        raise ValueError("shorter than a safetensors header")
    (size,) = struct.unpack("<Q", raw_prefix[:8])
    if len(raw_prefix) < 8 + size:
        raise ValueError(f"header of {size} bytes but only {len(raw_prefix) - 8} read")
    return 8 + size, json.loads(raw_prefix[8:8 + size])


# ---- reading a safetensors header ------------------------------------------------------------------

# safetensors' own bound on a header (`MAX_HEADER_SIZE` in its reader), and every dtype it knows with
# its size in bits (F4 and F6 pack below a byte).
MAX_SAFETENSORS_HEADER = 100_000_000
SAFETENSORS_BITS: dict[str, int] = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32,
    "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64,
}
_ST_HINT = "safetensors cannot load it: push the complete file, or leave it out"


@dataclass(frozen=True)
class SafetensorsHeader:
    """What a safetensors file's header says, after every check safetensors itself makes."""

    uri: str
    header_size: int  # the JSON header's bytes, without the 8-byte length before it
    tensors: Mapping[str, tuple[str, tuple[int, ...], int, int]]  # name -> (dtype, shape, begin, end)
    metadata: Mapping[str, str]

    @property
    def parameters(self) -> int:
        return sum(element_count(shape) for _dtype, shape, _b, _e in self.tensors.values())


def read_safetensors_header(uri: str, *, inside: str | None = None) -> SafetensorsHeader:
    """The header of the safetensors file at `uri`, read and checked as safetensors reads it: at most
    `MAX_SAFETENSORS_HEADER` bytes (a larger length is refused before anything is read), UTF-8 JSON
    nested at most `plumbing.files.MAX_JSON_DEPTH` deep, an object of tensors with a known dtype, a
    shape of non-negative integers and byte offsets that cover the data exactly, in order, without
    gaps; `__metadata__` strings to strings. A `CorruptFileError` naming the file says what is wrong."""
    def bad(why: str) -> CorruptFileError:
        return CorruptFileError(f"{uri} is not a valid safetensors file: {why}", file=uri, hint=_ST_HINT)

    with open_regular(uri, inside=inside) as fh:
        size = check_regular(uri, inside=inside)
        prefix = fh.read(8)
        if prefix.startswith(b"version "):
            raise bad("it is a Git LFS pointer, not the file (run `git lfs pull`)")
        if len(prefix) < 8:
            raise bad(f"it is {len(prefix)} bytes long, shorter than the 8-byte header length")
        (length,) = struct.unpack("<Q", prefix)
        if length > MAX_SAFETENSORS_HEADER:
            raise bad(f"its header length says {length:,} bytes, more than safetensors reads "
                      f"({MAX_SAFETENSORS_HEADER:,})")
        if 8 + length > size:
            raise bad(f"its header length says {length:,} bytes but the file holds {size - 8:,} after it")
        raw = fh.read(length)
    if len(raw) != length:
        raise bad("it changed while being read")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise bad("its header is not UTF-8 text") from None
    try:
        doc = load_json(text)
    except ValueError as exc:
        raise bad(f"its header is not valid JSON ({one_line(str(exc), 120)})") from None
    if not isinstance(doc, dict):
        raise bad("its header is not a JSON object")
    metadata = doc.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise bad("its __metadata__ is not an object of strings")
    tensors: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
    for name, info in doc.items():
        what = f"tensor {excerpt(name)}"
        if not isinstance(info, dict):
            raise bad(f"{what} is described by {excerpt(info)}, not an object")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in SAFETENSORS_BITS:
            raise bad(f"{what} has the dtype {excerpt(dtype)}, which safetensors does not know")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise bad(f"{what} has the shape {excerpt(shape)}, not a list of non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int and o >= 0 for o in offsets)):
            raise bad(f"{what} has the data offsets {excerpt(offsets)}, not two non-negative integers")
        bits = element_count(shape) * SAFETENSORS_BITS[dtype]
        if bits % 8 or offsets[1] - offsets[0] != bits // 8:
            raise bad(f"{what} has {offsets[1] - offsets[0]:,} bytes of data for a {dtype} tensor of shape "
                      f"{excerpt(shape, 80)}")
        tensors[name] = (dtype, tuple(shape), offsets[0], offsets[1])
    end = 0
    for name, (_dtype, _shape, begin, stop) in sorted(tensors.items(), key=lambda kv: (kv[1][2], kv[1][3])):
        if begin != end:
            raise bad(f"tensor {excerpt(name)} starts at byte {begin:,} of the data, where {end:,} was expected "
                      "(tensors must follow each other without gaps)")
        end = stop
    if 8 + length + end != size:
        raise bad(f"its tensors cover {end:,} bytes of data but the file holds {size - 8 - length:,}")
    return SafetensorsHeader(uri, length, tensors, metadata)


# ---- files that travel with the model -------------------------------------------------------------

# config.json is parsed (its dtype is rewritten): a config is kilobytes, a few MB with a large label map.
MAX_CONFIG_BYTES = 16 << 20
# Any other side file read whole into memory (from a config source): a tokenizer.json with a 256k
# vocabulary is about 35 MB.
MAX_SIDE_FILE_BYTES = 128 << 20
_SIDE_HINT = ("config, generation config and tokenizer files are carried into the model folder: replace it with a "
              "regular file in the checkpoint folder, or remove it")


def find_side_files(root: str) -> list[str]:
    """Names from `SIDE_FILES` present in the checkpoint folder `root` (the folder holding `latest`)."""
    fs, path = open_fs(root)
    try:
        present = {posixpath.basename(p) for p in fs.ls(path, detail=False)}
    except FileNotFoundError:
        return []
    return [name for name in SIDE_FILES if name in present]


def check_side_files(root: str, names: Sequence[str]) -> int:
    """The bytes the side files `names` of `root` take, each checked before anything is written: a
    regular file that stays inside `root` (`plumbing.files`), and config.json parsed."""
    total = 0
    for name in names:
        uri = join(root, name)
        total += check_regular(uri, inside=root, hint=_SIDE_HINT)
        if name == CONFIG_NAME:
            rewrite_config(read_config(root), "float32", uri=uri)
    return total


def read_config(root: str) -> bytes:
    """The bytes of `root`'s config.json: a regular file of at most `MAX_CONFIG_BYTES`."""
    return read_regular(join(root, CONFIG_NAME), limit=MAX_CONFIG_BYTES, what="config.json", inside=root,
                        hint=_SIDE_HINT)


def rewrite_config(raw: bytes, dtype: str, *, uri: str = CONFIG_NAME) -> bytes:
    """`config.json` with its dtype set to `dtype` (a torch dtype name such as "bfloat16").

    `torch_dtype` (what transformers 4 reads) is always set; `dtype` (what transformers 5 writes and
    prefers) is set too when the config has it. Everything else is kept as it was, in its order.
    JSON nested deeper than `plumbing.files.MAX_JSON_DEPTH` is refused."""
    try:
        config = load_json(raw)
    except ValueError as exc:
        raise CheckpointError(f"{uri} is not valid JSON ({one_line(str(exc), 200)})", file=uri,
                              hint="fix or remove config.json in the checkpoint folder") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{uri} does not hold a JSON object", file=uri,
                              hint="fix or remove config.json in the checkpoint folder")
    if "dtype" in config:
        config["dtype"] = dtype
    config["torch_dtype"] = dtype
    return (json.dumps(config, indent=2) + "\n").encode("utf-8")


def copy_side_files(root: str, names: Sequence[str], dest: str, dtype: str) -> dict[str, int]:
    """Copy `names` from `root` into `dest`, rewriting `config.json`'s dtype; {name: bytes written}.
    Regular files only (`plumbing.files`); a write that fails is an `OutputError`."""
    written = {}
    for name in names:
        if name == CONFIG_NAME:
            raw = rewrite_config(read_config(root), dtype, uri=join(root, name))
            write_bytes(join(dest, name), raw)
            written[name] = len(raw)
        else:
            written[name] = copy_regular(join(root, name), join(dest, name), inside=root, hint=_SIDE_HINT)
    return written


def side_file_bytes(name: str, data: bytes, dtype: str) -> bytes:
    """What the model folder holds for the side file `name` read as `data`: config.json with its dtype set
    to `dtype` (`rewrite_config`), any other file as it is."""
    return rewrite_config(data, dtype, uri=name) if name == CONFIG_NAME else data


def write_side_files(files: Mapping[str, bytes], dest: str, dtype: str) -> dict[str, int]:
    """Write side files held in memory (`name -> bytes` as read) into `dest`, config.json's dtype set to
    `dtype`; {name: bytes written}. A write that fails is an `OutputError`."""
    written = {}
    for name, data in files.items():
        raw = side_file_bytes(name, data, dtype)
        write_bytes(join(dest, name), raw)
        written[name] = len(raw)
    return written


__all__ = [
    "CONFIG_NAME",
    "GENERATION_CONFIG_NAME",
    "MAX_CONFIG_BYTES",
    "MAX_SIDE_FILE_BYTES",
    "OUTPUT_DTYPES",
    "PROVENANCE_NAME",
    "SAFE_WEIGHTS_INDEX_NAME",
    "SAFE_WEIGHTS_NAME",
    "MAX_SAFETENSORS_HEADER",
    "SIDE_FILES",
    "SafetensorsHeader",
    "SafetensorsFile",
    "TensorSlot",
    "check_side_files",
    "copy_side_files",
    "find_side_files",
    "index_json",
    "pack_shards",
    "read_config",
    "read_header",
    "read_safetensors_header",
    "rewrite_config",
    "safetensors_file",
    "shard_filename",
    "side_file_bytes",
    "side_kind",
    "write_side_files",
]
