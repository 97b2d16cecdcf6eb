"""Damage to the torch zip archive of a rank file: byte flips aimed at the zip directory, the local
headers, the pickle and the tensor data; truncations at each region; entries stored wrongly.

The canonical case of each kind damages a fixed place with a fixed value and pins the message. The
fuzzer draws the file, the place and the values (`ws.param`), and then only the generic contract
holds (exit 0 or one clean error): a flip in tensor data, say, leaves a valid archive.
"""

from __future__ import annotations

import random
import struct
import zipfile
from pathlib import Path

from tests.hostile.corpus import Workspace, kind
from tests.hostile.torchfile import Archive, get_pickle, regions, set_pickle

ANY = (0, 1)  # a flip may leave a file that still reads


def flip(path: Path, positions: list[int], values: list[int] | None = None) -> None:
    raw = bytearray(path.read_bytes())
    for i, pos in enumerate(positions):
        raw[pos] = values[i] if values else raw[pos] ^ 0xFF
    path.unlink()  # never edit a file in place: it may be shared
    path.write_bytes(bytes(raw))


def _random_flips(r: random.Random, start: int, end: int) -> tuple[list[int], list[int]]:
    count = r.choice([1, 1, 2, 4, 16])
    return [r.randrange(start, end) for _ in range(count)], [r.randrange(256) for _ in range(count)]


def _flip_region(ws: Workspace, canonical_file: Path, region: str, canonical_at: int) -> Path:
    path = ws.any_rank_file(canonical_file)
    reg = regions(path)
    spans = [(a, b) for a, b in {
        "directory": [reg.directory],
        "headers": list(reg.headers),
        "pickle": [reg.pickle],
        "data": list(reg.data),
    }[region] if b > a] or [reg.pickle]
    start, end = spans[0]
    positions, values = ws.param(([start + canonical_at], None), lambda r: _random_flips(r, *r.choice(spans)))
    flip(path, positions, values)
    return path


@kind(expect=r"is not a readable torch archive", code=ANY)
def directory_flip(ws: Workspace) -> None:
    """Bytes of the central directory flipped (the first entry's signature, canonically)."""
    path = _flip_region(ws, ws.optim_file(1), "directory", 0)
    ws.pin(str(path))


@kind(expect=r"damaged zip header|is not a readable torch archive|past the end", code=ANY)
def local_header_flip(ws: Workspace) -> None:
    """Bytes of a local file header flipped (a storage's signature, canonically)."""
    path = ws.any_rank_file(ws.optim_file(0))
    reg = regions(path)
    # A file may hold no storage at all (a pipeline layer without parameters): then any header.
    storage_headers = [h for h in reg.headers if any(h[1] == d[0] for d in reg.data)] or list(reg.headers)
    positions, values = ws.param(([storage_headers[0][0]], [0x00]),
                                 lambda r: _random_flips(r, *r.choice([h for h in reg.headers if h[1] > h[0]])))
    flip(path, positions, values)
    ws.pin(str(path))


@kind(expect=r"cannot read its pickle|refers to|is not a readable torch archive", code=ANY)
def pickle_flip(ws: Workspace) -> None:
    """Bytes of the pickle flipped (canonically the second opcode, turned into an unknown opcode)."""
    path = ws.any_rank_file(ws.model_file(0))
    # The pickle region is checked by the zip's CRC; a real corruption that kept the CRC right needs
    # the entry rewritten, so the flip is made in the pickle and the archive rewritten around it.
    data = bytearray(get_pickle(path))
    positions, values = ws.param(([2], [0xFF]), lambda r: _random_flips(r, 0, len(data)))
    for pos, value in zip(positions, values):
        data[pos] = value
    set_pickle(path, bytes(data))
    ws.pin(str(path))


@kind(code=ANY)
def data_flip(ws: Workspace) -> None:
    """Bytes of tensor data flipped; the archive stays valid (a NaN may appear for `--deep`)."""
    _flip_region(ws, ws.optim_file(0), "data", 5)


