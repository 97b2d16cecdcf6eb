"""Progress: one callback contract, and one tally that adds concurrent parts into it.

Every step that reports progress takes `progress(done, total)`: bytes done so far and bytes in all,
called from any thread, `done` never above `total`. A caller renders it (a rich bar in the CLI, a
Prefect progress artifact in a task); the core never prints.

Work that runs in parts (units on a pool, threads filling one file) reports through a `Tally`:
each part gets its own `Progress` from `tally.part(key)` and reports its own (done, total); the
tally sums the parts and calls the step's callback. A part that starts over (a retried unit)
reports from zero again and its earlier count is replaced, never added twice.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable

Progress = Callable[[int, int], None]  # (bytes done, bytes in all)


class Tally:
    """Sums the progress of concurrent parts into one `Progress` of `total` bytes."""

    def __init__(self, total: int, progress: Progress | None = None) -> None:
        self.total = max(0, total)
        self._progress = progress
        self._parts: dict[Hashable, int] = {}
        self._lock = threading.Lock()

    @property
    def done(self) -> int:
        with self._lock:
            return min(sum(self._parts.values()), self.total)

    def part(self, key: Hashable) -> Progress:
        """The `Progress` of part `key`; its reports replace that part's earlier ones."""

        def update(done: int, _total: int) -> None:
            with self._lock:
                self._parts[key] = done
                current = min(sum(self._parts.values()), self.total)
            if self._progress is not None:
                self._progress(current, self.total)

        return update

    def add(self, key: Hashable, nbytes: int) -> None:
        """Count `nbytes` more for part `key` (for parts that only know what they just did)."""
        with self._lock:
            self._parts[key] = self._parts.get(key, 0) + nbytes
            current = min(sum(self._parts.values()), self.total)
        if self._progress is not None:
            self._progress(current, self.total)

    def start(self) -> None:
        """Report (0, total) before any part has run, so a bar shows its size at once."""
        if self._progress is not None:
            self._progress(self.done, self.total)
