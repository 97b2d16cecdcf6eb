"""Checks that what was written matches its source.

- `verify_shard(uri, tensors)`: reopen one safetensors shard and check its header (names, dtypes,
  shapes, offsets, size) and every byte of every tensor against the source, re-read through
  its own byte ranges (not the writer's batches), and cast to the output dtype.
  `consolidate --verify` runs it on every shard before the output is moved into place.
- `verify_model(out, source=...)`: load a consolidated folder with transformers, run a forward pass
  on a fixed input, require finite logits, and compare every loaded tensor with the source weights.

Every mismatch raises `VerificationError` naming the tensor.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import tempfile
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ckptflow import hf
from ckptflow.casts import cast_into, scalar
from ckptflow.errors import VerificationError
from ckptflow.storage import is_local, local_path, mapped, open_fs, read_into
from ckptflow.torchzip import TensorRef

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

Progress = Callable[[int, int], None]


class _Run(Protocol):
    ref: TensorRef
    start: int
    numel: int
    offset: int


class SourceTensor(Protocol):
    """What the checks need of an output tensor (`ckptflow.consolidate.OutputTensor` is one)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    runs: tuple[_Run, ...]


# ---- reading the source, independently of the writer ----------------------------------------------


def read_source(tensor: SourceTensor, dtype: str | None = None, lo: int = 0, hi: int | None = None) -> "torch.Tensor":
    """Flat elements [lo, hi) of `tensor` read from its source runs and cast to `dtype` (default: the
    tensor's output dtype), as a torch tensor (this imports torch; the shard check does not)."""
    import torch

    numel = 1
    for d in tensor.shape:
        numel *= d
    hi = numel if hi is None else hi
    dtype = dtype or tensor.dtype
    out = np.empty((hi - lo) * hf.itemsize(dtype), dtype=np.uint8)
    _read_source_into(tensor, lo, hi, out, dtype, _Bytes(0))
    return torch.from_numpy(out).view(getattr(torch, dtype))


class _Bytes:
    """Byte ranges as buffers, valid inside `with bytes.get(...)`: local files through a memory-mapped
    window (no copy), other stores through a range read into a reused scratch buffer."""

    def __init__(self, scratch_bytes: int) -> None:
        self.scratch = np.empty(scratch_bytes, dtype=np.uint8)

    @contextlib.contextmanager
    def get(self, uri: str, start: int, end: int) -> Iterator[Any]:
        if is_local(uri):
            with mapped(uri, start, end) as view:
                yield view
            return
        if self.scratch.size < end - start:
            self.scratch = np.empty(end - start, dtype=np.uint8)
        raw = self.scratch[:end - start]
        read_into([(uri, start, end, memoryview(raw))])
        yield raw


