"""The consolidation task: the core's plan, one Prefect task per output shard, then finalize.

`consolidate_model` plans (`plan_consolidation`) and runs the core's `ConsolidateStep` with the core's
one step driver (`plumbing.steps.run_step`: prepare, one `ShardJob` per shard run by `run_job`,
`finalize`, `abort` on failure), the shards submitted as `write_shard` tasks (`tasks.units`), so each
shard shows in the UI (`consolidate global_step3 bf16`, `write shard 2/5`): through the flow's task
runner, at most `workers` at a time, or, with a `cluster` address (or `$CKPTFLOW_CLUSTER`), on that
Dask cluster through prefect-dask. The
outputs are the same bytes either way. It is cached on the checkpoint's identity, the options and
OUT (not on where it ran): a second flow run for the same checkpoint does not convert again.

With a config source (`config`, `config_revision`: a folder or a Hub repo), the config and tokenizer
files the checkpoint lacks come from there, its config.json checked against the tensors before any
shard is written (`ckptflow.consolidate.config`); the output's details say whether the folder holds a
config.json (`config_json`), without which `from_pretrained` cannot load it.

A conversion of at least `PROGRESS_BYTES` shows a progress bar while it runs; the result is one
artifact (key `consolidation-<source>-<tag>-<dtype>`): a table of every file in the model folder.
"""

from __future__ import annotations

import posixpath
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from ckptflow import DEFAULT_DTYPE
from ckptflow.consolidate import (
    ConsolidateOptions,
    ConsolidateStep,
    ConsolidationResult,
    ShardJob,
    ShardResult,
    plan_consolidation,
    run_job,
    shaped,
)
from ckptflow.formats import hf
from ckptflow.formats.deepspeed import load_index
from ckptflow.plumbing.redaction import describe
from ckptflow.plumbing.sizes import format_size
from ckptflow.plumbing.steps import run_step
from ckptflow.plumbing.storage import open_fs
from tasks.artifacts import ProgressArtifact, cell_size, checkpoint_key, code, markdown
from tasks.caching import checkpoint_cache_key
from tasks.models import Checkpoint, Output
from tasks.naming import in_form_words
from tasks.retries import io_retries
from tasks.units import cluster_address, unit_executor


def _shard_run_name() -> str:
    """'write shard 2/5' (shards counted from 1, out of the count in the shard's file name)."""
    from prefect.runtime import task_run

    job = task_run.parameters.get("job")
    if job is None:
        return "write shard"
    name = job.unit.filename  # model-00002-of-00005.safetensors, or model.safetensors
    of = name.split("-of-")[1].split(".")[0].lstrip("0") if "-of-" in name else "1"
    return f"write shard {job.unit.index + 1}/{of}"


# Results stay in memory (persist_result=False): a unit's result is small, and on a Dask worker a
# persisted result would land in that worker's own storage, out of the flow run's reach.
@task(name="write-shard", task_run_name=_shard_run_name, cache_policy=NO_CACHE, persist_result=False,
      **io_retries(retries=2))
def write_shard(job: ShardJob, progress: Any = None, cancel: Any = None) -> ShardResult:
    """`ckptflow.consolidate.run_job`: one output shard into the staging folder (the same bytes on a retry)."""
    return run_job(job, progress=progress, cancel=cancel)


@task(
    name="consolidate",
    task_run_name="consolidate {checkpoint.tag} {dtype}",
    cache_key_fn=checkpoint_cache_key,
    persist_result=True,
    **io_retries(retries=2),
)
@in_form_words
def consolidate_model(
    checkpoint: Checkpoint,
    out: str,
    *,
    dtype: str = DEFAULT_DTYPE,
    max_shard_size: str = "5GB",
    exclude_frozen: bool = False,
    workers: int = 4,
    verify: bool = True,
    cluster: str | None = None,
    config: str | None = None,
    config_revision: str | None = None,
    qkv_layout: str | None = None,
) -> Output:
    """Consolidate `checkpoint` into the Hugging Face model folder `out` (which must not exist yet);
    the shards on the Dask cluster at `cluster` (or `$CKPTFLOW_CLUSTER`) when one is given; the config
    and tokenizer files the checkpoint lacks from the config source `config` (at `config_revision`); a
    Megatron-style checkpoint's fused query_key_value joined in the `qkv_layout` the user declares."""
    logger = get_run_logger()
    options = ConsolidateOptions(
        dtype=dtype, max_shard_size=max_shard_size, exclude_frozen=exclude_frozen, workers=workers, verify=verify,
        config=config, config_revision=config_revision, qkv_layout=qkv_layout,
    )
    index = shaped(load_index(checkpoint.root, checkpoint.tag), config, config_revision)
    plan = plan_consolidation(index, options)
    logger.info("%s: %d shard(s), %s of %s weights", checkpoint.uri, len(plan.units), format_size(plan.total_size),
                plan.dtype)
    step = ConsolidateStep(plan, out)
    side = step.side_files()  # a config source is read and checked once, before anything is written
    if side.source is not None:
        logger.info("config source %s: %s taken%s%s", side.source.shown,
                    ", ".join(n for n in side.names if n in side.given) or "nothing",
                    f", checked against {side.architecture}" if side.architecture else "",
                    f"; the checkpoint's own {', '.join(side.unused)} kept instead" if side.unused else "")
    # A folder an earlier run committed (its cached result lost: another machine, a cleared result store)
    # is taken as it is when it holds this very model; anything else there fails the step.
    result = step.committed()
    if result is not None:
        logger.info("%s already holds this model, committed by an earlier run whose cached result is gone: taken "
                    "as it is, nothing written", out)
    else:
        result = _build(checkpoint, step, workers, cluster_address(cluster))
    logger.info("%s holds %d file(s), %d shard(s)%s", out, len(result.files), len(result.shards),
                ", each re-read and compared with the source" if result.verified else "")
    if not result.has_config:
        logger.warning("%s has no config.json (the checkpoint has none and no config source was given): "
                       "from_pretrained cannot load it; give the model's config as the config source", out)
    markdown(
        model_summary(checkpoint, result, _sizes(out)),
        key=checkpoint_key("consolidation", checkpoint.root, checkpoint.tag, dtype),
        description=f"Hugging Face model ({result.dtype}) of {checkpoint.uri}",
    )
    return Output(
        kind="model",
        uri=out,
        files=len(result.files),
        bytes=result.total_size,
        details={"dtype": result.dtype, "shards": len(result.shards), "verified_shards": result.verified,
                 "config_json": result.has_config,
                 **({"config_source": side.source.shown} if side.source is not None else {})},
    )


