"""What a reader knows while it reads one checkpoint: the problems found so far, the tag folder's listing,
the file set a world size implies, and the checks every rank file goes through before it is trusted.

Readers collect problems into an `Inspection` (one report of everything wrong, cheapest checks first)
and stop at a stage whose problems make later checks meaningless (`StopReading`).
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptflow.errors import CheckpointNotFoundError, CkptflowError, option
from ckptflow.formats.deepspeed.client_state import ClientState, class_name, client_state, misplaced
from ckptflow.formats.deepspeed.names import (
    ALLOWED,
    MODEL_FILE_RE,
    OPTIM_FILE_RE,
    SAFE_TAG,
    model_file_name,
    optim_file_name,
)
from ckptflow.formats.torch.tensorref import TensorRef
from ckptflow.formats.torch.unpickler import Allowed
from ckptflow.formats.torch.zipdir import ArchiveCache, open_archive
from ckptflow.plumbing.redaction import describe
from ckptflow.plumbing.sizes import element_count
from ckptflow.plumbing.storage import join, open_fs
from ckptflow.plumbing.text import excerpt


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a checkpoint: a stable code, a one-line message, and where."""

    code: str
    message: str
    file: str | None = None
    rank: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "file": self.file, "rank": self.rank}


class StopReading(Exception):
    """Raised inside `inspect` to stop at a stage whose problems make later checks meaningless."""


@dataclass
class Inspection:
    """What a reader knows while it reads one checkpoint: where, and every problem found so far."""

    root: str
    tag: str
    explicit_tag: bool = False
    problems: list[Problem] = field(default_factory=list)
    cache: ArchiveCache = field(default_factory=ArchiveCache, repr=False)  # pickles the ranks repeat, unpickled once
    allowed: Allowed = ALLOWED  # what the pickles may name (`names.allowed`: strict pickle mode or not)
    client_state: ClientState = field(default_factory=ClientState)  # rank 0's model states, once read

    def add(self, code: str, message: str, *, file: str | None = None, rank: int | None = None) -> None:
        self.problems.append(Problem(code, message, file, rank))

    def stop_if_any(self) -> None:
        if self.problems:
            raise StopReading


def read_head(st: Inspection) -> tuple[Listing, dict[str, Any]]:
    """The tag folder's listing and rank 0's model states: what every reader starts from."""
    listing = list_tag(st)
    model0 = open_rank_file(st, listing.model0_uri, rank=0)
    st.stop_if_any()
    st.client_state = client_state(model0)
    return listing, model0


@dataclass(frozen=True)
class Listing:
    """The DeepSpeed files of a tag folder, by name."""

    tag_uri: str
    names: tuple[str, ...]
    model_names: Mapping[str, re.Match[str]]
    optim_names: Mapping[str, re.Match[str]]

    @property
    def stage3(self) -> bool:
        return any(m.group(1) is not None for m in self.model_names.values())

    @property
    def model0_uri(self) -> str:
        """Rank 0's model states: every layout has this file."""
        return self.model_uri(0)

    def model_uri(self, mp_rank: int) -> str:
        """Data-parallel rank 0's model states of model-parallel rank `mp_rank`."""
        return join(self.tag_uri, model_file_name(3 if self.stage3 else 1, 0, mp_rank))


def list_tag(st: Inspection) -> Listing:
    """The tag folder's listing: it exists and holds rank 0's model states."""
    tag_uri = join(st.root, st.tag)
    fs, tag_path = open_fs(tag_uri)
    if not fs.isdir(tag_path):
        why = (
            f"check the {option('tag')} value against the folders beside `latest`"
            if st.explicit_tag
            else "`latest` names a tag that was never saved or not yet uploaded: wait for the upload, or point "
            "`latest` at an existing tag"
        )
        st.add("tag-missing", f"tag folder {tag_uri} does not exist; {why}", file=tag_uri)
        st.stop_if_any()
    names = tuple(sorted(posixpath.basename(p) for p in fs.ls(tag_path, detail=False)))
    listing = Listing(
        tag_uri, names,
        {n: m for n in names if (m := MODEL_FILE_RE.match(n))},
        {n: m for n in names if (m := OPTIM_FILE_RE.match(n))},
    )
    if model_file_name(3 if listing.stage3 else 1, 0) not in listing.model_names:
        st.add(
            "model-missing",
            f"{join(tag_uri, 'mp_rank_00_model_states.pt')} (ZeRO-1/2) or "
            f"{join(tag_uri, 'zero_pp_rank_0_mp_rank_00_model_states.pt')} (ZeRO-3) is missing; this is not a "
            "DeepSpeed ZeRO tag folder, or rank 0's upload has not finished",
            file=tag_uri,
        )
        st.stop_if_any()
    return listing


# More missing ranks than this are reported as one problem, not one each.
MAX_LISTED_MISSING = 8


