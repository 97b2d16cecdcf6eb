"""The `ckptflow` command line: one command per pipeline step, over the same core functions.

Bad input ends in one red line on stderr and exit 1; usage errors exit 2; never a traceback.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Optional

import typer
from rich.console import Console

from ckptflow.errors import CkptflowError

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
os.environ.setdefault("HF_HUB_DISABLE_XET", "1")

app = typer.Typer(
    name="ckptflow",
    help="Validate, consolidate, reshard and publish DeepSpeed ZeRO checkpoints, safely and fast.\n\n"
    "SRC and OUT are local paths or fsspec URLs (gs://, s3://, memory://, file://).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
out = Console(highlight=False)
err = Console(stderr=True, highlight=False)


@app.callback()
def _root() -> None:
    """Validate, consolidate, reshard and publish DeepSpeed ZeRO checkpoints."""


def fail(exc: BaseException) -> typer.Exit:
    """Print `exc` as one red line and return the exit to raise."""
    err.print(f"[red]error:[/red] {exc}", soft_wrap=True)
    return typer.Exit(1)


@app.command()
def validate(
    src: str = typer.Argument(..., help="Folder holding `latest` (or a tag folder), local or URL."),
    tag: Optional[str] = typer.Option(None, "--tag", help="Tag to check instead of the one `latest` names."),
    deep: bool = typer.Option(False, "--deep", help="Also scan fp32 weights and optimizer moments for NaN/Inf."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
) -> None:
    """Check that a ZeRO checkpoint is complete and consistent. Exit 0 valid, 1 not."""
    from ckptflow.validate import validate as run_validate
    from ckptflow.zero import check_tag

    if tag is not None and check_tag(tag, "--tag"):
        raise typer.BadParameter(str(check_tag(tag, "--tag")), param_hint="--tag")
    try:
        report = run_validate(src, tag=tag, deep=deep)
    except CkptflowError as exc:
        raise fail(exc) from None
    if as_json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        report.render(out)
    raise typer.Exit(0 if report.ok else 1)


def main() -> None:
    """Console-script entry point."""
    try:
        app()
    except KeyboardInterrupt:
        err.print("[red]interrupted[/red]")
        sys.exit(130)


if __name__ == "__main__":
    main()
