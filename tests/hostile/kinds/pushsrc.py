"""What `push` is given: a folder made of fixture files (a real safetensors file, config, tokenizer)
with special files in it, safetensors files whose headers lie, and model-card inputs (the provenance
record, config.json) that are not what they claim.

`push hf://` reads every safetensors header to count parameters for the model card when there is no
provenance record, so a header must be bounded (safetensors' own limit is 100 MB) and checked; a
file that is not valid safetensors must not be published as one. A push to a folder or bucket
copies any folder, so only the generic contract applies there.
"""

from __future__ import annotations

import json
import struct

from tests.hostile.corpus import MODEL_FOLDER, PUSH, PUSH_HF, PUSHERS, Workspace, kind

ST = r"model\.safetensors"
ANY = (0, 1)
LFS_POINTER = (
    "version https://git-lfs.github.com/spec/v1\n"
    "oid sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393\n"
    "size 12345\n"
)


def _header(doc: object | bytes, length: int | None = None, tail: bytes = b"") -> bytes:
    raw = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + tail


def safetensors_kind(name: str, issue: str = "14.1"):  # noqa: ANN202
    """A kind whose model.safetensors is made by the decorated function: push-hf must refuse it
    naming the file; a push to a folder may copy it."""
    return kind(name=name, source=MODEL_FOLDER, commands=PUSHERS, expect=ST, issue=issue,
                overrides={PUSH: {"code": ANY, "expect": None}})


@safetensors_kind("safetensors-lfs-pointer")
def _lfs(ws: Workspace) -> None:
    """model.safetensors is a Git LFS pointer (its first 8 bytes read as a header length of ~2**60)."""
    ws.write("model.safetensors", LFS_POINTER)


