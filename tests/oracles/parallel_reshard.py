"""Rank script for the model-parallel reshard oracle: DeepSpeed itself loads checkpoints natively at a
new data-parallel size, and everything it then holds is gathered and compared with the fixture's oracle.

The split fixtures (``specs.split``) are built with their own models (``models.split``), the tied Megatron-style
ones (``specs.megatron_tied``) with their writer's job (``writers.megatron_tied``).

Run on N ranks by ``launch("tests.oracles.parallel_reshard", N, ["--jobs", FILE])``. ``FILE`` holds a JSON
list of jobs of one layout (AutoTP, PipelineModule and Megatron-style each install process-wide
groups), run in order. Each job builds the fixture's model with ``tests.fixtures.writers.parallel``'s own
job for its ``spec`` (a ``ParallelSpec`` whose ``world_size`` is N: the same tensor and pipeline
degrees, another data-parallel size), then

- with ``"partition_method"``: the PipelineModule built with it instead of the writer's "uniform";
- with ``"data_types"``: every config built with that section (``writers.parallel_bf16.data_types``: a
  BF16_Optimizer source's fp32 gradient accumulation);
- with ``"round_robin"`` (true): every config built with ``zero_optimization.round_robin_gradients`` and the
  state gathered from the flat partitions at DeepSpeed's own offsets (``writers.parallel_rr.round_robin``:
  DeepSpeed's accessors read the wrong elements of such a run), as the source was trained and gathered;
- ``engine.load_checkpoint(job["load"])``, no universal-checkpoint flag;
- gathers the fp32 weights, Adam moments and buffers exactly as the writer did for the oracle
  (``job.gather``), and rank 0 compares them bit for bit with ``job["expected"]`` /
  ``job["buffers"]``, writing ``{"tensors_equal": n, "buffers_equal": m, "differ": [...]}`` to
  ``job["result"]`` (without ``"expected"``: nothing gathered or compared, for a source whose stages' copies of
  a tied parameter differ, which the gather refuses; the resave below is then the check);
- compares the client state ``load_checkpoint`` returns on every rank with the one the writer saved
  (the client state of the job of ``job["source"]``, the fixture's spec: each of its keys, field by field,
  ``models.client_state.differences``; Megatron's ``args`` with its shape fields at the target's, ``at_shape``),
  writing ``"client_state_keys"`` and ``"client_state_differ"`` (``rank R: ...``) to the same result;
- with ``"next_loss"``: trains one more step (after the save) on the writer's batches for it and writes
  its loss as ``"next_loss"``;
- with ``"save"``: ``engine.save_checkpoint(job["save"], tag=<the loaded tag>)`` with the client state
  the writer saved (carried as it is, as ckptflow carries it), so the files DeepSpeed writes at this size can be compared with ckptflow's.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
from deepspeed import comm as dist  # noqa: E402
from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from tests.fixtures.launch import run_jobs  # noqa: E402
from tests.fixtures.models.client_state import differences  # noqa: E402
from tests.fixtures.models.megatron_tied import TIED_FIXTURES  # noqa: E402
from tests.fixtures.models.parallel_extra import padded_vocab  # noqa: E402
from tests.fixtures.models.split import mha_models  # noqa: E402
from tests.fixtures.specs.parallel import MEGATRON, ParallelSpec  # noqa: E402
from tests.fixtures.specs.split import SPLIT_SPECS  # noqa: E402
from tests.fixtures.writers import parallel as writer  # noqa: E402
from tests.fixtures.writers import parallel_extra as parallel_extra_writer  # noqa: E402
from tests.fixtures.writers.megatron_tied import MegatronTiedJob  # noqa: E402
from tests.fixtures.writers.parallel_bf16 import data_types  # noqa: E402
from tests.fixtures.writers.parallel_rr import round_robin  # noqa: E402
from tests.fixtures.writers.rank import relink_optimizer_state  # noqa: E402
from tests.oracles.client_state import args_at  # noqa: E402

# A ZeRO-0 bf16 run's state is read as the extra fixtures' writer reads it (FP16_Optimizer's flat groups).
writer._local_states = parallel_extra_writer._local_states


def run_job(job: dict[str, Any]) -> None:
    with round_robin(bool(job.get("round_robin"))):
        _run_job(job)


def _run_job(job: dict[str, Any]) -> None:
    spec = ParallelSpec.from_json(job["spec"])
    if spec.world_size != dist.get_world_size():
        raise SystemExit(f"{spec.name} wants {spec.world_size} ranks, this launch has {dist.get_world_size()}")
    work = _job(spec)
    method = job.get("partition_method")
    with (mha_models() if spec.name in SPLIT_SPECS else contextlib.nullcontext(),  # `specs.split`'s models
          _partitioned(method) if method else contextlib.nullcontext(), data_types(job.get("data_types"))):
        engine, _ = work.initialize()
    tag = Path(job["load"], "latest").read_text().strip()
    path, client_state = engine.load_checkpoint(job["load"], tag=tag)
    if path is None:
        raise RuntimeError(f"DeepSpeed loaded nothing from {job['load']}")
    saved = _job(ParallelSpec.from_json(job.get("source", job["spec"]))).client_state()  # what the writer saved
    saved = at_shape(saved, spec)  # what ckptflow writes back: Megatron's `args` saying the target's shape
    client_differ = [f"rank {dist.get_rank()}: {d}" for key, value in saved.items()
                     for d in (differences(value, client_state[key], key) if key in client_state else [f"{key}: missing"])]
    client_differ = [d for differ in writer._all_gather_objects(client_differ) for d in differ]
    relink_optimizer_state(engine)
    compare = bool(job.get("expected"))
    state = work.gather(engine) if compare else {}
    buffers = work.buffers(engine) if compare else {}
    if job.get("save"):
        engine.save_checkpoint(job["save"], tag=tag, client_state=saved)
    # the loss of the next step, on the writer's batches for that step (a float, the same on every rank)
    next_loss = work.train_step(engine, engine.global_steps) if job.get("next_loss") else None
    if dist.get_rank() == 0:
        expected = load_file(job["expected"]) if compare else {}
        expected_buffers = load_file(job["buffers"]) if compare else {}
        differ = sorted(k for k in expected if k not in state or not torch.equal(state[k], expected[k]))
        differ += sorted(k for k in state if k not in expected)
        differ += [f"buffer {n}" for n in expected_buffers
                   if n not in buffers or not torch.equal(buffers[n], expected_buffers[n])]
        Path(job["result"]).write_text(json.dumps({
            "tensors_equal": sum(1 for k in expected if k in state and torch.equal(state[k], expected[k])),
            "buffers_equal": sum(1 for n in expected_buffers if n in buffers and torch.equal(buffers[n],
                                                                                              expected_buffers[n])),
            "differ": differ,
            "client_state_keys": sorted(saved),
            "client_state_differ": client_differ,
            "next_loss": next_loss,
        }))
    dist.barrier()
    engine.destroy()
    del engine, work
    gc.collect()


def at_shape(state: dict[str, Any], spec: ParallelSpec) -> dict[str, Any]:
    """`state` with its `args` Namespace's shape fields set to `spec`'s (`oracles.client_state.args_at`); where
    `args` record `make_vocab_size_divisible_by`, `padded_vocab_size` (there and in `universal_checkpoint_info`)
    Megatron's at `spec.tp` (`models.parallel_extra.padded_vocab`); the writer's own objects otherwise."""
    out = args_at(state, tp=spec.tp, pp=spec.pp, world_size=spec.world_size, stage=spec.stage)
    divisible_by = getattr(out.get("args"), "make_vocab_size_divisible_by", None)
    if divisible_by is None:
        return out
    padded = padded_vocab(spec.tp, divisible_by)
    args = argparse.Namespace(**{**vars(out["args"]), "padded_vocab_size": padded})
    return {**out, "args": args, UNIVERSAL_CHECKPOINT_INFO: {**state[UNIVERSAL_CHECKPOINT_INFO],
                                                             "padded_vocab_size": padded}}


@contextlib.contextmanager
def _partitioned(method: str) -> Iterator[None]:
    """The writer's PipelineModule built with `partition_method=method` (its jobs build it "uniform"). Not
    seeding its layers: DeepSpeed 0.19.8's `partition_balanced` returns numpy integers, which
    `seed_layers=True` hands to `random.seed`, a TypeError on Python 3.11; the load overwrites every
    weight anyway."""
    import deepspeed.pipe

    base = deepspeed.pipe.PipelineModule

    class PipelineModule(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **{**kwargs, "partition_method": method, "seed_layers": False})

    deepspeed.pipe.PipelineModule = PipelineModule
    try:
        yield
    finally:
        deepspeed.pipe.PipelineModule = base


def _job(spec: ParallelSpec) -> writer.Job:
    """The writer's job for ``spec`` (not initialized)."""
    if spec.layout == "autotp" and spec.tp == 1:
        return parallel_extra_writer.DataParallelHFJob(spec)
    if spec.name in TIED_FIXTURES:
        return MegatronTiedJob(spec)  # `specs.megatron_tied`'s tied embedding and head
    if spec.layout == MEGATRON:
        return parallel_extra_writer.megatron_job(spec)  # an extra fixture's client state, where it has one
    return writer.JOBS[spec.layout](spec)


def main(argv: list[str] | None = None) -> None:
    run_jobs(run_job, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    main()
