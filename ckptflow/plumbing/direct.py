"""Direct I/O on a local disk: whole blocks written from page-aligned memory straight to the device.

A buffered write copies every byte into the page cache first; for the multi-gigabyte files the
conversions write, that copy (and the page cache it fills, on a machine whose memory was never touched
before: each new page is a fault in a virtual machine) costs more than reading the source. With
`O_DIRECT` the data goes from our buffer to the disk. Offsets, lengths and memory must be aligned to
`BLOCK`; where the file system refuses direct I/O (tmpfs on older kernels, some network and FUSE file
systems), `open_direct` says so and the caller writes through the page cache.

- `open_direct(path)`: a second, direct descriptor of an open file, or -1.
- `aligned_buffer(nbytes)`: page-aligned memory to write from.
- `BlockWriter`: a file written front to back, in pieces of any length: whole blocks go out directly,
  the bytes of a block not yet full wait for the next piece, the last partial block is written through
  the page cache at the end.
"""

from __future__ import annotations

import mmap
import os

BLOCK = 4096  # alignment of offsets, lengths and memory (no logical block size in use is larger)
O_DIRECT = getattr(os, "O_DIRECT", 0)  # 0 where there is none; tests set it to 0 for the page-cache path


def open_direct(path: str) -> int:
    """A second descriptor of the file at `path` with O_DIRECT, or -1 where the file system refuses
    direct I/O or our alignment: one block of zeros is written at offset 0 to find out (the caller's
    own bytes overwrite it; a file shorter than a block is truncated back by the caller)."""
    if not O_DIRECT:
        return -1
    try:
        fd = os.open(path, os.O_WRONLY | O_DIRECT)
    except OSError:
        return -1
    probe = mmap.mmap(-1, BLOCK)
    try:
        os.pwrite(fd, probe, 0)
    except OSError:
        os.close(fd)
        return -1
    finally:
        probe.close()
    return fd


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """`nbytes` (rounded up to whole pages) of zeroed, page-aligned memory."""
    return mmap.mmap(-1, max(BLOCK, -(-nbytes // BLOCK) * BLOCK))


def pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


class BlockWriter:
    """Write a file front to back through `direct` (an O_DIRECT descriptor) and `fd` (the same file,
    buffered) in pieces that each sit in page-aligned memory at `offset % BLOCK` bytes past the
    start of their buffer (see `place`).

    `head`, the file's first bytes, is written first. `write(buffer, offset, nbytes)` writes the piece
    at file bytes [offset, offset + nbytes), whose bytes are `buffer[offset % BLOCK:offset % BLOCK +
    nbytes]`; the head of the buffer, [0, offset % BLOCK), is overwritten with the end of the previous
    piece so that the write starts on a block. Returns how many leading bytes of the file are now
    written. `close()` writes the last partial block through the page cache and returns the file's size.
    """

    def __init__(self, fd: int, direct: int, head: bytes = b"") -> None:
        """`head`: the file's first bytes (a header), written now as far as whole blocks go."""
        self.fd, self.direct = fd, direct
        whole = len(head) - len(head) % BLOCK
        if whole:
            buffer = aligned_buffer(whole)
            buffer[:whole] = head[:whole]
            pwrite_all(direct, memoryview(buffer)[:whole], 0)
            buffer.close()
        self.pos = len(head)  # where the next piece starts
        self.carry = head[whole:]  # bytes from the last block boundary to `pos`, not yet written

    @property
    def done(self) -> int:
        """How many leading bytes of the file are written."""
        return self.pos - len(self.carry)

    @staticmethod
    def place(offset: int) -> int:
        """Where a piece that starts at file byte `offset` sits in its buffer."""
        return offset % BLOCK

    def write(self, buffer: memoryview, offset: int, nbytes: int) -> int:
        assert offset == self.pos, "pieces must come in file order"
        head = offset % BLOCK
        assert len(self.carry) == head
        end = offset + nbytes
        whole = end - end % BLOCK - (offset - head)  # bytes from the block boundary before `offset`
        if whole > 0:
            buffer[:head] = self.carry
            pwrite_all(self.direct, buffer[:whole], offset - head)
            self.carry = bytes(buffer[whole:head + nbytes])
        else:
            self.carry += bytes(buffer[head:head + nbytes])
        self.pos = end
        return self.done

    def close(self) -> int:
        if self.carry:
            pwrite_all(self.fd, self.carry, self.pos - len(self.carry))
        return self.pos


__all__ = ["BLOCK", "BlockWriter", "O_DIRECT", "aligned_buffer", "open_direct", "pwrite_all"]
