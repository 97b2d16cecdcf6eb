"""`consolidate --config`: a model folder that loads when the checkpoint has no config.json (issue 25, item 4).

`engine.save_checkpoint`, Accelerate and Lightning write no config.json; these tests take the fixtures'
checkpoints without it (a copy with the side files left out) and give the model's config from a folder
or from a Hub repo at a revision (the local Hub of `tests/servers/hub.py`). Oracles that are not
ckptflow: the live engine's weights (`expected.safetensors`), `from_pretrained` with nothing missing,
unexpected or mismatched, and the logits the fixture writer recorded (or DeepSpeed's own
reconstruction run through transformers). A config that does not fit is refused in one line naming the
file and the first tensor, with nothing written; without a config anywhere the last line says so.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ckptflow.consolidate import (
    ConfigSource,
    ConsolidateOptions,
    ConsolidateStep,
    check_config,
    consolidate,
    plan_consolidation,
)
from ckptflow.errors import ConfigError
from ckptflow.formats import hf
from ckptflow.formats.deepspeed import load_index
from tests.fixtures import Fixture
from tests.fixtures.sets import ParallelFixture
from tests.fixtures.specs.extra import EXTRA_MATRIX, UNLOADABLE
from tests.fixtures.specs.parallel import PARALLEL_MATRIX
from tests.servers.hub import HubServer
from tests.test_consolidate import deepspeed_state_dict
from tests.test_model_parallel import check_oracle, output_dtype, rounded

HF_NAMES = [s.name for s in (*PARALLEL_MATRIX, *EXTRA_MATRIX) if s.is_hf and s.name not in UNLOADABLE]


def without_side_files(src: Path, dest: Path, keep: Sequence[str] = ()) -> Path:
    """A copy of the checkpoint folder `src` as `save_checkpoint` leaves it: no config, generation config or
    tokenizer file (except `keep`)."""
    def ignore(folder: str, names: list[str]) -> list[str]:
        return [n for n in names if n in hf.SIDE_FILES and n not in keep] if folder == str(src) else []

    shutil.copytree(src, dest, ignore=ignore)
    return dest


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def nothing_left(tmp_path: Path, out: Path) -> bool:
    return not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(f".{out.name}")]


def load_and_run(out: Path, input_ids: torch.Tensor) -> torch.Tensor:
    """`from_pretrained` on `out` with nothing missing, unexpected or mismatched; the logits of `input_ids`."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert {key: value for key, value in info.items() if value} == {}
    with torch.no_grad():
        return model.eval()(input_ids=input_ids).logits


# ---- every Hugging Face fixture, its config given from a folder -----------------------------------------


@pytest.mark.parametrize("name", HF_NAMES)
def test_every_hf_checkpoint_without_config_loads_with_the_config_given(
    name: str, tmp_path: Path, parallel_fixtures: Mapping[str, ParallelFixture],
    parallel_extra_fixtures: Mapping[str, ParallelFixture],
) -> None:
    """AutoTP, AutoEP and data-parallel checkpoints of Llama, tied Llama, GLM, Qwen3-MoE and Mixtral, saved
    without config.json: with --config (the reference folder, which also holds a model.safetensors that
    must not be taken) the folder holds the live engine's weights and the reference config, loads with
    `from_pretrained`, and gives the writer's logits."""
    fixture = {**parallel_fixtures, **parallel_extra_fixtures}[name]
    src = without_side_files(fixture.dir, tmp_path / "run")
    dtype = output_dtype(fixture)
    out = tmp_path / "out"
    result = consolidate(str(src), str(out), options=ConsolidateOptions(dtype=dtype, workers=2,
                                                                        config=str(fixture.reference_dir)))
    assert result.has_config and result.side_files == (hf.CONFIG_NAME,)
    reference_config = (fixture.reference_dir / hf.CONFIG_NAME).read_bytes()
    assert result.side is not None and result.side.architecture == json.loads(reference_config)["architectures"][0]
    assert sorted(files_of(out)) == sorted([hf.SAFE_WEIGHTS_NAME, hf.CONFIG_NAME, hf.PROVENANCE_NAME])
    assert (out / hf.CONFIG_NAME).read_bytes() == hf.rewrite_config(reference_config, hf.OUTPUT_DTYPES[dtype])
    tensors = load_file(out / hf.SAFE_WEIGHTS_NAME)
    check_oracle(fixture, tensors, dtype)
    logits = load_file(fixture.logits_path)
    got = load_and_run(out, logits["input_ids"])
    if dtype == "fp32":
        if fixture.layout == "autoep":  # expert routing sums in another order than the writer's model did
            torch.testing.assert_close(got, logits["logits"], rtol=0, atol=1e-6)
        else:
            assert torch.equal(got, logits["logits"])
    else:  # the reference model, its weights rounded as the training dtype rounds the masters
        from transformers import AutoModelForCausalLM

        reference = AutoModelForCausalLM.from_pretrained(fixture.reference_dir, dtype=torch.float32)
        reference.load_state_dict(rounded(reference.state_dict(), dtype))
        with torch.no_grad():
            assert torch.equal(got, reference.eval()(input_ids=logits["input_ids"]).logits)
    record = json.loads((out / hf.PROVENANCE_NAME).read_text())["config"]
    assert record["source"] == str(fixture.reference_dir) and record["unused"] == []
    assert list(record["files"]) == [hf.CONFIG_NAME] and record["commit"] is None


