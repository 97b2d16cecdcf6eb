"""Benchmark (issue 12), parts 2 and 3: ckptflow through 1, 2 and 4 Dask workers from an S3 server, and
what those figures predict for Llama-3-70B and 405B on 4 to 64 workers.

`throughput` puts a ~1B-parameter ZeRO-3 bf16 checkpoint into an S3 server on loopback: the `1b`
shape of `scale_checkpoints.py` (Llama-3.2-1B's layers, 8 of them, untied embeddings, 8 ranks; real
headers and pickles, 12.1 GB of tensor bytes, all zeros, which costs a store and the network what any
bytes cost). Then, for each worker count, it starts a fresh Dask scheduler and that many worker
processes (one thread each, no nanny; `tests.servers.cluster.start_cluster` with the store reached directly)
and runs the CLI as a user would:

    ckptflow consolidate s3://ckpt/llama-1b-ws8 s3://ckpt/out --dtype bf16 --max-shard-size 100MB --cluster tcp://...
    ckptflow reshard s3://ckpt/llama-1b-ws8 s3://ckpt/out --world-size 16 --cluster tcp://...

and records its wall time, the coordinator's peak RSS and CPU (`/usr/bin/time`), each worker's peak RSS
(`ru_maxrss`, asked of the worker after the run; one cluster per run), and the bytes converted. Beside
them, the store's own costs on this machine: one small range GET (the per-request cost) and 32 MiB
range GETs by 1, 2 and 4 reader processes at once (the store's ceiling here).

The S3 server is s3rver (npm, objects as files on disk, ranges streamed from the file), installed under
`benchmarks/.data/node` on first use. moto and the GCS emulator that the tests use read a whole object
for every range request, which makes GB-sized objects unusable for a throughput figure.

`model` turns the measured figures into predicted wall times for Llama-3-70B and 405B on 4, 16 and
64 workers against stores of a given aggregate bandwidth, beside DeepSpeed's own figures; its
assumptions are `ASSUMPTIONS` below and are printed with the table.

    .venv/bin/python -m benchmarks.scale throughput [--workers 1 2 4] [--what consolidate reshard] [--write-results]
    .venv/bin/python -m benchmarks.scale model [--write-results]
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.results import run_measured, write_section
from benchmarks.scale_checkpoints import DATA, MODELS, REPO_ROOT, TAG, Llama, generate

NODE = DATA.parent / "node"
S3RVER = "s3rver@3.7.1"
BUCKET = "ckpt"
RESULTS_JSON = DATA / "results-throughput.json"  # per model: results-throughput-{name}.json
SECTION_THROUGHPUT = "## Scale: throughput through Dask workers"
SECTION_MODEL = "## Scale: a model for 70B and 405B"
CONSOLIDATE_ARGS = ["--dtype", "bf16", "--max-shard-size", "100MB"]
RESHARD_TO = 16
READ_PIECE = 32 << 20  # the store-ceiling readers' range size: one consolidate read batch


# ---- the S3 server --------------------------------------------------------------------------------


@contextlib.contextmanager
def s3_server(folder: Path) -> Iterator[dict[str, str]]:
    """s3rver on loopback with its objects under `folder`; yields the environment that points fsspec's
    `s3://` (every process: this one's children, the CLI, the Dask workers) at it."""
    binary = NODE / "node_modules" / ".bin" / "s3rver"
    if not binary.exists():
        subprocess.run(["npm", "install", "--prefix", str(NODE), "--no-audit", "--no-fund", S3RVER], check=True,
                       stdout=subprocess.DEVNULL)
    sys.path.insert(0, str(REPO_ROOT))
    from tests.servers.stores import _free_port

    folder.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    log = open(folder.parent / "s3rver.log", "ab")
    proc = subprocess.Popen([str(binary), "-d", str(folder), "-a", "127.0.0.1", "-p", str(port),
                             "--configure-bucket", BUCKET, "--silent"], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    log.close()
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"s3rver did not start (see {folder.parent / 's3rver.log'})")
            time.sleep(0.1)
        yield {"FSSPEC_S3_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "S3RVER",
               "AWS_SECRET_ACCESS_KEY": "S3RVER", "AWS_DEFAULT_REGION": "us-east-1",
               "PYTHONPATH": os.pathsep.join([str(_single_copy_site()), str(REPO_ROOT)])}
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        if proc.poll() is None:
            proc.kill()


def _single_copy_site() -> Path:
    """A `sitecustomize` for the processes that talk to s3rver: s3fs copies an object over 150 MiB
    with UploadPartCopy, which s3rver does not implement (S3 does); raised to 5 GiB, S3's own limit
    for a single CopyObject, every commit copy here is one CopyObject."""
    site = DATA / "s3rver-site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text("import s3fs.core\n\ns3fs.core.MANAGED_COPY_THRESHOLD = 5 * 2**30\n")
    return site


def _s3(env: dict[str, str]) -> Any:
    import s3fs

    # s3rver assembles a multipart upload before it answers: a GB object takes longer than botocore's 60 s.
    return s3fs.S3FileSystem(endpoint_url=env["FSSPEC_S3_ENDPOINT_URL"], key=env["AWS_ACCESS_KEY_ID"],
                             secret=env["AWS_SECRET_ACCESS_KEY"], skip_instance_cache=True,
                             config_kwargs={"read_timeout": 900})


def upload(model: Llama, env: dict[str, str]) -> tuple[str, int]:
    """The checkpoint in the bucket (uploaded once; a marker object records it): its URL and size."""
    fs = _s3(env)
    prefix = f"{BUCKET}/{model.folder.name}"
    marker = f"{prefix}.uploaded.json"
    if fs.exists(marker):
        return f"s3://{prefix}", json.loads(fs.cat_file(marker))["bytes"]
    root = generate(model)
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name != "done.json")
    started = time.monotonic()
    for path in files:  # one at a time, skipping what an interrupted upload already put there
        key = f"{prefix}/{path.relative_to(root)}"
        if not (fs.exists(key) and fs.size(key) == path.stat().st_size):
            fs.put_file(str(path), key, chunksize=64 << 20)
    size = sum(p.stat().st_size for p in files)
    seconds = time.monotonic() - started
    fs.pipe_file(marker, json.dumps({"bytes": size, "seconds": seconds}).encode())
    print(f"uploaded {size / 1e9:.1f} GB in {seconds:.0f} s", flush=True)
    return f"s3://{prefix}", size


