"""The bucket trigger: finding `latest` pointers (`ckptflow.watch`) and the `watch_latest` flow.

The discovery tests run on `memory://`, local folders and the GCS emulator without Prefect. The flow
tests run against the session's Prefect server; the trigger test deploys `infra/prefect.yaml` there
and checks that the watcher's event makes the `on-checkpoint` deployment start a lifecycle run.
"""

from __future__ import annotations

import time
import uuid

import fsspec
import pytest

from ckptflow.watch import Scan, Seen, Sighting, content_identity, find_latest, object_version, select_new, step_of

# ---- discovery, no Prefect ------------------------------------------------------------------------


@pytest.fixture
def mem() -> str:
    root = f"memory://watch-{uuid.uuid4().hex[:8]}"
    yield root
    fs = fsspec.filesystem("memory")
    if fs.exists(root):
        fs.rm(root, recursive=True)


def put(uri: str, data: bytes) -> None:
    fs, path = fsspec.core.url_to_fs(uri)
    fs.pipe_file(path, data)


def until_the_clock_passes(uri: str, probe: str, timeout: float = 10.0) -> None:
    """Wait until a file written now at `probe` (same store, outside what is scanned) gets a later
    stamp than `uri` has, so that rewriting `uri` with as many bytes changes its version (mtime and
    size on local and memory stores), however coarse the store's clock."""
    fs, path = fsspec.core.url_to_fs(uri)
    _, probe_path = fsspec.core.url_to_fs(probe)
    before = _stamp(fs.info(path))
    deadline = time.monotonic() + timeout
    while True:
        fs.pipe_file(probe_path, b"")
        if _stamp(fs.info(probe_path)) > before:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"the clock of {probe} never passed {before}")
        time.sleep(0.001)
    fs.rm_file(probe_path)


def _stamp(info: dict) -> float:
    stamp = info.get("mtime", info.get("created"))  # memory:// gives a datetime
    return stamp.timestamp() if hasattr(stamp, "timestamp") else float(stamp)


def test_finds_every_latest_with_its_tag_and_folder(mem: str) -> None:
    put(f"{mem}/runs/a/latest", b"global_step3\n")
    put(f"{mem}/runs/a/global_step3/zero_pp_rank_0_mp_rank_00_model_states.pt", b"x")
    put(f"{mem}/runs/b/checkpoint-20/latest", b"global_step20")
    put(f"{mem}/runs/notes.txt", b"not a checkpoint")

    scan = find_latest([f"{mem}/runs"])

    assert [(s.root, s.tag, s.step) for s in scan.sightings] == [
        (f"{mem}/runs/a", "global_step3", 3),
        (f"{mem}/runs/b/checkpoint-20", "global_step20", 20),
    ]
    assert all(s.watched == f"{mem}/runs" for s in scan.sightings)
    assert scan.unreadable == ()


def test_one_unreadable_folder_does_not_hide_the_others(mem: str) -> None:
    put(f"{mem}/a/latest", b"global_step1")
    put(f"{mem}/b/latest", b"../../etc/passwd")
    put(f"{mem}/c/latest", b"\xff\xfe\x00binary")
    put(f"{mem}/d/latest", b"x" * 10_000)
    put(f"{mem}/e/latest", b"global_step5")

    scan = find_latest([mem, f"{mem}-missing"])

    assert [s.root for s in scan.sightings] == [f"{mem}/a", f"{mem}/e"]
    reasons = {u.where: u.reason for u in scan.unreadable}
    assert "not a plain folder name" in reasons[f"{mem}/b"]
    assert "not UTF-8 text" in reasons[f"{mem}/c"]
    assert "holds more than 4096 bytes, so it is not a DeepSpeed `latest` pointer" in reasons[f"{mem}/d"]
    assert reasons[f"{mem}-missing"] == f"{mem}-missing does not exist"
    assert [u.whole_root for u in scan.unreadable] == [False, False, False, True]


