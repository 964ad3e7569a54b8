"""`make bench`: one JSON object on stdout (progress on stderr), every number measured in this one run.

For each model (`quickstart`: recipes/quickstart/pretrain.yaml's model and batch at 32 px; `vit_ti16_224`:
ViT-Ti/16, width 192, depth 12, 3 heads, at 224 px), in its own process so `peak_rss_mb` is that model's:
  ours_img_s          our trainer (stages.run.one_run on the synthetic data) after warm-up, from the
                      trainer's own train/img_per_s rows in metrics.jsonl; ours_compile_img_s with run.compile
  bare_img_s          a hand-written loop over the same model, batch and precision: data in memory, forward,
                      cross-entropy, backward, torch.optim.AdamW with its defaults, no compile
  loader_img_s        our training data stream alone (decode + augmentation) at that size and num_workers
  mfu, mfu_compile    model FLOP/s over matmul_flops, the FLOP/s of a large matmul at the same precision
                      measured in this run. Model FLOPs are analytic: 3x the forward pass's matmul FLOPs
                      (backward = 2x forward), attention's two (N x N) products included, norms and
                      softmax not
  peak_rss_mb         getrusage ru_maxrss of the model's process; children_rss_mb: the largest of its children
                      (data workers, inductor's compiler processes), each a process of its own
  ema                 (ViT-Ti/16) the weight EMA's update (train.ema.WeightEma, ema.warmup on) after each step
                      of the bare loop, both timed step by step in one loop: seconds of each, and `cost`, the
                      update's time over the step's
  fewshot             few-shot feature extraction at the recipe's workers and precision (`extraction`), on the
                      quickstart's 32 px PNGs (4096, its eval batch) and, for ViT-Ti/16, on 380 JPEG
                      photographs of 375-640 px (bench/jpegs.py, eval batches of 128), three ways in turns,
                      the fastest of each:
                      ours (features.extract: extract_ours_img_s), a hand-written loop over the same encoded
                      images (torchvision.io decode, the same squash-resize and centre crop, [-1, 1], stack,
                      forward under inference_mode, one process: extract_bare_img_s) and the forward alone on
                      tensors in memory (extract_forward_img_s, the ceiling). extract_ratio = ours over the
                      hand-written loop (the goal), extract_vs_forward = ours over the forward alone
  distill             (ViT-Ti/16) a training step on a batch in memory, eager, our loss: without a teacher
                      (step_s) and with hard distillation from a teacher as large as the student (its own
                      architecture, from a checkpoint: distill_step_s), in turns, the fastest of each;
                      step_cost = distill_step_s / step_s, speed its inverse
`mae` holds, in a process of its own, an MAE training step (objective: mae at the paper's mask ratio 0.75 and
decoder, 512 wide, 8 blocks, 16 heads) against a supervised one of the same ViT (ViT-L/16, where the paper's
claim lives, and ViT-B/16) at 224 px: the same weights, batch in memory, precision, eager, the recipe's
optimizer (AdamW, MAE's betas and decay) built for each as its run builds it; each step the loop's own
(train.loop: the objective, forward, backward, the optimizer's step), in turns, the fastest of each:
mae_img_s / supervised_img_s = `ratio`; flop_ratio is models.flops's supervised over MAE FLOPs per image,
the most the ratio can be if both ran their FLOPs equally fast, and of_flop_bound the share of it reached
The precision is what run.precision=auto chooses on this machine. `input` holds bench/input.py's numbers (real
JPEG photographs: our loader per core against timm's and torchvision's, and DINO's multi-crop
input against dinov2's DataAugmentationDINO, in-process), `rehearsal`
bench/rehearse.py's (`vit pretrain` against timm's own train.py, both as commands in their own processes on an
ImageNet-shaped folder of 1,000 x 64 hard links; timm's side only with --timm-train), `transfer`
bench/transfer.py's (every frozen-feature protocol against a ViT-B/16 extraction), `preflight`
`vit pretrain --preflight` and then the run itself on the quickstart recipe, and the same for its fine-tune,
all as commands: the ETA over the run's wall-clock time, the peak memory over the run's (preflight_vs_run).
`ckpt_stall` bench/ckpt_stall.py's: `vit pretrain` checkpointing at every step, the loop's stall at each
with the background writer (run.ckpt_async) and the synchronous one, over a step, for the quickstart
network and ViT-B/16 at 224 px.
`search` bench/search.py's: a 12-trial search with pruning against the 4 x 3 grid over optim.lr and
optim.weight_decay on the quickstart, both `vit pretrain` commands, in training steps.
`targets` holds the goals and whether met (null: not measured).

    python bench/run.py [--timm-train PATH]   # the measurement (~27 min on 2 cores);
                                              # make bench [TIMM_TRAIN=PATH] also writes bench/last.json
    python bench/run.py --quick   # seconds of each part, to check the script, not to read the numbers
    python bench/run.py --extraction   # only each model's `fewshot` part and its goals (~2-4 min)
    python bench/run.py --mae   # only the `mae` part and its goal (~3 min with the cores free)
    python bench/run.py --preflight   # only the `preflight` part and its goals (~4 min with the cores free)
    python bench/run.py --ckpt-stall   # only the `ckpt_stall` part and its goals (~10 min, cores free)
    python bench/run.py --search   # only the `search` part (bench/search.py) and its goal
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import datasets
import numpy as np
import torch
import torchvision.io as tio
from jpegs import write_jpegs  # bench/jpegs.py
from torchvision.transforms.v2 import functional as v2F

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from vitcli.checkpoints.weights import save_weights
from vitcli.data.batching import batches
from vitcli.data.rows import sources
from vitcli.fewshot import features
from vitcli.models import zoo
from vitcli.models.flops import train_flops_per_image
from vitcli.models.mae import MaeModel
from vitcli.objectives import registry
from vitcli.recipe.resolve import resolve
from vitcli.recipe.schema import EmaConfig, Recipe
from vitcli.runtime.allocator import keep_freed_memory
from vitcli.runtime.dist import setup
from vitcli.runtime.metrics import read_metrics
from vitcli.runtime.peak import matmul_flops
from vitcli.runtime.precision import autocast, choose
from vitcli.stages.run import one_run
from vitcli.train import distill, loop, parallelize
from vitcli.train.ema import WeightEma
from vitcli.train.losses import loss_fn
from vitcli.train.optim import build_optimizer

# glibc's allocator as `vit` sets it when it starts (cli/entry.py): every side measured in this process,
# the reference's included, runs with it
ALLOCATOR = keep_freed_memory()

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "recipes/quickstart/pretrain.yaml"
VIT_TI16 = ["model.name=custom", "model.patch_size=16", "model.embed_dim=192", "model.depth=12",
            "model.num_heads=3", "model.mlp_dim=768"]
# name -> (recipe file, overrides, image size, batch, steps, log_every): the first logging window is warm-up
# (and compilation) and is dropped; the others are the steady state
MODELS = {
    "quickstart": (QUICKSTART, [], 32, 128, 100, 20),
    "vit_ti16_224": (None, VIT_TI16, 224, 64, 16, 4),
}
QUICK = {  # every code path, in seconds: tiny sizes and steps
    "quickstart": (QUICKSTART, [], 32, 16, 4, 2),
    "vit_ti16_224": (None, [*VIT_TI16[:1], "model.patch_size=16", "model.embed_dim=32", "model.depth=1",
                            "model.num_heads=2", "model.mlp_dim=64"], 32, 8, 4, 2),
}
# bench `mae`: name -> (model overrides, batch, turns); the first turn warms up, the fastest of the others
# counts. The part took 5.2 min of CPU time on 2 cores (2-core AMD EPYC, bf16: ~3 min with the cores free;
# 12 min at a load of 7, a ViT-L/16 supervised step of 8 images 57 s of it)
MAE_SIZES = {
    "vit_l16_224": (["model.name=ViT-L/16"], 8, 3),
    "vit_b16_224": (["model.name=ViT-B/16"], 8, 4),
}
MAE_QUICK_MODEL = ["model.name=custom", "model.patch_size=8", "model.embed_dim=32", "model.depth=1",
                   "model.num_heads=2", "model.mlp_dim=64", "model.img_size=32", "mae.decoder_embed_dim=32",
                   "mae.decoder_depth=1", "mae.decoder_num_heads=2"]
MAE = "mae"  # spawn's name for the part
# bench `preflight`: the quickstart pretraining, then its fine-tune from that run, each `--preflight` then run
PREFLIGHT_RUNS = {"pretrain": (QUICKSTART, []),
                  "finetune": (REPO / "recipes/quickstart/finetune.yaml", ["--init", "{pretrain}"])}
PREFLIGHT_QUICK = ["--preflight-steps", "4", "schedule.epochs=0", "schedule.steps=12",
                   "schedule.warmup_steps=2", "data.synthetic.train_size=256", "data.synthetic.val_size=64",
                   "data.synthetic.test_size=64", "data.batch_size=32", "run.eval_every=5",
                   "run.ckpt_every=5"]
MAE_CLASSES = 1000  # the supervised side's head: ImageNet-1k's, as the paper's supervised ViT-L

TARGETS = {  # name -> (path of keys in the results, goal)
    "ratio_vit_ti16_224": (("models", "vit_ti16_224", "best_ratio"), 1.0),  # compile allowed on our side
    "ratio_quickstart": (("models", "quickstart", "best_ratio"), 0.95),  # the same rule
    "loader_vs_model_vit_ti16_224": (("models", "vit_ti16_224", "loader_vs_model"), 2.0),
    "mfu_vit_ti16_224": (("models", "vit_ti16_224", "best_mfu"), 0.35),
    # few-shot extraction against a hand-written loop over the same images (bench `extraction`)
    "fewshot_extraction_vs_bare": (("models", "quickstart", "fewshot", "extract_ratio"), 0.9),
    "fewshot_extraction_vs_bare_vit_ti16_224": (("models", "vit_ti16_224", "fewshot", "extract_ratio"), 0.9),
    # bench/input.py, in-process: the loaders per core on real-size JPEG photographs
    "loader_224_vs_timm_per_core": (("input", "loader_224", "ours_vs_timm"), 2.5),
    "loader_224_vs_torchvision_per_core": (("input", "loader_224", "ours_vs_torchvision"), 1.5),
    "loader_224_deit_vs_timm_per_core": (("input", "loader_224_deit", "ours_vs_timm"), 1.5),
    # DINO's multi-crop input (issue 45): ours at least 2.5x dinov2's DataAugmentationDINO per core
    "multicrop_vs_dinov2_per_core": (("input", "multicrop", "ratio_vs_reference"), 2.5),
    # bench/rehearse.py: `vit pretrain` against timm's train.py, commands on an ImageNet-shaped folder
    **{f"train_vs_timm_{run}": (("rehearsal", "ratio", run), goal) for run, goal in (
        ("quickstart_32_plain_workers0", 2.0), ("quickstart_32_plain_workers1", 2.0),
        ("quickstart_32_deit_workers0", 1.75), ("quickstart_32_deit_workers1", 1.75),
        ("vit_ti16_224_plain_workers1", 1.0))},
    # a step's time over the step's and the EMA update's: at least 1 / 1.03, the update at most 3% of a step
    "ema_vit_ti16_224": (("models", "vit_ti16_224", "ema", "step_share"), 1 / 1.03),
    # a distilled step costs at most 1.6x an undistilled one: the teacher's forward, without autograd
    "distill_speed_vit_ti16_224": (("models", "vit_ti16_224", "distill", "speed"), 1 / 1.6),
    # an MAE step at mask ratio 0.75 at least 2.5x the images/s of a supervised one at ViT-L/16 (issue 37;
    # the paper's Table 2c: 2.8x for ViT-L on accelerators); at ViT-B/16 the FLOPs allow 1.8x only
    "mae_vs_supervised_vit_l16_224": (("mae", "vit_l16_224", "ratio"), 2.5),
    # bench/dino.py: a DINO step (2 x 224 + 8 x 96 crops, the teacher's forward) at least 0.85x the FLOP rate
    # of a supervised step of the same ViT-S/16 (issue 45)
    "dino_step_flop_rate_vit_s16_224": (("dino", "vit_s16_224", "flop_rate_ratio"), 0.85),
    # bench/ckpt_stall.py: the loop's stall at a checkpoint with the background writer at most 5% of a
    # step (issue 46), `vit pretrain` checkpointing every step: step_share = step / (step + stall)
    **{f"ckpt_stall_{net}": (("ckpt_stall", net, "step_share"), 1 / 1.05)
       for net in ("quickstart", "vit_b16_224")},
    # bench/transfer.py: every frozen-feature protocol on one cached pass at most 10% of the extraction
    "transfer_protocols_vit_b16_vtab1k": (("transfer", "extraction_share"), 1 / 1.1),
    # `--preflight`'s ETA within 15% of the run's wall-clock time and its peak memory within 10% of the run's
    # (issue 38): closeness = 1 - |preflight / run - 1|
    **{f"preflight_{what}_{run}": (("preflight", run, f"{what}_closeness"), goal)
       for run in PREFLIGHT_RUNS for what, goal in (("eta", 0.85), ("mem", 0.90))},
    # bench/search.py: a 12-trial search with pruning reaches the 4 x 3 grid's best val/top1 in <= 60%
    # of the grid's training steps (issue 47): speedup = grid steps / search steps when it reaches it
    "search_vs_grid_quickstart": (("search", "speedup"), 1 / 0.6),
}


def progress(msg: str) -> None:
    """Progress goes to stderr: stdout carries only the JSON."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def machine() -> dict:
    """CPU model, the bf16 instruction sets auto looks for, and the cores torch uses."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines()
                 if line.startswith("model name")), platform.processor())
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines()
                      if line.startswith("flags")), []))
    return {"cpu": name, "avx512_bf16": "avx512_bf16" in flags, "amx": "amx_bf16" in flags,
            "nproc": os.cpu_count(), "torch_threads": torch.get_num_threads()}


def recipe_for(spec: tuple, precision: str, workdir_size: int) -> Recipe:
    """The pretraining recipe of a benchmark model on the synthetic data at its size, no evaluation."""
    path, overrides, img, batch, steps, log_every = spec
    return resolve("pretrain", path, [
        *overrides, f"model.img_size={img}", f"data.synthetic.img_size={img}", f"data.batch_size={batch}",
        "data.micro_batch_size=0", f"data.synthetic.train_size={workdir_size}", "data.val_split=",
        "data.test_split=", "fewshot.every=0", f"schedule.steps={steps}", "schedule.epochs=0",
        "schedule.warmup_steps=1", f"run.log_every={log_every}", f"run.ckpt_every={steps}",
        f"run.precision={precision}", "data.synthetic.num_classes=10", "model.num_classes=10"])


def ours(recipe: Recipe, compile_: bool) -> float:
    """Images/s of `vit pretrain` as its trainer logs them, the first (warm-up) window dropped."""
    with tempfile.TemporaryDirectory() as d:
        one_run(dataclasses.replace(recipe, run=dataclasses.replace(recipe.run, compile=compile_)), Path(d))
        rows = [r["train/img_per_s"] for r in read_metrics(Path(d) / "metrics.jsonl")
                if "train/img_per_s" in r]
    return float(np.mean(rows[1:]))


def bare(recipe: Recipe, steps: int, warmup: int) -> float:
    """Images/s of the plainest loop on one batch kept in memory: what a user writes by hand."""
    model, opt, x, y = bare_setup(recipe)
    for i in range(warmup + steps):
        if i == warmup:
            t0 = time.perf_counter()
        bare_step(model, opt, x, y, recipe.run.precision)
    return steps * recipe.data.batch_size / (time.perf_counter() - t0)


def bare_setup(recipe: Recipe) -> tuple:
    """(model, torch.optim.AdamW with its defaults, images, labels) of the bare loop: one batch in memory."""
    torch.manual_seed(0)
    model = zoo.build_model(recipe.model, 10).train()
    img, batch = recipe.model.img_size, recipe.data.batch_size
    return (model, torch.optim.AdamW(model.parameters(), lr=1e-3), torch.randn(batch, 3, img, img),
            torch.randint(0, 10, (batch,)))


def bare_step(model, opt, x, y, precision: str) -> None:
    """One step of the bare loop: forward, cross-entropy, backward, the optimizer's step."""
    with autocast(torch.device("cpu"), precision):
        loss = torch.nn.functional.cross_entropy(model(x).float(), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def ema_cost(recipe: Recipe, steps: int, warmup: int) -> dict:
    """The weight EMA's update against the training step it follows: `bare`'s loop with the update after
    each optimizer step, the two timed apart step by step (on the CPU both are done when the call returns),
    so machine noise moves both alike."""
    model, opt, x, y = bare_setup(recipe)
    ema = WeightEma(model, EmaConfig(decay=0.9999, warmup=True))
    step_s = update_s = 0.0
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        bare_step(model, opt, x, y, recipe.run.precision)
        t1 = time.perf_counter()
        ema.update(model, i + 1)
        if i >= warmup:
            step_s, update_s = step_s + t1 - t0, update_s + time.perf_counter() - t1
    return {"step_s": step_s / steps, "update_s": update_s / steps, "cost": update_s / step_s,
            "step_share": step_s / (step_s + update_s)}


def distilled(recipe: Recipe, steps: int) -> dict:
    """Seconds of one training step (forward, our loss, backward, AdamW) on a batch in memory, without a
    teacher and with hard distillation from one as large as the student (its architecture, its initial
    weights saved as a checkpoint of ours, loaded by train.distill.load_teacher), in turns, the fastest of
    `steps` each: a load from other processes falls on both alike, and the data pipeline is left out."""
    with tempfile.TemporaryDirectory() as d:
        teacher_file = Path(d) / "teacher.safetensors"
        save_weights(teacher_file, zoo.build_model(recipe.model, 10).state_dict(),
                     {"model": zoo.model_spec(recipe.model, 10)})
        taught = dataclasses.replace(recipe.distill, teacher=str(teacher_file), type="hard")
        teacher = distill.load_teacher(dataclasses.replace(recipe, distill=taught), 10, torch.device("cpu"))
    model = zoo.build_model(recipe.model, 10).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    img, batch = recipe.model.img_size, recipe.data.batch_size
    x, y = torch.randn(batch, 3, img, img), torch.randint(0, 10, (batch,))
    criteria = [distill.criterion(loss_fn(recipe.optim), t, taught) for t in (None, teacher)]
    seconds = [[], []]
    for _ in range(steps + 1):  # the first of each is warm-up
        for which, criterion in enumerate(criteria):
            t0 = time.perf_counter()
            with autocast(torch.device("cpu"), recipe.run.precision):
                loss = criterion(model(x), y, x)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            seconds[which].append(time.perf_counter() - t0)
    plain, taught_s = (min(s[1:]) for s in seconds)
    return {"step_s": plain, "distill_step_s": taught_s, "step_cost": taught_s / plain,
            "speed": plain / taught_s}


def mae_recipe(model: list[str], precision: str) -> Recipe:
    """An MAE pretraining recipe at the paper's masking and decoder (the defaults) and its optimizer (AdamW,
    betas (0.9, 0.95), weight decay 0.05, no clipping) for `model` at 224 px, eager, at `precision`."""
    return resolve("pretrain", None, [
        "objective=mae", "model.img_size=224", "model.pool=token", *model, "optim.name=adamw",
        "optim.beta2=0.95", "optim.weight_decay=0.05", "optim.clip_grad_norm=0", f"run.precision={precision}",
        "run.compile=false"], inputs=False)


def loop_step(r: Recipe, parallel: parallelize.Parallel, dist):
    """step(x, y, i) -> (seconds of the forward and backward, of the whole step): the training step of
    train.loop.train for `r`'s objective without its data stream, logging and checkpoints: the loop's own
    objective (_objective), gradients (_accumulate_grads, one micro-batch), clipping and optimizer step, over
    an optimizer built as the run builds it. Private functions, reached on purpose: they are what every step
    of `vit pretrain` calls."""
    optimizer = build_optimizer(parallel.model, r.optim)
    made = registry.build(r, MAE_CLASSES, dist.device)  # the run's objective (run.network's)

    def step(x: torch.Tensor, y: torch.Tensor, i: int) -> tuple[float, float]:
        t0 = time.perf_counter()
        objective = loop._objective(made, r, i, 0)  # no mixing: neither side's recipe mixes
        loop._accumulate_grads(parallel, optimizer, iter([(x, y)]), 1, objective, r.run.precision, dist)
        t1 = time.perf_counter()  # on the CPU the backward is done when the call returns
        loop._clip(parallel.train, r.optim.clip_grad_norm)
        loop._step(optimizer, parallel.model, None, i + 1, made)
        return t1 - t0, time.perf_counter() - t0

    return step


def mae_vs_supervised(r: Recipe, batch: int, turns: int) -> dict:
    """Images/s of an MAE training step (`r`) and of a supervised one of the same ViT, in turns on one batch
    in memory, the fastest of `turns` each after one turn of warm-up: a load from other processes falls on
    both alike. The two share the ViT's weights (one ViT-L in memory, not two; the supervised side reads
    the head MAE leaves unused, and the position table MAE freezes stays frozen: 0.2M of 304M values); each
    has its own optimizer, as its run would."""
    torch.manual_seed(0)
    dist = setup("cpu")
    backbone = zoo.build_model(r.model, MAE_CLASSES)
    mae = MaeModel(backbone, r.mae, r.model.patch_size)
    steps = {"supervised": loop_step(dataclasses.replace(r, objective="supervised"),
                                     parallelize.apply(backbone, r.run, dist), dist),
             "mae": loop_step(r, parallelize.apply(mae, r.run, dist), dist)}
    img = r.model.img_size
    x, y = torch.randn(batch, 3, img, img), torch.randint(0, MAE_CLASSES, (batch,))
    seconds = {side: [] for side in steps}
    for i in range(turns + 1):
        for side, step in steps.items():
            seconds[side].append(step(x, y, i))
    fastest = {side: min(s[1:], key=lambda t: t[1]) for side, s in seconds.items()}
    flops = {"supervised": train_flops_per_image(r.model, MAE_CLASSES),
             "mae": train_flops_per_image(r.model, mae=r.mae)}
    out = {"model": r.model.name, "img_size": img, "batch": batch, "turns": turns,
           "precision": r.run.precision, "mae": dataclasses.asdict(r.mae)}
    for side, (forward_backward, whole) in fastest.items():
        out |= {f"{side}_img_s": batch / whole, f"{side}_step_s": whole,
                f"{side}_optimizer_s": whole - forward_backward, f"{side}_train_flops_per_img": flops[side]}
    out |= {"ratio": out["mae_img_s"] / out["supervised_img_s"],
            "flop_ratio": flops["supervised"] / flops["mae"]}
    out["of_flop_bound"] = out["ratio"] / out["flop_ratio"]
    goal = TARGETS["mae_vs_supervised_vit_l16_224"][1]
    if out["flop_ratio"] < goal:
        out["note"] = (f"FLOP bound {out['flop_ratio']:.2f}x at this size with this decoder: a {goal}x "
                       "ratio is out of reach whatever the implementation")
    return out


def mae_steps(quick: bool, precision: str) -> dict:
    """bench `mae`, every size (tiny ones with `quick`), measured in this process; its peak RSS and the load
    average before and after."""
    out = {"precision": precision, "load_before": os.getloadavg()}
    for name, (model, batch, turns) in MAE_SIZES.items():
        progress(f"mae: {name}, an MAE step against a supervised one, in turns")
        r = mae_recipe(MAE_QUICK_MODEL if quick else model, precision)
        out[name] = mae_vs_supervised(r, 2 if quick else batch, 1 if quick else turns)
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out["load_after"] = os.getloadavg()  # 1, 5, 15 min: other work on the cores shares the turns
    return out


def vit_json(args: list[str]) -> tuple[dict, float]:
    """`vit ARGS --json` as a process of its own, as a user runs it: what it printed, and its wall-clock
    seconds (interpreter start, imports and exit included)."""
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "vitcli", *args, "--json"], check=True,
                          stdout=subprocess.PIPE, text=True)
    return json.loads(done.stdout), time.perf_counter() - t0


