"""The publish task: `ckptflow.publish.push` of one output to one destination.

Cached on the checkpoint's identity, what is pushed and where: a flow run again for the same
checkpoint never pushes again (and `push` itself uploads nothing a destination already holds).
Transient errors that escape `push`'s own per-file retries (listing, manifest I/O) are retried by
Prefect; a permanent error (403, a missing repo with no right to create it) fails at once.
"""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task

from ckptflow.plumbing.sizes import format_size
from ckptflow.publish import push
from tasks.artifacts import ProgressArtifact, artifact_key
from tasks.caching import checkpoint_cache_key
from tasks.models import Checkpoint, Output, Published
from tasks.retries import io_retries


def _resolve_token(secret_block: str | None) -> str | None:
    if not secret_block:
        return None
    from prefect.blocks.system import Secret

    return Secret.load(secret_block).get()


@task(
    name="publish",
    task_run_name="publish {output.kind} to {destination}",
    cache_key_fn=checkpoint_cache_key,
    persist_result=True,
    **io_retries(),
)
def publish_output(
    checkpoint: Checkpoint,
    output: Output,
    destination: str,
    *,
    revision: str | None = None,
    private: bool = False,
    workers: int = 8,
    endpoint: str | None = None,
    token_secret: str | None = None,
) -> Published:
    """Push the folder `output.uri` to `destination` (an `hf://` repo or any fsspec URL)."""
    logger = get_run_logger()
    hub = destination.startswith("hf://")
    sink = ProgressArtifact(
        key=artifact_key("publish", output.kind, output.world_size, checkpoint.tag),
        description=f"Publishing {output.kind} of {checkpoint.tag} to {destination}",
    )
    kwargs: dict[str, Any] = {"workers": workers, "progress": sink}
    if hub:
        kwargs.update(revision=revision, private=private, endpoint=endpoint, token=_resolve_token(token_secret))
    result = push(output.uri, destination, **kwargs)
    sink.finish()
    logger.info(
        "published %s to %s: %d file(s) uploaded (%s), %d already there",
        output.uri, destination, len(result.uploaded), format_size(result.bytes_uploaded), len(result.skipped),
    )
    return Published(
        source=output.uri,
        destination=destination,
        kind=output.kind,
        files=len(result.uploaded) + len(result.skipped),
        bytes=result.bytes_uploaded,
        revision=revision if hub else None,
        url=result.commit_url or result.manifest_uri,
        details={"uploaded": len(result.uploaded), "skipped": len(result.skipped)},
    )
