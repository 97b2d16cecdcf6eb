"""The synthetic checkpoints of `benchmarks/scale_checkpoints.py` are checkpoints: torch and DeepSpeed read them,
ckptflow indexes and plans them, their key structure is that of a real DeepSpeed-written Llama, and
their storages are holes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from benchmarks import scale_checkpoints as scale
from benchmarks.scale import planning_api


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return scale.generate(scale.MODELS["tiny"], tmp_path_factory.mktemp("scale") / "tiny")


def test_torch_and_deepspeed_read_it(tiny: Path) -> None:
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    model = scale.MODELS["tiny"]
    optim = torch.load(tiny / scale.TAG / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", weights_only=False)
    flats = optim["optimizer_state_dict"]["fp32_flat_groups"]
    assert [f.numel() for f in flats] == [model.piece_numel(0), model.piece_numel(1)]
    assert flats[0].requires_grad and flats[0].ds_id == "0_20" and not flats[0].any()
    state = get_fp32_state_dict_from_zero_checkpoint(str(tiny))
    assert {k: tuple(v.shape) for k, v in state.items()} == dict(model.params())


def test_ckptflow_indexes_and_plans_it(tiny: Path) -> None:
    api = planning_api()
    index = api.load_index(str(tiny))
    model = scale.MODELS["tiny"]
    assert (index.stage, index.world_size, index.precision, index.numel) == (3, 4, "bf16", model.numel)
    plan = api.plan_consolidation(index, api.ConsolidateOptions(dtype="bf16"))
    assert plan.source_bytes == 4 * model.numel
    assert len(api.plan_reshard(index, 3).units) == 3


def test_same_key_structure_as_a_real_llama_checkpoint(tiny: Path, llama_bf16_ckpt) -> None:
    assert scale.check_structure(llama_bf16_ckpt.dir / llama_bf16_ckpt.tag, tiny / scale.TAG) == []


def test_storages_are_holes(tmp_path: Path) -> None:
    """A 4-rank checkpoint of a 70B-wide model: about 6.6 GB of logical size, a few MiB on disk."""
    wide = dataclasses.replace(scale.MODELS["70b"], name="wide", layers=1, world_size=4)
    usage = scale.disk_usage(scale.generate(wide, tmp_path / "wide"))
    assert usage["logical"] > 6e9
    assert usage["allocated"] < 8 << 20, usage
