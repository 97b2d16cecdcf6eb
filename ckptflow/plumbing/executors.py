"""Running a step's independent units side by side, and stopping them together.

Every step has the same shape: a pure plan, units that do not depend on each other, and a finalize.
`run_units` runs the units on any `concurrent.futures.Executor` (a thread pool of `workers` threads
when none is given) and gives their results in plan order. The first failure stops the rest: queued
units are cancelled, running ones see `cancel` set and stop at their next step by raising
`Cancelled`, and the failure that started it is what is raised, never a `Cancelled`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Executor, Future, ThreadPoolExecutor, wait
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


class Cancelled(Exception):
    """Raised inside a unit that stopped because another unit failed or the run was interrupted."""


def run_units(
    fn: Callable[[T], R],
    units: Sequence[T],
    *,
    workers: int = 4,
    executor: Executor | None = None,
    cancel: threading.Event | None = None,
    name: str = "ckptflow-unit",
) -> list[R]:
    """`fn(unit)` for every unit, at most `workers` at once on a thread pool (or on `executor`), results
    in the order of `units`. `cancel` (made here when not given) is set on the first failure or an
    interrupt; `fn` should check it between steps and raise `Cancelled`."""
    cancel = cancel if cancel is not None else threading.Event()
    if executor is not None:
        return _run(executor, fn, units, cancel)
    with ThreadPoolExecutor(max(1, min(workers, len(units))), thread_name_prefix=name) as pool:
        return _run(pool, fn, units, cancel)


def _run(executor: Executor, fn: Callable[[T], R], units: Sequence[T], cancel: threading.Event) -> list[R]:
    futures: list[Future[R]] = [executor.submit(fn, unit) for unit in units]
    try:
        finished, _ = wait(futures, return_when=FIRST_EXCEPTION)
    except BaseException:  # Ctrl-C: stop the running units at their next step, drop the queued ones
        _stop(futures, cancel)
        raise
    if any(f.exception() is not None for f in finished if not f.cancelled()):
        _stop(futures, cancel)
        errors = [f.exception() for f in futures if not f.cancelled() and f.exception() is not None]
        raise next((e for e in errors if not isinstance(e, Cancelled)), errors[0])  # type: ignore[misc]
    return [f.result() for f in futures]


def _stop(futures: Sequence[Future[R]], cancel: threading.Event) -> None:
    cancel.set()
    for future in futures:
        future.cancel()
    wait(futures)
