"""Rank script for the expert-parallel reshard oracle: DeepSpeed itself, at this launch's world size,
trains or loads a parallel fixture's model and saves it again.

Run on M ranks by ``launch("tests.oracles.expert_reshard", M, ["--jobs", FILE])``. ``FILE`` holds a
JSON list of jobs, run in order. Each builds the model of a parallel fixture (``"spec"``: its
``spec.json``) with that fixture's DeepSpeed config through the fixture writer's own job class
(``tests.fixtures.writers.parallel.JOBS``), at this world size and expert-parallel degree ``"ep"``
(the fixture's when absent; the writers draw each expert by its global id, so it is the same model at
any degree) and ZeRO stage ``"stage"`` (the fixture's when absent), and then:

- with ``"write": DIR``: trains the fixture's steps from scratch and saves there, so that what
  DeepSpeed writes at this size can be compared field by field with a reshard (with ``"state"``, the
  state it gathers after training too: a source made here);
- with ``"load": DIR``: ``engine.load_checkpoint(DIR)`` (no universal flag), gathers the state the
  way the writer gathered its oracle and writes it to ``"state"`` (safetensors, rank 0), and with
  ``"save": DIR2`` saves it again under the loaded tag.

``"frozen"`` (a list of the model's parameter names) trains the model with those parameters frozen
(``requires_grad`` off, left out of the optimizer's groups): their gathered state is their value as
``fp32`` and zero moments, as the optimizer holds none.

``"max_group_size"`` (elements) builds the engine with that as DeepSpeed's size limit of an expert
param group: the default of ``deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer``
(178,956,971, which the engine always uses) patched for the job, so that the tiny models' expert
groups are cut as a real-size model's are (the tests patch ckptflow's assumed default alike where
they mean DeepSpeed's default, and leave it where ckptflow must infer the limit).

``"data_types"`` (a config section) builds every config with it (``writers.parallel_bf16.data_types``): a
source's fp32 gradient accumulation, which makes it BF16_Optimizer's at bf16 ZeRO-1.

``"round_robin"`` (true) builds every config with ``zero_optimization.round_robin_gradients`` and gathers the
state from the flat partitions (``writers.parallel_rr.round_robin``): a source trained so.

``"hang_after"`` (seconds) dumps every rank's Python stack to its log if the job is still running
then, which is how a load that never returns shows where it waits.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402
from deepspeed import comm as dist  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from tests.fixtures.launch import run_jobs  # noqa: E402
from tests.fixtures.specs.parallel import ParallelSpec  # noqa: E402
from tests.fixtures.writers import parallel as writer  # noqa: E402
from tests.fixtures.writers.parallel import JOBS  # noqa: E402
from tests.fixtures.writers.parallel_bf16 import data_types  # noqa: E402
from tests.fixtures.writers.parallel_rr import round_robin  # noqa: E402
from tests.fixtures.writers.rank import relink_optimizer_state  # noqa: E402


@contextlib.contextmanager
def frozen_parameters(names: frozenset[str]) -> Iterator[None]:
    """Within it, the writer builds Hugging Face models with `names` frozen and out of the optimizer's
    param groups, and gathers a frozen parameter's state as its whole value and zero moments."""
    build, groups, local = writer.models.build_hf_model, writer.models.param_groups, writer._local_states

    def build_frozen(*args: Any) -> Any:
        model = build(*args)
        for name, param in model.named_parameters():
            if name in names:
                param.requires_grad_(False)
        return model

    def trainable_groups(model: Any) -> list[dict[str, Any]]:
        return [{**g, "params": [p for p in g["params"] if p.requires_grad]} for g in groups(model)]

    def states(engine: Any, param: Any) -> dict[str, torch.Tensor]:
        if param.requires_grad:
            return local(engine, param)
        with deepspeed.zero.GatheredParameters([param], enabled=hasattr(param, "ds_id")):
            value = param.detach().cpu().float().clone().contiguous()
        return {"fp32": value, "exp_avg": torch.zeros_like(value), "exp_avg_sq": torch.zeros_like(value)}

    writer.models.build_hf_model, writer.models.param_groups, writer._local_states = (
        build_frozen, trainable_groups, states)
    try:
        yield
    finally:
        writer.models.build_hf_model, writer.models.param_groups, writer._local_states = build, groups, local


@contextlib.contextmanager
def moe_group_limit(limit: int | None) -> Iterator[None]:
    """Within it, DeepSpeed cuts expert param groups at `limit` elements (None: its own default)."""
    from deepspeed.moe import utils

    split = utils.split_params_into_different_moe_groups_for_optimizer
    defaults = split.__defaults__
    if limit is not None:
        split.__defaults__ = (limit,)
    try:
        yield
    finally:
        split.__defaults__ = defaults


def run_job(job: dict[str, Any]) -> None:
    with (round_robin(bool(job.get("round_robin"))), frozen_parameters(frozenset(job.get("frozen") or ())),
          moe_group_limit(job.get("max_group_size")), data_types(job.get("data_types"))):
        _run_job(job)


def _run_job(job: dict[str, Any]) -> None:
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
        if job.get("state"):
            relink_optimizer_state(engine)
            _save_state(runner, engine, job["state"])
    else:
        tag = Path(job["load"], "latest").read_text().strip()
        path, _ = engine.load_checkpoint(job["load"], tag=tag)
        if path is None:
            raise RuntimeError(f"DeepSpeed loaded nothing from {job['load']}")
        if job.get("save"):
            engine.save_checkpoint(job["save"], tag=tag, client_state=runner.client_state())
        relink_optimizer_state(engine)
        _save_state(runner, engine, job.get("state"))
    faulthandler.cancel_dump_traceback_later()
    dist.barrier()
    engine.destroy()
    del engine, runner
    gc.collect()


def _save_state(runner: Any, engine: Any, path: str | None) -> None:
    """The state the fixture's writer gathers (collective), and the buffers, saved by rank 0 at `path`."""
    state = runner.gather(engine)
    buffers = runner.buffers(engine)
    if dist.get_rank() == 0 and path:
        save_file({**state, **{f"buffer/{k}": v for k, v in buffers.items()}}, path)


def main(argv: list[str] | None = None) -> None:
    run_jobs(run_job, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    main()
