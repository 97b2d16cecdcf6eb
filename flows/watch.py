"""`watch_latest`: the bucket trigger. One Prefect event per new checkpoint tag, never two.

Each run lists the watched roots (`ckptflow.watch.find_latest`), compares every `latest` it finds
with what earlier runs saw, and emits one `ckptflow.checkpoint.saved` event per tag not seen before
in its folder. What was seen is kept in a Prefect block (`WatchState`, one document per watcher,
named by `state`), so it survives restarts of workers and servers. Its payload carries everything
the lifecycle flow needs (`source`, `tag`), and a deployment trigger on that event starts one
lifecycle run per checkpoint (see `infra/prefect.yaml`).

Events are posted to the Prefect API one by one and recorded as seen right after; an event's id is
derived from its folder and tag, so even a repeated post is dropped by the server's triggers. A run
folder that cannot be read is reported (log and artifact) and retried on the next run; a root that
cannot be listed at all fails the run after the other roots were handled.
"""

import uuid
from datetime import datetime, timezone
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.blocks.core import Block
from prefect.client.orchestration import get_client
from pydantic import Field

from ckptflow.watch import Scan, Seen, Sighting, find_latest, select_new
from tasks.artifacts import artifact_key, code, markdown, md, source_name, table, text
from tasks.retries import io_retries

EVENT = "ckptflow.checkpoint.saved"
RESOURCE_PREFIX = "ckptflow.checkpoint"
_EVENT_NAMESPACE = uuid.UUID("7f1c2d0e-4b7a-5c8e-9a51-6c6b70746677")


class WatchState(Block):
    """What a `watch_latest` watcher saw: per run folder, the last `latest` version and every tag."""

    _block_type_name = "ckptflow watch state"
    _block_type_slug = "ckptflow-watch-state"
    _description = "Checkpoint tags a ckptflow watcher has already announced, per run folder."

    seen: dict[str, dict[str, Any]] = Field(default_factory=dict, description="Run folder URI -> version, tag, tags.")


def checkpoint_event(sighting: Sighting) -> dict[str, Any]:
    """The event announcing `sighting`, as the JSON the Prefect events API takes."""
    root, tag = sighting.root, sighting.tag
    return {
        "id": str(uuid.uuid5(_EVENT_NAMESPACE, f"{root}\0{tag}")),
        "occurred": datetime.now(timezone.utc).isoformat(),
        "event": EVENT,
        "resource": {
            "prefect.resource.id": f"{RESOURCE_PREFIX}.{root}/{tag}",
            "prefect.resource.name": f"{root}/{tag}",
            "ckptflow.root": root,
            "ckptflow.tag": tag,
        },
        "related": [],
        "payload": {
            "source": root,
            "tag": tag,
            "version": sighting.version,
            "step": sighting.step,
            "watched": sighting.watched,
        },
    }


def load_state(name: str) -> dict[str, Seen]:
    """The record kept under `name`, empty when there is none yet."""
    try:
        block = WatchState.load(name)
    except ValueError as exc:  # Prefect raises ValueError for a missing block document
        if "Unable to find block document" not in str(exc):
            raise
        return {}
    return {root: Seen.from_dict(data) for root, data in block.seen.items()}


def save_state(name: str, seen: dict[str, Seen]) -> None:
    WatchState(seen={root: s.to_dict() for root, s in sorted(seen.items())}).save(name, overwrite=True)


def post_event(event: dict[str, Any]) -> None:
    """POST one event to the Prefect API; raises when the API refuses it (unlike `emit_event`)."""
    with get_client(sync_client=True) as client:
        response = client.request("POST", "/events", json=[event])  # type: ignore[arg-type]
        response.raise_for_status()


def _names(roots: list[str]) -> str:
    names = [source_name(str(r)) for r in roots or []]
    return ", ".join(names[:3]) + (f" +{len(names) - 3}" if len(names) > 3 else "") or "nothing"


