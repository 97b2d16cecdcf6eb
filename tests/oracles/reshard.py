"""Rank script for the reshard oracle: DeepSpeed itself loads checkpoints natively and saves them again.

Run on M ranks by ``launch("tests.oracles.reshard", M, ["--jobs", FILE])``. ``FILE`` holds a JSON list of
jobs, run in order; each builds the fixture model at this world size with the fixture's DeepSpeed
config (``"dtype": "fp16"`` adds an fp16 section, see ``allow_fp16_on_cpu``; ``"zero"`` holds extra
``zero_optimization`` settings), and then either

- with ``"write"``: trains ``"steps"`` steps from scratch and saves a source checkpoint there, or
- calls ``engine.load_checkpoint(job["load"])`` (no universal-checkpoint flag), and then:

- with ``"save"``: ``engine.save_checkpoint(job["save"], tag=<the loaded tag>)``, so the state
  DeepSpeed now holds can be compared with the source through DeepSpeed's own readers;
- with ``"train_steps": k``: trains k more steps on a fixed sequence of global batches of
  ``"global_batch"`` samples (each rank takes its contiguous slice, so every world size sees the same
  data per step) and writes the mean loss of each step to ``job["losses"]`` (JSON, rank 0).

One launch serves many jobs: starting ranks costs more than the toy models.
"""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402
from deepspeed import comm as dist  # noqa: E402

from tests.fixtures.launch import run_jobs  # noqa: E402
from tests.fixtures.models import data_parallel as models  # noqa: E402

# fp16 with a dynamic loss scaler that moves within a few steps (loss_scale_window 2).
FP16_CONFIG = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2, "hysteresis": 1}


def allow_fp16_on_cpu() -> None:
    """Lift DeepSpeed's "Type fp16 is not supported on your device" gate for the CPU accelerator.

    torch computes in fp16 on CPU; DeepSpeed only refuses because its CPU accelerator reports no fp16
    support. With the gate lifted, DeepSpeed's own fp16 path (FP16 flat groups, DynamicLossScaler,
    overflow checks) runs unchanged and writes a real fp16 checkpoint: the closest to a GPU run this
    machine allows. It is still not a GPU run.
    """
    from deepspeed.accelerator import get_accelerator

    type(get_accelerator()).is_fp16_supported = lambda self: True


def global_batch(name: str, step: int, size: int, seed: int = 1234) -> dict[str, torch.Tensor]:
    """The `size` samples every rank splits at `step`, the same at every world size."""
    vocab = models.TOY_VOCAB if name == "toy" else len(models.VOCAB)
    generator = torch.Generator().manual_seed(seed * 7919 + step)
    ids = torch.randint(0, vocab, (size, models.SEQ_LEN + 1), generator=generator)
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}


def run_job(job: dict[str, Any]) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = models.build_model(job["model"], job.get("seed", 0))
    fp16 = job["dtype"] == "fp16"
    config = models.ds_config(stage=job["stage"], dtype="fp32" if fp16 else job["dtype"],
                              offload=job.get("offload", False), world_size=world_size,
                              grad_accum_dtype=job.get("grad_accum_dtype"))
    if fp16:
        allow_fp16_on_cpu()
        config["fp16"] = dict(FP16_CONFIG)
    config["zero_optimization"].update(job.get("zero") or {})
    steps = int(job.get("train_steps", 0))
    if steps:
        batch = int(job["global_batch"])
        assert batch % world_size == 0, f"global batch {batch} does not split over {world_size} ranks"
        config["train_micro_batch_size_per_gpu"] = batch // world_size
        config["train_batch_size"] = batch
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=models.param_groups(model, job["model"]),
                                           config=config)
    if job.get("write"):  # a source checkpoint: train from scratch on the fixtures' batches, save
        for step in range(int(job.get("steps", 3))):
            loss = models.loss_of(engine(**models.make_batch(job["model"], step=step, rank=rank)))
            engine.backward(loss)
            engine.step()
        engine.save_checkpoint(job["write"])
        dist.barrier()
        engine.destroy()
        return
    tag = Path(job["load"], "latest").read_text().strip()
    path, _ = engine.load_checkpoint(job["load"], tag=tag)
    if path is None:
        raise RuntimeError(f"DeepSpeed loaded nothing from {job['load']}")
    if job.get("save"):
        engine.save_checkpoint(job["save"], tag=tag)
    if steps:
        losses = []
        micro = int(job["global_batch"]) // world_size
        for step in range(steps):
            data = global_batch(job["model"], step, int(job["global_batch"]))
            mine = {k: v[rank * micro:(rank + 1) * micro] for k, v in data.items()}
            loss = models.loss_of(engine(**mine))
            engine.backward(loss)
            engine.step()
            total = loss.detach().float().clone()
            dist.all_reduce(total)
            losses.append(total.item() / world_size)
        if rank == 0:
            Path(job["losses"]).write_text(json.dumps(losses))
    dist.barrier()
    engine.destroy()
    del engine, model
    gc.collect()


def main(argv: list[str] | None = None) -> None:
    run_jobs(run_job, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    main()
