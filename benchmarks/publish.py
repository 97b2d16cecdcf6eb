"""Publish benchmark: `ckptflow push` of a ~1 GB model folder to the GCS emulator versus a plain
`fs.put` of the same folder, without faults and through a proxy that fails 20% of requests.

    .venv/bin/python benchmarks/publish.py [--size-gb 1] [--repeat 2] [--fault-rate 0.2]

The emulator (gcp-storage-emulator, in memory) and the fault proxy (tests/servers/faultproxy.py) each run in
their own process, so that neither shares the interpreter lock with the client being timed. Both
clients talk to the same emulator; each run writes a fresh prefix, which is checked byte for byte
against the source (sha256 of every object read back) and deleted outside the timed part.
Not a test: it prints times and ratios; record them in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

BUCKET = "bench"
# Helper processes; each exits when the benchmark does, however it ends.
EMULATOR = """
import os, sys, time
from gcp_storage_emulator.server import create_server
data_dir = sys.argv[3] or None
server = create_server("127.0.0.1", int(sys.argv[1]), in_memory=data_dir is None, default_bucket=sys.argv[2],
                       data_dir=data_dir)
server.start()
print("ready", flush=True)
parent = os.getppid()
while os.getppid() == parent:
    time.sleep(1)
os._exit(0)  # the server threads are not daemons
"""
PROXY = """
import os, sys, time
sys.path.insert(0, sys.argv[3])
from tests.servers.faultproxy import FaultProxy
proxy = FaultProxy(int(sys.argv[1])).start()
proxy.configure(rate=float(sys.argv[2]), seed=int(sys.argv[4]))
print(proxy.url, flush=True)
parent = os.getppid()
while os.getppid() == parent:
    time.sleep(1)
os._exit(0)  # the server threads are not daemons
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(code: str, *args: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    line = proc.stdout.readline().strip()
    if not line:
        raise RuntimeError(f"helper process failed to start: {code.splitlines()[1]}")
    return proc, line


def make_model(folder: Path, size_gb: float, shards: int) -> dict[str, str]:
    """A model-shaped folder: `shards` safetensors-sized blobs of random bytes plus small JSON files.
    Returns sha256 by relative path. Kept between runs."""
    folder.mkdir(parents=True, exist_ok=True)
    shard_size = int(size_gb * 1e9 / shards)
    names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    small = {
        "config.json": json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 4096}).encode(),
        "generation_config.json": b'{"do_sample": false}',
        "model.safetensors.index.json": json.dumps({"weight_map": {f"w{i}": n for i, n in enumerate(names)}}).encode(),
    }
    for name, data in small.items():
        (folder / name).write_bytes(data)
    for name in names:
        path = folder / name
        if not path.exists() or path.stat().st_size != shard_size:
            with open(path, "wb") as out:
                left = shard_size
                while left:
                    n = min(left, 64 * 2**20)
                    out.write(os.urandom(n))
                    left -= n
    digests = {}
    for path in sorted(folder.iterdir()):
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(16 * 2**20):
                h.update(chunk)
        digests[path.name] = h.hexdigest()
    return digests


def check_and_delete(fs, prefix: str, expected: dict[str, str]) -> bool:
    """True when every object under `prefix` (manifest aside) matches the source; then deletes them."""
    fs.invalidate_cache()
    found = {}
    for path in fs.find(prefix):
        rel = path[len(prefix) + 1:]
        if rel.startswith("ckptflow-manifest.json"):
            continue
        h = hashlib.sha256()
        with fs.open(path, "rb", block_size=32 * 2**20) as f:
            while chunk := f.read(32 * 2**20):
                h.update(chunk)
        found[rel] = h.hexdigest()
    fs.rm(prefix, recursive=True)
    return found == expected


def run(label: str, fn) -> tuple[float, str | None]:
    started = time.perf_counter()
    try:
        fn()
    except Exception as exc:  # a plain put may give up under faults: report it
        return time.perf_counter() - started, f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    return time.perf_counter() - started, None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--fault-rate", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=1, help="Seed of the proxy's fault draws.")
    parser.add_argument("--modes", default="clean,faults", help="Which runs: clean, faults or both (comma-separated).")
    parser.add_argument("--data", default=str(REPO / "benchmarks" / ".data" / "publish-model"))
    parser.add_argument("--emulator-dir", default="", help="Keep the emulator's objects in this folder, not in memory.")
    args = parser.parse_args()

    folder = Path(args.data)
    print(f"building / checking {args.size_gb} GB model folder at {folder} ...", flush=True)
    expected = make_model(folder, args.size_gb, args.shards)
    total = sum(p.stat().st_size for p in folder.iterdir())

    port = free_port()
    emulator_dir = str(Path(args.emulator_dir).resolve()) if args.emulator_dir else ""
    if emulator_dir:
        shutil.rmtree(emulator_dir, ignore_errors=True)
        Path(emulator_dir).mkdir(parents=True)
    emulator, _ = start(EMULATOR, str(port), BUCKET, emulator_dir)
    proxy, proxy_url = start(PROXY, str(port), str(args.fault_rate), str(REPO), str(args.seed))
    try:
        os.environ.update({"FSSPEC_GCS_TOKEN": "anon", "FSSPEC_GCS_PROJECT": "bench"})
        import fsspec.config

        fsspec.config.set_conf_env(fsspec.config.conf)
        from ckptflow.publish import push

        fs = fsspec.filesystem("gs")
        results: dict[str, list[float]] = {}
        failures: dict[str, list[str]] = {}
        modes = {m.strip() for m in args.modes.split(",")}
        for faults in [f for f in (False, True) if ("faults" if f else "clean") in modes]:
            os.environ["STORAGE_EMULATOR_HOST"] = proxy_url if faults else f"http://127.0.0.1:{port}"
            for i in range(args.repeat):
                for method in ("put", "ckptflow"):
                    key = f"{method}{' + faults' if faults else ''}"
                    prefix = f"{BUCKET}/{method}-{'faults' if faults else 'clean'}-{i}"
                    if method == "put":
                        seconds, error = run(key, lambda: fs.put(f"{folder}/", f"{prefix}/", recursive=True))
                    else:
                        seconds, error = run(key, lambda: push(str(folder), f"gs://{prefix}", workers=args.workers))
                    identical = check_and_delete(fs, prefix, expected) if error is None else False
                    status = "identical bytes" if identical else (error or "BYTES DIFFER")
                    print(f"{key:18s} run {i + 1}: {seconds:6.2f} s  {total / seconds / 1e6:7.1f} MB/s  {status}",
                          flush=True)
                    if identical:
                        results.setdefault(key, []).append(seconds)
                    else:
                        failures.setdefault(key, []).append(status)

        print()
        print(f"{total / 1e9:.2f} GB in {len(expected)} files, {args.workers} workers, fault rate "
              f"{args.fault_rate:.0%}, load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
        for key in ("put", "ckptflow", "put + faults", "ckptflow + faults"):
            times = results.get(key, [])
            line = (f"  {key:18s} best {min(times):6.2f} s, median {statistics.median(times):6.2f} s" if times
                    else f"  {key:18s} no complete run")
            if failures.get(key):
                line += f"  ({len(failures[key])} failed: {failures[key][0]})"
            print(line)
        for suffix in ("", " + faults"):
            a, b = results.get(f"ckptflow{suffix}"), results.get(f"put{suffix}")
            if a and b:
                print(f"  ratio ckptflow / put{suffix}: {min(a) / min(b):.2f}x (best), "
                      f"{statistics.median(a) / statistics.median(b):.2f}x (median)")
    finally:
        for proc in (proxy, emulator):
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    main()
