"""Benchmark (issue 24): `ckptflow reshard` across shapes, against DeepSpeed's universal route and the
I/O floor.

Three shape changes, each on a checkpoint written by DeepSpeed itself on CPU (bf16, one AdamW step,
cached in `benchmarks/.data/`, git-ignored):

- **ZeRO stage**: the dense model of `benchmarks/ckpt_builder.py` (linear layers of 4096), ZeRO-2 on 2
  ranks -> ZeRO-3 on 4 (`--world-size 4 --zero-stage 3`);
- **AutoTP**: a Llama-shaped `LlamaForCausalLM` (hidden 2048, 16 heads of 128, 8 KV heads, MLP 5632,
  vocabulary 32000, untied head) with `"tensor_parallel": {"autotp_size": 2}`, ZeRO-1 on 2 ranks
  (tp 2) -> tp 1, data-parallel over the same 2 ranks (`--world-size 2 --tp 1`);
- **AutoEP**: the Qwen3-MoE-shaped model of `benchmarks/moe.py`, ZeRO-2, ep 2 on 2 ranks -> ep 4 on 4
  ranks (`--world-size 4 --ep 4`).

Contenders, each a fresh process (imports included) under `/usr/bin/time` (wall, peak RSS):

- `ckptflow reshard SRC OUT --world-size N ...` with its default fsync of every file;
- the I/O floor (`benchmarks/floor.py`): read every source byte once, write as many bytes as
  ckptflow's output, fsync;
- DeepSpeed's route to another shape: `python -m deepspeed.checkpoint.ds_to_universal`, then a
  "+ sync" row adding a timed `sync` (ckptflow's output is durable, ds_to_universal's is not), then the
  target engine's start from the universal checkpoint: N CPU ranks (`tests/fixtures/launch.py`) build
  the target engine with `"checkpoint": {"load_universal": true}` and call `engine.load_checkpoint`.
  The launch's wall time, the `load_checkpoint` call alone (slowest rank) and the sum of the ranks'
  peak RSS are reported. For comparison the same launch loads ckptflow's output natively (no
  `load_universal`): the step both routes share. Both starts run after the timed rounds, the universal
  one first (earlier runs started the native one first, right after the checkpoint's build, and it
  came out the slower one both times).

`--repeat` rounds of the single-process runs (ds_to_universal in the first `--ds-repeat` of them,
default one: it takes minutes here), each round in a new (seeded) shuffled order, with a `sync` before
each run and the page cache warm; the output of ds_to_universal's last run is what the engine then
loads; the engine launches run `--load-repeat` times (default once); medians. A second, half-size checkpoint of each
model is resharded too (ckptflow and floor only) to show whether peak memory stays flat as the model
grows.

    .venv/bin/python -m benchmarks.shapes [--repeat 3] [--ds-repeat 1] [--load-repeat 1] [--cases zero,tp,ep]
        [--size 0.5b|1b] [--write-results]

`--size 1b` takes the issue's ~1B models (dense 64 layers, AutoTP 20, AutoEP 18; 1.02 to 1.07B parameters),
each with the 0.5B one beside it for memory. Each 1B checkpoint is about 15 GB, and DeepSpeed's writer
and the target engine's start hold about 21 GB over their ranks: on a machine of 24 GiB, add swap and run
one case at a time, removing `benchmarks/.data/` between them.

`--write-results` replaces the "Reshard across shapes (issue 24)" section of `benchmarks/RESULTS.md`
(with `--size 1b`, "Reshard across shapes at 1B, <cases> (issue 24)", one per set of cases).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
DATA = REPO_ROOT / "benchmarks" / ".data"
SECTION = "## Reshard across shapes (issue 24)"
CKPTFLOW, FLOOR, DS, DS_SYNCED = "ckptflow reshard", "I/O floor", "ds_to_universal", "ds_to_universal + sync"
LOAD_UNIVERSAL, LOAD_NATIVE = "target engine start, load_universal", "target engine start, ckptflow output"
LOAD_RENAMED = "target engine start, load_universal, model states file renamed by hand"


@dataclass(frozen=True, kw_only=True)
class TPSpec:
    """One Llama-shaped AutoTP checkpoint."""

    stage: int = 1
    layers: int = 8
    hidden: int = 2048
    heads: int = 16
    kv_heads: int = 8
    intermediate: int = 5632
    vocab: int = 32000
    dtype: str = "bf16"
    world_size: int = 2
    tp: int = 2

    @property
    def name(self) -> str:
        return f"autotp-llama-z{self.stage}-{self.dtype}-ws{self.world_size}-tp{self.tp}-{self.layers}L-{self.hidden}"

    @property
    def params(self) -> int:
        h, d = self.hidden, self.hidden // self.heads
        attention = 2 * h * self.heads * d + 2 * h * self.kv_heads * d
        return 2 * self.vocab * h + h + self.layers * (attention + 3 * h * self.intermediate + 2 * h)


def tp_initialize(spec: TPSpec, *, tp: int | None = None, overrides: dict[str, Any] | None = None) -> tuple[Any, Any]:
    """A DeepSpeed engine for `spec`'s Llama with AutoTP of degree `tp` (default: the spec's; 1: no
    `tensor_parallel` section) at this launch's world size, and the model's config."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch
    import transformers

    sys.path.insert(0, str(REPO_ROOT))
    from tests.fixtures.models.parallel import param_groups

    h = spec.hidden
    config = transformers.LlamaConfig(
        vocab_size=spec.vocab, hidden_size=h, num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads, head_dim=h // spec.heads, intermediate_size=spec.intermediate,
        tie_word_embeddings=False, max_position_embeddings=64,
    )
    dtype = torch.bfloat16 if spec.dtype == "bf16" else torch.float32
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.config.architectures = [type(model).__name__]
    tp = spec.tp if tp is None else tp
    ds_config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": spec.stage},
        "bf16": {"enabled": spec.dtype == "bf16"},
        "steps_per_print": 1000,
        **({"tensor_parallel": {"autotp_size": tp}} if tp > 1 else {}),
        **(overrides or {}),
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups(model), config=ds_config)
    config.dtype = dtype
    return engine, config