# ---- the store's own costs -----------------------------------------------------------------------


def _optim_objects(model: Llama) -> list[str]:
    return [f"{BUCKET}/{model.folder.name}/{TAG}/bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
            for r in range(model.world_size)]


def store_costs(model: Llama, env: dict[str, str], readers: list[int], nbytes: int) -> dict[str, Any]:
    """The median of 50 small range GETs (4 KiB), and MB/s of `readers` processes reading `nbytes`
    each in 32 MiB range GETs from different objects (one request at a time each)."""
    fs = _s3(env)
    obj = _optim_objects(model)[0]
    span = max(1, fs.size(obj) - 4096)
    times = []
    for i in range(50):
        started = time.perf_counter()
        fs.cat_file(obj, start=i * 65536 % span, end=i * 65536 % span + 4096)
        times.append(time.perf_counter() - started)
    out: dict[str, Any] = {"small_get_ms": statistics.median(times) * 1000, "ceiling": {}}
    for k in readers:
        started = time.monotonic()
        procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.scale_cluster", "_read", obj, str(nbytes)],
                                  cwd=REPO_ROOT, env={**os.environ, **env})
                 for obj in _optim_objects(model)[:k]]
        if any(p.wait() != 0 for p in procs):
            raise RuntimeError("a reader failed")
        out["ceiling"][k] = k * nbytes / (time.monotonic() - started)
    return out


def _read(obj: str, nbytes: int) -> None:
    """A reader process of `store_costs`: `nbytes` of `obj` in 32 MiB range GETs, one at a time."""
    env = os.environ
    fs = _s3({k: env[k] for k in ("FSSPEC_S3_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")})
    for start in range(0, nbytes, READ_PIECE):
        fs.cat_file(obj, start=start, end=min(nbytes, start + READ_PIECE))


# ---- runs through a cluster ---------------------------------------------------------------------


