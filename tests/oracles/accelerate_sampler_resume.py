"""Rank script for the Accelerate sampler oracle: Accelerate itself loads a ``save_state`` folder holding a
sampler file at this world size.

Run on M ranks by ``launch("tests.oracles.accelerate_sampler_resume", M, ["--jobs", FILE])`` (jobs as
``tests.oracles.accelerate_resume`` takes them, for ``specs.accelerate_sampler`` fixtures). Each prepares what
the writer prepared (``models.accelerate_run``, then ``models.accelerate_sampler``'s loader with another
``data_seed``, so that only the load can give the source's), allows the sampler's classes as the user must
(``torch.serialization.add_safe_globals``: Accelerate's ``load_state`` reads the file with ``weights_only=True``)
and calls ``accelerator.load_state(ckpt)``. Writes what ``accelerate_resume`` writes, the report with
``sampler``: the loaded sampler's state (``sampler_state``).
"""

from __future__ import annotations

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

from tests.fixtures.launch import run_jobs  # noqa: E402
from tests.fixtures.models.accelerate_run import draws, prepare  # noqa: E402
from tests.fixtures.models.accelerate_sampler import add_sampled_loader, safe_globals, sampler_state  # noqa: E402
from tests.fixtures.specs.accelerate_sampler import DATA_SEED  # noqa: E402
from tests.oracles.harness import read_job, write_report  # noqa: E402


def run_job(job: dict[str, str]) -> None:
    spec, out = read_job(job)
    run = prepare(stage=spec.stage, seed=spec.seed)
    loader = add_sampled_loader(run.accelerator, DATA_SEED + 1)
    torch.serialization.add_safe_globals(safe_globals())
    run.accelerator.load_state(job["ckpt"])
    report = {"step": run.accelerator.step, "scheduler": run.scheduler.state_dict(), "user": run.user.loaded,
              "draws": draws(), "sampler": sampler_state(loader)}
    write_report(out, report, run.engine)
    run.accelerator.free_memory()


if __name__ == "__main__":
    run_jobs(run_job, __doc__.splitlines()[0])
