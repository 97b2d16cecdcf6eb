"""Measure: what merging row-parallel tensors costs the index and the plan, at Llama-3-70B scale, tp 8.

A row-parallel tensor (`o_proj`, `down_proj`) is split on its last dimension, so each row of the full
tensor is made of one stretch of every tensor-parallel rank's local tensor. The index describes a
rank's rows as one strided `Run` (it held one run per row per rank before: 10.5 million at 70B tp 8).
This composes the runs the way the AutoTP reader does (`model_parallel.concat_pieces` + `compose`),
for local tensors saved in `--partitions` ZeRO partitions each (cut mid-row), then cuts every tensor
into the consolidation's read batches (`plan_batches`, bf16 output, default batch size), and reports
the runs, the time to compose them and to check that they tile each tensor (`check_coverage`), the
batches' copies, and the process's peak RSS. Nothing is read or written.

With `--merge M` it also plans the copies of a tensor-parallel merge (`ckptflow reshard
--tensor-parallel 1`) of those tensors into ZeRO-1 partitions over M data-parallel ranks
(`reshard.flats.ModelRuns`, as its ZeRO-1/2 planner cuts each target partition), and reports
their number, the time and the peak RSS.

With `--fill DIR --bucket [SECONDS ...]` it then times the merge write of that tensor from and to an S3
server on loopback (moto, behind a proxy that delays every request: a bucket's latency), which is
how `reshard --tensor-parallel 1` runs from a bucket to a bucket.

With `--fill DIR` it also writes one row-parallel tensor (`down_proj`, half of Llama-3-70B's in each
dimension: 4096 x 14336 fp32, 235 MB, split over the tp ranks) as raw rank files under DIR, and times
the consolidation's batch fill (read, cast to fp32 and to bf16, placed as full rows) on them, the
files in the page cache (the second of two passes).

    .venv/bin/python -m benchmarks.tp_runs [--layers 80] [--tp 8] [--partitions 3] [--merge 8] [--fill DIR [--bucket]]

Recorded in RESULTS.md ("Tensor-parallel merge").
"""

from __future__ import annotations

import argparse
import resource
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from fsspec.core import url_to_fs

from ckptflow.consolidate.plan import DEFAULT_CHUNK_BYTES, plan_batches
from ckptflow.consolidate.write import _fill
from ckptflow.formats.deepspeed.model import ModelTensor
from ckptflow.formats.deepspeed.readers.model_parallel import compose, concat_pieces
from ckptflow.formats.deepspeed.runs import Run, check_coverage
from ckptflow.formats.torch.pickler import OutStorage, OutTensor, Span
from ckptflow.formats.torch.tensorref import TensorRef
from ckptflow.formats.torch.writer import SourceReader, write_archive

HIDDEN, INTERMEDIATE = 8192, 28672  # Llama-3-70B


