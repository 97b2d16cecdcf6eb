"""Consolidate a ZeRO-1/2/3 checkpoint into a Hugging Face safetensors model folder.

Three steps, each usable on its own (the Prefect layer runs the units as tasks):

1. `plan_consolidation(index, options)` is pure: for every output tensor it lists the runs of source
   elements that make it (fp32 master-weight fragments for trainable parameters, module copies for
   frozen ones, buffers as saved) and packs the tensors into shards as `save_pretrained` does. One
   `ShardUnit` per output shard.
2. `prepare_output` checks OUT and the free space and makes a staging folder beside OUT;
   `run_unit` streams one shard into it: a safetensors header first, then the tensors in bounded
   batches of byte-range reads (one `fs.cat_ranges` round per batch on a bucket, memory-mapped
   windows on a local disk), cast on the way (with numpy, `ckptflow.casts`: no torch), hashed as
   written, and with `verify` read back and checked against the source: on a local disk by a
   checker thread that follows the writer, range by range; on a bucket once the object is written.
3. `finalize` adds the config and tokenizer files, a provenance record and the shard index, then
   moves the staging folder into place: one rename on a local disk, file by file (server-side
   copies) with the index last on a bucket. `abort` removes the staging folder.

`consolidate(src, out, ...)` runs all three with a thread per unit. Memory stays at a few batch
buffers per worker whatever the model size; only the fp32 master weights are read, never the
optimizer moments, and never a 16-bit module copy where an fp32 master exists.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import posixpath
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ckptflow import hf
from ckptflow.casts import cast_into
from ckptflow.errors import (
    CheckpointError,
    CkptflowError,
    CorruptFileError,
    OutputError,
    SourceReadError,
)
from ckptflow.storage import check_space, is_local, join, local_path, mapped, open_fs, read_ranges
from ckptflow.torchzip import DTYPE_SIZES, TensorRef
from ckptflow.zero import Param, ZeroCheckpoint, load_index, zero3_piece

logger = logging.getLogger(__name__)

Progress = Callable[[int, int], None]

PROVENANCE_NAME = "ckptflow_provenance.json"
DEFAULT_CHUNK_BYTES = 32 << 20


# ---- options --------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ConsolidateOptions:
    """How to consolidate.

    `dtype` is "fp32", "bf16" or "fp16" (torch names such as "bfloat16" are accepted too);
    `max_shard_size` is bytes or a string such as "5GB"; `chunk_bytes` bounds each read batch, and so
    the memory per worker (about three batches).
    """

    dtype: str = "fp32"
    max_shard_size: int | str = "5GB"
    exclude_frozen: bool = False
    workers: int = 4
    verify: bool = True
    chunk_bytes: int = DEFAULT_CHUNK_BYTES

    def __post_init__(self) -> None:
        names = {**hf.OUTPUT_DTYPES, **{v: v for v in hf.OUTPUT_DTYPES.values()}}
        if self.dtype not in names:
            raise ValueError(f"dtype must be one of fp32, bf16, fp16, got {self.dtype!r}")
        short = {v: k for k, v in hf.OUTPUT_DTYPES.items()}
        object.__setattr__(self, "dtype", short.get(self.dtype, self.dtype))
        object.__setattr__(self, "max_shard_size", hf.parse_size(self.max_shard_size))
        if not isinstance(self.workers, int) or self.workers < 1:
            raise ValueError(f"workers must be a positive integer, got {self.workers!r}")
        if self.chunk_bytes < 64:
            raise ValueError(f"chunk_bytes must be at least 64, got {self.chunk_bytes}")

    @property
    def torch_dtype(self) -> str:
        """The output dtype as torch names it ("float32", "bfloat16", "float16")."""
        return hf.OUTPUT_DTYPES[self.dtype]


# ---- the plan -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """`numel` elements of the source tensor `ref` from its element `start`, landing at element
    `offset` of an output tensor."""

    ref: TensorRef
    start: int
    numel: int
    offset: int

    @property
    def byte_range(self) -> tuple[int, int]:
        return self.ref.element_range(self.start, self.numel)


@dataclass(frozen=True)
class OutputTensor:
    """One tensor of the output: its name, dtype and shape, and the source runs that fill it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    runs: tuple[Run, ...]
    kind: str  # "param", "frozen" or "buffer"

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * hf.itemsize(self.dtype)


