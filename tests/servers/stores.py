"""Real servers on loopback for the publish tests, one of each per session.

- `gcs`: the gcp-storage-emulator behind a FaultProxy; gcsfs reaches it through
  STORAGE_EMULATOR_HOST and FSSPEC_GCS_TOKEN=anon, exactly as a user would configure it.
- `s3`: moto's ThreadedMotoServer behind a FaultProxy; s3fs reaches it through
  FSSPEC_S3_ENDPOINT_URL and dummy AWS keys.
- `hub`: the local Hub of `tests/servers/hub.py`, driven by the real huggingface_hub client.

Each test gets a fresh prefix (and bucket for S3) and faults switched off when it ends.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.servers.faultproxy import FaultProxy
from tests.servers.hub import HubServer

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
os.environ.setdefault("HF_HUB_DISABLE_XET", "1")

GCS_BUCKET = "ckptflow-test"
AWS_SECRET = "moto-secret-key-do-not-leak-7f3a9c"


@dataclass(frozen=True)
class Store:
    """A store under test: the proxy in front of it and a fresh `url` (bucket/prefix) for this test."""

    proxy: FaultProxy
    url: str
    env: dict[str, str]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _apply_env(env: dict[str, str]) -> None:
    """Set `env` for this process and its children, and refresh fsspec's defaults read from it."""
    import fsspec.config

    os.environ.update(env)
    fsspec.config.set_conf_env(fsspec.config.conf)


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[tuple[FaultProxy, dict[str, str]]]:
    from gcp_storage_emulator.server import create_server

    port = _free_port()
    server = create_server("127.0.0.1", port, in_memory=True, default_bucket=GCS_BUCKET)
    server.start()
    proxy = FaultProxy(port).start()
    env = {"STORAGE_EMULATOR_HOST": proxy.url, "FSSPEC_GCS_TOKEN": "anon", "FSSPEC_GCS_PROJECT": "test"}
    _apply_env(env)
    yield proxy, env
    proxy.stop()
    server.stop()


@pytest.fixture
def gcs(gcs_server: tuple[FaultProxy, dict[str, str]]) -> Iterator[Store]:
    proxy, env = gcs_server
    proxy.reset()
    yield Store(proxy=proxy, url=f"gs://{GCS_BUCKET}/{uuid.uuid4().hex[:12]}", env=env)
    proxy.reset()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[tuple[FaultProxy, dict[str, str]]]:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    proxy = FaultProxy(server.get_host_and_port()[1], xml_errors=True).start()
    env = {
        "FSSPEC_S3_ENDPOINT_URL": proxy.url,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": AWS_SECRET,
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    _apply_env(env)
    yield proxy, env
    proxy.stop()
    server.stop()


@pytest.fixture
def s3(s3_server: tuple[FaultProxy, dict[str, str]]) -> Iterator[Store]:
    import fsspec

    proxy, env = s3_server
    proxy.reset()
    bucket = f"ckptflow-{uuid.uuid4().hex[:12]}"
    fs = fsspec.filesystem("s3")
    fs.mkdir(bucket)
    yield Store(proxy=proxy, url=f"s3://{bucket}/run", env=env)
    proxy.reset()


@pytest.fixture(scope="session")
def hub_server() -> Iterator[HubServer]:
    server = HubServer().start()
    yield server
    server.stop()


@pytest.fixture
def hub(hub_server: HubServer) -> Iterator[HubServer]:
    hub_server.reset()
    yield hub_server
    hub_server.reset()
