"""GPU check and timing: fp16 checkpoints written by DeepSpeed on a real GPU, then validated, consolidated
and resharded across ZeRO stages by ckptflow, and loaded back by DeepSpeed on the GPU.

DeepSpeed refuses fp16 on CPU, so the test suite writes its fp16 fixtures with that gate lifted
(`tests/oracles/reshard.py`); this script is the run on the hardware the format is made for. On one GPU
(NCCL, world size 1), for a small Llama with tied embeddings:

- DeepSpeed trains ZeRO-1, 2 and 3 engines in fp16 (dynamic loss scaler moving within the run, torch
  Adam) and saves each; `ckptflow validate` reads them;
- `ckptflow consolidate --dtype fp32` equals the engine's fp32 masters bit for bit, `--dtype fp16`
  equals them cast as torch casts, and transformers loads the fp16 folder on the GPU with logits equal
  to the engine's own forward pass (`--config` gives the config.json that `save_checkpoint` leaves out);
- `ckptflow reshard --world-size 1 --zero-stage T` for every pair of stages: a fresh DeepSpeed engine at
  T loads the output natively (no universal flag) and holds the saving engine's fp32 masters, both Adam
  moments, the optimizer step and the loss scale bit for bit; one more step on each gives the same loss;
- timing, on a bigger model (`--big-layers`, about 1B parameters at 16): `ckptflow consolidate --dtype
  fp16` against DeepSpeed's `zero_to_fp32` with `dtype='float16'` (the library call behind
  `zero_to_fp32.py`, safetensors out) on the same ZeRO-2 fp16 checkpoint, wall time and peak RSS of each
  process, best of two, and `ckptflow reshard` 2 -> 3.

    python -m benchmarks.gpu --out DIR [--big-layers 16] [--skip-big]

Exits 1 at the first mismatch; prints one line per check. `--cpu` runs the same checks on CPU with gloo
and DeepSpeed's fp16 gate lifted (to test this script without a GPU; it proves nothing about GPUs).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
SMALL = {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 8,
         "num_key_value_heads": 4, "vocab_size": 1024, "tie_word_embeddings": True}
SEQ = 64
FP16 = {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 2, "hysteresis": 1}


def say(line: str) -> None:
    print(line, flush=True)


def fail(line: str) -> None:
    say(f"FAIL {line}")
    sys.exit(1)


def child_env() -> dict[str, str]:
    """This environment, with the checkout first on the import path of a child process."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}


def ckptflow(*args: str) -> subprocess.CompletedProcess[str]:
    """The CLI in a subprocess, as a user runs it; its last lines printed."""
    command = [sys.executable, "-c", "from ckptflow.cli import main; main()", *args]
    done = subprocess.run(command, capture_output=True, text=True, env=child_env())
    if done.returncode:
        fail(f"ckptflow {' '.join(args)}: rc {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return done


# A small process that starts the timed one and reports its wall time and peak RSS. The timed process is
# forked from it, not from this one: Linux counts the RSS a process had before its exec in its peak, and
# this process holds torch, DeepSpeed and the models.
LAUNCHER = """
import json, os, subprocess, sys, time
started = time.monotonic()
process = subprocess.Popen(json.loads(sys.argv[1]), stdout=subprocess.DEVNULL)
_, status, usage = os.wait4(process.pid, 0)
print(json.dumps([time.monotonic() - started, usage.ru_maxrss * 1024, status]))
"""


def timed(command: list[str]) -> tuple[float, int]:
    """Wall seconds and peak RSS (bytes) of one process."""
    done = subprocess.run([sys.executable, "-c", LAUNCHER, json.dumps(command)], capture_output=True, text=True,
                          env=child_env())
    if done.returncode:
        fail(f"{command[:4]}: the launcher failed: {done.stderr[-2000:]}")
    seconds, rss, status = json.loads(done.stdout.strip().splitlines()[-1])
    if status:
        fail(f"{' '.join(command[:6])} exited with status {status}: {done.stderr[-2000:]}")
    return seconds, rss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="a scratch folder (emptied)")
    parser.add_argument("--cpu", action="store_true", help="gloo on CPU with DeepSpeed's fp16 gate lifted")
    parser.add_argument("--big-layers", type=int, default=16)
    parser.add_argument("--big-hidden", type=int, default=2048, help="hidden size of the timed model")
    parser.add_argument("--repeat", type=int, default=2, help="timed runs of each command (the best is kept)")
    parser.add_argument("--skip-big", action="store_true", help="the checks only")
    parser.add_argument("--skip-small", action="store_true", help="the timing only")
    parser.add_argument("--profile", action="store_true",
                        help="after writing the big checkpoint, break the consolidate time down (the disk, the casts, "
                             "direct I/O and fsync on and off) instead of the timing table")
    parser.add_argument("--lightning", action="store_true",
                        help="also write a checkpoint with Lightning's DeepSpeed strategy on the GPU and run ckptflow on it")
    args = parser.parse_args()
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29517", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                      LOCAL_WORLD_SIZE="1")
    if args.cpu:
        os.environ["DS_ACCELERATOR"] = "cpu"
    else:
        os.environ.pop("DS_ACCELERATOR", None)

    import deepspeed
    import torch

    if args.cpu:
        from deepspeed.accelerator import get_accelerator

        type(get_accelerator()).is_fp16_supported = lambda self: True  # see tests/oracles/reshard.py
    elif not torch.cuda.is_available():
        fail("no CUDA device (use --cpu to test the script itself)")
    device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    deepspeed.init_distributed("gloo" if args.cpu else "nccl")
    say(f"device {torch.cuda.get_device_name(0) if not args.cpu else 'cpu'}; torch {torch.__version__}; "
        f"deepspeed {deepspeed.__version__}")

    from transformers import LlamaConfig

    config = LlamaConfig(**SMALL)
    config_dir = out / "config"
    config.save_pretrained(config_dir)

    if not args.skip_small:
        small(out, config, config_dir, device)
    if args.lightning:
        lightning(out, config_dir)
    if not args.skip_big:
        big(out, args.big_layers, args.big_hidden, device, args.repeat, args.profile)
    say("all GPU checks passed")


