"""plumbing.direct: a file written in pieces of any length through `BlockWriter` (whole blocks with
O_DIRECT, the partial ones through the page cache) holds exactly the bytes a plain write gives."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest

from ckptflow.plumbing import direct
from ckptflow.plumbing.direct import BLOCK, BlockWriter, aligned_buffer, open_direct


def _write(path: Path, head: bytes, pieces: list[bytes]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    fast = open_direct(str(path))
    if fast < 0:
        os.close(fd)
        pytest.skip("this file system refuses direct I/O")
    try:
        blocks = BlockWriter(fd, fast, head)
        assert blocks.done == len(head) - len(head) % BLOCK
        buffer = np.frombuffer(aligned_buffer(BLOCK + max(map(len, pieces), default=0)), dtype=np.uint8)
        offset = len(head)
        for piece in pieces:
            place = BlockWriter.place(offset)
            buffer[place:place + len(piece)] = np.frombuffer(piece, dtype=np.uint8)
            done = blocks.write(memoryview(buffer), offset, len(piece))
            offset += len(piece)
            assert done % BLOCK == 0 and offset - BLOCK < done <= offset  # whole blocks out, the rest waits
        assert blocks.close() == offset
        os.ftruncate(fd, offset)  # the probe wrote a whole block
    finally:
        os.close(fast)
        os.close(fd)


@pytest.mark.parametrize("head_size", [0, 8, 4095, 4096, 4097, 9000])
def test_pieces_of_any_length_give_the_plain_bytes(head_size: int, tmp_path: Path) -> None:
    rng = random.Random(head_size)
    head = rng.randbytes(head_size)
    lengths = [1, 7, 4096, 4089, 3, 12_288, 100_001, 2, 8191, 0, 65_536, 5]  # inside a block, across, exact
    pieces = [rng.randbytes(n) for n in lengths]
    out = tmp_path / "out.bin"
    _write(out, head, pieces)
    assert out.read_bytes() == head + b"".join(pieces)


def test_a_file_smaller_than_a_block(tmp_path: Path) -> None:
    out = tmp_path / "small.bin"
    _write(out, b"header", [b"abc", b"", b"defg"])
    assert out.read_bytes() == b"headerabcdefg"


def test_no_direct_io_where_the_system_has_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(direct, "O_DIRECT", 0)
    path = tmp_path / "f"
    path.touch()
    assert open_direct(str(path)) == -1
