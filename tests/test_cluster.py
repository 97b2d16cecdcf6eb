"""The Dask cluster fixture itself: two real worker processes, each behind its own counting proxies,
work submitted through `Client.get_executor()` (a `concurrent.futures.Executor`), and a worker
SIGKILLed mid-task whose task Dask runs again on the other worker."""

from __future__ import annotations

import os
import time
from pathlib import Path

import fsspec.core
import pytest

from tests.servers.cluster import Coordinator, DaskCluster, meet, read_range, wait_for_file

BLOB = bytes(range(256)) * 4096  # 1 MiB


def _upload(url: str) -> str:
    fs, path = fsspec.core.url_to_fs(f"{url}/blob.bin")
    fs.pipe_file(path, BLOB)
    return f"{url}/blob.bin"


def _wait_until(check, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.02)


def test_each_worker_reads_through_its_own_proxies(cluster: DaskCluster, gcs, s3, coordinator_traffic: Coordinator):
    urls = [_upload(gcs.url), _upload(s3.url)]
    coordinator_traffic.reset()  # the uploads above were the coordinator's; from here it only submits
    reads = {name: [(url, i * 65536, i * 65536 + 1000 * (i + 1)) for url in urls for i in range(4 * k + 1, 4 * k + 5)]
             for k, name in enumerate(cluster.workers)}

    with cluster.client() as client:
        results = []
        for name, ranges in reads.items():
            executor = client.get_executor(workers=[name], pure=False)
            assert executor.__class__.__mro__[1].__name__ == "Executor"  # concurrent.futures.Executor
            results += [executor.submit(read_range, *r) for r in ranges]
        results = [f.result(timeout=60) for f in results]

    for name, worker in cluster.workers.items():
        mine = [r for r in results if r["name"] == name]
        assert len(mine) == len(reads[name]), f"{name} ran {len(mine)} of its {len(reads[name])} reads"
        assert {r["STORAGE_EMULATOR_HOST"] for r in mine} == {worker.gcs.url}
        assert {r["FSSPEC_S3_ENDPOINT_URL"] for r in mine} == {worker.s3.url}
        asked = sum(end - start for _, start, end in reads[name])
        assert sum(r["nbytes"] for r in mine) == asked
        # Every byte the worker read went through its own proxies, as one ranged GET per read.
        assert worker.range_bytes == asked
        assert worker.range_reads == len(reads[name])
        assert worker.media_downloads == 0
        assert sorted(t.range for t in worker.gcs.counters.range_reads) == sorted(
            (a, b) for url, a, b in reads[name] if url.startswith("gs://"))
    assert coordinator_traffic.range_bytes == 0 and coordinator_traffic.media_downloads == 0


def test_unpinned_work_spreads_over_both_workers(cluster: DaskCluster, tmp_path: Path):
    log, workers = str(tmp_path / "met"), len(cluster.workers)
    with cluster.client() as client:
        executor = client.get_executor(pure=False)
        # Each task waits until both workers have started one: the scheduler must hand work to both.
        names = {r["name"] for r in executor.map(lambda _: meet(log, workers), range(8))}
    assert names == set(cluster.workers)


def test_killed_worker_task_runs_again_elsewhere(cluster: DaskCluster, tmp_path: Path):
    started, release = tmp_path / "started", tmp_path / "release"
    with cluster.client() as client:
        executor = client.get_executor(workers=["w1"], allow_other_workers=True, pure=False)
        future = executor.submit(wait_for_file, str(started), str(release))
        _wait_until(lambda: started.exists() and started.read_text().split() == ["w1"], what="the task to start on w1")
        killed = cluster.workers["w1"].pid
        cluster.kill("w1")
        _wait_until(lambda: started.read_text().split() == ["w1", "w0"], what="the task to start again on w0")
        release.touch()
        result = future.result(timeout=60)
    assert result["name"] == "w0"
    assert not cluster.workers["w1"].alive
    with pytest.raises(ProcessLookupError):
        os.kill(killed, 0)


def test_killed_worker_is_back_for_the_next_test(cluster: DaskCluster):
    assert cluster.names() == set(cluster.workers)
    assert all(w.alive for w in cluster.workers.values())


def test_finished_task_runs_again_when_its_worker_dies(cluster: DaskCluster, tmp_path: Path):
    """Dask keeps a result on the worker that made it; while the caller holds the future, losing that
    worker makes the scheduler run the task again. Units must therefore be idempotent."""
    runs = tmp_path / "runs"
    with cluster.client() as client:
        executor = client.get_executor(workers=["w1"], allow_other_workers=True, pure=False)
        future = executor.submit(wait_for_file, str(runs), str(tmp_path))  # returns at once
        assert future.result(timeout=60)["name"] == "w1"
        cluster.kill("w1")
        _wait_until(lambda: runs.read_text().split() == ["w1", "w0"], what="the finished task to run again on w0")


def test_identical_submissions_run_once_unless_impure(cluster: DaskCluster, tmp_path: Path):
    """`Client.submit` (and so `get_executor()`) defaults to `pure=True`: the task key is a hash of the
    function and its arguments, and a second submission of the same call shares the first one's run."""
    pure, impure = tmp_path / "pure", tmp_path / "impure"
    with cluster.client() as client:
        default = client.get_executor()
        [f.result(timeout=60) for f in [default.submit(wait_for_file, str(pure), str(tmp_path)) for _ in range(2)]]
        distinct = client.get_executor(pure=False)
        [f.result(timeout=60) for f in [distinct.submit(wait_for_file, str(impure), str(tmp_path)) for _ in range(2)]]
    assert len(pure.read_text().split()) == 1
    assert len(impure.read_text().split()) == 2
