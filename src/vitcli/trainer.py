"""The one training loop. Pretrain and finetune differ in their recipes and starting weights, not here.

Each optimizer step sees `data.batch_size` images: `accumulation_steps` micro-batches per process, summed
(not averaged twice) across processes by DDP, so the paper's batch of 4096 runs on a single small machine.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from vitcli import batches
from vitcli.checkpoints import files, state
from vitcli.dist import Dist, all_reduce_sum, wrap
from vitcli.errors import TrainingError
from vitcli.evaluators import Evaluator
from vitcli.interrupt import StopRequest, agreed_stop, interrupted
from vitcli.metrics import METRICS_FILE, MetricsLog, console, progress_bar
from vitcli.objectives import exported, mpp_step
from vitcli.optim import build_optimizer
from vitcli.precision import autocast
from vitcli.recipe import OptimConfig, Recipe, accumulation_steps, to_dict
from vitcli.schedule import learning_rate
from vitcli.trackers import open_trackers
from vitcli.transforms import seeded

log = logging.getLogger(__name__)
MIXUP_STREAM, MPP_STREAM = 1, 2  # keep these seeds apart from the data augmentation's (seed, rank, step)


@dataclass
class Job:
    """Everything a stage hands the loop."""

    recipe: Recipe
    workdir: Path
    model: torch.nn.Module
    train_ds: object  # datasets.Dataset
    num_classes: int
    total_steps: int
    model_meta: dict  # model spec stored with the weights so later stages rebuild the model
    evaluators: list[tuple[int, Evaluator]] = field(default_factory=list)  # (every N steps; 0 = end only)
    final_evaluators: list[Evaluator] = field(default_factory=list)  # run once after the last step
    resume_from: tuple[Path, dict] | None = None  # (checkpoint path, its state) to continue from


def loss_fn(cfg: OptimConfig, num_classes: int):
    """Softmax or sigmoid cross-entropy on integer labels or soft (mixup) targets."""

    def soft_targets(target: torch.Tensor) -> torch.Tensor:
        if target.ndim == 2:  # mixup already smoothed them
            return target
        onehot = F.one_hot(target, num_classes).float()
        return onehot * (1 - cfg.label_smoothing) + cfg.label_smoothing / num_classes

    def softmax_xent(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if target.ndim == 1:
            return F.cross_entropy(logits, target, label_smoothing=cfg.label_smoothing)
        return torch.sum(-target * F.log_softmax(logits, dim=-1), dim=-1).mean()

    def sigmoid_xent(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # Summed over classes, averaged over the batch (big_vision's sigmoid_xent).
        per_class = F.binary_cross_entropy_with_logits(logits, soft_targets(target), reduction="none")
        return per_class.sum(-1).mean()

    return softmax_xent if cfg.loss == "softmax" else sigmoid_xent


def _try_resume(job: Job, model, optimizer, dist: Dist) -> int:
    """Load the checkpoint the job resumes from, if any; return the step to continue from (0: a fresh run)."""
    if job.resume_from is None:
        return 0
    path, saved = job.resume_from
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    torch.set_rng_state(saved["rng"])
    if dist.is_main:
        console.log(f"resuming from {path} at step {saved['step']}")
    return int(saved["step"])


def _save_state(job: Job, model, optimizer, step: int) -> None:
    """A checkpoint of everything resuming needs (state.STATE_KEYS); the oldest beyond run.keep_checkpoints go."""
    snapshot = {
        "step": step,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "rng": torch.get_rng_state(),
        "recipe": to_dict(job.recipe),
    }
    state.save_checkpoint(job.workdir, snapshot, job.recipe.run.keep_checkpoints)


def _evaluate(evaluators: list[Evaluator], model) -> dict[str, float]:
    return {name: value for ev in evaluators for name, value in ev.run(model)}


def train(job: Job, dist: Dist) -> dict[str, float]:
    """Run (or resume) training to job.total_steps; write state, metrics and final weights; return metrics."""
    r = job.recipe
    model = job.model.to(dist.device)
    optimizer = build_optimizer(model, r.optim)
    start = _try_resume(job, model, optimizer, dist)
    ddp_model = wrap(model, dist)
    ddp_model = torch.compile(ddp_model) if r.run.compile else ddp_model  # `model` stays the one saved/exported
    accum = accumulation_steps(r, dist.world_size)
    micro = r.data.batch_size // (accum * dist.world_size)
    criterion = loss_fn(r.optim, job.num_classes)
    mixup = batches.build_mixup(r.data, job.num_classes, r.optim.label_smoothing)
    stream = batches.train_batches(
        job.train_ds, r.data, r.model.img_size, micro, r.run.seed, start * accum, dist.rank, dist.world_size
    )
    trackers = open_trackers(r.run.loggers, job.workdir, start, to_dict(r)) if dist.is_main else []
    metrics = MetricsLog(job.workdir / METRICS_FILE, start, enabled=dist.is_main, trackers=trackers)
    ddp_model.train()
    window = _Window(time.perf_counter(), 0, {})
    with progress_bar(dist.is_main) as bar, StopRequest() as stop:
        task = bar.add_task("train", total=job.total_steps, completed=start, stats="")
        for step in range(start, job.total_steps):
            lr = _set_lr(optimizer, r, step, job.total_steps)
            objective = _objective(r, criterion, mixup, dist.rank, step)
            loss, accuracy = _accumulate_grads(ddp_model, optimizer, stream, accum, objective, r, dist)
            if not math.isfinite(loss):  # checked before the update, so no NaN reaches the weights
                raise TrainingError(
                    f"loss became {loss} at step {step}; the last good checkpoint is kept in {job.workdir} "
                    f"(try a lower optim.lr or optim.clip_grad_norm=1)"
                )
            grad_norm = _clip(ddp_model, r.optim.clip_grad_norm)
            optimizer.step()
            done = step + 1
            row = {"train/loss": loss, "train/lr": lr, "train/grad_norm": grad_norm}
            _log(window, metrics, bar, task, done, job, row if accuracy is None else
                 {**row, "train/mpp_accuracy": accuracy})
            saved = _periodic(job, model, optimizer, metrics, done, dist)
            signum = agreed_stop(stop, dist)
            if signum:
                if dist.is_main and not saved:
                    _save_state(job, model, optimizer, done)
                raise interrupted(signum, done, job.total_steps, job.workdir)
    final = _evaluate([ev for _, ev in job.evaluators] + job.final_evaluators, model)
    if final:
        metrics.write(job.total_steps, final)
    metrics.close()
    if dist.is_main:
        files.save_weights(
            job.workdir / files.MODEL_FILE, exported(model).state_dict(),
            {"recipe": to_dict(r), "model": job.model_meta},
        )
    return {**window.last, **final, "data/skipped_images": stream.skipped.total}  # this rank's count


@dataclass
class _Window:
    """Throughput since the last logged step, and the last logged train metrics."""

    start: float
    images: int
    last: dict


def _set_lr(optimizer, r: Recipe, step: int, total_steps: int) -> float:
    lr = learning_rate(step, peak_lr=r.optim.lr, total_steps=total_steps, warmup_steps=r.schedule.warmup_steps,
                       decay=r.schedule.decay, end_lr=r.schedule.end_lr)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def _log(window: _Window, metrics: MetricsLog, bar, task, done: int, job: Job, row: dict) -> None:
    """Every run.log_every steps (and at the end): a metrics.jsonl row and the progress bar's stats."""
    window.images += job.recipe.data.batch_size
    if done % job.recipe.run.log_every == 0 or done == job.total_steps:
        elapsed = time.perf_counter() - window.start
        window.last = {**row, "train/img_per_s": window.images / max(elapsed, 1e-9)}
        metrics.write(done, window.last)
        window.start, window.images = time.perf_counter(), 0
        stats = f"loss {row['train/loss']:.4f}  lr {row['train/lr']:.2e}  {window.last['train/img_per_s']:.0f} img/s"
        bar.update(task, stats=stats)
    bar.update(task, completed=done)


