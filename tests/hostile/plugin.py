"""pytest plugin for the hostile-input corpus and the fuzzer.

- `--long` (or CKPTFLOW_LONG=1): the suite's long mode (`tests.sampling`): the fuzzer's thousands of
  cases, every oracle case.
- `hostile_runner`: a session `Runner` (two zygotes, the fixtures every kind uses, the local Hub).
- `corpus_params(commands)`: pytest params of every (kind, command) of the corpus for those commands,
  with the kind's strict xfail mark where it fails today.
- `corpus_results`: runs the (kind, command) pairs the session selected, on the harness's workers,
  once; each test then looks up its own result.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from tests.hostile.corpus import all_kinds, fixture_names, load_fixtures
from tests.hostile.harness import Harness, Limits
from tests.hostile.run import CaseRun, Runner
from tests.sampling import LONG_ENV
from tests.sampling import long_mode as sampling_long_mode

WORKERS_ENV = "CKPTFLOW_HOSTILE_WORKERS"
TIMEOUT_ENV = "CKPTFLOW_HOSTILE_TIMEOUT"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--long", action="store_true", default=False,
                     help="ckptflow: the long mode (every oracle case, thousands of seeded hostile cases); "
                     "also CKPTFLOW_LONG=1")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--long", default=False):  # before any test module is imported (`tests.sampling`)
        os.environ[LONG_ENV] = "1"


def long_mode_env() -> bool:
    """The long mode as the environment asks for it (`tests.sampling`): readable at collection time."""
    return sampling_long_mode()


def long_mode(config: pytest.Config) -> bool:
    return bool(config.getoption("--long", default=False)) or long_mode_env()


def default_limits() -> Limits:
    return Limits(seconds=float(os.environ.get(TIMEOUT_ENV, "8")))


@pytest.fixture(scope="session")
def hostile_runner(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runner]:
    from tests.fixtures.plugin import _progress
    from tests.hostile.fuzz import ALL_SOURCES

    fixtures = load_fixtures(sorted({*fixture_names(), *ALL_SOURCES}), progress=_progress(request.config))
    hub = request.getfixturevalue("hub_server")
    harness = Harness(workers=int(os.environ.get(WORKERS_ENV, "2")), limits=default_limits())
    runner = Runner(harness=harness, fixtures=fixtures, workdir=tmp_path_factory.mktemp("hostile"), hub=hub,
                    limits=harness.limits)
    yield runner
    harness.close()


def corpus_params(commands: Sequence[str]) -> list:
    """One pytest param per (kind, command) with `command` in `commands`, ids `kind::command`. By default
    (`tests.sampling`) about half of them: every kind with at least one of its commands, the commands
    alternating from one kind to the next so that each command meets about half of the kinds; the long
    mode runs every pair."""
    params = []
    long = long_mode_env()
    for i, (name, k) in enumerate(all_kinds().items()):
        mine = [(c, o) for c, o in k.outcomes.items() if c in commands]
        kept = [(c, o) for j, (c, o) in enumerate(mine) if long or (i + j) % 2 == 0] or mine[:1]
        for command, outcome in kept:
            marks = [pytest.mark.xfail(strict=True, reason=outcome.xfail)] if outcome.xfail else []
            params.append(pytest.param(name, command, id=f"{name}::{command}", marks=marks))
    return params


class CorpusResults:
    """Results of the corpus runs the session selected, computed in one parallel batch on first use."""

    def __init__(self, runner: Runner, wanted: set[tuple[str, str]]) -> None:
        self.runner, self.wanted = runner, wanted
        self.results: dict[tuple[str, str], CaseRun] = {}

    def get(self, kind_name: str, command: str) -> CaseRun:
        if (kind_name, command) not in self.results:
            self._run_batch({(kind_name, command)} | self.wanted - set(self.results))
        return self.results[(kind_name, command)]

    def _run_batch(self, pairs: set[tuple[str, str]]) -> None:
        kinds = all_kinds()
        by_kind: dict[str, list[str]] = {}
        for kind_name, command in sorted(pairs):
            by_kind.setdefault(kind_name, []).append(command)
        jobs = [(kinds[k], [c for c in kinds[k].commands if c in cs], None, _label(k)) for k, cs in by_kind.items()]
        for run in self.runner.run_many(jobs):
            self.results[(run.kind, run.command)] = run
        for pair in pairs:  # a command skipped (push-hf without a Hub) has no run
            self.results.setdefault(pair, CaseRun(pair[0], pair[1], "", None, (), Path()))


def _label(kind_name: str) -> str:
    return "corpus--" + kind_name.replace("/", "--")


@pytest.fixture(scope="session")
def corpus_results(request: pytest.FixtureRequest, hostile_runner: Runner) -> CorpusResults:
    wanted = set()
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and {"kind_name", "command"} <= set(callspec.params):
            wanted.add((callspec.params["kind_name"], callspec.params["command"]))
    return CorpusResults(hostile_runner, wanted)
