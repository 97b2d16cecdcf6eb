"""Consolidate and reshard through a real Dask cluster (issue 12): a scheduler and two worker processes
on loopback (`tests.servers.cluster`), each behind its own counting proxies in front of the GCS emulator and
moto's S3 server, the test process the coordinator behind the session's proxies.

What is pinned:
- bucket to bucket (`gs://` and `s3://`), the cluster's output is byte for byte the single-process
  (threads) output;
- every worker did work, by ranged GETs only, and the workers' bytes add up to the plan's bytes
  exactly (no whole-file download, no read-ahead, nothing read twice);
- the coordinator reads headers and pickles, never a byte of a tensor (its ranged reads checked against
  every storage's byte range, taken from the files with zipfile);
- a worker SIGKILLed mid-run: the run completes with the same bytes;
- a coordinator (the CLI) SIGKILLed mid-run leaves nothing at OUT, and the same command then completes;
- the CLI's `--cluster` and the lifecycle flow on prefect-dask's `DaskTaskRunner` give the same bytes.

The checkpoint is the tiny Llama of the fixtures (ZeRO-3 bf16, 2 ranks, config and tokenizer files),
uploaded to the emulators; the model is cut into 40 KB shards so that both workers get some.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import fsspec.core
import pytest

from ckptflow.consolidate import ConsolidateOptions, consolidate, plan_consolidation
from ckptflow.formats.deepspeed import load_index
from ckptflow.plumbing.executors import cluster as dask_executor
from ckptflow.reshard import plan_output, reshard
from tests.fixtures import Fixture
from tests.oracles.tensors import storage_ranges
from tests.servers.cluster import REPO, Coordinator, DaskCluster
from tests.servers.stores import Store

FIXTURE = "llama-z3-bf16-ws2"
OPTIONS = {"dtype": "bf16", "max_shard_size": "40KB"}
WORLD_SIZE = 3


# ---- helpers ------------------------------------------------------------------------------------------


def _upload(fixture: Fixture, url: str) -> str:
    fs, path = fsspec.core.url_to_fs(url)
    for file in sorted(p for p in fixture.dir.rglob("*") if p.is_file()):
        fs.pipe_file(f"{path}/{file.relative_to(fixture.dir).as_posix()}", file.read_bytes())
    return url


def _files(url: str) -> dict[str, bytes]:
    """Every object under `url` by relative path (hidden staging folders included)."""
    fs, root = fsspec.core.url_to_fs(url)
    fs.invalidate_cache()
    return {p[len(root) + 1:]: fs.cat_file(p) for p in sorted(fs.find(root))}


def _listing(url: str) -> list[str]:
    fs, root = fsspec.core.url_to_fs(url)
    fs.invalidate_cache()
    return sorted(p[len(root) + 1:] for p in fs.find(root))


def _object(transfer: Any) -> str:
    """The object name a proxied request was for (GCS JSON API or S3 path style)."""
    return unquote(transfer.path.split("?", 1)[0])


def _tensor_bytes(reads: list[Any], ranges: Mapping[str, list[tuple[int, int]]]) -> int:
    """Bytes of ranged reads that fall inside a storage of the object they read (`ranges`: object
    name suffix -> storage byte ranges)."""
    total = 0
    for t in reads:
        name = _object(t)
        for suffix, spans in ranges.items():
            if name.endswith(suffix):
                total += sum(max(0, min(t.range[1], b) - max(t.range[0], a)) for a, b in spans)
    return total


def _source_ranges(fixture: Fixture, src_url: str) -> dict[str, list[tuple[int, int]]]:
    prefix = fsspec.core.url_to_fs(src_url)[1].split("/", 1)[1]  # the key under the bucket
    return {f"{prefix}/{p.relative_to(fixture.dir).as_posix()}": storage_ranges(str(p))
            for p in fixture.dir.rglob("*.pt")}


def _coordinator_reads(coordinator: Coordinator) -> list[Any]:
    return coordinator.gcs.counters.range_reads + coordinator.s3.counters.range_reads


def _downloads(coordinator: Coordinator) -> list[Any]:
    return coordinator.gcs.counters.media_downloads + coordinator.s3.counters.media_downloads


def _wait_until(check: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.02)


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


def _started(cluster: DaskCluster, name: str) -> bool:
    """Whether worker `name` has begun a unit (sent any request through its proxies: a worker sends
    none otherwise)."""
    worker = cluster.workers[name]
    return worker.gcs.counters.requests + worker.s3.counters.requests > 0


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "ckptflow.cli", *args]


def _cli_env() -> dict[str, str]:
    """This process's environment (its stores, through the session's proxies) with this checkout first."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))