def _write(spec: TPSpec, out: Path) -> None:
    """Rank side: build the AutoTP model, train one step, save (run on every rank by `launch`)."""
    import deepspeed
    import torch

    deepspeed.init_distributed(dist_backend="gloo")
    engine, config = tp_initialize(spec)
    ids = torch.randint(0, spec.vocab, (1, 16), generator=torch.Generator().manual_seed(0))  # same on tp ranks
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    engine.save_checkpoint(str(out))
    if deepspeed.comm.get_rank() == 0:
        config.save_pretrained(out)
    deepspeed.comm.barrier()
    from benchmarks.ckpt_builder import _remove_shm_buffer

    _remove_shm_buffer()


def _load(job: dict[str, Any]) -> None:
    """Rank side: start the target engine and load `job["ckpt"]` (universal or native); print the time of
    `deepspeed.initialize`, of `load_checkpoint` and this rank's peak RSS."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    overrides = {"checkpoint": {"load_universal": job["universal"]}}
    started = time.monotonic()
    if job["kind"] == "zero":
        from benchmarks.ckpt_builder import BenchSpec, initialize

        engine = initialize(BenchSpec(**job["spec"]), stage=job["target"]["zero_stage"], overrides=overrides)
    elif job["kind"] == "tp":
        engine, _ = tp_initialize(TPSpec(**job["spec"]), tp=job["target"]["tp"], overrides=overrides)
    else:
        from benchmarks.moe import MoESpec
        from benchmarks.moe import initialize as moe_initialize

        engine, _ = moe_initialize(MoESpec(**job["spec"]), ep=job["target"]["ep"], overrides=overrides)
    built = time.monotonic()
    path, _ = engine.load_checkpoint(job["ckpt"], load_optimizer_states=True, load_lr_scheduler_states=False)
    if path is None:
        raise SystemExit(f"DeepSpeed found no checkpoint to load in {job['ckpt']}")
    loaded = time.monotonic()
    deepspeed.comm.barrier()
    print(f"INIT_SECONDS={built - started:.3f}\nLOAD_SECONDS={loaded - built:.3f}\n"
          f"PEAK_RSS={resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}", flush=True)
    from benchmarks.ckpt_builder import _remove_shm_buffer

    _remove_shm_buffer()


# ---- measuring --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One shape change: a checkpoint (and a half-size one for memory), ckptflow's flags, the target."""

    key: str
    title: str
    spec: Any
    small: Any
    world_size: int  # target ranks
    target: dict[str, int] = field(default_factory=dict)  # ckptflow's flags, without dashes
    inject: bool = False  # ds_to_universal --inject_missing_state, as benchmarks/reshard.py runs it

    def flags(self) -> list[str]:
        out = ["--world-size", str(self.world_size)]
        for name, value in self.target.items():
            out += [f"--{name.replace('_', '-')}", str(value)]
        return out


