"""Rank script for the client-state oracle: DeepSpeed itself loads a checkpoint and returns its client state.

Run on M ranks by ``launch("tests.oracles.client_state", M, ["--jobs", FILE])``. ``FILE`` holds a JSON list
of jobs, each ``{"spec": <a client-state fixture's spec.json>, "ckpt": <folder holding latest>,
"expected": <its client_state.pkl>, "out": <folder>}``. Each builds the fixture's model and config at
this world size (``writers.data_parallel.initialize_engine``), calls ``engine.load_checkpoint(ckpt)``
natively (no universal checkpoint), and writes:

- ``out/rank{R}.json`` (every rank): the differences between the client state DeepSpeed returned and the
  expected one (``models.client_state.differences``; Megatron's ``args`` saying this launch's shape, ``args_at``), and the keys it returned that are neither the
  expected ones nor DeepSpeed's own;
- ``out/state.safetensors`` (rank 0): the loaded engine's fp32 weights and Adam moments
  (``writers.data_parallel.live_state``), to compare with the fixture's ``expected.safetensors``.

This process defines the user classes (it imports ``tests.fixtures.models.client_state``): DeepSpeed's
``torch.load`` rebuilds them here, as a trainer's own process would.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from deepspeed import comm as dist  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from ckptflow.formats.deepspeed.names import DEEPSPEED_MODEL_KEYS  # noqa: E402
from tests.fixtures.launch import run_jobs  # noqa: E402
from tests.fixtures.models.client_state import differences  # noqa: E402
from tests.fixtures.specs.client_state import ClientSpec  # noqa: E402
from tests.fixtures.writers.client_state import engine_spec  # noqa: E402
from tests.fixtures.writers.data_parallel import initialize_engine, live_state  # noqa: E402


def run_job(job: dict[str, str]) -> None:
    rank = dist.get_rank()
    spec = ClientSpec.from_json(json.loads(Path(job["spec"]).read_text()))
    expected = pickle.loads(Path(job["expected"]).read_bytes())  # the test's own file: trusted
    expected = args_at(expected, tp=1, pp=1, world_size=dist.get_world_size(), stage=spec.stage)
    engine, _ = initialize_engine(engine_spec(spec), world_size=dist.get_world_size())
    path, client = engine.load_checkpoint(job["ckpt"])
    out = Path(job["out"])
    out.mkdir(parents=True, exist_ok=True)
    if path is None:
        raise SystemExit(f"DeepSpeed found no checkpoint to load in {job['ckpt']}")
    missing = sorted(set(expected) - set(client))
    got = {key: client[key] for key in expected if key in client}
    extra = sorted(k for k in client if k not in expected and k not in DEEPSPEED_MODEL_KEYS)
    report = {"rank": rank, "missing": missing, "extra": extra,
              "differences": differences(got, {k: v for k, v in expected.items() if k in got})}
    (out / f"rank{rank}.json").write_text(json.dumps(report, indent=1))
    state = live_state(engine)
    if rank == 0:
        save_file(state, str(out / "state.safetensors"))
    dist.barrier()
    engine.destroy()


def args_at(state: dict[str, Any], *, tp: int, pp: int, world_size: int, stage: int) -> dict[str, Any]:
    """`state` with its `args` Namespace's shape fields (those that are ints) set to the given shape, as
    `reshard.files.args_at` sets them (Megatron-DeepSpeed's loader compares them with its run's); `state`
    itself without such `args`."""
    args = state.get("args")
    if not isinstance(args, argparse.Namespace):
        return state
    shape = {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
             "data_parallel_size": world_size // (tp * pp), "world_size": world_size, "zero_stage": stage}
    return {**state, "args": argparse.Namespace(**{k: shape[k] if k in shape and type(v) is int else v
                                                    for k, v in vars(args).items()})}


def main(argv: list[str] | None = None) -> None:
    run_jobs(run_job, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    main()
