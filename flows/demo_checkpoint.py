"""The demo's training run: a tiny Llama trained a few steps with DeepSpeed on CPU ranks, then saved.

`write_demo_checkpoint(out)` starts `world_size` CPU ranks (gloo, `DS_ACCELERATOR=cpu`) running this
module, each training the same tiny `LlamaForCausalLM` under ZeRO-3 in bf16, and leaves what a
Hugging Face training run leaves: `latest`, `global_step<N>/`, `config.json`,
`generation_config.json` and a tokenizer. The checkpoint is written beside `out` and moved into
place when complete. Nothing is downloaded: the model comes from a config and the tokenizer from a
word list.

The tiny Llama and its tokenizer are defined here, once; the test fixtures build the same model.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")
CORPUS = (
    "the quick brown fox jumps over the lazy dog . "
    "a checkpoint is saved every few steps and loaded again on another cluster . "
    "each rank holds one slice of the optimizer state and the master weights . "
    "zero stage three splits parameters gradients and moments across all ranks . "
    "we merge the slices into one model and publish it to the hub ."
)
VOCAB = SPECIAL_TOKENS + tuple(sorted(set(CORPUS.split())))

LLAMA_CONFIG = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": True,
}
MICRO_BATCH = 2
SEQ_LEN = 9
REPO = Path(__file__).resolve().parents[1]


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over `VOCAB`, built without any download."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({word: i for i, word in enumerate(VOCAB)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=LLAMA_CONFIG["max_position_embeddings"],
    )


def build_llama(seed: int = 0) -> LlamaForCausalLM:
    """The tiny Llama, vocabulary matching `build_tokenizer()`, weights drawn from `seed`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(VOCAB),
        bos_token_id=VOCAB.index("<s>"),
        eos_token_id=VOCAB.index("</s>"),
        pad_token_id=VOCAB.index("<pad>"),
        **LLAMA_CONFIG,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


# ---- one rank -------------------------------------------------------------------------------------


def train_and_save(out: Path, *, stage: int, dtype: str, steps: int) -> None:
    """Train the tiny Llama `steps` steps on this rank's share of the corpus and save the checkpoint
    into `out` (a collective call: every rank runs it)."""
    import deepspeed
    import torch
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = build_llama()
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "train_batch_size": MICRO_BATCH * world_size,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8}},
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": dtype == "bf16"},
        "steps_per_print": 1000,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    ids = torch.tensor([VOCAB.index(w) for w in CORPUS.split()])
    for step in range(steps):
        start = (step * world_size + rank) * MICRO_BATCH % (len(ids) - SEQ_LEN - MICRO_BATCH)
        batch = torch.stack([ids[start + i:start + i + SEQ_LEN + 1] for i in range(MICRO_BATCH)])
        loss = engine(input_ids=batch[:, :-1], labels=batch[:, 1:]).loss
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(str(out))
    if rank == 0:
        module = engine.module
        module.config.dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
        module.config.architectures = [type(module).__name__]  # as save_pretrained records it
        module.config.save_pretrained(out)
        module.generation_config.save_pretrained(out)
        build_tokenizer().save_pretrained(out)
    dist.barrier()


# ---- all ranks ------------------------------------------------------------------------------------


def write_demo_checkpoint(out: str | os.PathLike[str], *, stage: int = 3, dtype: str = "bf16", world_size: int = 2,
                          steps: int = 3, timeout: float = 900.0) -> Path:
    """Train and save the tiny Llama on `world_size` CPU ranks into `out` (replaced if it exists)."""
    target = Path(out).resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.writing-", dir=target.parent))
    port = _free_port()
    try:
        _run_ranks(world_size, port, ["--out", str(tmp / "ckpt"), "--stage", str(stage), "--dtype", dtype,
                                      "--steps", str(steps)], tmp, timeout)
        if target.exists():
            shutil.rmtree(target)
        os.rename(tmp / "ckpt", target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        # DeepSpeed's CPU all-reduce leaves a 66 MB buffer per rank in /dev/shm (in RAM) and never removes it.
        for leaked in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"):
            with contextlib.suppress(OSError):
                leaked.unlink()
    return target


def _run_ranks(world_size: int, port: int, args: list[str], logs: Path, timeout: float) -> None:
    """This module on `world_size` ranks; when one fails the others are stopped, and the error carries
    the end of its log."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "WORLD_SIZE": str(world_size), "LOCAL_SIZE": str(world_size),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    procs = []
    for rank in range(world_size):
        log = open(logs / f"rank{rank}.log", "wb")
        procs.append((subprocess.Popen([sys.executable, "-m", "flows.demo_checkpoint", *args],
                                       env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                                       stdout=log, stderr=subprocess.STDOUT, cwd=REPO), log))
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p, _ in procs):
            failed = [(r, p) for r, (p, _) in enumerate(procs) if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                rank = failed[0][0] if failed else 0
                tail = (logs / f"rank{rank}.log").read_text(errors="replace").splitlines()[-30:]
                why = f"rank {rank} exited with code {failed[0][1].returncode}" if failed else "the ranks timed out"
                raise RuntimeError(f"training the demo checkpoint failed: {why}:\n" + "\n".join(tail))
            time.sleep(0.5)
        bad = [r for r, (p, _) in enumerate(procs) if p.returncode != 0]
        if bad:
            tail = (logs / f"rank{bad[0]}.log").read_text(errors="replace").splitlines()[-30:]
            raise RuntimeError(f"training the demo checkpoint failed on rank {bad[0]}:\n" + "\n".join(tail))
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="One rank of the demo's training run (see the module docstring).")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--local_rank", type=int, default=None, help="set by the deepspeed launcher")
    options = parser.parse_args(argv)
    train_and_save(options.out, stage=options.stage, dtype=options.dtype, steps=options.steps)
    _leave()


def _leave() -> None:
    """Exit this rank without running C++ static destructors: gloo's threads sometimes abort a normal
    exit once the engine is gone ("terminate called without an active exception", exit code -6), after
    the checkpoint is complete. Everything is saved and flushed by then."""
    import torch.distributed as dist

    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