@pytest.mark.parametrize("name", ["llama-z3-bf16-ws2", "llama-trainer"])
def test_data_parallel_llama_without_config_loads_with_the_config_given(
    name: str, ds_fixtures: Mapping[str, Fixture], llama_trainer_ckpt: Fixture, tmp_path: Path
) -> None:
    """The tiny Llama of `deepspeed.initialize` and of the Trainer, saved with its tokenizer but without
    config.json and generation_config.json: --config gives those two (SRC's tokenizer stays), and the
    logits are those of DeepSpeed's own reconstruction loaded into the model."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    fixture = llama_trainer_ckpt if name == "llama-trainer" else ds_fixtures[name]
    tokenizer_files = [n for n in hf.find_side_files(str(fixture.dir)) if hf.side_kind(n) == "tokenizer"]
    src = without_side_files(fixture.dir, tmp_path / "run", keep=tokenizer_files)
    result = consolidate(str(src), str(tmp_path / "out"), options=ConsolidateOptions(config=str(fixture.dir)))
    assert result.side is not None and result.side.own == tuple(tokenizer_files)
    assert sorted(result.side.given) == [hf.CONFIG_NAME, "generation_config.json"]
    assert set(result.side.unused) == set(tokenizer_files)  # the source has them too: SRC's are kept
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    ids = tokenizer("the quick brown fox jumps over the lazy dog", return_tensors="pt").input_ids
    reference = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(fixture.dir), dtype=torch.float32)
    reference.load_state_dict(deepspeed_state_dict(fixture.dir), strict=True)
    with torch.no_grad():
        assert torch.equal(load_and_run(tmp_path / "out", ids), reference.eval()(ids).logits)


# ---- from the Hub ------------------------------------------------------------------------------------


def test_config_from_a_hub_repo_at_a_revision(hub: HubServer, parallel_fixtures: Mapping[str, ParallelFixture],
                                              tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`org/name` with a revision: the files of that revision, read at one commit (recorded), not the default
    branch's (which holds a config of another size here); only side files are fetched."""
    fixture = parallel_fixtures["autotp-llama-tied-tp2-z1-fp32"]
    config = (fixture.dir / hf.CONFIG_NAME).read_bytes()
    wrong = json.dumps({**json.loads(config), "hidden_size": 128}).encode()
    hub.seed("org/tiny-llama", {hf.CONFIG_NAME: wrong, "README.md": b"# tiny\n"})
    hub.seed("org/tiny-llama", {hf.CONFIG_NAME: config, "generation_config.json": b'{"bos_token_id": 1}\n',
                                "model.safetensors": (fixture.reference_dir / "model.safetensors").read_bytes()},
             revision="trained")
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    src = without_side_files(fixture.dir, tmp_path / "run")
    out = tmp_path / "out"

    result = consolidate(str(src), str(out), options=ConsolidateOptions(config="org/tiny-llama",
                                                                        config_revision="trained"))

    assert result.side_files == (hf.CONFIG_NAME, "generation_config.json")
    commit = hub.repos[("model", "org/tiny-llama")].branches["trained"]
    assert result.side is not None and result.side.source is not None and result.side.source.commit == commit
    assert not [p for p in hub.requests("GET", "/resolve/") if p.endswith((".safetensors", "README.md"))]
    assert all(f"/{commit}/" in p for p in hub.requests("GET", "/resolve/"))
    record = json.loads((out / hf.PROVENANCE_NAME).read_text())["config"]
    assert (record["source"], record["revision"], record["commit"]) == ("hf://org/tiny-llama", "trained", commit)
    logits = load_file(fixture.logits_path)
    assert torch.equal(load_and_run(out, logits["input_ids"]), logits["logits"])

    # The default branch holds a config of another width: refused, nothing written.
    with pytest.raises(ConfigError) as caught:
        consolidate(str(src), str(tmp_path / "main"), options=ConsolidateOptions(config="hf://org/tiny-llama"))
    assert str(caught.value) == (
        "config.json of hf://org/tiny-llama does not fit the checkpoint: LlamaForCausalLM built from it has "
        "model.embed_tokens.weight of shape (37, 128), the checkpoint holds (37, 64); give the config of the model "
        "that was trained (its architecture and sizes)")
    assert nothing_left(tmp_path, tmp_path / "main")

    for source, revision, message in (
        ("org/tiny-llama", "v9", "org/tiny-llama has no revision 'v9' on the Hub; give a branch, tag or commit the "
                                 "repo has"),
        ("org/nothing", None, "no folder org/nothing here, and no model repo org/nothing on the Hub (or it is private "
                              "and the token cannot read it); check the repo id; for a private repo set HF_TOKEN or "
                              "run `hf auth login`"),
    ):
        with pytest.raises(ConfigError) as caught:
            consolidate(str(src), str(tmp_path / "x"), options=ConsolidateOptions(config=source,
                                                                                  config_revision=revision))
        assert str(caught.value) == message and caught.value.code == "config-not-found"
        assert nothing_left(tmp_path, tmp_path / "x")


