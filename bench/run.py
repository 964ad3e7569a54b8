"""`make bench`: speed targets as ratios measured in one run, never as timed tests.

1. training:   our trainer (data stream, loss, clipping, schedule, logging) vs a bare PyTorch loop over the
               same model on tensors already in memory, images/s.
2. extraction: few-shot feature extraction (data decode + transform + forward) vs bare inference on tensors
               already in memory, same model, batch and precision, images/s, for the quickstart model and
               for ViT-S/16 at 224 px. Target >= 0.95.
3. solves:     every closed-form solve of a VTAB run (19 tasks x 4 shot counts x 3 seeds, D = 768, real class
               counts and test-set sizes) vs the time to extract those tasks' features at the rate measured
               in 2 for a ViT-B/16. Target < 5%.
Also reports bf16 autocast against fp32 for the same step (this CPU may lack bf16 instructions).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from vitcli import data, models, tasks  # noqa: E402
from vitcli.dist import setup  # noqa: E402
from vitcli.fewshot import features, solver  # noqa: E402
from vitcli.metrics import read_metrics  # noqa: E402
from vitcli.resolve import resolve  # noqa: E402
from vitcli.stages.run import one_run  # noqa: E402

QUICK = Path(__file__).resolve().parents[1] / "recipes/quickstart/pretrain.yaml"
STEPS, BATCH = 120, 128
# VTAB-1k test-set sizes (TFDS splits as task_adaptation uses them), for the cost of predicting.
VTAB_TEST = {"caltech101": 6084, "cifar100": 10000, "dtd": 1880, "flowers102": 6149, "pets": 3669,
             "sun397": 21750, "svhn": 26032, "camelyon": 32768, "eurosat": 5400, "resisc45": 6300,
             "retinopathy": 42670, "clevr_count": 15000, "clevr_dist": 15000, "dmlab": 22735,
             "dsprites_loc": 73728, "dsprites_ori": 73728, "kitti_dist": 711, "smallnorb_azi": 12150,
             "smallnorb_ele": 12150}


def bare_train(recipe, precision: str) -> float:
    """Images/s of the plainest loop: forward, cross-entropy, backward, AdamW step; data already in memory."""
    torch.manual_seed(0)
    model = models.build_model(recipe.model, 10).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(BATCH, 3, 32, 32), torch.randint(0, 10, (BATCH,))
    for i in range(STEPS + 10):
        if i == 10:
            t0 = time.perf_counter()
        with torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16"):
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return STEPS * BATCH / (time.perf_counter() - t0)


def ours_train(recipe) -> float:
    """Images/s of `vit pretrain` as logged in metrics.jsonl, after the first logging window."""
    with tempfile.TemporaryDirectory() as d:
        one_run(recipe, Path(d))
        rows = [r["train/img_per_s"] for r in read_metrics(Path(d) / "metrics.jsonl") if "train/img_per_s" in r]
    return float(np.mean(rows[1:]))


def extraction(recipe) -> tuple[float, float]:
    """(ours, bare) images/s: features.extract over a dataset vs the same forward on in-memory tensors."""
    dist = setup("cpu")
    model = models.build_model(recipe.model, 10).eval()
    ds = data.load_split(recipe.data, "test")
    img, resize = recipe.model.img_size, round(recipe.model.img_size * 256 / 224)
    features.extract(model, ds.select(range(64)), recipe.data, img, resize, dist, "fp32")  # warm up
    t0 = time.perf_counter()
    features.extract(model, ds, recipe.data, img, resize, dist, "fp32")
    ours = len(ds) / (time.perf_counter() - t0)
    x = torch.randn(recipe.data.eval_batch_size, 3, img, img)
    n = 0
    with torch.inference_mode():
        t0 = time.perf_counter()
        while n < len(ds):
            features.pre_logits(model, x)
            n += len(x)
    return ours, n / (time.perf_counter() - t0)


def vit_b16_rate() -> float:
    """Images/s of ViT-B/16 pre-logits at 224 px on this machine (fp32, batch 32)."""
    model = models.build_model(resolve("pretrain", None, ["model.name=ViT-B/16"]).model, 0).eval()
    x = torch.randn(32, 3, 224, 224)
    with torch.inference_mode():
        features.pre_logits(model, x)
        t0 = time.perf_counter()
        for _ in range(2):
            features.pre_logits(model, x)
    return 64 / (time.perf_counter() - t0)


def vtab_solves() -> tuple[float, int]:
    """(seconds, images) for all VTAB few-shot solves at D = 768, and the images they need features of."""
    rng = np.random.default_rng(0)
    seconds, images = 0.0, 0
    for task in tasks.get_tasks("vtab"):
        k_cls, n_test = task.num_classes, VTAB_TEST[task.name.split("/")[1]]
        x_test = rng.standard_normal((n_test, 768)).astype(np.float32)
        images += 1000 + n_test  # train800val200 + test
        for shots in (1, 5, 10, 25):
            labels = np.repeat(np.arange(k_cls), shots)
            x = rng.standard_normal((len(labels), 768)).astype(np.float32)
            for _ in range(3):
                t0 = time.perf_counter()
                cache = solver.precompute(x)
                w = solver.solve(cache, solver.targets(labels, k_cls), solver.DEFAULT_L2_REG)
                solver.predict(cache, w, x_test).argmax(1)
                seconds += time.perf_counter() - t0
    return seconds, images


def main() -> None:
    r = resolve("pretrain", QUICK, [f"schedule.steps={STEPS}", "schedule.warmup_steps=10", "data.val_split=",
                                    "data.test_split=", "run.log_every=20", f"data.batch_size={BATCH}",
                                    "data.synthetic.train_size=4096"])
    results = {"torch_threads": torch.get_num_threads()}
    results["train_bare_img_s"] = bare_train(r, "fp32")
    results["train_ours_img_s"] = ours_train(r)
    results["train_ratio"] = results["train_ours_img_s"] / results["train_bare_img_s"]
    results["train_bare_bf16_img_s"] = bare_train(r, "bf16")
    results["bf16_over_fp32"] = results["train_bare_bf16_img_s"] / results["train_bare_img_s"]
    ours, bare = extraction(resolve("pretrain", QUICK, ["data.eval_batch_size=256",
                                                        "data.synthetic.test_size=4096"]))
    results.update(extract_ours_img_s=ours, extract_bare_img_s=bare, extract_ratio=ours / bare)
    # The same comparison where the model, not PNG decoding, is the cost: ViT-S/16 at 224 px.
    vit_s = resolve("pretrain", None, ["model.name=ViT-S/16", "model.img_size=224",
                                       "data.synthetic.img_size=224", "data.synthetic.test_size=256",
                                       "data.eval_batch_size=64"])
    ours, bare = extraction(vit_s)
    results.update(extract_vit_s16_ours_img_s=ours, extract_vit_s16_bare_img_s=bare,
                   extract_vit_s16_ratio=ours / bare)
    solve_s, images = vtab_solves()
    rate = vit_b16_rate()
    results.update(vtab_solve_s=solve_s, vtab_images=images, vit_b16_img_s=rate,
                   vtab_extract_s=images / rate, solve_fraction=solve_s / (images / rate))
    json.dump(results, sys.stdout, indent=2)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
