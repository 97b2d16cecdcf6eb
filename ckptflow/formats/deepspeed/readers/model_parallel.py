"""Model-parallel checkpoints: one data-parallel checkpoint per model-parallel rank, joined into the
full model by the pieces each rank holds.

In every model-parallel layout DeepSpeed writes (AutoTP, PipelineModule, Megatron-style), the files of
one model-parallel rank `mp_rank_XX` are a complete data-parallel ZeRO checkpoint of that rank's local
tensors (`index.read_zero`, `zero0.read_zero0`). What differs between layouts is how a full tensor is
made of local ones; every reader says it the same way, as `Piece`s: a block of `shape` elements at
(offset, strides) in the full tensor and in the local tensor, the arguments of `torch.as_strided` on
both sides, exactly as DeepSpeed's affine maps describe a shard (`deepspeed/checkpoint/affine.py`).

`join` turns the pieces into byte `Run`s of the full tensor: one run per stretch that is contiguous on
both sides, or one strided run for rows that are back to back in the local tensor and a fixed stride
apart in the full one (a row-parallel shard), composed with the local tensor's own runs into the
rank's saved partitions. Nothing is guessed: the runs must tile the full tensor exactly, and pieces
that several ranks hold (replicated parameters, a pipeline's tied weight) are read from one and
paired with the others as `Replica`s, whose bytes `ckptflow validate --deep` compares.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ckptflow.errors import CheckpointError, CkptflowError
from ckptflow.formats.deepspeed.inspection import Inspection, Listing, StopReading, check_model_fields, open_rank_file
from ckptflow.formats.deepspeed.model import Degrees, ModelTensor, ZeroCheckpoint
from ckptflow.formats.deepspeed.names import EXPERT_FILE_RE, EXPP_FILE_RE, LATEST, LAYER_FILE_RE, model_file_name
from ckptflow.formats.deepspeed.readers.zero import optimizer_step, read_zero
from ckptflow.formats.deepspeed.readers.zero0 import Zero0Checkpoint, read_zero0
from ckptflow.formats.deepspeed.runs import Run, check_coverage
from ckptflow.plumbing.sizes import element_count
from ckptflow.plumbing.storage import join as join_uri
from ckptflow.plumbing.text import excerpt

MAX_PATTERN = 4096  # characters of a recorded name pattern ckptflow matches (longer ones are refused)
MAX_STRETCHES = 1 << 24  # per piece: beyond this a layout is strided element by element; refuse it


@dataclass(frozen=True)
class Piece:
    """`shape` elements at (`source`, `source_strides`) of the full tensor and (`dest`, `dest_strides`) of
    one rank's local tensor (flat, row-major): `as_strided(full, shape, source_strides, source) ==
    as_strided(local, shape, dest_strides, dest)`."""

    shape: tuple[int, ...]
    source: int
    source_strides: tuple[int, ...]
    dest: int
    dest_strides: tuple[int, ...]

    @property
    def numel(self) -> int:
        return element_count(self.shape)

    @property
    def geometry(self) -> tuple[Any, ...]:
        """What two holders of the same block agree on."""
        return (self.shape, self.source, self.source_strides)


@dataclass(frozen=True)
class Holding:
    """The pieces of one full tensor that model-parallel rank `mp_rank` holds in its local tensor `name`."""

    mp_rank: int
    name: str
    pieces: tuple[Piece, ...]


@dataclass(frozen=True)
class Replica:
    """One block of a full tensor held by two model-parallel ranks: `runs` (read) and `other` (not read)
    cover the same elements of the full tensor, and must hold the same bytes."""

    name: str
    mp_rank: int
    other_mp_rank: int
    runs: tuple[Run, ...]
    other: tuple[Run, ...]


def row_major(shape: Sequence[int]) -> tuple[int, ...]:
    """Element strides of a dense row-major tensor of `shape`."""
    strides, step = [], 1
    for dim in reversed(shape):
        strides.append(step)
        step *= dim
    return tuple(reversed(strides))


def about(name: str, exc: BaseException) -> str:
    """The message of `exc` as one about tensor `name`: prefixed with the name unless it starts with it."""
    text = str(exc)
    return text if text.startswith(f"{name}: ") else f"{name}: {text}"


def concat_pieces(shapes: Sequence[Sequence[int]], dim: int) -> tuple[tuple[int, ...], list[Piece]]:
    """The full shape and one piece per rank for local tensors of `shapes` concatenated on `dim`, in
    rank order (what Megatron-style column-, row- and vocabulary-parallel tensors are). `ValueError`
    when they do not concatenate."""
    first = tuple(shapes[0])
    if not 0 <= dim < len(first):
        raise ValueError(f"local shapes {[list(s) for s in shapes]} have no dimension {dim}")
    for shape in shapes:
        if len(shape) != len(first) or any(a != b for i, (a, b) in enumerate(zip(shape, first)) if i != dim):
            raise ValueError(f"local shapes {[list(s) for s in shapes]} do not concatenate on dimension {dim}")
    full = list(first)
    full[dim] = sum(s[dim] for s in shapes)
    strides = row_major(full)
    pieces, offset = [], 0
    for shape in shapes:
        shape = tuple(shape)
        pieces.append(Piece(shape, offset * strides[dim], strides, 0, row_major(shape)))
        offset += shape[dim]
    return tuple(full), pieces


def check_piece(piece: Piece, full_numel: int, local_numel: int) -> str | None:
    """What is wrong with `piece` as a block of a `full_numel`-element tensor and a `local_numel`-element
    local tensor, or None."""
    n = len(piece.shape)
    if len(piece.source_strides) != n or len(piece.dest_strides) != n:
        return f"its strides do not match its shape {excerpt(list(piece.shape))}"
    if any(d < 0 for d in piece.shape) or any(s < 0 for s in piece.source_strides + piece.dest_strides):
        return "it has negative sizes or strides"
    if piece.source < 0 or piece.dest < 0:
        return "it has a negative offset"
    if piece.numel == 0:
        return None
    last_source = piece.source + sum((d - 1) * s for d, s in zip(piece.shape, piece.source_strides))
    last_dest = piece.dest + sum((d - 1) * s for d, s in zip(piece.shape, piece.dest_strides))
    if last_source >= full_numel:
        return f"it reaches element {excerpt(last_source)} of a tensor of {excerpt(full_numel)}"
    if last_dest >= local_numel:
        return f"it reaches element {excerpt(last_dest)} of a local tensor of {local_numel}"
    return None


def stretches(piece: Piece) -> list[tuple[int, int, int, int, int]]:
    """(local start, full start, row, rows, full stride) of each stretch of `piece`, in the piece's own
    row-major order: `rows` rows of `row` elements, back to back in the local tensor from its local
    start, and `full stride` apart in the full tensor from its full start. Trailing dimensions dense on
    both sides merge into one row; the dimension before them becomes the rows when it is dense in the
    local tensor and its rows do not overlap in the full one."""
    dims = [(n, s, d) for n, s, d in zip(piece.shape, piece.source_strides, piece.dest_strides) if n != 1]
    if any(n == 0 for n, _, _ in dims):
        return []
    block, k = 1, len(dims)
    while k > 0 and dims[k - 1][1] == block and dims[k - 1][2] == block:
        block *= dims[k - 1][0]
        k -= 1
    outer = dims[:k]
    rows, stride = 1, 0
    if outer and outer[-1][2] == block and outer[-1][1] >= block:
        rows, stride, _ = outer.pop()
    count = element_count([n for n, _, _ in outer])
    if count > MAX_STRETCHES:
        raise CheckpointError(
            f"a piece of shape {excerpt(list(piece.shape))} is strided into {excerpt(count)} separate stretches",
            hint="ckptflow reads tensors by byte range; this split is too fine-grained to read",
        )
    out = []
    for index in itertools.product(*(range(n) for n, _, _ in outer)):
        source = piece.source + sum(i * s for i, (_, s, _) in zip(index, outer))
        dest = piece.dest + sum(i * d for i, (_, _, d) in zip(index, outer))
        out.append((dest, source, block, rows, stride))
    return out


def compose(name: str, local: ModelTensor, piece: Piece) -> list[Run]:
    """The runs of the full tensor that `piece` of `local` fills, read through `local`'s own runs."""
    runs = sorted(local.runs, key=lambda r: r.offset)
    starts = [r.offset for r in runs]
    out: list[Run] = []
    for dest, source, row, rows, stride in stretches(piece):
        pos, end = dest, dest + row * rows
        i = bisect.bisect_right(starts, pos) - 1
        while pos < end:
            if i < 0 or i >= len(runs) or not runs[i].offset <= pos < runs[i].offset + runs[i].numel:
                raise CheckpointError(f"{name}: element {pos} of its local tensor {local.name} is in no saved "
                                      "partition", tensor=name, hint="run `ckptflow validate` on the source")
            run = runs[i]
            take = min(end, run.offset + run.numel) - pos
            parts = _rows(run.ref, run.start + pos - run.offset, pos - dest, pos - dest + take, row, stride, source)
            for part in parts:
                _append(out, part)
            pos += take
            i += 1
    return out


def _rows(ref: Any, start: int, first: int, last: int, row: int, stride: int, full: int) -> list[Run]:
    """Runs for elements [first, last) of a stretch of rows of `row` elements landing `stride` apart
    from element `full` of the full tensor, read from `ref` at element `start` onwards: a cut row at
    each end, the whole rows between them as one strided run."""
    out = []
    while first < last:
        r, c = divmod(first, row)
        if c or last - first < row:
            n = min(row - c, last - first)
            out.append(Run(ref, start, n, full + r * stride + c))
        else:
            k = (last - first) // row
            n = k * row
            out.append(Run(ref, start, n, full + r * stride, k, stride if k > 1 else 0))
        start, first = start + n, first + n
    return out


def _append(runs: list[Run], run: Run) -> None:
    last = runs[-1] if runs else None
    if last is not None and last.rows == run.rows == 1 and last.ref == run.ref \
            and last.start + last.numel == run.start and last.offset + last.numel == run.offset:
        runs[-1] = Run(last.ref, last.start, last.numel + run.numel, last.offset)
    else:
        runs.append(run)


def clip(runs: Sequence[Run], numel: int) -> tuple[Run, ...]:
    """`runs` cut to the first `numel` elements of the full tensor (vocabulary padding dropped)."""
    return tuple(part for run in runs for part in run.within(0, numel))


def join(name: str, shape: Sequence[int], kind: str, holdings: Sequence[Holding],
         local: Callable[[int, str], ModelTensor], *, rows: int | None = None) -> tuple[ModelTensor, list[Replica]]:
    """The full tensor `name` of `shape` made of `holdings`, with the replicas it has.

    `local(mp_rank, local_name)` gives a rank's local tensor. Pieces with the same geometry held by
    several ranks are read from the first holding that has them; the others become `Replica`s. With
    `rows`, only the first `rows` rows are kept (vocabulary padding cut). Raises `CheckpointError` when
    the pieces do not tile the tensor or a piece does not fit its local tensor."""
    shape = tuple(int(d) for d in shape)
    numel = element_count(shape)
    primary: dict[tuple[Any, ...], tuple[int, list[Run]]] = {}
    replicas: list[Replica] = []
    dtypes = set()
    for holding in holdings:
        tensor = local(holding.mp_rank, holding.name)
        dtypes.add(tensor.dtype)
        for piece in holding.pieces:
            bad = check_piece(piece, numel, tensor.numel)
            if bad:
                where = "" if holding.name == name else f" in {holding.name}"
                raise CheckpointError(f"{name}: a piece that rank {holding.mp_rank} holds{where} does not fit: {bad}",
                                      tensor=name, hint="the checkpoint's split metadata is inconsistent")
            runs = compose(name, tensor, piece)
            first = primary.get(piece.geometry)
            if first is None:
                primary[piece.geometry] = (holding.mp_rank, runs)
            else:
                replicas.append(Replica(name, first[0], holding.mp_rank, tuple(first[1]), tuple(runs)))
    if len(dtypes) > 1:
        raise CheckpointError(f"{name}: its local tensors are saved as {sorted(dtypes)} on different ranks",
                              tensor=name, hint="the folder mixes saves: re-copy it from one save")
    runs = [run for _, rank_runs in primary.values() for run in rank_runs]
    try:
        check_coverage(name, numel, runs)
    except CheckpointError:
        ranks = sorted({h.mp_rank for h in holdings})
        held = " and ".join(f"rank {r}" for r in ranks) if len(ranks) <= 2 else f"rank {ranks[0]} to rank {ranks[-1]}"
        raise CheckpointError(
            f"{name}: the pieces held by {held} do not tile its {excerpt(numel)} elements (they overlap or leave a "
            "gap)",
            tensor=name, hint="the checkpoint's split metadata is inconsistent: the folder mixes saves or a file is "
            "damaged; re-copy it from one save",
        ) from None
    runs.sort(key=lambda r: r.offset)
    out_shape = shape
    if rows is not None and shape and rows != shape[0]:
        if not 0 < rows < shape[0]:
            raise CheckpointError(
                f"{name}: the checkpoint records a vocabulary of {excerpt(rows)} rows (`original_vocab_size`) "
                f"but the tensor has {excerpt(shape[0])}", tensor=name, hint="the checkpoint's metadata is "
                "inconsistent: the folder mixes saves or a file is damaged; re-copy it from one save",
            )
        out_shape = (rows, *shape[1:])
        runs = list(clip(runs, element_count(out_shape)))
    return ModelTensor(name, out_shape, dtypes.pop() if dtypes else "float32", kind, tuple(runs)), replicas


# ---- the index ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelParallelCheckpoint:
    """Index of a model-parallel checkpoint: the data-parallel checkpoint of each model-parallel rank
    (`ranks`, by `mp_rank_XX`), the full model they make (`tensors`), and the blocks held twice
    (`replicas`). `carried` lists the tag folder's other DeepSpeed files (PipelineModule layer files),
    which a data-parallel reshard keeps as they are, and `layers` their tensors by (layer, tensor-parallel
    rank): what a tensor-parallel change writes again at the new degree."""

    root: str
    tag: str
    stage: int
    world_size: int  # the data-parallel size
    precision: str
    step: int
    ds_version: str
    kind: str  # the detected layout kind: "autotp", "pipeline", "megatron"
    description: str
    tp: int
    pp: int
    ranks: tuple[Any, ...]  # ZeroCheckpoint or Zero0Checkpoint per model-parallel rank
    tensors: tuple[ModelTensor, ...]
    tied: Mapping[str, str]
    replicas: tuple[Replica, ...]
    carried: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    layers: Mapping[tuple[int, int], Mapping[str, Any]] = field(default_factory=dict, repr=False, compare=False)
    tied_layers: tuple[tuple[str, int], ...] = ()  # PipelineModule: (tied module key, the layer whose file holds it)
    # Megatron-style PipelineModule: a tied module's copy on each stage after the lowest that trains it, by
    # (name, stage) (`readers.pipeline`: they may differ; `tensors` holds the lowest's)
    stage_copies: Mapping[tuple[str, int], ModelTensor] = field(default_factory=dict, repr=False, compare=False)

    @property
    def tag_uri(self) -> str:
        return join_uri(self.root, self.tag)

    @property
    def layout(self) -> str:
        return self.description

    @property
    def degrees(self) -> Degrees:
        return Degrees(self.world_size, tp=self.tp, pp=self.pp)

    def zero_index(self) -> None:
        return None

    def own_entries(self) -> frozenset[str]:
        return frozenset((LATEST, self.tag))

    @property
    def mp_world_size(self) -> int:
        return len(self.ranks)

    def rank_step(self, mp_rank: int) -> float | None:
        """The step model-parallel rank `mp_rank`'s optimizer is at (None when it has not stepped or the
        step cannot be read): counted when a ZeRO-0 rank is read, recorded in a ZeRO-1/2/3 rank's partitions."""
        rank = self.ranks[mp_rank]
        if isinstance(rank, Zero0Checkpoint):
            return float(rank.optimizer_step)
        try:
            step = optimizer_step(rank.partitions[0])
            return None if step is None else float(step)
        except (CkptflowError, OSError, ValueError, OverflowError):
            return None

    def rank_model_file(self, mp_rank: int) -> str:
        """The model-states file of model-parallel rank `mp_rank` (data-parallel rank 0's)."""
        rank = self.ranks[mp_rank]
        return str(rank.model_file if isinstance(rank, Zero0Checkpoint) else rank.model_file(0))

    def rank_label(self, mp_rank: int) -> str:
        """Model-parallel rank `mp_rank` in words, e.g. "pipeline stage 1 of 2, tensor-parallel rank 0 of 2"."""
        stage = f"pipeline stage {mp_rank // self.tp} of {self.pp}"
        tensor = f"tensor-parallel rank {mp_rank % self.tp} of {self.tp}"
        if self.pp > 1:
            return f"{stage}, {tensor}" if self.tp > 1 else stage
        return tensor

    def model_tensors(self) -> tuple[ModelTensor, ...]:
        return self.tensors

    def summary(self) -> dict[str, Any]:
        params = [t for t in self.tensors if t.kind != "buffer"]
        groups = getattr(self.ranks[0], "groups", None)
        return {
            "layout": self.layout,
            "stage": self.stage,
            "world_size": self.world_size,
            "tp": self.tp,
            "pp": self.pp,
            "mp_world_size": self.mp_world_size,
            "precision": self.precision,
            "step": self.step,
            "ds_version": self.ds_version,
            "params": len(params),
            "numel": sum(t.numel for t in params),
            "frozen": sum(t.kind == "frozen" for t in params),
            "tied": len(self.tied),
            "buffers": sum(t.kind == "buffer" for t in self.tensors),
            "replicated_blocks": len(self.replicas),
            **({"param_groups": len(groups)} if groups is not None else
               {"param_groups": getattr(self.ranks[0], "optimizer_groups", 0)}),
            "notes": list(self.notes),
        }


# ---- reading every model-parallel rank -------------------------------------------------------------

RankIndex = ZeroCheckpoint | Zero0Checkpoint


def check_mp_files(st: Inspection, listing: Listing, count: int, where: Callable[[int], str], description: str,
                   *, layer_files: bool = False) -> None:
    """Data-parallel rank 0's model states of each of the `count` model-parallel ranks present (stops
    when one is missing); no file of a model-parallel rank beyond them, no expert files, and (unless
    `layer_files`) no pipeline layer files. Per-rank files are `read_ranks`' to check."""
    stage3 = listing.stage3
    missing = False
    for mp in range(count):
        name = model_file_name(3 if stage3 else 1, 0, mp)
        if name not in listing.names:
            st.add("rank-missing", f"{where(mp)} is missing: expected {st.tag}/{name} under {st.root}; the upload may "
                   f"still be in progress, or the checkpoint was saved with fewer model-parallel ranks",
                   file=join_uri(listing.tag_uri, name))
            missing = True
    for name, match in [*listing.model_names.items(), *listing.optim_names.items()]:
        mp = int(match.group(2 if name in listing.model_names else 3))
        if mp >= count:
            st.add("rank-extra", f"unexpected file {st.tag}/{name}: model-parallel rank {mp} is beyond the {count} "
                   f"ranks of this {description} checkpoint; it is left over from another save into the same tag "
                   "folder: remove it, or re-save the checkpoint into a fresh folder",
                   file=join_uri(listing.tag_uri, name))
    for name in listing.names:
        if EXPERT_FILE_RE.match(name) or EXPP_FILE_RE.match(name) or (LAYER_FILE_RE.match(name) and not layer_files):
            st.add("rank-extra", f"unexpected file {st.tag}/{name}: a {description} checkpoint has no such file; it "
                   "is left over from another save into the same tag folder: remove it, or re-save the checkpoint "
                   "into a fresh folder", file=join_uri(listing.tag_uri, name))
    if missing:
        st.stop_if_any()


def stop_on_new(st: Inspection, since: int) -> None:
    """Stop reading when problems were found after the first `since` (earlier ones, such as left-over
    files, do not keep the ranks from being read and checked)."""
    if len(st.problems) > since:
        raise StopReading


def open_heads(st: Inspection, listing: Listing, model0: dict[str, Any], count: int) -> list[dict[str, Any]]:
    """Data-parallel rank 0's model states of every model-parallel rank (`model0` is rank 0's), their
    fields checked before any layout reads them. Stops if a field is not what DeepSpeed writes."""
    heads = [model0] + [open_rank_file(st, listing.model_uri(mp), rank=0) for mp in range(1, count)]
    before = len(st.problems)
    for mp, head in enumerate(heads):
        check_model_fields(st, head, listing.model_uri(mp), 0)
    if len(st.problems) > before:
        st.stop_if_any()
    return heads


def read_ranks(st: Inspection, listing: Listing, heads: Sequence[dict[str, Any]], stage: int | None,
               where: Callable[[int], str],
               modules: Sequence[Mapping[str, Any] | None] | None = None) -> list[RankIndex]:
    """The data-parallel checkpoint of every model-parallel rank (`heads[mp]` its rank-0 model states),
    each read on its own so that every rank's problems are reported; then they must agree on stage,
    data-parallel size, precision, step and version. Stops at any problem."""
    out: list[RankIndex] = []
    for mp, head in enumerate(heads):
        sub = Inspection(st.root, st.tag, explicit_tag=st.explicit_tag, allowed=st.allowed, cache=st.cache)
        module = modules[mp] if modules is not None else None
        try:
            reader = read_zero0 if stage == 0 else read_zero
            out.append(reader(sub, listing, head, mp_rank=mp, mp_world_size=len(heads), where=where(mp),
                              module=module))
        except StopReading:
            pass
        st.problems.extend(sub.problems)
    st.stop_if_any()
    first = out[0]
    for mp, index in enumerate(out[1:], start=1):
        for attr, label in (("stage", "ZeRO stage"), ("world_size", "data-parallel world size"),
                            ("precision", "precision"), ("step", "global step"), ("ds_version", "DeepSpeed version")):
            if getattr(index, attr) != getattr(first, attr):
                st.add("ranks-disagree", f"{where(mp)} records {label} {excerpt(getattr(index, attr))} but {where(0)} "
                       f"records {excerpt(getattr(first, attr))}; the folder mixes files from different saves: re-copy "
                       "the tag folder from one save", file=listing.model_uri(mp))
        dims = heads[mp].get("checkpoint_parallel_dimensions")
        if dims != heads[0].get("checkpoint_parallel_dimensions"):
            st.add("ranks-disagree", f"{where(mp)} records parallel dimensions {excerpt(dims)} but {where(0)} records "
                   f"{excerpt(heads[0].get('checkpoint_parallel_dimensions'))}; re-copy the tag folder from one save",
                   file=listing.model_uri(mp))
    st.stop_if_any()
    return out


def local_tensors(
    st: Inspection, ranks: Sequence[RankIndex], where: Callable[[int], str]
) -> list[dict[str, ModelTensor]]:
    """Each rank's local tensors by name; a rank whose runs do not add up is a problem (and stops)."""
    out = []
    for mp, index in enumerate(ranks):
        try:
            out.append({t.name: t for t in index.model_tensors()})
        except CkptflowError as exc:
            st.add(exc.code, f"{where(mp)}: {exc}", file=getattr(exc, "file", None))
            out.append({})
    st.stop_if_any()
    return out


__all__ = ["Holding", "ModelParallelCheckpoint", "Piece", "RankIndex", "Replica", "check_mp_files", "check_piece",
           "clip", "compose", "concat_pieces", "join", "local_tensors", "open_heads", "read_ranks", "row_major",
           "stop_on_new", "stretches"]
