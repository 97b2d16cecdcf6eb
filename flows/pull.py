"""The deployments' pull step: run flows from the ckptflow code on the worker, wherever it is.

`infra/prefect.yaml` names `flows.pull.set_code_directory` as its pull step. A worker runs it before
each flow run, in the flow run's own process, so the code directory is found on the worker's machine:

1. `$CKPTFLOW_CODE_DIR` when the worker has it (the images set `/opt/ckptflow`);
2. else the checkout this `flows` package is imported from (a process worker started from the
   virtual environment of a clone, `make install`, runs that clone's code).

When neither holds the flows, the step logs why to the flow run's own logs (Prefect otherwise shows
only an unrelated traceback there, and the cause only in the worker's output) and fails the run.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

CODE_DIR_ENV = "CKPTFLOW_CODE_DIR"
_MARKER = Path("flows") / "lifecycle.py"


class CodeNotFound(FileNotFoundError):
    """The worker has no ckptflow code where the pull step looked; the message says where and what to do."""


def code_directory() -> Path:
    """Where this worker's ckptflow code is (the folder holding `flows/` and `tasks/`)."""
    configured = os.environ.get(CODE_DIR_ENV, "").strip()
    if configured:
        folder = Path(configured).expanduser()
        if (folder / _MARKER).is_file():
            return folder.resolve()
        raise CodeNotFound(
            f"{CODE_DIR_ENV}={configured} on worker host {socket.gethostname()}, but "
            f"{folder / _MARKER} is not there: point {CODE_DIR_ENV} at the ckptflow checkout (or image folder) "
            "on this machine, or unset it to use the checkout ckptflow is installed from"
        )
    folder = Path(__file__).resolve().parents[1]
    if (folder / _MARKER).is_file():
        return folder
    raise CodeNotFound(  # pragma: no cover - `flows` always sits beside itself
        f"no ckptflow code found on worker host {socket.gethostname()}: set {CODE_DIR_ENV} to the checkout"
    )


def set_code_directory() -> dict[str, str]:
    """Prefect pull step: change into the code directory; `{"directory": ...}` for later steps."""
    try:
        folder = code_directory()
    except CodeNotFound as exc:
        _log_to_run(f"pull step: {exc}")
        raise
    os.chdir(folder)
    _log_to_run(f"pull step: running flows from {folder} on {socket.gethostname()}", error=False)
    return {"directory": str(folder)}


def _log_to_run(message: str, *, error: bool = True) -> None:
    """A line in the flow run's own logs (the pull step runs before the run has a logger of its own)."""
    flow_run_id = os.environ.get("PREFECT__FLOW_RUN_ID")
    if not flow_run_id:
        return
    try:
        from uuid import UUID

        from prefect.logging.loggers import flow_run_logger

        logger = flow_run_logger(flow_run_id=UUID(flow_run_id))
        (logger.error if error else logger.info)(message)
        if error:
            _flush_run_logs()
    except Exception:  # logging must not hide the error being logged
        pass


def _flush_run_logs() -> None:
    """Send queued log lines now: the process exits right after a failing pull step."""
    from prefect.logging.handlers import APILogWorker
    from prefect.utilities.asyncutils import run_coro_as_sync

    result = APILogWorker.instance().drain()
    if hasattr(result, "__await__"):
        async def wait() -> None:
            await result

        run_coro_as_sync(wait())
