"""Publishing a folder to an object store or any fsspec URL (`gs://`, `s3://`, `file://`, local paths,
`memory://` ...), configured the way fsspec always is.

How a push to a store stays atomic and resumable:

1. Plan: list SRC once (relative path and size of every file).
2. Read DEST's manifest, if any. If SRC differs from it (a new version), delete it first, so that no
   reader trusts a mix of two versions while files are replaced.
3. One unit per file, on a bounded thread pool. A unit skips a file whose DEST object already holds
   the same bytes (same size and a checksum the store reports equal to the source's, or an object
   recorded as verified by an earlier run and not rewritten since). Otherwise it streams the source
   to DEST, hashing on the way, then checks the object (size and the store's crc32c/md5, or the
   sha256 of what reads back). Transient failures (408, 429, 5xx, resets, timeouts) retry the whole
   file with backoff and jitter, reopening the source; so does a resumable session that broke (a
   chunk resent after its response was lost is refused as out of sync; a session that expired): the
   file starts over with a new session. Anything else stops the push at once: 401, 403, a missing
   bucket, a 404 while starting a session.
4. Each verified file is noted in `ckptflow-manifest.json.partial` at DEST (written every second or
   so). A re-run after a crash trusts an object only when it checks out against that record or the
   store's checksum; a half-written object never does.
5. When every file is verified, write `ckptflow-manifest.json` (every file, size, sha256): the commit
   marker. Then remove leftovers that are ours and not part of this version, and the partial record.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import stat
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import fsspec
from fsspec.spec import AbstractBufferedFile

from ckptflow.errors import (
    CheckpointError,
    CkptflowError,
    PublishError,
    UnsafeInputError,
    UploadMismatchError,
    UploadSessionError,
    VerificationError,
)
from ckptflow.plumbing.checksums import Digests, stamps_match, valid_stamp
from ckptflow.plumbing.files import load_json, read_regular, write_bytes
from ckptflow.plumbing.progress import Progress, Tally
from ckptflow.plumbing.redaction import describe, redact
from ckptflow.plumbing.retry import RetryPolicy, retry_call
from ckptflow.plumbing.steps import Cancelled, run_units
from ckptflow.plumbing.storage import join, open_fs, unstrip
from ckptflow.plumbing.stores import store_for
from ckptflow.plumbing.text import one_line
from ckptflow.publish.lease import hold_lease
from ckptflow.publish.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, PARTIAL_RECORD_NAME, Manifest, ManifestEntry
from ckptflow.publish.source import (
    READ_CHUNK,
    PushResult,
    SourceFile,
    failure_advice,
    failure_reason,
    list_source,
    open_source,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Upload block size: what gcsfs's own put_file sends per request; a multiple of 256 KiB (GCS) and
# at least 5 MiB (S3 parts).
UPLOAD_BLOCK = 50 * 2**20
PARTIAL_FLUSH_SECONDS = 1.0


def push_to_store(
    src: str,
    dest: str,
    *,
    workers: int = 8,
    progress: Progress | None = None,
    retry: RetryPolicy | None = None,
    break_lease: bool = False,
) -> PushResult:
    """Publish `src` to the fsspec location `dest`, atomically (manifest last) and resumably.

    Pushing the same folder again uploads nothing; a re-run after a failure or a crash uploads only
    what is not verified at DEST yet. See the module docstring for the protocol. `progress(done,
    total)` counts the bytes of the files uploaded or found in place (a file that starts over counts
    from zero again). One push at a time per DEST: the push holds DEST's lease (`publish.lease`) and
    fails at once when another push holds it; `break_lease` removes a lease a dead push left.
    """
    src_fs, src_root, files = list_source(src, retry=retry)
    dest_fs, dest_root = open_fs(dest)
    with hold_lease(dest_fs, dest_root, redact(dest), break_lease=break_lease, policy=retry):
        run = _StorePush(
            src_fs=src_fs, src_root=src_root, dest_fs=dest_fs, dest_root=dest_root, dest=dest,
            workers=workers, progress=progress, policy=retry or RetryPolicy(),
        )
        return run.run(files)


@dataclass(frozen=True)
class _Outcome:
    path: str
    size: int
    sha256: str
    stamp: dict[str, str]
    uploaded: bool


class _PartialRecord:
    """The partial record at DEST: files verified so far, with the store's stamp of each object.

    While a push runs, a background thread writes it every PARTIAL_FLUSH_SECONDS when something new
    was uploaded, so that writing it never holds up an upload; it is written once more at the end.
    Losing it costs time, never correctness, so failures to write it are logged and ignored."""

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str, entries: dict[str, dict[str, Any]]) -> None:
        self.fs = fs
        self.path = path
        self.entries = entries
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._dirty = False
        self._stop = threading.Event()

    @classmethod
    def parse(cls, fs: fsspec.AbstractFileSystem, path: str, data: bytes | None) -> _PartialRecord:
        """The record in `data`; entries that are not what a push writes are dropped, and a record that
        cannot be read at all is ignored (it only saves time: the push starts over)."""
        entries: dict[str, dict[str, Any]] = {}
        try:
            if data is not None:
                doc = load_json(data)
                files = doc.get("files") if isinstance(doc, dict) else None
                if not isinstance(files, dict):
                    raise ValueError("no `files` object")
                entries = {p: e for p, e in files.items() if isinstance(p, str) and _valid_entry(e)}
        except ValueError as exc:
            logger.warning("ignoring unreadable partial record %s (%s)", path, one_line(str(exc), 200))
        return cls(fs, path, entries)

    def get(self, path: str) -> dict[str, Any] | None:
        with self._lock:
            return self.entries.get(path)

    def record(self, path: str, size: int, sha256: str, object_stamp: dict[str, str], *, uploaded: bool) -> None:
        """Note a verified file. Only uploads make the record worth writing: a file found in place
        is found in place again by the next run."""
        with self._lock:
            self.entries[path] = {"size": size, "sha256": sha256, "stamp": object_stamp}
            self._dirty = self._dirty or uploaded

    def adopt(self, entries: Iterable[ManifestEntry]) -> None:
        """Carry the files of a manifest about to be removed into the record, so that a later run
        still knows them: to skip them when unchanged, to remove them when no longer listed."""
        with self._lock:
            for e in entries:
                if e.path not in self.entries:
                    self.entries[e.path] = {"size": e.size, "sha256": e.sha256, "stamp": dict(e.stamp or {})}
                    self._dirty = True

    @contextmanager
    def flushing(self) -> Iterator[None]:
        """Write the record in the background while the body runs, and once more when it ends."""
        self._stop.clear()
        writer = threading.Thread(target=self._flush_loop, name="ckptflow-partial-record", daemon=True)
        writer.start()
        try:
            yield
        finally:
            self._stop.set()
            writer.join()
            self.flush()

    def _flush_loop(self) -> None:
        while not self._stop.wait(PARTIAL_FLUSH_SECONDS):
            self.flush()

    def flush(self) -> None:
        with self._write_lock:
            with self._lock:
                if not self._dirty:
                    return
                data = json.dumps({"format": "ckptflow-partial", "files": self.entries}, indent=0).encode()
                self._dirty = False
            try:
                write_bytes(unstrip(self.fs, self.path), data)
            except Exception as exc:  # any store's failure: the record only saves a re-run some checks
                with self._lock:
                    self._dirty = True
                logger.warning("could not write the partial record %s (%s); a re-run may check more", self.path,
                               describe(exc))


def _valid_entry(entry: Any) -> bool:
    """A partial record's entry as a push writes it: size, sha256 and a stamp of strings."""
    return (isinstance(entry, dict) and type(entry.get("size")) is int and entry["size"] >= 0
            and isinstance(entry.get("sha256"), str) and valid_stamp(entry.get("stamp")))