@dataclass(frozen=True)
class Measure:
    label: str
    seconds: float
    peak_rss: int  # bytes
    load_seconds: float | None = None  # load_checkpoint alone, for the engine launches


# Layers of each model by `--size`: the large checkpoint, then the small one resharded beside it for memory.
LAYERS = {"0.5b": {"zero": (32, 16), "tp": (8, 4), "ep": (8, 4)},
          "1b": {"zero": (64, 32), "tp": (20, 8), "ep": (18, 8)}}


def cases(names: list[str], size: str = "0.5b") -> list[Case]:
    from benchmarks.ckpt_builder import BenchSpec
    from benchmarks.moe import MoESpec

    layers = LAYERS[size]
    every = [
        Case("zero", "ZeRO-2 on 2 ranks -> ZeRO-3 on 4 ranks, dense", BenchSpec(stage=2, layers=layers["zero"][0]),
             BenchSpec(stage=2, layers=layers["zero"][1]), 4, {"zero_stage": 3}, inject=True),
        Case("tp", "AutoTP tp 2 (ZeRO-1, 2 ranks) -> tp 1 x dp 2", TPSpec(layers=layers["tp"][0]),
             TPSpec(layers=layers["tp"][1]), 2, {"tp": 1}),
        Case("ep", "AutoEP ep 2 (ZeRO-2, 2 ranks) -> ep 4 on 4 ranks", MoESpec(stage=2, layers=layers["ep"][0]),
             MoESpec(stage=2, layers=layers["ep"][1]), 4, {"ep": 4}),
    ]
    return [case for case in every if case.key in names]


def build(spec: Any) -> Path:
    from benchmarks.ckpt_builder import BenchSpec
    from benchmarks.ckpt_builder import build as build_with
    from benchmarks.moe import MoESpec
    from benchmarks.moe import build as build_moe

    if isinstance(spec, MoESpec):
        return build_moe(spec)
    if isinstance(spec, BenchSpec):
        return build_with(spec, timeout=3600.0)
    return build_with(spec, writer="benchmarks.shapes", keep_logs=True, timeout=3600.0)


def timed_rounds(commands: dict[str, list[str]], repeat: int, out: Path, env: dict[str, str],
                 sizes: dict[str, int], *, ds_repeat: int, keep: Path) -> dict[str, list[tuple[float, int]]]:
    """Run each command `repeat` times (ds_to_universal `ds_repeat` times), in a new shuffled order each
    round, `sync` before each; a ds_to_universal run is followed by a timed `sync` (its "+ sync" row),
    and the output of its last run is moved to `keep` for the engine to load."""
    from benchmarks.reshard import folder_bytes
    from benchmarks.results import run_measured

    runs: dict[str, list[tuple[float, int]]] = {label: [] for label in commands}
    if DS in commands:
        runs[DS_SYNCED] = []
    for round_ in range(repeat):
        order = [(label, command) for label, command in commands.items() if label != DS or round_ < ds_repeat]
        random.Random(round_).shuffle(order)
        for label, command in order:
            shutil.rmtree(out, ignore_errors=True)
            if label == FLOOR:
                out.mkdir()
            os.sync()
            runs[label].append(run_measured(command, env=env)[:2])
            if label == DS:
                started = time.monotonic()
                os.sync()
                seconds, rss = runs[DS][-1]
                runs[DS_SYNCED].append((seconds + time.monotonic() - started, rss))
                sizes.setdefault(DS, folder_bytes(out))
                if round_ == ds_repeat - 1:
                    out.rename(keep)
            shutil.rmtree(out, ignore_errors=True)
            print(f"  {label}: {runs[label][-1][0]:.2f} s, {runs[label][-1][1] / 2**20:.0f} MiB", flush=True)
    return runs


