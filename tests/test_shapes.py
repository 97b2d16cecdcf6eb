"""Shapes: what `--world-size N [--zero-stage S] [--tp T] [--pp P] [--ep E]` means for a checkpoint, the
shapes `reshard --plan` lists with their per-GPU bytes, and the one-line refusals. Pure, plus the CLI."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ckptflow.cli import app
from ckptflow.errors import UnsupportedCheckpointError
from ckptflow.formats.deepspeed import load_index
from ckptflow.formats.deepspeed.model import Degrees
from ckptflow.reshard import Shape, Target, memory, resolve, shapes_at, source_shape


def test_a_shape_in_words() -> None:
    assert str(Shape(world_size=4, stage=2, tp=2)) == "ZeRO-2 tp2 x dp2 (4 ranks)"
    assert str(Shape(world_size=8, stage=3, ep=4)) == "ZeRO-3 ep4 x edp2 (8 ranks)"
    assert str(Shape(world_size=1, stage=1)) == "ZeRO-1 dp1 (1 rank)"
    assert str(Shape(world_size=8, stage=1, tp=2, pp=2)) == "ZeRO-1 pp2 x tp2 x dp2 (8 ranks)"
    assert Shape(world_size=4, stage=3, tp=2).slug == "ws4-tp2-z3"


@pytest.mark.parametrize("fields,message", [
    ({"world_size": 0}, "the world size must be a whole number of ranks, at least 1; got 0"),
    ({"world_size": True}, "the world size must be a whole number of ranks, at least 1; got True"),
    ({"world_size": 2, "stage": 4}, "the ZeRO stage must be 1, 2 or 3; got 4"),
    ({"world_size": 2, "tp": 0}, "the tensor-parallel degree must be a positive whole number; got 0"),
    ({"world_size": 2, "ep": 1.5}, "the expert-parallel degree must be a positive whole number; got 1.5"),
    ({"world_size": 2, "pipeline_layers": 0}, "a layer list's length must be a positive whole number; got 0"),
])
def test_a_target_is_checked_when_built(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as info:
        Target(**fields)
    assert str(info.value) == message


@dataclass(frozen=True)
class _Tensor:
    numel: int
    kind: str = "param"


@dataclass(frozen=True)
class _Index:
    """Just what `memory` reads of an index: 1,000 trainable elements, Adam."""

    precision: str
    stage: int = 2
    tensors_per_partition: int = 2

    @property
    def degrees(self) -> Degrees:
        return Degrees(2)

    def model_tensors(self) -> tuple[_Tensor, ...]:
        return (_Tensor(600), _Tensor(400), _Tensor(10, "buffer"))


def test_per_gpu_bytes_follow_the_zero_formulas() -> None:
    bf16, fp32 = _Index("bf16"), _Index("fp32")
    # bf16: 2 bytes of weights and of gradients per parameter; 12 of optimizer (fp32 master + 2 moments).
    at = {stage: memory(bf16, Shape(world_size=4, stage=stage)) for stage in (1, 2, 3)}
    assert (at[1].weights, at[1].gradients, at[1].optimizer) == (2000, 2000, 3000)
    assert (at[2].weights, at[2].gradients, at[2].optimizer) == (2000, 500, 3000)
    assert (at[3].weights, at[3].gradients, at[3].optimizer) == (500, 500, 3000)
    assert at[3].total == 4000
    # fp32: the weights are the masters; 8 bytes of moments per parameter.
    z1 = memory(fp32, Shape(world_size=2, stage=1))
    assert (z1.weights, z1.gradients, z1.optimizer) == (4000, 4000, 4000)
    # tensor parallelism divides everything by tp before ZeRO divides by dp
    tp = memory(bf16, Shape(world_size=4, stage=3, tp=2))
    assert (tp.weights, tp.gradients, tp.optimizer) == (500, 500, 3000)


def test_the_shapes_of_a_data_parallel_checkpoint(ds_fixtures: Mapping[str, Any]) -> None:
    index = load_index(str(ds_fixtures["z2-fp32-ws2"].dir))
    assert str(source_shape(index)) == "ZeRO-2 dp2 (2 ranks)"
    listed = shapes_at(index, 4)
    assert [(str(s), reason) for s, reason in listed] == [
        ("ZeRO-2 dp4 (4 ranks)", None), ("ZeRO-1 dp4 (4 ranks)", None), ("ZeRO-3 dp4 (4 ranks)", None)]
    assert resolve(index, Target(world_size=3, stage=3)) == Shape(world_size=3, stage=3)
    with pytest.raises(UnsupportedCheckpointError) as info:
        resolve(index, Target(world_size=4, tp=2))
    assert ("a data-parallel ZeRO checkpoint records no tensor-parallel split (AutoTP writes its affine maps only "
            "when it trains tensor-parallel), so ckptflow cannot tell how AutoTP would split it at tp2") in str(info.value)


def test_a_bf16_optimizer_checkpoint_moves_to_every_stage(ds_fixtures: Mapping[str, Any]) -> None:
    """bf16 ZeRO-1 with fp32 gradient accumulation (BF16_Optimizer): the same config runs DeepSpeed's ZeRO
    optimizers at ZeRO-2 and 3, which ckptflow writes (issue 24)."""
    index = load_index(str(ds_fixtures["z1-bf16-ws2-fp32accum"].dir))
    assert [(str(s), reason) for s, reason in shapes_at(index, 2)] == [
        ("ZeRO-1 dp2 (2 ranks)", None), ("ZeRO-2 dp2 (2 ranks)", None), ("ZeRO-3 dp2 (2 ranks)", None)]
    assert resolve(index, Target(world_size=3, stage=3)) == Shape(world_size=3, stage=3)


def test_tensor_parallel_degrees_must_divide_the_heads(parallel_fixtures: Mapping[str, Any]) -> None:
    """autotp-tp2-z1-fp32's config.json: 4 attention heads, 2 key-value heads: tp4 is never offered."""
    fixture = parallel_fixtures["autotp-tp2-z1-fp32"]
    index = load_index(str(fixture.dir))
    from ckptflow.reshard.run import model_config

    config = model_config(str(fixture.dir))
    assert config is not None and config["num_key_value_heads"] == 2
    assert {s.tp for s, _ in shapes_at(index, 4, config)} == {1, 2}
    assert 4 in {s.tp for s, _ in shapes_at(index, 4)}  # without the config, only the ranks limit it


