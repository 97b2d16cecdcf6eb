"""Artifacts people would rather read than logs: tables, progress bars and summaries.

Artifact keys must be lowercase letters, digits and dashes; `artifact_key` makes one from free text.
Creating an artifact never fails the work it describes: an error is logged and the work goes on.
Outside a flow or task run (a task's `.fn` called directly) no artifact is made at all.
"""

from __future__ import annotations

import contextvars
import logging
import re
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any
from uuid import UUID

from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

logger = logging.getLogger(__name__)


def artifact_key(*parts: object) -> str:
    """A valid artifact key from free text: lowercase, dashes, at most 100 characters."""
    text = "-".join(str(p) for p in parts if p not in (None, ""))
    key = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    return re.sub(r"-{2,}", "-", key)[:100].strip("-") or "ckptflow"


def in_run() -> bool:
    """True inside a Prefect flow or task run, where artifacts belong."""
    from prefect.context import FlowRunContext, TaskRunContext

    return FlowRunContext.get() is not None or TaskRunContext.get() is not None


def table(rows: Sequence[Mapping[str, Any]], *, key: str | None, description: str) -> None:
    """A table artifact, one row per mapping."""
    if not in_run():
        return
    try:
        create_table_artifact(table=[dict(r) for r in rows], key=key, description=description)
    except Exception:
        logger.warning("could not create table artifact %s", key, exc_info=True)


def markdown(text: str, *, key: str | None, description: str) -> None:
    """A markdown artifact."""
    if not in_run():
        return
    try:
        create_markdown_artifact(markdown=text, key=key, description=description)
    except Exception:
        logger.warning("could not create markdown artifact %s", key, exc_info=True)


class ProgressArtifact:
    """A progress artifact fed by the core's `progress(done_bytes, total_bytes)` callbacks.

    Callbacks may come from worker threads and may be frequent: updates are serialized, sent at most
    every `interval` seconds (and always at 100%), and run in the context of the task that made the
    artifact, so they reach the same Prefect API.
    """

    def __init__(self, *, key: str, description: str, interval: float = 1.0) -> None:
        self._lock = threading.Lock()
        self._interval = interval
        self._last_sent = 0.0
        self._last_percent = -1.0
        self._context = contextvars.copy_context()
        self._id: UUID | None = None
        if not in_run():
            return
        try:
            self._id = create_progress_artifact(progress=0.0, key=key, description=description)
        except Exception:
            logger.warning("could not create progress artifact %s", key, exc_info=True)

    def __call__(self, done: int, total: int) -> None:
        if self._id is None:
            return
        percent = 100.0 if total <= 0 else min(100.0, 100.0 * done / total)
        now = time.monotonic()
        with self._lock:
            if percent <= self._last_percent:
                return
            if percent < 100.0 and now - self._last_sent < self._interval:
                return
            self._last_sent, self._last_percent = now, percent
            try:
                self._context.run(update_progress_artifact, artifact_id=self._id, progress=round(percent, 1))
            except Exception:
                logger.debug("progress artifact update failed", exc_info=True)

    def finish(self) -> None:
        """Show 100%: the work is done even when the last callback said less."""
        if self._id is not None and self._last_percent < 100.0:
            self._last_sent = 0.0
            self(1, 1)
