"""`--layer-types`: the names of a PipelineModule's layer list's entries, which no file records, declared
so that a "type:REGEX" partition method is computed as DeepSpeed computes it. Pure: the parsing, its bounds
and refusals (pinned by message), the layers a method matches against DeepSpeed's own
`PipelineModule._find_layer_type`, and the CLI's and the Prefect form's refusals. The planner over
DeepSpeed-written PipelineModule checkpoints: `tests/test_pipeline_reshard.py`.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from typer.testing import CliRunner

from ckptflow.errors import UnsupportedCheckpointError
from ckptflow.reshard.pipeline_layers import MAX_LAYERS, MAX_TYPES_TEXT, parse_layer_types, typed_layers
from ckptflow.reshard.plan import PLANNERS, Ask
from ckptflow.reshard.shape import Shape, Target

PIPE_TOY = "PipeEmbed,PipeBlock*3,LayerNorm,PipeEmbed"  # tests/fixtures/models/parallel.py's pipe_layer_specs()


def test_the_names_are_read_one_per_layer_with_repeats() -> None:
    assert parse_layer_types(PIPE_TOY) == ("PipeEmbed", "PipeBlock", "PipeBlock", "PipeBlock", "LayerNorm",
                                           "PipeEmbed")
    assert parse_layer_types(" Embed , <lambda> ,Block * 2,Head*1") == ("Embed", "<lambda>", "Block", "Block", "Head")
    assert parse_layer_types(f"Block*{MAX_LAYERS}") == ("Block",) * MAX_LAYERS


@pytest.mark.parametrize("text,message", [
    ("", "layer types entry 1 ('') is not NAME or NAME*N, NAME a class or function name (letters, digits, _; or "
         "<lambda>)"),
    ("Embed,,Head", "layer types entry 2 ('') is not NAME or NAME*N, NAME a class or function name (letters, "
                    "digits, _; or <lambda>)"),
    ("Embed,Block*", "layer types entry 2 ('Block*') is not NAME or NAME*N, NAME a class or function name "
                     "(letters, digits, _; or <lambda>)"),
    ("Embed,Block*x", "layer types entry 2 ('Block*x') is not NAME or NAME*N, NAME a class or function name "
                      "(letters, digits, _; or <lambda>)"),
    ("nn.LayerNorm", "layer types entry 1 ('nn.LayerNorm') is not NAME or NAME*N, NAME a class or function name "
                     "(letters, digits, _; or <lambda>)"),
    ("2Block", "layer types entry 1 ('2Block') is not NAME or NAME*N, NAME a class or function name (letters, "
               "digits, _; or <lambda>)"),
    ("Block*0", "layer types entry 1 ('Block*0') repeats a name less than once"),
    (f"Embed,Block*{MAX_LAYERS}", f"layer types entry 2 ('Block*{MAX_LAYERS}') repeats a name past {MAX_LAYERS} "
                                  "layers in all"),
    ("Block*1234567", "layer types entry 1 ('Block*1234567') is not NAME or NAME*N, NAME a class or function name "
                      "(letters, digits, _; or <lambda>)"),
    ("x" * (MAX_TYPES_TEXT + 1), f"the layer types are {MAX_TYPES_TEXT + 1} characters long, more than "
                                 f"{MAX_TYPES_TEXT}"),
])
def test_a_malformed_list_is_refused_in_one_line(text: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_layer_types(text)
    assert str(info.value) == message
    with pytest.raises(ValueError) as built:
        Target(world_size=4, pp=4, partition_method="type:Block", layer_types=text)
    assert str(built.value) == message


@pytest.mark.parametrize("regex", ["PipeBlock", "pipeblock", "block|norm", "^Pipe", "Embed$", "e", "^$", r"\w+Norm",
                                   "lambda", "<"])
def test_the_layers_a_method_matches_are_deepspeeds(regex: str) -> None:
    """`typed_layers` finds what `PipelineModule._find_layer_type` finds over the same layer list (LayerSpec,
    TiedLayerSpec, a module, a function, a lambda), the method lowered as `_partition_layers` lowers it."""
    from deepspeed.runtime.pipe.module import PipelineModule

    from tests.fixtures.models.parallel import PIPE_HIDDEN, pipe_layer_specs

    def loss_of(x: Any) -> Any:
        return x

    specs = [*pipe_layer_specs(), __import__("torch").nn.LayerNorm(PIPE_HIDDEN), loss_of, lambda x: x]
    names = parse_layer_types(f"{PIPE_TOY},LayerNorm,loss_of,<lambda>")
    method = f"type:{regex}"
    try:
        theirs = PipelineModule._find_layer_type(SimpleNamespace(_layer_specs=specs), method.lower().split(":")[1])
    except RuntimeError:  # DeepSpeed finds none
        theirs = []
    assert typed_layers(method, names) == frozenset(theirs)


def test_a_megatron_style_checkpoint_refuses_declared_layer_types() -> None:
    index = SimpleNamespace(kind="megatron", root="/ckpt", tag="global_step3")
    ask = Ask(Shape(world_size=2, stage=1, pp=2), Shape(world_size=4, stage=1, pp=4), layer_types="Embed,Block*3")
    with pytest.raises(UnsupportedCheckpointError, match=(
            r"^/ckpt/global_step3 is a Megatron-style checkpoint, whose transformer layers ckptflow knows by their "
            r"parameters; `layer_types` declares a plain PipelineModule's layer names; leave `layer_types` out$")):
        PLANNERS[("megatron", "pp")][1](index, ask)


def test_the_cli_refuses_a_malformed_list_before_reading(tmp_path: Any) -> None:
    from ckptflow.cli import app

    result = CliRunner().invoke(app, ["reshard", str(tmp_path / "src"), str(tmp_path / "out"), "--world-size", "4",
                                      "--pp", "4", "--partition-method", "type:Block", "--layer-types", "Embed,,Head"])
    assert result.exit_code == 2
    assert "--layer-types" in result.output and "layer types entry 2" in result.output
    assert not (tmp_path / "out").exists()


def test_the_form_takes_the_layer_types_and_names_the_folder_by_them() -> None:
    from flows import paths
    from flows.params import ReshardForm

    form = ReshardForm(world_sizes=[4], pipeline_parallel_degree=4, partition_method="type:PipeBlock",
                       layer_types=PIPE_TOY)
    [target] = form.targets()
    assert target == Target(world_size=4, pp=4, partition_method="type:PipeBlock", layer_types=PIPE_TOY)
    name = paths.reshard_name(target)
    assert name.startswith("zero-ws4-pp4-type-PipeBlock-types-") and len(name) == len("zero-ws4-pp4-type-PipeBlock-"
                                                                                       "types-") + 8
    other = Target(world_size=4, pp=4, partition_method="type:PipeBlock", layer_types="PipeEmbed,PipeBlock*4")
    assert paths.reshard_name(other) != name  # other names, other stages: never the same folder
    assert ReshardForm(world_sizes=[4], pipeline_parallel_degree=4).targets() == [Target(world_size=4, pp=4)]
    with pytest.raises(ValueError, match=r"layer types entry 1 \('Block\*0'\) repeats a name less than once"):
        ReshardForm(world_sizes=[4], pipeline_parallel_degree=4, layer_types="Block*0")
