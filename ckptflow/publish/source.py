"""What a push takes and gives: the source folder's files, the result, and how failures read.

`list_source(src)` lists SRC once (relative path and size of every file) and refuses what a push must
not publish: anything but a regular file (a FIFO would hang the push, `/dev/zero` never ends), a link
out of SRC (it would publish a file from elsewhere). `open_source` opens a listed file the same safe
way. `PushResult` is what a push did, wherever
it went. `failure_reason` / `failure_advice` turn a store error into the redacted phrase
and the advice that every publish error carries.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import fsspec

from ckptflow.errors import CheckpointError, CheckpointNotFoundError, CkptflowError, PublishError, UploadMismatchError
from ckptflow.plumbing.failures import causes, status_code
from ckptflow.plumbing.files import check_regular, open_regular
from ckptflow.plumbing.redaction import describe, redact
from ckptflow.plumbing.retry import RetryPolicy, is_transient, retry_call
from ckptflow.plumbing.storage import open_fs, unstrip
from ckptflow.publish.manifest import LEASE_NAME, MANIFEST_NAME, PARTIAL_RECORD_NAME

logger = logging.getLogger(__name__)

READ_CHUNK = 8 * 2**20


@dataclass(frozen=True, kw_only=True)
class PushResult:
    """What a push did. `uploaded` and `skipped` are paths relative to SRC; `bytes_uploaded` counts
    the files uploaded. Store pushes set `manifest_uri`, Hub pushes `commit_url`."""

    dest: str
    uploaded: tuple[str, ...]
    skipped: tuple[str, ...]
    bytes_uploaded: int
    manifest_uri: str | None = None
    commit_url: str | None = None


@dataclass(frozen=True, kw_only=True)
class SourceFile:
    """A file to publish: its path relative to SRC ('/'-separated) and its size."""

    path: str
    size: int


def list_source(src: str, *, retry: RetryPolicy | None = None
                ) -> tuple[fsspec.AbstractFileSystem, str, tuple[SourceFile, ...]]:
    """The filesystem of `src`, its root, and every file under it, sorted by path.

    A manifest or partial record at the top of `src` is left out: a push writes its own."""
    policy = retry or RetryPolicy()
    fs, root = open_fs(src)
    shown = redact(src)

    def listing() -> dict[str, dict[str, Any]] | None:
        if not fs.exists(root):
            return None
        if not fs.isdir(root):
            raise CheckpointError(f"SRC {shown} is a file, not a folder", uri=shown,
                                  hint="push the folder that holds it")
        found: dict[str, dict[str, Any]] = fs.find(root, withdirs=False, detail=True)
        return found

    try:
        found = retry_call(listing, policy)
    except CkptflowError:
        raise
    except Exception as exc:  # each fsspec backend raises its own errors: one line naming SRC and what to do
        raise PublishError(
            f"could not list SRC {shown}: {failure_reason(exc, policy)}", uri=shown,
            hint=failure_advice(exc, of_source=True),
        ) from None
    if found is None:
        raise CheckpointNotFoundError(f"SRC {shown} does not exist", uri=shown, hint="check the path or URL")
    prefix = root.rstrip("/") + "/"
    files = []
    for path, info in sorted(found.items()):
        rel = path[len(prefix):] if path.startswith(prefix) else path.rsplit("/", 1)[-1]
        if rel in (MANIFEST_NAME, PARTIAL_RECORD_NAME, LEASE_NAME):
            logger.info("leaving out %s from SRC: the push writes its own", rel)
            continue
        size = int(info["size"])
        if info.get("type", "file") != "file" or info.get("islink"):  # local FIFOs, devices, links: look closer
            size = check_regular(unstrip(fs, path), inside=src, hint=_SPECIAL_HINT)
        files.append(SourceFile(path=rel, size=size))
    if not files:
        raise CheckpointNotFoundError(f"SRC {shown} holds no files", uri=shown, hint="nothing to push")
    return fs, root, tuple(files)


_SPECIAL_HINT = "a push publishes regular files only: remove it from SRC, or replace it with the file it stands for"


def open_source(fs: fsspec.AbstractFileSystem, root: str, rel: str, *, local: bool) -> Any:
    """A file of SRC open for reading: a local one only while it is still a regular file inside SRC."""
    if local:
        uri = unstrip(fs, f"{root.rstrip('/')}/{rel}")
        return open_regular(uri, inside=unstrip(fs, root), hint=_SPECIAL_HINT)
    return fs.open(f"{root.rstrip('/')}/{rel}", "rb")


def failure_reason(exc: Exception, policy: RetryPolicy) -> str:
    """What went wrong, in one redacted phrase: the error, its HTTP status, and whether retries ran out."""
    code = next((status_code(e) for e in causes(exc) if status_code(e) is not None), None)
    what = describe(exc)
    if is_transient(exc):
        return f"still failing after {policy.attempts} tries ({what})"
    return f"{what} (HTTP {code})" if code is not None and str(code) not in what else what


def failure_advice(exc: Exception, of_source: bool) -> str:
    """What to do about a failed store operation, from its status codes and kind."""
    codes = {status_code(e) for e in causes(exc)}
    text = " ".join(str(e) for e in causes(exc))
    if isinstance(exc, PermissionError) or codes & {401, 403} or "Forbidden" in text or "AccessDenied" in text:
        return "check the credentials fsspec uses for this URL and that they allow reading and writing there"
    if isinstance(exc, FileNotFoundError) or 404 in codes or "NoSuchBucket" in text:
        return "check that the bucket exists and the URL is right" if not of_source else "check SRC"
    if isinstance(exc, UploadMismatchError) or is_transient(exc):
        return "run the same push again to resume; verified files are kept"
    return "fix the cause and run the same push again; verified files are kept"
