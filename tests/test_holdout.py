"""Issue 11's "done when", for the tensor- and pipeline-parallel layouts: checkpoints that no test used
while the readers were written (``tests/fixtures/specs/extra.py``, ``HOLDOUT_MATRIX``: other seeds and
other combinations of degrees, stage and dtype) validate, consolidate and reshard, with every oracle of
``test_model_parallel.py`` and ``test_model_parallel_reshard.py`` agreeing bit for bit:

- ``validate --deep`` clean;
- consolidated weights (fp32, and bf16 as torch casts) equal the live engine's, buffers as saved;
  ``from_pretrained`` loads Hugging Face outputs with no missing or unexpected keys and gives the
  oracle logits exactly; pipelines give them through the reference forward;
- reshards to another data-parallel size (and AutoTP merged to tensor-parallel degree 1, and at another
  ZeRO stage) are loaded
  natively by DeepSpeed holding the source's state bit for bit, and DeepSpeed re-saves exactly
  ckptflow's files; ZeRO-0 is loaded natively by DeepSpeed at another size, and ckptflow says a reshard
  is not needed.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from ckptflow.errors import UnsupportedCheckpointError
from ckptflow.reshard import reshard
from tests.fixtures.sets import ParallelFixture
from tests.fixtures.specs.extra import HOLDOUT_MATRIX
from tests.sampling import sample
from tests.test_model_parallel import check_oracle, consolidated
from tests.test_model_parallel_reshard import (
    case_id,
    check_loaded_state,
    check_same_files,
    check_validates,
    run_reshard_oracle,
)

NAMES = [spec.name for spec in HOLDOUT_MATRIX]
ALL_RESHARDS = (
    ("holdout-autotp-tp2dp2-z2-bf16-s1", 1), ("holdout-autotp-tp2dp2-z2-bf16-s1", 2, 1),
    ("holdout-autotp-glm-tp2dp2-z3-fp32-s1", 1), ("holdout-autotp-glm-tp2dp2-z3-fp32-s1", 3, 1),
    ("holdout-pipe-pp2dp2-z1-bf16-s1", 1),
    ("holdout-megatron-pp2tp2-z1-fp32-ucinfo-s1", 2),
    # another ZeRO stage (fixture, dp, tp or None, stage), with the tensor parallelism merged too
    ("holdout-autotp-tp2dp2-z2-bf16-s1", 1, None, 3), ("holdout-autotp-glm-tp2dp2-z3-fp32-s1", 2, None, 1),
    ("holdout-autotp-tp2dp2-z2-bf16-s1", 3, 1, 3),
    ("holdout-autotp-glm-tp2dp2-z3-fp32-s1", 2, 1, 2),  # from ZeRO-3 with the degree: the module cast from masters
    # ZeRO-0 at ZeRO-2 and ZeRO-3 (issue 24): its optimizer state named
    ("holdout-zero-dp3-z0-fp32-s1", 2, None, 2), ("holdout-autotp-llama-tied-tp2dp2-z0-fp32-s1", 1, None, 3),
    # ... and merged to tp1 with it: each tensor-parallel rank's state named, a tied embedding
    ("holdout-autotp-llama-tied-tp2dp2-z0-fp32-s1", 3, 1, 1),
)
ALL_NATIVE = (("holdout-autotp-llama-tied-tp2dp2-z0-fp32-s1", 1), ("holdout-zero-dp3-z0-fp32-s1", 2))
# Sampled by default (`tests.sampling`): every held-out layout still validates and consolidates above;
# the DeepSpeed launches cover AutoTP ZeRO-2 and the ZeRO-0 load (the pipeline, the merges and the
# 3-rank launch in the long mode).
RESHARDS = sample(ALL_RESHARDS, [("holdout-autotp-tp2dp2-z2-bf16-s1", 1),
                                 ("holdout-autotp-tp2dp2-z2-bf16-s1", 1, None, 3),
                                 ("holdout-zero-dp3-z0-fp32-s1", 2, None, 2)])  # on the ZeRO-0 load's launch
NATIVE = sample(ALL_NATIVE, [("holdout-zero-dp3-z0-fp32-s1", 2)])


def test_every_holdout_is_resharded_or_loaded_natively() -> None:
    assert {case[0] for case in ALL_RESHARDS + ALL_NATIVE} == set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_validate_deep(name: str, holdout_fixtures: Mapping[str, ParallelFixture]) -> None:
    from ckptflow.validate import validate

    fixture = holdout_fixtures[name]
    report = validate(str(fixture.dir), deep=True)
    assert report.ok, [p.message for p in report.problems]
    summary = report.summary()
    assert (summary["world_size"], summary["stage"], summary["step"]) == (
        fixture.spec["dp"], fixture.spec["stage"], fixture.spec["global_steps"])
    assert (summary.get("tp", 1), summary.get("pp", 1)) == (fixture.spec["tp"], fixture.spec["pp"])


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("name", NAMES)
def test_consolidate(name: str, dtype: str, holdout_fixtures: Mapping[str, ParallelFixture], tmp_path: Path) -> None:
    fixture = holdout_fixtures[name]
    got = consolidated(fixture, tmp_path / "out", dtype)
    check_oracle(fixture, got, dtype)
    if dtype != "fp32":
        return
    logits = load_file(fixture.logits_path)
    if fixture.reference_dir is not None:
        from transformers import AutoModelForCausalLM

        model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32,
                                                           output_loading_info=True)
        assert {key: value for key, value in info.items() if value} == {}
        with torch.no_grad():
            again = model.eval()(input_ids=logits["input_ids"]).logits
    else:
        from tests.fixtures.models.parallel_extra import reference_logits

        again = reference_logits(fixture.name)(got, logits["input_ids"]).float()
    assert torch.equal(again, logits["logits"])


@pytest.fixture(scope="session")
def holdout_oracle(holdout_fixtures: Mapping[str, ParallelFixture],
                   tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_reshard_oracle(holdout_fixtures, RESHARDS, NATIVE, tmp_path_factory.mktemp("holdout-oracle"))


@pytest.mark.parametrize("case", RESHARDS + NATIVE, ids=case_id)
def test_deepspeed_loads_it_holding_the_source_state(holdout_oracle: dict[str, Any], case: tuple,
                                                     holdout_fixtures: Mapping[str, ParallelFixture]) -> None:
    check_loaded_state(holdout_oracle, case, holdout_fixtures[case[0]])


@pytest.mark.parametrize("case", RESHARDS, ids=case_id)
def test_deepspeed_writes_the_same_files(holdout_oracle: dict[str, Any], case: tuple) -> None:
    check_same_files(holdout_oracle, case)


@pytest.mark.parametrize("case", RESHARDS, ids=case_id)
def test_the_reshard_validates(holdout_oracle: dict[str, Any], case: tuple,
                               holdout_fixtures: Mapping[str, ParallelFixture]) -> None:
    check_validates(holdout_oracle, case, holdout_fixtures[case[0]])


@pytest.mark.parametrize("case", NATIVE, ids=case_id)
def test_zero0_needs_no_reshard(case: tuple, holdout_fixtures: Mapping[str, ParallelFixture], tmp_path: Path) -> None:
    with pytest.raises(UnsupportedCheckpointError) as info:
        reshard(str(holdout_fixtures[case[0]].dir), str(tmp_path / "out"), world_size=case[1])
    assert info.value.code == "reshard-not-needed"
