"""Which of DeepSpeed's checkpoint layouts a tag folder holds, from its file names and rank 0's model
states: the first thing read, so that every later message can name the layout.

| kind | what tells it |
|---|---|
| `zero` | data-parallel ZeRO 0-3: `mp_rank_00` files only, nothing below |
| `autotp` | `mp_rank_XX` for several XX and `universal_checkpoint_info` with an `affine_map` (AutoTP) |
| `tensor-parallel` | several `mp_rank_XX` without split metadata (client model parallelism, e.g. Megatron) |
| `pipeline` | `layer_XX-model_states.pt` files (PipelineModule) |
| `megatron` | `layer_XX-model_TT-model_states.pt` files (PipelineModule with Megatron-style TP inside) |
| `autoep` | `ds_autoep_layers` in the model states (AutoEP) |
| `moe` | `num_experts` without AutoEP metadata (`deepspeed.moe` layers) |

Pure: it looks at names and a plain dict, and reads nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ckptflow.formats.deepspeed.names import (
    EXPERT_FILE_RE,
    EXPP_FILE_RE,
    LAYER_FILE_RE,
    MODEL_FILE_RE,
    OPTIM_FILE_RE,
    UC_INFO,
)


@dataclass(frozen=True)
class Topology:
    """A checkpoint's topology: its kind and parallel degrees (1 where the kind has no such dimension)."""

    kind: str
    stage: int | None  # None until the optimizer files say (ZeRO-1 and 2 look alike from rank 0)
    dp: int
    tp: int = 1
    pp: int = 1
    ep: int = 1

    @property
    def description(self) -> str:
        """The layout in words, e.g. "AutoTP (tensor-parallel; tp 2 x dp 2, ZeRO-1)"."""
        names = {"zero": "data-parallel ZeRO", "autotp": "AutoTP (tensor-parallel", "autoep": "AutoEP (expert-parallel",
                 "moe": "deepspeed.moe (expert-parallel", "pipeline": "PipelineModule (pipeline-parallel",
                 "megatron": "PipelineModule (pipeline-parallel with Megatron-style tensor parallelism",
                 "tensor-parallel": "model-parallel (no record of how parameters are split"}
        degrees = [f"{label} {n}" for label, n in (("pp", self.pp), ("tp", self.tp), ("ep", self.ep)) if n > 1]
        degrees.append(f"dp {self.dp}")
        stage = f", ZeRO-{self.stage}" if self.stage is not None else ""
        name = names.get(self.kind, self.kind)
        return f"{name}; {' x '.join(degrees)}{stage})" if "(" in name else f"{name} ({' x '.join(degrees)}{stage})"


def detect(names: Iterable[str], model0: Mapping[str, Any]) -> Topology:
    """The layout of a tag folder holding the files `names`, whose rank-0 model states are `model0`."""
    names = list(names)
    mp_ranks = {int(m.group(2)) for n in names if (m := MODEL_FILE_RE.match(n))}
    mp_ranks |= {int(m.group(3)) for n in names if (m := OPTIM_FILE_RE.match(n))}
    dims = model0.get("checkpoint_parallel_dimensions")
    dims = dims if isinstance(dims, Mapping) else {}
    tp = _positive(dims.get("tp_degree"), 1)
    pp = _positive(dims.get("pp_degree"), 1)
    dp = _positive(model0.get("dp_world_size"), 1)
    stage = _stage(model0, names)
    layers = [m for n in names if (m := LAYER_FILE_RE.match(n))]
    if any(m.group(2) is not None for m in layers):
        return Topology("megatron", stage, dp, tp=max(tp, 1), pp=pp)
    if layers or (model0.get("module") is None and pp > 1):
        return Topology("pipeline", stage, dp, pp=pp)
    autoep = model0.get("ds_autoep_layers")
    if isinstance(autoep, list) and autoep:
        ep = _positive(autoep[0].get("ep_size") if isinstance(autoep[0], Mapping) else None, 1)
        return Topology("autoep", stage, dp, ep=ep)
    experts = model0.get("num_experts")
    if experts or any(EXPERT_FILE_RE.match(n) or EXPP_FILE_RE.match(n) for n in names):
        return Topology("moe", stage, dp, ep=_moe_ep(names))
    mp_world_size = _positive(model0.get("mp_world_size"), 1)
    recorded = "tp_degree" in dims or "mp_world_size" in model0  # the files' own word beats a glob
    if (len(mp_ranks) > 1 and not recorded) or tp > 1 or mp_world_size > 1:
        tp = max(tp, mp_world_size) if recorded else max(tp, len(mp_ranks), mp_world_size)
        info = model0.get(UC_INFO)
        if isinstance(info, Mapping) and isinstance(info.get("affine_map"), Mapping):
            return Topology("autotp", stage, dp, tp=tp)
        return Topology("tensor-parallel", stage, dp, tp=tp)
    return Topology("zero", stage, dp)


def _positive(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else default


def _stage(model0: Mapping[str, Any], names: list[str]) -> int | None:
    if any((m := MODEL_FILE_RE.match(n)) and m.group(1) is not None for n in names):
        return 3
    if not any(OPTIM_FILE_RE.match(n) for n in names) and model0.get("optimizer") is not None:
        return 0
    return None


def _moe_ep(names: list[str]) -> int:
    """deepspeed.moe records its expert-parallel degree only in param-group names; the ZeRO-0
    `expp_rank_*` files count it directly. 1 when neither is at hand here."""
    ranks = {int(m.group(1)) for n in names if (m := EXPP_FILE_RE.match(n))}
    return len(ranks) or 1
