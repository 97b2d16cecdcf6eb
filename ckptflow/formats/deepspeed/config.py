"""What DeepSpeed's saved config and records mean: the training precision, the ZeRO section and its flags,
the optimizer that laid the partitions out, and counts as DeepSpeed records them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckptflow.formats.deepspeed.partition import BF16, DEFAULT_SUB_GROUP_SIZE, ZERO, ZERO3


def precision_of(config: Any) -> str:
    """The training precision a saved `ds_config` names: "bf16", "fp16" or "fp32"."""
    config = config if isinstance(config, Mapping) else {}
    if enabled_section(config, "bf16") or enabled_section(config, "bfloat16"):
        return "bf16"
    return "fp16" if enabled_section(config, "fp16") else "fp32"


def enabled_section(config: Mapping[str, Any], key: str) -> bool:
    """Whether the section `key` of a config is there with `enabled` on."""
    section = config.get(key)
    return isinstance(section, Mapping) and bool(section.get("enabled", False))


def section(config: Any, key: str) -> Mapping[str, Any]:
    """The section `key` of a saved `ds_config` ({} where it has none)."""
    found = config.get(key) if isinstance(config, Mapping) else None
    return found if isinstance(found, Mapping) else {}


def zero_section(config: Any) -> Mapping[str, Any]:
    """The `zero_optimization` section of a saved `ds_config` ({} where it has none)."""
    return section(config, "zero_optimization")


def is_set(section: Mapping[str, Any], key: str) -> bool:
    """Whether a boolean option of a config section is on (DeepSpeed's configs hold True or "true")."""
    value = section.get(key, False)
    return value is True or (isinstance(value, str) and value.lower() == "true")


def optimizer_kind(stage: int, optimizer_state: Mapping[str, Any]) -> str:
    """Which DeepSpeed optimizer laid the partitions out (`partition.ZERO`, `BF16`, `ZERO3`), from the
    ZeRO stage and a rank's `optimizer_state_dict`: BF16_Optimizer records no `zero_stage`."""
    if stage == 3:
        return ZERO3
    return ZERO if "zero_stage" in optimizer_state else BF16


def sub_group_size(zero: Mapping[str, Any]) -> int:
    """ZeRO-3's `sub_group_size` from a `zero_optimization` section (DeepSpeed's default where unset or
    not a number)."""
    value = zero.get("sub_group_size")
    try:
        return int(float(value)) if value is not None else DEFAULT_SUB_GROUP_SIZE
    except (TypeError, ValueError):
        return DEFAULT_SUB_GROUP_SIZE


FP32_NAMES = frozenset({"fp32", "float32", "float", "torch.float32"})  # DeepSpeed's DtypeEnum.fp32


def builds_bf16_optimizer(config: Any) -> bool:
    """Whether DeepSpeed 0.19.8 builds BF16_Optimizer at ZeRO-1 for the recorded `ds_config` `config`: bf16
    weights, fp32 gradient accumulation (`data_types.grad_accum_dtype`) and no optimizer offload to the CPU
    (`offload_optimizer.device`, or the older `cpu_offload` DeepSpeed still reads);
    `engine._do_optimizer_sanity_check`."""
    accum = section(config, "data_types").get("grad_accum_dtype")
    zero = zero_section(config)
    offload = section(zero, "offload_optimizer")
    to_cpu = offload.get("device") == "cpu" if offload else is_set(zero, "cpu_offload")  # the older key
    return precision_of(config) == "bf16" and isinstance(accum, str) and accum in FP32_NAMES and not to_cpu

