"""Where a tensor's bytes are in a torch archive (`TensorRef`), and the dtypes torch stores.

A `TensorRef` is what the unpickler yields in place of a tensor: dtype, shape, stride, storage offset and
the exact byte range of its storage in the file, nothing read yet. `read_scalar` reads a one-element
tensor (an optimizer step, a loss scale) without torch.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from ckptflow.errors import CorruptFileError
from ckptflow.plumbing.ranges import read_ranges
from ckptflow.plumbing.sizes import element_count

# Storage class name -> (dtype name, item size in bytes).
STORAGE_DTYPES: dict[str, tuple[str, int]] = {
    "DoubleStorage": ("float64", 8),
    "FloatStorage": ("float32", 4),
    "HalfStorage": ("float16", 2),
    "BFloat16Storage": ("bfloat16", 2),
    "LongStorage": ("int64", 8),
    "IntStorage": ("int32", 4),
    "ShortStorage": ("int16", 2),
    "CharStorage": ("int8", 1),
    "ByteStorage": ("uint8", 1),
    "BoolStorage": ("bool", 1),
    "ComplexFloatStorage": ("complex64", 8),
    "ComplexDoubleStorage": ("complex128", 16),
}


DTYPE_SIZES: dict[str, int] = {name: size for name, size in STORAGE_DTYPES.values()}


@dataclass(frozen=True, slots=True)
class TensorRef:
    """Where a tensor's bytes are: everything needed to read exactly them, and nothing read yet."""

    uri: str
    key: str
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    storage_numel: int
    data_offset: int

    @property
    def numel(self) -> int:
        return element_count(self.shape)

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def is_contiguous(self) -> bool:
        expected = 1
        for dim, step in zip(reversed(self.shape), reversed(self.stride)):
            if dim != 1 and step != expected:
                return False
            expected *= dim
        return True

    @property
    def byte_range(self) -> tuple[int, int]:
        """[start, end) of this tensor's elements in the file; `CorruptFileError` for a strided tensor,
        whose elements are not one range (checkpoint tensors never are)."""
        if not self.is_contiguous:
            raise CorruptFileError(
                f"{self.uri}: storage {self.key} is read as a strided tensor (shape {list(self.shape)}, stride "
                f"{list(self.stride)}), which DeepSpeed never saves", file=self.uri,
                hint="the file is damaged or was written by another tool; copy it again from the training run",
            )
        start = self.data_offset + self.storage_offset * self.itemsize
        return start, start + self.nbytes

    def element_range(self, start: int, numel: int) -> tuple[int, int]:
        """[start, end) bytes of `numel` flat elements from element `start` of a contiguous tensor."""
        begin = self.byte_range[0] + start * self.itemsize
        return begin, begin + numel * self.itemsize


# A float32 tensor read as a narrower float: a virtual byte stream `cast:<dtype>:<uri>` whose byte v is
# byte 2v of the file `uri`, every 4-byte float32 turned into the 2 bytes of `dtype` as torch rounds it
# (`formats.casts`). The torch writer's `SourceReader` reads and casts it; a `TensorRef` of that stream
# (`cast_view`) lets a plan place cast elements like any other bytes.
CAST_PREFIX = "cast:"
CASTS = ("bfloat16", "float16")


def cast_view(ref: TensorRef, dtype: str) -> TensorRef:
    """The float32 tensor `ref` as `dtype` (bfloat16 or float16) elements: same shape, read and cast on
    the way (`parse_cast`)."""
    if ref.dtype != "float32" or dtype not in CASTS or ref.data_offset % 2:
        raise ValueError(f"cannot read {ref.dtype} {ref.uri} at byte {ref.data_offset} as {dtype}")
    return TensorRef(f"{CAST_PREFIX}{dtype}:{ref.uri}", ref.key, dtype, ref.shape, ref.stride, ref.storage_offset,
                     ref.storage_numel, ref.data_offset // 2)


def parse_cast(uri: str) -> tuple[str, str] | None:
    """(dtype, the float32 file's URI) of a `cast_view` stream; None for a plain URI."""
    if not uri.startswith(CAST_PREFIX):
        return None
    dtype, _, real = uri[len(CAST_PREFIX):].partition(":")
    return (dtype, real) if dtype in CASTS and real else None


_SCALAR_FORMATS = {"float64": "<d", "float32": "<f", "float16": "<e", "int64": "<q", "int32": "<i", "int16": "<h",
                   "int8": "<b", "uint8": "<B", "bool": "<?"}


def read_scalar(ref: TensorRef) -> float | int | bool:
    """The value of a one-element tensor (an optimizer step, a loss scale), read without torch."""
    if ref.numel != 1:
        raise ValueError(f"{ref.uri}: storage {ref.key} holds {ref.numel} elements, not one")
    start = ref.data_offset + ref.storage_offset * ref.itemsize
    raw = read_ranges([(ref.uri, start, start + ref.itemsize)])[0]
    value: float | int | bool  # struct gives Any; the formats above give these
    if ref.dtype == "bfloat16":  # the upper half of a float32
        value = struct.unpack("<f", b"\x00\x00" + raw)[0]
        return value
    if ref.dtype not in _SCALAR_FORMATS:
        raise ValueError(f"{ref.uri}: cannot read a {ref.dtype} scalar")
    value = struct.unpack(_SCALAR_FORMATS[ref.dtype], raw)[0]
    return value


def check_length(ref: TensorRef, raw: bytes, expected: int) -> None:
    if len(raw) != expected:
        raise CorruptFileError(
            f"{ref.uri}: read {len(raw)} bytes of storage {ref.key}, expected {expected}", file=ref.uri,
            expected=expected, actual=len(raw), hint="the file changed or was truncated while being read",
        )