@dataclass(frozen=True)
class ShardUnit:
    """One output shard: an independent unit of work."""

    index: int
    filename: str
    tensors: tuple[OutputTensor, ...]

    @property
    def nbytes(self) -> int:
        """Tensor bytes in this shard (the header not counted)."""
        return sum(t.nbytes for t in self.tensors)

    @property
    def source_bytes(self) -> int:
        return sum(r.numel * r.ref.itemsize for t in self.tensors for r in t.runs)

    def layout(self) -> hf.SafetensorsLayout:
        return hf.safetensors_layout([(t.name, t.dtype, t.shape) for t in self.tensors], {"format": "pt"})


@dataclass(frozen=True)
class ConsolidationPlan:
    """Everything `run_unit` and `finalize` need, computed from the index alone."""

    root: str
    tag: str
    step: int
    stage: int
    world_size: int
    precision: str
    ds_version: str
    options: ConsolidateOptions
    units: tuple[ShardUnit, ...]
    tied: Mapping[str, str]
    excluded: tuple[str, ...]

    @property
    def dtype(self) -> str:
        return self.options.torch_dtype

    @property
    def sharded(self) -> bool:
        return len(self.units) > 1

    @property
    def total_size(self) -> int:
        return sum(u.nbytes for u in self.units)

    @property
    def total_parameters(self) -> int:
        return sum(t.numel for u in self.units for t in u.tensors if t.kind != "buffer")

    @property
    def source_bytes(self) -> int:
        return sum(u.source_bytes for u in self.units)

    @property
    def weight_map(self) -> dict[str, str]:
        return {t.name: u.filename for u in self.units for t in u.tensors}

    @property
    def file_bytes(self) -> int:
        """Bytes of all shard files, headers included."""
        return sum(u.layout().file_size for u in self.units)


def plan_consolidation(index: ZeroCheckpoint, options: ConsolidateOptions | None = None) -> ConsolidationPlan:
    """The consolidation of `index` under `options`: output tensors in state-dict order, packed into
    shards as `save_pretrained` packs them. Pure: reads nothing.

    Tied parameters are written once, under the owner's name (transformers ties the alias on load);
    frozen parameters are left out with `exclude_frozen`; buffers keep their dtype.
    """
    options = options or ConsolidateOptions()
    params = index.param_by_name
    buffers = {b.name: b for b in index.buffers}
    names = [n for n in index.module_order if n in params or n in buffers]
    names += [n for n in [*params, *buffers] if n not in names]
    tensors: list[OutputTensor] = []
    excluded: list[str] = []
    for name in names:
        if name in index.tied:
            continue
        if name in buffers:
            ref = buffers[name].ref
            tensors.append(OutputTensor(name, ref.dtype, ref.shape, (whole_run(ref, name),), "buffer"))
            continue
        param = params[name]
        if param.frozen and options.exclude_frozen:
            excluded.append(name)
            continue
        runs = frozen_runs(index, param) if param.frozen else trainable_runs(index, param)
        check_coverage(name, param.numel, runs)
        kind = "frozen" if param.frozen else "param"
        tensors.append(OutputTensor(name, options.torch_dtype, param.shape, runs, kind))
    if not tensors:
        raise CheckpointError(
            f"{index.root}/{index.tag} has nothing to write: no parameters or buffers"
            + (" once frozen parameters are excluded" if excluded else ""), uri=index.root,
            hint="drop --exclude-frozen" if excluded else "check the source is the checkpoint you meant",
        )
    written = {t.name for t in tensors}
    shards = hf.pack_shards([(t.name, t.nbytes) for t in tensors], options.max_shard_size)
    by_name = {t.name: t for t in tensors}
    units = tuple(
        ShardUnit(i, hf.shard_filename(i, len(shards)), tuple(by_name[n] for n in shard))
        for i, shard in enumerate(shards)
    )
    return ConsolidationPlan(
        root=index.root, tag=index.tag, step=index.step, stage=index.stage, world_size=index.world_size,
        precision=index.precision, ds_version=index.ds_version, options=options, units=units,
        tied={a: o for a, o in index.tied.items() if o in written}, excluded=tuple(excluded),
    )


