"""Running a core plan's independent units as Prefect tasks, at most `limit` submitted at a time."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from prefect.futures import PrefectFuture, as_completed, wait


def run_bounded(submit: Any, items: Sequence[Any], limit: int, cancel: threading.Event) -> list[Any]:
    """`submit(item)` for every item, at most `limit` unfinished at a time; their results in order.

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
            results[running.pop(finished)] = finished.result()
    except BaseException:
        cancel.set()
        wait(list(running))
        raise
    return [results[i] for i in range(len(items))]