def test_tensor_parallel_splits_are_offered_where_the_heads_divide() -> None:
    """A model with 4 key/value heads (`specs.split`) at tp2: tp4 is a shape ckptflow writes, at every stage
    (from ZeRO-1), next to the merge to tp1 and the tp2 reshard."""
    from ckptflow.reshard.run import model_config
    from tests.fixtures.sets import build_split

    fixture = build_split(["autotp-mha-tp2-z1-fp32"])["autotp-mha-tp2-z1-fp32"]
    index = load_index(str(fixture.dir))
    shapes = shapes_at(index, 4, model_config(str(fixture.dir)))
    assert [(str(s), reason) for s, reason in shapes if s.tp == 4] == [
        ("ZeRO-1 tp4 x dp1 (4 ranks)", None), ("ZeRO-2 tp4 x dp1 (4 ranks)", None),
        ("ZeRO-3 tp4 x dp1 (4 ranks)", None)]
    assert all(reason is None for _, reason in shapes)


def test_the_stage_counts_of_a_pipeline(parallel_fixtures: Mapping[str, Any]) -> None:
    """pipe-toy at pp2 (5 layer files): any stage count up to its layers at ZeRO-1, the only stage a
    PipelineModule trains at; more stages than layers is not a shape of it."""
    index = load_index(str(parallel_fixtures["pipe-pp2-z1-fp32"].dir))
    assert [(str(s), reason) for s, reason in shapes_at(index, 4)] == [
        ("ZeRO-1 dp4 (4 ranks)", None), ("ZeRO-1 pp2 x dp2 (4 ranks)", None), ("ZeRO-1 pp4 x dp1 (4 ranks)", None)]
    assert dict((str(s), reason) for s, reason in shapes_at(index, 8))["ZeRO-1 pp8 x dp1 (8 ranks)"] == (
        "its 5 layers that save a file do not fill 8 pipeline stages")


