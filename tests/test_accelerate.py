"""Accelerate's `save_state` folder: the DeepSpeed tag folder `pytorch_model` beside Accelerate's own
files. Reshard names the per-process `random_states_{i}.pkl` for the target world size (target rank r
takes source rank r mod N, as for the Trainer's `rng_state_{i}.pth`), carries `scheduler.bin` and
`sampler.bin` byte for byte, and Accelerate's own loader reads every target rank's file back."""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import pytest

from ckptflow.reshard import reshard
from ckptflow.reshard.rng import ACCELERATE, TRAINER, describe, describe_families, plan_rng_files

TAG = "pytorch_model"  # the tag Accelerate's save_state gives DeepSpeed's save_checkpoint


def test_accelerate_rng_files_are_planned_for_the_target_world_size() -> None:
    def plan(names: list[str], m: int) -> list[tuple[str, str]]:
        return [(c.target, c.source) for c in plan_rng_files(names, m)]

    two = ["random_states_1.pkl", "random_states_0.pkl", "scheduler.bin", "sampler.bin", "custom_checkpoint_0.pkl"]
    assert plan(two, 1) == [("random_states_0.pkl", "random_states_0.pkl")]  # one process reads index 0's
    assert plan(two, 3) == [("random_states_0.pkl", "random_states_0.pkl"), ("random_states_1.pkl", "random_states_1.pkl"),
                            ("random_states_2.pkl", "random_states_0.pkl")]
    assert plan(["random_states.pkl", "random_states_x.pkl", "my_random_states_0.pkl"], 2) == []
    mixed = plan_rng_files(["rng_state_0.pth", "random_states_0.pkl", "random_states_1.pkl"], 2)
    assert [(c.family, c.target, c.source) for c in mixed] == [
        (TRAINER, "rng_state_0.pth", "rng_state_0.pth"), (TRAINER, "rng_state_1.pth", "rng_state_0.pth"),
        (ACCELERATE, "random_states_0.pkl", "random_states_0.pkl"),
        (ACCELERATE, "random_states_1.pkl", "random_states_1.pkl")]

    assert describe(plan_rng_files(two, 1)) == "random_states_0.pkl from source rank 0"
    assert describe(plan_rng_files(two, 3)) == ("random_states_0..2.pkl from source ranks 0, 1, 0 "
                                                "(rank r takes r mod 2)")
    assert describe(plan_rng_files(["random_states_0.pkl"], 2)) == ("random_states_0.pkl, random_states_1.pkl from "
                                                                    "source ranks 0, 0 (rank r takes r mod 1)")
    assert describe_families(mixed) == (
        ("Trainer", "rng_state_0.pth, rng_state_1.pth from source ranks 0, 0 (rank r takes r mod 1)"),
        ("Accelerate", "random_states_0.pkl, random_states_1.pkl from source ranks 0, 1 (rank r takes r mod 2)"))
    assert describe(mixed).startswith("Trainer: rng_state_0.pth, ") and "; Accelerate: random_states_0.pkl" in \
        describe(mixed)


def _accelerate_folder(trainer_dir: Path, root: Path) -> dict[int, float]:
    """A folder as `Accelerator.save_state` under DeepSpeed leaves it, 2 processes: the Trainer
    fixture's DeepSpeed files under the tag `pytorch_model`, and Accelerate's own files written by
    accelerate's `save_accelerator_state` (what `save_state` calls on each process). Returns the first
    `random.random()` each process's saved state gives."""
    import torch
    from accelerate.checkpointing import save_accelerator_state

    tag = (trainer_dir / "latest").read_text().strip()
    root.mkdir()
    shutil.copytree(trainer_dir / tag, root / TAG)
    (root / "latest").write_text(TAG)
    model = torch.nn.Linear(2, 2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD(model.parameters(), lr=0.1), lambda s: 1.0)
    first: dict[int, float] = {}
    for process in range(2):
        random.seed(100 + process)  # distinct states, to see which source rank each target got
        save_accelerator_state(str(root), [], [], [scheduler], [], process_index=process, step=7)
        first[process] = random.random()
    (root / "sampler.bin").write_bytes(b"sampler state, carried as bytes")
    return first


def _loaded(out: Path, process: int) -> tuple[dict[str, Any], float]:
    """What accelerate's `load_accelerator_state` gives process `process` from OUT, and its first draw."""
    from accelerate.checkpointing import load_accelerator_state

    random.seed(0)
    override = load_accelerator_state(str(out), [], [], [], [], process_index=process)
    return override, random.random()


@pytest.mark.parametrize("world_size", [1, 3])
def test_an_accelerate_save_state_folder_is_resharded(llama_trainer_ckpt, tmp_path: Path, world_size: int,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    from typer.testing import CliRunner

    from ckptflow.cli import app

    src = tmp_path / "acc"
    first = _accelerate_folder(llama_trainer_ckpt.dir, src)
    out = tmp_path / "out"
    result = reshard(str(src), str(out), world_size=world_size)
    assert result.tag == TAG and result.source_world_size == 2 and result.world_size == world_size
    names = [f"random_states_{r}.pkl" for r in range(world_size)]
    assert sorted(p.name for p in out.iterdir()) == sorted([*names, "scheduler.bin", "sampler.bin", "latest", TAG])
    for name in ("scheduler.bin", "sampler.bin"):
        assert (out / name).read_bytes() == (src / name).read_bytes()
    assert [(c.target, c.source, c.source_rank) for c in result.rng_files] == [
        (name, f"random_states_{r % 2}.pkl", r % 2) for r, name in enumerate(names)]
    for r in range(world_size):
        with caplog.at_level("INFO"):
            override, draw = _loaded(out, r)
        assert override == {"step": 7} and draw == first[r % 2]  # rank r resumes with source rank r mod 2's state
    assert "Could not load random states" not in caplog.text
    expected = {1: "random_states_0.pkl from source rank 0",
                3: "random_states_0..2.pkl from source ranks 0, 1, 0 (rank r takes r mod 2)"}[world_size]
    assert result.rng_summary == expected

    cli = CliRunner().invoke(app, ["reshard", str(src), str(tmp_path / "cli"), "--world-size", str(world_size)])
    assert cli.exit_code == 0, cli.output
    assert f"  Accelerate RNG files: {expected}\n" in cli.output and "Trainer RNG files" not in cli.output
