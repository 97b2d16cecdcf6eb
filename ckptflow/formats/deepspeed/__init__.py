"""Opening a DeepSpeed checkpoint of any layout: resolve the tag, detect its topology, run its reader.

`inspect(uri)` gives the index (a `Partitioned`; for data-parallel ZeRO the `ZeroCheckpoint`), every
problem found, and where it looked; `read(uri)` the same and what the trainer's client state holds
(`client_state`); `load_index(uri)` is the same for callers that only want a good index. A folder
without `latest` that holds per-rank optimizer states saved with torch.save (seed 002) is read by
`readers.optimizer_shards` (its tag is ""). A layout that no reader handles yet is a problem that
names the layout and what to do instead, never "damaged". With `strict_pickle`, any global outside
DeepSpeed's allow-list is refused, client state included (`names.ALLOWED_STRICT`); without it, client
state is read as inert records (`formats.torch.inert`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from ckptflow.errors import CheckpointError, CheckpointNotFoundError, CkptflowError
from ckptflow.formats.deepspeed.client_state import ClientState
from ckptflow.formats.deepspeed.inspection import Inspection, Listing, Problem, StopReading, read_head
from ckptflow.formats.deepspeed.model import Partitioned, ZeroCheckpoint
from ckptflow.formats.deepspeed.names import allowed
from ckptflow.formats.deepspeed.output_dir import Choice, choose, folders_in
from ckptflow.formats.deepspeed.readers.autoep import read_autoep
from ckptflow.formats.deepspeed.readers.autotp import read_autotp
from ckptflow.formats.deepspeed.readers.moe import read_moe
from ckptflow.formats.deepspeed.readers.optimizer_shards import read_shard_folder
from ckptflow.formats.deepspeed.readers.pipeline import read_pipeline
from ckptflow.formats.deepspeed.readers.zero import read_zero
from ckptflow.formats.deepspeed.readers.zero0 import read_zero0
from ckptflow.formats.deepspeed.tag import resolve_tag
from ckptflow.formats.deepspeed.topology import Topology, detect
from ckptflow.plumbing.text import and_more

logger = logging.getLogger(__name__)

Reader = Callable[[Inspection, Listing, dict[str, Any], Topology], Partitioned]

# One reader per layout kind (see `detect`); a kind missing here is refused with `_unsupported`.
READERS: dict[str, Reader] = {
    "zero": lambda st, listing, model0, topology: (
        (read_zero0 if topology.stage == 0 else read_zero)(st, listing, model0)
    ),
    "autotp": read_autotp,
    "pipeline": read_pipeline,
    "megatron": read_pipeline,
    "autoep": read_autoep,
    "moe": read_moe,
}

_WHAT_TO_DO = {
    "tensor-parallel": "ckptflow needs to know how each parameter is split, and the checkpoint does not say: save "
                       "it with `universal_checkpoint_info` in the client state (as Megatron-DeepSpeed does), or "
                       "convert it with your framework's own tools",
}
_DEFAULT_WHAT_TO_DO = ("ckptflow cannot convert this layout yet: convert it with DeepSpeed's universal converter "
                       "(python -m deepspeed.checkpoint.ds_to_universal --input_folder <tag folder> --output_folder "
                       "<out>) and load that with `\"checkpoint\": {\"load_universal\": true}`")


@dataclass(frozen=True)
class Reading:
    """What reading a checkpoint found: its index (None when unusable), every problem, (root, tag)
    (None when the tag could not be resolved), what rank 0's client state holds, and, for a Trainer's
    output_dir, which `checkpoint-N` folder was taken and which newer ones were skipped and why."""

    index: Partitioned | None
    problems: list[Problem]
    where: tuple[str, str] | None
    client_state: ClientState = field(default_factory=ClientState)
    choice: Choice | None = None


def read(uri: str, tag: str | None = None, *, strict_pickle: bool = False) -> Reading:
    """Read the checkpoint at `uri` (see the module docstring).

    A folder without `latest` that holds `checkpoint-{step}` folders (a Hugging Face Trainer's
    output_dir) is read as its newest complete checkpoint (`output_dir.choose`); which one was taken,
    and which newer ones were skipped and why, is logged as a warning (the command line prints it)."""
    return _read(uri, tag, strict_pickle=strict_pickle, search=True)


def _read(uri: str, tag: str | None, *, strict_pickle: bool, search: bool) -> Reading:
    explicit = tag is not None
    try:
        root, tag = resolve_tag(uri, tag)
    except CkptflowError as exc:
        if search and not explicit and exc.code == "latest-missing" and (folders := folders_in(uri)):
            return _newest_complete(uri, folders, strict_pickle=strict_pickle)
        if not explicit and exc.code == "latest-missing" and (shards := _shard_folder(uri, strict_pickle)):
            return shards
        return Reading(None, [Problem(exc.code, str(exc), exc.file)], None)
    st = Inspection(root, tag, explicit_tag=explicit, allowed=allowed(strict_pickle))
    try:
        listing, model0 = read_head(st)
        topology = detect(listing.names, model0)
        reader = READERS.get(topology.kind)
        if reader is None:
            st.add("unsupported-layout", f"{listing.tag_uri} is a checkpoint in the {topology.description} layout; "
                   f"{_WHAT_TO_DO.get(topology.kind, _DEFAULT_WHAT_TO_DO)}", file=listing.tag_uri)
            raise StopReading  # the problem just added is the report
        index = reader(st, listing, model0, topology)
    except StopReading:
        return Reading(None, st.problems, (root, tag), st.client_state)
    return Reading(index, st.problems, (root, tag), st.client_state)


def _shard_folder(uri: str, strict_pickle: bool) -> Reading | None:
    """A folder of per-rank optimizer states saved with torch.save (`readers.optimizer_shards`), or None
    when `uri` holds none."""
    st = Inspection(uri.rstrip("/") or uri, "", allowed=allowed(strict_pickle))
    try:
        index = read_shard_folder(st)
    except StopReading:
        return Reading(None, st.problems, (st.root, ""))
    return None if index is None else Reading(index, st.problems, (st.root, ""))


def inspect(uri: str, tag: str | None = None, *, strict_pickle: bool = False
            ) -> tuple[Partitioned | None, list[Problem], tuple[str, str] | None]:
    """Read the checkpoint at `uri`: its index (None when unusable), every problem, and (root, tag)."""
    found = read(uri, tag, strict_pickle=strict_pickle)
    return found.index, found.problems, found.where


def _newest_complete(output_dir: str, folders: list[str], *, strict_pickle: bool) -> Reading:
    """The newest complete checkpoint among an output_dir's `checkpoint-{step}` folders (newest first)."""
    seen: dict[str, Reading] = {}

    def problem(uri: str) -> str | None:
        seen[uri] = found = _read(uri, None, strict_pickle=strict_pickle, search=False)
        if not found.problems:
            return None if found.index is not None else "unreadable"
        first = "no `latest` file" if found.problems[0].code == "latest-missing" else found.problems[0].message
        return first + and_more(len(found.problems) - 1, "problem")

    choice = choose(output_dir, folders, problem)
    if choice.uri is None:
        return Reading(None, [Problem("no-complete-checkpoint", choice.failure, output_dir)], None, choice=choice)
    logger.warning("%s", choice.note)
    return replace(seen[choice.uri], choice=choice)


def zero_index(source: Partitioned | None) -> ZeroCheckpoint | None:
    """The data-parallel ZeRO index a source is made of (itself, or an expert-parallel checkpoint's),
    None for layouts without one."""
    return None if source is None else source.zero_index()


def load_index(uri: str, tag: str | None = None, *, strict_pickle: bool = False) -> Partitioned:
    """The index of a valid checkpoint; `CheckpointError` naming the first problem otherwise."""
    index, problems, _ = inspect(uri, tag, strict_pickle=strict_pickle)
    if problems or index is None:
        first = problems[0]
        more = and_more(len(problems) - 1, "problem", then=f"run `ckptflow validate {uri}`")
        not_found = first.code in ("latest-missing", "source-missing", "tag-missing")
        error_type = CheckpointNotFoundError if not_found else CheckpointError
        raise error_type(first.message + more, code=first.code, uri=uri, file=first.file, rank=first.rank)
    return index
