"""Where the lifecycle flow writes and publishes: the workspace folders and the destinations.

Workspace (outputs before publishing; a bucket URL when a GPU deployment writes the model)::

    <workspace>/<run-slug>/<tag>-<identity>/model-<dtype>-<options digest>/
    <workspace>/<run-slug>/<tag>-<identity>/zero-ws<N>[-<shape and choices>]/  (`reshard_name`)

The content identity in the path means a checkpoint rewritten under the same tag builds into a fresh
folder, and so does a new `tasks.caching.CACHE_VERSION`. So a folder found there holds this checkpoint's
output: a step whose cached result is gone (another machine, a cleared result store) takes it as it is
when it holds what the step would write (`committed_output` of the consolidate and reshard cores).

Destinations: a bucket or folder URL gets `<uri>/<tag>/model/` and `<uri>/<tag>/zero-ws<N>/`; a Hub
repo gets the model on its revision (default branch when empty) and resharded checkpoint N on the
branch `zero-ws<N>` (or `<revision>-zero-ws<N>`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

from ckptflow.plumbing.storage import join, open_fs
from ckptflow.reshard.shape import Target
from flows.params import ConsolidationForm, Destination
from tasks.caching import CACHE_VERSION
from tasks.models import Checkpoint

WORKSPACE_ENV = "CKPTFLOW_WORKSPACE"


def default_workspace() -> str:
    """`$CKPTFLOW_WORKSPACE`, else `~/.cache/ckptflow/work` on the machine running the flow."""
    return os.environ.get(WORKSPACE_ENV) or str(Path.home() / ".cache" / "ckptflow" / "work")


def run_slug(root: str) -> str:
    """A readable, unique folder name for a run folder URI: its last two parts and a digest."""
    parts = [p for p in re.split(r"[/:]+", root) if p and p not in (".", "..")]
    readable = re.sub(r"[^A-Za-z0-9._-]+", "-", "-".join(parts[-2:]))[:80].strip("-.") or "run"
    return f"{readable}-{hashlib.sha256(root.encode()).hexdigest()[:8]}"


def checkpoint_workspace(checkpoint: Checkpoint, workspace: str | None) -> str:
    """The folder a checkpoint's outputs are built in: named after its run, tag and content identity, and
    after the cache version when that is past 1 (outputs whose meaning changed are built afresh)."""
    version = "" if CACHE_VERSION == "1" else f"-v{CACHE_VERSION}"
    return join(workspace or default_workspace(), run_slug(checkpoint.root),
                f"{checkpoint.tag}-{checkpoint.identity[:12]}{version}")


def model_folder(base: str, options: ConsolidationForm) -> str:
    shape: dict[str, object] = {"max_shard_size": options.max_shard_size, "exclude_frozen": options.exclude_frozen}
    if options.config:  # a config source changes the folder's files; no key without one keeps older digests
        shape.update(config=options.config, config_revision=options.config_revision)
    if options.layout is not None:  # likewise a declared query_key_value layout: its rows' order
        shape.update(qkv_layout=options.layout)
    digest = hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:6]
    return join(base, f"model-{options.dtype}-{digest}")


def reshard_name(target: Target) -> str:
    """'zero-ws4', 'zero-ws4-tp1' for a reshard that also changed the tensor parallelism, 'zero-ws4-pp1-ep2'
    for pipeline and expert parallelism, 'zero-ws4-z3' for another ZeRO stage: the shape, by what changes.
    Then the choices that change the bytes written along an axis that changes, so two of them never share
    a folder (which `committed_output` could not tell apart: the same files at the same sizes): with the
    pipeline stages, the partition method, layer count and declared layer types ('-uniform-L6', '-types-' and
    a digest of them); the declared tied modules of a ZeRO-0 PipelineModule ('-tied-' and a digest); with
    the tensor-parallel degree, the declared query_key_value layout ('-qkv-blocks'). Only characters a path
    part and a git ref take: a method that is not one word is named by a digest."""
    degrees = "".join(f"-{axis}{degree}" for axis, degree in (("tp", target.tp), ("pp", target.pp), ("ep", target.ep))
                      if degree is not None)
    name = f"zero-ws{target.world_size}{degrees}" + (f"-z{target.stage}" if target.stage is not None else "")
    if target.pp is not None and target.partition_method is not None:
        name += f"-{_method_part(target.partition_method)}"
    if target.pp is not None and target.pipeline_layers is not None:
        name += f"-L{target.pipeline_layers}"
    if target.pp is not None and target.layer_types is not None:
        name += f"-types-{hashlib.sha256(target.layer_types.encode()).hexdigest()[:8]}"
    if target.tied_modules is not None:
        name += f"-tied-{hashlib.sha256(target.tied_modules.encode()).hexdigest()[:8]}"
    if target.tp is not None and target.qkv_layout is not None:
        name += f"-qkv-{target.qkv_layout}"
    return name


def _method_part(method: str) -> str:
    """A partition method as part of a folder and Hub branch name: "uniform", "type:transformer" as
    "type-transformer", anything else as "method-" and a digest of it."""
    if re.fullmatch(r"(type:)?[A-Za-z0-9_]+", method):
        return method.replace(":", "-")
    return f"method-{hashlib.sha256(method.encode()).hexdigest()[:8]}"


def reshard_folder(base: str, target: Target) -> str:
    return join(base, reshard_name(target))


def model_destination(dest: Destination, tag: str) -> tuple[str, str | None]:
    """(URI, revision) the model goes to."""
    if dest.is_hub:
        return dest.uri, dest.revision
    return join(dest.uri, tag, "model"), None


def reshard_destination(dest: Destination, tag: str, target: Target) -> tuple[str, str | None]:
    """(URI, revision) the checkpoint resharded to `target` goes to."""
    branch = reshard_name(target)
    if dest.is_hub:
        return dest.uri, f"{dest.revision}-{branch}" if dest.revision else branch
    return join(dest.uri, tag, branch), None


def published_marker(uri: str) -> str:
    """The file whose presence says a push to the bucket destination `uri` completed."""
    from ckptflow.publish.manifest import MANIFEST_NAME

    return join(uri, MANIFEST_NAME)


def exists(uri: str) -> bool:
    """True when something is at `uri` (a cached step's output folder is still there)."""
    fs, path = open_fs(uri)
    fs.invalidate_cache(path)
    return bool(fs.exists(path))


def remove(uri: str) -> None:
    """Remove the folder `uri` if it is there (to rebuild it on `refresh`)."""
    fs, path = open_fs(uri)
    if fs.exists(path):
        fs.rm(path, recursive=True)
