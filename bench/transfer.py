"""`make bench`'s frozen-feature part: every protocol of `vit eval-fewshot --protocols all` on one cached
feature pass, against the extraction that pass costs, for a VTAB-1k task at ViT-B/16 width (issue 29: all
protocols together at most 10% of the extraction).

  extraction  fewshot.features.extract of a ViT-B/16 (random init: speed does not depend on the weights) at
              224 px over scikit-image's photographs cut to JPEGs (bench/jpegs.py), at the precision `auto`
              picks here: images/s, and the seconds a CIFAR-100-sized VTAB-1k task (1,000 train + 10,000
              test images) takes at that rate (measured on `images`, extrapolated to the task)
  protocols   seconds of each protocol on features of that task's shape (768 wide, 100 classes): few-shot
              (1, 5, 10, 25 shots x 3 seeds), kNN, the logistic probe (λ swept on 200 held out), ridge on
              all 1,000 (λ by leave-one-out). The features are a stand-in with real features' difficulty:
              one Gaussian cluster per class, spread so that the probe scores ~70% (a real backbone's
              features are not reachable offline; the solvers' cost depends on the shape and on how
              separable the classes are, not on where the numbers came from)
  protocols_vs_extraction  all protocols' seconds over the extraction's; extraction_share, the extraction's
              over both (the target: at least 1 / 1.1, the protocols at most 10% of the extraction)

    python bench/transfer.py [--quick] [--train N] [--out F]   # its JSON alone; bench/run.py includes it

  --train N: the task with N train examples instead of 1,000 (the logistic probe's time grows with it, the
  extraction's per image does not: docs/eval-fewshot.md quotes --train 4000)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from jpegs import write_jpegs  # bench/jpegs.py

from vitcli.data.rows import sources
from vitcli.fewshot import evaluate, features, protocols
from vitcli.models import zoo
from vitcli.recipe.resolve import resolve
from vitcli.runtime.dist import setup
from vitcli.runtime.precision import choose

VIT_B16 = ["model.name=custom", "model.patch_size=16", "model.embed_dim=768", "model.depth=12",
           "model.num_heads=12", "model.mlp_dim=3072", "model.img_size=224"]
TASK = {"train": 1000, "test": 10000, "classes": 100, "width": 768}  # VTAB-1k CIFAR-100
QUICK_TASK = {"train": 200, "test": 400, "classes": 10, "width": 32}
SPREAD = 0.18  # cluster centres' scale over unit noise: the logistic probe scores ~70% on TASK


def progress(msg: str) -> None:
    print(f"[transfer {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def recipe(quick: bool, folder: Path):
    model = (["model.name=custom", "model.patch_size=8", "model.embed_dim=32", "model.depth=1",
              "model.num_heads=2", "model.mlp_dim=64", "model.img_size=32"] if quick else VIT_B16)
    # a pretraining recipe for its model, data and fewshot sections (eval-fewshot's would read a checkpoint)
    r = resolve("pretrain", None, [*model, f"data.source={folder}", "data.eval_batch_size=16",
                                   "data.val_split=", "data.test_split=", "schedule.steps=1",
                                   "schedule.warmup_steps=0", "fewshot.protocols=[fewshot,knn,linear,ridge]"],
                inputs=False)
    precision = choose("auto", torch.device("cpu"))[0]
    return dataclasses.replace(r, run=dataclasses.replace(r.run, precision=precision))


def extraction(r, images: int) -> dict:
    """images/s of features.extract on the JPEG folder (after one warm-up batch)."""
    model = zoo.build_model(r.model, 10).eval()
    ds = sources.load_split(r.data, "train").select(range(images))
    dist = setup("cpu")
    img, resize, method = evaluate.preprocessing(r)
    features.extract(model, ds.select(range(r.data.eval_batch_size)), r.data, img, resize, dist,
                     r.run.precision, resize_method=method)
    start = time.perf_counter()
    features.extract(model, ds, r.data, img, resize, dist, r.run.precision, resize_method=method)
    return {"images": images, "img_s": images / (time.perf_counter() - start), "precision": r.run.precision}


def stand_in(task: dict, seed: int = 0):
    """(train, test) (features (N, D) float32, labels (N,)) of one Gaussian cluster per class."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(task["classes"], task["width"])) * SPREAD

    def draw(n):
        y = np.arange(n) % task["classes"]  # balanced, as VTAB-1k's train is near enough
        return (centres[y] + rng.normal(size=(n, task["width"]))).astype(np.float32), y

    return draw(task["train"]), draw(task["test"])


def protocol_seconds(r, task: dict) -> dict:
    """Seconds and figures of each protocol on the stand-in features."""
    train, test = stand_in(task)
    start = time.perf_counter()
    rows = evaluate.evaluate_task(train, test, task["classes"], r, "task")
    out = {"fewshot": {"seconds": time.perf_counter() - start,
                       "accuracy_25shot": float(np.mean([x["accuracy"] for x in rows if x["shots"] == 25]))}}
    for row in protocols.task_rows(train, test, task["classes"], r.fewshot, "task"):
        out[row["protocol"]] = {k: v for k, v in row.items() if k not in ("task", "protocol")}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks the script, not the machine")
    p.add_argument("--train", type=int, help="train examples of the task (default: VTAB-1k's 1,000)")
    p.add_argument("--out", help="also write the JSON here")
    a = p.parse_args()
    task = {**(QUICK_TASK if a.quick else TASK), **({"train": a.train} if a.train else {})}
    with tempfile.TemporaryDirectory(prefix="bench-transfer-") as tmp:
        folder = write_jpegs(Path(tmp), 8 if a.quick else 12)  # 12 photographs: 144 images
        r = recipe(a.quick, folder)
        progress(f"extraction, {'tiny model' if a.quick else 'ViT-B/16 at 224'} ({r.run.precision})")
        ext = extraction(r, 32 if a.quick else 96)
    ext["task_seconds"] = (task["train"] + task["test"]) / ext["img_s"]
    progress(f"protocols on {task['train']} + {task['test']} features of width {task['width']}")
    prot = protocol_seconds(r, task)
    total = sum(v["seconds"] for v in prot.values())
    out = {"task": task, "extraction": ext, "protocols": prot, "protocols_seconds": total,
           "protocols_vs_extraction": total / ext["task_seconds"],
           "extraction_share": ext["task_seconds"] / (ext["task_seconds"] + total)}
    text = json.dumps(out, indent=2)
    if a.out:
        Path(a.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
