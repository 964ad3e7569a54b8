"""The loop's stall at a checkpoint, with the background writer (run.ckpt_async=true) and with the
synchronous one (false), as a fraction of a step (issue 46's goal: <= 5%).

Each side is `vit pretrain` as a user runs it, a command in its own process, checkpointing at every
step (run.ckpt_every=1, one kept), for the quickstart network (recipes/quickstart/pretrain.yaml, its
batch of 128 at 32 px) and ViT-B/16 at 224 px (a micro-batch of 8; model, AdamW's two moments: 1.0
GiB a checkpoint). From its summary.json and metrics.jsonl:
  stall_s    time/checkpoint_s / checkpoints: what the loop waited at each (staging, and waiting
             for the write before it, with the background writer; the whole write without), the
             first one's allocation of the staging buffers included
  write_s    time/checkpoint_write_s / checkpoints: one write's own time, in whichever thread
  step_s     the median of a step's seconds over the logged steps after the first (each row's
             window holds its step and the checkpoint before it: that stall is taken out)
  stall_of_step, step_share   stall_s / step, and step / (step + stall_s), the target's figure
             (>= 1 / 1.05), where `step` is the smaller of the two sides' step_s: load from other
             processes only stretches a step (at 2 threads on a busy machine, 10x at times), and a
             stretched step would flatter the stall
The two sides run one after the other, not in turns: on a shared machine the load moves between
them, so `load_1min` is kept with each.

    python bench/ckpt_stall.py [--quick] [--out FILE]   # ~10 min on 2 free cores
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "recipes/quickstart/pretrain.yaml"
COMMON = ["run.ckpt_every=1", "run.keep_checkpoints=1", "run.log_every=1", "run.eval_every=0",
          "data.val_split=", "data.test_split=", "schedule.epochs=0"]
VIT_B16 = ["model.name=custom", "model.img_size=224", "model.patch_size=16", "model.embed_dim=768",
           "model.depth=12", "model.num_heads=12", "model.mlp_dim=3072", "data.synthetic.img_size=224",
           "data.synthetic.train_size=256"]
# name -> (overrides of the quickstart recipe, steps): ViT-B/16 at a small batch, a few steps
NETWORKS = {
    "quickstart": (["schedule.warmup_steps=5"], 30),
    "vit_b16_224": ([*VIT_B16, "data.batch_size=8", "schedule.warmup_steps=1"], 4),
}
QUICK = {"quickstart": (["schedule.warmup_steps=1", "data.batch_size=16",
                         "data.synthetic.train_size=256"], 3)}


def side(overrides: list[str], steps: int, ckpt_async: bool) -> dict:
    """One `vit pretrain` run's figures (see the docstring)."""
    with tempfile.TemporaryDirectory() as workdir:
        cmd = [sys.executable, "-m", "vitcli.cli", "pretrain", "-r", str(QUICKSTART), "--workdir", workdir,
               *COMMON, *overrides, f"schedule.steps={steps}", f"run.ckpt_async={str(ckpt_async).lower()}"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=sys.stderr)
        summary = json.loads((Path(workdir) / "summary.json").read_text())
        rows = [json.loads(line) for line in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]
    # the recipe's 128 unless overridden: the last word
    batch = [int(o.split("=")[1]) for o in ["data.batch_size=128", *overrides]
             if o.startswith("data.batch_size=")][-1]
    checkpoints = summary["steps"]  # one at every step
    stall = summary["time/checkpoint_s"] / checkpoints
    step = statistics.median(batch / r["train/img_per_s"] for r in rows[1:] if "train/img_per_s" in r)
    return {"steps": summary["steps"], "batch": batch, "stall_s": stall,
            "write_s": summary["time/checkpoint_write_s"] / checkpoints, "step_s": step - stall,
            "run_s": summary["seconds"], "load_1min": os.getloadavg()[0]}


def measure(quick: bool) -> dict:
    out = {"cores": os.cpu_count()}
    for name, (overrides, steps) in (QUICK if quick else NETWORKS).items():
        row = {}
        for label, on in (("async", True), ("sync", False)):
            print(f"checkpoint stall: {name}, {label} writer", file=sys.stderr, flush=True)
            row[label] = side(overrides, steps, on)
        step = min(row[label]["step_s"] for label in ("async", "sync"))
        for label in ("async", "sync"):
            stall = row[label]["stall_s"]
            row[label] |= {"stall_of_step": stall / step, "step_share": step / (step + stall)}
        row["step_share"] = row["async"]["step_share"]
        row["stall_async_vs_sync"] = row["async"]["stall_s"] / row["sync"]["stall_s"]
        out[name] = row
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out")
    a = p.parse_args()
    text = json.dumps(measure(a.quick), indent=2)
    if a.out:
        Path(a.out).write_text(text)
    else:
        sys.stdout.write(text + "\n")


if __name__ == "__main__":
    main()
