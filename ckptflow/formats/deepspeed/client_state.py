"""A trainer's client state in a DeepSpeed checkpoint: what it holds, and the fields it must stay out of.

`engine.save_checkpoint(dir, client_state={...})` adds the trainer's own keys to every model-states
file beside DeepSpeed's (`names.DEEPSPEED_MODEL_KEYS`): Megatron-DeepSpeed's `args` (an
`argparse.Namespace`), `iteration` and RNG states; PyTorch Lightning's loops, callbacks and
hyper-parameters. Their objects are read as inert records (`formats.torch.inert`), never imported or
run. `client_state(model_states)` says what each key holds and which classes it names, for
`validate`'s report. `misplaced(obj, ...)` finds a record or a reference cycle where ckptflow reads
DeepSpeed's data (a tensor, a DeepSpeed dict field): there it is corrupt input, never carried.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ckptflow.formats.deepspeed.names import DEEPSPEED_MODEL_KEYS, USER_STATE_KEYS
from ckptflow.formats.torch.inert import InertRecord, TorchDevice, TorchDtype
from ckptflow.formats.torch.tensorref import TensorRef
from ckptflow.formats.torch.unpickler import PickledObject
from ckptflow.plumbing.text import excerpt, plain

MAX_CLASSES = 12  # classes listed per key; the rest are counted
MAX_KEYS = 50  # keys listed; the rest are counted


@dataclass(frozen=True)
class ClientEntry:
    """One key of the client state: what it holds ("an argparse.Namespace", "a dict of 3 items") and
    the other classes and functions its objects name (never loaded), sorted, with how many more there are."""

    key: str
    holds: str
    classes: tuple[str, ...] = ()
    more_classes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "holds": self.holds, "classes": list(self.classes),
                "more_classes": self.more_classes}

    def describe(self) -> str:
        """One line: `key: what it holds (classes ...)`, the key shown as plain text."""
        text = f"{self.key if _is_plain_key(self.key) else excerpt(self.key, 80)}: {self.holds}"
        if self.classes:
            more = f" and {self.more_classes} more" if self.more_classes else ""
            text += f", naming {', '.join(self.classes)}{more}"
        return text


@dataclass(frozen=True)
class ClientState:
    """The client state of a model-states file: its keys' entries, and how many keys were left out."""

    entries: tuple[ClientEntry, ...] = ()
    more_keys: int = 0

    def __bool__(self) -> bool:
        return bool(self.entries)

    def to_dict(self) -> dict[str, Any]:
        return {"keys": [e.to_dict() for e in self.entries], "more_keys": self.more_keys}


def client_keys(model_states: Mapping[str, Any]) -> list[Any]:
    """The keys of a model-states dict that DeepSpeed does not write: the trainer's client state."""
    return [k for k in model_states if k not in DEEPSPEED_MODEL_KEYS]


def client_state(model_states: Mapping[str, Any]) -> ClientState:
    """What the client state of `model_states` holds, key by key (at most `MAX_KEYS` listed)."""
    keys = client_keys(model_states)
    entries = []
    for key in keys[:MAX_KEYS]:
        value = model_states[key]
        own = class_name(value.qualname) if isinstance(value, InertRecord | PickledObject) else None
        classes = sorted(_classes(value) - {own})
        entries.append(ClientEntry(key if isinstance(key, str) else excerpt(key), holds(value),
                                   tuple(classes[:MAX_CLASSES]), max(0, len(classes) - MAX_CLASSES)))
    return ClientState(tuple(entries), max(0, len(keys) - MAX_KEYS))


def holds(value: Any) -> str:
    """What a value is, in a few words: its class for a record, its type and size for the rest."""
    if isinstance(value, InertRecord):
        name = class_name(value.qualname)
        return f"the {kind_of(value)} {name}" if value.how == "global" else _article(name)
    if isinstance(value, PickledObject):
        return _article(class_name(value.qualname))
    if isinstance(value, TensorRef):
        return f"a {value.dtype} tensor of shape {list(value.shape) if len(value.shape) <= 8 else '...'}"
    if isinstance(value, TorchDtype):
        return f"the dtype torch.{value}"
    if isinstance(value, TorchDevice):
        return f"the device {plain(value)}"
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, (int, float, complex)):
        return _article(type(value).__name__)
    if isinstance(value, str):
        return f"a string of {len(value):,} characters"
    if isinstance(value, bytes):
        return f"{len(value):,} bytes"
    if isinstance(value, (dict, list, tuple, set, frozenset)):
        return f"{_article(type(value).__name__)} of {len(value):,} item{'s' if len(value) != 1 else ''}"
    return _article(type(value).__name__)


