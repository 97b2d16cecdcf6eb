"""Does a config.json describe a checkpoint's tensors? Asked of transformers, before anything is committed.

`check_config(raw, tensors, ...)` reads the JSON (bounded, parsed by us), builds the configuration
class transformers registers for its `model_type` (`CONFIG_MAPPING`, built-in models only: ckptflow
never runs a repo's own code, `auto_map` is not followed), builds the model class its `architectures`
names on the meta device (no memory, no weights), and compares the model's state dict with the
checkpoint's names and shapes the way `from_pretrained` pairs them:

- checkpoint names go through transformers' own key renaming where it has one (legacy names, the
  base-model prefix added or stripped: a Lightning module's `model.` prefix, a bare `LlamaModel`
  checkpoint for a `LlamaForCausalLM`); a name a converter takes (per-expert weights fused on load) is
  paired without a shape check;
- parameters the model ties are one tensor: the checkpoint holds one of them, and a tensor the
  checkpoint ties (written once) must be tied in the model too;
- non-persistent buffers are not in a state dict; the names transformers ignores on load
  (`_keys_to_ignore_on_load_missing` / `_unexpected`, stale `rotary_emb.inv_freq` and `position_ids`)
  are ignored here too.

The first mismatch ends the check as a `ConfigError` (code `config-mismatch`) naming the file, the
tensor and both shapes. transformers and torch are imported here only, when a check runs.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ckptflow.errors import ConfigError
from ckptflow.plumbing.files import load_json
from ckptflow.plumbing.redaction import describe
from ckptflow.plumbing.text import excerpt, one_line

_HINT = "give the config of the model that was trained (its architecture and sizes)"

Shape = tuple[int, ...]
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")  # each layer holds at least one tensor


def check_config(raw: bytes, tensors: Sequence[tuple[str, Shape]], *, tied: Mapping[str, str] | None = None,
                 excluded: Sequence[str] = (), where: str = "config.json") -> str:
    """Check that the config.json `raw` describes `tensors` ((name, shape) as the model folder holds
    them, in order); `tied` maps each alias the folder leaves out to the tensor it shares, `excluded`
    names tensors left out on purpose (frozen). Returns the model class checked against; raises
    `ConfigError` naming `where` and the first mismatch."""
    config = parse_config(raw, where)
    for key in _LAYER_KEYS:  # bounded work: a model is not built with more layers than there are tensors
        value = config.get(key)
        if type(value) is int and value > len(tensors):
            raise ConfigError(f"{where} does not fit the checkpoint: its {key} is {value:,}, and the checkpoint holds "
                              f"{len(tensors):,} tensors in all", code="config-mismatch", file=where,
                              expected=value, actual=len(tensors), hint=_HINT)
    model = _build(config, where)
    name = type(model).__name__
    _compare(model, list(tensors), dict(tied or {}), set(excluded), f"{where} does not fit the checkpoint: {name} "
             "built from it")
    return name


def model_shapes(raw: bytes, *, most_tensors: int, where: str = "config.json") -> dict[str, Shape]:
    """Every tensor of the model the config.json `raw` describes, by name, with its shape (transformers on
    the meta device, as `check_config` builds it); a model of more layers than `most_tensors` is not
    built. What gives optimizer shards saved without their model their shapes."""
    config = parse_config(raw, where)
    for key in _LAYER_KEYS:
        value = config.get(key)
        if type(value) is int and value > most_tensors:
            raise ConfigError(f"{where} does not fit the checkpoint: its {key} is {value:,}, and the checkpoint holds "
                              f"{most_tensors:,} tensors in all", code="config-mismatch", file=where,
                              expected=value, actual=most_tensors, hint=_HINT)
    model = _build(config, where)
    return {k: tuple(int(d) for d in v.shape) for k, v in model.state_dict().items()}


def parse_config(raw: bytes, where: str) -> dict[str, Any]:
    """The config.json `raw` as a dict, after the checks that need no transformers: JSON (bounded), an
    object, a `model_type`, no `quantization_config`. `ConfigError` naming `where` otherwise."""
    try:
        config = load_json(raw)
    except ValueError as exc:
        raise ConfigError(f"{where} is not valid JSON ({one_line(str(exc), 200)})", code="config-unreadable",
                          file=where, hint=_HINT) from None
    if not isinstance(config, dict):
        raise ConfigError(f"{where} does not hold a JSON object", code="config-unreadable", file=where, hint=_HINT)
    if not isinstance(config.get("model_type"), str) or not config["model_type"]:
        raise ConfigError(f"{where} has no model_type, so transformers cannot tell which model it describes "
                          "(from_pretrained fails with 'Should have a `model_type` key')", code="config-mismatch",
                          file=where, hint=_HINT)
    if config.get("quantization_config"):
        raise ConfigError(f"{where} has a quantization_config: from_pretrained would take the weights for quantized "
                          "ones, and consolidated weights are not", code="config-mismatch", file=where,
                          hint="remove quantization_config from the config")
    return config


def _build(config: dict[str, Any], where: str) -> Any:
    """The model `config` describes, on the meta device."""
    try:
        import torch
        import transformers
        from transformers import CONFIG_MAPPING, PreTrainedModel
    except ImportError as exc:
        raise ConfigError(f"checking {where} against the checkpoint needs transformers and torch ({describe(exc)})",
                          code="config-unreadable", file=where,
                          hint="install ckptflow[verify] (pip install 'ckptflow[verify]')") from None
    version = transformers.__version__
    model_type = config["model_type"]
    if model_type not in CONFIG_MAPPING:
        raise ConfigError(f"{where} names model_type {excerpt(model_type)}, which transformers {version} does not "
                          "have built in", code="config-mismatch", file=where,
                          hint="upgrade transformers, or give the config of a model transformers has built in "
                               "(ckptflow never runs a repo's own code)")
    try:
        settings = CONFIG_MAPPING[model_type].from_dict(config)
    except Exception as exc:  # a config class raises what its own checks raise: each is a config it cannot read
        raise ConfigError(f"transformers {version} cannot read {where} ({describe(exc)})", code="config-mismatch",
                          file=where, hint=_HINT) from None
    last: ConfigError | None = None
    for cls in _classes(config, model_type, where, version, transformers, PreTrainedModel):
        try:
            with torch.device("meta"):
                return cls(settings)
        except Exception as exc:  # a model class raises what its own layers raise: the next class may build
            last = ConfigError(f"transformers {version} cannot build {cls.__name__} from {where} ({describe(exc)})",
                               code="config-mismatch", file=where, hint=_HINT)
    assert last is not None
    raise last


def _classes(config: dict[str, Any], model_type: str, where: str, version: str, transformers: Any,
             base: type) -> list[type]:
    """The model class `architectures` names (a model class of transformers itself, nothing else); without
    one, the causal LM class of the model type, else its base model class."""
    names = config.get("architectures")
    if isinstance(names, list) and names:
        name = names[0]
        cls = getattr(transformers, name, None) if isinstance(name, str) and name.isidentifier() else None
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise ConfigError(f"{where} names the architecture {excerpt(name)}, which is not a model class of "
                              f"transformers {version}", code="config-mismatch", file=where,
                              hint="upgrade transformers, or give the config of a model transformers has built in "
                                   "(ckptflow never runs a repo's own code)")
        return [cls]
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES

    found = []
    for mapping in (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES):
        entry = mapping.get(model_type)
        for name in ([entry] if isinstance(entry, str) else list(entry or ())):
            cls = getattr(transformers, name, None)
            if isinstance(cls, type) and issubclass(cls, base):
                found.append(cls)
    if not found:
        raise ConfigError(f"{where} names no architectures, and transformers {version} has no model class for "
                          f"model_type {excerpt(model_type)}", code="config-mismatch", file=where,
                          hint='add "architectures" (e.g. ["LlamaForCausalLM"]) to the config')
    return found[:1]


# ---- the comparison --------------------------------------------------------------------------------


def _compare(model: Any, tensors: list[tuple[str, Shape]], tied: dict[str, str], excluded: set[str],
             built: str) -> None:
    """Raise at the first difference between `model`'s state dict and the checkpoint's tensors: a tensor
    the model lacks or holds in another shape (in the checkpoint's order), a tie one side has and the
    other not, then a tensor of the model the checkpoint lacks (in the model's order)."""
    state = model.state_dict(keep_vars=True)
    shapes: dict[str, Shape] = {k: tuple(int(d) for d in v.shape) for k, v in state.items()}
    group = {k: id(v) for k, v in state.items()}  # tied parameters are one object
    rename = _renamer(model, state)
    ignore_missing, ignore_unexpected = _ignored(model)

    def fail(message: str, tensor: str, expected: object = None, actual: object = None) -> ConfigError:
        return ConfigError(f"{built} {message}", code="config-mismatch", tensor=tensor, expected=expected,
                           actual=actual, hint=_HINT)

    covered: dict[int, tuple[str, str]] = {}  # tie group -> (checkpoint name, model name) first holding it
    for name, shape in tensors:
        target, converted = rename(name)
        if target not in shapes:
            if ignore_unexpected(target) or ignore_unexpected(name):
                continue
            raise fail(f"has no {name}, which the checkpoint holds (shape {_shape(shape)})", name, None, shape)
        if not converted and shapes[target] != shape:
            held = f"the checkpoint's {name}" if target != name else "the checkpoint"
            raise fail(f"has {target} of shape {_shape(shapes[target])}, {held} holds {_shape(shape)}", target,
                       shapes[target], shape)
        earlier = covered.get(group[target])
        if earlier is not None and not converted and earlier[1] != target:
            raise fail(f"ties {target} to {earlier[1]} (one tensor), the checkpoint holds two different tensors "
                       f"{name} and {earlier[0]}: loading would keep one of them", target)
        covered.setdefault(group[target], (name, target))
    for alias, owner in tied.items():
        alias_target, owner_target = rename(alias)[0], rename(owner)[0]
        if alias_target in shapes and owner_target in shapes and group[alias_target] != group[owner_target]:
            raise fail(f"has {alias_target} apart from {owner_target}, the checkpoint holds one tensor for both "
                       "(tied): the model would miss its values", alias_target)
    for key, shape in shapes.items():
        if group[key] in covered or ignore_missing(key):
            continue
        left_out = " (it is left out as a frozen parameter)" if key in excluded or rename(key)[0] in excluded else ""
        raise fail(f"has {key} of shape {_shape(shape)}, which the checkpoint does not hold{left_out}", key, shape)


def _shape(shape: Shape) -> str:
    return str(tuple(shape))  # as torch.Size prints, and verify's messages: (64,), (37, 64)


def _renamer(model: Any, state: dict[str, Any]) -> Callable[[str], tuple[str, bool]]:
    """name -> (the model's name for it, whether a converter takes it), as `from_pretrained` pairs a
    checkpoint key: transformers' renamings and converters for this model, then its base-model prefix
    added or stripped. Where transformers has no such machinery (older releases), the prefix alone."""
    prefix = str(getattr(model, "base_model_prefix", "") or "")
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

        mapping = get_model_conversion_mapping(model)
        renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
        converters = [m for m in mapping if isinstance(m, WeightConverter)]
    except Exception:  # another transformers: the base-model prefix is what every release pairs
        def by_prefix(name: str) -> tuple[str, bool]:
            if name in state or not prefix:
                return name, False
            if name.startswith(prefix + ".") and name[len(prefix) + 1:] in state:
                return name[len(prefix) + 1:], False
            return (f"{prefix}.{name}", False) if f"{prefix}.{name}" in state else (name, False)

        return by_prefix

    def rename(name: str) -> tuple[str, bool]:
        renamed, pattern = rename_source_key(name, renamings, converters, prefix or None, state)
        if renamed not in state and name in state:
            renamed, pattern = rename_source_key(name, [], [], prefix or None, state)
        return renamed, pattern is not None

    return rename


def _ignored(model: Any) -> tuple[Callable[[str], bool], Callable[[str], bool]]:
    """(is a missing key ignored, is an unexpected key ignored), as transformers ignores them on load."""
    missing = set(getattr(model, "_keys_to_ignore_on_load_missing", None) or ())
    unexpected = set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
    buffers = [name for name, _ in model.named_buffers()]
    if any(b.endswith("rotary_emb.inv_freq") for b in buffers):
        unexpected.add(r"rotary_emb\.inv_freq")
    if any(b.endswith("position_ids") for b in buffers):
        unexpected.add(r"(^|\.)position_ids$")

    def matcher(patterns: set[str]) -> Callable[[str], bool]:
        regex = re.compile("|".join(f"({p})" for p in sorted(patterns))) if patterns else None
        return lambda key: regex is not None and regex.search(key) is not None

    return matcher(missing), matcher(unexpected)


__all__ = ["check_config", "model_shapes", "parse_config"]