@kind(expect=r"is not a readable torch archive|past the end|ends at byte|truncated")
def truncated_in_region(ws: Workspace) -> None:
    """A rank file cut inside one of its regions (canonically inside the central directory)."""
    path = ws.any_rank_file(ws.optim_file(1))
    reg = regions(path)
    spans = [(a, b) for a, b in (reg.directory, *reg.headers, reg.pickle, *reg.data) if b > a]
    at = ws.param(reg.directory[0] + 10, lambda r: r.randrange(*r.choice(spans)) if r.random() < 0.8
                  else r.randrange(1, path.stat().st_size))
    ws.write(path.relative_to(ws.src), path.read_bytes()[:at])
    ws.pin(str(path))


@kind(expect=r"is not a readable torch archive", code=ANY)
def directory_offset_past_end(ws: Workspace) -> None:
    """The end record says the central directory starts elsewhere (zipfile finds it anyway: it
    corrects for data prepended to an archive), so reading may succeed."""
    path = ws.optim_file(0)
    raw = bytearray(path.read_bytes())
    end = raw.rfind(b"PK\x05\x06")
    struct.pack_into("<I", raw, end + 16, ws.param(0xFFFFFFF0, lambda r: r.randrange(2**32)))
    ws.write(path.relative_to(ws.src), bytes(raw))
    ws.pin(str(path))


@kind(expect=r"lies past the end|ends at byte|damaged zip header|is not a readable torch archive")
def local_header_name_length(ws: Workspace) -> None:
    """A storage's local header claims a 65535-byte name: its data would start past the end."""
    path = ws.optim_file(0)
    reg = regions(path)
    header = next(h for h in reg.headers if any(h[1] == d[0] for d in reg.data))
    raw = bytearray(path.read_bytes())
    struct.pack_into("<H", raw, header[0] + 26, ws.param(0xFFFF, lambda r: r.randrange(2**16)))
    ws.write(path.relative_to(ws.src), bytes(raw))
    ws.pin(str(path))


@kind(expect=r"cannot read its pickle")
def pickle_truncated(ws: Workspace) -> None:
    """The pickle entry holds only the first half of the pickle (the zip itself is consistent)."""
    path = ws.model_file(0)
    data = get_pickle(path)
    set_pickle(path, data[: ws.param(len(data) // 2, lambda r: r.randrange(len(data)))])
    ws.pin(str(path))


@kind(expect=r"is compressed")
def storage_compressed(ws: Workspace) -> None:
    """A storage entry deflated: torch never compresses storages."""
    path = ws.optim_file(0)
    archive = Archive.read(path)
    name = archive.storage_names()[0]
    archive.entries = [(info, data) for info, data in archive.entries]
    for info, _ in archive.entries:
        if info.filename == name:
            info.compress_type = zipfile.ZIP_DEFLATED
    archive.write(path)
    ws.pin(str(path))


@kind(expect=r"holds \d+ bytes, expected \d+|cannot read its pickle")
def storage_shorter_than_recorded(ws: Workspace) -> None:
    """A storage entry shorter than the element count its pickle records."""
    path = ws.optim_file(1)
    archive = Archive.read(path)
    name = archive.storage_names()[-1]
    archive.set(name, archive.get(name)[: ws.param(8, lambda r: r.randrange(len(archive.get(name))))])
    archive.write(path)
    ws.pin(str(path))


@kind(expect=r"missing from the archive|cannot read its pickle")
def storage_entry_missing(ws: Workspace) -> None:
    """A storage the pickle names is not in the archive."""
    path = ws.optim_file(1)
    archive = Archive.read(path)
    name = archive.storage_names()[0]
    archive.entries = [(i, d) for i, d in archive.entries if i.filename != name]
    archive.write(path)
    ws.pin(str(path))


@kind(expect=r"big-endian")
def big_endian_byteorder(ws: Workspace) -> None:
    """The archive says it was written on a big-endian machine."""
    path = ws.optim_file(0)
    archive = Archive.read(path)
    name = next(i.filename for i, _ in archive.entries if i.filename.endswith("/byteorder"))
    archive.set(name, b"big")
    archive.write(path)
    ws.pin(str(path))


@kind(expect=r"is not a readable torch archive|not a torch archive|cannot read its pickle")
def zip_of_zips(ws: Workspace) -> None:
    """A zip whose data.pkl entry is itself the whole original archive."""
    path = ws.model_file(0)
    original = path.read_bytes()
    ws.remove(path.relative_to(ws.src))
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("archive/data.pkl", original)
    ws.pin(str(path))