# ---- refusals, in one line, with nothing written ---------------------------------------------------------


@pytest.fixture
def tied_llama(parallel_fixtures: Mapping[str, ParallelFixture], tmp_path: Path) -> tuple[Path, dict]:
    """The tied tiny Llama (AutoTP, ZeRO-1) without its config, and that config as a dict."""
    fixture = parallel_fixtures["autotp-llama-tied-tp2-z1-fp32"]
    return (without_side_files(fixture.dir, tmp_path / "run"),
            json.loads((fixture.dir / hf.CONFIG_NAME).read_text()))


def refused(tmp_path: Path, src: Path, config: Mapping | bytes) -> ConfigError:
    folder = tmp_path / "config"
    folder.mkdir(exist_ok=True)
    (folder / hf.CONFIG_NAME).write_bytes(config if isinstance(config, bytes) else json.dumps(config).encode())
    with pytest.raises(ConfigError) as caught:
        consolidate(str(src), str(tmp_path / "out"), options=ConsolidateOptions(config=str(folder)))
    assert nothing_left(tmp_path, tmp_path / "out")
    return caught.value


WHERE = "config.json of {folder} does not fit the checkpoint: LlamaForCausalLM built from it"
HINT = "; give the config of the model that was trained (its architecture and sizes)"


@pytest.mark.parametrize("change, message, tensor", [
    ({"vocab_size": 40}, "has model.embed_tokens.weight of shape (40, 64), the checkpoint holds (37, 64)",
     "model.embed_tokens.weight"),
    ({"intermediate_size": 128}, "has model.layers.0.mlp.gate_proj.weight of shape (128, 64), the checkpoint holds "
                                 "(96, 64)", "model.layers.0.mlp.gate_proj.weight"),
    ({"num_hidden_layers": 1}, "has no model.layers.1.self_attn.q_proj.weight, which the checkpoint holds (shape "
                               "(64, 64))", "model.layers.1.self_attn.q_proj.weight"),
    ({"num_hidden_layers": 3}, "has model.layers.2.self_attn.q_proj.weight of shape (64, 64), which the checkpoint "
                               "does not hold", "model.layers.2.self_attn.q_proj.weight"),
    ({"tie_word_embeddings": False}, "has lm_head.weight apart from model.embed_tokens.weight, the checkpoint holds "
                                     "one tensor for both (tied): the model would miss its values", "lm_head.weight"),
])
def test_a_config_that_does_not_fit_is_refused_naming_the_first_tensor(
    tied_llama: tuple[Path, dict], tmp_path: Path, change: dict, message: str, tensor: str
) -> None:
    src, config = tied_llama
    error = refused(tmp_path, src, {**config, **change})
    assert str(error) == WHERE.format(folder=tmp_path / "config") + " " + message + HINT
    assert (error.code, error.tensor) == ("config-mismatch", tensor)


