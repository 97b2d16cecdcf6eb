"""The reader of optimizer-shard folders: ZeRO-1/2 optimizer states saved one file per rank with
`torch.save(optimizer.state_dict(), ...)`, as seed 002's Accelerate script does (`optimizer.{rank:02d}.pt`).

Each file is exactly the `optimizer_state_dict` that `engine.save_checkpoint` stores in
`zero_pp_rank_<r>_mp_rank_00_optim_states.pt` (`DeepSpeedZeroOptimizer.state_dict()`, DeepSpeed 0.19.8):
the loss scaler, `clip_grad`, `base_optimizer_state`, `single_partition_of_fp32_groups` (without their
tail padding), `zero_stage`, `group_paddings`, `param_alignment_paddings`, `partition_count`,
`ds_version` and `param_slice_mappings`. There is no model-states file beside them: each parameter's
name and size come from `param_slice_mappings` (per param group, per rank: name -> its fragment's start
and size in that rank's partition); its shape from the model weights saved beside the shards (a
safetensors file or index, as `save_pretrained` writes them, or a `pytorch_model.bin`) when there are
some, else it is kept flat (enough to reshard; consolidation then needs the model's config,
`with_shapes`). The index is a `ZeroCheckpoint` (`OptimizerShards`), so validate, reshard and
consolidate take their usual paths.

Which files are the shards is found by content and by the numbers in their names (`name_ranks`): the
folder's files are grouped by their names with every run of digits taken out (`optimizer.00.pt` and
`optimizer.01.pt` are one family); a family is the shards when its files are torch archives holding a
ZeRO-1/2 optimizer state, and the one number that varies between them is the rank. Two families of
optimizer states, two numbers that vary, one rank named twice, mixed zero-padding, a rank missing, or
a count of files other than the recorded `partition_count` are refused, naming the files.

The shards do not record the run's `zero_optimization` settings: they are read as DeepSpeed lays
parameters out by default. A run with `round_robin_gradients` (and no `parameter_alignment`) records
its parameter mapping as if it had kept the model's order, so its shards cannot be told apart.
"""

from __future__ import annotations

import posixpath
import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ckptflow.errors import CkptflowError, ConfigError, option
from ckptflow.formats.deepspeed.inspection import Inspection, StopReading, open_rank_file
from ckptflow.formats.deepspeed.model import RankFiles, ZeroCheckpoint
from ckptflow.formats.deepspeed.readers.zero import check_steps, optimizer_step, read_partitions
from ckptflow.formats.torch.tensorref import TensorRef
from ckptflow.formats.torch.unpickler import TORCH_ONLY, PickledObject
from ckptflow.formats.torch.zipdir import open_archive
from ckptflow.plumbing.sizes import element_count
from ckptflow.plumbing.storage import join, map_files, open_fs
from ckptflow.plumbing.text import excerpt

# What marks a file as a ZeRO-1/2 optimizer state (`DeepSpeedZeroOptimizer.state_dict()`).
SHARD_KEYS = ("base_optimizer_state", "single_partition_of_fp32_groups", "partition_count", "param_slice_mappings")
_DIGITS = re.compile(r"(\d+)")
_ZIP_MAGIC = b"PK\x03\x04"
# Files of a family opened to tell whether it holds optimizer states (the first few, by name).
_PROBES = 3
# The model weights beside the shards that give parameter shapes, in the order they are looked for.
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
_HINT = ("save the model beside the shards (`save_pretrained`) or give the model's config (`--config FOLDER` or "
         "`--config ORG/NAME`)")


