"""Every output is built in a hidden sibling and moved into place whole, its marker file last.

`prepare(out)` checks OUT is free (absent, or an empty folder), on a local disk that the output fits,
and makes the staging folder `.<name>.ckptflow-<random>.partial` beside OUT. Units write into it.
`commit(staging, last=[...])` moves it into place as OUT:

- on a local disk: every file synced (with `durable`), then one rename of the folder, then the
  parent folder synced, so OUT appears complete or not at all;
- on a bucket (no rename there): server-side copies of every file (`COPIES` at once: a 405B
  reshard is 1,500 objects and 4.9 TB, which one copy at a time would take hours on S3), the files
  named in `first` before and those in `last` after all the others, one by one and in that order,
  so the marker a reader trusts (an index, `latest`, a manifest) appears last; a failed copy removes
  every copy this commit made.

`abort(staging)` removes the staging folder after a failure and never raises. A staging folder is
never mistaken for an output: it is hidden, and named after the run that made it.

Units may run in other processes or on other machines (a Dask cluster). Each reports what it wrote as
a `Written` (`written(uri, ...)`: the size, the checksums of the bytes it sent in the encodings the
store reports, and the store's stamp of the object right after), and the coordinator checks every one
against the store's metadata (`check_written`) before it writes the marker: right size, and the
store's own crc32c/md5 equal to the unit's (GCS, single-part S3), or else the very version the unit
finished (multipart S3 ETag, local size and mtime). Nothing is read back for it.
"""

from __future__ import annotations

import logging
import os
import posixpath
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ckptflow.errors import OutputError, VerificationError
from ckptflow.plumbing.checksums import Digests, StoreChecksum, stamps_match
from ckptflow.plumbing.redaction import describe
from ckptflow.plumbing.storage import check_space, open_fs
from ckptflow.plumbing.stores import store_for
from ckptflow.plumbing.stores.local import os_path

logger = logging.getLogger(__name__)

SUFFIX = ".partial"
MARKER = ".ckptflow-"
COPIES = 32  # server-side copies in flight during a bucket commit


@dataclass(frozen=True)
class Staging:
    """A staging folder (`uri`) that becomes the output `out` when committed."""

    out: str
    uri: str

    def join(self, *parts: str) -> str:
        out = self.uri.rstrip("/")
        for part in parts:
            out = f"{out}/{part.strip('/')}"
        return out


def is_staging_name(name: str) -> bool:
    """Whether a file or folder name is one of our staging folders."""
    return name.startswith(".") and MARKER in name and name.endswith(SUFFIX)


def check_out_free(out: str) -> None:
    """Raise `OutputError` unless `out` is absent or an empty folder."""
    fs, path = open_fs(out)
    if not fs.exists(path):
        return
    if not fs.isdir(path):
        raise OutputError(f"{out} exists and is a file", code="out-exists", uri=out,
                          hint="choose a folder name that does not exist")
    if fs.ls(path, detail=False):
        raise OutputError(f"{out} already exists and is not empty", code="out-exists", uri=out,
                          hint="choose a new folder, or remove this one first")


def committed_files(out: str) -> dict[str, int]:
    """Every file under OUT (paths relative to it) and its size; {} when OUT is absent or an empty folder.

    What a step checks before it takes an output an earlier run committed (`not_this_output` otherwise):
    the commit moves a folder into place whole, its marker last, so a folder that holds its marker
    holds everything the run wrote."""
    fs, path = open_fs(out)
    fs.invalidate_cache(path)
    if not fs.exists(path):
        return {}
    if not fs.isdir(path):
        raise OutputError(f"{out} exists and is a file", code="out-exists", uri=out,
                          hint="choose a folder name that does not exist")
    return {posixpath.relpath(p, path): int(info.get("size") or 0)
            for p, info in fs.find(path, detail=True).items() if info.get("type") != "directory"}


