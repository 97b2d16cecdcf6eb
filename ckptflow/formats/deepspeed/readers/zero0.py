"""ZeRO-0 checkpoints (no ZeRO partitioning), read into an index of named weights.

At ZeRO-0 DeepSpeed writes one file per model-parallel rank, `mp_rank_XX_model_states.pt`, written by
data-parallel rank 0 and the same for every data-parallel size: `module` holds the weights (fp32 in
an fp32 run: they are the master weights), and `optimizer` the whole optimizer as a `torch.optim`
state dict. That state dict is keyed by integer index (`state[i]`, `param_groups[g]['params']`), in
the order of the client's param groups, which only the training script knows: nothing in the file
maps an index to a parameter name. So the index names the weights and counts the optimizer state,
and says it cannot name it; consolidation writes the weights.

In a bf16 or fp16 run the module holds 16-bit copies and the fp32 masters sit in unnamed optimizer
state: DeepSpeed 0.19.8 trains both at ZeRO-0 with its FP16_Optimizer, whose `optimizer` entry holds
`optimizer_state_dict` (the base optimizer's, one flat state per param group) and `fp32_groups_flat`,
one flat fp32 tensor per param group. Which parameters a group holds, and in which order, is the
training script's; nothing in the file says it, so the masters cannot be placed. The 16-bit weights
can: after every step FP16_Optimizer copies each master into its 16-bit parameter (a round to nearest
even, the cast `formats.casts` does bit for bit), so the module's weights are exactly the masters
rounded to the training dtype. The index names them, in that dtype; a consolidation in that dtype is
exact, and one in any other is refused (`masters_unnamed`). (bf16 at ZeRO-1 with fp32 gradient
accumulation is DeepSpeed's BF16_Optimizer, which saves named partitions like ZeRO-1 and is read as
such.)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ckptflow.formats.deepspeed.inspection import Inspection, Listing
from ckptflow.formats.deepspeed.model import Degrees, ModelTensor
from ckptflow.formats.deepspeed.names import model_file_name
from ckptflow.formats.deepspeed.readers.zero import model_head
from ckptflow.formats.deepspeed.runs import whole_run
from ckptflow.formats.torch.tensorref import TensorRef
from ckptflow.plumbing.sizes import element_count
from ckptflow.plumbing.storage import join

UNNAMED_OPTIMIZER = ("ZeRO-0 saves the optimizer state by index, and nothing in the checkpoint maps an index to "
                     "a parameter name: it is left out (the weights are named, in `module`)")


def masters_note(precision: str) -> str:
    return (f"the weights are saved in {precision}, exactly the fp32 masters rounded as DeepSpeed rounds them; the "
            f"masters themselves sit unnamed in the optimizer state, so a model is written in {precision} only")


@dataclass(frozen=True)
class Zero0Checkpoint:
    """Index of one model-parallel rank's ZeRO-0 files: named weights, buffers, tied aliases, and the
    optimizer state counted but not named (see the module docstring)."""

    root: str
    tag: str
    world_size: int  # the data-parallel size it was saved at (it loads at any)
    precision: str
    step: int
    ds_version: str
    model_file: str
    tensors: tuple[ModelTensor, ...]
    tied: Mapping[str, str]
    optimizer_params: int  # indices in the optimizer's param groups
    optimizer_groups: int
    optimizer_step: int  # the largest `step` in the optimizer state (FusedAdam advances only the last one's)
    model_states: Mapping[str, Any]
    mp_rank: int = 0
    stage: int = 0
    master_elements: int | None = None  # 16-bit weights: the elements of FP16_Optimizer's flat fp32 masters

    @property
    def tag_uri(self) -> str:
        return join(self.root, self.tag)

    @property
    def layout(self) -> str:
        return f"ZeRO-0, data-parallel {self.world_size}"

    @property
    def degrees(self) -> Degrees:
        return Degrees(self.world_size)

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self.tensors if t.kind != "buffer")

    @property
    def masters_unnamed(self) -> bool:
        """The weights are 16-bit copies of fp32 masters that cannot be placed (see the module docstring)."""
        return self.precision != "fp32"

    @property
    def frozen_unknown(self) -> int | str:
        """Weights the optimizer does not hold (frozen ones); which they are, the file does not say. With
        16-bit weights the optimizer holds flat masters, so only their elements can be counted."""
        if self.master_elements is not None:
            frozen = self.numel - self.master_elements
            return f"{frozen:,} elements" if frozen else 0
        return max(0, sum(t.kind != "buffer" for t in self.tensors) - self.optimizer_params)

    def model_tensors(self) -> tuple[ModelTensor, ...]:
        return self.tensors

    def summary(self) -> dict[str, Any]:
        return {
            "layout": self.layout,
            "stage": 0,
            "world_size": self.world_size,
            "precision": self.precision,
            "step": self.step,
            "ds_version": self.ds_version,
            "params": sum(t.kind != "buffer" for t in self.tensors),
            "numel": self.numel,
            "frozen": self.frozen_unknown,
            "tied": len(self.tied),
            "buffers": sum(t.kind == "buffer" for t in self.tensors),
            "param_groups": self.optimizer_groups,
            "notes": [f"{UNNAMED_OPTIMIZER} ({self._held()})",
                      *([masters_note(self.precision)] if self.masters_unnamed else [])],
        }

    def _held(self) -> str:
        if self.master_elements is not None:
            return f"{self.master_elements:,} fp32 master elements in {self.optimizer_groups} param groups"
        return f"{self.optimizer_params} tensors in {self.optimizer_groups} param groups"


def read_zero0(st: Inspection, listing: Listing, model0: dict[str, Any], *, mp_rank: int = 0, mp_world_size: int = 1,
               where: str | None = None, module: Mapping[str, Any] | None = None) -> Zero0Checkpoint:
    """The index of model-parallel rank `mp_rank`'s ZeRO-0 model states `model0`; problems go to `st`.

    `module` stands in for `model0['module']` where DeepSpeed saves none there (PipelineModule: the
    weights are in the layer files). `where` names the model-parallel rank in messages."""
    uri = listing.model_uri(mp_rank)
    head = model_head(st, model0, uri, mp_world_size)
    st.stop_if_any()
    of = f" ({where})" if where else ""
    for name, match in [*listing.optim_names.items(), *listing.model_names.items()]:
        rank_of = int(match.group(3 if name in listing.optim_names else 2))
        if rank_of == mp_rank and name != model_file_name(0, 0, mp_rank):
            st.add("rank-extra", f"unexpected file {st.tag}/{name}: a ZeRO-0 checkpoint{of} has only "
                   f"{model_file_name(0, 0, mp_rank)}; it is left over from another save into the same tag folder: "
                   "remove it, or re-save the checkpoint into a fresh folder", file=join(listing.tag_uri, name))
    sixteen, masters = head["precision"] != "fp32", None
    optimizer = model0.get("optimizer")
    if sixteen and isinstance(optimizer, Mapping):  # FP16_Optimizer's entry: the base optimizer's state inside
        masters = optimizer.get("fp32_groups_flat")
        optimizer = optimizer.get("optimizer_state_dict")
    groups = optimizer.get("param_groups") if isinstance(optimizer, Mapping) else None
    if not isinstance(groups, list) or not all(isinstance(g, Mapping) and isinstance(g.get("params"), list)
                                               for g in groups):
        inside = " inside FP16_Optimizer's `optimizer_state_dict`" if sixteen else ""
        st.add("corrupt-file", f"{uri}{of} has no ZeRO-0 optimizer state (`optimizer` with param groups{inside}); "
               "the file is damaged or was written by another tool", file=uri)
    module = module if module is not None else model0.get("module")
    if not isinstance(module, Mapping):
        st.add("corrupt-file", f"{uri}{of} holds no module state dict; the file is damaged or was written by "
               "another tool", file=uri)
    st.stop_if_any()
    assert isinstance(optimizer, Mapping) and isinstance(groups, list) and isinstance(module, Mapping)
    buffers = set(model0.get("buffer_names") or [])
    tensors, tied = _module_tensors(module, buffers)
    held = _check_masters(st, masters, groups, tensors, head["precision"], uri, of) if sixteen else None
    state = optimizer.get("state") or {}
    steps = [s.get("step") for s in state.values() if isinstance(s, Mapping)] if isinstance(state, Mapping) else []
    step = max([int(s) for s in steps if isinstance(s, (int, float)) and not isinstance(s, bool)], default=0)
    return Zero0Checkpoint(
        root=st.root, tag=st.tag, world_size=head["world_size"], precision=head["precision"], step=head["step"],
        ds_version=head["ds_version"], model_file=uri, tensors=tensors, tied=tied,
        optimizer_params=sum(len(g["params"]) for g in groups), optimizer_groups=len(groups), optimizer_step=step,
        model_states=model0, mp_rank=mp_rank, master_elements=held,
    )


def _check_masters(st: Inspection, masters: Any, groups: list[Any], tensors: tuple[ModelTensor, ...], precision: str,
                   uri: str, of: str) -> int | None:
    """FP16_Optimizer's masters: one flat fp32 tensor per param group, together no more elements than the
    module's weights (frozen ones have no master). Their order is not in the file (module docstring).
    Returns how many elements they hold."""
    if not isinstance(masters, list) or len(masters) != len(groups) or not all(
            isinstance(m, TensorRef) and m.dtype == "float32" and len(m.shape) == 1 for m in masters):
        st.add("corrupt-file", f"{uri}{of} is a ZeRO-0 checkpoint trained in {precision}, but its optimizer holds "
               f"no flat fp32 master per param group (`fp32_groups_flat`, {len(groups)} expected); the file is "
               "damaged or was written by another tool", file=uri)
        return None
    held: int = sum(m.shape[0] for m in masters)  # 1-D TensorRefs, checked above
    weights = sum(t.numel for t in tensors if t.kind != "buffer")
    if held > weights:
        st.add("corrupt-file", f"{uri}{of} holds {held} fp32 master elements for {weights} weight elements; the "
               "optimizer state is from another model: re-save the checkpoint", file=uri)
    return held


def _module_tensors(module: Mapping[str, Any], buffers: set[str]) -> tuple[tuple[ModelTensor, ...], dict[str, str]]:
    """Every tensor of `module` in its order, aliases (a later name sharing an earlier one's storage,
    offset and shape: a tied weight) left out and returned as alias -> owner."""
    owners: dict[tuple[str, str, int, tuple[int, ...]], str] = {}
    tied: dict[str, str] = {}
    out = []
    for name, ref in module.items():
        if not isinstance(ref, TensorRef):
            continue
        key = (ref.uri, ref.key, ref.storage_offset, ref.shape)
        if name not in buffers and key in owners and element_count(ref.shape):
            tied[name] = owners[key]
            continue
        owners.setdefault(key, name)
        out.append(ModelTensor(name, ref.shape, ref.dtype, "buffer" if name in buffers else "param",
                               (whole_run(ref, name),)))
    return tuple(out), tied


__all__ = ["UNNAMED_OPTIMIZER", "Zero0Checkpoint", "masters_note", "read_zero0"]
