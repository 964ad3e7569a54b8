"""One training run: a resolved recipe -> a Job for the one loop, then the report. `vit pretrain` is this.

Fine-tuning is the same run with starting weights (vitcli.checkpoints.transfer); the sweep and VTAB drivers
call it once per setting with the Dist their command created.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from rich.table import Table
from rich.text import Text

from vitcli.checkpoints import manager
from vitcli.checkpoints.manager import Checkpoint
from vitcli.checkpoints.transfer import load_init, lr_rows
from vitcli.data.batching import batches, streams
from vitcli.data.rows import sources
from vitcli.errors import RecipeError
from vitcli.evaluators.heldout import ClassificationEvaluator, MaeEvaluator, MppEvaluator
from vitcli.fewshot.evaluate import FewshotEvaluator
from vitcli.figures import curves
from vitcli.models import zoo
from vitcli.models.flops import counted, train_flops_per_image
from vitcli.recipe.checks import check_schedule
from vitcli.recipe.data_checks import check_batch_fits
from vitcli.recipe.layers import to_yaml
from vitcli.recipe.schema import Recipe
from vitcli.runtime import files, threads
from vitcli.runtime.dist import Dist, setup
from vitcli.runtime.metrics import console, stdout
from vitcli.runtime.peak import mfu, peak_flops
from vitcli.runtime.precision import bf16_warning, resolved, resolved_compile
from vitcli.runtime.run_files import MODEL_FILE, RECIPE_FILE, SUMMARY_FILE
from vitcli.runtime.workdir import check_space, check_workdir
from vitcli.train import distill, micro_batch
from vitcli.train.loop import Feed, Job, train
from vitcli.train.objectives import MaeModel, MppModel, loss_fn
from vitcli.train.schedule import total_steps


def one_run(recipe: Recipe, workdir: Path, resume: bool | None = None, overwrite: bool = False) -> dict:
    """`vit pretrain`: join the process group, then one training run; returns what summary.json holds."""
    return run_training(recipe, workdir, setup(recipe.run.device), resume, overwrite)


def _evaluators(r: Recipe, dist: Dist) -> tuple[list, list]:
    """(periodic, final) evaluators: held-out top-1 (or the pretext's loss, for mpp and mae) every
    run.eval_every, on test at the end; few-shot every fewshot.every."""

    def held_out(name: str, split: str):
        ds = sources.load_split(r.data, split)
        if r.objective == "mpp":
            return MppEvaluator(name, ds, r.data, r.model.img_size, dist, r.run.precision, r.mpp,
                                r.model.patch_size)
        if r.objective == "mae":
            return MaeEvaluator(name, ds, r.data, r.model.img_size, dist, r.run.precision, r.mae,
                                r.model.patch_size)
        return ClassificationEvaluator(name, ds, r.data, r.model.img_size, dist, r.run.precision,
                                       loss=loss_fn(r.optim))

    periodic = [(r.run.eval_every, held_out("val", r.data.val_split))] if r.data.val_split else []
    final = [held_out("test", r.data.test_split)] if r.data.test_split else []
    if r.fewshot.every and r.fewshot.tasks:
        periodic.append((r.fewshot.every, FewshotEvaluator(r, dist)))
    return periodic, final


def _num_classes(r: Recipe, train_ds) -> int:
    """The head's width: the recipe's, else the data's (checked against the labels); 0 for mpp and mae (no
    labels). A streamed split cannot be scanned for its largest label before training: its ClassLabel
    decides."""
    if r.objective != "supervised":
        return 0
    num_classes = r.model.num_classes or sources.num_classes(r.data, train_ds)
    if not r.data.streaming:  # a streamed split's labels are checked as they are read: LabelChecked
        check_labels(train_ds, r, num_classes)
    return num_classes


def check_labels(train_ds, r: Recipe, num_classes: int) -> None:
    """Every train label must have a logit: a head smaller than the labels would fail deep in the loss."""
    check_label(int(batches.labels(train_ds, r.data.label_column).max()), r, num_classes)


def check_label(top: int, r: Recipe, num_classes: int) -> None:
    """The largest train label seen so far against the head's width (0: mpp or mae, no head to check)."""
    if num_classes and top >= num_classes:
        key = "model.num_classes" if r.model.num_classes else "data.num_classes"
        raise RecipeError(f"{key}={num_classes}, but the train split '{r.data.train_split}' of "
                          f"{r.data.source} has label {top}; set {key}={top + 1} or more "
                          "(model.num_classes=0 takes the data's own count)")


class LabelChecked:
    """A streamed train split's batches, each one's labels checked against the head as it arrives (one max
    over a (B,) CPU tensor, before it goes to the device): no scan of a stream can run ahead of training.
    The tally of skipped images and the state a checkpoint keeps are the stream's."""

    def __init__(self, stream: streams.TrainStream, r: Recipe, num_classes: int):
        self.stream, self.recipe, self.num_classes = stream, r, num_classes
        self.skipped = stream.skipped

    def __iter__(self) -> LabelChecked:
        return self

    def __next__(self):
        x, y = next(self.stream)
        if len(y):
            check_label(int(y.max()), self.recipe, self.num_classes)
        return x, y

    def state_dict(self) -> dict:
        return self.stream.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.stream.load_state_dict(state)

    def seek(self, micro_batch: int) -> None:
        self.stream.seek(micro_batch)


