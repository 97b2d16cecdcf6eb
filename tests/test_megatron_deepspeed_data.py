"""A checkpoint Megatron-DeepSpeed wrote itself, committed under ``tests/data/megatron-deepspeed/gpt-tp2-dp2-z1``
(its ``PROVENANCE``: the Megatron-DeepSpeed commit, the versions, how to write it again, each file's sha256), so
that the default run reads real Megatron-DeepSpeed files without a checkout: ``pretrain_gpt.py``'s GPT defaults
(tied embeddings, learned positions, a fused ``query_key_value``), tp 2 x dp 2, ZeRO-1, fp32, iteration 3, its
``args`` (an ``argparse.Namespace`` naming Megatron's ``ModelType``) and ``universal_checkpoint_info``.

- the files are those the PROVENANCE lists, byte for byte (an edit is caught);
- ``validate`` and ``validate --deep`` pass and list the client state, ``args`` as an ``argparse.Namespace``;
- ``reshard --world-size 2`` (dp 2 -> 1 at tp 2): ``ds_to_universal`` of it equals that of the source in every
  fp32 weight, Adam moment and step, bit for bit;
- ``reshard --world-size 1 --tp 1 --qkv-layout blocks`` (tp 2 -> 1): ``ds_to_universal`` of it equals that of
  the source but for each ``query_key_value``, whose weight, bias and moments are the source's rows reordered
  from rank after rank ([q0 k0 v0 q1 k1 v1]) to part by part ([q0 q1 k0 k1 v0 v1]), as Megatron-DeepSpeed's
  layout reads at tp 1; ``consolidate --qkv-layout blocks`` writes the same weights;
- each reshard's ``args`` say the target's tp, dp, world size and padded vocabulary, the rest as the source's;
- the tp change without ``--qkv-layout`` is refused in one line, nothing written.

No launch. DeepSpeed's ``ds_to_universal`` unpickles the model-states files whole, Megatron's ``ModelType``
with them: the tests give it a stand-in enum of the same name and values (the oracle only; ckptflow never
imports it). Megatron-DeepSpeed's own resume from these reshards is checked in the long mode
(``tests/test_megatron_deepspeed.py``, with a checkout).
"""

from __future__ import annotations

import enum
import hashlib
import re
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from ckptflow.cli import app
from ckptflow.formats.deepspeed.names import ALLOWED
from ckptflow.formats.torch.inert import InertRecord
from ckptflow.formats.torch.tensorref import TensorRef
from ckptflow.formats.torch.zipdir import open_archive
from tests.oracles.tensors import read_tensor
from tests.test_harness_holdout import check_universal
from tests.test_reshard import _load_plain, _universal, _universal_tensor

DATA = Path(__file__).resolve().parent / "data" / "megatron-deepspeed" / "gpt-tp2-dp2-z1"
CKPT = DATA / "ckpt"
TAG = "global_step3"
QKV = re.compile(r"\d+\.self_attention\.query_key_value\.(weight|bias)/(fp32|exp_avg|exp_avg_sq)\.pt")
ENV = {"COLUMNS": "400", "NO_COLOR": "1"}
SIZES = ("tensor_model_parallel_size", "data_parallel_size", "world_size", "padded_vocab_size")


def ckptflow(*args: str) -> Any:
    return CliRunner().invoke(app, list(args), env=ENV)


@pytest.fixture(scope="module")
def megatron_enums() -> Iterator[None]:
    """``megatron.core.enums.ModelType`` (an ``enum.Enum`` in Megatron-DeepSpeed), for ``ds_to_universal``'s
    ``torch.load`` of the model-states files: a stand-in with Megatron's names and values."""
    enums = types.ModuleType("megatron.core.enums")
    model_type = enum.Enum("ModelType", {"encoder_or_decoder": 1, "encoder_and_decoder": 2, "retro_encoder": 3,
                                         "retro_decoder": 4}, module=enums.__name__)
    enums.ModelType = model_type  # type: ignore[attr-defined]
    with pytest.MonkeyPatch.context() as patch:
        for name in ("megatron", "megatron.core"):
            patch.setitem(sys.modules, name, types.ModuleType(name))
        patch.setitem(sys.modules, enums.__name__, enums)
        yield