def preflight_vs_run(quick: bool) -> dict:
    """bench `preflight`: for each of PREFLIGHT_RUNS, `vit STAGE --preflight` then the real `vit STAGE` into
    the same workdir, as commands: the preflight's ETA over the run's wall-clock seconds, its peak memory of
    the main process over the run's summary mem/main_peak_mb, each as a ratio and a closeness (1 - |ratio -
    1|); beside them the parts of either (the preflight's model: once, steps, evaluations, checkpoints; the
    run's: outside train(), in it, checkpointing) to tell what an error comes from, and the load average
    (1 min) before the preflight, between and after the run: the cores may be shared."""
    out = {}
    with tempfile.TemporaryDirectory() as d:
        for stage, (recipe, extra) in PREFLIGHT_RUNS.items():
            workdir = Path(d) / stage
            extra = [a.format(pretrain=Path(d) / "pretrain") for a in extra]
            args = [stage, "--recipe", str(recipe), "--workdir", str(workdir), *extra,
                    *(PREFLIGHT_QUICK if quick else [])]
            progress(f"preflight: vit {stage} --preflight, then the run")
            load = [os.getloadavg()[0]]
            pf, pf_s = vit_json([*args, "--preflight"])
            load.append(os.getloadavg()[0])
            run, run_s = vit_json(args)
            load.append(os.getloadavg()[0])
            rows = read_metrics(workdir / "metrics.jsonl")
            out[stage] = preflight_figures(pf, pf_s, run, run_s, rows) | {"load_1min": load}
    return out


