"""The reshard task: the core's steps, one Prefect task per target rank.

`reshard_checkpoint` plans as `ckptflow.reshard.reshard` does (`plan_output` validates the source
and refuses an OUT inside it) and runs the same `ReshardStep` with the core's one step driver
(`plumbing.steps.run_step`): prepare, one `RankJob` per target rank (made here, just before it is
sent: pickles and source byte ranges) run by `run_job` as `write_rank` tasks (`write rank 1/4 (ws4)`:
unique when one run reshards to several world sizes) through the flow's task runner, or, with a
`cluster` address (or `$CKPTFLOW_CLUSTER`), on that Dask cluster through prefect-dask
(`tasks.units`), then finalize (every file checked against the store's metadata, `latest` last),
abort on failure. Cached on the checkpoint's identity, the world size and
OUT (not on where it ran).

A reshard of at least `PROGRESS_BYTES` shows a progress bar while it runs; the result is one artifact
(key `reshard-<source>-<tag>-ws<M>`): a table of the ranks' files, what was carried over, and which
source rank each Trainer RNG file came from.
"""

from __future__ import annotations

import posixpath
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from ckptflow.plumbing.redaction import describe as describe_error
from ckptflow.plumbing.sizes import format_size
from ckptflow.plumbing.steps import run_step
from ckptflow.plumbing.storage import open_fs
from ckptflow.reshard import RankJob, RankResult, ReshardPlan, ReshardStep, RngCopy, plan_output, run_job, write_threads
from ckptflow.reshard.rng import describe, describe_families
from ckptflow.reshard.shape import Target
from tasks.artifacts import ProgressArtifact, cell_size, checkpoint_key, code, markdown, md
from tasks.caching import checkpoint_cache_key
from tasks.models import Checkpoint, Output
from tasks.naming import in_form_words
from tasks.retries import io_retries
from tasks.units import cluster_address, unit_executor


def _rank_run_name() -> str:
    """'write rank 1/4 (ws4)': the rank and the target world size."""
    from prefect.runtime import task_run

    job = task_run.parameters.get("job")
    if job is None:
        return "write rank"
    return f"write rank {job.rank}/{job.world_size} (ws{job.world_size})"


def _reshard_run_name() -> str:
    """'reshard global_step3 to 4 ranks' ('to 1 rank')."""
    from prefect.runtime import task_run

    parameters = task_run.parameters
    checkpoint, n = parameters.get("checkpoint"), parameters.get("world_size")
    tag = checkpoint.get("tag") if isinstance(checkpoint, dict) else getattr(checkpoint, "tag", None)
    degrees = "".join(f", {axis} {parameters[name]}" for axis, name in
                      (("tp", "tensor_parallel"), ("pp", "pipeline_parallel"), ("ep", "expert_parallel"))
                      if parameters.get(name))
    stage = parameters.get("stage")
    return f"reshard {tag or 'checkpoint'} to {n} rank{'' if n == 1 else 's'}{degrees}" + (
        f", ZeRO-{stage}" if stage else "")


# Results stay in memory (persist_result=False): on a Dask worker a persisted result would land in that
# worker's own storage, out of the flow run's reach.
@task(name="write-rank", task_run_name=_rank_run_name, cache_policy=NO_CACHE, persist_result=False,
      **io_retries(retries=2))
def write_rank(job: RankJob, progress: Any = None, cancel: Any = None) -> RankResult:
    """`ckptflow.reshard.run_job`: one target rank's files into the staging folder (the same bytes on a retry)."""
    return run_job(job, progress=progress, cancel=cancel)


