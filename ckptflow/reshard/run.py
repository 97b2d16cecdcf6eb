"""Running a reshard: the checks before, the output folder around the units, and everything together.

1. `plan_output(src, out, target=M)`: validates the source (refusing it, before anything is
   written, when it has any problem), plans, and refuses an OUT inside the source.
2. `prepare_output(plan, out)`: OUT free, room on a local disk, a staging folder beside it
   (`plumbing.staging`).
3. `rank_job(plan, unit, staging)`, on the coordinator: the object trees of the target rank's files
   (`files.py`) pickled, and their storages as spans of source byte ranges: a `RankJob` that carries
   bytes and spans only, no plan, no index, no tree. `run_job(job)`, on a thread or a Dask worker,
   streams those spans into the rank's files in the staging folder (each source byte of weights and
   moments is read by exactly one unit; memory stays at a few chunks) and reports each file as a
   `plumbing.staging.Written`. `run_unit(plan, unit, staging)` does both.
4. `finalize(plan, staging, results)`: checks every reported file against the store's metadata,
   reads the staged checkpoint's headers back, carries the source's other files over (the Trainer's
   RNG files renamed for the new world size, `rng.py`), writes `latest` and commits everything into
   place with `latest` last. `abort(staging)` cleans up.

`ReshardStep` is 2-4 as a `plumbing.steps.Step`, which `run_step` runs on threads or on any
`concurrent.futures.Executor` (a Dask cluster, Prefect tasks); `reshard(src, out, world_size=M, ...)`
runs all four, as the CLI does, and the Prefect task runs the same step.
Archives carry torch's content-derived serialization id, so a rank's files are the same bytes whoever
writes them, and however often.
"""

from __future__ import annotations

import logging
import posixpath
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from ckptflow.errors import CheckpointError, OutputError, VerificationError
from ckptflow.formats.deepspeed import inspect
from ckptflow.formats.deepspeed.model import Partitioned
from ckptflow.formats.deepspeed.names import LATEST, is_rank_file
from ckptflow.formats.deepspeed.qkv import check_layout
from ckptflow.formats.deepspeed.tag import latest_hint, read_latest
from ckptflow.formats.hf import CONFIG_NAME, find_side_files, read_config
from ckptflow.formats.torch.pickler import OutStorage, dumps
from ckptflow.formats.torch.writer import CHUNK_BYTES, SourceReader, archive_size, write_pickled
from ckptflow.plumbing import staging as stage
from ckptflow.plumbing.files import check_regular, copy_all, copy_regular, load_json, write_bytes
from ckptflow.plumbing.progress import Progress, Tally
from ckptflow.plumbing.staging import Staging, Written, check_written, written
from ckptflow.plumbing.steps import Cancelled, run_step
from ckptflow.plumbing.storage import join, open_fs, unstrip
from ckptflow.plumbing.stores import digests_for, protocol
from ckptflow.plumbing.text import and_more, excerpt
from ckptflow.reshard.files import model_states, optim_states, tensor_file
from ckptflow.reshard.plan import ReshardOptions, plan_reshard, why_not_stages
from ckptflow.reshard.rng import RngCopy, describe, describe_families, is_rng_file, plan_rng_files
from ckptflow.reshard.shape import (
    Memory,
    Shape,
    SplitsByDegree,
    Target,
    check_world_size,
    memory,
    parameter_counts,
    shapes_at,
    source_shape,
)
from ckptflow.reshard.units import RankUnit, ReshardPlan
from ckptflow.validate import replica_problems, validate

logger = logging.getLogger(__name__)


# ---- before anything is written ---------------------------------------------------------------------


