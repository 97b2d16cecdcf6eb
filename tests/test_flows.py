"""The lifecycle flow on a real DeepSpeed checkpoint in the GCS emulator, under a Prefect server.

One full run (validate, consolidate + verify, reshard to 1 and 4 ranks, publish back to the bucket)
is shared by the end-to-end and idempotence tests; the retry tests reuse its cached builds and only
publish, through the fault-injecting proxies in front of the emulators. The task-level tests at the
top call `task.fn` without a server.
"""

from __future__ import annotations

import json
import re
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import fsspec
import pytest

from ckptflow.errors import CheckpointError, PublishError
from ckptflow.reshard.shape import Target
from tasks.validate import validate_checkpoint

# ---- tasks without a server -------------------------------------------------------------------------


@pytest.fixture
def incomplete_copy(llama_bf16_ckpt, tmp_path: Path) -> tuple[Path, Path, Path]:
    """A copy of the tiny Llama checkpoint whose rank-1 optimizer file has not arrived yet."""
    src = Path(llama_bf16_ckpt.dir)
    run = tmp_path / "run"
    shutil.copytree(src, run)
    late = run / llama_bf16_ckpt.tag / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    held = tmp_path / "held.pt"
    late.rename(held)
    return run, late, held


def test_validation_waits_for_rank_files_still_arriving(incomplete_copy) -> None:
    from prefect.logging import disable_run_logger

    run, late, held = incomplete_copy
    threading.Timer(1.0, lambda: shutil.move(held, late)).start()
    started = time.monotonic()
    with disable_run_logger():
        checkpoint = validate_checkpoint.fn(str(run), settle_seconds=30, poll_seconds=0.25)
    # It waited for the file (moved in after 1 s) and returned once it arrived, before the settle time ran out.
    assert 1.0 <= time.monotonic() - started < 30
    assert (checkpoint.tag, checkpoint.world_size, checkpoint.stage) == ("global_step3", 2, 3)
    assert checkpoint.root == str(run) and len(checkpoint.identity) == 20


def test_validation_fails_after_the_settle_time(incomplete_copy) -> None:
    from prefect.logging import disable_run_logger

    run, _, _ = incomplete_copy
    with disable_run_logger(), pytest.raises(CheckpointError) as caught:
        validate_checkpoint.fn(str(run), settle_seconds=1, poll_seconds=0.25)
    message = str(caught.value)
    assert f"{run}/global_step3 is not a valid checkpoint after waiting 1 s for files to arrive" in message
    assert "rank-missing: rank 1 of 2 is missing" in message


def test_validation_does_not_wait_for_problems_time_cannot_fix(incomplete_copy) -> None:
    from prefect.logging import disable_run_logger

    run, late, held = incomplete_copy
    late.write_bytes(held.read_bytes()[:100])  # truncated: no upload in progress makes this right
    started = time.monotonic()
    with disable_run_logger(), pytest.raises(CheckpointError, match="corrupt-file"):
        validate_checkpoint.fn(str(run), settle_seconds=30, poll_seconds=0.25)
    assert time.monotonic() - started < 30  # refused without waiting out the settle time


def test_retry_condition_is_a_plain_function_that_retries_only_transient_errors() -> None:
    import inspect

    from prefect.states import Failed

    from tasks.publish import publish_output
    from tasks.retries import retry_if_transient

    class HttpError(Exception):
        def __init__(self, code: int) -> None:
            super().__init__(f"HTTP {code}")
            self.code = code

    assert inspect.isfunction(retry_if_transient)
    assert publish_output.retry_condition_fn is retry_if_transient and publish_output.retries == 4
    assert publish_output.retry_jitter_factor == 0.5
    assert retry_if_transient(None, None, Failed(data=HttpError(503)))
    assert retry_if_transient(None, None, Failed(data=ConnectionResetError("reset by peer")))
    assert not retry_if_transient(None, None, Failed(data=HttpError(403)))
    assert not retry_if_transient(None, None, Failed(data=PublishError("gs://b/x: 403 Forbidden")))
    assert not retry_if_transient(None, None, Failed(data=ValueError("bad input")))


def test_cache_key_is_source_tag_identity_and_options() -> None:
    from types import SimpleNamespace

    from tasks.caching import checkpoint_cache_key
    from tasks.models import Checkpoint

    def ckpt(identity: str, **extra: Any) -> Checkpoint:
        return Checkpoint(source="gs://b/run", root="gs://b/run", tag="global_step3", identity=identity, stage=3,
                          world_size=2, precision="bf16", **extra)

    ctx = SimpleNamespace(task=SimpleNamespace(name="consolidate"))

    def key(**params: Any) -> str:
        return checkpoint_cache_key(ctx, {"out": "gs://b/work/model", "dtype": "bf16", **params})

    base = key(checkpoint=ckpt("aaa"))
    assert key(checkpoint=ckpt("aaa", summary={"seen": "again"}, step=3)) == base  # same files, same key
    assert key(checkpoint=ckpt("bbb")) != base  # files rewritten
    assert key(checkpoint=ckpt("aaa"), dtype="fp32") != base  # other options
    other_task = SimpleNamespace(task=SimpleNamespace(name="reshard"))
    assert checkpoint_cache_key(other_task, {"out": "gs://b/work/model", "dtype": "bf16",
                                             "checkpoint": ckpt("aaa")}) != base
    # An option added later keeps the keys of results cached before it while at its default.
    assert key(checkpoint=ckpt("aaa"), tensor_parallel=None) == base
    assert key(checkpoint=ckpt("aaa"), tensor_parallel=1) != base


