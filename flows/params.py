"""The lifecycle flow's parameters: pydantic models with titles, descriptions and defaults.

A Prefect UI run of a lifecycle deployment renders these as a form; the CLI and the watcher's event
fill the same fields. Values are checked when a model is built, so a bad form fails before any work.

For the form:
- Every field has a title and a description (markdown: no angle brackets, which the UI drops as HTML).
- Optional text is `Text`: a plain string whose empty value means "not set" (`None` from Python is
  taken as empty). A `str | None` field renders as a type toggle with 'Property is type "None"', and a
  null in a run's parameters fails the server's schema check.
- Constraints a form can check (shard-size pattern, world sizes >= 1, worker counts) are in the JSON
  schema, not only in validators.
"""

from __future__ import annotations

import os
import re
from typing import Annotated, Any, Literal

from prefect.blocks.system import Secret
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from ckptflow import DEFAULT_DTYPE
from ckptflow.reshard.pipeline_layers import MAX_TIED_TEXT, MAX_TYPES_TEXT, check_method, parse_layer_types
from ckptflow.reshard.pipeline_layers import tied_modules as parse_tied
from ckptflow.reshard.shape import Target

# A size such as '5GB', '500MB', '2GiB' or a byte count, as a JSON-schema pattern (no regex flags there).
SIZE_PATTERN = r"^\s*[0-9]+(\.[0-9]+)?\s*([KkMmGgTt][Ii]?[Bb]|[Bb])?\s*$"
_SIZE_RE = re.compile(SIZE_PATTERN)


def _text(value: Any) -> Any:
    """None -> '', surrounding space stripped: the empty string is "not set"."""
    if value is None:
        return ""
    return value.strip() if isinstance(value, str) else value


def flow_timeout_seconds() -> float:
    """The time limit of every ckptflow flow run: `$CKPTFLOW_FLOW_TIMEOUT_HOURS` (default 24) on the worker."""
    return float(os.environ.get("CKPTFLOW_FLOW_TIMEOUT_HOURS", "24")) * 3600


Text = Annotated[str, BeforeValidator(_text)]
"""Optional text for the form: a plain input; empty means not set."""

WorldSize = Annotated[int, Field(ge=1, le=65536)]
# A parallel degree of a reshard target; 0 keeps the source's (a number field has no "empty" in the form).
Degree = Annotated[int, Field(ge=0, le=65536)]


