"""Where a step's units run besides this process's threads: a Dask cluster.

`cluster(address)` gives the cluster's `concurrent.futures.Executor`, which `plumbing.steps.run_step`
(and `run_units`) submit units to. What crosses processes is the unit's function and its job,
pickled: the function must be a module-level one (pickled by reference) and the job plain data,
never a closure, a lock or an Event.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from concurrent.futures import Executor

from ckptflow.errors import ClusterError, option

__all__ = ["CLUSTER_ENV", "cluster"]

logger = logging.getLogger(__name__)

CLUSTER_ENV = "CKPTFLOW_CLUSTER"  # the scheduler address the CLI and the flows use when none is given
TIMEOUT_ENV = "CKPTFLOW_CLUSTER_TIMEOUT"  # seconds to wait for the scheduler to answer (default 20)


@contextlib.contextmanager
def cluster(address: str, *, timeout: float | None = None) -> Iterator[Executor]:
    """An `Executor` on the Dask scheduler at `address` ('tcp://host:8786'), for `plumbing.steps.run_step`.

    Submissions are impure (each gets a key of its own: units are never tokenized, and two equal units
    both run). Needs the `cluster` extra (`distributed`); raises `ClusterError` with one line saying
    what to do when it is missing or the scheduler does not answer within `timeout` seconds (default
    `$CKPTFLOW_CLUSTER_TIMEOUT`, else 20).
    """
    if timeout is None:
        timeout = float(os.environ.get(TIMEOUT_ENV) or 20)
    try:
        from distributed import Client
    except ImportError as error:  # kept as the cause: a package that is there but fails to import says why
        raise ClusterError(
            f"running on the Dask cluster at {address} needs Dask's `distributed` package, which is not installed",
            code="cluster-missing", uri=address,
            hint=f"pip install 'ckptflow[cluster]', or run without {option('cluster')}",
        ) from error
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
