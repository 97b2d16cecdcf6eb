"""The names DeepSpeed 0.19.8 gives its checkpoint files and the classes its pickles reference.

One home for these facts: the unpickler's allow-list (`ALLOWED`), the index and the writer of resharded files all
take them from here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ckptflow.formats.torch.unpickler import Allowed

# DeepSpeed classes that appear in checkpoint pickles. The reader turns them into plain records
# (`formats.torch.unpickler.PickledObject`); the reshard writer writes them back by name.
LOSS_SCALER = "deepspeed.runtime.fp16.loss_scaler.LossScaler"
DYNAMIC_LOSS_SCALER = "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"
FRAGMENT_ADDRESS = "deepspeed.utils.tensor_fragment.fragment_address"
RECORDS = (LOSS_SCALER, DYNAMIC_LOSS_SCALER, FRAGMENT_ADDRESS)
# Enums pickled by value (ZeroStageEnum(2)): read back as the int.
ZERO_STAGE_ENUM = "deepspeed.runtime.zero.config.ZeroStageEnum"
ENUMS = (ZERO_STAGE_ENUM,)
# What a DeepSpeed checkpoint pickle may name beyond torch's tensors: the unpickler's allow-list. Any
# other global is a trainer's client state (Megatron-DeepSpeed's `args`, Lightning's callbacks): kept as
# an inert record, never imported or run (`formats.torch.inert`), unless it is code. `ALLOWED_STRICT`
# (strict pickle mode) refuses every global outside the list, as ckptflow did before client state.
ALLOWED = Allowed(records=frozenset(RECORDS), enums=frozenset(ENUMS), inert=True)
ALLOWED_STRICT = Allowed(records=frozenset(RECORDS), enums=frozenset(ENUMS))


def allowed(strict_pickle: bool = False) -> Allowed:
    """The allow-list a DeepSpeed checkpoint is read with: `ALLOWED`, or `ALLOWED_STRICT` in strict mode."""
    return ALLOWED_STRICT if strict_pickle else ALLOWED


# The keys DeepSpeed 0.19.8 writes into a model-states file (`DeepSpeedEngine._common_checkpoint_state`,
# `_save_checkpoint`, `_save_moe_checkpoint`); every other key is the trainer's `client_state`.
DEEPSPEED_MODEL_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "skipped_steps", "global_steps",
    "global_samples", "dp_world_size", "mp_world_size", "checkpoint_parallel_dimensions", "ds_config", "ds_version",
    "universal_checkpoint_info", "num_experts", "ds_autoep_layers", "autoep_layers", "folding",
})
# Of those, the ones DeepSpeed fills from objects of the user's (a scheduler's or sampler's own
# state_dict): carried as they are, like client state, never read by ckptflow.
USER_STATE_KEYS = frozenset({"lr_scheduler", "data_sampler", "random_ltd"})

# The model-states key under which a client (AutoTP, Megatron-DeepSpeed, AutoEP) records how each parameter
# is split, for DeepSpeed's universal converter.
UC_INFO = "universal_checkpoint_info"

# Files of one tag folder.
LATEST = "latest"
MODEL_FILE_RE = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
OPTIM_FILE_RE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
SAFE_TAG = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,254}$")
# Expert-parallel and pipeline files.
EXPERT_FILE_RE = re.compile(r"^layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")  # one expert's weights
EXPP_FILE_RE = re.compile(r"^expp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")  # deepspeed.moe ZeRO-0 optimizer
LAYER_FILE_RE = re.compile(r"^layer_(\d+)-(?:model_(\d+)-)?model_states\.pt$")  # PipelineModule layer (+ TP rank)
# Optimizer param groups of expert parameters (AutoEP, deepspeed.moe): `moe: True` and this name, N the
# expert-parallel degree (`deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer`).
EP_GROUP_RE = re.compile(r"^ep_size_(\d+)$")


def model_file_name(stage: int, rank: int, mp_rank: int = 0) -> str:
    """The model-states file of data-parallel `rank` of model-parallel rank `mp_rank` (ZeRO-3: one per
    rank; ZeRO-0/1/2: data-parallel rank 0's only)."""
    mp = f"mp_rank_{mp_rank:02d}"
    return f"zero_pp_rank_{rank}_{mp}_model_states.pt" if stage == 3 else f"{mp}_model_states.pt"


def optim_file_name(precision: str, rank: int, mp_rank: int = 0) -> str:
    """The optimizer-states file of data-parallel `rank` of model-parallel rank `mp_rank`; bf16 training
    adds the `bf16_` prefix."""
    return f"{'bf16_' if precision == 'bf16' else ''}zero_pp_rank_{rank}_mp_rank_{mp_rank:02d}_optim_states.pt"


def layer_file_name(layer: int, tp_rank: int | None = None) -> str:
    """A PipelineModule layer's file (`layer_{XX}-model_states.pt`); with Megatron-style tensor
    parallelism one per tensor-parallel rank (`layer_{XX}-model_{TT}-model_states.pt`)."""
    if tp_rank is None:
        return f"layer_{layer:02d}-model_states.pt"
    return f"layer_{layer:02d}-model_{tp_rank:02d}-model_states.pt"


def expert_file_name(layer: int, expert: int, mp_rank: int = 0) -> str:
    """One expert's weights (AutoEP and deepspeed.moe at ZeRO-0/1/2), by MoE layer and global expert id."""
    return f"layer_{layer}_expert_{expert}_mp_rank_{mp_rank:02d}_model_states.pt"


def expp_file_name(ep_rank: int, mp_rank: int = 0) -> str:
    """deepspeed.moe ZeRO-0: the whole optimizer of one expert-parallel rank."""
    return f"expp_rank_{ep_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"


def expert_group_degree(group: Any) -> int | None:
    """The expert-parallel degree N of an optimizer param group named `ep_size_N` with `moe: True`; 1
    for any other group (a dense group, partitioned over every data-parallel rank); None for an expert
    group whose name does not say N."""
    if not isinstance(group, Mapping) or not group.get("moe"):
        return 1
    m = EP_GROUP_RE.match(str(group.get("name", "")))
    return int(m.group(1)) if m and int(m.group(1)) > 0 else None


def is_rank_file(name: str) -> bool:
    """Whether `name` is one of the files DeepSpeed saves into a tag folder."""
    return any(p.match(name) for p in (MODEL_FILE_RE, OPTIM_FILE_RE, EXPERT_FILE_RE, EXPP_FILE_RE, LAYER_FILE_RE))

# Accelerate's own files beside its DeepSpeed tag folder (`accelerate.checkpointing.save_accelerator_state`): each
# process's random states, and per object a scheduler's, a sampler's (a pickled `SeedableRandomSampler`) and a
# stateful dataloader's state and each object passed to `register_for_checkpointing`. Pickles all: listed by name,
# carried by reshard as bytes, never opened.
ACCELERATE_FILE_RE = re.compile(r"random_states_\d+\.pkl|(scheduler|sampler|dl_state_dict)(_\d+)?\.bin|"
                                r"custom_checkpoint_\d+\.pkl")