class _Form(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ValidationForm(_Form):
    """How the source checkpoint is checked before anything is built from it."""

    deep: bool = Field(
        default=False,
        title="Deep scan",
        description="Also read every fp32 weight and optimizer moment and fail on NaN or Inf "
                    "(reads the whole checkpoint).",
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


QkvLayout = Literal["unknown", "blocks", "groups"]


def declared(layout: QkvLayout) -> str | None:
    """The query_key_value layout a form declares, None for unknown (what the core takes)."""
    return None if layout == "unknown" else layout


def _qkv_layout(when: str, refused: str) -> Any:
    """The form field of Megatron's fused query_key_value layout (`formats.deepspeed.qkv`), "unknown" by default."""
    return Field(
        default="unknown",
        title="Megatron query_key_value layout",
        description=f"{when}: how each rank holds its fused query_key_value's rows, which no file records: blocks "
        "([q | k | v] of the rank's heads; Megatron-DeepSpeed since December 2024) or groups (key/value group by "
        f"group; before). Unknown refuses {refused}.",
    )


class ConsolidationForm(_Form):
    """The Hugging Face model built from the ZeRO checkpoint."""

    enabled: bool = Field(
        default=True,
        title="Consolidate",
        description="Build a Hugging Face safetensors model from the checkpoint's fp32 master weights.",
    )
    dtype: Literal["bf16", "fp16", "fp32"] = Field(
        default=DEFAULT_DTYPE, title="Output dtype", description="Floating-point dtype of the consolidated weights."
    )
    max_shard_size: str = Field(
        default="5GB",
        title="Max shard size",
        description="Largest safetensors file to write, e.g. '5GB' or '500MB'.",
        pattern=SIZE_PATTERN,
    )
    exclude_frozen: bool = Field(
        default=False,
        title="Exclude frozen parameters",
        description="Leave parameters that were frozen during training out of the model.",
    )
    workers: int = Field(
        default=4, ge=1, le=64, title="Workers", description="Output shards written at the same time."
    )
    config: Text = Field(
        default="",
        title="Config source",
        description="Where config.json, generation_config.json and the tokenizer files come from when the checkpoint "
        "has none (DeepSpeed's save_checkpoint, Accelerate and Lightning write none): a folder or bucket URL, or a "
        "Hugging Face Hub model repo ('org/name'). Its config.json is checked against the checkpoint's tensors before "
        "anything is written. Files of a kind the checkpoint has (config, generation config, tokenizer) stay the "
        "checkpoint's. Empty: the checkpoint's own files only; a model without config.json cannot be loaded with "
        "from_pretrained (and fails verification).",
    )
    config_revision: Text = Field(
        default="",
        title="Config revision",
        description="Branch, tag or commit of the Hub repo named in Config source; empty uses its default branch.",
    )
    qkv_layout: QkvLayout = _qkv_layout("Of a Megatron-DeepSpeed checkpoint at tensor-parallel degree 2 or more",
                                        "such a checkpoint")
    deployment: Text = Field(
        default="",
        title="GPU deployment",
        description="Run consolidation and verification as this deployment ('flow-name/deployment-name', e.g. "
        "'consolidate-checkpoint/gpu') on its work pool instead of in this flow run. The run fails at once "
        "when no worker is polling that pool. Empty runs them here.",
    )

    timeout_minutes: float = Field(
        default=360,
        gt=0,
        title="GPU run time limit (minutes)",
        description="With a GPU deployment: how long to wait for its run, waiting for a worker included, before "
        "cancelling it and failing.",
    )

    @property
    def layout(self) -> str | None:
        """The declared query_key_value layout, None for unknown."""
        return declared(self.qkv_layout)

    @field_validator("max_shard_size", mode="before")
    @classmethod
    def _size(cls, value: Any) -> Any:
        if isinstance(value, str) and not _SIZE_RE.match(value):
            raise ValueError(f"max_shard_size must look like '5GB' or '500MB', got {value!r}")
        return value.strip() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _revision_of_a_source(self) -> ConsolidationForm:
        if self.config_revision and not self.config:
            raise ValueError(f"config_revision {self.config_revision!r} needs a config source: the Hub repo it is a "
                             "revision of")
        return self


class ReshardForm(_Form):
    """ZeRO checkpoints rewritten for other numbers of GPUs: each target a shape (ranks, and the ZeRO
    stage and the tensor-, pipeline- and expert-parallel degrees when they change)."""

    world_sizes: list[WorldSize] = Field(
        default_factory=list,
        title="Target world sizes",
        description="Write the checkpoint again for each of these numbers of ranks (e.g. [1, 4]; tp x pp x dp, "
        "as the launcher counts them), so training can resume on a different number of GPUs. Empty writes none.",
    )

    zero_stage: Literal["source", "1", "2", "3"] = Field(
        default="source",
        title="ZeRO stage",
        description="Write each target at this ZeRO stage (e.g. 3, to fit fewer GPUs), or at the source's. "
        "Another stage is written to zero-wsN-zS.",
    )

    @property
    def stage(self) -> int | None:
        """The ZeRO stage to write, or None to keep the source's."""
        return None if self.zero_stage == "source" else int(self.zero_stage)

    tensor_parallel_degree: Degree = Field(
        default=0,
        title="Tensor-parallel degree",
        description="The tensor-parallel degree of each target (AutoTP: 1 merges the shards); 0 keeps the "
        "source's. Written to zero-wsN-tpT. The data-parallel degree is what the ranks leave: N / (tp x pp).",
    )
    pipeline_parallel_degree: Degree = Field(
        default=0,
        title="Pipeline stages",
        description="The pipeline-parallel degree of each target (PipelineModule); 0 keeps the source's. "
        "Written to zero-wsN-ppP.",
    )
    partition_method: str = Field(
        default="",
        title="Pipeline partition method",
        description="With another number of pipeline stages: the PipelineModule's partition_method, as in "
        "training (parameters, uniform, type:REGEX with the layer types below, or type:transformer for a "
        "Megatron-DeepSpeed GPT); the layers are assigned "
        "to the stages as it assigns them. Empty: the one the model's own run uses (PipelineModule's parameters; "
        "a Megatron-DeepSpeed GPT's type:transformer, or the pp_partition_method its args record).",
        max_length=200,
    )
    pipeline_layers: Degree = Field(
        default=0,
        title="Pipeline layers",
        description="With another number of pipeline stages: the length of the PipelineModule's layer list, where "
        "its files leave it open (layers that are functions save none); 0: what the files allow.",
    )
    layer_types: str = Field(
        default="",
        title="Pipeline layer types",
        description="With another number of pipeline stages and a type:REGEX partition method: the class (or "
        "function) name of each entry of the PipelineModule's layer list, in order, which no file records; "
        "comma-separated, NAME*N for N in a row (e.g. Embed,Block*3,LayerNorm,Embed). Empty: none declared.",
        max_length=MAX_TYPES_TEXT,
    )
    tied_modules: str = Field(
        default="",
        title="Pipeline tied modules",
        description="Of an fp32 ZeRO-0 PipelineModule (plain or Megatron-style) written at ZeRO-1: each "
        "TiedLayerSpec key and the index of the first layer that uses it (whose layer file holds it), which no "
        "ZeRO-0 file records; comma-separated KEY=LAYER (e.g. embed=0). Empty: none declared (a pipeline without "
        "tied modules needs none, nor a bf16 one, whose optimizer files name them).",
        max_length=MAX_TIED_TEXT,
    )
    qkv_layout: QkvLayout = _qkv_layout("With another tensor-parallel degree of a Megatron-DeepSpeed checkpoint",
                                        "such a change")
    expert_parallel_degree: Degree = Field(
        default=0,
        title="Expert-parallel degree",
        description="The expert-parallel degree of each target (AutoEP, deepspeed.moe): it must divide every "
        "layer's experts and the data-parallel ranks; 0 keeps the source's. Written to zero-wsN-epE.",
    )
    merge_tensor_parallel: bool = Field(
        default=False,
        title="Merge tensor parallelism (AutoTP)",
        description="The same as tensor-parallel degree 1, kept for deployments saved with it: AutoTP "
        "checkpoints only, training resumes without tensor parallelism at each world size.",
    )

    @property
    def tensor_parallel(self) -> int | None:
        """The tensor-parallel degree to write, or None to keep the source's."""
        return self.tensor_parallel_degree or (1 if self.merge_tensor_parallel else None)

    def targets(self) -> list[Target]:
        """One target shape per world size."""
        pipeline = {"partition_method": self.partition_method or None, "pipeline_layers": self.pipeline_layers or None,
                    "layer_types": self.layer_types or None, "tied_modules": self.tied_modules or None}
        return [Target(world_size=n, stage=self.stage, tp=self.tensor_parallel,
                       pp=self.pipeline_parallel_degree or None, ep=self.expert_parallel_degree or None,
                       qkv_layout=declared(self.qkv_layout), **pipeline)
                for n in self.world_sizes]

    @model_validator(mode="after")
    def _one_tensor_parallel_degree(self) -> ReshardForm:
        if self.merge_tensor_parallel and self.tensor_parallel_degree not in (0, 1):
            raise ValueError(f"merge_tensor_parallel asks for tensor-parallel degree 1, but "
                             f"tensor_parallel_degree is {self.tensor_parallel_degree}: set one of them")
        return self

    @field_validator("partition_method", "layer_types", "tied_modules")
    @classmethod
    def _pipeline_choice(cls, value: str, info: ValidationInfo) -> str:
        if value:  # `ValueError` in one line where malformed
            {"partition_method": check_method, "layer_types": parse_layer_types,
             "tied_modules": parse_tied}[info.field_name or ""](value)
        return value

    @field_validator("world_sizes")
    @classmethod
    def _sizes(cls, value: list[int]) -> list[int]:
        if any(n < 1 for n in value):
            raise ValueError(f"world sizes must be at least 1, got {value}")
        return sorted(set(value))


class VerificationForm(_Form):
    """The check of the consolidated model against the checkpoint."""

    enabled: bool = Field(
        default=True,
        title="Verify",
        description="Load the consolidated model with transformers, compare its weights with the checkpoint's and "
        "run a forward pass on a fixed input (on CUDA when present), requiring finite logits.",
    )
    device: Text = Field(
        default="",
        title="Device",
        description="Torch device for the forward pass ('cuda', 'cpu'); empty picks CUDA when present.",
    )


class Destination(_Form):
    """One place to publish to."""

    uri: str = Field(
        title="Destination URI",
        description="A Hugging Face Hub repo ('hf://org/name') or a bucket or folder URL ('gs://bucket/models/run-a', "
        "'s3://...', a local path). A bucket or folder gets `URI/TAG/model` and `URI/TAG/zero-wsN`; a Hub repo gets "
        "the model on its revision and resharded checkpoint N on the branch `zero-wsN`.",
        min_length=1,
    )
    what: Literal["model", "reshards", "both"] = Field(
        default="model",
        title="What to publish",
        description="The consolidated model, the resharded checkpoints, or both.",
    )
    revision: Text = Field(
        default="", title="Revision", description="Hub branch to push to; empty uses the repo's default branch."
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


class PublishForm(_Form):
    """How uploads run."""

    workers: int = Field(default=8, ge=1, le=64, title="Upload workers", description="Files uploaded at the same time.")
    hub_endpoint: Text = Field(
        default="",
        title="Hub endpoint",
        description="Hugging Face Hub URL for 'hf://' destinations; empty uses huggingface.co (or HF_ENDPOINT).",
    )
    hub_token: Secret | None = Field(
        default=None,
        title="Hub token",
        description="A Prefect Secret block holding a Hugging Face token with write access; none uses the worker's "
        "HF_TOKEN or its `hf auth login`. In prefect.yaml: `{\"$ref\": {\"block_document_slug\": \"secret/NAME\"}}`.",
        json_schema_extra=lambda schema: _block_picker(schema),
    )

    @model_serializer(mode="wrap")
    def _without_unset_token(self, handler: Any) -> dict[str, Any]:
        """No `hub_token: null` in the form's defaults or a run's parameters (the server's schema check
        refuses a null where a block is expected)."""
        data = handler(self)
        if data.get("hub_token") is None:
            data.pop("hub_token", None)
        return data

    @property
    def hub_token_block(self) -> str | None:
        """The Secret block's name, for tasks that load it themselves (a token never travels as a parameter)."""
        if self.hub_token is None:
            return None
        return getattr(self.hub_token, "_block_document_name", None)


def _block_picker(schema: dict[str, Any]) -> None:
    """`anyOf: [block, null]` -> the block's reference alone, so the form shows a block picker, not a type toggle."""
    options = schema.pop("anyOf", None) or []
    refs = [o for o in options if "$ref" in o]
    if refs:
        schema.update(refs[0])
    schema.pop("default", None)
