"""`infra/` is real: the work-pool templates are accepted, `infra/bootstrap.sh` registers every
deployment of `infra/prefect.yaml`, the server's scheduler creates their scheduled runs, and the
lifecycle's parameter form renders with titles, descriptions, types and constraints. The server is
the session's Prefect server (with its scheduler)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

INFRA = Path(__file__).resolve().parents[1] / "infra"

EXPECTED_DEPLOYMENTS = {
    "checkpoint-lifecycle/manual",
    "checkpoint-lifecycle/on-checkpoint",
    "checkpoint-lifecycle/on-dask",
    "post-training/post-training",
    "watch-latest/interval",
    "consolidate-checkpoint/gpu",
}


@pytest.fixture(scope="module")
def client(prefect_server: str):
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as c:
        yield c


def _deployment(client: Any, name: str) -> Any:
    return client.read_deployment_by_name(name)


# ---- templates, without a server ------------------------------------------------------------------


def _render(template: dict[str, Any], **overrides: Any) -> dict[str, Any]:
    """The job configuration a worker would get: the template with variable defaults filled in."""
    from prefect.utilities.templating import apply_values

    values = {k: v["default"] for k, v in template["variables"]["properties"].items() if "default" in v}
    return apply_values(template["job_configuration"], {**values, **overrides})


def test_kubernetes_template_requests_gpus() -> None:
    template = json.loads((INFRA / "work-pools" / "kubernetes-gpu.json").read_text())
    pod = _render(template, gpu_count=2)["job_manifest"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 2
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert {m["mountPath"] for m in container["volumeMounts"]} == {"/dev/shm", "/scratch"}
    assert container["image"] == "ckptflow-gpu:latest"


def test_docker_template_passes_gpus_through() -> None:
    template = json.loads((INFRA / "work-pools" / "docker-gpu.json").read_text())
    job = _render(template)
    (request,) = job["container_create_kwargs"]["device_requests"]
    assert request["capabilities"] == [["gpu"]] and request["count"] == -1
    assert job["image"] == "ckptflow-gpu:latest"


def test_compose_file_wires_server_database_and_worker() -> None:
    compose = yaml.safe_load((INFRA / "docker-compose.yaml").read_text())
    services = compose["services"]
    assert {"postgres", "prefect-server", "setup", "worker"} <= set(services)
    assert services["prefect-server"]["environment"]["PREFECT_API_DATABASE_CONNECTION_URL"].startswith(
        "postgresql+asyncpg://")
    for name in ("setup", "worker"):
        assert services[name]["environment"]["PREFECT_API_URL"] == "http://prefect-server:4200/api"
    dockerfile = services["setup"]["build"]["dockerfile"]
    assert (INFRA.parent / dockerfile).is_file() and (INFRA / "docker" / "Dockerfile.gpu").is_file()
    assert services["setup"]["command"] == ["bash", "infra/bootstrap.sh"] and (INFRA / "bootstrap.sh").is_file()


# ---- against the server -----------------------------------------------------------------------------


def test_work_pool_templates_are_accepted(work_pools: dict[str, str], client: Any) -> None:
    for name, kind in work_pools.items():
        pool = client.read_work_pool(name)
        assert pool.type == kind
    gpu = client.read_work_pool("gpu").base_job_template
    assert "nvidia.com/gpu" in json.dumps(gpu["job_configuration"])
    docker = client.read_work_pool("gpu-docker").base_job_template
    assert "device_requests" in json.dumps(docker["variables"])


def test_deploy_all_registers_every_deployment(deployed, client: Any) -> None:
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    found = {name: _deployment(client, name) for name in EXPECTED_DEPLOYMENTS}

    manual = found["checkpoint-lifecycle/manual"]
    assert manual.work_pool_name == "cpu" and manual.schedules == []
    assert manual.parameters == {}, "a manual run needs only `source`: local workspace, no GPU deployment"
    gpu = found["consolidate-checkpoint/gpu"]
    assert gpu.work_pool_name == "gpu" and gpu.job_variables["image"] == "ckptflow-gpu:latest"
    for deployment in found.values():
        assert deployment.pull_steps == [{"flows.pull.set_code_directory": {}}]
        env = deployment.job_variables["env"]
        assert env["PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK"] == "local-file-system/ckptflow-results"
    for name in ("checkpoint-lifecycle/on-checkpoint", "post-training/post-training"):
        consolidation = found[name].parameters["consolidation"]
        assert "deployment" not in consolidation and "workspace" not in found[name].parameters
        assert "destinations" not in found[name].parameters

    on_dask = found["checkpoint-lifecycle/on-dask"]
    assert on_dask.job_variables["env"]["CKPTFLOW_CLUSTER"] == "tcp://ckptflow-scheduler.ckptflow.svc.cluster.local:8786"
    assert on_dask.parameters == {"workspace": "gs://example-models/ckptflow-work"} and on_dask.schedules == []

    (cron,) = found["post-training/post-training"].schedules
    assert cron.schedule.cron == "0 */6 * * *"
    (interval,) = found["watch-latest/interval"].schedules
    assert interval.schedule.interval.total_seconds() == 300
    assert found["watch-latest/interval"].global_concurrency_limit.limit == 1

    on_checkpoint = found["checkpoint-lifecycle/on-checkpoint"]
    assert on_checkpoint.global_concurrency_limit.limit == 2
    automations = client.read_automations_by_name("ckptflow-checkpoint-saved")
    assert len(automations) == 1
    trigger = automations[0].trigger
    assert trigger.expect == {"ckptflow.checkpoint.saved"}
    assert trigger.for_each == {"prefect.resource.id"}
    (action,) = automations[0].actions
    assert action.deployment_id == on_checkpoint.id
    assert action.parameters == {"source": "{{ event.payload.source }}", "tag": "{{ event.payload.tag }}"}
    assert client.read_deployments(
        deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[d.id for d in found.values()]))
    ), "deployments are listed"


def _scheduled_in_prefect_yaml() -> set[str]:
    """'flow-name/deployment' for every deployment of infra/prefect.yaml with an active schedule."""
    from prefect.flows import load_flow_from_entrypoint

    config = yaml.safe_load((INFRA / "prefect.yaml").read_text())
    names = set()
    for d in config["deployments"]:
        if any(s.get("active", True) for s in d.get("schedules") or []):
            flow = load_flow_from_entrypoint(str(INFRA.parent / d["entrypoint"]))
            names.add(f"{flow.name}/{d['name']}")
    return names


def test_the_scheduler_creates_runs_for_every_scheduled_deployment(deployed, client: Any, prefect_server_log) -> None:
    """After bootstrap, the server's own scheduler has put runs on every schedule of prefect.yaml
    (prefect 3.8's failed every loop under SQLAlchemy 2.1 and none ever appeared; 3.9's runs on it)."""
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId, FlowRunFilter
    from prefect.client.schemas.objects import StateType

    scheduled = _scheduled_in_prefect_yaml()
    assert scheduled == {"post-training/post-training", "watch-latest/interval"}
    assert "check_schedules: the scheduler created runs for " + ", ".join(sorted(scheduled)) in deployed.stdout
    for name in scheduled:
        deployment = _deployment(client, name)

        def scheduled_runs() -> list[Any]:
            return client.read_flow_runs(
                flow_run_filter=FlowRunFilter(state={"type": {"any_": [StateType.SCHEDULED]}}),
                deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id])),
            )

        # A test that paused and resumed the deployment (test_flows' quiet_schedules) deleted its runs;
        # the scheduler puts them back on its next loop (every 60 s by default).
        deadline = time.monotonic() + 150
        while not (runs := scheduled_runs()) and time.monotonic() < deadline:
            time.sleep(2)
        assert runs, f"{name}: no scheduled run"
        assert all(r.created_by is not None and r.created_by.type == "SCHEDULE" for r in runs)
        assert {r.idempotency_key.split()[0] for r in runs} == {"scheduled"}
    assert "Can't evaluate bulk DML" not in prefect_server_log.read_text()


def test_schedule_check_names_the_cause_when_no_run_appears(prefect_server: str, work_pools, tmp_path) -> None:
    """A scheduled deployment that gets no run (here: one whose only date is in the past, so there is
    nothing to schedule) makes infra/check_schedules.py fail, naming it and the known cause."""
    import subprocess
    import sys

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import DeploymentScheduleCreate
    from prefect.client.schemas.schedules import RRuleSchedule

    from flows.watch import watch_latest

    with get_client(sync_client=True) as c:
        flow_id = c.create_flow(watch_latest)
        deployment_id = c.create_deployment(
            flow_id=flow_id, name="never-due", entrypoint="flows/watch.py:watch_latest", work_pool_name="cpu",
            schedules=[DeploymentScheduleCreate(
                schedule=RRuleSchedule(rrule="DTSTART:20200101T000000\nRRULE:FREQ=DAILY;COUNT=1"), active=True
            )],
            parameters={"roots": [str(tmp_path)]},
        )
    try:
        result = subprocess.run(
            [sys.executable, str(INFRA / "check_schedules.py"), "--wait", "3"],
            env=dict(os.environ, PREFECT_API_URL=prefect_server), capture_output=True, text=True,
            timeout=120,
        )
    finally:
        with get_client(sync_client=True) as c:
            c.delete_deployment(deployment_id)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "scheduled deployment(s) on" in result.stderr and "watch-latest/never-due" in result.stderr
    assert "Upgrade prefect to 3.9 where `prefect server start` runs" in result.stderr


def test_bootstrap_creates_result_storage_and_the_failure_automation(deployed, client: Any) -> None:
    from prefect.filesystems import LocalFileSystem

    block = LocalFileSystem.load("ckptflow-results")
    assert "ckptflow-results" in block.basepath
    assert "result storage: local-file-system/ckptflow-results created at" in deployed.stdout
    assert ("failure notifications: automation ckptflow-run-failed sends to custom-webhook/ckptflow-test-alerts"
            in deployed.stdout)
    (automation,) = client.read_automations_by_name("ckptflow-run-failed")
    assert automation.trigger.expect == {"prefect.flow-run.Failed", "prefect.flow-run.Crashed",
                                         "prefect.flow-run.TimedOut"}
    related = automation.trigger.match_related
    related = related[0] if isinstance(related, list) else related
    assert set(related["prefect.resource.name"]) == {"checkpoint-lifecycle", "post-training", "watch-latest",
                                                     "consolidate-checkpoint"}
    (action,) = automation.actions
    assert action.type == "send-notification" and "{{ flow_run.state.message }}" in action.body


def _resolve(schema: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    ref = node.get("$ref") or (node.get("allOf") or [{}])[0].get("$ref")
    if ref:
        return schema["definitions"][ref.rsplit("/", 1)[-1]]
    return node


def _has_type(schema: dict[str, Any], node: dict[str, Any]) -> bool:
    if "type" in node or "enum" in node or "const" in node:
        return True
    if "anyOf" in node:
        return all(_has_type(schema, option) for option in node["anyOf"])
    resolved = _resolve(schema, node)
    return resolved is not node and _has_type(schema, resolved)


def _fields(schema: dict[str, Any], node: dict[str, Any], where: str):
    for name, field in node.get("properties", {}).items():
        yield f"{where}{name}", field
        target = _resolve(schema, field)
        items = field.get("items")
        if "block_type_slug" in target:  # a block: the form shows a block picker, not its fields
            continue
        if target is not field:
            yield from _fields(schema, target, f"{where}{name}.")
        elif items is not None and _resolve(schema, items) is not items:
            yield from _fields(schema, _resolve(schema, items), f"{where}{name}[].")


@pytest.mark.parametrize("name", ["checkpoint-lifecycle/manual", "post-training/post-training"])
def test_parameter_form_renders(deployed, client: Any, name: str) -> None:
    schema = _deployment(client, name).parameter_openapi_schema
    fields = list(_fields(schema, schema, ""))
    assert len(fields) > 15
    missing = [
        f"{path}: " + ", ".join(k for k, ok in (("title", "title" in f), ("description", "description" in f),
                                                  ("type", _has_type(schema, f))) if not ok)
        for path, f in fields
        if not ("title" in f and "description" in f and _has_type(schema, f))
    ]
    assert missing == [], "form fields without a title, description or type:\n" + "\n".join(missing)


def test_lifecycle_schema_fields() -> None:
    """The same check without a server, straight from the flow's signature."""
    from prefect.utilities.callables import parameter_schema

    from flows.lifecycle import checkpoint_lifecycle

    schema = parameter_schema(checkpoint_lifecycle).model_dump()
    top = set(schema["properties"])
    assert top == {"source", "tag", "validation", "consolidation", "reshard", "verification", "destinations",
                   "publishing", "workspace", "refresh", "cluster"}
    assert schema["required"] == ["source"]
    destination = schema["definitions"]["Destination"]["properties"]
    assert destination["what"]["enum"] == ["model", "reshards", "both"]


