"""Reading checkpoints from `memory://` and from a real GCS server: the same index, the same values,
and tensors fetched by byte range rather than whole files."""

from __future__ import annotations

import io
from pathlib import Path

import fsspec
import torch

from ckptflow.formats.deepspeed import load_index
from ckptflow.formats.torch.zipdir import open_archive
from ckptflow.plumbing.storage import open_fs
from ckptflow.validate import validate
from tests.oracles.tensors import read_elements
from tests.test_validate import full_param


def upload(local: Path, url: str) -> None:
    fs, path = open_fs(url)
    for file in sorted(p for p in local.rglob("*") if p.is_file()):
        fs.pipe_file(f"{path}/{file.relative_to(local).as_posix()}", file.read_bytes())


def same_values(local_index, remote_index) -> None:
    assert [p.name for p in local_index.params] == [p.name for p in remote_index.params]
    for lp, rp in zip(local_index.params, remote_index.params):
        assert (lp.shape, lp.dtype, lp.group, lp.fragments) == (rp.shape, rp.dtype, rp.group, rp.fragments)
        assert torch.equal(full_param(local_index, lp), full_param(remote_index, rp)), lp.name
        if not lp.frozen:
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(full_param(local_index, lp, key), full_param(remote_index, rp, key))
    assert dict(local_index.tied) == dict(remote_index.tied)


def test_memory_filesystem(ds_fixtures):
    fx = ds_fixtures["z2-fp32-ws4"]
    url = "memory://ckptflow-read-test/run"
    upload(fx.dir, url)
    report = validate(url, deep=True)
    assert report.ok, report.problems
    assert report.index.files[3].optim.startswith("memory://ckptflow-read-test/run/")
    same_values(load_index(str(fx.dir)), report.index)
    fsspec.filesystem("memory").rm("/ckptflow-read-test", recursive=True)


def test_gcs_emulator(ds_fixtures, gcs):
    fx = ds_fixtures["z3-bf16-ws2"]
    upload(fx.dir, gcs.url)
    report = validate(gcs.url, deep=True)
    assert report.ok, report.problems
    same_values(load_index(str(fx.dir)), report.index)
    # A missing rank in the bucket is reported like a local one.
    fs, path = open_fs(gcs.url)
    fs.rm_file(f"{path}/{fx.tag}/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")
    report = validate(gcs.url)
    assert [p.code for p in report.problems] == ["rank-missing"]
    assert f"under {gcs.url}" in report.problems[0].message


def test_gcs_reads_by_byte_range(gcs):
    """Opening an archive and reading one slice of a 16 MiB tensor fetches a few KiB, not the file."""
    big = torch.randn(4 << 20)
    buf = io.BytesIO()
    torch.save({"big": big, "small": torch.arange(10)}, buf)
    url = f"{gcs.url}/big.pt"
    fs, path = open_fs(url)
    fs.pipe_file(path, buf.getvalue())
    fs.invalidate_cache()

    before = gcs.proxy.counters.bytes_down
    ref = open_archive(url).obj["big"]
    opened = gcs.proxy.counters.bytes_down - before
    values = read_elements(ref, 1_000_000, 1000)
    total = gcs.proxy.counters.bytes_down - before

    assert torch.equal(values, big[1_000_000:1_001_000])
    assert len(buf.getvalue()) > 16 << 20
    assert opened < 256 << 10, opened  # the zip directory, the pickle and storage headers
    assert total - opened < 64 << 10, total - opened  # 4000 bytes asked for, plus HTTP overhead


def test_gcs_permission_error_is_not_called_corruption(ds_fixtures, gcs):
    fx = ds_fixtures["z2-bf16-ws2"]
    upload(fx.dir, gcs.url)
    gcs.proxy.configure(status=403, only_paths=("optim_states",))
    report = validate(gcs.url)
    assert not report.ok
    assert {p.code for p in report.problems} == {"unreadable-file"}, [p.message for p in report.problems]
    message = report.problems[0].message
    assert "cannot read" in message and "Forbidden" in message and "check access to the store" in message
    assert "truncated" not in message and "corrupt" not in message


def test_small_files_are_opened_on_threads_on_a_store_and_in_turn_on_a_local_disk(tmp_path):
    """`map_files`: a store's requests wait on the network, so they go out together; a local file's
    parsing is Python holding the GIL, where threads would only contend for it."""
    import threading

    from ckptflow.plumbing.storage import LOCAL_PROBE, map_files

    def where(item: int) -> tuple[int, str]:
        return item, threading.current_thread().name

    n = LOCAL_PROBE  # as many as are parsed in turn before their waits are judged (the next test)
    local = [str(tmp_path / f"{i}.pt") for i in range(n)]
    for uris in (local, [f"file://{u}" for u in local]):
        assert map_files(where, list(range(n)), uris) == [(i, threading.current_thread().name) for i in range(n)]
    mixed = local[:4] + ["memory://ckpt/4.pt"]
    got = map_files(where, list(range(5)), mixed)
    assert [i for i, _ in got] == list(range(5))  # results in order
    assert all(name.startswith("ckptflow-open") for _, name in got), got


def test_local_files_that_keep_the_reader_waiting_go_on_threads(tmp_path):
    """A network file system mounted as a local path (NFS, Lustre) answers each read after a wait: once
    the first calls have waited longer than they computed, the rest run on threads."""
    import threading
    import time

    from ckptflow.plumbing.storage import LOCAL_PROBE, map_files

    def slow(item: int) -> tuple[int, str]:
        time.sleep(0.01)  # as a remote read waits, holding no GIL
        return item, threading.current_thread().name

    local = [str(tmp_path / f"{i}.pt") for i in range(12)]
    got = map_files(slow, list(range(12)), local)
    assert [i for i, _ in got] == list(range(12))
    here = threading.current_thread().name
    assert [name for _, name in got[:LOCAL_PROBE]] == [here] * LOCAL_PROBE
    assert all(name.startswith("ckptflow-open") for _, name in got[LOCAL_PROBE:]), got
