"""Rank script for the reshard oracle: DeepSpeed itself loads checkpoints natively and saves them again.

Run on M ranks by ``launch("tests.reshard_oracle", M, ["--jobs", FILE])``. ``FILE`` holds a JSON list of
jobs; each builds the fixture model at this world size with the fixture's DeepSpeed config, calls
``engine.load_checkpoint(job["load"])`` (no universal-checkpoint flag), and then:

- with ``"save"``: ``engine.save_checkpoint(job["save"], tag=<the loaded tag>)``, so the state
  DeepSpeed now holds can be compared with the source through DeepSpeed's own readers;
- with ``"train_steps": k``: trains k more steps on a fixed sequence of global batches of
  ``"global_batch"`` samples (each rank takes its contiguous slice, so every world size sees the same
  data per step) and writes the mean loss of each step to ``job["losses"]`` (JSON, rank 0).

One launch serves many jobs: starting ranks costs more than the toy models.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402
from deepspeed import comm as dist  # noqa: E402

from tests.fixtures import models  # noqa: E402


def global_batch(name: str, step: int, size: int, seed: int = 1234) -> dict[str, torch.Tensor]:
    """The `size` samples every rank splits at `step`, the same at every world size."""
    vocab = models.TOY_VOCAB if name == "toy" else len(models.VOCAB)
    generator = torch.Generator().manual_seed(seed * 7919 + step)
    ids = torch.randint(0, vocab, (size, models.SEQ_LEN + 1), generator=generator)
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}


def run_job(job: dict[str, Any]) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = models.build_model(job["model"], job.get("seed", 0))
    config = models.ds_config(stage=job["stage"], dtype=job["dtype"], offload=job.get("offload", False),
                              world_size=world_size, grad_accum_dtype=job.get("grad_accum_dtype"))
    steps = int(job.get("train_steps", 0))
    if steps:
        batch = int(job["global_batch"])
        assert batch % world_size == 0, f"global batch {batch} does not split over {world_size} ranks"
        config["train_micro_batch_size_per_gpu"] = batch // world_size
        config["train_batch_size"] = batch
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=models.param_groups(model, job["model"]),
                                           config=config)
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=Path, required=True, help="JSON list of jobs")
    parser.add_argument("--local_rank", type=int, default=None, help="set by the deepspeed launcher")
    options = parser.parse_args(argv)
    deepspeed.init_distributed(dist_backend="gloo")
    for job in json.loads(options.jobs.read_text()):
        run_job(job)


if __name__ == "__main__":
    main()
