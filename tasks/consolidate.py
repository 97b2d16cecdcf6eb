"""The consolidation task: the core's plan, one Prefect task per output shard, then finalize.

`consolidate_model` calls `ckptflow.consolidate` step by step (`plan_consolidation`,
`prepare_output`, `run_unit` per shard, `finalize`, `abort` on failure) and runs the shards as
`write_shard` tasks through the flow's task runner, at most `workers` at a time, so each shard shows
in the UI and the runner decides where they run. It is cached on the checkpoint's identity, the
options and OUT: a second flow run for the same checkpoint does not convert again.
"""

from __future__ import annotations

import threading
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from ckptflow.consolidate import (
    ConsolidateOptions,
    ConsolidationPlan,
    ShardUnit,
    UnitResult,
    abort,
    finalize,
    plan_consolidation,
    prepare_output,
    run_unit,
)
from ckptflow.formats.deepspeed.checkpoint import load_index
from ckptflow.plumbing.progress import Tally
from ckptflow.plumbing.sizes import format_size
from ckptflow.plumbing.staging import Staging
from tasks.artifacts import ProgressArtifact, artifact_key, markdown
from tasks.caching import checkpoint_cache_key
from tasks.models import Checkpoint, Output
from tasks.retries import io_retries
from tasks.units import run_bounded


@task(name="write-shard", task_run_name="write {unit.filename}", cache_policy=NO_CACHE, **io_retries(retries=2))
def write_shard(
    plan: ConsolidationPlan, unit: ShardUnit, staging: Staging, progress: Any = None, cancel: Any = None
) -> UnitResult:
    """`ckptflow.consolidate.run_unit`: one output shard into the staging folder (rewritten on retry)."""
    return run_unit(plan, unit, staging, progress=progress, cancel=cancel)


@task(
    name="consolidate",
    task_run_name="consolidate {checkpoint.tag} to {out}",
    cache_key_fn=checkpoint_cache_key,
    persist_result=True,
    **io_retries(retries=2),
)
def consolidate_model(
    checkpoint: Checkpoint,
    out: str,
    *,
    dtype: str = "bf16",
    max_shard_size: str = "5GB",
    exclude_frozen: bool = False,
    workers: int = 4,
    verify: bool = True,
) -> Output:
    """Consolidate `checkpoint` into the Hugging Face model folder `out` (which must not exist yet)."""
    logger = get_run_logger()
    options = ConsolidateOptions(
        dtype=dtype, max_shard_size=max_shard_size, exclude_frozen=exclude_frozen, workers=workers, verify=verify
    )
    plan = plan_consolidation(load_index(checkpoint.root, checkpoint.tag), options)
    logger.info("%s: %d shard(s), %s of %s weights", checkpoint.uri, len(plan.units), format_size(plan.total_size),
                plan.dtype)
    sink = ProgressArtifact(
        key=artifact_key("consolidate", checkpoint.tag, dtype),
        description=f"Consolidating {checkpoint.uri} to {dtype} at {out}",
    )
    progress = Tally(sum(u.nbytes for u in plan.units) * (2 if verify else 1), sink)
    staging = prepare_output(plan, out)
    cancel = threading.Event()
    try:
        results = run_bounded(
            lambda unit: write_shard.submit(plan, unit, staging, progress.part(unit.index), cancel),
            plan.units, workers, cancel,
        )
        result = finalize(plan, results, staging)
    except BaseException:
        abort(staging)
        raise
    sink.finish()
    markdown(
        f"## Consolidated model\n\n`{checkpoint.uri}` (ZeRO-{checkpoint.stage}, {checkpoint.world_size} ranks, "
        f"{checkpoint.precision}) → `{out}`\n\n| file | size |\n|---|---|\n"
        + "\n".join(f"| {s.filename} | {format_size(s.size)} |" for s in result.shards)
        + f"\n\n{len(result.files)} files, {format_size(result.total_size)} of {result.dtype} weights"
        + (", every shard re-read and checked against the source." if result.verified else "."),
        key=artifact_key("consolidated", checkpoint.tag, dtype),
        description=f"Consolidated {checkpoint.tag} to {out}",
    )
    return Output(
        kind="model",
        uri=out,
        files=len(result.files),
        bytes=result.total_size,
        details={"dtype": result.dtype, "shards": len(result.shards), "verified_shards": result.verified},
    )