def small(out: Path, config: Any, config_dir: Path, device: Any) -> None:
    """The checks: fp16 at every ZeRO stage through validate, consolidate and reshard."""
    sources = {stage: out / f"z{stage}" for stage in (1, 2, 3)}
    held: dict[int, dict[str, Any]] = {}
    for stage, path in sources.items():
        engine = train(config, stage, device, steps=6)
        engine.save_checkpoint(str(path), tag="step6")
        held[stage] = snapshot(engine)
        held[stage]["logits"] = logits(engine, config, device)
        held[stage]["next_loss"] = step_loss(engine, device, 99)
        say(f"wrote ZeRO-{stage} fp16: loss scale {held[stage]['scale']}, steps {held[stage]['steps']}")
        release(engine)

    for stage, path in sources.items():
        listing = ckptflow("validate", str(path)).stdout.strip().splitlines()
        say(f"ok validate ZeRO-{stage}: {listing[-1] if listing else ''}")
        check_consolidated(path, out / f"hf-z{stage}", config_dir, held[stage], device)
        say(f"ok consolidate ZeRO-{stage}: fp32 = masters, fp16 = masters cast, transformers logits = engine's")

    for source in (1, 2, 3):
        for target in (1, 2, 3):
            if source == target:
                continue
            resharded = out / f"z{source}-to-z{target}"
            ckptflow("reshard", str(sources[source]), str(resharded), "--world-size", "1", "--zero-stage",
                     str(target))
            engine = train(config, target, device, steps=0)
            engine.load_checkpoint(str(resharded))
            got = snapshot(engine)
            compare(f"ZeRO-{source} -> ZeRO-{target}", held[source], got)
            loss = step_loss(engine, device, 99)
            if abs(loss - held[source]["next_loss"]) > 1e-3 * abs(held[source]["next_loss"]):
                fail(f"ZeRO-{source} -> {target}: next loss {loss} vs {held[source]['next_loss']}")
            say(f"ok reshard ZeRO-{source} -> ZeRO-{target}: DeepSpeed loads it natively; masters, moments, step "
                f"and loss scale bit-equal; next loss {loss:.6f} vs {held[source]['next_loss']:.6f}")
            release(engine)
            shutil.rmtree(resharded)


def train(config: Any, stage: int, device: Any, steps: int) -> Any:
    import deepspeed
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
          "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}},
          "fp16": dict(FP16), "zero_optimization": {"stage": stage}}
    if stage == 3:
        ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    for step in range(steps):
        step_loss(engine, device, step)
    return engine


def batch(config_vocab: int, step: int, device: Any) -> Any:
    import torch

    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, config_vocab, (2, SEQ), generator=generator).to(device)


def step_loss(engine: Any, device: Any, step: int) -> float:
    ids = batch(engine.module.config.vocab_size, step, device)
    engine.train()
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    return float(loss)


