"""Megatron-DeepSpeed's own code on ckptflow's reshards (issue 25, item 3), run on CPU ranks.

Megatron-DeepSpeed writes a checkpoint itself (``pretrain_gpt.py``'s model and arguments, three training
steps, ``megatron.checkpointing.save_checkpoint`` at tp 2 x dp 2, ZeRO-1), ckptflow reshards it, and
Megatron-DeepSpeed resumes from the reshard as ``pretrain_gpt.py`` does (``load_checkpoint``, called by
``setup_model_and_optimizer``: DeepSpeed's engine load, ``check_checkpoint_args`` against the run's
own arguments, ``padded_vocab_size`` among them, the iteration read, the RNG restore). See
``tests.oracles.megatron_deepspeed`` for the runs and what they set aside. The GPT-defaults source is the
checkpoint committed under ``tests/data`` (what the default run tests without a checkout:
``tests/test_megatron_deepspeed_data.py``); this run's own save of it is checked to write the same files, tensors
and shapes.

- dp 2 -> 1 at tp 2 (Megatron-DeepSpeed's GPT defaults, tied embeddings): resumes at iteration 3, and its
  model's logits on a fixed batch equal those of the model that saved the source.
- tp 2 -> 1 of the same GPT defaults (``--qkv-layout blocks``; its tied module holds the vocabulary-parallel
  word embedding and the learned position embeddings, replicated): resumes at iteration 3 with the source
  model's logits.
- tp 2 -> 1 (its Llama recipe: untied embeddings, SwiGLU): resumes at iteration 3 (the vocabulary 40
  rows -> 38, as Megatron pads it at tp 1); the source's own ``args`` fail Megatron's check at tp 1,
  on ``padded_vocab_size`` and then on ``tensor_model_parallel_size`` (the counter-check). Its logits are NOT the source model's: Megatron-DeepSpeed's attention holds
  each rank's ``query_key_value`` rows as [q | k | v] of the rank's heads, and neither its
  ``universal_checkpoint_info`` nor anything else in the checkpoint says so, so the merge puts the
  ranks' blocks one after the other ([q0 k0 v0 q1 k1 v1], where tp 1 reads [q0 q1 k0 k1 v0 v1]), as
  ``ds_to_universal`` does on the same information (checked: the same tensor); the same layer files
  with each ``query_key_value`` reordered part by part give the source model's logits. So ckptflow
  refuses a tensor-parallel change of a checkpoint with a fused ``query_key_value``
  (``readers.pipeline.fused_qkv``); the tests lift that guard to show what it guards against.
- the same tp 2 -> 1 with the layout declared (``qkv_layout``, ``--qkv-layout``): "blocks", this
  Megatron-DeepSpeed's, resumes at iteration 3 with the source model's logits; "groups", the layout before
  December 2024, writes the same bytes as the guard lifted, and Megatron computes another model's logits
  (ckptflow takes the user's word); ``consolidate --qkv-layout blocks`` of the source writes exactly the
  tensors of the "blocks" reshard's layer files.
- pp 2 x tp 1 (``GPTModelPipe`` cut by its own ``type:transformer``) -> pp 1 x dp 2: resumes at iteration 3 with the
  source model's logits; that output cut again to pp 2 by ckptflow's default partition method for it
  (``type:transformer``, its layer list from the run's ``args``): each stage holds the parameters Megatron's own pp 2
  run gave it, and Megatron resumes at iteration 3 with the source model's logits (at pp 2 through DeepSpeed's
  pipeline forward). The stages' copies of the tied position embeddings, as Megatron's own save and resume at
  pp 2 hold them, are pinned beside ckptflow's.

Needs a Megatron-DeepSpeed checkout in ``CKPTFLOW_MEGATRON_DEEPSPEED`` (tested at microsoft/Megatron-DeepSpeed
f4157bea69f3df8c6cb66f2ebcda66ba03d1288e) and the long mode (``CKPTFLOW_LONG=1``): thirteen launches, two of
4 ranks and eleven of 2, about five minutes on two cores. Skipped otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from ckptflow.cli import app
from ckptflow.errors import UnsupportedCheckpointError
from ckptflow.formats.deepspeed.qkv import LAYOUTS
from ckptflow.reshard import megatron, reshard, shape
from tests.fixtures.launch import launch
from tests.oracles import megatron_deepspeed as oracle
from tests.sampling import long_mode
from tests.test_megatron_deepspeed_data import DATA
from tests.test_reshard import _universal

CHECKOUT = os.environ.get(oracle.MDS_ENV, "")
pytestmark = pytest.mark.skipif(
    not (long_mode() and CHECKOUT and (Path(CHECKOUT) / "pretrain_gpt.py").is_file()),
    reason=f"needs the long mode and a Megatron-DeepSpeed checkout in {oracle.MDS_ENV}",
)
TIMEOUT = 900.0


def _run(mode: str, ckpt: Path, world: int, tp: int, work: Path, recipe: str, tag: str, *counter: Path,
         module_only: bool = False, pp: int = 1) -> tuple[dict[str, Any], torch.Tensor]:
    launch(oracle.__file__, world, [mode, str(ckpt), str(tp), str(work), recipe, tag, *map(str, counter)],
           env={oracle.MDS_ENV: CHECKOUT, oracle.MODULE_ONLY_ENV: "1" if module_only else "0", oracle.PP_ENV: str(pp)},
           timeout=TIMEOUT, log_dir=work / f"logs-{tag}")
    return json.loads((work / f"{tag}.json").read_text()), torch.load(work / f"{tag}.logits.pt")


@pytest.fixture(scope="module")
def dp_change(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("mds-gpt")
    _run("save", work / "fresh", 4, 2, work, "gpt", "source")  # today's save: the committed layout (below)
    shutil.copytree(DATA / "ckpt", work / "src")  # the source: the committed files the default run tests
    source_logits = torch.load(DATA / "source.logits.pt")
    reshard(str(work / "src"), str(work / "dp1"), world_size=2, workers=2)
    loaded, logits = _run("load", work / "dp1", 2, 2, work, "gpt", "dp1")
    return {"work": work, "source": source_logits, "loaded": loaded, "logits": logits}


@pytest.fixture(scope="module")
def tp_change(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("mds-llama")
    _, source_logits = _run("save", work / "src", 4, 2, work, "llama", "source")
    with pytest.raises(UnsupportedCheckpointError) as refused:
        reshard(str(work / "src"), str(work / "tp1"), world_size=2, tp=1, workers=2)
    assert not (work / "tp1").exists()
    with pytest.MonkeyPatch.context() as patch:  # the guard lifted: the merge rank after rank, to see it load
        for module in (megatron, shape):  # the planner's and `--plan`'s
            patch.setattr(module, "fused_qkv", lambda index: None)
        reshard(str(work / "src"), str(work / "tp1"), world_size=2, tp=1, workers=2)
    counter = work / "src" / "global_step3" / "mp_rank_00_model_states.pt"
    loaded, logits = _run("load", work / "tp1", 2, 1, work, "llama", "tp1", counter)
    layouts = {}
    for layout in LAYOUTS:  # the user's word, which ckptflow cannot check: Megatron tells
        reshard(str(work / "src"), str(work / f"tp1-{layout}"), world_size=2, tp=1, workers=2, qkv_layout=layout)
        layouts[layout] = _run("load", work / f"tp1-{layout}", 2, 1, work, "llama", f"tp1-{layout}")
    return {"work": work, "source": source_logits, "loaded": loaded, "logits": logits, "refused": refused.value,
            "layouts": layouts}


def test_megatron_resumes_from_a_dp_change(dp_change: dict[str, Any]) -> None:
    assert dp_change["loaded"]["iteration"] == 3
    assert torch.allclose(dp_change["logits"], dp_change["source"], rtol=0, atol=1e-6)


def _tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor in a file written by Megatron-DeepSpeed (trusted: this run's or the committed one), by where
    it sits."""
    shapes: dict[str, tuple[int, ...]] = {}

    def walk(value: Any, at: str) -> None:
        if torch.is_tensor(value):
            shapes[at] = tuple(value.shape)
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{at}/{key}")
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                walk(item, f"{at}/{i}")

    walk(torch.load(path, map_location="cpu", weights_only=False), "")
    return shapes


