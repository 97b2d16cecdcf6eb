"""Measure: what merging row-parallel tensors costs the index, at Llama-3-70B scale with tp 8.

A row-parallel tensor (`o_proj`, `down_proj`) is split on its last dimension, so each row of the full
tensor is made of one stretch of every tensor-parallel rank's local tensor, and the index holds one
`Run` per row per rank. This composes those runs the way the AutoTP reader does
(`model_parallel.concat_pieces` + `compose`), for local tensors that are one saved run each (a ZeRO-1
partition per rank), and reports how many there are, how long it took and the process's peak RSS.
No checkpoint is read or written.

    .venv/bin/python -m benchmarks.tp_runs [--layers 80] [--tp 8]

Recorded in RESULTS.md ("Tensor-parallel merge"); a known limit of the AutoTP reader (issue 11).
"""

from __future__ import annotations

import argparse
import resource
import time

from ckptflow.formats.deepspeed.model_parallel import compose, concat_pieces
from ckptflow.formats.deepspeed.tensors import ModelTensor, Run
from ckptflow.formats.torchzip import TensorRef

HIDDEN, INTERMEDIATE = 8192, 28672  # Llama-3-70B


def row_parallel_runs(layers: int, tp: int) -> list[tuple[Run, ...]]:
    out = []
    for layer in range(layers):
        for name, rows, cols in (("self_attn.o_proj", HIDDEN, HIDDEN), ("mlp.down_proj", HIDDEN, INTERMEDIATE)):
            local_shape = (rows, cols // tp)
            numel = rows * (cols // tp)
            _, pieces = concat_pieces([local_shape] * tp, 1)
            runs: list[Run] = []
            for rank, piece in enumerate(pieces):
                ref = TensorRef(f"/ckpt/tag/zero_pp_rank_0_mp_rank_{rank:02d}_optim_states.pt", f"{layer}.{name}",
                                "float32", (numel,), (1,), 0, numel, 4096)
                local = ModelTensor(f"{layer}.{name}", local_shape, "float32", "param", (Run(ref, 0, numel, 0),))
                runs += compose(f"model.layers.{layer}.{name}.weight", local, piece)
            out.append(tuple(runs))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=80)
    parser.add_argument("--tp", type=int, default=8)
    args = parser.parse_args(argv)
    started = time.monotonic()
    runs = row_parallel_runs(args.layers, args.tp)
    print(f"{args.layers} layers, tp {args.tp}: {sum(map(len, runs)):,} runs for {len(runs)} row-parallel tensors "
          f"in {time.monotonic() - started:.1f} s; peak RSS "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