@dataclass(frozen=True)
class ShardNames:
    """How the shard files are named: a name split around its runs of digits (text, digits, text, ...),
    which run is the rank (zero-padded to `width`), and which runs are the number of ranks
    (`shard-0-of-4.pt`), rewritten with it."""

    parts: tuple[str, ...]
    rank_field: int
    width: int
    count_fields: tuple[int, ...] = ()

    def name(self, rank: int, world_size: int) -> str:
        """The file of `rank` at `world_size` ranks."""
        out = list(self.parts)
        for field, i in enumerate(range(1, len(out), 2)):
            if field == self.rank_field:
                out[i] = f"{rank:0{self.width}d}"
            elif field in self.count_fields:
                out[i] = f"{world_size:0{len(self.parts[i])}d}"
        return "".join(out)

    @property
    def pattern(self) -> str:
        """The names as a format string: `optimizer.{rank:02d}.pt`, `shard-{rank}-of-{world_size}.pt`."""
        out = [p.replace("{", "{{").replace("}", "}}") if i % 2 == 0 else p for i, p in enumerate(self.parts)]
        for field, i in enumerate(range(1, len(out), 2)):
            if field == self.rank_field:
                out[i] = "{rank:0%dd}" % self.width if self.width > 1 else "{rank}"
            elif field in self.count_fields:
                out[i] = "{world_size}"
        return "".join(out)

    def with_count(self, world_size: int) -> ShardNames:
        """These names with every constant number equal to `world_size` taken for the count of ranks."""
        digits = self.parts[1::2]
        counts = tuple(f for f, d in enumerate(digits) if f != self.rank_field and int(d) == world_size)
        return replace(self, count_fields=counts)


def family(name: str) -> tuple[str, ...]:
    """A file name with its runs of digits taken out: the names of one family of shards agree on it."""
    return tuple(_DIGITS.split(name)[0::2])


def name_ranks(names: Sequence[str]) -> tuple[ShardNames, dict[int, str]]:
    """The naming of one family of shard files and each file by rank; pure. `ValueError` with a
    one-line reason (naming the files) when the names do not say the rank unambiguously."""
    split = [tuple(_DIGITS.split(n)) for n in sorted(names)]
    fields = [s[1::2] for s in split]
    count = len(fields[0]) if fields else 0
    if not fields or count == 0 or any(len(f) != count for f in fields):
        raise ValueError(f"the names {_listed(names)} hold no number, or not the same numbers, to tell the ranks by")
    varying = [i for i in range(count) if len({f[i] for f in fields}) > 1]
    if len(varying) > 1:
        raise ValueError(f"two numbers vary between the names ({_listed(names)}), so they do not say which is the "
                         "rank; rename the files so that only the rank differs")
    if varying:
        rank_field = varying[0]
    else:
        zeros = [i for i in range(count) if int(fields[0][i]) == 0]
        if len(zeros) != 1:
            raise ValueError(f"the name {names[0]} holds {'no' if not zeros else 'more than one'} 0 to take for rank 0")
        rank_field = zeros[0]
    by_rank: dict[int, str] = {}
    for parts, f in zip(split, fields):
        rank, name = int(f[rank_field]), "".join(parts)
        if rank in by_rank:
            raise ValueError(f"{by_rank[rank]} and {name} both name rank {rank}; remove the one left over from another "
                             "save")
        by_rank[rank] = name
    digits = [f[rank_field] for f in fields]
    padded = {len(d) for d in digits if len(d) > 1 and d.startswith("0")}
    if padded and (len(padded) > 1 or {len(d) for d in digits} != padded):
        raise ValueError(f"the names {_listed(names)} mix zero-padded and unpadded rank numbers; they come from "
                         "different saves")
    width = padded.pop() if padded else 1
    return ShardNames(split[0], rank_field, width), dict(sorted(by_rank.items()))


