"""Every checkpoint layout DeepSpeed writes is recognised and named: the right diagnosis first.

Each real parallel fixture (AutoTP, AutoEP, deepspeed.moe, PipelineModule, Megatron-style; written by
DeepSpeed on CPU, `tests/fixtures/specs/parallel.py`) is detected as its own layout with its degrees,
and `ckptflow validate` says so in one line: never "damaged", "missing" or "another model". Layouts
without a reader yet, and Megatron-style checkpoints that do not record how their parameters are
split, are refused with what to do instead; every other one reads with no problem.
"""

from __future__ import annotations

import pytest

from ckptflow.formats.deepspeed import READERS, inspect
from ckptflow.formats.deepspeed.inspection import Inspection, read_head
from ckptflow.formats.deepspeed.topology import detect
from tests.fixtures.specs.parallel import PARALLEL_MATRIX

KINDS = {"autotp": "autotp", "autoep": "autoep", "dsmoe": "moe", "pipe": "pipeline", "megatron": "megatron"}
# Read by a reader, and still refused: nothing records how the parameters are split over tensor ranks.
REFUSED = {"megatron-pp2tp2-z1-fp32-no-ucinfo"}


@pytest.mark.parametrize("name", [s.name for s in PARALLEL_MATRIX])
def test_every_layout_is_detected_with_its_degrees(parallel_fixtures, name: str) -> None:
    fixture = parallel_fixtures[name]
    spec = fixture.parallel_spec
    st = Inspection(str(fixture.root / "ckpt"), fixture.spec["tag"])
    listing, model0 = read_head(st)
    layout = detect(listing.names, model0)
    assert layout.kind == KINDS[spec.layout]
    assert (layout.tp, layout.pp) == (spec.tp, spec.pp)
    if spec.layout == "autoep" or (spec.layout == "dsmoe" and spec.stage == 0):
        assert layout.ep == spec.ep
    if spec.stage in (0, 3):
        assert layout.stage == spec.stage
    assert layout.dp == fixture.spec["dp"]


@pytest.mark.parametrize("name", [s.name for s in PARALLEL_MATRIX])
def test_validate_names_the_layout_never_damage(parallel_fixtures, name: str) -> None:
    fixture = parallel_fixtures[name]
    index, problems, _ = inspect(str(fixture.root / "ckpt"))
    if KINDS[fixture.parallel_spec.layout] in READERS and name not in REFUSED:
        assert problems == [] and index is not None
        assert index.summary()["layout"].startswith(("AutoTP", "PipelineModule", "AutoEP", "deepspeed.moe"))
        spec = fixture.parallel_spec
        if spec.layout in ("autoep", "dsmoe"):  # the expert-parallel degree from the metadata, at every stage
            assert index.summary()["expert_parallel"] == spec.ep
            assert f"(expert-parallel; ep {spec.ep} x dp {spec.world_size}, ZeRO-{spec.stage})" in index.layout
        return
    assert [p.code for p in problems] == ["unsupported-layout"]
    message = problems[0].message
    assert "is a checkpoint in the " in message and ("ds_to_universal" in message
                                                     or "universal_checkpoint_info" in message)
    for wrong in ("damaged", "missing", "another model", "corrupt"):
        assert wrong not in message


@pytest.mark.parametrize("name", ["zero-dp2-z0-fp32", "zero-llama-tied-dp2-z0-fp32", "pipe-pp2-z0-fp32"])
def test_zero0_is_detected_and_read(parallel_extra_fixtures, name: str) -> None:
    fixture = parallel_extra_fixtures[name]
    st = Inspection(str(fixture.root / "ckpt"), fixture.spec["tag"])
    listing, model0 = read_head(st)
    layout = detect(listing.names, model0)
    assert (layout.kind, layout.stage, layout.pp) == ("zero" if name.startswith("zero") else "pipeline", 0,
                                                       fixture.spec["pp"])
    index, problems, _ = inspect(str(fixture.root / "ckpt"))
    assert problems == [] and index is not None and index.summary()["stage"] == 0
