"""Issue 25's "done when", on checkpoints no test used while the code was written (``specs.harness_holdout``:
Lightning's strategy, Accelerate's ``save_state``, a Megatron-DeepSpeed ``args`` client state and seed 002's
optimizer shards, each at another seed and shape than its development fixtures, all on 3 ranks):

- ``validate`` is clean and says what it found (the client state listed, never run);
- ``consolidate`` (with ``--config`` where the harness writes no config.json) gives a folder
  ``from_pretrained`` loads with nothing missing or unexpected, whose logits are the trained module's bit
  for bit; the writer's user classes leave no marker;
- ``reshard --world-size 2`` gives a folder ckptflow validates, and that the harness's own loading code
  resumes from at 2 ranks holding the source's fp32 weights and Adam moments bit for bit: Lightning's
  ``trainer.fit(ckpt_path=)``, Accelerate's ``load_state``, DeepSpeed's ``load_checkpoint`` (client state
  equal, and ``ds_to_universal`` of the reshard equal to that of the source), the seed's
  ``optimizer.load_state_dict([every shard])``.

The default run takes the optimizer shards (one fixture write: validated, consolidated, resharded); the other
holdouts, and every launch of a loading code, run in the long mode (``tests.sampling``).
"""

from __future__ import annotations

import functools
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from ckptflow.cli import app
from ckptflow.formats.deepspeed.names import DEEPSPEED_MODEL_KEYS
from tests.fixtures.models.client_state import MARKER_ENV, MARKERS, differences
from tests.fixtures.sets import SETS, HarnessFixture
from tests.fixtures.specs.client_state_holdout import CLIENT_HOLDOUT_SPECS
from tests.fixtures.specs.harness import LOGIT_IDS
from tests.fixtures.specs.harness_holdout import HARNESS_HOLDOUT_SPECS
from tests.fixtures.specs.optimizer_shards_holdout import SHARDS_HOLDOUT_SPECS
from tests.sampling import sample

LIGHTNING, ACCELERATE = HARNESS_HOLDOUT_SPECS
[CLIENT] = CLIENT_HOLDOUT_SPECS
[SHARDS] = SHARDS_HOLDOUT_SPECS
SET_OF = {LIGHTNING: "harness-holdout", ACCELERATE: "harness-holdout", CLIENT: "client-state-holdout",
          SHARDS: "optimizer-shards-holdout"}
NAMES = sample(tuple(SET_OF), keep=[SHARDS])
TARGET = 2  # every holdout is on 3 ranks
LOADS = sample(tuple(SET_OF), keep=[])  # one launch each


@pytest.fixture(scope="module")
def holdout() -> Callable[[str], Any]:
    """A held-out fixture by name, its set built (for that name only) on first use."""
    return functools.cache(lambda name: SETS[SET_OF[name]].build([name])[name])


@pytest.fixture
def markers(tmp_path: Path) -> Path:
    return tmp_path / "markers"


def ckptflow(*args: str, markers: Path) -> str:
    """``ckptflow ARGS`` (exit 0 asserted) with the marker classes' ``$CKPTFLOW_CLIENT_MARKER`` set; its output
    on one line. Nothing ckptflow does may rebuild the client state's classes: no marker is left."""
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "400", "NO_COLOR": "1", MARKER_ENV: str(markers)})
    assert result.exit_code == 0, (args, result.output)
    assert not markers.exists(), (args, sorted(p.name for p in markers.iterdir()))
    return result.output


def tag_dir(name: str, fixture: Any) -> Path:
    """Where validate reads the ranks: the tag folder (the optimizer shards have none)."""
    return fixture.dir if name == SHARDS else fixture.dir / fixture.tag


def config_dir(name: str, fixture: Any, tmp_path: Path) -> Path | None:
    """What ``--config`` is given: the harness fixtures' config/, the tiny Llama's own config for the client
    state (its writer saves none), none for the shards (their model is saved beside them)."""
    if name in HARNESS_HOLDOUT_SPECS:
        return fixture.config_dir
    if name == CLIENT:
        from tests.fixtures.models.data_parallel import build_model

        model = build_model(fixture.spec["model"], fixture.spec["seed"])
        model.config.architectures = [type(model).__name__]
        model.config.save_pretrained(tmp_path / "config")
        return tmp_path / "config"
    return None