def preflight_figures(pf: dict, pf_s: float, run: dict, run_s: float, rows: list[dict]) -> dict:
    """One run's row of bench `preflight`: the preflight's figures against the run's (`run` its summary,
    `rows` its metrics.jsonl)."""
    # the run's own rate: its median logging window (one that met an evaluation or a checkpoint is slow, and
    # a median leaves it out), against the preflight's
    rates = [r["train/img_per_s"] for r in rows if "train/img_per_s" in r]
    eta, mem = pf["eta/seconds"] / run_s, pf["mem/main_peak_mb"] / run["mem/main_peak_mb"]
    return {"eta_s": pf["eta/seconds"], "run_s": run_s, "eta_ratio": eta, "eta_closeness": 1 - abs(eta - 1),
            "mem_mb": pf["mem/main_peak_mb"], "run_mem_mb": run["mem/main_peak_mb"], "mem_ratio": mem,
            "mem_closeness": 1 - abs(mem - 1), "preflight_s": pf_s, "steps": pf["schedule/steps"],
            "step_s": pf["train/step_s"], "data_wait": pf["train/data_wait"],
            "eta_parts_s": {k.removeprefix("eta/").removesuffix("_s"): pf[k]
                            for k in ("eta/fixed_s", "eta/steps_s", "eta/eval_s", "eta/checkpoint_s")},
            "run_parts_s": {"outside_train": run_s - run["seconds"], "train": run["seconds"],
                            "checkpoint": run["time/checkpoint_s"]},
            "img_per_s": pf["train/img_per_s"], "run_img_per_s": run["train/img_per_s"],
            "run_median_img_per_s": float(np.median(rates[1:] or rates))}


