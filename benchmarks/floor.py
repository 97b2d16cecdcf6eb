"""The I/O floor of the reshard and MoE benchmarks: read the spec's byte ranges, write `out_bytes` the
way ckptflow writes storages (O_DIRECT from page-aligned memory where the file system takes it, the
unaligned tail through the page cache), maybe fsync. Run as a plain file, standard library only, so
that the measured process is Python and the I/O and nothing else:

    python benchmarks/floor.py SPEC.json OUT

SPEC: {"ranges": [[path, start, end], ...], "out_bytes": N, "fsync": true, "read_back": false}. With
`read_back` the written file is then read back whole with O_DIRECT, from the disk itself: what
`ckptflow consolidate --verify` adds to the I/O (it compares every byte on the disk with the source).
"""

from __future__ import annotations

import json
import mmap
import os
import sys
from pathlib import Path


def io_floor(spec_path: str, out: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    buffer = mmap.mmap(-1, 16 << 20)  # page-aligned, as O_DIRECT wants
    view = memoryview(buffer)
    for path, start, end in spec["ranges"]:
        with open(path, "rb", buffering=0) as fh:
            fh.seek(start)
            while start < end:
                start += fh.readinto(view[:min(len(view), end - start)]) or (end - start)
    total = spec["out_bytes"]
    aligned = total - total % 4096
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        direct = os.open(out, os.O_WRONLY | getattr(os, "O_DIRECT", 0))
    except OSError:
        direct = fd
    written = 0
    while written < total:
        n = min(len(view), (aligned if written < aligned else total) - written)
        written += os.pwrite(direct if written < aligned else fd, view[:n], written)
    if direct != fd:
        os.close(direct)
    if spec["fsync"]:
        os.fsync(fd)
    os.close(fd)
    if spec.get("read_back"):
        try:
            fd = os.open(out, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        except OSError:
            fd = os.open(out, os.O_RDONLY)
        done = 0
        while done < total:
            n = os.preadv(fd, [view], done)
            if n <= 0:
                break
            done += n
        os.close(fd)


def ranges_of(paths: list[str]) -> list[list[object]]:
    """Whole files as ranges."""
    return [[p, 0, Path(p).stat().st_size] for p in paths]


if __name__ == "__main__":
    io_floor(sys.argv[1], sys.argv[2])
