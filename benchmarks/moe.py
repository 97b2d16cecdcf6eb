"""Benchmark: ckptflow on AutoEP (Qwen3-MoE-shaped) checkpoints against DeepSpeed's `ds_to_universal`
and I/O floors.

The checkpoints are written by DeepSpeed itself on CPU (2 ranks, `"expert_parallel": {"autoep_size": 2,
"preset_model": "qwen3_moe"}`, bf16, one AdamW step) from a `Qwen3MoeForCausalLM` built from a config:
hidden 1024, 16 heads (4 KV) of 64, 64 experts of intermediate 256 per layer, top-4, vocabulary 32000,
untied head; 8 layers (about 0.49B parameters) at ZeRO-2 and ZeRO-3, and 4 layers (about 0.28B) at
ZeRO-3 to show whether memory stays flat as the model grows. They are built once into
`benchmarks/.data/` (git-ignored).

Contenders, each a fresh process under `/usr/bin/time` (wall time, peak RSS):

- `ckptflow consolidate CKPT OUT --dtype bf16` (Hugging Face names, fused experts), with its default
  `--verify` and with `--no-verify`; and the same two as library calls timed after their imports
  ("work only", `benchmarks.consolidate --work`), to separate the work from the start-up;
- `ckptflow reshard CKPT OUT --world-size 4` (ep 2 kept; dense groups over 4 ranks, experts over
  expert data-parallel groups of 2), with its default fsync and with `--no-fsync`;
- `python -m deepspeed.checkpoint.ds_to_universal --input_folder CKPT/TAG --output_folder OUT`: DeepSpeed's
  only tool for AutoEP checkpoints (`zero_to_fp32` refuses them), the offline step before a load at
  another size, and the only way to per-parameter fp32 weights; it writes without fsync, so each of its
  runs is followed by a timed `sync` and the sum is its row "+ sync": what its output costs to be as
  durable as ckptflow's (which fsyncs, unless `--no-fsync`). Each ckptflow row's speed-up is taken
  against the DeepSpeed row of the same durability;
- I/O floors, plain Python: for consolidate, read exactly the fp32 master bytes and write as many bytes
  as the bf16 output, then fsync, and the same then reading the output back from the disk (O_DIRECT),
  which is the I/O a `--verify` run does: its rows are compared with that one; for reshard, read every
  source byte and write as many bytes as the reshard's output (O_DIRECT where the file system takes
  it), with and without fsync.

ckptflow is byte-compiled first (`benchmarks.results.compile_sources`), as an installed wheel is.

Page cache warm; `--repeat` rounds, each in a new (seeded) shuffled order; before each run the previous
output is removed and `sync` flushes dirty pages so that no run pays another's writeback; medians.

    .venv/bin/python -m benchmarks.moe [--repeat 3] [--write-results]

`--write-results` replaces the "MoE (AutoEP)" section of `benchmarks/RESULTS.md`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
DATA = REPO_ROOT / "benchmarks" / ".data"
SECTION = "## MoE (AutoEP)"
DS = "deepspeed ds_to_universal"
DS_SYNCED = "deepspeed ds_to_universal + sync"


@dataclass(frozen=True, kw_only=True)
class MoESpec:
    """One Qwen3-MoE-shaped AutoEP checkpoint."""

    stage: int = 2
    layers: int = 8
    hidden: int = 1024
    heads: int = 16
    kv_heads: int = 4
    head_dim: int = 64
    experts: int = 64
    moe_intermediate: int = 256
    top_k: int = 4
    vocab: int = 32000
    dtype: str = "bf16"
    world_size: int = 2
    ep: int = 2

    @property
    def name(self) -> str:
        return (f"autoep-qwen3moe-z{self.stage}-{self.dtype}-ws{self.world_size}-ep{self.ep}-"
                f"{self.layers}L-{self.hidden}")

    @property
    def params(self) -> int:
        h, d = self.hidden, self.head_dim
        attention = h * self.heads * d * 2 + h * self.kv_heads * d * 2 + 2 * d
        moe = self.experts * 3 * h * self.moe_intermediate + self.experts * h
        return 2 * self.vocab * h + h + self.layers * (attention + moe + 2 * h)


def build(spec: MoESpec, *, data: Path = DATA, timeout: float = 3600.0) -> Path:
    """The checkpoint folder (holding `latest`) for `spec`, written by DeepSpeed on first use."""
    from benchmarks.ckpt_builder import build as build_with

    return build_with(spec, data=data, timeout=timeout, writer="benchmarks.moe", keep_logs=True)


def initialize(spec: MoESpec, *, ep: int | None = None, overrides: dict[str, Any] | None = None) -> tuple[Any, Any]:
    """A DeepSpeed engine for `spec`'s model with AutoEP of degree `ep` (default: the spec's) at this
    launch's world size, and the model's Hugging Face config; `overrides` adds top-level config keys."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch
    import transformers

    sys.path.insert(0, str(REPO_ROOT))
    from tests.fixtures.models.parallel import param_groups
    from tests.fixtures.writers.parallel import patch_transformers_output_capture_registry

    patch_transformers_output_capture_registry()
    config = transformers.Qwen3MoeConfig(
        vocab_size=spec.vocab, hidden_size=spec.hidden, num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads, head_dim=spec.head_dim, intermediate_size=4 * spec.hidden,
        moe_intermediate_size=spec.moe_intermediate, num_experts=spec.experts, num_experts_per_tok=spec.top_k,
        decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False, max_position_embeddings=64,
    )
    dtype = torch.bfloat16 if spec.dtype == "bf16" else torch.float32
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.config.architectures = [type(model).__name__]
    ds_config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": spec.stage},
        "bf16": {"enabled": spec.dtype == "bf16"},
        "expert_parallel": {"enabled": True, "autoep_size": spec.ep if ep is None else ep,
                            "preset_model": "qwen3_moe", "use_grouped_mm": False},
        "steps_per_print": 1000,
        **(overrides or {}),
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups(model), config=ds_config)
    config.dtype = dtype
    config.architectures = [type(model).__name__]
    return engine, config


