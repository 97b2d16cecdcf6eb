"""Both sides of the harness oracles. In the tests: what a harness fixture held, a resume script run at
M ranks (``oracles.lightning_resume``, ``oracles.accelerate_resume``) and its reports read back, and the
consolidated folder's logits next to the trained module's. In the resume scripts: a job read, and a
rank's report and the engine's state written (``read_job``, ``write_report``)."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from tests.fixtures.launch import REPO_ROOT, launch
from tests.fixtures.sets import HarnessFixture
from tests.fixtures.specs.harness import LOGIT_IDS, HarnessSpec


def run_cli(*args: str, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``ckptflow ARGS`` in a fresh process (wide lines), with ``env`` added to the environment."""
    return subprocess.run([sys.executable, "-m", "ckptflow.cli", *args], capture_output=True, text=True,
                          cwd=REPO_ROOT, timeout=300, env={**os.environ, "COLUMNS": "400", **(env or {})})


def held(fixture: HarnessFixture) -> dict[str, Any]:
    """``harness.pkl``: what the harness held after training (the fixture writer's own pickle: trusted)."""
    return dict(pickle.loads(fixture.harness_path.read_bytes()))


def resume(script: str, fixture: HarnessFixture, ckpt: Path, world_size: int, out: Path,
           env: Mapping[str, str] | None = None) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """Run ``tests.oracles.<script>`` on ``world_size`` ranks against ``ckpt``: rank 0's engine state
    (``live_state``) and every rank's report."""
    jobs = out / "jobs.json"
    out.mkdir(parents=True, exist_ok=True)
    jobs.write_text(json.dumps([{"spec": str(fixture.root / "spec.json"), "ckpt": str(ckpt), "out": str(out)}]))
    launch(f"tests.oracles.{script}", world_size, ["--jobs", str(jobs)], timeout=600, log_dir=out / "logs", env=env)
    reports = [pickle.loads((out / f"rank{rank}.pkl").read_bytes()) for rank in range(world_size)]
    return load_file(out / "state.safetensors"), reports


def unequal_tensors(fixture: HarnessFixture, state: Mapping[str, torch.Tensor]) -> list[str]:
    """The fp32 weights and Adam moments of ``state`` that are not bit-equal to the source's live engine's."""
    expected = load_file(fixture.expected_path)
    if state.keys() != expected.keys():
        return sorted(state.keys() ^ expected.keys())
    return [key for key in expected if not torch.equal(state[key], expected[key])]


def consolidated_logits(out: Path) -> torch.Tensor:
    """``from_pretrained`` on ``out`` with nothing missing, unexpected or mismatched; the logits of ``LOGIT_IDS``."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert {key: value for key, value in info.items() if value} == {}
    with torch.no_grad():
        return model.eval()(input_ids=torch.tensor(LOGIT_IDS)).logits


def trained_logits(fixture: HarnessFixture) -> torch.Tensor:
    return load_file(fixture.logits_path)["logits"]


def read_job(job: Mapping[str, str]) -> tuple[HarnessSpec, Path]:
    """A resume job's fixture spec, and its output folder (made)."""
    out = Path(job["out"])
    out.mkdir(parents=True, exist_ok=True)
    return HarnessSpec.from_json(json.loads(Path(job["spec"]).read_text())), out


def write_report(out: Path, report: Mapping[str, Any], engine: Any) -> None:
    """This rank's ``rank{R}.pkl`` and, from rank 0, the engine's ``state.safetensors`` (a collective call)."""
    from deepspeed import comm as dist
    from safetensors.torch import save_file

    from tests.fixtures.writers.data_parallel import live_state

    rank = dist.get_rank()
    (out / f"rank{rank}.pkl").write_bytes(pickle.dumps(dict(report), protocol=2))
    state = live_state(engine)
    if rank == 0:
        save_file(state, str(out / "state.safetensors"))
    dist.barrier()