def engine_start(case: Case, ckpt: Path, universal: bool, scratch: Path, repeat: int, label: str) -> Measure | str:
    """The target engine's start from `ckpt` on `case.world_size` CPU ranks, or why it failed."""
    sys.path.insert(0, str(REPO_ROOT))
    from tests.fixtures.launch import LaunchError, launch

    job = {"kind": case.key, "spec": asdict(case.spec), "target": case.target, "ckpt": str(ckpt),
           "universal": universal}
    walls, loads, rss = [], [], []
    for attempt in range(repeat):
        logs = scratch / f"logs-{len(label)}-{attempt}"
        os.sync()
        try:
            result = launch("benchmarks.shapes", case.world_size, ["--load", json.dumps(job)], timeout=3600.0,
                            env={"OMP_NUM_THREADS": "1"}, log_dir=logs)
        except LaunchError as error:
            return str(error).splitlines()[0] + "\n" + "\n".join(str(error).splitlines()[-8:])
        values: dict[str, list[float]] = {}
        for log in result.logs:
            for line in log.read_text(errors="replace").splitlines():
                key, _, value = line.partition("=")
                if key in ("INIT_SECONDS", "LOAD_SECONDS", "PEAK_RSS"):
                    values.setdefault(key, []).append(float(value))
        walls.append(result.seconds)
        loads.append(max(values["LOAD_SECONDS"]))
        rss.append(sum(values["PEAK_RSS"]))
        print(f"  {label}: {result.seconds:.2f} s (load_checkpoint {loads[-1]:.2f} s), "
              f"{rss[-1] / 2**20:.0f} MiB over {case.world_size} ranks", flush=True)
    return Measure(label, statistics.median(walls), int(statistics.median(rss)),
                   statistics.median(loads))


