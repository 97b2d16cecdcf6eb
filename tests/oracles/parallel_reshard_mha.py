"""Rank script for the model-parallel reshard oracle of the round-robin split (``specs.autotp_round_robin_split``):
``oracles.parallel_reshard`` with every job's model built as ``models.split`` builds it (4 key/value heads), as
that oracle builds ``specs.split``'s.

Kept apart from ``oracles.parallel_reshard`` so that its launches' replay keys (``fixtures.replay``) stay as they
are. Run on N ranks by ``launch("tests.oracles.parallel_reshard_mha", N, ["--jobs", FILE])``, the jobs as that
oracle's.
"""

from __future__ import annotations

from typing import Any

from tests.fixtures.launch import run_jobs
from tests.fixtures.models.split import mha_models
from tests.oracles import parallel_reshard as oracle


def run_job(job: dict[str, Any]) -> None:
    with mha_models():
        oracle.run_job(job)


def main(argv: list[str] | None = None) -> None:
    run_jobs(run_job, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    main()