# ---- bucket to bucket, threads against the cluster ----------------------------------------------------


@pytest.mark.parametrize("store_name", ["gcs", "s3"])
def test_consolidate_on_the_cluster(store_name: str, request: pytest.FixtureRequest, ds_fixtures: Mapping[str, Fixture],
                                    cluster: DaskCluster, coordinator_traffic: Coordinator) -> None:
    store: Store = request.getfixturevalue(store_name)
    fixture = ds_fixtures[FIXTURE]
    src = _upload(fixture, f"{store.url}/src")
    options = ConsolidateOptions(**OPTIONS, verify=False)
    consolidate(src, f"{store.url}/threads", options=options)
    plan = plan_consolidation(load_index(src), options)
    assert len(plan.units) >= 4
    coordinator_traffic.reset()
    cluster.reset_counters()

    with dask_executor(cluster.address) as executor:
        result = consolidate(src, f"{store.url}/model", options=options, executor=executor)

    # The workers: each did some of the work, by ranged GETs only, and between them read exactly the
    # plan's bytes: every fp32 master byte once, nothing else.
    done = {name: w.range_bytes for name, w in cluster.workers.items()}
    assert all(done.values()), done
    assert sum(done.values()) == plan.source_bytes
    assert [w.media_downloads for w in cluster.workers.values()] == [0, 0]
    # The coordinator: headers, pickles and side files, never a tensor byte.
    reads = _coordinator_reads(coordinator_traffic)
    assert reads and _tensor_bytes(reads, _source_ranges(fixture, src)) == 0
    assert not [t for t in _downloads(coordinator_traffic) if _object(t).endswith(".pt")]
    # The output: the threads' bytes, file for file.
    assert _files(f"{store.url}/model") == _files(f"{store.url}/threads")
    assert len(result.shards) == len(plan.units)


@pytest.mark.parametrize("store_name", ["gcs", "s3"])
def test_reshard_on_the_cluster(store_name: str, request: pytest.FixtureRequest, ds_fixtures: Mapping[str, Fixture],
                                cluster: DaskCluster, coordinator_traffic: Coordinator, tmp_path: Path) -> None:
    store: Store = request.getfixturevalue(store_name)
    fixture = ds_fixtures[FIXTURE]
    src = _upload(fixture, f"{store.url}/src")
    reshard(src, f"{store.url}/threads", world_size=WORLD_SIZE)
    plan = plan_output(src, f"{store.url}/ws", target=WORLD_SIZE)
    reference = _files(f"{store.url}/threads")
    coordinator_traffic.reset()
    cluster.reset_counters()

    with dask_executor(cluster.address) as executor:
        result = reshard(src, f"{store.url}/ws", world_size=WORLD_SIZE, executor=executor)

    done = {name: w.range_bytes for name, w in cluster.workers.items()}
    assert all(done.values()), done
    assert sum(done.values()) == plan.read_bytes == result.bytes_read
    assert [w.media_downloads for w in cluster.workers.values()] == [0, 0]
    # The coordinator read the source's and the staged files' headers, never their tensors.
    staged = {}
    for name, data in reference.items():
        if name.endswith(".pt") and f"{plan.tag}/" in name:
            local = tmp_path / name.replace("/", "_")
            local.write_bytes(data)
            staged[f".partial/{name}"] = storage_ranges(str(local))
    reads = _coordinator_reads(coordinator_traffic)
    assert reads and _tensor_bytes(reads, {**_source_ranges(fixture, src), **staged}) == 0
    assert not [t for t in _downloads(coordinator_traffic) if _object(t).endswith(".pt")]
    assert _files(f"{store.url}/ws") == reference


