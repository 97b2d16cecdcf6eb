"""Benchmark (issue 12), part 1: planning at real scale, on synthetic ZeRO-3 checkpoints.

The checkpoints (`benchmarks/scale_checkpoints.py`) are shaped like Llama-3-70B at 512 ranks and
Llama-3-405B at 1024 ranks: real archive headers and pickles as DeepSpeed 0.19.8 writes them, tensor
bytes left as holes. `plan` measures, each in a fresh subprocess (`nice`; wall and CPU time;
`ru_maxrss` of that process, Python and imports included, the baseline after imports beside it):

- `index`: `load_index` (the coordinator's read of every rank file's headers);
- `consolidate`: `load_index` + `plan_consolidation` (bf16 output, 5 GB shards): units, source bytes
  and range requests per unit (one per copy of `plan_batches`, what `run_unit` sends to a bucket),
  read amplification (bytes the plan reads / fp32 master bytes);
- `reshard`: `load_index` + `plan_reshard` to 3/4 of the world size: units, copies and bytes per unit;
- `ship`, `ship-reshard`: what a unit weighs pickled for a worker: every consolidation `ShardJob`
  (a shard's tensors with their runs, where it goes, the options), and a sample of reshard `RankJob`s
  (each file's pickle and its storages as spans of source byte ranges), with the coordinator's time to
  make them (a `RankJob` runs `files.py` and pickles its trees);
- `ship-dask`: every consolidation job submitted to a real local Dask cluster (`tests.servers.cluster`) through
  `plumbing.executors.cluster` (`Client.get_executor(pure=False)`): coordinator, scheduler and worker cost;
- `index-bucket`: `load_index` through `simbucket://`, the same files behind fsspec's buffered remote
  file, counting the requests a bucket would get.

`profile` runs index + plan under cProfile (and the archive opening, which `load_index` does on a
thread pool cProfile cannot see, on the main thread), then under tracemalloc, and prints where the time
and memory go.

    .venv/bin/python -m benchmarks.scale generate --model 70b
    .venv/bin/python -m benchmarks.scale plan --model 70b [--reshard-to 384] [--skip ship-dask] [--write-results]
    .venv/bin/python -m benchmarks.scale profile --model 405b --what consolidate
    .venv/bin/python -m benchmarks.scale check-structure --model tiny --fixture <fixture>/ckpt/global_step3
    .venv/bin/python -m benchmarks.scale remove --model 405b
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from benchmarks.scale_checkpoints import (
    DATA,
    MODELS,
    REPO_ROOT,
    TAG,
    Llama,
    check_structure,
    disk_usage,
    formats_api,
    generate,
)

SECTION = "## Scale: planning"
# What `plan` measures, each in its own process: step -> (measurement, filesystem).
STEPS = {
    "consolidate": ("consolidate", "local"),
    "reshard": ("reshard", "local"),
    "ship": ("ship", "local"),
    "ship-reshard": ("ship-reshard", "local"),
    "index-bucket": ("index", "simbucket"),
    "ship-dask": ("ship-dask", "local"),
}


# ---- the ckptflow API used here: the one place it is imported (the modules move in phase 2) ----------


def planning_api() -> SimpleNamespace:
    """The coordinator's public API: the index, the plans and the jobs shipped to workers."""
    from ckptflow.consolidate import ConsolidateOptions, plan_batches, plan_consolidation, shard_job
    from ckptflow.formats.deepspeed import load_index
    from ckptflow.plumbing.staging import Staging
    from ckptflow.reshard import plan_reshard, rank_job

    return SimpleNamespace(load_index=load_index, plan_consolidation=plan_consolidation,
                           ConsolidateOptions=ConsolidateOptions, plan_batches=plan_batches, plan_reshard=plan_reshard,
                           shard_job=shard_job, rank_job=rank_job,
                           staging=Staging(out="gs://bucket/out", uri="gs://bucket/.out.ckptflow-0123456789ab.partial"))


# ---- measuring (in a fresh process each) ----------------------------------------------------------------


def _rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _io() -> dict[str, int]:
    with open("/proc/self/io") as fh:
        return {k: int(v) for k, v in (line.split(": ") for line in fh)}


def _fp32_bytes(index: Any) -> int:
    return sum(4 * p.numel for p in index.params if not p.frozen)


