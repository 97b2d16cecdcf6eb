"""What a push finds at DEST before it starts: a manifest (the commit marker of an earlier push) or a
partial record (what an interrupted push verified) that is garbage, nested past any recursion limit,
a special file, or lying about paths and stamps.

A bad manifest must be refused with a message saying to delete it (or replaced by a successful push);
a bad partial record only costs time ("it only saves time: start over"), so ignoring it is fine.
"""

from __future__ import annotations

import hashlib
import json

from tests.hostile.corpus import MODEL_FOLDER, PUSH, Workspace, kind

MANIFEST = "ckptflow-manifest.json"
PARTIAL = MANIFEST + ".partial"
REFUSED = r"ckptflow-manifest\.json"
ANY = (0, 1)


def _special(ws: Workspace, name: str, what: str) -> None:
    ws.dest_prepared = True
    path = ws.out / name
    path.parent.mkdir(parents=True, exist_ok=True)
    if what == "fifo":
        import os

        os.mkfifo(path)
    elif what == "dev-zero":
        path.symlink_to("/dev/zero")
    elif what == "directory":
        path.mkdir()
    else:
        raise ValueError(what)


def manifest_kind(name: str, code: int | tuple[int, ...] = ANY, issue: str | None = None, hangs: bool = False):  # noqa: ANN202
    return kind(name=name, source=MODEL_FOLDER, commands=(PUSH,), code=code, expect=REFUSED, issue=issue, hangs=hangs)


@manifest_kind("manifest-garbage", code=ANY)
def _garbage(ws: Workspace) -> None:
    """The manifest at DEST is binary garbage."""
    ws.write_dest(MANIFEST, ws.param(b"\xff\xfe\x00garbage", lambda r: r.randbytes(r.randrange(1, 300))))


@manifest_kind("manifest-not-an-object")
def _list(ws: Workspace) -> None:
    """The manifest at DEST is a JSON list, or an object with `files` of the wrong type."""
    ws.write_dest(MANIFEST, ws.param("[]", lambda r: r.choice(["[]", "null",
                                                               '{"format": "ckptflow-manifest", "version": 1, "files": '
                                                               '{}}',
                                                               '{"format": "ckptflow-manifest", "version": 1, "files": '
                                                               '[1]}'])))


@manifest_kind("manifest-nested-deep", issue="14.4")
def _deep(ws: Workspace) -> None:
    """The manifest at DEST nests 100,000 arrays."""
    ws.write_dest(MANIFEST, '{"format": "ckptflow-manifest", "version": 1, "files": ' + "[" * 100_000 + "]" * 100_000
                  + "}")


@manifest_kind("manifest-hundred-megabytes", issue="14.4")
def _huge(ws: Workspace) -> None:
    """The manifest at DEST is 100 MB of `[`."""
    ws.write_dest(MANIFEST, b"[" * ws.param(100 << 20, lambda r: r.choice([1 << 20, 10 << 20])))


@manifest_kind("manifest-special-file", issue="14.7", hangs=True)
def _special_manifest(ws: Workspace) -> None:
    """The manifest at DEST is a FIFO (or /dev/zero, or a directory)."""
    _special(ws, MANIFEST, ws.pick("fifo", ["fifo", "dev-zero", "directory"]))


@manifest_kind("manifest-path-escape")
def _escape(ws: Workspace) -> None:
    """The manifest at DEST lists `../../etc/passwd`."""
    entry = {"path": "../../etc/passwd", "size": 1, "sha256": "0" * 64}
    ws.write_dest(MANIFEST, json.dumps({"format": "ckptflow-manifest", "version": 1, "files": [entry]}))


@manifest_kind("manifest-stamp-not-an-object")
def _stamp(ws: Workspace) -> None:
    """DEST holds SRC's files and a manifest listing them with stamps that are lists, not objects."""
    files = []
    for path in sorted(p for p in ws.src.rglob("*") if p.is_file()):
        rel = path.relative_to(ws.src).as_posix()
        ws.write_dest(rel, path.read_bytes())
        stamp = ws.param([1, 2], lambda r: r.choice([[1, 2], "x", 5, {"size": []}]))
        files.append({"path": rel, "size": path.stat().st_size, "sha256": hashlib.sha256(b"other").hexdigest(),
                      "stamp": stamp})
    ws.write_dest(MANIFEST, json.dumps({"format": "ckptflow-manifest", "version": 1, "files": files}))


@kind(source=MODEL_FOLDER, commands=(PUSH,), code=ANY, expect=r"ckptflow-manifest\.json\.partial", issue="14.4")
def partial_record_nested_deep(ws: Workspace) -> None:
    """The partial record at DEST nests 100,000 arrays."""
    ws.write_dest(PARTIAL, '{"files": ' + "[" * 100_000 + "]" * 100_000 + "}")


@kind(source=MODEL_FOLDER, commands=(PUSH,), code=ANY, expect=r"ckptflow-manifest\.json\.partial", issue="14.7",
      hangs=True)
def partial_record_special_file(ws: Workspace) -> None:
    """The partial record at DEST is a FIFO (or /dev/zero, or a directory)."""
    _special(ws, PARTIAL, ws.pick("fifo", ["fifo", "dev-zero", "directory"]))


@kind(source=MODEL_FOLDER, commands=(PUSH,), code=ANY, expect=r"ckptflow-manifest\.json\.partial")
def partial_record_odd_entries(ws: Workspace) -> None:
    """DEST holds SRC's files and a partial record whose entries have odd stamps and sizes."""
    entries = {}
    for path in sorted(p for p in ws.src.rglob("*") if p.is_file()):
        rel = path.relative_to(ws.src).as_posix()
        ws.write_dest(rel, path.read_bytes())
        stamp = ws.param([1], lambda r: r.choice([[1], "x", None, {"size": {"a": 1}}]))
        entries[rel] = {"size": ws.param("big", lambda r: r.choice(["big", -1, None])), "sha256": 5, "stamp": stamp}
    ws.write_dest(PARTIAL, json.dumps({"format": "ckptflow-partial", "files": entries}))
