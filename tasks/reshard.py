"""The reshard task: the core's steps, one Prefect task per target rank.

`reshard_checkpoint` calls `ckptflow.reshard` step by step, as `ckptflow.reshard.reshard` does:
`plan_output` (validates the source and refuses an OUT inside it), `prepare_output`, `run_unit` per
target rank as `write_rank` tasks through the flow's task runner, `finalize`, `abort` on failure.
Cached on the checkpoint's identity, the world size and OUT.
"""

from __future__ import annotations

import threading
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from ckptflow.plumbing.progress import Tally
from ckptflow.plumbing.sizes import format_size
from ckptflow.plumbing.staging import Staging
from ckptflow.reshard import (RankUnit, ReshardPlan, UnitResult, abort, finalize, plan_output, prepare_output, run_unit,
                              write_threads)
from tasks.artifacts import ProgressArtifact, artifact_key
from tasks.caching import checkpoint_cache_key
from tasks.models import Checkpoint, Output
from tasks.retries import io_retries
from tasks.units import run_bounded


@task(name="write-rank", task_run_name="write rank {unit.rank}", cache_policy=NO_CACHE, **io_retries(retries=2))
def write_rank(plan: ReshardPlan, unit: RankUnit, staging: Staging, progress: Any = None, cancel: Any = None,
               threads: int = 1) -> UnitResult:
    """`ckptflow.reshard.run_unit`: one target rank's files into the staging folder (rewritten on retry)."""
    return run_unit(plan, unit, staging, progress=progress, threads=threads, cancel=cancel)


@task(
    name="reshard",
    task_run_name="reshard {checkpoint.tag} to {world_size} ranks",
    cache_key_fn=checkpoint_cache_key,
    persist_result=True,
    **io_retries(retries=2),
)
def reshard_checkpoint(checkpoint: Checkpoint, out: str, world_size: int, workers: int = 4) -> Output:
    """Rewrite `checkpoint` for `world_size` data-parallel ranks into the new folder `out`."""
    logger = get_run_logger()
    plan = plan_output(checkpoint.root, out, world_size=world_size, tag=checkpoint.tag)
    logger.info("%s: %d -> %d ranks, %s to write", checkpoint.uri, plan.source_world_size, world_size,
                format_size(plan.write_bytes))
    sink = ProgressArtifact(
        key=artifact_key("reshard", checkpoint.tag, f"ws{world_size}"),
        description=f"Resharding {checkpoint.uri} to {world_size} ranks at {out}",
    )
    progress = Tally(plan.read_bytes, sink)
    staging = prepare_output(plan, out)
    threads = write_threads(workers, len(plan.units))
    cancel = threading.Event()
    try:
        results = run_bounded(
            lambda unit: write_rank.submit(plan, unit, staging, progress.part(unit.rank), cancel, threads),
            plan.units, workers, cancel,
        )
        finalize(plan, staging)
    except BaseException:
        abort(staging)
        raise
    sink.finish()
    return Output(
        kind="reshard",
        uri=out,
        world_size=world_size,
        files=len(plan.files),
        bytes=sum(r.bytes_written for r in results),
        details={"stage": plan.stage, "precision": plan.precision, "source_world_size": plan.source_world_size},
    )
