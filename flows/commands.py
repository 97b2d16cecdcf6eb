"""What `ckptflow run` and `ckptflow watch` do, minus the printing (which stays in `ckptflow.cli`).

`ckptflow run` runs `checkpoint_lifecycle` in this process: against `PREFECT_API_URL` when it is
set, else with Prefect's embedded defaults (a temporary local server, nothing to start). `ckptflow
watch` needs a real Prefect API: the watcher's memory and the events live there.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from ckptflow.plumbing.redaction import redact
from flows.params import ConsolidationForm, Destination, ReshardForm, ValidationForm, VerificationForm


class FlowFailed(RuntimeError):
    """The flow run ended in a state other than Completed; the message is its reason."""

    def __init__(self, message: str, flow_run_id: str | None = None) -> None:
        super().__init__(message)
        self.flow_run_id = flow_run_id


@dataclass(frozen=True)
class FlowOutcome:
    flow_run_id: str
    flow_run_name: str
    result: Any


def api_url() -> str | None:
    """The configured Prefect API URL, or None (embedded defaults)."""
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value() or None


def parse_world_sizes(text: str | None) -> list[int]:
    """'1,4' -> [1, 4]; ValueError naming the bad part."""
    if not text:
        return []
    sizes = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 1:
            raise ValueError(f"--reshard takes world sizes like 1,4; {part!r} is not a positive integer")
        sizes.append(int(part))
    return sizes


def lifecycle_parameters(
    src: str,
    *,
    tag: str | None,
    dtype: str,
    consolidate: bool,
    max_shard_size: str,
    reshard: str | None,
    destinations: Sequence[str],
    publish: str,
    verify: bool,
    settle: float,
    workspace: str | None,
    gpu_deployment: str | None,
    refresh: bool,
    config: str | None = None,
    config_revision: str | None = None,
    qkv_layout: str | None = None,
) -> dict[str, Any]:
    """The flow's parameters from command-line values; ValueError with a readable message."""
    layout = qkv_layout or "unknown"  # the forms' word for "not declared"
    try:
        return {
            "source": src,
            "tag": tag,
            "validation": ValidationForm(settle_seconds=settle, poll_seconds=min(15.0, max(settle / 10, 1.0))),
            "consolidation": ConsolidationForm(
                enabled=consolidate, dtype=dtype, max_shard_size=max_shard_size, deployment=gpu_deployment,
                config=config, config_revision=config_revision, qkv_layout=layout,
            ),
            "reshard": ReshardForm(world_sizes=parse_world_sizes(reshard), qkv_layout=layout),
            "verification": VerificationForm(enabled=verify and consolidate),
            "destinations": [Destination(uri=d, what=publish) for d in destinations],
            "workspace": workspace,
            "refresh": refresh,
        }
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'value'}: {e['msg']}" for e in exc.errors())
        raise ValueError(problems) from None


def run_lifecycle(parameters: dict[str, Any]) -> FlowOutcome:
    """Run `checkpoint_lifecycle` here; its summary, or FlowFailed with the run's reason.

    Without a server, Prefect starts a temporary one and gives it 20 s by default; on a busy machine
    (or a first run, which migrates the database) that is not enough, so the embedded server gets 2
    minutes unless the user set the limit."""
    if not os.environ.get("PREFECT_API_URL") and not api_url():
        os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    from flows.lifecycle import checkpoint_lifecycle

    return _outcome(run_here(checkpoint_lifecycle, parameters))


def watch_once(roots: Sequence[str], *, state: str, baseline: bool, exclude: Sequence[str]) -> FlowOutcome:
    """One run of the watcher flow against the configured API."""
    if not os.environ.get("PREFECT_API_URL") and not api_url():
        raise FlowFailed(
            "the watcher keeps what it saw and sends its events through a Prefect server: set PREFECT_API_URL "
            "(e.g. http://localhost:4200/api) to the server your lifecycle deployments run on"
        )
    from flows.watch import watch_latest

    parameters = {"roots": list(roots), "state": state, "baseline": baseline, "exclude": list(exclude)}
    return _outcome(run_here(watch_latest, parameters))


@dataclass(frozen=True)
class Ran:
    """A flow run made in this process: its final state, and its value or the exception it raised."""

    state: Any
    flow_run: Any
    value: Any = None
    error: BaseException | None = None


def run_here(flow: Any, parameters: dict[str, Any]) -> Ran:
    """Run `flow` in this process; its final state and the value it returned, kept in memory.

    The value is not read back from the final state: a run that completed on a slow server once came
    back with a Completed state without its data (Prefect's client takes the server's copy of the state
    when its proposal is not simply accepted, e.g. a repeat of a request that timed out), and
    `state.result()` raised MissingResult. The state and the run come from a state hook."""
    seen: list[tuple[Any, Any]] = []

    def hook(_flow: Any, flow_run: Any, state: Any) -> None:
        seen.append((flow_run, state))

    hooked = flow.with_options(
        on_completion=[*flow.on_completion_hooks, hook],
        on_failure=[*flow.on_failure_hooks, hook],
        on_cancellation=[*flow.on_cancellation_hooks, hook],
        on_crashed=[*flow.on_crashed_hooks, hook],
    )
    value, error = None, None
    try:
        value = hooked(**parameters)
    except Exception as exc:  # the run's failure, whatever it is: kept with its final state, or raised below
        error = exc
    if not seen:  # the run never reached a final state (it failed before it was created)
        if error is not None:
            raise error
        raise RuntimeError(f"flow {flow.name!r} returned without a final state")
    flow_run, state = seen[-1]
    return Ran(state=state, flow_run=flow_run, value=value, error=error)


def _outcome(ran: Ran) -> FlowOutcome:
    run_id = str(ran.flow_run.id)
    if ran.error is not None or not ran.state.is_completed():
        message = redact(str(ran.error)) if ran.error is not None else ""
        raise FlowFailed(message or ran.state.message or ran.state.name, run_id)
    return FlowOutcome(flow_run_id=run_id, flow_run_name=ran.flow_run.name, result=ran.value)
