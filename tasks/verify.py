"""The verification task: `ckptflow.verify.verify_model` on a consolidated model folder.

transformers loads the folder, runs a forward pass on a fixed input (on CUDA when present, or the
device asked for), requires finite logits and compares every loaded tensor with the checkpoint's
weights. Cached like the step it checks: the same model of the same checkpoint is verified once.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from prefect import get_run_logger, task

from ckptflow.verify import verify_model
from tasks.artifacts import artifact_key, table
from tasks.caching import checkpoint_cache_key
from tasks.models import Checkpoint, Output
from tasks.retries import io_retries


@task(
    name="verify",
    task_run_name="verify {model.uri}",
    cache_key_fn=checkpoint_cache_key,
    persist_result=True,
    **io_retries(retries=2),
)
def verify_output(checkpoint: Checkpoint, model: Output, *, device: str | None = None) -> dict[str, Any]:
    """Load `model` with transformers, run it, and compare it with `checkpoint`'s weights."""
    check = verify_model(model.uri, source=checkpoint.root, tag=checkpoint.tag, device=device)
    result = {"ok": True, **dataclasses.asdict(check)}
    result["logits_shape"] = list(check.logits_shape)
    get_run_logger().info(
        "%s loads as %s on %s (%s): finite logits %s, %d tensors equal to the checkpoint's",
        model.uri, check.model_class, check.device, check.dtype, check.logits_shape, check.tensors_compared,
    )
    table(
        [{"check": k, "result": str(v)} for k, v in result.items()],
        key=artifact_key("verification", checkpoint.tag),
        description=f"Verification of {model.uri} against {checkpoint.uri}",
    )
    return result
