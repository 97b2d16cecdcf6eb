"""Cache keys on (source URI, tag, content identity, options): the same checkpoint is never built twice.

A task given `cache_key_fn=checkpoint_cache_key` is keyed on its name and its parameters, where a
`Checkpoint` parameter counts only by its root, tag and content identity (the digest of its tag
folder's listing, see `ckptflow.watch.content_identity`): a checkpoint whose files are rewritten gets
a new key, one that is only re-validated keeps its key. Setting a cache key turns on result
persistence, so a flow run again for the same checkpoint reads the finished steps' results back.

Results go to Prefect's result storage (`PREFECT_LOCAL_STORAGE_PATH` by default; set
`PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK` so that workers on different machines share it).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import BaseModel

# Bump to invalidate every cached result when the meaning of a task's output changes (the workspace
# folders are named after it too, `flows.paths`, so no step takes an output built before the bump).
CACHE_VERSION = "1"


# Parameters that say where work runs, not what it makes: a model built on a Dask cluster is the same
# bytes as one built on threads, so they are left out of the key.
WHERE_IT_RUNS = frozenset({"cluster"})

# Options added to a task (or to a form section it takes) after results were cached, and the values
# that mean "not set": left out of the key while not set, so that a result cached before the option
# existed still matches (else the step runs again into an output folder that already exists, and fails).
ADDED_LATER: dict[str, tuple[Any, ...]] = {"tensor_parallel": (None,), "stage": (None,), "config": (None, ""),
                                           "config_revision": (None, ""), "pipeline_parallel": (None,),
                                           "expert_parallel": (None,), "partition_method": (None,),
                                           "pipeline_layers": (None,), "qkv_layout": (None, "unknown"),
                                           "layer_types": (None, ""), "tied_modules": (None, "")}


def _unset(name: str, value: Any) -> bool:
    return name in ADDED_LATER and any(value is v or value == v for v in ADDED_LATER[name])


def checkpoint_cache_key(context: Any, parameters: dict[str, Any]) -> str:
    """Prefect `cache_key_fn`: the task's name and its parameters, checkpoints by identity."""
    name = getattr(getattr(context, "task", None), "name", "task")
    payload = {k: _identity(v) for k, v in sorted(parameters.items())
               if not callable(v) and k not in WHERE_IT_RUNS and not _unset(k, v)}
    text = json.dumps([CACHE_VERSION, name, payload], sort_keys=True, default=str)
    return f"ckptflow-{name}-{hashlib.sha256(text.encode()).hexdigest()[:32]}"


def _identity(value: Any) -> Any:
    cache_identity = getattr(value, "cache_identity", None)
    if callable(cache_identity):
        return cache_identity()
    if isinstance(value, BaseModel):
        return {k: _identity(getattr(value, k)) for k in type(value).model_fields if not _unset(k, getattr(value, k))}
    if isinstance(value, dict):
        return {str(k): _identity(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_identity(v) for v in value]
    return value