def check_committed(out: str, present: Mapping[str, int], expected: Mapping[str, int]) -> None:
    """Raise `not_this_output` unless OUT's files (`committed_files`) are exactly `expected`: every one
    there at its size, nothing else."""
    for name, size in expected.items():
        if present.get(name) != size:
            raise not_this_output(out, f"its {name} is missing or not the {size} bytes this run writes")
    others = sorted(set(present) - set(expected))
    if others:
        raise not_this_output(out, f"it holds {others[0]}, which this run does not write")


def not_this_output(out: str, why: str) -> OutputError:
    """The error for an OUT that holds something other than the output a step was asked for."""
    return OutputError(f"{out} already exists and does not hold this output: {why}", code="out-exists", uri=out,
                       hint="remove it, or choose another folder")


def prepare(out: str, *, need: int = 0) -> Staging:
    """Check that `out` is free and (on a local disk) that `need` bytes fit beside it, and make a
    hidden staging folder next to it."""
    check_out_free(out)
    fs, path = open_fs(out)
    parent, name = posixpath.split(path.rstrip("/"))
    hidden = f".{name}{MARKER}{uuid.uuid4().hex[:12]}{SUFFIX}"
    if os_path(out) is not None and need:
        check_space(parent or ".", need, out)
    head, sep, _ = out.rstrip("/").rpartition("/")
    uri = f"{head}/{hidden}" if sep else hidden  # beside OUT, spelled as OUT is (scheme, relative path)
    try:
        fs.makedirs(posixpath.join(parent, hidden), exist_ok=False)
    except OSError as exc:
        raise OutputError(f"cannot create {uri} beside {out} ({describe(exc)})", code="out-unwritable",
                          uri=out, hint="check the destination folder is writable") from exc
    return Staging(out=out, uri=uri)


def commit(staging: Staging, *, first: Sequence[str] = (), last: Sequence[str] = (), durable: bool = True) -> None:
    """Move `staging` into place as its OUT. On a bucket the files (paths relative to the folder) are
    copied `first` first, in that order, then the rest, then `last` in that order. Raises `OutputError`
    when OUT appeared meanwhile or a move fails; the staging folder is then left for `abort`."""
    check_out_free(staging.out)
    here, there = os_path(staging.uri), os_path(staging.out)
    if here is not None and there is not None:
        _commit_local(here, there, durable)
        return
    fs, src = open_fs(staging.uri)
    _, dst = open_fs(staging.out)
    files = sorted(posixpath.relpath(p, src) for p in fs.find(src))
    ends = set(first) | set(last)
    body = [f for f in files if f not in ends]
    attempted: list[str] = []  # whatever may have reached OUT, removed again on failure

    def copy(rel: str) -> None:
        fs.copy(posixpath.join(src, rel), posixpath.join(dst, rel))

    try:
        fs.makedirs(dst, exist_ok=True)  # a no-op on object stores; needed where folders are real
        # Server-side copies: every store has them, not every store has a move.
        for rel in (f for f in first if f in files):
            attempted.append(rel)
            copy(rel)
        attempted += body
        pool = ThreadPoolExecutor(max_workers=max(1, min(COPIES, len(body))), thread_name_prefix="ckptflow-commit")
        try:
            for future in [pool.submit(copy, rel) for rel in body]:
                future.result()
        finally:  # after a failure: the queued copies are dropped, those in flight end
            pool.shutdown(wait=True, cancel_futures=True)
        for rel in (f for f in last if f in files):
            attempted.append(rel)
            copy(rel)
    except Exception as exc:  # whatever the store raised: the move's failure, what was moved removed, cause kept
        for rel in reversed(attempted):
            try:
                fs.rm_file(posixpath.join(dst, rel))
            except FileNotFoundError:
                pass
            except Exception:  # best effort: the error below is the one to report
                logger.warning("could not remove %s after a failed move", posixpath.join(dst, rel))
        raise OutputError(f"cannot move the output into {staging.out} ({describe(exc)})", code="out-unwritable",
                          uri=staging.out, hint="check access to the destination and run again") from exc
    abort(staging)


