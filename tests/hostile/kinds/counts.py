"""Absurd sizes and counts in the metadata: a world size of a billion, shapes of 10**18 elements,
integers too long to print, strings of ten million characters."""

from __future__ import annotations

from typing import Any

from tests.hostile.corpus import Workspace, kind
from tests.hostile.torchfile import resave

Z2 = "z2-fp32-ws2"
ABSURD_INTS = [10**9, 10**6, 2**62, 0, -1, -(10**9), 10**5000, -(10**5000)]
ODD_VALUES: list[Any] = ["2", 2.5, None, [2], float("nan")]


def _set(ws: Workspace, path: Any, key: str, value: Any) -> None:
    resave(path, lambda o: o.__setitem__(key, value))
    ws.pin(str(path))


@kind(expect=r"(?i)world size", issue="14.4", hangs=True)
def dp_world_size_billion(ws: Workspace) -> None:
    """Rank 0's model states record a data-parallel world size of 10**9 (2 rank files present)."""
    value = ws.param(10**9, lambda r: r.choice(ABSURD_INTS + ODD_VALUES))
    _set(ws, ws.model_file(0), "dp_world_size", value)


@kind(expect=r"(?i)world size|partitions", issue="14.4")
def partition_count_absurd(ws: Workspace) -> None:
    """Rank 0's optimizer records a partition count of 10**9."""
    value = ws.param(10**9, lambda r: r.choice(ABSURD_INTS + ODD_VALUES))

    def edit(o: dict) -> None:
        count = o["optimizer_state_dict"]["partition_count"]
        o["optimizer_state_dict"]["partition_count"] = [value for _ in count] if isinstance(count, list) else value

    resave(ws.optim_file(0), edit)
    ws.pin(str(ws.optim_file(0)))


def _reshape(ws: Workspace, shape: tuple[int, ...]) -> None:
    import torch

    def edit(o: dict) -> None:
        group = o["param_shapes"][0]
        name = ws.pick(next(iter(group)), list(group))
        group[name] = torch.Size(shape)

    for path in ({ws.model_file(r) for r in range(ws.world_size)} if ws.stage == 3 else {ws.model_file(0)}):
        resave(path, edit)
    ws.pin(str(ws.model_file(0)) if ws.stage != 3 else "")


@kind(source=Z2, expect=r"(?i)partition|elements|shape", issue="14.4", hangs=True)
def param_shape_huge_zero2(ws: Workspace) -> None:
    """ZeRO-2: a parameter recorded as (10**9, 10**9) elements, consistently in every file."""
    _reshape(ws, ws.param((10**9, 10**9), lambda r: r.choice([(10**9, 10**9), (2**62,), (10**18,), (1, 10**12)])))


@kind(expect=r"(?i)partition|elements|shape", issue="14.4")
def param_shape_huge_zero3(ws: Workspace) -> None:
    """ZeRO-3: a parameter recorded as (10**9, 10**9) elements in every rank's model states."""
    _reshape(ws, ws.param((10**9, 10**9), lambda r: r.choice([(10**9, 10**9), (2**62,), (10**18,)])))


@kind(expect=r"(?i)partition|elements|shape|negative", issue="14.4")
def param_shape_negative(ws: Workspace) -> None:
    """A parameter recorded with a negative dimension."""
    _reshape(ws, ws.param((-1, 11), lambda r: r.choice([(-1, 11), (-(10**9),), (0, -5)])))


@kind(source=Z2, expect=r"(?i)partition|padding|elements", issue="14.4")
def group_paddings_absurd(ws: Workspace) -> None:
    """ZeRO-2: rank 0 records a padding of 10**12 elements for its first param group."""
    value = ws.param(10**12, lambda r: r.choice(ABSURD_INTS))

    def edit(o: dict) -> None:
        o["optimizer_state_dict"]["group_paddings"][0] = value

    resave(ws.optim_file(0), edit)
    ws.pin(str(ws.optim_file(0)))


@kind(expect=r"(?i)stage", issue="14.4")
def zero_stage_absurd(ws: Workspace) -> None:
    """Rank 0's optimizer records ZeRO stage 10**9."""
    value = ws.param(10**9, lambda r: r.choice(ABSURD_INTS + ["3", None]))

    def edit(o: dict) -> None:
        o["optimizer_state_dict"]["zero_stage"] = value

    resave(ws.optim_file(0), edit)
    ws.pin(str(ws.optim_file(0)))


@kind(expect=r"(?i)global step", issue="14.4")
def global_steps_too_long_to_print(ws: Workspace) -> None:
    """Rank 1 records a global step of 10**5000 (Python refuses to print an int of 5,000 digits)."""
    _set(ws, ws.model_file(1), "global_steps", ws.param(10**5000, lambda r: r.choice(ABSURD_INTS + ODD_VALUES)))


@kind(expect=r"(?i)DeepSpeed version", issue="14.6")
def ds_version_ten_megabytes(ws: Workspace) -> None:
    """Rank 1 records a DeepSpeed version of ten million characters: echoed whole in the message."""
    _set(ws, ws.model_file(1), "ds_version", "9" * ws.param(10**7, lambda r: r.choice([10**4, 10**6, 10**7])))


@kind(expect=r"(?i)param groups|come from different saves|other parameter shapes|partition", issue="14.4")
def param_groups_many(ws: Workspace) -> None:
    """Rank 0's model states list 100,000 param groups (the optimizer has 2)."""
    count = ws.param(100_000, lambda r: r.choice([3, 1000, 100_000]))

    def edit(o: dict) -> None:
        o["param_shapes"] = [o["param_shapes"][0]] * count

    resave(ws.model_file(0), edit)
