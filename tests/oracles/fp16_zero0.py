"""Rank script for the fp16 ZeRO-0 stage-change oracle: DeepSpeed loads a checkpoint natively in fp16 (the CPU
accelerator's fp16 check lifted, as ``writers.fp16_zero0`` wrote the source) and says what it holds.

Run on M ranks by ``launch("tests.oracles.fp16_zero0", M, ["--jobs", FILE])``. Each job of ``FILE`` builds
the fixture's model with the fixture's config (``writers.fp16_zero0.fp16_config``) at ZeRO ``"stage"`` on
this world size, calls ``engine.load_checkpoint(job["load"])`` (no universal-checkpoint flag), then

- with ``"save"``: ``engine.save_checkpoint(job["save"], tag=<the loaded tag>)``;
- writes ``job["state"]`` (rank 0): the fp32 masters and Adam moments it holds per parameter, read through
  DeepSpeed's accessors (``writers.data_parallel.live_state``; at ZeRO-0 cut from FP16_Optimizer's flat
  groups, ``writers.fp16_zero0.expected_state``);
- writes ``job["result"]`` (JSON, rank 0): ``loaded``, the loss scale state it holds (``cur_scale``,
  ``cur_iter``, ``last_overflow_iter``, ``scale_factor``, ``scale_window``, ``skipped_steps``) and
  ``scaler``, the loss scaler's whole state (a ZeRO optimizer's); ``step``, the Adam step; and with
  ``"train_steps": k``, ``losses``, the mean loss of each of k more steps on the fixtures' batches (step
  numbers after the source's; every rank its own, as the source trained), and ``after``, the loss scale
  state then.
"""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from deepspeed import comm as dist  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from tests.fixtures.launch import run_jobs  # noqa: E402
from tests.fixtures.models import data_parallel as models  # noqa: E402
from tests.fixtures.specs.fp16_zero0 import Fp16Zero0Spec  # noqa: E402
from tests.fixtures.writers.data_parallel import live_state  # noqa: E402
from tests.fixtures.writers.fp16_zero0 import adam_step, expected_state, initialize, loss_scale  # noqa: E402
from tests.fixtures.writers.rank import relink_optimizer_state  # noqa: E402


def _scaler(engine: Any) -> dict[str, Any] | None:
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    return None if scaler is None else {k: str(v) if k == "dtype" else v for k, v in vars(scaler).items()}


def run_job(job: dict[str, Any]) -> None:
    rank = dist.get_rank()
    spec = Fp16Zero0Spec.from_json(job["fixture"])
    stage = int(job["stage"])
    engine = initialize(spec, stage=stage, world_size=dist.get_world_size())
    tag = Path(job["load"], "latest").read_text().strip()
    path, _ = engine.load_checkpoint(job["load"], tag=tag)
    if path is None:
        raise RuntimeError(f"DeepSpeed loaded nothing from {job['load']}")
    if job.get("save"):
        engine.save_checkpoint(job["save"], tag=tag)
    if stage:
        relink_optimizer_state(engine)
        state = live_state(engine)  # collective at ZeRO-3
    else:
        state = expected_state(engine)
    result: dict[str, Any] = {"loaded": loss_scale(engine), "scaler": _scaler(engine), "step": adam_step(engine)}
    steps = int(job.get("train_steps", 0))
    if steps:
        losses = []
        for step in range(spec.steps, spec.steps + steps):
            loss = models.loss_of(engine(**models.make_batch(spec.model, step=step, rank=rank, seed=spec.seed)))
            engine.backward(loss)
            engine.step()
            total = loss.detach().float().clone()
            dist.all_reduce(total)
            losses.append(total.item() / dist.get_world_size())
        result.update(losses=losses, after=loss_scale(engine))
    if rank == 0:
        save_file(state, job["state"])
        Path(job["result"]).write_text(json.dumps(result, indent=1))
    dist.barrier()
    engine.destroy()
    del engine
    gc.collect()


def main(argv: list[str] | None = None) -> None:
    run_jobs(run_job, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    main()
