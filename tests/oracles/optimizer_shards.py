"""Rank script for the optimizer-shard oracle: seed 002's own loading code at M ranks.

Run on M ranks by ``launch("tests.oracles.optimizer_shards", M, ["--jobs", FILE])``. ``FILE`` holds a JSON
list of jobs, run in order; each builds the fixture's model (``"model"``, ``"seed"``) with the model
weights saved beside the shards (``"shards"/model.safetensors``) loaded first, as the seed's script
does before it resumes, starts a ZeRO engine at this world size with the fixture's config
(``"dtype"``, ``"stage"``: 2 when not given), then loads the optimizer the seed's way::

    engine.optimizer.load_state_dict([torch.load(f, weights_only=False) for f in files])

with ``files`` the M names ``"pattern".format(rank=r)`` in ``"shards"`` (``"fp32_weights": true`` adds
``load_from_fp32_weights=True``). Rank 0 then writes what the engine holds to ``"out"``:
``state.safetensors`` (``writers.data_parallel.live_state``: each parameter's fp32 weights and Adam
moments, gathered through DeepSpeed's own accessors) and ``optimizer.json``
(``writers.optimizer_shards.optimizer_summary``: steps, param group hyper-parameters, loss scale).
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
from safetensors.torch import load_file, save_file  # noqa: E402

from tests.fixtures.launch import run_jobs  # noqa: E402
from tests.fixtures.models import data_parallel as models  # noqa: E402
from tests.fixtures.writers.data_parallel import live_state  # noqa: E402
from tests.fixtures.writers.optimizer_shards import optimizer_summary  # noqa: E402


def run_job(job: dict[str, Any]) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    shards = Path(job["shards"])
    model = models.build_model(job["model"], job.get("seed", 0))
    missing, unexpected = model.load_state_dict(load_file(str(job.get("weights") or shards / "model.safetensors")),
                                                strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:  # the tied head is saved once, as the embedding
        raise RuntimeError(f"the weights beside the shards do not fit the model: {missing} {unexpected}")
    config = models.ds_config(stage=job.get("stage", 2), dtype=job["dtype"], world_size=world_size)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=models.param_groups(model, job["model"]),
                                           config=config)
    files = [shards / job["pattern"].format(rank=r) for r in range(world_size)]
    # Seed 002's loading code, as its script has it (on the Accelerate wrapper, which passes the list on).
    optimizer_state_list = [torch.load(f, map_location="cpu", weights_only=False) for f in files]
    if job.get("fp32_weights"):
        engine.optimizer.load_state_dict(optimizer_state_list, load_from_fp32_weights=True)
    else:
        engine.optimizer.load_state_dict(optimizer_state_list)
    state = live_state(engine)
    summary = optimizer_summary(engine)
    if rank == 0:
        out = Path(job["out"])
        out.mkdir(parents=True, exist_ok=True)
        save_file(state, str(out / "state.safetensors"))
        (out / "optimizer.json").write_text(json.dumps(summary, indent=2, sort_keys=True))
    dist.barrier()
    engine.destroy()
    del engine, model
    gc.collect()


def main(argv: list[str] | None = None) -> None:
    run_jobs(run_job, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    main()
