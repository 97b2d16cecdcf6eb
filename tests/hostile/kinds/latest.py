"""Bad `latest` pointers: ten megabytes of text, an 8 GB sparse file, binary content, control
characters, special files where the pointer belongs. Every message must name `latest`, quote at most
a short escaped excerpt of it, and read at most a few KB of it."""

from __future__ import annotations

from tests.hostile.corpus import Workspace, kind

LATEST = r"latest"


@kind(expect=LATEST, issue="14.6")
def ten_megabytes(ws: Workspace) -> None:
    """`latest` holds ten million characters of a plausible tag."""
    size = ws.param(10**7, lambda r: r.choice([300, 5000, 10**6, 10**7]))
    ws.write("latest", "global_step" + "9" * size)


@kind(expect=LATEST, issue="14.6")
def eight_gigabytes_sparse(ws: Workspace) -> None:
    """`latest` is an 8 GB sparse file (a tag, then a hole): it must not be read whole."""
    size = ws.param(8 << 30, lambda r: r.choice([1 << 30, 8 << 30, 1 << 40]))
    ws.sparse("latest", size, b"global_step3")


@kind(expect=LATEST, forbid=r"latest\S* is empty", issue="14.6")
def binary(ws: Workspace) -> None:
    """`latest` holds bytes that are not UTF-8 text (reported today as "empty")."""
    ws.write("latest", ws.param(b"\xff\xfe\x00\x9cglobal_step3", lambda r: r.randbytes(r.randrange(1, 200))))


@kind(expect=LATEST)
def control_characters(ws: Workspace) -> None:
    """`latest` holds terminal escape sequences and other control characters."""
    ws.write("latest", ws.param("global_step3\x1b[2J\x1b]0;owned\x07\r",
                                lambda r: "".join(chr(r.randrange(32)) for _ in range(r.randrange(1, 40)))))


@kind(expect=LATEST)
def several_lines(ws: Workspace) -> None:
    """`latest` holds two tags on two lines."""
    ws.write("latest", "global_step3\nglobal_step4\n")


@kind(expect=LATEST)
def byte_order_mark(ws: Workspace) -> None:
    """`latest` starts with a UTF-8 byte order mark (an editor saved it)."""
    ws.write("latest", "\ufeffglobal_step3")


@kind(expect=LATEST)
def empty(ws: Workspace) -> None:
    """`latest` is empty."""
    ws.write("latest", ws.param("", lambda r: r.choice(["", " ", "\n\n", "\t"])))


@kind(expect=LATEST)
def a_directory(ws: Workspace) -> None:
    """`latest` is a directory."""
    ws.directory("latest")


@kind(expect=LATEST)
def a_fifo(ws: Workspace) -> None:
    """`latest` is a FIFO: opening it for reading blocks until a writer comes."""
    ws.fifo("latest")


@kind(expect=LATEST)
def dev_zero(ws: Workspace) -> None:
    """`latest` is a symlink to /dev/zero: reading it never ends."""
    ws.symlink("latest", "/dev/zero")


@kind(expect=LATEST)
def dangling_symlink(ws: Workspace) -> None:
    """`latest` is a symlink to nothing."""
    ws.symlink("latest", ws.root / "nowhere")


@kind(expect=LATEST)
def symlink_loop(ws: Workspace) -> None:
    """`latest` is a symlink to itself."""
    ws.symlink("latest", "latest")


@kind(expect=r"does not exist|not a (?:folder|directory)|latest")
def names_a_file(ws: Workspace) -> None:
    """`latest` names a regular file beside it, not a folder."""
    ws.write("global_step7", "not a folder")
    ws.write("latest", "global_step7")


@kind(code=(0, 1), expect=LATEST, issue="14.6", hangs=True)
def symlink_to_a_big_file(ws: Workspace) -> None:
    """`latest` is a symlink to a 64 MB file elsewhere."""
    big = ws.root / "big.bin"
    with open(big, "wb") as fh:
        fh.write(b"global_step3")
        fh.truncate(ws.param(64 << 20, lambda r: r.choice([1 << 20, 64 << 20])))
    ws.symlink("latest", big)