def logits_of(model: Any) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=torch.tensor(LOGIT_IDS)).logits


def trained_logits(name: str, fixture: Any) -> torch.Tensor:
    """The logits of ``LOGIT_IDS`` that the trained module gives: written by the harness writers; for the
    shards, the module saved beside them; for the client state, the tiny Llama holding the live engine's
    fp32 weights."""
    from transformers import AutoModelForCausalLM

    if name in HARNESS_HOLDOUT_SPECS:
        return load_file(fixture.logits_path)["logits"]
    if name == SHARDS:
        return logits_of(AutoModelForCausalLM.from_pretrained(fixture.dir, dtype=torch.float32))
    from tests.fixtures.models.data_parallel import build_model

    model = build_model(fixture.spec["model"], fixture.spec["seed"])
    weights = {k.removeprefix("fp32/"): v for k, v in load_file(fixture.expected_path).items() if k.startswith("fp32/")}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return logits_of(model)


@pytest.mark.parametrize("name", NAMES)
def test_a_held_out_checkpoint_validates(name: str, holdout: Callable[[str], Any], markers: Path) -> None:
    fixture = holdout(name)
    said = ckptflow("validate", str(fixture.dir), "--deep", markers=markers)
    spec = fixture.spec
    kind = f"optimizer shards {spec['pattern']}, " if name == SHARDS else ""
    assert said.startswith(f"valid {tag_dir(name, fixture)}: {kind}ZeRO-{spec['stage']}, data-parallel 3, "
                           f"{spec['dtype']}, step 3, "), said
    if name in (CLIENT, LIGHTNING):
        assert "client state: carried as it is; its classes are named here, never imported or run" in said
        assert ("args: an argparse.Namespace" if name == CLIENT else "hyper_parameters: a dict of 3 items") in said