def plan_output(src: str, out: str, *, target: Target | int, tag: str | None = None,
                strict_pickle: bool = False) -> ReshardPlan:
    """The plan that reshards the checkpoint at `src` into `out` at `target` (a `Target`: ranks and the
    degrees that change; or a number of ranks, every degree kept); `strict_pickle` refuses client state.

    The source is validated first: any problem refuses it (`CheckpointError` naming the first one).
    An `out` inside the source's tag folder is refused (`OutputError`)."""
    index = _valid_index(src, tag, "reshard", strict_pickle=strict_pickle)
    plan = plan_reshard(index, target, model_config(index.root))
    if index.kind == "megatron" and plan.shape is not None and plan.source_shape is not None \
            and plan.shape.tp != plan.source_shape.tp:
        _check_replicas(src, index)
    _check_not_inside(plan, out)
    carried_files(plan, out)  # a special file or a link out of the folder refuses the source now, not at the end
    return plan


def _check_replicas(src: str, index: Any) -> None:
    """A tensor-parallel change keeps one copy of each replicated block, as DeepSpeed's universal converter
    does, and like it refuses a source whose copies differ (`CheckpointError` naming the first)."""
    problems = replica_problems(index)
    if problems:
        first = problems[0]
        more = and_more(len(problems) - 1, "problem", then=f"run `ckptflow validate --deep {src}`")
        raise CheckpointError(f"refusing to reshard {src}: {first.message}{more}", code=first.code, uri=src,
                              file=first.file)


def _valid_index(src: str, tag: str | None, doing: str, *, strict_pickle: bool = False) -> Partitioned:
    """The index of the checkpoint at `src`, validated first: any problem refuses it (`CheckpointError`
    naming the first one, "refusing to `doing` SRC: ...")."""
    report = validate(src, tag=tag, strict_pickle=strict_pickle)
    if not report.ok or report.index is None:
        first = report.problems[0]
        more = and_more(len(report.problems) - 1, "problem", then=f"run `ckptflow validate {src}`")
        raise CheckpointError(f"refusing to {doing} {src}: {first.message}{more}", code=first.code, uri=src,
                              file=first.file, rank=first.rank)
    return report.index


def model_config(root: str) -> Mapping[str, Any] | None:
    """The model's config.json in the checkpoint folder `root` (its `text_config` for a multimodal
    model), or None when there is none or it does not parse: it only narrows the shapes offered."""
    if CONFIG_NAME not in find_side_files(root):
        return None
    try:
        config = load_json(read_config(root))
    except ValueError:
        return None
    if isinstance(config, dict) and isinstance(config.get("text_config"), dict):
        config = config["text_config"]
    return config if isinstance(config, dict) else None


@dataclass(frozen=True, kw_only=True)
class ShapeOption:
    """A shape the checkpoint's model runs at, what it costs per GPU, and why ckptflow cannot write it
    (None: it can)."""

    shape: Shape
    memory: Memory
    reason: str | None


@dataclass(frozen=True, kw_only=True)
class ShapePlan:
    """What `--plan` shows: the checkpoint, its shape and per-GPU cost, and the shapes at a world size."""

    where: str
    layout: str
    source: Shape
    source_memory: Memory
    parameters: int
    options: tuple[ShapeOption, ...]


def plan_shapes(src: str, world_size: int, *, tag: str | None = None, qkv_layout: str | None = None,
                tied_modules: str | None = None, partition_method: str | None = None,
                pipeline_layers: int | None = None, layer_types: str | None = None) -> ShapePlan:
    """Every shape the checkpoint at `src` runs at on `world_size` ranks, with the per-GPU bytes each
    implies and whether ckptflow writes it (a Megatron fused `query_key_value` in the `qkv_layout` the user
    declares, `reshard.qkv`; a ZeRO-0 PipelineModule's `tied_modules` as the user names them; another
    number of pipeline stages cut by `partition_method`, with `pipeline_layers` and `layer_types` as a
    reshard takes them); reads the checkpoint's index, writes nothing."""
    check_world_size(world_size)
    check_layout(qkv_layout)
    asked = Target(world_size=world_size, qkv_layout=qkv_layout, tied_modules=tied_modules,
                   partition_method=partition_method, pipeline_layers=pipeline_layers, layer_types=layer_types)
    index = _valid_index(src, tag, "plan a reshard of")
    source = source_shape(index)
    splits: SplitsByDegree = {}  # this listing's, each tensor-parallel degree's computed once
    options = tuple(ShapeOption(shape=shape, memory=memory(index, shape),
                                reason=reason if reason is not None else why_not_stages(index, shape, splits=splits,
                                                                                       asked=asked))
                    for shape, reason in shapes_at(index, world_size, model_config(index.root), qkv_layout,
                                                   splits=splits))
    return ShapePlan(where=f"{index.root}/{index.tag}" if index.tag else index.root, layout=index.layout, source=source,
                     source_memory=memory(index, source), parameters=sum(parameter_counts(index)), options=options)


