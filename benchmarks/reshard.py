"""Benchmark: `ckptflow reshard` against DeepSpeed's `ds_to_universal` and an I/O floor.

On the cached checkpoints of the consolidation benchmark (16 linear layers of 4096, about 268M
parameters, bf16, 2 ranks, written by DeepSpeed on CPU; see `benchmarks/ckpt_builder.py`):

- `ckptflow reshard CKPT OUT --world-size 4` and `--world-size 1`, each with its default fsync of
  every file and with `--no-fsync`;
- DeepSpeed's `python -m deepspeed.checkpoint.ds_to_universal --input_folder CKPT/TAG --output_folder OUT
  --inject_missing_state` (its default workers), the offline step DeepSpeed needs before a checkpoint
  can be loaded at another world size;
- an I/O floor per target: a plain-Python process that reads every byte of the source tag folder and
  writes as many bytes as ckptflow's output for that target as ckptflow does (O_DIRECT where the file
  system allows it), with and without fsync.

Every run is a fresh process (imports included) under `/usr/bin/time` (wall time, peak RSS) on a warm
page cache, `--repeat` rounds each in a new (seeded) shuffled order; the median is reported. Before
each run the previous output is deleted and `sync` flushes what is still dirty, so that no run pays
for another's writeback. ds_to_universal does not fsync, so it
compares with the `--no-fsync` rows; each ckptflow row compares with the floor of the same target and
fsync mode.

    .venv/bin/python -m benchmarks.reshard [--repeat 3] [--write-results]

`--write-results` replaces the "Reshard" section of `benchmarks/RESULTS.md`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
FLOOR = Path(__file__).resolve().with_name("floor.py")  # run as a plain file
SECTION = "## Reshard"
DS = "deepspeed ds_to_universal"


@dataclass(frozen=True)
class Measure:
    label: str
    seconds: float
    peak_rss: int  # bytes


def warm(folder: Path) -> None:
    for path in sorted(folder.rglob("*.pt")):
        with open(path, "rb", buffering=0) as fh:
            while fh.read(64 << 20):
                pass


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def bench(ckpt: Path, repeat: int, scratch: Path) -> tuple[list[Measure], dict[str, int]]:
    from benchmarks.floor import ranges_of
    from benchmarks.results import compile_sources, run_measured

    py = sys.executable
    tag = (ckpt / "latest").read_text().strip()
    sources = sorted(str(p) for p in (ckpt / tag).glob("*.pt"))
    out = scratch / "out"
    env = {"DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO_ROOT)}
    sizes = {"source": sum(Path(p).stat().st_size for p in sources)}
    commands: dict[str, list[str]] = {}
    for world_size in (4, 1):
        reshard = [py, "-m", "ckptflow.cli", "reshard", str(ckpt), str(out), "--world-size", str(world_size)]
        shutil.rmtree(out, ignore_errors=True)
        subprocess.run(reshard + ["--no-fsync"], check=True, env={**os.environ, **env}, capture_output=True)
        sizes[f"2->{world_size}"] = folder_bytes(out / tag)
        shutil.rmtree(out, ignore_errors=True)
        commands[f"ckptflow reshard 2->{world_size}"] = reshard
        commands[f"ckptflow reshard 2->{world_size} --no-fsync"] = reshard + ["--no-fsync"]
        for fsync in (True, False):
            spec = scratch / f"floor-{world_size}-{fsync}.json"
            spec.write_text(json.dumps({"ranges": ranges_of(sources), "out_bytes": sizes[f"2->{world_size}"],
                                        "fsync": fsync}))
            commands[f"I/O floor 2->{world_size}{'' if fsync else ' --no-fsync'}"] = [
                py, str(FLOOR), str(spec), str(out / "floor.bin")]
    commands[DS] = [py, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(ckpt / tag),
                    "--output_folder", str(out), "--inject_missing_state"]
    compile_sources()
    warm(ckpt)
    runs: dict[str, list[tuple[float, int]]] = {label: [] for label in commands}
    for round_ in range(repeat):
        order = list(commands.items())
        random.Random(round_).shuffle(order)  # a new order each round: no run always follows the same one
        for label, command in order:
            shutil.rmtree(out, ignore_errors=True)
            if label.startswith("I/O floor"):
                out.mkdir()
            os.sync()  # no run pays for the writeback of the one before
            try:
                measured = run_measured(command, env=env)[:2]
            except RuntimeError as exc:  # e.g. a worker killed by the OOM killer on a shared machine: once more
                print(f"  {label} failed, running it again: {str(exc).splitlines()[-1]}", flush=True)
                shutil.rmtree(out, ignore_errors=True)
                if label.startswith("I/O floor"):
                    out.mkdir()
                os.sync()
                measured = run_measured(command, env=env)[:2]
            runs[label].append(measured)
            shutil.rmtree(out, ignore_errors=True)
            print(f"  {label}: {runs[label][-1][0]:.2f} s", flush=True)
    return [Measure(label, statistics.median(s for s, _ in r), int(statistics.median(m for _, m in r)))
            for label, r in runs.items()], sizes


def table(title: str, measures: list[Measure]) -> list[str]:
    by = {m.label: m for m in measures}
    ds = by[DS]
    lines = [f"**{title}**", "", "| run | wall | peak RSS | vs ds_to_universal | vs I/O floor |",
             "|---|---:|---:|---:|---:|"]
    for m in measures:
        floor = None
        if m.label.startswith("ckptflow"):
            target = m.label.split()[2]
            floor = by[f"I/O floor {target}{' --no-fsync' if m.label.endswith('--no-fsync') else ''}"]
        vs_ds = f"{ds.seconds / m.seconds:.1f}x faster" if m.label.startswith("ckptflow") else ""
        vs_floor = f"{m.seconds / floor.seconds:.2f}x" if floor else ""
        lines.append(f"| {m.label} | {m.seconds:.2f} s | {m.peak_rss / 2**20:.0f} MiB | {vs_ds} | {vs_floor} |")
    return lines + [""]


def machine() -> str:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    load = os.getloadavg()
    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {mem / 2**30:.0f} GiB RAM, "
            f"Python {platform.python_version()}, load average at start {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Benchmark ckptflow reshard against ds_to_universal and an I/O floor.")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--stages", default="3,2", help="ZeRO stages of the checkpoints to use, e.g. 3,2")
    parser.add_argument("--write-results", action="store_true", help="replace the Reshard section of RESULTS.md")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO_ROOT))
    from benchmarks.ckpt_builder import BenchSpec, build
    from benchmarks.results import write_section

    lines = [SECTION, "", f"Machine: {machine()}. Page cache warm; median of {args.repeat} rounds, each in a new "
             "shuffled order; each run "
             "is a fresh process (imports included) measured by `/usr/bin/time`, after a `sync` so that it "
             "does not pay for the previous run's writeback. Command: "
             f"`.venv/bin/python -m benchmarks.reshard --repeat {args.repeat} --write-results`. "
             "ds_to_universal writes without fsync: "
             "compare it with the `--no-fsync` rows. Each ckptflow row's floor is the I/O floor of the same "
             "target and fsync mode (read every source byte once, write as many bytes as the output, with "
             "O_DIRECT as ckptflow does). "
             "ckptflow never imports torch (tests/test_reshard.py pins it); ds_to_universal's rows include "
             "importing torch and DeepSpeed. ds_to_universal only converts: loading the "
             "result at the new world size (`load_universal`) is a further step, not timed here.", ""]
    data = REPO_ROOT / "benchmarks" / ".data"
    data.mkdir(parents=True, exist_ok=True)
    for stage in (int(s) for s in args.stages.split(",")):
        spec = BenchSpec(stage=stage, layers=args.layers)
        ckpt = build(spec)
        scratch = Path(tempfile.mkdtemp(prefix="ckptflow-bench-reshard-", dir=data))
        try:
            print(f"ZeRO-{stage}: {ckpt}", flush=True)
            measures, sizes = bench(ckpt, args.repeat, scratch)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        title = (f"ZeRO-{stage}, bf16, 2 ranks, {spec.layers} x {spec.width} linear ({spec.params / 1e6:.0f}M params): "
                 f"source {sizes['source'] / 1e9:.2f} GB; output 2->4 {sizes['2->4'] / 1e9:.2f} GB, "
                 f"2->1 {sizes['2->1'] / 1e9:.2f} GB")
        block = table(title, measures)
        print("\n".join(block), flush=True)
        lines += block
    if args.write_results:
        write_section(SECTION, lines)


if __name__ == "__main__":
    main()
