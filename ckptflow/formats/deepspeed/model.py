"""What every reader gives: the index types of a DeepSpeed checkpoint and the `Partitioned` protocol.

An index is immutable and holds no tensor bytes: for every parameter, which bytes of which rank file hold
its fp32 master weights and optimizer moments (`Fragment`s of a `Partition`), its param group's
hyper-parameters (`ParamGroup`), and the full model as `ModelTensor`s (name, shape, dtype, the `Run`s
that make it). `ZeroCheckpoint` is a data-parallel ZeRO-1/2/3 checkpoint, and every model-parallel
layout is made of them (one per model-parallel rank). The consolidate and reshard steps plan over these
types alone, so a new layout needs a reader and nothing else.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from ckptflow.errors import CheckpointError
from ckptflow.formats.deepspeed.config import is_set, optimizer_kind, zero_section
from ckptflow.formats.deepspeed.names import LATEST
from ckptflow.formats.deepspeed.partition import ZERO, original_order, partition_ranks, zero3_piece, zero3_real
from ckptflow.formats.deepspeed.runs import Run, check_coverage, contiguous, whole_run
from ckptflow.formats.torch.tensorref import TensorRef
from ckptflow.plumbing.sizes import element_count
from ckptflow.plumbing.storage import join


@dataclass(frozen=True, slots=True)
class Fragment:
    """A run of a parameter's flat elements inside one rank's flat partition of its param group.
    (A 405B ZeRO-3 checkpoint at 1024 ranks has 1.16 million: slots keep each at 72 bytes.)"""

    rank: int
    group: int
    offset: int
    numel: int
    param_offset: int


@dataclass(frozen=True)
class Param:
    """One parameter: shape, training dtype, and where its values live. `shard` is the expert-parallel
    rank whose copy of an expert-group parameter this is (0 for every parameter of a dense group)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    group: int | None
    fragments: tuple[Fragment, ...] = ()
    frozen_pieces: tuple[TensorRef, ...] = ()
    shard: int = 0

    @property
    def frozen(self) -> bool:
        return self.group is None

    @property
    def numel(self) -> int:
        return element_count(self.shape)


@dataclass(frozen=True)
class Buffer:
    name: str
    ref: TensorRef


@dataclass(frozen=True)
class ParamGroup:
    """One optimizer param group: its hyper-parameters and its parameters, in flattening order. `ep` is
    the expert-parallel degree of an expert group (`ep_size_N`): each of its `ep` shards is partitioned
    over `layout.partition_ranks(world_size, ep, shard)`; 1 for a group partitioned over every rank.
    `index` is its place among the checkpoint's groups; in an index rebuilt at another expert-parallel
    degree (`reshard.experts.at_degree`), the source group whose hyper-parameters and optimizer state
    entries it carries, as DeepSpeed may cut the expert groups otherwise there."""

    index: int
    hyper: Mapping[str, Any]
    params: tuple[str, ...]
    ep: int = 1

    def ranks(self, world_size: int, shard: int = 0) -> tuple[int, ...]:
        """The global ranks, in partition order, holding shard `shard` of this group at `world_size`."""
        return partition_ranks(world_size, self.ep, shard)


@dataclass(frozen=True)
class Partition:
    """One rank's flat fp32 partition of one param group and the optimizer state over it.

    `numel` counts the partition's elements including its tail `padding`; `fp32` holds the first
    `fp32.numel` of them as saved (the ZeRO-1/2 optimizer drops the tail padding when saving;
    BF16_Optimizer and ZeRO-3 keep it). `state` is the base optimizer's state over the partition:
    `exp_avg`/`exp_avg_sq` as `TensorRef`s of `numel` elements, `step` as a tensor or a number.
    """

    rank: int
    group: int
    numel: int
    padding: int
    fp32: TensorRef
    state: Mapping[str, Any] = field(default_factory=dict)

    def is_moment(self, value: Any) -> bool:
        """Whether an optimizer state entry is a tensor over this flat partition (a moment, not `step`)."""
        return isinstance(value, TensorRef) and len(value.shape) == 1 and value.numel in (self.numel, self.fp32.numel)


