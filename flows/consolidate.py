"""`consolidate_checkpoint`: consolidation and verification as a flow of their own.

This is what the GPU deployment runs (`infra/prefect.yaml`, work pool `gpu`): the lifecycle flow
starts it with `run_deployment` when `consolidation.deployment` is set, so the conversion and the
forward pass happen on a machine with a GPU while the rest of the lifecycle runs elsewhere. The
output folder must be where both can reach it (a bucket URL).
"""

from typing import Any

from prefect import flow, tags
from prefect.task_runners import ThreadPoolTaskRunner

from flows.params import ConsolidationForm, VerificationForm, flow_timeout_seconds
from tasks.consolidate import consolidate_model
from tasks.models import Checkpoint
from tasks.verify import verify_output


@flow(
    name="consolidate-checkpoint",
    task_runner=ThreadPoolTaskRunner(max_workers=32),
    persist_result=True,  # the lifecycle flow that started this run reads its result back
    timeout_seconds=flow_timeout_seconds(),
    log_prints=False,
)
def consolidate_checkpoint(
    checkpoint: Checkpoint,
    out: str,
    consolidation: ConsolidationForm = ConsolidationForm(),
    verification: VerificationForm = VerificationForm(),
) -> dict[str, Any]:
    """Consolidate a validated checkpoint into a Hugging Face model folder, then verify it.

    Args:
        checkpoint: The validated checkpoint (as the lifecycle flow's validation step returns it).
        out: The model folder to write; it must not exist yet. A bucket URL when the caller runs elsewhere.
        consolidation: Output dtype, shard size and parallelism (its `deployment` field is ignored here).
        verification: Whether and where to load the model and run the forward pass.
    """
    model = consolidate_model(
        checkpoint, out, dtype=consolidation.dtype, max_shard_size=consolidation.max_shard_size,
        exclude_frozen=consolidation.exclude_frozen, workers=consolidation.workers,
        config=consolidation.config or None, config_revision=consolidation.config_revision or None,
        qkv_layout=consolidation.layout,
    )
    verified = None
    if verification.enabled:
        with tags("gpu"):  # the one step here that needs the GPU: `prefect concurrency-limit create gpu N`
            verified = verify_output(checkpoint, model, device=verification.device or None)
    return {"model": model.model_dump(mode="json"), "verification": verified}