def logits(engine: Any, config: Any, device: Any) -> Any:
    import torch

    engine.eval()
    with torch.no_grad():
        return engine(input_ids=batch(config.vocab_size, 7, device)).logits.float().cpu()


def snapshot(engine: Any) -> dict[str, Any]:
    """Per parameter: fp32 master and both Adam moments (full tensors, on CPU); optimizer steps; loss scale."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    # ZeRO-1/2 link the parameters to their optimizer state at the first step; a freshly loaded engine
    # has taken none (DeepSpeed's own universal-checkpoint save calls the same method).
    getattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state", lambda: None)()
    params = {}
    for name, param in engine.module.named_parameters():
        params[name] = tuple(t.detach().cpu().clone() for t in (
            safe_get_full_fp32_param(param), safe_get_full_optimizer_state(param, "exp_avg"),
            safe_get_full_optimizer_state(param, "exp_avg_sq")))
    base = engine.optimizer.optimizer
    steps = sorted({int(state["step"]) for state in base.state.values() if "step" in state})
    return {"params": params, "steps": steps, "scale": float(engine.optimizer.loss_scaler.cur_scale),
            "global_steps": engine.global_steps}


def compare(label: str, want: dict[str, Any], got: dict[str, Any]) -> None:
    import torch

    if want["params"].keys() != got["params"].keys():
        fail(f"{label}: parameters differ: {sorted(want['params'].keys() ^ got['params'].keys())[:4]}")
    for name, tensors in want["params"].items():
        for kind, a, b in zip(("fp32 master", "exp_avg", "exp_avg_sq"), tensors, got["params"][name]):
            if a.shape != b.shape or not torch.equal(a, b):
                fail(f"{label}: {kind} of {name} differs")
    for key in ("steps", "scale", "global_steps"):
        if want[key] != got[key]:
            fail(f"{label}: {key} {got[key]} != {want[key]}")


def check_consolidated(path: Path, hf: Path, config_dir: Path, held: dict[str, Any], device: Any) -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    for dtype in ("fp32", "fp16"):
        folder = hf.with_name(f"{hf.name}-{dtype}")
        ckptflow("consolidate", str(path), str(folder), "--dtype", dtype, "--config", str(config_dir))
        tensors: dict[str, Any] = {}
        for shard in folder.glob("*.safetensors"):
            tensors.update(load_file(shard))
        for name, (master, _, _) in held["params"].items():
            want = master if dtype == "fp32" else master.to(torch.float16)
            if name not in tensors or not torch.equal(tensors[name], want):
                fail(f"consolidate {path.name} --dtype {dtype}: {name} is not the engine's master"
                     f"{'' if dtype == 'fp32' else ' cast to fp16'}")
        if dtype == "fp16":
            model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float16).to(device).eval()
            with torch.no_grad():
                ids = batch(model.config.vocab_size, 7, device)
                got = model(input_ids=ids).logits.float().cpu()
            diff = float((got - held["logits"]).abs().max())
            if diff > 1e-2:
                fail(f"consolidate {path.name} fp16: logits differ from the engine's by {diff}")
            say(f"   transformers on {device}: logits max difference from the engine's forward {diff:.2e}")
            del model
        shutil.rmtree(folder)


# Lightning's DeepSpeed strategy sets up its own process group, so it trains in a process of its own.
LIGHTNING = """
import sys, torch
try:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DeepSpeedStrategy
except ImportError:
    import pytorch_lightning as pl
    from pytorch_lightning.strategies import DeepSpeedStrategy
from transformers import LlamaConfig, LlamaForCausalLM

class Module(pl.LightningModule):
    def __init__(self, lr=1e-3):
        super().__init__()
        self.save_hyperparameters()
        self.model = LlamaForCausalLM(LlamaConfig.from_pretrained(sys.argv[2]))
    def training_step(self, batch, index):
        return self.model(input_ids=batch[0], labels=batch[0]).loss
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)

torch.manual_seed(0)
data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randint(0, 1024, (16, 64))), batch_size=2)
trainer = pl.Trainer(accelerator="gpu", devices=1, strategy=DeepSpeedStrategy(stage=int(sys.argv[3])),
                     precision="16-mixed", max_steps=4, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False)
