"""Reshard a ZeRO-1/2/3 training checkpoint to another data-parallel world size.

The output is what DeepSpeed itself writes at the new world size M for the same stage, precision
and config: `latest`, and a tag folder with one optimizer file per rank (and, for ZeRO-3, one model
file per rank), every field DeepSpeed reads on load rewritten for M (partition counts, flat
partitions with DeepSpeed's alignment and padding, group paddings, parameter slice mappings, ZeRO-3
per-parameter pieces and frozen fragments, `dp_world_size`). DeepSpeed then loads it natively at M,
without the universal-checkpoint path, and holds exactly the source's state. Everything else in the
source folder (config.json, tokenizer, trainer_state.json, scheduler and RNG files) is carried over.

The work comes in four steps, so that an orchestrator can run the middle one in parallel:

1. `plan_reshard(index, M)`: pure; one `RankUnit` per target rank, each a list of element copies
   from source partitions (DeepSpeed's partition arithmetic lives in `ckptflow.zero_layout`; which
   fields of which file change with the world size, in `ckptflow.reshard_files`).
2. `prepare_output(out)`: refuses an existing non-empty OUT and creates a staging folder beside it.
3. `run_unit(plan, unit, staging)`: writes one target rank's files, streaming bytes from the source
   (each source byte of weights and moments is read by exactly one unit; memory stays at one chunk).
4. `finalize(plan, staging, out)`: reads the staged checkpoint back, carries the other files over,
   writes `latest` last and moves everything into place. `discard(staging)` cleans up on failure.

`reshard(src, out, world_size=M)` runs all four.
"""

from __future__ import annotations

import logging
import posixpath
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ckptflow.errors import CheckpointError, OutputError, UnsupportedCheckpointError, VerificationError
from ckptflow.reshard_files import is_partition_tensor, model_states, optim_states
from ckptflow.storage import check_space, is_local, join, local_path, open_fs, unstrip
from ckptflow.torchsave import CHUNK_BYTES, SourceReader, write_archive
from ckptflow.torchzip import DTYPE_SIZES
from ckptflow.zero import MODEL_FILE_RE, OPTIM_FILE_RE, ZeroCheckpoint, inspect, model_file_name, optim_file_name
from ckptflow.zero_layout import (BF16, DEFAULT_SUB_GROUP_SIZE, ZERO, ZERO3, Copy, Extent, moves, param_alignment,
                                  piece_offsets, round_robin_order, zero3_moves, zero3_piece, zero3_sub_groups,
                                  zero12_fragments, zero12_layout)

logger = logging.getLogger(__name__)

Progress = Callable[[int, int], None]  # (bytes done, bytes in all)



# ---- the plan ---------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class TargetFlat:
    """One flat fp32 partition of a target rank (a param group; a sub-group under ZeRO-3).

    `numel` counts its elements including padding, `saved` those DeepSpeed saves (ZeRO-1/2 drop the
    tail padding); `copies` fill it from source partitions of param group `group`, zeros elsewhere.
    """

    group: int
    numel: int
    saved: int
    copies: tuple[Copy, ...]


@dataclass(frozen=True, kw_only=True)
class FrozenPiece:
    """A target rank's piece of a frozen ZeRO-3 parameter, copied from the source ranks' pieces."""

    name: str
    numel: int
    copies: tuple[Copy, ...]


@dataclass(frozen=True, kw_only=True)
class RankUnit:
    """Everything one target rank's files need: an independent unit of work."""

    rank: int
    meta_rank: int  # the source rank whose per-rank scalars (step, loss scaler, buffers) it copies
    optim_file: str
    model_file: str | None
    flats: tuple[TargetFlat, ...]
    group_paddings: tuple[int, ...] = ()
    slice_mappings: tuple[tuple[tuple[str, int, int], ...], ...] = ()  # per group: (name, start, numel)
    frozen: tuple[FrozenPiece, ...] = ()
    read_bytes: int = 0  # source bytes this unit copies: what `run_unit` reports as progress
    write_bytes: int = 0  # storage bytes of its files (zeros included), about their size

    @property
    def files(self) -> tuple[str, ...]:
        return (self.optim_file,) + ((self.model_file,) if self.model_file else ())