@task(
    name="reshard",
    task_run_name=_reshard_run_name,
    cache_key_fn=checkpoint_cache_key,
    persist_result=True,
    **io_retries(retries=2),
)
@in_form_words
def reshard_checkpoint(checkpoint: Checkpoint, out: str, world_size: int, workers: int = 4,
                       cluster: str | None = None, tensor_parallel: int | None = None,
                       stage: int | None = None, pipeline_parallel: int | None = None,
                       expert_parallel: int | None = None, partition_method: str | None = None,
                       pipeline_layers: int | None = None, qkv_layout: str | None = None,
                       layer_types: str | None = None, tied_modules: str | None = None) -> Output:
    """Rewrite `checkpoint` for `world_size` ranks into the new folder `out`, at ZeRO `stage` and the
    tensor-, pipeline- and expert-parallel degrees given (None keeps the source's; data parallelism is
    what is left; a PipelineModule's layers assigned to new stages by `partition_method`, with
    `pipeline_layers` layers where the files leave it open, a "type:" method over the `layer_types` names the
    user declares; a ZeRO-0 PipelineModule's tied modules as `tied_modules` declares them; a Megatron fused
    `query_key_value` at another tensor-parallel degree in the `qkv_layout` the user declares); the ranks on
    the Dask cluster at `cluster`
    (or `$CKPTFLOW_CLUSTER`) when one is given."""
    logger = get_run_logger()
    target = Target(world_size=world_size, tp=tensor_parallel, stage=stage, pp=pipeline_parallel, ep=expert_parallel,
                    partition_method=partition_method, pipeline_layers=pipeline_layers, qkv_layout=qkv_layout,
                    layer_types=layer_types, tied_modules=tied_modules)
    plan = plan_output(checkpoint.root, out, target=target, tag=checkpoint.tag)
    logger.info("%s: %d -> %d ranks, %s to write", checkpoint.uri, plan.source_world_size, world_size,
                format_size(plan.write_bytes))
    # A folder an earlier run committed (its cached result lost: another machine, a cleared result store)
    # is taken as it is when it holds this very checkpoint; anything else there fails the step.
    found = ReshardStep(plan, out).committed()
    if found is not None:
        logger.info("%s already holds this checkpoint, committed by an earlier run whose cached result is gone: "
                    "taken as it is, nothing written", out)
    results, rng_files = found or _build(checkpoint, plan, out, workers, cluster_address(cluster))
    for label, text in describe_families(rng_files):
        logger.info("%s RNG files: %s", label, text)
    notes = getattr(plan, "notes", ())  # a model-parallel plan's: what the user should know of the output
    for note in notes:
        logger.info("note: %s", note)
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
                 "tensor_parallel": tensor_parallel, "target_stage": stage, "pipeline_parallel": pipeline_parallel,
                 "expert_parallel": expert_parallel, "shape": str(plan.shape),
                 "rng_files": describe(rng_files) if rng_files else None, "notes": list(notes) or None},
    )


def _build(checkpoint: Checkpoint, plan: ReshardPlan, out: str, workers: int, address: str | None
           ) -> tuple[list[RankResult], tuple[RngCopy, ...]]:
    """Write every target rank (a `write_rank` task each, on threads or on the cluster at `address`) and commit."""
    threads = 1 if address else write_threads(workers, len(plan.units))
    with ProgressArtifact(nbytes=plan.read_bytes,
                          description=f"Resharding {checkpoint.uri} to {plan.world_size} ranks") as sink, \
            unit_executor(address, {run_job: write_rank}) as executor:
        if address:
            get_run_logger().info("writing %d rank(s) on the Dask cluster at %s", len(plan.units), address)
        return run_step(ReshardStep(plan, out, threads=threads), executor=executor, workers=workers,
                        in_process=not address, progress=sink)


def reshard_summary(
    checkpoint: Checkpoint,
    plan: ReshardPlan,
    results: list[RankResult],
    rng_files: tuple[RngCopy, ...],
    out: str,
    listing: list[str],
) -> str:
    """One table, a row per target rank (its files and their size), and a line each on the files carried
    over and the per-process RNG files (Trainer's, Accelerate's)."""
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
    for label, text in describe_families(rng_files):
        lines += [f"{label} RNG files: {md(text)}.", ""]
    return "\n".join(lines).rstrip() + "\n"


def _listing(folder: str) -> list[str]:
    """Names at the top of `folder` ([] when it cannot be listed)."""
    try:
        fs, path = open_fs(folder)
        return sorted(posixpath.basename(p.rstrip("/")) for p in fs.ls(path, detail=False))
    except Exception as exc:  # the artifact is for people; the checkpoint is written
        get_run_logger().warning("could not list %s for the artifact: %s", folder, describe_error(exc))
        return []
