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
training script's; nothing in the file says it, so the masters cannot be placed for certain (a
reshard to another stage places them where exactly one assignment fits: below). The 16-bit weights
can: after every step FP16_Optimizer copies each master into its 16-bit parameter (a round to nearest
even, the cast `formats.casts` does bit for bit), so the module's weights are exactly the masters
rounded to the training dtype. The index names them, in that dtype; a consolidation in that dtype is
exact, and one in any other is refused (`masters_unnamed`). (bf16 at ZeRO-1 with fp32 gradient
accumulation is DeepSpeed's BF16_Optimizer, which saves named partitions like ZeRO-1 and is read as
such.)

Where a ZeRO-0 checkpoint moves to ZeRO-1, 2 or 3 (`reshard`), its optimizer state needs names after
all. `named_groups` finds them from what the file does record, under the one premise that holds for
every training script that builds its param groups by walking the model (DeepSpeed's default group,
`model.parameters()`, the usual decay / no-decay split): each group holds its parameters in the
module's order. Then the parameters are the module's, in order, each in one group (or in none: frozen),
and what the file records pins down which: per index the shape of its Adam moments (fp32), or per group
the size of its flat masters (16-bit; where the sizes fit several, also that each master, rounded to the
training dtype, is its weight over the weight's first `PROBE` elements: `_Agrees`). The assignment is
used only where exactly one fits. In fp16 the target's loss scaler is FP16_Optimizer's carried
(`zero_loss_scaler`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ckptflow.formats.casts import as_array, fp32_to_bf16, fp32_to_fp16
from ckptflow.formats.deepspeed.config import is_set, section, zero_section
from ckptflow.formats.deepspeed.inspection import Inspection, Listing, is_count, shown
from ckptflow.formats.deepspeed.model import Degrees, ModelTensor
from ckptflow.formats.deepspeed.names import DYNAMIC_LOSS_SCALER, LATEST, LOSS_SCALER, model_file_name
from ckptflow.formats.deepspeed.readers.zero import model_head
from ckptflow.formats.deepspeed.runs import whole_run
from ckptflow.formats.torch.tensorref import TensorRef
from ckptflow.formats.torch.unpickler import PickledObject
from ckptflow.plumbing.ranges import read_ranges
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
    def kind(self) -> str:
        return "zero0"

    @property
    def degrees(self) -> Degrees:
        return Degrees(self.world_size)

    def zero_index(self) -> None:
        return None

    def own_entries(self) -> frozenset[str]:
        return frozenset((LATEST, self.tag))

    @property
    def zero_config(self) -> Mapping[str, Any]:
        """The `zero_optimization` section of the config it was trained with."""
        return zero_section(self.model_states.get("ds_config"))

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


# ---- naming the optimizer state -------------------------------------------------------------------------


@dataclass(frozen=True)
class Zero0Group:
    """One param group of a ZeRO-0 optimizer with its parameters named (`named_groups`).

    `masters` are 1-D fp32 tensors: one per parameter, the module's own weight (an fp32 run), or one
    flat tensor over the whole group (a 16-bit run: FP16_Optimizer's `fp32_groups_flat`), the
    parameters end to end in `params` order. `states[i]` is the base optimizer's state over
    `masters[i]`, its moments as 1-D views; `step` the group's step (FusedAdam advances the step of a
    group's last parameter only, torch's Adam every one alike: the last one's is the group's)."""

    hyper: Mapping[str, Any]
    params: tuple[str, ...]
    masters: tuple[TensorRef, ...]
    states: tuple[Mapping[str, Any], ...]
    step: Any


# A model with more ways to check than this is refused rather than searched.
MAX_ASSIGNMENTS = 200_000
AMBIGUOUS = "fits them in more than one way"


def named_groups(index: Zero0Checkpoint) -> tuple[tuple[Zero0Group, ...], tuple[str, ...]] | str:
    """The param groups of `index`'s optimizer with their parameters named, and the weights that are in
    none (frozen), or why they cannot be named (see the module docstring)."""
    optimizer = index.model_states.get("optimizer")
    sixteen = index.precision != "fp32"
    assert isinstance(optimizer, Mapping), "read_zero0 checked the optimizer state"
    base = optimizer.get("optimizer_state_dict") if sixteen else optimizer
    assert isinstance(base, Mapping), "read_zero0 checked the optimizer state"
    groups = base["param_groups"]
    state = base.get("state") or {}
    weights = [t for t in index.tensors if t.kind != "buffer"]
    hyper = tuple({k: v for k, v in g.items() if k != "params"} for g in groups)
    if sixteen:
        masters = optimizer["fp32_groups_flat"]
        sizes = [m.shape[0] for m in masters]
        spare = sum(t.numel for t in weights) - sum(sizes)
        found = _assign([t.numel for t in weights], len(groups),
                        lambda at, g, n: at[g] + n <= sizes[g] if g >= 0 else at[-1] + n <= spare,
                        lambda n: n, lambda at: list(at) == [*sizes, spare])
        what = "the sizes of its flat fp32 masters"
        if found == AMBIGUOUS:  # the sizes alone allow several: the one whose masters round to the weights
            agrees = _Agrees(masters, _module(index), index.precision)
            found = _assign(list(range(len(weights))), len(groups),
                            lambda at, g, i: (at[g] + weights[i].numel <= sizes[g]
                                              and agrees(g, at[g], weights[i].name)) if g >= 0
                            else at[-1] + weights[i].numel <= spare,
                            lambda i: weights[i].numel, lambda at: list(at) == [*sizes, spare])
            what = (f"the sizes of its flat fp32 masters, and their first {PROBE} elements at each place rounded to "
                    f"{index.precision} against the weights")
    else:
        ids = [list(g["params"]) for g in groups]
        spare = len(weights) - sum(map(len, ids))
        shapes = [[_moment_shape(state.get(i)) for i in group] for group in ids]
        found = _assign([t.shape for t in weights], len(groups),
                        lambda at, g, shape: (at[g] < len(shapes[g]) and shapes[g][at[g]] in (None, shape))
                        if g >= 0 else at[-1] < spare,
                        lambda shape: 1, lambda at: list(at) == [*map(len, ids), spare])
        what = "the shapes of its Adam moments"
    if isinstance(found, str):
        return (f"ZeRO-0 saves which parameters each of its {len(groups)} param groups holds nowhere, and taking "
                f"them in the module's order {found} ({what}, {spare} left out)")
    members: list[list[str]] = [[] for _ in groups]
    for t, g in zip(weights, found):
        if g >= 0:
            members[g].append(t.name)
    frozen = tuple(t.name for t, g in zip(weights, found) if g < 0)
    if sixteen:
        out = tuple(Zero0Group(hyper[g], tuple(members[g]), (masters[g],), (_flat_state(state.get(g), masters[g]),),
                               _step(state.get(g))) for g in range(len(groups)))
        return out, frozen
    module = _module(index)
    out_groups = []
    for g, group in enumerate(ids):
        states = [state.get(i) for i in group]
        stepped = [s is not None for s in states]
        if any(stepped) and not all(stepped):
            name = members[g][stepped.index(False)]
            return (f"{name} has no optimizer state while the rest of its param group has (it never had a gradient), "
                    "and DeepSpeed's flat group at ZeRO-1/2/3 would hold zero moments for it, which ckptflow does not "
                    "write yet")
        refs = tuple(_flat(module[n]) for n in members[g])
        out_groups.append(Zero0Group(hyper[g], tuple(members[g]), refs,
                                     tuple(_flat_state(s, r) for s, r in zip(states, refs)),
                                     _step(states[-1]) if states else None))
    return tuple(out_groups), frozen


# How many elements of a weight `_Agrees` compares with its master's at a place.
PROBE = 64


class _Agrees:
    """Whether the flat fp32 master of group g, read from element `at`, rounds to the 16-bit weight `name`
    over its first `PROBE` elements (FP16_Optimizer copies each master into its weight after every step:
    `masters_note`); each answer read once (two small byte ranges) and kept."""

    def __init__(self, masters: Sequence[TensorRef], module: Mapping[str, TensorRef], precision: str) -> None:
        self.masters, self.module = masters, module
        self.cast = fp32_to_bf16 if precision == "bf16" else fp32_to_fp16
        self.seen: dict[tuple[int, int, str], bool] = {}

    def __call__(self, g: int, at: int, name: str) -> bool:
        key = (g, at, name)
        if key not in self.seen:
            weight, master = self.module[name], self.masters[g]
            n = min(PROBE, weight.numel)
            if weight.itemsize != 2 or not weight.is_contiguous:
                self.seen[key] = False
            else:
                fp32, sixteen = read_ranges([(master.uri, *master.element_range(at, n)),
                                             (weight.uri, *weight.element_range(0, n))])
                out = np.empty(n, dtype=np.uint16)
                self.cast(as_array(fp32, np.uint32), out)
                self.seen[key] = out.tobytes() == sixteen
        return self.seen[key]


def _module(index: Zero0Checkpoint) -> Mapping[str, TensorRef]:
    module = index.model_states.get("module")
    assert isinstance(module, Mapping), "read_zero0 checked the module"
    return module


def _moment_shape(state: Any) -> tuple[int, ...] | None:
    """The shape of the first moment in a parameter's optimizer state (None: no state yet)."""
    if isinstance(state, Mapping):
        for value in state.values():
            if isinstance(value, TensorRef) and value.shape:
                return value.shape
    return None


def _flat(ref: TensorRef) -> TensorRef:
    """A contiguous tensor as 1-D (the bytes are the same)."""
    return replace(ref, shape=(ref.numel,), stride=(1,)) if ref.is_contiguous else ref


def _flat_state(state: Any, master: TensorRef) -> Mapping[str, Any]:
    """The optimizer state over `master`: tensors of its size as 1-D views (the moments), the rest as saved."""
    if not isinstance(state, Mapping):
        return {}
    return {k: _flat(v) if isinstance(v, TensorRef) and v.numel == master.numel and v.shape else v
            for k, v in state.items()}


def _step(state: Any) -> Any:
    return state.get("step") if isinstance(state, Mapping) else None


def _assign(items: Sequence[Any], groups: int, fits: Callable[[tuple[int, ...], int, Any], bool],
            size: Callable[[Any], int], done: Callable[[tuple[int, ...]], bool]
            ) -> list[int] | str:
    """The one way to put `items`, in order, into `groups` groups or none (-1), as `fits(at, g, item)`
    allows from progress `at` (per group, then the items in none: each adds `size(item)`) and `done(at)`
    accepts at the end; or
    why not: no way, several, or too many to check (more than `MAX_ASSIGNMENTS` partial ones)."""
    start = (0,) * (groups + 1)
    layers: list[dict[tuple[int, ...], tuple[int, tuple[int, ...], int]]] = [{start: (1, start, -2)}]
    for item in items:
        nxt: dict[tuple[int, ...], tuple[int, tuple[int, ...], int]] = {}
        for at, (count, _, _) in layers[-1].items():
            for g in [*range(groups), -1]:
                if not fits(at, g, item):
                    continue
                moved = list(at)
                moved[g] += size(item)  # g -1: the items in none
                key = tuple(moved)
                seen = nxt.get(key)
                nxt[key] = (min(2, count + seen[0]), seen[1], seen[2]) if seen else (count, at, g)
        if len(nxt) > MAX_ASSIGNMENTS:
            return "has too many ways to check"
        layers.append(nxt)
    ends = [(at, count) for at, (count, _, _) in layers[-1].items() if done(at)]
    total = sum(count for _, count in ends)
    if total == 0:
        return "fits none of them"
    if total > 1:
        return AMBIGUOUS
    at = ends[0][0]
    out = []
    for layer in reversed(layers[1:]):
        _, at_before, g = layer[at]
        out.append(g)
        at = at_before
    return out[::-1]


# ---- the fp16 loss scaler ---------------------------------------------------------------------------------

# DeepSpeed 0.19.8's defaults for the `fp16` section's loss-scale settings (`DeepSpeedFP16Config`), which a
# saved config leaves out where the user did.
FP16_DEFAULTS = {"hysteresis": 2, "consecutive_hysteresis": False, "min_loss_scale": 1}


def _at_least(value: Any, least: int) -> bool:
    """An int (not a bool) of at least `least`, as bounded as the counts `inspection.is_count` takes."""
    return type(value) is int and is_count(value - least)


def _scale(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def zero_loss_scaler(index: Zero0Checkpoint) -> dict[str, Any] | str | None:
    """What DeepSpeed's ZeRO optimizers save of their loss scaler (`loss_scaler`, `dynamic_loss_scale`,
    `overflow`), carried from the fp16 ZeRO-0 checkpoint `index`'s FP16_Optimizer; None for a run that
    keeps no loss scale (fp32, bf16); or why its saved scale state is not what DeepSpeed 0.19.8 saves.

    FP16_Optimizer saves `dynamic_loss_scale`, `cur_scale` and `cur_iter`, and with a dynamic scale
    `last_overflow_iter`, `scale_factor` and `scale_window`: the target's `DynamicLossScaler` takes them
    as they are. The rest of it FP16_Optimizer does not keep, and the ZeRO optimizer builds it from the
    recorded config's `fp16` section as it would for this run (DeepSpeed's defaults where the section
    leaves a setting out): `min_scale` (`min_loss_scale`), `delayed_shift` and `cur_hysteresis`
    (`hysteresis`: FP16_Optimizer has none, so the target starts with its whole hysteresis),
    `consecutive_hysteresis`, `raise_error_at_min_scale` (always True) and the dtype (float16).
    `overflow` is whether the last step overflowed (`last_overflow_iter` is the step before `cur_iter`).
    A static scale is a `LossScaler` with FP16_Optimizer's `cur_scale`."""
    if index.precision != "fp16":
        return None
    return saved_loss_scaler(index.model_states.get("optimizer"), index.model_states.get("ds_config"))


def saved_loss_scaler(optimizer: Any, config: Any) -> dict[str, Any] | str:
    """`zero_loss_scaler` of one saved `FP16_Optimizer.state_dict()` (`optimizer`), run with the recorded
    DeepSpeed config `config`: what a ZeRO optimizer saves of its loss scaler, or why it cannot be carried."""
    saved = optimizer if isinstance(optimizer, Mapping) else {}
    fields: tuple[str, ...] = ("dynamic_loss_scale", "cur_scale", "cur_iter")
    dynamic = saved.get("dynamic_loss_scale")
    if dynamic is True:
        fields += ("last_overflow_iter", "scale_factor", "scale_window")
    values: dict[str, Any] = {k: saved.get(k) for k in fields}
    checks = {"dynamic_loss_scale": isinstance(dynamic, bool), "cur_scale": _scale(values["cur_scale"]),
              "cur_iter": _at_least(values["cur_iter"], 0),
              "last_overflow_iter": _at_least(values.get("last_overflow_iter"), -1),
              "scale_factor": _scale(values.get("scale_factor")),
              "scale_window": _at_least(values.get("scale_window"), 1)}
    bad = [k for k in fields if not checks[k]]
    if bad:
        found = ", ".join(f"{k}={shown(saved.get(k))}" for k in bad)
        return (f"its FP16_Optimizer's loss scale state is not what DeepSpeed 0.19.8 saves ({found}), so the "
                "target's loss scaler cannot be carried")
    if not dynamic:
        return {"loss_scaler": PickledObject(LOSS_SCALER, (), {"cur_scale": values["cur_scale"], "dynamic": False}),
                "dynamic_loss_scale": False, "overflow": False}
    fp16 = {**FP16_DEFAULTS, **section(config, "fp16")}
    hysteresis, least = fp16["hysteresis"], fp16["min_loss_scale"]
    if not _at_least(hysteresis, 1) or not _scale(least):
        return (f"its recorded config's fp16 section sets hysteresis={shown(hysteresis)}, "
                f"min_loss_scale={shown(least)}, which DeepSpeed 0.19.8 would not build a loss scaler from")
    state = {"cur_scale": values["cur_scale"], "dynamic": True, "cur_iter": values["cur_iter"],
             "last_overflow_iter": values["last_overflow_iter"], "scale_factor": values["scale_factor"],
             "scale_window": values["scale_window"], "min_scale": least, "delayed_shift": hysteresis,
             "cur_hysteresis": hysteresis, "consecutive_hysteresis": is_set(fp16, "consecutive_hysteresis"),
             "raise_error_at_min_scale": True, "dtype": "float16"}
    return {"loss_scaler": PickledObject(DYNAMIC_LOSS_SCALER, (), state), "dynamic_loss_scale": True,
            "overflow": values["last_overflow_iter"] == values["cur_iter"] - 1}


__all__ = ["FP16_DEFAULTS", "MAX_ASSIGNMENTS", "UNNAMED_OPTIMIZER", "Zero0Checkpoint", "Zero0Group", "masters_note",
           "named_groups", "read_zero0", "saved_loss_scaler", "zero_loss_scaler"]
