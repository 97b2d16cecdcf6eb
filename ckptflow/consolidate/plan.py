"""The consolidation plan: which source bytes make which output tensor, in which shard. Pure.

`plan_consolidation(index, options)` lists, for every output tensor, the runs of source elements that
make it (fp32 master-weight fragments for trainable parameters, module copies for frozen ones,
buffers as saved) and packs the tensors into shards as `save_pretrained` does: one `ShardUnit` per
output shard. `plan_batches` cuts one shard's data into bounded read-and-cast batches.
Nothing here reads a byte.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from ckptflow import DEFAULT_DTYPE
from ckptflow.errors import CheckpointError, UnsupportedCheckpointError, option
from ckptflow.formats import hf
from ckptflow.formats.deepspeed.model import ModelTensor, Partitioned
from ckptflow.formats.deepspeed.qkv import check_layout, in_rows, qkv_rows
from ckptflow.formats.deepspeed.readers.model_parallel import ModelParallelCheckpoint
from ckptflow.formats.deepspeed.readers.pipeline import (
    FUSED_QKV,
    FUSED_QKV_WHY,
    bf16_zero0,
    declare_qkv_layout,
    fused_heads,
    fused_qkv,
)
from ckptflow.formats.deepspeed.runs import Run
from ckptflow.formats.torch.tensorref import DTYPE_SIZES
from ckptflow.plumbing.sizes import element_count, parse_size

DEFAULT_CHUNK_BYTES = 32 << 20


# ---- options --------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ConsolidateOptions:
    """How to consolidate.

    `dtype` is "fp32" (`ckptflow.DEFAULT_DTYPE`), "bf16" or "fp16" (torch names such as "bfloat16"
    are accepted too);
    `max_shard_size` is bytes or a string such as "5GB"; `chunk_bytes` bounds each read batch, and so
    the memory per worker (about three batches).
    `config` names where the config, generation config and tokenizer files come from when SRC lacks
    them: a folder (local or a store URL) or a Hub model repo (`org/name`, `hf://org/name`) at
    `config_revision` (a branch, tag or commit; the default branch when None). Its config.json is
    checked against the checkpoint's tensors before anything is committed (`consolidate.config`).
    `strict_pickle` refuses a checkpoint whose pickles name any class outside DeepSpeed's allow-list,
    client state included (`formats.deepspeed.names`).
    `qkv_layout` ("blocks" or "groups") declares how each tensor-parallel rank of a Megatron-style checkpoint
    holds the rows of Megatron's fused `query_key_value`, which no file records (`formats.deepspeed.qkv`): the
    ranks are joined into the rows a model at tensor-parallel degree 1 reads in that layout. Without it such a
    checkpoint at degree 2 or more is refused.
    """

    dtype: str = DEFAULT_DTYPE
    max_shard_size: int | str = "5GB"
    exclude_frozen: bool = False
    workers: int = 4
    verify: bool = True
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    config: str | None = None
    config_revision: str | None = None
    strict_pickle: bool = False
    qkv_layout: str | None = None

    def __post_init__(self) -> None:
        check_layout(self.qkv_layout)
        names = {**hf.OUTPUT_DTYPES, **{v: v for v in hf.OUTPUT_DTYPES.values()}}
        if self.dtype not in names:
            raise ValueError(f"dtype must be one of fp32, bf16, fp16, got {self.dtype!r}")
        short = {v: k for k, v in hf.OUTPUT_DTYPES.items()}
        object.__setattr__(self, "dtype", short.get(self.dtype, self.dtype))
        object.__setattr__(self, "max_shard_size", parse_size(self.max_shard_size))
        if not isinstance(self.workers, int) or self.workers < 1:
            raise ValueError(f"workers must be a positive integer, got {self.workers!r}")
        if self.chunk_bytes < 64:
            raise ValueError(f"chunk_bytes must be at least 64, got {self.chunk_bytes}")
        for name in ("config", "config_revision"):  # "" and spaces mean not set (a form's empty field)
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name} must be a string, got {value!r}")
            object.__setattr__(self, name, (value.strip() or None) if isinstance(value, str) else None)
        if self.config_revision is not None and self.config is None:
            raise ValueError(f"config_revision ({self.config_revision}) needs a config: the Hub repo it is a "
                             "revision of")

    @property
    def torch_dtype(self) -> str:
        """The output dtype as torch names it ("float32", "bfloat16", "float16")."""
        return hf.OUTPUT_DTYPES[self.dtype]


# ---- the plan -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OutputTensor:
    """One tensor of the output: its name, dtype and shape, and the source runs that fill it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    runs: tuple[Run, ...]
    kind: str  # "param", "frozen" or "buffer"

    @property
    def numel(self) -> int:
        return element_count(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * hf.itemsize(self.dtype)


@dataclass(frozen=True)
class ShardUnit:
    """One output shard: an independent unit of work."""

    index: int
    filename: str
    tensors: tuple[OutputTensor, ...]

    @property
    def nbytes(self) -> int:
        """Tensor bytes in this shard (the header not counted)."""
        return sum(t.nbytes for t in self.tensors)

    @property
    def source_bytes(self) -> int:
        return sum(r.numel * r.ref.itemsize for t in self.tensors for r in t.runs)

    def file(self) -> hf.SafetensorsFile:
        return hf.safetensors_file([(t.name, t.dtype, t.shape) for t in self.tensors], {"format": "pt"})


@dataclass(frozen=True)
class ConsolidationPlan:
    """Everything `run_unit` and `finalize` need, computed from the index alone."""

    root: str
    tag: str
    step: int
    stage: int
    world_size: int
    precision: str
    ds_version: str
    options: ConsolidateOptions
    units: tuple[ShardUnit, ...]
    tied: Mapping[str, str]
    excluded: tuple[str, ...]
    source_layout: str = ""  # e.g. "ZeRO-3, data-parallel 2": what the reader recognized
    notes: tuple[str, ...] = ()  # what the reader says about the source (e.g. what it cannot name)

    @property
    def dtype(self) -> str:
        return self.options.torch_dtype

    @property
    def sharded(self) -> bool:
        return len(self.units) > 1

    @property
    def total_size(self) -> int:
        return sum(u.nbytes for u in self.units)

    @property
    def total_parameters(self) -> int:
        return sum(t.numel for u in self.units for t in u.tensors if t.kind != "buffer")

    @property
    def source_bytes(self) -> int:
        return sum(u.source_bytes for u in self.units)

    @property
    def weight_map(self) -> dict[str, str]:
        return {t.name: u.filename for u in self.units for t in u.tensors}

    @property
    def file_bytes(self) -> int:
        """Bytes of all shard files, headers included."""
        return sum(u.file().file_size for u in self.units)


def plan_consolidation(index: Partitioned, options: ConsolidateOptions | None = None) -> ConsolidationPlan:
    """The consolidation of `index` under `options`: output tensors in state-dict order, packed into
    shards as `save_pretrained` packs them. Pure: reads nothing.

    Tied parameters are written once, under the owner's name (transformers ties the alias on load);
    frozen parameters are left out with `exclude_frozen`; buffers keep their dtype.
    """
    options = options or ConsolidateOptions()
    _check_joinable(index, options.qkv_layout)
    _check_exact(index, options)
    tensors: list[OutputTensor] = []
    excluded: list[str] = []
    for t in _in_layout(index, index.model_tensors(), options.qkv_layout):
        if t.kind == "frozen" and options.exclude_frozen:
            excluded.append(t.name)
            continue
        dtype = t.dtype if t.kind == "buffer" else options.torch_dtype
        tensors.append(OutputTensor(t.name, dtype, t.shape, t.runs, t.kind))
    if not tensors:
        raise CheckpointError(
            f"{index.root}/{index.tag} has nothing to write: no parameters or buffers"
            + (" once frozen parameters are excluded" if excluded else ""), uri=index.root,
            hint=(f"leave {option('exclude_frozen')} off" if excluded
                  else "check the source is the checkpoint you meant"),
        )
    written = {t.name for t in tensors}
    shards = hf.pack_shards([(t.name, t.nbytes) for t in tensors], parse_size(options.max_shard_size))
    by_name = {t.name: t for t in tensors}
    units = tuple(
        ShardUnit(i, hf.shard_filename(i, len(shards)), tuple(by_name[n] for n in shard))
        for i, shard in enumerate(shards)
    )
    return ConsolidationPlan(
        root=index.root, tag=index.tag, step=index.step, stage=index.stage, world_size=index.world_size,
        precision=index.precision, ds_version=index.ds_version, source_layout=index.layout, options=options,
        units=units,
        tied={a: o for a, o in index.tied.items() if o in written}, excluded=tuple(excluded),
        notes=tuple(index.summary().get("notes") or ()),
    )


def _check_joinable(index: Partitioned, qkv_layout: str | None) -> None:
    """A Megatron-style checkpoint at tensor-parallel degree 2 or more holding Megatron's fused
    `query_key_value` is refused without the `qkv_layout` its ranks hold it in, as `reshard` refuses a
    tensor-parallel change of it: its ranks' rows joined one after the other are right for the older
    Megatron-DeepSpeed layout only, and the checkpoint does not say which layout it holds
    (`readers.pipeline.FUSED_QKV_WHY`)."""
    if qkv_layout is not None or not _megatron_tp(index):
        return
    assert isinstance(index, ModelParallelCheckpoint)
    fused = fused_qkv(index)
    if fused is not None:
        raise UnsupportedCheckpointError(
            f"{index.root}/{index.tag}: {fused} {FUSED_QKV_WHY}", code="unsupported-shape", uri=index.root,
            tensor=fused, hint=f"{declare_qkv_layout()}, or join its {index.tp} tensor-parallel ranks with the "
            "Megatron-DeepSpeed version that saved it")


def _megatron_tp(index: Partitioned) -> bool:
    return isinstance(index, ModelParallelCheckpoint) and index.kind == "megatron" and index.tp > 1


def _in_layout(index: Partitioned, tensors: Sequence[ModelTensor], qkv_layout: str | None) -> list[ModelTensor]:
    """`tensors`, each fused attention projection of the Megatron-style checkpoint `index` (at tensor-parallel
    degree 2 or more) with its rows, weight and bias alike, where a model at degree 1 reads them in `qkv_layout`
    (`formats.deepspeed.qkv`), the heads from the run's `args`. `UnsupportedCheckpointError` naming the first
    that cannot be."""
    if qkv_layout is None or not _megatron_tp(index):
        return list(tensors)
    assert isinstance(index, ModelParallelCheckpoint)
    out = []
    for t in tensors:
        if FUSED_QKV not in t.name:
            out.append(t)
            continue
        try:
            heads = fused_heads(index, t.name, t.shape[0])
        except UnsupportedCheckpointError as exc:
            raise UnsupportedCheckpointError(
                f"{index.root}/{index.tag}: {t.name} cannot be joined in the {qkv_layout} layout: {exc}",
                code="unsupported-shape", uri=index.root, tensor=t.name,
                hint=f"join its {index.tp} tensor-parallel ranks with the Megatron-DeepSpeed version that saved "
                     "it") from None
        row = element_count(t.shape[1:])
        out.append(replace(t, runs=in_rows(t.runs, row, qkv_rows(qkv_layout, heads, index.tp, 1)[0])))
    return out


def _check_exact(index: Partitioned, options: ConsolidateOptions) -> None:
    """ZeRO-0 in bf16 or fp16 names only its 16-bit weights (formats/deepspeed/zero0.py): a model in that
    dtype is exact, one in another dtype would be made from rounded weights, not from the masters. A
    PipelineModule's BF16_Optimizer names its masters (`readers.pipeline.bf16_zero0`): any dtype."""
    trained = hf.OUTPUT_DTYPES.get(index.precision)
    if index.stage != 0 or index.precision == "fp32" or trained is None or options.torch_dtype == trained \
            or bf16_zero0(index):  # BF16_Optimizer's partitions name its masters
        return
    raise UnsupportedCheckpointError(
        f"{index.root}/{index.tag} is a {index.layout} checkpoint trained in {index.precision}: it names its weights "
        f"in {index.precision} only (its fp32 masters sit in the optimizer state with no parameter names), so a "
        f"{options.dtype} model made from it would not hold the masters", code="unsupported-precision",
        uri=index.root, expected=index.precision, actual=options.dtype,
        hint=f"consolidate with {option('dtype')} {index.precision}: bit for bit the weights DeepSpeed trained "
             "with; or train with ZeRO-1 or higher for named fp32 masters")


# ---- batches: what one unit reads and writes, chunk by chunk (pure) --------------------------------


@dataclass(frozen=True)
class ByteCopy:
    """Bytes [start, end) of `uri`, elements of `dtype`, copied to byte `dest` of the batch's output
    buffer as `out_dtype` (cast when the two differ). With `rows` > 1 the source bytes are that many
    equal rows, landing `stride` bytes apart from `dest` (a row-parallel shard's rows)."""

    uri: str
    start: int
    end: int
    dtype: str
    dest: int
    out_dtype: str
    rows: int = 1
    stride: int = 0

    @property
    def out_row(self) -> int:
        """Output bytes per row."""
        return (self.end - self.start) // DTYPE_SIZES[self.dtype] // self.rows * DTYPE_SIZES[self.out_dtype]


@dataclass(frozen=True)
class Batch:
    """One bounded step of writing a shard: the data bytes [file_start, file_start + out_nbytes),
    made of `copies` that read `src_nbytes` source bytes in all."""

    file_start: int
    out_nbytes: int
    src_nbytes: int
    copies: tuple[ByteCopy, ...]


def plan_batches(slots: Sequence[tuple[str, int, tuple[Run, ...]]], chunk_bytes: int) -> list[Batch]:
    """Cut a shard's data into batches of at most `chunk_bytes` output bytes and source bytes each.

    `slots` is (output dtype, byte offset in the data section, runs) per tensor in file order.
    Copies of adjacent source bytes to adjacent output bytes are merged into one; a strided run
    becomes one strided copy per batch for its whole rows there.
    """
    batches: list[Batch] = []
    copies: list[ByteCopy] = []
    file_start: int | None = None
    out_used = src_used = 0
    for dtype, begin, runs in slots:
        out_size = DTYPE_SIZES[dtype]
        numel = sum(r.numel for r in runs)
        per_elem = max([out_size] + [r.ref.itemsize for r in runs])
        ordered = sorted(runs, key=lambda r: r.offset)
        pos = 0
        while pos < numel:
            room = (chunk_bytes - max(out_used, src_used)) // per_elem
            if room <= 0:
                assert file_start is not None
                batches.append(Batch(file_start, out_used, src_used, tuple(copies)))
                copies, file_start, out_used, src_used = [], None, 0, 0
                continue
            if file_start is None:
                file_start = begin + pos * out_size
            end = min(numel, pos + room)
            for run in ordered:
                for part in run.within(pos, end):
                    start, stop = part.byte_range
                    _append_copy(copies, ByteCopy(run.ref.uri, start, stop, run.ref.dtype,
                                              out_used + (part.offset - pos) * out_size, dtype,
                                              part.rows, part.stride * out_size))
                    src_used += stop - start
            out_used += (end - pos) * out_size
            pos = end
    if file_start is not None:
        batches.append(Batch(file_start, out_used, src_used, tuple(copies)))
    return batches


def _append_copy(copies: list[ByteCopy], copy: ByteCopy) -> None:
    last = copies[-1] if copies else None
    if last is not None and last.rows == copy.rows == 1 and \
            (last.uri, last.end, last.dtype, last.out_dtype) == (copy.uri, copy.start, copy.dtype, copy.out_dtype) and \
            last.dest + (last.end - last.start) // DTYPE_SIZES[last.dtype] * DTYPE_SIZES[last.out_dtype] == copy.dest:
        copies[-1] = ByteCopy(last.uri, last.start, copy.end, last.dtype, last.dest, last.out_dtype)
    else:
        copies.append(copy)