@safetensors_kind("safetensors-header-2-60")
def _huge_length(ws: Workspace) -> None:
    """The header length field says 2**60 bytes."""
    length = ws.param(2**60, lambda r: r.choice([2**60, 2**64 - 1, 2**32, 10**9, 100 * 2**20 + 1]))
    ws.write("model.safetensors", _header({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, length,
                                          b"\0" * 4))


@safetensors_kind("safetensors-header-past-end")
def _past_end(ws: Workspace) -> None:
    """The header length field says more than the file holds."""
    ws.write("model.safetensors", _header({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, 10**6))


@safetensors_kind("safetensors-header-over-100mb")
def _over_limit(ws: Workspace) -> None:
    """A header of 100 MB + 1 byte (a sparse file of zeros): over safetensors' own limit."""
    path = ws.src / "model.safetensors"
    # under the harness's 256 MiB file-size bound: a push to a bucket or folder copies the file whole
    size = ws.param(100 * 2**20 + 1, lambda r: r.choice([100 * 2**20 + 1, 200 * 2**20]))
    ws.sparse("model.safetensors", 8 + size + 4, struct.pack("<Q", size))
    assert path.stat().st_size == 8 + size + 4


@safetensors_kind("safetensors-header-list")
def _list(ws: Workspace) -> None:
    """The header is a JSON list."""
    ws.write("model.safetensors", _header([1, 2, 3]))


@safetensors_kind("safetensors-shape-missing")
def _no_shape(ws: Workspace) -> None:
    """A tensor entry without `shape`."""
    ws.write("model.safetensors", _header({"w": {"dtype": "F32", "data_offsets": [0, 4]}}, tail=b"\0" * 4))


@safetensors_kind("safetensors-shape-string")
def _str_shape(ws: Workspace) -> None:
    """A tensor entry whose `shape` is a string."""
    shape = ws.param("12", lambda r: r.choice(["12", "[1]", None, {"a": 1}, [1.5], [-1], [2**70]]))
    ws.write("model.safetensors", _header({"w": {"dtype": "F32", "shape": shape, "data_offsets": [0, 4]}},
                                          tail=b"\0" * 4))


@safetensors_kind("safetensors-entry-not-an-object")
def _entry_list(ws: Workspace) -> None:
    """A tensor entry that is a list, not an object."""
    ws.write("model.safetensors", _header({"w": [1, 2], "__metadata__": {"format": "pt"}}))


@safetensors_kind("safetensors-nested-deep")
def _deep(ws: Workspace) -> None:
    """A header that nests 100,000 arrays."""
    depth = ws.param(100_000, lambda r: r.choice([2000, 100_000]))
    ws.write("model.safetensors", _header(b'{"w": ' + b"[" * depth + b"]" * depth + b"}"))


@safetensors_kind("safetensors-not-utf8")
def _binary(ws: Workspace) -> None:
    """A header of bytes that are not UTF-8."""
    ws.write("model.safetensors", _header(ws.param(b"\xff\xfe\xfd{}", lambda r: r.randbytes(r.randrange(1, 64)))))


@safetensors_kind("safetensors-short")
def _short(ws: Workspace) -> None:
    """model.safetensors is 3 bytes long."""
    ws.write("model.safetensors", ws.param(b"abc", lambda r: r.randbytes(r.randrange(0, 8))))


# -- special files in SRC ----------------------------------------------------------------------------------


def _special(ws: Workspace, rel: str, what: str) -> None:
    if what == "fifo":
        ws.fifo(rel)
    elif what == "dev-zero":
        ws.symlink(rel, "/dev/zero")
    elif what == "dangling":
        ws.symlink(rel, ws.root / "nowhere.bin")
    elif what == "loop":
        ws.symlink(rel, rel.rsplit("/", 1)[-1])
    else:
        raise ValueError(what)


SPECIAL = ["fifo", "dev-zero", "dangling", "loop"]


@kind(source=MODEL_FOLDER, commands=PUSHERS, code=ANY, expect=r"extra\.bin", issue="14.7", hangs=True)
def src_fifo(ws: Workspace) -> None:
    """A FIFO in the folder to push (`extra.bin`): reading it blocks."""
    _special(ws, "extra.bin", ws.pick("fifo", SPECIAL))


@kind(source=MODEL_FOLDER, commands=PUSHERS, code=ANY, expect=r"zeros\.bin", issue="14.7", hangs=True)
def src_dev_zero(ws: Workspace) -> None:
    """`zeros.bin` in the folder to push is a symlink to /dev/zero: it never ends."""
    _special(ws, "zeros.bin", ws.pick("dev-zero", SPECIAL))


@kind(source=MODEL_FOLDER, commands=PUSHERS, code=ANY, expect=r"gone\.bin", issue="14.7")
def src_dangling_symlink(ws: Workspace) -> None:
    """`gone.bin` in the folder to push is a symlink to nothing."""
    _special(ws, "gone.bin", ws.pick("dangling", SPECIAL))


@kind(source=MODEL_FOLDER, commands=PUSHERS, code=ANY, expect=r"sub/", issue="14.7", hangs=True)
def src_fifo_in_subfolder(ws: Workspace) -> None:
    """A FIFO in a subfolder of the folder to push (`sub/pipe`)."""
    _special(ws, "sub/pipe", ws.pick("fifo", SPECIAL))


@kind(source=MODEL_FOLDER, commands=PUSHERS, code=ANY)
def src_symlink_out_of_the_folder(ws: Workspace) -> None:
    """`secret.txt` in the folder to push is a symlink to a file outside it (published or refused:
    either is clean; the report says which)."""
    outside = ws.root / "outside-secret.txt"
    outside.write_text("a file outside SRC\n")
    ws.symlink("secret.txt", outside)


# -- model-card inputs (push hf:// without README.md) -------------------------------------------------------


def _card_kind(name: str, file: str, issue: str | None = "14.1", hangs: bool = False):  # noqa: ANN202
    return kind(name=name, source=MODEL_FOLDER, commands=(PUSH_HF,), code=ANY, expect=file.replace(".", r"\."),
                issue=issue, hangs=hangs)


@_card_kind("provenance-source-not-an-object", "ckptflow_provenance.json")
def _prov_list(ws: Workspace) -> None:
    """ckptflow_provenance.json holds `"source": []` and `"output": "x"`."""
    doc = ws.param({"source": [], "output": "x"}, lambda r: r.choice([{"source": []}, {"output": "x"},
                                                                      {"source": {"zero_stage": 1}},
                                                                      {"output": {"total_parameters": "many"}}, [1]]))
    ws.write("ckptflow_provenance.json", json.dumps(doc))


@_card_kind("provenance-nested-deep", "ckptflow_provenance.json")
def _prov_deep(ws: Workspace) -> None:
    """ckptflow_provenance.json nests 100,000 arrays."""
    ws.write("ckptflow_provenance.json", '{"source": ' + "[" * 100_000 + "]" * 100_000 + "}")


@_card_kind("card-config-fifo", "config.json", issue="14.7", hangs=True)
def _config_fifo(ws: Workspace) -> None:
    """config.json in the folder to push is a FIFO (the model card reads it)."""
    _special(ws, "config.json", ws.pick("fifo", SPECIAL))


@_card_kind("card-config-dev-zero", "config.json", issue="14.7", hangs=True)
def _config_zero(ws: Workspace) -> None:
    """config.json in the folder to push is a symlink to /dev/zero."""
    _special(ws, "config.json", ws.pick("dev-zero", SPECIAL))


@_card_kind("card-config-nested-deep", "config.json")
def _config_deep(ws: Workspace) -> None:
    """config.json in the folder to push nests 100,000 arrays."""
    ws.write("config.json", '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")


@kind(source=MODEL_FOLDER, commands=PUSHERS, code=ANY)
def index_not_json(ws: Workspace) -> None:
    """model.safetensors.index.json is garbage, nested deep, or names shards that are not there."""
    ws.write("model.safetensors.index.json", ws.param(
        '{"weight_map": {"w": "model-00009-of-00009.safetensors"}}',
        lambda r: r.choice([b"\xff\xfe", "[" * 100_000, '{"weight_map": []}', '{"metadata": {"total_size": -1}}'])))
