"""The run, built once (torchtitan's train.py and Trainer.__init__): a resolved recipe and a workdir
-> what the command decides (`decide`: the precision, the compilation, the resume point, the
micro-batch, or a finished run), the Job for the one loop (`build_job`: data, network and objective,
step count, evaluators), the checks before the first file is written (`start`), and the run's end
(`finish`: its summary, curves and table). `vit pretrain`, `vit finetune`, its sweeps and VTAB, and
`--preflight` all build their runs here; the micro-batch trial builds its network as build_job does
(run.network).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from vitcli.checkpoints import manager
from vitcli.checkpoints.manager import Checkpoint
from vitcli.checkpoints.transfer import lr_rows
from vitcli.data.rows import sources
from vitcli.fewshot.evaluate import FewshotEvaluator
from vitcli.figures import curves
from vitcli.models import zoo
from vitcli.models.flops import counted
from vitcli.objectives import registry
from vitcli.objectives.objective import Objective
from vitcli.recipe.checks import check_schedule
from vitcli.recipe.data_checks import check_batch_fits
from vitcli.recipe.layers import to_yaml
from vitcli.recipe.schema import Recipe
from vitcli.run import micro_batch
from vitcli.run.feed import check_labels, train_feed
from vitcli.run.network import network
from vitcli.run.report import report
from vitcli.runtime import files, memory, threads
from vitcli.runtime.dist import Dist
from vitcli.runtime.metrics import console
from vitcli.runtime.peak import mfu, peak_flops
from vitcli.runtime.precision import bf16_warning, resolved, resolved_compile
from vitcli.runtime.run_files import RECIPE_FILE, SUMMARY_FILE
from vitcli.runtime.trackers import check_trackers, finish_trackers
from vitcli.runtime.workdir import check_space, check_workdir
from vitcli.train.loop import Job, train
from vitcli.train.schedule import total_steps


@dataclass
class Decided:
    """The run the command will train: its recipe resolved (precision, compilation, micro-batch),
    where it starts (a checkpoint to resume, or None), and why the precision and compilation are
    what they are."""

    recipe: Recipe
    start: Checkpoint | None
    why: str
    why_compile: str


@dataclass
class Finished:
    """The workdir holds this very run, finished: what its summary.json holds; nothing to train."""

    workdir: Path
    summary: dict

    def line(self) -> str:
        return (f"{self.workdir} holds this run, finished at step {self.summary['steps']}: "
                "nothing to do (--overwrite starts it over)")


def decide(recipe: Recipe, workdir: Path, dist: Dist, resume: bool | None = None,
           overwrite: bool = False) -> Decided | Finished:
    """What the command would train in `workdir`, decided before anything is built or written: the
    workdir checked, `auto` precision and compilation resolved (the one place), the resume point (a
    different run refused unless `overwrite`), data.micro_batch_size auto (the checkpoint's, or
    tried); or the finished run the workdir already holds."""
    check_workdir(workdir)
    auto = recipe.run.precision == "auto"
    recipe, why = resolved(recipe, dist.device)
    # run.compile may differ on resume: manager.RESUMABLE
    recipe, why_compile = resolved_compile(recipe, dist.device)
    start = manager.resume_point(recipe, workdir, dist, resume, overwrite, auto)
    recipe = micro_batch.resolved(recipe, dist, start)
    finished = manager.finished_summary(workdir, start)
    if finished is not None:
        return Finished(workdir, finished)
    return Decided(recipe, start, why, why_compile)


def start(recipe: Recipe, workdir: Path, dist: Dist, resume: bool | None = None,
          overwrite: bool = False) -> Job | Finished:
    """The Job of the run the command trains, checked, its workdir prepared (rank 0: recipe.yaml
    written, a finished run's files moved aside, never deleted, once a fresh one replaces it with
    `overwrite`) and announced; or the finished run the workdir holds, not one file touched.

    Everything is checked before the first file is touched: the workdir, the resume decision, the
    data, the model and its starting weights, the free space."""
    decided = decide(recipe, workdir, dist, resume, overwrite)
    if isinstance(decided, Finished):
        return decided
    # a tracking server that does not answer: one line, nothing written (every rank asks, so that
    # every rank stops, none left waiting for rank 0)
    check_trackers(decided.recipe.run)
    # same initial weights on every rank and every run of this recipe
    torch.manual_seed(decided.recipe.run.seed)
    job = build_job(decided.recipe, workdir, dist, decided.start)
    check_space(workdir, checkpoint_bytes(job), "training with its checkpoints")
    if dist.is_main:
        manager.prepare_workdir(workdir, fresh=decided.start is None,
                                ckpt_dir=decided.recipe.run.ckpt_dir)
        files.write_text(workdir / RECIPE_FILE, to_yaml(decided.recipe))
        announce(job, dist, decided.why, decided.why_compile)
    return job


def build_job(r: Recipe, workdir: Path, dist: Dist, start: Checkpoint | None = None) -> Job:
    """Data, network and objective (with its starting weights), step count and evaluators for a run.
    """
    train_ds = (sources.load_stream(r.data) if r.data.streaming
                else sources.load_split(r.data, r.data.train_split))
    if not r.data.streaming:  # before anything is written: the split's size is known only now
        where = f"{r.data.source} split '{r.data.train_split}'"
        check_batch_fits(len(train_ds), r.data.batch_size, where)
    # the head's width; a streamed split's labels are checked as they are read (feed.LabelChecked)
    num_classes = registry.named(r).head_width(r, lambda: train_ds)
    if num_classes and not r.data.streaming:
        check_labels(train_ds, r, num_classes)
    steps = r.schedule.steps or total_steps(0, r.schedule.epochs, len(train_ds), r.data.batch_size)
    check_schedule(r.schedule.warmup_steps, steps, derived=not r.schedule.steps)
    model, objective = network(r, num_classes, dist.device, dist)
    if not r.data.streaming:  # a streamed split's epoch is unknown: its schedules count steps alone
        objective.plan(steps, len(train_ds) / r.data.batch_size)
    else:  # recipe.objective_checks: the epochs schedule.steps covers, where an objective counts them
        objective.plan(steps, steps / r.schedule.epochs if r.schedule.epochs else float(steps))
    periodic, final = _evaluators(r, dist, objective)
    # the head's class names (vit predict prints them); a headless ViT has none
    names = sources.class_names(r.data, train_ds, num_classes) if num_classes else None
    meta = {**zoo.model_spec(r.model, num_classes), "class_names": names}
    feed = train_feed(r, train_ds, num_classes, views=objective.views())
    return Job(r, workdir, model, objective, train_ds, feed, num_classes, steps, meta, periodic, final,
               start)


def _evaluators(r: Recipe, dist: Dist, objective: Objective) -> tuple[list, list]:
    """(periodic, final) evaluators: the objective's held-out one every run.eval_every, on test at
    the end; few-shot every fewshot.every."""

    def held_out(name: str, split: str):
        return objective.evaluator(name, sources.load_split(r.data, split), dist)

    periodic = [(r.run.eval_every, held_out("val", r.data.val_split))] if r.data.val_split else []
    final = [held_out("test", r.data.test_split)] if r.data.test_split else []
    if r.fewshot.every and r.fewshot.tasks:
        periodic.append((r.fewshot.every, FewshotEvaluator(r, dist)))
    return periodic, final


def finish(job: Job, dist: Dist, table: bool = True) -> dict:
    """Train the job, then (rank 0) write summary.json and the curves and, with `table`, print the
    final numbers; returns what summary.json holds (the final metrics, the step count, the time
    taken)."""
    r = job.recipe
    t0 = time.perf_counter()
    results = train(job, dist)
    summary = {"stage": r.stage, "steps": job.total_steps, "seconds": time.perf_counter() - t0,
               "run/precision": r.run.precision, "run/compile": r.run.compile, **results,
               **utilisation(job, dist, results.get("train/img_per_s"))}
    if dist.is_main:
        curves.write_run_curves(job.workdir)  # warns rather than fails: the run is done
        summary = memory.refreshed(summary)  # the peaks as of now: the curves and FLOP count included
        files.write_text(job.workdir / SUMMARY_FILE, json.dumps(summary, indent=2) + "\n")
        finish_trackers(r.run, job.workdir)  # MLflow's artefacts: the curves and summary.json
        if table:
            report(summary, job.workdir)
    return summary


def run_training(recipe: Recipe, workdir: Path, dist: Dist, resume: bool | None = None,
                 overwrite: bool = False, skip_note: str = "", table: bool = True,
                 on_eval: Callable[[int, dict], BaseException | None] | None = None) -> dict:
    """Train as the recipe says (`start`, then `finish`); writes recipe.yaml, metrics.jsonl, state,
    model.safetensors, summary.json (rank 0), and returns what summary.json holds. A finished run is
    not trained again: its results are returned, and said (its table printed, with `table`) unless a
    driver of several runs says with `skip_note` how it skips one (its own table reports it).
    `table=False`: the final table is left to the caller's own (a sweep's). `on_eval`: told each
    periodic evaluation's (step, metrics); what it returns ends the run (Job.on_eval: a search's
    trial pruned)."""
    job = start(recipe, workdir, dist, resume, overwrite)
    if not isinstance(job, Finished):
        job.on_eval = on_eval
        return finish(job, dist, table)
    if dist.is_main:
        console.log(skip_note or job.line())
        if table and not skip_note:
            report(job.summary, workdir)
    return job.summary


def checkpoint_bytes(job: Job) -> int:
    """Disk a run needs at most: run.keep_checkpoints states and one being written (weights plus the
    optimizer's slots: Adam keeps two per weight, SGD momentum one; plus the EMA's copy, if kept),
    and the final model, all fp32."""
    weights = 4 * zoo.count_params(job.model)
    slots = (2 if job.recipe.optim.name == "adamw" else 1) + (1 if job.recipe.ema.decay else 0)
    return (job.recipe.run.keep_checkpoints + 1) * weights * (1 + slots) + weights


def utilisation(job: Job, dist: Dist, img_per_s: float | None) -> dict:
    """train/mfu (model FLOP/s over the peak of every process's device), train/peak_flops and where
    that peak came from; for a network the FLOP count does not cover, train/mfu_skipped says why
    instead."""
    r = job.recipe
    why_not = counted(r.model)
    if why_not or not img_per_s:
        return {"train/mfu_skipped": why_not or "no throughput was logged"}
    peak, source = peak_flops(dist.device, r.run.precision)
    peak *= dist.world_size  # img_per_s counts the global batch: every process's device works on it
    if dist.world_size > 1:
        source += f" x {dist.world_size} processes"
    flops = job.objective.flops_per_image()
    return {"train/mfu": mfu(img_per_s, flops, peak), "train/flops_per_img": float(flops),
            "train/peak_flops": peak, "train/peak_source": source}


def announce(job: Job, dist: Dist, why: str, why_compile: str) -> None:
    """The run's line: the network, the data, what it learns, the steps, the precision and
    compilation (and why), where it writes; the learning rates of a run without starting weights."""
    r = job.recipe
    if r.run.precision == "bf16" and bf16_warning(dist.device):
        console.log(f"[yellow]warning: {bf16_warning(dist.device)}")
    shared = dist.device.type == "cpu" and threads.check(r.data.num_workers)
    if shared:
        console.log(f"[yellow]warning: {shared}")
    console.log(
        f"{r.stage}: {r.model.name} ({zoo.count_params(job.model) / 1e6:.2f}M params), "
        f"{'streamed' if r.data.streaming else len(job.train_ds)} train images, "
        f"{job.objective.learns()}, "
        f"{job.total_steps} steps "
        f"of {r.data.batch_size}, {r.run.precision} ({why}){tf32(r, dist)}, "
        f"{'compiled' if r.run.compile else 'eager'} ({why_compile}) -> {job.workdir}"
    )
    # with starting weights their table says it (checkpoints.transfer.lr_rows)
    if not r.init.checkpoint:
        for what, detail in lr_rows(job.model, r):
            console.log(f"{what}: {detail}")


def tf32(r: Recipe, dist: Dist) -> str:
    """The announce line's note that fp32 matmuls run as TF32 (runtime.dist.setup turns it on for
    CUDA)."""
    on = dist.device.type == "cuda" and torch.get_float32_matmul_precision() != "highest"
    return " with TF32 matmuls" if on and r.run.precision == "fp32" else ""
