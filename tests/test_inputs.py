"""The helpers every reader of input goes through (issue 14): `plumbing.text` (input quoted in
messages: escaped, bounded, shown as it is) and `plumbing.files` (regular files only, size limits,
bounded JSON, copies whose failures are one-line errors)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import fsspec
import pytest

from ckptflow.errors import CheckpointNotFoundError, OutputError, UnsafeInputError
from ckptflow.plumbing.files import (
    MAX_JSON_DEPTH,
    JsonTooDeep,
    check_regular,
    copy_regular,
    load_json,
    open_regular,
    read_regular,
)
from ckptflow.plumbing.redaction import describe
from ckptflow.plumbing.text import excerpt, one_line, plain
from tests.hostile.guard import returns_within


def test_excerpts_escape_cut_and_never_expand() -> None:
    assert excerpt("[/]") == "'[/]'"  # markup as it is
    assert excerpt("a\\[b]") == "'a\\[b]'"  # a backslash is not doubled: the input shows as written
    assert excerpt("global_step3\x1b[2J\x07\n") == "'global_step3\\x1b[2J\\x07\\x0a'"
    assert excerpt("\u202egnp.exe") == "'\\u202egnp.exe'"  # a bidirectional override
    assert excerpt("x" * 100) == f"'{'x' * 60}' (and 40 more characters)"
    assert excerpt(b"global_step3") == "'global_step3'"
    assert excerpt(b"\xff\xfe\x00\x9c" + b"x" * 50).startswith("binary data (54 bytes, starting ff fe 00 9c")
    assert excerpt(10**5000) == "an integer of about 5001 digits"  # str() would raise
    assert excerpt(-(2**62)) == str(-(2**62))
    shared: list = []
    for _ in range(200):  # 2**200 leaves if printed
        shared = [shared, shared]
    assert returns_within(lambda: excerpt(shared), "excerpt of 2**200 leaves") == "a list of 2 items"
    assert returns_within(lambda: excerpt({"a": shared}), "excerpt of 2**200 leaves") == "a dict of 1 item"
    assert plain("tab\there") == "tab\\x09here" and plain("ok [red]:x:") == "ok [red]:x:"
    assert one_line("a\n  b\x1bc", 5) == "a b\\…"


def test_describe_escapes_and_redacts() -> None:
    line = describe(OSError("token hf_abcdefghijklmnop\x1b[2J refused\nsecond line"))
    assert line == "OSError: token ***\\x1b[2J refused"


def _specials(tmp_path: Path) -> dict[str, Path]:
    root = tmp_path / "root"
    root.mkdir()
    (root / "file.json").write_text("{}")
    outside = tmp_path / "outside.txt"
    outside.write_text("secret")
    os.mkfifo(root / "fifo")
    (root / "folder").mkdir()
    links = {"dangling": tmp_path / "nowhere", "loop": root / "loop", "out": outside, "dev": Path("/dev/zero"),
             "in": root / "file.json", "to-folder": root / "folder"}
    for name, target in links.items():
        (root / name).symlink_to(target)
    return {p.name: p for p in root.iterdir()} | {"root": root}


def test_only_regular_files_are_read(tmp_path: Path) -> None:
    paths = _specials(tmp_path)
    root = str(paths["root"])
    assert check_regular(str(paths["file.json"]), inside=root) == 2
    assert check_regular(str(paths["in"]), inside=root) == 2  # a link that stays inside
    refused = {
        "fifo": r"is a FIFO \(named pipe\), not a regular file",
        "folder": "is a folder, not a regular file",
        "dangling": "is a symbolic link to nothing",
        "loop": "is a symbolic link to a link loop",
        "dev": "outside",
        "out": "outside",
        "to-folder": "is a folder",
    }
    for name, message in refused.items():
        with pytest.raises(UnsafeInputError, match=message):
            check_regular(str(paths[name]), inside=root)
    with pytest.raises(UnsafeInputError, match="is a character device"):
        check_regular(str(paths["dev"]))  # without `inside`: still not a regular file
    with pytest.raises(CheckpointNotFoundError):
        check_regular(str(paths["root"] / "absent"))
    fs = fsspec.filesystem("memory")
    fs.pipe("/inputs-test/dir/a", b"x")
    with pytest.raises(UnsafeInputError, match="is a folder"):
        check_regular("memory://inputs-test/dir")
    assert check_regular("memory://inputs-test/dir/a") == 1


def test_a_fifo_swapped_in_after_the_check_cannot_hang(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`open_regular` opens without blocking and checks what it opened, not only the path."""
    import ckptflow.plumbing.files as files

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    monkeypatch.setattr(files, "check_regular", lambda *a, **k: 0)  # the path check passed, then the file changed
    done = threading.Event()

    def attempt() -> None:
        with pytest.raises(UnsafeInputError, match="FIFO"), open_regular(str(fifo)):
            pass
        done.set()

    threading.Thread(target=attempt, daemon=True).start()
    assert done.wait(5), "opening a FIFO blocked"


