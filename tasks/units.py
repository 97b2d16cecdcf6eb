"""Running a core plan's independent units as Prefect tasks: on the flow's task runner (threads), or
on a Dask cluster through prefect-dask's `DaskTaskRunner`.

`unit_runner(cluster)` gives the function that submits one unit task: `task.submit(...)` through the
flow's own runner when `cluster` is empty (and `$CKPTFLOW_CLUSTER` unset), else a `DaskTaskRunner`
connected to that scheduler for the step's units only (validation, planning and finalize stay in the
flow run, which reads headers only). On a cluster each unit task gets its job (small and picklable:
`ckptflow.consolidate.ShardJob`, `ckptflow.reshard.RankJob`) and nothing else: no progress callback,
no Event (neither pickles); progress then comes from finished units. Prefect-dask submits with
`pure=True`, so Dask tokenizes every submission: it is cheap because a job is small.

`run_bounded(submit, items, limit, cancel)` keeps at most `limit` unit tasks unfinished.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prefect.futures import PrefectFuture, as_completed, wait

from ckptflow.errors import ClusterError
from ckptflow.plumbing.executors import CLUSTER_ENV

CLUSTER_AHEAD = 256  # unit tasks in flight on a cluster (its workers' threads decide how many run)


def cluster_address(cluster: str | None) -> str | None:
    """The scheduler a step's units run on: `cluster`, else `$CKPTFLOW_CLUSTER` on this worker, else
    None (threads)."""
    return (cluster or os.environ.get(CLUSTER_ENV) or "").strip() or None


@contextlib.contextmanager
def unit_runner(cluster: str | None) -> Iterator[Callable[..., PrefectFuture[Any]]]:
    """`submit(task, **parameters)` for a step's unit tasks: the flow's runner, or the Dask cluster at
    `cluster` (see the module docstring). `ClusterError` when the cluster cannot be used."""
    if not cluster:
        yield lambda task, **parameters: task.submit(**parameters)
        return
    try:
        from prefect_dask import DaskTaskRunner
    except ImportError:
        raise ClusterError(f"running units on the Dask cluster at {cluster} needs prefect-dask, which is not installed",
                           code="cluster-missing", uri=cluster, hint="install ckptflow[cluster] on the flow's worker") from None
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
        yield lambda task, **parameters: runner.submit(task, parameters=parameters)
    finally:
        runner.__exit__(None, None, None)


def run_bounded(submit: Any, items: Sequence[Any], limit: int, cancel: threading.Event,
                done: Callable[[Any, Any], None] | None = None) -> list[Any]:
    """`submit(item)` for every item, at most `limit` unfinished at a time; their results in order.
    `done(item, result)` is called as each finishes.

    On the first failure `cancel` is set, the units still running are waited for (they stop at their
    next batch), and that failure is raised.
    """
    pending = list(enumerate(items))
    running: dict[PrefectFuture[Any], int] = {}
    results: dict[int, Any] = {}
    try:
        while pending or running:
            while pending and len(running) < max(1, limit):
                i, item = pending.pop(0)
                running[submit(item)] = i
            finished = next(as_completed(list(running)))
            i = running.pop(finished)
            results[i] = finished.result()
            if done is not None:
                done(items[i], results[i])
    except BaseException:
        cancel.set()
        wait(list(running))
        raise
    return [results[i] for i in range(len(items))]
