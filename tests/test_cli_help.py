"""The command line's help, as a user first reads it: one case for every argument name, choices shown."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from ckptflow.cli import app

COMMANDS = ("validate", "consolidate", "reshard", "push", "run", "watch")


@pytest.mark.parametrize("command", COMMANDS)
def test_every_argument_name_is_upper_case(command: str) -> None:
    result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "160", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    usage = next(line for line in result.output.splitlines() if "Usage:" in line)
    names = re.findall(r"[A-Za-z_]+", usage.split(f" {command} ", 1)[1].replace("[OPTIONS]", ""))
    assert names and all(n.isupper() for n in names), usage


@pytest.mark.parametrize("command", ["consolidate", "run"])
def test_dtype_shows_its_choices(command: str) -> None:
    result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "160", "NO_COLOR": "1"})
    assert re.search(r"--dtype\s+\S*fp32\|bf16\|fp16", result.output), result.output


@pytest.mark.parametrize("command", ["consolidate", "reshard"])
def test_qkv_layout_shows_its_choices(command: str) -> None:
    result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "160", "NO_COLOR": "1"})
    assert re.search(r"--qkv-layout\s+\S*blocks\|groups", result.output), result.output