# ---- the flow against a server and the emulators ----------------------------------------------------

RESHARD_TO = [1, 4]


@pytest.fixture(scope="module")
def bucket_run(gcs_server, llama_trainer_ckpt, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The Trainer-written tiny Llama (ZeRO-3, 2 ranks) uploaded to a fresh prefix of the emulator.

    The workspace is a local folder: outputs are moved into place by rename there, where the
    emulator lacks the `moveTo` call gcsfs tries first (and retries for half a minute per file).
    """
    from tests.servers.stores import GCS_BUCKET

    base = f"gs://{GCS_BUCKET}/flows-{uuid.uuid4().hex[:10]}"
    fs = fsspec.filesystem("gs")
    fs.put(str(llama_trainer_ckpt.dir) + "/", f"{base}/runs/llama/", recursive=True)
    fs.invalidate_cache()
    work = tmp_path_factory.mktemp("workspace")
    return {"base": base, "source": f"{base}/runs/llama", "tag": llama_trainer_ckpt.tag, "workspace": str(work)}


def lifecycle_parameters(bucket_run: dict[str, str], destinations: list[dict[str, str]]) -> dict[str, Any]:
    return {
        "source": bucket_run["source"],
        "consolidation": {"dtype": "bf16", "max_shard_size": "100KB"},
        "reshard": {"world_sizes": RESHARD_TO},
        "destinations": destinations,
        "workspace": bucket_run["workspace"],
        "validation": {"settle_seconds": 0},
    }


def run_lifecycle(parameters: dict[str, Any]) -> Any:
    """The run's final state and its value, in memory (`flows.commands.run_here`, as `ckptflow run` does)."""
    from flows.commands import run_here
    from flows.lifecycle import checkpoint_lifecycle

    return run_here(checkpoint_lifecycle, parameters)


def task_runs(flow_run_id: Any) -> list[Any]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        return client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])), limit=200)


@pytest.fixture(scope="module")
def first_run(prefect_server: str, bucket_run: dict[str, str]) -> dict[str, Any]:
    published = f"{bucket_run['base']}/published"
    params = lifecycle_parameters(bucket_run, [{"uri": published, "what": "both"}])
    started = time.monotonic()
    ran = run_lifecycle(params)
    return {"params": params, "state": ran.state, "value": ran.value, "seconds": time.monotonic() - started,
            "published": published}


