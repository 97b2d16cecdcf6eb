"""The reader of data-parallel ZeRO-1/2/3 checkpoints, the base every other layout's reader stands on.

`read_zero` reads a tag folder cheapest-first (the folder listing, rank 0's model states, then every
rank file) into a `model.ZeroCheckpoint`, collecting every problem on the way. Nothing here reads tensor bytes
but each rank's optimizer step (a one-element tensor, so that ranks saved at different steps are caught
by every reader): the index says, for every parameter, which bytes of which rank file hold its fp32 master weights and
optimizer moments, so consolidation and resharding can plan before they read.

Layout facts (DeepSpeed 0.19.8):
- ZeRO-1/2: one `mp_rank_00_model_states.pt` (16-bit module copy, buffers, shapes, frozen params) and
  `[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt` per rank. Each param group is flattened in
  `param_shapes` order (plus `param_alignment_paddings`), padded at the end and cut into equal
  partitions; each rank saves its partition without the tail padding (`group_paddings`).
- ZeRO-3: `zero_pp_rank_<r>_mp_rank_00_model_states.pt` and an optim file per rank. Every parameter
  is cut into ceil(numel / world_size) pieces (the last ones padded); a rank's flat group is its
  pieces of the group's parameters, concatenated.
- Expert parallelism (AutoEP, deepspeed.moe): a param group named `ep_size_N` (`moe: True`) holds, in
  each rank's file, the experts of that rank's expert-parallel rank (r % N), and is partitioned as above
  over that rank's expert data-parallel group (world_size / N ranks, `partition.partition_ranks`), not over
  every rank. Each expert-parallel rank's copy of such a group is one *shard*: its parameters have the
  same names and shapes in every shard (`Param.shard` tells them apart) and different values. ZeRO-3
  records the ranks of each sub-group in `ds_zero_partition_groups`; they are checked against this.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypedDict

from ckptflow.errors import CkptflowError
from ckptflow.formats.deepspeed.config import is_set, precision_of, zero_section
from ckptflow.formats.deepspeed.inspection import (
    BASE_STATE_FIELDS,
    MODEL_FIELDS,
    OPTIM_FIELDS,
    Inspection,
    Listing,
    check_fields,
    check_file_set,
    is_count,
    is_flat,
    open_rank_file,
    shown,
)
from ckptflow.formats.deepspeed.model import Buffer, Fragment, Param, ParamGroup, Partition, RankFiles, ZeroCheckpoint
from ckptflow.formats.deepspeed.names import expert_group_degree
from ckptflow.formats.deepspeed.partition import original_order, recorded_slices, zero3_piece, zero12_padded
from ckptflow.formats.torch.tensorref import TensorRef, read_scalar
from ckptflow.formats.torch.unpickler import PickledObject
from ckptflow.plumbing.redaction import describe
from ckptflow.plumbing.sizes import element_count
from ckptflow.plumbing.storage import map_files
from ckptflow.plumbing.text import excerpt


def read_zero(st: Inspection, listing: Listing, model0: dict[str, Any], *, mp_rank: int = 0, mp_world_size: int = 1,
              where: str | None = None, module: Mapping[str, Any] | None = None) -> ZeroCheckpoint:
    """The index of a data-parallel ZeRO checkpoint, checked stage by stage, cheapest first; each stage
    stops the reading at its problems.

    In a model-parallel checkpoint each model-parallel rank is such a checkpoint of its own local
    tensors: `mp_rank` picks its files (`mp_rank_XX`), `model0` is its data-parallel rank 0's model
    states, `mp_world_size` the number of model-parallel ranks its files record, `where` names it in
    messages (e.g. "tensor-parallel rank 1 of 2"). `module` stands in for the model states' `module`
    where DeepSpeed saves none there (PipelineModule: the stage's layer files, under the names
    `param_shapes` uses)."""
    first_model = listing.model_uri(mp_rank)
    head = model_head(st, model0, first_model, mp_world_size)
    st.stop_if_any()
    model_uris, optim_uris = check_file_set(st, listing, head["world_size"], head["precision"], mp_rank, where)
    st.stop_if_any()
    models, optims = _open_ranks(st, model0, model_uris, optim_uris)
    st.stop_if_any()
    stage = _check_agreement(st, listing, head, models, optims, model_uris, optim_uris, mp_world_size)
    st.stop_if_any()
    _check_zero0_bf16_optimizer(st, model0, first_model, where)
    parts = _Partitioning(st, stage, head["world_size"], head["precision"], models, optims, model_uris, optim_uris,
                          module)
    params, groups, partitions = parts.build()
    st.stop_if_any()
    check_steps(st, partitions, optim_uris)
    st.stop_if_any()
    module = parts.module
    return ZeroCheckpoint(
        root=st.root,
        tag=st.tag,
        stage=stage,
        world_size=head["world_size"],
        precision=head["precision"],
        step=head["step"],
        ds_version=head["ds_version"],
        files=tuple(
            RankFiles(r, optim_uris[r], model_uris[r] if listing.stage3 else (model_uris[0] if r == 0 else None))
            for r in range(head["world_size"])
        ),
        params=params,
        buffers=tuple(Buffer(n, module[n]) for n in models[0].get("buffer_names", []) if n in module),
        tied=parts.tied,
        groups=groups,
        partitions=partitions,
        module_order=tuple(module),
        model_states=tuple(models),
        optim_states=tuple(optims),
        mp_rank=mp_rank,
    )


def read_partitions(st: Inspection, stage: int, world_size: int, precision: str, models: list[dict[str, Any]],
                    optims: list[dict[str, Any]], model_uris: list[str], optim_uris: list[str]
                    ) -> tuple[tuple[Param, ...], tuple[ParamGroup, ...], tuple[tuple[Partition, ...], ...],
                               dict[str, str]]:
    """Parameters, param groups, partitions and tied aliases from model states and optimizer files
    already opened (a layout with no tag folder: `optimizer_shards`), checked as `read_zero` checks them;
    the caller stops on the problems added to `st`."""
    parts = _Partitioning(st, stage, world_size, precision, models, optims, model_uris, optim_uris)
    params, groups, partitions = parts.build()
    return params, groups, partitions, parts.tied


def optimizer_step(parts: Sequence[Partition]) -> int | float | None:
    """The step one rank's optimizer records: the first of its partitions' `step` that is a number (a
    tensor's one element read, a few bytes); None when none records one. Raises what the read raises
    (`CkptflowError`, `OSError`, `ValueError`)."""
    for part in parts:
        step = part.state.get("step")
        if isinstance(step, TensorRef):
            step = read_scalar(step)
        if isinstance(step, int | float) and not isinstance(step, bool):
            return step
    return None


def check_steps(st: Inspection, partitions: tuple[tuple[Partition, ...], ...], optim_uris: list[str]) -> None:
    """Every rank's optimizer is at the same step (a few bytes read per rank): files saved at different
    steps would be stitched into a model no run ever had."""
    steps: dict[int, Any] = {}
    for rank, parts in enumerate(partitions):
        try:
            step = optimizer_step(parts)
        except (CkptflowError, OSError, ValueError) as exc:
            st.add("unreadable-file",
                   f"rank {rank}: cannot read the optimizer step in {optim_uris[rank]} ({describe(exc)})",
                   file=optim_uris[rank], rank=rank)
            continue
        if step is not None:
            steps[rank] = step
    if not steps:
        return
    first_rank = min(steps)
    first = steps[first_rank]
    for rank, value in steps.items():
        if value != first and not (value != value and first != first):  # NaN == NaN here
            st.add("ranks-disagree",
                   f"rank {rank}'s optimizer in {optim_uris[rank]} is at step {_step(value)} but rank {first_rank}'s "
                   f"is at {_step(first)}; the tag folder mixes files from different saves: re-copy it from one save",
                   file=optim_uris[rank], rank=rank)


def _step(value: int | float) -> str:
    return f"{value:g}" if isinstance(value, float) and math.isfinite(value) else excerpt(value)


def _open_ranks(st: Inspection, model0: dict[str, Any], model_uris: list[str],
                optim_uris: list[str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every rank file parsed (in parallel on a store: `plumbing.storage.map_files`)."""
    jobs = list(enumerate(model_uris))[1:] + list(enumerate(optim_uris))
    parsed = map_files(lambda job: open_rank_file(st, job[1], job[0]), jobs, [uri for _, uri in jobs])
    return [model0] + parsed[:len(model_uris) - 1], parsed[len(model_uris) - 1:]


def _check_agreement(st: Inspection, listing: Listing, head: ModelHead, models: list[dict[str, Any]],
                     optims: list[dict[str, Any]], model_uris: list[str], optim_uris: list[str],
                     mp_world_size: int = 1) -> int:
    """The ranks agree on step, world size, version and ZeRO stage; returns the stage."""
    heads = [head] + [model_head(st, m, u, mp_world_size) for m, u in zip(models[1:], model_uris[1:])]
    st.stop_if_any()
    agreed: tuple[tuple[Literal["step", "world_size", "ds_version"], str], ...] = (
        ("step", "global step"), ("world_size", "data-parallel world size"), ("ds_version", "DeepSpeed version"),
    )
    for key, label in agreed:
        for rank, h in enumerate(heads[1:], start=1):
            if h[key] != head[key]:
                st.add(
                    "ranks-disagree",
                    f"rank {rank} records {label} {shown(h[key])} in {model_uris[rank]} but rank 0 records "
                    f"{shown(head[key])}; the folder mixes files from different saves: re-copy the tag folder from "
                    "one save",
                    file=model_uris[rank], rank=rank,
                )
    optim_heads = [_optim_head(st, o, u, r) for r, (o, u) in enumerate(zip(optims, optim_uris))]
    st.stop_if_any()
    stage = optim_heads[0]["stage"]
    if listing.stage3 != (stage == 3):
        st.add(
            "ranks-disagree",
            f"{optim_uris[0]} records ZeRO stage {stage} but the model state files are laid out for "
            f"{'ZeRO-3' if listing.stage3 else 'ZeRO-1/2'}; the folder mixes saves: re-copy it from one save",
            file=optim_uris[0], rank=0,
        )
    for rank, oh in enumerate(optim_heads):
        if oh["stage"] != stage:
            st.add("ranks-disagree", f"rank {rank} records ZeRO stage {oh['stage']} in {optim_uris[rank]} but rank 0 "
                   f"records {stage}; re-copy the tag folder from one save", file=optim_uris[rank], rank=rank)
        if oh["world_size"] != head["world_size"]:
            st.add(
                "world-size-mismatch",
                f"{optim_uris[rank]} was saved with {excerpt(oh['world_size'])} partitions but {model_uris[0]} "
                f"records a data-parallel world size of {head['world_size']}; the folder mixes saves of different "
                "sizes: re-copy it from one save",
                file=optim_uris[rank], rank=rank,
            )
    return stage


def zero0_bf16_optimizer(model0: Mapping[str, Any]) -> bool:
    """Whether the model states `model0` are a ZeRO-0 save whose optimizer is DeepSpeed's BF16_Optimizer:
    what a PipelineModule trained in bf16 gets at ZeRO-0. Its files look like ZeRO-1's
    (`bf16_zero_pp_rank_*`, BF16_Optimizer's own state dict, also the model states' `optimizer`), while the
    model states, written as ZeRO-0's, record no `param_shapes`. DeepSpeed 0.19.8 cannot load that checkpoint
    back (`tests/fixtures/specs/extra.py`); the PipelineModule reader names its stages from BF16_Optimizer's
    `param_slice_mappings` (`readers.pipeline`)."""
    config = model0.get("ds_config")
    zero = config.get("zero_optimization") if isinstance(config, Mapping) else None
    stage = zero.get("stage", 0) if isinstance(zero, Mapping) else 0
    return model0.get("param_shapes") is None and stage == 0


def _check_zero0_bf16_optimizer(st: Inspection, model0: Mapping[str, Any], uri: str, where: str | None) -> None:
    """The ZeRO-0 BF16_Optimizer layout (`zero0_bf16_optimizer`) where its optimizer files name no parameter:
    refused. A PipelineModule's, plain or Megatron-style, names each model-parallel rank's parameters from them
    before this reads it (`readers.pipeline`)."""
    if not zero0_bf16_optimizer(model0):
        return
    st.add("unsupported-layout", f"{uri}{f' ({where})' if where else ''} is a ZeRO-0 checkpoint whose optimizer is "
           "DeepSpeed's BF16_Optimizer (what a PipelineModule trained in bf16 gets at ZeRO-0), which DeepSpeed 0.19.8 "
           "cannot load back (its loader fails with KeyError 0); ckptflow reads that layout where its optimizer "
           "files name a PipelineModule's parameters, plain or Megatron-style (param_slice_mappings), not here: "
           "train with ZeRO-1, whose BF16_Optimizer files ckptflow reads, or save the 16-bit weights with "
           "`engine.save_16bit_model()`", file=uri)
    st.stop_if_any()


class ModelHead(TypedDict, total=False):
    """What a rank's model states record about the save; empty where the file failed its checks (the
    problem is in the `Inspection`, which the caller stops on before reading any of it)."""

    world_size: int
    precision: str
    step: int
    ds_version: str


class _OptimHead(TypedDict, total=False):
    """What a rank's optimizer states record; empty where the file failed its checks (as `ModelHead`)."""

    stage: int
    world_size: int


def model_head(st: Inspection, obj: Mapping[str, Any], uri: str, mp_world_size: int = 1) -> ModelHead:
    missing = [k for k in ("module", "param_shapes", "dp_world_size", "global_steps") if k not in obj]
    if missing:
        st.add("corrupt-file", f"{uri} is a torch file but not DeepSpeed model states (no {', '.join(missing)}); "
               "it was replaced or written by another tool", file=uri)
        return {}
    precision = precision_of(obj.get("ds_config"))
    world_size, step, version = obj["dp_world_size"], obj["global_steps"], obj.get("ds_version", "unknown")
    if not is_count(world_size) or world_size < 1:
        st.add("corrupt-file",
               f"{uri} records a data-parallel world size of {excerpt(world_size)}; the file is damaged", file=uri)
        return {}
    if not is_count(step):
        st.add("corrupt-file", f"{uri} records a global step of {excerpt(step)}, not a step count; the file is damaged",
               file=uri)
        return {}
    if not isinstance(version, str):
        st.add("corrupt-file", f"{uri} records a DeepSpeed version of {excerpt(version)}, not a version string; the "
               "file is damaged", file=uri)
        return {}
    recorded = obj.get("mp_world_size")
    if (recorded if recorded is not None else 1) != mp_world_size:
        if mp_world_size == 1:
            st.add("unsupported-parallelism", f"{uri} was saved with model-parallel size {excerpt(recorded)}; "
                   "ckptflow handles data-parallel ZeRO checkpoints only", file=uri)
        else:
            st.add("ranks-disagree", f"{uri} records model-parallel size {excerpt(recorded)} but the "
                   f"checkpoint's layout implies {mp_world_size}; the folder mixes saves: re-copy it from one save",
                   file=uri)
    return {"world_size": world_size, "precision": precision, "step": step, "ds_version": version}


def _optim_head(st: Inspection, obj: Mapping[str, Any], uri: str, rank: int) -> _OptimHead:
    osd = obj.get("optimizer_state_dict")
    if not isinstance(osd, Mapping) or "partition_count" not in osd:
        st.add("corrupt-file", f"rank {rank}: {uri} is a torch file but not a ZeRO optimizer state (no "
               "optimizer_state_dict.partition_count); it was replaced or written by another tool", file=uri, rank=rank)
        return {}
    count = osd["partition_count"]
    counts = count if isinstance(count, list) and count else [count]
    if not all(is_count(c) and c >= 1 for c in counts):
        st.add("corrupt-file", f"rank {rank}: {uri} records a partition count of {excerpt(count)}; the file is damaged",
               file=uri, rank=rank)
        return {}
    stage = osd.get("zero_stage", 1)  # BF16_Optimizer (ZeRO-1 with bf16 weights, fp32 gradients) records no stage
    if stage not in (0, 1, 2, 3) or type(stage) is bool:
        st.add("corrupt-file", f"rank {rank}: {uri} records ZeRO stage {excerpt(stage)}; the file is damaged",
               file=uri, rank=rank)
        return {}
    return {"stage": int(stage), "world_size": max(counts)}


class _Partitioning:
    """Parameter fragments and partitions from the rank files, checked as they are worked out."""

    def __init__(self, st: Inspection, stage: int, world_size: int, precision: str,
                 models: list[dict[str, Any]], optims: list[dict[str, Any]],
                 model_uris: list[str], optim_uris: list[str], module: Mapping[str, Any] | None = None) -> None:
        self.st, self.stage, self.ws, self.precision = st, stage, world_size, precision
        self.models, self.optims = models, optims
        self.module: Mapping[str, Any] = module if module is not None else (models[0].get("module") or {})
        self.model_uris, self.optim_uris = model_uris, optim_uris
        self.osds = [o["optimizer_state_dict"] for o in optims]
        self.padding_saved = stage != 3 and "zero_stage" not in self.osds[0]  # BF16_Optimizer
        # DeepSpeedZeroOptimizer flattens each group round-robin over its ranks (BF16_Optimizer does not)
        self.round_robin = stage in (1, 2) and not self.padding_saved and is_set(
            zero_section(models[0].get("ds_config")), "round_robin_gradients")
        self.tied: dict[str, str] = {}

    def build(self) -> tuple[tuple[Param, ...], tuple[ParamGroup, ...], tuple[tuple[Partition, ...], ...]]:
        for rank, (m, uri) in enumerate(zip(self.models, self.model_uris)):
            if rank == 0 or self.stage == 3:
                self._check_fields(m, MODEL_FIELDS, uri, rank)
        for rank, (osd, uri) in enumerate(zip(self.osds, self.optim_uris)):
            self._check_fields(osd, OPTIM_FIELDS, uri, rank)
            self._check_fields(self._base_state(rank), BASE_STATE_FIELDS, uri, rank)
        self.st.stop_if_any()
        model0 = self.models[0]
        shapes: list[Mapping[str, tuple[int, ...]]] = model0["param_shapes"]
        for rank, m in enumerate(self.models[1:], start=1):
            if m.get("param_shapes") != shapes:
                self.st.add("ranks-disagree", f"rank {rank}: {self.model_uris[rank]} lists other parameter shapes than "
                            "rank 0; the folder mixes saves of different models: re-copy it from one save",
                            file=self.model_uris[rank], rank=rank)
        if not isinstance(shapes, list):
            self.st.add("corrupt-file", f"{self.model_uris[0]} records no parameter shapes (`param_shapes` is "
                        f"{excerpt(shapes)}), which every ZeRO-1/2/3 save holds; the file is damaged or was written "
                        "by another tool", file=self.model_uris[0], rank=0)
        elif len(shapes) != len(self._fp32_groups(0)):
            self.st.add("corrupt-file", f"{self.model_uris[0]} lists {len(shapes)} param groups but "
                        f"{self.optim_uris[0]} holds {len(self._fp32_groups(0))}; the files come from different saves",
                        file=self.optim_uris[0], rank=0)
        self.st.stop_if_any()
        groups = self._groups(shapes)
        self.st.stop_if_any()
        partitions = tuple(
            tuple(self._partition(rank, g) for g in range(len(shapes))) for rank in range(self.ws)
        )
        self._check_partition_counts(groups)
        self._check_moments(partitions)
        self.st.stop_if_any()
        module = self.module
        dtypes = {name: ref.dtype for name, ref in module.items() if isinstance(ref, TensorRef)}
        trainable: dict[str, list[Param]] = {}  # name -> one Param per shard
        for group in groups:
            g, group_shapes = group.index, shapes[group.index]
            for shard in range(group.ep):
                ranks = group.ranks(self.ws, shard)
                fragments = self._fragments_zero3(g, group_shapes, partitions, ranks) if self.stage == 3 else \
                    self._fragments_zero12(g, group_shapes, partitions, ranks)
                for name, shape in group_shapes.items():
                    trainable.setdefault(name, []).append(
                        Param(name, tuple(shape), self._dtype(dtypes.get(name)), g, fragments.get(name, ()),
                              shard=shard))
        self.st.stop_if_any()
        frozen = self._frozen()
        self._find_tied(module, {**{n: p[0] for n, p in trainable.items()}, **frozen})
        if self.stage != 3 and model0.get("frozen_param_shapes") is None:
            frozen = self._frozen_from_module(module, trainable)
        order = [n for n in module if n in trainable or n in frozen]
        order += [n for n in [*trainable, *frozen] if n not in order]
        return tuple(p for n in order for p in (trainable.get(n) or [frozen[n]])), groups, partitions

    def _check_fields(self, obj: Mapping[str, Any], fields: Mapping[str, Any], uri: str, rank: int) -> None:
        check_fields(self.st, obj, fields, uri, rank)

    def _dtype(self, module_dtype: str | None) -> str:
        return module_dtype or {"bf16": "bfloat16", "fp16": "float16"}.get(self.precision, "float32")

    def _fp32_groups(self, rank: int) -> list[TensorRef]:
        osd = self.osds[rank]
        key = "fp32_flat_groups" if "fp32_flat_groups" in osd else "single_partition_of_fp32_groups"
        groups = osd.get(key)
        return groups if isinstance(groups, list) else []

    def _base_state(self, rank: int) -> Mapping[str, Any]:
        osd = self.osds[rank]
        base = osd.get("optimizer_state_dict") if self.stage == 3 else osd.get("base_optimizer_state")
        return base if isinstance(base, Mapping) else {}

    def _groups(self, shapes: list[Mapping[str, Any]]) -> tuple[ParamGroup, ...]:
        hyper = self._base_state(0).get("param_groups") or [{} for _ in shapes]
        groups = []
        for g, group_shapes in enumerate(shapes):
            group = {k: v for k, v in (hyper[g] if g < len(hyper) else {}).items() if k != "params"}
            ep = expert_group_degree(group)
            if ep is None or self.ws % ep:
                why = ("does not say its expert-parallel degree (DeepSpeed names expert groups ep_size_N)" if ep is None
                       else f"is split over {ep} expert-parallel ranks, which {self.ws} ranks cannot hold")
                self.st.add("partition-mismatch", f"param group {g} ({group.get('name')!r}) in {self.optim_uris[0]} is "
                            f"an expert group that {why}; ckptflow cannot tell which ranks hold which experts",
                            file=self.optim_uris[0], rank=0)
                ep = 1
            groups.append(ParamGroup(g, group, tuple(group_shapes), ep))
        return tuple(groups)

    def _check_partition_counts(self, groups: tuple[ParamGroup, ...]) -> None:
        """Each group is partitioned over the ranks its expert-parallel degree implies: ZeRO-1/2 record the
        count per group (`partition_count`), ZeRO-3 with expert groups the ranks of each sub-group
        (`ds_zero_partition_groups`, one sub-group per param group here)."""
        for rank, osd in enumerate(self.osds):
            uri = self.optim_uris[rank]
            count = osd.get("partition_count")
            recorded = osd.get("ds_zero_partition_groups")
            if self.stage != 3 and isinstance(count, list):
                for group, have in zip(groups, count):
                    want = self.ws // group.ep
                    if have != want:
                        self.st.add("partition-mismatch", f"rank {rank}: {uri} records param group {group.index} "
                                    f"({excerpt(group.hyper.get('name'))}) as partitioned over {have} ranks, but at "
                                    f"{self.ws} ranks {self._over(group)} it is partitioned over {want}; the file is "
                                    "damaged or from another save", file=uri, rank=rank)
            if self.stage != 3:
                continue
            if recorded is None:
                if any(g.ep > 1 for g in groups):
                    self.st.add("partition-mismatch", f"rank {rank}: {uri} has expert param groups but no "
                                "ds_zero_partition_groups, so it does not say which ranks hold which experts",
                                file=uri, rank=rank)
                continue
            if not isinstance(recorded, list) or len(recorded) != len(groups):
                count_shown = len(recorded) if isinstance(recorded, list) else repr(recorded)
                self.st.add("unsupported-layout", f"rank {rank}: {uri} records {count_shown} "
                            f"ZeRO-3 partition sub-groups for {len(groups)} param groups; ckptflow reads one sub-group "
                            "per param group (sub_group_size larger than any group)", file=uri, rank=rank)
                continue
            for group, entry in zip(groups, recorded):
                ranks = list(group.ranks(self.ws, rank % group.ep))
                want_sub = {
                    "partition_count": len(ranks), "partition_rank": ranks.index(rank), "partition_ranks": ranks,
                }
                have_sub = {k: entry.get(k) for k in want_sub} if isinstance(entry, Mapping) else entry
                if have_sub != want_sub:
                    self.st.add("partition-mismatch", f"rank {rank}: {uri} records sub-group {group.index} "
                                f"({excerpt(group.hyper.get('name'))}) as {have_sub}, but at {self.ws} ranks "
                                f"{self._over(group)} DeepSpeed's default topology gives {want_sub}; the checkpoint "
                                "was saved with another expert-parallel topology, which ckptflow cannot place",
                                file=uri, rank=rank)

    @staticmethod
    def _over(group: ParamGroup) -> str:
        return f"over {group.ep} expert-parallel ranks" if group.ep > 1 else "(a dense group)"

    def _partition(self, rank: int, group: int) -> Partition:
        uri = self.optim_uris[rank]
        flat = self._fp32_groups(rank)
        empty = Partition(rank, group, 0, 0, TensorRef(uri, "", "float32", (0,), (1,), 0, 0, 0))
        if group >= len(flat) or not isinstance(flat[group], TensorRef):
            self.st.add("corrupt-file", f"rank {rank}: {uri} has no fp32 partition for param group {group}",
                        file=uri, rank=rank)
            return empty
        ref = flat[group]
        if not is_flat(ref):
            self.st.add("corrupt-file", f"rank {rank}: the fp32 partition of param group {group} in {uri} is a "
                        f"strided view (shape {excerpt(list(ref.shape))}, stride {excerpt(list(ref.stride))}), not the "
                        "contiguous flat tensor DeepSpeed saves; the file is damaged", file=uri, rank=rank)
            return empty
        padding = 0
        if self.stage != 3:
            paddings = self.osds[rank].get("group_paddings") or []
            padding = paddings[group] if group < len(paddings) else 0
        state = self._base_state(rank).get("state") or {}
        if group == 0:
            unknown = [k for k in state if not (type(k) is int and 0 <= k < len(flat))]
            if unknown:
                self.st.add("corrupt-file", f"rank {rank}: {uri} holds optimizer state for param group "
                            f"{excerpt(unknown[0])}, but the checkpoint has {len(flat)} param group(s); the file is "
                            "damaged", file=uri, rank=rank)
        group_state = state.get(group) or {}
        if not isinstance(group_state, Mapping):
            self.st.add("corrupt-file", f"rank {rank}: {uri} holds the optimizer state of param group {group} as "
                        f"{excerpt(group_state)}; the file is damaged", file=uri, rank=rank)
            return empty
        # ZeRO-1/2 save their partition without its tail padding; BF16_Optimizer saves it whole.
        numel = ref.numel if self.padding_saved else ref.numel + padding
        for key, value in group_state.items():
            if key == "step" or not isinstance(value, TensorRef):
                continue
            if value.numel != numel:
                self.st.add("partition-mismatch", f"rank {rank}: optimizer state {excerpt(key)} of param group {group} "
                            f"in {uri} has {value.numel} elements but the fp32 partition has {numel}; the file is "
                            "damaged", file=uri, rank=rank)
            elif not is_flat(value):
                self.st.add("corrupt-file", f"rank {rank}: optimizer state {excerpt(key)} of param group {group} in "
                            f"{uri} is a strided view (stride {excerpt(list(value.stride))}), not the contiguous flat "
                            "tensor DeepSpeed saves; the file is damaged", file=uri, rank=rank)
        return Partition(rank, group, numel, padding, ref, dict(group_state))

    def _check_moments(self, partitions: tuple[tuple[Partition, ...], ...]) -> None:
        """Every rank holds the same optimizer moments (exp_avg, exp_avg_sq ...) for each param group."""
        for g in range(len(partitions[0]) if partitions else 0):
            names = [sorted(str(k) for k, v in p[g].state.items() if p[g].is_moment(v)) for p in partitions]
            for rank, have in enumerate(names[1:], start=1):
                if have != names[0]:
                    uri = self.optim_uris[rank]
                    self.st.add("ranks-disagree", f"rank {rank}: {uri} holds the optimizer state "
                                f"{excerpt(', '.join(have) or 'none', 80)} for param group {g} but rank 0 holds "
                                f"{excerpt(', '.join(names[0]) or 'none', 80)}; the files are damaged or from "
                                "different saves", file=uri, rank=rank)

    def _fragments_zero12(self, g: int, group_shapes: Mapping[str, Any], partitions: tuple[tuple[Partition, ...], ...],
                          ranks: tuple[int, ...]) -> dict[str, tuple[Fragment, ...]]:
        """Fragments of group `g`'s parameters, partitioned in order over the global `ranks`."""
        sizes = [partitions[r][g].numel for r in ranks]
        which = f"ranks {list(ranks)}" if len(ranks) < self.ws else "ranks"
        if len(set(sizes)) != 1:
            self.st.add("partition-mismatch", f"param group {g}: {which} hold partitions of {sizes} elements (saved + "
                        "padding); ZeRO-1/2 partitions are equal-sized, so a rank file is damaged or from another save",
                        file=self.optim_uris[ranks[0]])
            return {}
        size = sizes[0]
        saved = sum(partitions[r][g].fp32.numel for r in ranks)
        align_paddings = (self.osds[0].get("param_alignment_paddings") or [None] * (g + 1))[g]
        if align_paddings is not None and len(align_paddings) != len(group_shapes):
            self.st.add("partition-mismatch", f"param group {g}: {self.optim_uris[0]} records {len(align_paddings)} "
                        f"alignment paddings for {len(group_shapes)} parameters; the file is damaged",
                        file=self.optim_uris[0], rank=0)
            return {}
        need = sum(element_count(shape) for shape in group_shapes.values()) + sum(align_paddings or ())
        if need > size * len(ranks):
            self.st.add("partition-mismatch", f"param group {g}: the parameter shapes in {self.model_uris[0]} need "
                        f"{need:,} elements but the {which} hold partitions of {size:,} elements each ({len(ranks)} "
                        f"ranks, {self.optim_uris[ranks[0]]} and the others); the shapes and the partitions do not "
                        "belong together", file=self.model_uris[0])
            return {}
        offset = 0
        out: dict[str, tuple[Fragment, ...]] = {}
        numels, starts = [], []
        for i, (name, shape) in enumerate(group_shapes.items()):
            numel = element_count(shape)
            numels.append(numel)
            starts.append(offset)
            frags = []
            pos = offset
            while pos < offset + numel:
                local, start = divmod(pos, size)
                take = min(offset + numel - pos, size - start)
                frags.append(Fragment(ranks[local] if local < len(ranks) else self.ws + local, g, start, take,
                                      pos - offset))
                pos += take
            out[name] = tuple(frags)
            offset += numel + (align_paddings[i] if align_paddings else 0)
        if self.padding_saved:
            saved -= sum(partitions[r][g].padding for r in ranks)
            misfit = offset != saved
        else:  # ZeRO-1/2 round both ends to 2 * world_size in ways only the live optimizer knows exactly
            misfit = offset > saved or zero12_padded(offset, len(ranks)) != zero12_padded(saved, len(ranks))
        if misfit:
            self.st.add("partition-mismatch", f"param group {g}: its parameters need {offset} elements but the "
                        f"{which} saved {saved}; the partition sizes do not add up, so the files do not belong "
                        "together", file=self.optim_uris[ranks[0]])
        # The fragment addresses DeepSpeed records: where the parameters are, except with round-robin
        # gradients, whose addresses follow the optimizer's original order (`partition.recorded_slices`).
        names = list(group_shapes)
        order = original_order(len(names), len(ranks), self.round_robin)
        for part, rank in enumerate(ranks):
            mapping = (self.osds[rank].get("param_slice_mappings") or [{}] * (g + 1))[g]
            placed = {names[i]: (start, numel)
                      for i, start, numel in recorded_slices(numels, starts, size, part, order)}
            for name, addr in (mapping or {}).items():
                at = placed.get(name)
                if isinstance(addr, PickledObject) and at != (addr.get("start"), addr.get("numel")):
                    self.st.add("partition-mismatch", f"rank {rank}: {self.optim_uris[rank]} places {excerpt(name)} at "
                                f"{excerpt(addr.get('start'))}+{excerpt(addr.get('numel'))} but the shapes place it at "
                                f"{[at] if at else []}; the file is damaged or from another model",
                                file=self.optim_uris[rank], rank=rank)
        return out

    def _fragments_zero3(self, g: int, group_shapes: Mapping[str, Any], partitions: tuple[tuple[Partition, ...], ...],
                         ranks: tuple[int, ...]) -> dict[str, tuple[Fragment, ...]]:
        """Fragments of group `g`'s parameters, each cut into pieces over the global `ranks` in order."""
        out: dict[str, tuple[Fragment, ...]] = {}
        offset = 0
        count = len(ranks)
        for name, shape in group_shapes.items():
            numel = element_count(shape)
            piece = zero3_piece(numel, count)
            # zero3_real, unrolled: the first `full` of `ranks` hold a whole piece, the next the rest if any
            full = numel // piece if piece else 0
            frags = [Fragment(ranks[i], g, offset, piece, i * piece) for i in range(full)]
            if piece and full < count and numel - full * piece:
                frags.append(Fragment(ranks[full], g, offset, numel - full * piece, full * piece))
            out[name] = tuple(frags)
            offset += piece
        for rank in ranks:
            have = partitions[rank][g].fp32.numel
            if have != offset:
                self.st.add("partition-mismatch", f"rank {rank}: param group {g} in {self.optim_uris[rank]} holds "
                            f"{have} fp32 elements but its parameters need {offset} ({count} ranks); the file is "
                            "damaged or from a save with another world size", file=self.optim_uris[rank], rank=rank)
        return out

    def _frozen(self) -> dict[str, Param]:
        model0 = self.models[0]
        shapes = model0.get("frozen_param_shapes") or {}
        out: dict[str, Param] = {}
        for name, shape in shapes.items():
            shape = tuple(shape)
            numel = element_count(shape)
            pieces = []
            models = self.models if self.stage == 3 else [model0]
            for rank, m in enumerate(models):
                ref = (m.get("frozen_param_fragments") or {}).get(name)
                want = zero3_piece(numel, self.ws) if self.stage == 3 else numel
                if not isinstance(ref, TensorRef) or ref.numel != want:
                    self.st.add("partition-mismatch", f"rank {rank}: frozen parameter {excerpt(name)} in "
                                f"{self.model_uris[rank]} has {getattr(ref, 'numel', 'no')} elements, expected {want}; "
                                "the file is damaged or from another save", file=self.model_uris[rank], rank=rank)
                    continue
                if not ref.is_contiguous:
                    self.st.add("corrupt-file", f"rank {rank}: frozen parameter {excerpt(name)} in "
                                f"{self.model_uris[rank]} is saved as a strided view (stride "
                                f"{excerpt(list(ref.stride))}), not the contiguous tensor DeepSpeed saves; the file is "
                                "damaged",
                                file=self.model_uris[rank], rank=rank)
                    continue
                pieces.append(ref)
            dtype = pieces[0].dtype if pieces else "float32"
            out[name] = Param(name, shape, dtype, None, (), tuple(pieces))
        return out

    def _frozen_from_module(self, module: Mapping[str, Any], trainable: Mapping[str, Any]) -> dict[str, Param]:
        """ZeRO-1 records no frozen-parameter list: they are the module's tensors that are neither
        buffers, nor trainable, nor aliases, and their saved 16-bit (or fp32) copy is their only value."""
        buffers = set(self.models[0].get("buffer_names") or [])
        return {
            name: Param(name, ref.shape, ref.dtype, None, (), (ref,))
            for name, ref in module.items()
            if isinstance(ref, TensorRef) and name not in buffers and name not in trainable and name not in self.tied
        }

    def _find_tied(self, module: Mapping[str, Any], params: Mapping[str, Param]) -> None:
        """Aliases of parameters: ZeRO-1/2 list them in `shared_params`; ZeRO-3 leaves them in the module
        state dict sharing the owner's storage."""
        shared = self.models[0].get("shared_params") or {}
        for alias, owner in shared.items():
            if owner in params and alias not in params:
                self.tied[alias] = owner
        buffers = set(self.models[0].get("buffer_names") or [])
        by_storage = {
            (ref.uri, ref.key, ref.storage_offset, ref.shape): name
            for name, ref in module.items()
            if name in params and isinstance(ref, TensorRef)
        }
        for name, ref in module.items():
            if name in params or name in buffers or name in self.tied or not isinstance(ref, TensorRef):
                continue
            owner = by_storage.get((ref.uri, ref.key, ref.storage_offset, ref.shape))
            if owner is not None:
                self.tied[name] = owner
