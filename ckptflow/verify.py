"""The model check: does a consolidated folder load, run and hold the source's weights?

`verify_model(out, source=...)` loads a consolidated folder with transformers, runs a forward pass on
a fixed input, requires finite logits, and compares every loaded tensor with the source weights
(read through `ckptflow.formats.shard_check.read_source_into`, independently of the writer). Every
mismatch raises `VerificationError` naming the tensor. The byte-level check of each shard, which
`consolidate --verify` runs, is `ckptflow.formats.shard_check.verify_shard`.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from ckptflow.consolidate import plan_consolidation
from ckptflow.errors import VerificationError
from ckptflow.formats import hf
from ckptflow.formats.deepspeed import load_index
from ckptflow.formats.shard_check import SourceTensor, read_source_into
from ckptflow.plumbing.redaction import describe
from ckptflow.plumbing.sizes import element_count
from ckptflow.plumbing.storage import open_fs
from ckptflow.plumbing.stores.local import os_path

if TYPE_CHECKING:
    import torch


def read_source(tensor: SourceTensor, dtype: str | None = None, lo: int = 0, hi: int | None = None) -> "torch.Tensor":
    """Flat elements [lo, hi) of `tensor` read from its source runs and cast to `dtype` (default: the
    tensor's output dtype), as a torch tensor."""
    import torch

    hi = element_count(tensor.shape) if hi is None else hi
    dtype = dtype or tensor.dtype
    out = np.empty((hi - lo) * hf.itemsize(dtype), dtype=np.uint8)
    read_source_into(tensor, lo, hi, out, dtype)
    return torch.from_numpy(out).view(getattr(torch, dtype))


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


def verify_model(out: str, *, source: str | None = None, tag: str | None = None,
                 device: str | None = None) -> ModelCheck:
    """Load the model folder `out` with transformers (the class its `config.json` names: a causal LM
    when it is one, else `AutoModel`), run a forward pass on a fixed input on `device` (CUDA when
    present, else CPU) and require finite logits. With `source` (a ZeRO checkpoint), compare every
    loaded tensor with the source weights cast to its dtype; buffers must match exactly."""

    path = os_path(out)
    if path is not None:
        return _verify_local(path, out, source, tag, device)
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
        hint = ("consolidate again giving the trained model's config (a config source: a folder or a Hub repo); "
                "the checkpoint has none" if not os.path.exists(os.path.join(path, hf.CONFIG_NAME))
                else "fix the config.json of the model folder")
        raise VerificationError(f"transformers cannot read {out}/config.json ({describe(exc)})", file=out,
                                hint=hint) from None
    causal = any(str(a).endswith(("ForCausalLM", "LMHeadModel")) for a in (config.architectures or []))
    cls = AutoModelForCausalLM if causal else AutoModel
    try:
        # with output_loading_info, (model, info): transformers' annotations give the model alone
        loaded = cls.from_pretrained(path, output_loading_info=True, dtype="auto")
        model, info = cast(tuple[Any, dict[str, Any]], loaded)
    except Exception as exc:  # transformers' loaders raise what their formats raise: each is a model it cannot load
        raise VerificationError(f"transformers cannot load {out} ({describe(exc)})", file=out) from None
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
                      logits_shape=tuple(logits.shape), tensors_compared=compared,
                      compared_to_source=source is not None)


def _compare_to_source(model: Any, source: str, tag: str | None, out: str) -> int:
    import torch

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


__all__ = ["ModelCheck", "read_source", "verify_model"]
