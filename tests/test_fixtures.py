"""The fixture checkpoints exist, have DeepSpeed's layout, and DeepSpeed's own reader agrees with them.

What DeepSpeed 0.19.8 itself cannot do with them, pinned here so that a change shows up:

- ``zero_to_fp32`` refuses the ``BF16_Optimizer`` checkpoint (bf16 ZeRO-1 with fp32 gradient
  accumulation): its optimizer files carry no ``zero_stage``, "... is not a zero checkpoint".
- For ZeRO-1 DeepSpeed saves no ``frozen_param_shapes`` / ``frozen_param_fragments`` (only ZeRO-2/3
  do), so ``zero_to_fp32`` leaves frozen parameters out; they exist only in the module state dict,
  in the training dtype.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from flows.demo_checkpoint import write_demo_checkpoint
from tests.fixtures import MATRIX, Fixture, LaunchError, build, launch, replay
from tests.fixtures.cache import _generate_group
from tests.fixtures.models.data_parallel import BIG_INT64
from tests.fixtures.specs.data_parallel import TRAINER, FixtureSpec
from tests.sampling import long_mode

NAMES = [spec.name for spec in MATRIX]
TOY = {spec.name for spec in MATRIX if spec.model == "toy"}
LLAMA = {spec.name for spec in MATRIX if spec.model == "tiny-llama"}


def get_fixture(request: pytest.FixtureRequest, name: str) -> Fixture:
    if name == "llama-trainer":
        return request.getfixturevalue("llama_trainer_ckpt")
    return request.getfixturevalue("ds_fixtures")[name]


@pytest.fixture(params=NAMES)
def fixture(request: pytest.FixtureRequest) -> Fixture:
    return get_fixture(request, request.param)


def expected_files(fixture: Fixture) -> set[str]:
    prefix = "bf16_" if fixture.dtype == "bf16" else ""
    ranks = range(fixture.world_size)
    optim = {f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt" for rank in ranks}
    if fixture.stage == 3:
        return optim | {f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt" for rank in ranks}
    return optim | {"mp_rank_00_model_states.pt"}


def test_layout_matches_deepspeed(fixture: Fixture) -> None:
    spec = FixtureSpec.from_json(fixture.spec)
    assert (fixture.name, fixture.stage, fixture.dtype, fixture.world_size, fixture.offload) == (
        spec.name,
        spec.stage,
        spec.dtype,
        spec.world_size,
        spec.offload,
    )
    assert (fixture.dir / "latest").read_text().strip() == fixture.tag == spec.tag
    assert {path.name for path in fixture.tag_dir.iterdir()} == expected_files(fixture)
    assert fixture.buffers_path.is_file() and fixture.expected_path.is_file()


def test_deepspeed_chose_the_expected_optimizers(fixture: Fixture) -> None:
    spec = fixture.spec
    if fixture.stage == 3:
        wrapper = "DeepSpeedZeroOptimizer_Stage3"
    elif spec["grad_accum_dtype"] == "fp32":
        wrapper = "BF16_Optimizer"
    else:
        wrapper = "DeepSpeedZeroOptimizer"
    if spec["launcher"] == TRAINER:
        base = "AdamW"
    else:
        base = "DeepSpeedCPUAdam" if fixture.offload else "FusedAdam"
    assert (spec["optimizer"], spec["base_optimizer"]) == (wrapper, base)


def test_buffers_keep_their_real_dtypes(fixture: Fixture) -> None:
    import torch
    from safetensors.torch import load_file

    buffers = load_file(fixture.buffers_path)
    if fixture.name in LLAMA:
        assert buffers == {}  # rotary inv_freq is not persistent
        return
    assert {name: str(t.dtype).removeprefix("torch.") for name, t in buffers.items()} == {
        "big": "int64",
        "scale": "bfloat16",
        "updates": "int32",
        "mask": "bool",
    }
    assert buffers["big"].tolist() == [BIG_INT64]
    assert buffers["updates"].tolist() == [fixture.spec["steps"]] * 3
    assert torch.equal(buffers["mask"], torch.tensor([True, False, True, True, False]))


def test_zero_to_fp32_matches_the_live_engine(fixture: Fixture) -> None:
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file

    if fixture.spec["optimizer"] == "BF16_Optimizer":
        with pytest.raises(ValueError, match="is not a zero checkpoint"):
            get_fp32_state_dict_from_zero_checkpoint(str(fixture.dir))
        return
    state = get_fp32_state_dict_from_zero_checkpoint(str(fixture.dir))
    expected = load_file(fixture.expected_path)
    for key, value in expected.items():
        kind, name = key.split("/", 1)
        if kind == "fp32":
            assert torch.equal(state[name], value), name
        elif kind == "frozen" and fixture.stage == 1:
            assert name not in state  # ZeRO-1 saves no frozen fragments
        elif kind == "frozen":
            assert torch.equal(state[name], value.float()), name
    tied = ("head.weight", "emb.weight") if fixture.name in TOY else ("lm_head.weight", "model.embed_tokens.weight")
    assert torch.equal(state[tied[0]], state[tied[1]])
    if fixture.name in TOY:
        assert state["big"].dtype == torch.int64 and state["big"].tolist() == [BIG_INT64]


@pytest.mark.parametrize("name", sorted(LLAMA))
def test_hugging_face_files_sit_next_to_latest(request: pytest.FixtureRequest, name: str) -> None:
    from transformers import AutoConfig, AutoTokenizer

    fixture = get_fixture(request, name)
    names = {path.name for path in fixture.dir.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= names
    if fixture.spec["launcher"] == TRAINER:
        assert {"trainer_state.json", "training_args.bin", "scheduler.pt", "rng_state_0.pth",
                "rng_state_1.pth"} <= names
        assert json.loads((fixture.dir / "trainer_state.json").read_text())["global_step"] == fixture.spec["steps"]
    config = AutoConfig.from_pretrained(fixture.dir)
    tokenizer = AutoTokenizer.from_pretrained(fixture.dir)
    assert config.tie_word_embeddings and config.vocab_size == len(tokenizer)
    assert tokenizer("the quick brown fox")["input_ids"][0] != tokenizer.unk_token_id


def test_build_rejects_unknown_names() -> None:
    with pytest.raises(ValueError, match="unknown fixture z9-fp8-ws2; known fixtures: z1-fp32-ws2, "):
        build(["z9-fp8-ws2"])


def test_failed_generation_leaves_nothing_behind(tmp_path: Path) -> None:
    broken = FixtureSpec(name="broken", model="no-such-model", stage=1, dtype="fp32", world_size=1)
    with pytest.raises(LaunchError, match="unknown fixture model 'no-such-model'"):
        _generate_group(tmp_path, [broken], timeout=120)
    assert list(tmp_path.iterdir()) == []


def test_each_cache_key_hashes_the_code_its_writers_import_and_nothing_else(tmp_path: Path) -> None:
    """The key follows the rank scripts' imports: every module that shapes a set's checkpoints, none of
    the machinery; docstrings, comments and layout change no key."""
    from tests.fixtures.cache import KEYED_PACKAGES, KEYED_SOURCES, _code, cache_key, keyed_modules
    from tests.fixtures.sets import EXTRA_SOURCES, HARNESS_PACKAGES, HARNESS_SOURCES, HOLDOUT_SOURCES, PARALLEL_SOURCES

    fx = "tests.fixtures."
    assert keyed_modules(KEYED_SOURCES) == (
        "flows.demo_checkpoint", fx + "models.data_parallel", fx + "specs.data_parallel", fx + "writers.data_parallel",
        fx + "writers.rank", fx + "writers.trainer")
    assert keyed_modules(PARALLEL_SOURCES) == (
        fx + "models.parallel", fx + "specs.parallel", fx + "writers.parallel", fx + "writers.rank")
    assert set(keyed_modules(EXTRA_SOURCES)) == {*keyed_modules(PARALLEL_SOURCES), fx + "models.parallel_extra",
                                                  fx + "models.client_state", fx + "specs.extra",
                                                  fx + "writers.parallel_extra"}
    assert set(keyed_modules(HOLDOUT_SOURCES)) == {*keyed_modules(PARALLEL_SOURCES), fx + "specs.expert_holdout"}
    assert set(keyed_modules(HARNESS_SOURCES)) == {*keyed_modules(KEYED_SOURCES[:1]), fx + "models.client_state",
                                                   fx + "models.harness", fx + "models.lightning_module",
                                                   fx + "models.accelerate_run", fx + "specs.harness",
                                                   fx + "writers.harness", fx + "writers.lightning_strategy",
                                                   fx + "writers.accelerate_state"}
    # Lightning's version keys the harness set only: installing another Lightning regenerates nothing else.
    assert cache_key(HARNESS_SOURCES, HARNESS_PACKAGES) != cache_key(HARNESS_SOURCES)
    assert "lightning" not in KEYED_PACKAGES and set(HARNESS_PACKAGES) - set(KEYED_PACKAGES) == {"lightning"}
    plain, explained = tmp_path / "plain.py", tmp_path / "explained.py"
    plain.write_text("def f(x):\n    return x + 1\n")
    explained.write_text('"""A module."""\n\n\ndef f(x):  # one more\n    """Add one."""\n\n    return (x\n            '
                         '+ 1)\n')
    other = tmp_path / "other.py"
    other.write_text("def f(x):\n    return x + 2\n")
    assert _code(plain) == _code(explained)
    assert _code(plain) != _code(other)


@pytest.mark.parametrize(("holdout", "of"), [("harness-holdout", "harness"), ("client-state-holdout", "client-state"),
                                             ("optimizer-shards-holdout", "optimizer-shards"),
                                             ("pipe-round-robin", "round-robin"),
                                             ("autotp-round-robin", "round-robin"),
                                             ("megatron-round-robin", "round-robin")])
def test_a_held_out_set_is_keyed_by_its_writers_and_its_own_specs(holdout: str, of: str) -> None:
    """Issue 25's held-out checkpoints (and the round-robin PipelineModule, AutoTP and Megatron-style ones, written by the
    round-robin set's rank script): each set hashes the rank scripts of the set it is held out of and its own spec module; the set
    it is held out of does not hash that module (adding a holdout regenerates nothing else)."""
    from tests.fixtures.cache import keyed_modules
    from tests.fixtures.sets import SETS

    own = f"tests.fixtures.specs.{holdout.replace('-', '_')}"
    assert set(keyed_modules(SETS[holdout].sources)) == {*keyed_modules(SETS[of].sources), own}
    assert own not in keyed_modules(SETS[of].sources)
    assert set(SETS[holdout].specs).isdisjoint(SETS[of].specs)
    assert SETS[holdout].cache_dir() != SETS[of].cache_dir()


def test_launch_stops_the_other_ranks_and_shows_the_failing_log(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(
        "import os, signal, sys, time\n"
        "rank = int(os.environ['RANK'])\n"
        "stopped = lambda *_: (open(sys.argv[1] + f'/stopped{rank}', 'w').close(), sys.exit(143))\n"
        "signal.signal(signal.SIGTERM, stopped)\n"
        "open(sys.argv[1] + f'/ready{rank}', 'w').close()\n"
        "print(f'rank {rank} of {os.environ[\"WORLD_SIZE\"]} says hello', flush=True)\n"
        "while rank == 1 and not all(os.path.exists(sys.argv[1] + f'/ready{r}') for r in (0, 2)):\n"
        "    time.sleep(0.01)  # fails once the others can say they were stopped\n"
        "sys.exit(3) if rank == 1 else time.sleep(60)\n"
    )
    with pytest.raises(LaunchError) as raised:
        launch(script, 3, [str(tmp_path)], timeout=30)  # the timeout is the hang guard
    # The other ranks were stopped (signalled), not waited for: theirs would have been a 60 s sleep.
    assert sorted(p.name for p in tmp_path.glob("stopped*")) == ["stopped0", "stopped2"]
    error = raised.value
    assert (error.rank, error.returncode) == (1, 3)
    assert f"rank 1 of 3 running {script} exited with code 3; the other ranks were stopped." in str(error)
    assert "rank 1 of 3 says hello" in error.tails[1]


def test_launch_gives_up_after_its_timeout(tmp_path: Path) -> None:
    script = tmp_path / "sleep.py"
    script.write_text("import time\ntime.sleep(60)\n")
    with pytest.raises(LaunchError, match="ran past its time limit") as raised:
        launch(script, 2, timeout=1)
    assert raised.value.rank is None


def test_launch_passes_args_and_env(tmp_path: Path) -> None:
    script = tmp_path / "env.py"
    script.write_text(
        "import os, sys\n"
        "out = sys.argv[1]\n"
        "keys = ['RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'MASTER_ADDR', 'DS_ACCELERATOR', 'EXTRA']\n"
        "open(f\"{out}/{os.environ['RANK']}\", 'w').write(' '.join(os.environ[k] for k in keys))\n"
    )
    launch(script, 2, [str(tmp_path)], env={"EXTRA": "yes"}, timeout=30)
    assert (tmp_path / "1").read_text() == "1 1 2 127.0.0.1 cpu yes"


def test_a_launch_is_replayed_only_when_it_would_read_the_same_bytes(tmp_path: Path, monkeypatch) -> None:
    """`replay.launch` runs the ranks for a new key (code, arguments, the bytes of the inputs they name) and
    copies the outputs back for one it kept; a changed input byte, a changed script or the switch runs
    them again."""
    monkeypatch.setenv("CKPTFLOW_FIXTURE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(replay.REPLAY_ENV, raising=False)
    script, runs = tmp_path / "upper.py", tmp_path / "runs"
    script.write_text(
        "import json, os, sys\n"
        "for job in json.load(open(sys.argv[2])):\n"
        "    os.makedirs(job['out'])\n"
        "    open(job['out'] + '/upper', 'w').write(open(job['in']).read().upper())\n"
        "open(os.environ['RUNS'], 'a').write('ran\\n')\n"
    )
    source, jobs = tmp_path / "source.txt", tmp_path / "jobs.json"
    source.write_text("deepspeed")

    def run(out: str) -> tuple[bool, str]:
        jobs.write_text(json.dumps([{"in": str(source), "out": str(tmp_path / out)}]))
        ran = replay.launch(str(script), 1, ["--jobs", str(jobs)], env={"RUNS": str(runs)}, timeout=30)
        return ran, (tmp_path / out / "upper").read_text()

    assert run("a") == (True, "DEEPSPEED")
    assert run("b") == (False, "DEEPSPEED")  # another output folder, the same input bytes: copied back
    source.write_text("DeepSpeed")
    assert run("c") == (True, "DEEPSPEED")
    script.write_text(script.read_text() + "# another script\n")
    assert run("d") == (True, "DEEPSPEED")
    monkeypatch.setenv(replay.REPLAY_ENV, "0")
    assert run("e") == (True, "DEEPSPEED")
    assert runs.read_text() == "ran\n" * 4


@pytest.mark.skipif(not long_mode(), reason="a DeepSpeed launch that `make demo` makes too (CI runs it): long mode")
def test_the_demo_writes_a_training_run_folder(tmp_path: Path) -> None:
    """`make demo`'s checkpoint writer (product code, not a test helper) leaves what a Hugging Face
    training run leaves, valid for ckptflow. By default `.ci/run` covers it with `make demo` itself,
    which writes such a folder, validates it and takes it through the whole pipeline."""
    from ckptflow.validate import validate

    out = write_demo_checkpoint(tmp_path / "run", stage=3, dtype="bf16", world_size=2, steps=2)
    names = {path.name for path in out.iterdir()}
    assert {"latest", "global_step2", "config.json", "generation_config.json", "tokenizer.json"} <= names
    assert [path.name for path in tmp_path.iterdir()] == ["run"]
    report = validate(str(out))
    assert report.ok and report.index is not None and report.index.world_size == 2 and report.index.stage == 3


@pytest.mark.skipif(not long_mode(), reason="a second DeepSpeed launch: long mode (CKPTFLOW_LONG=1)")
def test_the_demo_replaces_an_older_run(tmp_path: Path) -> None:
    out = write_demo_checkpoint(tmp_path / "run", world_size=1, steps=2)
    write_demo_checkpoint(out, world_size=1, steps=3)
    assert (out / "latest").read_text() == "global_step3" and not (out / "global_step2").exists()
    assert [path.name for path in tmp_path.iterdir()] == ["run"]


def test_cli_lists_the_matrix() -> None:
    import subprocess

    result = subprocess.run(
        [sys.executable, "-m", "tests.fixtures", "--list"],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[1],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    assert result.stdout.split() == NAMES


@pytest.mark.skipif(not long_mode(), reason="a check of the fixtures, not of ckptflow: long mode (CKPTFLOW_LONG=1)")
def test_deepspeed_loads_the_fixtures_back_to_the_same_state(ds_fixtures, tmp_path: Path) -> None:
    """One launch reloads the fixture families at 2 ranks; the engines match expected.safetensors. (The
    default run checks the fixtures against the live engine through zero_to_fp32 above.)"""
    import torch
    from safetensors.torch import load_file

    names = ["z1-bf16-ws2", "z2-fp32-ws2", "z3-bf16-ws2", "z1-bf16-ws2-fp32accum", "z3-bf16-ws2-offload"]
    args = []
    for name in names:
        fixture = ds_fixtures[name]
        args += ["--spec", str(fixture.root / "spec.json"), "--ckpt", str(fixture.dir), "--out", str(tmp_path / name)]
    launch("tests.fixtures.writers.reload", 2, args, timeout=300)
    for name in names:
        expected = load_file(ds_fixtures[name].expected_path)
        reloaded = load_file(tmp_path / name)
        assert reloaded.keys() == expected.keys()
        different = [key for key in expected if not torch.equal(reloaded[key], expected[key])]
        assert different == [], name