def _check_not_inside(plan: ReshardPlan, out: str) -> None:
    src_fs, tag_path = open_fs(plan.index.tag_uri)
    out_fs, out_path = open_fs(out)
    if type(src_fs) is type(out_fs) and (out_path == tag_path or out_path.startswith(tag_path.rstrip("/") + "/")):
        raise OutputError(f"{out} is inside the source tag folder {plan.index.tag_uri}", code="out-inside-source",
                          uri=out, hint="write the resharded checkpoint to a folder outside the source")


def prepare_output(plan: ReshardPlan, out: str) -> Staging:
    """Check that `out` is absent or an empty folder (and, on a local disk, that the files fit beside it)
    and make the staging folder."""
    return stage.prepare(out, need=plan.write_bytes)


# ---- one unit ---------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class RankResult:
    rank: int
    files: tuple[str, ...]
    bytes_read: int
    bytes_written: int
    seconds: float
    written: tuple[Written, ...] = ()  # each file as the unit left it: checked against the store before the commit


@dataclass(frozen=True, kw_only=True)
class FileJob:
    """One file of a target rank as a worker writes it: its name in the tag folder, its pickle, its
    storages (spans of source byte ranges, zeros elsewhere) and the size it must come to."""

    name: str
    pickle: bytes
    storages: tuple[OutStorage, ...]
    size: int

    @property
    def read_bytes(self) -> int:
        return sum(s.source_bytes for s in self.storages)


@dataclass(frozen=True, kw_only=True)
class RankJob:
    """One target rank as a worker gets it: its files as bytes and spans, where they go (`staging`,
    the staging folder's URI, and the tag folder in it), and how to write them."""

    rank: int
    world_size: int
    staging: str
    tag: str
    files: tuple[FileJob, ...]
    chunk_bytes: int = CHUNK_BYTES
    durable: bool = True
    threads: int = 1

    @property
    def read_bytes(self) -> int:
        return sum(f.read_bytes for f in self.files)


def rank_job(plan: ReshardPlan, unit: RankUnit, staging: Staging, *, chunk_bytes: int = CHUNK_BYTES,
             durable: bool = True, threads: int = 1) -> RankJob:
    """The job that writes target rank `unit.rank`'s files into `staging`: the object trees of
    `files.py`, pickled here (on the coordinator, which holds the index), so the worker only streams
    bytes."""
    return RankJob(rank=unit.rank, world_size=plan.world_size, staging=staging.uri, tag=plan.tag,
                   files=_file_jobs(plan, unit), chunk_bytes=chunk_bytes, durable=durable, threads=threads)


def _file_jobs(plan: ReshardPlan, unit: RankUnit) -> tuple[FileJob, ...]:
    files = []
    for name, tree in ((unit.optim_file, optim_states(plan, unit)),
                       *(((unit.model_file, model_states(plan, unit)),) if unit.model_file else ()),
                       *((f.name, tensor_file(f)) for f in unit.tensor_files)):
        data, storages = dumps(tree)
        files.append(FileJob(name=name, pickle=data, storages=tuple(storages), size=archive_size(name, data, storages)))
    return tuple(files)


