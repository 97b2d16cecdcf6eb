"""Build a kind's input and run its commands on it through the harness, judged by the oracle.

`Runner(harness, fixtures, workdir, hub)` is what the corpus tests, the fuzzer and the replay command
share. `run_kind(kind, commands, rng, label)` builds one workspace (in `workdir/label`), runs each
command on it in turn (OUT emptied in between) and returns one `CaseRun` per command.
"""

from __future__ import annotations

import random
import re
import shutil
import traceback
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tests.hostile.corpus import HANG_SECONDS, PUSH_HF, Kind, Outcome, Workspace, prepare
from tests.hostile.harness import Harness, Limits, Result
from tests.hostile.oracle import judge, snapshot


@dataclass(frozen=True)
class CaseRun:
    kind: str
    command: str
    label: str  # the workspace folder's name: the kind, and the seed for fuzzed cases
    result: Result | None
    violations: tuple[str, ...]
    root: Path

    @property
    def ok(self) -> bool:
        return not self.violations

    def report(self) -> str:
        head = f"[{self.kind} :: {self.command}] {self.root}"
        body = "\n".join(f"  - {v}" for v in self.violations)
        return f"{head}\n{body}\n{self.result.describe() if self.result else ''}".rstrip()


@dataclass
class Runner:
    harness: Harness
    fixtures: Mapping[str, Any]
    workdir: Path
    hub: Any = None  # tests.servers.hub.HubServer for push-hf, else those commands are skipped
    limits: Limits = field(default_factory=Limits)
    keep: bool = False  # keep workspaces of runs that were fine (failed ones are always kept)
    # After a command hung, skip the case's other commands (they read the same input the same way
    # first; the case has failed already): the fuzzer's default run, where a hang costs its limit.
    stop_after_hang: bool = False

    def run_kind(self, kind: Kind, commands: Sequence[str] | None = None, *, seed: int | None = None,
                 label: str | None = None, outcomes: Mapping[str, Outcome | None] | None = None) -> list[CaseRun]:
        """Build `kind` (canonical, or with parameters drawn from `seed`) and run `commands` (default:
        all of the kind's) on it in turn. The input is built again before a command when the kind put
        something at DEST or changes SRC itself, so that every command sees the input as built."""
        label = label or _safe(kind.name)
        root = self.workdir / label
        commands = [c for c in (commands or kind.commands) if c != PUSH_HF or self.hub is not None]
        runs: list[CaseRun] = []
        ws: Workspace | None = None
        for command in commands:
            if ws is None or ws.src_may_change or any(ws.out_parent.iterdir()) or ws.dest_prepared:
                try:
                    ws = prepare(kind, root, self.fixtures, None if seed is None else random.Random(seed))
                except Exception:
                    runs.append(CaseRun(kind.name, command, label, None,
                                        (f"the builder failed:\n{traceback.format_exc()}",), root))
                    ws = None
                    continue
            outcome = (outcomes or kind.outcomes).get(command)
            if kind.hangs and seed is None and ws.seconds is None:
                ws.seconds = HANG_SECONDS
            runs.append(self._run(ws, kind, command, outcome, label))
            _empty(ws.out_parent)
            if self.stop_after_hang and runs[-1].result is not None and runs[-1].result.timed_out:
                break
        if runs and all(r.ok for r in runs) and not self.keep:
            shutil.rmtree(root, ignore_errors=True)
        return runs

    def _run(self, ws: Workspace, kind: Kind, command: str, outcome: Outcome | None, label: str) -> CaseRun:
        limits = replace(self.limits, seconds=ws.seconds) if ws.seconds else self.limits
        env = dict(ws.env)
        if command == PUSH_HF:
            from tests.servers.hub import WRITE_TOKEN

            env.update(HF_ENDPOINT=self.hub.url, HF_TOKEN=WRITE_TOKEN, HF_HOME=str(ws.root / "hf-home"))
        before = snapshot(ws, self.hub)
        result = self.harness.run(ws.argv(command), cwd=ws.root, env=env, hooks=ws.hooks, limits=limits)
        try:
            violations = judge(ws, command, outcome, result, before, limits=limits, hub=self.hub)
        except Exception:
            violations = [f"the oracle failed:\n{traceback.format_exc()}"]
        return CaseRun(kind.name, command, label, result, tuple(violations), ws.root)

    def run_many(self, jobs: Iterable[tuple[Kind, Sequence[str] | None, int | None, str]],
                 outcomes: Mapping[str, Outcome | None] | None = None) -> list[CaseRun]:
        """Run (kind, commands, seed, label) jobs on the harness's workers; results in job order."""
        with ThreadPoolExecutor(max_workers=self.harness.workers) as pool:
            futures = [pool.submit(self.run_kind, k, c, seed=sd, label=lbl, outcomes=outcomes)
                       for k, c, sd, lbl in jobs]
            return [run for f in futures for run in f.result()]


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "--", name)


def _empty(folder: Path) -> None:
    for entry in folder.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