def build_job(r: Recipe, workdir: Path, dist: Dist, start: Checkpoint | None = None) -> Job:
    """Data, model (with its starting weights), step count and evaluators for a training run."""
    train_ds = (sources.load_stream(r.data) if r.data.streaming
                else sources.load_split(r.data, r.data.train_split))
    if not r.data.streaming:  # before anything is written: the split's size is known only now
        check_batch_fits(len(train_ds), r.data.batch_size, f"{r.data.source} split '{r.data.train_split}'")
    num_classes = _num_classes(r, train_ds)
    steps = r.schedule.steps or total_steps(0, r.schedule.epochs, len(train_ds), r.data.batch_size)
    check_schedule(r.schedule.warmup_steps, steps, derived=not r.schedule.steps)
    model = zoo.build_model(r.model, num_classes)
    if r.init.checkpoint:
        load_init(model, r, num_classes, dist)
    # the ViT is exported headless: the self-supervised objectives train no classifier
    if r.objective == "mpp":
        model = MppModel(model, r.mpp, r.model.patch_size, r.data.mean, r.data.std)
    elif r.objective == "mae":
        model = MaeModel(model, r.mae, r.model.patch_size, fresh=not r.init.checkpoint)
    teacher = distill.load_teacher(r, num_classes, dist.device)
    distill.use_distillation_token(model, r.distill)
    periodic, final = _evaluators(r, dist)
    # the head's class names (vit predict prints them); a headless ViT has none
    names = sources.class_names(r.data, train_ds, num_classes) if num_classes else None
    meta = {**zoo.model_spec(r.model, num_classes), "class_names": names}
    return Job(r, workdir, model, train_ds, train_feed(r, train_ds, num_classes), num_classes, steps, meta,
               periodic, final, start, teacher)


def train_feed(r: Recipe, train_ds, num_classes: int = 0) -> Feed:
    """The loop's train micro-batches: map-style (data.batches) or streamed (data.streams, its labels checked
    against a `num_classes` head as they come), as data.streaming says; both from the run's first micro-batch
    until the CheckpointManager places them where a checkpoint left them."""

    def mapped(micro: int, accum: int, dist: Dist):
        return batches.train_batches(train_ds, r.data, r.model.img_size, micro, r.run.seed, 0, dist.rank,
                                     dist.world_size, accum, device=dist.device)

    def streamed(micro: int, accum: int, dist: Dist):
        stream = streams.stream_train_batches(train_ds, r.data, r.model.img_size, micro, r.run.seed, 0,
                                              dist.rank, dist.world_size, accum=accum, device=dist.device)
        return LabelChecked(stream, r, num_classes)

    return streamed if r.data.streaming else mapped


def run_training(recipe: Recipe, workdir: Path, dist: Dist, resume: bool | None = None,
                 overwrite: bool = False, skip_note: str = "") -> dict:
    """Train as the recipe says; writes recipe.yaml, metrics.jsonl, state, model.safetensors, summary.json
    (rank 0), and returns what summary.json holds (the final metrics, the step count, the time taken).
    A driver of several runs says with `skip_note` how it skips a finished one (its table reports it).

    Everything is checked before the first file is touched: the workdir, the resume decision, the data,
    the model and its starting weights, the free space. A finished run in the workdir is replaced only
    with `overwrite`, and its files are moved aside (never deleted) once the new run has started cleanly.
    """
    check_workdir(workdir)
    auto = recipe.run.precision == "auto"
    recipe, why = resolved(recipe, dist.device)  # the one place `auto` becomes fp32 or bf16
    # and run.compile's auto true or false (run.compile may differ on resume: manager.RESUMABLE)
    recipe, why_compile = resolved_compile(recipe, dist.device)
    start = manager.resume_point(recipe, workdir, dist, resume, overwrite, auto)
    recipe = micro_batch.resolved(recipe, dist, start)  # micro_batch_size auto: the checkpoint's, or tried
    finished = manager.finished_summary(workdir, start)
    if finished is not None:  # the same command again: its results, and not one file touched
        if dist.is_main and skip_note:
            console.log(skip_note)
        elif dist.is_main:
            console.log(f"{workdir} holds this run, finished at step {finished['steps']}: nothing to do "
                        "(--overwrite starts it over)")
            report(finished, workdir)
        return finished
    torch.manual_seed(recipe.run.seed)  # same initial weights on every rank and every run of this recipe
    job = build_job(recipe, workdir, dist, start)
    check_space(workdir, checkpoint_bytes(job), "training with its checkpoints")
    if dist.is_main:
        manager.prepare_workdir(workdir, fresh=start is None)
        files.write_text(workdir / RECIPE_FILE, to_yaml(recipe))
        _announce(job, dist, why, why_compile)
    t0 = time.perf_counter()
    results = train(job, dist)
    summary = {"stage": recipe.stage, "steps": job.total_steps, "seconds": time.perf_counter() - t0,
               "run/precision": recipe.run.precision, "run/compile": recipe.run.compile, **results,
               **utilisation(job, dist, results.get("train/img_per_s"))}
    if dist.is_main:
        files.write_text(workdir / SUMMARY_FILE, json.dumps(summary, indent=2) + "\n")
        curves.write_run_curves(workdir)  # warns rather than fails: the run is done
        report(summary, workdir)
    return summary