def trainable_runs(index: ZeroCheckpoint, param: Param) -> tuple[Run, ...]:
    """The fp32 master-weight runs of a trainable parameter, one per fragment."""
    runs = []
    for frag in param.fragments:
        part = index.partitions[frag.rank][frag.group]
        if frag.offset + frag.numel > part.fp32.numel:
            raise CheckpointError(
                f"{param.name}: its fragment on rank {frag.rank} reaches element {frag.offset + frag.numel} of param "
                f"group {frag.group}, but {part.fp32.uri} saved {part.fp32.numel}", uri=part.fp32.uri, rank=frag.rank,
                tensor=param.name, hint="the rank files do not belong together; run `ckptflow validate`",
            )
        runs.append(Run(_contiguous(part.fp32, param.name), frag.offset, frag.numel, frag.param_offset))
    return tuple(runs)


def frozen_runs(index: ZeroCheckpoint, param: Param) -> tuple[Run, ...]:
    """A frozen parameter's runs: ZeRO-3 per-rank pieces of ceil(numel / world size) elements, trimmed;
    ZeRO-1/2 one full tensor (the module copy, the only value a frozen parameter has)."""
    numel = param.numel
    if index.stage != 3 or len(param.frozen_pieces) == 1 and index.world_size == 1:
        if len(param.frozen_pieces) != 1:
            raise CheckpointError(f"frozen parameter {param.name} has {len(param.frozen_pieces)} saved copies, "
                                  "expected 1", tensor=param.name, hint="run `ckptflow validate` on the source")
        return (Run(_contiguous(param.frozen_pieces[0], param.name), 0, numel, 0),)
    piece = zero3_piece(numel, index.world_size)
    runs = []
    for rank, ref in enumerate(param.frozen_pieces):
        take = max(0, min(piece, numel - rank * piece))
        if take:
            runs.append(Run(_contiguous(ref, param.name), 0, take, rank * piece))
    return tuple(runs)


def whole_run(ref: TensorRef, name: str) -> Run:
    return Run(_contiguous(ref, name), 0, ref.numel, 0)


def check_coverage(name: str, numel: int, runs: Sequence[Run]) -> None:
    """Runs must tile [0, numel) exactly: no gap (padding would leak in), no overlap."""
    pos = 0
    for run in sorted(runs, key=lambda r: r.offset):
        if run.offset != pos or run.numel <= 0 or run.start + run.numel > run.ref.numel:
            break
        pos += run.numel
    else:
        if pos == numel:
            return
    raise CheckpointError(
        f"{name}: its saved pieces do not add up to its {numel} elements", tensor=name, expected=numel,
        hint="the checkpoint's partition metadata is inconsistent; run `ckptflow validate` on it",
    )


def _contiguous(ref: TensorRef, name: str) -> TensorRef:
    if not ref.is_contiguous:
        raise CheckpointError(
            f"{name}: its saved tensor in {ref.uri} is a strided view", file=ref.uri, tensor=name,
            hint="ckptflow reads contiguous tensors by byte range; re-save the checkpoint with DeepSpeed",
        )
    return ref


# ---- batches: what one unit reads and writes, chunk by chunk (pure) --------------------------------


@dataclass(frozen=True)
class Copy:
    """Bytes [start, end) of `uri`, elements of `dtype`, copied to byte `dest` of the batch's output
    buffer as `out_dtype` (cast when the two differ)."""

    uri: str
    start: int
    end: int
    dtype: str
    dest: int
    out_dtype: str


@dataclass(frozen=True)
class Batch:
    """One bounded step of writing a shard: the data bytes [file_start, file_start + out_nbytes),
    made of `copies` that read `src_nbytes` source bytes in all."""

    file_start: int
    out_nbytes: int
    src_nbytes: int
    copies: tuple[Copy, ...]


