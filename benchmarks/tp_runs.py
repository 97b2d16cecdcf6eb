"""Measure: what merging row-parallel tensors costs the index and the plan, at Llama-3-70B scale, tp 8.

A row-parallel tensor (`o_proj`, `down_proj`) is split on its last dimension, so each row of the full
tensor is made of one stretch of every tensor-parallel rank's local tensor. The index describes a
rank's rows as one strided `Run` (it held one run per row per rank before: 10.5 million at 70B tp 8).
This composes the runs the way the AutoTP reader does (`model_parallel.concat_pieces` + `compose`),
for local tensors saved in `--partitions` ZeRO partitions each (cut mid-row), then cuts every tensor
into the consolidation's read batches (`plan_batches`, bf16 output, default batch size), and reports
the runs, the time to compose them and to check that they tile each tensor (`check_coverage`), the
batches' copies, and the process's peak RSS. Nothing is read or written.

With `--fill DIR` it also writes one row-parallel tensor (`down_proj`, half of Llama-3-70B's in each
dimension: 4096 x 14336 fp32, 235 MB, split over the tp ranks) as raw rank files under DIR, and times
the consolidation's batch fill (read, cast to fp32 and to bf16, placed as full rows) on them, the
files in the page cache (the second of two passes).

    .venv/bin/python -m benchmarks.tp_runs [--layers 80] [--tp 8] [--partitions 3] [--fill DIR]

Recorded in RESULTS.md ("Tensor-parallel merge").
"""

from __future__ import annotations

import argparse
import resource
import time
from pathlib import Path

import numpy as np

from ckptflow.consolidate.plan import DEFAULT_CHUNK_BYTES, plan_batches
from ckptflow.consolidate.write import _fill
from ckptflow.formats.deepspeed.model_parallel import compose, concat_pieces
from ckptflow.formats.deepspeed.tensors import ModelTensor, Run, check_coverage
from ckptflow.formats.torchzip import TensorRef

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
              f"{sum(len(b.copies) for b in batches):,} copies, {took:.2f} s, {rows * cols * 4 / took / 1e9:.2f} GB/s of source")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=80)
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--partitions", type=int, default=3, help="ZeRO partitions per local tensor")
    parser.add_argument("--fill", type=Path, help="also time the batch fill on rank files written here")
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
    if args.fill is not None:
        fill(args.fill, args.tp)


if __name__ == "__main__":
    main()