def _write(spec: MoESpec, out: Path) -> None:
    """Rank side: build the model, train one step with AutoEP, save (run on every rank by `launch`)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch

    deepspeed.init_distributed(dist_backend="gloo")
    engine, config = initialize(spec)
    ids = torch.randint(0, spec.vocab, (1, 16), generator=torch.Generator().manual_seed(deepspeed.comm.get_rank()))
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(str(out))
    if deepspeed.comm.get_rank() == 0:
        config.save_pretrained(out)
    deepspeed.comm.barrier()
    from benchmarks.ckpt_builder import _remove_shm_buffer

    _remove_shm_buffer()


# ---- measuring --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Measure:
    label: str
    seconds: float
    peak_rss: int  # bytes


def floor_spec(ckpt: Path, scratch: Path, out_bytes: dict[str, int]) -> dict[str, Path]:
    """The I/O floors' inputs: the fp32 master ranges a consolidation reads and its output size; every
    source file and the size of each reshard output."""
    from benchmarks.floor import ranges_of
    from ckptflow.consolidate import ConsolidateOptions, plan_consolidation
    from ckptflow.formats.deepspeed import load_index

    index = load_index(str(ckpt))
    plan = plan_consolidation(index, ConsolidateOptions(dtype="bf16"))
    ranges = sorted({(r.ref.uri, *r.byte_range) for t in index.model_tensors() for r in t.runs})
    tag = (ckpt / "latest").read_text().strip()
    sources = sorted(str(p) for p in (ckpt / tag).glob("*.pt"))
    specs = {}
    for name, spec in {
        "consolidate": {"ranges": ranges, "out_bytes": plan.file_bytes, "fsync": True},
        "consolidate-read-back": {"ranges": ranges, "out_bytes": plan.file_bytes, "fsync": True, "read_back": True},
        "reshard": {"ranges": ranges_of(sources), "out_bytes": out_bytes["reshard"],
                    "fsync": True},
        "reshard-no-fsync": {"ranges": ranges_of(sources),
                             "out_bytes": out_bytes["reshard"], "fsync": False},
    }.items():
        specs[name] = scratch / f"floor-{name}.json"
        specs[name].write_text(json.dumps(spec))
    return specs


def bench(ckpt: Path, repeat: int, scratch: Path, *, with_ds: bool = True) -> tuple[list[Measure], dict[str, int]]:
    import subprocess

    from benchmarks.reshard import folder_bytes, warm
    from benchmarks.results import compile_sources, run_measured

    py = sys.executable
    tag = (ckpt / "latest").read_text().strip()
    out = scratch / "out"
    env = {"DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO_ROOT)}
    sizes = {"source": folder_bytes(ckpt / tag)}
    reshard = [py, "-m", "ckptflow.cli", "reshard", str(ckpt), str(out), "--world-size", "4"]
    consolidate = [py, "-m", "ckptflow.cli", "consolidate", str(ckpt), str(out), "--dtype", "bf16"]
    for label, command in (("reshard", reshard + ["--no-fsync"]), ("consolidate", consolidate + ["--no-verify"])):
        shutil.rmtree(out, ignore_errors=True)
        subprocess.run(command, check=True, env={**os.environ, **env}, capture_output=True)
        sizes[label] = folder_bytes(out)
    shutil.rmtree(out, ignore_errors=True)
    floors = floor_spec(ckpt, scratch, sizes)
    floor = str(Path(__file__).resolve().with_name("floor.py"))  # run as a plain file
    commands = {
        "ckptflow consolidate": consolidate,
        "ckptflow consolidate --no-verify": consolidate + ["--no-verify"],
        # The same conversions as library calls, timed after their imports (benchmarks.consolidate --work).
        "ckptflow consolidate, work only": [py, "-m", "benchmarks.consolidate", "--work", "ckptflow", str(ckpt),
                                            str(out)],
        "ckptflow consolidate --no-verify, work only": [py, "-m", "benchmarks.consolidate", "--work",
                                                        "ckptflow-no-verify", str(ckpt), str(out)],
        "ckptflow reshard 2->4": reshard,
        "ckptflow reshard 2->4 --no-fsync": reshard + ["--no-fsync"],
        "I/O floor consolidate": [py, floor, str(floors["consolidate"]), str(out / "floor.bin")],
        "I/O floor consolidate + read back": [py, floor, str(floors["consolidate-read-back"]), str(out / "floor.bin")],
        "I/O floor reshard": [py, floor, str(floors["reshard"]), str(out / "floor.bin")],
        "I/O floor reshard --no-fsync": [py, floor, str(floors["reshard-no-fsync"]), str(out / "floor.bin")],
    }
    if with_ds:
        commands[DS] = [py, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(ckpt / tag),
                        "--output_folder", str(out)]
    compile_sources()
    warm(ckpt)
    runs: dict[str, list[tuple[float, int]]] = {label: [] for label in commands}
    if with_ds:
        runs[DS_SYNCED] = []
    for round_ in range(repeat):
        order = list(commands.items())
        random.Random(round_).shuffle(order)
        for label, command in order:
            shutil.rmtree(out, ignore_errors=True)
            if label.startswith("I/O floor"):
                out.mkdir()
            os.sync()
            runs[label].append(run_measured(command, env=env)[:2])
            if label == DS:  # its output is still in the page cache: what making it durable costs on top
                started = time.monotonic()
                os.sync()
                seconds, rss = runs[DS][-1]
                runs[DS_SYNCED].append((seconds + time.monotonic() - started, rss))
                sizes.setdefault("ds_to_universal", folder_bytes(out))
            shutil.rmtree(out, ignore_errors=True)
            print(f"  {label}: {runs[label][-1][0]:.2f} s, {runs[label][-1][1] / 2**20:.0f} MiB", flush=True)
    return [Measure(label, statistics.median(s for s, _ in r), int(statistics.median(m for _, m in r)))
            for label, r in runs.items()], sizes


def floor_of(label: str) -> str | None:
    """The floor a run is compared with: a verified consolidation reads its output back from the disk."""
    if label.startswith("ckptflow consolidate"):
        return "I/O floor consolidate" + ("" if "--no-verify" in label else " + read back")
    if label.startswith("ckptflow reshard"):
        return "I/O floor reshard" + (" --no-fsync" if label.endswith("--no-fsync") else "")
    return None


def ds_of(label: str) -> str:
    """The DeepSpeed run a ckptflow run is compared with: the one whose output is as durable (ckptflow
    fsyncs what it writes unless told `--no-fsync`; ds_to_universal never does, so its synced row adds
    the `sync` that makes its output durable)."""
    return DS if label.endswith("--no-fsync") else DS_SYNCED


def table(title: str, measures: list[Measure]) -> list[str]:
    by = {m.label: m for m in measures}
    lines = [f"**{title}**", "", "| run | wall | peak RSS | vs ds_to_universal, same durability | vs I/O floor |",
             "|---|---:|---:|---:|---:|"]
    for m in measures:
        floor = by.get(floor_of(m.label) or "")
        ds = by.get(ds_of(m.label))
        vs_ds = f"{ds.seconds / m.seconds:.1f}x faster" if ds and m.label.startswith("ckptflow") else ""
        vs_floor = f"{m.seconds / floor.seconds:.2f}x" if floor else ""
        lines.append(f"| {m.label} | {m.seconds:.2f} s | {m.peak_rss / 2**20:.0f} MiB | {vs_ds} | {vs_floor} |")
    return lines + [""]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Benchmark ckptflow on AutoEP checkpoints against ds_to_universal.")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--write-results", action="store_true", help="replace the MoE section of RESULTS.md")
    parser.add_argument("--build-only", action="store_true", help="build the checkpoints and stop")
    parser.add_argument("--write", help=argparse.SUPPRESS)  # rank side: a MoESpec as JSON
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.write:
        _write(MoESpec(**json.loads(args.write)), Path(args.out))
        return
    sys.path.insert(0, str(REPO_ROOT))
    from benchmarks.reshard import machine
    from benchmarks.results import write_section

    specs = [MoESpec(stage=3, layers=8), MoESpec(stage=2, layers=8), MoESpec(stage=3, layers=4)]
    ckpts = {spec: build(spec) for spec in specs}
    if args.build_only:
        for spec, ckpt in ckpts.items():
            print(spec.name, ckpt)
        return
    lines = [SECTION, "", f"Machine: {machine()}. Page cache warm; median of {args.repeat} rounds, each in a new "
             "shuffled order; each run is a fresh process (imports included) measured by `/usr/bin/time`, after a "
             "`sync`. Command: `.venv/bin/python -m benchmarks.moe --repeat "
             f"{args.repeat} --write-results`. Checkpoints written by DeepSpeed 0.19.8 on CPU with AutoEP "
             "(preset qwen3_moe, ep 2 on 2 ranks, bf16, one AdamW step); see the module docstring for the shape. "
             "ds_to_universal is DeepSpeed's only converter for AutoEP and writes without fsync: its \"+ sync\" row "
             "adds a timed `sync` right after each of its runs, and each ckptflow row is compared with the DeepSpeed "
             "row of the same durability (ckptflow fsyncs unless `--no-fsync`); ckptflow consolidate writes one bf16 "
             "Hugging Face folder.",
             ""]
    results: dict[MoESpec, dict[str, Measure]] = {}
    data = DATA
    for spec in specs:
        scratch = Path(tempfile.mkdtemp(prefix="ckptflow-bench-moe-", dir=data))
        try:
            print(f"{spec.name}: {ckpts[spec]}", flush=True)
            measures, sizes = bench(ckpts[spec], args.repeat, scratch)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        results[spec] = {m.label: m for m in measures}
        title = (f"ZeRO-{spec.stage}, {spec.layers} layers x {spec.experts} experts ({spec.params / 1e9:.2f}B params): "
                 f"source {sizes['source'] / 1e9:.2f} GB; bf16 model {sizes['consolidate'] / 1e9:.2f} GB, reshard "
                 f"2->4 {sizes['reshard'] / 1e9:.2f} GB, ds_to_universal output "
                 f"{sizes.get('ds_to_universal', 0) / 1e9:.2f} GB")
        block = table(title, measures)
        print("\n".join(block), flush=True)
        lines += block
    lines += targets(results, specs)
    if args.write_results:
        write_section(SECTION, lines)


def targets(results: dict[MoESpec, dict[str, Measure]], specs: list[MoESpec]) -> list[str]:
    big3, big2, small3 = specs
    lines = ["**Targets** (ratios of the medians above)", "", "| target | goal | ZeRO-3 | ZeRO-2 | |",
             "|---|---|---:|---:|---|"]

    def row(label: str, goal: str, values: list[float], ok: bool) -> None:
        lines.append(f"| {label} | {goal} | " + " | ".join(f"{v:.2f}" for v in values)
                     + f" | {'met' if ok else 'not met'} |")

    for run in ("ckptflow consolidate", "ckptflow reshard 2->4", "ckptflow reshard 2->4 --no-fsync"):
        speed = [results[s][ds_of(run)].seconds / results[s][run].seconds for s in (big3, big2)]
        row(f"speed-up over {ds_of(run)}, {run}", ">= 10", speed, min(speed) >= 10)
    # Kept from earlier records, where ckptflow's synced reshard was set against DeepSpeed's unsynced run.
    speed = [results[s][DS].seconds / results[s]["ckptflow reshard 2->4"].seconds for s in (big3, big2)]
    row(f"speed-up over {DS} (not synced), ckptflow reshard 2->4 (synced)", ">= 10", speed, min(speed) >= 10)
    for run in ("ckptflow consolidate", "ckptflow consolidate --no-verify", "ckptflow consolidate, work only",
                "ckptflow consolidate --no-verify, work only", "ckptflow reshard 2->4",
                "ckptflow reshard 2->4 --no-fsync"):
        ratio = [results[s][run].seconds / results[s][floor_of(run)].seconds for s in (big3, big2)]
        row(f"time / {floor_of(run)}, {run}", "<= 1.3", ratio, max(ratio) <= 1.3)
        if floor_of(run) != "I/O floor consolidate" and run.startswith("ckptflow consolidate"):
            ratio = [results[s][run].seconds / results[s]["I/O floor consolidate"].seconds for s in (big3, big2)]
            row(f"time / I/O floor consolidate (no read back), {run}", "<= 1.3", ratio, max(ratio) <= 1.3)
    lines += ["", f"**Peak memory as the ZeRO-3 model doubles ({small3.layers} -> {big3.layers} layers, "
              f"{small3.params / 1e9:.2f}B -> {big3.params / 1e9:.2f}B params)**", "",
              "| run | peak RSS, small | peak RSS, large | growth |", "|---|---:|---:|---:|"]
    for label in results[big3]:
        small, big = results[small3][label].peak_rss, results[big3][label].peak_rss
        lines.append(f"| {label} | {small / 2**20:.0f} MiB | {big / 2**20:.0f} MiB | {big / small:.2f}x |")
    return lines + [""]


if __name__ == "__main__":
    main()