def class_name(qualname: str, limit: int = 120) -> str:
    """A class's qualified name for a report, cut when long (`inert.refusal` admits only dotted ASCII
    identifiers, so nothing in it acts on a terminal)."""
    return qualname if len(qualname) <= limit else f"{qualname[:limit]}... ({len(qualname):,} characters)"


def kind_of(record: InertRecord) -> str:
    """"class" or "function": a guess from the name's case, for a global named as a value."""
    return "class" if record.name[:1].isupper() else "function"


def _article(name: str) -> str:
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def _is_plain_key(key: str) -> bool:
    return key.isascii() and key.isprintable() and len(key) <= 80 and "'" not in key


def _classes(value: Any) -> set[str]:
    """The qualified names of every record under `value` (each object visited once)."""
    found: set[str] = set()
    for obj, _ in _walk(value, ""):
        if isinstance(obj, InertRecord | PickledObject):
            found.add(class_name(obj.qualname))
    return found


def _walk(root: Any, path: str) -> Any:
    """(object, path) for every object under `root`, each once (the tree shares references and may refer
    back to itself; the unpickler bounds its depth and size), depth first."""
    seen: set[int] = set()
    stack = [(root, path)]
    while stack:
        obj, where = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        yield obj, where
        stack.extend(reversed(_held(obj, where)))


def _held(obj: Any, where: str) -> list[tuple[Any, str]]:
    """(object, path) for what `obj` holds, in order: a dict's keys that are objects, then its values."""
    if isinstance(obj, Mapping):
        keys = [(k, f"{where}/key {_segment(k)}") for k in obj if not isinstance(k, str | bytes | int | float)]
        return keys + [(v, f"{where}/{_segment(k)}") for k, v in obj.items()]
    if isinstance(obj, list | tuple):
        return [(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, set | frozenset):
        return [(v, f"{where}{{}}") for v in obj]
    if isinstance(obj, PickledObject):
        return [(obj.args, f"{where}.args"), (obj.state, f"{where}.state")]
    if isinstance(obj, InertRecord):
        return [(obj.args, f"{where}.args"), (obj.kwargs, f"{where}.kwargs"),
                *((items, f"{where}.{kind}") for kind, items in obj.ops)]
    return []


def _segment(key: Any) -> str:
    if isinstance(key, InertRecord):  # a record as a key (the only object a key may be): its class, named
        return class_name(key.qualname, 60)
    return key if isinstance(key, str) and _is_plain_key(key) and len(key) <= 60 else excerpt(key, 40)


@dataclass(frozen=True)
class Misplaced:
    """Where ckptflow reads DeepSpeed's data, the first object that is not plain data: an inert record
    (`record`), or an object that refers back to itself (`record` None: a cycle), at path `where`."""

    where: str
    record: InertRecord | None = None


def misplaced(obj: Mapping[str, Any], *, model_states: bool) -> Misplaced | None:
    """The first inert record or reference cycle where ckptflow reads DeepSpeed's data, in one walk:
    anywhere in an optimizer, layer or expert file; in a model-states file, under any key DeepSpeed writes
    except the user's own scheduler and sampler state (`names.USER_STATE_KEYS`). None when there is none:
    ckptflow's readers then take DeepSpeed's fields for trees of plain data."""
    keys = [k for k in obj if not model_states or (k in DEEPSPEED_MODEL_KEYS and k not in USER_STATE_KEYS)]
    done: set[int] = set()
    for key in keys:
        path: set[int] = set()  # the objects being walked: the ancestors of the one on top of the stack
        stack: list[tuple[Any, str, bool]] = [(obj[key], _segment(key), False)]
        while stack:
            item, where, leaving = stack.pop()
            if leaving:
                path.discard(id(item))
                done.add(id(item))
                continue
            if id(item) in path:
                return Misplaced(where)
            if id(item) in done:
                continue
            if isinstance(item, InertRecord):
                return Misplaced(where, item)
            path.add(id(item))
            stack.append((item, where, True))
            stack.extend((kid, at, False) for kid, at in reversed(_held(item, where)))
    return None


def namespace_state(value: Any) -> dict[str, Any] | None:
    """The attributes `value` was built with when it is an `argparse.Namespace` record with a dict state
    (Megatron-DeepSpeed's `args`), else None."""
    if isinstance(value, InertRecord) and value.qualname == "argparse.Namespace" and isinstance(value.state, dict):
        return value.state
    return None


__all__ = ["ClientEntry", "ClientState", "client_keys", "client_state", "holds", "class_name", "Misplaced",
           "misplaced", "namespace_state"]
