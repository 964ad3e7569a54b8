"""A DINO step's FLOP rate against a supervised step's, on this machine (issue 45's goal: >= 0.85x).

Both steps of the same ViT are the loop's own (train.loop: the objective's `before_step` for DINO's
teacher over the step, `_accumulate_grads`, the clip, `_step` with the teacher's EMA), each with its
own optimizer as its run builds it, on one batch in memory (the multi-crop views for DINO), timed in
turns, the fastest of `turns` each after one of warm-up: a load from other processes falls on both.
The FLOP rate is images/s x the step's counted FLOPs per image (objectives' flops_per_image: DINO's
student on 2 global and n local crops and its teacher on the 2 global ones, the heads left out, as
the supervised count leaves out the classifier's).

    python bench/dino.py [--quick] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from vitcli.recipe.resolve import resolve
from vitcli.run.network import network
from vitcli.runtime.dist import setup
from vitcli.runtime.precision import choose
from vitcli.train import loop, parallelize
from vitcli.train.optim import build_optimizer

CLASSES = 1000
# (model overrides, batch, turns): ViT-S/16 at 224 with DINO's 2 x 224 + 8 x 96 crops, the paper's
SIZES = {"vit_s16_224": (["model.name=ViT-S/16"], 8, 3)}
QUICK = (["model.name=custom", "model.img_size=32", "model.patch_size=8", "model.embed_dim=32",
          "model.depth=1", "model.num_heads=2", "model.mlp_dim=64", "dino.out_dim=256", "dino.hidden_dim=64",
          "dino.bottleneck_dim=32", "dino.local_crop_size=16"], 4, 1)


def recipe(objective: str, model: list[str], precision: str):
    """DINO's ViT-S/16 recipe's optimizer and head (recipes/pretrain/dino_vit_s16_i1k.yaml), eager, at
    `precision`; the supervised side the same ViT and optimizer with a 1000-way head, its clip at 3.0 on
    the global norm where DINO clips each parameter's (dino.clip_grad)."""
    return resolve("pretrain", None, [
        f"objective={objective}", "model.pool=token", *model, "optim.name=adamw", "optim.weight_decay=0.04",
        f"optim.clip_grad_norm={0 if objective == 'dino' else 3.0}", f"run.precision={precision}",
        "run.compile=false", "data.label_column=label",
        "schedule.steps=100", "schedule.warmup_steps=10", "model.drop_path=0.1"], inputs=False)


def step_of(r, dist):
    """step(i) -> seconds of one optimizer step of `r`'s objective through the loop's functions, on a batch
    made once."""
    width = CLASSES if r.objective == "supervised" else 0
    torch.manual_seed(0)
    model, made = network(r, width, dist.device)
    made.plan(100, 10.0)
    parallel = parallelize.apply(model, r.run, dist)
    optimizer = build_optimizer(parallel.model, r.optim)
    batch = r.data.batch_size
    x, y = made.example(batch, dist.device), torch.randint(0, max(width, 1), (batch,))

    def step(i: int) -> float:
        t0 = time.perf_counter()
        objective = loop._objective(made, r, i, 0)
        loop._accumulate_grads(parallel, optimizer, iter([(x, y)]), 1, objective, r.run.precision, dist,
                               made.whole_step)
        loop._clip(parallel.train, r.optim.clip_grad_norm)
        loop._step(optimizer, parallel.model, None, i + 1, made)
        return time.perf_counter() - t0

    return step, made.flops_per_image()


def measure(quick: bool) -> dict:
    dist = setup("cpu")
    precision = choose("auto", torch.device("cpu"))[0]
    out = {"precision": precision}
    sizes = {"quick": QUICK} if quick else SIZES
    for name, (model, batch, turns) in sizes.items():
        sides = {}
        for objective in ("supervised", "dino"):
            r = recipe(objective, model + [f"data.batch_size={batch}"], precision)
            sides[objective] = step_of(r, dist)
        seconds = {side: [] for side in sides}
        for i in range(turns + 1):
            for side, (step, _) in sides.items():
                seconds[side].append(step(i))
        row = {"batch": batch, "turns": turns}
        for side, (_, flops) in sides.items():
            fastest = min(seconds[side][1:])
            row |= {f"{side}_img_s": batch / fastest, f"{side}_flops_per_img": flops,
                    f"{side}_gflop_s": batch * flops / fastest / 1e9}
        row["flop_rate_ratio"] = row["dino_gflop_s"] / row["supervised_gflop_s"]
        row["flop_ratio"] = row["dino_flops_per_img"] / row["supervised_flops_per_img"]
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