class _StorePush:
    """One push to an fsspec DEST: the shared state of its units and the steps of `run`."""

    def __init__(
        self,
        *,
        src_fs: fsspec.AbstractFileSystem,
        src_root: str,
        dest_fs: fsspec.AbstractFileSystem,
        dest_root: str,
        dest: str,
        workers: int,
        progress: Progress | None,
        policy: RetryPolicy,
    ) -> None:
        self.src_fs = src_fs
        self.src_root = src_root
        self.dest_fs = dest_fs
        self.dest_root = dest_root
        self.dest = redact(dest)
        self.workers = workers
        self.progress = progress
        self.tally = Tally(0)
        self.policy = policy
        self.store = store_for(dest_fs)
        self.local_dest = self.store.local
        self.local_src = store_for(src_fs).local
        self.want_md5 = self.store.reports_md5  # S3 reports md5 (ETag); GCS crc32c
        self.cancelled = threading.Event()
        self.source_digests: dict[str, Digests] = {}
        self.published: dict[str, ManifestEntry] = {}
        self.existing: dict[str, dict[str, Any]] = {}
        self.partial = _PartialRecord(dest_fs, self._dest_path(PARTIAL_RECORD_NAME), {})

    # The run, step by step.

    def run(self, files: tuple[SourceFile, ...]) -> PushResult:
        self.tally = Tally(sum(f.size for f in files), self.progress)
        self.tally.start()
        logger.info("pushing %d files (%d bytes) to %s", len(files), sum(f.size for f in files), self.dest)
        manifest_path = self._dest_path(MANIFEST_NAME)
        self.existing = self._retry(self._list_dest, what="list", path="")
        previous = self._read_manifest(manifest_path) if MANIFEST_NAME in self.existing else None
        self.published = previous.by_path() if previous is not None else {}
        staged = None
        if PARTIAL_RECORD_NAME in self.existing:
            try:
                staged = self._read_optional(self.partial.path, PARTIAL_RECORD_NAME)
            except UnsafeInputError as exc:  # it only saves time: start over, and replace it at the first flush
                logger.warning("ignoring the partial record at %s: %s", self.dest, exc)
        self.partial = _PartialRecord.parse(self.dest_fs, self.partial.path, staged)
        if previous is not None:
            self._map(self._hash_source_into_cache, files)
            if previous != Manifest.of(self._entry_from_cache(f) for f in files):
                logger.info("%s holds another version: removing its manifest before replacing files", self.dest)
                self.partial.adopt(previous.files)
                self.partial.flush()
                self._retry(lambda: self.dest_fs.rm_file(manifest_path), what=f"remove the old {MANIFEST_NAME} at",
                            path=MANIFEST_NAME)
        with self.partial.flushing():
            outcomes = self._map(self._publish_file, files)
        manifest = Manifest.of(ManifestEntry(path=o.path, size=o.size, sha256=o.sha256, stamp=o.stamp)
                               for o in outcomes)
        if manifest != previous or any(o.uploaded for o in outcomes):
            self._write_manifest(manifest_path, manifest)
        self._clean_up(previous, manifest)
        uploaded = tuple(o.path for o in outcomes if o.uploaded)
        logger.info("pushed %s: %d uploaded, %d already there", self.dest, len(uploaded), len(outcomes) - len(uploaded))
        return PushResult(
            dest=self.dest,
            uploaded=uploaded,
            skipped=tuple(o.path for o in outcomes if not o.uploaded),
            bytes_uploaded=sum(o.size for o in outcomes if o.uploaded),
            manifest_uri=join(self.dest, MANIFEST_NAME),
        )

    def _publish_file(self, f: SourceFile) -> _Outcome:
        """One unit: skip the file if DEST already holds it, else upload and verify it."""
        dest_path = self._dest_path(f.path)
        info = self.existing.get(f.path)
        sha256 = self._already_there(f, info) if info is not None else None
        if info is not None and sha256 is not None:
            logger.debug("%s already at DEST, verified", f.path)
            self.partial.record(f.path, f.size, sha256, self.store.stamp(info), uploaded=False)
            self.tally.part(f.path)(f.size, f.size)
            return _Outcome(f.path, f.size, sha256, self.store.stamp(info), uploaded=False)

        def on_retry(attempt: int, exc: BaseException, delay: float) -> None:
            logger.warning("upload of %s failed (%s); try %d of %d in %.1fs", f.path, describe(exc), attempt + 1,
                           self.policy.attempts, delay)
            self.tally.part(f.path)(0, f.size)  # the file starts over

        sha256, info = self._retry(lambda: self._upload(f, dest_path), what=f"upload {f.path} to", path=f.path,
                                   on_retry=on_retry)
        self.partial.record(f.path, f.size, sha256, self.store.stamp(info), uploaded=True)
        self.tally.part(f.path)(f.size, f.size)
        return _Outcome(f.path, f.size, sha256, self.store.stamp(info), uploaded=True)

    def _already_there(self, f: SourceFile, info: dict[str, Any]) -> str | None:
        """The sha256 of `f` when the object at DEST provably holds its bytes, else None.

        Proof is the store's checksum equal to the source's, or, where the store reports none, a
        record (partial record or manifest) of the object as verified, with the same stamp now."""
        if int(info.get("size", -1)) != f.size:
            return None
        checksum = self.store.checksum(info)
        if checksum is not None and (checksum.kind != "crc32c" or Digests().can_check(checksum)):
            digests = self.source_digests.get(f.path)
            if digests is None or not digests.can_check(checksum):
                digests = self._hash_source(f, md5=checksum.kind != "crc32c")
            return digests.sha256 if digests.matches(checksum) else None
        current = self.store.stamp(info)
        staged, published = self.partial.get(f.path), self.published.get(f.path)
        if staged is not None and stamps_match(staged["stamp"], current):
            recorded = staged["sha256"]
        elif published is not None and published.stamp is not None and stamps_match(dict(published.stamp), current):
            recorded = published.sha256
        else:
            return None  # no checksum and no record: uploading is the way to be sure
        digests = self.source_digests.get(f.path) or self._hash_source(f)
        return digests.sha256 if digests.sha256 == recorded else None

    def _upload(self, f: SourceFile, dest_path: str) -> tuple[str, dict[str, Any]]:
        """One try: stream SRC to DEST hashing it, then verify the object. Returns (sha256, info)."""
        digests = Digests(md5=self.want_md5)
        if self.local_dest:
            self.dest_fs.makedirs(posixpath.dirname(dest_path), exist_ok=True)
            _clear_local_target(dest_path)
        uploaded = self.tally.part(f.path)
        with open_source(self.src_fs, self.src_root, f.path, local=self.local_src) as source:
            target = self.dest_fs.open(dest_path, "wb", block_size=UPLOAD_BLOCK)
            try:
                while chunk := source.read(READ_CHUNK):
                    if self.cancelled.is_set():
                        raise Cancelled()
                    digests.update(chunk)
                    target.write(chunk)
                    uploaded(digests.size, f.size)
                if digests.size != f.size:
                    raise CheckpointError(
                        f"{f.path} changed size while being pushed ({f.size} bytes listed, {digests.size} read)",
                        file=f.path, expected=f.size, actual=digests.size, hint="push again once SRC is stable",
                    )
                target.close()
            except BaseException as exc:  # any stop, Ctrl-C included, abandons the upload; re-raised
                if self.store.session_broke(target, exc):
                    target.closed = True  # forgotten, never finalized: an unfinished session makes no object
                    raise UploadSessionError(
                        f"the upload session of {f.path} at {self.dest} broke ({describe(exc)}); the file starts "
                        "over with a new session", uri=self.dest, file=f.path) from exc
                _abandon(target, self.dest_fs, dest_path)
                raise
        info = self._verify(f, dest_path, self._dest_info(dest_path), digests)
        return digests.sha256, info

    def _verify(self, f: SourceFile, dest_path: str, info: dict[str, Any] | None, digests: Digests
                ) -> dict[str, Any]:
        """The object's info at DEST; UploadMismatchError unless it holds exactly the bytes sent."""
        actual_size = None if info is None else int(info.get("size", -1))
        if info is None or actual_size != f.size:
            raise UploadMismatchError(
                f"{f.path} at {self.dest} has {actual_size} bytes after upload, expected {f.size}",
                uri=self.dest, file=f.path, expected=f.size, actual=actual_size,
            )
        checksum = self.store.checksum(info)
        if checksum is not None and digests.can_check(checksum):
            if not digests.matches(checksum):
                raise UploadMismatchError(
                    f"{f.path} at {self.dest}: the store's {checksum.kind} differs from the source's after upload",
                    uri=self.dest, file=f.path,
                )
            return info
        read_back = self._hash_dest(dest_path)
        if read_back != digests.sha256:
            raise UploadMismatchError(
                f"{f.path} at {self.dest} reads back with sha256 {read_back}, expected {digests.sha256}",
                uri=self.dest, file=f.path, expected=digests.sha256, actual=read_back,
            )
        return info

    def _write_manifest(self, path: str, manifest: Manifest) -> None:
        data = manifest.to_json()

        def write_and_check() -> None:
            if self.local_dest:  # a local reader must never see half a manifest (a temporary sibling, renamed)
                write_bytes(unstrip(self.dest_fs, path), data)
            else:  # an object appears whole or not at all
                self.dest_fs.pipe_file(path, data)
            self.dest_fs.invalidate_cache(path)
            if self.dest_fs.cat_file(path) != data:
                raise UploadMismatchError(f"the manifest at {self.dest} reads back different", uri=self.dest,
                                          file=MANIFEST_NAME)

        self._retry(write_and_check, what=f"write {MANIFEST_NAME} to", path=MANIFEST_NAME)

    def _clean_up(self, previous: Manifest | None, manifest: Manifest) -> None:
        """Remove what earlier pushes left that this version does not list, then the partial record."""
        ours = set(self.partial.entries) | (set(previous.by_path()) if previous else set())
        for rel in sorted(ours - set(manifest.by_path())):
            try:
                self.dest_fs.rm_file(self._dest_path(rel))
                logger.info("removed %s from %s: not part of this version", rel, self.dest)
            except FileNotFoundError:
                pass
            except Exception as exc:  # cleanup, any store's failure: the version is written
                logger.warning("could not remove leftover %s at %s (%s)", rel, self.dest, describe(exc))
        try:
            self.dest_fs.rm_file(self.partial.path)
        except FileNotFoundError:
            pass
        except Exception as exc:  # cleanup, any store's failure: the version is written
            logger.warning("could not remove the partial record at %s (%s)", self.dest, describe(exc))

    # Reads, each retried on transient errors.

    def _read_manifest(self, path: str) -> Manifest | None:
        uri = join(self.dest, MANIFEST_NAME)
        try:
            data = self._read_optional(path, MANIFEST_NAME)
        except UnsafeInputError as exc:
            what = str(exc).split("; ")[0].replace(unstrip(self.dest_fs, path), "it", 1)
            raise VerificationError(f"{uri} is not a ckptflow manifest: {what}", uri=uri,
                                    hint="delete it and push again") from None
        return None if data is None else Manifest.from_json(data, uri=uri)

    def _read_optional(self, path: str, name: str) -> bytes | None:
        """The bytes of a small file at DEST (a manifest, a partial record), None when there is none;
        `UnsafeInputError` when it is larger than `MAX_MANIFEST_BYTES` or, on a local DEST, not a
        regular file (a FIFO there would hang the push)."""
        if self.local_dest:
            uri = unstrip(self.dest_fs, path)
            if not os.path.lexists(uri):
                return None
            return read_regular(uri, limit=MAX_MANIFEST_BYTES, what=name, hint="delete it and push again")
        size = self.existing.get(name, {}).get("size")
        if isinstance(size, int) and size > MAX_MANIFEST_BYTES:
            raise UnsafeInputError(f"{join(self.dest, name)} holds {size:,} bytes, more than a {name} can "
                                   f"({MAX_MANIFEST_BYTES:,} at most)", code="too-large", file=name)

        def read() -> bytes | None:
            try:
                data: bytes = self.dest_fs.cat_file(path)
            except FileNotFoundError:
                return None
            return data

        return self._retry(read, what=f"read {name} at", path=name)

    def _list_dest(self) -> dict[str, dict[str, Any]]:
        """What DEST holds now, by path relative to it: one listing instead of a request per file."""
        self.dest_fs.invalidate_cache(self.dest_root)
        try:
            found = self.dest_fs.find(self.dest_root, withdirs=False, detail=True)
        except FileNotFoundError:
            return {}
        prefix = self.dest_root.rstrip("/") + "/"
        return {path[len(prefix):]: info for path, info in found.items() if path.startswith(prefix)}

    def _dest_info(self, dest_path: str) -> dict[str, Any] | None:
        self.dest_fs.invalidate_cache(dest_path)
        try:
            info = self.dest_fs.info(dest_path)
        except FileNotFoundError:
            return None
        return info if info.get("type", "file") == "file" else None

    def _hash_source(self, f: SourceFile, *, md5: bool = False) -> Digests:
        def read() -> Digests:
            digests = Digests(md5=md5)
            with open_source(self.src_fs, self.src_root, f.path, local=self.local_src) as source:
                while chunk := source.read(READ_CHUNK):
                    if self.cancelled.is_set():
                        raise Cancelled()
                    digests.update(chunk)
            return digests

        return self._retry(read, what=f"read {f.path} in", path=f.path, of_source=True)

    def _hash_source_into_cache(self, f: SourceFile) -> None:
        self.source_digests[f.path] = self._hash_source(f, md5=self.want_md5)

    def _entry_from_cache(self, f: SourceFile) -> ManifestEntry:
        return ManifestEntry(path=f.path, size=f.size, sha256=self.source_digests[f.path].sha256)

    def _hash_dest(self, dest_path: str) -> str:
        digests = Digests()
        with self.dest_fs.open(dest_path, "rb", block_size=READ_CHUNK) as readback:
            while chunk := readback.read(READ_CHUNK):
                digests.update(chunk)
        return digests.sha256

    # Plumbing.

    def _src_path(self, rel: str) -> str:
        return f"{self.src_root.rstrip('/')}/{rel}"

    def _dest_path(self, rel: str) -> str:
        return f"{self.dest_root.rstrip('/')}/{rel}"

    def _map(self, fn: Callable[[SourceFile], T], files: Iterable[SourceFile]) -> list[T]:
        """`fn` over `files` on the pool, results in order. The first failure (or an interrupt) stops
        the other units where they are, and is raised."""
        return run_units(fn, list(files), workers=self.workers, cancel=self.cancelled, name="ckptflow-push")

    def _retry(
        self,
        fn: Callable[[], T],
        *,
        what: str,
        path: str,
        on_retry: Callable[[int, BaseException, float], None] | None = None,
        of_source: bool = False,
    ) -> T:
        """`fn()` with the push's retry policy; a failure for good becomes a PublishError."""

        def guarded() -> T:
            if self.cancelled.is_set():
                raise Cancelled()
            return fn()

        def log_retry(attempt: int, exc: BaseException, delay: float) -> None:
            logger.warning("could not %s %s (%s); retrying", what, self.dest, describe(exc))

        try:
            return retry_call(guarded, self.policy, on_retry=on_retry or log_retry)
        except (Cancelled, PublishError):
            raise
        except CkptflowError as exc:
            if not isinstance(exc, UploadMismatchError):
                raise
            raise self._publish_error(exc, what=what, path=path, of_source=of_source) from None
        except Exception as exc:  # each store raises its own errors: one line naming DEST and what to do
            raise self._publish_error(exc, what=what, path=path, of_source=of_source) from None

    def _publish_error(self, exc: Exception, *, what: str, path: str, of_source: bool) -> PublishError:
        where = "SRC" if of_source else self.dest
        return PublishError(
            f"could not {what} {where}: {failure_reason(exc, self.policy)}", uri=self.dest, file=path,
            hint=failure_advice(exc, of_source),
        )


def _clear_local_target(path: str) -> None:
    """Before a file is written at a local DEST path: a link or a special file there is removed, so that
    the write never goes through a link to a file elsewhere nor opens a FIFO (which would block)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode) and not stat.S_ISDIR(st.st_mode):
        os.unlink(path)


def _abandon(target: Any, fs: fsspec.AbstractFileSystem, path: str) -> None:
    """Throw away a write in progress, so that no partial object is ever finalized at DEST.

    Closing an fsspec buffered write file commits it, and so would its destructor: `discard` cancels
    the resumable upload (GCS) or multipart upload (S3), and marking the file closed keeps anything
    from committing what was buffered. Files written in place (local, memory) are closed and removed."""
    if isinstance(target, AbstractBufferedFile):
        try:
            target.discard()
        except Exception as exc:  # cleanup, any store's failure: the file is marked closed below either way
            logger.debug("cancelling the upload of %s failed (%s); it is never finalized", path, describe(exc))
        target.closed = True
        return
    try:
        target.close()
        fs.rm_file(path)
    except FileNotFoundError:
        pass
    except Exception as exc:  # cleanup on a failure path: the error that brought us here is the one raised
        logger.warning("could not remove the partial file %s (%s)", path, describe(exc))
