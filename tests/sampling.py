"""The suite's two modes. By default the slow families are sampled: the cases that each cost a
DeepSpeed launch (the reshard oracles) run a fixed subset chosen to cover every layout, stage, dtype
and direction; the fuzzer and the hostile corpus run their default samples. The long mode runs every
case: `CKPTFLOW_LONG=1 make test` (or `pytest --long`; the older `CKPTFLOW_HOSTILE_LONG=1` and
`CKPTFLOW_FUZZ_LONG=1` still turn it on).

The mode is read from the environment when a test module is imported, so that parametrization and
the session fixtures that launch DeepSpeed for every selected case agree on the cases.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import TypeVar

LONG_ENV = "CKPTFLOW_LONG"
_ALIASES = (LONG_ENV, "CKPTFLOW_HOSTILE_LONG", "CKPTFLOW_FUZZ_LONG")

T = TypeVar("T")


def long_mode() -> bool:
    return any(os.environ.get(name) == "1" for name in _ALIASES)


def sample(cases: Sequence[T], keep: Iterable[T]) -> tuple[T, ...]:
    """Every one of `cases` in the long mode; else those in `keep`, in `cases`' order. Each kept case
    must be one of `cases` (a renamed case must not silently drop out of the default run)."""
    keep = set(keep)
    unknown = keep - set(cases)
    if unknown:
        raise ValueError(f"sampled cases that are not cases: {sorted(map(str, unknown))}")
    return tuple(cases) if long_mode() else tuple(case for case in cases if case in keep)
