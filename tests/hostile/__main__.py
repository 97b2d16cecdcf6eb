"""Run corpus kinds by hand: `python -m tests.hostile [PATTERN ...] [--command C ...] [--keep DIR]`.

Every kind whose name contains one of the PATTERNs (all kinds when none) is built and run on its
commands (or those given), through the same harness and oracle as the tests; each run prints one
line, failures their violations and output. `--list` prints the kinds and exits. A local Hub is
started for push-hf. Workspaces go to `--keep DIR` (kept) or a temporary folder.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from tests.hostile.corpus import all_kinds, fixture_names, load_fixtures
from tests.hostile.harness import Harness, Limits
from tests.hostile.run import Runner


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.hostile", description=__doc__.split("\n")[0])
    parser.add_argument("patterns", nargs="*")
    parser.add_argument("--command", action="append", default=[])
    parser.add_argument("--keep", type=Path)
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--verbose", "-v", action="store_true", help="print the output of passing runs too")
    args = parser.parse_args(argv)
    kinds = {n: k for n, k in all_kinds().items() if not args.patterns or any(p in n for p in args.patterns)}
    if args.list:
        for name, k in kinds.items():
            print(f"{name:55s} {','.join(k.commands):40s} {k.doc}")
        return 0
    from tests.servers.hub import HubServer

    fixtures = load_fixtures(fixture_names())
    hub = HubServer().start()
    workdir = args.keep or Path(tempfile.mkdtemp(prefix="ckptflow-hostile-"))
    workdir.mkdir(parents=True, exist_ok=True)
    harness = Harness(workers=args.workers, limits=Limits(seconds=args.seconds))
    runner = Runner(harness=harness, fixtures=fixtures, workdir=workdir, hub=hub, limits=harness.limits,
                    keep=args.keep is not None)
    started = time.monotonic()
    jobs = [(k, args.command or None, None, "corpus--" + n.replace("/", "--")) for n, k in kinds.items()]
    runs = runner.run_many(jobs)
    failed = 0
    for run in runs:
        outcome = all_kinds()[run.kind].outcomes.get(run.command)
        xfail = f"  (xfail: {outcome.xfail})" if outcome and outcome.xfail else ""
        status = "ok  " if run.ok else "FAIL"
        failed += not run.ok
        seconds = f"{run.result.seconds:5.2f}s" if run.result else "  -  "
        print(f"{status} {seconds} {run.kind} :: {run.command}{xfail}")
        if not run.ok or args.verbose:
            print("\n".join("    " + line for line in run.report().splitlines()))
    print(f"{len(runs)} runs, {failed} failing, {time.monotonic() - started:.1f}s; workspaces in {workdir}")
    harness.close()
    hub.stop()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