def loader(recipe: Recipe, batches_: int) -> float:
    """Images/s of our training stream alone: decode + augmentation, the recipe's num_workers."""
    ds = sources.load_split(recipe.data, recipe.data.train_split)
    stream = batches.train_batches(ds, recipe.data, recipe.model.img_size, recipe.data.batch_size, 0)
    next(stream)  # worker start-up is not throughput
    t0 = time.perf_counter()
    for _ in range(batches_):
        next(stream)
    return batches_ * recipe.data.batch_size / (time.perf_counter() - t0)


def extraction(recipe: Recipe, ds, n_rounds: int) -> dict:
    """Few-shot feature extraction of the split `ds` at the recipe's model, size, eval batch, workers and
    precision, three ways, in turns (the fastest of `n_rounds` each, so a load from other processes falls on
    all alike): ours (features.extract), `bare_extraction` over the same encoded images, and the forward
    alone on in-memory tensors (`forward_only`, the ceiling no decoding pipeline reaches). Each is warmed up
    first on the first 64 images (allocator, kernels, file cache)."""
    torch.manual_seed(0)
    model = zoo.build_model(recipe.model, 10).eval()
    cfg, dist, precision = recipe.data, setup("cpu"), recipe.run.precision
    img, resize = recipe.model.img_size, round(recipe.model.img_size * 256 / 224)
    raws = ds.cast_column(cfg.image_column, datasets.Image(decode=False))[cfg.image_column]  # bytes or path
    sides = {
        "ours": lambda n: features.extract(model, ds.select(range(n)), cfg, img, resize, dist, precision),
        "bare": lambda n: bare_extraction(model, raws[:n], img, resize, cfg.eval_batch_size, precision),
        "forward": lambda n: forward_only(model, n, img, cfg.eval_batch_size, precision),
    }
    seconds = {k: [] for k in sides}
    for side in sides.values():
        side(min(64, len(ds)))
    for _ in range(n_rounds):
        for k, side in sides.items():
            t0 = time.perf_counter()
            side(len(ds))
            seconds[k].append(time.perf_counter() - t0)
    rates = {k: len(ds) / min(s) for k, s in seconds.items()}
    return {"images": len(ds), "img_size": img, "batch": cfg.eval_batch_size, "num_workers": cfg.num_workers,
            "torch_threads": torch.get_num_threads(), "extract_ours_img_s": rates["ours"],
            "extract_bare_img_s": rates["bare"], "extract_forward_img_s": rates["forward"],
            "extract_ratio": rates["ours"] / rates["bare"],
            "extract_vs_forward": rates["ours"] / rates["forward"]}