def test_lifecycle_end_to_end_from_and_to_the_bucket(
    first_run: dict[str, Any], bucket_run: dict[str, str], tmp_path: Path
) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
    from safetensors import safe_open

    from ckptflow.validate import validate

    state = first_run["state"]
    assert state.is_completed(), state.message
    summary = first_run["value"]
    tag = bucket_run["tag"]
    assert summary["failures"] == []
    assert summary["checkpoint"]["root"] == bucket_run["source"] and summary["checkpoint"]["tag"] == tag
    assert summary["verification"]["ok"] and summary["verification"]["tensors_compared"] > 0
    assert summary["verification"]["logits_shape"][0] == 1
    assert sorted(summary["reshards"]) == ["1", "4"]
    assert len(summary["published"]) == 3

    fs = fsspec.filesystem("gs")
    fs.invalidate_cache()
    dest = first_run["published"]
    model = f"{dest}/{tag}/model"
    names = {p.rsplit("/", 1)[-1] for p in fs.ls(model)}
    assert {"config.json", "model.safetensors.index.json", "tokenizer.json", "ckptflow-manifest.json"} <= names
    shard = sorted(n for n in names if n.endswith(".safetensors"))[0]
    local = tmp_path / shard
    fs.get(f"{model}/{shard}", str(local))
    with safe_open(str(local), "pt") as f:
        assert {str(f.get_slice(k).get_dtype()) for k in f.keys()} == {"BF16"}
    for n in RESHARD_TO:
        report = validate(f"{dest}/{tag}/zero-ws{n}")
        assert report.ok, report.problems
        assert report.index.world_size == n and report.index.tag == tag

    run_id = state.state_details.flow_run_id
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run_id])))
    by_type: dict[str, list[Any]] = {}
    for a in artifacts:
        by_type.setdefault(a.type, []).append(a)
    from tasks.artifacts import checkpoint_key

    source = bucket_run["source"]
    keys = {a.key for a in artifacts if a.key}
    validation_key = checkpoint_key("validation", source, tag)
    assert validation_key.startswith("validation-llama-") and validation_key.endswith("-global-step3")
    # One artifact per step and output, every key naming the source (name and digest) and the tag.
    stem = validation_key[len("validation-"):]
    assert sorted(a.key or "" for a in artifacts) == sorted([
        validation_key, checkpoint_key("verification", source, tag), checkpoint_key("summary", source, tag),
        checkpoint_key("consolidation", source, tag, "bf16"),
        *(checkpoint_key("reshard", source, tag, f"ws{n}") for n in RESHARD_TO),
        *(a.key for a in artifacts if (a.key or "").startswith(f"published-{stem}-")),
    ]), "no unkeyed artifact, no near-duplicate key"
    assert all(k.split("-", 1)[1].startswith(stem) for k in keys)
    assert "progress" not in by_type, "steps under PROGRESS_BYTES show no bar, and bars never outlive their step"
    model_md = next(a for a in artifacts if a.key == checkpoint_key("consolidation", source, tag, "bf16")).data
    table_rows = [line for line in model_md.splitlines() if line.startswith("| `")]
    model_files = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(model) if not p.endswith("ckptflow-manifest.json"))
    assert sorted(re.findall(r"^\| `([^`]+)`", "\n".join(table_rows), re.M)) == model_files
    assert f": {len(model_files)} files, " in model_md and model_md.count("| file |") == 1
    reshard_md = next(a for a in artifacts if a.key == checkpoint_key("reshard", source, tag, "ws4")).data
    assert r"Trainer RNG files: rng\_state\_0..3.pth from source ranks 0, 1, 0, 1 (rank r takes r mod 2)." in reshard_md
    assert len([line for line in reshard_md.splitlines() if re.match(r"^\| \d \|", line)]) == 4
    summary_md = next(a for a in by_type["markdown"] if a.key == checkpoint_key("summary", source, tag))
    assert summary_md.data.startswith(f"# llama@{tag}\n")
    assert "## Published" in summary_md.data and f"{dest}/{tag}/zero-ws4" in summary_md.data
    assert "| loads as | LlamaForCausalLM |" in summary_md.data and "```json" not in summary_md.data
    assert f"[`{dest}/{tag}/model`](https://console.cloud.google.com/storage/browser/" in summary_md.data
    published = [a for a in by_type["markdown"] if a.key and a.key.startswith("published-llama-")]
    assert len(published) == 3 and len({a.key for a in published}) == 3
    published_files = next(a for a in published if "-model-" in a.key).data
    manifest = json.loads(fs.cat_file(f"{model}/ckptflow-manifest.json"))
    for entry in manifest["files"]:
        assert f"| `{entry['path']}` |" in published_files and f"`{entry['sha256']}`" in published_files
    validation = next(a for a in by_type["table"] if a.key == validation_key)
    rows = json.loads(validation.data) if isinstance(validation.data, str) else validation.data
    assert {tuple(r) for r in rows} == {("field", "value")}, "the validation table is two columns wide"
    assert len(rows) < 10, "all on the UI's first page of ten rows"
    assert {"field": "layout", "value": "ZeRO-3, 2 rank(s), fp32"} in rows

    from prefect.client.orchestration import get_client as _client

    with _client(sync_client=True) as client:
        run = client.read_flow_run(run_id)
    assert run.name == f"llama@{tag}"
    names = sorted(r.name for r in task_runs(run_id))
    assert len(names) == len(set(names)), f"task run names are unique: {names}"
    bucket = bucket_run["base"].split("/")[2]
    shards = len([f for f in model_files if f.endswith(".safetensors")])
    assert shards > 1
    assert names == sorted([
        "validate llama@latest", f"consolidate {tag} bf16", f"verify {tag} model",
        *(f"write shard {i}/{shards}" for i in range(1, shards + 1)),
        f"reshard {tag} to 1 rank", f"reshard {tag} to 4 ranks",
        *(f"write rank {r}/{n} (ws{n})" for n in RESHARD_TO for r in range(n)),
        f"publish model to gs://{bucket}", f"publish zero-ws1 to gs://{bucket}", f"publish zero-ws4 to gs://{bucket}",
    ])


def _progress_artifacts(flow_run_id: Any) -> list[Any]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterType

    with get_client(sync_client=True) as client:
        return client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]), type=ArtifactFilterType(any_=["progress"])))


def test_a_progress_bar_lives_only_while_its_step_runs(prefect_server: str) -> None:
    """Against the server: a long step's bar is made at 0%, moves, and is deleted when the step ends,
    whether it succeeded or failed; a short step (under PROGRESS_BYTES) gets none; no key is needed."""
    from prefect import flow, task
    from prefect.runtime import flow_run

    from tasks.artifacts import PROGRESS_BYTES, ProgressArtifact

    seen: dict[str, list[Any]] = {}

    @task
    def step(name: str, nbytes: int, fail: bool) -> None:
        with ProgressArtifact(nbytes=nbytes, description=f"copying {name}") as bar:
            seen[name] = [[a.data for a in _progress_artifacts(flow_run.id)]]
            bar(1, 4)
            seen[name].append([a.data for a in _progress_artifacts(flow_run.id)])
            bar(4, 4)
            seen[name].append([(a.data, a.key, a.description) for a in _progress_artifacts(flow_run.id)])
            if fail:
                raise ValueError("the copy failed")

    @flow
    def steps() -> Any:
        step("long", PROGRESS_BYTES, False)
        step("short", PROGRESS_BYTES - 1, False)
        failed = step("failing", 2 * PROGRESS_BYTES, True, return_state=True)
        return flow_run.id, failed

    run_id, failed = steps()
    assert failed.is_failed()
    assert seen["long"] == [[0.0], [25.0], [(100.0, None, "copying long")]]
    assert seen["short"] == [[], [], []]
    assert seen["failing"][-1] == [(100.0, None, "copying failing")]
    assert _progress_artifacts(run_id) == []