def test_an_untied_checkpoint_is_refused_with_a_config_that_ties(
    parallel_fixtures: Mapping[str, ParallelFixture], tmp_path: Path
) -> None:
    """Two trained tensors would load as one (transformers ties lm_head to the embedding): refused."""
    fixture = parallel_fixtures["autotp-tp2-z1-fp32"]
    src = without_side_files(fixture.dir, tmp_path / "run")
    config = {**json.loads((fixture.dir / hf.CONFIG_NAME).read_text()), "tie_word_embeddings": True}
    error = refused(tmp_path, src, config)
    assert str(error) == WHERE.format(folder=tmp_path / "config") + (
        " ties lm_head.weight to model.embed_tokens.weight (one tensor), the checkpoint holds two different tensors "
        "lm_head.weight and model.embed_tokens.weight: loading would keep one of them") + HINT


@pytest.mark.parametrize("config, message", [
    (b"{not json", "is not valid JSON"),
    (b"[1, 2]", "does not hold a JSON object"),
    ({"vocab_size": 37}, "has no model_type, so transformers cannot tell which model it describes (from_pretrained "
                         "fails with 'Should have a `model_type` key')"),
    ({"model_type": "my-own-llama", "auto_map": {"AutoConfig": "configuration_mine.MyConfig"}},
     "names model_type 'my-own-llama', which transformers {version} does not have built in; upgrade transformers, "
     "or give the config of a model transformers has built in (ckptflow never runs a repo's own code)"),
    ({"model_type": "llama", "architectures": ["os.system"]}, "names the architecture 'os.system', which is not a "
                                                               "model class of transformers {version}"),
    ({"model_type": "llama", "architectures": ["LlamaConfig"]}, "names the architecture 'LlamaConfig', which is "
                                                                 "not a model class of transformers {version}"),
    ({"model_type": "llama", "quantization_config": {"quant_method": "gptq"}},
     "has a quantization_config: from_pretrained would take the weights for quantized ones, and consolidated weights "
     "are not; remove quantization_config from the config"),
])
def test_configs_transformers_cannot_build_are_refused(tied_llama: tuple[Path, dict], tmp_path: Path,
                                                       config: Mapping | bytes, message: str) -> None:
    import transformers

    src, _ = tied_llama
    error = refused(tmp_path, src, config)
    assert str(error).startswith(f"config.json of {tmp_path / 'config'} " +
                                 message.format(version=transformers.__version__))


