"""Types of the compiled `ckptflow.formats._casts` (`_casts.c`), which mypy cannot read.

Both functions take any C-contiguous buffers (numpy arrays among them): `src` holds float32 bits, `out`
receives half as many bytes; a size mismatch raises ValueError.
"""

from typing import Any

from _typeshed import ReadableBuffer, WriteableBuffer
from numpy.typing import NDArray

has_f16c: int  # 1 where the CPU has AVX and F16C, 0 elsewhere

def fp32_to_bf16(src: ReadableBuffer | NDArray[Any], out: WriteableBuffer | NDArray[Any], /) -> None: ...
def fp32_to_fp16(src: ReadableBuffer | NDArray[Any], out: WriteableBuffer | NDArray[Any], /) -> None: ...
