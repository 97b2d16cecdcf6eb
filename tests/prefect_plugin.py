"""A real Prefect server for the flow tests: one per test session, started only when a test asks.

`prefect_server` starts `prefect_test_harness` (a subprocess API server on a temporary SQLite
database, about 8 s) the first time a test uses it, with results and the Prefect home in the
session's temporary folder, and yields its API URL. Tests that only need a task's function call
`task.fn(...)` under `disable_run_logger()` and never start it.

`deployed` registers every deployment of `infra/prefect.yaml` against that server with the real
`prefect deploy --all`, once, after creating the work pools from `infra/work-pools/`.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
INFRA = REPO / "infra"

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# Flow tests must not leave cached results or a database in the user's ~/.prefect.
if "PREFECT_HOME" not in os.environ:
    _home = Path(os.environ.get("TMPDIR", "/tmp")) / f"ckptflow-prefect-{os.getpid()}"
    os.environ["PREFECT_HOME"] = str(_home)
    atexit.register(shutil.rmtree, _home, True)
# Task retries in tests wait fractions of a second, not seconds.
os.environ.setdefault("CKPTFLOW_TASK_RETRY_BACKOFF", "0.05")

# Work pools: name -> (type, base job template in infra/work-pools/, or None for the type's default).
# `cpu` and `gpu` are the ones infra/prefect.yaml deploys to; `gpu-docker` checks the Docker template.
WORK_POOLS: dict[str, tuple[str, str | None]] = {
    "cpu": ("process", None),
    "gpu": ("kubernetes", "kubernetes-gpu.json"),
    "gpu-docker": ("docker", "docker-gpu.json"),
}


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The API URL of a Prefect server that lives for the rest of the session."""
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_LOCAL_STORAGE_PATH,
        PREFECT_SERVER_ANALYTICS_ENABLED,
        temporary_settings,
    )
    from prefect.testing.utilities import prefect_test_harness

    storage = tmp_path_factory.mktemp("prefect-results")
    with temporary_settings({PREFECT_LOCAL_STORAGE_PATH: storage, PREFECT_SERVER_ANALYTICS_ENABLED: False}):
        with prefect_test_harness(server_startup_timeout=90):
            yield str(PREFECT_API_URL.value())


def prefect_cli(api_url: str, *args: str, timeout: float = 180.0) -> subprocess.CompletedProcess[str]:
    """Run the `prefect` command line against `api_url` from the repository root."""
    env = dict(os.environ, PREFECT_API_URL=api_url, PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_CLI_PROMPT="false")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "prefect", "--no-prompt", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
    )


@pytest.fixture(scope="session")
def work_pools(prefect_server: str) -> dict[str, str]:
    """The work pools of `WORK_POOLS`, created with `prefect work-pool create [--base-job-template]`."""
    for name, (kind, template) in WORK_POOLS.items():
        extra = ["--base-job-template", str(INFRA / "work-pools" / template)] if template else []
        result = prefect_cli(prefect_server, "work-pool", "create", name, "--type", kind, *extra, "--overwrite")
        assert result.returncode == 0, f"work-pool create {name} failed:\n{result.stdout}\n{result.stderr}"
    return {name: kind for name, (kind, _) in WORK_POOLS.items()}


@pytest.fixture(scope="session")
def deployed(prefect_server: str, work_pools: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`prefect deploy --all --prefect-file infra/prefect.yaml` against the session's server."""
    result = prefect_cli(prefect_server, "deploy", "--all", "--prefect-file", str(INFRA / "prefect.yaml"), timeout=300)
    assert result.returncode == 0, f"prefect deploy --all failed:\n{result.stdout}\n{result.stderr}"
    return result

