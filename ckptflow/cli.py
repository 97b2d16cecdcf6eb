"""The `ckptflow` command line: one command per pipeline step, over the same core functions.

Bad input ends in one red line on stderr and exit 1; usage errors exit 2; never a traceback. Text that
comes from the input (paths, tags, tensor names, messages quoting them) is printed as plain text:
the consoles interpret no markup and no emoji codes, colour comes from `rich.text.Text` styles, and
control characters are shown escaped (`plumbing.text.one_line`), so input never reaches the terminal
as escape sequences.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import sys
from collections.abc import Callable
from enum import Enum
from typing import TYPE_CHECKING, Any, Optional, TypeVar

import typer
from rich.console import Console
from rich.text import Text

from ckptflow import DEFAULT_DTYPE
from ckptflow.errors import CkptflowError, ConfigError, naming
from ckptflow.plumbing.progress import Progress as ProgressFn
from ckptflow.plumbing.text import one_line

if TYPE_CHECKING:
    from ckptflow.consolidate import ConsolidationResult
    from ckptflow.validate import ValidationReport



class DType(str, Enum):
    """Output dtypes, as `--dtype` takes them."""

    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class QkvLayout(str, Enum):
    """Megatron's fused query_key_value layouts, as `--qkv-layout` takes them (`formats.deepspeed.qkv.LAYOUTS`)."""

    blocks = "blocks"
    groups = "groups"


app = typer.Typer(
    name="ckptflow",
    help="Validate, consolidate, reshard and publish DeepSpeed ZeRO checkpoints, safely and fast.\n\n"
    "SRC and OUT are local paths or fsspec URLs (gs://, s3://, memory://, file://).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # help text as written, its single line breaks joined: no markup read in it
)
out = Console(highlight=False, markup=False, emoji=False)
T = TypeVar("T")
err = Console(stderr=True, highlight=False, markup=False, emoji=False)


def say(label: str, style: str, rest: str, console: Console = out) -> None:
    """One line: `label` in `style`, then `rest` as plain text, whatever characters it holds (control
    characters escaped, whitespace runs one space: `plumbing.text.one_line`)."""
    console.print(Text.assemble((label, style), " ", one_line(rest)), soft_wrap=True)


def line(text: str) -> None:
    """One plain line on stdout (control characters escaped), its leading indentation kept."""
    indent = " " * (len(text) - len(text.lstrip(" ")))
    out.print(Text(indent + one_line(text)), soft_wrap=True)


# How the core's messages name the options it asks for (`errors.option`): as this command line's flags.
FLAGS = {
    "tag": "--tag", "dtype": "--dtype", "exclude_frozen": "--exclude-frozen", "verify": "--verify",
    "config": "--config", "config_revision": "--config-revision", "max_shard_size": "--max-shard-size",
    "world_size": "--world-size", "stage": "--zero-stage", "tp": "--tp", "pp": "--pp", "ep": "--ep",
    "partition_method": "--partition-method", "pipeline_layers": "--pipeline-layers", "qkv_layout": "--qkv-layout",
    "tied_modules": "--tied-modules",
    "layer_types": "--layer-types",
    "strict_pickle": "--strict-pickle", "break_lease": "--break-lease",
    "cluster": "--cluster",
}


@app.callback()
def _root(ctx: typer.Context) -> None:
    """Validate, consolidate, reshard and publish DeepSpeed ZeRO checkpoints."""
    ctx.with_resource(naming(FLAGS))


def fail(exc: BaseException) -> typer.Exit:
    """Print `exc` as one red line and return the exit to raise."""
    say("error:", "red", str(exc), err)
    return typer.Exit(1)


MAX_NAMED = 12  # Accelerate files named in the report line; the rest counted (a run may keep thousands)
STRICT_PICKLE_HELP = ("Refuse any object of a class outside DeepSpeed's allow-list, the trainer's client state "
                     "included (by default it is read as inert records, never imported or run, and carried).")
CLUSTER_HELP = ("Run the units on the Dask scheduler at this address (tcp://HOST:PORT), read and written by its "
                "workers; needs the cluster extra.")