def run_unit(plan: ReshardPlan, unit: RankUnit, staging: Staging, *, progress: Progress | None = None,
             chunk_bytes: int = CHUNK_BYTES, durable: bool = True, threads: int = 1,
             cancel: threading.Event | None = None) -> RankResult:
    """Write target rank `unit.rank`'s files into the staging folder, streaming from the source
    (`run_job(rank_job(...))`).

    `progress(done, total)` counts the source bytes copied, `unit.read_bytes` in all. Memory stays at a
    few `chunk_bytes` buffers plus the pickled metadata, whatever the partition size. In a local
    staging folder the optimizer file (nearly all the bytes) is written by `threads` threads at once.
    Running a unit again rewrites its files with the same bytes, so a failed unit can simply be retried.
    """
    if cancel is not None and cancel.is_set():
        raise Cancelled(f"rank {unit.rank}")
    job = rank_job(plan, unit, staging, chunk_bytes=chunk_bytes, durable=durable, threads=threads)
    return run_job(job, progress=progress, cancel=cancel)


def run_job(job: RankJob, *, progress: Progress | None = None, cancel: threading.Event | None = None) -> RankResult:
    """Write the job's files into the staging folder's tag folder, streaming their storages from the
    source, and report each (`Written`). A file that does not come to its planned size is an
    `OutputError` (a ckptflow bug). Safe to run again: the same bytes go to the same files."""
    started = time.monotonic()
    if cancel is not None and cancel.is_set():
        raise Cancelled(f"rank {job.rank}")
    tag_uri = join(job.staging, job.tag)
    fs, tag_path = open_fs(tag_uri)
    fs.makedirs(tag_path, exist_ok=True)
    store = protocol(fs)
    tally = Tally(job.read_bytes, progress)
    reader = SourceReader(job.chunk_bytes)
    size, reports = 0, []
    try:
        for file in job.files:
            if cancel is not None and cancel.is_set():
                raise Cancelled(f"rank {job.rank}")
            digests = digests_for(store, file.size)
            got = write_pickled(join(tag_uri, file.name), file.pickle, file.storages, reader,
                                progress=tally.part(file.name), durable=job.durable,
                                threads=job.threads if digests is None else 1, digests=digests)
            if got != file.size:
                raise OutputError(f"{join(tag_uri, file.name)} came to {got} bytes, {file.size} were planned",
                                  file=join(tag_uri, file.name), expected=file.size, actual=got,
                                  hint="this is a ckptflow bug; please report it")
            reports.append(written(job.staging, in_tag(job.tag, file.name), got, digests))
            size += got
    finally:
        reader.close()
    names = tuple(f.name for f in job.files)
    logger.info("rank %d of %d: wrote %s (%.1f MB) in %.2f s", job.rank, job.world_size, ", ".join(names), size / 1e6,
                time.monotonic() - started)
    return RankResult(rank=job.rank, files=names, bytes_read=reader.bytes_read, bytes_written=size,
                      seconds=time.monotonic() - started, written=tuple(reports))


