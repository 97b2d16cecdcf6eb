"""Rank script for the Lightning oracle: Lightning itself resumes from a checkpoint folder at this world size.

Run on M ranks by ``launch("tests.oracles.lightning_resume", M, ["--jobs", FILE])``. ``FILE`` holds a JSON
list of jobs, each ``{"spec": <a harness fixture's spec.json>, "ckpt": <a Lightning checkpoint folder>,
"out": <folder>}``. Each builds the fixture's LightningModule and Trainer at this world size
(``models.lightning_module``) and calls ``trainer.fit(module, ckpt_path=ckpt)``: Lightning's
``DeepSpeedStrategy.load_checkpoint`` (DeepSpeed's ``load_checkpoint`` with the optimizer states), then
Lightning restores its loops, callbacks and schedulers from the client state. The fixture stopped at
``max_steps``, so the resumed fit trains no further step. It writes:

- ``out/rank{R}.pkl`` (every rank): the client state Lightning got back (``on_load_checkpoint``), the
  trainer's ``global_step`` and ``epoch``, the scheduler's state and what the user's callback was
  given back, as the writer's ``harness.pkl`` holds them;
- ``out/state.safetensors`` (rank 0): the engine's fp32 weights and Adam moments (``live_state``).

This process defines the user classes: their markers are left here, as in the trainer's own process.
"""

from __future__ import annotations

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from deepspeed import comm as dist  # noqa: E402

from tests.fixtures.launch import run_jobs  # noqa: E402
from tests.fixtures.models.client_state import Schedule  # noqa: E402
from tests.fixtures.models.lightning_module import LitLlama, callback, make_trainer  # noqa: E402
from tests.oracles.harness import read_job, write_report  # noqa: E402


def run_job(job: dict[str, str]) -> None:
    spec, out = read_job(job)
    module = LitLlama(seed=spec.seed, schedule=Schedule(2, 100))
    trainer = make_trainer(stage=spec.stage, world_size=dist.get_world_size(), steps=spec.steps, root=out / "run")
    trainer.fit(module, ckpt_path=job["ckpt"])
    if module.loaded is None:
        raise SystemExit(f"Lightning restored nothing from {job['ckpt']}")
    report = {"client_state": module.loaded, "global_step": trainer.global_step, "epoch": trainer.current_epoch,
              "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
              "callback": callback(trainer).user.loaded}
    write_report(out, report, trainer.strategy.deepspeed_engine)


if __name__ == "__main__":
    run_jobs(run_job, __doc__.splitlines()[0])