def test_exclude_patterns_and_depth(mem: str) -> None:
    put(f"{mem}/run/latest", b"global_step1")
    put(f"{mem}/run/ckptflow-work/zero-ws4/latest", b"global_step1")
    put(f"{mem}/deep/a/b/c/latest", b"global_step2")

    scan = find_latest([mem], exclude=["*/ckptflow-work/*"], max_depth=3)

    assert [s.root for s in scan.sightings] == [f"{mem}/run"]


def test_overlapping_roots_report_a_folder_once(mem: str) -> None:
    put(f"{mem}/runs/a/latest", b"global_step1")
    scan = find_latest([f"{mem}/runs", f"{mem}/runs/a/"])
    assert [s.root for s in scan.sightings] == [f"{mem}/runs/a"]


def test_an_unchanged_latest_is_not_read_again(mem: str) -> None:
    put(f"{mem}/a/latest", b"global_step1")
    first = find_latest([mem]).sightings[0]
    # Same version as recorded: the recorded tag is taken as is, the file is not read.
    again = find_latest([mem], known={first.root: Seen(first.version, "global_step1-recorded")}).sightings[0]
    assert again.tag == "global_step1-recorded"
    until_the_clock_passes(f"{mem}/a/latest", f"{mem}/clock-probe")
    put(f"{mem}/a/latest", b"global_step2")
    moved = find_latest([mem], known={first.root: Seen(first.version, "global_step1")}).sightings[0]
    assert moved.tag == "global_step2" and moved.version != first.version


def test_select_new_never_announces_a_tag_twice() -> None:
    def scan(*pairs: tuple[str, str, str]) -> Scan:
        return Scan(tuple(Sighting(root=r, tag=t, version=v, watched="w") for r, t, v in pairs))

    new, seen = select_new(scan(("a", "global_step1", "v1"), ("b", "global_step7", "v1")), {})
    assert [(s.root, s.tag) for s in new] == [("a", "global_step1"), ("b", "global_step7")]

    new, seen = select_new(scan(("a", "global_step1", "v1"), ("b", "global_step7", "v1")), seen)
    assert new == []

    new, seen = select_new(scan(("a", "global_step2", "v2")), seen)
    assert [(s.root, s.tag) for s in new] == [("a", "global_step2")]
    assert seen["a"] == Seen("v2", "global_step2", ("global_step1", "global_step2"))

    # `latest` pointed back at an older tag (a rollback): not new, only the version is recorded.
    new, seen = select_new(scan(("a", "global_step1", "v3")), seen)
    assert new == [] and seen["a"].version == "v3" and seen["a"].tag == "global_step1"
    assert Seen.from_dict(seen["a"].to_dict()) == seen["a"]