def write_threads(workers: int, units: int) -> int:
    """Threads per target rank when `workers` threads run `units` ranks: the workers left over once
    every running rank has one (4 workers: 4 threads for one rank, 2 each for two, 1 from three up)."""
    return max(1, workers // max(1, min(workers, units)))


# ---- finishing ----------------------------------------------------------------------------------------


def finalize(plan: ReshardPlan, staging: Staging, *, durable: bool = True,
             results: Sequence[RankResult] = ()) -> tuple[RngCopy, ...]:
    """Check the staged checkpoint, carry the source's other files over, write `latest` and commit the
    whole into place (`latest` last). Returns the per-process RNG files written (`rng.plan_rng_files`).

    Files the plan carries as they are (PipelineModule layer files, per-expert files) are copied into the staged tag
    folder first, several at once (`plumbing.files.copy_all`), and made durable by the commit's fsync of
    every staged file. With the units' `results`, every planned file must have been reported and be in the
    staging folder as its unit left it (`plumbing.staging.check_written`: sizes and the store's
    checksums, no data read). The staged files' headers must then read back as a checkpoint at the new
    world size. Raises `VerificationError` otherwise; the staging folder is then left for `abort`."""
    inside = plan.root  # links in a local checkpoint folder must stay inside it
    if results:
        reported = [w for r in results for w in r.written]
        check_written(staging, reported, {w.name: w.size for w in reported})
        missing = sorted({in_tag(plan.tag, name) for name in set(plan.files) - set(plan.carried)}
                         - {w.name for w in reported})
        if missing:
            raise VerificationError(f"{missing[0]} was planned but no unit reported writing it", file=missing[0],
                                    hint="run every unit of the plan before finalize")
    copy_all([(join(plan.index.tag_uri, name), staging.join(posixpath.join(plan.tag, name))) for name in plan.carried],
             inside=inside, hint=_CARRY_HINT)  # flushed with the rest by the commit
    problem = _read_back(plan, staging.uri)
    if problem:
        raise VerificationError(f"the resharded checkpoint {problem}", uri=staging.uri, expected=plan.world_size,
                                hint="this is a ckptflow bug; please report it with the source's `ckptflow validate` "
                                     "output")
    rng_files = _carry_over(plan, staging, durable=durable)
    if not plan.tag:  # optimizer shards: no `latest`; on a bucket the shards go last, rank 0's first of them
        stage.commit(staging, last=[u.optim_file for u in plan.units], durable=durable)
        return rng_files
    write_bytes(staging.join(LATEST), plan.tag.encode())
    stage.commit(staging, last=[LATEST], durable=durable)
    return rng_files


def in_tag(tag: str, name: str) -> str:
    """The path of tag-folder file `name` relative to the checkpoint folder (the folder itself for
    optimizer shards, whose tag is "")."""
    return f"{tag}/{name}" if tag else name


def _read_back(plan: ReshardPlan, uri: str) -> str | None:
    """What is wrong with the checkpoint at `uri` as the output of `plan` (its headers read back: tag,
    layout, world size, stage and tensor count), or None."""
    index, problems, _ = inspect(uri, plan.tag or None)
    if index is not None:  # an expert-parallel checkpoint is planned over the ZeRO index under it
        index = index.zero_index() or index
    if problems:
        return f"does not read back as a valid checkpoint: {problems[0].message}"
    if not isinstance(index, type(plan.index)):
        return f"reads back as a {type(index).__name__}, where this run writes a {type(plan.index).__name__}"
    got, want = _tensor_count(index), _tensor_count(plan.index)
    if (index.world_size, index.stage, got) != (plan.world_size, plan.stage, want):
        return (f"reads back as ZeRO-{index.stage} at {index.world_size} ranks with {got} tensors, expected "
                f"ZeRO-{plan.stage} at {plan.world_size} with {want}")
    return None


def committed_output(plan: ReshardPlan, out: str) -> tuple[list[RankResult], tuple[RngCopy, ...]] | None:
    """What an earlier run of this same plan committed at OUT, as `ReshardStep.finalize` reports it
    (each rank's files and their sizes; the RNG files); None when OUT is absent or empty.

    OUT is taken when it holds exactly the files the plan writes (`latest` naming the plan's tag, each
    rank's files at their planned sizes, the files carried over from the source at theirs, the Trainer
    RNG files) and its headers read back as the plan's output (layout, world size, stage, tensor
    count; `finalize` checks the same before a commit). A DeepSpeed folder does not record its source,
    so the caller names OUT after the source's identity (the Prefect flow's workspace does). Anything
    else at OUT is an `OutputError` (code `out-exists`) that says what differs.
    """
    present = stage.committed_files(out)
    if not present:
        return None
    if not plan.tag:
        return _committed_shards(plan, out, present)
    if LATEST not in present:
        raise stage.not_this_output(out, f"it has no `{LATEST}` file")
    try:
        fs, path = open_fs(out)
        latest = read_latest(fs, posixpath.join(path, LATEST), join(out, LATEST))
    except CheckpointError as exc:  # its advice (fix `latest` or pass --tag) is not what to do here
        raise stage.not_this_output(out, str(exc).replace(f"; {latest_hint()}", "")) from None
    if latest != plan.tag:
        raise stage.not_this_output(out, f"its `{LATEST}` names {excerpt(latest)}, this run writes {excerpt(plan.tag)}")
    carried, rng_names = carried_files(plan, out)
    rng_files = plan_rng_files(rng_names, _processes(plan))
    expected = {LATEST: len(plan.tag.encode()), **{rel: _file_size(uri) for rel, uri in carried},
                **{c.target: _file_size(join(plan.root, c.source)) for c in rng_files},
                **{f"{plan.tag}/{name}": _file_size(join(plan.index.tag_uri, name)) for name in plan.carried}}
    files = {u.rank: _file_jobs(plan, u) for u in plan.units}
    expected.update({f"{plan.tag}/{f.name}": f.size for jobs in files.values() for f in jobs})
    stage.check_committed(out, present, expected)
    problem = _read_back(plan, out)
    if problem:
        raise stage.not_this_output(out, f"it {problem}")
    logger.info("%s already holds this checkpoint at %d ranks (committed by an earlier run)", out, plan.world_size)
    results = [RankResult(rank=u.rank, files=u.files, bytes_read=0, seconds=0.0,
                          bytes_written=sum(f.size for f in files[u.rank])) for u in plan.units]
    return results, rng_files


def _committed_shards(plan: ReshardPlan, out: str, present: Mapping[str, int]
                      ) -> tuple[list[RankResult], tuple[RngCopy, ...]]:
    """`committed_output` for optimizer shards: the carried files and each rank's file at their sizes, and
    the files read back as the plan's output."""
    carried, rng_names = carried_files(plan, out)
    rng_files = plan_rng_files(rng_names, _processes(plan))
    files = {u.rank: _file_jobs(plan, u) for u in plan.units}
    expected = {**{rel: _file_size(uri) for rel, uri in carried},
                **{c.target: _file_size(join(plan.root, c.source)) for c in rng_files},
                **{f.name: f.size for jobs in files.values() for f in jobs}}
    stage.check_committed(out, present, expected)
    problem = _read_back(plan, out)
    if problem:
        raise stage.not_this_output(out, f"it {problem}")
    results = [RankResult(rank=u.rank, files=u.files, bytes_read=0, seconds=0.0,
                          bytes_written=sum(f.size for f in files[u.rank])) for u in plan.units]
    return results, rng_files


def _file_size(uri: str) -> int:
    fs, path = open_fs(uri)
    return int(fs.size(path))


def _tensor_count(index: Partitioned) -> int:
    zero = index.zero_index()
    return len(zero.params) + len(zero.buffers) if zero is not None else len(index.model_tensors())


def abort(staging: Staging | None) -> None:
    """Remove the staging folder and everything in it (after a failure); never raises."""
    stage.abort(staging)


_CARRY_HINT = ("reshard carries the checkpoint folder's other files (Trainer state, scheduler, RNG, config, "
               "tokenizer) into OUT, and only regular files: replace it with a regular file or remove it")


def carried_files(plan: ReshardPlan, out: str) -> tuple[list[tuple[str, str]], list[str]]:
    """The files of the source folder that go into OUT besides this checkpoint's DeepSpeed files, as
    (path relative to the folder, URI), and the names of the per-process RNG files (`rng.FAMILIES`) (renamed for the new
    world size by `rng.plan_rng_files`). Each is checked to be a regular file that stays inside the
    folder (`plumbing.files`), so that copying it can neither hang nor leak a file from elsewhere.
    Other DeepSpeed tag folders, OUT and staging folders are left out."""
    src_fs, root = open_fs(plan.root)
    _, out_path = open_fs(out)
    inside = plan.root  # links in a local checkpoint folder must stay inside it
    files: list[tuple[str, str]] = []
    rng_names: list[str] = []
    source = plan.index
    skipped = source.own_entries()
    for entry in src_fs.ls(root, detail=True):
        path = entry["name"].rstrip("/")
        name = posixpath.basename(path)
        if name in skipped or posixpath.normpath(path) == posixpath.normpath(out_path) \
                or stage.is_staging_name(name):
            continue
        if entry["type"] == "directory":
            inner = [posixpath.basename(p) for p in src_fs.ls(path, detail=False)]
            if any(is_rank_file(n) for n in inner):
                logger.warning("not carrying over %s: it is another DeepSpeed tag folder, saved at %d ranks",
                               unstrip(src_fs, path), plan.source_world_size)
                continue
            found = src_fs.find(path, withdirs=False, detail=True)
            paths = [p for p, info in sorted(found.items())]
        else:
            paths = [path]
        for file in paths:
            uri = unstrip(src_fs, file)
            check_regular(uri, inside=inside, hint=_CARRY_HINT)
            if file == path and is_rng_file(name):
                rng_names.append(name)  # named for the source's world size: renamed on the way
            else:
                files.append((posixpath.relpath(file, root), uri))
    return files, rng_names


def _processes(plan: ReshardPlan) -> int:
    """The processes a Trainer (or Accelerate) runs the output with: every rank (tp x pp x dp), one RNG file each."""
    return plan.shape.world_size if plan.shape is not None else plan.world_size


def _carry_over(plan: ReshardPlan, staging: Staging, *, durable: bool = True) -> tuple[RngCopy, ...]:
    """Copy the source folder's other files (`carried_files`) into the staging folder; the per-process RNG
    files (the Trainer's, Accelerate's) go under the names the target world size reads
    (`rng.plan_rng_files`), which are returned."""
    files, rng_names = carried_files(plan, staging.out)
    inside = plan.root  # links in a local checkpoint folder must stay inside it
    for rel, uri in files:
        copy_regular(uri, staging.join(rel), inside=inside, hint=_CARRY_HINT, durable=durable)
    rng_files = plan_rng_files(rng_names, _processes(plan))
    for copy in rng_files:
        copy_regular(join(plan.root, copy.source), staging.join(copy.target), inside=inside, hint=_CARRY_HINT,
                     durable=durable)
    for label, text in describe_families(rng_files):
        logger.info("%s RNG files: %s", label, text)
    return rng_files


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
    rng_files: tuple[RngCopy, ...] = ()  # the per-process RNG files written for the new world size, from which files
    source_shape: Shape | None = None  # the shapes, in ranks and degrees (`world_size` above: data-parallel ranks)
    shape: Shape | None = None
    notes: tuple[str, ...] = ()  # what the user should know of the output (`ModelParallelPlan.notes`)

    @property
    def rng_summary(self) -> str:
        """One line on the RNG files (`rng.describe`)."""
        return describe(self.rng_files)


class ReshardStep:
    """Resharding `plan` into OUT, as the step driver runs it (`plumbing.steps`): units are the plan's
    target ranks, a job is a `RankJob` (its optimizer file written by `threads` threads), `run` is
    `run_job`, and `finalize` carries the source's other files over and commits `latest` last. Its
    output is the units' results and the RNG files written, as `committed_output` gives them."""

    run = staticmethod(run_job)

    def __init__(self, plan: ReshardPlan, out: str, *, durable: bool = True, threads: int = 1) -> None:
        self.plan, self.out, self.durable, self.threads = plan, out, durable, threads
        self.staging: Staging | None = None

    def committed(self) -> tuple[list[RankResult], tuple[RngCopy, ...]] | None:
        return committed_output(self.plan, self.out)

    def prepare(self) -> tuple[RankUnit, ...]:
        self.staging = prepare_output(self.plan, self.out)
        return tuple(self.plan.units)

    def check(self) -> None:
        """Nothing beside the units: every check of a reshard is in its plan."""

    def job(self, unit: RankUnit) -> RankJob:
        return rank_job(self.plan, unit, self._staging(), durable=self.durable, threads=self.threads)

    def unit_bytes(self, unit: RankUnit) -> int:
        """Source bytes copied (the small per-rank scalars left out)."""
        return unit.read_bytes

    def finalize(self, results: Sequence[RankResult]) -> tuple[list[RankResult], tuple[RngCopy, ...]]:
        return list(results), finalize(self.plan, self._staging(), durable=self.durable, results=results)

    def abort(self) -> None:
        abort(self.staging)

    def _staging(self) -> Staging:
        assert self.staging is not None, "prepare() comes first"
        return self.staging


def reshard(src: str, out: str, *, world_size: int | None = None, tag: str | None = None,
            options: ReshardOptions | None = None, workers: int | None = None, durable: bool = True,
            stage: int | None = None, tp: int | None = None, pp: int | None = None, ep: int | None = None,
            partition_method: str | None = None, pipeline_layers: int | None = None, qkv_layout: str | None = None,
            tied_modules: str | None = None, layer_types: str | None = None, progress: Progress | None = None,
            executor: Executor | None = None) -> ReshardResult:
    """Reshard the checkpoint at `src` into the new folder `out` as `options` say: for
    `options.world_size` ranks, at the ZeRO stage and tensor-, pipeline- and expert-parallel degrees
    given (every one not given is the source's; the data parallelism is what is left). The options may
    come as keywords instead (`ReshardOptions`' fields), not both.

    The source is validated first and refused, before anything is written, when it has problems.
    `out` must not exist or be empty. `workers` threads (default 4) write at once: one per target
    rank while there are more ranks than workers, and the rest share a rank's optimizer file (see
    `write_threads`); with `executor` (a Dask cluster's) the ranks run there instead, to the same
    bytes. On any error nothing is left at `out` and the staging folder is removed.
    """
    started = time.monotonic()
    asked = {"world_size": world_size, "stage": stage, "tp": tp, "pp": pp, "ep": ep, "workers": workers,
             "partition_method": partition_method, "pipeline_layers": pipeline_layers, "qkv_layout": qkv_layout,
             "tied_modules": tied_modules, "layer_types": layer_types}
    options = _options(options, asked, durable=durable)
    plan = plan_output(src, out, target=options.target, tag=tag, strict_pickle=options.strict_pickle)
    threads = write_threads(options.workers, len(plan.units)) if executor is None else 1
    step = ReshardStep(plan, out, durable=options.durable, threads=threads)
    results, rng_files = run_step(step, executor=executor, workers=options.workers, progress=progress, name="reshard")
    seconds = time.monotonic() - started
    logger.info("resharded %s (%s) to %s (%s) in %.1f s", src, plan.source_shape, out, plan.shape, seconds)
    return ReshardResult(
        out=out, tag=plan.tag, stage=plan.stage, precision=plan.precision, source_world_size=plan.source_world_size,
        world_size=plan.world_size, files=plan.files, bytes_read=sum(r.bytes_read for r in results),
        bytes_written=sum(r.bytes_written for r in results), seconds=seconds, rng_files=rng_files,
        source_shape=plan.source_shape, shape=plan.shape, notes=getattr(plan, "notes", ()),
    )


def _options(options: ReshardOptions | None, asked: dict[str, Any], *, durable: bool) -> ReshardOptions:
    """`options`, or the options the keywords give; a `TypeError` when both or neither are given."""
    given = {k: v for k, v in asked.items() if v is not None}
    if options is not None and (given or not durable):
        raise TypeError("give reshard() its options as `options` or as keywords, not both")
    if options is not None:
        return options
    if "world_size" not in given:
        raise TypeError("reshard() needs `world_size` (or `options`)")
    return ReshardOptions(**given, durable=durable, strict_pickle=False)