def _measure(what: str, root: str, to: int, chunk_bytes: int) -> dict[str, Any]:
    api = planning_api()
    out: dict[str, Any] = {"what": what, "rss_after_imports": _rss()}
    io0, t0, c0 = _io(), time.perf_counter(), time.process_time()
    index = api.load_index(root)
    out["index_seconds"] = time.perf_counter() - t0
    out["index_cpu_seconds"] = time.process_time() - c0
    io1 = _io()
    out["index_read_bytes"] = io1["rchar"] - io0["rchar"]
    out["index_read_calls"] = io1["syscr"] - io0["syscr"]
    out["rss_after_index"] = _rss()
    out["params"] = len(index.params)
    out["numel"] = index.numel
    out["fp32_bytes"] = _fp32_bytes(index)
    out["world_size"] = index.world_size
    if what == "consolidate" or what == "ship":
        t1, c1 = time.perf_counter(), time.process_time()
        plan = api.plan_consolidation(index, api.ConsolidateOptions(dtype="bf16", chunk_bytes=chunk_bytes))
        out["plan_seconds"] = time.perf_counter() - t1
        out["plan_cpu_seconds"] = time.process_time() - c1
        out["rss_after_plan"] = _rss()
        out["units"] = len(plan.units)
        out["source_bytes"] = plan.source_bytes
        out["output_bytes"] = plan.total_size
        if what == "consolidate":
            t2 = time.perf_counter()
            per_unit = []
            for unit in plan.units:
                layout = unit.file()
                by_name = {t.name: t for t in unit.tensors}
                batches = api.plan_batches([(s.dtype, s.begin, by_name[s.name].runs) for s in layout.slots],
                                           chunk_bytes)
                per_unit.append({"tensors": len(unit.tensors), "source_bytes": unit.source_bytes,
                                 "out_bytes": unit.nbytes, "batches": len(batches),
                                 "requests": sum(len(b.copies) for b in batches),
                                 "runs": sum(len(t.runs) for t in unit.tensors)})
            out["batches_seconds"] = time.perf_counter() - t2
            out["per_unit"] = per_unit
            out["rss_after_batches"] = _rss()
        else:
            out.update(_ship(plan, api, chunk_bytes))
    elif what in ("reshard", "ship-reshard"):
        t1, c1 = time.perf_counter(), time.process_time()
        plan = api.plan_reshard(index, to)
        out["plan_seconds"] = time.perf_counter() - t1
        out["plan_cpu_seconds"] = time.process_time() - c1
        out["rss_after_plan"] = _rss()
        if what == "ship-reshard":
            out.update(_ship_reshard(plan, api))
            out["rss_peak"] = _rss()
            return out
        out["units"] = len(plan.units)
        out["read_bytes"] = plan.read_bytes
        out["write_bytes"] = plan.write_bytes
        chunk = 8 << 20  # formats.torch.writer.CHUNK_BYTES: SourceReader's read size
        out["per_unit"] = [{"copies": sum(len(f.copies) for f in u.flats),
                            "spans": 3 * sum(len(f.copies) for f in u.flats),
                            "requests": 3 * sum(math.ceil(4 * c.numel / chunk) for f in u.flats for c in f.copies),
                            "read_bytes": u.read_bytes, "write_bytes": u.write_bytes} for u in plan.units]
    out["rss_peak"] = _rss()
    return out