def _watch_run_name() -> str:
    """'watch runs, checkpoints': the last folder name of each root (the state block's name when it is
    not the default, so two watchers' runs tell apart)."""
    from prefect.runtime import flow_run

    parameters = flow_run.parameters
    state = parameters.get("state") or "ckptflow-watch"
    return f"watch {_names(parameters.get('roots') or [])}" + ("" if state == "ckptflow-watch" else f" ({state})")


def _scan_run_name() -> str:
    from prefect.runtime import task_run

    return f"scan {_names(task_run.parameters.get('roots') or [])} for latest"


@task(name="scan-for-latest", task_run_name=_scan_run_name, **io_retries(retries=2))
def scan_roots(roots: list[str], known: dict[str, Seen], exclude: list[str], max_depth: int | None) -> Scan:
    return find_latest(roots, known=known, exclude=exclude, max_depth=max_depth)


@flow(name="watch-latest", flow_run_name=_watch_run_name, log_prints=False)
def watch_latest(
    roots: list[str],
    state: str = "ckptflow-watch",
    baseline: bool = False,
    exclude: list[str] = [],  # noqa: B006 - Prefect needs a JSON default for the UI form
    max_depth: int | None = None,
) -> dict[str, Any]:
    """Emit one `ckptflow.checkpoint.saved` event per checkpoint tag not seen before under `roots`.

    Args:
        roots: Folders or bucket URLs to search for DeepSpeed `latest` pointers (any fsspec URL).
        state: Name of the `ckptflow-watch-state` block that remembers what was seen; one per watcher.
        baseline: Record every tag found now without emitting events (for pointing a new watcher at a
            bucket with history).
        exclude: Glob patterns of run folders to ignore (e.g. the folders ckptflow itself writes).
        max_depth: How many folder levels below each root to search; empty searches all.
    """
    logger = get_run_logger()
    seen = load_state(state)
    scan = scan_roots(roots, seen, list(exclude), max_depth)
    new, updated = select_new(scan, seen)

    pending = list(new)
    try:
        for sighting in new:
            if not baseline:
                post_event(checkpoint_event(sighting))
                logger.info("new checkpoint %s/%s: event emitted", sighting.root, sighting.tag)
            pending.remove(sighting)
    finally:
        # Record what was seen, except the new tags whose event could not be posted: next run retries them.
        record = dict(updated)
        for sighting in pending:
            if sighting.root in seen:
                record[sighting.root] = seen[sighting.root]
            else:
                record.pop(sighting.root, None)
        save_state(state, record)
    emitted = [s for s in new if s not in pending]

    for bad in scan.unreadable:
        logger.warning("skipped %s: %s", bad.where, bad.reason)
    _report(scan, emitted, baseline, state)
    dead_roots = [u for u in scan.unreadable if u.whole_root]
    if dead_roots:
        raise RuntimeError("; ".join(u.reason for u in dead_roots))
    return {
        "checkpoints": len(scan.sightings),
        "emitted": [] if baseline else [s.to_dict() for s in emitted],
        "recorded": [s.to_dict() for s in emitted] if baseline else [],
        "unreadable": [u.to_dict() for u in scan.unreadable],
    }


def _report(scan: Scan, emitted: list[Sighting], baseline: bool, state: str) -> None:
    """A table of what was announced (or recorded) and a list of what could not be read, keyed by the
    watcher (its state block), so two watchers never share an artifact's history."""
    if emitted:
        table(
            [{"folder": text(s.root), "tag": text(s.tag), "step": s.step, "version": text(s.version)} for s in emitted],
            key=artifact_key("watch", state, "recorded" if baseline else "new-checkpoints"),
            description=("Recorded without events" if baseline else "New checkpoints announced") + f": {len(emitted)}",
        )
    if scan.unreadable:
        lines = [f"- {code(u.where)}: {md(u.reason)}" for u in scan.unreadable]
        markdown(
            "## Folders the watcher could not read\n\nThey are tried again on the next run.\n\n" + "\n".join(lines),
            key=artifact_key("watch", state, "unreadable"),
            description=f"{len(scan.unreadable)} folder(s) could not be read",
        )
