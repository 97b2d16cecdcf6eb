"""Rank script for the Megatron-DeepSpeed oracle: Megatron-DeepSpeed's own code saves and loads on CPU ranks.

Run on N ranks by ``launch(__file__, N, [MODE, CKPT, TP, WORK, RECIPE, TAG, *COUNTER])`` with
``CKPTFLOW_MEGATRON_DEEPSPEED`` naming a Megatron-DeepSpeed checkout (its root, holding ``megatron/`` and
``pretrain_gpt.py``), and ``CKPTFLOW_MEGATRON_PP`` the number of pipeline stages (1 when unset). Every rank
parses Megatron's own command line (``pretrain_gpt.py``'s arguments at tp ``TP`` x pp PP x dp N/(TP x PP), ZeRO-1, fp32, a GPT-2 BPE tokenizer over a 37-token vocabulary written to
``WORK``, ``--make-vocab-size-divisible-by 2``), runs ``initialize_megatron`` and builds the model with
``setup_model_and_optimizer(pretrain_gpt.model_provider, ...)``: a ``GPTModelPipe`` under DeepSpeed's
PipelineEngine, the run ``pretrain_gpt.py`` makes.

- ``save``: three training steps on seeded batches, then ``megatron.checkpointing.save_checkpoint`` at
  iteration 3 into CKPT (Megatron's client state: ``args``, ``iteration``, RNG states,
  ``universal_checkpoint_info``).
- ``load``: ``setup_model_and_optimizer`` itself calls ``megatron.checkpointing.load_checkpoint`` on
  CKPT (``--load``): DeepSpeed's engine load, ``check_checkpoint_args`` against this run's arguments,
  the iteration read and the RNG restore, all as ``pretrain_gpt.py`` resumes. With COUNTER (a source's
  ``mp_rank_00_model_states.pt``), every rank then runs ``check_checkpoint_args`` on that file's ``args``
  as well, and records the assertion it raises; then again with that ``padded_vocab_size``, then also
  that ``tensor_model_parallel_size``, set to this run's (``None`` once it passes).

Both modes write ``WORK/{TAG}.json`` (rank 0: the iteration Megatron resumes at, the counter-check's
message) and ``WORK/{TAG}.logits.pt``: the model's own forward of one fixed batch (eval mode), logits
gathered over the tensor-parallel group, the 37 columns of the real vocabulary. At one stage that is the
module's forward; at more, DeepSpeed's pipeline forward (``eval_batch(return_logits=True)``, one micro-batch),
whose last stage writes them. Every rank also writes ``WORK/{TAG}.tied.{RANK}.pt``: its stage's own
copy of each tied module's parameters (``tied_modules.*``), as its engine holds them after the save or load.

``RECIPE`` is ``gpt`` (Megatron-DeepSpeed's defaults: tied embeddings, learned positions) or ``llama``
(its Llama recipe, ``examples_deepspeed/pretrain_llama*.sh``: untied embeddings, SwiGLU, no linear
biases; without rotary positions, whose ``GPTModelPipe`` path fails at the commit tested,
``update_rotary_pos_emb`` calling ``.to`` on a list). Both use RMSNorm: ``GPTModelPipe`` passes
``sequence_parallel`` to ``torch.nn.LayerNorm`` off CUDA.

Three things are set aside before Megatron is imported, none of them on the path tested: the vision
KNN monitor (``training.py`` imports it; it needs torchvision), ``deepspeed.compression.compress``
(gone from DeepSpeed 0.19; used under ``--compression-training`` only) and the C++ dataset index
builder (``_compile_dependencies`` builds it with pybind11; no dataset is read here).
"""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

MDS_ENV = "CKPTFLOW_MEGATRON_DEEPSPEED"
PP_ENV = "CKPTFLOW_MEGATRON_PP"  # the pipeline stages, 1 when unset
MODULE_ONLY_ENV = "CKPTFLOW_MEGATRON_MODULE_ONLY"  # "1": load with --finetune, the layer files' weights only
VOCAB = 37  # the tokenizer's own tokens; Megatron pads them to 38 at tp 1, 40 at tp 2
GLOBAL_BATCH = 2
RECIPES = {
    "gpt": [],
    "llama": ["--untie-embeddings-and-output-weights", "--no-position-embedding", "--swiglu",
              "--disable-bias-linear", "--ffn-hidden-size", "32"],
}


def _set_aside() -> None:
    knn = types.ModuleType("megatron.model.vision.knn_monitor")
    knn.compute_feature_bank = None  # type: ignore[attr-defined]
    compress = types.ModuleType("deepspeed.compression.compress")
    compress.init_compression = compress.redundancy_clean = None  # type: ignore[attr-defined]
    sys.modules.update({knn.__name__: knn, compress.__name__: compress})