def bench(case: Case, ckpt: Path, scratch: Path, *, repeat: int, ds_repeat: int, load_repeat: int, with_ds: bool,
          ) -> tuple[list[Measure], dict[str, int], dict[str, str]]:
    from benchmarks.floor import ranges_of
    from benchmarks.reshard import folder_bytes, warm
    from benchmarks.results import compile_sources

    py = sys.executable
    tag = (ckpt / "latest").read_text().strip()
    sources = sorted(str(p) for p in (ckpt / tag).glob("*.pt"))
    out = scratch / "out"
    env = {"DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO_ROOT)}
    reshard = [py, "-m", "ckptflow.cli", "reshard", str(ckpt), str(out), *case.flags()]
    shutil.rmtree(out, ignore_errors=True)
    subprocess.run(reshard + ["--no-fsync"], check=True, env={**os.environ, **env}, capture_output=True)
    sizes = {"source": sum(Path(p).stat().st_size for p in sources), CKPTFLOW: folder_bytes(out)}
    failures: dict[str, str] = {}
    shutil.rmtree(out, ignore_errors=True)
    spec = scratch / "floor.json"
    spec.write_text(json.dumps({"ranges": ranges_of(sources), "out_bytes": sizes[CKPTFLOW], "fsync": True}))
    universal = scratch / "universal"  # <tag>/ and `latest_universal`, as ds_to_universal writes them
    commands = {CKPTFLOW: reshard, FLOOR: [py, str(Path(__file__).with_name("floor.py")), str(spec), str(out / "f")]}
    if with_ds:
        commands[DS] = [py, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(ckpt / tag),
                        "--output_folder", str(out / tag)] + (["--inject_missing_state"] if case.inject else [])
    compile_sources()
    warm(ckpt)
    runs = timed_rounds(commands, max(repeat, ds_repeat), out, env, sizes, ds_repeat=ds_repeat, keep=universal)
    measures = [Measure(label, statistics.median(s for s, _ in r), int(statistics.median(m for _, m in r)))
                for label, r in runs.items()]
    if with_ds:  # both starts after the timed rounds, from the same page-cache state; one output on disk at a time
        loaded = engine_start(case, universal, True, scratch, load_repeat, LOAD_UNIVERSAL)
        measures.append(loaded) if isinstance(loaded, Measure) else failures.setdefault(LOAD_UNIVERSAL, loaded)
        if not isinstance(loaded, Measure) and case.target.get("zero_stage") == 3 and zero3_model_states(universal / tag):
            loaded = engine_start(case, universal, True, scratch, load_repeat, LOAD_RENAMED)
            measures.append(loaded) if isinstance(loaded, Measure) else failures.setdefault(LOAD_RENAMED, loaded)
        shutil.rmtree(universal, ignore_errors=True)
        # The target engine loads ckptflow's output natively: the step both routes share.
        subprocess.run(reshard + ["--no-fsync"], check=True, env={**os.environ, **env}, capture_output=True)
        native = engine_start(case, out, False, scratch, load_repeat, LOAD_NATIVE)
        measures.append(native) if isinstance(native, Measure) else failures.setdefault(LOAD_NATIVE, native)
        shutil.rmtree(out, ignore_errors=True)
    return measures, sizes, failures


def zero3_model_states(tag_dir: Path) -> bool:
    """A ZeRO-3 engine with `load_universal` looks for `zero_pp_rank_0_mp_rank_XX_model_states.pt`
    (deepspeed/runtime/engine.py, `_get_all_ckpt_names`); the universal folder of a ZeRO-1/2 source holds
    `mp_rank_XX_model_states.pt`. Link each under the ZeRO-3 name, as a user would have to: whether
    anything was linked."""
    linked = False
    for path in sorted(tag_dir.glob("mp_rank_*_model_states.pt")):
        alias = tag_dir / f"zero_pp_rank_0_{path.name}"
        if not alias.exists():
            alias.symlink_to(path.name)
            linked = True
    return linked


def universal_start(by: dict[str, Measure]) -> Measure | None:
    return by.get(LOAD_UNIVERSAL) or by.get(LOAD_RENAMED)


def table(title: str, measures: list[Measure], world_size: int) -> list[str]:
    by = {m.label: m for m in measures}
    ours, floor = by[CKPTFLOW], by[FLOOR]
    lines = [f"**{title}**", "", "| run | wall | of which load_checkpoint | peak RSS | / ckptflow reshard | / I/O floor |",
             "|---|---:|---:|---:|---:|---:|"]
    for m in measures:
        load = f"{m.load_seconds:.2f} s" if m.load_seconds is not None else ""
        rss = f"{m.peak_rss / 2**20:.0f} MiB" + (f" (sum of {world_size} ranks)" if m.load_seconds is not None else "")
        vs_ours = f"{m.seconds / ours.seconds:.2f}" if m.label != CKPTFLOW and m.load_seconds is None else ""
        vs_floor = f"{m.seconds / floor.seconds:.2f}" if m.label in (CKPTFLOW, DS_SYNCED) else ""
        lines.append(f"| {m.label} | {m.seconds:.2f} s | {load} | {rss} | {vs_ours} | {vs_floor} |")
    start = universal_start(by)
    if DS_SYNCED in by and start and LOAD_NATIVE in by:
        ds_route = by[DS_SYNCED].seconds + start.seconds
        our_route = ours.seconds + by[LOAD_NATIVE].seconds
        lines.append(f"| DeepSpeed route: ds_to_universal + sync, then start from it | {ds_route:.2f} s | | | "
                     f"{ds_route / ours.seconds:.2f} | |")
        lines.append(f"| ckptflow route: reshard, then start from its output | {our_route:.2f} s | | | | |")
        lines.append(f"| DeepSpeed route / ckptflow route | {ds_route / our_route:.2f} | | | | |")
    return lines + [""]


def describe(spec: Any) -> str:
    return f"{spec.layers} layers, {spec.params / 1e9:.2f}B params"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Benchmark ckptflow reshard across shapes (issue 24).")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--ds-repeat", type=int, default=1, help="ds_to_universal runs (minutes each here)")
    parser.add_argument("--load-repeat", type=int, default=1)
    parser.add_argument("--cases", default="zero,tp,ep", help="any of zero, tp, ep, comma-separated")
    parser.add_argument("--no-small", action="store_true", help="skip the half-size checkpoints")
    parser.add_argument("--size", choices=sorted(LAYERS), default="0.5b",
                        help="the large checkpoints' size (1b: about 1B parameters; 15 GB each on disk, and "
                             "DeepSpeed's writers and engine starts need about 30 GB of RAM and swap)")
    parser.add_argument("--no-deepspeed", action="store_true", help="ckptflow and the floor only")
    parser.add_argument("--build-only", action="store_true", help="build the checkpoints and stop")
    parser.add_argument("--write-results", action="store_true", help="replace this benchmark's RESULTS.md section")
    parser.add_argument("--write", help=argparse.SUPPRESS)  # rank side: a TPSpec as JSON
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--load", help=argparse.SUPPRESS)  # rank side: a target engine's start, as JSON
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO_ROOT))
    if args.write:
        _write(TPSpec(**json.loads(args.write)), Path(args.out))
        return
    if args.load:
        _load(json.loads(args.load))
        return
    from benchmarks.reshard import machine
    from benchmarks.results import write_section

    chosen = cases(args.cases.split(","), args.size)
    specs = [s for case in chosen for s in ([case.spec] if args.no_small else [case.spec, case.small])]
    ckpts = {}
    for spec in specs:
        started = time.monotonic()
        ckpts[spec] = build(spec)
        print(f"{spec.name}: {ckpts[spec]} ({time.monotonic() - started:.0f} s)", flush=True)
    if args.build_only:
        return
    # The 1B checkpoints do not fit this machine's disk together: one section per run of them.
    section = SECTION if args.size == "0.5b" else \
        f"## Reshard across shapes at 1B, {','.join(case.key for case in chosen)} (issue 24)"
    lines = [section, "", f"Machine: {machine()}. Command: `.venv/bin/python -m benchmarks.shapes --repeat "
             f"{args.repeat} --ds-repeat {args.ds_repeat} --load-repeat {args.load_repeat} --cases {args.cases}"
             f"{' --size ' + args.size if args.size != '0.5b' else ''}"
             f"{' --no-small' if args.no_small else ''}{' --no-deepspeed' if args.no_deepspeed else ''} --write-results`. Single-process runs: median of "
             f"{args.repeat} rounds (ds_to_universal: {args.ds_repeat}, minutes each here), each in a new shuffled order, "
             "page cache warm, `sync` before each; engine "
             f"starts: median of {args.load_repeat} launch(es) of fresh CPU ranks. Checkpoints written by DeepSpeed "
             "0.19.8 on CPU (bf16, one AdamW step); shapes in the module docstring. ckptflow fsyncs its output; "
             "ds_to_universal does not, so \"+ sync\" adds a timed `sync` after it. The floor reads every source "
             "byte and writes as many bytes as ckptflow's output, fsynced.", ""]
    results: dict[Any, dict[str, Measure]] = {}
    for case in chosen:
        for spec in [case.spec] + ([] if args.no_small else [case.small]):
            scratch = Path(tempfile.mkdtemp(prefix="ckptflow-bench-shapes-", dir=DATA))
            load = os.getloadavg()
            try:
                print(f"{case.key}, {spec.name}", flush=True)
                measures, sizes, failures = bench(case, ckpts[spec], scratch, repeat=args.repeat,
                                                  ds_repeat=args.ds_repeat if spec is case.spec else 0,
                                                  load_repeat=args.load_repeat,
                                                  with_ds=spec is case.spec and not args.no_deepspeed)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
            results[spec] = {m.label: m for m in measures}
            title = (f"{case.title} (`{' '.join(case.flags())}`), {describe(spec)}: source "
                     f"{sizes['source'] / 1e9:.2f} GB, ckptflow output {sizes[CKPTFLOW] / 1e9:.2f} GB"
                     + (f", ds_to_universal output {sizes[DS] / 1e9:.2f} GB" if DS in sizes else "")
                     + f"; load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} at its start, "
                     + "{:.1f} / {:.1f} / {:.1f} at its end".format(*os.getloadavg()))
            block = table(title, measures, case.world_size)
            for label, why in failures.items():
                block += [f"{label} failed (DeepSpeed 0.19.8, CPU ranks): `{why.splitlines()[0]}`", "", "```", why, "```", ""]
            print("\n".join(block), flush=True)
            lines += block
    lines += targets(chosen, results, args.no_small)
    if args.write_results:
        write_section(section, lines)