def test_the_cli_moves_a_pipeline_to_other_stages(parallel_fixtures: Mapping[str, Any], tmp_path: Path) -> None:
    """Under DeepSpeed's default partition method the files of pipe-toy (trained "uniform") leave four stages
    open, and the refusal says so in one line naming the flags; with the method it was trained with, or the
    length of its layer list, the stages are written."""
    runner = CliRunner()
    src = str(parallel_fixtures["pipe-pp2-z1-fp32"].dir)
    refused = runner.invoke(app, ["reshard", src, str(tmp_path / "out"), "--world-size", "4", "--pp", "4"],
                            env={"COLUMNS": "400"})
    assert refused.exit_code == 1 and len(refused.output.strip().splitlines()) == 1
    assert refused.output.startswith(f"error: cannot tell which layers each of 4 pipeline stages of {src}/global_step3 "
                                     "holds: layer lists the files allow")
    assert refused.output.rstrip().endswith("give the length of the model's layer list with --pipeline-layers, keep "
                                            "the number of pipeline stages, or merge them (pp 1)")
    assert not (tmp_path / "out").exists()
    for flags, out in ((["--partition-method", "uniform"], "uniform"), (["--pipeline-layers", "6"], "six")):
        done = runner.invoke(app, ["reshard", src, str(tmp_path / out), "--world-size", "4", "--pp", "4", *flags],
                             env={"COLUMNS": "400"})
        assert done.exit_code == 0, done.output
        assert "ZeRO-1 pp2 x dp1 (2 ranks) -> ZeRO-1 pp4 x dp1 (4 ranks)" in done.output
        assert (tmp_path / out / "global_step3" / "zero_pp_rank_0_mp_rank_03_optim_states.pt").is_file()


