"""Source files that change while a command reads them: a rank file truncated by another process
(a sync job, a user) right after consolidate memory-maps it. Reading a mapped page past the new end
of the file raises SIGBUS, which kills the process unless the reader guards against it.

The truncation is done by the harness hook `shrink-after-map` (a wrapper around `mmap.mmap` in the
child process), not by patching ckptflow.
"""

from __future__ import annotations

from tests.hostile.corpus import CONSOLIDATE, Workspace, kind


@kind(commands=(CONSOLIDATE,), expect=r"(?i)changed|truncated|shorter|cannot read", issue="14.9")
def truncated_while_mapped(ws: Workspace) -> None:
    """Rank 0's optimizer file is cut in half right after consolidate maps it."""
    path = ws.optim_file(ws.param(0, lambda r: r.randrange(ws.world_size)))
    ws.hooks.append(("shrink-after-map", str(path)))
    ws.src_may_change = True
    ws.pin(str(path))