trainer.fit(Module(), data)
trainer.save_checkpoint(sys.argv[1])
print("lightning", pl.__version__)
"""


def lightning(out: Path, config_dir: Path) -> None:
    """A real Lightning DeepSpeed-strategy checkpoint (fp16, ZeRO-2 and 3) through validate, consolidate and
    reshard; what it holds and what ckptflow says are written to lightning-*.txt beside the checkpoint."""
    for stage in (2, 3):
        path = out / f"lightning-z{stage}.ckpt"
        env = {key: value for key, value in os.environ.items()
               if key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")}
        env["MASTER_PORT"] = str(29541 + stage)  # this process holds 29517
        done = subprocess.run([sys.executable, "-c", LIGHTNING, str(path), str(config_dir), str(stage)],
                              capture_output=True, text=True, env=env)
        report = [f"$ lightning write (stage {stage}): rc {done.returncode}", done.stdout[-3000:], done.stderr[-3000:]]
        if done.returncode == 0:
            report.append("$ find")
            report += sorted(str(f.relative_to(path)) + f"  {f.stat().st_size}" for f in path.rglob("*") if f.is_file())
            for args in (("validate", str(path)),
                         ("consolidate", str(path), str(out / f"lightning-z{stage}-hf"), "--config", str(config_dir)),
                         ("reshard", str(path), str(out / f"lightning-z{stage}-ws2"), "--world-size", "2")):
                command = [sys.executable, "-c", "from ckptflow.cli import main; main()", *args]
                run = subprocess.run(command, capture_output=True, text=True,
                                     env=child_env())
                report += [f"$ ckptflow {' '.join(args)}: rc {run.returncode}", run.stdout[-4000:], run.stderr[-2000:]]
                say(f"{'ok' if run.returncode == 0 else 'NOT OK'} lightning ZeRO-{stage}: ckptflow {args[0]} rc {run.returncode}")
        else:
            say(f"NOT OK lightning ZeRO-{stage}: the Lightning run failed (see lightning-z{stage}.txt)")
        (out / f"lightning-z{stage}.txt").write_text("\n".join(report))


def big(out: Path, layers: int, hidden: int, device: Any, repeat: int, profile: bool = False) -> None:
    """Timing on a ~1B model: ckptflow consolidate vs DeepSpeed's zero_to_fp32, and ckptflow reshard 2 -> 3
    (with `profile`: `profile_consolidate` instead)."""
    import torch
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 43 // 16, num_hidden_layers=layers,
                         num_attention_heads=16, num_key_value_heads=16, vocab_size=32000, tie_word_embeddings=False)
    source = out / "big-z2"
    engine = train(config, 2, device, steps=2)
    params = sum(p.numel() for p in engine.module.parameters())
    engine.save_checkpoint(str(source), tag="step2")
    release(engine)
    torch.cuda.empty_cache() if device.type == "cuda" else None
    size = sum(f.stat().st_size for f in source.rglob("*") if f.is_file())
    say(f"big: {params / 1e9:.2f}B parameters, ZeRO-2 fp16 checkpoint {size / 2**30:.1f} GiB")
    config.save_pretrained(out / "big-config")
    if profile:
        profile_consolidate(out, source, repeat)
        return
    rows = []
    for attempt in range(repeat):
        for label, command in (
            ("ckptflow consolidate --dtype fp16", [sys.executable, "-c", "from ckptflow.cli import main; main()",
                                                   "consolidate", str(source), str(out / "big-ours"), "--dtype", "fp16",
                                                   "--config", str(out / "big-config"), "--no-verify"]),
            ("ckptflow consolidate --dtype fp16 --verify (transformers on the GPU)",
             [sys.executable, "-c", "from ckptflow.cli import main; main()", "consolidate", str(source),
              str(out / "big-ours"), "--dtype", "fp16", "--config", str(out / "big-config")]),
            ("ckptflow consolidate --dtype fp32", [sys.executable, "-c", "from ckptflow.cli import main; main()",
                                                   "consolidate", str(source), str(out / "big-ours"), "--dtype", "fp32",
                                                   "--config", str(out / "big-config"), "--no-verify"]),
            ("deepspeed zero_to_fp32", [sys.executable, "-c", "import sys; from deepspeed.utils.zero_to_fp32 import "
                                        "convert_zero_checkpoint_to_state_dict as c; "
                                        "c(sys.argv[1], sys.argv[2], safe_serialization=True)",
                                        str(source), str(out / "big-theirs")]),
            ("deepspeed zero_to_fp32 --dtype float16", [sys.executable, "-c",
                                                        "import sys; from deepspeed.utils.zero_to_fp32 import "
                                                        "convert_zero_checkpoint_to_state_dict as c; "
                                                        "c(sys.argv[1], sys.argv[2], dtype='float16', "
                                                        "safe_serialization=True)", str(source), str(out / "big-theirs")]),
            ("ckptflow reshard ZeRO-2 -> ZeRO-3", [sys.executable, "-c", "from ckptflow.cli import main; main()",
                                                   "reshard", str(source), str(out / "big-z3"), "--world-size", "1",
                                                   "--zero-stage", "3"]),
        ):
            for leftover in ("big-ours", "big-theirs", "big-z3"):
                shutil.rmtree(out / leftover, ignore_errors=True)
            seconds, rss = timed(command)
            rows.append((attempt, label, seconds, rss))
            say(f"   run {attempt + 1}: {label}: {seconds:.1f} s, peak RSS {rss / 2**30:.2f} GiB")
    best = {}
    for _, label, seconds, rss in rows:
        if label not in best or seconds < best[label][0]:
            best[label] = (seconds, rss)
    ours, theirs = best["ckptflow consolidate --dtype fp16"], best["deepspeed zero_to_fp32 --dtype float16"]
    say(f"big: consolidate (no verify) {ours[0]:.1f} s / {ours[1] / 2**30:.2f} GiB vs zero_to_fp32 --dtype float16 {theirs[0]:.1f} s / "
        f"{theirs[1] / 2**30:.2f} GiB: {theirs[0] / ours[0]:.2f}x faster, {theirs[1] / ours[1]:.1f}x less memory; "
        f"fp32: {best['ckptflow consolidate --dtype fp32'][0]:.1f} s vs {best['deepspeed zero_to_fp32'][0]:.1f} s; "
        f"reshard 2 -> 3 {best['ckptflow reshard ZeRO-2 -> ZeRO-3'][0]:.1f} s")
    (out / "big.json").write_text(json.dumps({"params": params, "bytes": size, "rows": rows}))


# The CLI in this process with ckptflow's INFO log on stderr (each shard's "wrote ... in N s"), after one
# of the patches below: the page cache instead of direct I/O, and no fsync at all (what DeepSpeed's
# converter does: its output is in the page cache when it exits).
PATCHED_CLI = """
import logging, os, sys, time
logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(relativeCreated)7.0f ms %(name)s %(message)s")
logging.getLogger("ckptflow").setLevel(logging.INFO)
patch = sys.argv.pop(1)
if patch in ("page-cache", "no-fsync"):
    import ckptflow.plumbing.direct as direct
    direct.O_DIRECT = 0
