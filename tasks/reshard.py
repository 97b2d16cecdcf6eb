"""The reshard task: the core's plan, one Prefect task per target rank, then finalize.

`reshard_checkpoint` calls `ckptflow.reshard` step by step (`plan_reshard`, `prepare_output`,
`run_unit` per target rank, `finalize`, `discard` on failure) with the ranks as `write_rank` tasks
through the flow's task runner. Cached on the checkpoint's identity, the world size and OUT.
"""

from __future__ import annotations

import threading
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from ckptflow.reshard import (RankUnit, ReshardPlan, UnitResult, discard, finalize, plan_reshard, prepare_output, run_unit,
                              write_threads)
from ckptflow.zero import load_index
from tasks.artifacts import ProgressArtifact, artifact_key, human_bytes
from tasks.caching import checkpoint_cache_key
from tasks.models import Checkpoint, Output
from tasks.retries import io_retries
from tasks.units import run_bounded


class _Bytes:
    """Turns `run_unit`'s "n more bytes written" reports into (done, total) for an artifact."""

    def __init__(self, total: int, sink: Any) -> None:
        self.total, self.done, self._sink = max(total, 1), 0, sink
        self._lock = threading.Lock()

    def __call__(self, nbytes: int) -> None:
        with self._lock:
            self.done += nbytes
            done = self.done
        self._sink(min(done, self.total), self.total)


@task(name="write-rank", task_run_name="write rank {unit.rank}", cache_policy=NO_CACHE, **io_retries(retries=2))
def write_rank(plan: ReshardPlan, unit: RankUnit, staging: str, progress: Any = None, cancel: Any = None,
               threads: int = 1) -> UnitResult:
    """`ckptflow.reshard.run_unit`: one target rank's files into the staging folder (rewritten on retry)."""
    if cancel is not None and cancel.is_set():
        raise RuntimeError(f"rank {unit.rank} not written: another rank failed")
    return run_unit(plan, unit, staging, progress=progress, threads=threads)


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
    plan = plan_reshard(load_index(checkpoint.root, checkpoint.tag), world_size)
    logger.info("%s: %d -> %d ranks, %s to write", checkpoint.uri, plan.source_world_size, world_size,
                human_bytes(plan.write_bytes))
    sink = ProgressArtifact(
        key=artifact_key("reshard", checkpoint.tag, f"ws{world_size}"),
        description=f"Resharding {checkpoint.uri} to {world_size} ranks at {out}",
    )
    progress = _Bytes(plan.read_bytes, sink)  # run_unit reports the source bytes it copies
    staging = prepare_output(out, need=plan.write_bytes)
    threads = write_threads(workers, len(plan.units))
    cancel = threading.Event()
    try:
        results = run_bounded(
            lambda unit: write_rank.submit(plan, unit, staging, progress, cancel, threads), plan.units, workers, cancel
        )
        finalize(plan, staging, out)
    except BaseException:
        discard(staging)
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
