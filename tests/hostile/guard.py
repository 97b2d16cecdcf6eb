"""A hang guard for in-process calls on hostile input (a pickle bomb, a deep structure): the call runs
on a daemon thread and the test fails, naming it, if it has not returned within a limit set far above
its expected time. Not a speed check: benchmarks/ measures speed."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

HANG_GUARD_S = 60.0


def returns_within(fn: Callable[[], T], what: str, seconds: float = HANG_GUARD_S) -> T:
    """`fn()`'s result or exception, or an AssertionError when it is still running after `seconds`."""
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["result"] = fn()
        except BaseException as exc:  # re-raised in the caller
            out["error"] = exc

    thread = threading.Thread(target=run, name=f"hang-guard {what}", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise AssertionError(f"{what} still running after {seconds:.0f} s: unbounded work on hostile input")
    if "error" in out:
        raise out["error"]  # type: ignore[misc]
    return out["result"]  # type: ignore[return-value]