def _periodic(job: Job, model, optimizer, metrics: MetricsLog, done: int, dist: Dist) -> bool:
    """Evaluators due at this step (the last step's run after the loop) and the resumable checkpoint; True
    when a checkpoint was written."""
    due = [ev for every, ev in job.evaluators if every and done % every == 0 and done != job.total_steps]
    if due:
        results = _evaluate(due, model)
        metrics.write(done, results)
        console.log(f"step {done}: " + "  ".join(f"{k} {v:.4f}" for k, v in results.items()))
    due = done % job.recipe.run.ckpt_every == 0 or done == job.total_steps
    if dist.is_main and due:
        _save_state(job, model, optimizer, done)
    return due


def _objective(r: Recipe, criterion, mixup, rank: int, step: int):
    """This step's loss(model, x, y, micro) -> (loss, accuracy or None): supervised or masked patch prediction.

    Random draws outside the data pipeline get their own stream per (seed, rank, step, micro-batch), as the
    augmentation does: timm's Mixup would otherwise draw from numpy's global RNG, and the corruption of
    masked patch prediction from torch's; so runs repeat and resume exactly.
    """

    def seed(micro: int, purpose: int) -> int:
        return int(np.random.SeedSequence([r.run.seed, rank, step, micro, purpose]).generate_state(1)[0])

    def supervised(model, x, y, micro):
        if mixup is not None:
            with seeded(seed(micro, MIXUP_STREAM)):
                x, y = mixup(x, y)
        return criterion(model(x).float(), y), None

    def masked_patches(model, x, y, micro):
        return mpp_step(model, x, seed(micro, MPP_STREAM), r.mpp.target)

    return masked_patches if r.objective == "mpp" else supervised


def _accumulate_grads(ddp_model, optimizer, stream, accum: int, objective, r: Recipe, dist: Dist):
    """Gradients of one optimizer step over `accum` micro-batches; (loss, accuracy or None), averaged over
    micro-batches and processes."""
    optimizer.zero_grad(set_to_none=True)
    loss_sum = accuracy_sum = 0.0
    for i in range(accum):
        x, y = next(stream)
        x, y = x.to(dist.device, non_blocking=True), y.to(dist.device, non_blocking=True)
        # DDP syncs gradients only on the last micro-batch; the others just accumulate locally.
        sync = i == accum - 1 or dist.world_size == 1
        with ddp_model.no_sync() if not sync else contextlib.nullcontext():
            with autocast(dist.device, r.run.precision):
                loss, accuracy = objective(ddp_model, x, y, i)
            (loss / accum).backward()
        loss_sum += loss.item() / accum
        accuracy_sum += float(accuracy) / accum if accuracy is not None else math.nan
    loss_mean, accuracy_mean = all_reduce_sum([loss_sum / dist.world_size, accuracy_sum / dist.world_size], dist)
    return loss_mean, None if math.isnan(accuracy_mean) else accuracy_mean


def _clip(model, max_norm: float) -> float:
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
    return float(norm)
