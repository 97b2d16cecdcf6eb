"""Pushing folders to object stores: round trips, faults, crashes, idempotence, messages.

GCS and S3 are real servers on loopback (the gcp-storage-emulator through gcsfs, moto through s3fs),
each behind a fault-injecting proxy (tests/servers/faultproxy.py); see tests/servers/stores.py.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import fsspec
import pytest

from ckptflow.errors import CkptflowError, PublishError, UploadMismatchError
from ckptflow.plumbing.redaction import redact
from ckptflow.plumbing.retry import RetryPolicy, is_transient, retry_call
from ckptflow.publish import MANIFEST_NAME, PARTIAL_RECORD_NAME, Manifest, push
from ckptflow.publish import store as publish
from tests.servers.stores import AWS_SECRET, Store

FAST = RetryPolicy(attempts=8, base_delay=0.05, max_delay=0.5)
REPO_ROOT = Path(__file__).resolve().parents[1]


def make_folder(root: Path, sizes: dict[str, int], seed: int = 0) -> Path:
    rng = random.Random(seed)
    for rel, size in sizes.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rng.randbytes(size))
    return root


MODEL = {
    "config.json": 700,
    "model-00001-of-00002.safetensors": 900_000,
    "model-00002-of-00002.safetensors": 600_000,
    "model.safetensors.index.json": 2_000,
    "tokenizer/tokenizer.json": 50_000,
    "empty.txt": 0,
}


def dest_files(url: str) -> dict[str, bytes]:
    """Every object under `url` except the manifest and the partial record, by relative path."""
    fs, root = fsspec.core.url_to_fs(url)
    fs.invalidate_cache()
    out = {}
    for path in fs.find(root):
        rel = path[len(root.rstrip("/")) + 1:]
        if rel not in (MANIFEST_NAME, PARTIAL_RECORD_NAME):
            out[rel] = fs.cat_file(path)
    return out


def src_files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def read_manifest(url: str) -> Manifest | None:
    fs, root = fsspec.core.url_to_fs(url)
    fs.invalidate_cache()
    try:
        return Manifest.from_json(fs.cat_file(f"{root}/{MANIFEST_NAME}"), uri=url)
    except FileNotFoundError:
        return None


def assert_published(folder: Path, url: str) -> None:
    """Every byte at DEST equals SRC and the manifest lists each file with its size and sha256."""
    expected = src_files(folder)
    assert dest_files(url) == expected
    manifest = read_manifest(url)
    assert manifest is not None
    assert {e.path: (e.size, e.sha256) for e in manifest.files} == {
        rel: (len(data), hashlib.sha256(data).hexdigest()) for rel, data in expected.items()
    }
    fs, root = fsspec.core.url_to_fs(url)
    assert not fs.exists(f"{root}/{PARTIAL_RECORD_NAME}")


def uploads(store: Store) -> list[str]:
    """Paths of upload requests the store's proxy forwarded (GCS: POST /upload/..., S3: PUT), the push's
    lease left out (`publish.lease`: on S3 its key, on GCS the only create with `ifGenerationMatch=0`)."""
    return [p for m, p, fault in store.proxy.counters.log if fault is None and (m == "PUT" or "/upload/" in p)
            and m != "GET"
            and "ckptflow-push.lease" not in p and "ifGenerationMatch=0" not in p]


# Round trips.


@pytest.mark.parametrize("store_name", ["gcs", "s3"])
def test_round_trip(store_name: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    store: Store = request.getfixturevalue(store_name)
    folder = make_folder(tmp_path / "model", MODEL)
    seen: list[tuple[int, int]] = []

    result = push(str(folder), store.url, workers=4, progress=lambda done, total: seen.append((done, total)))

    assert_published(folder, store.url)
    assert AWS_SECRET.encode() not in fsspec.core.url_to_fs(store.url)[0].cat_file(result.manifest_uri)
    assert sorted(result.uploaded) == sorted(MODEL) and result.skipped == ()
    assert result.bytes_uploaded == sum(MODEL.values())
    assert result.manifest_uri == f"{store.url}/{MANIFEST_NAME}"
    assert seen[-1] == (sum(MODEL.values()), sum(MODEL.values())) and all(d <= t for d, t in seen)


def test_round_trip_local_and_memory(tmp_path: Path) -> None:
    folder = make_folder(tmp_path / "model", MODEL)
    for dest in (str(tmp_path / "out"), f"file://{tmp_path}/out2", "memory://bucket/published"):
        push(str(folder), dest)
        assert_published(folder, dest)


def test_chunked_uploads_round_trip(gcs: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(publish, "UPLOAD_BLOCK", 256 * 1024)  # resumable uploads in several chunks
    folder = make_folder(tmp_path / "model", {"big.bin": 1_300_000, "small.bin": 10})
    push(str(folder), gcs.url)
    assert_published(folder, gcs.url)


# Idempotence and re-publishing.


@pytest.mark.parametrize("store_name", ["gcs", "s3"])
def test_second_push_uploads_nothing(store_name: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    store: Store = request.getfixturevalue(store_name)
    folder = make_folder(tmp_path / "model", MODEL)
    push(str(folder), store.url)
    store.proxy.reset()

    result = push(str(folder), store.url)

    assert result.uploaded == () and sorted(result.skipped) == sorted(MODEL) and result.bytes_uploaded == 0
    assert uploads(store) == []
    assert_published(folder, store.url)


def test_second_push_to_local_folder_uploads_nothing(tmp_path: Path) -> None:
    folder = make_folder(tmp_path / "model", MODEL)
    push(str(folder), str(tmp_path / "out"))
    assert push(str(folder), str(tmp_path / "out")).uploaded == ()


def test_new_version_removes_the_manifest_first(gcs: Store, tmp_path: Path) -> None:
    v1 = make_folder(tmp_path / "v1", {"a.bin": 1000, "b.bin": 2000, "old.bin": 300})
    push(str(v1), gcs.url)
    v2 = make_folder(tmp_path / "v2", {"a.bin": 1000, "b.bin": 2500}, seed=1)
    (v2 / "a.bin").write_bytes((v1 / "a.bin").read_bytes())  # unchanged file

    # With one worker, the first uploads are the push's lease and the partial record (written before
    # the manifest is removed), the third one b.bin: refuse it and every later one.
    gcs.proxy.configure(status=403, only_paths=("/upload/",), spare_first=2)
    with pytest.raises(PublishError, match="could not upload b.bin"):
        push(str(v2), gcs.url, workers=1)
    assert read_manifest(gcs.url) is None, "a reader must not trust a mix of v1 and v2"

    gcs.proxy.reset()
    result = push(str(v2), gcs.url)
    assert result.uploaded == ("b.bin",) and result.skipped == ("a.bin",)
    assert_published(v2, gcs.url)  # old.bin, part of v1 only, is gone


def test_leftover_object_with_other_bytes_is_replaced(gcs: Store, tmp_path: Path) -> None:
    folder = make_folder(tmp_path / "model", {"a.bin": 5000, "b.bin": 5000})
    fs, root = fsspec.core.url_to_fs(gcs.url)
    fs.pipe_file(f"{root}/a.bin", b"x" * 5000)  # same size, other bytes: a failed run's leftover

    result = push(str(folder), gcs.url)

    assert sorted(result.uploaded) == ["a.bin", "b.bin"]
    assert_published(folder, gcs.url)


# Faults.


@pytest.mark.parametrize("store_name", ["gcs", "s3"])
def test_push_completes_through_faults(
    store_name: str, request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store: Store = request.getfixturevalue(store_name)
    monkeypatch.setattr(publish, "UPLOAD_BLOCK", 5 * 2**20 if store_name == "s3" else 256 * 1024)
    sizes = {f"shard-{i}.bin": 200_000 for i in range(4)} | {"big.bin": 5 * 2**20 + 700_000 if store_name == "s3"
                                                             else 900_000}
    folder = make_folder(tmp_path / "model", sizes)
    store.proxy.configure(rate=0.2, seed=1)

    push(str(folder), store.url, workers=4, retry=FAST)

    faults = store.proxy.faults
    store.proxy.reset()
    assert sum(faults.values()) >= 3 and {"503", "reset"} <= set(faults)
    assert_published(folder, store.url)


def test_truncated_responses_are_retried(gcs: Store, tmp_path: Path) -> None:
    folder = make_folder(tmp_path / "model", MODEL)
    push(str(folder), gcs.url)
    gcs.proxy.configure(rate=0.5, kinds=("truncate",), seed=3, max_faults=3)

    result = push(str(folder), gcs.url, retry=FAST)

    assert gcs.proxy.faults["truncate"] >= 1
    gcs.proxy.reset()
    assert result.uploaded == ()
    assert_published(folder, gcs.url)


def test_forbidden_fails_fast_without_retries(gcs: Store, tmp_path: Path) -> None:
    folder = make_folder(tmp_path / "model", MODEL)
    gcs.proxy.configure(status=403)

    with pytest.raises(PublishError) as caught:
        push(str(folder), gcs.url)

    assert gcs.proxy.requests == 1  # fast because nothing is retried: one request, no backoff
    message = str(caught.value)
    assert message.startswith(f"could not take the lease {gcs.url}/ckptflow-push.lease: OSError: Forbidden")
    assert message.endswith("; check the credentials fsspec uses for this URL and that they allow reading and writing "
                            "there")
    assert "\n" not in message


@pytest.mark.parametrize("store_name", ["gcs", "s3"])
def test_missing_bucket_fails_fast_without_retries(store_name: str, request: pytest.FixtureRequest,
                                                   tmp_path: Path) -> None:
    store: Store = request.getfixturevalue(store_name)
    folder = make_folder(tmp_path / "model", {"a.bin": 100, "b.bin": 100})
    scheme = {"gcs": "gs", "s3": "s3"}[store_name]
    url = f"{scheme}://no-such-bucket-ckptflow/run"

    with pytest.raises(PublishError) as caught:
        push(str(folder), url, workers=1)

    message = str(caught.value)
    assert message.startswith(f"could not take the lease {url}/ckptflow-push.lease: FileNotFoundError")
    assert message.endswith("; check that the bucket exists and the URL is right")
    log = store.proxy.counters.log
    assert len(log) == len(set(log)), "no request may be repeated"


def test_s3_forbidden_fails_fast_and_hides_the_secret(s3: Store, tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    folder = make_folder(tmp_path / "model", MODEL)
    s3.proxy.configure(status=403)

    with caplog.at_level(logging.DEBUG), pytest.raises(PublishError) as caught:
        push(str(folder), s3.url)

    assert "check the credentials" in str(caught.value)
    assert s3.proxy.requests == 1  # the listing, never retried
    assert AWS_SECRET not in str(caught.value) and AWS_SECRET not in caplog.text


def test_killed_push_leaves_no_manifest_and_rerun_finishes(gcs: Store, tmp_path: Path) -> None:
    sizes = {f"shard-{i:02d}.bin": 150_000 for i in range(16)}
    folder = make_folder(tmp_path / "model", sizes)
    gcs.proxy.configure(delay=0.05)  # slow enough to be caught mid-way
    code = (
        "import sys; from ckptflow.publish import push; "
        "push(sys.argv[1], sys.argv[2], workers=1)"
    )
    env = {**os.environ, **gcs.env, "PYTHONPATH": str(REPO_ROOT)}
    child = subprocess.Popen([sys.executable, "-c", code, str(folder), gcs.url], env=env, cwd=REPO_ROOT)
    fs, root = fsspec.core.url_to_fs(gcs.url)
    recorded: dict = {}
    try:
        deadline = time.monotonic() + 60
        while len(recorded) < 3 and time.monotonic() < deadline and child.poll() is None:
            time.sleep(0.2)
            try:
                recorded = json.loads(fs.cat_file(f"{root}/{PARTIAL_RECORD_NAME}"))["files"]
            except FileNotFoundError:
                pass
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    gcs.proxy.reset()
    assert 3 <= len(recorded) < len(sizes), "the child was not killed mid-way"
    assert read_manifest(gcs.url) is None

    result = push(str(folder), gcs.url)

    assert not set(result.uploaded) & set(recorded), "verified files must not be uploaded again"
    assert set(recorded) <= set(result.skipped)
    assert 0 < len(result.uploaded) < len(sizes)
    assert_published(folder, gcs.url)


# Errors a user reads.


def test_missing_source_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(CkptflowError, match=r"^SRC .*/nope does not exist; check the path or URL$"):
        push(str(tmp_path / "nope"), "memory://x/y")


def test_hub_options_are_refused_for_stores(tmp_path: Path) -> None:
    folder = make_folder(tmp_path / "model", {"a": 1})
    with pytest.raises(ValueError, match="revision, private only apply to hf:// destinations"):
        push(str(folder), "memory://x/y", revision="v1", private=True)


# Retry classification.


def _gcs_http_error(code: int) -> Exception:
    from gcsfs.retry import HttpError

    return HttpError({"code": code, "message": "x"})


def _boto_error(status: int, code: str) -> Exception:
    from botocore.exceptions import ClientError

    return ClientError({"Error": {"Code": code, "Message": "x"}, "ResponseMetadata": {"HTTPStatusCode": status}},
                       "PutObject")


def _hub_error(status: int) -> Exception:
    import httpx2
    from huggingface_hub.errors import HfHubHTTPError

    response = httpx2.Response(status, request=httpx2.Request("POST", "http://hub/api"))
    return HfHubHTTPError("x", response=response)


def _wrapped(inner: Exception) -> Exception:
    try:
        try:
            raise inner
        except Exception as exc:
            raise RuntimeError("Error while uploading 'a' to the Hub.") from exc
    except RuntimeError as outer:
        return outer


def _s3fs_translated(status: int, code: str) -> Exception:
    from s3fs.errors import translate_boto_error

    return translate_boto_error(_boto_error(status, code))


@pytest.mark.parametrize(
    "make, transient",
    [
        (lambda: _gcs_http_error(503), True),
        (lambda: _gcs_http_error(429), True),
        (lambda: _gcs_http_error(408), True),
        (lambda: _gcs_http_error(403), False),
        (lambda: _gcs_http_error(404), False),
        (lambda: _gcs_http_error(501), False),
        (lambda: OSError("Forbidden: gs://b/o"), False),
        (lambda: FileNotFoundError("gs://b/o"), False),
        (lambda: ConnectionResetError(104, "reset"), True),
        (lambda: TimeoutError(), True),
        (lambda: __import__("aiohttp").ServerDisconnectedError(), True),
        (lambda: __import__("aiohttp").ClientPayloadError("Response payload is not completed"), True),
        (lambda: __import__("requests").exceptions.ProxyError(), True),
        (lambda: _boto_error(503, "SlowDown"), True),
        (lambda: _boto_error(500, "InternalError"), True),
        (lambda: _boto_error(403, "AccessDenied"), False),
        (lambda: _s3fs_translated(503, "ServiceUnavailable"), True),
        (lambda: _s3fs_translated(404, "NoSuchBucket"), False),
        (lambda: _hub_error(429), True),
        (lambda: _hub_error(502), True),
        (lambda: _hub_error(401), False),
        (lambda: _hub_error(403), False),
        (lambda: _wrapped(_hub_error(503)), True),
        (lambda: _wrapped(_hub_error(404)), False),
        (lambda: __import__("httpx2").RemoteProtocolError("peer closed connection"), True),
        (lambda: UploadMismatchError("read back different"), True),
        (lambda: PublishError("gave up"), False),
        (lambda: ValueError("bad"), False),
    ],
)
def test_is_transient(make, transient: bool) -> None:
    assert is_transient(make()) is transient


def test_retry_call_retries_transient_errors_only(monkeypatch: pytest.MonkeyPatch) -> None:
    delays: list[float] = []
    monkeypatch.setattr(time, "sleep", delays.append)
    calls = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 4:
            raise ConnectionResetError("reset")
        return "ok"

    assert retry_call(flaky, RetryPolicy(attempts=5, base_delay=1.0, max_delay=3.0)) == "ok"
    assert len(calls) == 4 and len(delays) == 3
    assert all(0 <= d <= cap for d, cap in zip(delays, [1.0, 2.0, 3.0]))

    calls.clear()
    with pytest.raises(PermissionError):
        retry_call(lambda: calls.append(1) or (_ for _ in ()).throw(PermissionError("no")), RetryPolicy(attempts=5))
    assert len(calls) == 1

    with pytest.raises(ConnectionResetError):
        retry_call(lambda: (_ for _ in ()).throw(ConnectionResetError()), RetryPolicy(attempts=3, base_delay=0))


def test_redact() -> None:
    text = (
        "Authorization: Bearer hf_abcdefghijklmnopqrstuvwxyz https://user:pa55word@host/x?X-Amz-Signature=deadbeef&a=1 "
        "AKIAABCDEFGHIJKLMNOP my-secret-value"
    )
    out = redact(text, ["my-secret-value"])
    for secret in ("hf_abcdefghijklmnopqrstuvwxyz", "pa55word", "deadbeef", "AKIAABCDEFGHIJKLMNOP", "my-secret-value"):
        assert secret not in out
    assert "https://***@host/x?X-Amz-Signature=***&a=1" in out


# The command line.


def test_cli_push(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from ckptflow.cli import app

    folder = make_folder(tmp_path / "model", {"a.bin": 1000, "b/c.json": 20})
    runner = CliRunner()

    ok = runner.invoke(app, ["push", str(folder), "memory://cli/out", "--workers", "2"])
    assert ok.exit_code == 0, ok.output
    assert ok.stdout.strip() == (
        f"pushed {folder} to memory://cli/out: 2 file(s) uploaded (1.0 KB), 0 already there; "
        f"memory://cli/out/{MANIFEST_NAME}"
    )

    missing = runner.invoke(app, ["push", str(tmp_path / "nope"), "memory://cli/out"])
    assert missing.exit_code == 1
    assert missing.stderr.strip() == f"error: SRC {tmp_path}/nope does not exist; check the path or URL"

    usage = runner.invoke(app, ["push", str(folder), "memory://cli/out", "--revision", "v1"])
    assert usage.exit_code == 2 and "Invalid value for DEST: --revision and --private are for hf://" in usage.stderr
    bad_hub = runner.invoke(app, ["push", str(folder), "hf://nope"])
    assert bad_hub.exit_code == 2 and "Invalid value for DEST: not a Hub repo URL" in bad_hub.stderr
    assert "Traceback" not in missing.output + usage.output + bad_hub.output
