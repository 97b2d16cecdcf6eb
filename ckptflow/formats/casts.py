"""Dtype casts on raw bytes with numpy, bit for bit as torch's CPU casts, so that converting a
checkpoint needs no `import torch` (over a second of start-up).

`cast_into(dest, out_dtype, src, src_dtype)` fills the buffer `dest` from the buffer `src`; dtypes
are torch names ("float32", "bfloat16", ...). Handled here:

- any dtype to itself: a byte copy;
- float32 -> bfloat16: round to nearest, ties to even, on the bits (what `c10::BFloat16` and torch's
  vectorized kernels do): finite values that round past the largest bfloat16 become infinity,
  subnormals round like any other value. Every NaN becomes 0xFFFF, the pattern torch's AVX2 and
  AVX-512 kernels give on x86-64 whatever the sign and payload (torch's scalar fallback, with
  `ATEN_CPU_CAPABILITY=default`, would give 0x7FC0 instead);
- float32 -> float16: numpy's cast (round to nearest even, overflow to infinity, subnormals), with
  NaNs then set as torch (F16C) sets them: the sign, the quiet bit and the top 9 payload bits;
- bfloat16 -> float32: the bits shifted into place (exact, NaN payloads kept, as torch);
- float16 -> float32: numpy's cast (exact), with the quiet bit set on NaNs as torch's vectorized
  kernel (F16C) sets it, sign and payload kept. (Torch is not consistent here: the last `numel % 8`
  elements of a tensor, which its kernel converts one by one, get 0x7FFFFFFF for any NaN instead.)

- bfloat16 -> float16: through float32 (exact), then as float32 -> float16, which is what torch does;
- float16 -> bfloat16: through float32 (exact), then as float32 -> bfloat16, except that torch gives
  0x7FC0 for every NaN on this path.

Anything else (float64, integers to floats, ...) goes through torch, imported only then.
`tests/test_casts.py` compares the numpy casts with torch's over every 16-bit pattern and several
million float32 patterns (every exponent, rounding boundaries, NaN payloads, subnormals).

The work goes in blocks of `BLOCK` elements so that the temporaries stay in the CPU cache.

float32 -> bfloat16 and float32 -> float16, the casts a consolidation spends its CPU on, go through
the compiled `ckptflow.formats._casts` where the install built it (one pass without the GIL: 8 to 11
GB/s of source against numpy's 3 for bfloat16, F16C against numpy's well under 1 for float16), and
through numpy otherwise; `native` is that module or None. Both give the same bits, checked against
torch by the same tests.

`cast_rows_into` does the same into rows spread apart in the destination.

`count_non_finite(raw, dtype)` counts NaN and Inf values in raw floating-point bytes, on the bits.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np


class NativeCasts(Protocol):
    """What `ckptflow.formats._casts` (`_casts.c`, typed in `_casts.pyi`) offers."""

    has_f16c: int

    def fp32_to_bf16(self, src: np.ndarray, out: np.ndarray, /) -> None: ...

    def fp32_to_fp16(self, src: np.ndarray, out: np.ndarray, /) -> None: ...


native: NativeCasts | None  # the compiled module, or None where the install did not build it
try:
    from ckptflow.formats import _casts as native
except ImportError:  # built without a C compiler: numpy gives the same bits, slower
    native = None

BLOCK = 1 << 16  # elements per step; the uint32 scratch (256 KiB) stays in the L2 cache

# torch dtype names that numpy holds as they are (bfloat16 is kept as its uint16 bits).
NUMPY_DTYPES: dict[str, Any] = {
    "float64": np.float64, "float32": np.float32, "float16": np.float16, "bfloat16": np.uint16,
    "int64": np.int64, "int32": np.int32, "int16": np.int16, "int8": np.int8, "uint8": np.uint8,
    "uint16": np.uint16, "uint32": np.uint32, "uint64": np.uint64, "bool": np.bool_,
    "complex64": np.complex64, "complex128": np.complex128,
}

BF16_NAN = 0xFFFF  # torch's float32 -> bfloat16 result for every NaN (x86-64 vectorized kernels)
BF16_NAN_FROM_F16 = 0x7FC0  # torch's float16 -> bfloat16 result for every NaN
F32_QUIET = 0x00400000  # the quiet bit of a float32 NaN


def as_array(buffer: Any, dtype: Any) -> np.ndarray:
    """A flat numpy view of a buffer (bytes, bytearray, memoryview, mmap, numpy array), no copy."""
    if isinstance(buffer, np.ndarray):
        return buffer.reshape(-1).view(dtype)
    return np.frombuffer(buffer, dtype=dtype)


def _native_fits(src: np.ndarray, out: np.ndarray) -> bool:
    """Whether the compiled casts (where built) can take these arrays: both contiguous, `out` writable."""
    return src.flags.c_contiguous and out.flags.c_contiguous and out.flags.writeable


def fp32_to_bf16(src: np.ndarray, out: np.ndarray) -> None:
    """`out` (uint16, bfloat16 bits) = `src` (uint32, float32 bits) rounded as torch rounds."""
    if native is not None and _native_fits(src, out):
        native.fp32_to_bf16(src, out)
        return
    n = src.size
    scratch = np.empty(min(n, BLOCK), dtype=np.uint32)
    for i in range(0, n, BLOCK):
        s = src[i:i + BLOCK]
        t = scratch[:s.size]
        np.right_shift(s, 16, out=t)
        np.bitwise_and(t, 1, out=t)
        np.add(t, 0x7FFF, out=t)  # the rounding bias: 0x7FFF, plus one when the kept part is odd
        np.add(t, s, out=t)
        np.right_shift(t, 16, out=t)
        o = out[i:i + BLOCK]
        np.copyto(o, t, casting="unsafe")
        f = s.view(np.float32)
        if np.isnan(f.max()):  # max propagates NaN: one cheap pass tells whether to look closer
            o[np.isnan(f)] = BF16_NAN


def fp32_to_fp16(src: np.ndarray, out: np.ndarray) -> None:
    """`out` (uint16, float16 bits) = `src` (uint32, float32 bits) rounded as torch rounds."""
    if native is not None and _native_fits(src, out) and native.has_f16c:
        native.fp32_to_fp16(src, out)
        return
    with np.errstate(over="ignore", invalid="ignore"):
        for i in range(0, src.size, BLOCK):
            s = src[i:i + BLOCK]
            f = s.view(np.float32)
            o = out[i:i + BLOCK]
            np.copyto(o.view(np.float16), f, casting="unsafe")
            if np.isnan(f.max()):
                nan = np.isnan(f)
                bits = s[nan]
                # numpy keeps a signaling NaN signaling; torch (F16C) sets the quiet bit.
                o[nan] = ((bits >> 16) & 0x8000 | 0x7E00 | (bits >> 13) & 0x3FF).astype(np.uint16)


def bf16_to_fp32(src: np.ndarray, out: np.ndarray) -> None:
    """`out` (uint32, float32 bits) = `src` (uint16, bfloat16 bits) widened: exact."""
    for i in range(0, src.size, BLOCK):
        o = out[i:i + BLOCK]
        np.copyto(o, src[i:i + BLOCK])
        np.left_shift(o, 16, out=o)


def fp16_to_fp32(src: np.ndarray, out: np.ndarray) -> None:
    """`out` (uint32, float32 bits) = `src` (uint16, float16 bits) widened: exact; NaNs made quiet."""
    for i in range(0, src.size, BLOCK):
        o = out[i:i + BLOCK].view(np.float32)
        np.copyto(o, src[i:i + BLOCK].view(np.float16))
        if np.isnan(o.max()):
            o.view(np.uint32)[np.isnan(o)] |= F32_QUIET  # numpy keeps a signaling NaN signaling


def bf16_to_fp16(src: np.ndarray, out: np.ndarray) -> None:
    """`out` (uint16, float16 bits) = `src` (uint16, bfloat16 bits) rounded as torch rounds."""
    mid = np.empty(min(src.size, BLOCK), dtype=np.uint32)
    for i in range(0, src.size, BLOCK):
        m = mid[:src[i:i + BLOCK].size]
        bf16_to_fp32(src[i:i + BLOCK], m)
        fp32_to_fp16(m, out[i:i + BLOCK])


def fp16_to_bf16(src: np.ndarray, out: np.ndarray) -> None:
    """`out` (uint16, bfloat16 bits) = `src` (uint16, float16 bits) rounded as torch rounds."""
    mid = np.empty(min(src.size, BLOCK), dtype=np.uint32)
    for i in range(0, src.size, BLOCK):
        m = mid[:src[i:i + BLOCK].size]
        fp16_to_fp32(src[i:i + BLOCK], m)
        o = out[i:i + BLOCK]
        fp32_to_bf16(m, o)
        f = m.view(np.float32)
        if np.isnan(f.max()):
            o[np.isnan(f)] = BF16_NAN_FROM_F16


# (source dtype, output dtype) -> (cast, source bits dtype, output bits dtype)
CASTS = {
    ("float32", "bfloat16"): (fp32_to_bf16, np.uint32, np.uint16),
    ("float32", "float16"): (fp32_to_fp16, np.uint32, np.uint16),
    ("bfloat16", "float32"): (bf16_to_fp32, np.uint16, np.uint32),
    ("float16", "float32"): (fp16_to_fp32, np.uint16, np.uint32),
    ("bfloat16", "float16"): (bf16_to_fp16, np.uint16, np.uint16),
    ("float16", "bfloat16"): (fp16_to_bf16, np.uint16, np.uint16),
}


def needs_torch(src_dtype: str, out_dtype: str) -> bool:
    """Whether `cast_into` has to import torch for this pair."""
    return src_dtype != out_dtype and (src_dtype, out_dtype) not in CASTS


def cast_into(dest: Any, out_dtype: str, src: Any, src_dtype: str) -> None:
    """Fill `dest` (a writable buffer of exactly the output's bytes) with the elements of `src` (a
    buffer of whole `src_dtype` elements) cast to `out_dtype`, as `tensor.to(out_dtype)` would on CPU."""
    if src_dtype == out_dtype:
        np.copyto(as_array(dest, np.uint8), as_array(src, np.uint8))
        return
    cast = CASTS.get((src_dtype, out_dtype))
    if cast is not None:
        fn, src_bits, out_bits = cast
        fn(as_array(src, src_bits), as_array(dest, out_bits))
        return
    _torch_cast_into(dest, out_dtype, src, src_dtype)


def cast_rows_into(dest: np.ndarray, out_dtype: str, src: Any, src_dtype: str, rows: int, row: int,
                   stride: int) -> None:
    """`cast_into` for a destination of `rows` rows of `row` bytes, `stride` bytes apart from the start
    of `dest` (uint8), the rows back to back in `src`: a row-parallel shard's rows in the full tensor."""
    raw = as_array(src, np.uint8)
    if rows == 1:
        cast_into(dest[:row], out_dtype, raw, src_dtype)
        return
    if (rows - 1) * stride + row > dest.size or stride < row:
        raise ValueError(f"{rows} rows of {row} bytes {stride} bytes apart do not fit in {dest.size} bytes")
    view = np.lib.stride_tricks.as_strided(dest, shape=(rows, row), strides=(stride, 1))
    if src_dtype == out_dtype:
        np.copyto(view, raw.reshape(rows, row))
        return
    flat = np.empty(rows * row, dtype=np.uint8)
    cast_into(flat, out_dtype, raw, src_dtype)
    np.copyto(view, flat.reshape(rows, row))


