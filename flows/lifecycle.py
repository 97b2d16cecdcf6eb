"""`checkpoint_lifecycle`: validate, consolidate + verify, reshard, publish, summarize.

1. Validate the source (waiting, within the settle time, for rank files still arriving).
2. Consolidate and verify the model, and reshard to every target world size, side by side through
   the flow's task runner (each of them splits into per-shard / per-rank tasks). With
   `consolidation.deployment` set, consolidation and verification run as that deployment (on the GPU
   work pool) through `run_deployment`, keyed so that one checkpoint gets one child run.
3. When everything built and verified, publish each output to each destination that wants it.
4. Leave a markdown summary of what was produced where.

Every step is cached on (source, tag, content identity, options): running the flow again for the
same checkpoint skips what was done, and never publishes twice.

Nothing waits without end: a named GPU deployment is checked for a worker before anything else (the
run fails at once, naming the pool, when none is polling it), its child run has a time limit and is
cancelled when it passes, and the flow itself has one (`CKPTFLOW_FLOW_TIMEOUT_HOURS`, default 24,
read when the module is imported on the worker).

`post_training` is the scheduled variant: the newest tag of each configured run, one lifecycle each.
"""

import hashlib
import json
import logging
import re
from datetime import datetime, timezone
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.futures import PrefectFuture
from prefect.task_runners import ThreadPoolTaskRunner
from pydantic import Field

from ckptflow.plumbing.redaction import describe
from ckptflow.plumbing.sizes import format_size
from flows import paths
from flows.params import (
    ConsolidationForm,
    Destination,
    PublishForm,
    ReshardForm,
    Text,
    ValidationForm,
    VerificationForm,
    flow_timeout_seconds,
)
from tasks.artifacts import checkpoint_key, code, link, markdown, md
from tasks.caching import checkpoint_cache_key
from tasks.consolidate import consolidate_model
from tasks.models import Checkpoint, Output, Published
from tasks.publish import publish_output
from tasks.reshard import reshard_checkpoint
from tasks.validate import validate_checkpoint
from tasks.verify import verification_rows, verify_output

logger = logging.getLogger(__name__)


FLOW_TIMEOUT_SECONDS = flow_timeout_seconds()


class LifecycleError(RuntimeError):
    """One or more steps of the lifecycle failed; the message names each."""


class DeploymentNotReady(RuntimeError):
    """The GPU deployment named for consolidation cannot start a run now; the message says why and what to do."""


def _titled(default: Any, title: str) -> Any:
    """A parameter default with a title for the deployment form (Prefect titles top-level fields with their
    Python names otherwise)."""
    return Field(default, json_schema_extra={"title": title})


def source_label(source: str, tag: str | None = None) -> str:
    """'llama-7b@global_step1200': the run folder's name (with its parent's for Trainer `checkpoint-N`
    folders) and the tag, for run names."""
    parts = [p for p in re.split(r"[/:]+", source.rstrip("/")) if p and p not in (".", "..")]
    trainer = len(parts) > 1 and parts[-1].startswith("checkpoint-")  # output_dir/checkpoint-N
    name = "/".join(parts[-2:]) if trainer else (parts[-1] if parts else "checkpoint")
    return f"{name}@{tag or 'latest'}"


def _lifecycle_run_name() -> str:
    from prefect.runtime import flow_run

    parameters = flow_run.parameters
    return source_label(str(parameters.get("source", "")), parameters.get("tag") or None)


def _post_training_run_name() -> str:
    from prefect.runtime import flow_run

    runs = [source_label(r).split("@")[0] for r in flow_run.parameters.get("runs") or []]
    return "post-training: " + (", ".join(runs[:3]) + (f" +{len(runs) - 3}" if len(runs) > 3 else "") or "no runs")


