"""The files beside `latest` that consolidate carries into the model folder (config.json, the
generation config, the tokenizer) and that reshard copies into OUT (every other root file): dangling
symlinks, directories, FIFOs and /dev/zero where a file belongs, a hundred megabytes of `[`, JSON
nested past any recursion limit.

What must happen: one clean error naming the file, or the file left out (consolidate may refuse a
config it cannot parse; reshard copies regular files only). Never a traceback, a hang, gigabytes of
memory or a partial OUT.
"""

from __future__ import annotations

from tests.hostile.corpus import CONSOLIDATE, RESHARD, Workspace, kind

LLAMA = "llama-z3-bf16-ws2"
BOTH = (CONSOLIDATE, RESHARD)
EITHER = (0, 1)
SPECIAL = ["dangling", "directory", "fifo", "dev-zero", "loop"]


def _special(ws: Workspace, name: str, what: str) -> None:
    if what == "dangling":
        ws.symlink(name, ws.root / "nowhere.json")
    elif what == "directory":
        ws.directory(name)
    elif what == "fifo":
        ws.fifo(name)
    elif what == "dev-zero":
        ws.symlink(name, "/dev/zero")
    elif what == "loop":
        ws.symlink(name, name)
    else:
        raise ValueError(what)


def _config_kind(what: str, doc: str):  # noqa: ANN202
    def build(ws: Workspace) -> None:
        _special(ws, "config.json", ws.pick(what, SPECIAL))
    build.__doc__ = doc
    return build


for _what, _doc in (
    ("dangling", "config.json is a symlink to nothing."),
    ("directory", "config.json is a directory."),
    ("fifo", "config.json is a FIFO: reading it blocks."),
    ("dev-zero", "config.json is a symlink to /dev/zero: reading it never ends."),
    ("loop", "config.json is a symlink to itself."),
):
    kind(name=f"config-{_what}", source=LLAMA, commands=BOTH, code=EITHER, expect=r"config\.json", issue="14.3",
         hangs=_what == "fifo")(
        _config_kind(_what, _doc))


@kind(source=LLAMA, commands=BOTH, code=EITHER, expect=r"config\.json", issue="14.3")
def config_hundred_megabytes_of_brackets(ws: Workspace) -> None:
    """config.json is 100 MB of `[`."""
    size = ws.param(100 << 20, lambda r: r.choice([1 << 20, 10 << 20]))
    ws.write("config.json", b"[" * size)


@kind(source=LLAMA, commands=BOTH, code=EITHER, expect=r"config\.json", issue="14.3")
def config_nested_deep(ws: Workspace) -> None:
    """config.json nests 100,000 arrays (a RecursionError for json)."""
    depth = ws.param(100_000, lambda r: r.choice([2000, 100_000]))
    ws.write("config.json", '{"a": ' + "[" * depth + "]" * depth + "}")


@kind(source=LLAMA, commands=BOTH, code=EITHER, expect=r"config\.json")
def config_not_an_object(ws: Workspace) -> None:
    """config.json holds a JSON list."""
    ws.write("config.json", ws.param("[1, 2, 3]", lambda r: r.choice(["[1]", "null", "3", '"x"', "true"])))


@kind(source=LLAMA, commands=BOTH, code=EITHER, expect=r"config\.json")
def config_not_json(ws: Workspace) -> None:
    """config.json is not JSON: not UTF-8, truncated, an integer of 5,000 digits."""
    ws.write("config.json", ws.param(b"\xff\xfe{", lambda r: r.choice([b"\xff\xfe{", b'{"a": 1', b'{"a": ' + b"1" * 5000
                                                                       + b"}", b""])))


@kind(source=LLAMA, commands=BOTH, code=EITHER, expect=r"tokenizer\.json", issue="14.3", hangs=True)
def tokenizer_fifo(ws: Workspace) -> None:
    """tokenizer.json is a FIFO (consolidate copies it, reshard too)."""
    _special(ws, "tokenizer.json", ws.pick("fifo", SPECIAL))


@kind(source=LLAMA, commands=BOTH, code=EITHER, expect=r"generation_config\.json", issue="14.3")
def generation_config_dev_zero(ws: Workspace) -> None:
    """generation_config.json is a symlink to /dev/zero."""
    _special(ws, "generation_config.json", ws.pick("dev-zero", SPECIAL))


@kind(source=LLAMA, commands=(RESHARD,), code=EITHER, expect=r"trainer_state\.json", issue="14.3", hangs=True)
def other_root_file_fifo(ws: Workspace) -> None:
    """A FIFO among the root files reshard carries over (`trainer_state.json`)."""
    _special(ws, "trainer_state.json", ws.pick("fifo", SPECIAL))


@kind(source=LLAMA, commands=(RESHARD,), code=EITHER, expect=r"rng_state\.pth", issue="14.3")
def other_root_file_dev_zero(ws: Workspace) -> None:
    """`rng_state.pth` is a symlink to /dev/zero: copying it fills the disk (here: the file-size limit)."""
    _special(ws, "rng_state.pth", ws.pick("dev-zero", SPECIAL))


@kind(source=LLAMA, commands=(RESHARD,), code=EITHER, expect=r"scheduler\.pt", issue="14.3")
def other_root_file_dangling(ws: Workspace) -> None:
    """`scheduler.pt` is a dangling symlink."""
    _special(ws, "scheduler.pt", ws.pick("dangling", SPECIAL))


@kind(source=LLAMA, commands=(RESHARD,), code=EITHER, expect=r"events\.fifo|runs", issue="14.3", hangs=True)
def fifo_in_a_subfolder(ws: Workspace) -> None:
    """A FIFO inside a subfolder of the checkpoint root (`runs/events.fifo`)."""
    ws.fifo("runs/events.fifo")
