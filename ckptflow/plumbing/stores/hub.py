"""The Hugging Face Hub (`hf://`), where the publish step commits through `huggingface_hub.HfApi`.

The Hub knows a file by content: an LFS file by the sha256 of its bytes, any other by its git blob id
(`holds`). Its `info()` through fsspec carries neither as a store checksum ckptflow reads, and no key
ckptflow stamps: a file is known by its size there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ckptflow.plumbing.stores import Store

STORE = Store(name="hub", protocols=("hf",))


def holds(remote: Any, read: Callable[[], bytes], size: int, sha256: str) -> bool:
    """Whether the Hub's `remote` file (a `huggingface_hub` RepoFile, or None) holds these bytes: by
    LFS sha256, or by git blob id for regular files (small, so `read()` is cheap)."""
    if remote is None or remote.size != size:
        return False
    if remote.lfs is not None:
        return bool(remote.lfs.sha256 == sha256)
    from huggingface_hub.utils.sha import git_hash

    return bool(remote.blob_id == git_hash(read()))


@contextmanager
def quiet_progress_bars() -> Iterator[None]:
    """huggingface_hub's tqdm bars off (progress, where there is any, goes through ckptflow's callbacks),
    then as before."""
    from huggingface_hub.utils.tqdm import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    was_disabled = are_progress_bars_disabled()
    disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            enable_progress_bars()
