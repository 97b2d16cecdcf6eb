"""When and how Prefect retries an I/O task: only transient errors, with backoff and jitter.

Prefect needs `retry_condition_fn` to be a plain function (a bound method, a `functools.partial` or a
callable object silently disables retries), so `retry_if_transient` is one. The decision itself is
`ckptflow.plumbing.retry.is_transient`, the same rule the core library uses inside its own retry loops.
"""

from __future__ import annotations

import os
from typing import Any

from prefect.tasks import exponential_backoff

from ckptflow.plumbing.retry import is_transient


def retry_if_transient(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect `retry_condition_fn`: retry when the task failed with a transient error."""
    exc = getattr(state, "data", None)
    if not isinstance(exc, BaseException):
        try:
            exc = state.result(raise_on_failure=False)
        except Exception as error:  # the state holds no readable result; judge the error itself
            exc = error
    return isinstance(exc, BaseException) and is_transient(exc)


def io_retries(retries: int = 4, backoff: float | None = None) -> dict[str, Any]:
    """Task options for I/O: `retries` more tries after `backoff`, 2x, 4x ... seconds, +-50% jitter.

    `backoff` defaults to `$CKPTFLOW_TASK_RETRY_BACKOFF` (seconds, read at import), else 2.
    """
    if backoff is None:
        backoff = float(os.environ.get("CKPTFLOW_TASK_RETRY_BACKOFF", "2"))
    return {
        "retries": retries,
        "retry_delay_seconds": exponential_backoff(backoff_factor=backoff)(retries),
        "retry_jitter_factor": 0.5,
        "retry_condition_fn": retry_if_transient,
    }
