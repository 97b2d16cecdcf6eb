"""Running a consolidation: the output folder around the units, and everything together.

`prepare_output(plan, out)` checks OUT and the free space and makes the staging folder
(`plumbing.staging`); the units (`consolidate.write.run_unit`) write into it; `finalize` adds the
config and tokenizer files, a provenance record and the shard index, then commits the folder into
place with the index (or the only shard) last. `abort` removes the staging folder.
`consolidate(src, out, ...)` does all of it, the units on `options.workers` threads.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ckptflow.consolidate.plan import ConsolidateOptions, ConsolidationPlan, plan_consolidation
from ckptflow.consolidate.write import UnitResult, run_unit
from ckptflow.errors import OutputError
from ckptflow.formats import hf
from ckptflow.formats.deepspeed.checkpoint import load_index
from ckptflow.plumbing import staging as stage
from ckptflow.plumbing.executors import run_units as run_all
from ckptflow.plumbing.files import write_bytes
from ckptflow.plumbing.progress import Progress, Tally
from ckptflow.plumbing.sizes import format_size
from ckptflow.plumbing.staging import Staging
from ckptflow.plumbing.storage import is_local, join, local_path

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConsolidationResult:
    """What `consolidate` / `finalize` produced."""

    out: str
    shards: tuple[UnitResult, ...]
    side_files: tuple[str, ...]
    files: tuple[str, ...]
    total_size: int
    dtype: str
    verified: bool
    plan: ConsolidationPlan = field(repr=False, compare=False)


def prepare_output(plan: ConsolidationPlan, out: str) -> Staging:
    """Check the config and tokenizer files that go with the model (regular files, config.json
    parsed: `hf.check_side_files`), that OUT is free (absent or an empty folder) and, on a local disk,
    that there is room; make the staging folder beside it."""
    side = hf.check_side_files(plan.root, hf.find_side_files(plan.root))
    need = plan.file_bytes + side + (1 << 20) if is_local(out) else 0
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


def provenance(plan: ConsolidationPlan, shards: Sequence[UnitResult]) -> dict[str, Any]:
    """The record written beside the model: where it came from and what each shard hashes to."""
    root = os.path.abspath(local_path(plan.root)) if is_local(plan.root) else plan.root
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
            "excluded": list(plan.excluded),
            "tied": dict(plan.tied),
            "total_size": plan.total_size,
            "total_parameters": plan.total_parameters,
            "verified": all(s.verified for s in shards),
        },
        "shards": {s.filename: {"sha256": s.sha256, "size": s.size} for s in sorted(shards, key=lambda s: s.index)},
    }


def finalize(plan: ConsolidationPlan, results: Sequence[UnitResult], staging: Staging) -> ConsolidationResult:
    """Add config, tokenizer, provenance and index to `staging`, then commit it into place as OUT, the
    index last (or, unsharded, the only shard last: it is what makes the folder loadable).

    Raises `OutputError` when a unit's shard is missing; the staging folder is then left for `abort`.
    """
    got = {r.filename: r for r in results}
    for unit in plan.units:
        result = got.get(unit.filename)
        if result is None or result.size != unit.layout().file_size:
            raise OutputError(f"shard {unit.filename} has not been written to {staging.uri}", file=unit.filename,
                              hint="run every unit of the plan before finalize")
    shards = tuple(got[u.filename] for u in plan.units)
    side = hf.find_side_files(plan.root)
    hf.copy_side_files(plan.root, side, staging.uri, plan.dtype)
    record = json.dumps(provenance(plan, shards), indent=2, sort_keys=True) + "\n"
    write_bytes(staging.join(hf.PROVENANCE_NAME), record.encode())
    files = [u.filename for u in plan.units] + list(side) + [hf.PROVENANCE_NAME]
    if plan.sharded:
        text = hf.index_json(plan.weight_map, total_size=plan.total_size, total_parameters=plan.total_parameters)
        write_bytes(staging.join(hf.SAFE_WEIGHTS_INDEX_NAME), text.encode())
        files.append(hf.SAFE_WEIGHTS_INDEX_NAME)
    marker = files[-1] if plan.sharded else files[0]
    stage.commit(staging, first=[u.filename for u in plan.units if u.filename != marker], last=[marker])
    verified = all(s.verified for s in shards)
    logger.info("consolidated %s/%s into %s: %d shard(s), %s %s%s", plan.root, plan.tag, staging.out, len(shards),
                format_size(plan.total_size), plan.dtype, ", verified" if verified else "")
    return ConsolidationResult(out=staging.out, shards=shards, side_files=tuple(side),
                               files=tuple([f for f in files if f != marker] + [marker]),
                               total_size=plan.total_size, dtype=plan.dtype, verified=verified, plan=plan)


def abort(staging: Staging | None) -> None:
    """Remove the staging folder (after a failure); never raises."""
    stage.abort(staging)


def run_units(plan: ConsolidationPlan, staging: Staging, *, progress: Progress | None = None) -> list[UnitResult]:
    """Run every unit on `plan.options.workers` threads; the first failure stops the others."""
    tally = Tally(sum(u.nbytes for u in plan.units) * (2 if plan.options.verify else 1), progress)
    tally.start()
    cancel = threading.Event()
    return run_all(lambda u: run_unit(plan, u, staging, progress=tally.part(u.index), cancel=cancel), plan.units,
                   workers=plan.options.workers, cancel=cancel)


def consolidate(
    src: str,
    out: str,
    *,
    tag: str | None = None,
    options: ConsolidateOptions | None = None,
    progress: Progress | None = None,
) -> ConsolidationResult:
    """Consolidate the ZeRO checkpoint at `src` into a Hugging Face model folder `out`.

    `src` is a folder holding `latest` or a tag folder, `out` a folder that does not exist yet (or is
    empty); both are local paths or fsspec URLs. `progress(done_bytes, total_bytes)` is called as
    shards are written and checked. On any error nothing is left at `out` and the staging folder is
    removed.
    """
    options = options or ConsolidateOptions()
    index = load_index(src, tag)
    plan = plan_consolidation(index, options)
    logger.info("plan: %d tensors in %d shard(s), %s %s from %s of source", sum(len(u.tensors) for u in plan.units),
                len(plan.units), format_size(plan.total_size), plan.dtype, format_size(plan.source_bytes))
    staging = prepare_output(plan, out)
    try:
        results = run_units(plan, staging, progress=progress)
        return finalize(plan, results, staging)
    except BaseException:
        abort(staging)
        raise
