"""PyTorch Lightning's DeepSpeed strategy (issue 25, item 3): a `*.ckpt` folder written by Lightning itself
(`Trainer(strategy=DeepSpeedStrategy(stage=3 or 2), accelerator="cpu", devices=2).fit`, then
`trainer.save_checkpoint("last.ckpt")`, on CPU ranks with gloo; `tests.fixtures.specs.harness`).

- `validate` lists Lightning's client state (loops, callbacks, hyper-parameters, schedulers) and the user
  classes it names, without importing or running them;
- `consolidate --config` (Lightning writes no config.json) gives a folder `from_pretrained` loads with no
  key missing or unexpected (the LightningModule's `model.` prefix is transformers' to strip), whose
  logits are the trained module's, bit for bit;
- `reshard --world-size M` gives a folder Lightning itself resumes from at M ranks
  (`trainer.fit(module, ckpt_path=OUT)`): the engine holds the source's fp32 weights and Adam moments bit
  for bit, and every rank gets back the source's client state, global step, epoch, scheduler state and
  the user callback's state;
- no ckptflow command rebuilds the user classes in the client state (they leave a marker file when they
  are); Lightning's own resume does, in the user's process.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import pytest
import torch

from ckptflow.formats.deepspeed.names import DEEPSPEED_MODEL_KEYS
from tests.fixtures.models.client_state import MARKER_ENV, MARKERS, differences
from tests.fixtures.sets import HarnessFixture
from tests.oracles.harness import consolidated_logits, held, resume, run_cli, trained_logits, unequal_tensors
from tests.sampling import sample

NAMES = ("lightning-z3-fp32-ws2", "lightning-z2-fp32-ws2")
# Each a Lightning resume on M ranks: ZeRO-3 to 3 ranks in the default run, every pair in the long mode.
RESUMES = sample([(name, m) for name in NAMES for m in (1, 3, 4)], keep=[(NAMES[0], 3)])


@pytest.fixture(params=NAMES)
def lightning(request: pytest.FixtureRequest, harness_fixtures: Mapping[str, HarnessFixture]) -> HarnessFixture:
    return harness_fixtures[request.param]


def test_validate_lists_lightnings_client_state(lightning: HarnessFixture) -> None:
    result = run_cli("validate", str(lightning.dir))
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    stage = lightning.spec["stage"]
    assert lines[0].startswith(f"valid {lightning.dir / 'checkpoint'}: ZeRO-{stage}, data-parallel 2, fp32, step 3, ")
    assert lines[1:] == [
        "  client state: carried as it is; its classes are named here, never imported or run",
        "    epoch: an int",
        "    global_step: an int",
        "    pytorch-lightning_version: a string of 5 characters",
        "    loops: a dict of 4 items",
        "    callbacks: a dict of 2 items, naming tests.fixtures.models.client_state.Schedule, "
        "tests.fixtures.models.client_state.TrainerState, tests.fixtures.models.client_state.rebuild_tokens",
        "    lr_schedulers: a list of 1 item",
        "    hparams_name: a string of 6 characters",
        "    hyper_parameters: a dict of 3 items, naming tests.fixtures.models.client_state.Schedule",
    ]


def test_consolidate_with_config_loads_and_gives_the_trained_logits(lightning: HarnessFixture, tmp_path: Path) -> None:
    bare = run_cli("consolidate", str(lightning.dir), str(tmp_path / "bare"))
    assert bare.returncode == 0, bare.stdout + bare.stderr
    assert bare.stdout.splitlines()[-1].startswith("not loadable:")
    out = tmp_path / "hf"
    result = run_cli("consolidate", str(lightning.dir), str(out), "--config", str(lightning.config_dir))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[-1] == ("  config: config.json, generation_config.json, tokenizer.json, "
                                              f"tokenizer_config.json from {lightning.config_dir}, checked against "
                                              "LlamaForCausalLM")
    assert torch.equal(consolidated_logits(out), trained_logits(lightning))


@pytest.mark.parametrize("lightning", sample(NAMES, keep=NAMES[:1]), indirect=True)
def test_no_command_runs_the_client_state(lightning: HarnessFixture, tmp_path: Path) -> None:
    markers = tmp_path / "markers"
    src = str(lightning.dir)
    for args in (["validate", src], ["validate", src, "--deep"],
                 ["consolidate", src, str(tmp_path / "hf"), "--config", str(lightning.config_dir)],
                 ["reshard", src, str(tmp_path / "out"), "--world-size", "3"], ["validate", str(tmp_path / "out")]):
        result = run_cli(*args, env={MARKER_ENV: str(markers)})
        assert result.returncode == 0, (args, result.stdout, result.stderr)
        assert not markers.exists(), (args, sorted(p.name for p in markers.iterdir()))


@pytest.mark.parametrize(("lightning", "world_size"), RESUMES, indirect=["lightning"])
def test_lightning_resumes_from_the_resharded_checkpoint(lightning: HarnessFixture, world_size: int,
                                                         tmp_path: Path) -> None:
    out = tmp_path / "last-ws.ckpt"
    result = run_cli("reshard", str(lightning.dir), str(out), "--world-size", str(world_size))
    assert result.returncode == 0, result.stdout + result.stderr
    optim = [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(world_size)]
    model = ([f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world_size)]
             if lightning.spec["stage"] == 3 else ["mp_rank_00_model_states.pt"])
    assert sorted(p.name for p in (out / "checkpoint").iterdir()) == sorted([*model, *optim])
    markers = tmp_path / "markers"
    state, reports = resume("lightning_resume", lightning, out, world_size, tmp_path / "resume",
                            env={MARKER_ENV: str(markers)})
    assert unequal_tensors(lightning, state) == []
    source = held(lightning)
    for rank, report in enumerate(reports):
        client = {key: value for key, value in report["client_state"].items() if key not in DEEPSPEED_MODEL_KEYS}
        assert differences(client, source["client_state"]) == [], rank
        assert (report["global_step"], report["epoch"]) == (source["global_step"], source["epoch"]) == (3, 1)
        assert differences(report["scheduler"], source["scheduler"]) == [], rank
        assert differences(report["callback"], source["callback"]) == [], rank
    assert sorted(p.name for p in markers.iterdir()) == sorted(MARKERS)  # the user's process rebuilt them