def bare_extraction(model, raws: list[dict], img: int, resize: int, batch: int, precision: str) -> np.ndarray:
    """Pre-logits features of every image as a user writes the loop by hand with the dependencies: read and
    decode each image (torchvision.io), squash to resize x resize (bilinear, no antialias: big_vision's
    resize) on uint8, centre crop, stack, scale to [-1, 1], forward under inference_mode; one process."""
    out = []
    with torch.inference_mode(), autocast(torch.device("cpu"), precision):
        for i in range(0, len(raws), batch):
            x = torch.stack([v2F.center_crop(v2F.resize(_decoded(raw), [resize, resize], antialias=False),
                                              [img, img]) for raw in raws[i : i + batch]])
            out.append(features.pre_logits(model, x.float().div_(127.5).sub_(1.0)).float())
    return torch.cat(out).numpy()


def _decoded(raw: dict) -> torch.Tensor:
    """uint8 (3, H, W) RGB of an encoded dataset row: its bytes, else its file."""
    data = raw["bytes"] if raw.get("bytes") is not None else tio.read_file(raw["path"])
    data = torch.frombuffer(bytearray(data), dtype=torch.uint8) if isinstance(data, bytes) else data
    return tio.decode_image(data, mode=tio.ImageReadMode.RGB)


def forward_only(model, n: int, img: int, batch: int, precision: str) -> None:
    """The forward of `n` images, in batches of `batch` from one tensor already in memory."""
    x = torch.randn(batch, 3, img, img)
    with torch.inference_mode(), autocast(torch.device("cpu"), precision):
        for i in range(0, n, batch):
            features.pre_logits(model, x[: min(batch, n - i)])