def checkpoint_bytes(job: Job) -> int:
    """Disk a run needs at most: run.keep_checkpoints states and one being written (weights plus the
    optimizer's slots: Adam keeps two per weight, SGD momentum one; plus the EMA's copy, if kept), and the
    final model, all fp32."""
    weights = 4 * zoo.count_params(job.model)
    slots = (2 if job.recipe.optim.name == "adamw" else 1) + (1 if job.recipe.ema.decay else 0)
    return (job.recipe.run.keep_checkpoints + 1) * weights * (1 + slots) + weights


def utilisation(job: Job, dist: Dist, img_per_s: float | None) -> dict:
    """train/mfu (model FLOP/s over the peak of every process's device), train/peak_flops and where that
    peak came from; for a network the FLOP count does not cover, train/mfu_skipped says why instead."""
    r = job.recipe
    why_not = counted(r.model)
    if why_not or not img_per_s:
        return {"train/mfu_skipped": why_not or "no throughput was logged"}
    peak, source = peak_flops(dist.device, r.run.precision)
    peak *= dist.world_size  # img_per_s counts the global batch: every process's device works on it
    if dist.world_size > 1:
        source += f" x {dist.world_size} processes"
    flops = train_flops_per_image(r.model, job.num_classes, r.mae if r.objective == "mae" else None)
    return {"train/mfu": mfu(img_per_s, flops, peak), "train/flops_per_img": float(flops),
            "train/peak_flops": peak, "train/peak_source": source}


def _announce(job: Job, dist: Dist, why: str, why_compile: str) -> None:
    r = job.recipe
    if r.run.precision == "bf16" and bf16_warning(dist.device):
        console.log(f"[yellow]warning: {bf16_warning(dist.device)}")
    shared = dist.device.type == "cpu" and threads.check(r.data.num_workers)
    if shared:
        console.log(f"[yellow]warning: {shared}")
    learns = {"mpp": f"masked patch prediction ({r.mpp.target})",
              "mae": f"a masked autoencoder ({r.mae.mask_ratio:g} of the patches removed)"}
    learns = learns.get(r.objective, f"{job.num_classes} classes")
    console.log(
        f"{r.stage}: {r.model.name} ({zoo.count_params(job.model) / 1e6:.2f}M params), "
        f"{'streamed' if r.data.streaming else len(job.train_ds)} train images, "
        f"{learns}{distilled(r)}, "
        f"{job.total_steps} steps "
        f"of {r.data.batch_size}, {r.run.precision} ({why}){tf32(r, dist)}, "
        f"{'compiled' if r.run.compile else 'eager'} ({why_compile}) -> {job.workdir}"
    )
    if not r.init.checkpoint:  # with starting weights their table says it (checkpoints.transfer.lr_rows)
        for what, detail in lr_rows(job.model, r):
            console.log(f"{what}: {detail}")


def distilled(r: Recipe) -> str:
    """The announce line's note of the teacher, if any."""
    d = r.distill
    return f" taught by {d.teacher} ({d.type} distillation, alpha {d.alpha:g})" if d.teacher else ""


def tf32(r: Recipe, dist: Dist) -> str:
    """The announce line's note that fp32 matmuls run as TF32 (runtime.dist.setup turns it on for CUDA)."""
    on = dist.device.type == "cuda" and torch.get_float32_matmul_precision() != "highest"
    return " with TF32 matmuls" if on and r.run.precision == "fp32" else ""


def report(summary: dict, workdir: Path) -> None:
    """Print the final numbers as a table."""
    table = Table(title=f"{summary['stage']} finished in {summary['seconds']:.0f} s", show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right", overflow="fold")
    for k, v in summary.items():
        if "/" in k:
            table.add_row(k, _cell(v))
    stdout.print(table)
    stdout.print(f"weights: {workdir / MODEL_FILE}")


def _cell(v) -> str | Text:
    """Numbers to the right; words (train/mfu_skipped's reason) wrap from the left."""
    if isinstance(v, float):
        return number(v)
    return Text(v, justify="left") if isinstance(v, str) else str(v)


def number(v: float) -> str:
    """4 decimals, but small and large values (a final learning rate of 3e-6, a peak of 9.89e+14 FLOP/s) in
    3 significant digits, not `0.0000`."""
    return f"{v:.3g}" if v and not 1e-3 <= abs(v) < 1e6 else f"{v:.4f}"