def test_the_cli_plan_lists_shapes_and_writes_nothing(ds_fixtures: Mapping[str, Any], tmp_path: Path) -> None:
    runner = CliRunner()
    src = str(ds_fixtures["z2-fp32-ws2"].dir)
    result = runner.invoke(app, ["reshard", src, "--world-size", "4", "--plan"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0] == f"{src}/global_step3: ZeRO-2, data-parallel 2, 589 parameters"
    assert "ZeRO-2 dp2 (2 ranks) (now)" in lines[2]
    assert [line.split("  ")[0] for line in lines[3:6]] == ["ZeRO-2 dp4 (4 ranks)", "ZeRO-1 dp4 (4 ranks)",
                                                            "ZeRO-3 dp4 (4 ranks)"]
    assert all(line.rstrip().endswith("writes it") for line in lines[3:6])
    assert lines[-1].startswith("3 of 3 shape(s) at 4 rank(s) can be written.")
    with_out = runner.invoke(app, ["reshard", src, str(tmp_path / "out"), "--world-size", "4", "--plan"],
                             env={"COLUMNS": "200"})
    assert with_out.exit_code == 2 and "--plan writes nothing: leave OUT out" in with_out.output
    assert not (tmp_path / "out").exists()
    without = runner.invoke(app, ["reshard", src, "--world-size", "4"], env={"COLUMNS": "200"})
    assert without.exit_code == 2 and "give the folder to write (or --plan to list the shapes)" in without.output
    odd = runner.invoke(app, ["reshard", src, str(tmp_path / "out"), "--world-size", "4", "--pp", "2",
                              "--partition-method", "type:("], env={"COLUMNS": "200"})
    assert odd.exit_code == 2 and "the partition method's regular expression does not compile" in odd.output
    assert not (tmp_path / "out").exists()


def test_the_cli_refuses_a_shape_in_one_line(ds_fixtures: Mapping[str, Any], tmp_path: Path) -> None:
    runner = CliRunner()
    src = str(ds_fixtures["z1-bf16-ws2-fp32accum"].dir)
    result = runner.invoke(app, ["reshard", src, str(tmp_path / "out"), "--world-size", "2", "--tp", "2"],
                           env={"COLUMNS": "300"})
    assert result.exit_code == 1
    assert result.output.startswith(f"error: cannot reshard {src}/global_step3 (ZeRO-1 dp2 (2 ranks)) to 2 ranks, "
                                    "tp2: a data-parallel ZeRO checkpoint records no tensor-parallel split")
    assert len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_the_cli_plan_of_a_folder_without_a_checkpoint_is_one_line(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["reshard", str(tmp_path), "--world-size", "2", "--plan"],
                                env={"COLUMNS": "300"})
    assert result.exit_code == 1
    assert result.output == (f"error: refusing to plan a reshard of {tmp_path}: no `latest` file in {tmp_path}; point "
                             "at the folder DeepSpeed saved into (it holds `latest`), at a tag folder, or pass --tag\n")


def test_the_cli_plan_of_a_megatron_checkpoint_names_what_its_rules_split(
        parallel_extra_fixtures: Mapping[str, Any]) -> None:
    """A Megatron-style checkpoint (tp2 x dp2) is written at every tensor-parallel degree its
    `universal_checkpoint_info` cuts every parameter at, and at other stage counts; the others name the first
    parameter it does not cut."""
    src = str(parallel_extra_fixtures["megatron-args-tp2dp2-z1-fp32"].dir)
    result = CliRunner().invoke(app, ["reshard", src, "--world-size", "4", "--plan"], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    rows = {line.split("  ")[0]: line.rstrip().rsplit("  ", 1)[-1].strip() for line in result.output.splitlines()[2:-1]}
    assert rows["ZeRO-1 dp4 (4 ranks)"] == "writes it"
    assert rows["ZeRO-1 tp4 x dp1 (4 ranks)"] == (
        "not yet: 0.weight does not split at tensor-parallel degree 4: the padded vocabulary's 38 rows do not split "
        "into 4 equal blocks")
    assert rows["ZeRO-1 pp2 x tp2 x dp1 (4 ranks)"] == "writes it"  # the pipeline stages too (issue 24)
    assert result.output.splitlines()[-1].startswith("5 of 6 shape(s) at 4 rank(s) can be written.")


def test_the_cli_plan_of_an_autoep_zero3_checkpoint_offers_every_degree_at_every_stage(
        parallel_fixtures: Mapping[str, Any]) -> None:
    """AutoEP ZeRO-3 at ep2: on 4 ranks ckptflow writes it at ep1, ep2 and ep4, at ZeRO-3 and at ZeRO-1/2
    (the degree and the stage change together, `experts.at_degree`); a degree that does not divide its 4
    experts is not offered."""
    src = str(parallel_fixtures["autoep-mixtral-ep2-z3-fp32"].dir)
    result = CliRunner().invoke(app, ["reshard", src, "--world-size", "4", "--plan"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    rows = [line for line in result.output.splitlines() if line.startswith("ZeRO-") and "(now)" not in line]
    assert [row.split("  ")[0] for row in rows] == [
        f"ZeRO-{stage} {axes} (4 ranks)" for stage in (3, 1, 2) for axes in ("dp4", "ep2 x edp2", "ep4 x edp1")]
    assert all(row.rstrip().endswith("writes it") for row in rows)
    assert result.output.splitlines()[-1].startswith("9 of 9 shape(s) at 4 rank(s) can be written.")
    assert {s.ep for s, why in shapes_at(load_index(src), 6) if why is None} == {1, 2}


def test_an_autotp_zero3_checkpoint_changes_its_degree_and_stage_at_once(parallel_fixtures: Mapping[str, Any]) -> None:
    """AutoTP ZeRO-3 tp2 x dp2 in bf16 (issue 24): every shape at 4 ranks is one ckptflow writes, the degree
    and the stage changing together among them. Merged to ZeRO-1 it is DeepSpeedZeroOptimizer's, written from
    the ZeRO-3 partitions, rank 0's module the fp32 masters read as bf16 (ZeRO-3 saves no 16-bit weights)."""
    from ckptflow.formats.deepspeed.partition import ZERO, ZERO3
    from ckptflow.formats.torch.tensorref import parse_cast
    from ckptflow.reshard import plan_reshard
    from ckptflow.reshard.run import model_config

    fixture = parallel_fixtures["autotp-tp2dp2-z3-bf16"]
    index = load_index(str(fixture.dir))
    config = model_config(str(fixture.dir))
    assert [(str(s), reason) for s, reason in shapes_at(index, 4, config)] == [
        ("ZeRO-3 dp4 (4 ranks)", None), ("ZeRO-3 tp2 x dp2 (4 ranks)", None), ("ZeRO-1 dp4 (4 ranks)", None),
        ("ZeRO-1 tp2 x dp2 (4 ranks)", None), ("ZeRO-2 dp4 (4 ranks)", None), ("ZeRO-2 tp2 x dp2 (4 ranks)", None)]
    plan = plan_reshard(index, Target(world_size=2, tp=1, stage=1), config)
    assert (plan.stage, plan.optimizer, plan.src_optimizer, plan.world_size) == (1, ZERO, ZERO3, 2)
    assert [u.model_file for u in plan.units] == ["mp_rank_00_model_states.pt", None]
    casts = {(r.ref.dtype, parse_cast(r.ref.uri) is not None) for runs in plan.module_runs.values() for r in runs}
    assert casts == {("bfloat16", True)}


# A bf16 run's recorded config, without and with fp32 gradient accumulation (BF16_Optimizer at ZeRO-1).
_BF16_RUN = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}
_FP32_ACCUM = {**_BF16_RUN, "data_types": {"grad_accum_dtype": "fp32"}}


@pytest.mark.parametrize(("source", "source_stage", "stage", "config", "optimizer"), [
    ("bf16", 1, 1, _FP32_ACCUM, "bf16"), ("bf16", 1, 2, _FP32_ACCUM, "zero"), ("bf16", 1, 3, _FP32_ACCUM, "zero3"),
    ("zero", 1, 2, _BF16_RUN, "zero"), ("zero", 2, 3, _BF16_RUN, "zero3"), ("zero3", 3, 1, _BF16_RUN, "zero"),
    ("zero3", 3, 3, _BF16_RUN, "zero3"), ("zero", 2, 1, _BF16_RUN, "zero"),
    # whichever optimizer wrote the source, ZeRO-1 with fp32 gradient accumulation gets BF16_Optimizer
    ("zero", 2, 1, _FP32_ACCUM, "bf16"), ("zero3", 3, 1, _FP32_ACCUM, "bf16"), ("zero", 2, 2, _FP32_ACCUM, "zero"),
    ("bf16", 1, 1, None, "bf16")])
def test_the_target_optimizer_is_the_one_deepspeed_builds_at_the_stage(source: str, source_stage: int, stage: int,
                                                                      config: Any, optimizer: str) -> None:
    """The recorded config at the target stage: BF16_Optimizer at bf16 ZeRO-1 with fp32 gradient accumulation
    (DeepSpeed's sanity check), whichever optimizer saved the source (and a BF16_Optimizer source's own at
    ZeRO-1), else DeepSpeedZeroOptimizer at ZeRO-1/2 and the ZeRO-3 optimizer at ZeRO-3."""
    from ckptflow.reshard.flats import target_optimizer

    assert target_optimizer(source, source_stage, stage, config) == optimizer


def test_an_expert_parallel_checkpoint_changes_stage_where_deepspeed_trains_it() -> None:
    """deepspeed.moe trains at ZeRO-1 and 2, AutoEP at 1, 2 and 3 (whichever optimizer saved it: a
    BF16_Optimizer source's groups are laid out again, `plan._expert_degree`); deepspeed.moe at ZeRO-3 is
    refused as DeepSpeed refuses it."""
    from ckptflow.reshard.shape import why_not_expert_stage

    assert why_not_expert_stage("moe", 2) is None
    assert why_not_expert_stage("autoep", 2) is None
    assert why_not_expert_stage("autoep", 3) is None
    assert why_not_expert_stage("moe", 3) == (
        "DeepSpeed refuses deepspeed.moe layers at ZeRO-3 (\"Native DeepSpeed MoE is not supported with ZeRO Stage "
        "3. Use AutoEP or choose ZeRO stage 1/2.\"), so a deepspeed.moe checkpoint is written at ZeRO-1 or ZeRO-2 "
        "only")


def test_zero1_where_the_config_gets_bf16_optimizer_is_bf16_optimizers(ds_fixtures: Mapping[str, Any],
                                                                        tmp_path: Path) -> None:
    """A bf16 run with fp32 gradient accumulation gets BF16_Optimizer at ZeRO-1 and DeepSpeedZeroOptimizer at
    ZeRO-2/3 (`engine._do_optimizer_sanity_check`): its ZeRO-2 and ZeRO-3 checkpoints back at ZeRO-1 are
    written in BF16_Optimizer's files, the very files the BF16_Optimizer source resharded at ZeRO-1 gives
    (DeepSpeed's load of them: `test_reshard`'s oracle, long mode)."""
    from ckptflow.formats.deepspeed.partition import BF16
    from ckptflow.reshard import reshard

    source = str(ds_fixtures["z1-bf16-ws2-fp32accum"].dir)
    reshard(source, str(tmp_path / "same"), world_size=3)
    want = _files(tmp_path / "same")
    for stage in (2, 3):
        reshard(source, str(tmp_path / f"z{stage}"), world_size=2, stage=stage)
        assert load_index(str(tmp_path / f"z{stage}")).optimizer_kind != BF16
        reshard(str(tmp_path / f"z{stage}"), str(tmp_path / f"back{stage}"), world_size=3, stage=1)
        back = _files(tmp_path / f"back{stage}")
        assert list(back) == list(want)
        for name, obj in back.items():
            assert _same(obj, want[name]), (stage, name)
    assert load_index(str(tmp_path / "back3")).optimizer_kind == BF16


def _files(checkpoint: Path) -> dict[str, Any]:
    """Every file of a checkpoint's tag folder, loaded (trusted: ckptflow's own output)."""
    import torch

    tag = (checkpoint / "latest").read_text().strip()
    return {p.name: torch.load(p, map_location="cpu", weights_only=False) for p in sorted((checkpoint / tag).iterdir())}


def _same(a: Any, b: Any) -> bool:
    """Equal object trees, tensors bit for bit in dtype and shape."""
    import torch

    if type(a) is not type(b):
        return False
    if isinstance(a, Mapping):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a.view(-1).view(torch.uint8),
                                                                               b.view(-1).view(torch.uint8)))
    return bool(a == b)


def test_which_configs_get_bf16_optimizer_at_zero1() -> None:
    """`engine._do_optimizer_sanity_check`: bf16, fp32 gradient accumulation and no optimizer offload to the CPU,
    the older `cpu_offload` key counted as DeepSpeed still counts it."""
    from ckptflow.formats.deepspeed.config import builds_bf16_optimizer

    run = {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}, "zero_optimization": {"stage": 2}}
    assert builds_bf16_optimizer(run)
    assert builds_bf16_optimizer({**run, "data_types": {"grad_accum_dtype": "float32"}})
    assert not builds_bf16_optimizer({**run, "data_types": {"grad_accum_dtype": "bf16"}})
    assert not builds_bf16_optimizer({**run, "data_types": {"grad_accum_dtype": ["fp32"]}})
    assert not builds_bf16_optimizer({**run, "bf16": {"enabled": False}})
    assert not builds_bf16_optimizer({**run, "zero_optimization": {"stage": 2, "cpu_offload": True}})
    assert not builds_bf16_optimizer({**run, "zero_optimization": {"offload_optimizer": {"device": "cpu"}}})
    assert builds_bf16_optimizer({**run, "zero_optimization": {"offload_optimizer": {"device": "none"}}})


def test_partition_methods_are_checked_as_deepspeed_reads_them() -> None:
    """Any case, as `PipelineModule` lowers the method; anything but a string or a known method is a one-line
    `ValueError`."""
    Target(world_size=2, pp=2, partition_method="Uniform")
    Target(world_size=2, pp=2, partition_method="TYPE:Transformer")
    for bad in (123, "balanced", "type:"):
        with pytest.raises(ValueError, match="the partition method must be"):
            Target(world_size=2, pp=2, partition_method=bad)  # type: ignore[arg-type]
