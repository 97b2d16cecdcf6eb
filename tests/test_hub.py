"""Pushing to the Hugging Face Hub: the real huggingface_hub client against the local Hub server of
tests/servers/hub.py (HF_HUB_DISABLE_XET=1), round trips through snapshot_download and transformers."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from ckptflow.errors import PublishError
from ckptflow.formats.hf import PROVENANCE_NAME
from ckptflow.plumbing.retry import RetryPolicy
from ckptflow.publish import push
from tests.servers.hub import READ_TOKEN, WRITE_TOKEN, HubServer

FAST = RetryPolicy(attempts=6, base_delay=0.05, max_delay=0.3)

PROVENANCE = {
    "source": {"uri": "gs://runs/llama-tiny/global_step30", "root": "gs://runs/llama-tiny", "tag": "global_step30",
               "step": 30, "zero_stage": 3, "world_size": 2, "precision": "bf16"},
    "output": {"dtype": "float32", "total_parameters": 26784},
}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A consolidated model as `consolidate` leaves it: save_pretrained output plus the provenance record."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, max_position_embeddings=64,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    (folder / PROVENANCE_NAME).write_text(json.dumps(PROVENANCE, indent=2))
    return folder


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def download(hub: HubServer, repo_id: str, tmp_path: Path, **kwargs: object) -> Path:
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(repo_id, endpoint=hub.url, token=WRITE_TOKEN, cache_dir=tmp_path / "cache", **kwargs))


def lfs_uploads(hub: HubServer) -> list[str]:
    return hub.requests("PUT", "/lfs/upload/")


def test_consolidated_model_round_trip(hub: HubServer, tiny_model: Path, tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    result = push(str(tiny_model), "hf://org/tiny-llama", token=WRITE_TOKEN, endpoint=hub.url)

    assert sorted(result.uploaded) == sorted([*files_of(tiny_model), "README.md"]) and result.skipped == ()
    assert result.commit_url is not None and result.commit_url.startswith(f"{hub.url}/org/tiny-llama/commit/")
    local = download(hub, "org/tiny-llama", tmp_path)
    downloaded = files_of(local)
    assert {k: v for k, v in downloaded.items() if k not in ("README.md", ".gitattributes")} == files_of(tiny_model)
    card = downloaded["README.md"].decode()
    for line in ("| Source run | gs://runs/llama-tiny/global_step30 |", "| Tag | global_step30 |", "| Step | 30 |",
                 "| dtype | float32 |", "| Parameters | 26,784 |", "library_name: transformers"):
        assert line in card

    original = AutoModelForCausalLM.from_pretrained(tiny_model)
    loaded = AutoModelForCausalLM.from_pretrained(local)
    for (name, a), (_, b) in zip(original.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name


def test_second_push_uploads_nothing(hub: HubServer, tiny_model: Path) -> None:
    push(str(tiny_model), "hf://org/tiny-llama", token=WRITE_TOKEN, endpoint=hub.url)
    hub.log.clear()

    result = push(str(tiny_model), "hf://org/tiny-llama", token=WRITE_TOKEN, endpoint=hub.url)

    assert result.uploaded == () and result.bytes_uploaded == 0
    assert lfs_uploads(hub) == [] and hub.requests("POST", "/commit/") == []


def test_commit_is_retried_and_blobs_are_not_sent_twice(hub: HubServer, tiny_model: Path, tmp_path: Path) -> None:
    hub.configure_faults(rate=1.0, kinds=("503", "reset"), only_paths=("/commit/",), max_faults=2, seed=1)

    push(str(tiny_model), "hf://org/retried", token=WRITE_TOKEN, endpoint=hub.url, retry=FAST)

    assert sum(hub.fault_counts.values()) == 2
    assert len(hub.requests("POST", "/commit/")) == 1
    assert len(lfs_uploads(hub)) == 1  # model.safetensors, once across the three tries
    assert (files_of(download(hub, "org/retried", tmp_path))["model.safetensors"]
            == (tiny_model / "model.safetensors").read_bytes())


def test_push_completes_through_random_faults(hub: HubServer, tiny_model: Path, tmp_path: Path) -> None:
    hub.configure_faults(rate=0.3, seed=3)

    push(str(tiny_model), "hf://org/flaky", token=WRITE_TOKEN, endpoint=hub.url, retry=FAST)

    assert sum(hub.fault_counts.values()) >= 2, hub.fault_counts
    hub.configure_faults()
    downloaded = files_of(download(hub, "org/flaky", tmp_path))
    assert {k: downloaded[k] for k in files_of(tiny_model)} == files_of(tiny_model)


def test_rerun_after_a_failed_push_uploads_only_what_is_missing(hub: HubServer, tiny_model: Path) -> None:
    hub.configure_faults(rate=1.0, kinds=("503",), only_paths=("/commit/",))
    with pytest.raises(PublishError) as caught:
        push(str(tiny_model), "hf://org/resumed", token=WRITE_TOKEN, endpoint=hub.url,
             retry=RetryPolicy(attempts=2, base_delay=0.01, max_delay=0.01))
    assert str(caught.value).startswith("could not commit to hf://org/resumed@main: still failing after 2 tries (")
    assert str(caught.value).endswith("; the Hub may be overloaded; run the same push again: what is uploaded already "
                                      "is not sent twice")
    assert len(lfs_uploads(hub)) == 1
    hub.configure_faults()
    hub.log.clear()

    result = push(str(tiny_model), "hf://org/resumed", token=WRITE_TOKEN, endpoint=hub.url)

    assert lfs_uploads(hub) == [], "the blob uploaded by the failed push is not sent again"
    assert len(hub.requests("POST", "/commit/")) == 1
    assert "model.safetensors" in result.uploaded  # committed now


def test_read_only_token_fails_fast_and_never_shows(hub: HubServer, tiny_model: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    push(str(tiny_model), "hf://org/locked", token=WRITE_TOKEN, endpoint=hub.url)
    hub.log.clear()

    with caplog.at_level(logging.DEBUG), pytest.raises(PublishError) as caught:
        push(str(tiny_model), "hf://org/locked", token=READ_TOKEN, endpoint=hub.url)

    message = str(caught.value)
    assert message.startswith("could not commit to hf://org/locked@main: HfHubHTTPError: 403")
    assert message.endswith("; the token may not write to this repo: use a token with write access to it")
    assert len(hub.requests("POST", "/preupload/")) == 1, "a 403 is never retried"
    assert READ_TOKEN not in message and READ_TOKEN not in caplog.text and WRITE_TOKEN not in caplog.text


def test_missing_token_is_a_clear_error(hub: HubServer, tiny_model: Path, monkeypatch: pytest.MonkeyPatch,
                                        tmp_path: Path) -> None:
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_TOKEN_PATH", str(tmp_path / "no-token"))
    with pytest.raises(PublishError, match=r"^could not create the repo hf://org/anon: .*401.*; the Hub did not accept "
                                           r"the token: set HF_TOKEN"):
        push(str(tiny_model), "hf://org/anon", endpoint=hub.url)


def test_private_dataset_on_a_branch(hub: HubServer, tmp_path: Path) -> None:
    folder = tmp_path / "data"
    (folder / "train").mkdir(parents=True)
    (folder / "train" / "part-0.bin").write_bytes(bytes(range(256)) * 400)
    (folder / "README.md").write_text("---\nlicense: mit\n---\n# my data\n")

    result = push(str(folder), "hf://datasets/org/data", revision="v1", private=True, token=WRITE_TOKEN,
                  endpoint=hub.url)

    repo = hub.repos[("dataset", "org/data")]
    assert repo.private and result.commit_url and "/datasets/org/data/commit/" in result.commit_url
    assert hub.file_bytes("org/data", "README.md", revision="v1",
                          repo_type="dataset") == (folder / "README.md").read_bytes()
    assert "train/part-0.bin" not in repo.commits[repo.branches["main"]]
    local = download(hub, "org/data", tmp_path, repo_type="dataset", revision="v1")
    assert (local / "train" / "part-0.bin").read_bytes() == (folder / "train" / "part-0.bin").read_bytes()


def test_token_and_endpoint_from_the_environment(hub: HubServer, tiny_model: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", WRITE_TOKEN)
    monkeypatch.setenv("HF_ENDPOINT", hub.url)

    result = push(str(tiny_model), "hf://org/from-env")

    assert result.commit_url and result.commit_url.startswith(hub.url)


def test_card_without_provenance_reads_the_safetensors_headers(hub: HubServer, tiny_model: Path,
                                                               tmp_path: Path) -> None:
    folder = tmp_path / "plain"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        (folder / name).write_bytes((tiny_model / name).read_bytes())

    push(str(folder), "hf://org/plain", token=WRITE_TOKEN, endpoint=hub.url)

    card = hub.file_bytes("org/plain", "README.md").decode()
    assert "Published with ckptflow." in card and "| Parameters | 26,784 |" in card and "| Tag | not recorded |" in card


def test_a_file_over_the_hubs_size_limit_is_refused_before_anything_is_sent(hub: HubServer, tmp_path: Path) -> None:
    """The Hub takes files of at most 500 GB (hub-docs, storage-limits.md); a larger one is refused before
    it is read (a sparse file here: nothing is hashed), and no request reaches the Hub."""
    from ckptflow.publish.hub import HUB_MAX_FILE_BYTES

    folder = tmp_path / "huge"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    with open(folder / "model.safetensors", "wb") as sparse:
        sparse.truncate(HUB_MAX_FILE_BYTES + 1)

    with pytest.raises(PublishError) as caught:
        push(str(folder), "hf://org/huge", token=WRITE_TOKEN, endpoint=hub.url)

    assert str(caught.value) == (
        "model.safetensors is 500,000,000,001 bytes; the Hub takes files of at most 500,000,000,000 bytes (500 GB); "
        "split it into smaller files (consolidate with a smaller shard size) and push again"
    )
    assert caught.value.file == "model.safetensors" and caught.value.actual == HUB_MAX_FILE_BYTES + 1
    assert hub.log == []


def test_a_folder_over_the_hubs_entry_limit_is_refused_before_anything_is_sent(hub: HubServer, tmp_path: Path) -> None:
    """At most 10,000 entries per folder on the Hub: SRC's own folders are checked before the repo is
    even looked up."""
    folder = tmp_path / "many"
    (folder / "shards").mkdir(parents=True)
    for i in range(10_001):
        (folder / "shards" / f"{i:05d}.bin").write_bytes(b"x")

    with pytest.raises(PublishError) as caught:
        push(str(folder), "hf://org/many", token=WRITE_TOKEN, endpoint=hub.url)

    assert str(caught.value) == (
        "folder shards/ would hold 10,001 entries (10,001 from this push); the Hub allows at most 10,000 per "
        "folder; spread the files over subfolders and push again"
    )
    assert hub.log == []


def test_the_files_a_revision_holds_count_toward_the_entry_limit(hub: HubServer, tmp_path: Path) -> None:
    """A push that fits alone but would take a folder of the revision past 10,000 entries is refused once
    the revision is listed, before any upload or commit."""
    hub.seed("org/crowded", {f"data/{i:05d}.json": b"{}" for i in range(9_999)})
    folder = tmp_path / "more"
    (folder / "data").mkdir(parents=True)
    for name in ("a.json", "b.json"):
        (folder / "data" / name).write_text("{}")
    (folder / "README.md").write_text("# crowded\n")

    with pytest.raises(PublishError) as caught:
        push(str(folder), "hf://org/crowded", token=WRITE_TOKEN, endpoint=hub.url)

    assert str(caught.value) == (
        "folder data/ would hold 10,001 entries (2 from this push); the Hub allows at most 10,000 per folder; "
        "spread the files over subfolders and push again"
    )
    assert hub.requests("POST", "/preupload/") == [] and lfs_uploads(hub) == []
    assert hub.requests("POST", "/commit/") == []


def test_entry_limit_counts_files_and_subfolders_up_to_exactly_10000() -> None:
    from ckptflow.publish.hub import check_folder_entries

    check_folder_entries({f"d/{i}" for i in range(10_000)}, added=set())  # exactly the limit: allowed
    check_folder_entries({f"d/{i}/x" for i in range(10_000)}, added=set())
    with pytest.raises(PublishError, match=r"^folder d/ would hold 10,001 entries \(1 from this push\)"):
        check_folder_entries({*(f"d/{i}" for i in range(10_000)), "d/sub/x"}, added={"d/sub/x"})
    with pytest.raises(PublishError, match=r"^the repo's top folder would hold 10,001 entries \(0 from this push\)"):
        check_folder_entries({f"{i}" for i in range(10_001)}, added=set())


@pytest.mark.parametrize("url", ["hf://only-one-part", "hf://org/repo/sub/path", "hf://buckets/org/x"])
def test_bad_hub_urls(url: str, tiny_model: Path) -> None:
    with pytest.raises(ValueError, match=r"^not a Hub repo URL: .*; expected hf://ORG/REPO, hf://datasets/ORG/REPO or hf://ORG/REPO@REVISION$"):
        push(str(tiny_model), url, token=WRITE_TOKEN)


def _st(header: object | bytes, data: bytes = b"", length: int | None = None) -> bytes:
    import json
    import struct

    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


SAFETENSORS_CASES = {
    "valid": _st({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "__metadata__": {"format": "pt"}},
                 b"\0" * 8),
    "valid-two": _st({"b": {"dtype": "BF16", "shape": [1, 2], "data_offsets": [4, 8]},
                      "a": {"dtype": "I32", "shape": [], "data_offsets": [0, 4]}}, b"\0" * 8),
    "valid-empty": _st({}),
    "valid-zero-size": _st({"w": {"dtype": "F32", "shape": [0, 3], "data_offsets": [0, 0]}}),
    "lfs-pointer": b"version https://git-lfs.github.com/spec/v1\noid sha256:00\nsize 12345\n",
    "length-huge": _st({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4, length=2**60),
    "past-end": _st({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, length=10**6),
    "list": _st([1, 2, 3]),
    "no-shape": _st({"w": {"dtype": "F32", "data_offsets": [0, 4]}}, b"\0" * 4),
    "string-shape": _st({"w": {"dtype": "F32", "shape": "12", "data_offsets": [0, 4]}}, b"\0" * 4),
    "negative-shape": _st({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4),
    "float-shape": _st({"w": {"dtype": "F32", "shape": [1.5], "data_offsets": [0, 4]}}, b"\0" * 4),
    "entry-list": _st({"w": [1, 2]}),
    "nested": _st(b'{"w": ' + b"[" * 5000 + b"]" * 5000 + b"}"),
    "not-utf8": _st(b"\xff\xfe{}"),
    "short": b"abc",
    "gap": _st({"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8),
    "overlap": _st({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                    "b": {"dtype": "F32", "shape": [1], "data_offsets": [2, 6]}}, b"\0" * 6),
    "wrong-size": _st({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4),
    "trailing-bytes": _st({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 5),
    "metadata-not-strings": _st({"__metadata__": {"a": 1}}),
    "unknown-dtype": _st({"w": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}}, b"\0" * 16),
    "valid-leading-space": _st(b' {"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}', b"\0" * 4),
}


def test_safetensors_headers_are_judged_as_safetensors_judges_them(tmp_path: Path) -> None:
    """`hf.read_safetensors_header` (what `push hf://` reads for the card and checks every file with)
    accepts exactly the files the safetensors library opens, each refused with one clear error."""
    from safetensors import safe_open

    from ckptflow.errors import CorruptFileError
    from ckptflow.formats.hf import read_safetensors_header

    for name, data in SAFETENSORS_CASES.items():
        path = tmp_path / f"{name}.safetensors"
        path.write_bytes(data)
        try:
            with safe_open(str(path), framework="np") as fh:
                theirs = sorted(fh.keys())
        except Exception:
            theirs = None
        try:
            ours = sorted(read_safetensors_header(str(path)).tensors)
        except CorruptFileError as exc:
            assert str(path) in str(exc) and "is not a valid safetensors file" in str(exc), (name, exc)
            ours = None
        assert ours == theirs, (name, ours, theirs)
        assert name.startswith("valid") == (ours is not None), name
