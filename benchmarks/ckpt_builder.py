"""Large DeepSpeed checkpoints for benchmarks, written by DeepSpeed itself on CPU and cached.

A benchmark model is `layers` linear layers of `width` x `width` (no bias) with a small LayerNorm
after each, trained one step with AdamW and saved by `engine.save_checkpoint`. The default, 16 layers
of 4096, has about 268M parameters: a bf16 ZeRO-3 checkpoint of it on 2 ranks is about 3.2 GB.

    from benchmarks.ckpt_builder import BenchSpec, build
    ckpt = build(BenchSpec(stage=3))          # benchmarks/.data/<name>/ckpt, built once, then cached

From the shell: `python -m benchmarks.ckpt_builder --stage 3 --layers 16` builds one and prints its
path. A folder is complete when its `done.json` exists; an interrupted build is removed and redone.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
DATA = REPO_ROOT / "benchmarks" / ".data"


@dataclass(frozen=True, kw_only=True)
class BenchSpec:
    """One benchmark checkpoint."""

    stage: int = 3
    layers: int = 16
    width: int = 4096
    dtype: str = "bf16"
    world_size: int = 2

    def __post_init__(self) -> None:
        if self.stage not in (1, 2, 3) or self.dtype not in ("bf16", "fp32") or self.layers < 1 or self.width < 8:
            raise ValueError(f"bad benchmark spec {self}")

    @property
    def name(self) -> str:
        return f"z{self.stage}-{self.dtype}-ws{self.world_size}-{self.layers}x{self.width}"

    @property
    def params(self) -> int:
        return self.layers * (self.width * self.width + 2 * self.width)


def build(spec: Any, *, data: Path = DATA, timeout: float = 1800.0, writer: str = "benchmarks.ckpt_builder",
          keep_logs: bool = False) -> Path:
    """The checkpoint folder (holding `latest`) for `spec` (a dataclass with `name` and `world_size`),
    written on first use by `writer --write SPEC --out CKPT` on every rank (`benchmarks.moe` writes the
    MoE ones); with `keep_logs` the ranks' logs stay in the folder's `logs/`."""
    folder = data / spec.name
    ckpt = folder / "ckpt"
    if (folder / "done.json").exists():
        return ckpt
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    sys.path.insert(0, str(REPO_ROOT))
    from tests.fixtures.launch import launch

    result = launch(writer, spec.world_size, ["--write", json.dumps(asdict(spec)), "--out", str(ckpt)],
                    timeout=timeout, env={"OMP_NUM_THREADS": "1"}, log_dir=folder / "logs" if keep_logs else None)
    size = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
    (folder / "done.json").write_text(json.dumps({**asdict(spec), "bytes": size, "seconds": result.seconds}) + "\n")
    return ckpt


def remove(spec: BenchSpec, *, data: Path = DATA) -> None:
    """Delete a cached checkpoint."""
    shutil.rmtree(data / spec.name, ignore_errors=True)


def initialize(spec: BenchSpec, *, stage: int | None = None, overrides: dict[str, Any] | None = None) -> Any:
    """A DeepSpeed engine for `spec`'s model at ZeRO `stage` (default: the spec's) and this launch's world
    size; `overrides` adds top-level config keys (e.g. `{"checkpoint": {"load_universal": True}}`)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(spec.layers):
        layers += [nn.Linear(spec.width, spec.width, bias=False), nn.LayerNorm(spec.width)]
    model = nn.Sequential(*layers)
    decay = [p for n, p in model.named_parameters() if p.ndim == 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": {"stage": spec.stage if stage is None else stage},
        "bf16": {"enabled": spec.dtype == "bf16"},
        "steps_per_print": 1000,
        **(overrides or {}),
    }
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=[{"params": decay, "weight_decay": 0.01},
                                       {"params": no_decay, "weight_decay": 0.0}],
        config=config,
    )
    return engine


def _write(spec: BenchSpec, out: Path) -> None:
    """Rank side: build the model, train one step, save (run on every rank by `launch`)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch

    deepspeed.init_distributed(dist_backend="gloo")
    engine = initialize(spec)
    dtype = torch.bfloat16 if spec.dtype == "bf16" else torch.float32
    x = torch.randn(2, spec.width, dtype=dtype)
    loss = engine(x).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(str(out))
    deepspeed.comm.barrier()
    _remove_shm_buffer()


def _remove_shm_buffer() -> None:
    """DeepSpeed's CPU all-reduce leaves a 66 MB file per rank in /dev/shm (RAM) and never removes
    it; each rank removes its own once every collective is done."""
    name = (f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR')}_"
            f"{os.environ.get('MASTER_PORT')}_{os.environ.get('RANK')}")
    try:
        os.unlink(f"/dev/shm/{name}")
    except FileNotFoundError:
        pass


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build a cached benchmark checkpoint.")
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--write", help=argparse.SUPPRESS)  # rank side: a BenchSpec as JSON
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.write:
        _write(BenchSpec(**json.loads(args.write)), Path(args.out))
        return
    spec = BenchSpec(stage=args.stage, layers=args.layers, width=args.width, dtype=args.dtype,
                     world_size=args.world_size)
    print(build(spec))


if __name__ == "__main__":
    main()
