"""`make demo`: the whole lifecycle on a fresh DeepSpeed checkpoint, on this machine, in a few minutes.

1. Train the tiny Llama for three steps with DeepSpeed ZeRO-3 in bf16 on 2 CPU ranks and save a real
   checkpoint with its config and tokenizer (`demo-output/runs/tiny-llama/`); kept for later runs.
2. Run `checkpoint_lifecycle` on it with Prefect's embedded defaults (no server to start):
   consolidate to bf16, verify with transformers, reshard to 1 and 4 ranks, and publish everything
   to `demo-output/bucket/`, a local folder playing the bucket.
3. Print where everything is and how to look at the run in the Prefect UI.

Run it again and the finished steps are read from Prefect's cache. `python -m flows.demo --help`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    # What this demo needs on a machine without a GPU or a Prefect server; set before Prefect and
    # DeepSpeed are imported (both are imported below, inside main).
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = argparse.ArgumentParser(prog="python -m flows.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(REPO / "demo-output"), help="Folder for everything the demo writes.")
    parser.add_argument("--fresh", action="store_true", help="Train a new checkpoint even if one is there.")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    run_dir = out / "runs" / "tiny-llama"
    bucket = out / "bucket"
    started = time.monotonic()

    if args.fresh or not (run_dir / "latest").is_file():
        say(f"1/2 training the tiny Llama with DeepSpeed ZeRO-3 (bf16, 2 CPU ranks) into {run_dir} ...")
        from flows.demo_checkpoint import write_demo_checkpoint

        t = time.monotonic()
        write_demo_checkpoint(run_dir, stage=3, dtype="bf16", world_size=2)
        say(f"    checkpoint {(run_dir / 'latest').read_text().strip()} written in {time.monotonic() - t:.0f} s")
    else:
        say(f"1/2 reusing the checkpoint in {run_dir} (--fresh trains a new one)")

    say("2/2 running the checkpoint-lifecycle flow with Prefect's embedded defaults ...")
    from flows.commands import FlowFailed, run_lifecycle
    from flows.params import ConsolidationForm, Destination, ReshardForm, ValidationForm

    try:
        outcome = run_lifecycle({
            "source": str(run_dir),
            "validation": ValidationForm(settle_seconds=0),
            "consolidation": ConsolidationForm(dtype="bf16"),
            "reshard": ReshardForm(world_sizes=[1, 4]),
            "destinations": [Destination(uri=str(bucket), what="both")],
            "workspace": str(out / "work"),
        })
    except FlowFailed as exc:
        say(f"\nthe lifecycle flow failed: {exc}")
        return 1
    summary = outcome.result
    tag = summary["checkpoint"]["tag"]
    verification = summary.get("verification") or {}

    say("")
    say(f"done in {time.monotonic() - started:.0f} s: {summary['headline']}")
    say(f"  source checkpoint   {run_dir}  ({tag}, ZeRO-{summary['checkpoint']['stage']}, "
        f"{summary['checkpoint']['world_size']} ranks)")
    if summary.get("model"):
        say(f"  consolidated model  {summary['model']['uri']}")
    if verification:
        say(f"  verified            {verification.get('model_class')} on {verification.get('device')}: finite logits, "
            f"{verification.get('tensors_compared')} tensors equal to the checkpoint's")
    for n, reshard in sorted(summary["reshards"].items(), key=lambda kv: int(kv[0])):
        say(f"  resharded, {n} rank(s) {reshard['uri']}")
    say(f"  published           {bucket}/{tag}/  (model/, zero-ws1/, zero-ws4/, each with ckptflow-manifest.json)")
    say("")
    say("See the run in the Prefect UI (same local database as the embedded server):")
    say(f"  {REPO / '.venv/bin/prefect'} server start")
    say(f"  open http://127.0.0.1:4200/runs/flow-run/{outcome.flow_run_id}   (flow run '{outcome.flow_run_name}')")
    say("Load the model:")
    say("  python -c \"from transformers import AutoModelForCausalLM as M; "
        f"print(M.from_pretrained('{bucket}/{tag}/model'))\"")
    say("Next: infra/README.md takes this to a self-hosted Prefect server with workers.")
    return 0


def say(line: str) -> None:
    print(line, flush=True)


if __name__ == "__main__":
    sys.exit(main())