def _listed(names: Sequence[str], most: int = 4) -> str:
    shown = ", ".join(sorted(names)[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def is_optimizer_state(obj: Any) -> bool:
    """Whether an unpickled file holds a ZeRO-1/2 optimizer's `state_dict()` (not a whole checkpoint file)."""
    return isinstance(obj, Mapping) and all(k in obj for k in SHARD_KEYS)


@dataclass(frozen=True)
class OptimizerShards(ZeroCheckpoint):
    """A folder of per-rank ZeRO-1/2 optimizer states (`root`; `tag` is ""), read as a `ZeroCheckpoint`
    whose model states are made up from the shards: `names` says how the files are named, `shapes_from`
    where the parameter shapes came from (None: each parameter is flat, its shape unknown)."""

    names: ShardNames | None = None
    shapes_from: str | None = None

    @property
    def tag_uri(self) -> str:
        return self.root

    @property
    def kind(self) -> str:
        """The layout kind `reshard.shape` plans by."""
        return "optimizer-shards"

    @property
    def layout(self) -> str:
        pattern = self.names.pattern if self.names else "?"
        return f"optimizer shards {pattern}, ZeRO-{self.stage}, data-parallel {self.world_size}"

    @property
    def has_shapes(self) -> bool:
        return self.shapes_from is not None

    def shard_names(self) -> tuple[str, ...]:
        """The shard files by rank."""
        return tuple(posixpath.basename(f.optim) for f in self.files)

    def own_entries(self) -> frozenset[str]:
        return frozenset(self.shard_names())

    def summary(self) -> dict[str, Any]:
        out = super().summary()
        out["pattern"] = self.names.pattern if self.names else None
        out["files"] = list(self.shard_names())
        out["shapes_from"] = self.shapes_from
        where = (f"parameter shapes from {self.shapes_from}" if self.shapes_from else
                 "no model weights beside the shards: parameters are known by size, not shape (enough to reshard; "
                 f"consolidate needs {option('config')})")
        out["notes"] = [f"ranks 0-{self.world_size - 1}: {', '.join(self.shard_names()[:2])}"
                        f"{' ...' if self.world_size > 2 else ''}; {where}"]
        return out

    def with_shapes(self, shapes: Mapping[str, tuple[int, ...]], source: str) -> OptimizerShards:
        """This index with each parameter's shape from `shapes` (a model's, named by `source`); a
        `ConfigError` names the first parameter whose size differs or that `shapes` lacks."""
        params = []
        for p in self.params:
            shape = shapes.get(p.name)
            if shape is None:
                raise ConfigError(f"{source} has no parameter {p.name}, which the optimizer shards in {self.root} "
                                  "hold; it describes another model", code="config-mismatch", file=source,
                                  tensor=p.name, hint="give the config of the model that was trained")
            if element_count(shape) != p.numel:
                raise ConfigError(f"{source} gives {p.name} the shape {list(shape)} ({element_count(shape):,} "
                                  f"elements), but the optimizer shards in {self.root} hold {p.numel:,}",
                                  code="config-mismatch", file=source, tensor=p.name, expected=p.numel,
                                  actual=element_count(shape), hint="give the config of the model that was trained")
            params.append(replace(p, shape=tuple(shape)))
        return replace(self, params=tuple(params), shapes_from=source)


def find_shards(st: Inspection) -> tuple[ShardNames, dict[int, str]] | None:
    """The shard files of the folder `st.root` by rank, and how they are named; None when no family of
    its files holds optimizer states. An ambiguity is a problem added to `st` (and `StopReading`)."""
    fs, path = open_fs(st.root)
    try:
        entries = fs.ls(path, detail=True)
    except (FileNotFoundError, NotADirectoryError):
        return None
    names = sorted(posixpath.basename(e["name"].rstrip("/")) for e in entries if e.get("type") == "file")
    families: dict[tuple[str, ...], list[str]] = {}
    for name in names:
        if _DIGITS.search(name):
            families.setdefault(family(name), []).append(name)
    found = [members for members in families.values() if _holds_optimizer_state(st, members)]
    if not found:
        return None
    if len(found) > 1:
        st.add("ambiguous-shards", f"{st.root} holds optimizer states under {len(found)} name patterns ("
               f"{', '.join(m[0] for m in found)}); keep the files of one save, one pattern, in the folder",
               file=join(st.root, found[1][0]))
        raise StopReading
    try:
        return name_ranks(found[0])
    except ValueError as exc:
        st.add("ambiguous-shards", f"{st.root}: {exc}", file=join(st.root, found[0][0]))
        raise StopReading from None


def _holds_optimizer_state(st: Inspection, members: Sequence[str]) -> bool:
    """Whether one of the family's first files is a torch archive holding a ZeRO-1/2 optimizer state."""
    fs, path = open_fs(st.root)
    for name in members[:_PROBES]:
        try:
            with fs.open(posixpath.join(path, name), "rb") as fh:
                if fh.read(4) != _ZIP_MAGIC:
                    continue
        except OSError:
            continue
        probe = Inspection(st.root, "", allowed=st.allowed, cache=st.cache)
        if is_optimizer_state(open_rank_file(probe, join(st.root, name), rank=0)):
            return True
    return False


def read_optimizer_shards(st: Inspection, found: tuple[ShardNames, dict[int, str]]) -> OptimizerShards:
    """The index of the shard folder `st.root` (`find_shards` found its files), checked as a tag folder's
    rank files are: every rank present, each an optimizer state that agrees with the others."""
    names, by_rank = found
    uris = {rank: join(st.root, name) for rank, name in by_rank.items()}
    parsed = map_files(lambda item: open_rank_file(st, item[1], item[0]), list(uris.items()), list(uris.values()))
    osds = dict(zip(uris, parsed))
    st.stop_if_any()
    for rank, osd in osds.items():
        _check_shard(st, osd, uris[rank], rank)
    st.stop_if_any()
    world = _world_size(st, osds, uris)
    names = names.with_count(world)
    missing = [r for r in range(world) if r not in osds]
    for rank in missing[:8]:
        st.add("rank-missing", f"rank {rank} of {world} is missing: expected {names.name(rank, world)} in {st.root} "
               f"({by_rank[min(by_rank)]} records {world} partitions); copy it from the save, or the save is "
               "incomplete", file=join(st.root, names.name(rank, world)), rank=rank)
    if len(missing) > 8:
        st.add("rank-missing", f"{len(missing) - 8} more ranks of {world} are missing in {st.root}", file=st.root)
    for rank in [r for r in osds if r >= world]:
        st.add("rank-extra", f"{by_rank[rank]} is rank {rank}, beyond the {world} partitions the shards record; it is "
               "left over from another save: remove it", file=uris[rank], rank=rank)
    st.stop_if_any()
    ordered = [osds[r] for r in range(world)]
    optim_uris = [uris[r] for r in range(world)]
    stage = ordered[0].get("zero_stage", 1)
    precision, shapes, shapes_from = _beside(st, ordered)
    model0 = {
        "module": {}, "param_shapes": _param_shapes(st, ordered, optim_uris, shapes), "buffer_names": [],
        "frozen_param_shapes": {}, "shared_params": {}, "dp_world_size": world,
        "ds_version": ordered[0].get("ds_version"),
        "ds_config": {"zero_optimization": {"stage": stage}, "bf16": {"enabled": precision == "bf16"},
                      "fp16": {"enabled": precision == "fp16"}},
    }
    st.stop_if_any()
    optims = [{"optimizer_state_dict": osd} for osd in ordered]
    params, groups, partitions, tied = read_partitions(st, stage, world, precision, [model0], optims,
                                                       [optim_uris[0]], optim_uris)
    st.stop_if_any()
    check_steps(st, partitions, optim_uris)
    st.stop_if_any()
    return OptimizerShards(
        root=st.root, tag="", stage=stage, world_size=world, precision=precision,
        step=_step(partitions), ds_version=str(model0["ds_version"]),
        files=tuple(RankFiles(r, optim_uris[r], None) for r in range(world)), params=params, buffers=(), tied=tied,
        groups=groups, partitions=partitions, module_order=tuple(p.name for p in params),
        model_states=(model0,), optim_states=tuple(optims), names=names,
        shapes_from=shapes_from if shapes is not None else None,
    )


def _check_shard(st: Inspection, osd: Any, uri: str, rank: int) -> None:
    if not isinstance(osd, Mapping):
        return  # open_rank_file added the problem
    if not is_optimizer_state(osd):
        stage = osd.get("zero_stage")
        if "fp32_flat_groups" in osd and stage == 3:
            st.add("unsupported-layout", f"rank {rank}: {uri} is a ZeRO-3 optimizer state, which records no parameter "
                   "names; ckptflow reads torch.save'd ZeRO-1/2 optimizer states only: save with "
                   "engine.save_checkpoint instead", file=uri, rank=rank)
            return
        lacks = [k for k in SHARD_KEYS if k not in osd]
        st.add("corrupt-file", f"rank {rank}: {uri} is a torch file but not a ZeRO-1/2 optimizer state (no "
               f"{', '.join(lacks)}); it was replaced or written by another tool", file=uri, rank=rank)
        return
    if isinstance(osd.get("base_optimizer_state"), list):
        st.add("unsupported-layout", f"rank {rank}: {uri} was saved with zero_optimization.elastic_checkpoint; "
               "DeepSpeed already loads it at any world size", file=uri, rank=rank)


def _world_size(st: Inspection, osds: Mapping[int, Mapping[str, Any]], uris: Mapping[int, str]) -> int:
    """The partition count every shard records (a list per param group, all alike for a dense model)."""
    counts: dict[int, Any] = {}
    for rank, osd in osds.items():
        count = osd.get("partition_count")
        values = count if isinstance(count, list) else [count]
        if not values or not all(type(v) is int and v >= 1 for v in values) or len(set(values)) != 1:
            st.add("corrupt-file" if not all(type(v) is int for v in values) else "unsupported-layout",
                   f"rank {rank}: {uris[rank]} records a partition count of {excerpt(count)}; ckptflow reads shards of "
                   "a data-parallel ZeRO-1/2 run, partitioned over every rank", file=uris[rank], rank=rank)
            continue
        counts[rank] = values[0]
    st.stop_if_any()
    first = min(counts)
    for rank, count in counts.items():
        if count != counts[first]:
            st.add("world-size-mismatch", f"rank {rank}: {uris[rank]} records {count} partitions but "
                   f"{uris[first]} records {counts[first]}; the folder mixes saves of different world sizes: keep "
                   "the files of one save", file=uris[rank], rank=rank)
    st.stop_if_any()
    return int(counts[first])


def _beside(st: Inspection, osds: Sequence[Mapping[str, Any]]
            ) -> tuple[str, dict[str, tuple[int, ...]] | None, str | None]:
    """The training precision and the parameter shapes the model weights beside the shards say (their
    dtype and shapes), and which file said them; ("unknown", None, None) without weights."""
    fs, path = open_fs(st.root)
    for name in WEIGHT_FILES:
        if not fs.isfile(posixpath.join(path, name)):
            continue
        try:
            tensors = _weights(st, name)
        except (CkptflowError, OSError, ValueError) as exc:
            st.add("corrupt-file", f"the model weights beside the shards cannot be read ({exc}); fix or remove "
                   f"{join(st.root, name)}", file=join(st.root, name))
            return "unknown", None, None
        names = {n for m in osds[0].get("param_slice_mappings") or () if isinstance(m, Mapping) for n in m}
        dtypes = {dtype for n, (dtype, _) in tensors.items() if n in names}
        precision = _PRECISIONS.get(dtypes.pop(), "unknown") if len(dtypes) == 1 else "unknown"
        return precision, {n: shape for n, (_, shape) in tensors.items()}, name
    return "unknown", None, None


# The training precision that model weights of a dtype (safetensors' name, or torch's) were saved in.
_PRECISIONS = {"BF16": "bf16", "F16": "fp16", "F32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def _weights(st: Inspection, name: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The tensors of the model weights file `name` beside the shards: name -> (dtype, shape), read from
    safetensors headers or a torch archive's pickle, never the tensors."""
    from ckptflow.formats.hf import read_safetensors_header

    uri = join(st.root, name)
    if name.endswith(".bin"):
        obj = open_archive(uri, TORCH_ONLY, cache=st.cache).obj
        if not isinstance(obj, Mapping):
            raise ValueError(f"{uri} holds no state dict")
        return {k: (v.dtype, tuple(v.shape)) for k, v in obj.items() if isinstance(v, TensorRef)}
    files = _index_files(uri, st.root) if name.endswith(".json") else [name]
    headers = [read_safetensors_header(join(st.root, f), inside=st.root) for f in files]
    return {t: (info[0], tuple(info[1])) for h in headers for t, info in h.tensors.items()}


def _index_files(uri: str, inside: str) -> list[str]:
    """The safetensors files a `model.safetensors.index.json` names (its weight_map's values, once each)."""
    from ckptflow.plumbing.files import load_json, read_regular

    doc = load_json(read_regular(uri, limit=64 << 20, inside=inside))
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) and "/" not in v for v in weight_map.values()):
        raise ValueError(f"{uri} has no weight_map of file names")
    return sorted(set(weight_map.values()))


def _param_shapes(st: Inspection, osds: Sequence[Mapping[str, Any]], uris: Sequence[str],
                  shapes: Mapping[str, tuple[int, ...]] | None) -> list[OrderedDict[str, tuple[int, ...]]]:
    """Each param group's parameters in flattening order with their shapes: names, sizes and order from
    every rank's `param_slice_mappings`, shapes from `shapes` (the model beside) or flat."""
    groups = osds[0].get("single_partition_of_fp32_groups")
    out: list[OrderedDict[str, tuple[int, ...]]] = []
    for g in range(len(groups) if isinstance(groups, list) else 0):
        found: dict[str, list[tuple[int, int]]] = {}
        for rank, osd in enumerate(osds):
            flat = (osd.get("single_partition_of_fp32_groups") or [None] * (g + 1))[g]
            paddings = osd.get("group_paddings") or []
            mappings = osd.get("param_slice_mappings") or []
            mapping = mappings[g] if g < len(mappings) else None
            if not isinstance(flat, TensorRef) or not isinstance(mapping, Mapping):
                st.add("corrupt-file", f"rank {rank}: {uris[rank]} has no fp32 partition or parameter mapping for "
                       f"param group {g}; the file is damaged", file=uris[rank], rank=rank)
                return out
            size = flat.numel + (paddings[g] if g < len(paddings) and type(paddings[g]) is int else 0)
            starts = []
            for name, addr in mapping.items():
                start = addr.get("start") if isinstance(addr, PickledObject) else None
                numel = addr.get("numel") if isinstance(addr, PickledObject) else None
                if not (isinstance(name, str) and type(start) is int and type(numel) is int and start >= 0
                        and numel >= 1 and start + numel <= size):
                    st.add("corrupt-file", f"rank {rank}: {uris[rank]} places {excerpt(name)} at {excerpt(start)}+"
                           f"{excerpt(numel)} in a partition of {size} elements; the file is damaged",
                           file=uris[rank], rank=rank)
                    return out
                found.setdefault(name, []).append((rank * size + start, numel))
                starts.append(start)
            if starts != sorted(starts):
                # The mapping lists the parameters in the model's order; placed in another one, the run
                # reordered them (round_robin_gradients with parameter_alignment: DeepSpeed records the real
                # places only then; without alignment it records them as if in order, and nothing tells).
                st.add("unsupported-layout", f"rank {rank}: {uris[rank]} holds param group {g}'s parameters in "
                       "another order than the model's (zero_optimization.round_robin_gradients); the shards do not "
                       "record the setting, and ckptflow reads shards saved without it", file=uris[rank], rank=rank)
                return out
        group: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        for name, pieces in sorted(found.items(), key=lambda item: min(item[1])):
            numel = sum(n for _, n in pieces)
            shape = (shapes or {}).get(name)
            if shapes is not None and shape is not None and element_count(shape) != numel:
                st.add("shape-mismatch", f"the model weights beside the shards give {name} the shape {list(shape)} "
                       f"({element_count(shape):,} elements), but the shards hold {numel:,} for it; the weights are "
                       "from another model: remove them, or save the trained model's beside the shards",
                       file=st.root, rank=None)
            group[name] = tuple(shape) if shape is not None and element_count(shape) == numel else (numel,)
        out.append(group)
    return out


def _step(partitions: Sequence[Sequence[Any]]) -> int:
    """The optimizer step rank 0 records (0 before the first step or when it cannot be read)."""
    try:
        step = optimizer_step(partitions[0]) if partitions else None
    except (CkptflowError, OSError, ValueError):
        return 0
    return int(step) if step is not None and step == step and abs(step) < 2**62 else 0


def read_shard_folder(st: Inspection) -> OptimizerShards | None:
    """The index of the optimizer-shard folder `st.root`, or None when it holds no optimizer states."""
    found = find_shards(st)
    if found is None:
        return None
    return read_optimizer_shards(st, found)


__all__ = ["OptimizerShards", "ShardNames", "find_shards", "name_ranks", "read_shard_folder"]
