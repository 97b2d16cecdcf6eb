"""The step driver (`plumbing.steps.run_step`) with a step of its own, in memory: the order of the calls,
and the check that runs beside the units (consolidate's config check) stopping them when it fails and
holding the commit back until it passes. No sleeps: each ordering is made with events, each wait
bounded far above what it takes."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from ckptflow.plumbing.steps import Cancelled, run_step

HANG = 60.0  # a hang guard, not a timing: every wait below ends in milliseconds when the driver is right


class Refused(Exception):
    pass


class Recorder:
    """A step of `n` units. Each unit records itself; with `block`, it waits for the run's cancel event
    (a unit still writing when something else fails). The check waits for `release` when given, then
    fails with `failure` or passes."""

    def __init__(self, n: int = 3, *, block: bool = False, failure: BaseException | None = None,
                 release: threading.Event | None = None, unit_failure: BaseException | None = None) -> None:
        self.n, self.block, self.failure, self.release, self.unit_failure = n, block, failure, release, unit_failure
        self.calls: list[str] = []
        self.started = threading.Event()  # a unit is running
        self.checked = threading.Event()
        self.lock = threading.Lock()
        step = self

        def run(job: int, *, progress: Any = None, cancel: threading.Event | None = None) -> int:
            step.log(f"run {job}")
            step.started.set()
            if step.unit_failure is not None:
                raise step.unit_failure
            if step.block:
                assert cancel is not None and cancel.wait(HANG), "the unit was never told to stop"
                raise Cancelled(f"unit {job}")
            return job * 10

        self.run = run

    def log(self, call: str) -> None:
        with self.lock:
            self.calls.append(call)

    def committed(self) -> None:
        return None

    def prepare(self) -> Sequence[int]:
        self.log("prepare")
        return list(range(self.n))

    def job(self, unit: int) -> int:
        return unit

    def unit_bytes(self, unit: int) -> int:
        return 1

    def check(self) -> None:
        if self.release is not None:
            assert self.release.wait(HANG)
        if self.failure is not None:
            self.started.wait(HANG)  # fail while a unit is running
            raise self.failure
        self.log("checked")
        self.checked.set()

    def finalize(self, results: Sequence[int]) -> list[int]:
        self.log("finalize")
        assert self.checked.is_set(), "finalize before the check passed"
        return list(results)

    def abort(self) -> None:
        self.log("abort")


def test_the_units_run_while_the_check_does_and_the_commit_waits_for_it() -> None:
    release = threading.Event()
    step = Recorder(release=release)
    # Every unit runs while the check is held back; the check is let go once they have all run.
    original = step.run

    def run(job: int, **kwargs: Any) -> int:
        result = original(job, **kwargs)
        if sum(c.startswith("run") for c in step.calls) == step.n:
            release.set()
        return result

    step.run = run
    assert run_step(step, workers=2) == [0, 10, 20]
    assert step.calls.index("checked") < step.calls.index("finalize")
    assert all(step.calls.index(f"run {i}") < step.calls.index("checked") for i in range(step.n))
    assert "abort" not in step.calls


@pytest.mark.parametrize("executor", [None, "threads"])
def test_a_failed_check_stops_the_running_units_and_is_the_error(executor: str | None) -> None:
    step = Recorder(n=2, block=True, failure=Refused("config.json does not fit the checkpoint"))
    with ThreadPoolExecutor(2) as pool:
        with pytest.raises(Refused, match="does not fit"):
            run_step(step, workers=2, executor=pool if executor else None, in_process=True)
    assert step.calls[-1] == "abort" and "finalize" not in step.calls


def test_a_failed_unit_is_the_error_while_the_check_still_runs() -> None:
    release = threading.Event()
    step = Recorder(n=2, release=release, unit_failure=OSError("disk full"))
    try:
        with pytest.raises(OSError, match="disk full"):
            run_step(step, workers=2)
    finally:
        release.set()  # the check's thread, left behind, ends
    assert step.calls[-1] == "abort" and "finalize" not in step.calls