def plan_batches(slots: Sequence[tuple[str, int, tuple[Run, ...]]], chunk_bytes: int) -> list[Batch]:
    """Cut a shard's data into batches of at most `chunk_bytes` output bytes and source bytes each.

    `slots` is (output dtype, byte offset in the data section, runs) per tensor in file order.
    Copies of adjacent source bytes to adjacent output bytes are merged into one.
    """
    batches: list[Batch] = []
    copies: list[Copy] = []
    file_start: int | None = None
    out_used = src_used = 0
    for dtype, begin, runs in slots:
        out_size = DTYPE_SIZES[dtype]
        numel = sum(r.numel for r in runs)
        per_elem = max([out_size] + [r.ref.itemsize for r in runs])
        ordered = sorted(runs, key=lambda r: r.offset)
        pos = 0
        while pos < numel:
            room = (chunk_bytes - max(out_used, src_used)) // per_elem
            if room <= 0:
                assert file_start is not None
                batches.append(Batch(file_start, out_used, src_used, tuple(copies)))
                copies, file_start, out_used, src_used = [], None, 0, 0
                continue
            if file_start is None:
                file_start = begin + pos * out_size
            end = min(numel, pos + room)
            for run in ordered:
                lo, hi = max(pos, run.offset), min(end, run.offset + run.numel)
                if lo < hi:
                    start, stop = run.ref.element_range(run.start + (lo - run.offset), hi - lo)
                    _append_copy(copies, Copy(run.ref.uri, start, stop, run.ref.dtype,
                                              out_used + (lo - pos) * out_size, dtype))
                    src_used += stop - start
            out_used += (end - pos) * out_size
            pos = end
    if file_start is not None:
        batches.append(Batch(file_start, out_used, src_used, tuple(copies)))
    return batches


def _append_copy(copies: list[Copy], copy: Copy) -> None:
    last = copies[-1] if copies else None
    if last is not None and (last.uri, last.end, last.dtype, last.out_dtype) == (copy.uri, copy.start, copy.dtype,
                                                                                 copy.out_dtype) and \
            last.dest + (last.end - last.start) // DTYPE_SIZES[last.dtype] * DTYPE_SIZES[last.out_dtype] == copy.dest:
        copies[-1] = Copy(last.uri, last.start, copy.end, last.dtype, last.dest, last.out_dtype)
    else:
        copies.append(copy)


# ---- running one unit -----------------------------------------------------------------------------


class Cancelled(Exception):
    """Raised inside a unit when another unit failed and the run is being stopped."""


@dataclass(frozen=True)
class UnitResult:
    """One shard written (and, when `verified`, reopened and checked against the source)."""

    index: int
    filename: str
    size: int
    sha256: str
    verified: bool


def run_unit(
    plan: ConsolidationPlan,
    unit: ShardUnit,
    staging: str,
    *,
    verify: bool | None = None,
    progress: Progress | None = None,
    cancel: threading.Event | None = None,
) -> UnitResult:
    """Write shard `unit` of `plan` as `staging/<unit.filename>`; with `verify` (default: the plan's
    option) reopen it and check every byte against the source. Safe to run again: the file is rewritten.

    On a local disk the check runs while the shard is written: a checker thread re-reads each range
    of the file as soon as the writer has written it and compares it with its own read and cast of
    the source, and the writer's fsync overlaps the end of the check. On a bucket the object exists
    only once written, so the check follows the write.

    `progress(done, total)` counts this unit's bytes written plus, with `verify`, bytes checked.
    """
    from ckptflow.verify import verify_shard

    verify = plan.options.verify if verify is None else verify
    layout = unit.layout()
    by_name = {t.name: t for t in unit.tensors}
    batches = plan_batches([(s.dtype, s.begin, by_name[s.name].runs) for s in layout.slots], plan.options.chunk_bytes)
    uri = join(staging, unit.filename)
    total = unit.nbytes * (2 if verify else 1)
    done = [0, 0]  # bytes written, bytes checked

    def report(written: int | None = None, checked: int | None = None) -> None:
        done[0] = done[0] if written is None else written
        done[1] = done[1] if checked is None else checked
        if progress:
            progress(done[0] + done[1], total)

    stopped = (lambda: cancel.is_set()) if cancel is not None else (lambda: False)
    started = time.monotonic()
    if verify and is_local(uri):
        sha256 = _write_and_check(uri, layout, batches, report, stopped,
                                  lambda written: verify_shard(uri, unit.tensors, chunk_bytes=plan.options.chunk_bytes,
                                                               progress=lambda n, _t: report(checked=n),
                                                               written=written))
        logger.info("wrote and checked %s (%s) in %.2fs", uri, hf.format_size(layout.file_size),
                    time.monotonic() - started)
        return UnitResult(unit.index, unit.filename, layout.file_size, sha256, True)
    sha256 = _write_shard(uri, layout, batches, lambda n: report(written=n), stopped)
    logger.info("wrote %s (%s) in %.2fs", uri, hf.format_size(layout.file_size), time.monotonic() - started)
    if verify:
        if stopped():
            raise Cancelled(unit.filename)
        verify_shard(uri, unit.tensors, chunk_bytes=plan.options.chunk_bytes,
                     progress=lambda n, _total: report(checked=n))
    return UnitResult(unit.index, unit.filename, layout.file_size, sha256, verify)


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

    def wait_for(self, nbytes: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._bytes >= nbytes or self._abandoned)
            if self._bytes < nbytes:
                raise Cancelled(f"the write stopped before byte {nbytes}")


