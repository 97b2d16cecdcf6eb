"""Accelerate's `save_state` folder: the DeepSpeed tag folder `pytorch_model` beside Accelerate's own
files. Reshard names the per-process `random_states_{i}.pkl` for the target world size (target rank r
takes source rank r mod N, as for the Trainer's `rng_state_{i}.pth`), carries `scheduler.bin` and
`sampler.bin` byte for byte, and Accelerate's own loader reads every target rank's file back.

The end-to-end half runs on a folder written by Accelerate itself (`tests.fixtures.specs.harness`: processes
on CPU ranks with gloo run `Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=2 or 3))`, prepare the tiny
Llama, AdamW, a scheduler and a dataloader, train and call `accelerator.save_state(dir)`): it validates,
consolidates with `--config` to the trained logits bit for bit, and after `reshard --world-size M`,
`accelerator.load_state(OUT)` in M launched processes gives the engine the source's fp32 weights and Adam
moments bit for bit, and the source's step, scheduler state and registered object, and process r the
random states of source process r mod N. ckptflow never opens Accelerate's own pickles (the registered
object holds classes that leave a marker when rebuilt; only Accelerate's load leaves one; `sampler.bin`, a
pickled `SeedableRandomSampler` Accelerate writes in-process here, is never rebuilt either). In the long mode,
a folder whose `sampler_1.bin` Accelerate's `save_state` wrote on 2 ranks (`specs.accelerate_sampler`) is
resharded and loaded back by Accelerate with the source's sampler.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptflow.reshard import reshard
from ckptflow.reshard.rng import ACCELERATE, TRAINER, describe, describe_families, plan_rng_files
from tests.fixtures.models.client_state import MARKER_ENV, MARKERS, differences
from tests.fixtures.sets import HarnessFixture
from tests.oracles.harness import consolidated_logits, held, resume, run_cli, trained_logits, unequal_tensors
from tests.sampling import sample

TAG = "pytorch_model"  # the tag Accelerate's save_state gives DeepSpeed's save_checkpoint
SAVE_STATES = ("accelerate-z2-fp32-ws2", "accelerate-z3-fp32-ws2")
# Each an `accelerator.load_state` on M processes: ZeRO-2 to 3 in the default run, every pair in the long mode.
LOADS = sample([(name, m) for name in SAVE_STATES for m in (1, 3, 4)], keep=[(SAVE_STATES[0], 3)])
CARRIED = ("custom_checkpoint_0.pkl", "scheduler.bin", "zero_to_fp32.py", "zero_to_torch.py")


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


def _sampled_loader() -> Any:
    """A dataloader as Accelerate prepares an iterable one for process 0 of 2 without dispatching batches,
    given a `SeedableRandomSampler`: the one kind whose sampler `save_accelerator_state` writes
    (`tests.fixtures.models.accelerate_sampler`)."""
    from accelerate.data_loader import DataLoaderShard, IterableDatasetShard, SeedableRandomSampler

    from tests.fixtures.models.accelerate_sampler import TokenStream

    loader = DataLoaderShard(IterableDatasetShard(TokenStream(0), batch_size=2, num_processes=2, process_index=0),
                             batch_size=2)
    loader.set_sampler(SeedableRandomSampler(data_source=range(16), data_seed=5))
    return loader


def _accelerate_folder(trainer_dir: Path, root: Path) -> dict[int, float]:
    """A folder as `Accelerator.save_state` under DeepSpeed leaves it, 2 processes: the Trainer
    fixture's DeepSpeed files under the tag `pytorch_model`, and Accelerate's own files written by
    accelerate's `save_accelerator_state` (what `save_state` calls on each process), `sampler.bin` among
    them (a pickled `SeedableRandomSampler`). Returns the first `random.random()` each process's saved
    state gives."""
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
        save_accelerator_state(str(root), [], [], [scheduler], [_sampled_loader()], process_index=process, step=7)
        first[process] = random.random()
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


def test_no_command_unpickles_accelerates_sampler(llama_trainer_ckpt, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """`sampler.bin` as Accelerate writes it is a pickled `SeedableRandomSampler`: validate, consolidate and
    reshard never rebuild it (a rebuild would call the class's `__setstate__`, recorded here; torch.load does),
    and reshard carries it byte for byte."""
    from accelerate.data_loader import SeedableRandomSampler
    from typer.testing import CliRunner

    from ckptflow.cli import app

    src = tmp_path / "acc"
    _accelerate_folder(llama_trainer_ckpt.dir, src)
    rebuilt: list[object] = []
    monkeypatch.setattr(SeedableRandomSampler, "__setstate__", lambda self, state: rebuilt.append(state),
                        raising=False)
    for args in (["validate", str(src), "--deep"], ["consolidate", str(src), str(tmp_path / "hf")],
                 ["reshard", str(src), str(tmp_path / "out"), "--world-size", "3"]):
        done = CliRunner().invoke(app, args, env={"COLUMNS": "400", "NO_COLOR": "1"})
        assert done.exit_code == 0, (args, done.output)
        if args[0] == "validate":  # listed by name
            assert done.output.splitlines()[1] == (
                "  Accelerate files: random_states_0.pkl, random_states_1.pkl, sampler.bin, scheduler.bin (pickles: "
                "named here, never opened; reshard carries them)")
    assert rebuilt == []
    assert (tmp_path / "out" / "sampler.bin").read_bytes() == (src / "sampler.bin").read_bytes()
    torch.load(src / "sampler.bin", weights_only=False)  # trusted: this test's own file; the hook sees a rebuild
    assert len(rebuilt) == 1 and rebuilt[0]["initial_seed"] == 5



def test_many_accelerate_files_are_named_in_one_bounded_line(llama_trainer_ckpt, tmp_path: Path) -> None:
    """A run at many processes keeps one random-states file each: the report names the first few and
    counts the rest."""
    from typer.testing import CliRunner

    from ckptflow.cli import MAX_NAMED, app

    src = tmp_path / "acc"
    _accelerate_folder(llama_trainer_ckpt.dir, src)
    for rank in range(2, 40):
        (src / f"random_states_{rank}.pkl").write_bytes(b"")
    done = CliRunner().invoke(app, ["validate", str(src)], env={"COLUMNS": "400", "NO_COLOR": "1"})
    assert done.exit_code == 0, done.output
    line = done.output.splitlines()[1]
    assert line.startswith("  Accelerate files: random_states_0.pkl, random_states_1.pkl, random_states_10.pkl")
    named, _, rest = line.partition(" and 30 more ")
    assert named.count(", ") == MAX_NAMED - 1 and rest.startswith("(pickles: named here, never opened")

# ---- a folder written by Accelerate's own save_state ------------------------------------------------------


@pytest.fixture(params=SAVE_STATES)
def saved(request: pytest.FixtureRequest, harness_fixtures: Mapping[str, HarnessFixture]) -> HarnessFixture:
    return harness_fixtures[request.param]


def test_a_save_state_folder_validates(saved: HarnessFixture) -> None:
    result = run_cli("validate", str(saved.dir))
    assert result.returncode == 0, result.stdout + result.stderr
    stage = saved.spec["stage"]
    assert result.stdout.startswith(f"valid {saved.dir / TAG}: ZeRO-{stage}, data-parallel 2, fp32, step 3, 20 params ")


def test_a_save_state_folder_consolidates_to_the_trained_logits(saved: HarnessFixture, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    result = run_cli("consolidate", str(saved.dir), str(out), "--config", str(saved.config_dir))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[-1].endswith(f"from {saved.config_dir}, checked against LlamaForCausalLM")
    assert torch.equal(consolidated_logits(out), trained_logits(saved))


@pytest.mark.parametrize("saved", sample(SAVE_STATES, keep=SAVE_STATES[:1]), indirect=True)
def test_no_command_opens_accelerates_pickles(saved: HarnessFixture, tmp_path: Path) -> None:
    """The registered object's `custom_checkpoint_0.pkl` holds classes that leave a marker when rebuilt:
    validate, consolidate and reshard leave none, and reshard carries Accelerate's files byte for byte."""
    markers = tmp_path / "markers"
    src, out = str(saved.dir), tmp_path / "out"
    for args in (["validate", src, "--deep"], ["consolidate", src, str(tmp_path / "hf"), "--config", str(saved.config_dir)],
                 ["reshard", src, str(out), "--world-size", "3"]):
        result = run_cli(*args, env={MARKER_ENV: str(markers)})
        assert result.returncode == 0, (args, result.stdout, result.stderr)
        assert not markers.exists(), (args, sorted(p.name for p in markers.iterdir()))
    assert [name for name in CARRIED if (out / name).read_bytes() != (saved.dir / name).read_bytes()] == []


@pytest.mark.parametrize(("saved", "world_size"), LOADS, indirect=["saved"])
def test_accelerate_loads_the_resharded_state(saved: HarnessFixture, world_size: int, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = run_cli("reshard", str(saved.dir), str(out), "--world-size", str(world_size))
    assert result.returncode == 0, result.stdout + result.stderr
    rng = [f"random_states_{r}.pkl" for r in range(world_size)]
    assert sorted(p.name for p in out.iterdir()) == sorted([*rng, *CARRIED, "latest", TAG])
    assert [(out / name).read_bytes() == (saved.dir / f"random_states_{r % 2}.pkl").read_bytes()
            for r, name in enumerate(rng)] == [True] * world_size
    markers = tmp_path / "markers"
    state, reports = resume("accelerate_resume", saved, out, world_size, tmp_path / "resume",
                            env={MARKER_ENV: str(markers)})
    assert unequal_tensors(saved, state) == []
    source = held(saved)
    assert source["draws"][0] != source["draws"][1]  # each source process had its own random states
    for rank, report in enumerate(reports):
        assert report["step"] == source["step"] == 3
        assert differences(report["scheduler"], source["scheduler"]) == [], rank
        assert differences(report["user"], source["user"]) == [], rank
        assert report["draws"] == source["draws"][rank % 2], rank  # process r resumes source process r mod N's
    assert sorted(p.name for p in markers.iterdir()) == sorted(MARKERS)  # Accelerate's load rebuilt them


# ---- a sampler file written by Accelerate's own save_state (long mode) ------------------------------------

# Each: the `accelerate-sampler` fixture (one launch, once) and an `accelerator.load_state` on M processes.
SAMPLER_LOADS = sample([1, 3], keep=[])


def _pickled_globals(path: Path) -> set[str]:
    """The globals a torch zip file's pickle names, read with pickletools (nothing rebuilt)."""
    import pickletools
    import zipfile

    with zipfile.ZipFile(path) as archive:
        data = archive.read(next(n for n in archive.namelist() if n.endswith("/data.pkl")))
    return {str(arg) for op, arg, _ in pickletools.genops(data) if op.name in ("GLOBAL", "STACK_GLOBAL")}


@pytest.mark.parametrize("world_size", SAMPLER_LOADS)
def test_accelerate_loads_a_reshard_with_the_sampler_it_saved(world_size: int, tmp_path: Path) -> None:
    """`save_state` with a dataloader whose sampler Accelerate saves (`specs.accelerate_sampler`): its
    `sampler_1.bin` is carried byte for byte by `reshard --world-size M`, no command rebuilds a pickled object,
    and `accelerator.load_state` at M processes (the sampler's classes allowed, as Accelerate's own load of the
    source needs) gives the loader the source's sampler, and the engine, step, scheduler, registered object and
    random states as the other Accelerate resumes. At one process Accelerate reads no sampler file (it loads one
    only into a loader sharded over processes): the loader keeps the sampler it was prepared with."""
    from tests.fixtures.sets import SETS
    from tests.fixtures.specs.accelerate_sampler import DATA_SEED, SAMPLER_FILE, SAMPLER_SPECS

    [name] = SAMPLER_SPECS
    saved = SETS["accelerate-sampler"].build([name])[name]
    assert _pickled_globals(saved.dir / SAMPLER_FILE) == {"accelerate.data_loader SeedableRandomSampler",
                                                          "__builtin__ xrange"}
    markers, out = tmp_path / "markers", tmp_path / "out"
    for args in (["validate", str(saved.dir), "--deep", "--json"], ["reshard", str(saved.dir), str(out),
                                                                    "--world-size", str(world_size)]):
        result = run_cli(*args, env={MARKER_ENV: str(markers)})
        assert result.returncode == 0, (args, result.stdout, result.stderr)
        assert not markers.exists(), args
        if args[0] == "validate":
            assert json.loads(result.stdout)["accelerate_files"] == [
                "custom_checkpoint_0.pkl", "random_states_0.pkl", "random_states_1.pkl", SAMPLER_FILE, "scheduler.bin"]
    assert [n for n in (*CARRIED, SAMPLER_FILE) if (out / n).read_bytes() != (saved.dir / n).read_bytes()] == []
    state, reports = resume("accelerate_sampler_resume", saved, out, world_size, tmp_path / "resume",
                            env={MARKER_ENV: str(markers)})
    assert unequal_tensors(saved, state) == []
    source = held(saved)
    for rank, report in enumerate(reports):
        assert report["sampler"] == {"data_source": list(range(16)), "replacement": False, "_num_samples": None,
                                     "generator": None, "initial_seed": DATA_SEED if world_size > 1 else DATA_SEED + 1,
                                     "epoch": 0}, rank
        assert report["step"] == source["step"] == 3
        assert differences(report["scheduler"], source["scheduler"]) == [], rank
        assert differences(report["user"], source["user"]) == [], rank
        assert report["draws"] == source["draws"][rank % 2], rank
