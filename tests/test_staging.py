"""A bucket commit (`plumbing.staging.commit`) against the GCS emulator: copies side by side, the
marker last, and a failed copy undone so that OUT holds nothing."""

from __future__ import annotations

import posixpath
import threading

import pytest

from ckptflow.errors import OutputError
from ckptflow.plumbing.staging import Staging, commit, prepare
from ckptflow.plumbing.storage import open_fs
from tests.servers.stores import Store

SHARDS = [f"model-{i:05d}-of-00040.safetensors" for i in range(40)]
INDEX = "model.safetensors.index.json"


def _staged(out: str) -> tuple[object, Staging]:
    staging = prepare(out)
    fs, path = open_fs(staging.uri)
    for name in [*SHARDS, INDEX]:
        fs.pipe_file(f"{path}/{name}", name.encode())
    return fs, staging


def test_a_bucket_commit_copies_side_by_side_and_the_marker_last(gcs: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    fs, staging = _staged(f"{gcs.url}/out")
    real, lock = fs.copy, threading.Lock()
    order: list[str] = []
    active = peak = 0

    def copy(src: str, dst: str, **kwargs: object) -> object:
        nonlocal active, peak
        with lock:
            active += 1
            peak = max(peak, active)
            order.append(posixpath.basename(dst))
        try:
            return real(src, dst, **kwargs)
        finally:
            with lock:
                active -= 1

    monkeypatch.setattr(fs, "copy", copy)  # the instance open_fs hands out (fsspec caches it)
    commit(staging, last=[INDEX])
    assert order[-1] == INDEX and sorted(order[:-1]) == SHARDS
    assert peak > 1, "the copies ran one at a time"
    _, out = open_fs(staging.out)
    assert sorted(posixpath.basename(p) for p in fs.find(out)) == sorted([*SHARDS, INDEX])
    assert fs.cat_file(f"{out}/{SHARDS[7]}") == SHARDS[7].encode()
    assert not fs.exists(open_fs(staging.uri)[1])


def test_a_failed_copy_leaves_nothing_at_out(gcs: Store) -> None:
    fs, staging = _staged(f"{gcs.url}/out")
    gcs.proxy.configure(answers=(("POST", SHARDS[7], 403),))  # the store refuses one copy
    with pytest.raises(OutputError, match=r"^cannot move the output into gs://\S+/out \("):
        commit(staging, last=[INDEX])
    gcs.proxy.reset()
    _, out = open_fs(staging.out)
    assert fs.find(out) == []  # the copies that succeeded were removed, the marker never copied
    assert len(fs.find(open_fs(staging.uri)[1])) == len(SHARDS) + 1  # left for abort()