CONFIG_HELP = ("Where config.json, generation_config.json and tokenizer files come from when SRC has none: a "
               "folder, or a Hub model repo (ORG/NAME or hf://ORG/NAME). Its config.json is checked against the "
               "checkpoint's tensors (transformers, meta device) while the shards are written; a mismatch commits "
               "nothing. A kind of file SRC has (config, generation config, tokenizer) stays SRC's.")


def units_on(address: str | None) -> Any:
    """A context giving the executor units run on: the Dask cluster at `address`, or None (threads)."""
    import contextlib

    if not address:
        return contextlib.nullcontext(None)
    from ckptflow.plumbing.executors import cluster

    return cluster(address)


def with_bar(label: str, work: Callable[[ProgressFn, Any], T], *, cluster: str | None = None,
             remaining: bool = True) -> T:
    """`work(progress, executor)` under a transient byte-progress bar on stderr, its units on the Dask
    cluster at `cluster` or on threads; a `CkptflowError` becomes the one line `fail` prints."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    columns = [TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=False),
               TransferSpeedColumn(), *([TimeRemainingColumn()] if remaining else [])]
    with Progress(*columns, console=err, transient=True) as bar:
        task = bar.add_task(label, total=None)
        try:
            with units_on(cluster) as executor:
                return work(lambda done, total: bar.update(task, completed=done, total=total), executor)
        except CkptflowError as exc:
            raise fail(exc) from None


def where(root: str | None, tag: str | None) -> str:
    """A checkpoint's tag folder as the lines name it: the folder itself where there is no tag (optimizer shards)."""
    return f"{root}/{tag}" if tag else str(root)


def render_report(report: "ValidationReport") -> None:
    """A validation report: a summary line, then one line per problem."""
    if report.ok:
        s = report.summary()
        sizes = (f", {s['params']} params ({s['numel']:,} elements, {s['frozen']} frozen, {s['tied']} tied), "
                 f"{s['buffers']} buffers" if "params" in s else "")
        groups = f", {s['param_groups']} param groups" if "param_groups" in s else ""
        say("valid", "green", f"{where(report.root, report.tag)}: {s.get('layout', '')}, {s.get('precision')}, "
            f"step {s.get('step')}{sizes}{groups}" + (", no NaN/Inf" if report.deep else ""))
        for note in s.get("notes") or ():
            out.print(Text.assemble("  ", ("note:", "yellow"), " ", one_line(note)), soft_wrap=True)
        if report.accelerate_files:
            named = report.accelerate_files
            more = f" and {len(named) - MAX_NAMED} more" if len(named) > MAX_NAMED else ""
            shown = ", ".join(named[:MAX_NAMED]) + more
            out.print(Text.assemble("  ", ("Accelerate files:", "cyan"), " ", shown,
                                    " (pickles: named here, never opened; reshard carries them)"), soft_wrap=True)
        render_client_state(report)
        return
    place = f"{report.root}/{report.tag}" if report.tag else report.source
    count = len(report.problems)
    say("invalid", "red", f"{place}: {count} problem{'s' if count != 1 else ''}")
    for p in report.problems:
        out.print(Text.assemble("  ", (f"{one_line(p.code)}:", "red"), " ", one_line(p.message)), soft_wrap=True)


def render_client_state(report: "ValidationReport") -> None:
    """What the trainer's client state holds: one line per key, the classes it names (never loaded)."""
    client = report.client_state
    if not client:
        return
    out.print(Text.assemble("  ", ("client state:", "cyan"), " ", "carried as it is; its classes are named here, "
                            "never imported or run"), soft_wrap=True)
    for entry in client.entries:
        line(f"    {entry.describe()}")
    if client.more_keys:
        line(f"    and {client.more_keys:,} more key{'s' if client.more_keys != 1 else ''}")


