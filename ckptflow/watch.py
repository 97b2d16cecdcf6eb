"""Which checkpoints are there: every `latest` under a set of roots, with the version of each.

`find_latest(roots)` lists each root once through fsspec (any URL: `gs://`, `s3://`, `memory://`, a
local path), reads every `latest` pointer it finds and returns one `Sighting` per run folder: the tag
that `latest` names and the storage version of the `latest` object (GCS generation, S3 version id or
ETag, local mtime and size). A run folder whose `latest` cannot be read or names an unsafe tag becomes
an `Unreadable` entry instead; one bad folder never hides the others.

`select_new(scan, seen)` is the pure comparison with what a watcher saw before: it returns the
sightings whose tag was never seen for their folder, and the updated record. A `latest` whose version
did not change is not read again.

`content_identity(root, tag)` names the bytes of one checkpoint by the listing of its tag folder
(names, sizes, versions), so that work done on a checkpoint can be cached on it and done again when
the files change.

Nothing here imports Prefect: the watcher flow in `flows/watch.py` keeps the record and emits events.
"""

from __future__ import annotations

import fnmatch
import hashlib
import logging
import posixpath
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptflow.errors import CkptflowError
from ckptflow.formats.deepspeed.names import LATEST
from ckptflow.formats.deepspeed.tag import read_latest
from ckptflow.plumbing.redaction import describe
from ckptflow.plumbing.storage import open_fs, unstrip

logger = logging.getLogger(__name__)

_STEP_RE = re.compile(r"(\d+)$")
# `latest` is a few bytes; anything larger is not a DeepSpeed pointer.


@dataclass(frozen=True, kw_only=True)
class Sighting:
    """One `latest` pointer: the run folder holding it, the tag it names, and its storage version."""

    root: str
    tag: str
    version: str
    watched: str
    step: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"root": self.root, "tag": self.tag, "version": self.version, "watched": self.watched, "step": self.step}


@dataclass(frozen=True, kw_only=True)
class Unreadable:
    """A run folder (or a whole watched root) that could not be read, and why."""

    where: str
    reason: str
    whole_root: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"where": self.where, "reason": self.reason, "whole_root": self.whole_root}


@dataclass(frozen=True)
class Scan:
    """What `find_latest` found under every root."""

    sightings: tuple[Sighting, ...] = ()
    unreadable: tuple[Unreadable, ...] = ()


@dataclass(frozen=True)
class Seen:
    """What a watcher saw of one run folder: the last `latest` version and tag, and every tag so far."""

    version: str
    tag: str
    tags: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "tag": self.tag, "tags": list(self.tags)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Seen:
        tags = tuple(str(t) for t in data.get("tags", ()))
        return cls(str(data.get("version", "")), str(data.get("tag", "")), tags)


def object_version(info: Mapping[str, Any]) -> str:
    """A string that changes whenever the object behind an fsspec `info()` dict is rewritten.

    GCS generation, S3 version id, S3 ETag, then modification time and size (local and memory
    filesystems), in that order of preference.
    """
    for key, prefix in (("generation", "gen"), ("VersionId", "vid"), ("ETag", "etag"), ("etag", "etag")):
        value = info.get(key)
        if value not in (None, "", "null"):
            return f"{prefix}:{str(value).strip(chr(34))}"
    mtime = info.get("mtime", info.get("LastModified", info.get("created", info.get("updated"))))
    if hasattr(mtime, "timestamp"):
        mtime = mtime.timestamp()
    return f"mtime:{mtime}:size:{info.get('size')}"


def step_of(tag: str) -> int | None:
    """The training step a tag like `global_step1200` names, or None."""
    match = _STEP_RE.search(tag)
    return int(match.group(1)) if match else None