@pytest.mark.parametrize("name", NAMES)
def test_a_held_out_checkpoint_consolidates_to_the_trained_logits(name: str, holdout: Callable[[str], Any],
                                                                  markers: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    fixture = holdout(name)
    config = config_dir(name, fixture, tmp_path)
    out = tmp_path / "hf"
    said = ckptflow("consolidate", str(fixture.dir), str(out), *(["--config", str(config)] if config else []),
                    markers=markers)
    assert "not loadable" not in said, said
    if config is not None:
        assert said.splitlines()[-1].endswith(f"from {config}, checked against LlamaForCausalLM"), said
    model, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert {key: value for key, value in info.items() if value} == {}
    assert torch.equal(logits_of(model), trained_logits(name, fixture))
    if name == SHARDS:  # without the model beside them, the shapes come from --config
        bare = tmp_path / "bare"
        bare.mkdir()
        for path in fixture.dir.glob("optim_rank*.bin"):
            shutil.copyfile(path, bare / path.name)
        ckptflow("consolidate", str(bare), str(tmp_path / "from-config"), "--config", str(fixture.dir / "config.json"),
                 markers=markers)
        assert torch.equal(logits_of(AutoModelForCausalLM.from_pretrained(tmp_path / "from-config",
                                                                          dtype=torch.float32)),
                           trained_logits(name, fixture))


def resharded(name: str, fixture: Any, out: Path, markers: Path) -> str:
    """``reshard --world-size 2`` of the holdout into ``out``, then ``validate`` of ``out``; what validate said."""
    said = " ".join(ckptflow("reshard", str(fixture.dir), str(out), "--world-size", str(TARGET),
                             markers=markers).split())
    assert "data-parallel 3" in said or "dp3" in said, said
    return ckptflow("validate", str(out), markers=markers)


@pytest.mark.parametrize("name", NAMES)
def test_a_held_out_checkpoint_reshards_to_a_folder_that_validates(name: str, holdout: Callable[[str], Any],
                                                                   markers: Path, tmp_path: Path) -> None:
    fixture = holdout(name)
    out = tmp_path / "out"
    said = resharded(name, fixture, out, markers)
    assert f"ZeRO-{fixture.spec['stage']}, data-parallel {TARGET}, {fixture.spec['dtype']}, step 3, " in said, said
    if name == SHARDS:  # the same pattern at the target, the model beside carried byte for byte
        shards = [fixture.spec["pattern"].format(rank=r) for r in range(TARGET)]
        side = sorted(p.name for p in fixture.dir.iterdir() if not p.name.startswith("optim_rank"))
        assert sorted(p.name for p in out.iterdir()) == sorted([*shards, *side])
        assert [n for n in side if (out / n).read_bytes() != (fixture.dir / n).read_bytes()] == []
    if name == ACCELERATE:  # random_states_{r}.pkl named for the target: process r takes source process r mod 3
        assert [(out / f"random_states_{r}.pkl").read_bytes() == (fixture.dir / f"random_states_{r}.pkl").read_bytes()
                for r in range(TARGET)] == [True] * TARGET
        assert not (out / f"random_states_{TARGET}.pkl").exists()


# ---- each harness's own loading code at the target (long mode) -------------------------------------------


def load_shards(fixture: Any, out: Path, work: Path) -> None:
    """Seed 002's loading code at 2 ranks, on both of its paths: the masters from the model's weights
    (default) and from the shards' fp32 partitions; Adam moments, step and hyper-parameters on both."""
    from tests.fixtures.replay import launch

    spec = fixture.spec
    jobs = [{"shards": str(out), "model": spec["model"], "seed": spec["seed"], "dtype": spec["dtype"],
             "stage": spec["stage"], "pattern": spec["pattern"], "out": str(work / path), "fp32_weights": path == "fp32"}
            for path in ("default", "fp32")]
    (work / "jobs.json").write_text(json.dumps(jobs))
    launch("tests.oracles.optimizer_shards", TARGET, ["--jobs", str(work / "jobs.json")])
    expected = load_file(fixture.expected_path)  # fp32: the module's weights are the masters
    for path in ("default", "fp32"):
        held = load_file(work / path / "state.safetensors")
        assert held.keys() == expected.keys()
        assert [k for k in expected if not torch.equal(held[k], expected[k])] == [], path
        summary = json.loads((work / path / "optimizer.json").read_text())
        assert [summary[k] == spec[k] for k in ("steps", "param_groups", "loss_scale", "clip_grad")] == [True] * 4


def load_client_state(fixture: Any, out: Path, work: Path) -> None:
    """DeepSpeed's own ``load_checkpoint`` at 2 ranks (the client-state oracle): the client state equal to the
    source's (``args`` saying the target's shape), the live engine's fp32 weights and Adam moments."""
    from tests.fixtures.replay import launch

    (work / "jobs.json").write_text(json.dumps([{"spec": str(fixture.root / "spec.json"), "ckpt": str(out),
                                                 "expected": str(fixture.root / "client_state.pkl"),
                                                 "out": str(work / "load")}]))
    launch("tests.oracles.client_state", TARGET, ["--jobs", str(work / "jobs.json")], timeout=600,
           log_dir=work / "logs")
    for rank in range(TARGET):
        report = json.loads((work / "load" / f"rank{rank}.json").read_text())
        assert report == {"rank": rank, "missing": [], "extra": [], "differences": []}
    expected, loaded = load_file(fixture.expected_path), load_file(work / "load" / "state.safetensors")
    assert loaded.keys() == expected.keys()
    assert [k for k in expected if not torch.equal(loaded[k], expected[k])] == []


def check_universal(source: Path, out: Path, work: Path) -> None:
    """``ds_to_universal`` of ``out`` equals that of ``source`` in every file it writes: each parameter's fp32
    weight, Adam moments and step (ZeRO-1/2); of ``optimizer_state.pt`` all but what says the world size."""
    from tests.test_reshard import _load_plain, _universal, _universal_tensor

    cache: dict[Path, Path] = {}
    ours, theirs = (_universal(folder, cache, work) / "zero" for folder in (source, out))
    files = sorted(str(p.relative_to(ours)) for p in ours.rglob("*.pt"))
    assert files and files == sorted(str(p.relative_to(theirs)) for p in theirs.rglob("*.pt"))
    assert {Path(f).name for f in files} >= {"fp32.pt", "exp_avg.pt", "exp_avg_sq.pt"}  # and step.pt below ZeRO-3
    params = [f for f in files if f != "optimizer_state.pt"]
    assert [f for f in params if _universal_tensor(_load_plain(ours / f)) != _universal_tensor(_load_plain(theirs / f))
            ] == []
    # optimizer_state.pt is rank 0's optimizer state: at ZeRO-1/2 without its partitions, so that only what says
    # the world size differs; at ZeRO-3 whole, its partitions (of another size at another world size) included
    was, now = _load_plain(ours / "optimizer_state.pt"), _load_plain(theirs / "optimizer_state.pt")
    assert was.keys() == now.keys() and was["param_groups"] == now["param_groups"]
    sized = {"partition_count", "group_paddings"}
    if "fp32_flat_groups" in was:
        sized |= {"fp32_flat_groups", "optimizer_state_dict"}
    assert {k for k in was if was[k] != now[k]} <= sized


def resume_harness(name: str, fixture: HarnessFixture, out: Path, work: Path) -> None:
    """Lightning's ``trainer.fit(ckpt_path=OUT)`` or Accelerate's ``load_state(OUT)`` at 2 ranks, in processes
    that define the user classes (they leave their markers there): the engine holds the source's fp32 weights
    and Adam moments; every rank the source's client state, step, scheduler and callback or registered
    object, and Accelerate's process r the random states of source process r."""
    from tests.oracles.harness import held, resume, unequal_tensors

    markers = work / "markers"
    script = "lightning_resume" if name == LIGHTNING else "accelerate_resume"
    state, reports = resume(script, fixture, out, TARGET, work / "resume", env={MARKER_ENV: str(markers)})
    assert unequal_tensors(fixture, state) == []
    source = held(fixture)
    if name == ACCELERATE:
        assert len({repr(draws) for draws in source["draws"]}) == 3  # each source process had its own
    for rank, report in enumerate(reports):
        assert differences(report["scheduler"], source["scheduler"]) == [], rank
        if name == LIGHTNING:
            client = {k: v for k, v in report["client_state"].items() if k not in DEEPSPEED_MODEL_KEYS}
            assert differences(client, source["client_state"]) == [], rank
            assert (report["global_step"], report["epoch"]) == (source["global_step"], source["epoch"]), rank
            assert differences(report["callback"], source["callback"]) == [], rank
        else:
            assert report["step"] == source["step"], rank
            assert differences(report["user"], source["user"]) == [], rank
            assert report["draws"] == source["draws"][rank], rank
    assert sorted(p.name for p in markers.iterdir()) == sorted(MARKERS)  # the user's process rebuilt them


@pytest.mark.parametrize("name", LOADS)
def test_the_harnesses_own_loading_code_resumes_from_the_reshard(name: str, holdout: Callable[[str], Any],
                                                                 markers: Path, tmp_path: Path) -> None:
    fixture = holdout(name)
    out = tmp_path / ("last-ws2.ckpt" if name == LIGHTNING else "out")
    resharded(name, fixture, out, markers)
    work = tmp_path / "oracle"
    work.mkdir()
    if name == SHARDS:
        load_shards(fixture, out, work)
    elif name == CLIENT:
        load_client_state(fixture, out, work)
        check_universal(fixture.dir, out, work)
    else:
        resume_harness(name, fixture, out, work)


# ---- the client-state oracle through ds_to_universal, on the development fixtures too -----------------------

# `tests.fixtures.specs.client_state`'s checkpoints (built for test_client_state.py in the default run anyway)
DEV_CLIENT = ("client-megatron-z1-fp32-ws2", "client-lightning-z3-bf16-ws2")
UNIVERSAL = sample((*DEV_CLIENT, CLIENT), keep=DEV_CLIENT)


@pytest.mark.parametrize("name", UNIVERSAL)
def test_ds_to_universal_of_a_client_state_reshard_equals_the_sources(name: str, holdout: Callable[[str], Any],
                                                                      markers: Path, tmp_path: Path) -> None:
    """Every fp32 weight, Adam moment and step of a checkpoint with a client state comes through ``reshard``
    (to 3 ranks from 2, to 2 from 3) as DeepSpeed's own converter reads it."""
    fixture = SETS["client-state"].build([name])[name] if name in DEV_CLIENT else holdout(name)
    out = tmp_path / "out"
    ckptflow("reshard", str(fixture.dir), str(out), "--world-size", str(5 - fixture.world_size), markers=markers)
    check_universal(fixture.dir, out, tmp_path)