def extraction_data(name: str, recipe: Recipe, quick: bool, workdir: Path) -> tuple[Recipe, object]:
    """(recipe, split) the extraction is measured on: the quickstart's own synthetic 32 px PNGs (4096; 256
    quick); for ViT-Ti/16, JPEG photographs of 375-640 px (bench/jpegs.py: 380; 20 quick) in `workdir`, in
    eval batches of 128: three batches, so the measure sees the loader workers decode while the model runs
    as on a real split (of one batch, nothing can overlap the first batch's decoding, on either side)."""
    if name == "quickstart":
        n = 256 if quick else 4096
        synthetic = dataclasses.replace(recipe.data.synthetic, test_size=n)
        cfg = dataclasses.replace(recipe.data, synthetic=synthetic)
        return dataclasses.replace(recipe, data=cfg), sources.load_split(cfg, "test")
    root = write_jpegs(workdir, 2 if quick else 38)
    cfg = dataclasses.replace(recipe.data, source=str(root), eval_batch_size=recipe.data.eval_batch_size
                              if quick else 128)
    return dataclasses.replace(recipe, data=cfg), sources.load_split(cfg, "train")


def extraction_only(name: str, quick: bool, precision: str) -> dict:
    """`extraction` of one model on its data (extraction_data), alone: --extraction's per-model part."""
    spec = (QUICK if quick else MODELS)[name]
    with tempfile.TemporaryDirectory() as d:
        recipe, ds = extraction_data(name, recipe_for(spec, precision, 256), quick, Path(d))
        return extraction(recipe, ds, 1 if quick else 2 if name == "vit_ti16_224" else 5)