def test_size_limits_refuse_without_reading(tmp_path: Path) -> None:
    big = tmp_path / "big.json"
    with open(big, "wb") as fh:
        fh.truncate(8 << 30)  # sparse
    with pytest.raises(UnsafeInputError, match=r"holds 8.6 GB, more than a config.json can \(1.0 KB at most\)"):
        read_regular(str(big), limit=1000, what="config.json")
    small = tmp_path / "small.json"
    small.write_bytes(b"x" * 1000)
    assert read_regular(str(small), limit=1000) == b"x" * 1000


def test_json_nesting_is_bounded() -> None:
    assert load_json("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH) is not None
    for depth in (MAX_JSON_DEPTH + 1, 100_000):
        with pytest.raises(JsonTooDeep, match=f"nested deeper than {MAX_JSON_DEPTH} levels"):
            returns_within(lambda: load_json('{"a": ' + "[" * depth + "]" * depth + "}"), f"JSON {depth} deep")
    with pytest.raises(JsonTooDeep):
        load_json(b"[" * (10 << 20))


def test_copies_fail_as_one_line_errors(tmp_path: Path) -> None:
    paths = _specials(tmp_path)
    with pytest.raises(OutputError, match="cannot write /dev/full \\(No space left on device\\)"):
        copy_regular(str(paths["file.json"]), "/dev/full")
    with pytest.raises(UnsafeInputError, match="FIFO"):
        copy_regular(str(paths["fifo"]), str(tmp_path / "copy"))
    assert not (tmp_path / "copy").exists()
    assert copy_regular(str(paths["in"]), str(tmp_path / "sub" / "copy.json"), inside=str(paths["root"])) == 2
    assert (tmp_path / "sub" / "copy.json").read_text() == "{}"


@pytest.mark.parametrize("direct", [True, False])
def test_large_local_copies_are_byte_exact_with_or_without_direct_io(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     direct: bool) -> None:
    """Files of a megabyte or more go to a local disk with direct I/O (whole blocks from an aligned
    buffer, the last partial block through the page cache); chunks that are not whole blocks move the
    piece inside the buffer. Where the file system refuses direct I/O, the page cache takes them."""
    from ckptflow.plumbing import direct as direct_io
    from ckptflow.plumbing import files

    if not direct:
        monkeypatch.setattr(direct_io, "O_DIRECT", 0)  # open_direct then refuses, as on such a file system
    opened = []
    monkeypatch.setattr(files, "open_direct", lambda path: opened.append(path) or direct_io.open_direct(path))
    rng = __import__("random").Random(7)
    for size in (files.DIRECT_MIN - 1, files.DIRECT_MIN, files.DIRECT_MIN + 1, files.DIRECT_MIN + 4095, 3_000_017):
        src, dst = tmp_path / f"src-{size}", tmp_path / "out" / f"dst-{size}"
        src.write_bytes(rng.randbytes(size))
        for chunk in (files.COPY_CHUNK, 5000, 1 << 16):
            dst.unlink(missing_ok=True)
            assert copy_regular(str(src), str(dst), chunk=chunk, durable=True) == size
            assert dst.read_bytes() == src.read_bytes(), (size, chunk)
    assert len(opened) == 4 * 3  # every copy of a megabyte or more tried direct I/O; the smaller one did not
    with pytest.raises(OutputError, match="cannot write /dev/full \\(No space left on device\\)"):
        copy_regular(str(tmp_path / "src-3000017"), "/dev/full")


def test_copies_side_by_side_report_the_first_failure(tmp_path: Path) -> None:
    from ckptflow.plumbing.files import copy_all

    paths = _specials(tmp_path)
    sources = []
    for i in range(6):
        sources.append(tmp_path / f"{i}.bin")
        sources[-1].write_bytes(bytes([i]) * (1000 + i))
    pairs = [(str(s), str(tmp_path / "out" / s.name)) for s in sources]
    assert copy_all(pairs) == sum(1000 + i for i in range(6))
    assert all((tmp_path / "out" / s.name).read_bytes() == s.read_bytes() for s in sources)
    with pytest.raises(UnsafeInputError, match="FIFO"):
        copy_all(pairs[:3] + [(str(paths["fifo"]), str(tmp_path / "out2" / "fifo"))] + pairs[3:])
