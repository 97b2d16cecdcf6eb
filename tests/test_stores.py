"""The stores' traits: which store a URI or filesystem is, what its info() reports, and that a backend
is one module of `ckptflow.plumbing.stores`."""

from __future__ import annotations

import pkgutil

import fsspec
import pytest

from ckptflow.plumbing import stores
from ckptflow.plumbing.checksums import StoreChecksum
from ckptflow.plumbing.stores import OTHER, backends, store_for, store_named
from ckptflow.plumbing.stores.local import os_path

GCS_INFO = {"size": 3, "generation": "17", "metageneration": "1", "crc32c": "AAAAAA==",
            "md5Hash": "rL0Y20zC+Fzt72VPzMSk2A==",
            "etag": "CKih", "mtime": "2026-01-01 00:00:00+00:00", "name": "b/k", "type": "file"}
S3_INFO = {"size": 3, "ETag": '"acbd18db4cc2f85cedef654fccc4a4d8"', "LastModified": "2026-01-01", "VersionId": None,
           "StorageClass": "STANDARD", "name": "b/k", "type": "file"}


def test_every_backend_is_one_module_that_defines_store() -> None:
    modules = sorted(m.name for m in pkgutil.iter_modules(stores.__path__) if not m.name.startswith("_"))
    assert [s.name for s in backends()] == ["gcs", "hub", "local", "memory", "s3"]
    assert len(modules) == len(backends())


@pytest.mark.parametrize(("where", "name"), [
    ("/tmp/x", "local"), ("relative/x", "local"), ("file:///tmp/x", "local"), ("gs://b/k", "gcs"),
    ("gcs://b/k", "gcs"), ("s3://b/k", "s3"), ("s3a://b/k", "s3"), ("memory://x", "memory"), ("hf://org/repo", "hub"),
    ("abfs://c/k", "other"),
])
def test_a_uri_names_its_store(where: str, name: str) -> None:
    assert store_for(where).name == name


def test_a_filesystem_names_its_store() -> None:
    assert store_for(fsspec.filesystem("file")).local
    assert store_for(fsspec.filesystem("memory")).name == "memory"
    assert store_named("gs").name == "gcs" and store_named("nope") is OTHER


def test_os_path_is_the_one_local_test() -> None:
    assert os_path("/tmp/x") == "/tmp/x" and os_path("file:///tmp/x") == "/tmp/x"
    assert os_path("gs://b/k") is None and os_path("memory://x") is None


def test_checksums_each_store_reports() -> None:
    assert store_named("gs").checksum(GCS_INFO) == StoreChecksum("crc32c", "AAAAAA==")
    assert store_named("s3").checksum(S3_INFO) == StoreChecksum("md5-hex", "acbd18db4cc2f85cedef654fccc4a4d8")
    assert store_named("s3").checksum({**S3_INFO, "ETag": '"acbd18db4cc2f85cedef654fccc4a4d8-2"'}) is None
    assert store_named("file").checksum({"size": 3, "mtime": 1.0}) is None
    assert OTHER.checksum(GCS_INFO) == StoreChecksum("crc32c", "AAAAAA==")
    assert OTHER.checksum(S3_INFO) == StoreChecksum("md5-hex", "acbd18db4cc2f85cedef654fccc4a4d8")


def test_stamps_keep_their_keys_and_order() -> None:
    assert list(store_named("gs").stamp(GCS_INFO)) == ["size", "generation", "crc32c", "md5Hash", "etag", "mtime"]
    assert store_named("s3").stamp(S3_INFO) == {"size": "3", "ETag": S3_INFO["ETag"], "LastModified": "2026-01-01"}
    assert store_named("file").stamp({"size": 3, "mtime": 1.5, "created": 1.0, "ino": 7}) == \
        {"size": "3", "mtime": "1.5", "created": "1.0"}
    assert OTHER.stamp(GCS_INFO) == store_named("gs").stamp(GCS_INFO)


def test_digests_worth_hashing_while_writing() -> None:
    gcs, s3 = store_named("gs").digests(1 << 30), store_named("s3").digests(1 << 20)
    assert gcs is not None and [c.kind for c in gcs.checksums()] == ["crc32c"]
    assert s3 is not None and [c.kind for c in s3.checksums()] == ["md5-base64", "md5-hex"]
    assert store_named("s3").digests(50 << 20) is None  # sent in parts: the ETag is not the md5
    assert store_named("file").digests(1) is None and store_named("memory").digests(1) is None
    assert OTHER.digests(1) is None
    assert store_named("s3").reports_md5 and not store_named("gs").reports_md5


class _Refused(Exception):
    def __init__(self, code: int) -> None:
        self.code = code


class _Upload:
    def __init__(self, **session: object) -> None:
        self.__dict__.update(session)


def test_a_broken_session_is_the_stores_own_rule() -> None:
    gcs, s3 = store_named("gs"), store_named("s3")
    assert gcs.session_broke(_Upload(location="https://x"), _Refused(400))
    assert gcs.session_broke(_Upload(location="https://x"), _Refused(410))
    assert not gcs.session_broke(_Upload(location=None), _Refused(404))  # no session yet: a missing bucket
    assert not gcs.session_broke(_Upload(location="https://x"), _Refused(403))
    assert s3.session_broke(_Upload(mpu={"UploadId": "u"}), _Refused(404))
    assert not s3.session_broke(_Upload(location="https://x"), _Refused(404))
    assert OTHER.session_broke(_Upload(mpu={"UploadId": "u"}), FileNotFoundError("gone"))
    assert not store_named("file").session_broke(_Upload(location="x"), _Refused(404))
