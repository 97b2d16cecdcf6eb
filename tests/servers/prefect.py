"""A real Prefect server for the flow tests: one per test session, started only when a test asks.

`prefect_server` starts `prefect server start` (API and every background service: scheduler,
triggers, late runs; no UI) on a loopback port with a SQLite database, results and the Prefect home
in the session's temporary folder, and yields its API URL. Unlike `prefect_test_harness`, whose
server is ephemeral and runs no scheduler, this one creates the runs of scheduled deployments, as a
user's server does; its scheduler looks every 2 s instead of every 60. `prefect_server_log` is the
file the server logs to. Tests that only need a task's function call `task.fn(...)` under
`disable_run_logger()` and never start it.

`deployed` registers every deployment of `infra/prefect.yaml` against that server with the real
`infra/bootstrap.sh` (work pools, `prefect deploy --all`, the scheduler check), once.
"""

from __future__ import annotations

import atexit
import inspect
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
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


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


_SERVER_LOG: list[Path] = []


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The API URL of a Prefect server (with its services) that lives for the rest of the session."""
    import httpx
    from prefect.context import _temporary_global_settings_context, get_settings_context
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_LOCAL_STORAGE_PATH,
        PREFECT_SERVER_ANALYTICS_ENABLED,
        temporary_settings,
    )

    home = tmp_path_factory.mktemp("prefect-server")
    storage = tmp_path_factory.mktemp("prefect-results")
    log_path = home / "server.log"
    port = _free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API_")}
    env.update(
        PREFECT_SERVER_DATABASE_CONNECTION_URL=f"sqlite+aiosqlite:///{home / 'prefect.db'}",
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS="2",
        PREFECT_SERVER_LOGGING_LEVEL="WARNING",
    )
    with log_path.open("w") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "prefect", "--no-prompt", "server", "start", "--host", "127.0.0.1",
             "--port", str(port), "--no-ui"],
            env=env, stdout=log, stderr=subprocess.STDOUT,
        )
    _SERVER_LOG.append(log_path)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the Prefect server did not start:\n{log_path.read_text()[-4000:]}")
            time.sleep(0.5)
        with temporary_settings(
            {PREFECT_API_URL: url, PREFECT_LOCAL_STORAGE_PATH: storage, PREFECT_SERVER_ANALYTICS_ENABLED: False}
        ):
            with _temporary_global_settings_context(get_settings_context()):
                yield url
                _drain_workers()
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()


@pytest.fixture(scope="session")
def prefect_server_log(prefect_server: str) -> Path:
    """The file the session's Prefect server writes its log to."""
    return _SERVER_LOG[-1]


def _drain_workers() -> None:
    """Send the logs and events still queued before the server goes away."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.utilities.asyncutils import run_coro_as_sync

    async def drain() -> None:
        try:
            result = APILogWorker.instance().drain()
            if inspect.isawaitable(result):
                await result
        except RuntimeError:  # never started
            pass
        result = EventsWorker.drain_all()
        if inspect.isawaitable(result):
            await result

    try:
        run_coro_as_sync(drain())
    except Exception:  # the session is over either way
        pass


def prefect_cli(api_url: str, *args: str, timeout: float = 180.0) -> subprocess.CompletedProcess[str]:
    """Run the `prefect` command line against `api_url` from the repository root."""
    env = dict(os.environ, PREFECT_API_URL=api_url, PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_CLI_PROMPT="false")
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
def deployed(
    prefect_server: str, work_pools: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> subprocess.CompletedProcess[str]:
    """`infra/bootstrap.sh` against the session's server: pools, blocks, the failure automation (through a
    webhook block `custom-webhook/ckptflow-test-alerts` to a port nothing listens on), `prefect deploy
    --all`, the schedule check."""
    from prefect.blocks.notifications import CustomWebhookNotificationBlock

    CustomWebhookNotificationBlock(name="ckptflow", url="http://127.0.0.1:9/alerts").save(
        "ckptflow-test-alerts", overwrite=True
    )
    env = dict(os.environ, PREFECT_API_URL=prefect_server, PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_CLI_PROMPT="false", CKPTFLOW_GPU_POOL_TYPE="kubernetes", CKPTFLOW_SCHEDULE_CHECK_SECONDS="60",
               CKPTFLOW_RESULTS=str(tmp_path_factory.mktemp("ckptflow-results")),
               CKPTFLOW_NOTIFY_BLOCK="custom-webhook/ckptflow-test-alerts")
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    result = subprocess.run(["bash", str(INFRA / "bootstrap.sh")], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=400)
    assert result.returncode == 0, f"infra/bootstrap.sh failed:\n{result.stdout}\n{result.stderr}"
    return result
