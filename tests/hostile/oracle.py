"""What every run of a command on hostile input must satisfy, whatever the input.

`judge` returns the violations (empty when the run was fine):

- finished inside the time limit, not killed by a signal (SIGBUS, SIGSEGV ...), resident memory
  within `Limits.rss_growth` of the zygote's, no MemoryError/RecursionError/OverflowError reported;
- no `Traceback`; exit status 0, 1 or 2 (and the one the kind expects);
- on exit 1, one `error:` line on stderr and nothing else; `validate` may instead print its report
  (an `invalid ...` line, then one `  code: message` line per problem). Every message line names a
  file, rank or tensor (a path under the workspace, `rank N`, `tensor X`, or the hf:// DEST), is at
  most `MAX_LINE` characters and holds no control characters;
- the kind's `expect` regex is found in the output (whitespace collapsed), `forbid` is not, and so
  are the literal texts the builder asked to be shown (input quoted as it is, markup and all);
- the payload marker does not exist: nothing from the input ran;
- nothing is left behind: OUT's parent holds only OUT after a success and nothing after a failure
  (no OUT, no `.OUT.*` staging sibling); a failed push to a folder leaves no manifest there; a
  failed push to the Hub makes no commit; SRC is exactly as it was.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.hostile.corpus import CONSOLIDATE, DEEP, PUSH, PUSH_HF, RESHARD, VALIDATE, Outcome, Workspace
from tests.hostile.harness import Limits, Result

MAX_LINE = 2000
MANIFEST = "ckptflow-manifest.json"
# What a run reports when it hit one of the harness's limits (address space, file size) or Python's
# own, instead of checking the input: a finding even when it comes out as a clean error line.
LIMIT_ERRORS = re.compile(r"\b(MemoryError|RecursionError|OverflowError|maximum recursion depth|File too large"
                          r"|Cannot allocate memory)\b")
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
LOCATION = re.compile(r"\brank \d+|\btensor \S|hf://|\bparameter \S|`latest`"
                      r"|\b[\w.+-]+\.(?:json|safetensors|pt|pth|bin|txt|model|jinja|partial)\b")


@dataclass(frozen=True)
class Snapshot:
    """What the workspace looked like before a command ran."""

    src: tuple[tuple[str, int, bool], ...]
    out_parent: frozenset[str]
    hub_commits: int
    manifest: bytes | None  # DEST's manifest before a push (a kind may put a bad one there)


def listing(root: Path) -> tuple[tuple[str, int, bool], ...]:
    """(relative path, size, is a link) of everything under `root`, links and special files not followed."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            out.append((os.path.relpath(path, root), st.st_size if not os.path.isdir(path) or os.path.islink(path)
                        else 0,
                        os.path.islink(path)))
    return tuple(sorted(out))


def hub_commits(hub: Any, repo_id: str) -> int:
    if hub is None:
        return 0
    repo = hub.repos.get(("model", repo_id))
    return len(repo.commits) if repo is not None else 0


def read_manifest(ws: Workspace) -> bytes | None:
    path = ws.out / MANIFEST
    if not path.is_file() or path.is_symlink():
        return None if not os.path.lexists(path) else b"<not a regular file>"
    with open(path, "rb") as fh:
        return fh.read(1 << 20)


def snapshot(ws: Workspace, hub: Any = None) -> Snapshot:
    return Snapshot(listing(ws.src), frozenset(os.listdir(ws.out_parent)), hub_commits(hub, ws.hub_repo),
                    read_manifest(ws))


def normalize(text: str) -> str:
    return " ".join(text.split())


def message_lines(command: str, result: Result) -> tuple[list[str], list[str]]:
    """(the lines that carry the error, structural violations) of a run that exited 1."""
    errs = [line for line in result.stderr.splitlines() if line.strip()]
    outs = [line for line in result.stdout.splitlines() if line.strip()]
    if command in (VALIDATE, DEEP) and not errs and outs and outs[0].startswith("invalid "):
        bad = [line for line in outs[1:] if not re.match(r"^  [a-z0-9-]+: \S", line)]
        return outs, ([f"report line is not `  code: message`: {bad[0][:200]!r}"] if bad else [])
    problems = []
    if len(errs) != 1 or not errs[0].startswith("error: "):
        problems.append(f"expected one `error:` line on stderr, got {len(errs)} line(s): {[e[:200] for e in errs[:4]]}")
    if outs:
        problems.append(f"expected nothing on stdout after an error, got {outs[0][:200]!r}")
    return errs, problems


