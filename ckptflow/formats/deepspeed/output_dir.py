"""A Hugging Face Trainer's `output_dir`: `checkpoint-{step}` folders, each a checkpoint with its own
`latest`, and no `latest` of its own. Which of them to read.

The newest complete one: the highest step whose folder reads as a checkpoint without a problem (its
`latest` names a tag that is there, every rank's files are present and agree). A newer one still being
written (or left half-written by a crash) is skipped, and the choice says why. At most
`MAX_CANDIDATES` folders are examined, newest first, so a run that kept every checkpoint is not read
whole. Which folder is complete is asked of the caller (`problem`), so this module knows nothing of
readers.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ckptflow.plumbing.storage import join, open_fs

CHECKPOINT_DIR = re.compile(r"checkpoint-(\d+)")  # transformers' PREFIX_CHECKPOINT_DIR + "-" + step
MAX_CANDIDATES = 8  # folders examined, newest first
MAX_WHY = 300  # characters of a skipped folder's problem in the note


@dataclass(frozen=True, kw_only=True)
class Choice:
    """The `checkpoint-N` folder taken from an output_dir (None when no examined one is complete), the
    newer ones skipped with why, and how many folders there were."""

    output_dir: str
    taken: str | None  # a folder name under output_dir
    found: int  # checkpoint-* folders in output_dir
    skipped: tuple[tuple[str, str], ...]  # (folder name, its first problem), newest first

    @property
    def uri(self) -> str | None:
        return join(self.output_dir, self.taken) if self.taken else None

    def to_dict(self) -> dict[str, Any]:
        return {"output_dir": self.output_dir, "taken": self.taken, "found": self.found,
                "skipped": [{"folder": name, "why": why} for name, why in self.skipped]}

    @property
    def note(self) -> str:
        """'taken: OUT/checkpoint-30 (newest complete of 3; checkpoint-40 skipped: <why>)'."""
        skipped = "".join(f"; {name} skipped: {why}" for name, why in self.skipped)
        return f"taken: {self.uri} (newest complete of {self.found}{skipped})"

    @property
    def failure(self) -> str:
        """Why nothing was taken, naming every folder examined."""
        examined = len(self.skipped)
        which = f"the newest {examined} of its {self.found}" if self.found > examined else f"its {self.found}"
        why = "; ".join(f"{name}: {why}" for name, why in self.skipped)
        return (f"{self.output_dir} has no `latest` and none of {which} checkpoint-* folders is a complete "
                f"checkpoint: {why}")


def checkpoint_folders(names: Iterable[str]) -> list[str]:
    """The `checkpoint-{step}` names among `names`, newest (highest step) first."""
    steps = [(int(m.group(1)), n) for n in names if (m := CHECKPOINT_DIR.fullmatch(n))]
    return [n for _, n in sorted(steps, reverse=True)]


def folders_in(uri: str) -> list[str]:
    """The `checkpoint-{step}` folders directly under `uri`, newest first ([] when there are none)."""
    fs, path = open_fs(uri)
    try:
        entries = fs.ls(path, detail=True)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return checkpoint_folders(posixpath.basename(e["name"].rstrip("/")) for e in entries if e["type"] == "directory")


def choose(output_dir: str, folders: list[str], problem: Callable[[str], str | None]) -> Choice:
    """The newest of `folders` (newest first) for which `problem(uri)` is None, examining at most
    `MAX_CANDIDATES`; `problem` says what is wrong with the checkpoint at a folder's URI."""
    output_dir = output_dir.rstrip("/")
    skipped: list[tuple[str, str]] = []
    for name in folders[:MAX_CANDIDATES]:
        why = problem(join(output_dir, name))
        if why is None:
            return Choice(output_dir=output_dir, taken=name, found=len(folders), skipped=tuple(skipped))
        skipped.append((name, why if len(why) <= MAX_WHY else why[:MAX_WHY] + "..."))
    return Choice(output_dir=output_dir, taken=None, found=len(folders), skipped=tuple(skipped))
