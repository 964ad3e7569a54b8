"""`make bench-memory`: peak RSS of a real fine-tuning step of ViT-B/16 at 384 px, global batch 512, as
recipes/finetune/imagenet.yaml runs it (micro-batches of its data.micro_batch_size, accumulated), on the
synthetic data drawn at 384 px and from random weights (the memory does not depend on their values).

Peak memory does not grow with the number of micro-batches: each micro-batch's activations are freed by its
backward pass before the next forward, and gradients accumulate in place into the .grad buffers the first
micro-batch allocated. So the peak is that of (weights + gradients + optimizer slots + one micro-batch's
activations), reached within the first two micro-batches; by default we run those two (batch_size = 2 x the
micro-batch; the second one adds into existing gradients). `--micro-batches 16` runs all 512 images.
With data.micro_batch_size 0 the trainer takes batch_size / processes: there is no memory-based rule.

    python bench/memory.py                 # ~2 x 32 ViT-B/16 images at 384 px: minutes on 2 cores
    python bench/memory.py --quick         # a tiny model, to check the script
Prints one JSON object: model, img_size, precision, batch_size, micro_batch_size, micro_batches_run,
peak_rss_mb (this process: model, optimizer, activations) and children_rss_mb (largest data worker).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from vitcli.recipe.resolve import resolve
from vitcli.recipe.schema import micro_batches
from vitcli.stages.run import one_run

RECIPE = Path(__file__).resolve().parents[1] / "recipes/finetune/imagenet.yaml"
TINY = ["model.name=custom", "model.img_size=32", "model.patch_size=8", "model.embed_dim=32", "model.depth=1",
        "model.num_heads=2", "model.mlp_dim=64", "data.micro_batch_size=4"]


def finetune_recipe(count: int, quick: bool, precision: str | None):
    """The ImageNet fine-tuning recipe, one optimizer step over `count` micro-batches, synthetic data."""
    base = resolve("finetune", RECIPE, ["model.name=ViT-B/16", *(TINY if quick else [])])
    micro, _ = micro_batches(base)
    img = base.model.img_size
    return resolve("finetune", RECIPE, [
        "model.name=ViT-B/16", *(TINY if quick else []), "data.source=synthetic",
        f"data.synthetic.img_size={img}", f"data.synthetic.train_size={micro * count}",
        "data.synthetic.num_classes=10", "model.num_classes=1000", f"data.batch_size={micro * count}",
        "data.train_split=train", "data.val_split=", "data.test_split=", "schedule.steps=1",
        "schedule.warmup_steps=0", "init.checkpoint=",
        *([f"run.precision={precision}"] if precision else [])])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--micro-batches", type=int, default=2, help="micro-batches in the one step (16: all 512)")
    p.add_argument("--precision", help="override the recipe's run.precision (auto, fp32, bf16)")
    p.add_argument("--quick", action="store_true", help="a tiny model: checks the script, not the memory")
    a = p.parse_args()
    r = finetune_recipe(a.micro_batches, a.quick, a.precision)
    with tempfile.TemporaryDirectory() as d, contextlib.redirect_stdout(sys.stderr):  # stdout: the JSON only
        summary = one_run(r, Path(d))
        precision = json.loads((Path(d) / "summary.json").read_text())["run/precision"]
    out = {"model": r.model.name, "img_size": r.model.img_size, "precision": precision,
           "recipe_batch_size": resolve("finetune", RECIPE, []).data.batch_size,
           **dict(zip(("micro_batch_size", "micro_batches_run"), micro_batches(r))),
           "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # Linux: KiB
           "children_rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
           "train_loss": summary.get("train/loss")}
    json.dump(out, sys.stdout, indent=2)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