def test_a_source_without_a_config_or_that_does_not_exist_is_refused(tied_llama: tuple[Path, dict],
                                                                    tmp_path: Path) -> None:
    src, _ = tied_llama
    tokenizer_only = tmp_path / "tok"
    tokenizer_only.mkdir()
    (tokenizer_only / "tokenizer.json").write_text("{}")
    for source, message in (
        (tokenizer_only, f"{tokenizer_only} has no config.json (it holds tokenizer.json), and the checkpoint has none "
                         "either; give the config of the model that was trained: a folder holding its config.json, "
                         "or its Hub repo"),
        (tmp_path / "empty", f"{tmp_path / 'empty'} holds no config.json, generation config or tokenizer file; give "
                             "the config of the model that was trained: a folder holding its config.json, or its "
                             "Hub repo"),
        (tmp_path / "absent", f"there is no folder {tmp_path / 'absent'}; give the config of the model that was "
                              "trained: a folder holding its config.json, or its Hub repo"),
    ):
        (tmp_path / "empty").mkdir(exist_ok=True)
        with pytest.raises(ConfigError) as caught:
            consolidate(str(src), str(tmp_path / "out"), options=ConsolidateOptions(config=str(source)))
        assert str(caught.value) == message and caught.value.code == "config-not-found"
        assert nothing_left(tmp_path, tmp_path / "out")


def test_a_config_file_path_is_taken_alone(tied_llama: tuple[Path, dict], parallel_fixtures, tmp_path: Path) -> None:
    src, _ = tied_llama
    config = parallel_fixtures["autotp-llama-tied-tp2-z1-fp32"].dir / hf.CONFIG_NAME
    result = consolidate(str(src), str(tmp_path / "out"), options=ConsolidateOptions(config=str(config)))
    assert result.side_files == (hf.CONFIG_NAME,)


# ---- precedence, sources, options --------------------------------------------------------------------


