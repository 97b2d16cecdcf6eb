"""Running a consolidation: the output folder around the units, and everything together.

`prepare_output(plan, out)` checks the config and tokenizer files (SRC's, and those of the config
source `options.config` names, its config.json checked against the tensors: `consolidate.config`),
OUT and the free space, and makes the staging folder (`plumbing.staging`); the units
(`consolidate.write.run_job`, one `ShardJob` per shard) write into it; `finalize` checks what each
unit reports against the store's metadata, adds the config and tokenizer files, a provenance record
and the shard index, then commits the folder into place with the index (or the only shard) last.
`abort` removes the staging folder. `ConsolidateStep` is the four as a `plumbing.steps.Step`, which
`run_step` runs on threads or on any `concurrent.futures.Executor` (a Dask cluster, Prefect tasks);
`consolidate(src, out, ...)` does all of it. The coordinator (the process that plans and finalizes)
reads headers and pickles only, never a tensor byte.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from ckptflow.consolidate.config import SideFiles, checked, shaped, side_files
from ckptflow.consolidate.plan import ConsolidateOptions, ConsolidationPlan, ShardUnit, plan_consolidation
from ckptflow.consolidate.write import ShardJob, ShardResult, run_job, shard_job
from ckptflow.errors import OutputError, option
from ckptflow.formats import hf
from ckptflow.formats.deepspeed import load_index
from ckptflow.plumbing import staging as stage
from ckptflow.plumbing.files import load_json, read_regular, write_bytes
from ckptflow.plumbing.progress import Progress
from ckptflow.plumbing.redaction import describe
from ckptflow.plumbing.sizes import format_size
from ckptflow.plumbing.staging import Staging, check_written
from ckptflow.plumbing.steps import run_step
from ckptflow.plumbing.storage import join, open_fs
from ckptflow.plumbing.stores.local import os_path
from ckptflow.plumbing.text import excerpt

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConsolidationResult:
    """What `consolidate` / `finalize` produced."""

    out: str
    shards: tuple[ShardResult, ...]
    side_files: tuple[str, ...]
    files: tuple[str, ...]
    total_size: int
    dtype: str
    verified: bool
    plan: ConsolidationPlan = field(repr=False, compare=False)
    side: SideFiles | None = field(default=None, repr=False, compare=False)

    @property
    def has_config(self) -> bool:
        """Whether the folder holds a config.json (without one, `from_pretrained` cannot load it)."""
        return hf.CONFIG_NAME in self.side_files


def prepare_output(plan: ConsolidationPlan, out: str, side: SideFiles | None = None) -> Staging:
    """Check the config and tokenizer files that go with the model (`side`, by default found now:
    `consolidate.config.side_files`; SRC's regular files, config.json parsed: `hf.check_side_files`),
    that OUT is free (absent or an empty folder) and, on a local disk, that there is room; make the
    staging folder beside it. Nothing is written when a check fails."""
    side = side if side is not None else side_files(plan)
    size = hf.check_side_files(plan.root, side.own) + sum(side.sizes(plan.dtype).values())
    need = plan.file_bytes + size + (1 << 20)  # checked on a local disk only (`stage.prepare`)
    return stage.prepare(out, need=need)


def ckptflow_version() -> str:
    """This package's version (from its metadata when an editable install hides `ckptflow.__version__`)."""
    try:
        from ckptflow import __version__

        return __version__
    except ImportError:
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("ckptflow")
        except PackageNotFoundError:
            return "unknown"


def provenance(plan: ConsolidationPlan, shards: Sequence[ShardResult], side: SideFiles | None = None
               ) -> dict[str, Any]:
    """The record written beside the model: where it came from and what each shard hashes to; with a
    config source, where the config came from (`SideFiles.record`)."""
    local = os_path(plan.root)
    root = os.path.abspath(local) if local is not None else plan.root
    config = side.record(plan.dtype) if side is not None else None
    return {
        "ckptflow_version": ckptflow_version(),
        "source": {
            "uri": join(root, plan.tag),
            "root": root,
            "tag": plan.tag,
            "step": plan.step,
            "zero_stage": plan.stage,
            "world_size": plan.world_size,
            "precision": plan.precision,
            "deepspeed_version": plan.ds_version,
            "layout": plan.source_layout,
            **({"notes": list(plan.notes)} if plan.notes else {}),  # what the reader could not name, ...
        },
        "output": {
            "dtype": plan.dtype,
            "max_shard_size": plan.options.max_shard_size,
            "exclude_frozen": plan.options.exclude_frozen,
            "qkv_layout": plan.options.qkv_layout,  # None (null) where none was declared
            "excluded": list(plan.excluded),
            "tied": dict(plan.tied),
            "total_size": plan.total_size,
            "total_parameters": plan.total_parameters,
            "verified": all(s.verified for s in shards),
        },
        "shards": {s.filename: {"sha256": s.sha256, "size": s.size} for s in sorted(shards, key=lambda s: s.index)},
        **({"config": config} if config is not None else {}),
    }


def finalize(plan: ConsolidationPlan, results: Sequence[ShardResult], staging: Staging,
             side: SideFiles | None = None) -> ConsolidationResult:
    """Add config and tokenizer files (`side`, by default SRC's: `consolidate.config.side_files`),
    provenance and index to `staging`, then commit it into place as OUT, the index last (or, unsharded,
    the only shard last: it is what makes the folder loadable).

    Raises `OutputError` when a unit's shard is missing, `VerificationError` when a shard in the
    staging folder is not what its unit reported writing (`plumbing.staging.check_written`: sizes and
    the store's checksums, no data read); the staging folder is then left for `abort`.
    """
    got = {r.filename: r for r in results}
    sizes = {u.filename: u.file().file_size for u in plan.units}
    for unit in plan.units:
        result = got.get(unit.filename)
        if result is None or result.size != sizes[unit.filename]:
            raise OutputError(f"shard {unit.filename} has not been written to {staging.uri}", file=unit.filename,
                              hint="run every unit of the plan before finalize")
    shards = tuple(got[u.filename] for u in plan.units)
    check_written(staging, [s.written for s in shards if s.written is not None],
                  {s.filename: sizes[s.filename] for s in shards if s.written is not None})
    side = side if side is not None else side_files(plan)
    hf.copy_side_files(plan.root, side.own, staging.uri, plan.dtype)
    hf.write_side_files(side.given, staging.uri, plan.dtype)
    record = json.dumps(provenance(plan, shards, side), indent=2, sort_keys=True) + "\n"
    write_bytes(staging.join(hf.PROVENANCE_NAME), record.encode())
    files = [u.filename for u in plan.units] + list(side.names) + [hf.PROVENANCE_NAME]
    if plan.sharded:
        text = hf.index_json(plan.weight_map, total_size=plan.total_size, total_parameters=plan.total_parameters)
        write_bytes(staging.join(hf.SAFE_WEIGHTS_INDEX_NAME), text.encode())
        files.append(hf.SAFE_WEIGHTS_INDEX_NAME)
    marker = files[-1] if plan.sharded else files[0]
    stage.commit(staging, first=[u.filename for u in plan.units if u.filename != marker], last=[marker])
    verified = all(s.verified for s in shards)
    logger.info("consolidated %s/%s into %s: %d shard(s), %s %s%s", plan.root, plan.tag, staging.out, len(shards),
                format_size(plan.total_size), plan.dtype, ", verified" if verified else "")
    return ConsolidationResult(out=staging.out, shards=shards, side_files=side.names,
                               files=tuple([f for f in files if f != marker] + [marker]),
                               total_size=plan.total_size, dtype=plan.dtype, verified=verified, plan=plan, side=side)


PROVENANCE_LIMIT = 64 << 20  # the record lists every shard and tied name: a few hundred KiB at 405B
# What a committed model must have been made with to be taken as this plan's: (record section, key).
RECORD_KEYS = (("source", "uri"), ("source", "tag"), ("source", "step"), ("output", "dtype"),
               ("output", "max_shard_size"), ("output", "exclude_frozen"), ("output", "qkv_layout"),
               ("output", "total_size"), ("output", "total_parameters"))
SHA256 = re.compile(r"[0-9a-f]{64}")


def committed_output(plan: ConsolidationPlan, out: str, side: SideFiles | None = None) -> ConsolidationResult | None:
    """The model an earlier run of this same plan committed at OUT; None when OUT is absent or empty.

    OUT is taken when its provenance record names the plan's source, tag and output options (and says
    the shards were verified, when the plan verifies) and the same config source files (`side`, by
    default found now: `consolidate.config.side_files`), and it holds exactly the files the plan writes:
    each shard at its planned size with the record's sha256 for it, the config and tokenizer files at
    the sizes they come to, the shard index byte for byte. No tensor byte is read: the commit moves the
    index (or the only shard) last, so a folder that holds it is whole. Anything else at OUT is an
    `OutputError` (code `out-exists`) that says what differs.
    """
    present = stage.committed_files(out)
    if not present:
        return None
    if hf.PROVENANCE_NAME not in present:
        raise stage.not_this_output(out, f"it has no {hf.PROVENANCE_NAME}, so ckptflow did not write it")
    try:
        record = load_json(read_regular(join(out, hf.PROVENANCE_NAME), limit=PROVENANCE_LIMIT,
                                        what="provenance record"))
    except ValueError as exc:  # not JSON, too deep, too large, not a regular file
        raise stage.not_this_output(out, f"its {hf.PROVENANCE_NAME} does not read back ({describe(exc)})") from None
    if not isinstance(record, dict) or not all(isinstance(record.get(k), dict) for k in ("source", "output", "shards")):
        raise stage.not_this_output(out, f"its {hf.PROVENANCE_NAME} is not a ckptflow provenance record")
    output, listed = record["output"], record["shards"]
    want = provenance(plan, ())
    for part, key in RECORD_KEYS:
        found = record[part].get(key)
        if found != want[part][key]:
            raise stage.not_this_output(out, f"it was made with {part} {key} {excerpt(found)}, this run asks for "
                                             f"{excerpt(want[part][key])}")
    side = side if side is not None else side_files(plan)
    if record.get("config") != side.record(plan.dtype):
        raise stage.not_this_output(out, "its config and tokenizer files came from another config source (or "
                                         "none): see the config section of its " + hf.PROVENANCE_NAME)
    if plan.options.verify and output.get("verified") is not True:
        raise stage.not_this_output(out, f"its shards were written without {option('verify')}, this run verifies them")
    sizes = {u.filename: u.file().file_size for u in plan.units}
    if sorted(listed) != sorted(sizes):
        raise stage.not_this_output(out, f"its {hf.PROVENANCE_NAME} lists other shards than this plan writes")
    for name, size in sizes.items():
        entry = listed[name]
        if present.get(name) != size or not isinstance(entry, dict) or entry.get("size") != size \
                or not SHA256.fullmatch(str(entry.get("sha256"))):
            raise stage.not_this_output(out, f"its {name} is missing, is not {size} bytes or has no sha256")
    expected = {**_side_sizes(plan, side.own), **side.sizes(plan.dtype), **sizes,
                hf.PROVENANCE_NAME: present[hf.PROVENANCE_NAME]}
    if plan.sharded:
        index = hf.index_json(plan.weight_map, total_size=plan.total_size, total_parameters=plan.total_parameters)
        expected[hf.SAFE_WEIGHTS_INDEX_NAME] = len(index.encode())
    stage.check_committed(out, present, expected)
    if plan.sharded and read_regular(join(out, hf.SAFE_WEIGHTS_INDEX_NAME), limit=len(index.encode()),
                                     what="shard index") != index.encode():
        raise stage.not_this_output(out, f"its {hf.SAFE_WEIGHTS_INDEX_NAME} is not the index of this model")
    shards = tuple(ShardResult(u.index, u.filename, sizes[u.filename], listed[u.filename]["sha256"],
                              output.get("verified") is True) for u in plan.units)
    files = [u.filename for u in plan.units] + list(side.names) + [hf.PROVENANCE_NAME]
    marker = hf.SAFE_WEIGHTS_INDEX_NAME if plan.sharded else files[0]
    files = [f for f in files if f != marker] + [marker]
    logger.info("%s already holds this model (committed by an earlier run): %d shard(s), %s %s", out, len(shards),
                format_size(plan.total_size), plan.dtype)
    return ConsolidationResult(out=out, shards=shards, side_files=side.names, files=tuple(files),
                               total_size=plan.total_size, dtype=plan.dtype,
                               verified=all(s.verified for s in shards), plan=plan, side=side)


def _side_sizes(plan: ConsolidationPlan, names: Sequence[str]) -> dict[str, int]:
    """The size each config and tokenizer file comes to in the model folder (`hf.copy_side_files`)."""
    fs, root = open_fs(plan.root)
    return {name: len(hf.rewrite_config(hf.read_config(plan.root), plan.dtype)) if name == hf.CONFIG_NAME
            else int(fs.size(f"{root}/{name}")) for name in names}


def abort(staging: Staging | None) -> None:
    """Remove the staging folder (after a failure); never raises."""
    stage.abort(staging)


class ConsolidateStep:
    """Consolidating `plan` into OUT, as the step driver runs it (`plumbing.steps`): units are the
    plan's shards, a job is a `ShardJob`, `run` is `run_job`, `check` checks a config source's
    config.json against the plan beside the units (transformers' import and a model built on the meta
    device: seconds, fixed, that the shards are written in meanwhile), and `finalize` commits the
    index (or the only shard) last. The coordinator reads headers and pickles only, never a tensor byte."""

    run = staticmethod(run_job)

    def __init__(self, plan: ConsolidationPlan, out: str, side: SideFiles | None = None) -> None:
        self.plan, self.out = plan, out
        self.staging: Staging | None = None
        self.side = side  # the side files, found and read (a given config.json checked once `check` ran)

    def side_files(self) -> SideFiles:
        """The config and tokenizer files, found, read and checked (each once)."""
        self.side = checked(self.plan, self._found())
        return self.side

    def committed(self) -> ConsolidationResult | None:
        return committed_output(self.plan, self.out, self.side_files())

    def prepare(self) -> tuple[ShardUnit, ...]:
        self.staging = prepare_output(self.plan, self.out, self._found())
        return self.plan.units

    def check(self) -> None:
        self.side_files()

    def job(self, unit: ShardUnit) -> ShardJob:
        return shard_job(self.plan, unit, self._staging())

    def unit_bytes(self, unit: ShardUnit) -> int:
        """Bytes written, and with `verify` read back and checked."""
        return unit.nbytes * (2 if self.plan.options.verify else 1)

    def finalize(self, results: Sequence[ShardResult]) -> ConsolidationResult:
        return finalize(self.plan, results, self._staging(), self.side_files())

    def abort(self) -> None:
        abort(self.staging)

    def _found(self) -> SideFiles:
        """The side files found and a config source read, not yet checked against the plan."""
        if self.side is None:
            self.side = side_files(self.plan, check=False)
        return self.side

    def _staging(self) -> Staging:
        assert self.staging is not None, "prepare() comes first"
        return self.staging


def consolidate(
    src: str,
    out: str,
    *,
    tag: str | None = None,
    options: ConsolidateOptions | None = None,
    progress: Progress | None = None,
    executor: Executor | None = None,
) -> ConsolidationResult:
    """Consolidate the ZeRO checkpoint at `src` into a Hugging Face model folder `out`.

    `src` is a folder holding `latest` or a tag folder, `out` a folder that does not exist yet (or is
    empty); both are local paths or fsspec URLs. The shards are written on `options.workers` threads,
    or on `executor` (e.g. a Dask cluster's; the outputs are the same bytes either way).
    `progress(done_bytes, total_bytes)` is called as shards are written and checked. On any error
    nothing is left at `out` and the staging folder is removed. With `options.config`, the config and
    tokenizer files SRC lacks come from that source, its config.json checked against the tensors
    while the shards are written, and a mismatch stops them and commits nothing (`consolidate.config`);
    `ConsolidationResult.has_config` says whether the folder holds a config.json at all.
    """
    options = options or ConsolidateOptions()
    index = shaped(load_index(src, tag, strict_pickle=options.strict_pickle), options.config, options.config_revision)
    plan = plan_consolidation(index, options)
    logger.info("plan: %d tensors in %d shard(s), %s %s from %s of source", sum(len(u.tensors) for u in plan.units),
                len(plan.units), format_size(plan.total_size), plan.dtype, format_size(plan.source_bytes))
    return run_step(ConsolidateStep(plan, out), executor=executor, workers=options.workers, progress=progress)
