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

`post_training` is the scheduled variant: the newest tag of each configured run, one lifecycle each.
"""

import hashlib
import json
import logging
from datetime import datetime, timezone
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.futures import PrefectFuture
from prefect.task_runners import ThreadPoolTaskRunner

from flows import layout
from flows.params import (
    ConsolidationOptions,
    Destination,
    PublishOptions,
    ReshardOptions,
    ValidationOptions,
    VerificationOptions,
)
from ckptflow.plumbing.sizes import format_size
from tasks.artifacts import artifact_key, markdown
from tasks.caching import checkpoint_cache_key
from tasks.consolidate import consolidate_model
from tasks.models import Checkpoint, Output, Published
from tasks.publish import publish_output
from tasks.reshard import reshard_checkpoint
from tasks.validate import validate_checkpoint
from tasks.verify import verify_output

logger = logging.getLogger(__name__)


class LifecycleError(RuntimeError):
    """One or more steps of the lifecycle failed; the message names each."""


@flow(name="checkpoint-lifecycle", task_runner=ThreadPoolTaskRunner(max_workers=32), log_prints=False)
def checkpoint_lifecycle(
    source: str,
    tag: str | None = None,
    validation: ValidationOptions = ValidationOptions(),
    consolidation: ConsolidationOptions = ConsolidationOptions(),
    reshard: ReshardOptions = ReshardOptions(),
    verification: VerificationOptions = VerificationOptions(),
    destinations: list[Destination] = [],  # noqa: B006 - Prefect needs a JSON default for the UI form
    publishing: PublishOptions = PublishOptions(),
    workspace: str | None = None,
    refresh: bool = False,
) -> dict[str, Any]:
    """Turn a DeepSpeed ZeRO checkpoint into a verified Hugging Face model and resharded checkpoints, and publish them.

    Args:
        source: The folder DeepSpeed saved into (it holds `latest`), local or a bucket URL (gs://, s3://, ...).
        tag: The checkpoint tag to process (e.g. 'global_step1200'); empty takes the one `latest` names.
        validation: How the checkpoint is checked first, and how long to wait for rank files still arriving.
        consolidation: The Hugging Face model to build: on or off, dtype, shard size, and where it runs.
        reshard: Data-parallel world sizes to rewrite the ZeRO checkpoint for.
        verification: Load the built model with transformers and check it against the checkpoint.
        destinations: Where to publish: Hub repos ('hf://org/name') and bucket URLs, each for the model, the resharded checkpoints or both.
        publishing: Upload settings (parallel uploads, Hub endpoint and token).
        workspace: Where outputs are built before publishing (a folder or bucket URL); empty uses $CKPTFLOW_WORKSPACE or ~/.cache/ckptflow/work. Must be a bucket when consolidation runs on a GPU deployment elsewhere.
        refresh: Ignore cached results and do every step again.
    """
    log = get_run_logger()
    destinations = [d if isinstance(d, Destination) else Destination.model_validate(d) for d in destinations]
    checkpoint = validate_checkpoint(
        source, tag, deep=validation.deep, settle_seconds=validation.settle_seconds, poll_seconds=validation.poll_seconds
    )
    base = layout.checkpoint_workspace(checkpoint, workspace)
    log.info("building %s into %s", checkpoint.uri, base)

    # Build: the model (and its verification) and every reshard, side by side. A step whose output
    # folder is gone (a cleaned workspace) is built again even when its result is cached.
    def build_options(out: str) -> dict[str, Any]:
        if refresh:
            layout.remove(out)
        return {"refresh_cache": True} if refresh or _gone(out) else {}

    model_future: PrefectFuture[Output] | None = None
    verify_future: PrefectFuture[dict[str, Any]] | None = None
    if consolidation.enabled:
        out = layout.model_folder(base, consolidation)
        built = build_options(out)
        if consolidation.deployment:
            model_future = consolidate_on_deployment.with_options(**built).submit(
                checkpoint, out, consolidation.deployment, consolidation, verification
            )
        else:
            model_future = consolidate_model.with_options(**built).submit(
                checkpoint, out, dtype=consolidation.dtype, max_shard_size=consolidation.max_shard_size,
                exclude_frozen=consolidation.exclude_frozen, workers=consolidation.workers,
            )
            if verification.enabled:
                verify_future = verify_output.with_options(**built).submit(
                    checkpoint, model_future, device=verification.device
                )
    reshard_futures = {}
    for n in reshard.world_sizes:
        out = layout.reshard_folder(base, n)
        reshard_futures[n] = reshard_checkpoint.with_options(**build_options(out)).submit(checkpoint, out, n)

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
            targets.append((model, *layout.model_destination(dest, checkpoint.tag)))
        if dest.includes("reshards"):
            targets += [(o, *layout.reshard_destination(dest, checkpoint.tag, n)) for n, o in reshards.items() if o]
        for output, uri, revision in targets:
            # A bucket destination whose manifest is gone (deleted since) is published again.
            gone = not dest.is_hub and _gone(layout.published_marker(uri))
            future = publish_output.with_options(**({"refresh_cache": True} if refresh or gone else {})).submit(
                checkpoint, output, uri, revision=revision, private=dest.private, workers=publishing.workers,
                endpoint=publishing.hub_endpoint if dest.is_hub else None,
                token_secret=publishing.hub_token_secret if dest.is_hub else None,
            )
            pushes.append((f"publishing {output.kind} to {uri}" + (f"@{revision}" if revision else ""), future))
    published = [p for what, f in pushes if (p := _outcome(f, what, failures)) is not None]

    summary = _summary(checkpoint, model, verified, reshards, published, failures)
    if failures:
        raise LifecycleError(f"{checkpoint.uri}: " + "; ".join(failures))
    log.info("done: %s", summary["headline"])
    return summary


@task(name="consolidate-on-deployment", cache_key_fn=checkpoint_cache_key, persist_result=True)
def consolidate_on_deployment(
    checkpoint: Checkpoint,
    out: str,
    deployment: str,
    consolidation: ConsolidationOptions,
    verification: VerificationOptions,
) -> Output:
    """Run consolidation (and verification) as the deployment `deployment`, and wait for it.

    The child run's idempotency key is derived from the source, tag, content identity and options,
    so re-running this flow attaches to the same child run instead of starting another. A child from
    an earlier attempt that ended failed is started once more (under a new key); a child that fails
    now fails this task with its reason.
    """
    from prefect.deployments import run_deployment

    log = get_run_logger()
    params = {
        "checkpoint": checkpoint.model_dump(mode="json"),
        "out": out,
        "consolidation": consolidation.model_copy(update={"deployment": None}).model_dump(mode="json"),
        "verification": verification.model_dump(mode="json"),
    }
    digest = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:16]
    key = f"ckptflow:{checkpoint.root}/{checkpoint.tag}:{checkpoint.identity}:{digest}"
    asked = datetime.now(timezone.utc)
    run = run_deployment(deployment, parameters=params, idempotency_key=key, timeout=None, as_subflow=True)
    earlier = run.created is not None and run.created < asked
    if earlier and run.state is not None and run.state.is_final() and not run.state.is_completed():
        log.warning("child run %s for this checkpoint ended %s earlier; starting it again", run.name, run.state.name)
        from prefect.runtime import flow_run as current

        run = run_deployment(
            deployment, parameters=params, idempotency_key=f"{key}:after:{run.id}:{current.id}", timeout=None,
            as_subflow=True,
        )
    state = run.state
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
            return Output.model_validate(result["model"]).model_copy(update={"details": {**result["model"].get("details", {}), **details}})
    except Exception:  # the child's result storage may not be readable from here; its output is
        log.info("the child run's result is not readable here; taking its output folder %s as written", out)
    if verification.enabled:  # the child verifies before it completes
        details["verification"] = {"ok": True, "verified_by": f"flow run {run.name} ({run.id})"}
    return Output(kind="model", uri=out, details=details)


def _gone(uri: str) -> bool:
    """True when nothing is at `uri` any more; False when it is there or cannot be checked (the step's
    own task then meets the same error and reports it)."""
    try:
        return not layout.exists(uri)
    except Exception as exc:
        get_run_logger().warning("cannot check %s (%s); trusting the cached result if there is one", uri, exc)
        return False


def _outcome(future: PrefectFuture[Any] | None, what: str, failures: list[str]) -> Any:
    """The future's result, or None with a line added to `failures`."""
    if future is None:
        return None
    try:
        return future.result()
    except Exception as exc:
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
    """The markdown summary artifact, and the same as a dict (the flow's return value)."""
    rows = []
    if model is not None:
        check = "verified" if verified and verified.get("ok", True) else "not verified"
        rows.append(("model", model.uri, f"{model.details.get('dtype', '')}, {format_size(model.bytes or 0)}, {check}"))
    for n, out in sorted(reshards.items()):
        if out is not None:
            rows.append((f"ZeRO, {n} rank(s)", out.uri, format_size(out.bytes or 0)))
    lines = [
        f"# {checkpoint.root} @ {checkpoint.tag}",
        "",
        f"ZeRO-{checkpoint.stage}, {checkpoint.world_size} ranks, {checkpoint.precision}, step {checkpoint.step}; "
        f"content identity `{checkpoint.identity}`.",
        "",
    ]
    if rows:
        lines += ["## Built", "", "| what | where | notes |", "|---|---|---|"]
        lines += [f"| {a} | `{b}` | {c} |" for a, b, c in rows] + [""]
    if verified:
        lines += ["## Verification", "", "```json", json.dumps(verified, indent=2, default=str)[:4000], "```", ""]
    if published:
        lines += ["## Published", "", "| what | from | to | uploaded |", "|---|---|---|---|"]
        lines += [
            f"| {p.kind} | `{p.source}` | `{p.destination}`{' @ ' + p.revision if p.revision else ''} | "
            f"{p.details.get('uploaded', '?')} of {p.files} file(s), {format_size(p.bytes or 0)} |"
            for p in published
        ] + [""]
    if failures:
        lines += ["## Failed", ""] + [f"- {f}" for f in failures] + [""]
    headline = (
        f"{checkpoint.root}/{checkpoint.tag}: "
        + ("model + " if model else "")
        + f"{sum(1 for o in reshards.values() if o)} reshard(s) built, {len(published)} push(es)"
        + (f", {len(failures)} failure(s)" if failures else "")
    )
    markdown("\n".join(lines), key=artifact_key("lifecycle", checkpoint.tag), description=headline)
    return {
        "headline": headline,
        "checkpoint": checkpoint.model_dump(mode="json"),
        "model": model.model_dump(mode="json") if model else None,
        "verification": verified,
        "reshards": {str(n): o.model_dump(mode="json") if o else None for n, o in reshards.items()},
        "published": [p.model_dump(mode="json") for p in published],
        "failures": failures,
    }


@flow(name="post-training", log_prints=False)
def post_training(
    runs: list[str],
    consolidation: ConsolidationOptions = ConsolidationOptions(),
    reshard: ReshardOptions = ReshardOptions(),
    verification: VerificationOptions = VerificationOptions(),
    destinations: list[Destination] = [],  # noqa: B006
    publishing: PublishOptions = PublishOptions(),
    workspace: str | None = None,
) -> list[dict[str, Any]]:
    """Process the newest checkpoint (the tag `latest` names) of each training run.

    Args:
        runs: Run folders (each holds `latest`), local or bucket URLs.
        consolidation: The Hugging Face model to build for each.
        reshard: Data-parallel world sizes to rewrite each checkpoint for.
        verification: Load each built model with transformers and check it against its checkpoint.
        destinations: Where to publish each run's outputs (see `checkpoint-lifecycle`).
        publishing: Upload settings.
        workspace: Where outputs are built before publishing.
    """
    results, failures = [], []
    for run in runs:
        state = checkpoint_lifecycle(
            source=run, consolidation=consolidation, reshard=reshard, verification=verification,
            destinations=destinations, publishing=publishing, workspace=workspace, return_state=True,
        )
        if state.is_completed():
            results.append(state.result())
        else:
            error = state.result(raise_on_failure=False)
            failures.append(f"{run}: {error if isinstance(error, BaseException) else state.message}")
    if failures:
        raise LifecycleError(f"{len(failures)} of {len(runs)} run(s) failed: " + "; ".join(failures))
    return results
