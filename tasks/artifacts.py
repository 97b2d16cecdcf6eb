"""Artifacts people would rather read than logs: tables, progress bars and summaries.

Artifact keys must be lowercase letters, digits and dashes; `artifact_key` makes one from free text,
`checkpoint_key` one that names the checkpoint's source as well as its tag (`validation-llama-7b-
3f2a1b9c-global-step3`), so two training runs never share an artifact's history. Creating an artifact
never fails the work it describes: an error is logged and the work goes on. Outside a flow or task
run (a task's `.fn` called directly) no artifact is made at all. Progress bars are made only for long
steps and are gone once their step ends (`ProgressArtifact`).

Tables stay narrow enough for the page: a record is shown as `field | value` rows, not one wide row.

What an artifact quotes from the input (paths, file names, tags, messages that quote a checkpoint) is
plain text: `text` for table cells (control characters escaped, `ckptflow.plumbing.text`), `md` for
markdown prose (markdown's own characters escaped too), `code` for a file name or URI as a code span
that no backtick or `|` in it can end.
"""

from __future__ import annotations

import contextvars
import hashlib
import logging
import re
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import quote
from uuid import UUID

from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from ckptflow.plumbing.sizes import format_size
from ckptflow.plumbing.text import one_line
from ckptflow.publish import HubTarget

logger = logging.getLogger(__name__)


def artifact_key(*parts: object) -> str:
    """A valid artifact key from free text: lowercase, dashes, at most 100 characters."""
    text = "-".join(str(p) for p in parts if p not in (None, ""))
    key = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    return re.sub(r"-{2,}", "-", key)[:100].strip("-") or "ckptflow"


def source_name(root: str) -> str:
    """The readable part of a run folder URI: its last path component ('gs://b/runs/llama-7b' -> 'llama-7b')."""
    parts = [p for p in re.split(r"[/:]+", root.rstrip("/")) if p and p not in (".", "..")]
    return parts[-1] if parts else "checkpoint"


def checkpoint_key(kind: str, root: str, tag: str | None, *extra: object) -> str:
    """`kind-<source name>-<8 hex of the source URI>-<tag>[-extra...]`: one artifact history per checkpoint."""
    digest = hashlib.sha256(root.encode()).hexdigest()[:8]
    return artifact_key(kind, source_name(root)[:40], digest, tag or "latest", *extra)


def web_url(uri: str, *, revision: str | None = None, endpoint: str | None = None) -> str | None:
    """A link a browser opens for a destination: the Hub repo (at its revision) or the bucket's console
    page; None for a local folder."""
    if uri.startswith("hf://"):
        target = HubTarget.parse(uri)
        base = (endpoint or "https://huggingface.co").rstrip("/")
        kind = "" if target.repo_type == "model" else f"{target.repo_type}s/"
        return f"{base}/{kind}{target.repo_id}/tree/{revision or target.revision or 'main'}"
    if uri.startswith(("gs://", "gcs://")):
        return "https://console.cloud.google.com/storage/browser/" + uri.split("://", 1)[1].strip("/")
    if uri.startswith(("s3://", "s3a://")):
        bucket, _, prefix = uri.split("://", 1)[1].partition("/")
        return f"https://s3.console.aws.amazon.com/s3/buckets/{bucket}?prefix={prefix.strip('/')}/"
    return None


def text(value: object) -> str:
    """A value as plain one-line text for a table cell."""
    return one_line(str(value))


_MARKDOWN = re.compile(r"([\\`*_\[\]<>|~])")  # what formats inline text (the values are never at a line's start)


def md(value: object) -> str:
    """A value as plain text inside markdown: one line, control characters and markdown's own
    characters escaped, so input can neither format nor break the artifact."""
    return _MARKDOWN.sub(r"\\\1", one_line(str(value)))


def code(value: object) -> str:
    """A value as a markdown code span: fenced by more backticks than any run inside it, `|` escaped
    (a table cell would split there), control characters escaped."""
    body = one_line(str(value)).replace("|", "\\|")
    fence = "`" * (1 + max((len(run) for run in re.findall(r"`+", body)), default=0))
    pad = " " if body.startswith("`") or body.endswith("`") else ""
    return f"{fence}{pad}{body}{pad}{fence}"


