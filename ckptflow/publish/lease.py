"""One push at a time per DEST: a lease file taken with a conditional create.

`hold_lease(fs, dest_root, dest)` creates `ckptflow-push.lease` at DEST only if it does not exist yet,
with the store's own conditional create, so two pushes that start together cannot both take it:

- a local folder: `open(..., O_CREAT | O_EXCL)`;
- S3: `PutObject` with `If-None-Match: *` (s3fs `mode="create"`; 412 when the object exists);
- GCS: an upload with `ifGenerationMatch=0` (gcsfs `mode="create"`; 412 when the object exists).

The lease names its holder (user, host, process, start time, a random id). A second push finds it
and fails at once, naming the first; a lease left by a push that died (killed, machine lost) is
broken on purpose with `break_lease=True` (`ckptflow push --break-lease`). The lease is removed when
the push ends, whether it succeeded or failed, and only if it is still the one this push took.

What a store that ignores the precondition does (the GCS emulator used in tests overwrites the
object on `ifGenerationMatch=0`) cannot be prevented from here: there two pushes can both take the
lease. Real GCS and S3 (and moto) refuse the second create.
"""

from __future__ import annotations

import datetime
import getpass
import json
import logging
import os
import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import fsspec

from ckptflow.errors import PublishError, option
from ckptflow.plumbing.files import load_json, read_regular
from ckptflow.plumbing.redaction import describe
from ckptflow.plumbing.retry import RetryPolicy, retry_call
from ckptflow.plumbing.storage import join, unstrip
from ckptflow.plumbing.stores import store_for
from ckptflow.plumbing.stores.local import local_path
from ckptflow.plumbing.text import excerpt
from ckptflow.publish.manifest import LEASE_NAME
from ckptflow.publish.source import failure_advice, failure_reason

logger = logging.getLogger(__name__)

MAX_LEASE_BYTES = 64 << 10


def _holder() -> dict[str, Any]:
    try:
        user = getpass.getuser()
    except (OSError, KeyError, ImportError):  # no user name in some containers (before 3.13: pwd's own errors)
        user = "unknown"
    return {"format": "ckptflow-lease", "id": uuid.uuid4().hex, "user": user, "host": socket.gethostname(),
            "pid": os.getpid(), "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def _create(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    """Create `path` holding `data` only if nothing is there: `FileExistsError` otherwise."""
    if store_for(fs).local:
        fd = os.open(local_path(unstrip(fs, path)), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        return
    fs.pipe_file(path, data, mode="create")


def _read(fs: fsspec.AbstractFileSystem, path: str) -> dict[str, Any]:
    """The lease at `path` as written ({} when it is gone or cannot be read)."""
    try:
        if store_for(fs).local:
            raw = read_regular(unstrip(fs, path), limit=MAX_LEASE_BYTES, what="lease")
        else:
            raw = fs.cat_file(path, start=0, end=MAX_LEASE_BYTES)
        doc = load_json(raw)
    except FileNotFoundError:
        return {}
    except Exception as exc:  # a lease we cannot read is still a lease: it is described as unreadable
        return {"unreadable": describe(exc)}
    return doc if isinstance(doc, dict) else {"unreadable": "not a JSON object"}


def describe_holder(doc: dict[str, Any]) -> str:
    """Who holds a lease and since when, from what it says (quoted as input: it is a file at DEST)."""
    if "unreadable" in doc:
        return f"a holder it does not name ({doc['unreadable']})"
    who = f"{doc.get('user')}@{doc.get('host')} (process {doc.get('pid')})"
    return f"{excerpt(who, 120)} since {excerpt(str(doc.get('started')), 40)}"


@contextmanager
def hold_lease(fs: fsspec.AbstractFileSystem, root: str, dest: str, *, break_lease: bool = False,
               policy: RetryPolicy | None = None) -> Iterator[None]:
    """Hold DEST's lease while the body runs (see the module docstring); `PublishError` (code
    `push-in-progress`) at once when another push holds it. With `break_lease`, a lease already there
    is removed first (a push that died left it). Transient store failures are retried by `policy`; a
    create retried after its answer was lost finds the lease it made (same id) and holds it."""
    policy = policy or RetryPolicy()
    path = f"{root.rstrip('/')}/{LEASE_NAME}"
    shown = join(dest, LEASE_NAME)
    mine = _holder()
    data = (json.dumps(mine, indent=1) + "\n").encode()
    if break_lease:
        held = _read(fs, path)
        if held:
            logger.warning("breaking the lease of %s at %s", describe_holder(held), shown)
            try:
                fs.rm_file(path)
            except FileNotFoundError:
                pass
    try:
        if store_for(fs).local:
            fs.makedirs(root, exist_ok=True)
        retry_call(lambda: _create(fs, path, data), policy)
    except FileExistsError:
        held = _read(fs, path)
        if held.get("id") != mine["id"]:  # not our own create, retried after its answer was lost
            raise PublishError(
                f"another push to {dest} is in progress: {shown} is held by {describe_holder(held)}",
                code="push-in-progress",
                uri=dest, file=LEASE_NAME,
                hint=f"wait for it to finish; if that push died, run again with {option('break_lease')}",
            ) from None
    except PublishError:
        raise
    except Exception as exc:  # each store raises its own errors: one line naming DEST and what to do
        raise PublishError(f"could not take the lease {shown}: {failure_reason(exc, policy)}", uri=dest,
                           file=LEASE_NAME, hint=failure_advice(exc, of_source=False)) from None
    try:
        yield
    finally:
        _release(fs, path, shown, mine["id"])


def _release(fs: fsspec.AbstractFileSystem, path: str, shown: str, lease_id: str) -> None:
    """Remove the lease if it is still ours (never one another push took after ours was broken)."""
    try:
        if _read(fs, path).get("id") == lease_id:
            fs.rm_file(path)
    except FileNotFoundError:
        pass
    except Exception as exc:  # the push's own outcome is what counts; a stale lease can be broken
        logger.warning("could not remove the lease %s (%s); remove it or push with %s", shown, describe(exc),
                       option("break_lease"))


__all__ = ["LEASE_NAME", "describe_holder", "hold_lease"]
