"""Sizes and counts: the one place that parses and prints byte sizes and counts tensor elements.

Sizes are printed in decimal units (1 GB = 10**9 bytes), as the Hugging Face Hub, `save_pretrained`'s
`max_shard_size` and disk vendors count them; `parse_size` reads both decimal and binary units.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

_UNITS = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3,
          "TIB": 2**40, "GIB": 2**30, "MIB": 2**20, "KIB": 2**10, "B": 1}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def parse_size(value: int | str) -> int:
    """Bytes in `value`: an int, or a string such as "5GB", "500MB", "2GiB" (units as huggingface_hub)."""
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"a size must be positive, got {value}")
        return value
    match = _SIZE_RE.match(str(value))
    unit = match.group(2).upper() if match else ""
    if not match or (unit and unit not in _UNITS):
        raise ValueError(f"cannot read {value!r} as a size; write it like 5GB, 500MB or 2GiB")
    size = int(float(match.group(1)) * _UNITS.get(unit, 1))
    if size <= 0:
        raise ValueError(f"a size must be positive, got {value!r}")
    return size


def format_size(n: int) -> str:
    """`n` bytes for people: 1.2 GB, 340.0 MB, 12.0 KB, 7 B."""
    for unit, scale in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def element_count(shape: Iterable[int]) -> int:
    """Elements of a tensor of `shape` (1 for a scalar's empty shape)."""
    return math.prod(shape)
