"""Check that the Prefect server creates runs for every deployment with an active schedule.

    python infra/check_schedules.py [--wait SECONDS]

Run by `infra/bootstrap.sh` after `prefect deploy`, against `$PREFECT_API_URL`. The server's
scheduler looks at new and changed deployments every few seconds; when a scheduled deployment still
has no run after `--wait` seconds (default 60), its scheduler is failing, and nothing else would
say so: the deployments show active schedules and no upcoming runs. The known cause is a server
still on prefect 3.8 with SQLAlchemy 2.1 in its environment (its log shows `InvalidRequestError:
Can't evaluate bulk DML statement` from `_insert_scheduled_flow_runs` every loop); prefect 3.9's
scheduler runs on SQLAlchemy 2.1.

Exit status: 0 when every scheduled deployment has runs, 1 otherwise (with the reason), 2 when the
API cannot be reached.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

FIX = (
    "The server's scheduler is not creating runs. The known cause is a server on prefect 3.8 with "
    "SQLAlchemy 2.1 in its Python environment: its log shows \"InvalidRequestError: Can't evaluate bulk "
    "DML statement\" every minute. Upgrade prefect to 3.9 where `prefect server start` runs (ckptflow's "
    "[prefect] extra asks for it), or install 'sqlalchemy<2.1' there, and restart the server; scheduled "
    "runs appear within seconds."
)


def scheduled_deployments(client: Any) -> dict[str, Any]:
    """'flow/deployment' -> deployment, for every deployment with an active schedule that is not paused."""
    found = {}
    flows = {f.id: f.name for f in client.read_flows()}
    for deployment in client.read_deployments():
        if deployment.paused or not any(s.active for s in deployment.schedules):
            continue
        found[f"{flows.get(deployment.flow_id, deployment.flow_id)}/{deployment.name}"] = deployment
    return found


def runs_per_deployment(client: Any, deployments: dict[str, Any]) -> dict[str, int]:
    """'flow/deployment' -> how many of its runs are waiting in the Scheduled state (0 or 1: one is enough)."""
    from prefect.client.schemas.filters import (
        DeploymentFilter,
        DeploymentFilterId,
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType

    scheduled = FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.SCHEDULED])))
    counts = {}
    for name, deployment in deployments.items():
        runs = client.read_flow_runs(
            flow_run_filter=scheduled,
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id])),
            limit=1,
        )
        counts[name] = len(runs)
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wait", type=float, default=60.0, help="Seconds to wait for the first runs (default 60).")
    args = parser.parse_args(argv)

    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    api = PREFECT_API_URL.value()
    try:
        with get_client(sync_client=True) as client:
            deployments = scheduled_deployments(client)
            if not deployments:
                print("check_schedules: no deployment with an active schedule")
                return 0
            deadline = time.monotonic() + args.wait
            while True:
                counts = runs_per_deployment(client, deployments)
                missing = sorted(name for name, n in counts.items() if n == 0)
                if not missing or time.monotonic() >= deadline:
                    break
                time.sleep(2)
    except Exception as exc:  # noqa: BLE001 - one line for the person running the setup
        print(f"check_schedules: cannot read deployments from {api}: {exc}", file=sys.stderr)
        return 2
    if missing:
        print(
            f"check_schedules: after {args.wait:.0f} s, {len(missing)} scheduled deployment(s) on {api} have no "
            f"run: {', '.join(missing)}. {FIX}",
            file=sys.stderr,
        )
        return 1
    print("check_schedules: the scheduler created runs for " + ", ".join(sorted(deployments)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
