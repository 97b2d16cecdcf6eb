"""`push(src, dest)`: the publish step's one entry point.

`hf://` destinations go to the Hugging Face Hub (`publish.hub`), everything else through fsspec
(`publish.store`: `gs://`, `s3://`, `file://`, local paths, `memory://` ...).
"""

from __future__ import annotations

from dataclasses import dataclass

from ckptflow.plumbing.progress import Progress
from ckptflow.plumbing.retry import RetryPolicy
from ckptflow.publish.hub import push_to_hub
from ckptflow.publish.source import PushResult
from ckptflow.publish.store import push_to_store


@dataclass(frozen=True, kw_only=True)
class PushOptions:
    """How to push.

    `workers` files are uploaded at once. On the Hub only: `revision` is the branch to commit to
    (default main), `private` makes a missing repo private, `endpoint` is the Hub's URL (default
    `HF_ENDPOINT`, else huggingface.co). On a bucket or folder only: `break_lease` removes the lease a
    push that died left at DEST.
    """

    revision: str | None = None
    private: bool = False
    workers: int = 8
    endpoint: str | None = None
    break_lease: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 1:
            raise ValueError(f"workers must be at least 1, got {self.workers}")


def push(
    src: str,
    dest: str,
    *,
    options: PushOptions | None = None,
    revision: str | None = None,
    private: bool = False,
    workers: int | None = None,
    token: str | None = None,
    endpoint: str | None = None,
    progress: Progress | None = None,
    retry: RetryPolicy | None = None,
    break_lease: bool = False,
) -> PushResult:
    """Publish the folder `src` (local path or fsspec URL) to `dest` as `options` say; the options may
    come as keywords instead (`revision`, `private`, `workers`, `endpoint`, `break_lease`:
    `PushOptions`' fields), not both.

    `dest` is `hf://[datasets/|spaces/]ORG/REPO[@REVISION]` for the Hugging Face Hub (`revision`,
    `private`, `token` and `endpoint` apply there only; see `push_to_hub`), or any fsspec URL or local
    path (see `push_to_store`; `break_lease` removes the lease a dead push left at DEST). `workers`
    bounds parallel uploads. `progress(done, total)` counts bytes of files published, from worker
    threads. Raises `PublishError` when the push fails for good, with a one-line message naming the
    file, DEST and what to do; credentials never appear in it.
    """
    keywords = revision is not None or private or workers is not None or endpoint is not None or break_lease
    if options is not None and keywords:
        raise TypeError("give push() its options as `options` or as keywords, not both")
    if options is None:
        options = PushOptions(revision=revision, private=private, workers=8 if workers is None else workers,
                              endpoint=endpoint, break_lease=break_lease)
    if dest.startswith("hf://"):
        if options.break_lease:
            raise ValueError("break_lease applies to bucket and folder destinations; the Hub orders commits itself")
        return push_to_hub(
            src, dest, revision=options.revision, private=options.private, workers=options.workers, token=token,
            endpoint=options.endpoint, progress=progress, retry=retry,
        )
    given = [name for name, value in (("revision", options.revision), ("token", token), ("endpoint", options.endpoint))
             if value]
    given += ["private"] if options.private else []
    if given:
        raise ValueError(
            f"{', '.join(given)} only apply to hf:// destinations; storage credentials and endpoints come "
            "from fsspec's configuration (FSSPEC_* variables, config files)"
        )
    return push_to_store(src, dest, workers=options.workers, progress=progress, retry=retry,
                         break_lease=options.break_lease)
