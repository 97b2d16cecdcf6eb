"""`infra/dask/` without a Kubernetes cluster: the manifests agree with each other, their scheduler and
worker command lines start a working cluster with this repository's `dask`, and the example Prefect
deployment registers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.servers.cluster import REPO, _stop, base_env
from tests.servers.prefect import prefect_cli

DASK = REPO / "infra" / "dask"


def _load(name: str) -> dict[str, Any]:
    return yaml.safe_load((DASK / name).read_text())


def _containers(cluster: dict[str, Any]) -> dict[str, dict[str, Any]]:
    spec = cluster["spec"]
    (worker,) = spec["worker"]["spec"]["containers"]
    (scheduler,) = spec["scheduler"]["spec"]["containers"]
    return {"worker": worker, "scheduler": scheduler}


def test_manifests_agree() -> None:
    cluster, account = _load("daskcluster.yaml"), _load("serviceaccount.yaml")
    autoscaler, policy = _load("autoscaler.yaml"), _load("networkpolicy.yaml")
    assert (cluster["apiVersion"], cluster["kind"]) == ("kubernetes.dask.org/v1", "DaskCluster")
    assert (autoscaler["apiVersion"], autoscaler["kind"]) == ("kubernetes.dask.org/v1", "DaskAutoscaler")
    name, namespace = cluster["metadata"]["name"], cluster["metadata"]["namespace"]
    for doc in (account, autoscaler, policy):
        assert doc["metadata"]["namespace"] == namespace
    assert autoscaler["spec"]["cluster"] == name
    assert policy["spec"]["podSelector"]["matchLabels"] == {"dask.org/cluster-name": name}
    assert cluster["spec"]["scheduler"]["service"]["selector"]["dask.org/cluster-name"] == name
    for role in ("worker", "scheduler"):
        assert cluster["spec"][role]["spec"]["serviceAccountName"] == account["metadata"]["name"]
    # The Prefect workers' image (infra/docker/Dockerfile.cpu, as docker-compose names it).
    compose = yaml.safe_load((REPO / "infra" / "docker-compose.yaml").read_text())
    cpu_image = compose["services"]["worker"]["image"]
    for container in _containers(cluster).values():
        assert container["image"] == cpu_image
        names = {e["name"] for e in container.get("env", [])}
        assert not {n for n in names if re.search(r"KEY|SECRET|TOKEN|PASSWORD|CREDENTIALS", n)}, names
    assert re.search(r'"\.\[[a-z,]*cluster[a-z,]*\]"', (REPO / "infra" / "docker" / "Dockerfile.cpu").read_text())
    assert set(account["metadata"]["annotations"]) == {"iam.gke.io/gcp-service-account", "eks.amazonaws.com/role-arn"}


def _expand(args: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' `$(VAR)` expansion of container args."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in args]


def _with_option(args: list[str], option: str, value: str) -> list[str]:
    out = list(args)
    out[out.index(option) + 1] = value
    return out


def test_manifest_command_lines_start_a_cluster(tmp_path: Path) -> None:
    """The scheduler and worker `args` of daskcluster.yaml, run here (ports moved to free ones, /scratch
    to a temporary folder) with the environment the operator gives the worker containers."""
    from distributed import Client

    from tests.servers.stores import _free_port

    containers = _containers(_load("daskcluster.yaml"))
    port, dashboard = _free_port(), _free_port()
    bin_dir = Path(sys.executable).parent
    scheduler_args = _with_option(_with_option(containers["scheduler"]["args"], "--port", str(port)),
                                  "--dashboard-address", f"127.0.0.1:{dashboard}")
    env = base_env()
    env.update({e["name"]: e["value"] for e in containers["scheduler"].get("env", [])})
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    procs = [subprocess.Popen(scheduler_args + ["--host", "127.0.0.1"], env=env, cwd=tmp_path,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)]
    try:
        worker_env = dict(env, DASK_SCHEDULER_ADDRESS=f"tcp://127.0.0.1:{port}",
                          DASK_WORKER_NAME="ckptflow-default-worker-0")
        worker_env.update({e["name"]: e["value"] for e in containers["worker"].get("env", [])})
        args = _expand(containers["worker"]["args"], worker_env)
        args = _with_option(_with_option(args, "--local-directory", str(tmp_path / "scratch")),
                            "--dashboard-address", f"127.0.0.1:{_free_port()}")
        procs.append(subprocess.Popen(args + ["--host", "127.0.0.1"], env=worker_env, cwd=tmp_path,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
        with Client(f"tcp://127.0.0.1:{port}", timeout="30s") as client:
            client.wait_for_workers(1, timeout=60)
            (info,) = client.scheduler_info(n_workers=-1)["workers"].values()
            assert info["name"] == "ckptflow-default-worker-0"
            assert info["nthreads"] == int(args[args.index("--nthreads") + 1])
            assert info["memory_limit"] == 14 * 2**30
            assert client.submit(lambda: os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"]).result(timeout=30) == "false"
            import urllib.request

            deadline = time.monotonic() + 30
            while True:  # the readiness and liveness probes' endpoint
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{dashboard}/health", timeout=5) as response:
                        assert response.read() == b"ok"
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
    finally:
        for proc in reversed(procs):
            _stop(proc)


@pytest.mark.usefixtures("work_pools")
def test_example_deployment_registers(prefect_server: str) -> None:
    result = prefect_cli(prefect_server, "deploy", "--all", "--prefect-file", str(DASK / "deployment.example.yaml"),
                         timeout=300)
    assert result.returncode == 0, f"prefect deploy failed:\n{result.stdout}\n{result.stderr}"
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("checkpoint-lifecycle/on-dask")
    address = deployment.job_variables["env"]["CKPTFLOW_CLUSTER"]
    cluster = _load("daskcluster.yaml")
    assert address == (f"tcp://{cluster['metadata']['name']}-scheduler.{cluster['metadata']['namespace']}"
                       ".svc.cluster.local:8786")