def _read_source_into(tensor: SourceTensor, lo: int, hi: int, out: np.ndarray, dtype: str, source: _Bytes) -> None:
    """Fill `out` (the bytes of hi - lo elements of `dtype`) from the source runs, each run's byte
    range computed here from its `TensorRef` (not taken from the writer's batches), and cast."""
    size = hf.itemsize(dtype)
    for run in tensor.runs:
        a, b = max(lo, run.offset), min(hi, run.offset + run.numel)
        if a >= b:
            continue
        start, end = run.ref.element_range(run.start + (a - run.offset), b - a)
        try:
            with source.get(run.ref.uri, start, end) as raw:
                cast_into(out[(a - lo) * size:(b - lo) * size], dtype, raw, run.ref.dtype)
        except (OSError, EOFError) as exc:
            raise VerificationError(f"cannot read the source again to check the output ({exc})", file=run.ref.uri,
                                    hint="the checkpoint changed or became unreadable while converting; run again",
                                    ) from exc


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Byte equality of two uint8 arrays, compared eight bytes at a time where the length allows."""
    if a.size != b.size:
        return False
    for word in (np.uint64, np.uint32, np.uint16):
        if a.size % np.dtype(word).itemsize == 0:
            return bool(np.array_equal(a.view(word), b.view(word)))
    return bool(np.array_equal(a, b))


# ---- one shard ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardCheck:
    """A shard that passed `verify_shard`."""

    uri: str
    tensors: int
    size: int
    sha256: str | None


def verify_shard(
    uri: str,
    tensors: Sequence[SourceTensor],
    *,
    sha256: str | None = None,
    chunk_bytes: int = 32 << 20,
    progress: Progress | None = None,
    written: Callable[[int], None] | None = None,
) -> ShardCheck:
    """Check the safetensors file at `uri` holds exactly `tensors`, each equal to its source cast to
    its dtype, byte for byte. With `sha256`, also check the file hashes to it.

    With `written`, the check runs while the file is still being written: `written(n)` must return
    once the first n bytes of the file are written (and raise if they never will be). Each range is
    then read back as soon as it exists, and the whole-file checks (size, header, what the
    safetensors library sees) come last instead of first.
    """
    expected = hf.safetensors_layout([(t.name, t.dtype, t.shape) for t in tensors], {"format": "pt"})
    size = _check_file(uri, expected) if written is None else None
    hasher = hashlib.sha256(expected.header) if sha256 else None  # the file's own header is checked to be this
    by_name = {t.name: t for t in tensors}
    total = expected.file_size - expected.data_start
    done = 0
    step = max(8, chunk_bytes // 8)  # elements per chunk: at most chunk_bytes of the widest dtype
    chunks = [(slot, lo, min((slot.end - slot.begin) // hf.itemsize(slot.dtype), lo + step))
              for slot in expected.slots for lo in range(0, (slot.end - slot.begin) // hf.itemsize(slot.dtype), step)]
    wants = [np.empty(step * 8, dtype=np.uint8) for _ in range(2)]
    shard, source = _Bytes(step * 8), _Bytes(step * 8)

    def expect(i: int) -> np.ndarray:
        """Chunk i as the source says it must be (read + cast), in a buffer of its own."""
        slot, lo, hi = chunks[i]
        want = wants[i % 2][:(hi - lo) * hf.itemsize(slot.dtype)]
        _read_source_into(by_name[slot.name], lo, hi, want, slot.dtype, source)
        return want

    # The source side of chunk i+1 is read and cast on a helper thread while chunk i is compared here.
    with ThreadPoolExecutor(1, thread_name_prefix="ckptflow-verify") as helper:
        pending = helper.submit(expect, 0) if chunks else None
        for i, (slot, lo, hi) in enumerate(chunks):
            assert pending is not None
            want = pending.result()
            pending = helper.submit(expect, i + 1) if i + 1 < len(chunks) else None
            nbytes = (hi - lo) * hf.itemsize(slot.dtype)
            start = expected.data_start + slot.begin + lo * hf.itemsize(slot.dtype)
            if written is not None:
                written(start + nbytes)
            try:
                with shard.get(uri, start, start + nbytes) as view:
                    got = np.frombuffer(view, dtype=np.uint8)
                    if not _same_bytes(got, want):
                        _raise_mismatch(uri, slot.name, slot.dtype, got, want, lo)
                    if hasher is not None:
                        hasher.update(view)
                    del got
            except (OSError, EOFError) as exc:
                raise VerificationError(f"cannot read {slot.name} back from {uri} ({exc})", file=uri,
                                        tensor=slot.name, hint="the shard is damaged; run again") from exc
            done += nbytes
            if progress:
                progress(done, total)
    if size is None:
        assert written is not None
        written(expected.file_size)
        size = _check_file(uri, expected)
    if hasher is not None and hasher.hexdigest() != sha256:
        raise VerificationError(f"{uri} hashes to {hasher.hexdigest()}, but {sha256} was recorded when it was "
                                "written", file=uri, expected=sha256, actual=hasher.hexdigest(),
                                hint="the file changed after it was written; run again")
    return ShardCheck(uri, len(expected.slots), size, sha256)


def _check_file(uri: str, expected: hf.SafetensorsLayout) -> int:
    """The file's size and header are the planned ones and the safetensors library reads it (on a
    local disk). Returns the size."""
    fs, path = open_fs(uri)
    try:
        size = fs.size(path)
        head = fs.cat_file(path, start=0, end=min(size, 8))
        length = 8 + int.from_bytes(head, "little") if len(head) == 8 else 0
        prefix = fs.cat_file(path, start=0, end=min(size, length, 8 + (100 << 20)))
    except (OSError, ValueError) as exc:
        raise VerificationError(f"cannot reopen {uri} ({exc})", file=uri, hint="the shard was not written") from exc
    _check_header(uri, prefix, expected)
    if size != expected.file_size:
        raise VerificationError(f"{uri} holds {size} bytes, expected {expected.file_size}", file=uri,
                                expected=expected.file_size, actual=size, hint="the write was cut short; run again")
    if is_local(uri):
        _check_with_safetensors(local_path(uri), [s.name for s in expected.slots])
    return size


def _check_header(uri: str, prefix: bytes, expected: hf.SafetensorsLayout) -> None:
    try:
        _, header = hf.read_header(prefix)
    except ValueError as exc:
        raise VerificationError(f"{uri} has no readable safetensors header ({exc})", file=uri,
                                hint="the shard is damaged; run again") from None
    header.pop("__metadata__", None)
    want = {s.name: s for s in expected.slots}
    for name in sorted(set(header) - set(want)):
        raise VerificationError(f"{uri} holds tensor {name}, which is not in the plan", file=uri, tensor=name)
    for name in sorted(set(want) - set(header)):
        raise VerificationError(f"{uri} lacks tensor {name}", file=uri, tensor=name)
    for name in sorted(want):
        entry, slot = header[name], want[name]
        wanted = {"dtype": hf.SAFETENSORS_DTYPES[slot.dtype][0], "shape": list(slot.shape),
                  "data_offsets": [slot.begin, slot.end]}
        if entry != wanted:
            raise VerificationError(f"{uri}: tensor {name} is recorded as {entry}, expected {wanted}", file=uri,
                                    tensor=name, expected=wanted, actual=entry)
    if prefix != expected.header:
        raise VerificationError(f"{uri}: the header differs from the planned one", file=uri,
                                hint="the shard is damaged; run again")


def _check_with_safetensors(path: str, names: list[str]) -> None:
    """The safetensors library itself must accept the file and see the same tensors."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="numpy") as f:  # the header is all that is read: no torch needed
            keys = sorted(f.keys())
    except Exception as exc:
        raise VerificationError(f"safetensors cannot open {path} ({exc})", file=path,
                                hint="the shard is damaged; run again") from None
    if keys != sorted(names):
        raise VerificationError(f"safetensors sees other tensors in {path} than were planned", file=path)


