"""Rank script: a Hugging Face Trainer run resumes from a resharded checkpoint at its new world size.

Run by ``launch("tests.oracles.reshard_trainer", M, ["--spec", SPEC_JSON, "--checkpoint", DIR, "--out", FILE])``
where DIR is a ``checkpoint-K`` folder resharded to M ranks and SPEC_JSON the fixture's spec (``--stage S``
resumes at another ZeRO stage; ``--universal`` through DeepSpeed's universal checkpoint in DIR instead). The run
is set up as ``tests.fixtures.writers.trainer`` set up the original one (same model, DeepSpeed config with
"auto" values, optimizer built by the Trainer), with ``max_steps`` two past the checkpoint, and calls
``trainer.train(resume_from_checkpoint=DIR)``. Rank 0 writes the Trainer's state to FILE as JSON,
with what each rank's `Trainer._load_rng_state` did: the files it loaded, its "Didn't find an RNG
file" messages, and the CPU generator's state right after.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

from tests.fixtures.models import data_parallel as models  # noqa: E402
from tests.fixtures.writers.trainer import _Batches, _configure_distributed_state, trainer_ds_config  # noqa: E402

EXTRA_STEPS = 2


class _Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _watch_rng_loading(trainer_class: type) -> tuple[type, dict]:
    """A Trainer subclass that records what `_load_rng_state` loads (the first time it runs)."""
    seen: dict = {"files": [], "missing": [], "cpu": None}
    messages = _Messages()
    trainer_logger = logging.getLogger("transformers.trainer")
    trainer_logger.addHandler(messages)
    trainer_logger.setLevel(logging.INFO)

    class Watched(trainer_class):  # type: ignore[misc, valid-type]
        def _load_rng_state(self, checkpoint):  # noqa: ANN001, ANN202
            if seen["cpu"] is not None:
                return super()._load_rng_state(checkpoint)
            load = torch.load

            def recording_load(f, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
                seen["files"].append(os.path.basename(str(f)))
                return load(f, *args, **kwargs)

            before = len(messages.messages)
            torch.load = recording_load
            try:
                super()._load_rng_state(checkpoint)
            finally:
                torch.load = load
            seen["missing"] = [m for m in messages.messages[before:] if "Didn't find an RNG file" in m]
            seen["cpu"] = torch.random.get_rng_state().tolist()

    return Watched, seen


def ds_config(stage: int, *, universal: bool) -> dict:
    """The fixture's Trainer config at ZeRO `stage`; with `universal`, loading DeepSpeed's universal
    checkpoint (`latest_universal`) as DeepSpeed documents it for another world size."""
    config = copy.deepcopy(trainer_ds_config(stage))
    if universal:
        config["checkpoint"] = {"load_universal": True}
    return config


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True, help="the fixture's spec.json content")
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--stage", type=int, default=None, help="the ZeRO stage to resume at (the fixture's)")
    parser.add_argument("--universal", action="store_true",
                        help="resume through DeepSpeed's universal checkpoint (`checkpoint.load_universal`)")
    parser.add_argument("--local_rank", type=int, default=None, help="set by the deepspeed launcher")
    options = parser.parse_args(argv)
    spec = json.loads(options.spec)

    from transformers import Trainer, TrainingArguments

    _configure_distributed_state()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    steps = spec["steps"] + EXTRA_STEPS
    arguments = TrainingArguments(
        output_dir=str(options.out.parent / "run"),
        per_device_train_batch_size=models.MICRO_BATCH,
        max_steps=steps,
        save_strategy="no",
        logging_steps=1,
        learning_rate=1e-3,
        weight_decay=0.01,
        warmup_steps=1,
        seed=spec["seed"],
        data_seed=spec["seed"],
        deepspeed=ds_config(options.stage or spec["stage"], universal=options.universal),
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        accelerator_config={"use_configured_state": True},
    )
    watched, rng = _watch_rng_loading(Trainer)
    trainer = watched(
        model=models.build_model(spec["model"], spec["seed"]),
        args=arguments,
        train_dataset=_Batches(steps=steps, world_size=world_size, seed=spec["seed"]),
        processing_class=models.build_tokenizer(),
    )
    trainer.train(resume_from_checkpoint=str(options.checkpoint))
    engine = trainer.model_wrapped
    rank = int(os.environ.get("RANK", "0"))
    ranks_rng: list = [None] * world_size
    torch.distributed.all_gather_object(ranks_rng, {"rank": rank, **rng})
    if rank == 0:
        options.out.write_text(json.dumps({
            "global_step": trainer.state.global_step,
            "engine_global_steps": engine.global_steps,
            "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
            "lr": [entry["learning_rate"] for entry in trainer.state.log_history if "learning_rate" in entry],
            "dp_world_size": engine.dp_world_size,
            "rng": ranks_rng,
        }))
    torch.distributed.barrier()
    # Leave as `tests.fixtures.launch.run_jobs` does, without C++ static destructors: gloo's threads
    # sometimes abort a normal exit ("terminate called without an active exception") after the work is done.
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