def test_form_fields_are_plain_titled_and_constrained() -> None:
    """What the UI form needs from the JSON schema: titles everywhere (top-level ones included), optional
    text as plain strings (no `anyOf` with null: a type toggle and 'Property is type "None"'),
    constraints the form can check, no angle brackets (markdown drops them as HTML), the Hub token as a
    Secret block picker."""
    from prefect.utilities.callables import parameter_schema

    from flows.lifecycle import checkpoint_lifecycle, post_training

    for flow in (checkpoint_lifecycle, post_training):
        schema = parameter_schema(flow).model_dump()
        fields = dict(_fields(schema, schema, ""))
        for path, field in fields.items():
            assert "title" in field and field["title"] != path.rsplit(".", 1)[-1].rstrip("[]"), path
            options = field.get("anyOf") or []
            assert not any(o.get("type") == "null" for o in options), f"{path} renders as a type toggle"
            assert "<" not in field.get("description", ""), path

    schema = parameter_schema(checkpoint_lifecycle).model_dump()
    props = schema["properties"]
    assert props["tag"] == {**props["tag"], "type": "string", "default": "", "title": "Tag"}
    assert props["workspace"]["type"] == "string" and props["workspace"]["default"] == ""
    definitions = schema["definitions"]
    shard = definitions["ConsolidationForm"]["properties"]["max_shard_size"]
    import re

    pattern = re.compile(shard["pattern"])
    assert all(pattern.match(v) for v in ("5GB", "500MB", "2GiB", "1.5 gb", "1024"))
    assert not any(pattern.match(v) for v in ("5 parsecs", "GB", "-1GB", ""))
    world = definitions["ReshardForm"]["properties"]["world_sizes"]
    assert world["items"]["minimum"] == 1
    for degree in ("tensor_parallel_degree", "pipeline_parallel_degree", "expert_parallel_degree"):
        field = definitions["ReshardForm"]["properties"][degree]
        assert (field["type"], field["minimum"], field["default"]) == ("integer", 0, 0), degree
    workers = definitions["ConsolidationForm"]["properties"]["workers"]
    assert (workers["minimum"], workers["maximum"]) == (1, 64)
    assert definitions["ConsolidationForm"]["properties"]["timeout_minutes"]["exclusiveMinimum"] == 0
    token = definitions["PublishForm"]["properties"]["hub_token"]
    assert token["$ref"] == "#/definitions/Secret" and "default" not in token
    assert definitions["Secret"]["block_type_slug"] == "secret"
    assert "hub_token" not in props["publishing"]["default"]


def test_optional_text_takes_none_from_python_and_means_not_set() -> None:
    from pydantic import ValidationError

    from flows.params import ConsolidationForm, Destination, PublishForm, ReshardForm

    assert ConsolidationForm(deployment=None).deployment == ""
    assert ConsolidationForm(deployment="  consolidate-checkpoint/gpu ").deployment == "consolidate-checkpoint/gpu"
    assert Destination(uri="hf://o/m", revision=None).revision == ""
    assert "hub_token" not in PublishForm().model_dump(mode="json")
    with pytest.raises(ValidationError, match="max_shard_size must look like '5GB' or '500MB', got '5 parsecs'"):
        ConsolidationForm(max_shard_size="5 parsecs")
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        ReshardForm(world_sizes=[0])