def _raise_mismatch(uri: str, name: str, dtype: str, got: np.ndarray, want: np.ndarray, lo: int) -> None:
    item = hf.itemsize(dtype)
    first = int(np.argmax((got.reshape(-1, item) != want.reshape(-1, item)).any(axis=1)))
    value = scalar(got[first * item:(first + 1) * item].tobytes(), dtype)
    expected = scalar(want[first * item:(first + 1) * item].tobytes(), dtype)
    raise VerificationError(
        f"tensor {name} in {uri} differs from the source at element {lo + first}: the file holds "
        f"{value!r}, the source gives {expected!r}", file=uri, tensor=name,
        expected=expected, actual=value, hint="the output is wrong; report this as a ckptflow bug",
    )


# ---- the whole model ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelCheck:
    """A consolidated folder that loaded, ran and (with a source) matched it tensor for tensor."""

    out: str
    model_class: str
    device: str
    dtype: str
    logits_shape: tuple[int, ...]
    tensors_compared: int
    compared_to_source: bool


def verify_model(out: str, *, source: str | None = None, tag: str | None = None, device: str | None = None) -> ModelCheck:
    """Load the model folder `out` with transformers (the class its `config.json` names: a causal LM
    when it is one, else `AutoModel`), run a forward pass on a fixed input on `device` (CUDA when
    present, else CPU) and require finite logits. With `source` (a ZeRO checkpoint), compare every
    loaded tensor with the source weights cast to its dtype; buffers must match exactly."""
    import torch

    if is_local(out):
        return _verify_local(local_path(out), out, source, tag, device)
    fs, path = open_fs(out)
    with tempfile.TemporaryDirectory(prefix="ckptflow-verify-") as tmp:
        fs.get(path.rstrip("/") + "/", tmp + "/", recursive=True)
        return _verify_local(tmp, out, source, tag, device)


