"""The one step driver: an output built from independent units, committed whole or not at all.

Every step that writes an output (consolidate, reshard) has one shape: a pure plan made before, units
that do not depend on each other, and a commit. `Step` is that shape and `run_step` runs it, on a
thread pool, a Dask cluster or Prefect tasks (any `concurrent.futures.Executor`). The call order,
which `run_step` follows and anyone driving a step by hand must follow too:

1. `committed()`, optionally and before anything else: the output an earlier run of the same plan
   committed at OUT, taken as it is; None when OUT is absent or empty. Writes nothing. (`run_step`
   does not call it: whether an earlier output may stand is the caller's choice.)
2. `prepare()`, once, on the coordinator: checks that OUT is free (and, on a local disk, that there is
   room) and makes the staging folder; returns the units in plan order. From here on, `abort()` is
   owed on any failure.
   `check()`, once, on a thread of its own beside the units (`run_step` starts it right after
   `prepare`): the step's checks that do not need the units' output (consolidate's config source
   checked against the plan, which imports transformers: seconds that would otherwise come before the
   first byte is written). Its failure stops the units, as a unit's failure does, and is the step's
   error; `finalize` comes only after it returned. It writes nothing. Driving by hand, call it before
   `finalize`.
3. `job(unit)`, once per unit, on the coordinator or one of its threads: what a worker needs for the
   unit and nothing more, plain picklable data (no plan, no callable).
4. `run(job, progress=, cancel=)`, once per job, anywhere: writes the unit's files into the staging
   folder and reports them. Jobs run side by side, in any order; a job may run again after a failure
   (it rewrites the same bytes). `run` is a module-level function, so that it pickles by reference.
   In this process it gets a `progress` callback and the `cancel` event, and stops with `Cancelled`
   soon after `cancel` is set; elsewhere (a cluster) it gets the job alone.
5. `finalize(results)`, once, on the coordinator, after every `run` returned; `results` in unit order.
   Checks what the units report against the store, writes the rest, and commits with the marker (the
   index, `latest`) written last. Returns the step's output. A failure here leaves the staging folder
   for `abort`.
6. `abort()`, after a failure or an interrupt anywhere in 2-5, once no unit is running any more:
   removes the staging folder and all in it. Never raises; calling it twice is harmless.

`run_units` is the one bounded submit loop (`run_step` and `publish.store` use it): at most a given
number of units unfinished at a time, results in order, the first failure stopping the rest.

What crosses processes on a cluster is `run` and each job, pickled: so on a cluster a running unit
cannot be told to stop (Dask lets it finish and drops the result), and progress comes from units as
they finish, not from inside them.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Executor, Future, ThreadPoolExecutor, wait
from typing import Any, Protocol, TypeVar

from ckptflow.plumbing.progress import Progress, Tally

__all__ = ["DEFAULT_AHEAD", "Cancelled", "Step", "beside", "run_step", "run_units"]

T = TypeVar("T")
R = TypeVar("R")
U = TypeVar("U")
O_co = TypeVar("O_co", covariant=True)

DEFAULT_AHEAD = 256  # units submitted to a cluster ahead of the finished ones


class Cancelled(Exception):
    """Raised inside a unit that stopped because another unit failed or the run was interrupted."""


class Step(Protocol[U, O_co]):
    """One step's output as units and a commit; the module docstring gives the order of the calls."""

    run: Callable[..., Any]  # run(job, *, progress=None, cancel=None) -> the unit's result; module level

    def committed(self) -> O_co | None:
        """The output an earlier run of this plan committed at OUT, or None when OUT is absent or empty."""
        ...

    def prepare(self) -> Sequence[U]:
        """Check OUT and make the staging folder; the units, in plan order."""
        ...

    def job(self, unit: U) -> Any:
        """What a worker needs to write `unit`: small, plain, picklable."""
        ...

    def unit_bytes(self, unit: U) -> int:
        """The bytes `unit`'s progress counts to."""
        ...

    def check(self) -> None:
        """The checks that gate the commit but need no unit's output; beside the units, writing nothing."""
        ...

    def finalize(self, results: Sequence[Any]) -> O_co:
        """Check the units' reports, write the rest, commit (the marker last); the output."""
        ...

    def abort(self) -> None:
        """Remove the staging folder; never raises."""
        ...


