"""The publish manifest: the commit marker readers trust.

A published folder is complete when, and only when, `ckptflow-manifest.json` sits at its top. The
manifest lists every file with its size and sha256 and is written after every file was uploaded and
checked. A reader that finds no manifest must treat the folder as incomplete, whatever else is there.

    {"format": "ckptflow-manifest", "version": 1,
     "files": [{"path": "config.json", "size": 655, "sha256": "...", "stamp": {...}}, ...],
     "total_size": 12345}

`stamp` is advisory: what the store reported for the object when it was verified (size, generation,
ETag, mtime ...), so that a later push can tell the object was not rewritten without reading it.
Readers check `size` and `sha256`; two manifests are the same version when those agree.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from ckptflow.errors import VerificationError
from ckptflow.plumbing.files import load_json
from ckptflow.plumbing.text import excerpt, one_line
from ckptflow.publish.checksums import valid_stamp

MANIFEST_NAME = "ckptflow-manifest.json"
# Files verified so far by a push still running (or interrupted): what lets a re-run skip them.
PARTIAL_RECORD_NAME = MANIFEST_NAME + ".partial"
# Held by the push in progress at a DEST (`publish.lease`).
LEASE_NAME = "ckptflow-push.lease"
# A manifest lists every file of a folder (about 200 bytes each): 64 MB is a third of a million files.
MAX_MANIFEST_BYTES = 64 << 20
FORMAT = "ckptflow-manifest"
VERSION = 1

_SHA256 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True, kw_only=True)
class ManifestEntry:
    """One published file: its path relative to the manifest, size in bytes and sha256 (hex)."""

    path: str
    size: int
    sha256: str
    stamp: Mapping[str, str] | None = field(default=None, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not self.path or self.path.startswith("/") or ".." in self.path.split("/"):
            raise ValueError(f"manifest path must be relative and stay inside the folder: {excerpt(self.path)}")
        if self.size < 0:
            raise ValueError(f"manifest size must be >= 0 for {excerpt(self.path)}: {excerpt(self.size)}")
        if not _SHA256.match(self.sha256):
            raise ValueError(f"manifest sha256 of {excerpt(self.path)} is not 64 lowercase hex digits: "
                             f"{excerpt(self.sha256)}")


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """Every file of a published folder, sorted by path."""

    files: tuple[ManifestEntry, ...]

    def __post_init__(self) -> None:
        paths = [f.path for f in self.files]
        if paths != sorted(set(paths)):
            raise ValueError("manifest files must be sorted by path and appear once each")

    @classmethod
    def of(cls, entries: Iterable[ManifestEntry]) -> Manifest:
        return cls(files=tuple(sorted(entries, key=lambda e: e.path)))

    @property
    def total_size(self) -> int:
        return sum(f.size for f in self.files)

    def by_path(self) -> dict[str, ManifestEntry]:
        return {f.path: f for f in self.files}

    def to_json(self) -> bytes:
        doc = {
            "format": FORMAT,
            "version": VERSION,
            "files": [_entry_json(f) for f in self.files],
            "total_size": self.total_size,
        }
        return (json.dumps(doc, indent=1) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes, *, uri: str) -> Manifest:
        """Parse a manifest read from `uri`; a VerificationError says what is wrong with it. JSON nested
        deeper than `plumbing.files.MAX_JSON_DEPTH` is refused; a `stamp` that is not an object of
        strings is dropped (it is advisory: the file is then checked instead of trusted)."""
        try:
            doc = load_json(data)
            if not isinstance(doc, dict):
                raise ValueError(f"it holds {excerpt(doc)}, not an object")
            if doc.get("format") != FORMAT or doc.get("version") != VERSION:
                raise ValueError(f"format {excerpt(doc.get('format'))} version {excerpt(doc.get('version'))}")
            files = doc.get("files")
            if not isinstance(files, list) or not all(isinstance(f, dict) for f in files):
                raise ValueError(f"its files are {excerpt(files)}, not a list of objects")
            entries = []
            for f in files:
                path, size, sha256 = f.get("path"), f.get("size"), f.get("sha256")
                if not isinstance(path, str) or type(size) is not int or not isinstance(sha256, str):
                    raise ValueError(f"an entry for {excerpt(path)} has the size {excerpt(size)} and the sha256 "
                                     f"{excerpt(sha256)}")
                stamp = f.get("stamp")
                entries.append(ManifestEntry(path=path, size=size, sha256=sha256,
                                             stamp=stamp if valid_stamp(stamp) else None))
            return cls.of(entries)
        except ValueError as exc:
            raise VerificationError(
                f"{uri} is not a ckptflow manifest ({one_line(str(exc), 300)})",
                uri=uri,
                expected=f"{FORMAT} version {VERSION}",
                hint="delete it and push again",
            ) from None


def _entry_json(entry: ManifestEntry) -> dict[str, object]:
    out: dict[str, object] = {"path": entry.path, "size": entry.size, "sha256": entry.sha256}
    if entry.stamp is not None:
        out["stamp"] = dict(entry.stamp)
    return out