def _write_and_check(uri: str, layout: hf.SafetensorsLayout, batches: Sequence[Batch],
                     report: Callable[..., None], stopped: Callable[[], bool],
                     check: Callable[[Callable[[int], None]], Any]) -> str:
    """Write the shard on this thread while `check(written)` runs on another, `written(n)` blocking it
    until the first n bytes of the file are written. A failed write stops the check and is the error
    raised (a source that breaks fails both; the writer's error says it best); otherwise the check's
    error, if any. Returns the file's sha256."""
    mark = _Watermark()
    with ThreadPoolExecutor(1, thread_name_prefix="ckptflow-check") as pool:
        checking = pool.submit(check, mark.wait_for)
        try:
            sha256 = _write_shard(uri, layout, batches, lambda n: report(written=n), stopped, written=mark.advance)
        except BaseException:
            mark.abandon()
            raise
        checking.result()
    return sha256


def _write_shard(uri: str, layout: hf.SafetensorsLayout, batches: Sequence[Batch], report: Callable[[int], None],
                 stopped: Callable[[], bool], *, written: Callable[[int], None] | None = None) -> str:
    """Stream the shard: the header, then each batch. Three stages overlap, on up to three buffers:
    a reader thread fills batch i+2 (reads + casts) while this thread writes batch i+1 and a hasher
    thread hashes batch i. On a local disk a flusher thread keeps an fdatasync of what is written so
    far going, so the disk writes while the CPU casts and the final fsync has little left to do. `written(n)` is told each time the first n bytes of the file are out of
    this process (in the page cache on a local disk). Returns the file's sha256."""
    out_cap = max((b.out_nbytes for b in batches), default=0)
    buffers = [np.empty(out_cap, dtype=np.uint8) for _ in range(max(1, min(3, len(batches))))]
    hashed: list[Any] = [None] * len(buffers)  # the pending hash of what each buffer holds
    hasher = hashlib.sha256(layout.header)
    done = 0
    try:
        with _open_output(uri) as fh, ThreadPoolExecutor(1, thread_name_prefix="ckptflow-read") as reader, \
                ThreadPoolExecutor(1, thread_name_prefix="ckptflow-hash") as hashing, \
                ThreadPoolExecutor(1, thread_name_prefix="ckptflow-flush") as flusher:
            local = is_local(uri)
            flushing: Any = None  # a pending fdatasync of what has been written so far (local disk)

            def fill(j: int) -> Any:
                slot = j % len(buffers)
                if hashed[slot] is not None:
                    hashed[slot].result()
                return reader.submit(_fill, batches[j], buffers[slot])

            fh.write(layout.header)
            if written is not None:
                fh.flush()
                written(len(layout.header))
            depth = max(1, len(buffers) - 1)  # batches being filled ahead of the one being written
            pending = deque(fill(j) for j in range(min(depth, len(batches))))
            for i, batch in enumerate(batches):
                pending.popleft().result()
                if stopped():
                    raise Cancelled(uri)
                if i + depth < len(batches):
                    pending.append(fill(i + depth))
                view = memoryview(buffers[i % len(buffers)])[:batch.out_nbytes]
                hashed[i % len(buffers)] = hashing.submit(hasher.update, view)
                fh.write(view)
                done += batch.out_nbytes
                if local and (flushing is None or flushing.done()):
                    if flushing is not None:
                        flushing.result()
                    fh.flush()
                    flushing = flusher.submit(_datasync, fh.fileno())  # the disk writes while we cast
                if written is not None:
                    fh.flush()
                    written(len(layout.header) + done)
                report(done)
            for future in hashed:
                if future is not None:
                    future.result()
            if flushing is not None:
                flushing.result()
            if local:
                fh.flush()
                os.fsync(fh.fileno())
    except (CkptflowError, Cancelled):
        raise
    except EOFError as exc:
        raise _source_error(exc, [c.uri for b in batches for c in b.copies]) from exc
    except OSError as exc:
        raise OutputError(f"cannot write {uri} ({exc})", file=uri,
                          hint="check the destination is writable and has room, then run again") from exc
    return hasher.hexdigest()


