"""Rank script for the fp16 deepspeed.moe ZeRO-0 reshard oracle: ``tests.oracles.expert_reshard`` in fp16, on CPU
ranks with the CPU accelerator's fp16 check lifted, as ``writers.moe_zero0_fp16`` wrote the source
(``fp16_on_cpu``: the config's fp16 section, ``specs.moe_zero0_fp16.MoEFp16Spec`` read, the overflow forced
where it trains).

Run on M ranks by ``launch("tests.oracles.moe_zero0_fp16", M, ["--jobs", FILE])`` with
``tests.oracles.expert_reshard``'s jobs. A loading job with ``"scale": FILE`` also writes there (JSON, rank 0):
``loaded``, the loss scale state the engine holds (``cur_scale``, ``cur_iter``, ``last_overflow_iter``,
``scale_factor``, ``scale_window``, ``skipped_steps``: ``writers.fp16_zero0.loss_scale``), ``scaler``, the
loss scaler's whole state (``oracles.fp16_zero0._scaler``), ``optimizer`` (the class DeepSpeed built) and
``step``, the Adam step (its base optimizer's largest, ``writers.fp16_zero0.adam_step``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from deepspeed import comm as dist  # noqa: E402

from tests.fixtures.launch import run_jobs  # noqa: E402
from tests.fixtures.specs.moe_zero0_fp16 import MoEFp16Spec  # noqa: E402
from tests.fixtures.writers.fp16_zero0 import adam_step, loss_scale  # noqa: E402
from tests.fixtures.writers.moe_zero0_fp16 import fp16_on_cpu  # noqa: E402
from tests.oracles import expert_reshard  # noqa: E402
from tests.oracles.fp16_zero0 import _scaler  # noqa: E402

_save_state = expert_reshard._save_state
_scale_file: dict[str, str | None] = {"path": None}  # the running job's "scale"


def save_state(runner: Any, engine: Any, path: str | None) -> None:
    """``expert_reshard._save_state``, and the engine's loss scale state at the job's ``"scale"``."""
    _save_state(runner, engine, path)
    if dist.get_rank() == 0 and _scale_file["path"]:
        result = {"loaded": loss_scale(engine), "scaler": _scaler(engine),
                  "optimizer": type(engine.optimizer).__name__, "step": adam_step(engine)}
        Path(_scale_file["path"]).write_text(json.dumps(result, indent=1))


def run_job(job: dict[str, Any]) -> None:
    _scale_file["path"] = job.get("scale")
    expert_reshard.run_job(job)


def main(argv: list[str] | None = None) -> None:
    fp16_on_cpu()
    expert_reshard.ParallelSpec = MoEFp16Spec  # type: ignore[misc]
    expert_reshard._save_state = save_state
    run_jobs(run_job, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    main()