def check_file_set(st: Inspection, listing: Listing, world_size: int, precision: str, mp_rank: int = 0,
                    where: str | None = None) -> tuple[list[str], list[str]]:
    """Exactly the files the world size implies for model-parallel rank `mp_rank`, none missing, none
    extra among that rank's files: (model URIs, optim URIs). `where` names the model-parallel rank.

    The world size comes from a file and may be absurd: names are built for the files present, and
    ranks missing past `MAX_LISTED_MISSING` are counted, not listed."""
    first_model = model_file_name(3 if listing.stage3 else 1, 0, mp_rank)
    label = "rank" if where is None else "data-parallel rank"
    of = "" if where is None else f" of {where}"
    present: dict[str, int] = {}  # expected files present -> rank
    for name, m in listing.optim_names.items():
        rank = int(m.group(2))
        if rank < world_size and name == optim_file_name(precision, rank, mp_rank):
            present[name] = rank
    for name, m in listing.model_names.items():
        rank = int(m.group(1) or 0)
        if rank < world_size and name == (model_file_name(3, rank, mp_rank) if listing.stage3 else first_model):
            present[name] = rank
    wanted = world_size * (2 if listing.stage3 else 1) + (0 if listing.stage3 else 1)
    if wanted - len(present) > MAX_LISTED_MISSING:
        have = sorted({r for n, r in present.items() if n in listing.optim_names})
        first = next(r for r in range(world_size) if r not in have)
        name = optim_file_name(precision, first, mp_rank)
        st.add("rank-missing",
               f"{join(listing.tag_uri, first_model)} records a data-parallel world size of {excerpt(world_size)} but "
               f"the tag folder holds optimizer files for {len(have)} {label}(s){of}; {wanted - len(present):,} files "
               f"are missing, the first {st.tag}/{name} ({label} {first}); the upload may still be in progress, or "
               f"{first_model} is damaged", file=join(listing.tag_uri, name), rank=first)
        return [], []
    expected_optim = {optim_file_name(precision, r, mp_rank): r for r in range(world_size)}
    expected_model = ({model_file_name(3, r, mp_rank): r for r in range(world_size)} if listing.stage3
                      else {first_model: 0})
    for name, rank in {**expected_model, **expected_optim}.items():
        if name not in listing.names:
            st.add(
                "rank-missing",
                f"{label} {rank} of {world_size}{of} is missing: expected {st.tag}/{name} under {st.root}; the upload "
                f"may still be in progress, or the checkpoint was saved with fewer ranks",
                file=join(listing.tag_uri, name), rank=rank,
            )
    mine = [n for n, m in listing.model_names.items() if int(m.group(2)) == mp_rank]
    mine += [n for n, m in listing.optim_names.items() if int(m.group(3)) == mp_rank]
    if where is None:  # a data-parallel checkpoint: files of any other model-parallel rank do not belong
        others = [n for n, m in listing.model_names.items() if int(m.group(2)) != mp_rank]
        others += [n for n, m in listing.optim_names.items() if int(m.group(3)) != mp_rank]
        for name in others:
            st.add("rank-extra", f"unexpected file {st.tag}/{name}: it belongs to another model-parallel rank, but "
                   f"{first_model} records a data-parallel checkpoint (model-parallel size 1); it is left over from "
                   "another save into the same tag folder: remove it, or re-save the checkpoint into a fresh folder",
                   file=join(listing.tag_uri, name))
    for name in mine:
        if name not in expected_model and name not in expected_optim:
            m = listing.model_names.get(name) or listing.optim_names[name]
            rank = int(m.group(2) if name in listing.optim_names else (m.group(1) or 0))
            why = (
                f"{label} {rank}{of} is beyond the data-parallel world size {world_size} recorded in {first_model}"
                if where is not None and rank >= world_size else
                f"rank {rank} is beyond the world size {world_size} recorded in {first_model}"
                if rank >= world_size
                else f"its precision prefix does not match the {precision} training recorded in {first_model}"
            )
            st.add(
                "rank-extra",
                f"unexpected file {st.tag}/{name}: {why}; it is left over from another save into the same tag "
                "folder: remove it, or re-save the checkpoint into a fresh folder",
                file=join(listing.tag_uri, name), rank=rank,
            )
    model_uris = [join(listing.tag_uri, n) for n in expected_model]
    optim_uris = [join(listing.tag_uri, n) for n in expected_optim]
    return model_uris, optim_uris


def shown(value: Any) -> str:
    """A value from a file in a message: a plain version or number as it is, anything else quoted."""
    if isinstance(value, str) and SAFE_TAG.match(value) and len(value) <= 60:
        return value
    return excerpt(value)


