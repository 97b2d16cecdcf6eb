"""Source files that change while a command reads them: a rank file truncated by another process
(a sync job, a user) while consolidate reads it. Had the reader memory-mapped it, touching a page past
the new end would raise SIGBUS and kill the process (it did, issue 14 item 9); a read instead comes
back short and must be reported as a read error.

The truncation is done by harness hooks (wrappers around `mmap.mmap` and `os.preadv` in the child
process: whichever reads the file first cuts it in half), not by patching ckptflow.
"""

from __future__ import annotations

from tests.hostile.corpus import CONSOLIDATE, Workspace, kind


@kind(commands=(CONSOLIDATE,), expect=r"(?i)changed|truncated|shorter|cannot read", issue="14.9")
def truncated_while_read(ws: Workspace) -> None:
    """Rank 0's optimizer file is cut in half right after consolidate first maps or reads its data."""
    path = ws.optim_file(ws.param(0, lambda r: r.randrange(ws.world_size)))
    ws.hooks.append(("shrink-after-map", str(path)))
    ws.hooks.append(("shrink-after-read", str(path)))
    ws.src_may_change = True
    ws.pin(str(path))