def _build(checkpoint: Checkpoint, step: ConsolidateStep, workers: int, address: str | None) -> ConsolidationResult:
    """Write the plan's shards (a `write_shard` task each, on threads or on the cluster at `address`) and commit."""
    plan = step.plan
    with ProgressArtifact(nbytes=plan.total_size,
                          description=f"Consolidating {checkpoint.uri} to {plan.options.dtype}") as sink, \
            unit_executor(address, {run_job: write_shard}) as executor:
        if address:
            get_run_logger().info("writing %d shard(s) on the Dask cluster at %s", len(plan.units), address)
        return run_step(step, executor=executor, workers=workers, in_process=not address, progress=sink)


_WHAT = {
    hf.SAFE_WEIGHTS_INDEX_NAME: "which shard holds each tensor",
    hf.PROVENANCE_NAME: "where the model came from (source, options, ckptflow version)",
    hf.CONFIG_NAME: "model config",
    "generation_config.json": "generation defaults",
    "chat_template.jinja": "chat template",
    "chat_template.json": "chat template",
}


def model_summary(checkpoint: Checkpoint, result: ConsolidationResult, sizes: dict[str, int]) -> str:
    """The model folder as one table, a row per file (shards first), with what it holds and its size;
    the line above counts the same rows."""
    tensors = {u.filename: len(u.tensors) for u in result.plan.units}
    rows = []
    for name in [s.filename for s in result.shards] + [f for f in result.files if f not in tensors]:
        if name in tensors:
            what = f"{tensors[name]} tensors, {result.dtype}"
        else:
            what = _WHAT.get(name, "tokenizer" if name.startswith(("tokenizer", "vocab", "merges", "special_tokens",
                                                                   "added_tokens")) or name.endswith(".model") else "")
            if result.side is not None and result.side.source is not None and name in result.side.given:
                what += f", from {code(result.side.source.shown)}"
        size = sizes.get(name)
        rows.append(f"| {code(name)} | {what} | {'' if size is None else cell_size(size)} |")
    total = sum(sizes.get(name, 0) for name in result.files) or result.total_size
    checked = ", every shard re-read and compared with the source" if result.verified else ""
    unloadable = [] if result.has_config else [
        "", "**No config.json**: the checkpoint has none and no config source was given, so `from_pretrained` "
        "cannot load this folder. Consolidate again with the model's config as the config source."]
    return "\n".join([
        f"## Hugging Face model of {checkpoint.tag} ({result.dtype})",
        "",
        f"From {code(checkpoint.uri)} (ZeRO-{checkpoint.stage}, {checkpoint.world_size} ranks, {checkpoint.precision}) "
        f"into {code(result.out)}: {len(rows)} files, {format_size(total)}{checked}.",
        "",
        "| file | holds | size |",
        "|---|---|---:|",
        *rows,
        *unloadable,
    ])


def _sizes(folder: str) -> dict[str, int]:
    """File name -> size in `folder` ({} when it cannot be listed: the table then shows shard sizes only)."""
    try:
        fs, path = open_fs(folder)
        return {posixpath.basename(e["name"].rstrip("/")): int(e["size"]) for e in fs.ls(path, detail=True)
                if e.get("type") == "file" and e.get("size") is not None}
    except Exception as exc:  # the table is for people; the model is written
        get_run_logger().warning("could not list %s for the artifact: %s", folder, describe(exc))
        return {}
