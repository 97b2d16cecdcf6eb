"""The validation task: `ckptflow.validate.validate`, re-checked while rank files are still arriving.

When a checkpoint is synced into a bucket by another process, `latest` can land before the other
ranks' files. So while every problem in the report is of the "not there yet" kind, the task waits
`poll_seconds` and validates again, for up to `settle_seconds`; then it fails with the report. Any
other problem fails at once. The report is left as a table artifact either way.
"""

from __future__ import annotations

import time
from typing import Any

from prefect import get_run_logger, task

from ckptflow.errors import CheckpointError
from ckptflow.plumbing.text import and_more
from ckptflow.validate import ValidationReport, validate
from ckptflow.watch import content_identity
from tasks.artifacts import checkpoint_key, field_rows, source_name, table, text
from tasks.models import Checkpoint
from tasks.naming import in_form_words
from tasks.retries import io_retries

# Problems that mean "some files are not there yet": worth waiting for, within the settle time.
ARRIVING = frozenset({"tag-missing", "model-missing", "rank-missing", "unreadable-file"})


def still_arriving(report: ValidationReport) -> bool:
    """True when every problem in `report` may go away once a sync in progress finishes."""
    return bool(report.problems) and all(p.code in ARRIVING for p in report.problems)


def report_rows(report: ValidationReport) -> list[dict[str, Any]]:
    """The report as a table no wider than the page: for a valid checkpoint, a few `field | value` rows,
    most telling first and fewer than the UI's ten to a page; else one row per problem (the message
    names the file)."""
    if report.ok:
        s = report.summary()
        return field_rows({
            "checkpoint": f"{report.root}/{report.tag}",
            "result": "valid" + (" (deep scan: every fp32 value finite)" if report.deep else ""),
            "layout": f"ZeRO-{s['stage']}, {s['world_size']} rank(s), {s['precision']}",
            "optimizer step": s["step"],
            "parameters": f"{s['params']} ({s['numel']:,} elements) in {s['param_groups']} group(s)",
            "tied / frozen / buffers": f"{s['tied']} / {s['frozen']} / {s['buffers']}",
            "saved by": f"DeepSpeed {s['ds_version']}",
        })
    return [{"problem": p.code, "rank": "" if p.rank is None else p.rank, "message": text(p.message)}
            for p in report.problems]


def _run_name() -> str:
    """'validate llama-7b@global_step3' (the source's name, never its whole path)."""
    from prefect.runtime import task_run

    parameters = task_run.parameters
    return f"validate {source_name(str(parameters.get('source', '')))}@{parameters.get('tag') or 'latest'}"


@task(name="validate-checkpoint", task_run_name=_run_name, **io_retries())
@in_form_words
def validate_checkpoint(
    source: str,
    tag: str | None = None,
    *,
    deep: bool = False,
    settle_seconds: float = 300.0,
    poll_seconds: float = 15.0,
) -> Checkpoint:
    """Validate the checkpoint at `source`, waiting up to `settle_seconds` for files still arriving.

    Returns the validated `Checkpoint` (with its content identity); raises `CheckpointError` listing
    every problem when the checkpoint is not valid.
    """
    logger = get_run_logger()
    deadline = time.monotonic() + settle_seconds
    attempt = 0
    while True:
        attempt += 1
        report = validate(source, tag=tag, deep=deep)
        if report.ok or not still_arriving(report) or time.monotonic() + poll_seconds > deadline:
            break
        missing = ", ".join(sorted({p.file.rsplit("/", 1)[-1] for p in report.problems if p.file})) or "files"
        logger.info(
            "%s: %d file(s) not there yet (%s); checking again in %.0f s (settle time left %.0f s)",
            source, len(report.problems), missing, poll_seconds, deadline - time.monotonic(),
        )
        time.sleep(poll_seconds)

    table(
        report_rows(report),
        key=checkpoint_key("validation", report.root or source, report.tag),
        description=f"Validation of {report.root or source} at {report.tag or 'latest'}: "
        + ("valid" if report.ok else f"{len(report.problems)} problem{'s' if len(report.problems) != 1 else ''}"),
    )
    if not report.ok:
        where = f"{report.root}/{report.tag}" if report.tag else source
        arriving = still_arriving(report) and attempt > 1
        waited = f" after waiting {settle_seconds:.0f} s for files to arrive" if arriving else ""
        lines = "; ".join(f"{p.code}: {p.message}" for p in report.problems[:5])
        more = and_more(len(report.problems) - 5, "problem")
        raise CheckpointError(f"{where} is not a valid checkpoint{waited}: {lines}{more}", uri=source)

    index = report.index
    assert index is not None and report.root is not None and report.tag is not None
    logger.info("%s/%s is valid: ZeRO-%d, %d ranks, %s", report.root, report.tag, index.stage, index.world_size,
                index.precision)
    return Checkpoint(
        source=source,
        root=report.root,
        tag=report.tag,
        identity=content_identity(report.root, report.tag),
        stage=index.stage,
        world_size=index.world_size,
        precision=index.precision,
        step=index.step,
        summary=report.summary(),
    )
