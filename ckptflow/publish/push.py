"""`push(src, dest)`: the publish step's one entry point.

`hf://` destinations go to the Hugging Face Hub (`publish.hub`), everything else through fsspec
(`publish.store`: `gs://`, `s3://`, `file://`, local paths, `memory://` ...).
"""

from __future__ import annotations

from ckptflow.plumbing.progress import Progress
from ckptflow.plumbing.retry import RetryPolicy
from ckptflow.publish.hub import push_to_hub
from ckptflow.publish.source import PushResult
from ckptflow.publish.store import push_to_store


def push(
    src: str,
    dest: str,
    *,
    revision: str | None = None,
    private: bool = False,
    workers: int = 8,
    token: str | None = None,
    endpoint: str | None = None,
    progress: Progress | None = None,
    retry: RetryPolicy | None = None,
    break_lease: bool = False,
) -> PushResult:
    """Publish the folder `src` (local path or fsspec URL) to `dest`.

    `dest` is `hf://[datasets/|spaces/]ORG/REPO` for the Hugging Face Hub (`revision`, `private`,
    `token` and `endpoint` apply there only; see `push_to_hub`), or any fsspec URL or local path (see
    `push_to_store`; `break_lease` removes the lease a dead push left at DEST). `workers` bounds
    parallel uploads. `progress(done, total)` counts bytes of files
    published, from worker threads. Raises `PublishError` when the push fails for good, with a
    one-line message naming the file, DEST and what to do; credentials never appear in it.
    """
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    if dest.startswith("hf://"):
        if break_lease:
            raise ValueError("break_lease applies to bucket and folder destinations; the Hub orders commits itself")
        return push_to_hub(
            src, dest, revision=revision, private=private, workers=workers, token=token, endpoint=endpoint,
            progress=progress, retry=retry,
        )
    given = [name for name, value in (("revision", revision), ("token", token), ("endpoint", endpoint)) if value]
    given += ["private"] if private else []
    if given:
        raise ValueError(
            f"{', '.join(given)} only apply to hf:// destinations; storage credentials and endpoints come "
            "from fsspec's configuration (FSSPEC_* variables, config files)"
        )
    return push_to_store(src, dest, workers=workers, progress=progress, retry=retry, break_lease=break_lease)