def run_step(step: Step[U, O_co], *, executor: Executor | None = None, workers: int = 4,
             in_process: bool | None = None, ahead: int = DEFAULT_AHEAD, progress: Progress | None = None,
             name: str = "ckptflow-unit") -> O_co:
    """Run `step` through: `prepare`, every unit, `finalize`; `abort` on any failure or interrupt, once
    no unit is running any more, so nothing half-written is left.

    `step.check()` runs on a thread of its own beside the units; its failure stops them.
    Units run on `workers` threads made here (named `name`), each making its job and running it; or
    on `executor`. An `in_process` executor (a Prefect thread runner) gets `workers` units at a time
    with their progress callback and the cancel event; any other (a Dask cluster's) gets up to `ahead`
    jobs at a time, made here just before each is sent, and progress counts each unit as it finishes.
    `progress(done, total)` counts `step.unit_bytes` over all units.
    """
    units = step.prepare()
    try:
        checking = beside(step.check, name=f"{name}-check")
        tally = Tally(sum(step.unit_bytes(u) for u in units), progress)
        tally.start()
        results = _run_all(step, units, tally, executor=executor, workers=workers,
                           in_process=executor is None if in_process is None else in_process, ahead=ahead, name=name,
                           watch=checking)
        checking.result()  # the units finished first: the commit waits for the check
        return step.finalize(results)
    except BaseException:  # any failure, Ctrl-C included: no partial output; re-raised
        step.abort()
        raise


def beside(fn: Callable[[], Any], *, name: str) -> Future[Any]:
    """`fn()` started on a daemon thread of its own (named `name`, in a copy of the caller's context), as a
    future. Daemon: a check still running when the step fails for another reason does not hold up the
    process's exit."""
    future: Future[Any] = Future()
    context = contextvars.copy_context()

    def go() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(context.run(fn))
        except BaseException as exc:  # the future carries it to whoever waits
            future.set_exception(exc)

    threading.Thread(target=go, name=name, daemon=True).start()
    return future


def _run_all(step: Step[U, Any], units: Sequence[U], tally: Tally, *, executor: Executor | None, workers: int,
             in_process: bool, ahead: int, name: str, watch: Future[Any] | None = None) -> list[Any]:
    cancel = threading.Event()
    items = list(enumerate(units))
    if executor is None:
        def write(item: tuple[int, U]) -> Any:
            if cancel.is_set():
                raise Cancelled(f"unit {item[0]}")
            return step.run(step.job(item[1]), progress=tally.part(item[0]), cancel=cancel)

        return run_units(write, items, workers=workers, cancel=cancel, name=name, watch=watch)
    if in_process:
        return _bounded(lambda item: executor.submit(step.run, step.job(item[1]), progress=tally.part(item[0]),
                                                     cancel=cancel),
                        items, cancel, None, max(1, workers), watch)
    return _bounded(lambda item: executor.submit(step.run, step.job(item[1])), items, cancel,
                    lambda item, _result: tally.add(item[0], step.unit_bytes(item[1])), max(1, ahead), watch)


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
    watch: Future[Any] | None = None,
) -> list[R]:
    """`fn(unit)` for every unit, at most `workers` at once on a thread pool (or on `executor`), results
    in the order of `units`. `cancel` (made here when not given) is set on the first failure or an
    interrupt; `fn` should check it between steps and raise `Cancelled`. `done(unit, result)` is called
    on this thread as each unit finishes. On `executor`, `units` is consumed lazily: at most `ahead`
    units are submitted and unfinished at a time (a unit made on the fly, e.g. a job for a worker, is
    made just before it is submitted). `watch`, a future running beside the units (a check), fails the
    loop as a unit does when it fails: the units are stopped and its error raised."""
    cancel = cancel if cancel is not None else threading.Event()
    if executor is not None:
        return _bounded(lambda unit: executor.submit(fn, unit), units, cancel, done, max(1, ahead), watch)
    items = list(units)
    with ThreadPoolExecutor(max(1, min(workers, len(items))), thread_name_prefix=name) as pool:
        # Each unit runs in a copy of the caller's context, so what it says follows the caller's choices
        # (`errors.naming`: an option named as the command line or the form names it).
        return _bounded(lambda unit: pool.submit(contextvars.copy_context().run, fn, unit), items, cancel, done,
                        max(1, ahead, len(items)), watch)


def _bounded(submit: Callable[[T], Future[R]], units: Iterable[T], cancel: threading.Event,
             done: Callable[[T, R], None] | None, ahead: int, watch: Future[Any] | None = None) -> list[R]:
    """The loop: `submit(unit)` while fewer than `ahead` are unfinished, then wait for one to finish (or
    for `watch`). The first failure, of a unit or of `watch` (or an interrupt), sets `cancel`, cancels
    what has not started, waits for what has, and is raised: the unit's own error, never a `Cancelled`
    when another error is there."""
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
                running[submit(unit)] = (submitted, unit)
                submitted += 1
            if not running:
                break
            finished, _ = wait([*running, *([watch] if watch is not None else [])], return_when=FIRST_COMPLETED)
            if watch is not None and watch in finished:
                finished.discard(watch)
                failure = watch.exception()
                if failure is not None:
                    _stop(list(running), cancel)
                    raise failure
                watch = None
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


_END: Any = object()


def _stop(futures: list[Future[Any]], cancel: threading.Event) -> None:
    """Set `cancel`, cancel what has not started, and wait for what has (threads stop at their next
    step; a cluster's running units are let finish)."""
    cancel.set()
    for future in futures:
        future.cancel()
    wait(futures)
