"""Reading a whole tensor from a checkpoint as torch would, for tests: by its byte range, strided or not.

ckptflow itself never needs a whole tensor in memory; tests compare with one.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from ckptflow.formats.torch.tensorref import TensorRef, check_length
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


def storage_ranges(path: str) -> list[tuple[int, int]]:
    """[start, end) of every non-empty storage's bytes in the local torch archive at `path`, from its
    zip records (zipfile and the local headers, not ckptflow's reader): what a reader of headers and
    pickles must never touch."""
    import struct
    import zipfile

    out = []
    with open(path, "rb") as fh, zipfile.ZipFile(fh) as zf:
        for info in zf.infolist():
            if "/data/" not in info.filename or not info.file_size:
                continue
            fh.seek(info.header_offset)
            header = struct.unpack("<4sHHHHHIIIHH", fh.read(30))
            start = info.header_offset + 30 + header[9] + header[10]
            out.append((start, start + info.file_size))
    return out


def tensor_reads(reads: "list[tuple[str, int, int]]", ranges: "dict[str, list[tuple[int, int]]]") -> int:
    """Bytes of `reads` (path, start, end) that fall inside the storage ranges of their file."""
    total = 0
    for path, start, end in reads:
        for a, b in ranges.get(path, ()):
            total += max(0, min(end, b) - max(start, a))
    return total