@app.command()
def validate(
    src: str = typer.Argument(..., metavar="SRC", help="Folder holding `latest` (or a tag folder), local or URL."),
    tag: Optional[str] = typer.Option(None, "--tag", help="Tag to check instead of the one `latest` names."),
    deep: bool = typer.Option(False, "--deep", help="Also scan fp32 weights and optimizer moments for NaN/Inf."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    strict_pickle: bool = typer.Option(False, "--strict-pickle", help=STRICT_PICKLE_HELP),
) -> None:
    """Check that a ZeRO checkpoint is complete and consistent. Exit 0 valid, 1 not.

    A valid report also lists the trainer's client state (Megatron-DeepSpeed's args, Lightning's loops and
    callbacks): each key and the classes it names, never imported or run."""
    from ckptflow.formats.deepspeed.tag import check_tag
    from ckptflow.validate import validate as run_validate

    if tag is not None and check_tag(tag, "--tag"):
        raise typer.BadParameter(str(check_tag(tag, "--tag")), param_hint="--tag")
    try:
        report = run_validate(src, tag=tag, deep=deep, strict_pickle=strict_pickle)
    except CkptflowError as exc:
        raise fail(exc) from None
    if as_json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        render_report(report)
    raise typer.Exit(0 if report.ok else 1)


@app.command("consolidate")
def consolidate_command(
    src: str = typer.Argument(..., metavar="SRC", help="Folder holding `latest` (or a tag folder), local or URL."),
    dest: str = typer.Argument(..., metavar="OUT", help="Model folder to create, local or URL; must not exist."),
    tag: Optional[str] = typer.Option(None, "--tag", help="Tag to convert instead of the one `latest` names."),
    dtype: DType = typer.Option(DType(DEFAULT_DTYPE), "--dtype", help="Output dtype."),
    max_shard_size: str = typer.Option("5GB", "--max-shard-size", help="Largest shard, e.g. 5GB or 500MB."),
    exclude_frozen: bool = typer.Option(False, "--exclude-frozen", help="Leave frozen parameters out."),
    workers: int = typer.Option(4, "--workers", min=1, help="Shards written at once."),
    verify: bool = typer.Option(True, "--verify/--no-verify",
                                help="Reopen every shard and check it against the source."),
    cluster: Optional[str] = typer.Option(None, "--cluster", envvar="CKPTFLOW_CLUSTER", metavar="ADDRESS",
                                          help=CLUSTER_HELP),
    config: Optional[str] = typer.Option(None, "--config", metavar="SOURCE", help=CONFIG_HELP),
    config_revision: Optional[str] = typer.Option(None, "--config-revision", metavar="REV",
                                                  help="Branch, tag or commit of the --config Hub repo."),
    strict_pickle: bool = typer.Option(False, "--strict-pickle", help=STRICT_PICKLE_HELP),
    qkv_layout: Optional[QkvLayout] = typer.Option(
        None, "--qkv-layout",
        help="Of a Megatron-DeepSpeed checkpoint at tensor-parallel degree 2 or more: how each rank holds "
             "query_key_value's rows, which no file records: blocks ([q | k | v] of its heads; Megatron-DeepSpeed "
             "since December 2024) or groups (key/value group by group; before)."),
) -> None:
    """Consolidate a ZeRO-1/2/3 checkpoint into a Hugging Face safetensors model folder.

    DeepSpeed's save_checkpoint, Accelerate and Lightning write no config.json: give the model's with
    --config, or the folder cannot be loaded by from_pretrained (the last line says so).
    """
    import time

    # The converter's own threads keep the cores busy and numpy does no linear algebra here; an
    # OpenBLAS worker would only spin after numpy's import (~0.1 s of CPU, measured). Before numpy loads.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

    from ckptflow.consolidate import ConsolidateOptions, consolidate
    from ckptflow.formats.deepspeed.tag import check_tag
    from ckptflow.plumbing.sizes import format_size

    if tag is not None and check_tag(tag, "--tag"):
        raise typer.BadParameter(str(check_tag(tag, "--tag")), param_hint="--tag")
    if config_revision is not None and not (config or "").strip():
        raise typer.BadParameter("needs --config: the Hub repo it is a revision of", param_hint="--config-revision")
    try:
        options = ConsolidateOptions(dtype=dtype.value, max_shard_size=max_shard_size, exclude_frozen=exclude_frozen,
                                     workers=workers, verify=verify, config=config, config_revision=config_revision,
                                     strict_pickle=strict_pickle,
                                     qkv_layout=qkv_layout.value if qkv_layout is not None else None)
    except ValueError as exc:  # --dtype and --workers are checked by their option types
        raise typer.BadParameter(str(exc), param_hint="--max-shard-size") from None
    started = time.monotonic()  # no torch here: the converter casts with numpy (`ckptflow.formats.casts`)

    def work(progress: ProgressFn, executor: Any) -> ConsolidationResult:
        try:
            return consolidate(src, dest, tag=tag, options=options, executor=executor, progress=progress)
        except ConfigError as exc:  # the core names the config source; the line names the flag
            raise ConfigError(f"--config: {exc}", code=exc.code, uri=exc.uri, file=exc.file, tensor=exc.tensor,
                              expected=exc.expected, actual=exc.actual) from None

    result = with_bar("writing + verifying" if verify else "writing", work, cluster=cluster)
    shards = len(result.shards)
    say("consolidated", "green",
        f"{where(result.plan.root, result.plan.tag)} into {dest}: {shards} shard{'s' if shards > 1 else ''}, "
        f"{format_size(result.total_size)} {result.dtype}{', verified' if result.verified else ''}, "
        f"{len(result.side_files)} config/tokenizer file(s), {time.monotonic() - started:.1f}s")
    for note in result.plan.notes:
        out.print(Text.assemble("  ", ("note:", "yellow"), " ", one_line(note)), soft_wrap=True)
    render_config(result, dest)


def render_config(result: ConsolidationResult, dest: str) -> None:
    """Where the config came from (with --config), what SRC overrode, and, as the last line, that the folder
    has no config.json when it has none."""
    from ckptflow.formats import hf

    side = result.side
    if side is not None and side.source is not None:
        given = ", ".join(n for n in side.names if n in side.given)
        commit = f" (commit {side.source.commit[:12]})" if side.source.commit else ""
        checked = f", checked against {side.architecture}" if side.architecture else ""
        if given:
            line(f"  config: {given} from {side.source.shown}{commit}{checked}")
        if side.unused:
            kinds = " and ".join(sorted({hf.side_kind(n) for n in side.unused}))
            out.print(Text.assemble("  ", ("note:", "yellow"), " ", one_line(
                f"SRC has its own {kinds} files, so --config's {', '.join(side.unused)} "
                f"{'was' if len(side.unused) == 1 else 'were'} not used")), soft_wrap=True)
    if not result.has_config:
        say("not loadable:", "yellow",
            f"{dest} has no config.json, so from_pretrained cannot load it (SRC has none); consolidate again into a "
            "new OUT with --config FOLDER or --config ORG/NAME (the trained model's config)")


@app.command("run")
def run_command(
    src: str = typer.Argument(..., metavar="SRC", help="Folder holding `latest`, local or URL."),
    tag: Optional[str] = typer.Option(None, "--tag", help="Tag to process instead of the one `latest` names."),
    dtype: DType = typer.Option(DType(DEFAULT_DTYPE), "--dtype", help="Consolidated model dtype."),
    consolidate: bool = typer.Option(True, "--consolidate/--no-consolidate", help="Build the Hugging Face model."),
    max_shard_size: str = typer.Option("5GB", "--max-shard-size", help="Largest model shard, e.g. 5GB."),
    reshard: Optional[str] = typer.Option(None, "--reshard", help="World sizes to reshard to, e.g. 1,4."),
    to: list[str] = typer.Option([], "--to",
                                 help="Publish to DEST: hf://org/repo or a bucket/folder URL (repeatable)."),
    publish: str = typer.Option("both", "--publish", help="What goes to each --to: model, reshards or both."),
    verify: bool = typer.Option(True, "--verify/--no-verify", help="Load the model with transformers and check it."),
    settle: float = typer.Option(60.0, "--settle", min=0, help="Seconds to wait for rank files still arriving."),
    workspace: Optional[str] = typer.Option(None, "--workspace", help="Where outputs are built before publishing."),
    gpu_deployment: Optional[str] = typer.Option(None, "--gpu-deployment", help="Consolidate as this deployment."),
    refresh: bool = typer.Option(False, "--refresh", help="Ignore cached results and redo every step."),
    config: Optional[str] = typer.Option(None, "--config", metavar="SOURCE", help=CONFIG_HELP),
    config_revision: Optional[str] = typer.Option(None, "--config-revision", metavar="REV",
                                                  help="Branch, tag or commit of the --config Hub repo."),
    qkv_layout: Optional[QkvLayout] = typer.Option(
        None, "--qkv-layout", help="Megatron's query_key_value row layout, for the model and the reshards "
        "(see `consolidate --help`)."),
) -> None:
    """Run the whole pipeline (validate, consolidate + verify, reshard, publish) as a Prefect flow.

    Uses the Prefect server at PREFECT_API_URL when set, else Prefect's embedded defaults.
    """
    from flows.commands import FlowFailed, api_url, lifecycle_parameters, run_lifecycle

    if publish not in ("model", "reshards", "both"):
        raise typer.BadParameter(f"must be model, reshards or both, got {publish!r}", param_hint="--publish")
    if config_revision is not None and not (config or "").strip():
        raise typer.BadParameter("needs --config: the Hub repo it is a revision of", param_hint="--config-revision")
    try:
        params = lifecycle_parameters(
            src, tag=tag, dtype=dtype.value, consolidate=consolidate, max_shard_size=max_shard_size, reshard=reshard,
            destinations=to, publish=publish, verify=verify, settle=settle, workspace=workspace,
            gpu_deployment=gpu_deployment, refresh=refresh, config=config, config_revision=config_revision,
            qkv_layout=qkv_layout.value if qkv_layout is not None else None,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    server = api_url()
    try:
        outcome = run_lifecycle(params)
    except FlowFailed as exc:
        raise fail(exc) from None
    summary = outcome.result
    say("done", "green", summary["headline"])
    if summary.get("model"):
        line(f"  model:     {summary['model']['uri']}")
    for n, reshard_out in sorted(summary.get("reshards", {}).items(), key=lambda kv: int(kv[0])):
        if reshard_out:
            line(f"  {n} rank(s): {reshard_out['uri']}")
    for p in summary.get("published", []):
        line(f"  published: {p['kind']} -> {p['destination']}")
    where = server.rstrip("/").removesuffix("/api") if server else "embedded Prefect (no server was configured)"
    line(f"  flow run:  {outcome.flow_run_name} on {where}")
    model = summary.get("model") or {}
    if model.get("details", {}).get("config_json") is False:
        say("not loadable:", "yellow",
            f"{model['uri']} has no config.json, so from_pretrained cannot load it (SRC has none); run again with "
            "--config FOLDER or --config ORG/NAME (the trained model's config)")


@app.command("watch")
def watch_command(
    roots: list[str] = typer.Argument(..., metavar="ROOT",
                                      help="Folders or bucket URLs to search for `latest` pointers."),
    once: bool = typer.Option(False, "--once", help="Look once and exit, instead of every --interval seconds."),
    interval: float = typer.Option(300.0, "--interval", min=1, help="Seconds between looks."),
    state: str = typer.Option("ckptflow-watch", "--state", help="Name of the block that remembers what was seen."),
    baseline: bool = typer.Option(False, "--baseline", help="Record what is there now without emitting events."),
    exclude: list[str] = typer.Option([], "--exclude", help="Glob of run folders to ignore (repeatable)."),
) -> None:
    """Emit one Prefect event per new checkpoint tag under ROOTs (needs PREFECT_API_URL)."""
    import time

    from flows.commands import FlowFailed, watch_once

    while True:
        try:
            outcome = watch_once(roots, state=state, baseline=baseline, exclude=exclude)
        except FlowFailed as exc:
            if once:
                raise fail(exc) from None
            say("error:", "red", f"{exc}; trying again in {interval:.0f}s", err)
        else:
            result = outcome.result
            new = result["recorded"] if baseline else result["emitted"]
            verb = "recorded" if baseline else "new"
            line(f"{result['checkpoints']} checkpoint(s) under {len(roots)} root(s), {len(new)} {verb}"
                 + (f", {len(result['unreadable'])} unreadable" if result["unreadable"] else ""))
            for s in new:
                line(f"  {verb}: {s['root']} @ {s['tag']}")
            for u in result["unreadable"]:
                out.print(Text.assemble("  ", ("skipped", "yellow"), " ", one_line(f"{u['where']}: {u['reason']}")),
                          soft_wrap=True)
        if once:
            return
        time.sleep(interval)


@app.command("reshard")
def reshard_command(
    src: str = typer.Argument(..., metavar="SRC", help="Folder holding `latest` (or a tag folder), local or URL."),
    dest: Optional[str] = typer.Argument(None, metavar="OUT",
                                         help="Checkpoint folder to create, local or URL; absent or empty."),
    world_size: int = typer.Option(..., "--world-size", min=1,
                                   help="Ranks DeepSpeed runs the output at (what the launcher starts): "
                                        "tp x pp x dp (earlier releases took the data-parallel size here)."),
    stage: Optional[int] = typer.Option(None, "--zero-stage", min=1, max=3,
                                        help="ZeRO stage of the output (1, 2 or 3); default: the source's."),
    tp: Optional[int] = typer.Option(None, "--tp", "--tensor-parallel", min=1,
                                     help="Tensor-parallel degree; default: the source's."),
    pp: Optional[int] = typer.Option(None, "--pp", min=1, help="Pipeline stages; default: the source's."),
    ep: Optional[int] = typer.Option(None, "--ep", min=1, help="Expert-parallel degree; default: the source's."),
    partition_method: Optional[str] = typer.Option(
        None, "--partition-method", metavar="METHOD",
        help="With --pp: the PipelineModule's partition_method (parameters, its default, or uniform; "
             "type:REGEX with --layer-types; type:transformer for a Megatron-style one, Megatron-DeepSpeed GPT's "
             "default)."),
    layer_types: Optional[str] = typer.Option(
        None, "--layer-types", metavar="NAMES",
        help="With --pp and --partition-method type:REGEX: the class (or function) name of each entry of the "
             "PipelineModule's layer list, in order, which no file records; comma-separated, NAME*N for N in a row "
             "(e.g. Embed,Block*3,LayerNorm,Embed)."),
    pipeline_layers: Optional[int] = typer.Option(
        None, "--pipeline-layers", min=1, metavar="N",
        help="With --pp: the length of the PipelineModule's layer list, where its files leave it open."),
    qkv_layout: Optional[QkvLayout] = typer.Option(
        None, "--qkv-layout",
        help="With --tp, of a Megatron-DeepSpeed checkpoint: how each rank holds query_key_value's rows, which "
             "no file records: blocks ([q | k | v] of its heads; Megatron-DeepSpeed since December 2024) or groups "
             "(key/value group by group; before)."),
    tied_modules: Optional[str] = typer.Option(
        None, "--tied-modules", metavar="KEY=LAYER[,...]",
        help="With --zero-stage 1, of a ZeRO-0 PipelineModule: each TiedLayerSpec key and the first layer that uses "
             "it, which no ZeRO-0 file records (e.g. embed=0)."),
    plan: bool = typer.Option(False, "--plan",
                              help="List the shapes at --world-size ranks with their per-GPU memory; write nothing."),
    tag: Optional[str] = typer.Option(None, "--tag", help="Tag to reshard instead of the one `latest` names."),
    workers: int = typer.Option(4, "--workers", min=1,
                                help="Threads writing at once: one per target rank, the rest share a rank's files."),
    fsync: bool = typer.Option(True, "--fsync/--no-fsync",
                               help="Flush each file to disk before moving OUT into place (local outputs)."),
    cluster: Optional[str] = typer.Option(None, "--cluster", envvar="CKPTFLOW_CLUSTER", metavar="ADDRESS",
                                          help=CLUSTER_HELP),
    strict_pickle: bool = typer.Option(False, "--strict-pickle", help=STRICT_PICKLE_HELP),
) -> None:
    """Reshard a ZeRO-1/2/3 training checkpoint (weights and optimizer state) for another number of GPUs.

    --world-size is the number of ranks, as DeepSpeed counts them: every degree not given is the
    source's, and the data parallelism is what is left (N / (tp x pp)). DeepSpeed loads OUT natively at
    that shape; config, tokenizer and trainer files are carried over so a Hugging Face Trainer run can
    resume from it. With --plan, list the shapes at N ranks instead, writing nothing.
    """

    from ckptflow.formats.deepspeed.tag import check_tag
    from ckptflow.plumbing.sizes import format_size
    from ckptflow.reshard import ReshardOptions, reshard
    from ckptflow.reshard.pipeline_layers import check_method, parse_layer_types
    from ckptflow.reshard.pipeline_layers import tied_modules as parse_tied
    from ckptflow.reshard.rng import describe_families

    if tag is not None and check_tag(tag, "--tag"):
        raise typer.BadParameter(str(check_tag(tag, "--tag")), param_hint="--tag")
    layout = qkv_layout.value if qkv_layout is not None else None
    for value, check, flag in ((tied_modules, parse_tied, "--tied-modules"), (partition_method, check_method,
                               "--partition-method"), (layer_types, parse_layer_types, "--layer-types")):
        try:
            if value is not None:
                check(value)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint=flag) from None
    if plan:
        if dest is not None:
            raise typer.BadParameter("--plan writes nothing: leave OUT out", param_hint="OUT")
        render_shapes(src, world_size, tag, layout, tied_modules=tied_modules, partition_method=partition_method,
                      pipeline_layers=pipeline_layers, layer_types=layer_types)
        return
    if dest is None:
        raise typer.BadParameter("give the folder to write (or --plan to list the shapes)", param_hint="OUT")
    options = ReshardOptions(world_size=world_size, stage=stage, tp=tp, pp=pp, ep=ep, workers=workers, durable=fsync,
                             strict_pickle=strict_pickle, partition_method=partition_method,
                             pipeline_layers=pipeline_layers, qkv_layout=layout, tied_modules=tied_modules,
                             layer_types=layer_types)
    result = with_bar("resharding", lambda progress, executor: reshard(src, dest, tag=tag, options=options,
                                                                      executor=executor, progress=progress),
                      cluster=cluster)
    say("resharded", "green",
        f"{src} ({f'{result.tag}, ' if result.tag else ''}{result.precision}) into {dest}: "
        f"{result.source_shape} -> {result.shape}, "
        f"{len(result.files)} files, {format_size(result.bytes_written)} in {result.seconds:.1f}s")
    for label, text in describe_families(result.rng_files):
        line(f"  {label} RNG files: {text}")
    for note in result.notes:
        line(f"  note: {note}")


def render_shapes(src: str, world_size: int, tag: str | None, qkv_layout: str | None = None,
                  **declared: Any) -> None:
    """`reshard --plan`: the source's shape and the shapes at `world_size` ranks, per-GPU bytes each."""
    from rich.table import Table

    from ckptflow.plumbing.sizes import format_size
    from ckptflow.reshard.run import plan_shapes

    try:
        shapes = plan_shapes(src, world_size, tag=tag, qkv_layout=qkv_layout, **declared)
    except CkptflowError as exc:
        raise fail(exc) from None
    table = Table(box=None, pad_edge=False)
    table.add_column("shape")
    for name in ("weights", "gradients", "optimizer", "per GPU"):
        table.add_column(name, justify="right")
    table.add_column("ckptflow")

    def row(shape: Text, memory: Any, note: Text) -> None:
        sizes = (memory.weights, memory.gradients, memory.optimizer, memory.total)
        table.add_row(shape, *(Text(format_size(n)) for n in sizes), note)

    row(Text(f"{shapes.source} (now)"), shapes.source_memory, Text(""))
    for option in shapes.options:
        note = Text("writes it", "green") if option.reason is None else Text(f"not yet: {one_line(option.reason)}",
                                                                            "yellow")
        row(Text(str(option.shape)), option.memory, note)
    out.print(Text(f"{shapes.where}: {shapes.layout}, {shapes.parameters:,} parameters"), soft_wrap=True)
    out.print(table)
    writable = sum(o.reason is None for o in shapes.options)
    line(f"{writable} of {len(shapes.options)} shape(s) at {world_size} rank(s) can be written. Per GPU: the "
         "training state (weights, gradients, optimizer state) by the ZeRO formulas; activations not counted.")


@app.command("push")
def push_command(
    src: str = typer.Argument(..., metavar="SRC",
                              help="Folder to publish, local or URL: a model, a checkpoint, any folder."),
    dest: str = typer.Argument(..., metavar="DEST",
                               help="hf://ORG/REPO (or hf://datasets/ORG/REPO), or a bucket or folder URL."),
    revision: Optional[str] = typer.Option(None, "--revision",
                                           help="Hub branch to commit to (default main); hf:// only."),
    private: bool = typer.Option(False, "--private", help="Create a missing Hub repo as private; hf:// only."),
    workers: int = typer.Option(8, "--workers", min=1, help="Files uploaded at once."),
    break_lease: bool = typer.Option(False, "--break-lease",
                                     help="Remove the lease a push that died left at DEST, then push; "
                                          "bucket or folder only."),
) -> None:
    """Publish a folder to the Hugging Face Hub or to a bucket, verified and resumable.

    On a bucket, ckptflow-manifest.json is written last: the folder is complete once it is there. One
    push at a time per bucket folder: a second one fails at once, naming the first (its lease).
    The Hub gets one commit. After a failure, run the same command again: nothing verified is sent twice.
    """

    from ckptflow.plumbing.sizes import format_size
    from ckptflow.publish import PushOptions, push

    if not dest.startswith("hf://") and (revision or private):
        raise typer.BadParameter("--revision and --private are for hf:// destinations", param_hint="DEST")
    if dest.startswith("hf://") and break_lease:
        raise typer.BadParameter("--break-lease is for bucket and folder destinations", param_hint="DEST")
    try:
        options = PushOptions(revision=revision, private=private, workers=workers, break_lease=break_lease)
        result = with_bar("uploading", lambda progress, _executor: push(src, dest, options=options, progress=progress),
                          remaining=False)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="DEST") from None
    where = result.commit_url or result.manifest_uri
    say("pushed", "green",
        f"{src} to {result.dest}: {len(result.uploaded)} file(s) uploaded ({format_size(result.bytes_uploaded)}), "
        f"{len(result.skipped)} already there; {where}")


