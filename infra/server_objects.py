"""The Prefect server objects ckptflow's deployments rely on besides the deployments themselves.

    python infra/server_objects.py

Run by `infra/bootstrap.sh` against `$PREFECT_API_URL`; safe to run again.

- `local-file-system/ckptflow-results`: where task results (the cache of finished steps) are kept,
  named by every deployment's `PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK` in `prefect.yaml`. A folder:
  `$CKPTFLOW_RESULTS`, else `~/.cache/ckptflow/results`. An existing block is left as it is (replace
  it with a bucket block, under that name in prefect.yaml, when workers run on several machines).
- The automation `ckptflow-run-failed`: when a run of a ckptflow flow (`FLOWS`, from a deployment or
  from `ckptflow run`) fails, crashes or times out, send a notification through the block `$CKPTFLOW_NOTIFY_BLOCK` ('block-type/name', e.g.
  'slack-webhook/ckptflow-alerts'). Without that variable no automation is created, and the script
  says how to add one.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

RESULTS_BLOCK = "ckptflow-results"
AUTOMATION = "ckptflow-run-failed"
FLOWS = ["checkpoint-lifecycle", "post-training", "watch-latest", "consolidate-checkpoint"]
FAILED_STATES = ["prefect.flow-run.Failed", "prefect.flow-run.Crashed", "prefect.flow-run.TimedOut"]


def ensure_results_block() -> str:
    from prefect.filesystems import LocalFileSystem

    try:
        block = LocalFileSystem.load(RESULTS_BLOCK)
        return f"result storage: local-file-system/{RESULTS_BLOCK} kept ({block.basepath})"
    except ValueError:
        path = os.environ.get("CKPTFLOW_RESULTS") or str(Path.home() / ".cache" / "ckptflow" / "results")
        LocalFileSystem(basepath=path).save(RESULTS_BLOCK)
        return f"result storage: local-file-system/{RESULTS_BLOCK} created at {path}"


def failure_automation(block_document_id: object) -> object:
    """The automation: one notification per failed, crashed or timed-out ckptflow flow run."""
    from prefect.automations import Automation, EventTrigger, Posture, SendNotification

    return Automation(
        name=AUTOMATION,
        description="Notify when a ckptflow flow run fails, crashes or times out (infra/server_objects.py).",
        enabled=True,
        trigger=EventTrigger(
            expect=set(FAILED_STATES),
            match={"prefect.resource.id": "prefect.flow-run.*"},
            match_related={"prefect.resource.role": "flow", "prefect.resource.name": FLOWS},
            posture=Posture.Reactive,
            threshold=1,
            within=0,
        ),
        actions=[
            SendNotification(
                block_document_id=block_document_id,
                subject="ckptflow: {{ flow.name }} run {{ flow_run.name }} {{ flow_run.state.name }}",
                body="Flow run {{ flow_run.name }} of {{ flow.name }} ended {{ flow_run.state.name }}: "
                "{{ flow_run.state.message }}\n{{ flow_run|ui_url }}",
            )
        ],
    )


def ensure_failure_automation() -> str:
    from prefect.automations import Automation
    from prefect.blocks.core import Block

    slug = os.environ.get("CKPTFLOW_NOTIFY_BLOCK", "").strip()
    if not slug:
        return ("failure notifications: none (set CKPTFLOW_NOTIFY_BLOCK=block-type/name of a notification block, "
                "e.g. slack-webhook/ckptflow-alerts, and run infra/bootstrap.sh again)")
    block = Block.load(slug)
    wanted = failure_automation(block._block_document_id)
    try:
        existing = Automation.read(name=AUTOMATION)
    except ValueError:
        existing = None
    if existing is not None:
        existing.delete()
    wanted.create()  # type: ignore[attr-defined]
    return f"failure notifications: automation {AUTOMATION} sends to {slug}"


def main() -> int:
    print(ensure_results_block())
    print(ensure_failure_automation())
    return 0


if __name__ == "__main__":
    sys.exit(main())