@dataclass(frozen=True)
class RankFiles:
    rank: int
    optim: str
    model: str | None


@dataclass(frozen=True)
class ZeroCheckpoint:
    """Immutable index of a ZeRO checkpoint: what is where, never the tensors themselves."""

    root: str
    tag: str
    stage: int
    world_size: int
    precision: str
    step: int
    ds_version: str
    files: tuple[RankFiles, ...]
    params: tuple[Param, ...]
    buffers: tuple[Buffer, ...]
    tied: Mapping[str, str]
    groups: tuple[ParamGroup, ...]
    partitions: tuple[tuple[Partition, ...], ...]
    module_order: tuple[str, ...]
    model_states: tuple[Mapping[str, Any], ...]
    optim_states: tuple[Mapping[str, Any], ...]
    mp_rank: int = 0  # the model-parallel rank this data-parallel checkpoint belongs to (`mp_rank_XX`)
    # Its groups list their parameters in the optimizer's own order already (`in_optimizer_order`, a
    # planner's virtual source): whatever round-robin flattened is undone, nothing left to undo.
    optimizer_ordered: bool = False

    @property
    def tag_uri(self) -> str:
        return join(self.root, self.tag)

    @property
    def param_by_name(self) -> dict[str, Param]:
        """Parameters by name; of an expert group (whose shards share names and shapes), shard 0's."""
        return {p.name: p for p in self.params if p.shard == 0}

    @property
    def param_by_key(self) -> dict[tuple[int, str], Param]:
        """Every parameter by (shard, name)."""
        return {(p.shard, p.name): p for p in self.params}

    @property
    def expert_parallel(self) -> bool:
        """Whether some param group is partitioned per expert-parallel rank (AutoEP, deepspeed.moe)."""
        return any(g.ep > 1 for g in self.groups)

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    def model_file(self, rank: int = 0) -> str:
        return self.files[rank if self.stage == 3 else 0].model or self.files[0].model or ""

    @property
    def layout(self) -> str:
        return f"ZeRO-{self.stage}, data-parallel {self.world_size}"

    @property
    def kind(self) -> str:
        return "zero"

    def zero_index(self) -> ZeroCheckpoint:
        return self

    def own_entries(self) -> frozenset[str]:
        return frozenset((LATEST, self.tag))

    @property
    def degrees(self) -> Degrees:
        return Degrees(self.world_size, ep=max((g.ep for g in self.groups), default=1))

    @property
    def ds_config(self) -> Any:
        """The config it was trained with, as rank 0 recorded it (`ds_config`; None where it did not)."""
        return self.model_states[0].get("ds_config")

    @property
    def zero_config(self) -> Mapping[str, Any]:
        """The `zero_optimization` section of the config it was trained with."""
        return zero_section(self.ds_config)

    @property
    def optimizer_kind(self) -> str:
        """The DeepSpeed optimizer that laid its partitions out (`partition.ZERO`, `BF16`, `ZERO3`)."""
        return optimizer_kind(self.stage, self.optim_states[0]["optimizer_state_dict"])

    @property
    def is_round_robin(self) -> bool:
        """Whether its param groups are listed as flattened round-robin: saved at ZeRO-1/2 by an optimizer
        that flattens them so (`flattens_round_robin`), and not yet put back in the optimizer's order
        (`optimizer_ordered`)."""
        return not self.optimizer_ordered and self.stage in (1, 2) and self.flattens_round_robin(self.optimizer_kind)

    def flattens_round_robin(self, optimizer: str) -> bool:
        """Whether `optimizer` (`partition.ZERO`, `BF16`, `ZERO3`), built at ZeRO-1/2 from the config this
        run recorded, flattens each param group round-robin: `DeepSpeedZeroOptimizer` with
        `zero_optimization.round_robin_gradients` (BF16_Optimizer and ZeRO-3 ignore the setting). A
        planner asks it of the optimizer DeepSpeed builds at the target (`reshard.flats.target_optimizer`)."""
        return optimizer == ZERO and is_set(self.zero_config, "round_robin_gradients")

    def optimizer_order(self, group: ParamGroup) -> tuple[str, ...]:
        """`group`'s parameters in the optimizer's own order: as flattened, except that round-robin
        (`is_round_robin`) flattens each group over the ranks that partition it, an expert group's over its
        expert data-parallel group (`partition.original_order` undoes it)."""
        order = original_order(len(group.params), self.world_size // group.ep, self.is_round_robin)
        return tuple(group.params[pos] for pos in order)

    def in_optimizer_order(self) -> ZeroCheckpoint:
        """This index with each param group's parameters in the optimizer's own order (`optimizer_order`):
        what a planner that lays the groups out again starts from (asked again, it has nothing to undo)."""
        if not self.is_round_robin:
            return self
        return replace(self, groups=tuple(replace(g, params=self.optimizer_order(g)) for g in self.groups),
                       optimizer_ordered=True)

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the storages its buffers are saved in."""
        return sum(b.ref.storage_numel * b.ref.itemsize for b in self.buffers)

    @property
    def tensors_per_partition(self) -> int:
        """How many partition-sized tensors each rank's flat group has: the fp32 weights and the moments."""
        part = self.partitions[0][0]
        return 1 + sum(1 for ref in part.state.values() if part.is_moment(ref))

    def summary(self) -> dict[str, Any]:
        """What the checkpoint is, for a report: layout, stage, world size, precision, step, sizes."""
        return {
            "layout": self.layout,
            "stage": self.stage,
            "world_size": self.world_size,
            "precision": self.precision,
            "step": self.step,
            "ds_version": self.ds_version,
            "params": len(self.params),
            "numel": self.numel,
            "frozen": sum(p.frozen for p in self.params),
            "tied": len(self.tied),
            "buffers": len(self.buffers),
            "param_groups": len(self.groups),
        }

    def model_tensors(self) -> tuple[ModelTensor, ...]:
        """The full model in state-dict order, tied aliases left out (see `tied`): trained parameters
        from their fp32 master fragments, frozen ones from their saved copies (ZeRO-3: per-rank pieces,
        padding cut), buffers as saved. An expert-parallel index holds expert-local shards under
        DeepSpeed's names: its layout's reader (`autoep`, `moe`) gives the model instead."""
        assert not self.expert_parallel, "an expert-parallel index is read through its layout's reader"
        params = self.param_by_name
        buffers = {b.name: b for b in self.buffers}
        names = [n for n in self.module_order if n in params or n in buffers]
        names += [n for n in [*params, *buffers] if n not in names]
        out = []
        checked: set[int] = set()
        for name in names:
            if name in self.tied:
                continue
            if name in buffers:
                ref = buffers[name].ref
                out.append(ModelTensor(name, ref.shape, ref.dtype, "buffer", (whole_run(ref, name),)))
                continue
            param = params[name]
            runs = self.param_runs(param, checked)
            check_coverage(name, param.numel, runs)
            dtype = param.dtype if param.frozen else "float32"
            out.append(ModelTensor(name, param.shape, dtype, "frozen" if param.frozen else "param", runs))
        return tuple(out)

    def param_runs(self, param: Param, checked: set[int] | None = None) -> tuple[Run, ...]:
        """The runs that hold `param`: fp32 master fragments when trained, its saved copies when frozen."""
        return self.frozen_runs(param) if param.frozen else self.trainable_runs(param, checked)

    def trainable_runs(self, param: Param, checked: set[int] | None = None) -> tuple[Run, ...]:
        """The fp32 master-weight runs of a trainable parameter, one per fragment. `checked` holds the
        ids of partition tensors already found contiguous (each is checked once, not per fragment)."""
        runs = []
        checked = set() if checked is None else checked
        for frag in param.fragments:
            part = self.partitions[frag.rank][frag.group]
            fp32 = part.fp32
            if id(fp32) not in checked:
                contiguous(fp32, param.name)
                checked.add(id(fp32))
            if frag.offset + frag.numel > fp32.numel:
                raise CheckpointError(
                    f"{param.name}: its fragment on rank {frag.rank} reaches element {frag.offset + frag.numel} of "
                    f"param group {frag.group}, but {part.fp32.uri} saved {part.fp32.numel}", uri=part.fp32.uri,
                    rank=frag.rank, tensor=param.name,
                    hint="the rank files do not belong together; run `ckptflow validate`",
                )
            runs.append(Run(fp32, frag.offset, frag.numel, frag.param_offset))
        return tuple(runs)

    def frozen_runs(self, param: Param) -> tuple[Run, ...]:
        """A frozen parameter's runs: ZeRO-3 per-rank pieces of ceil(numel / world size) elements, padding
        cut; ZeRO-1/2 one full tensor (the module copy, the only value a frozen parameter has)."""
        if self.stage != 3 or len(param.frozen_pieces) == 1 and self.world_size == 1:
            if len(param.frozen_pieces) != 1:
                raise CheckpointError(f"frozen parameter {param.name} has {len(param.frozen_pieces)} saved copies, "
                                      "expected 1", tensor=param.name, hint="run `ckptflow validate` on the source")
            return (Run(contiguous(param.frozen_pieces[0], param.name), 0, param.numel, 0),)
        piece = zero3_piece(param.numel, self.world_size)
        runs = []
        for rank, ref in enumerate(param.frozen_pieces):
            take = zero3_real(param.numel, self.world_size, rank)
            if take:
                runs.append(Run(contiguous(ref, param.name), 0, take, rank * piece))
        return tuple(runs)


@dataclass(frozen=True)
class ModelTensor:
    """One tensor of the full model: its name and shape, the dtype its runs are stored in (fp32 masters
    for trained parameters, the module's dtype for frozen ones, a buffer's own dtype), and its runs."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    kind: str  # "param", "frozen" or "buffer"
    runs: tuple[Run, ...]

    @property
    def numel(self) -> int:
        return element_count(self.shape)


@dataclass(frozen=True)
class Degrees:
    """A checkpoint's parallel degrees: data, tensor, pipeline and expert parallel. DeepSpeed runs it on
    `ranks` = dp x tp x pp processes; the expert-parallel degree divides the data-parallel ranks."""

    dp: int
    tp: int = 1
    pp: int = 1
    ep: int = 1

    @property
    def ranks(self) -> int:
        return self.dp * self.tp * self.pp


class Partitioned(Protocol):
    """What every reader gives the consolidate and reshard steps, whatever the layout: where the
    checkpoint is (`root`, `tag`), what trained it (`stage`, `precision`, `step`, `ds_version`), how it
    is partitioned (`world_size`, the data-parallel size, and `degrees`), its layout `kind` (what the
    steps pick their planner by), the ZeRO index under it, the folder entries it owns,
    the full model as tensors, the tied aliases left out of them, and a summary for reports. Read-only:
    the indexes are frozen."""

    @property
    def root(self) -> str: ...

    @property
    def tag(self) -> str: ...

    @property
    def tag_uri(self) -> str: ...

    @property
    def step(self) -> int: ...

    @property
    def stage(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def precision(self) -> str: ...

    @property
    def ds_version(self) -> str: ...

    @property
    def tied(self) -> Mapping[str, str]: ...

    @property
    def layout(self) -> str: ...

    @property
    def kind(self) -> str:
        """The layout kind, which names the reshard family (`reshard.plan`) and the shapes it allows:
        "zero", "zero0", "autotp", "pipeline", "megatron", "autoep", "moe" or "optimizer-shards"."""
        ...

    @property
    def degrees(self) -> Degrees: ...

    def zero_index(self) -> ZeroCheckpoint | None:
        """The data-parallel ZeRO index it is made of (itself, or an expert-parallel checkpoint's), None
        for layouts without one."""
        ...

    def own_entries(self) -> frozenset[str]:
        """The names in the checkpoint folder that are this checkpoint's own (`latest` and its tag folder,
        or a shard folder's rank files): what a reshard writes anew rather than carries."""
        ...

    def model_tensors(self) -> tuple[ModelTensor, ...]: ...

    def summary(self) -> dict[str, Any]: ...
