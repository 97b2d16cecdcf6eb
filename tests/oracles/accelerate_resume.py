"""Rank script for the Accelerate oracle: Accelerate itself loads a ``save_state`` folder at this world size.

Run on M ranks by ``launch("tests.oracles.accelerate_resume", M, ["--jobs", FILE])``. ``FILE`` holds a
JSON list of jobs, each ``{"spec": <a harness fixture's spec.json>, "ckpt": <a save_state folder>,
"out": <folder>}``. Each prepares the fixture's model, optimizer, scheduler and dataloader at this world
size (``models.accelerate_run``) and calls ``accelerator.load_state(ckpt)``: DeepSpeed's
``load_checkpoint`` of tag ``pytorch_model``, ``scheduler.bin``, this process's ``random_states_{r}.pkl``
and the registered object's ``custom_checkpoint_0.pkl``. It writes:

- ``out/rank{R}.pkl`` (every rank): the Accelerator's ``step``, the scheduler's state, what the user's
  object was given back and the next draws of each generator, as the writer's ``harness.pkl`` holds them;
- ``out/state.safetensors`` (rank 0): the engine's fp32 weights and Adam moments (``live_state``).
"""

from __future__ import annotations

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from tests.fixtures.launch import run_jobs  # noqa: E402
from tests.fixtures.models.accelerate_run import draws, prepare  # noqa: E402
from tests.oracles.harness import read_job, write_report  # noqa: E402


def run_job(job: dict[str, str]) -> None:
    spec, out = read_job(job)
    run = prepare(stage=spec.stage, seed=spec.seed)
    run.accelerator.load_state(job["ckpt"])
    report = {"step": run.accelerator.step, "scheduler": run.scheduler.state_dict(), "user": run.user.loaded,
              "draws": draws()}
    write_report(out, report, run.engine)
    run.accelerator.free_memory()


if __name__ == "__main__":
    run_jobs(run_job, __doc__.splitlines()[0])
