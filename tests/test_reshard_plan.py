"""The reshard planner table: (layout kind, the axis that changes) picks the planner, narrowed to the
reader's own type at the table's edge; a pair without a planner is refused in one line. Pure."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from ckptflow.errors import UnsupportedCheckpointError
from ckptflow.formats.deepspeed.model import Degrees
from ckptflow.reshard.plan import AXES, PLANNERS, Ask, plan_shape
from ckptflow.reshard.shape import NAMES, Shape


@dataclass(frozen=True)
class _Index:
    """Just what `plan_shape` reads of an index before a planner runs: where it is, its kind and shape."""

    kind: str
    stage: int = 1
    dp: int = 2
    tp: int = 1
    root: str = "/runs/a"
    tag: str = "global_step3"

    @property
    def degrees(self) -> Degrees:
        return Degrees(self.dp, tp=self.tp)

    @property
    def layout(self) -> str:
        return f"{self.kind} layout"


@pytest.mark.parametrize(("target", "axis"), [
    (Shape(world_size=4, stage=1), "dp"),
    (Shape(world_size=2, stage=2), "stage"),
    (Shape(world_size=4, stage=3, tp=2), "tp"),
    (Shape(world_size=4, stage=3, tp=2, pp=2), "pp"),
    (Shape(world_size=4, stage=1, ep=2), "ep"),
    (Shape(world_size=4, stage=2, ep=2), "stage"),
])
def test_the_first_axis_that_changes_picks_the_planner(target: Shape, axis: str) -> None:
    assert Ask(Shape(world_size=2, stage=1), target).changed_axis == axis


def test_every_family_is_named_and_every_axis_is_known() -> None:
    assert {kind for kind, _ in PLANNERS} <= set(NAMES)
    assert {axis for _, axis in PLANNERS} <= {*AXES, "dp"}


def test_a_pair_without_a_planner_is_refused_in_one_line() -> None:
    with pytest.raises(UnsupportedCheckpointError) as refused:
        plan_shape(_Index("zero"), Shape(world_size=4, stage=1, tp=2))
    assert str(refused.value) == ("/runs/a/global_step3 is a checkpoint in the zero layout layout; ckptflow changes "
                                  "the tensor-parallel degree of AutoTP checkpoints only; reshard it to another "
                                  "data-parallel size without `tp`")
    assert refused.value.code == "unsupported-layout"
    with pytest.raises(UnsupportedCheckpointError, match=r"^/runs/a holds ZeRO-2 optimizer states saved one file per "
                                                         r"rank; .* not another stage or parallel degree; give `world_size` alone$"):
        plan_shape(_Index("optimizer-shards", stage=2), Shape(world_size=2, stage=1))
    with pytest.raises(UnsupportedCheckpointError, match=r"reshards data-parallel ZeRO checkpoints only so far; convert it "):
        plan_shape(_Index("zero0", stage=0), Shape(world_size=4, stage=0))


def test_an_index_of_another_type_than_its_kind_says_is_a_programming_error() -> None:
    with pytest.raises(TypeError, match="a zero index is a ZeroCheckpoint, not a _Index"):
        plan_shape(_Index("zero"), Shape(world_size=4, stage=1))
