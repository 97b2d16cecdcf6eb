"""Hashes of what we write or send, and the checksums object stores report back.

`Digests` hashes a stream once: sha256 (by default: it goes into manifests), crc32c when
`google_crc32c` is present (GCS reports it for every object), md5 on request (S3 reports it as the
ETag of a single-part object). Which checksum a store reports and where its `info()` carries it, which
is worth hashing while writing, and what stamps one version of an object are the store's own traits
(`plumbing.stores`: `Store.checksum(info)`, `Store.digests(size)`, `Store.stamp(info)`); a stamp is
compared here (`stamps_match`). The publish step checks uploads with them, and the conversion steps
check each unit's output before the commit marker is written (`plumbing.staging`).
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass
from typing import Any

google_crc32c: Any  # its C extension, unannotated
try:
    import google_crc32c as _google_crc32c

    google_crc32c = _google_crc32c
except ImportError:  # pragma: no cover - gcsfs depends on it
    google_crc32c = None


@dataclass(frozen=True)
class StoreChecksum:
    """A checksum a store reports for an object: `kind` is 'crc32c' or 'md5', `value` as the store wrote it."""

    kind: str
    value: str


class Digests:
    """Running hashes of one stream of bytes."""

    def __init__(self, *, md5: bool = False, crc32c: bool = True, sha256: bool = True) -> None:
        self.size = 0
        self._sha256 = hashlib.sha256() if sha256 else None
        self._md5 = hashlib.md5(usedforsecurity=False) if md5 else None
        self._crc32c = google_crc32c.Checksum() if crc32c and google_crc32c is not None else None

    def update(self, data: bytes | memoryview) -> None:
        self.size += len(data)
        if self._sha256 is not None:
            self._sha256.update(data)
        if self._md5 is not None:
            self._md5.update(data)
        if self._crc32c is not None:  # google_crc32c's C extension takes bytes only, not a memoryview
            self._crc32c.update(data if isinstance(data, bytes) else bytes(data))

    @property
    def sha256(self) -> str:
        if self._sha256 is None:
            raise ValueError("these digests were made without sha256")
        return self._sha256.hexdigest()

    def checksums(self) -> tuple[StoreChecksum, ...]:
        """What was hashed, in the encodings stores report (crc32c and md5 as GCS and S3 give them)."""
        out = []
        if self._crc32c is not None:
            out.append(StoreChecksum("crc32c", base64.b64encode(self._crc32c.digest()).decode()))
        if self._md5 is not None:
            out += [StoreChecksum("md5-base64", base64.b64encode(self._md5.digest()).decode()),
                    StoreChecksum("md5-hex", self._md5.hexdigest())]
        return tuple(out)

    def can_check(self, checksum: StoreChecksum) -> bool:
        """Whether these digests include the kind of `checksum`."""
        if checksum.kind == "crc32c":
            return self._crc32c is not None
        return checksum.kind.startswith("md5") and self._md5 is not None

    def matches(self, checksum: StoreChecksum) -> bool:
        """Whether the store's `checksum` is that of the bytes hashed here."""
        if checksum.kind == "crc32c" and self._crc32c is not None:
            return base64.b64encode(self._crc32c.digest()).decode() == checksum.value
        if checksum.kind == "md5-base64" and self._md5 is not None:
            return base64.b64encode(self._md5.digest()).decode() == checksum.value
        if checksum.kind == "md5-hex" and self._md5 is not None:
            return self._md5.hexdigest() == checksum.value.lower()
        return False


def valid_stamp(value: Any) -> bool:
    """Whether `value` is a stamp as `Store.stamp` makes them (`plumbing.stores`): an object of strings with a size."""
    return isinstance(value, dict) and "size" in value and all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items())


def stamps_match(recorded: dict[str, str], current: dict[str, str]) -> bool:
    """Whether `current` is the same object version as `recorded`: equal size and equal values for
    every identity key both have (a listing and a HEAD may report different sets), at least one."""
    common = (recorded.keys() & current.keys()) - {"size"}
    return (recorded.get("size") == current.get("size") and bool(common)
            and all(recorded[k] == current[k] for k in common))