def test_megatron_deepspeed_writes_the_committed_layout(dp_change: dict[str, Any],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Today's Megatron-DeepSpeed save, from the same command, writes the files of `tests/data`'s (what the
    default run tests and the resumes above start from): the same names, each with the same tensors and shapes."""
    monkeypatch.syspath_prepend(CHECKOUT)  # the model-states files pickle Megatron's own classes
    fresh, committed = dp_change["work"] / "fresh", DATA / "ckpt"
    names = sorted(str(p.relative_to(committed)) for p in committed.rglob("*") if p.is_file())
    assert sorted(str(p.relative_to(fresh)) for p in fresh.rglob("*") if p.is_file()) == names
    for name in names:
        if name.endswith(".pt"):
            assert _tensor_shapes(fresh / name) == _tensor_shapes(committed / name), name


@pytest.fixture(scope="module")
def gpt_tp_change(dp_change: dict[str, Any]) -> dict[str, Any]:
    """The GPT-defaults source at tp 1, as a user types it (`--world-size 2 --tp 1 --qkv-layout blocks`),
    and Megatron's resume from it."""
    work = dp_change["work"]
    done = CliRunner().invoke(app, ["reshard", str(work / "src"), str(work / "gpt-tp1"), "--world-size", "2",
                                    "--tp", "1", "--qkv-layout", "blocks"], env={"COLUMNS": "400", "NO_COLOR": "1"})
    assert done.exit_code == 0, done.output
    loaded, logits = _run("load", work / "gpt-tp1", 2, 1, work, "gpt", "gpt-tp1")
    return {"work": work, "loaded": loaded, "logits": logits}


def test_megatron_resumes_from_a_tp_change_of_its_tied_embeddings(dp_change: dict[str, Any],
                                                                   gpt_tp_change: dict[str, Any]) -> None:
    """Megatron's GPT defaults (a fused `query_key_value`, declared "blocks"; the embedding tied, its vocabulary-
    parallel word embedding and its learned position embeddings, replicated over tp, one tied module) at tp 2 ->
    1: Megatron resumes at iteration 3 (its engine load: the weights from the fp32 masters) and computes the
    source model's logits; the layer file holds the position embeddings each source rank held, whole."""
    assert gpt_tp_change["loaded"]["iteration"] == 3
    assert torch.allclose(gpt_tp_change["logits"], dp_change["source"], rtol=0, atol=1e-5)
    work, name = dp_change["work"], "layer_01-model_0{}-model_states.pt"
    positions = "position_embeddings.weight"
    ours = torch.load(work / "gpt-tp1" / "global_step3" / name.format(0))[positions]
    for t in range(2):
        assert torch.equal(torch.load(work / "src" / "global_step3" / name.format(t))[positions], ours)


def test_megatron_resumes_from_a_tp_change(tp_change: dict[str, Any]) -> None:
    assert tp_change["loaded"]["iteration"] == 3
    assert tp_change["logits"].shape == tp_change["source"].shape


def test_megatron_resumes_from_a_tp_change_in_the_blocks_layout(tp_change: dict[str, Any]) -> None:
    """Declared "blocks" (this Megatron-DeepSpeed's layout), the tp change joins each `query_key_value` part by
    part: Megatron resumes at iteration 3 (its engine load: the weights from the fp32 masters) and computes the
    source model's logits; the layer files hold what the part-by-part reorder of the rank-after-rank merge does."""
    loaded, logits = tp_change["layouts"]["blocks"]
    assert loaded["iteration"] == 3
    assert torch.allclose(logits, tp_change["source"], rtol=0, atol=1e-5)
    work = tp_change["work"]
    for layer in (2, 3):
        name = f"layer_0{layer}-model_00-model_states.pt"
        merged = torch.load(work / "tp1" / "global_step3" / name)["self_attention.query_key_value.weight"]
        ours = torch.load(work / "tp1-blocks" / "global_step3" / name)["self_attention.query_key_value.weight"]
        assert torch.equal(ours, merged.view(2, 3, -1, merged.shape[1]).transpose(0, 1).reshape(merged.shape))


def test_consolidate_in_the_blocks_layout_gives_the_tp1_reshards_tensors(tp_change: dict[str, Any],
                                                                         tmp_path: Path) -> None:
    """`ckptflow consolidate --qkv-layout blocks` of the same tp 2 source writes, for every tensor, exactly the
    tensor the tp 1 reshard in that layout holds in its layer files (from which Megatron computes the source
    model's logits, above): `query_key_value` joined part by part, not rank after rank as the guard lifted
    joins it; the vocabulary parameters without the padding rows Megatron adds at tp 1 (zeros in the reshard:
    the model keeps `original_vocab_size` rows). Without the option it refuses, naming it."""
    src, out = str(tp_change["work"] / "src"), tmp_path / "model"
    env = {"COLUMNS": "400", "NO_COLOR": "1"}
    refused = CliRunner().invoke(app, ["consolidate", src, str(out)], env=env)
    assert refused.exit_code != 0 and not out.exists()
    assert "query_key_value.weight is Megatron's fused attention projection" in refused.output
    assert "declare the layout the checkpoint's Megatron-DeepSpeed wrote with --qkv-layout" in refused.output
    done = CliRunner().invoke(app, ["consolidate", src, str(out), "--qkv-layout", "blocks"], env=env)
    assert done.exit_code == 0, done.output
    ours = load_file(out / "model.safetensors")
    resharded = {}
    for layer_file in sorted((tp_change["work"] / "tp1-blocks" / "global_step3").glob("layer_*-model_00-*.pt")):
        layer = int(layer_file.name.split("-")[0].removeprefix("layer_"))
        resharded.update({f"{layer}.{k}": v for k, v in torch.load(layer_file).items()})
    assert sorted(ours) == sorted(resharded)
    for name, tensor in ours.items():
        theirs = resharded[name]
        if tensor.shape != theirs.shape:  # the vocabulary (embedding, head), padded at tp 1
            assert tensor.shape[1:] == theirs.shape[1:] and not theirs[tensor.shape[0]:].any(), name
            theirs = theirs[:tensor.shape[0]]
        assert torch.equal(tensor, theirs), name
    lifted = tp_change["work"] / "tp1" / "global_step3"
    for layer in (2, 3):
        name = "self_attention.query_key_value.weight"
        joined = torch.load(lifted / f"layer_0{layer}-model_00-model_states.pt")[name]
        assert not torch.equal(ours[f"{layer}.{name}"], joined)


def test_the_groups_layout_declared_of_a_blocks_checkpoint_loads_another_model(tp_change: dict[str, Any]) -> None:
    """Declared "groups" (the layout before December 2024), the same checkpoint is joined rank after rank, as
    with the guard lifted: byte for byte the same files, and Megatron computes other logits. ckptflow takes
    the user's word for the layout."""
    loaded, logits = tp_change["layouts"]["groups"]
    assert loaded["iteration"] == 3
    assert not torch.allclose(logits, tp_change["source"], rtol=0, atol=1e-2)
    assert torch.equal(logits, tp_change["logits"])
    work = tp_change["work"]
    lifted = {p.relative_to(work / "tp1"): p.read_bytes() for p in (work / "tp1").rglob("*") if p.is_file()}
    groups = {p.relative_to(work / "tp1-groups"): p.read_bytes() for p in (work / "tp1-groups").rglob("*")
              if p.is_file()}
    assert groups == lifted


def test_the_command_line_names_the_option(tp_change: dict[str, Any], tmp_path: Path) -> None:
    """`ckptflow reshard` refuses the tp change naming `--qkv-layout`; `--plan` with it offers tp 1."""
    src = str(tp_change["work"] / "src")
    refused = CliRunner().invoke(app, ["reshard", src, str(tmp_path / "out"), "--world-size", "2", "--tp", "1"],
                                 env={"COLUMNS": "400", "NO_COLOR": "1"})
    assert refused.exit_code != 0 and not (tmp_path / "out").exists()
    assert "declare the layout the checkpoint's Megatron-DeepSpeed wrote with --qkv-layout" in refused.output
    for layout, offered in ((None, False), ("blocks", True)):
        more = ["--qkv-layout", layout] if layout else []
        plan = CliRunner().invoke(app, ["reshard", src, "--world-size", "2", "--plan", *more],
                                  env={"COLUMNS": "400", "NO_COLOR": "1"})
        assert plan.exit_code == 0, plan.output
        row = next(line for line in plan.output.splitlines() if line.strip().startswith("ZeRO-1 dp2 (2 ranks)"))
        assert ("writes it" in row) is offered, row


def test_the_source_args_fail_megatrons_check_at_the_target_tp(tp_change: dict[str, Any]) -> None:
    """Both fields ckptflow rewrites are checked by Megatron: the source's padded vocabulary (40 rows, tp 2's)
    fails first, then its tensor-parallel size; with both the target's, the rest of its `args` pass."""
    assert tp_change["loaded"]["counter"] == [
        "padded_vocab_size value from checkpoint (40) is not equal to the input argument value (38).",
        "tensor_model_parallel_size value from checkpoint (2) is not equal to the input argument value (1).",
        None,
    ]


def test_a_tp_change_of_a_fused_attention_is_refused(tp_change: dict[str, Any]) -> None:
    """What the guard prevents: merged rank after rank, Megatron loads the model and computes other logits."""
    assert "2.self_attention.query_key_value.weight is Megatron's fused attention projection" in str(
        tp_change["refused"])
    assert not torch.allclose(tp_change["logits"], tp_change["source"], rtol=0, atol=1e-2)


def _qkv_by_part(layer_file: Path, ranks: int) -> None:
    """Reorder a merged `query_key_value` from [q0 k0 v0 q1 k1 v1] (rank after rank) to [q0 q1 k0 k1 v0 v1]."""
    state = torch.load(layer_file)
    weight = state["self_attention.query_key_value.weight"]
    state["self_attention.query_key_value.weight"] = (
        weight.view(ranks, 3, -1, weight.shape[1]).transpose(0, 1).reshape(weight.shape).clone())
    torch.save(state, layer_file)


def test_the_logits_differ_by_the_qkv_layout_alone(tp_change: dict[str, Any]) -> None:
    """The expected failure above is the attention layout and nothing else: the same layer files with each
    `query_key_value` reordered part by part give the source model's logits (Megatron's --finetune load:
    the layer files' weights only, no optimizer state), as ckptflow's own give another model's."""
    work = tp_change["work"]
    _, ours = _run("load", work / "tp1", 2, 1, work, "llama", "tp1-module", module_only=True)
    fixed = work / "tp1-by-part"
    shutil.copytree(work / "tp1", fixed)
    for layer_file in sorted((fixed / "global_step3").glob("layer_0[23]-model_00-model_states.pt")):
        _qkv_by_part(layer_file, ranks=2)
    _, reordered = _run("load", fixed, 2, 1, work, "llama", "tp1-by-part", module_only=True)
    assert not torch.allclose(ours, tp_change["source"], rtol=0, atol=1e-2)
    assert torch.allclose(reordered, tp_change["source"], rtol=0, atol=1e-5)


def test_ds_to_universal_merges_query_key_value_as_ckptflow_does(tp_change: dict[str, Any],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSpeed's own converter, from the same `universal_checkpoint_info`, gives the same merged tensor."""
    monkeypatch.syspath_prepend(CHECKOUT)  # the model-states files pickle Megatron's own classes
    work = tp_change["work"]
    converted = _universal(work / "src", {}, work) / "zero"
    for layer in (2, 3):
        universal = torch.load(converted / f"{layer}.self_attention.query_key_value.weight" / "fp32.pt")
        ours = torch.load(work / "tp1" / "global_step3" / f"layer_0{layer}-model_00-model_states.pt")
        assert torch.equal(universal["param"], ours["self_attention.query_key_value.weight"])


@pytest.fixture(scope="module")
def pp_change(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Megatron-DeepSpeed's GPT defaults saved at pp 2 x tp 1 x dp 1 (`GPTModelPipe` cut by its own
    `type:transformer`), merged to pp 1 x dp 2 and resumed there; that output cut again to pp 2 x dp 1 as a user
    types it (`--world-size 2 --pp 2`: the default partition method, the run's own) and resumed at pp 2."""
    work = tmp_path_factory.mktemp("mds-gpt-pp")
    env = {"COLUMNS": "400", "NO_COLOR": "1"}
    _, source_logits = _run("save", work / "src", 2, 1, work, "gpt", "source", pp=2)
    native = _run("load", work / "src", 2, 1, work, "gpt", "native", pp=2)  # Megatron's own resume, the control
    reshard(str(work / "src"), str(work / "pp1"), world_size=2, pp=1, workers=2)
    merged = _run("load", work / "pp1", 2, 1, work, "gpt", "pp1")
    plan = CliRunner().invoke(app, ["reshard", str(work / "pp1"), "--world-size", "2", "--plan"], env=env)
    done = CliRunner().invoke(app, ["reshard", str(work / "pp1"), str(work / "pp2"), "--world-size", "2", "--pp", "2"],
                              env=env)
    assert done.exit_code == 0, done.output
    cut = _run("load", work / "pp2", 2, 1, work, "gpt", "pp2", pp=2)
    return {"work": work, "source": source_logits, "native": native, "merged": merged, "cut": cut,
            "plan": plan.output}


def _tied(work: Path, tag: str, rank: int) -> dict[str, torch.Tensor]:
    return torch.load(work / f"{tag}.tied.{rank}.pt")


def _master(folder: Path, stage: int, name: str) -> torch.Tensor:
    """Stage `stage`'s fp32 master of `name` in a dp 1 ZeRO-1 save: its group's one flat partition, laid out in
    `param_shapes` order."""
    step = folder / "global_step3"
    shapes = torch.load(step / f"mp_rank_{stage:02d}_model_states.pt", weights_only=False)["param_shapes"]
    optim = torch.load(step / f"zero_pp_rank_0_mp_rank_{stage:02d}_optim_states.pt", weights_only=False)
    flats = optim["optimizer_state_dict"]["single_partition_of_fp32_groups"]
    for group, flat in zip(shapes, flats):
        offset = 0
        for param, size in group.items():
            if param == name:
                return flat[offset:offset + size.numel()].view(size).detach()
            offset += size.numel()
    raise KeyError(name)


def test_megatron_resumes_from_merged_stages(pp_change: dict[str, Any]) -> None:
    """pp 2 -> pp 1 x dp 2: Megatron resumes at iteration 3 with the source model's logits."""
    loaded, logits = pp_change["merged"]
    assert loaded["iteration"] == 3
    assert torch.allclose(logits, pp_change["source"], rtol=0, atol=1e-6)


def test_megatron_resumes_from_stages_cut_by_its_own_partition_method(pp_change: dict[str, Any],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """pp 1 -> pp 2 by the default partition method (`type:transformer`, from the transformer layers and the run's
    `args`): each stage holds the parameters Megatron-DeepSpeed's own pp 2 run gave it, and Megatron resumes at
    iteration 3 with the source model's logits."""
    loaded, logits = pp_change["cut"]
    assert loaded["iteration"] == 3
    assert torch.allclose(logits, pp_change["source"], rtol=0, atol=1e-6)
    work = pp_change["work"]
    monkeypatch.syspath_prepend(CHECKOUT)  # the model-states files pickle Megatron's own classes
    for stage in range(2):
        name = f"global_step3/mp_rank_{stage:02d}_model_states.pt"
        theirs = torch.load(work / "src" / name, weights_only=False)["param_shapes"]
        ours = torch.load(work / "pp2" / name, weights_only=False)["param_shapes"]
        assert [list(group) for group in ours] == [list(group) for group in theirs], stage


def test_the_plan_offers_two_stages(pp_change: dict[str, Any]) -> None:
    plan = pp_change["plan"]
    row = next(line for line in plan.splitlines() if line.strip().startswith("ZeRO-1 pp2 x dp1 (2 ranks)"))
    assert "writes it" in row, plan


def test_the_stages_copies_of_the_tied_position_embeddings(pp_change: dict[str, Any],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """What a real GPT at pp 2 does to its tied module's copies: the word embeddings stay equal over the tie; the
    last stage's learned position embeddings, which its head never reads, differ from stage 0's (DeepSpeed
    synchronises `word_embeddings_weight` alone over the tie). Merged, the model takes stage 0's; cut again, both
    stages' masters hold that copy, where Megatron's own save kept the last stage's other one (gone at pp 1). At
    load the last stage's module holds neither master (it has no layer file of its own: the tied module's is
    layer 1's), and the same value after ckptflow's reshard as after Megatron's own save; the logits equal. The
    word embedding's padding row, trained by no token, is written as zeros, as DeepSpeed's universal route pads a
    vocabulary."""
    work = pp_change["work"]
    words, positions = "tied_modules.embed.word_embeddings.weight", "tied_modules.embed.position_embeddings.weight"
    first, last = _tied(work, "source", 0), _tied(work, "source", 1)
    assert torch.equal(first[words], last[words])
    assert not torch.equal(first[positions], last[positions])
    for tag, rank in (("pp1", 0), ("pp1", 1), ("pp2", 0), ("pp2", 1)):
        ours = _tied(work, tag, rank)
        if (tag, rank) != ("pp2", 1):  # the last stage's module copy: below
            assert torch.equal(ours[positions], first[positions]), (tag, rank)
        assert torch.equal(ours[words][:oracle.VOCAB], first[words][:oracle.VOCAB]), (tag, rank)
        assert first[words][oracle.VOCAB:].any() and not ours[words][oracle.VOCAB:].any(), (tag, rank)
    native, logits = pp_change["native"]
    assert native["iteration"] == 3 and torch.allclose(logits, pp_change["source"], rtol=0, atol=1e-6)
    assert torch.equal(_tied(work, "native", 1)[positions], _tied(work, "pp2", 1)[positions])
    assert not torch.equal(_tied(work, "native", 1)[positions], last[positions])
    monkeypatch.syspath_prepend(CHECKOUT)  # the model-states files pickle Megatron's own classes
    assert torch.equal(_master(work / "src", 1, positions), last[positions])
    assert torch.equal(_master(work / "src", 0, positions), first[positions])
    for stage in range(2):
        assert torch.equal(_master(work / "pp2", stage, positions), first[positions]), stage