def _ship(plan: Any, api: Any, chunk_bytes: int) -> dict[str, Any]:
    """Every consolidation unit as the `ShardJob` a worker gets, pickled."""
    t = time.perf_counter()
    jobs = [api.shard_job(plan, u, api.staging) for u in plan.units]
    blobs = [pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL) for job in jobs]
    out: dict[str, Any] = {"jobs_seconds": time.perf_counter() - t, "job_pickle_bytes": [len(b) for b in blobs],
                           "rss_after_jobs": _rss()}
    t = time.perf_counter()
    pickle.loads(blobs[len(blobs) // 2])
    out["job_unpickle_seconds"] = time.perf_counter() - t
    return out


def _ship_reshard(plan: Any, api: Any, sample: int = 8) -> dict[str, Any]:
    """A sample of reshard units as the `RankJob` a worker gets (made on the coordinator: `files.py`,
    then each file's tree pickled), pickled."""
    picks = sorted({round(i * (len(plan.units) - 1) / max(1, sample - 1)) for i in range(sample)})
    made, sizes, files = [], [], []
    for i in picks:
        t = time.perf_counter()
        job = api.rank_job(plan, plan.units[i], api.staging)
        made.append(time.perf_counter() - t)
        sizes.append(len(pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL)))
        files.append([(len(f.pickle), sum(len(st.spans) for st in f.storages)) for f in job.files])
    return {"units": len(plan.units), "sample": picks, "job_seconds": made, "job_pickle_bytes": sizes,
            "job_files": files, "rss_after_jobs": _rss()}


def _register_sim_bucket() -> None:
    """`simbucket:///path`: the local files as an object store client sees them, counting requests.

    Reads go through fsspec's `AbstractBufferedFile` (read-ahead cache of the block size the caller
    asks for), as gcsfs and s3fs files do; `cat_file` with a range is one request, and `cat_ranges`
    is one request per range (what gcsfs and s3fs send, concurrently). `info`/`ls` count as metadata
    requests. Only the number and size of requests are meaningful here, not the time (no latency)."""
    import fsspec
    from fsspec.spec import AbstractBufferedFile, AbstractFileSystem

    class SimFile(AbstractBufferedFile):
        def _fetch_range(self, start: int, end: int) -> bytes:
            return self.fs._read(self.path, start, end)

    class SimBucket(AbstractFileSystem):
        protocol = "simbucket"
        counts = {"range_requests": 0, "range_bytes": 0, "metadata_requests": 0}  # over every instance

        @classmethod
        def _strip_protocol(cls, path: str) -> str:
            path = path[len("simbucket://"):] if path.startswith("simbucket://") else path
            return "/" + path.strip("/")

        def _read(self, path: str, start: int, end: int) -> bytes:
            with open(self._strip_protocol(path), "rb") as fh:
                fh.seek(start)
                data = fh.read(max(0, end - start))
            self.counts["range_requests"] += 1
            self.counts["range_bytes"] += len(data)
            return data

        def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
            self.counts["metadata_requests"] += 1
            local = self._strip_protocol(path)
            if os.path.isdir(local):
                return {"name": local, "size": 0, "type": "directory"}
            if os.path.isfile(local):
                return {"name": local, "size": os.path.getsize(local), "type": "file"}
            raise FileNotFoundError(path)

        def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
            self.counts["metadata_requests"] += 1
            local = self._strip_protocol(path)
            names = sorted(os.path.join(local, n) for n in os.listdir(local))
            if not detail:
                return names
            return [{"name": n, "size": os.path.getsize(n), "type": "directory" if os.path.isdir(n) else "file"}
                    for n in names]

        def _open(self, path: str, mode: str = "rb", block_size: Any = None, **kwargs: Any) -> Any:
            return SimFile(self, path, mode, block_size=block_size or (1 << 20), cache_type="readahead",
                           size=os.path.getsize(self._strip_protocol(path)))

        def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
            size = os.path.getsize(self._strip_protocol(path))
            start = 0 if start is None else start if start >= 0 else size + start
            end = size if end is None else end if end >= 0 else size + end
            return self._read(path, start, end)

    fsspec.register_implementation("simbucket", SimBucket, clobber=True)


def _weigh(*payload: Any) -> dict[str, Any]:
    """Runs on a Dask worker: what receiving a unit cost there (the arguments are already unpickled)."""
    import psutil

    return {"pid": os.getpid(), "rss_peak": _rss(), "rss": psutil.Process().memory_info().rss}


def _ship_dask(root: str, chunk_bytes: int) -> dict[str, Any]:
    """Every consolidation `ShardJob` submitted to a real local Dask cluster (a scheduler and two worker
    processes, `tests.servers.cluster`) the way `consolidate --cluster` submits them (`plumbing.executors.cluster`:
    impure, so nothing is tokenized; pickled, and unpickled again by the scheduler, which holds them until
    the task is done), each running `_weigh` instead of `run_job`."""
    import tempfile

    import psutil

    sys.path.insert(0, str(REPO_ROOT))
    from ckptflow.plumbing.executors import cluster as dask_executor
    from tests.servers.cluster import start_cluster

    api = planning_api()
    index = api.load_index(root)
    plan = api.plan_consolidation(index, api.ConsolidateOptions(dtype="bf16", chunk_bytes=chunk_bytes))
    jobs = [api.shard_job(plan, u, api.staging) for u in plan.units]
    del index
    out: dict[str, Any] = {"units": len(jobs), "rss_before": _rss()}
    with tempfile.TemporaryDirectory() as tmp:
        cluster = start_cluster(Path(tmp), 1, 1)  # the storage proxies are not used here
        try:
            scheduler = psutil.Process(cluster.scheduler.pid)
            cpu0, rss0 = sum(scheduler.cpu_times()[:2]), scheduler.memory_info().rss
            with dask_executor(cluster.address) as executor:
                t = time.perf_counter()
                futures = [executor.submit(_weigh, job) for job in jobs]
                submitted = time.perf_counter() - t
                results = [f.result(timeout=3600) for f in futures]
                out["jobs"] = {
                    "count": len(jobs),
                    "submit_seconds": submitted,
                    "all_done_seconds": time.perf_counter() - t,
                    "coordinator_rss_peak": _rss(),
                    "worker_rss": max(r["rss"] for r in results),
                    "worker_pids": sorted({r["pid"] for r in results}),
                    "scheduler_rss_growth": scheduler.memory_info().rss - rss0,
                    "scheduler_cpu_seconds": sum(scheduler.cpu_times()[:2]) - cpu0,
                }
        finally:
            cluster.close()
    return out


def _child(args: argparse.Namespace) -> None:
    if args.via == "simbucket":
        _register_sim_bucket()
        args.root = "simbucket://" + os.path.abspath(args.root)
    if args.limit_gb:
        limit = int(args.limit_gb * (1 << 30))
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    if args.what == "ship-dask":
        result = _ship_dask(args.root, args.chunk_bytes)
    else:
        result = _measure(args.what, args.root, args.to, args.chunk_bytes)
    if args.via == "simbucket":
        import fsspec

        result["bucket"] = dict(fsspec.get_filesystem_class("simbucket").counts)
    print("RESULT=" + json.dumps(result))


def measure(model: Llama, what: str, *, to: int = 0, chunk_bytes: int = 32 << 20, limit_gb: float = 12.0,
            via: str = "local") -> dict[str, Any]:
    """Run one measurement in a fresh `nice` subprocess; its JSON result (or the error it died of)."""
    command = ["nice", "-n", "10", sys.executable, "-m", "benchmarks.scale", "_child", "--what", what,
               "--root", str(model.folder), "--to", str(to), "--chunk-bytes", str(chunk_bytes), "--limit-gb",
               str(limit_gb),
               "--via", via]
    started = time.monotonic()
    proc = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    wall = time.monotonic() - started
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT="):
            return {**json.loads(line[len("RESULT="):]), "process_seconds": wall}
    return {"what": what, "error": (proc.stdout + proc.stderr)[-3000:], "process_seconds": wall}


# ---- profiling -------------------------------------------------------------------------------------------


def profile(model: Llama, what: str, to: int, top: int) -> None:
    """cProfile (time) then, in a second pass, tracemalloc (memory by line) of index + plan."""
    import cProfile
    import io
    import pstats
    import tracemalloc

    api = planning_api()

    def work() -> Any:
        index = api.load_index(str(model.folder))
        if what == "consolidate":
            return index, api.plan_consolidation(index, api.ConsolidateOptions(dtype="bf16"))
        if what == "reshard":
            return index, api.plan_reshard(index, to)
        return index, None

    # load_index opens the rank files on a thread pool, which cProfile does not see: open some here.
    open_archive = formats_api().open_archive  # the reader itself, to see inside one file's opening

    tag = model.folder / TAG
    sample = min(32, model.world_size)
    for kind in ("zero_pp_rank_{}_mp_rank_00_model_states.pt", "bf16_zero_pp_rank_{}_mp_rank_00_optim_states.pt"):
        prof = cProfile.Profile()
        c = time.process_time()
        prof.enable()
        for rank in range(sample):
            open_archive(str(tag / kind.format(rank)), formats_api().ALLOWED)
        prof.disable()
        per_file = (time.process_time() - c) / sample
        print(f"## open_archive({kind.format('r')}): {per_file * 1000:.1f} ms CPU per file under cProfile, "
              f"x {model.world_size} ranks = {per_file * model.world_size:.1f} s")
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(12)
        print("\n".join(line for line in buf.getvalue().splitlines() if line.strip())[-3000:])
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    result = work()
    prof.disable()
    print(f"## {model.name} ws{model.world_size}: {what} under cProfile: {time.perf_counter() - t:.1f} s")
    for sort in ("cumulative", "tottime"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(sort).print_stats(top)
        print(f"### by {sort}\n" + "\n".join(line for line in buf.getvalue().splitlines() if line.strip())[-6000:])
    del result, prof
    import gc

    gc.collect()
    tracemalloc.start(1)
    t = time.perf_counter()
    index, plan = work()
    current, peak = tracemalloc.get_traced_memory()
    snapshot = tracemalloc.take_snapshot()
    print(f"## tracemalloc ({time.perf_counter() - t:.1f} s): {current / 2**20:.0f} MiB held, {peak / 2**20:.0f} MiB "
          "peak")
    for stat in snapshot.statistics("lineno")[:top]:
        frame = stat.traceback[0]
        print(f"{stat.size / 2**20:9.1f} MiB {stat.count:>10} blocks  "
              f"{frame.filename.replace(str(REPO_ROOT) + '/', '')}:{frame.lineno}")
    print("## the index, part by part (sys.getsizeof of the objects reachable from each, each counted once)")
    for name, part in (("model_states", index.model_states), ("optim_states", index.optim_states),
                       ("params", index.params), ("partitions", index.partitions)):
        print(f"{name:>14}: {_deep_size(part) / 2**20:9.1f} MiB")
    print("## live objects by type (gc-tracked; sys.getsizeof, contents not included)")
    import gc
    from collections import Counter

    counts: Counter = Counter()
    sizes: Counter = Counter()
    for obj in gc.get_objects():
        kind = type(obj).__qualname__
        counts[kind] += 1
        sizes[kind] += sys.getsizeof(obj)
    for kind, size in sizes.most_common(12):
        print(f"{size / 2**20:9.1f} MiB {counts[kind]:>10} {kind}")
    del plan


def _deep_size(obj: Any) -> int:
    """Bytes of the objects reachable from `obj` (each counted once), by sys.getsizeof."""
    seen: set[int] = set()
    stack, total = [obj], 0
    while stack:
        o = stack.pop()
        if id(o) in seen or isinstance(o, (type, type(len))):
            continue
        seen.add(id(o))
        total += sys.getsizeof(o)
        if isinstance(o, dict):
            stack.extend(o.keys())
            stack.extend(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            stack.extend(o)
        elif hasattr(o, "__dict__"):
            stack.append(vars(o))
        elif hasattr(o, "__slots__"):
            stack.extend(getattr(o, s) for s in o.__slots__ if hasattr(o, s))
    return total


# ---- reporting -------------------------------------------------------------------------------------------


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def _gb(n: float) -> str:
    return f"{n / 1e9:,.1f} GB"


def _spread(values: list[float], fmt: Any = str) -> str:
    return f"{fmt(min(values))} / {fmt(statistics.median(values))} / {fmt(max(values))}"


def report(model: Llama, results: dict[str, dict[str, Any]], disk: dict[str, int], reshard_to: int) -> list[str]:
    lines = [f"**{model.name}, ZeRO-3 bf16, {model.world_size} ranks** ({model.numel / 1e9:.1f}B parameters; "
             f"{disk['files']} files, {_gb(disk['logical'])} logical, {_mib(disk['allocated'])} on disk)", ""]
    ix = results.get("index", {})
    if "error" in ix:
        return lines + [f"index failed: `{ix['error'][-500:]}`", ""]
    lines += ["| step | wall | CPU | peak RSS (process) | RSS after imports |", "|---|---:|---:|---:|---:|"]
    cpu = lambda r, *keys: f"{sum(r[k] for k in keys):.1f} s" if all(k in r for k in keys) else "n/a"  # noqa: E731
    lines.append(f"| load_index | {ix['index_seconds']:.1f} s | {cpu(ix, 'index_cpu_seconds')} | "
                 f"{_mib(ix['rss_peak'])} | {_mib(ix['rss_after_imports'])} |")
    for key, label in (("consolidate", "load_index + plan_consolidation"),
                       ("reshard", f"load_index + plan_reshard -> {reshard_to}")):
        r = results.get(key, {})
        if "error" in r:
            lines.append(f"| {label} | failed | | `{r['error'].strip().splitlines()[-1][:160]}` | |")
        elif r:
            lines.append(f"| {label} | {r['index_seconds'] + r['plan_seconds']:.1f} s ({r['plan_seconds']:.1f} s plan) "
                         f"| {cpu(r, 'index_cpu_seconds', 'plan_cpu_seconds')} | {_mib(r['rss_after_plan'])} | "
                         f"{_mib(r['rss_after_imports'])} |")
    lines += ["", f"Index from a local disk: read {_mib(ix['index_read_bytes'])} in {ix['index_read_calls']:,} read "
                  "calls "
              f"({ix['index_read_bytes'] / (2 * model.world_size) / 1024:.0f} KiB per file)."]
    b = results.get("index-bucket", {})
    if b and "error" not in b:
        n = b["bucket"]
        lines[-1] += (f" From a bucket (`simbucket`: the same files through fsspec's buffered remote file, counting "
                      f"requests): {n['range_requests']:,} range requests "
                      f"({n['range_requests'] / (2 * model.world_size):,.0f} per file) for {_mib(n['range_bytes'])}, "
                      f"and {n['metadata_requests']:,} metadata requests.")
    lines.append("")
    c = results.get("consolidate", {})
    if c and "error" not in c:
        pu = c["per_unit"]
        lines += [f"Consolidation (bf16, 5 GB shards, {32} MiB batches): {c['units']} units; per unit (min / median / "
                  f"max): {_spread([u['source_bytes'] for u in pu], _gb)} read, "
                  f"{_spread([u['requests'] for u in pu], lambda v: f'{v:,.0f}')} range requests "
                  f"({_spread([u['source_bytes'] / u['requests'] for u in pu], _mib)} each), "
                  f"{_spread([u['tensors'] for u in pu])} tensors. Read amplification "
                  f"{c['source_bytes'] / c['fp32_bytes']:.4f} (tensor bytes / fp32 master bytes)"
                  + (f"; {(c['source_bytes'] + b['bucket']['range_bytes']) / c['fp32_bytes']:.4f} with the index's "
                     "reads from a bucket." if b and "error" not in b else "."), ""]
    r = results.get("reshard", {})
    if r and "error" not in r:
        pu = r["per_unit"]
        lines += [f"Reshard {model.world_size} -> {reshard_to}: {r['units']} units; per unit (min / median / max): "
                  f"{_spread([u['read_bytes'] for u in pu], _gb)} read, "
                  f"{_spread([u['copies'] for u in pu], lambda v: f'{v:,.0f}')} copies "
                  f"({_spread([u['requests'] for u in pu], lambda v: f'{v:,.0f}')} reads of at most 8 MiB). Read "
                  f"amplification {r['read_bytes'] / (3 * r['fp32_bytes']):.4f} (bytes read / fp32 weights and two "
                  "moments).", ""]
    s = results.get("ship", {})
    if s and "error" not in s and "job_pickle_bytes" in s:
        sizes = s["job_pickle_bytes"]
        lines += ["A consolidation unit shipped to a worker (`ShardJob`: the shard's tensors with their runs, where "
                  f"it goes, the options; no plan, no index): {_spread(sizes, lambda v: f'{v / 1024:,.0f} KiB')} "
                  f"pickled (min / median / max), {_mib(sum(sizes))} for all {len(sizes)} units, all made and pickled "
                  f"in {s['jobs_seconds']:.1f} s, one unpickled in {s['job_unpickle_seconds'] * 1000:.0f} ms.", ""]
    s = results.get("ship-dask", {})
    if s and "error" not in s and "jobs" in s:
        j = s["jobs"]
        lines += [f"All {j['count']} consolidation jobs submitted to a local Dask cluster (scheduler + 2 worker "
                  f"processes) through `plumbing.executors.cluster` (pure=False): {j['submit_seconds']:.1f} s to "
                  f"submit, {j['all_done_seconds']:.1f} s until every worker had its jobs; the scheduler spent "
                  f"{j['scheduler_cpu_seconds']:.1f} s CPU and grew by {_mib(j['scheduler_rss_growth'])}; worker RSS "
                  f"afterwards up to {_mib(j['worker_rss'])}.", ""]
    s = results.get("ship-reshard", {})
    if s and "error" not in s and "job_pickle_bytes" in s:
        sizes, made = s["job_pickle_bytes"], s["job_seconds"]
        lines += [f"A reshard unit shipped to a worker (`RankJob`: each file's pickle and its storages as spans of "
                  f"source byte ranges; made on the coordinator, which runs `files.py` and pickles): "
                  f"{_spread(sizes, lambda v: f'{v / 1024:,.0f} KiB')} pickled for {len(sizes)} of the {s['units']} "
                  f"units (min / median / max), {_spread(made, lambda v: f'{v:.2f} s')} to make one; all "
                  f"{s['units']} would take about {statistics.mean(made) * s['units']:.0f} s of coordinator CPU, "
                  "overlapped with the workers (each is made just before it is submitted).", ""]
    return lines


def _machine(loads: list[str]) -> str:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return (f"Machine: {platform.machine()}, {os.cpu_count()} cores, {mem / 2**30:.0f} GiB RAM, Python "
            f"{platform.python_version()} (1-minute load average when each `plan` started: "
            f"{'; '.join(loads) or 'not recorded'}). Each figure is one fresh process (`nice`): wall time, its CPU "
            "time (all threads; wall time beyond it is waiting for the two cores) and its peak RSS (`ru_maxrss`).")


def _before_after(model: Llama) -> list[str]:
    """The 405B figures before the exact-range archive reader, the archive cache and the implicit ZeRO-3
    fragments (`before-405b.json`, kept from that run) beside today's."""
    before_path, now_path = DATA / "before-405b.json", DATA / f"results-{model.name}-ws{model.world_size}.json"
    if not (before_path.exists() and now_path.exists()):
        return []
    before, now = json.loads(before_path.read_text()), json.loads(now_path.read_text())
    lines = [f"**{model.name}, before and after the planning rework** (before: {before['started']}, load "
             f"{before['load_at_start']:.1f}; after: {now['started']}, load {now['load_at_start']:.1f})", "",
             "| step | wall before | wall now | peak RSS before | peak RSS now |", "|---|---:|---:|---:|---:|"]
    for key, label in (("index", "load_index"), ("consolidate", "load_index + plan_consolidation"),
                       ("reshard", "load_index + plan_reshard")):
        b, n = before["results"].get(key, {}), now["results"].get(key, {})
        if not b or not n or "error" in b or "error" in n:
            continue
        wall = lambda r: r["index_seconds"] + r.get("plan_seconds", 0)  # noqa: E731
        rss = lambda r: r.get("rss_after_plan", r["rss_peak"])  # noqa: E731
        lines.append(f"| {label} | {wall(b):.1f} s | {wall(n):.1f} s | {_mib(rss(b))} | {_mib(rss(n))} |")
    b, n = before["results"]["index"], now["results"]["index"]
    lines += ["", f"The index read {_mib(b['index_read_bytes'])} in {b['index_read_calls']:,} read calls before, "
              f"{_mib(n['index_read_bytes'])} in {n['index_read_calls']:,} now.", ""]
    return lines


def _targets(results: dict[str, dict[str, Any]]) -> list[str]:
    """Issue 12's planning targets, judged on the slower of the two plans."""
    plans = [results[k] for k in ("consolidate", "reshard") if results.get(k) and "error" not in results[k]]
    if not plans:
        return []
    wall = max(r["index_seconds"] + r["plan_seconds"] for r in plans)
    rss = max(r["rss_peak"] for r in plans)
    amp = ([results["consolidate"]["source_bytes"] / results["consolidate"]["fp32_bytes"]]
           if "consolidate" in results else [])
    amp += [results["reshard"]["read_bytes"] / (3 * results["reshard"]["fp32_bytes"])] if "reshard" in results else []
    met = lambda ok: "met" if ok else "NOT met"  # noqa: E731
    return [f"**Targets:** indexed and planned in {wall:.1f} s at most ({met(wall < 60)}: < 60 s), peak RSS "
            f"{_mib(rss)} ({met(rss < 2e9)}: < 2 GB), read amplification {max(amp):.4f} ({met(max(amp) <= 1.01)}: "
            "<= 1.01).", ""]


def _write_results() -> None:
    """The RESULTS.md section from every results-*.json present."""
    sys.path.insert(0, str(REPO_ROOT))
    from benchmarks.results import write_section

    body, loads = [], []
    for name in ("70b", "405b"):
        model = MODELS[name]
        path = DATA / f"results-{model.name}-ws{model.world_size}.json"
        if path.exists():
            saved = json.loads(path.read_text())
            body += report(model, saved["results"], saved["disk"], saved["reshard_to"])
            body += _targets(saved["results"]) if name == "405b" else []
            if "load_at_start" in saved:
                loads.append(f"{model.name} {saved['load_at_start']:.1f}")
    lines = [SECTION, "", _machine(loads), "",
             "Command: `.venv/bin/python -m benchmarks.scale plan --model {70b,405b} --write-results`. Synthetic "
             "ZeRO-3 checkpoints (real headers and pickles, tensor bytes as holes; see "
             "`benchmarks/scale_checkpoints.py`). Targets (issue 12): 405B indexed and planned in under 60 s and 2 GB; "
             "read amplification <= 1.01.", "",
             *body, *_before_after(MODELS["405b"])]
    write_section(SECTION, lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("generate", "plan", "profile", "remove", "check-structure"):
        p = sub.add_parser(name)
        p.add_argument("--model", choices=sorted(MODELS), required=True)
    p = sub.add_parser("throughput", help="part 2: 1, 2, 4 Dask workers from an S3 server (scale_cluster.py)")
    p.add_argument("--model", choices=sorted(MODELS), default="1b", help="tiny: a quick check of the harness")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--what", nargs="+", choices=["consolidate", "reshard"], default=["consolidate", "reshard"])
    p.add_argument("--write-results", action="store_true")
    p = sub.add_parser("model", help="part 3: predicted wall times for 70B and 405B on 4-64 workers")
    p.add_argument("--write-results", action="store_true")
    child = sub.add_parser("_child")
    for p in (sub.choices["plan"], sub.choices["profile"]):
        p.add_argument("--reshard-to", type=int, default=0, help="target world size (default: 3/4 of the source)")
    sub.choices["plan"].add_argument("--skip", nargs="*", default=[], choices=list(STEPS))
    sub.choices["plan"].add_argument("--write-results", action="store_true")
    sub.choices["plan"].add_argument("--limit-gb", type=float, default=12.0, help="address-space cap per process")
    sub.choices["profile"].add_argument("--what", choices=["index", "consolidate", "reshard"], default="consolidate")
    sub.choices["profile"].add_argument("--top", type=int, default=25)
    sub.choices["check-structure"].add_argument("--fixture", type=Path, required=True,
                                                help="tag folder of a real ZeRO-3 bf16 checkpoint with >= 2 ranks")
    child.add_argument("--what", required=True)
    child.add_argument("--root", required=True)
    child.add_argument("--to", type=int, default=0)
    child.add_argument("--chunk-bytes", type=int, default=32 << 20)
    child.add_argument("--limit-gb", type=float, default=0)
    child.add_argument("--via", choices=["local", "simbucket"], default="local")
    args = parser.parse_args(argv)
    if args.command == "_child":
        _child(args)
        return
    if args.command in ("throughput", "model"):
        from benchmarks import scale_cluster

        if args.command == "throughput":
            scale_cluster.throughput(MODELS[args.model], args.workers, args.what, args.write_results)
        else:
            scale_cluster.model(args.write_results)
        return
    model = MODELS[args.model]
    if args.command == "remove":
        shutil.rmtree(model.folder, ignore_errors=True)
        return
    if args.command == "generate":
        started = time.monotonic()
        generate(model)
        usage = disk_usage(model.folder)
        print(json.dumps({**json.loads((model.folder / "done.json").read_text()), **usage,
                          "seconds_this_call": round(time.monotonic() - started, 1)}))
        return
    if args.command == "check-structure":
        problems = check_structure(args.fixture, generate(model) / TAG)
        print("\n".join(problems) if problems else "same key structure as the real checkpoint")
        sys.exit(1 if problems else 0)
    to = args.reshard_to or model.world_size * 3 // 4
    if args.command == "profile":
        profile(model, args.what, to, args.top)
        return
    generate(model)
    disk = disk_usage(model.folder)
    load, started = os.getloadavg()[0], time.strftime("%Y-%m-%d %H:%M")
    out = DATA / f"results-{model.name}-ws{model.world_size}.json"
    saved = json.loads(out.read_text())["results"] if out.exists() else {}
    results = {"index": measure(model, "index", limit_gb=args.limit_gb)}
    for step, (what, via) in STEPS.items():
        if step in args.skip:
            results[step] = saved.get(step, {})
        elif "error" not in results["index"]:
            results[step] = measure(model, what, to=to, limit_gb=args.limit_gb, via=via)
    out.write_text(json.dumps({"disk": disk, "results": results, "reshard_to": to, "load_at_start": load,
                               "started": started}, indent=1) + "\n")
    lines = report(model, results, disk, to)
    print("\n".join(lines))
    print(f"(raw figures: {out})")
    if args.write_results:
        _write_results()


if __name__ == "__main__":
    main()
