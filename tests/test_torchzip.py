"""The safe lazy reader of torch archives, on files torch itself writes."""

from __future__ import annotations

import io
import os
import pickle
import zipfile
from collections import OrderedDict
from pathlib import Path

import fsspec
import pytest
import torch

from ckptflow.errors import CorruptFileError, UnsafePickleError
from ckptflow.formats.torch.tensorref import TensorRef
from ckptflow.formats.torch.zipdir import open_archive
from tests.hostile.guard import returns_within
from tests.oracles.tensors import iter_chunks, read_elements, read_tensor


def save(tmp_path: Path, obj, name: str = "f.pt") -> str:
    path = tmp_path / name
    torch.save(obj, path)
    return str(path)


def test_tensors_of_every_dtype_and_layout_round_trip(tmp_path):
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    obj = {
        "f32": base,
        "view": base[2:4],  # shares the storage at an offset
        "strided": base.t(),  # not contiguous
        "bf16": base.to(torch.bfloat16),
        "f16": base.to(torch.float16),
        "i64": torch.tensor([16777217, -1, 2**62], dtype=torch.int64),
        "i32": torch.tensor([7], dtype=torch.int32),
        "bool": torch.tensor([True, False]),
        "u8": torch.tensor([255], dtype=torch.uint8),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "param": torch.nn.Parameter(torch.ones(3)),
        "nested": OrderedDict(a=[1, (2, 3.0)], b={"c": None, "d": "text", "e": b"bytes"}),
        "size": torch.Size([2, 3]),
        "set": {1, 2},
    }
    path = save(tmp_path, obj)
    archive = open_archive(path)
    got = archive.obj
    for key in ("f32", "view", "strided", "bf16", "f16", "i64", "i32", "bool", "u8", "scalar", "empty", "param"):
        ref = got[key]
        assert isinstance(ref, TensorRef), key
        tensor = read_tensor(ref)
        assert tensor.dtype == obj[key].dtype and torch.equal(tensor, obj[key].detach()), key
    assert got["view"].key == got["f32"].key and got["view"].storage_offset == 20
    assert not got["strided"].is_contiguous
    assert got["nested"] == OrderedDict(a=[1, (2, 3.0)], b={"c": None, "d": "text", "e": b"bytes"})
    assert got["size"] == (2, 3) and got["set"] == {1, 2}


def test_element_ranges_and_chunks_read_only_their_bytes(tmp_path):
    values = torch.randn(1000)
    ref = open_archive(save(tmp_path, {"v": values})).obj["v"]
    assert torch.equal(read_elements(ref, 100, 50), values[100:150])
    start, end = ref.element_range(100, 50)
    assert end - start == 200
    with open(ref.uri, "rb") as fh:
        fh.seek(start)
        assert torch.equal(torch.frombuffer(bytearray(fh.read(200)), dtype=torch.float32), values[100:150])
    chunks = list(iter_chunks(ref, chunk_bytes=1024))
    assert [c.numel() for c in chunks] == [256, 256, 256, 232]
    assert torch.equal(torch.cat(chunks), values)


def test_reads_from_memory_filesystem(tmp_path):
    values = torch.randn(7, 3)
    buf = io.BytesIO()
    torch.save({"w": values}, buf)
    fs = fsspec.filesystem("memory")
    fs.pipe("/torchzip-test/w.pt", buf.getvalue())
    ref = open_archive("memory://torchzip-test/w.pt").obj["w"]
    assert ref.uri == "memory://torchzip-test/w.pt"
    assert torch.equal(read_tensor(ref), values)


class RunsCode:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class Smuggled:
    def __reduce__(self):
        return (getattr, (print, "__self__"))


@pytest.mark.parametrize("payload,name", [(RunsCode, "posix.system"), (Smuggled, "builtins.getattr")])
def test_hostile_globals_are_refused_before_running(tmp_path, payload, name):
    marker = tmp_path / "ran"
    obj = payload(str(marker)) if payload is RunsCode else payload()
    path = save(tmp_path, {"x": torch.ones(1), "evil": obj})
    with pytest.raises(UnsafePickleError) as info:
        open_archive(path)
    assert str(info.value).startswith(f"{path} refers to {name}, which ckptflow does not load")
    assert info.value.file == path and info.value.actual == name
    assert not marker.exists()


def test_plain_pickle_file_is_not_an_archive(tmp_path):
    path = tmp_path / "legacy.pt"
    path.write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(CorruptFileError, match="is not a readable torch archive"):
        open_archive(str(path))