if patch == "no-fsync":
    import ckptflow.consolidate.write as write
    import ckptflow.plumbing.staging as staging
    os.fsync = lambda fd: None
    write._datasync = lambda fd: None
    staging._fsync_dir = lambda path: None
from ckptflow.cli import main
main()
"""

# Reads, casts and hashes alone, on the source's own bytes in the page cache: what one thread does per second.
PARTS = """
import hashlib, json, os, sys, time
import numpy as np
from ckptflow.formats.casts import cast_into
path = sys.argv[1]
size = min(os.path.getsize(path), 2 << 30) // 4 * 4
buf = np.empty(size, dtype=np.uint8)
fd = os.open(path, os.O_RDONLY)
started = time.monotonic(); os.preadv(fd, [buf], 0); read = time.monotonic() - started
out = np.empty(size // 2, dtype=np.uint8)
started = time.monotonic(); cast_into(out, "float16", buf, "float32"); cast = time.monotonic() - started
started = time.monotonic(); hashlib.sha256(out).hexdigest(); sha = time.monotonic() - started
print(json.dumps({"bytes": size, "pread GB/s": size / read / 1e9, "cast fp32->fp16 GB/s (source)": size / cast / 1e9,
                  "sha256 GB/s": size / 2 / sha / 1e9}))
"""

# What `--config`'s check costs, part by part: torch's import, transformers', its modeling code's, and
# the model built on the meta device and compared (`consolidate.architecture.check_config`).
CHECK_PARTS = """
import json, sys, time
marks = [time.monotonic()]
import torch; marks.append(time.monotonic())
import transformers; marks.append(time.monotonic())
import transformers.modeling_utils; marks.append(time.monotonic())
from ckptflow.consolidate.architecture import _build, parse_config
config = parse_config(open(sys.argv[1], "rb").read(), "config.json")
model = _build(config, "config.json"); marks.append(time.monotonic())
steps = ["import torch", "import transformers", "transformers.modeling_utils", "model on meta"]
print(json.dumps({k: round(b - a, 2) for k, a, b in zip(steps, marks, marks[1:])}))
"""


def profile_consolidate(out: Path, source: Path, repeat: int) -> None:
    """Where consolidate's time goes on this machine: the disk's direct and buffered write speed, one
    thread's read, cast and hash speed, then `ckptflow consolidate --dtype fp16 --no-verify` as shipped,
    through the page cache, and through the page cache with no fsync, against DeepSpeed's converter with
    and without a `sync` after it. Each a fresh process; best of `repeat`."""
    def run(label: str, command: list[str]) -> float:
        best = None
        for _ in range(max(1, repeat)):
            for leftover in ("prof-ours", "prof-theirs", "dd.bin"):
                target = out / leftover
                shutil.rmtree(target, ignore_errors=True) if target.is_dir() else target.unlink(missing_ok=True)
            subprocess.run(["sync"], check=False)
            seconds, rss = timed(command)
            best = seconds if best is None else min(best, seconds)
            say(f"   profile: {label}: {seconds:.1f} s, peak RSS {rss / 2**30:.2f} GiB")
        return best or 0.0

    gib = 2
    dd = ["dd", "if=/dev/zero", f"of={out / 'dd.bin'}", "bs=16M", f"count={gib * 64}"]
    direct = run(f"dd {gib} GiB oflag=direct", [*dd, "oflag=direct"])
    buffered = run(f"dd {gib} GiB buffered + fsync", [*dd, "conv=fsync"])
    cached = run(f"dd {gib} GiB buffered, no fsync", dd)
    say(f"   disk: direct {gib * 2**30 / direct / 1e9:.2f} GB/s, buffered+fsync {gib * 2**30 / buffered / 1e9:.2f} GB/s, "
        f"page cache only {gib * 2**30 / cached / 1e9:.2f} GB/s")
    optim = max(source.rglob("*optim_states.pt"), key=lambda f: f.stat().st_size)
    parts = subprocess.run([sys.executable, "-c", PARTS, str(optim)], capture_output=True, text=True, env=child_env())
    say(f"   one thread: {parts.stdout.strip() or parts.stderr[-1000:]}")
    check = subprocess.run([sys.executable, "-c", CHECK_PARTS, str(out / "big-config" / "config.json")],
                           capture_output=True, text=True, env=child_env())
    say(f"   the config check, part by part (s): {check.stdout.strip() or check.stderr[-1000:]}")
    cli = [sys.executable, "-c", PATCHED_CLI]
    args = ["consolidate", str(source), str(out / "prof-ours"), "--dtype", "fp16", "--no-verify"]
    config = ["--config", str(out / "big-config")]  # checked against the tensors: transformers on the meta device
    times = {"shipped --config": run("ckptflow consolidate fp16 --config (shipped)", [*cli, "shipped", *args, *config])}
    times.update({patch: run(f"ckptflow consolidate fp16 ({patch})", [*cli, patch, *args])
                  for patch in ("shipped", "page-cache", "no-fsync")})
    z2f = [sys.executable, "-c", "import sys; from deepspeed.utils.zero_to_fp32 import "
           "convert_zero_checkpoint_to_state_dict as c; c(sys.argv[1], sys.argv[2], dtype='float16', "
           "safe_serialization=True)", str(source), str(out / "prof-theirs")]
    theirs = run("zero_to_fp32 fp16", z2f)
    synced = run("zero_to_fp32 fp16 then sync", ["sh", "-c", '"$@" && sync', "sh", *z2f])
    log = subprocess.run([*cli, "shipped", *args, *config], capture_output=True, text=True, env=child_env())
    say("   the shipped run's log:\n" + "\n".join("      " + line for line in log.stderr.splitlines()[-12:]))
    say(f"big profile: ckptflow with --config {times['shipped --config']:.1f} s, shipped {times['shipped']:.1f} s, page cache {times['page-cache']:.1f} s, "
        f"no fsync {times['no-fsync']:.1f} s; zero_to_fp32 {theirs:.1f} s, with sync {synced:.1f} s")
    (out / "profile.json").write_text(json.dumps({**times, "check": check.stdout.strip(), "zero_to_fp32": theirs, "zero_to_fp32+sync": synced,
                                                  "dd_direct": direct, "dd_fsync": buffered, "dd_cache": cached,
                                                  "parts": parts.stdout.strip()}))


def release(engine: Any) -> None:
    import gc

    import torch

    engine.destroy() if hasattr(engine, "destroy") else None
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