@dataclass(frozen=True, kw_only=True)
class ReshardPlan:
    """How to turn the checkpoint `index` into the same checkpoint at `world_size` ranks."""

    root: str
    tag: str
    stage: int
    precision: str
    optimizer: str
    source_world_size: int
    world_size: int
    flat_shapes: tuple[tuple[tuple[str, tuple[int, ...]], ...], ...]  # `param_shapes`: params of each flat
    param_alignment_paddings: tuple[tuple[int, ...], ...]
    module: tuple[tuple[int, tuple[tuple[str, int], ...]], ...]  # ZeRO-1/2: 16-bit flat numel, param offsets
    units: tuple[RankUnit, ...]
    index: ZeroCheckpoint = field(repr=False, compare=False)

    @property
    def files(self) -> tuple[str, ...]:
        return tuple(name for unit in self.units for name in unit.files)

    @property
    def read_bytes(self) -> int:
        return sum(u.read_bytes for u in self.units)

    @property
    def write_bytes(self) -> int:
        return sum(u.write_bytes for u in self.units)


def plan_reshard(index: ZeroCheckpoint, world_size: int) -> ReshardPlan:
    """The plan that reshards `index` to `world_size` ranks; reads nothing.

    Raises `ValueError` for a world size below 1 and `UnsupportedCheckpointError` for layouts ckptflow
    cannot convert, or a source whose recorded layout is not the one DeepSpeed's arithmetic predicts.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"--world-size must be a whole number of ranks, at least 1; got {world_size!r}")
    optimizer = _optimizer_kind(index)
    _check_supported(index, optimizer)
    if optimizer == ZERO3:
        return _plan_zero3(index, world_size)
    return _plan_zero12(index, world_size, optimizer)


def _optimizer_kind(index: ZeroCheckpoint) -> str:
    if index.stage == 3:
        return ZERO3
    osd = index.optim_states[0]["optimizer_state_dict"]
    return ZERO if "zero_stage" in osd else BF16


def _zero_config(index: ZeroCheckpoint) -> Mapping[str, Any]:
    config = index.model_states[0].get("ds_config") or {}
    zero = config.get("zero_optimization") if isinstance(config, Mapping) else None
    return zero if isinstance(zero, Mapping) else {}


def _flag(zero: Mapping[str, Any], key: str) -> bool:
    value = zero.get(key, False)
    return value is True or (isinstance(value, str) and value.lower() == "true")


def _check_supported(index: ZeroCheckpoint, optimizer: str) -> None:
    zero = _zero_config(index)
    where = index.tag_uri
    for key in ("offload_optimizer", "offload_param"):
        section = zero.get(key)
        if isinstance(section, Mapping) and section.get("device") == "nvme":
            raise UnsupportedCheckpointError(
                f"{where} was trained with {key} on NVMe; its optimizer state lives in offloaded_tensors/, "
                "which ckptflow does not reshard", uri=where, hint="reshard a checkpoint saved without NVMe offload")
    model0 = index.model_states[0]
    if model0.get("num_experts") is not None:
        raise UnsupportedCheckpointError(f"{where} holds mixture-of-experts layers, which ckptflow does not reshard",
                                         uri=where, hint="use DeepSpeed's universal checkpoint for MoE models")
    for rank, optim in enumerate(index.optim_states):
        osd = optim["optimizer_state_dict"]
        if optimizer == ZERO3:
            base = osd.get("optimizer_state_dict")
            if osd.get("ds_zero_partition_groups") is not None:
                raise UnsupportedCheckpointError(
                    f"rank {rank}: {index.files[rank].optim} records AutoEP partition groups, which ckptflow does "
                    "not reshard", uri=where, file=index.files[rank].optim, rank=rank)
        else:
            base = osd.get("base_optimizer_state")
            if isinstance(base, list):
                raise UnsupportedCheckpointError(
                    f"rank {rank}: {index.files[rank].optim} was saved with zero_optimization.elastic_checkpoint; "
                    "DeepSpeed already loads such checkpoints at any world size", uri=where,
                    file=index.files[rank].optim, rank=rank, hint="load it directly with elastic_checkpoint enabled")
        if not isinstance(base, Mapping) or not isinstance(base.get("param_groups"), list):
            raise CheckpointError(f"rank {rank}: {index.files[rank].optim} holds no base optimizer state dict",
                                  uri=where, file=index.files[rank].optim, rank=rank)
        if len(base["param_groups"]) != len(index.groups):
            raise UnsupportedCheckpointError(
                f"rank {rank}: {index.files[rank].optim} has {len(base['param_groups'])} optimizer param groups but "
                f"{len(index.groups)} flat groups; ZeRO-3 sub-groups (sub_group_size smaller than a rank's share of a "
                "group) are not supported", uri=where, file=index.files[rank].optim, rank=rank)
        if any(isinstance(g, Mapping) and g.get("moe") for g in base["param_groups"]):
            raise UnsupportedCheckpointError(f"{where} has mixture-of-experts param groups, which ckptflow does not "
                                             "reshard", uri=where)


def _moment_keys(index: ZeroCheckpoint) -> int:
    """How many partition-sized tensors (fp32 weights and moments) each flat holds."""
    part = index.partitions[0][0]
    return 1 + sum(1 for ref in part.state.values() if is_partition_tensor(ref, part.numel, part.fp32.numel))


def _plan_zero12(index: ZeroCheckpoint, world_size: int, optimizer: str) -> ReshardPlan:
    zero = _zero_config(index)
    src_ws = index.world_size
    by_name = index.param_by_name
    bf16_opt = optimizer == BF16
    round_robin = _flag(zero, "round_robin_gradients") and not bf16_opt
    osd0 = index.optim_states[0]["optimizer_state_dict"]
    recorded_paddings = osd0.get("param_alignment_paddings")
    n_tensors = _moment_keys(index)

    per_rank_flats: list[list[TargetFlat]] = [[] for _ in range(world_size)]
    per_rank_paddings: list[list[int]] = [[] for _ in range(world_size)]
    per_rank_slices: list[list[tuple[tuple[str, int, int], ...]]] = [[] for _ in range(world_size)]
    flat_shapes, alignment_paddings, module = [], [], []
    for g, group in enumerate(index.groups):
        src_names = list(group.params)
        params = [by_name[n] for n in src_names]
        align = 1 if bf16_opt or not params else param_alignment(DTYPE_SIZES[params[0].dtype],
                                                                 _flag(zero, "parameter_alignment"))
        if round_robin:  # saved order is the round-robin order for the source world size: undo it
            original = [""] * len(src_names)
            for pos, i in enumerate(round_robin_order(len(src_names), src_ws)):
                original[i] = src_names[pos]
            dst_names = [original[i] for i in round_robin_order(len(original), world_size)]
        else:
            original = dst_names = src_names
        numel = {p.name: p.numel for p in params}
        src = zero12_layout([numel[n] for n in src_names], src_ws, alignment=align, bf16_optimizer=bf16_opt)
        dst = zero12_layout([numel[n] for n in dst_names], world_size, alignment=align, bf16_optimizer=bf16_opt)
        _check_zero12_source(index, g, src_names, src, recorded_paddings)
        src_pos = {n: src.offsets[i] for i, n in enumerate(src_names)}
        dst_pos = {n: dst.offsets[i] for i, n in enumerate(dst_names)}
        extents = [Extent(numel=numel[n], src=src_pos[n], dst=dst_pos[n]) for n in dst_names]
        # param_slice_mappings follow the optimizer's original order; like DeepSpeed, offsets are the
        # real ones only when some parameter carries alignment padding, else cumulative in that order.
        if any(dst.param_paddings):
            mapping_offsets = [dst_pos[n] for n in original]
        else:
            mapping_offsets, pos = [], 0
            for n in original:
                mapping_offsets.append(pos)
                pos += numel[n]
        for r in range(world_size):
            copies = moves(extents, src.partition, dst.partition, r, src_flat=g)
            per_rank_flats[r].append(TargetFlat(group=g, numel=dst.partition, saved=dst.saved[r], copies=copies))
            per_rank_paddings[r].append(dst.group_paddings[r])
            lo, hi = r * dst.partition, (r + 1) * dst.partition
            slices = []
            for n, off in zip(original, mapping_offsets):
                a, b = max(off, lo), min(off + numel[n], hi)
                if a < b:
                    slices.append((n, a - lo, b - a))
            per_rank_slices[r].append(tuple(slices))
        flat_shapes.append(tuple((n, by_name[n].shape) for n in dst_names))
        alignment_paddings.append(dst.param_paddings)
        module.append((dst.flat_numel, tuple((n, dst_pos[n]) for n in dst_names)))

    # Rank 0 also writes the model file: the 16-bit module copy, frozen parameters and buffers.
    module_bytes = sum(p.numel * DTYPE_SIZES[p.dtype] for p in index.params) + _buffer_bytes(index)
    units = []
    for r in range(world_size):
        flats = tuple(per_rank_flats[r])
        moved = sum(c.numel for f in flats for c in f.copies)
        units.append(RankUnit(
            rank=r, meta_rank=min(r, src_ws - 1), optim_file=optim_file_name(index.precision, r),
            model_file=model_file_name(index.stage, 0) if r == 0 else None, flats=flats,
            group_paddings=tuple(per_rank_paddings[r]), slice_mappings=tuple(per_rank_slices[r]),
            read_bytes=4 * n_tensors * moved + (module_bytes if r == 0 else 0),
            write_bytes=4 * n_tensors * sum(f.numel for f in flats) + (module_bytes if r == 0 else 0),
        ))
    return ReshardPlan(
        root=index.root, tag=index.tag, stage=index.stage, precision=index.precision, optimizer=optimizer,
        source_world_size=src_ws, world_size=world_size, flat_shapes=tuple(flat_shapes),
        param_alignment_paddings=tuple(alignment_paddings), module=tuple(module), units=tuple(units), index=index,
    )


def _check_zero12_source(index: ZeroCheckpoint, g: int, names: Sequence[str], src: Any, recorded: Any) -> None:
    """The source's recorded layout must be DeepSpeed's arithmetic at its world size, or we refuse."""
    problems = []
    if isinstance(recorded, list) and g < len(recorded) and list(recorded[g]) != list(src.param_paddings):
        problems.append(f"parameter alignment paddings {list(recorded[g])} instead of {list(src.param_paddings)}")
    for r in range(index.world_size):
        part = index.partitions[r][g]
        if part.fp32.numel != src.saved[r] or part.numel != src.partition or part.padding != src.group_paddings[r]:
            problems.append(f"rank {r} saved {part.fp32.numel} of {part.numel} fp32 elements with padding "
                            f"{part.padding} instead of {src.saved[r]} of {src.partition} with {src.group_paddings[r]}")
    by_name = index.param_by_name
    expected: dict[str, list[tuple[int, int, int, int]]] = {n: [] for n in names}
    for r in range(index.world_size):
        for i, start, numel in zero12_fragments(src, r):
            offset = src.offsets[i]
            expected[names[i]].append((r, start, numel, r * src.partition + start - offset))
    for n in names:
        got = [(f.rank, f.offset, f.numel, f.param_offset) for f in by_name[n].fragments]
        if got != expected[n]:
            problems.append(f"{n} at {got} instead of {expected[n]}")
    if problems:
        raise UnsupportedCheckpointError(
            f"param group {g} of {index.tag_uri} is not laid out the way DeepSpeed lays out {index.world_size} ranks "
            f"({'; '.join(problems[:3])}); it was saved with settings ckptflow does not know", uri=index.tag_uri,
            hint="check zero_optimization.round_robin_gradients / parameter_alignment in its ds_config")


def _plan_zero3(index: ZeroCheckpoint, world_size: int) -> ReshardPlan:
    zero = _zero_config(index)
    src_ws = index.world_size
    sub_group_size = _as_int(zero.get("sub_group_size"), DEFAULT_SUB_GROUP_SIZE)
    by_name = index.param_by_name
    n_tensors = _moment_keys(index)
    per_rank_flats: list[list[TargetFlat]] = [[] for _ in range(world_size)]
    flat_shapes = []
    for g, group in enumerate(index.groups):
        names = list(group.params)
        numels = [by_name[n].numel for n in names]
        src_offsets = piece_offsets(numels, src_ws)
        if len(zero3_sub_groups([zero3_piece(n, src_ws) for n in numels], sub_group_size)) > 1:
            raise UnsupportedCheckpointError(
                f"param group {g} of {index.tag_uri} is split into ZeRO-3 sub-groups at {src_ws} ranks, which "
                "ckptflow does not read", uri=index.tag_uri)
        _check_zero3_source(index, g, names, numels, src_offsets)
        for sub in zero3_sub_groups([zero3_piece(n, world_size) for n in numels], sub_group_size):
            sub_numels = [numels[i] for i in sub]
            dst_offsets = piece_offsets(sub_numels, world_size)
            size = sum(zero3_piece(n, world_size) for n in sub_numels)
            for r in range(world_size):
                copies = zero3_moves(sub_numels, src_ws, world_size, r, src_offsets=[src_offsets[i] for i in sub],
                                     dst_offsets=dst_offsets, src_flat=g)
                per_rank_flats[r].append(TargetFlat(group=g, numel=size, saved=size, copies=copies))
            flat_shapes.append(tuple((names[i], by_name[names[i]].shape) for i in sub))
    frozen = [p for p in index.params if p.frozen]
    units = []
    for r in range(world_size):
        pieces = tuple(
            FrozenPiece(name=p.name, numel=zero3_piece(p.numel, world_size),
                        copies=zero3_moves([p.numel], src_ws, world_size, r, src_offsets=[0], dst_offsets=[0],
                                           src_flat=-1))
            for p in frozen
        )
        flats = tuple(per_rank_flats[r])
        frozen_bytes = sum(c.numel * DTYPE_SIZES[p.dtype] for p, piece in zip(frozen, pieces) for c in piece.copies)
        frozen_bytes += _buffer_bytes(index)
        units.append(RankUnit(
            rank=r, meta_rank=min(r, src_ws - 1), optim_file=optim_file_name(index.precision, r),
            model_file=model_file_name(3, r), flats=flats, frozen=pieces,
            read_bytes=4 * n_tensors * sum(c.numel for f in flats for c in f.copies) + frozen_bytes,
            write_bytes=4 * n_tensors * sum(f.numel for f in flats) + frozen_bytes,
        ))
    return ReshardPlan(
        root=index.root, tag=index.tag, stage=3, precision=index.precision, optimizer=ZERO3,
        source_world_size=src_ws, world_size=world_size, flat_shapes=tuple(flat_shapes),
        param_alignment_paddings=(), module=(), units=tuple(units), index=index,
    )


def _buffer_bytes(index: ZeroCheckpoint) -> int:
    return sum(b.ref.storage_numel * b.ref.itemsize for b in index.buffers)


def _check_zero3_source(index: ZeroCheckpoint, g: int, names: Sequence[str], numels: Sequence[int],
                        offsets: Sequence[int]) -> None:
    by_name = index.param_by_name
    for n, numel, off in zip(names, numels, offsets):
        piece = zero3_piece(numel, index.world_size)
        want = [(r, off, min(piece, numel - r * piece), r * piece) for r in range(index.world_size) if numel > r * piece]
        got = [(f.rank, f.offset, f.numel, f.param_offset) for f in by_name[n].fragments]
        if got != want:
            raise UnsupportedCheckpointError(
                f"{n} in param group {g} of {index.tag_uri} sits at {got}, not where DeepSpeed's ZeRO-3 partitioning "
                f"at {index.world_size} ranks puts it ({want})", uri=index.tag_uri, tensor=n)


def _as_int(value: Any, default: int) -> int:
    try:
        return int(float(value)) if value is not None else default
    except (TypeError, ValueError):
        return default


# ---- output folder ----------------------------------------------------------------------------------


def prepare_output(out: str, need: int = 0) -> str:
    """Check that `out` is absent or an empty folder (and, on a local disk, that `need` bytes are
    free beside it) and create a staging folder beside it.

    Returns the staging folder's URI. Raises `OutputError` when `out` exists and is not empty, when
    the disk is too full, or when the staging folder cannot be made.
    """
    fs, path = open_fs(out)
    if fs.exists(path):
        if not fs.isdir(path):
            raise OutputError(f"{out} exists and is a file", uri=out, hint="choose a new output folder")
        if fs.ls(path, detail=False):
            raise OutputError(f"{out} exists and is not empty; ckptflow never writes into an existing checkpoint",
                              uri=out, hint="choose a new output folder, or empty this one")
    parent, name = posixpath.split(path.rstrip("/"))
    staging = posixpath.join(parent, f".{name}.reshard-{uuid.uuid4().hex[:12]}")
    if is_local(out) and need:
        check_space(parent or ".", need, out)
    try:
        fs.makedirs(staging, exist_ok=False)
    except OSError as exc:
        raise OutputError(f"cannot create {unstrip(fs, staging)} beside {out} ({exc})", uri=out,
                          hint="check the destination folder is writable") from exc
    return unstrip(fs, staging)


def discard(staging: str) -> None:
    """Remove a staging folder and everything in it (never raises)."""
    try:
        fs, path = open_fs(staging)
        if fs.exists(path):
            fs.rm(path, recursive=True)
    except Exception as exc:  # cleanup must not hide the error that caused it
        logger.warning("could not remove staging folder %s: %s", staging, exc)


# ---- one unit ---------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class UnitResult:
    rank: int
    files: tuple[str, ...]
    bytes_read: int
    bytes_written: int
    seconds: float


def run_unit(plan: ReshardPlan, unit: RankUnit, staging: str, *, progress: Callable[[int], None] | None = None,
             chunk_bytes: int = CHUNK_BYTES, durable: bool = True, threads: int = 1) -> UnitResult:
    """Write target rank `unit.rank`'s files into `staging/<tag>/`, streaming from the source.

    `progress` receives the number of source bytes each step copied (from any of the unit's
    `threads`); over the unit they add up to `unit.read_bytes` (use `plan.read_bytes` as the total).
    Memory stays at a few `chunk_bytes` buffers plus the pickled metadata, whatever the partition
    size. In a local staging folder the optimizer file (nearly all the bytes) is written by `threads`
    threads at once. Running a unit again rewrites its files, so a failed unit can simply be retried.
    """
    started = time.monotonic()
    tag_uri = join(staging, plan.tag)
    fs, tag_path = open_fs(tag_uri)
    fs.makedirs(tag_path, exist_ok=True)
    reader = SourceReader(chunk_bytes)
    written = 0
    try:
        written += write_archive(join(tag_uri, unit.optim_file), optim_states(plan, unit), reader,
                                 progress=progress, durable=durable, threads=threads)
        if unit.model_file:
            written += write_archive(join(tag_uri, unit.model_file), model_states(plan, unit), reader,
                                     progress=progress, durable=durable)
    finally:
        reader.close()
    logger.info("rank %d of %d: wrote %s (%.1f MB) in %.2f s", unit.rank, plan.world_size, ", ".join(unit.files),
                written / 1e6, time.monotonic() - started)
    return UnitResult(rank=unit.rank, files=unit.files, bytes_read=reader.bytes_read, bytes_written=written,
                      seconds=time.monotonic() - started)


# ---- finishing ----------------------------------------------------------------------------------------


def finalize(plan: ReshardPlan, staging: str, out: str, *, durable: bool = True) -> None:
    """Check the staged checkpoint, carry the source's other files over, write `latest` and move the
    whole into place at `out` (`latest` last). Raises `VerificationError` when the staged files do not
    read back as a checkpoint at the new world size; the staging folder is then left for `discard`."""
    index, problems, _ = inspect(staging, plan.tag)
    if problems or index is None:
        raise VerificationError(
            f"the resharded checkpoint does not read back as a valid checkpoint: {problems[0].message if problems else '?'}",
            uri=staging, hint="this is a ckptflow bug; please report it with the source's `ckptflow validate` output")
    if (index.world_size, index.stage, len(index.params)) != (plan.world_size, plan.stage, len(plan.index.params)):
        raise VerificationError(
            f"the resharded checkpoint reads back as ZeRO-{index.stage} at {index.world_size} ranks with "
            f"{len(index.params)} parameters, expected ZeRO-{plan.stage} at {plan.world_size} with "
            f"{len(plan.index.params)}", uri=staging, expected=plan.world_size, actual=index.world_size)
    _carry_over(plan, staging, out, durable=durable)
    fs, path = open_fs(staging)
    with fs.open(posixpath.join(path, "latest"), "wb") as fh:
        fh.write(plan.tag.encode())
        _sync(fh, staging, durable)
    _move_into_place(staging, out, plan.tag, durable=durable)


def _sync(fh: Any, uri: str, durable: bool) -> None:
    if durable and is_local(uri):
        import os

        fh.flush()
        os.fsync(fh.fileno())


def _carry_over(plan: ReshardPlan, staging: str, out: str, *, durable: bool = True) -> None:
    """Copy the source folder's files that are not this checkpoint's DeepSpeed files."""
    src_fs, root = open_fs(plan.root)
    _, staging_path = open_fs(staging)
    _, out_path = open_fs(out)
    skip = {posixpath.normpath(p) for p in (staging_path, out_path)}
    for entry in src_fs.ls(root, detail=True):
        path = entry["name"].rstrip("/")
        name = posixpath.basename(path)
        if name in ("latest", plan.tag) or posixpath.normpath(path) in skip or name.startswith(".") and ".reshard-" in name:
            continue
        if entry["type"] == "directory":
            inner = [posixpath.basename(p) for p in src_fs.ls(path, detail=False)]
            if any(MODEL_FILE_RE.match(n) or OPTIM_FILE_RE.match(n) for n in inner):
                logger.warning("not carrying over %s: it is another DeepSpeed tag folder, saved at %d ranks",
                               unstrip(src_fs, path), plan.source_world_size)
                continue
            files = src_fs.find(path)
        else:
            files = [path]
        for file in files:
            rel = posixpath.relpath(file, root)
            _copy_file(unstrip(src_fs, file), join(staging, rel), durable=durable)


def _copy_file(src: str, dst: str, chunk: int = CHUNK_BYTES, *, durable: bool = True) -> None:
    src_fs, src_path = open_fs(src)
    dst_fs, dst_path = open_fs(dst)
    dst_fs.makedirs(posixpath.dirname(dst_path), exist_ok=True)
    with src_fs.open(src_path, "rb") as fin, dst_fs.open(dst_path, "wb") as fout:
        while True:
            data = fin.read(chunk)
            if not data:
                break
            fout.write(data)
        _sync(fout, dst, durable)


def _move_into_place(staging: str, out: str, tag: str, *, durable: bool = True) -> None:
    fs, staging_path = open_fs(staging)
    _, out_path = open_fs(out)
    if is_local(staging) and is_local(out):
        import os

        target = local_path(out)
        if os.path.isdir(target):
            os.rmdir(target)  # empty, checked by prepare_output
        os.rename(local_path(staging), target)
        if durable:  # the rename itself, and the tag folder's entries
            for folder in (os.path.dirname(os.path.abspath(target)), target, os.path.join(target, tag)):
                fd = os.open(folder, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        return
    files = [f for f in fs.find(staging_path) if posixpath.basename(f) != "latest"]
    for file in files:
        fs.mv(file, posixpath.join(out_path, posixpath.relpath(file, staging_path)))
    fs.mv(posixpath.join(staging_path, "latest"), posixpath.join(out_path, "latest"))
    discard(staging)


# ---- all together --------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ReshardResult:
    """What `reshard` wrote."""

    out: str
    tag: str
    stage: int
    precision: str
    source_world_size: int
    world_size: int
    files: tuple[str, ...]
    bytes_read: int
    bytes_written: int
    seconds: float


def reshard(src: str, out: str, *, world_size: int, tag: str | None = None, workers: int | None = None,
            progress: Progress | None = None, durable: bool = True) -> ReshardResult:
    """Reshard the checkpoint at `src` to `world_size` ranks into the new folder `out`.

    The source is validated first and refused, before anything is written, when it has problems.
    `out` must not exist or be empty. `workers` threads (default 4) write at once: one per target
    rank while there are more ranks than workers, and the rest share a rank's optimizer file (see
    `write_threads`). On any error nothing is left at `out` and the staging folder is removed.
    """
    from ckptflow.validate import validate

    started = time.monotonic()
    report = validate(src, tag=tag)
    if not report.ok or report.index is None:
        first = report.problems[0]
        more = f" (and {len(report.problems) - 1} more; run `ckptflow validate {src}`)" if len(report.problems) > 1 else ""
        raise CheckpointError(f"refusing to reshard {src}: {first.message}{more}", uri=src, file=first.file,
                              rank=first.rank)
    plan = plan_reshard(report.index, world_size)
    _check_not_inside(plan, out)
    staging = prepare_output(out, need=plan.write_bytes)
    total = plan.read_bytes  # source bytes to copy (a close estimate: small per-rank scalars are left out)
    done = 0
    lock = threading.Lock()

    def step(nbytes: int) -> None:
        nonlocal done
        with lock:
            done += nbytes
            current = done
        if progress is not None:
            progress(current, max(total, current))

    try:
        count = max(1, min(workers or 4, len(plan.units)))
        threads = write_threads(workers or 4, len(plan.units))
        if count == 1:
            results = [run_unit(plan, u, staging, progress=step, durable=durable, threads=threads)
                       for u in plan.units]
        else:
            with ThreadPoolExecutor(max_workers=count, thread_name_prefix="reshard") as pool:
                results = list(pool.map(
                    lambda u: run_unit(plan, u, staging, progress=step, durable=durable, threads=threads),
                    plan.units))
        finalize(plan, staging, out, durable=durable)
    except BaseException:
        discard(staging)
        raise
    seconds = time.monotonic() - started
    result = ReshardResult(
        out=out, tag=plan.tag, stage=plan.stage, precision=plan.precision, source_world_size=plan.source_world_size,
        world_size=plan.world_size, files=plan.files, bytes_read=sum(r.bytes_read for r in results),
        bytes_written=sum(r.bytes_written for r in results), seconds=seconds,
    )
    logger.info("resharded %s (%d ranks) to %s (%d ranks) in %.1f s", src, plan.source_world_size, out, world_size,
                seconds)
    return result


def write_threads(workers: int, units: int) -> int:
    """Threads per target rank when `workers` threads run `units` ranks: the workers left over once
    every running rank has one (4 workers: 4 threads for one rank, 2 each for two, 1 from three up)."""
    return max(1, workers // max(1, min(workers, units)))


def _check_not_inside(plan: ReshardPlan, out: str) -> None:
    src_fs, tag_path = open_fs(plan.index.tag_uri)
    out_fs, out_path = open_fs(out)
    if type(src_fs) is type(out_fs) and (out_path == tag_path or out_path.startswith(tag_path.rstrip("/") + "/")):
        raise OutputError(f"{out} is inside the source tag folder {plan.index.tag_uri}", uri=out,
                          hint="write the resharded checkpoint to a folder outside the source")


__all__ = [
    "FrozenPiece", "RankUnit", "ReshardPlan", "ReshardResult", "TargetFlat", "UnitResult", "discard", "finalize",
    "plan_reshard", "prepare_output", "reshard", "run_unit", "write_threads",
]