class _Warnings(logging.Handler):
    """ckptflow's own warnings (a retried upload, a card input left out) as `warning:` lines on stderr,
    one line each and never a traceback."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            say("warning:", "yellow", record.getMessage(), err)
        except Exception:  # a broken terminal must not turn into a traceback
            self.handleError(record)


def configure_logging() -> None:
    """The command line's logging, unless the user configured some: ckptflow's warnings as `warning:`
    lines; everything libraries log (gcsfs logs a traceback for every request it gives up on) stays
    out of the terminal, since the error a command ends with says what went wrong."""
    root = logging.getLogger()
    if root.handlers:
        return
    root.addHandler(logging.NullHandler())  # no "last resort" printing of other loggers' records
    logging.getLogger("ckptflow").addHandler(_Warnings(logging.WARNING))


def main() -> None:
    """Console-script entry point."""
    configure_logging()
    try:
        app()
    except KeyboardInterrupt:
        say("interrupted", "red", "", err)
        sys.exit(130)
    finally:
        # Whatever is alive now lives until the process ends: left to the collector, the interpreter's
        # shutdown walks and frees the cycles of every module imported (typer, pydantic, numpy,
        # fsspec), about 0.08 s of each run here; frozen, the operating system reclaims them at once.
        gc.freeze()


if __name__ == "__main__":
    main()
