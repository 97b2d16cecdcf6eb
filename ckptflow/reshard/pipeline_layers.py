"""Which layers each stage of a PipelineModule holds at another stage count. Pure.

DeepSpeed 0.19.8's `PipelineModule._partition_layers` cuts the layer list into `num_stages` runs by
`partition_method`: "parameters" (the default: `ds_utils.partition_balanced` over each layer's
trainable elements, a `TiedLayerSpec` counted at every use, a function as 0), "uniform"
(`partition_uniform` over the number of layers) or "type:REGEX" (balanced over weights 1 for the layers
whose class name matches, case-insensitively, 0 for the others and for functions). `partition_uniform`
and `partition_balanced` below are ports of DeepSpeed's. No file records a layer's class: a "type:"
method is computed where the caller knows which layers match (`Layer`'s count is then that 0 or 1;
`megatron`: Megatron-DeepSpeed's transformer layers, known by their parameters; a plain PipelineModule's
from the names of its layer list's entries the user declares, `parse_layer_types`, `typed_layers`).

No file records the layer list. What the files say (`Evidence`): each layer that is a module saved
`layer_XX-model_states.pt` under its global index; each stage's `param_shapes` and `buffer_names` name
the layers it holds (`{layer}.{name}`) and the tied modules it uses (`tied_modules.{key}.{name}`); a
tied module's file sits under one of its uses. Layers that are functions, and a tied module's uses
with a `forward_fn`, save nothing: an index without a file is one or the other, and how many such
layers follow the last file is unknown. `layer_lists` tries every filling of those indices (up to
`SPAN` layers after the last file) and keeps those whose partition at the source's stage count gives
each source stage exactly the layers and tied modules it holds; `target_stages` then cuts each at the
target count, and answers only when every kept list gives every target stage the same modules.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

METHODS = ("parameters", "uniform")  # and "type:REGEX" where the caller knows the layers it matches
TYPE = "type:"
MAX_METHOD = 200  # characters of a partition method


def check_method(method: str) -> None:
    """`ValueError` unless `method` is one of PipelineModule's partition methods, in any case as DeepSpeed
    lowers it: `METHODS`, or "type:" and a regular expression (of at most `MAX_METHOD` characters in all)."""
    if not isinstance(method, str):
        raise ValueError(f"the partition method must be a string; got a {type(method).__name__}")
    lowered = method.lower()
    if lowered in METHODS:
        return
    if not lowered.startswith(TYPE) or len(method) == len(TYPE) or len(method) > MAX_METHOD:
        raise ValueError(f"the partition method must be {', '.join(METHODS)} or type:REGEX (at most {MAX_METHOD} "
                         f"characters); got {method[:60]!r}")
    try:
        re.compile(method[len(TYPE):], re.IGNORECASE)
    except re.error as exc:
        raise ValueError(f"the partition method's regular expression does not compile: {exc}") from None


# `--layer-types`: the layer list's names as `PipelineModule._find_layer_type` reads them, which no file records.
MAX_TYPES_TEXT = 20_000  # characters of a declared list
MAX_LAYERS = 10_000  # layers a declared list names, repeats counted
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,199}|<lambda>")  # a class's or a function's `__name__`
_ENTRY = re.compile(r"(?P<name>[^*]*?)\s*(?:\*\s*(?P<times>[0-9]{1,6}))?")


def parse_layer_types(text: str) -> tuple[str, ...]:
    """The layer list's names, one per layer in order, as `text` declares them: comma-separated names
    (a `LayerSpec`'s class, a module's class, a function's `__name__`), `NAME*N` for N of them in a row.
    `ValueError`, in one line, unless the list is well formed (at most `MAX_TYPES_TEXT` characters, 1 to
    `MAX_LAYERS` layers)."""
    if not isinstance(text, str):
        raise ValueError(f"the layer types must be a string; got a {type(text).__name__}")
    if len(text) > MAX_TYPES_TEXT:
        raise ValueError(f"the layer types are {len(text)} characters long, more than {MAX_TYPES_TEXT}")
    names: list[str] = []
    for at, entry in enumerate(text.split(",")):
        match = _ENTRY.fullmatch(entry.strip())
        name = match.group("name") if match else ""
        if match is None or not _NAME.fullmatch(name):
            raise ValueError(f"layer types entry {at + 1} ({entry.strip()[:60]!r}) is not NAME or NAME*N, NAME a "
                             "class or function name (letters, digits, _; or <lambda>)")
        times = int(match.group("times")) if match.group("times") is not None else 1
        if times < 1 or len(names) + times > MAX_LAYERS:
            raise ValueError(f"layer types entry {at + 1} ({entry.strip()[:60]!r}) repeats a name "
                             f"{'less than once' if times < 1 else f'past {MAX_LAYERS} layers in all'}")
        names += [name] * times
    return tuple(names)


def typed_layers(method: str, names: Sequence[str]) -> frozenset[int]:
    """The layers a "type:" partition `method` weighs 1, as `PipelineModule` finds them: the regular
    expression after "type:" (of the method lowered, up to a second ":", as DeepSpeed splits it) searched
    in each of the layer list's `names`, ignoring case. `ValueError` where it does not compile."""
    regex = method.lower().split(":")[1]
    try:
        found = re.compile(regex, re.IGNORECASE)
    except re.error as exc:
        raise ValueError(f"the partition method's regular expression {regex[:60]!r} does not compile: {exc}") from None
    return frozenset(i for i, name in enumerate(names) if found.search(name))


SPAN = 8  # layers without files tried after the last layer file
MAX_LISTS = 4096  # layer lists tried at most

Layer = tuple[str, int]  # (tied module key, or "" for a module or a function; trainable elements, or a
# "type:" method's weight)


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """`deepspeed.runtime.utils.partition_uniform`."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunk, residual = divmod(num_items, num_parts)
    return [p * chunk + min(p, residual) for p in range(num_parts + 1)]


def partition_balanced(weights: Sequence[int], num_parts: int) -> list[int]:
    """`deepspeed.runtime.utils.partition_balanced`: the linear partition minimising the spread between
    the heaviest and the lightest part. DeepSpeed's innermost loop keeps the last split point of least
    cost (it replaces on `>=`); this takes the same one, a row of split points at a time."""
    n, m = len(weights), num_parts
    if n <= m:
        return partition_uniform(n, m)
    dp_max = np.full((n + 1, m + 1), np.inf)
    dp_min = np.full((n + 1, m + 1), np.inf)
    position = np.zeros((n + 1, m + 1), dtype=int)
    prefix = np.zeros(n + 1)
    prefix[1:] = np.cumsum(weights)
    dp_max[0, 0] = 0
    for i in range(1, n + 1):
        top = min(i, m)  # parts j = 1..top, every split point k < i at once
        part = (prefix[i] - prefix[:i])[:, None]
        high, low = np.maximum(dp_max[:i, :top], part), np.minimum(dp_min[:i, :top], part)
        k = i - 1 - np.argmin((high - low)[::-1], axis=0)  # per part count, the last k of least cost
        columns = np.arange(top)
        dp_max[i, 1:top + 1], dp_min[i, 1:top + 1] = high[k, columns], low[k, columns]
        position[i, 1:top + 1] = k
    parts = [n]
    for j in range(m, 0, -1):
        parts.append(int(position[parts[-1], j]))
    return parts[::-1]


def partition(method: str, layers: Sequence[Layer], num_stages: int) -> list[int]:
    """`PipelineModule._partition_layers`' `parts` for `layers` (methods of `METHODS`, and a "type:" one over
    `layers` that carry its weights)."""
    if method == "uniform":
        return partition_uniform(len(layers), num_stages)
    return partition_balanced([count for _, count in layers], num_stages)


@dataclass(frozen=True)
class Evidence:
    """What a PipelineModule checkpoint's files say about its layer list: `known`, the layers that saved
    a file (layer -> (tied key or "", trainable elements)); per source stage, the layers it names
    (`stage_layers`) and the tied modules it uses (`stage_tied`); each tied module's elements (`tied`);
    for a "type:" method, the layers its class matches (`typed`: each weighs 1, every other 0, whatever
    it is; None: the elements weigh)."""

    known: dict[int, Layer]
    stage_layers: tuple[frozenset[int], ...]
    stage_tied: tuple[frozenset[str], ...]
    tied: dict[str, int]
    typed: frozenset[int] | None = None


@dataclass(frozen=True)
class TargetStage:
    """What one target stage holds: its layers that are modules (in order) and the tied modules it uses
    (in the order of their first use in the stage)."""

    layers: tuple[int, ...]
    tied: tuple[str, ...]


def layer_lists(evidence: Evidence, method: str, count: int | None = None) -> Iterator[list[Layer]]:
    """Every layer list the files allow (of `count` layers when given) whose partition by `method` at the
    source's stage count gives each source stage the layers and tied modules it holds. `ValueError` when
    more than `MAX_LISTS` lists would have to be tried."""
    first = max(evidence.known, default=-1) + 1
    tried = 0
    counts = range(max(first, 1), first + SPAN + 1) if count is None else range(count, count + 1)
    for count in counts:
        unknown = [i for i in range(count) if i not in evidence.known]
        for filling in itertools.product(*(_choices(evidence, i) for i in unknown)):
            tried += 1
            if tried > MAX_LISTS:
                raise ValueError(f"more than {MAX_LISTS} layer lists fit the files")
            layers = [evidence.known.get(i, ("", 0)) for i in range(count)]
            for i, layer in zip(unknown, filling):
                layers[i] = layer
            if evidence.typed is not None:
                layers = [(key, int(i in evidence.typed)) for i, (key, _) in enumerate(layers)]
            if _holds_the_source(evidence, layers, partition(method, layers, len(evidence.stage_layers))):
                yield layers


def _choices(evidence: Evidence, index: int) -> list[Layer]:
    """What a layer without a file at `index` can be: a function, or a use of a tied module that a source
    stage whose layers could reach `index` uses (stages hold runs of layers in order)."""
    keys: set[str] = set()
    named = evidence.stage_layers
    for s, tied in enumerate(evidence.stage_tied):
        below = max((i for layers in named[:s] for i in layers), default=-1)
        above = min((i for layers in named[s + 1:] for i in layers), default=index + 1)
        if below < index < above:
            keys |= tied
    return [("", 0), *sorted((key, evidence.tied[key]) for key in keys)]


def _holds_the_source(evidence: Evidence, layers: Sequence[Layer], parts: Sequence[int]) -> bool:
    for s, (named, tied) in enumerate(zip(evidence.stage_layers, evidence.stage_tied)):
        span = range(parts[s], parts[s + 1])
        if any(i not in span for i in named) or {layers[i][0] for i in span} - {""} != tied:
            return False
    return True


def target_stages(layers: Sequence[Layer], parts: Sequence[int], modules: frozenset[int]) -> tuple[TargetStage, ...]:
    """Each stage's modules (those of `modules`, the layers any stage names) and tied modules at `parts`."""
    return tuple(TargetStage(tuple(i for i in range(a, b) if i in modules),
                             tuple(dict.fromkeys(layers[i][0] for i in range(a, b) if layers[i][0])))
                 for a, b in zip(parts, parts[1:]))