_datasync = getattr(os, "fdatasync", os.fsync)  # macOS has no fdatasync


def _open_output(uri: str) -> Any:
    if is_local(uri):
        return open(local_path(uri), "wb")
    fs, path = open_fs(uri)
    return fs.open(path, "wb")


def _fill(batch: Batch, out: np.ndarray) -> None:
    """Copy (and cast) one batch's source bytes into `out` (uint8): local files through memory-mapped
    windows, other stores through one `fs.cat_ranges` round for the whole batch."""
    remote = [i for i, c in enumerate(batch.copies) if not is_local(c.uri)]
    try:
        fetched = read_ranges([(batch.copies[i].uri, batch.copies[i].start, batch.copies[i].end) for i in remote])
        blobs = dict(zip(remote, fetched))
        for i, copy in enumerate(batch.copies):
            numel = (copy.end - copy.start) // DTYPE_SIZES[copy.dtype]
            dest = out[copy.dest:copy.dest + numel * DTYPE_SIZES[copy.out_dtype]]
            blob = blobs.get(i)
            if blob is not None:
                cast_into(dest, copy.out_dtype, blob, copy.dtype)
                continue
            with mapped(copy.uri, copy.start, copy.end) as view:
                cast_into(dest, copy.out_dtype, view, copy.dtype)
    except OSError as exc:
        raise _source_error(exc, [c.uri for c in batch.copies]) from exc


def _source_error(exc: BaseException, uris: Sequence[str]) -> CkptflowError:
    files = sorted(set(uris))
    if isinstance(exc, EOFError):
        uri = str(exc).split(": ", 1)[0]
        return CorruptFileError(
            f"{exc}; the file is shorter than its own index says", file=uri,
            hint="the file was truncated or replaced while being read; copy it again and re-run",
        )
    return SourceReadError(
        f"cannot read the checkpoint: {type(exc).__name__}: {exc} (reading {', '.join(files)})",
        file=files[0] if len(files) == 1 else None,
        hint="check access to the store and run again; nothing was written to OUT",
    )


# ---- output folder: prepare, finalize, abort ------------------------------------------------------


@dataclass(frozen=True)
class ConsolidationResult:
    """What `consolidate` / `finalize` produced."""

    out: str
    shards: tuple[UnitResult, ...]
    side_files: tuple[str, ...]
    files: tuple[str, ...]
    total_size: int
    dtype: str
    verified: bool
    plan: ConsolidationPlan = field(repr=False, compare=False)


def prepare_output(plan: ConsolidationPlan, out: str) -> str:
    """Check that OUT is free (absent or an empty folder) and, on a local disk, that there is room;
    make and return a staging folder beside it."""
    fs, path = open_fs(out)
    _check_out_free(fs, path, out)
    parent, name = posixpath.split(path.rstrip("/"))
    staging = posixpath.join(parent, f".{name}.ckptflow-{uuid.uuid4().hex[:12]}.partial")
    if is_local(out):
        need = plan.file_bytes + _side_bytes(plan.root) + (1 << 20)
        check_space(parent or ".", need, out)
        try:
            os.makedirs(staging)
        except OSError as exc:
            raise OutputError(f"cannot create {staging} beside {out} ({exc})", file=out,
                              hint="check the destination folder is writable") from exc
        return staging
    staging_uri = f"{out.rstrip('/').rsplit('/', 1)[0]}/{posixpath.basename(staging)}"  # same scheme as OUT
    fs.makedirs(staging, exist_ok=True)
    return staging_uri


def _check_out_free(fs: Any, path: str, out: str) -> None:
    if not fs.exists(path):
        return
    if not fs.isdir(path):
        raise OutputError(f"{out} exists and is a file", file=out, hint="choose a folder name that does not exist")
    if fs.ls(path, detail=False):
        raise OutputError(f"{out} already exists and is not empty", file=out,
                          hint="choose a new folder, or remove this one first")


