"""Check a written safetensors shard against its source, byte for byte, without torch.

`verify_shard(uri, tensors)` reopens one shard and checks its header (names, dtypes, shapes, offsets,
size), that the safetensors library reads it, and every byte of every tensor against the source,
re-read through its own byte ranges (not the writer's batches) and cast to the output dtype.
`consolidate --verify` runs it on every shard before the output is moved into place. Every mismatch
raises `VerificationError` naming the tensor.

`read_source_into` is the independent source read it uses; the model check (`ckptflow.verify`) reads
the source through it too.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ckptflow.errors import VerificationError
from ckptflow.formats import hf
from ckptflow.formats.casts import cast_into, cast_rows_into, scalar
from ckptflow.formats.deepspeed.runs import Run
from ckptflow.plumbing.direct import BLOCK, O_DIRECT, aligned_buffer
from ckptflow.plumbing.progress import Progress
from ckptflow.plumbing.ranges import ShortRead, read_into
from ckptflow.plumbing.redaction import describe
from ckptflow.plumbing.storage import open_fs
from ckptflow.plumbing.stores.local import os_path


class SourceTensor(Protocol):
    """What the checks need of an output tensor (`ckptflow.consolidate.OutputTensor` is one)."""

    @property
    def name(self) -> str: ...

    @property
    def dtype(self) -> str: ...

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def runs(self) -> tuple[Run, ...]: ...


# ---- reading the source, independently of the writer ----------------------------------------------


class _Bytes:
    """Byte ranges as buffers, valid inside `with bytes.get(...)`: a range read (`preadv` on a local
    disk, never a memory map: a source truncated meanwhile must be a read error, not a SIGBUS) into a
    reused scratch buffer."""

    def __init__(self, scratch_bytes: int) -> None:
        self.scratch = np.empty(scratch_bytes, dtype=np.uint8)

    @contextlib.contextmanager
    def get(self, uri: str, start: int, end: int) -> Iterator[Any]:
        if self.scratch.size < end - start:
            self.scratch = np.empty(end - start, dtype=np.uint8)
        raw = self.scratch[:end - start]
        read_into([(uri, start, end, raw.data)])
        yield raw


class _ShardBytes(_Bytes):
    """The shard's own bytes, read back in windows of up to `window` bytes, with direct I/O where its
    file system takes it: from the disk itself (not what the page cache kept of the write), into
    page-aligned memory, with no copy into the page cache. A window starts on the block before the
    range asked for and covers the chunks after it too, so that tensors of a few hundred KB are not
    each a round trip to the disk. `written`, when set, is how many leading bytes of the file the
    writer has written: a window never keeps bytes past it."""

    def __init__(self, uri: str, window: int) -> None:
        self.uri, self.window, self.path = uri, window, os_path(uri)
        self.fd: int | None = None if O_DIRECT and self.path is not None else -1  # opened at the first read
        self.scratch = np.frombuffer(aligned_buffer(window + 2 * BLOCK), dtype=np.uint8)
        self.lo = self.hi = 0  # the scratch holds file bytes [lo, hi)
        self.written: int | None = None

    def close(self) -> None:
        if self.fd is not None and self.fd >= 0:
            os.close(self.fd)
        self.fd = -1

    def _open(self) -> int:
        if self.fd is None:
            try:
                self.fd = os.open(self.path, os.O_RDONLY | O_DIRECT) if self.path is not None else -1
            except OSError:
                self.fd = -1
        return self.fd

    @contextlib.contextmanager
    def get(self, uri: str, start: int, end: int) -> Iterator[Any]:
        if uri != self.uri or self._open() < 0:
            with super().get(uri, start, end) as raw:
                yield raw
            return
        if not (self.lo <= start and end <= self.hi):
            try:
                self._read(start, end)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.close()  # the file system takes direct writes but not these reads: the page cache then
                with super().get(uri, start, end) as raw:
                    yield raw
                return
        yield self.scratch[start - self.lo:end - self.lo]

    def _read(self, start: int, end: int) -> None:
        assert end - start <= self.window
        valid = max(end, self.written) if self.written is not None else None
        lo = start - start % BLOCK
        hi = lo + self.window if valid is None else max(end, min(lo + self.window, valid))
        hi = -(-hi // BLOCK) * BLOCK
        self.lo = self.hi = lo
        pos = lo
        while pos < hi:
            n = os.preadv(self._open(), [self.scratch.data[pos - lo:hi - lo]], pos)
            if n <= 0:
                break
            pos += n
        if pos < end:
            raise ShortRead(self.uri, start, end, max(0, pos - start))
        self.hi = pos if valid is None else min(pos, valid)


def read_source_into(tensor: SourceTensor, lo: int, hi: int, out: np.ndarray, dtype: str,
                     source: _Bytes | None = None) -> None:
    """Fill `out` (the bytes of hi - lo elements of `dtype`) from the source runs, each run's byte
    range computed here from its `TensorRef` (not taken from the writer's batches), and cast."""
    source = source or _Bytes(0)
    size = hf.itemsize(dtype)
    for part in (part for run in tensor.runs for part in run.within(lo, hi)):
        start, end = part.ref.element_range(part.start, part.numel)
        dest = out[(part.offset - lo) * size:]
        try:
            with source.get(part.ref.uri, start, end) as raw:
                if part.rows > 1:
                    cast_rows_into(dest, dtype, raw, part.ref.dtype, part.rows, part.numel // part.rows * size,
                                   part.stride * size)
                else:
                    cast_into(dest[:part.numel * size], dtype, raw, part.ref.dtype)
        except (OSError, EOFError) as exc:
            raise VerificationError(
                f"cannot read the source again to check the output ({describe(exc)})", file=part.ref.uri,
                hint="the checkpoint changed or became unreadable while converting; run again",
            ) from exc


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Byte equality of two uint8 arrays, compared eight bytes at a time where the length allows."""
    if a.size != b.size:
        return False
    for word in (np.uint64, np.uint32, np.uint16):
        if a.size % np.dtype(word).itemsize == 0:
            return bool(np.array_equal(a.view(word), b.view(word)))
    return bool(np.array_equal(a, b))


# ---- one shard ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardCheck:
    """A shard that passed `verify_shard`."""

    uri: str
    tensors: int
    size: int
    sha256: str | None


def verify_shard(
    uri: str,
    tensors: Sequence[SourceTensor],
    *,
    sha256: str | None = None,
    chunk_bytes: int = 32 << 20,
    progress: Progress | None = None,
    written: Callable[[int], int | None] | None = None,
) -> ShardCheck:
    """Check the safetensors file at `uri` holds exactly `tensors`, each equal to its source cast to
    its dtype, byte for byte. With `sha256`, also check the file hashes to it.

    With `written`, the check runs while the file is still being written: `written(n)` must return
    once the first n bytes of the file are written (and raise if they never will be); it may return
    how many are. Each range is then read back as soon as it exists, and the whole-file checks (size,
    header, what the safetensors library sees) come last instead of first. `progress(done, total)`
    counts the tensor bytes checked.
    """
    expected = hf.safetensors_file([(t.name, t.dtype, t.shape) for t in tensors], {"format": "pt"})
    size = _check_file(uri, expected) if written is None else 0
    hasher = hashlib.sha256(expected.header) if sha256 else None  # the file's own header is checked to be this
    _compare_data(uri, expected, {t.name: t for t in tensors}, chunk_bytes, hasher, progress, written)
    if written is not None:  # the file is whole now: the whole-file checks
        written(expected.file_size)
        size = _check_file(uri, expected)
    if hasher is not None and hasher.hexdigest() != sha256:
        raise VerificationError(f"{uri} hashes to {hasher.hexdigest()}, but {sha256} was recorded when it was "
                                "written", file=uri, expected=sha256, actual=hasher.hexdigest(),
                                hint="the file changed after it was written; run again")
    return ShardCheck(uri, len(expected.slots), size, sha256)


def _chunks(shard: hf.SafetensorsFile, step: int) -> list[tuple[hf.TensorSlot, int, int]]:
    """(slot, first element, end element) of every chunk of at most `step` elements, in file order."""
    out = []
    for slot in shard.slots:
        count = (slot.end - slot.begin) // hf.itemsize(slot.dtype)
        out += [(slot, lo, min(count, lo + step)) for lo in range(0, count, step)]
    return out


def _compare_data(uri: str, expected: hf.SafetensorsFile, by_name: dict[str, SourceTensor], chunk_bytes: int,
                  hasher: Any, progress: Progress | None, written: Callable[[int], int | None] | None) -> None:
    """Compare every chunk of the file's data with the source's. The source side of the next
    `_AHEAD` chunks is read and cast on a helper thread while chunk i is compared here (and, while the
    file is still being written, while this thread waits for the writer)."""
    step = max(8, chunk_bytes // 8)  # elements per chunk: at most chunk_bytes of the widest dtype
    chunks = _chunks(expected, step)
    wants = [np.empty(step * 8, dtype=np.uint8) for _ in range(min(_AHEAD, len(chunks)))]
    shard, source = _ShardBytes(uri, step * 8), _Bytes(step * 8)
    total = expected.file_size - expected.data_start
    done = 0

    def expect(i: int) -> np.ndarray:
        """Chunk i as the source says it must be (read + cast), in a buffer of its own."""
        slot, lo, hi = chunks[i]
        want = wants[i % len(wants)][:(hi - lo) * hf.itemsize(slot.dtype)]
        read_source_into(by_name[slot.name], lo, hi, want, slot.dtype, source)
        return want

    with ThreadPoolExecutor(1, thread_name_prefix="ckptflow-verify") as helper, contextlib.closing(shard):
        pending = deque(helper.submit(expect, i) for i in range(len(wants)))
        for i, (slot, lo, hi) in enumerate(chunks):
            want = pending.popleft().result()
            nbytes = (hi - lo) * hf.itemsize(slot.dtype)
            start = expected.data_start + slot.begin + lo * hf.itemsize(slot.dtype)
            if written is not None:
                mark = written(start + nbytes)
                shard.written = mark if isinstance(mark, int) else start + nbytes
            _compare_chunk(uri, shard, start, want, slot, lo, hasher)
            if i + len(wants) < len(chunks):  # chunk i's buffer is free again
                pending.append(helper.submit(expect, i + len(wants)))
            done += nbytes
            if progress:
                progress(done, total)


_AHEAD = 3  # source chunks read and cast ahead of the comparison


def _compare_chunk(uri: str, shard: _Bytes, start: int, want: np.ndarray, slot: hf.TensorSlot, lo: int,
                   hasher: Any) -> None:
    try:
        with shard.get(uri, start, start + want.size) as view:
            got = np.frombuffer(view, dtype=np.uint8)
            if not _same_bytes(got, want):
                _raise_mismatch(uri, slot.name, slot.dtype, got, want, lo)
            if hasher is not None:
                hasher.update(view)
            del got
    except (OSError, EOFError) as exc:
        raise VerificationError(f"cannot read {slot.name} back from {uri} ({describe(exc)})", file=uri,
                                tensor=slot.name, hint="the shard is damaged; run again") from exc


def _check_file(uri: str, expected: hf.SafetensorsFile) -> int:
    """The file's size and header are the planned ones and the safetensors library reads it (on a
    local disk). Returns the size."""
    fs, path = open_fs(uri)
    try:
        size: int = fs.size(path)
        head = fs.cat_file(path, start=0, end=min(size, 8))
        length = 8 + int.from_bytes(head, "little") if len(head) == 8 else 0
        prefix = fs.cat_file(path, start=0, end=min(size, length, 8 + (100 << 20)))
    except (OSError, ValueError) as exc:
        raise VerificationError(
            f"cannot reopen {uri} ({describe(exc)})", file=uri, hint="the shard was not written"
        ) from exc
    _check_header(uri, prefix, expected)
    if size != expected.file_size:
        raise VerificationError(f"{uri} holds {size} bytes, expected {expected.file_size}", file=uri,
                                expected=expected.file_size, actual=size, hint="the write was cut short; run again")
    local = os_path(uri)
    if local is not None:
        _check_with_safetensors(local, [s.name for s in expected.slots])
    return size


def _check_header(uri: str, prefix: bytes, expected: hf.SafetensorsFile) -> None:
    try:
        _, header = hf.read_header(prefix)
    except ValueError as exc:
        raise VerificationError(f"{uri} has no readable safetensors header ({describe(exc)})", file=uri,
                                hint="the shard is damaged; run again") from None
    header.pop("__metadata__", None)
    want = {s.name: s for s in expected.slots}
    for name in sorted(set(header) - set(want)):
        raise VerificationError(f"{uri} holds tensor {name}, which is not in the plan", file=uri, tensor=name)
    for name in sorted(set(want) - set(header)):
        raise VerificationError(f"{uri} lacks tensor {name}", file=uri, tensor=name)
    for name in sorted(want):
        entry, slot = header[name], want[name]
        wanted = {"dtype": hf.SAFETENSORS_DTYPES[slot.dtype][0], "shape": list(slot.shape),
                  "data_offsets": [slot.begin, slot.end]}
        if entry != wanted:
            raise VerificationError(f"{uri}: tensor {name} is recorded as {entry}, expected {wanted}", file=uri,
                                    tensor=name, expected=wanted, actual=entry)
    if prefix != expected.header:
        raise VerificationError(f"{uri}: the header differs from the planned one", file=uri,
                                hint="the shard is damaged; run again")


def _check_with_safetensors(path: str, names: list[str]) -> None:
    """The safetensors library itself must accept the file and see the same tensors."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="numpy") as f:  # the header is all that is read: no torch needed
            keys = sorted(f.keys())
    except (SafetensorError, OSError) as exc:
        raise VerificationError(f"safetensors cannot open {path} ({describe(exc)})", file=path,
                                hint="the shard is damaged; run again") from None
    if keys != sorted(names):
        raise VerificationError(f"safetensors sees other tensors in {path} than were planned", file=path)


def _raise_mismatch(uri: str, name: str, dtype: str, got: np.ndarray, want: np.ndarray, lo: int) -> None:
    item = hf.itemsize(dtype)
    first = int(np.argmax((got.reshape(-1, item) != want.reshape(-1, item)).any(axis=1)))
    value = scalar(got[first * item:(first + 1) * item].tobytes(), dtype)
    expected = scalar(want[first * item:(first + 1) * item].tobytes(), dtype)
    raise VerificationError(
        f"tensor {name} in {uri} differs from the source at element {lo + first}: the file holds "
        f"{value!r}, the source gives {expected!r}", file=uri, tensor=name,
        expected=expected, actual=value, hint="the output is wrong; report this as a ckptflow bug",
    )


__all__ = ["ShardCheck", "SourceTensor", "read_source_into", "verify_shard"]
