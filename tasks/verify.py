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
from tasks.artifacts import checkpoint_key, table
from tasks.caching import checkpoint_cache_key
from tasks.models import Checkpoint, Output
from tasks.naming import in_form_words
from tasks.retries import io_retries


@task(
    name="verify",
    task_run_name="verify {checkpoint.tag} model",
    cache_key_fn=checkpoint_cache_key,
    persist_result=True,
    **io_retries(retries=2),
)
@in_form_words
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
        verification_rows(result),
        key=checkpoint_key("verification", checkpoint.root, checkpoint.tag),
        description=f"Verification of {model.uri} against {checkpoint.uri}: passed",
    )
    return result


def verification_rows(result: dict[str, Any]) -> list[dict[str, str]]:
    """A verification result as `check | result` rows a person reads (the lifecycle summary shows the same)."""
    labels = {
        "model_class": "loads as",
        "device": "device",
        "dtype": "dtype",
        "logits_shape": "forward pass",
        "tensors_compared": "tensors equal to the checkpoint's",
        "compared_to_source": "compared with the checkpoint",
        "verified_by": "verified by",
        "out": "model folder",
    }
    rows = []
    for key, label in labels.items():
        if key not in result:
            continue
        value = result[key]
        if key == "logits_shape":
            value = "finite logits " + " x ".join(str(n) for n in value)
        elif isinstance(value, bool):
            value = "yes" if value else "no"
        rows.append({"check": label, "result": str(value)})
    return rows
