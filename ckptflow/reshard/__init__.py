"""The reshard step: a ZeRO-1/2/3 training checkpoint rewritten for another data-parallel world size.

The output is what DeepSpeed itself writes at the new world size M for the same stage, precision
and config: `latest`, and a tag folder with one optimizer file per rank (and, for ZeRO-3, one model
file per rank), every field DeepSpeed reads on load rewritten for M. DeepSpeed then loads it natively
at M, without the universal-checkpoint path, and holds exactly the source's state. Everything else
in the source folder (config.json, tokenizer, trainer_state.json, scheduler) is carried over, and the
Trainer's RNG files are renamed for the new world size (`rng_state.pth` at 1 rank, one
`rng_state_{r}.pth` per rank otherwise).

- `plan.py`: `plan_reshard(index, M)`, pure, one `RankUnit` per target rank;
- `files.py`: the object trees of the files one target rank gets (which fields change with M);
- `rng.py`: `plan_rng_files(names, M)`, pure: which Trainer RNG file each target rank gets;
- `run.py`: `plan_output` (validate, plan, refuse OUT inside SRC), `prepare_output`, `rank_job` (what a
  worker needs for one rank: pickles and source byte ranges) and `run_job`, `run_unit` (both),
  `finalize` (`latest` last), `abort`, `ReshardStep` (all of it as one `plumbing.steps.Step`, run on
  threads or any `concurrent.futures.Executor`), and `reshard(src, out, world_size=M)`, which runs it.
"""

from ckptflow.reshard.plan import FrozenPiece, RankUnit, ReshardOptions, ReshardPlan, TargetFlat, plan_reshard
from ckptflow.reshard.rng import RngCopy, plan_rng_files
from ckptflow.reshard.run import (
    FileJob,
    RankJob,
    RankResult,
    ReshardResult,
    ReshardStep,
    abort,
    committed_output,
    finalize,
    plan_output,
    prepare_output,
    rank_job,
    reshard,
    run_job,
    run_unit,
    write_threads,
)

__all__ = [
    "FileJob", "FrozenPiece", "RankJob", "RankResult", "RankUnit", "ReshardOptions", "ReshardPlan", "ReshardResult",
    "ReshardStep", "RngCopy", "TargetFlat", "abort", "committed_output", "finalize", "plan_output", "plan_reshard",
    "plan_rng_files", "prepare_output", "rank_job", "reshard", "run_job", "run_unit", "write_threads",
]
