"""The consolidate step: a ZeRO checkpoint into a Hugging Face safetensors model folder.

Three parts, each usable on its own (the Prefect layer and a Dask cluster run the units):

1. `plan.py`: `plan_consolidation(index, options)` is pure: for every output tensor, the runs of
   source elements that make it, packed into shards as `save_pretrained` packs them; one
   `ShardUnit` per output shard.
2. `write.py`: `shard_job(plan, unit, staging)` is what a worker needs for one shard (its tensors'
   byte ranges, where it goes, the options: small and picklable); `run_job(job)` streams the shard
   into the staging folder in bounded batches of byte-range reads, cast on the way, hashed as written,
   and (with `verify`) checked against an independent read of the source. `run_unit(plan, unit,
   staging)` does both.
3. `run.py`: `prepare_output`, `finalize` (each shard checked against the store's metadata, side
   files, provenance, index last, commit), `abort`, `ConsolidateStep` (the three and the units as one
   `plumbing.steps.Step`, run on threads or any `concurrent.futures.Executor`: a Dask cluster's,
   Prefect tasks), and `consolidate(src, out, ...)`, which runs them all.
4. `config.py`: where the config and tokenizer files come from (SRC, or the config source
   `options.config` names: a folder or a Hub repo, for the kinds SRC lacks), and `architecture.py`:
   `check_config`, a config.json checked against the tensors with transformers on the meta device
   (imported only when a config source is given).

Memory stays at a few batch buffers per worker whatever the model size; only the fp32 master
weights are read, never the optimizer moments, and never a 16-bit module copy where an fp32 master
exists.
"""

from ckptflow.consolidate.architecture import check_config
from ckptflow.consolidate.config import ConfigFiles, ConfigSource, SideFiles, read_config_source, shaped, side_files
from ckptflow.consolidate.plan import (
    Batch,
    ByteCopy,
    ConsolidateOptions,
    ConsolidationPlan,
    OutputTensor,
    ShardUnit,
    plan_batches,
    plan_consolidation,
)
from ckptflow.consolidate.run import (
    ConsolidateStep,
    ConsolidationResult,
    abort,
    committed_output,
    consolidate,
    finalize,
    prepare_output,
    provenance,
)
from ckptflow.consolidate.write import ShardJob, ShardResult, run_job, run_unit, shard_job
from ckptflow.formats.deepspeed.runs import Run

__all__ = [
    "Batch",
    "ConfigFiles",
    "ConfigSource",
    "ConsolidateOptions",
    "ConsolidateStep",
    "ConsolidationPlan",
    "ConsolidationResult",
    "ByteCopy",
    "OutputTensor",
    "Run",
    "ShardJob",
    "ShardUnit",
    "ShardResult",
    "SideFiles",
    "abort",
    "check_config",
    "committed_output",
    "consolidate",
    "finalize",
    "plan_batches",
    "plan_consolidation",
    "prepare_output",
    "provenance",
    "read_config_source",
    "run_job",
    "run_unit",
    "shaped",
    "shard_job",
    "side_files",
]
