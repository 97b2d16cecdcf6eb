"""The publish task: `ckptflow.publish.push` of one output to one destination.

Cached on the checkpoint's identity, what is pushed and where: a flow run again for the same
checkpoint never pushes again (and `push` itself uploads nothing a destination already holds).
Transient errors that escape `push`'s own per-file retries (listing, manifest I/O) are retried by
Prefect; a permanent error (403, a missing repo with no right to create it) fails at once.

Each push leaves one markdown artifact: where it went (a link to the Hub commit or the bucket's
console page) and a table of every file with its size and sha256 (from the bucket's manifest, or the
Hub's LFS records). A progress bar is shown only while a push big enough to watch runs
(`tasks.artifacts.PROGRESS_BYTES`, the rule every step follows).
The lifecycle flow tags Hub pushes `hub-upload` and bucket pushes `bucket-upload`, for task
concurrency limits (`prefect concurrency-limit create hub-upload 2`).
"""

from __future__ import annotations

import hashlib
from typing import Any

from prefect import get_run_logger, task

from ckptflow.plumbing.redaction import describe
from ckptflow.plumbing.sizes import format_size
from ckptflow.plumbing.storage import open_fs
from ckptflow.publish import HubTarget, Manifest, PushOptions, push
from tasks.artifacts import ProgressArtifact, cell_size, checkpoint_key, code, link, markdown, web_url
from tasks.caching import checkpoint_cache_key
from tasks.models import Checkpoint, Output, Published
from tasks.naming import in_form_words
from tasks.retries import io_retries


def _resolve_token(secret_block: str | None) -> str | None:
    if not secret_block:
        return None
    from prefect.blocks.system import Secret

    return Secret.load(secret_block).get()


def _run_name() -> str:
    """'publish model to hf://org/name', 'publish zero-ws4 to gs://bucket': never a whole path."""
    from prefect.runtime import task_run

    parameters = task_run.parameters
    output, destination = parameters.get("output"), str(parameters.get("destination", ""))
    world = getattr(output, "world_size", None) if not isinstance(output, dict) else output.get("world_size")
    what = f"zero-ws{world}" if world else "model"
    if destination.startswith("hf://"):
        where = destination
    elif "://" in destination:
        scheme, rest = destination.split("://", 1)
        where = f"{scheme}://{rest.split('/', 1)[0]}"
    else:
        where = "a local folder"
    return f"publish {what} to {where}"


@task(
    name="publish",
    task_run_name=_run_name,
    cache_key_fn=checkpoint_cache_key,
    persist_result=True,
    **io_retries(),
)
@in_form_words
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
    if hub:  # the revision may come in the URL (hf://org/name@v1) as the core reads it
        revision = revision or HubTarget.parse(destination).revision
    n = output.world_size
    what = output.kind if n is None else f"{output.kind} ({n} rank{'' if n == 1 else 's'})"
    options = PushOptions(revision=revision, private=private, workers=workers, endpoint=endpoint) if hub \
        else PushOptions(workers=workers)
    token = _resolve_token(token_secret) if hub else None
    with ProgressArtifact(nbytes=output.bytes or 0,
                          description=f"Publishing the {what} of {checkpoint.tag} to {destination}") as sink:
        result = push(output.uri, destination, options=options, token=token, progress=sink)
    logger.info(
        "published %s to %s: %d file(s) uploaded (%s), %d already there",
        output.uri, destination, len(result.uploaded), format_size(result.bytes_uploaded or 0), len(result.skipped),
    )
    url = result.commit_url if hub and result.commit_url else web_url(destination, revision=revision, endpoint=endpoint)
    files = _published_files(destination, result, revision=revision, endpoint=endpoint, token=token)
    _file_table(checkpoint, output, what, destination, revision, url, result, files)
    return Published(
        source=output.uri,
        destination=destination,
        kind=output.kind,
        files=len(result.uploaded) + len(result.skipped),
        bytes=result.bytes_uploaded,
        revision=revision if hub else None,
        url=url,
        details={"uploaded": len(result.uploaded), "skipped": len(result.skipped),
                 "manifest": result.manifest_uri, "commit": result.commit_url,
                 "total_bytes": sum(f["size"] for f in files) if files else None},
    )


def _published_files(
    destination: str, result: Any, *, revision: str | None, endpoint: str | None, token: str | None
) -> list[dict[str, Any]]:
    """Every file at the destination with its size and sha256: the bucket's manifest, or the Hub's tree
    (sha256 for LFS files; small files are stored in git and show their git blob id). [] when unreadable."""
    try:
        if result.manifest_uri:
            fs, path = open_fs(result.manifest_uri)
            manifest = Manifest.from_json(fs.cat_file(path), uri=result.manifest_uri)
            return [{"file": f.path, "size": f.size, "sha256": f.sha256} for f in manifest.files]
        if destination.startswith("hf://"):
            from huggingface_hub import HfApi

            target = HubTarget.parse(destination)
            api = HfApi(endpoint=endpoint, token=token)
            rows = []
            for item in api.list_repo_tree(target.repo_id, repo_type=target.repo_type,
                                           revision=revision or target.revision, recursive=True):
                size = getattr(item, "size", None)
                if size is None:  # a folder
                    continue
                lfs = getattr(item, "lfs", None)
                digest = lfs.sha256 if lfs is not None else f"git {item.blob_id}"
                rows.append({"file": item.path, "size": int(size), "sha256": digest})
            return sorted(rows, key=lambda r: r["file"])
    except Exception as exc:  # an artifact never fails a push that succeeded
        get_run_logger().warning("could not list the published files of %s: %s", destination, describe(exc))
    return []


def _file_table(
    checkpoint: Checkpoint,
    output: Output,
    what: str,
    destination: str,
    revision: str | None,
    url: str | None,
    result: Any,
    files: list[dict[str, Any]],
) -> None:
    where = destination + (f" @ {revision}" if revision and not destination.endswith(f"@{revision}") else "")
    total = sum(f["size"] for f in files)
    lines = [
        f"## {what.capitalize()} of {checkpoint.tag} published",
        "",
        f"To {link(where, url)}: "
        + (f"{len(files)} file(s), {format_size(total or 0)} in all; " if files else "")
        + f"{len(result.uploaded)} uploaded ({format_size(result.bytes_uploaded or 0)}), "
        + f"{len(result.skipped)} already there.",
        "",
    ]
    if result.manifest_uri:
        lines += [f"Readers trust {code(result.manifest_uri)} (written last).", ""]
    if files:
        lines += ["| file | size | sha256 |", "|---|---:|---|"]
        lines += [f"| {code(f['file'])} | {cell_size(f['size'] or 0)} | {code(f['sha256'])} |" for f in files]
    digest = hashlib.sha256(where.encode()).hexdigest()[:6]
    markdown(
        "\n".join(lines),
        key=checkpoint_key("published", checkpoint.root, checkpoint.tag, output.kind,
                           f"ws{output.world_size}" if output.world_size else None, digest),
        description=f"{what.capitalize()} of {checkpoint.tag} published to {where}",
    )

