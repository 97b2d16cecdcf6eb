"""A Hugging Face Trainer's output_dir (no `latest`, several `checkpoint-{step}` folders): validate,
consolidate and reshard take the newest complete checkpoint and say which, and which newer ones they
skipped and why."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ckptflow.consolidate import consolidate
from ckptflow.formats.deepspeed.output_dir import MAX_CANDIDATES, checkpoint_folders, choose
from ckptflow.reshard import reshard
from ckptflow.validate import validate

MISSING = "zero_pp_rank_1_mp_rank_00_optim_states.pt"


def _output_dir(trainer_dir: Path, root: Path) -> Path:
    """checkpoint-3 complete, checkpoint-6 missing a rank file, checkpoint-10 without `latest` (being
    written); copies of the Trainer fixture."""
    root.mkdir()
    for step in (3, 6, 10):
        shutil.copytree(trainer_dir, root / f"checkpoint-{step}")
    (root / "checkpoint-6" / "global_step3" / MISSING).unlink()
    (root / "checkpoint-10" / "latest").unlink()
    (root / "runs").mkdir()  # the Trainer's logging folder sits beside them
    return root


def _note(root: Path) -> str:
    return (f"taken: {root}/checkpoint-3 (newest complete of 3; checkpoint-10 skipped: no `latest` file; "
            f"checkpoint-6 skipped: rank 1 of 2 is missing: expected global_step3/{MISSING} under "
            f"{root}/checkpoint-6; the upload may still be in progress, or the checkpoint was saved with fewer ranks)")


def test_folders_are_taken_newest_first_and_few_are_examined() -> None:
    assert checkpoint_folders(["checkpoint-6", "checkpoint-10", "runs", "checkpoint-x", "checkpoint-3",
                               "my-checkpoint-99"]) == ["checkpoint-10", "checkpoint-6", "checkpoint-3"]
    folders = checkpoint_folders(f"checkpoint-{n}" for n in range(MAX_CANDIDATES + 5))
    asked: list[str] = []

    def broken(uri: str) -> str:
        asked.append(uri)
        return "broken"

    choice = choose("memory://od/", folders, broken)
    assert choice.taken is None and len(asked) == MAX_CANDIDATES and asked[0] == f"memory://od/checkpoint-{MAX_CANDIDATES + 4}"
    assert choice.failure.startswith(f"memory://od has no `latest` and none of the newest {MAX_CANDIDATES} of its "
                                     f"{MAX_CANDIDATES + 5} checkpoint-* folders is a complete checkpoint: "
                                     f"checkpoint-{MAX_CANDIDATES + 4}: broken; ")
    chosen = choose("od", ["checkpoint-2", "checkpoint-1"], lambda uri: None if uri.endswith("-1") else "half")
    assert (chosen.uri, chosen.note) == ("od/checkpoint-1", "taken: od/checkpoint-1 (newest complete of 2; "
                                                            "checkpoint-2 skipped: half)")


def test_validate_takes_the_newest_complete_checkpoint(llama_trainer_ckpt, tmp_path: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    root = _output_dir(llama_trainer_ckpt.dir, tmp_path / "od")
    with caplog.at_level(logging.WARNING, logger="ckptflow"):
        report = validate(str(root))
    assert report.ok, report.problems
    assert (report.root, report.tag) == (f"{root}/checkpoint-3", "global_step3")
    assert [r.getMessage() for r in caplog.records] == [_note(root)]

    cli = subprocess.run([sys.executable, "-m", "ckptflow.cli", "validate", str(root)], capture_output=True,
                         text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.startswith(f"valid {root}/checkpoint-3/global_step3: ")
    assert f"warning: {_note(root)}" in " ".join(cli.stderr.split())  # rich may wrap the line
    as_json = subprocess.run([sys.executable, "-m", "ckptflow.cli", "validate", str(root), "--json"],
                             capture_output=True, text=True, timeout=300)
    assert as_json.returncode == 0, as_json.stderr
    taken = json.loads(as_json.stdout)["output_dir"]
    assert taken == {"output_dir": str(root), "taken": "checkpoint-3", "found": 3, "skipped": [
        {"folder": "checkpoint-10", "why": "no `latest` file"},
        {"folder": "checkpoint-6", "why": f"rank 1 of 2 is missing: expected global_step3/{MISSING} under "
                                          f"{root}/checkpoint-6; the upload may still be in progress, or the "
                                          "checkpoint was saved with fewer ranks"}]}

    (root / "checkpoint-3" / "latest").unlink()
    report = validate(str(root))
    assert [(p.code, p.message) for p in report.problems] == [(
        "no-complete-checkpoint",
        f"{root} has no `latest` and none of its 3 checkpoint-* folders is a complete checkpoint: checkpoint-10: no "
        f"`latest` file; checkpoint-6: rank 1 of 2 is missing: expected global_step3/{MISSING} under "
        f"{root}/checkpoint-6; the upload may still be in progress, or the checkpoint was saved with fewer ranks; "
        "checkpoint-3: no `latest` file")]
    assert report.to_dict()["output_dir"]["taken"] is None and len(report.to_dict()["output_dir"]["skipped"]) == 3


def test_consolidate_and_reshard_take_it_too(llama_trainer_ckpt, tmp_path: Path) -> None:
    root = _output_dir(llama_trainer_ckpt.dir, tmp_path / "od")
    model = tmp_path / "model"
    consolidate(str(root), str(model))
    assert (model / "tokenizer.json").read_bytes() == (root / "checkpoint-3" / "tokenizer.json").read_bytes()
    reference = tmp_path / "reference"
    consolidate(str(llama_trainer_ckpt.dir), str(reference))  # the checkpoint-3 folder itself
    shards = sorted(p.name for p in reference.glob("*.safetensors"))
    assert shards and sorted(p.name for p in model.glob("*.safetensors")) == shards
    assert all((model / n).read_bytes() == (reference / n).read_bytes() for n in shards)

    out = tmp_path / "out"
    result = reshard(str(root), str(out), world_size=3)
    assert result.tag == "global_step3" and result.source_world_size == 2 and result.world_size == 3
    assert (out / "trainer_state.json").read_bytes() == (root / "checkpoint-3" / "trainer_state.json").read_bytes()
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("rng_state")) == [
        f"rng_state_{r}.pth" for r in range(3)]
    assert validate(str(out)).ok
