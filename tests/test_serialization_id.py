"""torch's `.data/serialization_id`, derived from the records exactly as torch derives it, so that an
archive ckptflow writes is the same bytes every time (threads or cluster, one run or the next)."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import pytest
import torch

from ckptflow.formats.torch.serialization_id import serialization_id, std_hash


def _records(blob: bytes) -> tuple[list[tuple[str, int]], str]:
    with zipfile.ZipFile(io.BytesIO(blob)) as zf:
        infos = zf.infolist()
        return [(i.filename.split("/", 1)[1], i.CRC) for i in infos[:-1]], zf.read(infos[-1]).decode()


@pytest.mark.parametrize("count", [0, 1, 12, 13, 14, 29, 30, 58, 59, 60, 127, 128, 257, 258, 541, 1137, 2400])
def test_the_id_is_the_one_torch_writes(count: int) -> None:
    """Around every size where libstdc++'s hashtable grows (its iteration order changes there)."""
    buf = io.BytesIO()
    torch.save({f"t{i}": torch.tensor([i, count]) for i in range(count)}, buf)
    records, written = _records(buf.getvalue())
    assert serialization_id(records) == written


def test_std_hash_of_known_strings() -> None:
    """libstdc++'s std::hash<std::string> (_Hash_bytes, seed 0xc70f6907) on 64-bit Linux."""
    import ctypes

    try:  # the C++ runtime itself, where this machine has one we can call
        lib = ctypes.CDLL("libstdc++.so.6")
        fn = lib._ZSt11_Hash_bytesPKvmm
    except (OSError, AttributeError):
        pytest.skip("no libstdc++ to compare with")
    fn.restype, fn.argtypes = ctypes.c_size_t, [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t]
    for text in (b"", b"a", b"data.pkl", b"data/0", b".data/serialization_id", b"x" * 63, "é".encode()):
        assert std_hash(text) == fn(text, len(text), 0xC70F6907), text


def test_an_archive_written_twice_is_the_same_bytes(tmp_path: Path) -> None:
    from ckptflow.formats.torch.pickler import OutStorage, OutTensor, Span
    from ckptflow.formats.torch.writer import SourceReader, write_archive

    src = tmp_path / "src.bin"
    src.write_bytes(bytes(range(256)) * 16)
    obj = {"a": OutTensor(OutStorage("float32", 300, [Span(str(src), 4, 1000, 8)])), "n": 3}
    first, second = tmp_path / "1" / "x.pt", tmp_path / "2" / "x.pt"
    for path in (first, second):
        path.parent.mkdir()
        write_archive(str(path), obj, SourceReader())
    assert first.read_bytes() == second.read_bytes()
    records, written = _records(first.read_bytes())
    assert written == serialization_id(records)
    assert torch.load(first, weights_only=False)["n"] == 3