def test_content_identity_follows_the_files(tmp_path) -> None:
    tag = tmp_path / "global_step3"
    tag.mkdir()
    (tag / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(b"rank0")
    first = content_identity(str(tmp_path), "global_step3")
    assert content_identity(str(tmp_path), "global_step3") == first
    (tag / "zero_pp_rank_1_mp_rank_00_model_states.pt").write_bytes(b"rank1")
    second = content_identity(str(tmp_path), "global_step3")
    assert second != first
    until_the_clock_passes(str(tag / "zero_pp_rank_1_mp_rank_00_model_states.pt"), str(tmp_path / "clock-probe"))
    (tag / "zero_pp_rank_1_mp_rank_00_model_states.pt").write_bytes(b"RANK1")  # same size, rewritten
    assert content_identity(str(tmp_path), "global_step3") != second
    with pytest.raises(FileNotFoundError, match="holds no files"):
        content_identity(str(tmp_path), "global_step9")


def test_versions_by_store() -> None:
    assert object_version({"generation": "1712", "size": 3}) == "gen:1712"
    assert object_version({"VersionId": "abc", "ETag": '"e"'}) == "vid:abc"
    assert object_version({"ETag": '"e1"', "size": 3}) == "etag:e1"
    assert object_version({"mtime": 12.5, "size": 3}) == "mtime:12.5:size:3"
    assert step_of("global_step1200") == 1200 and step_of("best") is None


def test_gcs_generations(gcs) -> None:
    put(f"{gcs.url}/runs/a/latest", b"global_step1")
    put(f"{gcs.url}/runs/a/global_step1/zero_pp_rank_0_mp_rank_00_model_states.pt", b"x")
    put(f"{gcs.url}/runs/broken/latest", b"")

    scan = find_latest([f"{gcs.url}/runs"])

    (sighting,) = scan.sightings
    assert sighting.root == f"{gcs.url}/runs/a" and sighting.version.startswith("gen:")
    assert [u.where for u in scan.unreadable] == [f"{gcs.url}/runs/broken"]
    put(f"{gcs.url}/runs/a/latest", b"global_step2")
    again = find_latest([f"{gcs.url}/runs"], known={sighting.root: Seen(sighting.version, sighting.tag)})
    assert again.sightings[0].tag == "global_step2" and again.sightings[0].version != sighting.version


# ---- the flow, against a Prefect server -----------------------------------------------------------


def _events(api_url: str, root: str) -> list[dict]:
    """Events the server stored whose resource id starts with the checkpoint prefix under `root`."""
    import httpx

    body = {"filter": {"event": {"name": ["ckptflow.checkpoint.saved"]},
                       "resource": {"id_prefix": [f"ckptflow.checkpoint.{root}"]},
                       "occurred": {"since": "2000-01-01T00:00:00Z"}},
            "limit": 50}
    return httpx.post(f"{api_url}/events/filter", json=body, timeout=10).json()["events"]


def _wait_for(check, timeout: float = 30.0, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def test_watch_flow_emits_each_new_tag_once(prefect_server: str, tmp_path) -> None:
    from flows.watch import EVENT, WatchState, watch_latest

    runs = tmp_path / "runs"
    for name, tag in (("a", "global_step1"), ("b", "global_step5")):
        (runs / name).mkdir(parents=True)
        (runs / name / "latest").write_text(tag)
    (runs / "bad").mkdir()
    (runs / "bad" / "latest").write_text("no/such/../tag")
    state = f"test-{uuid.uuid4().hex[:8]}"

    first = watch_latest(roots=[str(runs)], state=state)
    assert sorted((e["root"], e["tag"]) for e in first["emitted"]) == [
        (f"{runs}/a", "global_step1"), (f"{runs}/b", "global_step5")]
    assert [u["where"] for u in first["unreadable"]] == [f"{runs}/bad"]

    assert watch_latest(roots=[str(runs)], state=state)["emitted"] == []

    until_the_clock_passes(str(runs / "a" / "latest"), str(tmp_path / "clock-probe"))
    (runs / "a" / "latest").write_text("global_step2")
    third = watch_latest(roots=[str(runs)], state=state)
    assert [(e["root"], e["tag"]) for e in third["emitted"]] == [(f"{runs}/a", "global_step2")]

    # The record survives in a Prefect block; the events reached the server with their payloads.
    assert set(WatchState.load(state).seen[f"{runs}/a"]["tags"]) == {"global_step1", "global_step2"}
    stored = _wait_for(lambda: len(found := _events(prefect_server, str(runs))) >= 3 and found)
    assert sorted((e["payload"]["source"], e["payload"]["tag"]) for e in stored) == [
        (f"{runs}/a", "global_step1"), (f"{runs}/a", "global_step2"), (f"{runs}/b", "global_step5")]
    assert {e["event"] for e in stored} == {EVENT}


def test_baseline_records_without_emitting(prefect_server: str, tmp_path) -> None:
    from flows.watch import watch_latest

    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "latest").write_text("global_step9")
    state = f"test-{uuid.uuid4().hex[:8]}"
    result = watch_latest(roots=[str(tmp_path)], state=state, baseline=True)
    assert result["emitted"] == [] and [r["tag"] for r in result["recorded"]] == ["global_step9"]
    assert watch_latest(roots=[str(tmp_path)], state=state)["emitted"] == []


def test_watch_runs_are_named_by_their_roots_and_keep_their_own_artifacts(prefect_server: str, tmp_path) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, FlowRunFilter, FlowRunFilterId

    from flows.watch import watch_latest

    (tmp_path / "runs" / "r").mkdir(parents=True)
    (tmp_path / "runs" / "r" / "latest").write_text("global_step9")
    (tmp_path / "runs" / "r" / "global_step9").mkdir()
    (tmp_path / "more").mkdir()
    state = f"test-{uuid.uuid4().hex[:8]}"
    run = watch_latest(roots=[str(tmp_path / "runs"), str(tmp_path / "more")], state=state, return_state=True)
    assert run.is_completed(), run.message
    run_id = run.state_details.flow_run_id
    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(run_id)
        # task runs reach the server as events, recorded a moment later (the name comes with the run's start)
        names = _wait_for(lambda: [t.name for t in client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])))] == ["scan runs, more for latest"])
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])))
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run_id])))
    assert flow_run.name == f"watch runs, more ({state})"
    assert names, [t.name for t in tasks]
    assert [a.key for a in artifacts] == [f"watch-{state}-new-checkpoints"]


