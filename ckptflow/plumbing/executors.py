"""Running a step's independent units side by side, and stopping them together.

Every step has the same shape: a pure plan, units that do not depend on each other, and a finalize.
`run_units` runs the units on any `concurrent.futures.Executor`: a thread pool of `workers` threads
when none is given, or a Dask cluster (`cluster(address)` gives its executor). Results come back in
plan order. The first failure stops the rest: queued units are cancelled, running ones on threads see
`cancel` set and stop at their next step by raising `Cancelled`, and the failure that started it is
what is raised, never a `Cancelled`.

What crosses processes on a cluster is `fn` and each unit, pickled: `fn` must be a module-level
function (pickled by reference) and a unit plain data, never a closure, a lock or an Event. So on a
cluster a running unit cannot be told to stop (Dask lets it finish and drops the result), and progress
comes from units as they finish (`done`), not from inside them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Executor, Future, ThreadPoolExecutor, wait
from typing import TypeVar

from ckptflow.errors import ClusterError

__all__ = ["CLUSTER_ENV", "Cancelled", "Executor", "cluster", "run_units"]

T = TypeVar("T")
R = TypeVar("R")

logger = logging.getLogger(__name__)

CLUSTER_ENV = "CKPTFLOW_CLUSTER"  # the scheduler address the CLI and the flows use when none is given
TIMEOUT_ENV = "CKPTFLOW_CLUSTER_TIMEOUT"  # seconds to wait for the scheduler to answer (default 20)
DEFAULT_AHEAD = 256  # units submitted to an executor ahead of the finished ones


class Cancelled(Exception):
    """Raised inside a unit that stopped because another unit failed or the run was interrupted."""


def run_units(
    fn: Callable[[T], R],
    units: Iterable[T],
    *,
    workers: int = 4,
    executor: Executor | None = None,
    cancel: threading.Event | None = None,
    name: str = "ckptflow-unit",
    done: Callable[[T, R], None] | None = None,
    ahead: int = DEFAULT_AHEAD,
) -> list[R]:
    """`fn(unit)` for every unit, at most `workers` at once on a thread pool (or on `executor`), results
    in the order of `units`. `cancel` (made here when not given) is set on the first failure or an
    interrupt; `fn` should check it between steps and raise `Cancelled`. `done(unit, result)` is called
    on this thread as each unit finishes. `units` is consumed lazily: at most `ahead` units are
    submitted and unfinished at a time (a unit made on the fly, e.g. a job for a worker, is made just
    before it is submitted)."""
    cancel = cancel if cancel is not None else threading.Event()
    if executor is not None:
        return _run(executor, fn, units, cancel, done, max(1, ahead))
    items = list(units)
    with ThreadPoolExecutor(max(1, min(workers, len(items))), thread_name_prefix=name) as pool:
        return _run(pool, fn, items, cancel, done, max(1, ahead, len(items)))


def _run(executor: Executor, fn: Callable[[T], R], units: Iterable[T], cancel: threading.Event,
         done: Callable[[T, R], None] | None, ahead: int) -> list[R]:
    pending = iter(units)
    running: dict[Future[R], tuple[int, T]] = {}
    results: dict[int, R] = {}
    submitted = 0
    exhausted = False
    try:
        while True:
            while not exhausted and len(running) < ahead:
                unit = next(pending, _END)
                if unit is _END:
                    exhausted = True
                    break
                running[executor.submit(fn, unit)] = (submitted, unit)  # type: ignore[arg-type,assignment]
                submitted += 1
            if not running:
                break
            finished, _ = wait(list(running), return_when=FIRST_COMPLETED)
            if any(f.cancelled() or f.exception() is not None for f in finished):
                _stop(list(running), cancel)
                errors = [f.exception() for f in running if not f.cancelled() and f.exception() is not None]
                if not errors:
                    raise Cancelled("a unit was cancelled")
                raise next((e for e in errors if not isinstance(e, Cancelled)), errors[0])  # type: ignore[misc]
            for future in sorted(finished, key=lambda f: running[f][0]):
                # The future is dropped once its result is here: a cluster then forgets the unit, and
                # never runs a finished unit again when the worker that ran it dies later.
                i, unit = running.pop(future)
                results[i] = future.result()
                if done is not None:
                    done(unit, results[i])
    except BaseException:  # Ctrl-C, or a failure above: stop the running units, drop the queued ones
        _stop(list(running), cancel)
        raise
    return [results[i] for i in range(submitted)]


_END = object()


def _stop(futures: list[Future[R]], cancel: threading.Event) -> None:
    """Set `cancel`, cancel what has not started, and wait for what has (threads stop at their next
    step; a cluster's running units are let finish)."""
    cancel.set()
    for future in futures:
        future.cancel()
    wait(futures)


@contextlib.contextmanager
def cluster(address: str, *, timeout: float | None = None) -> Iterator[Executor]:
    """An `Executor` on the Dask scheduler at `address` ('tcp://host:8786'), for `run_units`.

    Submissions are impure (each gets a key of its own: units are never tokenized, and two equal units
    both run). Needs the `cluster` extra (`distributed`); raises `ClusterError` with one line saying
    what to do when it is missing or the scheduler does not answer within `timeout` seconds (default
    `$CKPTFLOW_CLUSTER_TIMEOUT`, else 20).
    """
    if timeout is None:
        timeout = float(os.environ.get(TIMEOUT_ENV) or 20)
    try:
        from distributed import Client
    except ImportError:
        raise ClusterError(
            f"running on the Dask cluster at {address} needs Dask's `distributed` package, which is not installed",
            code="cluster-missing", uri=address, hint="pip install 'ckptflow[cluster]', or run without --cluster",
        ) from None
    try:
        client = Client(address, timeout=f"{timeout:g}s", set_as_default=False)
    except (OSError, TimeoutError, ValueError, TypeError) as exc:
        detail = " ".join(str(exc).split()) or type(exc).__name__
        raise ClusterError(
            f"cannot reach the Dask scheduler at {address} ({detail[:200]})", uri=address,
            hint="check the address (tcp://HOST:PORT) and that the scheduler is running and reachable from here",
        ) from None
    try:
        logger.info("running units on the Dask cluster at %s (%d workers)", address,
                    len(client.scheduler_info().get("workers", {})))
        yield client.get_executor(pure=False)
    finally:
        with contextlib.suppress(Exception):
            client.close(timeout=10)