def test_truncated_storage_is_detected_when_opening(tmp_path):
    path = save(tmp_path, {"w": torch.randn(4096)})
    raw = Path(path).read_bytes()
    # Keep the zip directory but cut the storage region: rebuild an archive whose data entry is short.
    with zipfile.ZipFile(path) as zf:
        entries = {i.filename: zf.read(i) for i in zf.infolist()}
    key = next(n for n in entries if n.endswith("/data/0"))
    entries[key] = entries[key][:100]
    bad = tmp_path / "bad.pt"
    with zipfile.ZipFile(bad, "w", compression=zipfile.ZIP_STORED) as zf:
        for n, data in entries.items():
            zf.writestr(n, data)
    assert len(raw) > bad.stat().st_size
    with pytest.raises(CorruptFileError, match="storage 0 holds 100 bytes, expected 16384"):
        open_archive(str(bad))


def test_missing_file_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"{tmp_path}/nope.pt does not exist"):
        open_archive(str(tmp_path / "nope.pt"))


def test_scalars_read_without_torch(tmp_path):
    from ckptflow.formats.torch.tensorref import read_scalar

    values = {
        "f32": torch.tensor(3.0), "f64": torch.tensor(-2.5, dtype=torch.float64), "i64": torch.tensor(2**40),
        "bf16": torch.tensor(1.5, dtype=torch.bfloat16), "f16": torch.tensor(0.25, dtype=torch.float16),
        "one": torch.tensor([7], dtype=torch.int32), "b": torch.tensor(True),
    }
    got = open_archive(save(tmp_path, values)).obj
    for key, tensor in values.items():
        assert read_scalar(got[key]) == tensor.item(), key
    with pytest.raises(ValueError, match="holds 2 elements, not one"):
        read_scalar(open_archive(save(tmp_path, {"v": torch.ones(2)}, "two.pt")).obj["v"])


def test_records_are_checked_as_they_are_used(tmp_path):
    """A tensor's storage reference is checked again when the tensor is made (a BUILD run after
    `persistent_load` could otherwise have changed its key, dtype or size behind the first check)."""
    from ckptflow.formats.torch.unpickler import TensorRecord as _TensorRecord
    from ckptflow.formats.torch.unpickler import _Storage

    archive = open_archive(save(tmp_path, {"w": torch.ones(4)}))
    key = archive.obj["w"].key
    for storage, message in ((_Storage("no-such-storage", "float32", 4), "missing from the archive"),
                             (_Storage(key, "float64", 4), "holds 16 bytes, expected 32"),
                             (_Storage(key, "evil", 4), "unknown dtype"),
                             (_Storage(key, "float32", 10**12), "holds 16 bytes, expected")):
        with pytest.raises(CorruptFileError, match=message):
            archive.tensor(_TensorRecord(storage, 0, (4,), (1,)))
    with pytest.raises(CorruptFileError, match="reaches past its storage"):  # elements 0, -1, -2, -3
        archive.tensor(_TensorRecord(_Storage(key, "float32", 4), 0, (4,), (-1,)))
    with pytest.raises(CorruptFileError, match="negative dimension"):
        archive.tensor(_TensorRecord(_Storage(key, "float32", 4), 0, (-4,), (1,)))
    assert not archive.tensor(_TensorRecord(_Storage(key, "float32", 4), 3, (4,), (-1,))).is_contiguous  # 3, 2, 1, 0


def test_pickle_bombs_cost_their_size(tmp_path):
    """Shared references stay shared (a "billion laughs" is refused by its expanded size, quickly),
    a memo index of 2**31 costs nothing, BUILD on an allowed function is refused, and a tuple nested
    far past any recursion limit is refused before it is ever hashed."""
    from tests.hostile import pickleasm as asm
    from tests.hostile.torchfile import inject

    base = save(tmp_path, {"w": torch.ones(2)}, "base.pt")
    cases = {
        "laughs": (asm.laughs("list", 40), "expand to more than"),
        "memo": (asm.memo_bomb(2**31), None),
        "build-function": (asm.build(asm.glob("torch", "Size"),
                                     asm.tup(asm.none(), asm.dct((asm.string("__defaults__"), asm.tup())))),
                           "BUILD gives the function _size a state it cannot take"),
        "deep-tuple-key": (asm.dct((asm.nested("tuple", 100_000), asm.none())), "nested more than 100 deep"),
        "cycle": (asm.op("EMPTY_LIST") + asm.put(900) + asm.get(900) + asm.op("APPEND"), "reference cycle"),
    }
    for name, (ops, message) in cases.items():
        path = tmp_path / f"{name}.pt"
        path.write_bytes(Path(base).read_bytes())
        inject(path, "payload", ops)
        if message is None:
            assert returns_within(lambda: open_archive(str(path)), name).obj["payload"] is None
        else:
            with pytest.raises(CorruptFileError, match=message):
                returns_within(lambda: open_archive(str(path)), name)
