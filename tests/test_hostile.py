"""The corpus of hostile inputs (tests/hostile/kinds) on consolidate, reshard and push, and the checks
that keep the corpus and its harness honest.

Each kind builds its input from a real fixture and says which commands read it and what a user must
get from each; `tests/hostile/oracle.py` says what every run must satisfy whatever the input (one
clean error line, no traceback, no hang, no memory blow-up, nothing executed, nothing left behind).
`validate` and `validate --deep` run the same corpus in tests/test_validate.py. Cases that fail today
are strict xfails (tests/hostile/xfails.py), each naming the item of issue 14 that fixes it.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from tests.hostile.corpus import ALL_COMMANDS, CONSOLIDATE, PUSH, PUSH_HF, RESHARD, VALIDATE, all_kinds, prepare
from tests.hostile.harness import Limits
from tests.hostile.oracle import exception_line, judge, snapshot
from tests.hostile.plugin import corpus_params
from tests.hostile.run import Runner


@pytest.mark.parametrize(("kind_name", "command"), corpus_params((CONSOLIDATE, RESHARD, PUSH, PUSH_HF)))
def test_corpus(kind_name: str, command: str, corpus_results) -> None:
    run = corpus_results.get(kind_name, command)
    assert run.ok, run.report()


def test_every_kind_declares_what_it_needs() -> None:
    kinds = all_kinds()
    assert len(kinds) >= 100
    for name, k in kinds.items():
        assert k.doc, f"{name}: the builder's docstring says what the input is"
        assert k.commands and set(k.commands) <= set(ALL_COMMANDS), name
        for command, outcome in k.outcomes.items():
            if outcome.expect:
                re.compile(outcome.expect)
            assert outcome.xfail is None or outcome.xfail.startswith("issue 14"), (name, command, outcome.xfail)


def test_the_harness_is_the_cli(hostile_runner: Runner, tmp_path: Path) -> None:
    """A forked child of the zygote and a fresh `python -m ckptflow.cli` give the same exit status and
    output, for a valid checkpoint and for a few hostile ones (the corpus trusts the fork)."""
    kinds = all_kinds()
    for name, command in (("checkpoint/missing-rank-file", VALIDATE), ("checkpoint/garbage-file", CONSOLIDATE),
                          ("markup/latest-closing-tag", CONSOLIDATE),
                          ("checkpoint/tag-folder-without-latest", RESHARD)):
        ws = prepare(kinds[name], tmp_path / name.replace("/", "-"), hostile_runner.fixtures)
        argv = ws.argv(command)
        forked = hostile_runner.harness.run(argv, cwd=ws.root)
        shutil.rmtree(ws.out, ignore_errors=True)
        spawned = hostile_runner.harness.run(argv, cwd=ws.root, spawn=True)
        shutil.rmtree(ws.out, ignore_errors=True)
        assert (forked.returncode, forked.stdout.split("\n")[0][:60]) == (spawned.returncode,
                                                                          spawned.stdout.split("\n")[0][:60]), name
        assert _comparable(forked.stderr) == _comparable(spawned.stderr), name


def _comparable(stderr: str) -> str:
    """stderr as both runs must agree on it: a traceback by its exception line (the outermost frames
    differ: the zygote's child versus runpy), anything else as it is."""
    if "Traceback (most recent call last)" in stderr:
        return "traceback: " + exception_line(stderr)
    return stderr


def test_the_harness_bounds_time_memory_and_disk(hostile_runner: Runner, tmp_path: Path) -> None:
    """A hang is killed at the time limit, an allocation past the memory limit fails, a write past the
    file-size limit fails, and the oracle reports each."""
    harness = hostile_runner.harness
    argv = ["validate", str(tmp_path)]  # the command itself ends at once: the hooks misbehave before it
    hung = harness.run(argv, cwd=tmp_path, hooks=[("hang", "")], limits=Limits(seconds=2))
    assert hung.timed_out and 1.9 < hung.seconds < 60  # killed at its limit; 60 s is a hang guard
    big = tmp_path / "big.bin"
    disk = harness.run(argv, cwd=tmp_path, hooks=[("fill", str(big))], limits=Limits(seconds=30, file_size=8 << 20))
    assert not disk.timed_out and "File too large" in disk.stderr, disk.stderr
    assert big.stat().st_size <= 8 << 20
    memory = harness.run(argv, cwd=tmp_path, hooks=[("allocate", str(4 << 30))], limits=Limits(seconds=30))
    assert not memory.timed_out and "allocate 4294967296: MemoryError" in memory.stderr, memory.stderr


def test_the_oracle_catches_what_it_must(hostile_runner: Runner, tmp_path: Path) -> None:
    """Judged on known bad runs: a traceback, a hang and a leftover are each reported."""
    kinds = all_kinds()
    ws = prepare(kinds["pickles/deep-list"], tmp_path / "deep", hostile_runner.fixtures)
    before = snapshot(ws)
    result = hostile_runner.harness.run(ws.argv(VALIDATE), cwd=ws.root)
    violations = judge(ws, VALIDATE, kinds["pickles/deep-list"].outcomes[VALIDATE], result, before,
                       limits=hostile_runner.limits)
    if result.returncode == 1 and "Traceback" in result.stderr:  # today; once fixed there is nothing to catch
        assert any(v.startswith("traceback: RecursionError") and "ckptflow/" in v for v in violations), violations
    (ws.out_parent / ".out.staging-left-behind").mkdir()
    assert any("left in OUT's folder" in v for v in judge(ws, CONSOLIDATE, None, result, before,
                                                          limits=hostile_runner.limits))
