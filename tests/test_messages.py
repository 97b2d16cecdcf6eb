"""A message that asks for an option names it as its reader knows it: the Python keyword from the
core, the flag from the command line, the form field from a Prefect task (`ckptflow.errors.option`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckptflow.errors import CheckpointError, naming, option
from ckptflow.validate import validate


def _no_latest(tmp_path: Path) -> Path:
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "notes.txt").write_text("no checkpoint here")
    return folder


def test_the_core_says_its_keyword_and_the_command_line_its_flag(tmp_path: Path) -> None:
    from ckptflow.cli import FLAGS, app

    folder = _no_latest(tmp_path)
    [problem] = validate(str(folder)).problems
    assert problem.message.endswith("at a tag folder, or pass `tag`")

    result = CliRunner().invoke(app, ["validate", str(folder)])
    assert result.exit_code == 1
    assert " ".join(result.output.split()).endswith("at a tag folder, or pass --tag")
    # The command's naming ends with it: the next core message is the core's again.
    assert validate(str(folder)).problems[0].message.endswith("or pass `tag`")
    assert option("tag") == "`tag`"
    with naming(FLAGS):
        assert option("exclude_frozen") == "--exclude-frozen" and option("stage") == "--zero-stage"


def test_a_prefect_task_says_the_form_field(tmp_path: Path) -> None:
    from prefect.logging import disable_run_logger

    from tasks.validate import validate_checkpoint

    folder = _no_latest(tmp_path)
    with disable_run_logger(), pytest.raises(CheckpointError) as failure:
        validate_checkpoint.fn(str(folder), settle_seconds=0)
    assert str(failure.value).endswith("at a tag folder, or pass the form's \"Tag\""), str(failure.value)


def test_every_form_name_is_a_field_of_the_form() -> None:
    """The titles the tasks name are the lifecycle form's own, and every flag is one the CLI takes."""
    from prefect.utilities.callables import parameter_schema

    from ckptflow.cli import FLAGS
    from flows.lifecycle import checkpoint_lifecycle
    from tasks.naming import FORM_FIELDS

    schema = parameter_schema(checkpoint_lifecycle).model_dump()
    titles = {field["title"] for field in schema["properties"].values()}
    for definition in schema["definitions"].values():
        titles |= {field.get("title") for field in definition.get("properties", {}).values()}
    assert set(FORM_FIELDS.values()) <= titles, set(FORM_FIELDS.values()) - titles

    from ckptflow.cli import app
    helps = " ".join(CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "200"}).output
                     for command in ("validate", "consolidate", "reshard", "push"))
    assert all(flag in helps for flag in FLAGS.values()), [f for f in FLAGS.values() if f not in helps]


def test_units_on_threads_name_options_as_their_caller() -> None:
    """A unit on the step driver's threads says an option the way the command that started it does."""
    from ckptflow.plumbing.steps import run_units

    with naming({"tag": "--tag"}):
        assert run_units(lambda _: option("tag"), range(3), workers=2) == ["--tag"] * 3
    assert run_units(lambda _: option("tag"), range(2), workers=2) == ["`tag`"] * 2
