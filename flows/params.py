"""The lifecycle flow's parameters: pydantic models with titles, descriptions and defaults.

A Prefect UI run of a lifecycle deployment renders these as a form; the CLI and the watcher's event
fill the same fields. Values are checked when a model is built, so a bad form fails before any work.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)


class _Options(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ValidationOptions(_Options):
    """How the source checkpoint is checked before anything is built from it."""

    deep: bool = Field(
        default=False,
        title="Deep scan",
        description="Also read every fp32 weight and optimizer moment and fail on NaN or Inf (reads the whole checkpoint).",
    )
    settle_seconds: float = Field(
        default=300.0,
        ge=0,
        title="Settle time (seconds)",
        description="When rank files are still missing (a bucket sync delivers `latest` first), wait and check again "
        "for up to this long before failing. 0 fails at once.",
    )
    poll_seconds: float = Field(
        default=15.0,
        gt=0,
        title="Re-check interval (seconds)",
        description="How long to wait between checks while rank files are still arriving.",
    )


class ConsolidationOptions(_Options):
    """The Hugging Face model built from the ZeRO checkpoint."""

    enabled: bool = Field(
        default=True,
        title="Consolidate",
        description="Build a Hugging Face safetensors model from the checkpoint's fp32 master weights.",
    )
    dtype: Literal["bf16", "fp16", "fp32"] = Field(
        default="bf16", title="Output dtype", description="Floating-point dtype of the consolidated weights."
    )
    max_shard_size: str = Field(
        default="5GB",
        title="Max shard size",
        description="Largest safetensors file to write, e.g. '5GB' or '500MB'.",
    )
    exclude_frozen: bool = Field(
        default=False,
        title="Exclude frozen parameters",
        description="Leave parameters that were frozen during training out of the model.",
    )
    workers: int = Field(
        default=4, ge=1, le=64, title="Workers", description="Output shards written at the same time."
    )
    deployment: str | None = Field(
        default=None,
        title="GPU deployment",
        description="Run consolidation and verification as this deployment ('flow-name/deployment-name', e.g. "
        "'consolidate-checkpoint/gpu') on its work pool instead of in this flow run. Empty runs them here.",
    )

    @field_validator("max_shard_size")
    @classmethod
    def _size(cls, value: str) -> str:
        if not _SIZE_RE.match(value):
            raise ValueError(f"max_shard_size must look like '5GB' or '500MB', got {value!r}")
        return value.strip()


class ReshardOptions(_Options):
    """ZeRO checkpoints rewritten for other data-parallel world sizes."""

    world_sizes: list[int] = Field(
        default_factory=list,
        title="Target world sizes",
        description="Write the checkpoint again for each of these data-parallel world sizes (e.g. [1, 4]), "
        "so training can resume on a different number of GPUs. Empty writes none.",
    )

    @field_validator("world_sizes")
    @classmethod
    def _sizes(cls, value: list[int]) -> list[int]:
        if any(n < 1 for n in value):
            raise ValueError(f"world sizes must be at least 1, got {value}")
        return sorted(set(value))


class VerificationOptions(_Options):
    """The check of the consolidated model against the checkpoint."""

    enabled: bool = Field(
        default=True,
        title="Verify",
        description="Load the consolidated model with transformers, compare its weights with the checkpoint's and "
        "run a forward pass on a fixed input (on CUDA when present), requiring finite logits.",
    )
    device: str | None = Field(
        default=None,
        title="Device",
        description="Torch device for the forward pass ('cuda', 'cpu'); empty picks CUDA when present.",
    )


class Destination(_Options):
    """One place to publish to."""

    uri: str = Field(
        title="Destination",
        description="A Hugging Face Hub repo ('hf://org/name') or a bucket or folder URL ('gs://bucket/models/run-a', "
        "'s3://...', a local path). Bucket outputs go under '<uri>/<tag>/'.",
    )
    what: Literal["model", "reshards", "both"] = Field(
        default="model",
        title="What to publish",
        description="The consolidated model, the resharded checkpoints, or both.",
    )
    revision: str | None = Field(
        default=None, title="Revision", description="Hub branch to push to; empty uses the repo's default branch."
    )
    private: bool = Field(default=False, title="Private", description="Create a missing Hub repo as private.")

    @field_validator("uri")
    @classmethod
    def _uri(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("a destination needs a URI")
        return value.strip().rstrip("/")

    @property
    def is_hub(self) -> bool:
        return self.uri.startswith("hf://")

    def includes(self, kind: Literal["model", "reshards"]) -> bool:
        return self.what in (kind, "both")


class PublishOptions(_Options):
    """How uploads run."""

    workers: int = Field(default=8, ge=1, le=64, title="Upload workers", description="Files uploaded at the same time.")
    hub_endpoint: str | None = Field(
        default=None,
        title="Hub endpoint",
        description="Hugging Face Hub URL for 'hf://' destinations; empty uses huggingface.co (or HF_ENDPOINT).",
    )
    hub_token_secret: str | None = Field(
        default=None,
        title="Hub token secret",
        description="Name of a Prefect Secret block holding the Hub token; empty uses HF_TOKEN or the local login.",
    )
