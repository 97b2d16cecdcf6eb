"""What the expert-parallel readers (`autoep`, `moe`) share: the index they give, and the checks of the
per-expert files.

An expert-parallel checkpoint is a data-parallel ZeRO checkpoint (`index.ZeroCheckpoint`, whose
expert param groups are partitioned per expert-parallel rank) plus, at ZeRO-0/1/2, one
`layer_{L}_expert_{E}_mp_rank_00_model_states.pt` per MoE layer and global expert (module-dtype
weights, which DeepSpeed loads back at any data-parallel size) and, for deepspeed.moe at ZeRO-0,
`expp_rank_{e}` optimizer files. The reader turns it into the model's own tensors: `ExpertCheckpoint`
holds them (`model_tensors`), with the ZeRO index and the expert files a reshard needs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ckptflow.errors import CheckpointNotFoundError, CkptflowError
from ckptflow.formats.deepspeed.inspection import Inspection, Listing, check_records
from ckptflow.formats.deepspeed.model import Degrees, ModelTensor, ZeroCheckpoint
from ckptflow.formats.deepspeed.names import EXPERT_FILE_RE, LATEST, expert_file_name
from ckptflow.formats.deepspeed.topology import Topology
from ckptflow.formats.torch.tensorref import TensorRef
from ckptflow.formats.torch.zipdir import open_archive
from ckptflow.plumbing.storage import join, map_files

LAYOUT_NAMES = {"autoep": "AutoEP", "moe": "deepspeed.moe"}


@dataclass(frozen=True)
class ExpertCheckpoint:
    """The index of an AutoEP or deepspeed.moe checkpoint: the model's tensors under the model's own
    names (`model_tensors`), and what a reshard needs: the ZeRO index (`zero`; None at ZeRO-0, whose
    deepspeed.moe model states and optimizers `model0` and `expp` hold) and the per-expert files, which are
    the same at any data-parallel size (`expert_files`, tag-relative)."""

    root: str
    tag: str
    kind: str  # "autoep" or "moe"
    stage: int
    world_size: int  # data-parallel ranks (every rank holds a copy of the dense parameters)
    ep: int  # the largest expert-parallel degree (every layer's, for AutoEP)
    precision: str
    step: int
    ds_version: str
    tensors: tuple[ModelTensor, ...]
    tied: Mapping[str, str]
    zero: ZeroCheckpoint | None = field(repr=False, compare=False)
    expert_files: tuple[str, ...] = ()
    experts: int = 0  # experts over all MoE layers
    # deepspeed.moe at ZeRO-0: rank 0's model states (the whole non-expert module, the recorded config) and
    # each expert-parallel rank's `expp_rank` optimizer, by position (`readers.moe.zero0_index` names it).
    model0: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)
    expp: tuple[Mapping[str, Any], ...] = field(default=(), repr=False, compare=False)

    @property
    def tag_uri(self) -> str:
        return join(self.root, self.tag)

    @property
    def layout(self) -> str:
        return Topology(self.kind, self.stage, self.world_size, ep=self.ep).description

    @property
    def degrees(self) -> Degrees:
        return Degrees(self.world_size, ep=self.ep)

    def zero_index(self) -> ZeroCheckpoint | None:
        return self.zero

    def own_entries(self) -> frozenset[str]:
        return frozenset((LATEST, self.tag))

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self.tensors if t.kind != "buffer")

    def model_tensors(self) -> tuple[ModelTensor, ...]:
        return self.tensors

    def summary(self) -> dict[str, Any]:
        """What the checkpoint is, for a report: layout, degrees, stage, precision, step, sizes."""
        return {
            "layout": self.layout,
            "stage": self.stage,
            "world_size": self.world_size,
            "expert_parallel": self.ep,
            "experts": self.experts,
            "precision": self.precision,
            "step": self.step,
            "ds_version": self.ds_version,
            "params": sum(t.kind != "buffer" for t in self.tensors),
            "numel": self.numel,
            "frozen": sum(t.kind == "frozen" for t in self.tensors),
            "tied": len(self.tied),
            "buffers": sum(t.kind == "buffer" for t in self.tensors),
            **({"param_groups": len(self.zero.groups)} if self.zero is not None else {}),
        }


def check_expert_files(st: Inspection, listing: Listing, experts: Sequence[int], what: str) -> list[str]:
    """Exactly one `layer_{L}_expert_{E}` file for every MoE layer L and global expert E < experts[L]:
    missing and extra ones are problems naming the file, layer and expert. Returns the expected names."""
    expected = [expert_file_name(layer, e) for layer, count in enumerate(experts) for e in range(count)]
    wanted = set(expected)
    for layer, count in enumerate(experts):
        for e in range(count):
            name = expert_file_name(layer, e)
            if name not in listing.names:
                st.add("expert-missing", f"expert {e} of MoE layer {layer} is missing: expected {st.tag}/{name} under "
                       f"{st.root} ({what}); the upload may still be in progress, or the folder was copied in part",
                       file=join(listing.tag_uri, name))
    for name in listing.names:
        m = EXPERT_FILE_RE.match(name)
        if m and name not in wanted:
            layer, e = int(m.group(1)), int(m.group(2))
            why = (f"MoE layer {layer} has {experts[layer]} experts" if layer < len(experts)
                   else f"the model has {len(experts)} MoE layers")
            st.add("expert-extra", f"unexpected file {st.tag}/{name}: {why} ({what}); it is left over from another "
                   "save into the same tag folder: remove it, or re-save the checkpoint into a fresh folder",
                   file=join(listing.tag_uri, name))
    return expected


def open_files(
    st: Inspection, tag_uri: str, names: Iterable[str], label: Callable[[str], str]
) -> dict[str, dict[str, Any]]:
    """The files `names` of the tag folder parsed (in parallel on a store: `plumbing.storage.map_files`);
    unreadable ones are problems, their messages starting with `label(name)`, and absent
    from the result."""
    names = list(names)
    if not names:
        return {}

    def one(name: str) -> dict[str, Any]:
        uri = join(tag_uri, name)
        try:
            archive = open_archive(uri, st.allowed)
            obj = archive.obj
        except CkptflowError as exc:
            code = "expert-missing" if isinstance(exc, CheckpointNotFoundError) else exc.code
            st.add(code, f"{label(name)}: {exc}", file=uri)
            return {}
        except OSError as exc:
            st.add("unreadable-file", f"{label(name)}: cannot read {uri} ({exc}); check access to the store and retry",
                   file=uri)
            return {}
        if not isinstance(obj, dict):
            st.add("corrupt-file", f"{label(name)}: {uri} holds a {type(obj).__name__}, not a DeepSpeed state dict",
                   file=uri)
            return {}
        if (archive.has_records or archive.has_cycles) and not check_records(st, obj, uri, label(name)):
            return {}
        return obj

    objs = map_files(one, names, [join(tag_uri, name) for name in names])
    return {n: o for n, o in zip(names, objs) if o}


def check_expert_file(st: Inspection, tag_uri: str, name: str, obj: Mapping[str, Any],
                      want: Mapping[str, tuple[int, ...]], layer: int, expert: int) -> None:
    """One expert file holds exactly the tensors `want` (key -> shape)."""
    uri = join(tag_uri, name)
    have = {k: tuple(v.shape) for k, v in obj.items() if isinstance(v, TensorRef)}
    if have != dict(want):
        missing = sorted(set(want) - set(have))
        extra = sorted(set(have) - set(want))
        wrong = sorted(k for k in set(want) & set(have) if have[k] != want[k])
        parts = ([f"no {', '.join(missing[:3])}"] if missing else []) + \
                ([f"unexpected {', '.join(extra[:3])}"] if extra else []) + \
                ([f"{k} is {list(have[k])}, expected {list(want[k])}" for k in wrong[:3]])
        st.add("expert-mismatch", f"expert {expert} of MoE layer {layer}: {uri} does not hold that expert's weights "
               f"as the optimizer files describe them ({'; '.join(parts)}); the file is damaged or from another save",
               file=uri)


def ordered(module_order: Sequence[str], tensors: Mapping[str, ModelTensor],
            after: Mapping[str, Sequence[str]] | None = None) -> tuple[ModelTensor, ...]:
    """`tensors` in state-dict order: the module's order, each name in `after` followed by the names it
    lists (the experts of a MoE layer after its router), the rest at the end."""
    out: list[str] = []
    seen: set[str] = set()
    after = after or {}

    def add(name: str) -> None:
        if name in tensors and name not in seen:
            seen.add(name)
            out.append(name)
        for follower in after.get(name, ()):
            add(follower)

    for name in module_order:
        add(name)
    for name in tensors:
        add(name)
    return tuple(tensors[n] for n in out)


def rename_tied(tied: Mapping[str, str], rename: Callable[[str], str]) -> dict[str, str]:
    return {rename(alias): rename(owner) for alias, owner in tied.items()}
