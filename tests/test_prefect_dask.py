"""Prefect flows whose tasks run on the fixture's Dask cluster through prefect-dask's `DaskTaskRunner`.

What these pin down (prefect 3.9.1, prefect-dask 0.3.7, distributed 2026.8.0):
- `DaskTaskRunner(address=...)` connects to a running scheduler; each task runs in a worker process
  (`run_task_sync` there), with the flow's settings (API URL included) shipped in the task's pickled
  context, so workers report task states to the Prefect API themselves.
- Parameters and results cross processes by cloudpickle: module-level dataclasses go by reference
  (the workers must be able to import their module), and come back as equal values.
- A worker SIGKILLed mid-task: Dask runs the task again on another worker under the same task run
  id, and the flow completes.
- A worker SIGKILLed after a task finished, while the flow still holds that task's future: Dask
  runs the finished task again (its result lived only on the dead worker); Prefect records a second
  Pending/Running/Completed on the same task run. Units must be idempotent.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec.core
from prefect import flow, task

from flows.commands import run_here
from tests.servers.cluster import DaskCluster, meet, read_range, whoami


@dataclass(frozen=True)
class Unit:
    index: int
    url: str
    start: int
    end: int


@dataclass(frozen=True)
class Done:
    index: int
    worker: str
    pid: int
    nbytes: int


@task
def run_unit(unit: Unit, log: str, workers: int) -> Done:
    got = read_range(unit.url, unit.start, unit.end)
    meet(log, workers)  # returns once every worker has started a unit: the units are spread over all
    return Done(unit.index, got["name"], got["pid"], got["nbytes"])


@task
def note(log: str) -> str:
    """Append this worker's name to `log` (one line per run of the task)."""
    name = whoami()["name"]
    with open(log, "a") as fh:
        fh.write(name + "\n")
    return name


@task
def note_and_wait(log: str, release: str) -> str:
    name = note.fn(log)
    while not os.path.exists(release):
        time.sleep(0.02)
    return name


@flow
def units_flow(units: list[Unit], log: str, workers: int) -> list[Done]:
    return [f.result() for f in [run_unit.submit(u, log, workers) for u in units]]


@flow
def blocking_flow(log: str, release: str) -> str:
    return note_and_wait.submit(log, release).result()


@flow
def finished_then_blocking_flow(log: str, started: str, release: str) -> tuple[str, str]:
    import dask

    with dask.annotate(workers=["w1"], allow_other_workers=True):  # prefect-dask honours annotations
        finished = note.submit(log)
    first = finished.result()
    with dask.annotate(workers=["w0"], allow_other_workers=True):
        waiting = note_and_wait.submit(started, release)
    return first, waiting.result()


def _runner(cluster: DaskCluster) -> Any:
    from prefect_dask import DaskTaskRunner

    return DaskTaskRunner(address=cluster.address)


def _in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = fn()
        except BaseException as exc:  # handed to the test
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def _lines(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


def _wait_until(check: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _state_history(flow_run_id: Any) -> dict[str, list[str]]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        return {r.task_key.rsplit("-", 1)[0] + f"#{r.id}": [s.type.value for s in
                sorted(client.read_task_run_states(r.id), key=lambda s: s.timestamp)] for r in runs}


def test_flow_runs_its_tasks_on_the_cluster(prefect_server: str, cluster: DaskCluster, gcs, coordinator_traffic,
                                            tmp_path: Path) -> None:
    fs, path = fsspec.core.url_to_fs(f"{gcs.url}/blob.bin")
    fs.pipe_file(path, bytes(1 << 20))
    coordinator_traffic.reset()
    units = [Unit(i, f"{gcs.url}/blob.bin", i * 4096, i * 4096 + 1000 + i) for i in range(8)]

    done = units_flow.with_options(task_runner=_runner(cluster))(units, str(tmp_path / "met"), len(cluster.workers))

    assert [d.index for d in done] == list(range(8))
    assert all(isinstance(d, Done) for d in done)  # a dataclass made on a worker, unpickled here
    assert {d.worker for d in done} == set(cluster.workers)
    assert os.getpid() not in {d.pid for d in done}
    for name, worker in cluster.workers.items():
        assert worker.gcs.counters.range_bytes == sum(d.nbytes for d in done if d.worker == name)
    assert coordinator_traffic.range_bytes == 0


def test_flow_survives_a_worker_killed_mid_task(prefect_server: str, cluster: DaskCluster, tmp_path: Path) -> None:
    from prefect import get_client

    log, release = tmp_path / "runs", tmp_path / "release"
    thread, out = _in_thread(lambda: run_here(blocking_flow.with_options(task_runner=_runner(cluster)),
                                              {"log": str(log), "release": str(release)}))
    _wait_until(lambda: len(_lines(log)) == 1, "the task to start")
    first = _lines(log)[0]
    cluster.kill(first)
    _wait_until(lambda: len(_lines(log)) == 2, "the task to start again")
    release.touch()
    thread.join(60)

    state = out["result"].state
    assert state.is_completed(), out
    other = (set(cluster.workers) - {first}).pop()
    assert _lines(log) == [first, other]
    assert out["result"].value == other
    history = _state_history(state.state_details.flow_run_id)
    assert len(history) == 1, history  # one task run, run twice
    (states,) = history.values()
    assert states[-1] == "COMPLETED" and states.count("COMPLETED") == 1, states
    with get_client(sync_client=True) as client:
        assert client.read_flow_run(state.state_details.flow_run_id).state.is_completed()


def test_finished_task_runs_again_when_its_worker_dies(prefect_server: str, cluster: DaskCluster,
                                                       tmp_path: Path) -> None:
    log, started, release = tmp_path / "finished", tmp_path / "started", tmp_path / "release"
    thread, out = _in_thread(lambda: run_here(finished_then_blocking_flow.with_options(task_runner=_runner(cluster)),
                                              {"log": str(log), "started": str(started), "release": str(release)}))
    _wait_until(lambda: _lines(started) == ["w0"], "the second task to start on w0")
    assert _lines(log) == ["w1"]
    cluster.kill("w1")
    _wait_until(lambda: _lines(log) == ["w1", "w0"], "the finished task to run again on w0")
    release.touch()
    thread.join(60)

    state = out["result"].state
    assert state.is_completed(), out
    assert out["result"].value == ("w1", "w0")
    history = _state_history(state.state_details.flow_run_id)
    note_states = next(v for k, v in history.items() if k.startswith("note#"))
    assert note_states == ["PENDING", "RUNNING", "COMPLETED"] * 2, history