@flow(
    name="checkpoint-lifecycle",
    flow_run_name=_lifecycle_run_name,
    task_runner=ThreadPoolTaskRunner(max_workers=32),
    timeout_seconds=FLOW_TIMEOUT_SECONDS,
    log_prints=False,
)
def checkpoint_lifecycle(
    source: str = Field(..., json_schema_extra={"title": "Source checkpoint"}, min_length=1),
    tag: Text = _titled("", "Tag"),
    validation: ValidationForm = _titled(ValidationForm(), "Validation"),
    consolidation: ConsolidationForm = _titled(ConsolidationForm(), "Hugging Face model"),
    reshard: ReshardForm = _titled(ReshardForm(), "Reshard"),
    verification: VerificationForm = _titled(VerificationForm(), "Verification"),
    destinations: list[Destination] = _titled([], "Destinations"),
    publishing: PublishForm = _titled(PublishForm(), "Publishing"),
    workspace: Text = _titled("", "Workspace"),
    refresh: bool = _titled(False, "Rebuild everything"),
    cluster: Text = _titled("", "Dask cluster"),
) -> dict[str, Any]:
    """Turn a DeepSpeed ZeRO checkpoint into a verified Hugging Face model and resharded checkpoints, and publish them.

    Args:
        source: The folder DeepSpeed saved into (it holds `latest`), local or a bucket URL (gs://, s3://, ...).
        tag: The checkpoint tag to process (e.g. 'global_step1200'); empty takes the one `latest` names.
        validation: How the checkpoint is checked first, and how long to wait for rank files still arriving.
        consolidation: The Hugging Face model to build: on or off, dtype, shard size, and where it runs.
        reshard: The shapes to rewrite the ZeRO checkpoint for: world sizes (ranks), ZeRO stage, parallel degrees.
        verification: Load the built model with transformers and check it against the checkpoint.
        destinations: Where to publish: Hub repos ('hf://org/name') and bucket URLs, each for the model, the
            resharded checkpoints or both.
        publishing: Upload settings (parallel uploads, Hub endpoint and token).
        workspace: Where outputs are built before publishing (a folder or bucket URL); empty uses
            $CKPTFLOW_WORKSPACE or ~/.cache/ckptflow/work on the worker. Must be a bucket when consolidation runs
            on a GPU deployment elsewhere.
        refresh: Ignore cached results and do every step again.
        cluster: Run the conversion's units (one per output shard and per target rank) on the Dask scheduler at
            this address, e.g. 'tcp://ckptflow-scheduler.ckptflow.svc.cluster.local:8786' (infra/dask); empty uses
            $CKPTFLOW_CLUSTER on the worker, or threads when that is unset too.
    """
    log = get_run_logger()
    destinations = [d if isinstance(d, Destination) else Destination.model_validate(d) for d in destinations]
    if consolidation.enabled and consolidation.deployment:
        check_deployment_ready(consolidation.deployment)  # before any waiting: fail now if no worker would run it
    checkpoint = validate_checkpoint(
        source, tag or None, deep=validation.deep, settle_seconds=validation.settle_seconds,
        poll_seconds=validation.poll_seconds,
    )
    if not tag:
        _rename_run(source_label(source, checkpoint.tag))
    base = paths.checkpoint_workspace(checkpoint, workspace or None)
    log.info("building %s into %s", checkpoint.uri, base)

    # Build: the model (and its verification) and every reshard, side by side. A step whose output
    # folder is gone (a cleaned workspace) is built again even when its result is cached.
    def build_options(out: str) -> dict[str, Any]:
        if refresh:
            paths.remove(out)
        return {"refresh_cache": True} if refresh or _gone(out) else {}

    model_future: PrefectFuture[Output] | None = None
    verify_future: PrefectFuture[dict[str, Any]] | None = None
    if consolidation.enabled:
        out = paths.model_folder(base, consolidation)
        built = build_options(out)
        if consolidation.deployment:
            model_future = consolidate_on_deployment.with_options(**built).submit(
                checkpoint, out, consolidation.deployment, consolidation, verification,
                run_name=f"{source_label(source, checkpoint.tag)} {consolidation.dtype}",
            )
        else:
            model_future = consolidate_model.with_options(**built).submit(
                checkpoint, out, dtype=consolidation.dtype, max_shard_size=consolidation.max_shard_size,
                exclude_frozen=consolidation.exclude_frozen, workers=consolidation.workers, cluster=cluster or None,
                config=consolidation.config or None, config_revision=consolidation.config_revision or None,
                qkv_layout=consolidation.layout,
            )
            if verification.enabled:
                verify_future = verify_output.with_options(**built).submit(
                    checkpoint, model_future, device=verification.device or None
                )
    reshard_futures = {}
    shapes = {target.world_size: target for target in reshard.targets()}
    for n, target in shapes.items():
        out = paths.reshard_folder(base, target)
        reshard_futures[n] = reshard_checkpoint.with_options(**build_options(out)).submit(
            checkpoint, out, n, cluster=cluster or None, tensor_parallel=target.tp, stage=target.stage,
            pipeline_parallel=target.pp, expert_parallel=target.ep, partition_method=target.partition_method,
            pipeline_layers=target.pipeline_layers, qkv_layout=target.qkv_layout, layer_types=target.layer_types,
            tied_modules=target.tied_modules)

    failures: list[str] = []
    model = _outcome(model_future, "consolidation", failures)
    verified = _outcome(verify_future, "verification", failures)
    if model is not None and consolidation.deployment and verification.enabled:
        verified = model.details.get("verification")
    reshards = {n: _outcome(f, f"reshard to {n} ranks", failures) for n, f in reshard_futures.items()}
    if failures:
        _summary(checkpoint, model, verified, reshards, [], failures)
        raise LifecycleError(f"{checkpoint.uri}: " + "; ".join(failures) + "; nothing was published")

    # Publish: only what was built (and verified) above.
    pushes: list[tuple[str, PrefectFuture[Published]]] = []
    for dest in destinations:
        targets: list[tuple[Output, str, str | None]] = []
        if dest.includes("model") and model is not None:
            targets.append((model, *paths.model_destination(dest, checkpoint.tag)))
        if dest.includes("reshards"):
            targets += [(o, *paths.reshard_destination(dest, checkpoint.tag, shapes[n]))
                        for n, o in reshards.items() if o]
        for output, uri, revision in targets:
            # A bucket destination whose manifest is gone (deleted since) is published again.
            gone = not dest.is_hub and _gone(paths.published_marker(uri))
            options: dict[str, Any] = {"tags": {"hub-upload"} if dest.is_hub else {"bucket-upload"}}
            if refresh or gone:
                options["refresh_cache"] = True
            future = publish_output.with_options(**options).submit(
                checkpoint, output, uri, revision=revision or None, private=dest.private, workers=publishing.workers,
                endpoint=(publishing.hub_endpoint or None) if dest.is_hub else None,
                token_secret=publishing.hub_token_block if dest.is_hub else None,
            )
            pushes.append((f"publishing {output.kind} to {uri}" + (f"@{revision}" if revision else ""), future))
    published = [p for what, f in pushes if (p := _outcome(f, what, failures)) is not None]

    summary = _summary(checkpoint, model, verified, reshards, published, failures)
    if failures:
        raise LifecycleError(f"{checkpoint.uri}: " + "; ".join(failures))
    log.info("done: %s", summary["headline"])
    return summary