def _verify_local(path: str, out: str, source: str | None, tag: str | None, device: str | None) -> ModelCheck:
    import torch
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise VerificationError(f"transformers cannot read {out}/config.json ({exc})", file=out,
                                hint="consolidate from a Hugging Face checkpoint that has a config.json") from None
    causal = any(str(a).endswith(("ForCausalLM", "LMHeadModel")) for a in (config.architectures or []))
    cls = AutoModelForCausalLM if causal else AutoModel
    try:
        model, info = cls.from_pretrained(path, output_loading_info=True, dtype="auto")
    except Exception as exc:
        raise VerificationError(f"transformers cannot load {out} ({type(exc).__name__}: {exc})", file=out) from None
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        found = sorted(str(k) for k in (info.get(key) or ()))
        if found:
            raise VerificationError(f"loading {out} reports {key.replace('_', ' ')}: {', '.join(found[:5])}"
                                    + (f" and {len(found) - 5} more" if len(found) > 5 else ""), file=out,
                                    tensor=found[0], actual=found)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device).eval()
    vocab = int(getattr(config, "vocab_size", 0) or 0) or 2
    length = min(16, int(getattr(config, "max_position_embeddings", 16) or 16))
    ids = (torch.arange(length, dtype=torch.long) * 7 + 3).remainder(vocab).unsqueeze(0).to(device)
    with torch.no_grad():
        output = model(input_ids=ids)
    logits = getattr(output, "logits", None)
    if logits is None:
        logits = output.last_hidden_state
    if not bool(torch.isfinite(logits).all()):
        raise VerificationError(f"{out}: the forward pass gives non-finite logits", file=out, tensor="logits",
                                hint="the weights are corrupt or overflow in this dtype")
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    compared = _compare_to_source(model, source, tag, out) if source is not None else 0
    return ModelCheck(out=out, model_class=type(model).__name__, device=str(device), dtype=dtype,
                      logits_shape=tuple(logits.shape), tensors_compared=compared, compared_to_source=source is not None)


def _compare_to_source(model: Any, source: str, tag: str | None, out: str) -> int:
    import torch

    from ckptflow.consolidate import plan_consolidation
    from ckptflow.zero import load_index

    index = load_index(source, tag)
    plan = plan_consolidation(index)
    tensors = {t.name: t for u in plan.units for t in u.tensors}
    count = 0
    for name, loaded in model.state_dict().items():
        owner = index.tied.get(name, name)
        tensor = tensors.get(owner)
        if tensor is None:
            raise VerificationError(f"{out}: the model holds {name}, which {source} does not", file=out, tensor=name)
        if tuple(loaded.shape) != tuple(tensor.shape):
            raise VerificationError(f"{out}: {name} has shape {tuple(loaded.shape)}, the source {tensor.shape}",
                                    file=out, tensor=name, expected=tensor.shape, actual=tuple(loaded.shape))
        dtype = str(loaded.dtype).removeprefix("torch.")
        if getattr(tensor, "kind", None) == "buffer" and dtype != tensor.dtype:
            raise VerificationError(f"{out}: {name} loaded as {dtype}, the source holds {tensor.dtype}",
                                    file=out, tensor=name, expected=tensor.dtype, actual=dtype)
        want = read_source(tensor, dtype).view(tensor.shape)
        got = loaded.detach().cpu().contiguous()
        if not torch.equal(got.view(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)):
            diff = (got.float() - want.float()).abs().max().item() if got.is_floating_point() else None
            raise VerificationError(f"{out}: {name} differs from the source ({source})"
                                    + (f", max abs difference {diff:g}" if diff is not None else ""),
                                    file=out, tensor=name, hint="the output does not hold the source's weights")
        count += 1
    return count


__all__ = ["ModelCheck", "ShardCheck", "read_source", "verify_model", "verify_shard"]