def exception_line(output: str) -> str:
    """The `Type: message` line that ends the last traceback in `output`."""
    lines = output.splitlines()
    start = max(i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)"))
    for line in lines[start + 1:]:
        if line and not line.startswith(" "):
            return line
    return "?"


def culprit(output: str) -> str:
    """`ckptflow/<module>.py:<line> in <function>` of the innermost ckptflow frame of the last traceback."""
    frames = re.findall(r'File "[^"]*/(ckptflow/[^"]+\.py)", line (\d+), in (\S+)', output)
    if not frames:
        return "no ckptflow frame"
    path, line, func = frames[-1]
    return f"{path}:{line} in {func}"


def judge(ws: Workspace, command: str, outcome: Outcome | None, result: Result, before: Snapshot,
          *, limits: Limits, hub: Any = None) -> list[str]:
    v: list[str] = []
    output = result.output
    if result.timed_out:
        v.append(f"hang: still running after {limits.seconds:g}s (killed)")
    elif result.signal:
        import signal

        v.append(f"killed by {signal.Signals(result.signal).name}")
    traceback = "Traceback (most recent call last)" in output
    if traceback:
        v.append(f"traceback: {exception_line(output)[:300]} ({culprit(output)})")
    if ws.marker.exists():
        v.append("a code payload ran (the marker file exists)")
    if not result.spawned and result.rss_growth > limits.rss_growth:
        v.append(f"memory: resident set grew by {result.rss_growth >> 20} MiB (bound {limits.rss_growth >> 20} MiB)")
    if (found := LIMIT_ERRORS.search(output)) and "Traceback" not in output:
        v.append(f"reports {found.group(1)}: an internal limit was hit, not the input checked")
    code = result.returncode
    if not result.timed_out and not result.signal:
        if code not in (0, 1, 2):
            v.append(f"exit status {code} (0, 1 or 2 expected)")
        elif outcome is not None and not outcome.allows(code):
            v.append(f"exit status {code}, expected {outcome.code}")
    text = normalize(output)
    if code == 1 and not result.timed_out and not traceback:
        lines, problems = message_lines(command, result)
        v += problems
        root = str(ws.root)
        for line in lines:
            if len(line) > MAX_LINE:
                v.append(f"an error line of {len(line)} characters (at most {MAX_LINE})")
            if CONTROL.search(line):
                v.append(f"control characters in an error line: {line[:200]!r}")
            if root not in line and not LOCATION.search(line):
                v.append(f"an error line names no file, rank or tensor: {line[:300]!r}")
        if outcome is not None and outcome.expect and not re.search(outcome.expect, text):
            v.append(f"message does not match /{outcome.expect}/")
        for literal, commands in ws.must_show:
            if (not commands or command in commands) and normalize(literal) not in text:
                v.append(f"the output does not show the input as it is: {literal[:80]!r} missing")
    if outcome is not None and outcome.forbid and re.search(outcome.forbid, text):
        v.append(f"output matches the forbidden /{outcome.forbid}/")
    if not result.timed_out and not result.signal:  # a killed run cannot clean up: the kill is the finding
        v += leftovers(ws, command, code, before, hub)
    return v


def leftovers(ws: Workspace, command: str, code: int | None, before: Snapshot, hub: Any) -> list[str]:
    v = []
    if listing(ws.src) != before.src and not ws.src_may_change:
        v.append("SRC changed: a command must never write into its input")
    after = frozenset(os.listdir(ws.out_parent))
    ok = code == 0
    if command in (CONSOLIDATE, RESHARD):
        want = before.out_parent | {ws.out.name} if ok else before.out_parent
        if after != want:
            v.append(f"left in OUT's folder: {sorted(after - before.out_parent)} (expected "
                     f"{sorted(want - before.out_parent)})")
    elif command == PUSH:
        manifest = read_manifest(ws)
        if ok and (manifest is None or manifest == before.manifest):
            v.append("a successful push wrote no manifest")
        elif not ok and manifest is not None and manifest != before.manifest:
            v.append("a failed push wrote a manifest")
    elif command == PUSH_HF and not ok and hub_commits(hub, ws.hub_repo) > max(before.hub_commits, 1):
        v.append("a failed push made a commit on the Hub")
    return v