def describe(layers: Sequence[Layer]) -> str:
    """A layer list in words: "0 embed, 1-3 modules, 4 function, 5 embed"."""
    words = [key or ("module" if count else "function or module without parameters") for key, count in layers]
    out, start = [], 0
    for i in range(1, len(words) + 1):
        if i == len(words) or words[i] != words[start]:
            out.append(f"{start}{f'-{i - 1}' if i - 1 > start else ''} {words[start]}")
            start = i
    return ", ".join(out)


MAX_TIED = 6  # tied modules a user names (`tied_modules`): the stages are tried with every ordered subset of them
MAX_TIED_TEXT = 4096  # characters of their list
_TIED_RE = re.compile(r"([A-Za-z_][A-Za-z0-9_]{0,99})=([0-9]{1,6})")


def tied_modules(text: str) -> dict[str, int]:
    """The tied modules a user names, "KEY=LAYER[,KEY=LAYER...]": each `TiedLayerSpec` key and the index
    of the first layer that uses it, whose `layer_XX-model_states.pt` holds it (what a ZeRO-0
    PipelineModule's files do not record). `ValueError` for anything else."""
    if not isinstance(text, str):
        raise ValueError(f"the tied modules must be a string KEY=LAYER[,KEY=LAYER...]; got a {type(text).__name__}")
    if len(text) > MAX_TIED_TEXT:
        raise ValueError(f"the tied modules are {len(text)} characters long, more than {MAX_TIED_TEXT}")
    out: dict[str, int] = {}
    for item in text.split(",")[:MAX_TIED + 1]:
        match = _TIED_RE.fullmatch(item.strip())
        if match is None:
            raise ValueError(f"the tied modules must be KEY=LAYER[,KEY=LAYER...] (a TiedLayerSpec key and the index of "
                             f"the first layer that uses it); got {item.strip()[:60]!r}")
        key, layer = match.group(1), int(match.group(2))
        if key in out or layer in out.values():
            raise ValueError(f"the tied modules name {key!r} or layer {layer} twice")
        out[key] = layer
    if len(out) > MAX_TIED:
        raise ValueError(f"the tied modules name more than {MAX_TIED} keys")
    return out


__all__ = ["Evidence", "MAX_TIED", "MAX_TIED_TEXT", "METHODS", "TYPE", "TargetStage", "describe", "layer_lists",
           "parse_layer_types", "partition", "partition_balanced", "partition_uniform", "target_stages", "tied_modules",
           "typed_layers"]