def _commit_local(src: str, dst: str, durable: bool) -> None:
    if durable:
        for folder, _dirs, names in os.walk(src):
            for name in names:
                with open(os.path.join(folder, name), "rb") as fh:
                    os.fsync(fh.fileno())
    try:
        if os.path.isdir(dst):
            os.rmdir(dst)  # empty: checked just before
        os.rename(src, dst)
    except OSError as exc:
        raise OutputError(f"cannot move {src} to {dst} ({describe(exc)})", code="out-unwritable", uri=dst,
                          hint="OUT appeared while converting, or the destination refused the rename") from exc
    if durable:  # the rename itself, and every folder's entries
        for folder, _dirs, _names in os.walk(dst):
            _fsync_dir(folder)
        _fsync_dir(os.path.dirname(os.path.abspath(dst)))


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Written:
    """One file a unit wrote into a staging folder, as the unit saw it once the file was closed."""

    name: str  # path inside the staging folder
    size: int
    checksums: tuple[StoreChecksum, ...] = ()  # of the bytes the unit wrote, as the store encodes them
    stamp: tuple[tuple[str, str], ...] = ()  # the store's identity of the object the unit left


def written(staging: Staging | str, name: str, size: int, digests: Digests | None = None) -> Written:
    """What a unit reports for file `name` of the staging folder (a `Staging` or its URI) once
    written: `size` bytes, hashed by `digests` as they went out."""
    uri = staging.join(name) if isinstance(staging, Staging) else f"{staging.rstrip('/')}/{name.strip('/')}"
    fs, path = open_fs(uri)
    fs.invalidate_cache(path)
    info = fs.info(path)
    return Written(name, size, digests.checksums() if digests is not None else (),
                   tuple(sorted(store_for(fs).stamp(info).items())))


def check_written(staging: Staging, files: Sequence[Written], sizes: Mapping[str, int]) -> None:
    """Before the commit: every file of `sizes` (name -> planned size) was reported by its unit and is
    in the staging folder at that size, holding what its unit wrote (see the module docstring).
    Reads only metadata. Raises `VerificationError` naming the first file that is not."""
    fs, root = open_fs(staging.uri)
    fs.invalidate_cache(root)
    store = store_for(fs)
    by_name = {w.name: w for w in files}
    for name, size in sizes.items():
        got = by_name.get(name)
        if got is None:
            raise VerificationError(f"{name} was planned but no unit reported writing it to {staging.uri}",
                                    file=name, hint="run every unit of the plan before finalize")
        try:
            info = fs.info(posixpath.join(root, name))
        except FileNotFoundError:
            raise VerificationError(f"{staging.join(name)} is missing although its unit reported writing it",
                                    file=staging.join(name), hint="something removed it; run again") from None
        found = int(info.get("size") or 0)
        if got.size != size or found != size:
            raise VerificationError(
                f"{staging.join(name)} holds {found} bytes; its unit wrote {got.size} and the plan says {size}",
                file=staging.join(name), expected=size, actual=found, hint="the write was cut short; run again")
        reported = store.checksum(info)
        mine = {c.kind: c.value for c in got.checksums}
        if reported is not None and reported.kind in mine:
            if mine[reported.kind] != reported.value:
                raise VerificationError(
                    f"{staging.join(name)}: the store's {reported.kind} is {reported.value}, but its unit wrote "
                    f"bytes whose {reported.kind} is {mine[reported.kind]}", file=staging.join(name),
                    expected=mine[reported.kind], actual=reported.value, hint="the object changed or was damaged "
                    "on the way; run again")
        elif got.stamp and not stamps_match(dict(got.stamp), store.stamp(info)):
            raise VerificationError(
                f"{staging.join(name)} is not the object its unit wrote (written as {dict(got.stamp)}, now "
                f"{store.stamp(info)})", file=staging.join(name), hint="another process rewrote it; run again")


def abort(staging: Staging | None) -> None:
    """Remove the staging folder and everything in it (after a failure); never raises."""
    if staging is None:
        return
    try:
        fs, path = open_fs(staging.uri)
        if fs.exists(path):
            fs.rm(path, recursive=True)
    except Exception as exc:  # cleanup must not hide the error that brought us here
        logger.warning("could not remove the staging folder %s (%s); remove it by hand", staging.uri, describe(exc))