def targets(chosen: list[Case], results: dict[Any, dict[str, Measure]], no_small: bool) -> list[str]:
    lines = ["**Targets** (ratios of the medians above)", "", "| case | ckptflow / I/O floor (<= 1.2) | "
             "ds_to_universal + sync / ckptflow | DeepSpeed route / ckptflow route | peak RSS small -> large "
             "(flat) |", "|---|---:|---:|---:|---:|"]
    for case in chosen:
        big = results[case.spec]
        ratio = big[CKPTFLOW].seconds / big[FLOOR].seconds
        ds = f"{big[DS_SYNCED].seconds / big[CKPTFLOW].seconds:.1f}x" if DS_SYNCED in big else ""
        route = ""
        start = universal_start(big)
        if DS_SYNCED in big and start and LOAD_NATIVE in big:
            theirs = big[DS_SYNCED].seconds + start.seconds
            route = f"{theirs / (big[CKPTFLOW].seconds + big[LOAD_NATIVE].seconds):.1f}x"
        flat = ""
        if not no_small:
            small, large = results[case.small][CKPTFLOW].peak_rss, big[CKPTFLOW].peak_rss
            flat = (f"{small / 2**20:.0f} -> {large / 2**20:.0f} MiB ({large / small:.2f}x for "
                    f"{case.spec.params / case.small.params:.2f}x params)")
        lines.append(f"| {case.key}: {case.title} | {ratio:.2f} ({'met' if ratio <= 1.2 else 'not met'}) | {ds} | "
                     f"{route} | {flat} |")
    return lines + [""]


if __name__ == "__main__":
    main()