def link(uri: str, url: str | None) -> str:
    """Markdown for `uri`: a link when there is a web page for it, else the URI as code."""
    return f"[{code(uri)}]({quote(url, safe=':/?=&%#@+~,;')})" if url else code(uri)


def cell_size(nbytes: int) -> str:
    """`format_size` for a table cell: a no-break space, so '58.5 KB' never wraps between number and unit."""
    return format_size(nbytes).replace(" ", "\u00a0")


def field_rows(record: Mapping[str, Any]) -> list[dict[str, str]]:
    """A record as two-column rows (`field`, `value`), for a table no wider than the page."""
    return [{"field": text(k), "value": "" if v is None else text(v)} for k, v in record.items()]


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
    except Exception:  # whatever Prefect's client raises: an artifact is for people and never fails the step
        logger.warning("could not create table artifact %s", key, exc_info=True)


def markdown(text: str, *, key: str | None, description: str) -> None:
    """A markdown artifact."""
    if not in_run():
        return
    try:
        create_markdown_artifact(markdown=text, key=key, description=description)
    except Exception:  # whatever Prefect's client raises: an artifact is for people and never fails the step
        logger.warning("could not create markdown artifact %s", key, exc_info=True)


PROGRESS_BYTES = 1 << 30  # a step that moves less than this is over before a progress bar says much


class ProgressArtifact:
    """A progress bar for one long step, fed by the core's `progress(done_bytes, total_bytes)` callbacks,
    that lives only while the step runs.

    One rule for every step: a bar is made only for work of at least `PROGRESS_BYTES` (`nbytes`; None
    always makes one), and only inside a flow or task run. Use it as a context manager: when the step
    ends, whether it succeeded or failed, the bar is deleted, so no bar is left at 100% (or stuck at
    43%) beside the step's own result artifact and state. It has no key by default: a bar is not a
    history worth keeping (`key` puts it into one; deleting it then makes the key's previous version
    the latest again).

    Callbacks may come from worker threads and may be frequent: updates are serialized, sent at most
    every `interval` seconds (and always at 100%), and run in the context of the task that made the
    artifact, so they reach the same Prefect API. Nothing here ever fails the step: errors are logged.
    """

    def __init__(self, *, description: str, nbytes: int | None = None, key: str | None = None,
                 interval: float = 1.0) -> None:
        self._lock = threading.Lock()
        self._interval = interval
        self._last_sent = 0.0
        self._last_percent = -1.0
        self._context = contextvars.copy_context()
        self.id: UUID | None = None
        if not in_run() or (nbytes is not None and nbytes < PROGRESS_BYTES):
            return
        try:
            self.id = create_progress_artifact(progress=0.0, key=key, description=description)
        except Exception:  # whatever Prefect's client raises: the bar is for people and never fails the step
            logger.warning("could not create progress artifact %s", key or description, exc_info=True)

    def __call__(self, done: int, total: int) -> None:
        if self.id is None:
            return
        percent = 100.0 if total <= 0 else min(100.0, 100.0 * done / total)
        now = time.monotonic()
        with self._lock:
            if self.id is None or percent <= self._last_percent:
                return
            if percent < 100.0 and now - self._last_sent < self._interval:
                return
            self._last_sent, self._last_percent = now, percent
            try:
                self._context.run(update_progress_artifact, artifact_id=self.id, progress=round(percent, 1))
            except Exception:  # whatever Prefect's client raises: a missed update is made good by the next
                logger.debug("progress artifact update failed", exc_info=True)

    def close(self) -> None:
        """Delete the bar (the step is over); later callbacks do nothing. Safe to call twice."""
        with self._lock:
            artifact_id, self.id = self.id, None
            if artifact_id is None:
                return
            try:
                self._context.run(_delete_artifact, artifact_id)
            except Exception:  # whatever Prefect's client raises: the step's outcome stands
                logger.warning("could not delete progress artifact %s", artifact_id, exc_info=True)

    def __enter__(self) -> ProgressArtifact:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _delete_artifact(artifact_id: UUID) -> None:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        client.delete_artifact(artifact_id)
