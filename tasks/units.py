"""A step's units as Prefect tasks: Prefect task submission wrapped as a `concurrent.futures.Executor`,
so that the core's one step driver (`ckptflow.plumbing.steps.run_step`) runs them.

`unit_executor(cluster, tasks)` gives a `TaskExecutor` that submits each unit as the Prefect task
that runs the core's unit function (`{run_job: write_shard}`): through the flow's own task runner
(threads) when `cluster` is empty (and `$CKPTFLOW_CLUSTER` unset), else through a prefect-dask
`DaskTaskRunner` connected to that scheduler for the step's units only (validation, planning and
finalize stay in the flow run, which reads headers only). On a cluster each unit task gets its job
(small and picklable: `ckptflow.consolidate.ShardJob`, `ckptflow.reshard.RankJob`) and nothing else:
no progress callback, no Event (neither pickles); progress then comes from finished units.
Prefect-dask submits with `pure=True`, so Dask tokenizes every submission: it is cheap because a job
is small. Retries, caching and names stay the unit task's own.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Executor, Future
from typing import Any

from prefect.futures import PrefectFuture

from ckptflow.errors import ClusterError
from ckptflow.plumbing.executors import CLUSTER_ENV


def cluster_address(cluster: str | None) -> str | None:
    """The scheduler a step's units run on: `cluster`, else `$CKPTFLOW_CLUSTER` on this worker, else
    None (threads)."""
    return (cluster or os.environ.get(CLUSTER_ENV) or "").strip() or None


class TaskExecutor(Executor):
    """Prefect task submission as an `Executor`: `submit(fn, *args, **kwargs)` submits the Prefect task
    that runs the core function `fn` (from `tasks`) with those arguments as its parameters, and
    returns a future that ends as the task run ends, after Prefect's own retries, with its result or
    the error it failed with.

    The future is running from the start: `cancel()` never drops a submitted task run. A unit stops
    through the cancel event it was given (threads) or runs to its end (a cluster); either way the
    driver waits for it before it aborts the step."""

    def __init__(self, tasks: Mapping[Callable[..., Any], Any], submit: Callable[..., PrefectFuture[Any]]) -> None:
        self._tasks = dict(tasks)
        self._submit = submit

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        task = self._tasks.get(fn)
        if task is None:
            raise TypeError(f"no Prefect task runs {getattr(fn, '__qualname__', fn)!r}")
        parameters = inspect.signature(task.fn).bind(*args, **kwargs).arguments
        submitted = self._submit(task, **parameters)
        future: Future[Any] = Future()
        future.set_running_or_notify_cancel()
        submitted.add_done_callback(lambda run: _settle(future, run))
        return future


def _settle(future: Future[Any], run: PrefectFuture[Any]) -> None:
    """Hand the finished task run's result, or the error it failed with, to `future`."""
    try:
        result = run.result()
    except BaseException as exc:  # the unit's failure, whatever it is: the driver waiting on `future` raises
        future.set_exception(exc)  # it (a future left unresolved would keep the driver waiting for ever)
    else:
        future.set_result(result)


@contextlib.contextmanager
def unit_executor(cluster: str | None, tasks: Mapping[Callable[..., Any], Any]) -> Iterator[TaskExecutor]:
    """A `TaskExecutor` for a step's unit `tasks` (core function -> Prefect task): on the flow's runner,
    or on the Dask cluster at `cluster` (see the module docstring). `ClusterError` when the cluster
    cannot be used."""
    if not cluster:
        yield TaskExecutor(tasks, lambda task, **parameters: task.submit(**parameters))
        return
    try:
        from prefect_dask import DaskTaskRunner
    except ImportError as error:  # kept as the cause: a package that is there but fails to import says why
        raise ClusterError(
            f"running units on the Dask cluster at {cluster} needs prefect-dask, which is not installed",
            code="cluster-missing",
            uri=cluster,
            hint="install ckptflow[cluster] on the flow's worker",
        ) from error
    runner = DaskTaskRunner(address=cluster, client_kwargs={"timeout": "20s", "set_as_default": False})
    try:
        runner.__enter__()
        runner.client  # connects now (the runner would only on its first submission)
    except (OSError, TimeoutError, ValueError) as exc:
        runner.__exit__(None, None, None)
        detail = " ".join(str(exc).split()) or type(exc).__name__
        raise ClusterError(f"cannot reach the Dask scheduler at {cluster} ({detail[:200]})", uri=cluster,
                           hint="check the address (tcp://HOST:PORT) and that the flow's worker can reach it") from None
    try:
        yield TaskExecutor(tasks, lambda task, **parameters: runner.submit(task, parameters=parameters))
    finally:
        runner.__exit__(None, None, None)