def _side_bytes(root: str) -> int:
    fs, path = open_fs(root)
    return sum(fs.size(posixpath.join(path, n)) for n in hf.find_side_files(root))


def ckptflow_version() -> str:
    """This package's version (from its metadata when an editable install hides `ckptflow.__version__`)."""
    try:
        from ckptflow import __version__

        return __version__
    except ImportError:
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("ckptflow")
        except PackageNotFoundError:
            return "unknown"


def provenance(plan: ConsolidationPlan, shards: Sequence[UnitResult]) -> dict[str, Any]:
    """The record written beside the model: where it came from and what each shard hashes to."""
    root = os.path.abspath(local_path(plan.root)) if is_local(plan.root) else plan.root
    return {
        "ckptflow_version": ckptflow_version(),
        "source": {
            "uri": join(root, plan.tag),
            "root": root,
            "tag": plan.tag,
            "step": plan.step,
            "zero_stage": plan.stage,
            "world_size": plan.world_size,
            "precision": plan.precision,
            "deepspeed_version": plan.ds_version,
        },
        "output": {
            "dtype": plan.dtype,
            "max_shard_size": plan.options.max_shard_size,
            "exclude_frozen": plan.options.exclude_frozen,
            "excluded": list(plan.excluded),
            "tied": dict(plan.tied),
            "total_size": plan.total_size,
            "total_parameters": plan.total_parameters,
            "verified": all(s.verified for s in shards),
        },
        "shards": {s.filename: {"sha256": s.sha256, "size": s.size} for s in sorted(shards, key=lambda s: s.index)},
    }


def finalize(plan: ConsolidationPlan, results: Sequence[UnitResult], staging: str, out: str) -> ConsolidationResult:
    """Add config, tokenizer, provenance and index to `staging`, then move it into place as OUT.

    Locally that is one rename of the folder (after every file is synced); on a bucket the files are
    copied server-side one by one, shards first and the index last, and the staging folder removed. Either way a reader never sees a folder that
    looks complete before it is.
    """
    got = {r.filename: r for r in results}
    for unit in plan.units:
        result = got.get(unit.filename)
        if result is None or result.size != unit.layout().file_size:
            raise OutputError(f"shard {unit.filename} has not been written to {staging}", file=unit.filename,
                              hint="run every unit of the plan before finalize")
    shards = tuple(got[u.filename] for u in plan.units)
    side = hf.find_side_files(plan.root)
    hf.copy_side_files(plan.root, side, staging, plan.dtype)
    fs, staging_path = open_fs(staging)
    record = json.dumps(provenance(plan, shards), indent=2, sort_keys=True) + "\n"
    fs.pipe_file(posixpath.join(staging_path, PROVENANCE_NAME), record.encode())
    order = [u.filename for u in plan.units] + list(side) + [PROVENANCE_NAME]
    if plan.sharded:
        text = hf.index_json(plan.weight_map, total_size=plan.total_size, total_parameters=plan.total_parameters)
        fs.pipe_file(posixpath.join(staging_path, hf.SAFE_WEIGHTS_INDEX_NAME), text.encode())
        order.append(hf.SAFE_WEIGHTS_INDEX_NAME)
    else:
        order = order[1:] + order[:1]  # the only shard goes last: it is what makes the folder loadable
    _publish(staging, out, order)
    verified = all(s.verified for s in shards)
    logger.info("consolidated %s/%s into %s: %d shard(s), %s %s%s", plan.root, plan.tag, out, len(shards),
                hf.format_size(plan.total_size), plan.dtype, ", verified" if verified else "")
    return ConsolidationResult(out=out, shards=shards, side_files=tuple(side), files=tuple(order),
                               total_size=plan.total_size, dtype=plan.dtype, verified=verified, plan=plan)


