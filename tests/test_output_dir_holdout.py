"""A Hugging Face Trainer output_dir the Trainer wrote itself, held out (``specs.output_dir_holdout``): one run
of ``transformers.Trainer`` with DeepSpeed ZeRO-2 on 2 CPU ranks saved ``checkpoint-2``, ``checkpoint-4`` and
``checkpoint-6`` (``tests/test_output_dir.py`` copies one Trainer checkpoint under three names).

- ``validate``, ``consolidate`` and ``reshard`` of the output_dir take ``checkpoint-6``, the newest, and say so;
  the consolidated folder loads with ``from_pretrained`` and gives the trained module's logits bit for bit;
  ``ds_to_universal`` of the reshard equals that of ``checkpoint-6``;
- in a copy whose ``checkpoint-6`` lacks a rank file, they take ``checkpoint-4`` and say why ``checkpoint-6``
  was skipped; the consolidated folder gives the logits of the model the Trainer saved in ``checkpoint-4``
  itself (its ``model.safetensors``).

One fixture write (one 2-rank launch of the Trainer) in the default run; no other launch.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from ckptflow.cli import app
from tests.fixtures.sets import SETS
from tests.fixtures.specs.harness import LOGIT_IDS
from tests.fixtures.specs.output_dir_holdout import OUTPUT_DIR_HOLDOUT_SPECS
from tests.oracles.harness import run_cli
from tests.test_harness_holdout import check_universal

[NAME] = OUTPUT_DIR_HOLDOUT_SPECS
MISSING = "zero_pp_rank_1_mp_rank_00_optim_states.pt"


@pytest.fixture(scope="module")
def held_out() -> Any:
    return SETS["output-dir-holdout"].build([NAME])[NAME]


@pytest.fixture(scope="module")
def damaged(held_out: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the output_dir whose newest checkpoint lost rank 1's optimizer file."""
    root = tmp_path_factory.mktemp("od") / "output_dir"
    shutil.copytree(held_out.dir, root)
    (root / "checkpoint-6" / "global_step6" / MISSING).unlink()
    return root


def ckptflow(caplog: pytest.LogCaptureFixture, *args: str) -> str:
    """``ckptflow ARGS`` in this process (exit 0 asserted): its output and the warnings it logged, on one line."""
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ckptflow"):
        result = CliRunner().invoke(app, list(args), env={"COLUMNS": "400", "NO_COLOR": "1"})
    assert result.exit_code == 0, (args, result.output)
    return " ".join([*result.output.split(), *" ".join(caplog.messages).split()])


def logits_of(folder: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    assert {key: value for key, value in info.items() if value} == {}
    with torch.no_grad():
        return model.eval()(input_ids=torch.tensor(LOGIT_IDS)).logits


def skipped_note(root: Path) -> str:
    return (f"taken: {root}/checkpoint-4 (newest complete of 3; checkpoint-6 skipped: rank 1 of 2 is missing: "
            f"expected global_step6/{MISSING} under {root}/checkpoint-6; the upload may still be in progress, or "
            "the checkpoint was saved with fewer ranks)")


def test_the_trainer_saved_several_checkpoints(held_out: Any) -> None:
    assert sorted(p.name for p in held_out.dir.iterdir() if p.name.startswith("checkpoint-")) == [
        "checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert [(held_out.dir / f"checkpoint-{n}" / "latest").read_text().strip() for n in (2, 4, 6)] == [
        "global_step2", "global_step4", "global_step6"]


def test_validate_takes_the_newest_and_says_so(held_out: Any, damaged: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    root = held_out.dir
    said = ckptflow(caplog, "validate", str(root))
    assert f"taken: {root}/checkpoint-6 (newest complete of 3)" in said
    assert f"valid {root}/checkpoint-6/global_step6: ZeRO-2, data-parallel 2, fp32, step 6, " in said
    report = json.loads(run_cli("validate", str(root), "--json").stdout)
    assert report["output_dir"] == {"output_dir": str(root), "taken": "checkpoint-6", "found": 3, "skipped": []}

    cli = run_cli("validate", str(damaged))  # as a user's shell shows it
    assert cli.returncode == 0, cli.stderr
    assert f"warning: {skipped_note(damaged)}" in " ".join(cli.stderr.split())
    assert cli.stdout.startswith(f"valid {damaged}/checkpoint-4/global_step4: ZeRO-2, data-parallel 2, fp32, step 4, ")


def test_consolidate_takes_the_newest_complete(held_out: Any, damaged: Path, tmp_path: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    said = ckptflow(caplog, "consolidate", str(held_out.dir), str(tmp_path / "newest"))
    assert f"taken: {held_out.dir}/checkpoint-6 (newest complete of 3)" in said
    assert torch.equal(logits_of(tmp_path / "newest"), load_file(held_out.root / "logits.safetensors")["logits"])

    said = ckptflow(caplog, "consolidate", str(damaged), str(tmp_path / "older"))
    assert skipped_note(damaged) in said
    assert torch.equal(logits_of(tmp_path / "older"), logits_of(damaged / "checkpoint-4"))  # the Trainer's own save


def test_reshard_takes_the_newest_complete(held_out: Any, damaged: Path, tmp_path: Path,
                                           caplog: pytest.LogCaptureFixture) -> None:
    out = tmp_path / "out"
    said = ckptflow(caplog, "reshard", str(held_out.dir), str(out), "--world-size", "3")
    assert f"taken: {held_out.dir}/checkpoint-6 (newest complete of 3)" in said
    assert (out / "latest").read_text().strip() == "global_step6"
    assert "ZeRO-2, data-parallel 3, fp32, step 6, " in ckptflow(caplog, "validate", str(out))
    check_universal(held_out.dir / "checkpoint-6", out, tmp_path)

    older = tmp_path / "older"
    said = ckptflow(caplog, "reshard", str(damaged), str(older), "--world-size", "3")
    assert skipped_note(damaged) in said
    assert (older / "latest").read_text().strip() == "global_step4"
    assert (older / "trainer_state.json").read_bytes() == (damaged / "checkpoint-4" / "trainer_state.json").read_bytes()