def test_the_steps_bars_are_gone_when_they_end(prefect_server: str, llama_bf16_ckpt, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Consolidate, reshard and publish as they run in a flow, every step counted as long: each makes a
    bar, and none is left when the run ends."""
    from prefect import flow

    import tasks.artifacts
    from tasks.consolidate import consolidate_model
    from tasks.models import Output
    from tasks.publish import publish_output
    from tasks.reshard import reshard_checkpoint

    made: list[Any] = []
    create = tasks.artifacts.create_progress_artifact

    def recording_create(**kwargs: Any) -> Any:
        made.append(create(**kwargs))
        return made[-1]

    monkeypatch.setattr(tasks.artifacts, "PROGRESS_BYTES", 0)
    monkeypatch.setattr(tasks.artifacts, "create_progress_artifact", recording_create)

    @flow
    def build(source: str, work: str) -> Any:
        from prefect.runtime import flow_run

        checkpoint = validate_checkpoint(source, settle_seconds=0)
        model = consolidate_model(checkpoint, f"{work}/model", dtype="bf16", max_shard_size="100KB")
        reshard_checkpoint(checkpoint, f"{work}/ws3", 3)
        publish_output(checkpoint, model, f"{work}/published")
        assert isinstance(model, Output)
        return flow_run.id

    run_id = build(str(llama_bf16_ckpt.dir), str(tmp_path / "work"))
    assert len(made) == 3
    assert _progress_artifacts(run_id) == []


# The form's reshard fields, each through the task: (fixture set, fixture, the form's Reshard fields, the
# folder the shape names, the task run's name). Each target's output is loaded natively by DeepSpeed in
# test_model_parallel_reshard, test_reshard, test_expert_parallel and test_pipeline_reshard.
TASK_SHAPES = [
    ("parallel_fixtures", "autotp-tp2-z1-fp32", {"world_sizes": [2], "merge_tensor_parallel": True}, "zero-ws2-tp1",
     "reshard global_step3 to 2 ranks, tp 1"),
    ("ds_fixtures", "z2-fp32-ws2", {"world_sizes": [3], "zero_stage": "3"}, "zero-ws3-z3",
     "reshard global_step3 to 3 ranks, ZeRO-3"),
    ("parallel_fixtures", "dsmoe-ep2-z2-fp32", {"world_sizes": [4], "expert_parallel_degree": 4}, "zero-ws4-ep4",
     "reshard global_step3 to 4 ranks, ep 4"),
    ("parallel_fixtures", "pipe-pp2-z1-fp32", {"world_sizes": [4], "pipeline_parallel_degree": 4,
                                               "partition_method": "uniform"}, "zero-ws4-pp4-uniform",
     "reshard global_step3 to 4 ranks, pp 4"),
]


@pytest.mark.parametrize(("fixtures", "name", "form", "folder", "run_name"), TASK_SHAPES,
                         ids=[case[3] for case in TASK_SHAPES])
def test_the_reshard_task_writes_the_form_s_shape(prefect_server: str, request: pytest.FixtureRequest, tmp_path: Path,
                                                  fixtures: str, name: str, form: dict[str, Any], folder: str,
                                                  run_name: str) -> None:
    """The form's Reshard fields reach the core: the task writes, into the folder its shape names, the same
    bytes as `ckptflow reshard` to that shape, and its run and summary name the shape."""
    from prefect import flow

    from ckptflow.reshard import reshard
    from flows import paths
    from flows.params import ReshardForm
    from tasks.reshard import reshard_checkpoint

    [target] = ReshardForm(**form).targets()
    out = paths.reshard_folder(str(tmp_path), target)
    assert out.endswith(f"/{folder}")
    src = request.getfixturevalue(fixtures)[name]

    @flow
    def build(source: str) -> Any:
        from prefect.runtime import flow_run

        checkpoint = validate_checkpoint(source, settle_seconds=0)
        return reshard_checkpoint(checkpoint, out, target.world_size, tensor_parallel=target.tp, stage=target.stage,
                                  pipeline_parallel=target.pp, expert_parallel=target.ep,
                                  partition_method=target.partition_method,
                                  pipeline_layers=target.pipeline_layers), flow_run.id

    output, run_id = build(str(src.dir))
    cli = reshard(str(src.dir), str(tmp_path / "cli"), world_size=target.world_size, stage=target.stage, tp=target.tp,
                  pp=target.pp, ep=target.ep, partition_method=target.partition_method,
                  pipeline_layers=target.pipeline_layers)
    assert output.details["shape"] == str(cli.shape) and output.world_size == target.world_size
    ours = {p.relative_to(out): p.read_bytes() for p in Path(out).rglob("*") if p.is_file()}
    theirs = {p.relative_to(tmp_path / "cli"): p.read_bytes() for p in (tmp_path / "cli").rglob("*") if p.is_file()}
    assert ours.keys() == theirs.keys() and ours == theirs
    assert [r.name for r in task_runs(run_id) if r.name.startswith("reshard")] == [run_name]


def test_the_form_names_each_target_by_its_shape() -> None:
    """A target is a shape: folder and Hub branch say every degree that changes, in one order."""
    from flows import paths
    from flows.params import Destination, ReshardForm

    options = ReshardForm(world_sizes=[8, 4], zero_stage="3", tensor_parallel_degree=2,
                             pipeline_parallel_degree=1, expert_parallel_degree=4)
    assert options.targets() == [Target(world_size=4, stage=3, tp=2, pp=1, ep=4),
                                 Target(world_size=8, stage=3, tp=2, pp=1, ep=4)]
    assert [paths.reshard_name(t) for t in options.targets()] == ["zero-ws4-tp2-pp1-ep4-z3", "zero-ws8-tp2-pp1-ep4-z3"]
    assert [paths.reshard_name(t) for t in ReshardForm(world_sizes=[2]).targets()] == ["zero-ws2"]
    hub = Destination(uri="hf://org/model", revision="run-7")
    branch = paths.reshard_destination(hub, "global_step3", Target(world_size=2, ep=1))
    assert branch == ("hf://org/model", "run-7-zero-ws2-ep1")
    merged = ReshardForm(world_sizes=[2], merge_tensor_parallel=True)
    assert merged.tensor_parallel == 1 and ReshardForm(world_sizes=[2]).tensor_parallel is None
    assert ReshardForm(world_sizes=[2], tensor_parallel_degree=1).targets() == merged.targets()
    assert ReshardForm(world_sizes=[3]).stage is None
    pipeline = ReshardForm(world_sizes=[4], pipeline_parallel_degree=4, partition_method="uniform", pipeline_layers=6)
    assert pipeline.targets() == [Target(world_size=4, pp=4, partition_method="uniform", pipeline_layers=6)]
    assert paths.reshard_name(pipeline.targets()[0]) == "zero-ws4-pp4-uniform-L6"
    assert paths.reshard_name(Target(world_size=2, pp=2, partition_method="type:transformer")) == \
        "zero-ws2-pp2-type-transformer"
    odd = paths.reshard_name(Target(world_size=2, pp=2, partition_method="type:../../[Tt]ransformer|Block"))
    assert re.fullmatch(r"zero-ws2-pp2-method-[0-9a-f]{8}", odd), odd  # one path part, one git ref part
    # a choice along an axis that does not change changes no byte, and names nothing
    assert paths.reshard_name(Target(world_size=2, partition_method="uniform", qkv_layout="blocks")) == "zero-ws2"
    for bad in ("../../escaped", "type:", "type:(", "x" * 300):
        with pytest.raises(ValueError, match="partition method"):
            Target(world_size=2, pp=2, partition_method=bad)
        with pytest.raises(ValueError, match="partition[ _]method"):
            ReshardForm(world_sizes=[2], pipeline_parallel_degree=2, partition_method=bad)
    # empty is the run's own method (a Megatron-DeepSpeed GPT's type:transformer); "parameters" is asked for
    assert ReshardForm(world_sizes=[4], pipeline_parallel_degree=2).targets() == [Target(world_size=4, pp=2)]
    assert ReshardForm(world_sizes=[4], pipeline_parallel_degree=2, partition_method="parameters").targets() == [
        Target(world_size=4, pp=2, partition_method="parameters")]
    assert ReshardForm(world_sizes=[4], pipeline_parallel_degree=4).targets() == [Target(world_size=4, pp=4)]
    declared = ReshardForm(world_sizes=[2], tensor_parallel_degree=1, qkv_layout="blocks").targets()
    assert declared == [Target(world_size=2, tp=1, qkv_layout="blocks")]
    assert paths.reshard_name(declared[0]) == "zero-ws2-tp1-qkv-blocks"  # never the "groups" reshard's folder
    assert paths.reshard_name(Target(world_size=2, tp=1, qkv_layout="groups")) == "zero-ws2-tp1-qkv-groups"
    assert ReshardForm(world_sizes=[2], tensor_parallel_degree=1).targets() == [Target(world_size=2, tp=1)]
    with pytest.raises(ValueError, match="merge_tensor_parallel asks for tensor-parallel degree 1, but "
                                         "tensor_parallel_degree is 2"):
        ReshardForm(world_sizes=[2], merge_tensor_parallel=True, tensor_parallel_degree=2)


def test_same_checkpoint_twice_does_the_work_once(first_run: dict[str, Any]) -> None:
    fs = fsspec.filesystem("gs")
    fs.invalidate_cache()
    before = {p: i.get("generation") for p, i in fs.find(first_run["published"], detail=True).items()}

    ran = run_lifecycle(first_run["params"])
    state = ran.state

    assert state.is_completed(), state.message
    runs = task_runs(state.state_details.flow_run_id)
    by_name: dict[str, list[str]] = {}
    for r in runs:
        by_name.setdefault(r.task_key.rsplit("-", 1)[0], []).append(r.state.name)
    assert by_name["consolidate_model"] == ["Cached"]
    assert by_name["verify_output"] == ["Cached"]
    assert by_name["reshard_checkpoint"] == ["Cached", "Cached"]
    assert by_name["publish_output"] == ["Cached"] * 3
    assert "write_shard" not in by_name and "write_rank" not in by_name  # no unit ran again
    fs.invalidate_cache()
    assert {p: i.get("generation") for p, i in fs.find(first_run["published"], detail=True).items()} == before
    assert ran.value["published"] == first_run["value"]["published"]


def test_steps_whose_cached_results_are_gone_take_the_folders_they_built(first_run: dict[str, Any],
                                                                          bucket_run: dict[str, str],
                                                                          tmp_path: Path) -> None:
    """The result store is gone (a worker on another machine, a cleared store) but the workspace is not:
    the build steps run again, find the folders they committed and take them as they are (no unit runs,
    no file is rewritten), and the run ends as the first one did. It used to fail with "already exists"."""
    from prefect.settings import PREFECT_LOCAL_STORAGE_PATH, temporary_settings

    work = Path(bucket_run["workspace"])
    stamps = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in work.rglob("*")}
    with temporary_settings({PREFECT_LOCAL_STORAGE_PATH: tmp_path / "results"}):
        ran = run_lifecycle(first_run["params"])
    state = ran.state
    assert state.is_completed(), state.message
    by_name: dict[str, list[str]] = {}
    for r in task_runs(state.state_details.flow_run_id):
        by_name.setdefault(r.task_key.rsplit("-", 1)[0], []).append(r.state.name)
    assert by_name["consolidate_model"] == ["Completed"]
    assert by_name["reshard_checkpoint"] == ["Completed", "Completed"]
    assert "write_shard" not in by_name and "write_rank" not in by_name
    assert {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in work.rglob("*")} == stamps
    for key in ("model", "reshards", "failures"):
        assert ran.value[key] == first_run["value"][key], key
    pushed = [(p["destination"], p["details"]["uploaded"], p["details"]["skipped"]) for p in ran.value["published"]]
    before = {p["destination"]: p["files"] for p in first_run["value"]["published"]}
    assert pushed == [(where, 0, before[where]) for where, _, _ in pushed] and len(pushed) == 3  # all there already


def test_transient_publish_failures_are_retried(first_run: dict[str, Any], bucket_run: dict[str, str],
                                                gcs_server) -> None:
    proxy, _ = gcs_server
    token = f"pub{uuid.uuid4().hex[:8]}"
    dest = f"{bucket_run['base']}/{token}"
    params = lifecycle_parameters(bucket_run, [{"uri": dest, "what": "model"}])
    proxy.configure(rate=1.0, kinds=("503", "reset"), only_paths=(token,), max_faults=4, seed=1)
    try:
        ran = run_lifecycle(params)
    finally:
        faults = sum(proxy.faults.values())
        proxy.reset()

    assert faults == 4
    assert ran.state.is_completed(), ran.state.message
    fs = fsspec.filesystem("gs")
    fs.invalidate_cache()
    manifest = json.loads(fs.cat_file(f"{dest}/{bucket_run['tag']}/model/ckptflow-manifest.json"))
    assert len(manifest["files"]) == ran.value["published"][0]["files"]


def test_permanent_publish_failure_fails_the_flow_and_publishes_nothing(
    first_run: dict[str, Any], bucket_run: dict[str, str], s3
) -> None:
    params = lifecycle_parameters(bucket_run, [{"uri": s3.url, "what": "both"}])
    s3.proxy.configure(status=403)
    try:
        state = run_lifecycle(params).state
    finally:
        s3.proxy.reset()

    assert state.is_failed()
    message = state.message
    assert f"publishing model to {s3.url}/{bucket_run['tag']}/model failed" in message
    assert "403" in message or "denied" in message.lower() or "forbidden" in message.lower()
    fs = fsspec.filesystem("s3")
    fs.invalidate_cache()
    assert fs.find(s3.url) == []



def test_post_training_processes_the_newest_tag_of_each_run(first_run: dict[str, Any],
                                                            bucket_run: dict[str, str]) -> None:
    from flows.lifecycle import post_training

    params = {k: v for k, v in first_run["params"].items() if k not in ("source", "validation")}
    missing = f"{bucket_run['base']}/runs/never-saved"
    state = post_training(runs=[bucket_run["source"], missing], **params, return_state=True)

    assert state.is_failed()
    assert state.message.endswith(
        f"1 of 2 run(s) failed: {missing}: {missing} is not a valid checkpoint: source-missing: {missing} does not "
        "exist; check the path or URL"
    )


# ---- consolidation as a separate deployment (the GPU path), served by a local runner -----------------


@pytest.fixture(scope="module")
def gpu_deployment(prefect_server: str):
    """`consolidate-checkpoint/gpu-test`, served by a Prefect runner in this process (runs in subprocesses)."""
    import asyncio

    from prefect.runner import Runner

    from flows.consolidate import consolidate_checkpoint

    ready = threading.Event()
    holder: dict[str, Any] = {}

    async def serve() -> None:
        runner = Runner(name=f"gpu-test-{uuid.uuid4().hex[:6]}", query_seconds=1, pause_on_shutdown=False)
        await runner.aadd_flow(consolidate_checkpoint, name="gpu-test")
        holder["runner"], holder["loop"] = runner, asyncio.get_running_loop()
        ready.set()
        await runner.start()

    thread = threading.Thread(target=lambda: asyncio.run(serve()), daemon=True)
    thread.start()
    assert ready.wait(60), "the runner did not start"
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import DeploymentStatus

    deadline = time.monotonic() + 60  # READY once the runner has polled: a loaded machine takes a while
    with get_client(sync_client=True) as client:
        while client.read_deployment_by_name("consolidate-checkpoint/gpu-test").status != DeploymentStatus.READY:
            assert time.monotonic() < deadline, "the served deployment never became ready"
            time.sleep(0.5)
    yield "consolidate-checkpoint/gpu-test"
    asyncio.run_coroutine_threadsafe(holder["runner"].astop(), holder["loop"]).result(30)
    thread.join(30)


def test_consolidation_runs_as_a_deployment_and_its_failure_fails_the_parent(
    first_run: dict[str, Any], bucket_run: dict[str, str], gpu_deployment: str, tmp_path: Path
) -> None:
    from prefect.client.orchestration import get_client

    params = lifecycle_parameters(bucket_run, [])
    params.update(reshard={"world_sizes": []}, workspace=str(tmp_path / "work"),
                  consolidation={"dtype": "bf16", "max_shard_size": "100KB", "deployment": gpu_deployment})

    ran = run_lifecycle(params)

    assert ran.state.is_completed(), ran.state.message
    summary = ran.value
    assert summary["model"]["details"]["deployment"] == gpu_deployment
    assert summary["verification"]["ok"] and summary["verification"]["tensors_compared"] > 0
    child_id = summary["model"]["details"]["flow_run"]
    with get_client(sync_client=True) as client:
        child = client.read_flow_run(child_id)
        assert child.state.is_completed()
        assert child.idempotency_key.startswith(f"ckptflow:{bucket_run['source']}/{bucket_run['tag']}:")
        assert child.deployment_id is not None and child.parent_task_run_id is not None

    # The same model into a folder that is in the way: the child fails, and so does the parent, saying why.
    blocked = tmp_path / "blocked"
    params.update(workspace=str(blocked))
    target = Path(summary["model"]["uri"].replace(str(tmp_path / "work"), str(blocked)))
    target.mkdir(parents=True)
    (target / "someone-elses-file").write_text("x")
    failed = run_lifecycle(params).state
    assert failed.is_failed()
    assert f"consolidation deployment '{gpu_deployment}' run" in failed.message
    assert "ended Failed" in failed.message
    assert (f"{target} already exists and does not hold this output: it has no ckptflow_provenance.json"
            in failed.message)
    assert child.name == f"llama@{bucket_run['tag']} bf16"


def test_a_gpu_deployment_without_a_worker_fails_at_once(deployed, bucket_run: dict[str, str], tmp_path: Path) -> None:
    """`consolidate-checkpoint/gpu` of infra/prefect.yaml, on the `gpu` pool with no worker: the run fails
    before validating anything, naming the pool, instead of waiting for a child that never starts."""
    params = lifecycle_parameters(bucket_run, [])
    params.update(workspace=str(tmp_path / "work"), validation={"settle_seconds": 300},
                  consolidation={"deployment": "consolidate-checkpoint/gpu"})
    started = time.monotonic()
    state = run_lifecycle(params).state
    assert state.is_failed()
    assert time.monotonic() - started < 60
    assert (
        "consolidation deployment 'consolidate-checkpoint/gpu' runs on work pool 'gpu', which has no online worker "
        "(0 known, none online), so its run would wait there: start one (`prefect worker start --pool gpu`) or leave "
        "consolidation.deployment empty to consolidate in this run"
    ) in state.message
    assert not (tmp_path / "work").exists()


# ---- the command line over the flows -----------------------------------------------------------------


def test_cli_run_prints_what_was_produced_where(first_run: dict[str, Any], bucket_run: dict[str, str]) -> None:
    from typer.testing import CliRunner

    from ckptflow.cli import app

    result = CliRunner().invoke(app, [
        "run", bucket_run["source"], "--dtype", "bf16", "--max-shard-size", "100KB", "--reshard", "1,4",
        "--to", first_run["published"], "--workspace", bucket_run["workspace"], "--settle", "0",
    ])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith(f"done {bucket_run['source']}/{bucket_run['tag']}: model + 2 reshard(s) built, 3 "
                               "push(es)")
    assert any(line.startswith("  model:") and "/model-bf16-" in line for line in lines)
    assert sum(line.startswith("  published:") for line in lines) == 3
    assert any(line.startswith("  flow run:") and "http://127.0.0.1" in line for line in lines)


def test_cli_run_fails_with_one_clear_line(prefect_server: str, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from ckptflow.cli import app

    runner = CliRunner()
    bad = runner.invoke(app, ["run", str(tmp_path), "--reshard", "1,x"])
    flat = " ".join(re.sub(r"[│╭╮╰╯─]", " ", bad.output).split())
    assert bad.exit_code == 2 and "--reshard takes world sizes like 1,4; 'x' is not a positive integer" in flat

    missing = runner.invoke(app, ["run", str(tmp_path / "nowhere"), "--settle", "0"])
    assert missing.exit_code == 1
    assert f"error: {tmp_path / 'nowhere'} is not a valid checkpoint: source-missing:" in missing.output
    assert "Traceback" not in missing.output


def test_cli_watch_once(prefect_server: str, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from ckptflow.cli import app

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "latest").write_text("global_step7")
    state = f"cli-{uuid.uuid4().hex[:8]}"
    first = CliRunner().invoke(app, ["watch", str(tmp_path), "--once", "--state", state])
    assert first.exit_code == 0, first.output
    assert "1 checkpoint(s) under 1 root(s), 1 new" in first.output
    assert f"new: {tmp_path}/run @ global_step7" in first.output
    again = CliRunner().invoke(app, ["watch", str(tmp_path), "--once", "--state", state])
    assert again.exit_code == 0 and "1 checkpoint(s) under 1 root(s), 0 new" in again.output
    gone = CliRunner().invoke(app, ["watch", str(tmp_path / "gone"), "--once", "--state", state])
    assert gone.exit_code == 1 and f"{tmp_path / 'gone'} does not exist" in gone.output


def test_a_completed_run_whose_state_came_back_without_data_still_gives_its_value(
    prefect_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What made `ckptflow run` fail on a slow server: the client's retry of the final transition got the
    server's copy of the Completed state back, without the data, and `state.result()` raised MissingResult.
    The proposal is made to return that copy here; the CLI's runner still has the value and the run's name."""
    import prefect.flow_engine
    from prefect import flow
    from prefect.exceptions import MissingResult

    from flows.commands import FlowFailed, _outcome, run_here

    propose = prefect.flow_engine.propose_state_sync

    def without_data(client: Any, state: Any, **kwargs: Any) -> Any:
        accepted = propose(client, state, **kwargs)
        return accepted.model_copy(update={"data": None}) if accepted.is_completed() else accepted

    monkeypatch.setattr(prefect.flow_engine, "propose_state_sync", without_data)

    @flow(name="value-kept", flow_run_name="kept {n}")
    def value_kept(n: int) -> dict[str, int]:
        return {"n": n}

    with pytest.raises(MissingResult):  # the way the CLI read it before
        value_kept(n=1, return_state=True).result()
    outcome = _outcome(run_here(value_kept, {"n": 2}))
    assert outcome.result == {"n": 2} and outcome.flow_run_name == "kept 2"

    @flow(name="fails-with-a-reason")
    def fails() -> None:
        raise ValueError("the flow's own reason")

    with pytest.raises(FlowFailed, match="^the flow's own reason$") as failed:
        _outcome(run_here(fails, {}))
    assert failed.value.flow_run_id


# ---- the manual deployment as a user runs it: a process worker on this machine, only `source` given ---------


@pytest.fixture
def quiet_schedules(deployed):
    """The scheduled deployments paused (their runs would reach the worker below), resumed afterwards."""
    from prefect.client.orchestration import get_client

    names = ["post-training/post-training", "watch-latest/interval"]
    with get_client(sync_client=True) as client:
        ids = [client.read_deployment_by_name(n).id for n in names]
        for i in ids:
            client.pause_deployment(i)
    yield
    with get_client(sync_client=True) as client:
        for i in ids:
            client.resume_deployment(i)


def test_manual_deployment_with_only_source_completes_on_a_process_worker(
    prefect_server: str, deployed, quiet_schedules, llama_bf16_ckpt, tmp_path: Path
) -> None:
    """`checkpoint-lifecycle/manual` with nothing but `source`, run by `prefect worker start --pool cpu`
    started outside the checkout: the pull step finds the code, consolidation and verification run in
    the flow, outputs go to the worker's local workspace, the run ends Completed under its name."""
    import os
    import subprocess
    import sys

    from prefect.deployments import run_deployment

    source = tmp_path / "runs" / "llama"
    shutil.copytree(llama_bf16_ckpt.dir, source)
    env = dict(os.environ, PREFECT_API_URL=prefect_server, CKPTFLOW_WORKSPACE=str(tmp_path / "work"))
    env.pop("CKPTFLOW_CODE_DIR", None)
    log = (tmp_path / "worker.log").open("w")
    worker = subprocess.Popen(
        [sys.executable, "-m", "prefect", "worker", "start", "--pool", "cpu", "--type", "process"],
        cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        run = run_deployment("checkpoint-lifecycle/manual", parameters={"source": str(source)}, timeout=600)
    finally:  # a worker slow to stop under load (it finishes its poll first) is killed: the run is what is checked
        worker.terminate()
        try:
            worker.wait(60)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait(30)
    assert run.state.is_completed(), (f"{run.state.name}: {run.state.message}\n"
                                      f"{(tmp_path / 'worker.log').read_text()[-3000:]}")
    assert run.name == f"llama@{llama_bf16_ckpt.tag}"
    # the form's dtype left at its default: fp32, the one default of the core, the CLI and the form
    models = list((tmp_path / "work").glob("*/*/model-fp32-*/model*.safetensors"))
    assert models, "the model was built in the worker's local workspace"
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    with get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])))
    messages = [entry.message for entry in logs]
    assert any(m.startswith("pull step: running flows from ") for m in messages), messages[:10]