# ---- failures ---------------------------------------------------------------------------------------------


def test_a_worker_killed_mid_run_changes_nothing(gcs: Store, ds_fixtures: Mapping[str, Fixture],
                                                 cluster: DaskCluster) -> None:
    """w1 reads slowly (its proxy holds each request a second) and is killed once it has started; its
    units run again on w0 and the model comes out the same. Checked (verify) as the CLI does by default."""
    src = _upload(ds_fixtures[FIXTURE], f"{gcs.url}/src")
    options = ConsolidateOptions(**OPTIONS)
    consolidate(src, f"{gcs.url}/threads", options=options)
    cluster.workers["w1"].gcs.configure(delay=1.0)

    with dask_executor(cluster.address) as executor:
        thread, out = _in_thread(lambda: consolidate(src, f"{gcs.url}/model", options=options, executor=executor))
        _wait_until(lambda: _started(cluster, "w1"), "w1 to start a unit")
        cluster.kill("w1")
        thread.join(120)

    assert "error" not in out, out
    assert out["result"].verified
    assert cluster.workers["w0"].range_bytes >= 2 * plan_consolidation(load_index(src), options).source_bytes
    assert _files(f"{gcs.url}/model") == _files(f"{gcs.url}/threads")


def test_a_coordinator_killed_mid_run_leaves_nothing_and_runs_again(gcs: Store, ds_fixtures: Mapping[str, Fixture],
                                                                    cluster: DaskCluster) -> None:
    """`ckptflow reshard ... --cluster` SIGKILLed once the workers have started: OUT does not exist (its
    staging folder is hidden beside it), and the same command then completes with the same bytes."""
    src = _upload(ds_fixtures[FIXTURE], f"{gcs.url}/src")
    reshard(src, f"{gcs.url}/threads", world_size=WORLD_SIZE)
    command = _cli("reshard", src, f"{gcs.url}/ws", "--world-size", str(WORLD_SIZE), "--cluster", cluster.address)
    for worker in cluster.workers.values():
        worker.gcs.configure(delay=0.5)

    coordinator = subprocess.Popen(command, env=_cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        _wait_until(lambda: any(_started(cluster, n) for n in cluster.workers) or coordinator.poll() is not None,
                    "a worker to start a unit")
        assert coordinator.poll() is None, coordinator.stdout.read().decode() if coordinator.stdout else ""
        coordinator.send_signal(signal.SIGKILL)
        coordinator.wait(30)
    finally:
        if coordinator.poll() is None:
            coordinator.kill()
    # Nothing at OUT; what the units write goes to the hidden staging folder beside it (on a bucket,
    # objects appear there only as units finish; units already running finish after the coordinator died).
    left = _listing(gcs.url)
    assert all(p.startswith(("src/", "threads/", ".ws.ckptflow-")) for p in left), left

    cluster.reset_counters()  # no more delays
    again = subprocess.run(command, env=_cli_env(), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "resharded" in again.stdout
    assert _files(f"{gcs.url}/ws") == _files(f"{gcs.url}/threads")
    assert all(p.startswith(("src/", "threads/", "ws/", ".ws.ckptflow-")) for p in _listing(gcs.url))


# ---- the command line and the flow ---------------------------------------------------------------------


def test_cli_consolidates_on_the_cluster(s3: Store, ds_fixtures: Mapping[str, Fixture], cluster: DaskCluster) -> None:
    """`--cluster` from $CKPTFLOW_CLUSTER, bucket to bucket, the same bytes as without it."""
    src = _upload(ds_fixtures[FIXTURE], f"{s3.url}/src")
    args = ["consolidate", src, "OUT", "--dtype", "bf16", "--max-shard-size", "40KB"]
    plain = subprocess.run(_cli(*[a if a != "OUT" else f"{s3.url}/plain" for a in args]), env=_cli_env(),
                           capture_output=True, text=True, timeout=300)
    assert plain.returncode == 0, plain.stderr
    on_cluster = subprocess.run(_cli(*[a if a != "OUT" else f"{s3.url}/cluster" for a in args]),
                                env={**_cli_env(), "CKPTFLOW_CLUSTER": cluster.address},
                                capture_output=True, text=True, timeout=300)
    assert on_cluster.returncode == 0, on_cluster.stderr
    assert all(w.range_bytes for w in cluster.workers.values())
    assert _files(f"{s3.url}/cluster") == _files(f"{s3.url}/plain")


def test_cli_says_when_the_cluster_cannot_be_used(tmp_path: Path) -> None:
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**_cli_env(), "CKPTFLOW_CLUSTER_TIMEOUT": "1"}
    unreachable = subprocess.run(_cli("reshard", str(tmp_path / "src"), str(tmp_path / "out"), "--world-size", "2",
                                      "--cluster", f"tcp://127.0.0.1:{port}"), env=env, capture_output=True, text=True,
                                 timeout=120)
    assert unreachable.returncode == 1
    lines = unreachable.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: cannot reach the Dask scheduler at tcp://127.0.0.1:{port} ")
    assert "check the address (tcp://HOST:PORT) and that the scheduler is running" in lines[0]
    missing = subprocess.run(
        [sys.executable, "-c", "import sys; sys.modules['distributed'] = None\nfrom ckptflow.cli import main\n"
         "sys.argv = ['ckptflow', 'consolidate', 'SRC', 'OUT']\nmain()"],
        env={**env, "CKPTFLOW_CLUSTER": "tcp://127.0.0.1:8786"}, capture_output=True, text=True, timeout=120)
    assert missing.returncode == 1
    assert missing.stderr.strip() == (
        "error: running on the Dask cluster at tcp://127.0.0.1:8786 needs Dask's `distributed` package, which is "
        "not installed; pip install 'ckptflow[cluster]', or run without --cluster")


def test_the_lifecycle_flow_runs_its_units_on_dask(prefect_server: str, gcs: Store, ds_fixtures: Mapping[str, Fixture],
                                                   cluster: DaskCluster, coordinator_traffic: Coordinator) -> None:
    """`checkpoint_lifecycle(..., cluster=ADDRESS)`: validation, planning and finalize in the flow run,
    every shard and rank a task on prefect-dask's DaskTaskRunner; the same bytes as the core on threads."""
    from flows.lifecycle import checkpoint_lifecycle
    from flows.params import ConsolidationForm, ReshardForm, ValidationForm, VerificationForm

    fixture = ds_fixtures[FIXTURE]
    src = _upload(fixture, f"{gcs.url}/src")
    consolidate(src, f"{gcs.url}/threads-model", options=ConsolidateOptions(**OPTIONS))
    reshard(src, f"{gcs.url}/threads-ws", world_size=WORLD_SIZE)
    coordinator_traffic.reset()
    cluster.reset_counters()

    summary = checkpoint_lifecycle(
        source=src, validation=ValidationForm(settle_seconds=0),
        consolidation=ConsolidationForm(**OPTIONS), reshard=ReshardForm(world_sizes=[WORLD_SIZE]),
        verification=VerificationForm(enabled=False), workspace=f"{gcs.url}/work", cluster=cluster.address,
    )

    assert summary["failures"] == []
    assert all(w.range_bytes for w in cluster.workers.values())
    assert _tensor_bytes(_coordinator_reads(coordinator_traffic), _source_ranges(fixture, src)) == 0
    model, ranks = summary["model"]["uri"], summary["reshards"][str(WORLD_SIZE)]["uri"]
    assert _files(model) == _files(f"{gcs.url}/threads-model")
    assert _files(ranks) == _files(f"{gcs.url}/threads-ws")
