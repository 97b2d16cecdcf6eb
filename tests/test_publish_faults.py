"""Publishing through broken networks and alongside other pushes (issue 14, items 8, 10 and 11).

- Item 8: a resumable upload to GCS whose chunk response is lost (the proxy forwards the chunk, the
  emulator applies it, the connection drops) is resent by gcsfs with its original Content-Range; the
  emulator answers `400 Invalid Content-Range start: expected 58720256, got 0`. The store upload treats
  that (and 404/410 on an existing session) as a broken session: that file's upload starts over with a
  new session. 401/403/404 and missing buckets still fail fast (tests/test_publish.py pins those).
- Item 10: what the stores under test do with conditional creates (facts), two pushes to one DEST (a
  local folder: exclusive create), a lease several holders race for on S3 (moto honours
  `If-None-Match: *`), a stale lease broken on purpose and the lease released after a success and a
  failure. The GCS emulator ignores `ifGenerationMatch=0`, so what real GCS does with the lease (412
  to the second create) cannot be shown here: against the emulator two pushes can both take it.
- Item 11: `watch` logs store errors without redaction.

The pushes run as the CLI would (`ckptflow push` in a child of the hostile-input harness) where the
output matters, and in-process where only the library's behaviour does.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path

import fsspec
import pytest

from ckptflow.errors import PublishError
from ckptflow.publish import push
from ckptflow.publish.lease import LEASE_NAME, hold_lease
from tests.hostile.harness import Limits
from tests.hostile.plugin import long_mode_env
from tests.hostile.run import Runner
from tests.servers.stores import Store

LONG = long_mode_env()
BIG = 120 * 2**20  # three resumable chunks with ckptflow's 50 MiB blocks (56 MiB, 56 MiB, 8 MiB)
# Real GCS answers the DELETE that cancels a resumable upload with 499; the emulator has no handler for
# it (501, which gcsfs retries for half a minute), so the proxy answers it the way GCS does.
CANCEL_AS_GCS = (("DELETE", "upload_id=", 499),)


@pytest.fixture(scope="module")
def big_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("big-src")
    rng = random.Random(14)
    (folder / "big.bin").write_bytes(rng.randbytes(BIG))
    (folder / "config.json").write_text('{"model_type": "llama"}\n')
    return folder


def _cli_push(runner: Runner, src: Path, url: str, store: Store, seconds: float = 240) -> object:
    return runner.harness.run(["push", str(src), url, "--workers", "1"], cwd=src.parent, env=store.env,
                              limits=Limits(seconds=seconds, file_size=1 << 30))


def _assert_published(src: Path, url: str) -> None:
    fs, root = fsspec.core.url_to_fs(url)
    fs.invalidate_cache()
    for path in src.iterdir():
        data = fs.cat_file(f"{root}/{path.name}")
        assert hashlib.sha256(data).hexdigest() == hashlib.sha256(path.read_bytes()).hexdigest(), path.name
    assert fs.exists(f"{root}/ckptflow-manifest.json")


# ---- item 8: a resumable session that breaks restarts its file ------------------------------------------


def test_a_lost_chunk_response_restarts_the_file(gcs: Store, big_folder: Path, hostile_runner: Runner) -> None:
    """The first chunk of big.bin is applied but its response is lost: the push must still complete
    byte-exact, print nothing but its summary line, and exit 0."""
    gcs.proxy.configure(kinds=("drop",), rate=1.0, max_faults=1, only_paths=("upload_id=",), answers=CANCEL_AS_GCS)
    result = _cli_push(hostile_runner, big_folder, gcs.url, gcs)
    faults = dict(gcs.proxy.faults)
    gcs.proxy.reset()
    assert faults == {"drop": 1}
    assert result.returncode == 0, result.describe()  # type: ignore[attr-defined]
    assert "Traceback" not in result.stderr, result.describe()  # type: ignore[attr-defined]
    _assert_published(big_folder, gcs.url)


# Seeds whose faults drop the response to a chunk after the first; the long mode adds 20 more.
DROP_SEEDS = [8, 24]
FAULT_SEEDS = DROP_SEEDS + ([s for s in range(100, 120)] if LONG else [])


@pytest.mark.parametrize("seed", FAULT_SEEDS)
def test_push_through_dropped_connections_and_503s(gcs: Store, big_folder: Path, hostile_runner: Runner,
                                                   seed: int) -> None:
    """20% of the requests for big.bin answered 503, reset before forwarding, or dropped after the store
    applied them: the push completes byte-exact, every time (2 seeds by default, 22 in the long mode:
    `CKPTFLOW_HOSTILE_LONG=1`)."""
    gcs.proxy.configure(rate=0.2, kinds=("503", "reset", "drop"), seed=seed, only_paths=("big.bin",),
                        answers=CANCEL_AS_GCS)
    result = _cli_push(hostile_runner, big_folder, gcs.url, gcs)
    faults = dict(gcs.proxy.faults)
    gcs.proxy.reset()
    if seed in DROP_SEEDS:
        assert faults.get("drop"), f"seed {seed} must drop at least one response: {faults}"
    assert "Traceback" not in result.stderr, result.describe()  # type: ignore[attr-defined]
    assert result.returncode == 0, result.describe()  # type: ignore[attr-defined]
    _assert_published(big_folder, gcs.url)


# ---- item 10: conditional creates in the stores under test, two pushes to one DEST -------------------


def test_gcs_emulator_ignores_if_generation_match(gcs: Store) -> None:
    """Fact: the emulator overwrites an existing object on `ifGenerationMatch=0`, through a simple
    upload, a resumable one and the JSON media upload; real GCS answers 412. A GCS lease can only be
    shown against real GCS."""
    fs, root = fsspec.core.url_to_fs(gcs.url)
    fs.pipe_file(f"{root}/lease", b"first")
    fs.pipe_file(f"{root}/lease", b"second", mode="create")  # gcsfs sends ifGenerationMatch=0
    assert fs.cat_file(f"{root}/lease") == b"second"
    with fs.open(f"{root}/lease", "xb", block_size=2**18) as fh:  # resumable, ifGenerationMatch=0 on initiate
        fh.write(b"x" * 3 * 2**18)
    fs.invalidate_cache()
    assert fs.info(f"{root}/lease")["size"] == 3 * 2**18


def test_moto_honours_if_none_match(s3: Store) -> None:
    """Fact: moto answers 412 to `If-None-Match: *` on PutObject and on CompleteMultipartUpload for an
    existing key (s3fs raises FileExistsError) and leaves the object as it was."""
    fs, root = fsspec.core.url_to_fs(s3.url)
    fs.pipe_file(f"{root}/lease", b"first")
    with pytest.raises(FileExistsError):
        fs.pipe_file(f"{root}/lease", b"second", mode="create")
    with pytest.raises(FileExistsError), fs.open(f"{root}/lease", "xb", block_size=5 * 2**20) as fh:
        fh.write(b"y" * 11 * 2**20)
    fs.invalidate_cache()
    assert fs.cat_file(f"{root}/lease") == b"first"
    fs.pipe_file(f"{root}/fresh", b"x", mode="create")


def test_a_second_push_to_the_same_dest_fails_at_once(hostile_runner: Runner, tmp_path: Path) -> None:
    """Two pushes of the same folder to one local DEST, the second started while the first runs: the
    second exits 1 at once with one error naming the first push's lease, and the first completes."""
    src = tmp_path / "src"
    src.mkdir()
    with open(src / "big.bin", "wb") as fh:  # sparse: costs no disk, takes a few seconds to hash and copy
        fh.truncate(300 * 2**20)
    dest = tmp_path / "dest"
    limits = Limits(seconds=120, file_size=1 << 30)
    results: dict[str, object] = {}
    first = threading.Thread(target=lambda: results.setdefault("first", hostile_runner.harness.run(
        ["push", str(src), str(dest)], cwd=tmp_path, limits=limits)))
    first.start()
    _wait_until(lambda: _holder(dest / LEASE_NAME) is not None or not first.is_alive(), "the first push's lease")
    assert _holder(dest / LEASE_NAME) is not None, ("the first push ended before its lease was seen", results)
    second = hostile_runner.harness.run(["push", str(src), str(dest)], cwd=tmp_path, limits=limits)
    first.join()
    assert results["first"].returncode == 0, results["first"].describe()  # type: ignore[attr-defined]
    # Refused, not queued: a second push that waited for the lease would have pushed and exited 0.
    # `limits` (120 s) is the hang guard.
    assert second.returncode == 1, second.describe()
    assert "lease" in second.stderr or "another push" in second.stderr, second.describe()


