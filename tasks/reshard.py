"""The reshard task: the core's steps, one Prefect task per target rank.

`reshard_checkpoint` calls `ckptflow.reshard` step by step, as `ckptflow.reshard.reshard` does:
`plan_output` (validates the source and refuses an OUT inside it), `prepare_output`, `run_unit` per
target rank as `write_rank` tasks through the flow's task runner (`write rank 1/4 (ws4)`: unique when
one run reshards to several world sizes), `finalize`, `abort` on failure. Cached on the checkpoint's
identity, the world size and OUT.

A reshard of at least `PROGRESS_BYTES` shows a progress bar while it runs; the result is one artifact
(key `reshard-<source>-<tag>-ws<M>`): a table of the ranks' files, what was carried over, and which
source rank each Trainer RNG file came from.
"""

from __future__ import annotations

import posixpath
import threading
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from ckptflow.plumbing.progress import Tally
from ckptflow.plumbing.sizes import format_size
from ckptflow.plumbing.staging import Staging
from ckptflow.plumbing.storage import open_fs
from ckptflow.reshard import (RankUnit, ReshardPlan, RngCopy, UnitResult, abort, finalize, plan_output, prepare_output,
                              run_unit, write_threads)
from ckptflow.reshard.rng import describe
from ckptflow.plumbing.redaction import describe as describe_error
from tasks.artifacts import ProgressArtifact, cell_size, checkpoint_key, code, markdown, md
from tasks.caching import checkpoint_cache_key
from tasks.models import Checkpoint, Output
from tasks.retries import io_retries
from tasks.units import run_bounded


def _rank_run_name() -> str:
    """'write rank 1/4 (ws4)': the rank and the target world size."""
    from prefect.runtime import task_run

    parameters = task_run.parameters
    unit, plan = parameters.get("unit"), parameters.get("plan")
    if unit is None or plan is None:
        return "write rank"
    return f"write rank {unit.rank}/{plan.world_size} (ws{plan.world_size})"


def _reshard_run_name() -> str:
    """'reshard global_step3 to 4 ranks' ('to 1 rank')."""
    from prefect.runtime import task_run

    parameters = task_run.parameters
    checkpoint, n = parameters.get("checkpoint"), parameters.get("world_size")
    tag = checkpoint.get("tag") if isinstance(checkpoint, dict) else getattr(checkpoint, "tag", None)
    return f"reshard {tag or 'checkpoint'} to {n} rank{'' if n == 1 else 's'}"


@task(name="write-rank", task_run_name=_rank_run_name, cache_policy=NO_CACHE, **io_retries(retries=2))
def write_rank(plan: ReshardPlan, unit: RankUnit, staging: Staging, progress: Any = None, cancel: Any = None,
               threads: int = 1) -> UnitResult:
    """`ckptflow.reshard.run_unit`: one target rank's files into the staging folder (rewritten on retry)."""
    return run_unit(plan, unit, staging, progress=progress, threads=threads, cancel=cancel)


@task(
    name="reshard",
    task_run_name=_reshard_run_name,
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
    staging = prepare_output(plan, out)
    threads = write_threads(workers, len(plan.units))
    cancel = threading.Event()
    with ProgressArtifact(nbytes=plan.read_bytes,
                          description=f"Resharding {checkpoint.uri} to {world_size} ranks") as sink:
        progress = Tally(plan.read_bytes, sink)
        try:
            results = run_bounded(
                lambda unit: write_rank.submit(plan, unit, staging, progress.part(unit.rank), cancel, threads),
                plan.units, workers, cancel,
            )
            rng_files = finalize(plan, staging)
        except BaseException:
            abort(staging)
            raise
    if rng_files:
        logger.info("Trainer RNG files: %s", describe(rng_files))
    markdown(
        reshard_summary(checkpoint, plan, results, rng_files, out, _listing(out)),
        key=checkpoint_key("reshard", checkpoint.root, checkpoint.tag, f"ws{world_size}"),
        description=f"ZeRO checkpoint of {checkpoint.uri} for {world_size} ranks",
    )
    return Output(
        kind="reshard",
        uri=out,
        world_size=world_size,
        files=len(plan.files),
        bytes=sum(r.bytes_written for r in results),
        details={"stage": plan.stage, "precision": plan.precision, "source_world_size": plan.source_world_size,
                 "rng_files": describe(rng_files) if rng_files else None},
    )


def reshard_summary(checkpoint: Checkpoint, plan: ReshardPlan, results: list[UnitResult], rng_files: tuple[RngCopy, ...],
                    out: str, listing: list[str]) -> str:
    """One table, a row per target rank (its files and their size), and a line each on the files carried
    over and the Trainer RNG files."""
    rows = [f"| {r.rank} | " + ", ".join(code(f) for f in r.files) + f" | {cell_size(r.bytes_written)} |"
            for r in sorted(results, key=lambda r: r.rank)]
    rng = {c.target for c in rng_files}
    carried = [n for n in listing if n not in (plan.tag, "latest") and n not in rng]
    lines = [
        f"## ZeRO checkpoint of {checkpoint.tag} for {plan.world_size} ranks",
        "",
        f"From {code(checkpoint.uri)} (ZeRO-{plan.stage}, {plan.source_world_size} ranks, {plan.precision}) into "
        f"{code(out)}: DeepSpeed loads it natively at {plan.world_size} ranks. "
        f"{len(plan.files)} files in {code(plan.tag + '/')}, {format_size(sum(r.bytes_written for r in results))}.",
        "",
        "| rank | files | size |",
        "|---:|---|---:|",
        *rows,
        "",
    ]
    if carried:
        lines += ["Carried over from the source: " + ", ".join(code(n) for n in carried) + ".", ""]
    if rng_files:
        lines += [f"Trainer RNG files: {md(describe(rng_files))}.", ""]
    return "\n".join(lines).rstrip() + "\n"


def _listing(folder: str) -> list[str]:
    """Names at the top of `folder` ([] when it cannot be listed)."""
    try:
        fs, path = open_fs(folder)
        return sorted(posixpath.basename(p.rstrip("/")) for p in fs.ls(path, detail=False))
    except Exception as exc:  # the artifact is for people; the checkpoint is written
        get_run_logger().warning("could not list %s for the artifact: %s", folder, describe_error(exc))
        return []
