"""One consolidation unit: one output shard streamed into the staging folder, and checked.

A `ShardJob` is what a worker needs for one shard and nothing more: the shard's tensors with their
source runs (byte ranges of the rank files), where the shard goes, and the options. It is small and
plain (no plan, no index, no callable), so it pickles to a Dask worker as well as it runs on a thread.
`run_job(job)` writes a safetensors header first, then the tensors in bounded batches of byte-range
reads (one `fs.cat_ranges` round per batch on a bucket, `preadv` on a local disk: straight into the
output buffer when no cast is needed, through a small scratch buffer when one is; never a memory map,
which a file truncated by another process would turn into a SIGBUS), cast on the way (numpy,
`formats.casts`: no torch), hashed as written, and on a local disk written with direct I/O (whole blocks
from the buffers to the disk, no copy into the page cache: `plumbing.direct`); with `verify`, each range
is read back and compared with an independent read of the source (`formats.shard_check`): on a local
disk by a checker thread that follows the writer and reads from the disk, on a bucket once the object
is written. It reports the shard
as `plumbing.staging.Written` (size, the checksum the store will report, the store's stamp), which
the coordinator checks before the commit. A job is safe to run again: it rewrites its file with the
same bytes. `run_unit(plan, unit, staging)` is `run_job(shard_job(plan, unit, staging))`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptflow.consolidate.plan import Batch, ByteCopy, ConsolidationPlan, ShardUnit, plan_batches
from ckptflow.errors import CkptflowError, CorruptFileError, OutputError, SourceReadError
from ckptflow.formats import hf
from ckptflow.formats.casts import cast_into, cast_rows_into
from ckptflow.formats.shard_check import verify_shard
from ckptflow.formats.torch.tensorref import DTYPE_SIZES
from ckptflow.plumbing.checksums import Digests
from ckptflow.plumbing.direct import BLOCK, BlockWriter, aligned_buffer, open_direct
from ckptflow.plumbing.progress import Progress, Tally
from ckptflow.plumbing.ranges import ShortRead, read_into, read_ranges
from ckptflow.plumbing.redaction import describe
from ckptflow.plumbing.sizes import format_size
from ckptflow.plumbing.staging import Staging, Written, written
from ckptflow.plumbing.steps import Cancelled
from ckptflow.plumbing.storage import open_fs
from ckptflow.plumbing.stores import store_for
from ckptflow.plumbing.stores.local import os_path

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardResult:
    """One shard written (and, when `verified`, reopened and checked against the source)."""

    index: int
    filename: str
    size: int
    sha256: str
    verified: bool
    written: Written | None = None  # what the coordinator checks against the store before the commit


@dataclass(frozen=True, kw_only=True)
class ShardJob:
    """One output shard as a worker gets it: its tensors and their source runs, where it goes (`staging`,
    the staging folder's URI, and the unit's file name there), and how to write it."""

    unit: ShardUnit
    staging: str
    chunk_bytes: int
    verify: bool

    @property
    def uri(self) -> str:
        return f"{self.staging.rstrip('/')}/{self.unit.filename}"


def shard_job(plan: ConsolidationPlan, unit: ShardUnit, staging: Staging, *, verify: bool | None = None) -> ShardJob:
    """The job that writes shard `unit` of `plan` into `staging` (checked when `verify`, by default the
    plan's option)."""
    return ShardJob(unit=unit, staging=staging.uri, chunk_bytes=plan.options.chunk_bytes,
                    verify=plan.options.verify if verify is None else verify)


def run_unit(
    plan: ConsolidationPlan,
    unit: ShardUnit,
    staging: Staging,
    *,
    verify: bool | None = None,
    progress: Progress | None = None,
    cancel: threading.Event | None = None,
) -> ShardResult:
    """Write shard `unit` of `plan` into the staging folder; with `verify` (default: the plan's
    option) reopen it and check every byte against the source (see `run_job`)."""
    return run_job(shard_job(plan, unit, staging, verify=verify), progress=progress, cancel=cancel)


def run_job(job: ShardJob, *, progress: Progress | None = None, cancel: threading.Event | None = None) -> ShardResult:
    """Write the job's shard; with `job.verify` reopen it and check every byte against the source.
    Safe to run again: the file is rewritten, with the same bytes.

    On a local disk the check runs while the shard is written: a checker thread re-reads each range
    of the file as soon as the writer has written it and compares it with its own read and cast of
    the source, and the writer's fsync overlaps the end of the check. On a bucket the object exists
    only once written, so the check follows the write.

    `progress(done, total)` counts this unit's bytes written plus, with `verify`, bytes checked.
    """
    unit, verify = job.unit, job.verify
    shard = unit.file()
    by_name = {t.name: t for t in unit.tensors}
    batches = plan_batches([(s.dtype, s.begin, by_name[s.name].runs) for s in shard.slots], job.chunk_bytes)
    uri = job.uri
    fs, _ = open_fs(uri)
    store = store_for(fs).digests(shard.file_size)
    tally = Tally(unit.nbytes * (2 if verify else 1), progress)
    wrote, checked = tally.part("write"), tally.part("check")
    stopped: Callable[[], bool] = cancel.is_set if cancel is not None else (lambda: False)
    started = time.monotonic()
    if verify and os_path(uri) is not None:
        sha256 = _write_and_check(uri, shard, batches, wrote, stopped,
                                  lambda done: verify_shard(uri, unit.tensors, chunk_bytes=job.chunk_bytes,
                                                            progress=checked, written=done))
        logger.info("wrote and checked %s (%s) in %.2fs", uri, format_size(shard.file_size),
                    time.monotonic() - started)
        return ShardResult(unit.index, unit.filename, shard.file_size, sha256, True,
                          written(job.staging, unit.filename, shard.file_size))
    sha256 = _write_shard(uri, shard, batches, wrote, stopped, store=store)
    logger.info("wrote %s (%s) in %.2fs", uri, format_size(shard.file_size), time.monotonic() - started)
    if verify:
        if stopped():
            raise Cancelled(unit.filename)
        verify_shard(uri, unit.tensors, chunk_bytes=job.chunk_bytes, progress=checked)
    return ShardResult(unit.index, unit.filename, shard.file_size, sha256, verify,
                      written(job.staging, unit.filename, shard.file_size, store))


class _Watermark:
    """How many leading bytes of a file have been written: the writer raises it, a reader waits on it."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._bytes = 0
        self._abandoned = False

    def advance(self, nbytes: int) -> None:
        with self._cond:
            self._bytes = nbytes
            self._cond.notify_all()

    def abandon(self) -> None:
        """The writer stopped: wake the reader, which raises `Cancelled`."""
        with self._cond:
            self._abandoned = True
            self._cond.notify_all()

    def wait_for(self, nbytes: int) -> int:
        """Wait until at least `nbytes` are written; returns how many are."""
        with self._cond:
            self._cond.wait_for(lambda: self._bytes >= nbytes or self._abandoned)
            if self._bytes < nbytes:
                raise Cancelled(f"the write stopped before byte {nbytes}")
            return self._bytes


def _write_and_check(uri: str, shard: hf.SafetensorsFile, batches: Sequence[Batch],
                     progress: Progress, stopped: Callable[[], bool],
                     check: Callable[[Callable[[int], int]], Any]) -> str:
    """Write the shard on this thread while `check(written)` runs on another, `written(n)` blocking it
    until the first n bytes of the file are written. A failed write stops the check and is the error
    raised (a source that breaks fails both; the writer's error says it best); otherwise the check's
    error, if any. Returns the file's sha256."""
    mark = _Watermark()
    with ThreadPoolExecutor(1, thread_name_prefix="ckptflow-check") as pool:
        checking = pool.submit(check, mark.wait_for)
        try:
            sha256 = _write_shard(uri, shard, batches, progress, stopped, written=mark.advance)
        except BaseException:  # whatever stops the write, Ctrl-C included, must release the check; re-raised
            mark.abandon()
            raise
        checking.result()
    return sha256


def _write_shard(uri: str, shard: hf.SafetensorsFile, batches: Sequence[Batch], progress: Progress,
                 stopped: Callable[[], bool], *, written: Callable[[int], None] | None = None,
                 store: Digests | None = None) -> str:
    """Stream the shard: the header, then each batch (see `_ShardWriter`); `progress` counts data bytes
    written. `written(n)` is told each time the first n bytes of the file are out of this process
    (in the page cache on a local disk); `store` hashes every byte too. Returns the file's sha256."""
    try:
        with _open_output(uri) as fh:
            return _ShardWriter(fh, uri, shard, batches, store).write(progress, stopped, written)
    except EOFError as exc:  # a `ShortRead` (a CorruptFileError too): said here as a source gone short
        raise _source_error(exc, [c.uri for b in batches for c in b.copies]) from exc
    except (CkptflowError, Cancelled):
        raise
    except OSError as exc:
        raise OutputError(f"cannot write {uri} ({describe(exc)})", file=uri,
                          hint="check the destination is writable and has room, then run again") from exc


class _ShardWriter:
    """Three stages overlap, on up to three buffers: a reader thread fills batch i+2 (reads + casts)
    while this thread writes batch i+1 and a hasher thread hashes batch i.

    On a local disk the data goes out with direct I/O where the file system takes it
    (`plumbing.direct`): each batch sits in page-aligned memory at its place within a disk block, and
    whole blocks go from the buffer to the disk with no copy into the page cache. Without direct I/O
    a flusher thread keeps an fdatasync of what is written so far going, so the disk writes while the
    CPU casts and the final fsync has little left to do."""

    def __init__(self, fh: Any, uri: str, shard: hf.SafetensorsFile, batches: Sequence[Batch],
                 store: Digests | None = None) -> None:
        path = os_path(uri)
        self.fh, self.uri, self.local, self.shard, self.batches = fh, uri, path is not None, shard, batches
        self.direct = open_direct(path) if path is not None else -1
        self.blocks: BlockWriter | None = None
        out_cap = max((b.out_nbytes for b in batches), default=0)
        count = max(1, min(3, len(batches)))
        if self.direct >= 0:  # room for the end of the previous batch's last block in front of each
            try:
                self.buffers = [np.frombuffer(aligned_buffer(BLOCK + out_cap), dtype=np.uint8) for _ in range(count)]
            except BaseException:  # cleanup, re-raised: the descriptor must not leak, whatever stopped us
                os.close(self.direct)  # `write` closes it otherwise
                raise
            self.places = [BlockWriter.place(shard.data_start + b.file_start) for b in batches]
        else:
            self.buffers = [np.empty(out_cap, dtype=np.uint8) for _ in range(count)]
            self.places = [0] * len(batches)
        self.hashed: list[Any] = [None] * len(self.buffers)  # the pending hash of what each buffer holds
        self.sha256 = hashlib.sha256(shard.header)
        self.store = store
        if store is not None:
            store.update(shard.header)
        self.flushing: Any = None  # a pending fdatasync of what has been written so far (local disk)

    def write(self, progress: Progress, stopped: Callable[[], bool], written: Callable[[int], None] | None) -> str:
        try:
            with ThreadPoolExecutor(1, thread_name_prefix="ckptflow-read") as self.reader, \
                    ThreadPoolExecutor(1, thread_name_prefix="ckptflow-hash") as self.hashing, \
                    ThreadPoolExecutor(1, thread_name_prefix="ckptflow-flush") as self.flusher:
                self._write_header(written)
                done, total = 0, sum(b.out_nbytes for b in self.batches)
                depth = max(1, len(self.buffers) - 1)  # batches being filled ahead of the one being written
                pending = deque(self._fill(j) for j in range(min(depth, len(self.batches))))
                for i, batch in enumerate(self.batches):
                    pending.popleft().result()
                    if stopped():
                        raise Cancelled(self.uri)
                    if i + depth < len(self.batches):
                        pending.append(self._fill(i + depth))
                    out = self._write_batch(i, batch)
                    done += batch.out_nbytes
                    if written is not None:
                        if self.blocks is None:
                            self.fh.flush()
                        written(out)
                    progress(done, total)
                self._finish()
                if written is not None:
                    written(self.shard.file_size)
        finally:
            if self.direct >= 0:
                os.close(self.direct)
        return self.sha256.hexdigest()

    def _write_header(self, written: Callable[[int], None] | None) -> None:
        if self.direct >= 0:
            self.blocks = BlockWriter(self.fh.fileno(), self.direct, self.shard.header)
            out = self.blocks.done
        else:
            self.fh.write(self.shard.header)
            out = len(self.shard.header)
        if written is not None:
            if self.blocks is None:
                self.fh.flush()
            written(out)

    def _hash(self, view: memoryview) -> None:
        self.sha256.update(view)
        if self.store is not None:
            self.store.update(view)

    def _fill(self, j: int) -> Any:
        slot, place, batch = j % len(self.buffers), self.places[j], self.batches[j]
        if self.hashed[slot] is not None:
            self.hashed[slot].result()
        return self.reader.submit(_fill, batch, self.buffers[slot][place:place + batch.out_nbytes])

    def _write_batch(self, i: int, batch: Batch) -> int:
        """Write batch i; returns how many leading bytes of the file are written now."""
        buffer, place = self.buffers[i % len(self.buffers)].data, self.places[i]
        view = buffer[place:place + batch.out_nbytes]
        self.hashed[i % len(self.buffers)] = self.hashing.submit(self._hash, view)
        if self.blocks is not None:
            return self.blocks.write(buffer, self.shard.data_start + batch.file_start, batch.out_nbytes)
        self.fh.write(view)
        if self.local and (self.flushing is None or self.flushing.done()):
            if self.flushing is not None:
                self.flushing.result()
            self.fh.flush()
            self.flushing = self.flusher.submit(_datasync, self.fh.fileno())  # the disk writes while we cast
        return self.shard.data_start + batch.file_start + batch.out_nbytes

    def _finish(self) -> None:
        for future in self.hashed:
            if future is not None:
                future.result()
        if self.flushing is not None:
            self.flushing.result()
        if self.blocks is not None:
            self.blocks.close()
            os.ftruncate(self.fh.fileno(), self.shard.file_size)  # the direct-I/O probe wrote a whole block
        if self.local:
            self.fh.flush()
            os.fsync(self.fh.fileno())


_datasync = getattr(os, "fdatasync", os.fsync)  # macOS has no fdatasync


def _open_output(uri: str) -> Any:
    path = os_path(uri)
    if path is not None:
        return open(path, "wb")
    fs, path = open_fs(uri)
    return fs.open(path, "wb")


# Source bytes read per cast on a local disk: small enough to stay in the CPU's cache between the read
# and the cast.
_CAST_PIECE = 4 << 20
_scratch = threading.local()


def _fill(batch: Batch, out: np.ndarray) -> None:
    """Copy (and cast) one batch's source bytes into `out` (uint8): local files by `preadv` (into `out`
    itself when the dtype stays, else piece by piece through a scratch buffer), other stores through
    one `fs.cat_ranges` round for the whole batch."""
    remote = [i for i, c in enumerate(batch.copies) if os_path(c.uri) is None]
    try:
        fetched = read_ranges([(batch.copies[i].uri, batch.copies[i].start, batch.copies[i].end) for i in remote])
        blobs = dict(zip(remote, fetched))
        for i, copy in enumerate(batch.copies):
            blob = blobs.get(i)
            if copy.rows > 1:
                _fill_rows(copy, out, blob)
                continue
            size, out_size = DTYPE_SIZES[copy.dtype], DTYPE_SIZES[copy.out_dtype]
            numel = (copy.end - copy.start) // size
            dest = out[copy.dest:copy.dest + numel * out_size]
            if blob is not None:
                cast_into(dest, copy.out_dtype, blob, copy.dtype)
            elif copy.dtype == copy.out_dtype:
                read_into([(copy.uri, copy.start, copy.end, dest.data)])
            else:
                per = max(1, _CAST_PIECE // size)
                scratch = _scratch_bytes(per * size)
                for lo in range(0, numel, per):
                    n = min(per, numel - lo)
                    raw = scratch[:n * size]
                    read_into([(copy.uri, copy.start + lo * size, copy.start + (lo + n) * size, raw.data)])
                    cast_into(dest[lo * out_size:(lo + n) * out_size], copy.out_dtype, raw, copy.dtype)
    except OSError as exc:
        raise _source_error(exc, [c.uri for c in batch.copies]) from exc


def _fill_rows(copy: ByteCopy, out: np.ndarray, blob: Any) -> None:
    """A strided copy: its rows, back to back in the source, land `copy.stride` bytes apart in `out`;
    read a few rows at a time through the scratch buffer."""
    dest = out[copy.dest:]
    if blob is not None:
        cast_rows_into(dest, copy.out_dtype, blob, copy.dtype, copy.rows, copy.out_row, copy.stride)
        return
    row = (copy.end - copy.start) // copy.rows  # source bytes per row
    per = max(1, _CAST_PIECE // row)
    scratch = _scratch_bytes(per * row)
    for lo in range(0, copy.rows, per):
        n = min(per, copy.rows - lo)
        raw = scratch[:n * row]
        read_into([(copy.uri, copy.start + lo * row, copy.start + (lo + n) * row, raw.data)])
        cast_rows_into(dest[lo * copy.stride:], copy.out_dtype, raw, copy.dtype, n, copy.out_row, copy.stride)


def _scratch_bytes(nbytes: int) -> np.ndarray:
    """This thread's scratch buffer, at least `nbytes` long."""
    scratch = getattr(_scratch, "buffer", None)
    if scratch is None or scratch.size < nbytes:
        scratch = _scratch.buffer = np.empty(max(nbytes, _CAST_PIECE), dtype=np.uint8)
    return scratch


def _source_error(exc: BaseException, uris: Sequence[str]) -> CkptflowError:
    files = sorted(set(uris))
    if isinstance(exc, ShortRead):
        return CorruptFileError(
            f"{exc}; the file is shorter than its own index says", file=exc.uri,
            hint="the file was truncated or replaced while being read; copy it again and re-run",
        )
    return SourceReadError(
        f"cannot read the checkpoint: {describe(exc)} (reading {', '.join(files)})",
        file=files[0] if len(files) == 1 else None,
        hint="check access to the store and run again; nothing was written to OUT",
    )
