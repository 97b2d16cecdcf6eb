"""The reshard step: a ZeRO-1/2/3 training checkpoint rewritten for another data-parallel world size.

The output is what DeepSpeed itself writes at the new world size M for the same stage, precision
and config: `latest`, and a tag folder with one optimizer file per rank (and, for ZeRO-3, one model
file per rank), every field DeepSpeed reads on load rewritten for M. DeepSpeed then loads it natively
at M, without the universal-checkpoint path, and holds exactly the source's state. Everything else
in the source folder (config.json, tokenizer, trainer_state.json, scheduler) is carried over, and the
Trainer's RNG files are renamed for the new world size (`rng_state.pth` at 1 rank, one
`rng_state_{r}.pth` per rank otherwise).

- `shape.py`: `Shape` (ranks = tp x pp x dp, ep, ZeRO stage), `Target` (what a user asks for),
  `resolve` (a target for a checkpoint, or a refusal naming the shapes that work), `shapes_at`
  (what `--plan` lists) and `memory` (per-GPU bytes by the ZeRO formulas); pure;
- `plan.py`: `ReshardOptions`, `plan_reshard(index, target)`: the planner of the axis that changes;
- `units.py`: what plans are made of (`RankUnit` per target rank, `DataParallelPlan`, `ModelParallelPlan`);
- `data_parallel.py`: the data-parallel size and the ZeRO stage; `tensor_parallel.py`: AutoTP's degree;
  `pipeline.py`: a PipelineModule's stages merged into one (pp1);
- `files.py`: the object trees of the files one target rank gets (which fields change with M);
- `rng.py`: `plan_rng_files(names, M)`, pure: which Trainer RNG file each target rank gets;
- `run.py`: `plan_output` (validate, plan, refuse OUT inside SRC), `prepare_output`, `rank_job` (what a
  worker needs for one rank: pickles and source byte ranges) and `run_job`, `run_unit` (both),
  `finalize` (`latest` last), `abort`, `ReshardStep` (all of it as one `plumbing.steps.Step`, run on
  threads or any `concurrent.futures.Executor`), and `reshard(src, out, world_size=M)`, which runs it.
"""

from ckptflow.reshard.plan import ReshardOptions, plan_reshard
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
from ckptflow.reshard.shape import Memory, Shape, Target, memory, resolve, shapes_at, source_shape
from ckptflow.reshard.units import FrozenPiece, RankUnit, ReshardPlan, TargetFlat

__all__ = [
    "FileJob", "FrozenPiece", "Memory", "RankJob", "RankResult", "RankUnit", "ReshardOptions", "ReshardPlan",
    "ReshardResult", "ReshardStep", "RngCopy", "Shape", "Target", "TargetFlat", "abort", "committed_output", "finalize",
    "memory", "plan_output", "plan_reshard", "plan_rng_files", "prepare_output", "rank_job", "reshard", "resolve",
    "run_job", "run_unit", "shapes_at", "source_shape", "write_threads",
]