def find_latest(
    roots: Iterable[str],
    *,
    known: Mapping[str, Seen] | None = None,
    exclude: Iterable[str] = (),
    max_depth: int | None = None,
) -> Scan:
    """Every `latest` under `roots` (searched recursively, `max_depth` levels at most).

    `known` maps run-folder URIs to what was seen there before: a `latest` whose version is the same
    is not read again. Folders whose URI matches one of the `exclude` glob patterns are skipped. A
    root that cannot be listed, or a `latest` that cannot be read or names an unsafe tag, is reported
    in `Scan.unreadable`; everything else is still returned.
    """
    known = known or {}
    patterns = tuple(exclude)
    sightings: list[Sighting] = []
    unreadable: list[Unreadable] = []
    found_at: set[str] = set()
    for root in roots:
        try:
            fs, base = open_fs(root)
            fs.invalidate_cache(base)
            found = _find_pointers(fs, base, max_depth)
        except FileNotFoundError:
            unreadable.append(Unreadable(where=root, reason=f"{root} does not exist", whole_root=True))
            continue
        except Exception as exc:  # one root's failure must not hide the others
            logger.warning("cannot list %s: %s", root, describe(exc))
            unreadable.append(Unreadable(where=root, reason=f"cannot list {root}: {describe(exc)}", whole_root=True))
            continue
        for path, info in sorted(found.items()):
            folder = _beneath(root, base, posixpath.dirname(path))
            if folder in found_at:  # overlapping roots
                continue
            found_at.add(folder)
            if any(fnmatch.fnmatch(folder, pattern) for pattern in patterns):
                continue
            version = object_version(info)
            before = known.get(folder)
            if before is not None and before.version == version and before.tag:
                tag = before.tag
            else:
                try:
                    tag = _read_tag(fs, path, folder)
                except _BadPointer as exc:
                    unreadable.append(Unreadable(where=folder, reason=str(exc)))
                    continue
            sightings.append(Sighting(root=folder, tag=tag, version=version, watched=root, step=step_of(tag)))
    return Scan(tuple(sightings), tuple(unreadable))


def select_new(scan: Scan, seen: Mapping[str, Seen]) -> tuple[list[Sighting], dict[str, Seen]]:
    """The sightings whose tag was never seen in their folder, and `seen` updated with every sighting.

    A tag seen once in a folder is never new again there, even after `latest` moved on and back.
    """
    updated = dict(seen)
    new: list[Sighting] = []
    for s in scan.sightings:
        before = updated.get(s.root)
        tags = before.tags if before else ()
        if s.tag not in tags:
            new.append(s)
            tags = (*tags, s.tag)
        updated[s.root] = Seen(s.version, s.tag, tags)
    return new, updated


def content_identity(root: str, tag: str) -> str:
    """A short digest of the listing of `root/tag` (relative names, sizes, versions).

    Two calls give the same digest exactly when no file of the checkpoint was added, removed or
    rewritten in between (as far as the store's versions tell).
    """
    fs, base = open_fs(root)
    folder = posixpath.join(base, tag)
    fs.invalidate_cache(folder)
    listing = fs.find(folder, detail=True)
    if not listing:
        raise FileNotFoundError(f"{unstrip(fs, folder)} holds no files")
    digest = hashlib.sha256()
    for path, info in sorted(listing.items()):
        rel = posixpath.relpath(path, folder)
        digest.update(f"{rel}\0{info.get('size')}\0{object_version(info)}\n".encode())
    return digest.hexdigest()[:20]


class _BadPointer(Exception):
    pass


def _find_pointers(fs: Any, base: str, max_depth: int | None) -> dict[str, Mapping[str, Any]]:
    if not fs.exists(base):
        raise FileNotFoundError(base)
    listing = fs.find(base, maxdepth=max_depth, detail=True)
    return {p: info for p, info in listing.items()
            if posixpath.basename(p) == LATEST and info.get("type") != "directory"}


def _beneath(root: str, base: str, path: str) -> str:
    """`path` (inside the filesystem) as a URI spelled the way the user spelled `root`."""
    rel = posixpath.relpath(path, base)
    return root.rstrip("/") if rel == "." else f"{root.rstrip('/')}/{rel}"


def _read_tag(fs: Any, path: str, folder: str) -> str:
    where = f"{folder}/{LATEST}"
    try:
        return read_latest(fs, path, where)
    except CkptflowError as exc:
        raise _BadPointer(str(exc)) from None
    except Exception as exc:  # each fsspec backend raises its own errors: one root's bad pointer, cause kept
        raise _BadPointer(f"cannot read {where}: {describe(exc)}") from exc
