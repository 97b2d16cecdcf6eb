"""Which tag of a checkpoint folder to read: the `latest` pointer, read bounded and checked, or a tag named.
"""

from __future__ import annotations

import os
import posixpath
from typing import Any

from ckptflow.errors import CheckpointError, CheckpointNotFoundError, UnsafeInputError, option
from ckptflow.formats.deepspeed.names import LATEST, MODEL_FILE_RE, SAFE_TAG
from ckptflow.plumbing.files import open_regular
from ckptflow.plumbing.storage import join, open_fs, unstrip
from ckptflow.plumbing.stores.local import os_path
from ckptflow.plumbing.text import excerpt

MAX_LATEST_BYTES = 4096  # a tag is a folder name: DeepSpeed writes a few dozen bytes


def latest_hint() -> str:
    """What to do about a `latest` that cannot be followed."""
    return f"refusing to follow it; fix `latest` or pass {option('tag')}"


def check_tag(tag: str, where: str) -> str | None:
    """The problem with `tag` as a folder name, or None when it is safe."""
    if not tag:
        return f"{where} is empty"
    if "/" in tag or "\\" in tag or ".." in tag or "\x00" in tag:
        return f"{where} names {excerpt(tag)}, which is not a plain folder name (path separators or '..')"
    if not SAFE_TAG.match(tag):
        return f"{where} names {excerpt(tag)}, which has characters DeepSpeed never writes in a tag"
    return None


def read_latest(fs: Any, path: str, where: str) -> str:
    """The tag the `latest` file at `path` names, reading at most `MAX_LATEST_BYTES`; `CheckpointError`
    (code `latest-unsafe`) when it is not a regular file, too long, not text, or not a plain folder
    name. A local FIFO, device or folder is never opened for reading (`plumbing.files`)."""
    hint = latest_hint()
    uri = unstrip(fs, path)
    try:
        if os_path(uri) is not None:
            with open_regular(uri, hint=hint) as fh:
                raw = fh.read(MAX_LATEST_BYTES + 1)
        else:
            raw = fs.cat_file(path, start=0, end=MAX_LATEST_BYTES + 1)
    except UnsafeInputError as exc:
        raise CheckpointError(str(exc).replace(uri, where, 1), code="latest-unsafe", file=where) from None
    if len(raw) > MAX_LATEST_BYTES:
        raise CheckpointError(f"{where} holds more than {MAX_LATEST_BYTES} bytes, so it is not a DeepSpeed `latest` "
                              "pointer", code="latest-unsafe", file=where, hint=hint)
    try:
        text = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise CheckpointError(f"{where} is not UTF-8 text but {excerpt(raw)}, so it is not a DeepSpeed `latest` "
                              "pointer", code="latest-unsafe", file=where, hint=hint) from None
    bad = check_tag(text, where)
    if bad:
        raise CheckpointError(bad, code="latest-unsafe", file=where, hint=hint)
    return text


def resolve_tag(uri: str, tag: str | None = None) -> tuple[str, str]:
    """(root, tag) for a folder holding `latest` or for a tag folder itself."""
    fs, path = open_fs(uri)
    if tag is not None:
        bad = check_tag(tag, "--tag")
        if bad:
            raise CheckpointError(bad, code="tag-unsafe", uri=uri, hint="pass the name of a folder beside `latest`")
        return uri.rstrip("/"), tag
    latest = posixpath.join(path, LATEST)
    local_latest = os_path(join(uri, LATEST))
    if fs.isfile(latest) or (local_latest is not None and os.path.lexists(local_latest)):
        return uri.rstrip("/"), read_latest(fs, latest, join(uri, LATEST))  # a FIFO or folder is refused there
    if not fs.exists(path):
        raise CheckpointNotFoundError(f"{uri} does not exist", code="source-missing", uri=uri,
                                      hint="check the path or URL")
    names = [posixpath.basename(p) for p in fs.ls(path, detail=False)]
    if any(MODEL_FILE_RE.match(n) for n in names):
        parent = uri.rstrip("/").rsplit("/", 1)
        return parent[0] if len(parent) == 2 else ".", parent[-1]
    raise CheckpointNotFoundError(
        f"no `latest` file in {uri}", code="latest-missing", uri=uri, file=join(uri, LATEST),
        hint=f"point at the folder DeepSpeed saved into (it holds `latest`), at a tag folder, or pass {option('tag')}",
    )