@pytest.fixture(scope="module")
def resharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The dp change (``dp1``) and the tp change (``tp1``), as a user types them."""
    work = tmp_path_factory.mktemp("mds-data")
    for out, more in (("dp1", ["--world-size", "2"]), ("tp1", ["--world-size", "1", "--tp", "1", "--qkv-layout",
                                                                "blocks"])):
        done = ckptflow("reshard", str(CKPT), str(work / out), *more)
        assert done.exit_code == 0, done.output
    return work


def test_the_files_are_those_megatron_deepspeed_wrote() -> None:
    listed = dict(reversed(line.split("  ", 1)) for line in (DATA / "PROVENANCE").read_text().splitlines()
                  if re.fullmatch(r"[0-9a-f]{64}  \S+", line))
    held = sorted(str(p.relative_to(DATA)) for p in DATA.rglob("*") if p.is_file() and p.name != "PROVENANCE")
    assert sorted(listed) == held
    assert [name for name in held if hashlib.sha256((DATA / name).read_bytes()).hexdigest() != listed[name]] == []


@pytest.mark.parametrize("deep", [False, True], ids=["shapes", "deep"])
def test_validate_lists_megatrons_args(deep: bool) -> None:
    said = ckptflow("validate", str(CKPT), *(["--deep"] if deep else []))
    assert said.exit_code == 0, said.output
    lines = said.output.splitlines()
    assert lines[0].startswith(f"valid {CKPT}/{TAG}: PipelineModule (pipeline-parallel with Megatron-style tensor "
                               "parallelism; tp 2 x dp 2, ZeRO-1), fp32, step 3, 23 params (7,232 elements, "), lines[0]
    assert lines[-6:] == [
        "  client state: carried as it is; its classes are named here, never imported or run",
        "    args: an argparse.Namespace, naming megatron.core.enums.ModelType",
        "    checkpoint_version: a float",
        "    iteration: an int",
        "    tokens: an int",
        "    rng_state: a list of 1 item, naming numpy._core.multiarray._reconstruct, numpy.dtype, numpy.ndarray",
    ]


def test_a_dp_change_holds_the_sources_state_through_ds_to_universal(resharded: Path, megatron_enums: None,
                                                                     tmp_path: Path) -> None:
    check_universal(CKPT, resharded / "dp1", tmp_path)


def _by_part(value: Any, ranks: int) -> Any:
    """A universal file's tensor ``{"cat_dim": 0, "param": t}`` with ``t``'s rows reordered from rank after rank
    ([q0 k0 v0 q1 k1 v1]) to part by part ([q0 q1 k0 k1 v0 v1])."""
    rows = value["param"]
    return {**value, "param": rows.view(ranks, 3, -1, *rows.shape[1:]).transpose(0, 1).reshape(rows.shape)}


def test_a_tp_change_in_the_blocks_layout_through_ds_to_universal(resharded: Path, megatron_enums: None,
                                                                  tmp_path: Path) -> None:
    cache: dict[Path, Path] = {}
    ours, theirs = (_universal(folder, cache, tmp_path) / "zero" for folder in (CKPT, resharded / "tp1"))
    files = sorted(str(p.relative_to(ours)) for p in ours.rglob("*.pt") if p.name != "optimizer_state.pt")
    assert files and files == sorted(str(p.relative_to(theirs)) for p in theirs.rglob("*.pt")
                                     if p.name != "optimizer_state.pt")
    fused = [f for f in files if QKV.fullmatch(f)]
    assert len(fused) == 12  # 2 layers x weight, bias x fp32, exp_avg, exp_avg_sq
    assert [f for f in files if f not in fused and _universal_tensor(_load_plain(ours / f))
            != _universal_tensor(_load_plain(theirs / f))] == []
    for name in fused:
        source, target = (torch.load(folder / name, weights_only=False) for folder in (ours, theirs))
        assert not torch.equal(source["param"], target["param"]), name  # the reorder is no identity here
        assert torch.equal(_by_part(source, 2)["param"], target["param"]), name

    consolidated = tmp_path / "model"
    done = ckptflow("consolidate", str(CKPT), str(consolidated), "--qkv-layout", "blocks")
    assert done.exit_code == 0, done.output
    weights = load_file(consolidated / "model.safetensors")
    assert sorted(weights) == sorted({Path(f).parent.name for f in files})
    for name, tensor in weights.items():
        merged = torch.load(theirs / name / "fp32.pt", weights_only=False)["param"]
        assert torch.equal(tensor, merged.view(tensor.shape)), name


def _args(folder: Path, model_rank: int = 0) -> dict[str, Any]:
    """The ``args`` Namespace's fields, comparable: a tensor as its dtype, shape and values, a record (Megatron's
    ``ModelType``) as what rebuilds it."""
    def plain(value: Any) -> Any:
        if isinstance(value, TensorRef):
            return value.dtype, value.shape, read_tensor(value).tolist()
        if isinstance(value, InertRecord):
            return value.module, value.name, value.how, value.args, value.kwargs, value.ops
        return value

    record = open_archive(str(folder / TAG / f"mp_rank_{model_rank:02d}_model_states.pt"), ALLOWED).obj["args"]
    assert (record.module, record.name) == ("argparse", "Namespace")
    return {key: plain(value) for key, value in record.state.items()}


@pytest.mark.parametrize(("out", "sizes"), [("dp1", (2, 1, 2, 40)), ("tp1", (1, 1, 1, 38))])
def test_a_reshards_args_say_the_target(resharded: Path, out: str, sizes: tuple[int, ...]) -> None:
    for model_rank in range(sizes[0]):  # each model-parallel rank's file, against the source's of that rank
        source = _args(CKPT, model_rank)
        assert tuple(source[k] for k in SIZES) == (2, 2, 4, 40)
        args = _args(resharded / out, model_rank)
        assert tuple(args[k] for k in SIZES) == sizes
        assert {k for k in source if args.get(k) != source[k]} <= set(SIZES) and args.keys() == source.keys()


def test_a_tp_change_without_the_layout_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "out"
    refused = ckptflow("reshard", str(CKPT), str(out), "--world-size", "1", "--tp", "1")
    assert refused.exit_code == 1 and not out.exists()
    assert refused.output.strip().splitlines() == [
        f"error: cannot reshard {CKPT}/{TAG} (ZeRO-1 tp2 x dp2 (4 ranks)) to 1 rank, tp1: "
        "2.self_attention.query_key_value.weight is Megatron's fused attention projection, whose rows each "
        "tensor-parallel rank holds as [q | k | v] of its own heads in Megatron-DeepSpeed since December 2024 and "
        "key/value group by group before; the checkpoint does not record which, and joined or cut the wrong way "
        "the model loads and computes something else; declare the layout the checkpoint's Megatron-DeepSpeed "
        "wrote with --qkv-layout (blocks since December 2024, groups before); ckptflow can write no shape of it "
        "at 1 rank (it can at 2)"]