def one_model(name: str, quick: bool, precision: str) -> dict:
    """Every per-model number, measured in this process (the caller runs one process per model)."""
    spec = (QUICK if quick else MODELS)[name]
    batch, steps = spec[3], spec[4]
    loader_batches = 2 if quick else 8
    # the loader is timed within the first epoch: a small dataset's decoded images are cached after it
    r = recipe_for(spec, precision, max((loader_batches + 1) * batch, 256))
    progress(f"{name}: loader")
    out = {"img_size": spec[2], "batch": batch, "steps": steps, "num_workers": r.data.num_workers,
           "loader_img_s": loader(r, loader_batches)}
    progress(f"{name}: bare loop")
    out["bare_img_s"] = bare(r, 2 if quick else max(steps // 2, 4), 1 if quick else 3)
    for key, compile_ in (("ours_img_s", False), ("ours_compile_img_s", True)):
        progress(f"{name}: our trainer, compile={compile_}")
        out[key] = ours(r, compile_)
    if name == "vit_ti16_224":
        progress(f"{name}: our trainer with a teacher as large as the student")
        out["distill"] = distilled(r, 2 if quick else 5)
    out["train_flops_per_img"] = train_flops_per_image(r.model)
    progress(f"{name}: few-shot extraction")
    out["fewshot"] = extraction_only(name, quick, precision)
    if name == "vit_ti16_224":
        progress(f"{name}: weight EMA beside the bare loop's steps")
        out["ema"] = ema_cost(r, 2 if quick else max(steps // 2, 4), 1 if quick else 2)
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    out["children_rss_mb"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return out


def derived(m: dict, peak: float) -> dict:
    """Ratios and MFU from a model's raw numbers and the matmul peak."""
    mfu = {k: m[f"{k}_img_s"] * m["train_flops_per_img"] / peak for k in ("ours", "ours_compile")}
    return {"ratio": m["ours_img_s"] / m["bare_img_s"],
            "ratio_compile": m["ours_compile_img_s"] / m["bare_img_s"],
            "best_ratio": max(m["ours_img_s"], m["ours_compile_img_s"]) / m["bare_img_s"],
            "loader_vs_model": m["loader_img_s"] / m["ours_img_s"], "mfu": mfu["ours"],
            "mfu_compile": mfu["ours_compile"], "best_mfu": max(mfu.values())}


def targets(results: dict, names: list[str] | None = None) -> dict:
    """Each goal (of `names`; None: all) with the value measured and whether it is met."""
    out = {}
    for name, (path, goal) in TARGETS.items() if names is None else ((k, TARGETS[k]) for k in names):
        value = results
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        # None: not measured (the rehearsal without timm's train.py)
        out[name] = {"target": goal, "value": value, "met": None if value is None else bool(value >= goal)}
    return out


def extraction_results(quick: bool, chosen: dict[str, str]) -> dict:
    """--extraction: the few-shot extraction of each model alone, each in its own process, and its goals."""
    models = {name: {"precision": chosen[name], "fewshot": spawn(name, quick, chosen[name], True)}
              for name in MODELS}
    results = {"machine": machine(), "torch": torch.__version__, "quick": quick, "models": models}
    results["targets"] = targets(results, [k for k in TARGETS if k.startswith("fewshot_")])
    return results


# bench/rehearse.py's comparison on a smaller tree (1,000 classes x 64: 7 GB as any tool sees it, past every
# cache), without its start measurements (make rehearse has them, at 1.28M entries)
REHEARSAL = ["--per-class", "64", "--val-per-class", "0", "--no-start", "--steps", "40",
             "--networks", "quickstart_32,vit_ti16_224", "--only", ",".join(
                 k.removeprefix("train_vs_timm_") for k in TARGETS if k.startswith("train_vs_timm_"))]


def rehearsal(quick: bool, timm_train: str | None) -> dict:
    """bench/rehearse.py's JSON: `vit pretrain` and (given its path) timm's train.py as commands."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, str(Path(__file__).with_name("rehearse.py")), "--out", f.name]
        cmd += ["--quick"] if quick else REHEARSAL
        cmd += ["--timm-train", timm_train] if timm_train else []
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        return json.loads(Path(f.name).read_text())


def ckpt_stall(quick: bool) -> dict:
    """bench/ckpt_stall.py's JSON: the checkpoint stall, background writer against synchronous."""
    progress("the checkpoint stall, background and synchronous writers (bench/ckpt_stall.py)")
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, str(Path(__file__).with_name("ckpt_stall.py")), "--out", f.name]
        subprocess.run(cmd + (["--quick"] if quick else []), check=True, stdout=sys.stderr)
        return json.loads(Path(f.name).read_text())


def search_vs_grid(quick: bool) -> dict:
    """bench/search.py's JSON: a search that prunes against the grid, as commands."""
    progress("a 12-trial search against the 4 x 3 grid, as commands (bench/search.py)")
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, str(Path(__file__).with_name("search.py")), "--out", f.name]
        subprocess.run(cmd + (["--quick"] if quick else []), check=True, stdout=subprocess.DEVNULL)
        return json.loads(Path(f.name).read_text())


def spawn(name: str, quick: bool, precision: str, only_extraction: bool = False) -> dict:
    """One model's numbers from a fresh process, so its ru_maxrss is its own."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, __file__, "--model", name, "--precision", precision, "--out", f.name]
        cmd += ["--quick"] if quick else []
        subprocess.run(cmd + (["--extraction"] if only_extraction else []), check=True, stdout=sys.stderr)
        return json.loads(Path(f.name).read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks the script, not the machine")
    p.add_argument("--extraction", action="store_true", help="only the few-shot extraction of each model")
    p.add_argument("--mae", action="store_true", help="only the MAE step against the supervised one")
    p.add_argument("--preflight", action="store_true",
                   help="only `--preflight`'s ETA and memory against the runs")
    p.add_argument("--ckpt-stall", action="store_true",
                   help="only the checkpoint stall, background against synchronous writer")
    p.add_argument("--search", action="store_true", help="only a search against the grid it replaces")
    p.add_argument("--timm-train", help="timm's train.py, for the command-level comparison (rehearse.py)")
    p.add_argument("--model", help=argparse.SUPPRESS)  # internal: measure one model, write --out
    p.add_argument("--precision", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.model == MAE:
        Path(a.out).write_text(json.dumps(mae_steps(a.quick, a.precision)))
        return
    if a.model:
        measure = extraction_only if a.extraction else one_model
        Path(a.out).write_text(json.dumps(measure(a.model, a.quick, a.precision)))
        return
    t0 = time.perf_counter()
    auto, why = choose("auto", torch.device("cpu"))
    # each model at its recipe's precision as a user gets it: the quickstart pins fp32 (bf16 autocast is ~3x
    # slower than fp32 at width 64 even on an AVX-512 bf16 CPU: casts and small kernels), ViT-Ti takes auto
    chosen = {name: choose(resolve("pretrain", spec[0], spec[1], inputs=False).run.precision,
                           torch.device("cpu"))[0]
              for name, spec in MODELS.items()}
    if a.extraction:
        json.dump(extraction_results(a.quick, chosen), sys.stdout, indent=2)
        sys.stdout.write("\n")
        return
    # one part alone, with its own targets
    alone = {"mae": (a.mae, lambda: spawn(MAE, a.quick, auto)),
             "ckpt_stall": (a.ckpt_stall, lambda: ckpt_stall(a.quick)),
             "preflight": (a.preflight, lambda: preflight_vs_run(a.quick)),
             "search": (a.search, lambda: search_vs_grid(a.quick))}
    for key, (asked, measure) in alone.items():
        if asked:
            results = {"machine": machine(), "torch": torch.__version__, "quick": a.quick, key: measure()}
            results["targets"] = targets(results, [k for k in TARGETS if k.startswith(f"{key}_")])
            json.dump(results, sys.stdout, indent=2)
            sys.stdout.write("\n")
            return
    peaks = {}
    for precision in sorted(set(chosen.values())):
        progress(f"matmul peak at {precision}")
        peaks[precision] = matmul_flops(precision, 512 if a.quick else 4096, 2 if a.quick else 10)
    results = {"machine": machine(), "allocator": ALLOCATOR, "auto_precision": auto, "auto_reason": why,
               "torch": torch.__version__, "quick": a.quick, "matmul_flops": peaks, "models": {}}
    for name in MODELS:
        m = spawn(name, a.quick, chosen[name])
        results["models"][name] = {"precision": chosen[name], **m, **derived(m, peaks[chosen[name]])}
    results["mae"] = spawn(MAE, a.quick, auto)  # at auto's precision: the ViT-L's, as a user runs it
    progress("input pipeline on JPEG photographs (bench/input.py)")
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, str(Path(__file__).with_name("input.py")), "--out", f.name]
        subprocess.run(cmd + (["--quick"] if a.quick else []), check=True, stdout=sys.stderr)
        results["input"] = json.loads(Path(f.name).read_text())
    progress("vit pretrain vs timm's train.py, as commands (bench/rehearse.py)")
    results["rehearsal"] = rehearsal(a.quick, a.timm_train)
    progress("a DINO step against a supervised one, in turns (bench/dino.py)")
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, str(Path(__file__).with_name("dino.py")), "--out", f.name]
        subprocess.run(cmd + (["--quick"] if a.quick else []), check=True, stdout=sys.stderr)
        results["dino"] = json.loads(Path(f.name).read_text())
    results["ckpt_stall"] = ckpt_stall(a.quick)
    progress("frozen-feature protocols vs the extraction (bench/transfer.py)")
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, str(Path(__file__).with_name("transfer.py")), "--out", f.name]
        subprocess.run(cmd + (["--quick"] if a.quick else []), check=True, stdout=sys.stderr)
        results["transfer"] = json.loads(Path(f.name).read_text())
    progress("--preflight's ETA and memory against the quickstart runs, as commands")
    results["preflight"] = preflight_vs_run(a.quick)
    results["search"] = search_vs_grid(a.quick)
    results["targets"] = targets(results)
    results["seconds"] = time.perf_counter() - t0
    json.dump(results, sys.stdout, indent=2)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