def worker_usage() -> tuple[int, float]:
    """Run on a worker: its process's peak RSS in bytes and its CPU seconds so far (all threads)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_maxrss * 1024, usage.ru_utime + usage.ru_stime


def run_through(model: Llama, what: str, src: str, workers: int, env: dict[str, str], folder: Path) -> dict[str, Any]:
    """One CLI run of `what` through a fresh cluster of `workers` processes: wall, coordinator peak
    RSS and CPU, every worker's peak RSS, the output's size; the output is removed afterwards."""
    sys.path.insert(0, str(REPO_ROOT))
    from tests.servers.cluster import start_cluster

    out = f"s3://{BUCKET}/out-{what}-{workers}"
    fs = _s3(env)
    if fs.exists(out):
        fs.rm(out, recursive=True)
    cli = str(Path(sys.executable).with_name("ckptflow"))
    command = [cli, "consolidate", src, out, *CONSOLIDATE_ARGS] if what == "consolidate" else \
        [cli, "reshard", src, out, "--world-size", str(RESHARD_TO)]
    shutil.rmtree(folder, ignore_errors=True)
    cluster = start_cluster(folder, None, None, tuple(f"w{i}" for i in range(workers)), threads=1, store_env=env)
    try:
        client = cluster.client()
        try:
            before = client.run(worker_usage)
            wall, rss, cpu = run_measured([*command, "--cluster", cluster.address], env=env)
            after = client.run(worker_usage)
        finally:
            client.close()
    finally:
        cluster.close()
    written = fs.du(out)
    fs.rm(out, recursive=True)
    return {"wall": wall, "measured": time.strftime("%Y-%m-%d %H:%M"), "coordinator_rss": rss, "coordinator_cpu": cpu,
            "worker_rss": sorted(rss for rss, _ in after.values()),
            "worker_rss_before": max(rss for rss, _ in before.values()),
            "worker_cpu": sum(after[w][1] - before[w][1] for w in after),
            "written": written, "load": os.getloadavg()[0]}


def converted_bytes(model: Llama, what: str) -> int:
    """What a run converts: the fp32 masters (consolidate), or masters and both Adam moments (reshard)."""
    return model.numel * 4 * (1 if what == "consolidate" else 3)


def throughput(model: Llama, workers: list[int], whats: list[str], write: bool) -> None:
    results = RESULTS_JSON.with_name(f"results-throughput-{model.name}.json")
    saved = json.loads(results.read_text()) if results.exists() else {}
    with s3_server(DATA / "s3rver") as env:
        src, size = upload(model, env)
        print(f"{src}: {size / 1e9:.1f} GB", flush=True)
        costs = store_costs(model, env, [1, 2, 4], min(1 << 30, model.piece_numel(0) * 4))
        print(f"store: small GET {costs['small_get_ms']:.1f} ms; ceiling "
              + ", ".join(f"{k} readers {v / 1e6:.0f} MB/s" for k, v in costs["ceiling"].items()), flush=True)
        runs, replaced = saved.get("runs", {}), saved.get("replaced", {})
        for what in whats:
            for n in workers:
                r = run_through(model, what, src, n, env, DATA / "cluster")
                earlier = runs.get(f"{what}/{n}")
                if earlier:  # an earlier figure of the same run stays on record
                    replaced[f"{what}/{n}"] = {k: earlier[k] for k in ("wall", "measured") if k in earlier}
                runs[f"{what}/{n}"] = r
                print(f"{what} through {n} workers: {r['wall']:.1f} s, "
                      f"{converted_bytes(model, what) / r['wall'] / 1e6:.0f} MB/s, workers up to "
                      f"{max(r['worker_rss']) / 2**20:.0f} MiB, coordinator {r['coordinator_rss'] / 2**20:.0f} MiB",
                      flush=True)
    costs["measured"] = time.strftime("%Y-%m-%d %H:%M")
    stores = [*saved.get("stores", []), costs]  # one per invocation: the store's figures move with the load
    results.write_text(json.dumps({"source_bytes": size, "stores": stores, "runs": runs, "replaced": replaced,
                                   "started": saved.get("started", costs["measured"])}, indent=1) + "\n")
    print("\n".join(throughput_report(model, results)))
    if write:
        write_section(SECTION_THROUGHPUT, throughput_report(model, results))


def throughput_report(model: Llama, results: Path) -> list[str]:
    saved = json.loads(results.read_text())
    stores, runs = saved["stores"], saved["runs"]
    lines = [SECTION_THROUGHPUT, "",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores, "
             f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB RAM; the S3 server, the "
             f"coordinator and every worker share its cores. Run {saved['started']}. Command: "
             "`.venv/bin/python -m benchmarks.scale throughput --write-results` (see "
             "`benchmarks/scale_cluster.py`).", "",
             f"Checkpoint: `{model.name}`, ZeRO-3 bf16, {model.world_size} ranks, {model.numel / 1e9:.2f}B parameters, "
             f"{saved['source_bytes'] / 1e9:.1f} GB in s3rver (objects as files on this disk). The store alone, "
             "measured at the start of each invocation: " + "; ".join(
                 f"{store['measured']}: {store['small_get_ms']:.1f} ms per small range GET, 32 MiB range GETs one at "
                 "a time per reader " + ", ".join(f"{k} reader{'s' * (int(k) > 1)} {v / 1e6:,.0f} MB/s"
                                                  for k, v in store["ceiling"].items()) for store in stores) + ".", "",
             "| run | workers | wall | converted | MB/s | per-worker peak RSS | coordinator peak RSS / CPU | load "
             "| measured |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for key, r in runs.items():
        what, n = key.split("/")
        done = converted_bytes(model, what)
        label = ("consolidate (bf16, 100 MB shards, verify)" if what == "consolidate"
                 else f"reshard {model.world_size} -> {RESHARD_TO}")
        lines.append(f"| {label} | {n} | {r['wall']:.1f} s | {done / 1e9:.1f} GB | {done / r['wall'] / 1e6:,.0f} | "
                     f"{min(r['worker_rss']) / 2**20:,.0f}-{max(r['worker_rss']) / 2**20:,.0f} MiB | "
                     f"{r['coordinator_rss'] / 2**20:,.0f} MiB / {r['coordinator_cpu']:.1f} s | {r['load']:.1f} | "
                     f"{r.get('measured', '')} |")
    earlier = saved.get("replaced", {})
    lines += ["", "**Reading.**"]
    if earlier:
        lines.append("- Run again later (the newer figure is in the table): " + "; ".join(
            f"{k.replace('/', ' through ')} worker(s) {v['wall']:.1f} s at {v['measured']}" for k, v in earlier.items())
            + ".")
    for what in ("consolidate", "reshard"):
        ns = sorted(int(k.split("/")[1]) for k in runs if k.startswith(what + "/"))
        if not ns:
            continue
        first, best = runs[f"{what}/{ns[0]}"], min((runs[f"{what}/{n}"] for n in ns), key=lambda r: r["wall"])
        base = min([first["wall"]] + [v["wall"] for k, v in earlier.items() if k == f"{what}/{ns[0]}"])
        traffic = store_traffic(what, converted_bytes(model, what), first["written"])
        lines.append(f"- {what}: {ns[0]} -> {max(ns)} workers, best wall {best['wall']:.1f} s against the best "
                     f"{ns[0]}-worker wall {base:.1f} s ({base / best['wall']:.2f}x); the store served about "
                     f"{traffic / 1e9:.0f} GB per run (see `store_traffic`), {traffic / best['wall'] / 1e6:,.0f} MB/s "
                     f"at the best wall; a worker's own CPU: {first.get('worker_cpu', float('nan')):.0f} s for "
                     f"{converted_bytes(model, what) / 1e9:.1f} GB with one worker; per-worker peak RSS "
                     f"{min(min(r['worker_rss']) for k, r in runs.items() if k.startswith(what)) / 2**20:,.0f}-"
                     f"{max(max(r['worker_rss']) for k, r in runs.items() if k.startswith(what)) / 2**20:,.0f} MiB "
                     f"(about {first.get('worker_rss_before', 0) / 2**20:,.0f} MiB of it before the run: Python, "
                     "Dask, ckptflow)" + (", the same whatever the unit (a 525 MB embedding shard or a 100 MB one)."
                                         if what == "consolidate" else "."))
    lines += ["- Two cores hold the S3 server, the coordinator and every worker, so more than two workers only "
              "share them: the table shows what spreading the units over processes costs here and the memory "
              "per worker, not a cluster's scaling (that the outputs are byte-identical whatever the workers is "
              "tests/test_scale_out.py's to check, not this benchmark's). The model below takes a worker's rate "
              "from its own CPU time instead."]
    return lines + [""]


# ---- part 3: a model for the real thing ------------------------------------------------------------

# What the prediction assumes beyond what was measured here.
ASSUMPTIONS = {
    "latency_ms": 30.0,  # first byte of a range GET from a cloud bucket in the same region (here: loopback)
    "batch_bytes": 32 << 20,  # a unit reads in rounds of 32 MiB of concurrent range GETs, one latency each
    "index_threads": 16,  # load_index opens 16 rank files at once
    "store_gbps": (5.0, 20.0),  # aggregate bandwidth of the bucket (every byte read, written or copied), GB/s
    "copy_mbps": 100.0,  # one server-side copy (S3 CopyObject); the commit runs 32 at once (staging.COPIES)
    "workers": (4, 16, 64),
    "fixed_seconds": 10.0,  # CLI start, cluster connect (the tiny checkpoint's whole run here: 7-14 s)
}
COMMIT_COPIES = 32
# DeepSpeed's zero_to_fp32 on one machine (DeepSpeed PR #6658): wall seconds and peak RAM.
DEEPSPEED = {"70b": (20 * 60 + 45, "159 GB"), "405b": (2 * 3600 + 10 * 60, "262 GB")}


def store_traffic(what: str, read: int, written: int) -> int:
    """Bytes the bucket serves for one run: consolidate (with its default verify) reads the source
    twice (once to write, once to check) and the output once, writes the output, and copies it into
    place (a read and a write inside the store); reshard reads the source, writes and copies the output."""
    return 2 * read + 4 * written if what == "consolidate" else read + 3 * written


def _plan_figures(name: str) -> dict[str, Any]:
    path = DATA / f"results-{MODELS[name].name}-ws{MODELS[name].world_size}.json"
    return json.loads(path.read_text())["results"]


def predict(what: str, rate: float, units: int, read: int, written: int, plan_s: float, index_requests: int,
            workers: int, store_bps: float) -> float:
    """Wall seconds: planning (headers from the bucket at `latency_ms` per request over the index
    threads); then ceil(units / workers) rounds of one unit per worker, each unit at the measured
    per-worker `rate` slowed by one latency per read batch, or the store's aggregate bandwidth for the
    run's traffic, whichever is slower; then the commit's server-side copies, 32 at a time; plus the
    fixed costs. The measured rate already holds this machine's commit copies and verify reads, so a
    worker here is counted at most once slower, never faster."""
    a = ASSUMPTIONS
    latency = a["latency_ms"] / 1000
    planning = plan_s + index_requests * latency / a["index_threads"]
    per_worker = 1 / (1 / rate + latency / a["batch_bytes"])
    compute = -(-units // workers) * (read / units) / per_worker
    store = store_traffic(what, read, written) / store_bps
    commit = written / min(store_bps, COMMIT_COPIES * a["copy_mbps"] * 1e6)
    return planning + max(compute, store) + commit + a["fixed_seconds"]


def _clock(seconds: float) -> str:
    seconds = round(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def model(write: bool) -> None:
    print("\n".join(model_report()))
    if write:
        write_section(SECTION_MODEL, model_report())


def model_report() -> list[str]:
    small = MODELS["1b"]
    measured = json.loads(RESULTS_JSON.with_name(f"results-throughput-{small.name}.json").read_text())
    runs, a = measured["runs"], ASSUMPTIONS
    whats = ("consolidate", "reshard")
    # Per worker: its bytes over its own CPU seconds (a worker with a core of its own, doing what it did
    # here), and over the run's wall time here (sharing 2 cores with the S3 server and the coordinator).
    core = {w: converted_bytes(small, w) / runs[f"{w}/1"]["worker_cpu"] for w in whats}
    wall = {w: converted_bytes(small, w) / runs[f"{w}/1"]["wall"] for w in whats}
    worker_rss = max(max(r["worker_rss"]) for r in runs.values())
    low, high = a["store_gbps"][0], a["store_gbps"][-1]
    mbs = lambda rates: ", ".join(f"{w} {rates[w] / 1e6:,.0f} MB/s" for w in whats)  # noqa: E731
    lines = [SECTION_MODEL, "",
             "`.venv/bin/python -m benchmarks.scale model --write-results`: predicted wall time of `ckptflow "
             "consolidate --dtype bf16 --cluster` and `ckptflow reshard --cluster` (to 3/4 of the ranks) for the "
             "checkpoints of the planning benchmark, read from and written to a bucket, on W worker processes of one "
             "unit at a time each. Measured here: a worker's rate from the 1-worker runs of the throughput table "
             f"(bytes converted over the worker's own CPU seconds, for a worker with a core of its own: {mbs(core)}; "
             f"over the run's wall time on this machine, start-up included and 2 cores shared with the S3 server: "
             f"{mbs(wall)}), each plan's units and bytes, and its index + plan time and range reads (planning "
             f"table). Assumed: {a['latency_ms']:.0f} ms per range GET (here "
             f"{measured['stores'][-1]['small_get_ms']:.1f} ms on loopback), one such wait per "
             f"{a['batch_bytes'] >> 20} MiB read batch and none overlapped, the index's reads {a['index_threads']} at "
             f"a time, a store of {low:g} or {high:g} GB/s aggregate for every byte read, written or copied "
             "(consolidate with its default verify: twice the source and four times the output; reshard: the source "
             f"and three times the output), the commit's server-side copies at {a['copy_mbps']:.0f} MB/s each, "
             f"{COMMIT_COPIES} at once (S3's CopyObject; on GCS a copy within one location and storage class moves no "
             "data, so these rows are pessimistic for GCS), workers whose network is not the limit, "
             f"{a['fixed_seconds']:.0f} s of fixed costs. A unit is not split: with more workers than units the extra "
             "workers idle.", "",
             f"| model | step | units | read | written | workers | {low:g} GB/s store | {high:g} GB/s store | "
             f"{high:g} GB/s, this machine's rate | DeepSpeed zero_to_fp32, one machine |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name in ("70b", "405b"):
        plan = _plan_figures(name)
        index_requests = plan.get("index-bucket", {}).get("bucket", {}).get("range_requests",
                                                                            plan["index"]["index_read_calls"])
        steps = {"consolidate": (plan["consolidate"]["units"], plan["consolidate"]["source_bytes"],
                                 plan["consolidate"]["output_bytes"],
                                 plan["consolidate"]["index_seconds"] + plan["consolidate"]["plan_seconds"]),
                 "reshard": (plan["reshard"]["units"], plan["reshard"]["read_bytes"], plan["reshard"]["write_bytes"],
                             plan["reshard"]["index_seconds"] + plan["reshard"]["plan_seconds"])}
        for what, (units, read, written, plan_s) in steps.items():
            for w in a["workers"]:
                times = [predict(what, rate[what], units, read, written, plan_s, index_requests, w, g * 1e9)
                         for rate, g in ((core, low), (core, high), (wall, high))]
                ds = DEEPSPEED[name]
                deepspeed = f"{_clock(ds[0])}, {ds[1]} RAM" if what == "consolidate" and w == a["workers"][0] else ""
                lines.append(f"| {MODELS[name].name} | {what} | {units} | {read / 1e9:,.0f} GB | "
                             f"{written / 1e9:,.0f} GB | {w} | " + " | ".join(_clock(t) for t in times)
                             + f" | {deepspeed} |")
    lines += ["", f"Memory: every worker peaked at {worker_rss / 2**20:,.0f} MiB or less in the throughput runs, "
              "whatever its unit; the coordinator's is the planning table's (405B: 533 MiB with the reshard plan), "
              f"against DeepSpeed's {DEEPSPEED['70b'][1]} (70B) and {DEEPSPEED['405b'][1]} (405B) on one machine.", ""]
    return lines


def main_read(argv: list[str]) -> None:
    _read(argv[0], int(argv[1]))


if __name__ == "__main__":
    if sys.argv[1:2] == ["_read"]:
        main_read(sys.argv[2:])