def open_rank_file(st: Inspection, uri: str, rank: int) -> dict[str, Any]:
    """The object tree of a rank's model- or optimizer-states file ({} when it is unusable, with the
    problem added)."""
    try:
        archive = open_archive(uri, st.allowed, cache=st.cache)
        obj = archive.obj
    except CkptflowError as exc:
        code = "rank-missing" if isinstance(exc, CheckpointNotFoundError) else exc.code
        st.add(code, f"rank {rank}: {exc}", file=uri, rank=rank)
        return {}
    except OSError as exc:
        st.add("unreadable-file",
               f"rank {rank}: cannot read {uri} ({describe(exc)}); check access to the store and retry",
               file=uri, rank=rank)
        return {}
    if not isinstance(obj, dict):
        st.add("corrupt-file", f"rank {rank}: {uri} holds a {type(obj).__name__}, not a DeepSpeed state dict; the "
               "file is not a DeepSpeed checkpoint file", file=uri, rank=rank)
        return {}
    if (archive.has_records or archive.has_cycles) and not check_records(st, obj, uri, f"rank {rank}", rank=rank):
        return {}
    return obj


def check_records(st: Inspection, obj: Mapping[str, Any], uri: str, label: str, *, rank: int | None = None) -> bool:
    """No inert record (an object of a class outside the allow-list) and no reference cycle where ckptflow
    reads DeepSpeed's data: a model-states file's DeepSpeed keys, every other file whole
    (`client_state.misplaced`). One problem naming the file and the field otherwise; returns whether
    there was none."""
    found = misplaced(obj, model_states=MODEL_FILE_RE.match(posixpath.basename(uri)) is not None)
    if found is None:
        return True
    where = found.where if len(found.where) <= 160 else f"{found.where[:160]}..."
    what = ("an object that refers back to itself" if found.record is None else
            f"an object of class {class_name(found.record.qualname)} (never loaded)")
    st.add("corrupt-file", f"{label}: {uri} holds {what} in {where}, where DeepSpeed writes tensors and plain data; "
           "the file is damaged or was not written by DeepSpeed", file=uri, rank=rank)
    return False


def is_count(value: Any) -> bool:
    """Whether `value` is a count a checkpoint records: a non-negative int (not a bool) that fits the
    int64 torch and DeepSpeed keep counts in (a larger one, thousands of digits, cannot even be printed)."""
    return type(value) is int and 0 <= value <= MAX_NUMEL


# A tensor has at most 2**63 - 1 elements (torch counts them in an int64).
MAX_NUMEL = 2**63 - 1


def _is_shape(value: Any) -> bool:
    return (isinstance(value, tuple | list) and len(value) <= 64 and all(is_count(d) for d in value)
            and element_count(value) <= MAX_NUMEL)


def _is_shape_map(value: Any) -> bool:
    return isinstance(value, Mapping) and all(isinstance(k, str) and _is_shape(v) for k, v in value.items())


def _is_list_of(test: Any) -> Any:
    return lambda value: isinstance(value, list) and all(test(v) for v in value)


def _is_str_map(value: Any) -> bool:
    return isinstance(value, Mapping) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())


def is_flat(ref: TensorRef) -> bool:
    """A flat partition or moment: one dimension, contiguous."""
    return len(ref.shape) == 1 and ref.is_contiguous


# What a reader relies on in each file: the fields it reads, and what they must hold (None is "absent").
MODEL_FIELDS: dict[str, Any] = {
    "module": lambda v: isinstance(v, Mapping) and all(isinstance(k, str) for k in v),
    "param_shapes": _is_list_of(_is_shape_map),
    "buffer_names": _is_list_of(lambda n: isinstance(n, str)),
    "shared_params": _is_str_map,
    "frozen_param_shapes": _is_shape_map,
    "frozen_param_fragments": lambda v: isinstance(v, Mapping),
}


OPTIM_FIELDS: dict[str, Any] = {
    "fp32_flat_groups": lambda v: isinstance(v, list),
    "single_partition_of_fp32_groups": lambda v: isinstance(v, list),
    "group_paddings": _is_list_of(is_count),
    "param_alignment_paddings": _is_list_of(lambda v: v is None or _is_list_of(is_count)(v)),
    "param_slice_mappings": _is_list_of(lambda v: v is None or isinstance(v, Mapping)),
}


BASE_STATE_FIELDS: dict[str, Any] = {
    "state": lambda v: isinstance(v, Mapping),
    "param_groups": _is_list_of(lambda v: isinstance(v, Mapping)),
}


def check_fields(st: Inspection, obj: Mapping[str, Any], fields: Mapping[str, Any], uri: str, rank: int) -> None:
    """Each field a reader uses holds what DeepSpeed writes there (types, not values), so that what
    follows can rely on it; one problem per field that does not."""
    for key, ok in fields.items():
        value = obj.get(key)
        if value is not None and not ok(value):
            st.add("corrupt-file", f"rank {rank}: {uri} records {key} as {excerpt(value)}, not what DeepSpeed "
                   "writes there; the file is damaged", file=uri, rank=rank)


def check_model_fields(st: Inspection, obj: Mapping[str, Any], uri: str, rank: int) -> None:
    """`check_fields` for a model states file."""
    check_fields(st, obj, MODEL_FIELDS, uri, rank)
