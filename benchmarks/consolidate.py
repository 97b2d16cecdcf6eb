"""Benchmark: `ckptflow consolidate --dtype bf16` against DeepSpeed's converter and an I/O floor.

On the same cached checkpoints (written by DeepSpeed on CPU, see `benchmarks/ckpt_builder.py`):

- `ckptflow consolidate CKPT OUT --dtype bf16` (the CLI, with its default `--verify`, and with
  `--no-verify`);
- DeepSpeed's `zero_to_torch.py CKPT OUT --dtype bfloat16`, the copy DeepSpeed put in the checkpoint;
- an I/O floor (`benchmarks/floor.py`, the one the reshard and MoE benchmarks use): a plain-Python
  process that reads exactly the fp32 master bytes and writes as many bytes as the bf16 output as
  ckptflow writes (O_DIRECT where the file system takes it), then fsyncs (no torch, no cast, no hash);
- "work only" rows: the same two conversions as library calls, timed inside the process after their
  imports (DeepSpeed's converter needs torch, over a second to import here; ckptflow's casts with
  numpy and never imports it), to separate the work from start-up.

Each runs in its own subprocess under `/usr/bin/time` (wall time and peak RSS), `--repeat` times, each
time right after the bytes it reads were read once (warm page cache); the median is reported. The main model is \
16 layers of 4096 (about 268M parameters,
ZeRO-3 and ZeRO-2, bf16, 2 ranks); a half-size ZeRO-3 model (8 layers) shows whether peak memory
stays flat as the model grows.

    .venv/bin/python -m benchmarks.consolidate [--repeat 3] [--write-results]

`--write-results` replaces the "Consolidate" section of `benchmarks/RESULTS.md`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SECTION = "## Consolidate"


@dataclass(frozen=True)
class Measure:
    label: str
    seconds: float
    peak_rss: int  # bytes
    cpu: float  # user + system seconds of the whole process
    failed: int = 0  # runs that did not finish (left out of the medians)


def work(kind: str, ckpt: str, out: str, verify: bool) -> None:
    """Subprocess body of the in-process timings: import first, then time only the conversion."""
    if kind == "ckptflow":
        from ckptflow.consolidate import ConsolidateOptions, consolidate  # casts with numpy: no torch

        started = time.monotonic()
        consolidate(ckpt, out, options=ConsolidateOptions(dtype="bf16", verify=verify))
    else:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_state_dict

        started = time.monotonic()
        convert_zero_checkpoint_to_state_dict(ckpt, out, dtype="bfloat16")
    print(f"WORK_SECONDS={time.monotonic() - started:.4f}", flush=True)


def warm(ckpt: Path, ranges: list[list]) -> None:
    """Read what every contender reads (the fp32 master ranges and the model-state files) once, so
    that all of them start on a warm page cache without crowding it with optimizer moments."""
    for uri, start, end in ranges:
        with open(uri, "rb", buffering=0) as fh:
            fh.seek(start)
            while start < end:
                start += len(fh.read(min(64 << 20, end - start)) or b"x" * (end - start))
    for path in sorted(ckpt.rglob("*model_states.pt")):
        path.read_bytes()


def floor_plan(ckpt: Path) -> dict[str, object]:
    """The fp32 master byte ranges of every rank and the size of the bf16 output."""
    from ckptflow.consolidate import ConsolidateOptions, plan_consolidation
    from ckptflow.formats.deepspeed import load_index

    index = load_index(str(ckpt))
    plan = plan_consolidation(index, ConsolidateOptions(dtype="bf16"))
    ranges = [[part.fp32.uri, *part.fp32.byte_range] for row in index.partitions for part in row]
    return {"ranges": ranges, "out_bytes": plan.file_bytes, "params": index.numel, "fsync": True}


def contenders(ckpt: Path, out: Path, floor_spec: Path) -> dict[str, list[str]]:
    py = sys.executable
    return {
        "ckptflow (verify)": [py, "-m", "ckptflow.cli", "consolidate", str(ckpt), str(out), "--dtype", "bf16"],
        "ckptflow --no-verify": [py, "-m", "ckptflow.cli", "consolidate", str(ckpt), str(out), "--dtype", "bf16",
                                 "--no-verify"],
        "deepspeed zero_to_torch.py": [py, str(ckpt / "zero_to_torch.py"), str(ckpt), str(out), "--dtype", "bfloat16"],
        "I/O floor": [py, str(Path(__file__).resolve().with_name("floor.py")), str(floor_spec), str(out / "floor.bin")],
        "work only: ckptflow (verify)": [py, str(Path(__file__).resolve()), "--work", "ckptflow", str(ckpt), str(out)],
        "work only: ckptflow --no-verify": [py, str(Path(__file__).resolve()), "--work", "ckptflow-no-verify",
                                            str(ckpt), str(out)],
        "work only: deepspeed": [py, str(Path(__file__).resolve()), "--work", "deepspeed", str(ckpt), str(out)],
    }


def bench(ckpt: Path, repeat: int, only: set[str] | None = None) -> tuple[list[Measure], dict[str, object]]:
    from benchmarks.results import compile_sources, run_measured

    compile_sources()
    plan = floor_plan(ckpt)
    scratch = Path(tempfile.mkdtemp(prefix="ckptflow-bench-", dir=REPO_ROOT / "benchmarks" / ".data"))
    try:
        spec = scratch / "floor.json"
        spec.write_text(json.dumps(plan))
        out = scratch / "out"
        runs: dict[str, list[tuple[float, int, float]]] = {}
        failures: dict[str, int] = {}
        for _ in range(repeat):
            for label, command in contenders(ckpt, out, spec).items():
                if only and label not in only:
                    continue
                shutil.rmtree(out, ignore_errors=True)
                warm(ckpt, plan["ranges"])  # type: ignore[arg-type]
                if label == "I/O floor":
                    out.mkdir()
                try:
                    runs.setdefault(label, []).append(
                        run_measured(command, env={"DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO_ROOT)}))
                except RuntimeError as exc:  # e.g. killed by the kernel when memory runs out: report, go on
                    failures[label] = failures.get(label, 0) + 1
                    print(f"{label} failed: {str(exc).splitlines()[0]}", file=sys.stderr, flush=True)
                shutil.rmtree(out, ignore_errors=True)
        measures = [Measure(label, statistics.median(x[0] for x in r), int(statistics.median(x[1] for x in r)),
                            statistics.median(x[2] for x in r), failures.get(label, 0)) for label, r in runs.items()
                    if r]
        measures += [Measure(label, float("nan"), 0, float("nan"), n) for label, n in failures.items()
                     if not runs.get(label)]
        return measures, plan
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def table(title: str, measures: list[Measure]) -> list[str]:
    by = {m.label: m for m in measures}
    floor = by.get("I/O floor")
    lines = [f"**{title}**", "",
             "| run | wall | CPU (user+sys) | peak RSS | vs DeepSpeed: speed-up, memory | vs I/O floor |",
             "|---|---:|---:|---:|---|---:|"]
    for m in measures:
        ds = by.get("work only: deepspeed" if m.label.startswith("work only") else "deepspeed zero_to_torch.py")
        vs_ds = f"{ds.seconds / m.seconds:.2f}x faster, {m.peak_rss / ds.peak_rss:.2f}x memory" \
            if ds and m is not ds and ds.peak_rss and m.peak_rss else ""
        vs_floor = f"{m.seconds / floor.seconds:.2f}x" if floor and m is not floor else ""
        label = f"{m.label} ({m.failed} run(s) failed)" if m.failed else m.label
        lines.append(f"| {label} | {m.seconds:.2f} s | {m.cpu:.2f} s | {m.peak_rss / 2**20:.0f} MiB | {vs_ds} | "
                     f"{vs_floor} |")
    return lines + [""]


def machine() -> str:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    load = os.getloadavg()
    available = ""
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        available = (f", {int(info['MemAvailable'].split()[0]) / 2**20:.1f} GiB available "
                     f"({int(info['Shmem'].split()[0]) / 2**20:.1f} GiB held in /dev/shm and other shared memory)")
    except (OSError, KeyError, ValueError):
        pass
    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {mem / 2**30:.0f} GiB RAM"
            f"{available}, Python {platform.python_version()}, load average at start {load[0]:.1f} / {load[1]:.1f} / "
            f"{load[2]:.1f} (the machine is shared: other test suites run beside this)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Benchmark ckptflow consolidate against DeepSpeed and an I/O floor.")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--write-results", action="store_true", help="replace the Consolidate section of RESULTS.md")
    parser.add_argument("--work", nargs=3, metavar=("KIND", "CKPT", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.work:
        kind, ckpt, out = args.work
        work(kind.removesuffix("-no-verify"), ckpt, out, verify=not kind.endswith("-no-verify"))
        return
    sys.path.insert(0, str(REPO_ROOT))
    from benchmarks.ckpt_builder import BenchSpec, build
    from benchmarks.results import write_section

    started = machine()
    lines = [SECTION, "", f"Machine: {started}. Page cache warm; median of {args.repeat} runs; each run is a "
             "fresh process (imports included) measured by `/usr/bin/time`. Command: "
             f"`.venv/bin/python -m benchmarks.consolidate --repeat {args.repeat} --write-results`.", ""]
    flat: dict[str, dict[int, Measure]] = {}
    full_size: dict[int, dict[str, Measure]] = {}
    for stage, layers in ((3, args.layers), (2, args.layers), (3, args.layers // 2)):
        spec = BenchSpec(stage=stage, layers=layers)
        ckpt = build(spec)
        only = None if layers == args.layers else {"ckptflow (verify)", "ckptflow --no-verify",
                                                   "deepspeed zero_to_torch.py",
                                                   "work only: ckptflow (verify)", "work only: deepspeed"}
        measures, plan = bench(ckpt, args.repeat, only)
        size = sum(p.stat().st_size for p in ckpt.rglob("*.pt"))
        title = (f"ZeRO-{stage}, bf16, 2 ranks, {layers} x 4096 linear ({plan['params'] / 1e6:.0f}M params): "
                 f"checkpoint {gb(size)}, bf16 output {gb(plan['out_bytes'])}")
        block = table(title, measures)
        print("\n".join(block), flush=True)
        lines += block
        if stage == 3:
            for m in measures:
                flat.setdefault(m.label, {})[layers] = m
        if layers == args.layers:
            full_size[stage] = {m.label: m for m in measures}
    full, half = args.layers, args.layers // 2
    lines += [f"**Peak memory as the ZeRO-3 model doubles ({half} -> {full} layers)**", "",
              "| run | peak RSS, half | peak RSS, full | growth |", "|---|---:|---:|---:|"]
    for label, by_size in flat.items():
        if half in by_size and full in by_size:
            a, b = by_size[half].peak_rss, by_size[full].peak_rss
            lines.append(f"| {label} | {a / 2**20:.0f} MiB | {b / 2**20:.0f} MiB | {b / a:.2f}x |")
    lines.append("")
    lines += targets(full_size, flat, half, full)
    print("\n".join(lines[-(len(flat) + 16):]))
    if args.write_results:
        write_section(SECTION, lines)


def targets(full_size: dict[int, dict[str, Measure]], flat: dict[str, dict[int, Measure]], half: int,
            full: int) -> list[str]:
    """The issue's targets, checked against the numbers above (wall times, ZeRO-3 and ZeRO-2)."""
    def ratio(stage: int, a: str, b: str, attr: str) -> float:
        x, y = full_size.get(stage, {}).get(a), full_size.get(stage, {}).get(b)
        return getattr(x, attr) / getattr(y, attr) if x and y and getattr(y, attr) else float("nan")

    rows = []
    for what, a, b, attr, goal, better in (
        ("speed-up over DeepSpeed, CLI with --verify", "deepspeed zero_to_torch.py", "ckptflow (verify)", "seconds",
         2.0, "≥"),
        ("speed-up over DeepSpeed, CLI --no-verify", "deepspeed zero_to_torch.py", "ckptflow --no-verify", "seconds",
         2.0, "≥"),
        ("speed-up over DeepSpeed, work only, --verify", "work only: deepspeed", "work only: ckptflow (verify)",
         "seconds",
         2.0, "≥"),
        ("speed-up over DeepSpeed, work only, --no-verify", "work only: deepspeed", "work only: ckptflow --no-verify",
         "seconds", 2.0, "≥"),
        ("peak RSS / DeepSpeed's, CLI with --verify", "ckptflow (verify)", "deepspeed zero_to_torch.py", "peak_rss",
         0.25, "≤"),
        ("time / I/O floor, CLI with --verify", "ckptflow (verify)", "I/O floor", "seconds", 1.5, "≤"),
        ("time / I/O floor, CLI --no-verify", "ckptflow --no-verify", "I/O floor", "seconds", 1.5, "≤"),
        ("time / I/O floor, work only, --no-verify", "work only: ckptflow --no-verify", "I/O floor", "seconds", 1.5,
         "≤"),
        ("time / I/O floor, work only, --verify", "work only: ckptflow (verify)", "I/O floor", "seconds", 1.5, "≤"),
    ):
        got = [ratio(stage, a, b, attr) for stage in (3, 2)]
        met = all((g >= goal) if better == "≥" else (g <= goal) for g in got)
        rows.append(f"| {what} | {better} {goal:g} | {got[0]:.2f} | {got[1]:.2f} | {'met' if met else 'not met'} |")
    growth = [f"{by[full].peak_rss / by[half].peak_rss:.2f}x" for label, by in flat.items()
              if label.startswith("ckptflow") and half in by and full in by]
    return ["**Targets** (ratios of the medians above)", "", "| target | goal | ZeRO-3 | ZeRO-2 | |",
            "|---|---|---:|---:|---|", *rows,
            f"| ckptflow peak RSS as the model doubles | flat | {', '.join(growth)} | | "
            f"{'met' if all(float(g[:-1]) < 1.1 for g in growth) else 'not met'} |", ""]


if __name__ == "__main__":
    main()
