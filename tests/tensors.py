"""Reading a whole tensor from a checkpoint as torch would, for tests: by its byte range, strided or not.

ckptflow itself never needs a whole tensor in memory; tests compare with one.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from ckptflow.formats.torchzip import TensorRef, check_length
from ckptflow.plumbing.storage import open_fs

if TYPE_CHECKING:
    import torch


def read_tensor(ref: TensorRef) -> "torch.Tensor":
    """Read exactly `ref`'s bytes and return a tensor that owns them."""
    import torch

    dtype = getattr(torch, ref.dtype)
    if ref.numel == 0:
        return torch.empty(ref.shape, dtype=dtype)
    fs, path = open_fs(ref.uri)
    if ref.is_contiguous:
        start, end = ref.byte_range
        raw = fs.cat_file(path, start=start, end=end)
        check_length(ref, raw, end - start)
        return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(ref.shape)
    span = 1 + sum((d - 1) * s for d, s in zip(ref.shape, ref.stride))
    start = ref.data_offset + ref.storage_offset * ref.itemsize
    raw = fs.cat_file(path, start=start, end=start + span * ref.itemsize)
    check_length(ref, raw, span * ref.itemsize)
    flat = torch.frombuffer(bytearray(raw), dtype=dtype)
    return flat.as_strided(ref.shape, ref.stride).clone()


def read_elements(ref: TensorRef, start: int, numel: int) -> "torch.Tensor":
    """Flat elements [start, start + numel) of a contiguous tensor, reading only their bytes."""
    import torch

    dtype = getattr(torch, ref.dtype)
    if numel == 0:
        return torch.empty(0, dtype=dtype)
    fs, path = open_fs(ref.uri)
    begin, end = ref.element_range(start, numel)
    raw = fs.cat_file(path, start=begin, end=end)
    check_length(ref, raw, end - begin)
    return torch.frombuffer(bytearray(raw), dtype=dtype)


def iter_chunks(ref: TensorRef, chunk_bytes: int = 64 << 20) -> Iterator["torch.Tensor"]:
    """A contiguous tensor's flat elements in chunks of at most `chunk_bytes`, for bounded memory."""
    step = max(1, chunk_bytes // ref.itemsize)
    for start in range(0, ref.numel, step):
        yield read_elements(ref, start, min(step, ref.numel - start))