def test_src_keeps_its_own_config_and_the_source_fills_the_kinds_it_lacks(
    llama_trainer_ckpt: Fixture, tmp_path: Path
) -> None:
    """The Trainer checkpoint has config.json and generation_config.json, and no tokenizer in this copy:
    its own config stays (the source's, of another size, is neither checked nor taken), the tokenizer
    comes whole from the source."""
    src = without_side_files(llama_trainer_ckpt.dir, tmp_path / "run", keep=[hf.CONFIG_NAME, "generation_config.json"])
    source = tmp_path / "base"
    source.mkdir()
    (source / hf.CONFIG_NAME).write_text(json.dumps({"model_type": "llama", "hidden_size": 4096}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(llama_trainer_ckpt.dir / name, source / name)
    result = consolidate(str(src), str(tmp_path / "out"), options=ConsolidateOptions(config=str(source)))
    side = result.side
    assert side is not None and side.own == (hf.CONFIG_NAME, "generation_config.json")
    assert sorted(side.given) == ["tokenizer.json", "tokenizer_config.json"] and side.unused == (hf.CONFIG_NAME,)
    assert side.architecture is None
    out = files_of(tmp_path / "out")
    assert out[hf.CONFIG_NAME] == hf.rewrite_config((src / hf.CONFIG_NAME).read_bytes(), "float32")
    assert out["tokenizer.json"] == (source / "tokenizer.json").read_bytes()
    assert json.loads(out[hf.PROVENANCE_NAME])["config"]["unused"] == [hf.CONFIG_NAME]


def test_config_source_parsing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert ConfigSource.parse("org/name") == ConfigSource(hub=False, location="org/name", text="org/name")
    assert ConfigSource.parse("meta-llama/Llama-3.2-1B", "main").hub
    assert ConfigSource.parse("hf://org/name@v1").revision == "v1"
    assert ConfigSource.parse("hf://org/name", "v2").shown == "hf://org/name@v2"
    assert ConfigSource.parse("gs://bucket/models/base") == ConfigSource(hub=False, location="gs://bucket/models/base",
                                                                         text="gs://bucket/models/base")
    with pytest.raises(ConfigError, match=r"^two revisions given for the config: 'v1' in hf://org/name@v1 and 'v2'"):
        ConfigSource.parse("hf://org/name@v1", "v2")
    with pytest.raises(ConfigError, match=r"revision \(v1\) was given for the config folder org/name; revisions are "
                                          r"for Hub repos"):
        ConfigSource.parse("org/name", "v1")
    with pytest.raises(ConfigError, match=r"^hf://datasets/org/data is not a Hub model repo"):
        ConfigSource.parse("hf://datasets/org/data")
    assert ConsolidateOptions(config="  ", config_revision="").config is None
    with pytest.raises(ValueError, match=r"config_revision \(v1\) needs a config"):
        ConsolidateOptions(config_revision="v1")


def test_an_earlier_output_is_taken_only_with_the_same_config(tied_llama: tuple[Path, dict], tmp_path: Path) -> None:
    src, config = tied_llama
    for name, body in (("a", config), ("b", {**config, "rms_norm_eps": 1e-5})):
        (tmp_path / name).mkdir()
        (tmp_path / name / hf.CONFIG_NAME).write_text(json.dumps(body))
    out = tmp_path / "out"
    consolidate(str(src), str(out), options=ConsolidateOptions(config=str(tmp_path / "a")))
    plan = plan_consolidation(load_index(str(src)), ConsolidateOptions(config=str(tmp_path / "a")))
    assert ConsolidateStep(plan, str(out)).committed() is not None
    other = plan_consolidation(load_index(str(src)), ConsolidateOptions(config=str(tmp_path / "b")))
    with pytest.raises(Exception, match="its config and tokenizer files came from another config source"):
        ConsolidateStep(other, str(out)).committed()
    bare = plan_consolidation(load_index(str(src)), ConsolidateOptions())
    with pytest.raises(Exception, match="came from another config source"):
        ConsolidateStep(bare, str(out)).committed()


# ---- the check alone, with plain names and shapes ----------------------------------------------------------


MIXTRAL = {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "vocab_size": 37, "hidden_size": 16,
           "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
           "head_dim": 8, "num_local_experts": 2, "num_experts_per_tok": 1, "tie_word_embeddings": False}


def mixtral_tensors(per_expert: bool, prefix: str = "") -> list[tuple[str, tuple[int, ...]]]:
    layer = "model.layers.0."
    experts = ([(f"{layer}block_sparse_moe.experts.{e}.{w}.weight", (8, 16) if w != "w2" else (16, 8))
                for e in range(2) for w in ("w1", "w2", "w3")] if per_expert else
               [(f"{layer}mlp.experts.gate_up_proj", (2, 16, 16)), (f"{layer}mlp.experts.down_proj", (2, 16, 8))])
    names = [("model.embed_tokens.weight", (37, 16)), (f"{layer}self_attn.q_proj.weight", (16, 16)),
             (f"{layer}self_attn.k_proj.weight", (8, 16)), (f"{layer}self_attn.v_proj.weight", (8, 16)),
             (f"{layer}self_attn.o_proj.weight", (16, 16)),
             (f"{layer}{'block_sparse_moe' if per_expert else 'mlp'}.gate.weight", (2, 16)), *experts,
             (f"{layer}input_layernorm.weight", (16,)), (f"{layer}post_attention_layernorm.weight", (16,)),
             ("model.norm.weight", (16,)), ("lm_head.weight", (37, 16))]
    return [(prefix + n, s) for n, s in names]


def test_the_check_pairs_names_as_from_pretrained_does() -> None:
    """Fused experts (transformers 5's own names), legacy per-expert names (fused by transformers on load) and
    a Lightning module's `model.` prefix (stripped on load) all fit; another prefix does not."""
    raw = json.dumps(MIXTRAL).encode()
    assert check_config(raw, mixtral_tensors(per_expert=False)) == "MixtralForCausalLM"
    assert check_config(raw, mixtral_tensors(per_expert=True)) == "MixtralForCausalLM"
    assert check_config(raw, mixtral_tensors(per_expert=False, prefix="model.")) == "MixtralForCausalLM"
    with pytest.raises(ConfigError, match=r"MixtralForCausalLM built from it has no net.model.embed_tokens.weight, "
                                          r"which the checkpoint holds \(shape \(37, 16\)\)"):
        check_config(raw, mixtral_tensors(per_expert=False, prefix="net."))
    without_architectures = json.dumps({k: v for k, v in MIXTRAL.items() if k != "architectures"}).encode()
    assert check_config(without_architectures, mixtral_tensors(per_expert=False)) == "MixtralForCausalLM"
    with pytest.raises(ConfigError, match=r"^config.json does not fit the checkpoint: its num_hidden_layers is "
                                          r"1,000,000, and the checkpoint holds 12 tensors in all; give the config"):
        check_config(json.dumps({**MIXTRAL, "num_hidden_layers": 10**6}).encode(), mixtral_tensors(per_expert=False))
    frozen = [t for t in mixtral_tensors(per_expert=False) if t[0] != "model.norm.weight"]
    with pytest.raises(ConfigError, match=r"has model.norm.weight of shape \(16,\), which the checkpoint does not "
                                          r"hold \(it is left out as a frozen parameter\)"):
        check_config(raw, frozen, excluded=["model.norm.weight"])


def test_consolidating_without_config_never_imports_transformers(tied_llama: tuple[Path, dict], tmp_path: Path) -> None:
    src, _ = tied_llama
    script = ("import sys\nfrom ckptflow.consolidate import consolidate\n"
              f"consolidate({str(src)!r}, {str(tmp_path / 'out')!r})\n"
              "print(sorted(m for m in ('transformers', 'torch') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


# ---- the command line ---------------------------------------------------------------------------------


def test_cli_config_and_the_last_line_without_one(tied_llama: tuple[Path, dict], parallel_fixtures,
                                                  tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from ckptflow.cli import app

    src, config = tied_llama
    runner = CliRunner()
    bare = runner.invoke(app, ["consolidate", str(src), str(tmp_path / "bare")])
    assert bare.exit_code == 0, bare.output
    assert bare.output.strip().splitlines()[-1] == (
        f"not loadable: {tmp_path / 'bare'} has no config.json, so from_pretrained cannot load it (SRC has none); "
        "consolidate again into a new OUT with --config FOLDER or --config ORG/NAME (the trained model's config)")

    fixture = parallel_fixtures["autotp-llama-tied-tp2-z1-fp32"]
    given = runner.invoke(app, ["consolidate", str(src), str(tmp_path / "given"), "--config", str(fixture.dir)])
    assert given.exit_code == 0, given.output
    lines = given.output.strip().splitlines()
    assert lines[-1] == (f"  config: config.json, generation_config.json from {fixture.dir}, checked against "
                         "LlamaForCausalLM")
    assert "not loadable" not in given.output

    own = runner.invoke(app, ["consolidate", str(fixture.dir), str(tmp_path / "own"), "--config", str(fixture.dir)])
    assert own.exit_code == 0, own.output
    assert own.output.strip().splitlines()[-1] == (
        "  note: SRC has its own config and generation config files, so --config's config.json, "
        "generation_config.json were not used")

    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / hf.CONFIG_NAME).write_text(json.dumps({**config, "vocab_size": 40}))
    bad = runner.invoke(app, ["consolidate", str(src), str(tmp_path / "refused"), "--config", str(tmp_path / "bad")])
    assert bad.exit_code == 1 and "Traceback" not in bad.output
    assert " ".join(bad.output.split()) == (
        f"error: --config: config.json of {tmp_path / 'bad'} does not fit the checkpoint: LlamaForCausalLM built from "
        "it has model.embed_tokens.weight of shape (40, 64), the checkpoint holds (37, 64); give the config of the "
        "model that was trained (its architecture and sizes)")
    assert nothing_left(tmp_path, tmp_path / "refused")

    usage = runner.invoke(app, ["consolidate", str(src), str(tmp_path / "x"), "--config-revision", "v1"])
    assert usage.exit_code == 2 and "needs --config" in usage.output


# ---- the Prefect form and task (no server: the schema, the parameters, the task's committed path) ---------


def test_the_lifecycle_form_has_the_config_source() -> None:
    from prefect.utilities.callables import parameter_schema
    from pydantic import ValidationError

    from flows import paths
    from flows.commands import lifecycle_parameters
    from flows.lifecycle import checkpoint_lifecycle
    from flows.params import ConsolidationForm
    from tasks.caching import _identity

    fields = parameter_schema(checkpoint_lifecycle).model_dump()["definitions"]["ConsolidationForm"]["properties"]
    assert {k: (fields[k]["type"], fields[k]["default"], fields[k]["title"]) for k in ("config", "config_revision")} \
        == {"config": ("string", "", "Config source"), "config_revision": ("string", "", "Config revision")}
    assert "Hugging Face Hub model repo ('org/name')" in fields["config"]["description"]
    assert ConsolidationForm(config=None, config_revision=" ").config == ""
    with pytest.raises(ValidationError, match="config_revision 'v1' needs a config source"):
        ConsolidationForm(config_revision="v1")
    params = lifecycle_parameters("gs://b/run", tag=None, dtype="bf16", consolidate=True, max_shard_size="5GB",
                                  reshard=None, destinations=[], publish="model", verify=True, settle=0,
                                  workspace=None, gpu_deployment=None, refresh=False, config="org/base",
                                  config_revision="v1")
    assert (params["consolidation"].config, params["consolidation"].config_revision) == ("org/base", "v1")
    assert (params["consolidation"].layout, params["reshard"].qkv_layout) == (None, "unknown")
    declared = lifecycle_parameters("gs://b/run", tag=None, dtype="bf16", consolidate=True, max_shard_size="5GB",
                                    reshard="2", destinations=[], publish="model", verify=True, settle=0,
                                    workspace=None, gpu_deployment=None, refresh=False, qkv_layout="blocks")
    assert (declared["consolidation"].layout, declared["reshard"].qkv_layout) == ("blocks", "blocks")  # `run --qkv-layout`
    # Without a config source, the folder and the cached results' keys are those of before the field existed.
    assert "config" not in _identity(ConsolidationForm()) and "config_revision" not in _identity(
        ConsolidationForm())
    plain = paths.model_folder("/w", ConsolidationForm())
    assert plain == "/w/model-fp32-" + paths.hashlib.sha256(
        json.dumps({"max_shard_size": "5GB", "exclude_frozen": False}, sort_keys=True).encode()).hexdigest()[:6]
    assert paths.model_folder("/w", ConsolidationForm(config="org/base")) != plain
    # A declared query_key_value layout: a form field beside them, a folder of its own, the same keys without it.
    assert (fields["qkv_layout"]["default"], fields["qkv_layout"]["title"]) == ("unknown",
                                                                               "Megatron query_key_value layout")
    assert ConsolidationForm().layout is None and ConsolidationForm(qkv_layout="blocks").layout == "blocks"
    assert "qkv_layout" not in _identity(ConsolidationForm()) and "qkv_layout" in _identity(
        ConsolidationForm(qkv_layout="groups"))
    folders = {paths.model_folder("/w", ConsolidationForm(qkv_layout=layout)) for layout in ("blocks", "groups")}
    assert len(folders) == 2 and plain not in folders
    with pytest.raises(ValidationError, match="qkv_layout"):
        ConsolidationForm(qkv_layout="rows")


def test_the_consolidate_task_takes_a_config_source(tied_llama: tuple[Path, dict], parallel_fixtures,
                                                   tmp_path: Path) -> None:
    """The task's options reach the core: a folder committed with this config is taken as this model (its
    details say it holds a config.json, and from where), and one with none is reported as such."""
    from prefect.logging import disable_run_logger

    from tasks.consolidate import consolidate_model
    from tasks.validate import validate_checkpoint

    src, _ = tied_llama
    source = str(parallel_fixtures["autotp-llama-tied-tp2-z1-fp32"].reference_dir)
    consolidate(str(src), str(tmp_path / "given"), options=ConsolidateOptions(dtype="bf16", config=source))
    consolidate(str(src), str(tmp_path / "bare"), options=ConsolidateOptions(dtype="bf16"))
    with disable_run_logger():
        checkpoint = validate_checkpoint.fn(str(src), settle_seconds=0)
        given = consolidate_model.fn(checkpoint, str(tmp_path / "given"), dtype="bf16", config=source)
        bare = consolidate_model.fn(checkpoint, str(tmp_path / "bare"), dtype="bf16")
        with pytest.raises(Exception, match="came from another config source"):
            consolidate_model.fn(checkpoint, str(tmp_path / "bare"), dtype="bf16", config=source)
    assert given.details["config_json"] is True and given.details["config_source"] == source
    assert bare.details["config_json"] is False and "config_source" not in bare.details
