"""Rank script for the expert-parallel reshard oracle: DeepSpeed itself, at this launch's world size,
trains or loads a parallel fixture's model and saves it again.

Run on M ranks by ``launch("tests.oracles.expert_reshard", M, ["--jobs", FILE])``. ``FILE`` holds a
JSON list of jobs, run in order. Each builds the model of a parallel fixture (``"spec"``: its
``spec.json``) with that fixture's DeepSpeed config through the fixture writer's own job class
(``tests.fixtures.writers.parallel.JOBS``), at this world size and expert-parallel degree ``"ep"``
(the fixture's when absent; the writers draw each expert by its global id, so it is the same model at
any degree) and ZeRO stage ``"stage"`` (the fixture's when absent), and then:

- with ``"write": DIR``: trains the fixture's steps from scratch and saves there, so that what
  DeepSpeed writes at this size can be compared field by field with a reshard;
- with ``"load": DIR``: ``engine.load_checkpoint(DIR)`` (no universal flag), gathers the state the
  way the writer gathered its oracle and writes it to ``"state"`` (safetensors, rank 0), and with
  ``"save": DIR2`` saves it again under the loaded tag.

``"hang_after"`` (seconds) dumps every rank's Python stack to its log if the job is still running
then, which is how a load that never returns shows where it waits.
"""

from __future__ import annotations

import faulthandler
import gc
import json
import os
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from deepspeed import comm as dist  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from tests.fixtures.launch import run_jobs  # noqa: E402
from tests.fixtures.specs.parallel import ParallelSpec  # noqa: E402
from tests.fixtures.writers.parallel import JOBS  # noqa: E402
from tests.fixtures.writers.rank import relink_optimizer_state  # noqa: E402


def run_job(job: dict[str, Any]) -> None:
    spec = ParallelSpec.from_json(json.loads(Path(job["spec"]).read_text()))
    spec = ParallelSpec.from_json({**spec.to_json(), "world_size": dist.get_world_size(),
                                   "ep": job.get("ep") or spec.ep, "stage": job.get("stage") or spec.stage})
    if job.get("hang_after"):
        faulthandler.dump_traceback_later(float(job["hang_after"]), exit=False)
    runner = JOBS[spec.layout](spec)
    engine, _ = runner.initialize()
    if job.get("write"):
        for step in range(spec.steps):
            runner.train_step(engine, step)
        engine.save_checkpoint(job["write"], client_state=runner.client_state())
    else:
        tag = Path(job["load"], "latest").read_text().strip()
        path, _ = engine.load_checkpoint(job["load"], tag=tag)
        if path is None:
            raise RuntimeError(f"DeepSpeed loaded nothing from {job['load']}")
        if job.get("save"):
            engine.save_checkpoint(job["save"], tag=tag, client_state=runner.client_state())
        relink_optimizer_state(engine)
        state = runner.gather(engine)
        buffers = runner.buffers(engine)
        if dist.get_rank() == 0 and job.get("state"):
            save_file({**state, **{f"buffer/{k}": v for k, v in buffers.items()}}, job["state"])
    faulthandler.cancel_dump_traceback_later()
    dist.barrier()
    engine.destroy()
    del engine, runner
    gc.collect()


def main(argv: list[str] | None = None) -> None:
    run_jobs(run_job, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    main()