def test_the_lease_is_taken_with_a_conditional_create_on_s3(s3: Store, tmp_path: Path) -> None:
    """On S3 (moto honours `If-None-Match: *`), a second holder is refused at once naming the first,
    even when both go for the lease together; the lease is gone once the first is done."""
    fs, root = fsspec.core.url_to_fs(s3.url)
    outcomes: list[str] = []
    barrier = threading.Barrier(4)

    def take() -> None:
        barrier.wait()
        try:
            with hold_lease(fs, root, s3.url):
                outcomes.append("held")
                # Held until every contender has had its answer, so none can find the lease released.
                _wait_until(lambda: len(outcomes) == len(threads), "every contender's answer", fail=False)
        except PublishError as exc:
            outcomes.append(str(exc))

    threads = [threading.Thread(target=take) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert outcomes.count("held") == 1, outcomes
    assert all("another push to" in o and "is held by" in o and "since" in o for o in outcomes if o != "held"), outcomes
    fs.invalidate_cache()
    assert not fs.exists(f"{root}/{LEASE_NAME}")


def _wait_until(check: Callable[[], bool], what: str, *, timeout: float = 60.0, fail: bool = True) -> None:
    """Poll `check` until it holds; `timeout` is a hang guard (TimeoutError, or a return with `fail=False`
    so that the test's own assertions say what went wrong)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            if fail:
                raise TimeoutError(f"timed out waiting for {what}")
            return
        time.sleep(0.01)


def _holder(lease: Path) -> dict | None:
    """The holder a local lease file names, or None while there is none (or it is still being written)."""
    try:
        return json.loads(lease.read_text())
    except (FileNotFoundError, ValueError):
        return None


def _src(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    (src / "a.bin").write_bytes(b"a" * 1000)
    (src / "config.json").write_text("{}")
    return src


@pytest.mark.parametrize("store", ["local", "s3"])
def test_a_stale_lease_is_broken_on_purpose_and_released_either_way(store: str, tmp_path: Path,
                                                                    request: pytest.FixtureRequest) -> None:
    """A lease a dead push left refuses the next push, which names it; `break_lease` (the CLI's
    `--break-lease`) removes it and pushes. The lease is removed after a push that succeeds and after
    one that fails."""
    url = str(tmp_path / "dest") if store == "local" else request.getfixturevalue("s3").url
    fs, root = fsspec.core.url_to_fs(url)
    fs.makedirs(root, exist_ok=True)
    stale = {"format": "ckptflow-lease", "id": "dead", "user": "trainer", "host": "node-7", "pid": 4242,
             "started": "2026-01-01T00:00:00+00:00"}
    fs.pipe_file(f"{root}/{LEASE_NAME}", json.dumps(stale).encode())
    src = _src(tmp_path)
    with pytest.raises(PublishError, match=r"another push to .* is held by 'trainer@node-7 \(process 4242\)' since "
                                           r"'2026-01-01T00:00:00\+00:00'.*`break_lease`"):
        push(str(src), url)
    result = push(str(src), url, break_lease=True)
    assert len(result.uploaded) == 2
    fs.invalidate_cache()
    assert not fs.exists(f"{root}/{LEASE_NAME}")
    fs.pipe_file(f"{root}/ckptflow-manifest.json", b"[]")  # a bad manifest: the next push fails inside the lease
    with pytest.raises(Exception, match="is not a ckptflow manifest"):
        push(str(src), url)
    fs.invalidate_cache()
    assert not fs.exists(f"{root}/{LEASE_NAME}")


# ---- item 11: redaction in watch ------------------------------------------------------------------------


def test_watch_redacts_store_errors(gcs: Store, monkeypatch: pytest.MonkeyPatch,
                                    caplog: pytest.LogCaptureFixture) -> None:
    from ckptflow.watch import find_latest

    secret = "ya29.watch-secret-token-0123456789"
    monkeypatch.setenv("GOOGLE_OAUTH_ACCESS_TOKEN", secret)
    gcs.proxy.configure(status=403, message=f"Forbidden: the token {secret} may not list this bucket")
    try:
        with caplog.at_level(logging.DEBUG):
            scan = find_latest([gcs.url])
    finally:
        gcs.proxy.reset()
    reasons = " ".join(u.reason for u in scan.unreadable)
    assert scan.unreadable, "the forbidden root is reported as unreadable"
    ours = "\n".join(r.getMessage() for r in caplog.records if r.name.startswith("ckptflow"))
    assert secret not in ours, ours
    assert secret not in reasons, reasons