def _tokenizer(work: Path) -> tuple[Path, Path]:
    vocab, merges = work / "vocab.json", work / "merges.txt"
    if int(os.environ["RANK"]) == 0:
        tokens = {f"t{i}": i for i in range(VOCAB - 1)} | {"<|endoftext|>": VOCAB - 1}
        vocab.write_text(json.dumps(tokens))
        merges.write_text("#version: 0.2\n")
    return vocab, merges


def _argv(ckpt: str, tp: int, work: Path, recipe: str, vocab: Path, merges: Path) -> list[str]:
    world, pp = int(os.environ["WORLD_SIZE"]), int(os.environ.get(PP_ENV, "1"))
    config = work / f"ds_config_{os.environ['RANK']}.json"
    config.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 1, "train_batch_size": GLOBAL_BATCH,
        "gradient_accumulation_steps": GLOBAL_BATCH // (world // (tp * pp)),
        "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True, "steps_per_print": 1000,
    }))
    return [
        "pretrain_gpt.py", "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
        "--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
        "--max-position-embeddings", "8", "--micro-batch-size", "1", "--global-batch-size", str(GLOBAL_BATCH),
        "--train-iters", "10", "--lr", "1e-2", "--min-lr", "1e-3", "--seed", "1234",
        "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(vocab), "--merge-file", str(merges),
        "--make-vocab-size-divisible-by", "2", "--normalization", "rmsnorm",
        "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
        "--no-gradient-accumulation-fusion", "--attention-dropout", "0", "--hidden-dropout", "0",
        "--deepspeed", "--deepspeed_config", str(config), "--zero-stage", "1", "--distributed-backend", "gloo",
        "--save", ckpt, "--load", ckpt, "--save-interval", "1", *RECIPES[recipe],
        *(["--finetune"] if os.environ.get(MODULE_ONLY_ENV) == "1" else []),
    ]


def main(argv: list[str]) -> None:
    mode, ckpt, tp, work, recipe, tag, *counter = argv
    sys.path.insert(0, os.environ[MDS_ENV])
    _set_aside()
    work_dir = Path(work)
    vocab, merges = _tokenizer(work_dir)
    sys.argv = _argv(ckpt, int(tp), work_dir, recipe, vocab, merges)

    import megatron.data.dataset_utils as dataset_utils
    import pretrain_gpt
    from megatron import get_args
    from megatron.checkpointing import check_checkpoint_args, save_checkpoint
    from megatron.core import mpu
    from megatron.core.enums import ModelType
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    from megatron.initialize import initialize_megatron
    from megatron.training import _create_ds_config_dict, setup_model_and_optimizer

    dataset_utils.compile_helper = lambda: None
    initialize_megatron()
    args = get_args()
    args.deepspeed_config_dict = _create_ds_config_dict()  # as megatron.training.pretrain does
    if mode == "save":
        args.load = None
    model, optimizer, scheduler = setup_model_and_optimizer(pretrain_gpt.model_provider,
                                                             ModelType.encoder_or_decoder)
    result: dict[str, Any] = {"iteration": args.iteration}
    if mode == "save":
        generator = torch.Generator().manual_seed(7)
        batches = iter([{"text": torch.randint(0, VOCAB, (1, 9), generator=generator)} for _ in range(6)])
        for _ in range(3):
            model[0].train_batch(data_iter=batches)
        save_checkpoint(3, model, optimizer, scheduler)
    if counter:
        source = torch.load(counter[0], map_location="cpu", weights_only=False)["args"]  # Megatron's, trusted
        result["counter"] = []
        for field in ("padded_vocab_size", "tensor_model_parallel_size", None):
            try:
                check_checkpoint_args(source)
                result["counter"].append(None)
                break
            except AssertionError as error:
                result["counter"].append(str(error))
            if field is not None:  # this run's value, to reach the next comparison
                setattr(source, field, getattr(args, field))

    batch = {"text": torch.arange(9).remainder(VOCAB).view(1, 9)}
    engine = model[0]
    if engine.num_stages == 1:
        inputs, _ = pretrain_gpt.get_batch_pipe(batch)
        engine.module.eval()
        with torch.no_grad():
            output = engine.module(inputs)
    else:
        _, output = engine.eval_batch(iter([batch]), return_logits=True, num_micro_batches=1)
    if engine.is_last_stage():
        logits = gather_from_tensor_model_parallel_region(output)
    if engine.is_last_stage() and mpu.get_tensor_model_parallel_rank() == 0 and mpu.get_data_parallel_rank() == 0:
        torch.save(logits[..., :VOCAB].clone(), work_dir / f"{tag}.logits.pt")
        (work_dir / f"{tag}.json").write_text(json.dumps(result))
    tied = {name: p.detach().clone() for name, p in engine.module.named_parameters() if name.startswith("tied_modules.")}
    torch.save(tied, work_dir / f"{tag}.tied.{os.environ['RANK']}.pt")
    torch.distributed.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # on CPU, DeepSpeed's shared-memory comm thread aborts the interpreter's own exit


if __name__ == "__main__":
    main(sys.argv[1:])