def row_parallel_runs(layers: int, tp: int, partitions: int) -> list[tuple[Run, ...]]:
    out = []
    for layer in range(layers):
        for name, rows, cols in (("self_attn.o_proj", HIDDEN, HIDDEN), ("mlp.down_proj", HIDDEN, INTERMEDIATE)):
            local_shape = (rows, cols // tp)
            numel = rows * (cols // tp)
            _, pieces = concat_pieces([local_shape] * tp, 1)
            cuts = [numel * p // partitions + 1 for p in range(partitions)] + [numel]  # mid-row
            cuts[0] = 0
            runs: list[Run] = []
            for rank, piece in enumerate(pieces):
                saved = []
                for p, (lo, hi) in enumerate(zip(cuts, cuts[1:])):
                    ref = TensorRef(f"/ckpt/tag/zero_pp_rank_{p}_mp_rank_{rank:02d}_optim_states.pt", f"{layer}.{name}",
                                    "float32", (hi - lo,), (1,), 0, hi - lo, 4096)
                    saved.append(Run(ref, 0, hi - lo, lo))
                local = ModelTensor(f"{layer}.{name}", local_shape, "float32", "param", tuple(saved))
                runs += compose(f"model.layers.{layer}.{name}.weight", local, piece)
            out.append(tuple(runs))
    return out


def merge(runs: list[tuple[Run, ...]], world_size: int) -> tuple[int, float]:
    """The merge's copies for the tensors of `runs` laid out one after another in one param group and
    partitioned over `world_size` ranks: (copies, seconds)."""
    from ckptflow.reshard.flats import ModelRuns

    refs = sorted({r.ref for tensor in runs for r in tensor}, key=lambda ref: (ref.uri, ref.key))
    by_rank: dict[str, list[SimpleNamespace]] = {}
    for ref in refs:
        by_rank.setdefault(ref.uri, []).append(SimpleNamespace(fp32=ref, group=0))
    files = sorted(by_rank)  # zero_pp_rank_{p}_mp_rank_{mp}: virtual rank mp * partitions + p
    partitions = len({f.split("zero_pp_rank_")[1].split("_")[0] for f in files})
    ranks = [SimpleNamespace(world_size=partitions, partitions=[
        by_rank[f"/ckpt/tag/zero_pp_rank_{p}_mp_rank_{mp:02d}_optim_states.pt"] for p in range(partitions)])
        for mp in range(len(files) // partitions)]
    tensors = [ModelTensor(f"t{i}", (), "float32", "param", tensor) for i, tensor in enumerate(runs)]
    started = time.monotonic()
    index = ModelRuns(SimpleNamespace(ranks=ranks, tensors=tensors))
    numels = [sum(r.numel for r in tensor) for tensor in runs]
    total = sum(numels)
    partition = -(-total // world_size)
    count = 0
    for rank in range(world_size):
        lo, hi, offset = rank * partition, min(total, (rank + 1) * partition), 0
        for tensor, numel in zip(tensors, numels):
            a, b = max(offset, lo), min(offset + numel, hi)
            if a < b:
                count += len(index.copies(tensor.name, 0, a - offset, b - offset, a - lo))
            offset += numel
    return count, time.monotonic() - started


def fill(folder: Path, tp: int, rows: int = HIDDEN // 2, cols: int = INTERMEDIATE // 2) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    width = cols // tp
    _, pieces = concat_pieces([(rows, width)] * tp, 1)
    rng = np.random.default_rng(0)
    runs: list[Run] = []
    for rank, piece in enumerate(pieces):
        path = folder / f"tp{tp}-rank{rank}-{rows}x{width}.bin"
        if not path.exists():
            rng.standard_normal(rows * width, dtype=np.float32).tofile(path)
        ref = TensorRef(str(path), "0", "float32", (rows * width,), (1,), 0, rows * width, 0)
        local = ModelTensor("w", (rows, width), "float32", "param", (Run(ref, 0, rows * width, 0),))
        runs += compose("w", local, piece)
    for dtype in ("float32", "bfloat16"):
        batches = plan_batches([(dtype, 0, tuple(runs))], DEFAULT_CHUNK_BYTES)
        out = np.empty(max(b.out_nbytes for b in batches), dtype=np.uint8)
        for _ in range(2):
            started = time.monotonic()
            for batch in batches:
                _fill(batch, out[:batch.out_nbytes])
            took = time.monotonic() - started
        print(f"fill of a {rows} x {cols} row-parallel tensor to {dtype}: {len(runs)} runs, "
              f"{sum(len(b.copies) for b in batches):,} copies, {took:.2f} s, {rows * cols * 4 / took / 1e9:.2f} GB/s "
              "of source")
    # The merge's write of the same tensor into a torch file (the target flat of `reshard
    # --tensor-parallel 1`), its runs as strided spans and as one span per row, the archive in the
    # page cache (no fsync); and streamed front to back, as to a bucket (here `memory://`).
    strided = [Span(r.ref.uri, *_span(r)) for r in runs]
    for label, spans, target in (("strided spans", strided, str(folder / "merged.pt")),
                                 ("per-row spans", [Span(p.ref.uri, *_span(p)) for r in runs for p in r.plain()],
                                  str(folder / "merged.pt")),
                                 ("strided spans, streamed to memory://", strided, "memory://tp-runs/merged.pt")):
        storage = OutStorage("float32", rows * cols, spans)
        for _ in range(2):
            started = time.monotonic()
            write_archive(target, {"w": OutTensor(storage)}, SourceReader(), durable=False, threads=2)
            took = time.monotonic() - started
        assert np.array_equal(np.frombuffer(torch_data(target), dtype=np.float32).reshape(rows, cols)[:, :width],
                              np.fromfile(folder / f"tp{tp}-rank0-{rows}x{width}.bin", dtype=np.float32).reshape(rows,
                                                                                                                 width))
        fs, path = url_to_fs(target)
        fs.rm(path)
        print(f"merge write of that tensor from {len(spans):,} {label}: {took:.2f} s, "
              f"{rows * cols * 4 / took / 1e9:.2f} GB/s")


def bucket(folder: Path, tp: int, delays: list[float], rows: int = HIDDEN // 2, cols: int = INTERMEDIATE // 2) -> None:
    """The merge write of the `--fill` tensor from a bucket to a bucket: its rank files put in an S3
    server on loopback (moto, as the tests start it) behind a proxy that delays every request by each
    of `delays` seconds (a bucket's latency), the torch file streamed back to the same bucket."""
    import logging
    import os

    from moto.server import ThreadedMotoServer

    from tests.servers.faultproxy import FaultProxy

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's request log
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    proxy = FaultProxy(server.get_host_and_port()[1], xml_errors=True).start()
    try:
        os.environ.update({"FSSPEC_S3_ENDPOINT_URL": proxy.url, "AWS_ACCESS_KEY_ID": "testing",
                           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"})
        import fsspec.config

        fsspec.config.set_conf_env(fsspec.config.conf)
        fs = fsspec.filesystem("s3")
        fs.mkdir("tp-runs")
        width = cols // tp
        _, pieces = concat_pieces([(rows, width)] * tp, 1)
        runs: list[Run] = []
        for rank, piece in enumerate(pieces):
            path = folder / f"tp{tp}-rank{rank}-{rows}x{width}.bin"
            fs.put(str(path), f"s3://tp-runs/{path.name}")
            ref = TensorRef(f"s3://tp-runs/{path.name}", "0", "float32", (rows * width,), (1,), 0, rows * width, 0)
            runs += compose("w", ModelTensor("w", (rows, width), "float32", "param", (Run(ref, 0, rows * width, 0),)),
                            piece)
        storage = OutStorage("float32", rows * cols, [Span(r.ref.uri, *_span(r)) for r in runs])
        for delay in delays:
            proxy.configure(delay=delay)
            took = []
            for _ in range(3):
                started = time.monotonic()
                write_archive("s3://tp-runs/merged.pt", {"w": OutTensor(storage)}, SourceReader(), durable=False)
                took.append(time.monotonic() - started)
            print(f"merge write of that tensor from {len(runs)} strided spans, s3:// to s3://, {delay * 1000:.0f} ms "
                  f"per request: {min(took):.2f}-{max(took):.2f} s (3 runs)")
    finally:
        proxy.stop()
        server.stop()


def _span(run: Run) -> tuple[int, int, int, int, int]:
    start, end = run.byte_range
    return start, end - start, run.offset * 4, run.rows, run.stride * 4


def torch_data(uri: str) -> bytes:
    """The one storage of a torch file written by `write_archive`, read with the zip module."""
    import zipfile

    fs, path = url_to_fs(uri)
    with fs.open(path, "rb") as fh, zipfile.ZipFile(fh) as zf:
        return zf.read(next(n for n in zf.namelist() if n.endswith("/data/0")))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=80)
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--partitions", type=int, default=3, help="ZeRO partitions per local tensor")
    parser.add_argument("--fill", type=Path, help="also time the batch fill on rank files written here")
    parser.add_argument("--merge", type=int, help="also plan a tensor-parallel merge to this many data-parallel ranks")
    parser.add_argument("--bucket", type=float, nargs="*", metavar="SECONDS",
                        help="with --fill, also time the merge write from and to an S3 server with these delays")
    args = parser.parse_args(argv)
    started = time.monotonic()
    runs = row_parallel_runs(args.layers, args.tp, args.partitions)
    composed = time.monotonic() - started
    started = time.monotonic()
    for layer in range(args.layers):  # the proof that the runs tile each tensor, as `join` runs it
        check_coverage("o_proj", HIDDEN * HIDDEN, runs[2 * layer])
        check_coverage("down_proj", HIDDEN * INTERMEDIATE, runs[2 * layer + 1])
    covered = time.monotonic() - started
    started = time.monotonic()
    copies = batches = 0
    for tensor in runs:
        for batch in plan_batches([("bfloat16", 0, tensor)], DEFAULT_CHUNK_BYTES):
            batches += 1
            copies += len(batch.copies)
    planned = time.monotonic() - started
    print(f"{args.layers} layers, tp {args.tp}, {args.partitions} partitions per local tensor: "
          f"{sum(map(len, runs)):,} runs for {len(runs)} row-parallel tensors in {composed:.2f} s, "
          f"checked to tile them in {covered:.2f} s; "
          f"{batches:,} batches of {copies:,} copies in {planned:.2f} s; peak RSS "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
    if args.merge is not None:
        copies, took = merge(runs, args.merge)
        print(f"merge to tp 1 x dp {args.merge}: {copies:,} copies planned in {took:.2f} s; peak RSS "
              f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
    if args.fill is not None:
        fill(args.fill, args.tp)
        if args.bucket is not None:
            bucket(args.fill, args.tp, args.bucket or [0.0, 0.03])


if __name__ == "__main__":
    main()