def test_a_root_that_cannot_be_listed_fails_the_run_after_the_others(prefect_server: str, tmp_path) -> None:
    from flows.watch import WatchState, watch_latest

    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "latest").write_text("global_step1")
    state = f"test-{uuid.uuid4().hex[:8]}"
    run = watch_latest(roots=[str(tmp_path), str(tmp_path / "gone")], state=state, return_state=True)
    assert run.is_failed()
    assert f"{tmp_path / 'gone'} does not exist" in run.message
    assert list(WatchState.load(state).seen) == [f"{tmp_path}/r"]  # the good root was still handled


def test_trigger_starts_one_lifecycle_run_per_new_checkpoint(prefect_server: str, deployed, gcs) -> None:
    """A new `latest` in the bucket -> the watcher's event -> a run of the on-checkpoint deployment."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    from flows.watch import watch_latest

    run_root = f"{gcs.url}/runs/llama"
    put(f"{run_root}/global_step40/zero_pp_rank_0_mp_rank_00_model_states.pt", b"x")
    put(f"{run_root}/latest", b"global_step40")
    state = f"test-{uuid.uuid4().hex[:8]}"

    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("checkpoint-lifecycle/on-checkpoint")

        def runs():
            return client.read_flow_runs(
                deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id]))
            )

        before = {r.id for r in runs()}
        emitted = watch_latest(roots=[f"{gcs.url}/runs"], state=state)["emitted"]
        assert [(e["root"], e["tag"]) for e in emitted] == [(run_root, "global_step40")]

        def mine(root: str = run_root):  # other tests' events may still be turning into runs of the same deployment
            return [r for r in runs() if r.id not in before and r.parameters.get("source") == root]

        def settled() -> None:
            """Wait until the events sent so far have made their runs: announce one more checkpoint, under
            a root of its own, and wait for its run, which the trigger makes after theirs."""
            marker = f"{gcs.url}/settle-{uuid.uuid4().hex[:8]}/run"
            put(f"{marker}/global_step1/zero_pp_rank_0_mp_rank_00_model_states.pt", b"x")
            put(f"{marker}/latest", b"global_step1")
            assert watch_latest(roots=[marker.rsplit("/", 1)[0]], state=f"{state}-settle")["emitted"]
            (sentinel,) = _wait_for(lambda: mine(marker), timeout=120)
            client.delete_flow_run(sentinel.id)

        assert _wait_for(mine, timeout=120)
        settled()
        created = mine()
        assert len(created) == 1, "the trigger did not create exactly one lifecycle run"
        (run,) = created
        assert run.parameters["source"] == run_root
        assert run.parameters["tag"] == "global_step40"
        # Everything else comes from the deployment's defaults in infra/prefect.yaml.
        assert run.parameters["consolidation"]["dtype"] == "bf16"

        # Running the watcher again announces nothing, and no second run appears.
        assert watch_latest(roots=[f"{gcs.url}/runs"], state=state)["emitted"] == []
        settled()
        assert [r.id for r in mine()] == [run.id]
        client.delete_flow_run(run.id)  # nobody works the pool in tests; keep the server tidy