def _publish(staging: str, out: str, order: Sequence[str]) -> None:
    fs, out_path = open_fs(out)
    _check_out_free(fs, out_path, out)
    _, staging_path = open_fs(staging)
    if is_local(out):
        for name in order:
            with open(posixpath.join(staging_path, name), "rb+") as fh:
                os.fsync(fh.fileno())
        try:
            os.replace(staging_path, out_path)
        except OSError as exc:
            raise OutputError(f"cannot move {staging} to {out} ({exc})", file=out,
                              hint="OUT appeared while converting, or the destination refused the rename") from exc
        _fsync_dir(posixpath.dirname(out_path) or ".")
        return
    moved = []
    try:
        fs.makedirs(out_path, exist_ok=True)  # a no-op on object stores; needed where folders are real
        for name in order:  # server-side copies (every store has them; not every store has a move)
            fs.copy(posixpath.join(staging_path, name), posixpath.join(out_path, name))
            moved.append(name)
    except Exception as exc:
        for name in moved:
            try:
                fs.rm_file(posixpath.join(out_path, name))
            except Exception:  # best effort: the error below is the one to report
                logger.warning("could not remove %s after a failed move", posixpath.join(out_path, name))
        raise OutputError(f"cannot move the output into {out} ({exc})", file=out,
                          hint="check access to the destination and run again") from exc
    abort(staging)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def abort(staging: str) -> None:
    """Remove the staging folder (after a failure, or what is left of it after a move)."""
    try:
        fs, path = open_fs(staging)
        if fs.exists(path):
            fs.rm(path, recursive=True)
    except Exception as exc:  # cleanup must not hide the error that brought us here
        logger.warning("could not remove the staging folder %s (%s); remove it by hand", staging, exc)


# ---- all together ---------------------------------------------------------------------------------


def run_units(plan: ConsolidationPlan, staging: str, *, progress: Progress | None = None) -> list[UnitResult]:
    """Run every unit on `plan.options.workers` threads; the first failure stops the others."""
    total = sum(u.nbytes for u in plan.units) * (2 if plan.options.verify else 1)
    done: dict[int, int] = {}
    lock = threading.Lock()
    cancel = threading.Event()

    def report(index: int) -> Progress:
        def update(unit_done: int, _unit_total: int) -> None:
            with lock:
                done[index] = unit_done
                if progress:
                    progress(sum(done.values()), total)
        return update

    if progress:
        progress(0, total)
    with ThreadPoolExecutor(min(plan.options.workers, len(plan.units)) or 1, thread_name_prefix="ckptflow-unit") as pool:
        futures = [pool.submit(run_unit, plan, u, staging, progress=report(u.index), cancel=cancel) for u in plan.units]
        try:
            finished, _ = wait(futures, return_when=FIRST_EXCEPTION)
        except BaseException:  # Ctrl-C: stop the running units at their next batch, drop the queued ones
            cancel.set()
            for f in futures:
                f.cancel()
            raise
        if any(f.exception() for f in finished):
            cancel.set()
            for f in futures:
                f.cancel()
            wait(futures)
            errors = [f.exception() for f in futures if not f.cancelled() and f.exception()]
            raise next((e for e in errors if not isinstance(e, Cancelled)), errors[0])  # type: ignore[misc]
        return [f.result() for f in futures]


def consolidate(
    src: str,
    out: str,
    *,
    tag: str | None = None,
    options: ConsolidateOptions | None = None,
    progress: Progress | None = None,
) -> ConsolidationResult:
    """Consolidate the ZeRO checkpoint at `src` into a Hugging Face model folder `out`.

    `src` is a folder holding `latest` or a tag folder, `out` a folder that does not exist yet (or is
    empty); both are local paths or fsspec URLs. `progress(done_bytes, total_bytes)` is called as
    shards are written and checked. On any error nothing is left at `out` and the staging folder is
    removed.
    """
    options = options or ConsolidateOptions()
    index = load_index(src, tag)
    plan = plan_consolidation(index, options)
    logger.info("plan: %d tensors in %d shard(s), %s %s from %s of source", sum(len(u.tensors) for u in plan.units),
                len(plan.units), hf.format_size(plan.total_size), plan.dtype, hf.format_size(plan.source_bytes))
    staging = prepare_output(plan, out)
    try:
        results = run_units(plan, staging, progress=progress)
        return finalize(plan, results, staging, out)
    except BaseException:
        abort(staging)
        raise


__all__ = [
    "Batch",
    "Cancelled",
    "Copy",
    "ConsolidateOptions",
    "ConsolidationPlan",
    "ConsolidationResult",
    "OutputTensor",
    "PROVENANCE_NAME",
    "Run",
    "ShardUnit",
    "UnitResult",
    "abort",
    "consolidate",
    "finalize",
    "plan_batches",
    "plan_consolidation",
    "prepare_output",
    "provenance",
    "run_unit",
    "run_units",
]