def _torch_cast_into(dest: Any, out_dtype: str, src: Any, src_dtype: str) -> None:
    import torch

    raw = as_array(src, np.uint8)
    if not raw.flags.writeable:  # torch.frombuffer warns on read-only buffers; it only reads here
        raw = raw.copy()
    out = torch.from_numpy(as_array(dest, np.uint8)).view(getattr(torch, out_dtype))
    if raw.size:
        out.copy_(torch.frombuffer(raw, dtype=getattr(torch, src_dtype)))


def scalar(raw: bytes, dtype: str) -> Any:
    """One element's bytes as a Python value (for messages): a float, int, bool or complex; the hex
    of the bytes for a dtype numpy cannot read."""
    if dtype == "bfloat16":
        return float(np.frombuffer(b"\0\0" + raw, dtype=np.float32)[0])
    np_dtype = NUMPY_DTYPES.get(dtype)
    if np_dtype is None:
        return raw.hex()
    return np.frombuffer(raw, dtype=np_dtype)[0].item()


__all__ = [
    "BLOCK",
    "CASTS",
    "bf16_to_fp16",
    "bf16_to_fp32",
    "cast_into",
    "fp16_to_bf16",
    "fp16_to_fp32",
    "fp32_to_bf16",
    "fp32_to_fp16",
    "needs_torch",
    "scalar",
]


# Exponent bits of each floating-point dtype, all ones for NaN and Inf: (unsigned word, mask).
_EXPONENTS: dict[str, tuple[Any, int]] = {
    "bfloat16": (np.uint16, 0x7F80),
    "float16": (np.uint16, 0x7C00),
    "float32": (np.uint32, 0x7F800000),
    "float64": (np.uint64, 0x7FF0000000000000),
}


def count_non_finite(raw: Any, dtype: str) -> int:
    """NaN and Inf values in the buffer `raw` of `dtype` elements (0 for integer and bool dtypes)."""
    if dtype not in _EXPONENTS:
        return 0
    word, mask = _EXPONENTS[dtype]
    bits = np.frombuffer(raw, dtype=word)
    return int(np.count_nonzero((bits & word(mask)) == word(mask)))