def _rename_run(name: str) -> None:
    """Give the current flow run `name` (once the tag `latest` named is known); a failure only logs."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    try:
        if flow_run.id:
            with get_client(sync_client=True) as client:
                client.update_flow_run(flow_run.id, name=name)
    except Exception as exc:  # the name is for people; the run goes on
        get_run_logger().debug("could not rename the flow run to %s: %s", name, exc)


@task(name="check-deployment-ready", task_run_name="check {deployment} has a worker")
def check_deployment_ready(deployment: str) -> None:
    """Fail at once, saying what to do, when a run of `deployment` would wait for a worker that is not there.

    Ready means: the deployment exists and is not paused, and its work pool (not paused) has an online
    worker; a push or managed pool needs none; a deployment served by a process (`.serve()`, no pool)
    is ready when the server marks it so (that process polled within the last minute).
    """
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import DeploymentStatus, WorkerStatus
    from prefect.exceptions import ObjectNotFound

    empty = "or leave consolidation.deployment empty to consolidate in this run"
    with get_client(sync_client=True) as client:
        try:
            found = client.read_deployment_by_name(deployment)
        except ObjectNotFound:
            raise DeploymentNotReady(
                f"consolidation deployment {deployment!r} does not exist on this Prefect server: deploy it "
                f"(infra/bootstrap.sh) {empty}"
            ) from None
        if found.paused:
            raise DeploymentNotReady(f"consolidation deployment {deployment!r} is paused: resume it {empty}")
        pool_name = found.work_pool_name
        if not pool_name:
            if found.status == DeploymentStatus.READY:
                return
            raise DeploymentNotReady(
                f"consolidation deployment {deployment!r} is served by a process (no work pool) that has not "
                f"polled in the last minute: start it again {empty}"
            )
        pool = client.read_work_pool(pool_name)
        if pool.type.endswith(":push") or pool.type.endswith(":managed"):
            return
        if pool.is_paused:
            raise DeploymentNotReady(
                f"consolidation deployment {deployment!r} runs on work pool {pool_name!r}, which is paused: "
                f"resume it (`prefect work-pool resume {pool_name}`) {empty}"
            )
        workers = client.read_workers_for_work_pool(pool_name)
        if any(w.status == WorkerStatus.ONLINE for w in workers):
            return
        raise DeploymentNotReady(
            f"consolidation deployment {deployment!r} runs on work pool {pool_name!r}, which has no online worker "
            f"({len(workers)} known, none online), so its run would wait there: start one "
            f"(`prefect worker start --pool {pool_name}`) {empty}"
        )


@task(
    name="consolidate-on-deployment",
    task_run_name="consolidate {checkpoint.tag} on {deployment}",
    cache_key_fn=checkpoint_cache_key,
    persist_result=True,
    tags={"gpu"},
)
def consolidate_on_deployment(
    checkpoint: Checkpoint,
    out: str,
    deployment: str,
    consolidation: ConsolidationForm,
    verification: VerificationForm,
    run_name: str | None = None,
) -> Output:
    """Run consolidation (and verification) as the deployment `deployment`, and wait for it.

    The child run's idempotency key is derived from the source, tag, content identity and options,
    so re-running this flow attaches to the same child run instead of starting another. A child from
    an earlier attempt that ended failed is started once more (under a new key); a child that fails
    now fails this task with its reason. A child not finished within `consolidation.timeout_minutes`
    (waiting for a worker included) is cancelled and fails this task.
    """
    from prefect.deployments import run_deployment

    log = get_run_logger()
    params = {
        "checkpoint": checkpoint.model_dump(mode="json"),
        "out": out,
        "consolidation": consolidation.model_copy(update={"deployment": ""}).model_dump(mode="json"),
        "verification": verification.model_dump(mode="json"),
    }
    digest = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:16]
    key = f"ckptflow:{checkpoint.root}/{checkpoint.tag}:{checkpoint.identity}:{digest}"
    limit = consolidation.timeout_minutes * 60
    asked = datetime.now(timezone.utc)
    run = run_deployment(deployment, parameters=params, idempotency_key=key, timeout=limit, as_subflow=True,
                         flow_run_name=run_name)
    earlier = run.created is not None and run.created < asked
    if earlier and run.state is not None and run.state.is_final() and not run.state.is_completed():
        log.warning("child run %s for this checkpoint ended %s earlier; starting it again", run.name, run.state.name)
        from prefect.runtime import flow_run as current

        run = run_deployment(
            deployment, parameters=params, idempotency_key=f"{key}:after:{run.id}:{current.id}", timeout=limit,
            as_subflow=True, flow_run_name=run_name,
        )
    state = run.state
    if state is not None and not state.is_final():
        _cancel(run.id)
        raise TimeoutError(
            f"consolidation deployment {deployment!r} run {run.name!r} did not finish within "
            f"{consolidation.timeout_minutes:g} minutes (it was {state.name}); it was cancelled. Raise "
            "consolidation.timeout_minutes, or check the work pool's workers"
        )
    if state is None or not state.is_completed():
        name = state.name if state is not None else "in an unknown state"
        reason = (state.message or "no message") if state is not None else "no state"
        raise RuntimeError(f"consolidation deployment {deployment!r} run {run.name!r} ended {name}: {reason}")
    log.info("consolidation deployment run %s completed", run.name)
    details: dict[str, Any] = {"deployment": deployment, "flow_run": str(run.id)}
    try:
        result = state.result()
        if isinstance(result, dict):
            details["verification"] = result.get("verification")
            details = {**result["model"].get("details", {}), **details}
            return Output.model_validate(result["model"]).model_copy(update={"details": details})
    except Exception:  # the child's result storage may not be readable from here; its output is
        log.info("the child run's result is not readable here; taking its output folder %s as written", out)
    if verification.enabled:  # the child verifies before it completes
        details["verification"] = {"ok": True, "verified_by": f"flow run {run.name} ({run.id})"}
    return Output(kind="model", uri=out, details=details)


def _cancel(flow_run_id: Any) -> None:
    """Ask the server to cancel a child run that ran out of time (a late one is simply never started)."""
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    try:
        with get_client(sync_client=True) as client:
            client.set_flow_run_state(flow_run_id, Cancelling(message="the parent lifecycle run stopped waiting"),
                                      force=True)
    except Exception as exc:  # whatever Prefect's client raises: the child times out on its own
        get_run_logger().warning("could not cancel the child run %s: %s", flow_run_id, exc)


def _gone(uri: str) -> bool:
    """True when nothing is at `uri` any more; False when it is there or cannot be checked (the step's
    own task then meets the same error and reports it)."""
    try:
        return not paths.exists(uri)
    except Exception as exc:  # each fsspec backend raises its own errors; the step's task meets and reports them
        get_run_logger().warning("cannot check %s (%s); trusting the cached result if there is one", uri, describe(exc))
        return False


def _outcome(future: PrefectFuture[Any] | None, what: str, failures: list[str]) -> Any:
    """The future's result, or None with a line added to `failures`."""
    if future is None:
        return None
    try:
        return future.result()
    except Exception as exc:  # the task's failure, whatever it raised: one line of the summary
        failures.append(f"{what} failed: {exc}")
        return None


