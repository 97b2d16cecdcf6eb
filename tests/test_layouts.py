"""Every checkpoint layout DeepSpeed writes is recognised and named: the right diagnosis first.

Each real parallel fixture (AutoTP, AutoEP, deepspeed.moe, PipelineModule, Megatron-style; written by
DeepSpeed on CPU, `tests/fixtures/parallel_matrix.py`) is detected as its own layout with its degrees,
and `ckptflow validate` says so in one line: never "damaged", "missing" or "another model". Layouts
without a reader yet are refused with what to do instead.
"""

from __future__ import annotations

import pytest

from ckptflow.formats.deepspeed.checkpoint import READERS, inspect
from ckptflow.formats.deepspeed.detect import detect
from ckptflow.formats.deepspeed.index import Inspection, read_head
from tests.fixtures.parallel_matrix import PARALLEL_MATRIX

KINDS = {"autotp": "autotp", "autoep": "autoep", "dsmoe": "moe", "pipe": "pipeline", "megatron": "megatron"}


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
    if KINDS[fixture.parallel_spec.layout] in READERS:
        assert problems == [] and index is not None
        spec = fixture.parallel_spec
        if spec.layout in ("autoep", "dsmoe"):  # the expert-parallel degree from the metadata, at every stage
            assert index.summary()["expert_parallel"] == spec.ep
            assert f"(expert-parallel; ep {spec.ep} x dp {spec.world_size}, ZeRO-{spec.stage})" in index.layout
        return
    assert [p.code for p in problems] == ["unsupported-layout"]
    message = problems[0].message
    assert "is a checkpoint in the " in message and ("ds_to_universal" in message or "universal_checkpoint_info" in message)
    for wrong in ("damaged", "missing", "another model", "corrupt"):
        assert wrong not in message
