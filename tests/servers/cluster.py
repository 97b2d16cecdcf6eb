"""A real Dask cluster on loopback for the scale-out tests, one per session.

`dask_cluster` starts, from this venv, a `dask scheduler` and two `dask worker --no-nanny` processes
(`w0`, `w1`), all at once, each in its own process group and killed with the test process if that
dies. Every worker has its own environment, in which `STORAGE_EMULATOR_HOST` and
`FSSPEC_S3_ENDPOINT_URL` point at that worker's own counting `FaultProxy` in front of the session's
GCS emulator and moto S3 server: each worker's requests to the buckets show up in its own counters
(`cluster.workers["w0"].gcs.counters.range_bytes`). The test process (the coordinator) keeps the
session proxies of `tests.servers.stores`; `coordinator_traffic` hands them over with their counters reset.

- `cluster` (per test): the session's cluster with both workers running (a worker killed by an earlier
  test is started again under its name and proxies) and every worker proxy's counters reset.
- `cluster.kill(name)` SIGKILLs a worker process (no nanny, so nothing restarts it) and waits until
  the scheduler has dropped it; Dask then reschedules its tasks on the other worker.
- Worker-side helpers (`whoami`, `read_range`, `wait_for_file`) live here so that the workers import
  them by name from `tests.servers.cluster`, like any task function of a package the workers have installed.

Start-up (scheduler and two workers registered) takes 1.5-1.7 s on this 2-core machine under load,
about 1.1 s to stop; restarting a killed worker about 0.6 s.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.servers.faultproxy import FaultProxy

REPO = Path(__file__).resolve().parents[2]
WORKER_NAMES = ("w0", "w1")
WORKER_THREADS = 2
START_TIMEOUT = 60.0

# Variables that point a process at a store: the coordinator's values never leak into a worker.
_STORE_VARS = ("STORAGE_EMULATOR_HOST", "FSSPEC_S3_ENDPOINT_URL")


@dataclass
class Worker:
    """One worker process: its name, its proxies (GCS and S3) and the environment it runs in."""

    name: str
    gcs: FaultProxy | None  # None: the worker talks to the stores directly (benchmarks)
    s3: FaultProxy | None
    env: dict[str, str]
    log: Path
    proc: subprocess.Popen | None = None
    starts: int = 0
    threads: int = WORKER_THREADS

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def range_bytes(self) -> int:
        return self.gcs.counters.range_bytes + self.s3.counters.range_bytes

    @property
    def range_reads(self) -> int:
        return len(self.gcs.counters.range_reads) + len(self.s3.counters.range_reads)

    @property
    def media_downloads(self) -> int:
        return len(self.gcs.counters.media_downloads) + len(self.s3.counters.media_downloads)

    def reset(self) -> None:
        for proxy in (self.gcs, self.s3):
            if proxy is not None:
                proxy.reset()


@dataclass
class DaskCluster:
    """The scheduler's `address`, the workers by name, and `startup_seconds` of the first start."""

    address: str
    scheduler: subprocess.Popen
    workers: dict[str, Worker]
    folder: Path
    startup_seconds: float = 0.0
    _admin: Any = field(default=None, repr=False)

    def client(self) -> Any:
        """A new `distributed.Client` of this cluster (close it when done)."""
        from distributed import Client

        return Client(self.address, timeout="30s")

    def names(self) -> set[str]:
        """Names of the workers the scheduler knows now."""
        info = self._admin.scheduler_info(n_workers=-1)
        return {w["name"] for w in info["workers"].values()}

    def kill(self, name: str, *, timeout: float = 30.0) -> None:
        """SIGKILL worker `name` and wait until the scheduler no longer lists it."""
        worker = self.workers[name]
        assert worker.proc is not None
        os.killpg(worker.proc.pid, signal.SIGKILL)
        worker.proc.wait(timeout=timeout)
        deadline = time.monotonic() + timeout
        while name in self.names():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the scheduler still lists worker {name} {timeout:.0f} s after it was killed")
            time.sleep(0.05)

    def ensure_workers(self) -> None:
        """Start every worker that is not running again, then wait until all are registered."""
        for worker in self.workers.values():
            if not worker.alive:
                _start_worker(worker, self.folder)
        self._wait_registered()

    def reset_counters(self) -> None:
        for worker in self.workers.values():
            worker.reset()

    def _wait_registered(self, timeout: float = START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while not set(self.workers) <= self.names():
            for worker in self.workers.values():
                if worker.proc is not None and worker.proc.poll() is not None:
                    raise RuntimeError(f"dask worker {worker.name} exited "
                                       f"({worker.proc.returncode}):\n{_tail(worker.log)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers {sorted(set(self.workers) - self.names())} did not register in "
                                   f"{timeout:.0f} s")
            time.sleep(0.05)

    def close(self) -> None:
        if self._admin is not None:
            with contextlib.suppress(Exception):
                self._admin.close(timeout=5)
        procs = [w.proc for w in self.workers.values() if w.proc is not None] + [self.scheduler]
        for proc in procs:
            _stop(proc)
        for proxy in (p for w in self.workers.values() for p in (w.gcs, w.s3)):
            if proxy is not None:
                proxy.stop()


# ---- worker-side helpers (run on the workers; imported there from this module) ----------------------


def whoami() -> dict[str, Any]:
    """The worker this runs on: its name, pid and the store endpoints its environment names."""
    from distributed import get_worker

    return {"name": get_worker().name, "pid": os.getpid(), **{k: os.environ.get(k) for k in _STORE_VARS}}


def read_range(url: str, start: int, end: int) -> dict[str, Any]:
    """Read bytes [start, end) of `url` through fsspec as this worker's environment configures it."""
    import fsspec.core

    fs, path = fsspec.core.url_to_fs(url)
    data = fs.cat_file(path, start=start, end=end)
    return {**whoami(), "url": url, "start": start, "end": end, "nbytes": len(data)}


def wait_for_file(started: str, release: str, timeout: float = 60.0) -> dict[str, Any]:
    """Append this worker's name to `started`, then block until `release` exists (a task a test can
    catch mid-run)."""
    me = whoami()
    with open(started, "a") as fh:
        fh.write(me["name"] + "\n")
    deadline = time.monotonic() + timeout
    while not os.path.exists(release):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{release} never appeared")
        time.sleep(0.02)
    return me


def meet(log: str, workers: int, timeout: float = 60.0) -> dict[str, Any]:
    """Append this worker's name to `log`, then block until `workers` distinct workers have written
    theirs: tasks that call it cannot all finish on one worker, whatever the scheduler's timing."""
    me = whoami()
    with open(log, "a") as fh:
        fh.write(me["name"] + "\n")
    deadline = time.monotonic() + timeout
    while len(set(Path(log).read_text().split())) < workers:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{Path(log).read_text().split()} in {log}: {workers} workers never met")
        time.sleep(0.02)
    return me


# ---- starting and stopping ---------------------------------------------------------------------------


try:
    _prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl  # resolved here: the child only calls it
except (OSError, AttributeError):  # not Linux: the processes then outlive a test process that is killed
    _prctl = None


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the test process dies (PR_SET_PDEATHSIG)."""
    if _prctl is not None:
        _prctl(1, signal.SIGKILL)


def _dask_cli() -> list[str]:
    script = Path(sys.executable).with_name("dask")
    return [str(script)] if script.exists() else [sys.executable, "-m", "dask"]


def _spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    out = open(log, "ab")
    try:
        return subprocess.Popen(_dask_cli() + args, env=env, cwd=REPO, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=_die_with_parent)
    finally:
        out.close()


def _start_worker(worker: Worker, folder: Path) -> None:
    worker.starts += 1
    worker.proc = _spawn(
        ["worker", "--scheduler-file", str(folder / "scheduler.json"), "--name", worker.name,
         "--nthreads", str(worker.threads), "--no-nanny", "--no-dashboard", "--host", "127.0.0.1",
         "--memory-limit", "0", "--death-timeout", "60", "--local-directory", str(folder / worker.name)],
        worker.env, worker.log,
    )


def _stop(proc: subprocess.Popen, grace: float = 5.0) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=grace)


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def base_env() -> dict[str, str]:
    """The environment every cluster process starts from: this one, with the repository importable,
    no store endpoints, and one compute thread per library."""
    env = {k: v for k, v in os.environ.items() if k not in _STORE_VARS}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update({"OMP_NUM_THREADS": "1", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false", "PYTHONUNBUFFERED": "1"})
    return env


def start_cluster(folder: Path, gcs_port: int | None, s3_port: int | None, names: tuple[str, ...] = WORKER_NAMES, *,
                  threads: int = WORKER_THREADS, store_env: dict[str, str] | None = None) -> DaskCluster:
    """Start a scheduler and one worker per name, each worker behind its own proxies to the GCS
    emulator on `gcs_port` and moto on `s3_port`; returns once all are registered. With `store_env`
    (and no ports) the workers reach the stores it names directly, with no proxy and no counters."""
    from distributed import Client

    started = time.monotonic()
    folder.mkdir(parents=True, exist_ok=True)
    scheduler_file = folder / "scheduler.json"
    scheduler_file.unlink(missing_ok=True)
    env = base_env()
    scheduler = _spawn(["scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
                        "--scheduler-file", str(scheduler_file)], env, folder / "scheduler.log")
    workers = {}
    for name in names:
        if store_env is not None:
            workers[name] = Worker(name, None, None, dict(env, **store_env), folder / f"{name}.log", threads=threads)
        else:
            gcs, s3 = FaultProxy(gcs_port).start(), FaultProxy(s3_port, xml_errors=True).start()
            worker_env = dict(env, STORAGE_EMULATOR_HOST=gcs.url, FSSPEC_S3_ENDPOINT_URL=s3.url)
            workers[name] = Worker(name, gcs, s3, worker_env, folder / f"{name}.log", threads=threads)
        _start_worker(workers[name], folder)  # workers wait for the scheduler file themselves
    cluster = DaskCluster(address="", scheduler=scheduler, workers=workers, folder=folder)
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while not scheduler_file.exists() or not scheduler_file.read_text().strip():
            if scheduler.poll() is not None:
                raise RuntimeError(f"dask scheduler exited ({scheduler.returncode}):\n"
                                   f"{_tail(folder / 'scheduler.log')}")
            if time.monotonic() > deadline:
                raise TimeoutError("the dask scheduler did not start")
            time.sleep(0.05)
        cluster.address = json.loads(scheduler_file.read_text())["address"]
        cluster._admin = Client(cluster.address, timeout="30s")
        cluster._wait_registered()
    except BaseException:
        cluster.close()
        raise
    cluster.startup_seconds = time.monotonic() - started
    return cluster


# ---- fixtures --------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def dask_cluster(tmp_path_factory: pytest.TempPathFactory, gcs_server: tuple[FaultProxy, dict[str, str]],
                 s3_server: tuple[FaultProxy, dict[str, str]]) -> Iterator[DaskCluster]:
    cluster = start_cluster(tmp_path_factory.mktemp("dask"), gcs_server[0].upstream[1], s3_server[0].upstream[1])
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def cluster(dask_cluster: DaskCluster) -> Iterator[DaskCluster]:
    dask_cluster.ensure_workers()
    dask_cluster.reset_counters()
    yield dask_cluster
    dask_cluster.reset_counters()


@dataclass(frozen=True)
class Coordinator:
    """The test process's own proxies (those of `tests.servers.stores`), counting what the coordinator fetches."""

    gcs: FaultProxy
    s3: FaultProxy

    @property
    def range_bytes(self) -> int:
        return self.gcs.counters.range_bytes + self.s3.counters.range_bytes

    @property
    def media_downloads(self) -> int:
        return len(self.gcs.counters.media_downloads) + len(self.s3.counters.media_downloads)

    def reset(self) -> None:
        for proxy in (self.gcs, self.s3):
            if proxy is not None:
                proxy.reset()


@pytest.fixture
def coordinator_traffic(gcs_server: tuple[FaultProxy, dict[str, str]],
                        s3_server: tuple[FaultProxy, dict[str, str]]) -> Iterator[Coordinator]:
    """Reset the coordinator's proxies; a test calls `.reset()` again once its setup uploads are done."""
    coordinator = Coordinator(gcs_server[0], s3_server[0])
    coordinator.reset()
    yield coordinator
    coordinator.reset()