def _summary(
    checkpoint: Checkpoint,
    model: Output | None,
    verified: dict[str, Any] | None,
    reshards: dict[int, Output | None],
    published: list[Published],
    failures: list[str],
) -> dict[str, Any]:
    """The markdown summary artifact, and the same as a dict (the flow's return value).

    Lists, not wide tables, for what was built and published (URIs are long), with links to the Hub
    and bucket consoles; the verification as a two-column table."""
    label = source_label(checkpoint.root, checkpoint.tag)
    lines = [
        f"# {label}",
        "",
        f"{code(checkpoint.uri)}: ZeRO-{checkpoint.stage}, {checkpoint.world_size} ranks, {checkpoint.precision}, "
        f"step {checkpoint.step}; content identity {code(checkpoint.identity)}.",
        "",
    ]
    built = []
    if model is not None:
        check = "verified" if verified and verified.get("ok", True) else "not verified"
        if model.details.get("config_json") is False:
            check += ", no config.json: from_pretrained cannot load it"
        built.append(f"- **model** ({model.details.get('dtype', '')}, {format_size(model.bytes or 0)}, {check}): "
                     f"{code(model.uri)}")
    for n, out in sorted(reshards.items()):
        if out is not None:
            shape = f", {out.details['shape']}" if out.details.get("shape") else ""
            built.append(f"- **ZeRO checkpoint for {n} rank(s)**{shape} ({format_size(out.bytes or 0)}): "
                         f"{code(out.uri)}")
    if built:
        lines += ["## Built", ""] + built + [""]
    if verified:
        lines += ["## Verification", "", "| check | result |", "|---|---|"]
        lines += [f"| {md(r['check'])} | {md(r['result'])} |" for r in verification_rows(verified)] + [""]
    if published:
        lines += ["## Published", ""]
        for p in published:
            where = p.destination + (f" @ {p.revision}" if p.revision else "")
            lines.append(
                f"- **{p.kind}** to {link(where, p.url)}: {p.details.get('uploaded', '?')} of {p.files} file(s) "
                f"uploaded ({format_size(p.bytes or 0)}), {p.details.get('skipped', 0)} already there"
            )
        lines += ["", "Each push's artifact lists its files with their sizes and sha256.", ""]
    elif not failures:
        lines += ["Nothing was published: no destination was given.", ""]
    if failures:
        lines += ["## Failed", ""] + [f"- {md(f)}" for f in failures] + [""]
    headline = (
        f"{checkpoint.root}/{checkpoint.tag}: "
        + ("model + " if model else "")
        + f"{sum(1 for o in reshards.values() if o)} reshard(s) built, {len(published)} push(es)"
        + (f", {len(failures)} failure(s)" if failures else "")
    )
    markdown("\n".join(lines), key=checkpoint_key("summary", checkpoint.root, checkpoint.tag), description=headline)
    return {
        "headline": headline,
        "checkpoint": checkpoint.model_dump(mode="json"),
        "model": model.model_dump(mode="json") if model else None,
        "verification": verified,
        "reshards": {str(n): o.model_dump(mode="json") if o else None for n, o in reshards.items()},
        "published": [p.model_dump(mode="json") for p in published],
        "failures": failures,
    }


