"""What tasks hand each other: small, JSON-serializable records of what was checked and built where."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class _Record(BaseModel):
    model_config = ConfigDict(frozen=True)


class Checkpoint(_Record):
    """A validated ZeRO checkpoint: where it is and what its files were when it was checked."""

    source: str = Field(description="The URI the flow was given.")
    root: str = Field(description="The folder holding `latest` and the tag folder.")
    tag: str = Field(description="The tag folder that was validated.")
    identity: str = Field(description="Digest of the tag folder's listing (names, sizes, storage versions).")
    stage: int
    world_size: int
    precision: str
    step: int | None = None
    summary: dict[str, Any] = Field(default_factory=dict)

    @property
    def uri(self) -> str:
        return f"{self.root.rstrip('/')}/{self.tag}"

    def cache_identity(self) -> dict[str, str]:
        """What a cache key depends on: the source, the tag and the files' identity."""
        return {"root": self.root, "tag": self.tag, "identity": self.identity}


class Output(_Record):
    """Something a task wrote: a consolidated model or a resharded checkpoint."""

    kind: str = Field(description="'model' or 'reshard'.")
    uri: str
    world_size: int | None = None
    files: int | None = None
    bytes: int | None = None
    details: dict[str, Any] = Field(default_factory=dict)

    def cache_identity(self) -> dict[str, Any]:
        return {"kind": self.kind, "uri": self.uri, "world_size": self.world_size, "files": self.files,
                "bytes": self.bytes}


class Published(_Record):
    """One push of one output to one destination."""

    source: str
    destination: str
    kind: str
    files: int | None = None
    bytes: int | None = None
    revision: str | None = None
    url: str | None = None
    details: dict[str, Any] = Field(default_factory=dict)
