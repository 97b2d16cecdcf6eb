"""Strided runs: a row-parallel shard's rows as one `Run`, cut by batches, checked for coverage, read
and cast into rows of the output. Element by element against plain Python and numpy; no checkpoint.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from ckptflow.consolidate import write
from ckptflow.consolidate.plan import plan_batches
from ckptflow.consolidate.write import _fill
from ckptflow.errors import CheckpointError
from ckptflow.formats import casts
from ckptflow.formats.deepspeed import runs as tensors
from ckptflow.formats.deepspeed.model import ModelTensor
from ckptflow.formats.deepspeed.readers.model_parallel import Piece, compose, concat_pieces
from ckptflow.formats.deepspeed.runs import Run, check_coverage, plain_runs, slice_runs
from ckptflow.formats.shard_check import read_source_into
from ckptflow.formats.torch.tensorref import TensorRef


def ref(numel: int, uri: str = "/ckpt/a.pt", dtype: str = "float32") -> TensorRef:
    return TensorRef(uri, "0", dtype, (numel,), (1,), 0, numel, 0)


def elements(run: Run) -> dict[int, int]:
    """Full-tensor element -> saved element, row by row, written out by hand."""
    out = {}
    for i in range(run.rows):
        for j in range(run.row):
            out[run.offset + i * run.stride + j] = run.start + i * run.row + j
    return out


RUNS = [Run(ref(200), start, rows * row, offset, rows, stride if rows > 1 else 0)
        for start, offset, rows, row, stride in itertools.product((0, 3), (0, 5), (1, 2, 5), (1, 3), (3, 4, 7))
        if rows == 1 or stride >= row]


@pytest.mark.parametrize("run", RUNS, ids=lambda r: f"s{r.start}o{r.offset}x{r.rows}r{r.row}d{r.stride}")
def test_within_gives_exactly_the_elements_in_the_window(run: Run) -> None:
    whole = elements(run)
    for lo in range(0, run.end + 2):
        for hi in range(lo + 1, run.end + 3):
            parts = run.within(lo, hi)
            got: dict[int, int] = {}
            for part in parts:
                assert part.ref == run.ref and part.numel > 0
                assert not set(got) & set(elements(part))
                got.update(elements(part))
            assert got == {k: v for k, v in whole.items() if lo <= k < hi}, (lo, hi)
            assert [p.offset for p in parts] == sorted(p.offset for p in parts)
            assert len(parts) <= 3


def test_plain_runs_and_slices_keep_every_element() -> None:
    run = Run(ref(100), 4, 12, 2, 4, 10)
    assert {k: v for r in plain_runs([run]) for k, v in elements(r).items()} == elements(run)
    assert all(r.rows == 1 for r in plain_runs([run]))
    moved = slice_runs([run], 10, 20, 100)  # elements [10, 30) of the tensor, moved to land at 100
    assert {k: v for r in moved for k, v in elements(r).items()} == \
        {k - 10 + 100: v for k, v in elements(run).items() if 10 <= k < 30}


def row_parallel(rows: int, cols: list[int]) -> list[Run]:
    """The runs of a [rows, sum(cols)] tensor split on its columns, one saved tensor per rank."""
    _, pieces = concat_pieces([(rows, c) for c in cols], 1)
    out = []
    for rank, (piece, c) in enumerate(zip(pieces, cols)):
        local = ModelTensor("w", (rows, c), "float32", "param", (Run(ref(rows * c, f"/r{rank}"), 0, rows * c, 0),))
        out += compose("w", local, piece)
    return out


def test_a_row_parallel_tensor_is_one_strided_run_per_rank() -> None:
    runs = row_parallel(6, [4, 6])
    assert [(r.rows, r.row, r.stride, r.offset) for r in runs] == [(6, 4, 10, 0), (6, 6, 10, 4)]
    check_coverage("w", 60, runs)


def test_partitions_that_cut_rows_give_cut_rows_and_strided_rest() -> None:
    """A local tensor saved in two partitions split mid-row: a cut row each side of the split."""
    _, pieces = concat_pieces([(4, 3), (4, 3)], 1)
    a, b = ref(100, "/p0"), ref(100, "/p1")
    local = ModelTensor("w", (4, 3), "float32", "param", (Run(a, 10, 5, 0), Run(b, 0, 7, 5)))
    runs = compose("w", local, pieces[1])
    got = {k: (r.ref.uri, v) for r in runs for k, v in elements(r).items()}
    expected = {}
    for i in range(4):
        for j in range(3):
            e = i * 3 + j  # the local element
            expected[i * 6 + 3 + j] = ("/p0", 10 + e) if e < 5 else ("/p1", e - 5)
    assert got == expected
    assert max(r.rows for r in runs) > 1


@pytest.mark.parametrize("change,fits", [
    (lambda rs: rs, True),
    (lambda rs: [rs[0], Run(rs[1].ref, 0, 30, 4, 5, 10)], False),  # a row missing: a gap
    (lambda rs: [rs[0], Run(rs[1].ref, 0, 36, 3, 6, 10)], False),  # shifted: overlap and gap
    (lambda rs: [rs[0], Run(ref(20, "/r1"), 0, 36, 4, 6, 10)], False),  # past its saved tensor
])
def test_coverage_of_strided_runs(change, fits) -> None:
    runs = change(row_parallel(6, [4, 6]))
    if fits:
        check_coverage("w", 60, runs)
    else:
        with pytest.raises(CheckpointError, match="do not add up to its 60 elements"):
            check_coverage("w", 60, runs)


def test_coverage_check_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tensors, "MAX_ROWS", 11)
    with pytest.raises(CheckpointError, match="do not add up"):
        check_coverage("w", 60, row_parallel(6, [4, 6]))


def test_fine_grained_pieces_still_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptflow.formats.deepspeed.readers import model_parallel

    monkeypatch.setattr(model_parallel, "MAX_STRETCHES", 3)
    # A 3-d piece strided on its two outer dimensions: only the inner one becomes rows.
    piece = Piece((4, 2, 3), 0, (24, 6, 1), 0, (6, 3, 1))
    local = ModelTensor("w", (4, 2, 3), "float32", "param", (Run(ref(24), 0, 24, 0),))
    with pytest.raises(CheckpointError, match="4 separate stretches"):
        compose("w", local, piece)


@pytest.mark.parametrize("src,out", [("float32", "bfloat16"), ("float32", "float16"), ("float32", "float32"),
                                     ("bfloat16", "float32")])
def test_cast_rows_into_equals_a_cast_per_row(src: str, out: str) -> None:
    rng = np.random.default_rng(0)
    rows, row, stride = 5, 7, 11  # elements
    raw = rng.integers(0, 1 << 8, size=rows * row * (4 if src == "float32" else 2), dtype=np.uint8)
    size_in, size_out = (4 if src == "float32" else 2), (4 if out == "float32" else 2)
    dest = np.full((rows - 1) * stride * size_out + row * size_out + 3, 0xAB, dtype=np.uint8)
    casts.cast_rows_into(dest, out, raw, src, rows, row * size_out, stride * size_out)
    expected = np.full_like(dest, 0xAB)
    for i in range(rows):
        at = i * stride * size_out
        casts.cast_into(expected[at:at + row * size_out], out, raw[i * row * size_in:(i + 1) * row * size_in], src)
    assert np.array_equal(dest, expected)
    with pytest.raises(ValueError, match="do not fit"):
        casts.cast_rows_into(dest[:-4], out, raw, src, rows, row * size_out, stride * size_out)


@pytest.mark.parametrize("chunk_bytes", [64, 100, 256, 1000, 1 << 20])
@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("piece", [24, 4 << 20])
def test_batches_and_the_checker_read_a_row_parallel_tensor_right(chunk_bytes: int, out_dtype: str, piece: int,
                                                                  tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches of every size cut the strided runs mid-row, and the writer reads them a few rows at a
    time (`piece` bytes); the writer's fill and the checker's independent read both give the full
    tensor numpy makes."""
    monkeypatch.setattr(write, "_CAST_PIECE", piece)
    rng = np.random.default_rng(1)
    rows, cols = 9, [5, 7, 4]
    full = rng.standard_normal((rows, sum(cols))).astype(np.float32)
    runs = []
    _, pieces = concat_pieces([(rows, c) for c in cols], 1)
    lo = 0
    for rank, (split, c) in enumerate(zip(pieces, cols)):
        path = tmp_path / f"rank{rank}.bin"
        pad = rng.standard_normal(3).astype(np.float32)  # the local tensor sits after 3 other elements
        path.write_bytes(pad.tobytes() + np.ascontiguousarray(full[:, lo:lo + c]).tobytes())
        saved = TensorRef(str(path), "0", "float32", (rows * c + 3,), (1,), 0, rows * c + 3, 0)
        # Saved in two partitions cut in the middle of row 4.
        cut = 4 * c + 2
        local = ModelTensor("w", (rows, c), "float32", "param",
                            (Run(saved, 3, cut, 0), Run(saved, 3 + cut, rows * c - cut, cut)))
        runs += compose("w", local, split)
        lo += c
    check_coverage("w", full.size, runs)
    assert any(r.rows > 1 for r in runs)
    size = 4 if out_dtype == "float32" else 2
    expected = np.empty(full.size * size, dtype=np.uint8)
    casts.cast_into(expected, out_dtype, full.reshape(-1).view(np.uint8), "float32")
    begin = 40  # the tensor's byte offset in the shard's data
    batches = plan_batches([(out_dtype, begin, tuple(runs))], chunk_bytes)
    got = np.zeros(full.size * size, dtype=np.uint8)
    for batch in batches:
        assert batch.out_nbytes <= chunk_bytes and batch.src_nbytes <= chunk_bytes
        out = np.zeros(batch.out_nbytes, dtype=np.uint8)
        _fill(batch, out)
        got[batch.file_start - begin:batch.file_start - begin + batch.out_nbytes] = out
    assert np.array_equal(got, expected)

    tensor = SimpleNamespace(name="w", dtype=out_dtype, shape=full.shape, runs=tuple(runs))
    for a, b in [(0, full.size), (3, 50), (17, 18), (40, full.size)]:
        checked = np.zeros((b - a) * size, dtype=np.uint8)
        read_source_into(tensor, a, b, checked, out_dtype)
        assert np.array_equal(checked, expected[a * size:b * size]), (a, b)