@flow(name="post-training", flow_run_name=_post_training_run_name, timeout_seconds=FLOW_TIMEOUT_SECONDS,
      log_prints=False)
def post_training(
    runs: list[str] = Field(..., json_schema_extra={"title": "Training runs"}, min_length=1),
    consolidation: ConsolidationForm = _titled(ConsolidationForm(), "Hugging Face model"),
    reshard: ReshardForm = _titled(ReshardForm(), "Reshard"),
    verification: VerificationForm = _titled(VerificationForm(), "Verification"),
    destinations: list[Destination] = _titled([], "Destinations"),
    publishing: PublishForm = _titled(PublishForm(), "Publishing"),
    workspace: Text = _titled("", "Workspace"),
    cluster: Text = _titled("", "Dask cluster"),
) -> list[dict[str, Any]]:
    """Process the newest checkpoint (the tag `latest` names) of each training run.

    Args:
        runs: Run folders (each holds `latest`), local or bucket URLs.
        consolidation: The Hugging Face model to build for each.
        reshard: The shapes to rewrite each checkpoint for: world sizes (ranks), ZeRO stage, parallel degrees.
        verification: Load each built model with transformers and check it against its checkpoint.
        destinations: Where to publish each run's outputs (see `checkpoint-lifecycle`).
        publishing: Upload settings.
        workspace: Where outputs are built before publishing.
        cluster: Run the conversion's units on the Dask scheduler at this address (see `checkpoint-lifecycle`);
            empty uses $CKPTFLOW_CLUSTER on the worker, or threads.
    """
    results, failures = [], []
    for run in runs:
        try:  # the value in memory, not read back from the child's state (see flows.commands.run_here)
            results.append(checkpoint_lifecycle(
                source=run, consolidation=consolidation, reshard=reshard, verification=verification,
                destinations=destinations, publishing=publishing, workspace=workspace, cluster=cluster,
            ))
        except Exception as exc:  # one run's failure, whatever it is, must not stop the others
            failures.append(f"{run}: {exc}")
    if failures:
        raise LifecycleError(f"{len(failures)} of {len(runs)} run(s) failed: " + "; ".join(failures))
    return results
