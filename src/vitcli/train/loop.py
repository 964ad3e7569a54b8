"""The one training loop. Pretrain and finetune differ in their recipes and starting weights, not
here.

Each optimizer step sees `data.batch_size` images: each process accumulates micro-batches (their
size and count from recipe.schema.micro_batches), summed (not averaged twice) across processes by
DDP, so the paper's batch of 4096 runs on a single small machine. Parallelism is applied before the
loop (train.parallelize.apply), and one CheckpointManager saves and resumes; the loop asks neither
which strategy nor which data kind it runs.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from vitcli.checkpoints.manager import Checkpoint, CheckpointManager
from vitcli.checkpoints.weights import save_weights
from vitcli.data.batching import sampler
from vitcli.recipe.layers import to_dict
from vitcli.recipe.schema import Recipe, micro_batches
from vitcli.runtime.dist import Dist, all_reduce_max
from vitcli.runtime.memory import CHILD_POLL_S, PeakMemory
from vitcli.runtime.metrics import MetricsLog, console, progress_bar
from vitcli.runtime.precision import autocast
from vitcli.runtime.run_files import METRICS_FILE, MODEL_FILE
from vitcli.runtime.trackers import open_trackers
from vitcli.train import parallelize
from vitcli.train.ema import WeightEma, ema_metric
from vitcli.train.interrupt import StopRequest, interrupted
from vitcli.train.optim import build_optimizer
from vitcli.train.rollback import Guard
from vitcli.train.schedule import learning_rate
from vitcli.train.throughput import Waited, feeding, input_bound
from vitcli.train.watchdog import Watchdog

log = logging.getLogger(__name__)
# purposes of sampler.micro_seed; 0 is the augmentation's
MIXUP_STREAM, MPP_STREAM, MODEL_STREAM = 1, 2, 3


class Evaluator(Protocol):
    """What the loop runs when due (the evaluators package holds them): something that measures a
    model and names what it measured (`val/top1`, `fewshot/x/5shot`)."""

    def run(self, model: torch.nn.Module) -> Iterator[tuple[str, float]]: ...


@dataclass(frozen=True)
class Draws:
    """Where the global micro-batch `micro` of optimizer step `step` draws its randomness: a seed
    per purpose (`draws(purpose)`: sampler.micro_seed of the run's `seed`), and the run's index of
    its first image; both of `batch`, the step whose batch it takes (sampler.batch_step: the step
    itself unless batches were skipped, -1 here)."""

    seed: int
    step: int
    micro: int
    batch_size: int
    batch: int = -1

    @property
    def drawn(self) -> int:
        """The step whose draws this micro-batch takes."""
        return self.step if self.batch < 0 else self.batch

    def __call__(self, purpose: int) -> int:
        return sampler.micro_seed(self.seed, self.drawn, self.micro, purpose)

    def first_sample(self, size: int) -> int:
        """The run's index of this micro-batch's first image, for a micro-batch of `size` images."""
        return sampler.first_sample(self.drawn, self.micro, size, self.batch_size)


class Objective(Protocol):
    """What the loop asks of the run's objective (the objectives package holds them), never which it
    is."""

    def loss(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, draws: Draws): ...

    whole_step: bool

    def before_step(self, xs: list, draws: list[Draws]) -> None: ...

    def before_update(self, model: torch.nn.Module, step: int) -> None: ...

    def after_step(self, model: torch.nn.Module, done: int) -> None: ...

    def logged(self, dist: Dist) -> dict[str, float]: ...

    def why_diverged(self) -> str: ...

    def exported(self, model: torch.nn.Module) -> torch.nn.Module: ...


class Feed(Protocol):
    """This rank's endless train micro-batches (x, y) of `micro` images, `accum` per optimizer step,
    from the first on: a stream the CheckpointManager places before its first batch and saves with
    each checkpoint (checkpoints.manager.TrainStream). It counts undecodable images in `skipped`."""

    def __call__(self, micro: int, accum: int, dist: Dist) -> Iterator: ...


@dataclass
class Job:
    """Everything a stage hands the loop."""

    recipe: Recipe
    workdir: Path
    model: torch.nn.Module
    objective: Objective  # its loss per micro-batch, what it updates after a step, what is exported
    train_ds: object  # datasets.Dataset, or datasets.IterableDataset when streamed
    feed: Feed  # this rank's train micro-batches, map-style or streamed: the stage chose
    num_classes: int
    total_steps: int
    model_meta: dict  # model spec stored with the weights so later stages rebuild the model
    # (every N steps; 0 = end only)
    evaluators: list[tuple[int, Evaluator]] = field(default_factory=list)
    final_evaluators: list[Evaluator] = field(default_factory=list)  # run once after the last step
    # (checkpoint path, its state) to continue from: checkpoints.manager
    resume_from: Checkpoint | None = None
    # told (step, metrics) after each periodic evaluation, once they are logged: a search's trial
    # reports them to its study. What it returns ends the run, raised once the step's checkpoint is
    # written and a Ctrl-C or a scheduler's signal has had its say (stages/search.py's pruning)
    on_eval: Callable[[int, dict], BaseException | None] | None = None




def _evaluate(evaluators: list[Evaluator], model, ema: WeightEma | None = None) -> dict[str, float]:
    """Every evaluator's metrics on the model's weights, then (with an EMA) on the EMA weights
    swapped in, named `val_ema/top1`, `fewshot_ema/<task>/<k>shot` (ema.ema_metric)."""
    if not evaluators:
        return {}
    results = _measure(evaluators, model)
    if ema is not None:
        with ema.swapped(model):
            results.update({ema_metric(k): v for k, v in _measure(evaluators, model).items()})
    return results


def _measure(evaluators: list[Evaluator], model) -> dict[str, float]:
    # sharded: each rank evaluates its rows with the whole weights
    with parallelize.gathered(model):
        return {name: value for ev in evaluators for name, value in ev.run(model)}


def train(job: Job, dist: Dist) -> dict[str, float]:
    """Train (or resume) to job.total_steps; write state, metrics, weights; return metrics."""
    r = job.recipe
    parallel = parallelize.apply(job.model.to(dist.device), r.run, dist)
    model, ddp_model = parallel.model, parallel.train  # `model`: saved, evaluated, exported
    optimizer = build_optimizer(model, r.optim)
    ema = WeightEma(model, r.ema) if r.ema.decay else None  # in the model's layout: after sharding
    micro, accum = micro_batches(r, dist.world_size)
    stream = job.feed(micro, accum, dist)  # this rank's, placed by the checkpoint if any
    checkpoints = CheckpointManager(job.workdir, r, dist, model, optimizer, stream, parallel.sharded,
                                    job.resume_from, ema)
    guard = Guard(r, job.workdir, dist, job.resume_from is not None, job.objective.why_diverged)
    step = start = checkpoints.load(guard.recorded)  # the skips its rollbacks recorded too
    # the host seconds spent in next(stream), for train/data_wait: no device sync (train.throughput:
    # why that is still the honest measure on CUDA)
    waited = Waited(stream)
    advise = functools.partial(input_bound, feeding=feeding(r))
    metrics = _metrics_log(job, start, dist)
    ddp_model.train()
    window = _Window(time.perf_counter(), 0, {}, warm=_warm(stream, accum), since=start)
    clock = _Clock(r.run.ckpt_every_minutes)
    newest = job.resume_from[0] if job.resume_from else None  # the newest checkpoint on disk
    with (progress_bar(dist.is_main) as bar, StopRequest() as stop, checkpoints.writing(),
          Watchdog(r.run, dist.rank, job.workdir) as watchdog):
        task = bar.add_task("train", total=job.total_steps, completed=start, stats="")
        while step < job.total_steps:
            done = step + 1
            watchdog.step(done)  # from here to the optimizer's step: watched for a hang
            lr = _set_lr(optimizer, r, step, job.total_steps)
            objective = _objective(job.objective, r, step, dist.rank * accum, checkpoints.skips)
            loss, accuracy = _accumulate_grads(parallel, optimizer, waited, accum, objective,
                                               r.run.precision, dist, job.objective.whole_step)
            signum, timed = _agree(stop, clock, dist, watchdog)
            save = bool(signum or timed) or done % r.run.ckpt_every == 0 or done == job.total_steps
            log = done % r.run.log_every == 0 or done == job.total_steps
            # read at log and checkpoint steps, before the update: a spike rolls back (rollback.py)
            values = guard.read([loss, accuracy], done, due=save or log)
            if values is not None and guard.check(values[0], done):
                step, metrics = guard.roll_back(done, values[0], checkpoints, metrics, newest, watchdog)
                continue
            grad_norm = _clip(ddp_model, r.optim.clip_grad_norm)
            _step(optimizer, model, ema, done, job.objective)
            watchdog.done()  # (and VITCLI_FAULTS' kill and crash, when planned for this step)
            window.images += r.data.batch_size
            if log:  # the objective's own terms too (DINO's)
                _log(window, waited.take(), advise, metrics, bar, task, done,
                     {**_row(values, lr, grad_norm), **job.objective.logged(dist)})
            bar.update(task, completed=done)
            ended = _periodic(job, model, ema, metrics, done)  # on_eval's end of the run, or None
            if save:
                newest = checkpoints.save(done)
                clock.reset()
            if signum or ended is not None:  # a signal first: its checkpoint is written, the run resumes
                raise interrupted(signum, done, job.total_steps, job.workdir) if signum else ended
            step = done
    final = _final_metrics(job, model, ema, metrics)
    _save_final(job, parallel, ema, dist)
    # this rank's count of skipped images; the throughput of the whole run after the warm-up window
    return {**window.last, **window.steady(), **final, "data/skipped_images": stream.skipped.total,
            **_footprint(window.memory, getattr(stream, "cache", None), dist), **checkpoints.spent()}


def _final_metrics(job: Job, model, ema: WeightEma | None, metrics: MetricsLog) -> dict[str, float]:
    """Every evaluator once after the last step (the periodic ones too), logged at that step;
    metrics.jsonl and the trackers closed."""
    final = _evaluate([ev for _, ev in job.evaluators] + job.final_evaluators, model, ema)
    if final:
        metrics.write(job.total_steps, final)
    metrics.close()
    return final


def _metrics_log(job: Job, start: int, dist: Dist) -> MetricsLog:
    """metrics.jsonl from step `start` on, and the recipe's trackers (rank 0 writes)."""
    r = job.recipe
    trackers = open_trackers(r.run, job.workdir, start, to_dict(r)) if dist.is_main else []
    return MetricsLog(job.workdir / METRICS_FILE, start, enabled=dist.is_main, trackers=trackers)


def _warm(stream, accum: int) -> int:
    """The step from which the data are warm (decoded from a cache, when the loader keeps one):
    waits before it are the first epochs' decoding, which the input-bound warning leaves out."""
    return -(-getattr(stream, "warm_after", 0) // accum)


def _footprint(memory: PeakMemory, cache, dist: Dist) -> dict[str, float]:
    """The peak resident MiB of the main process and of its largest loader worker, the most of any
    rank, and what the decoded-image cache held (data/decoding/image_cache.py), if the stream kept
    one."""
    memory.stop()  # the stream, and so its workers, still alive
    found = memory.metrics()
    found = dict(zip(found, all_reduce_max(list(found.values()), dist)))
    if cache is not None:
        held, images = cache.held()
        found.update({"data/cache_held_mb": held / 2**20, "data/cache_images": images})
    return found


class _Clock:
    """Minutes since the last checkpoint, against run.ckpt_every_minutes (0: never due)."""

    def __init__(self, minutes: float):
        self.seconds = minutes * 60
        self.reset()

    def reset(self) -> None:
        self.last = time.monotonic()

    def due(self) -> bool:
        return bool(self.seconds) and time.monotonic() - self.last >= self.seconds


def _agree(stop: StopRequest, clock: _Clock, dist: Dist, watchdog: Watchdog) -> tuple[int, bool]:
    """(the signal any rank received or 0, whether any rank's checkpoint clock ran out), the same on
    every rank: one small all-reduce on the CPU per step, so every rank saves and stops at the same
    step. A rank that never joins it is the watchdog's (VITCLI_FAULTS' hang sleeps just before)."""
    watchdog.before_agree()
    signum, timed = all_reduce_max([float(stop.signum), float(clock.due())], dist)
    return int(signum), bool(timed)


def _row(values: list, lr: float, grad_norm: torch.Tensor) -> dict[str, float]:
    loss, accuracy = values
    row = {"train/loss": loss, "train/lr": lr, "train/grad_norm": float(grad_norm)}
    return row if accuracy is None else {**row, "train/mpp_accuracy": accuracy}


@dataclass
class _Window:
    """Throughput since the last logged step, and the last logged train metrics; the logging windows
    after the first (warm-up: worker start-up, compilation) summed as [seconds, seconds waiting,
    images]."""

    start: float
    images: int
    last: dict
    logged: int = 0
    totals: list = field(default_factory=lambda: [0.0, 0.0, 0])
    warned: bool = False
    # the step from which the data are warm (decoded from the loader's cache, if it keeps one)
    warm: int = 0
    since: int = 0  # the step the current window began after
    # warm windows: the totals, then a count
    judged: list = field(default_factory=lambda: [0.0, 0.0, 0, 0])
    # the process's and its children's (loader workers, a held-out pass's too): sampled by a thread
    memory: PeakMemory = field(default_factory=lambda: PeakMemory(CHILD_POLL_S))

    def add(self, elapsed: float, wait: float, done: int) -> None:
        """Count a logging window ending at step `done` that ran `elapsed` seconds, `wait` of them
        waiting for data: into the steady totals after the first window, into the judged ones once
        it began warm."""
        if self.logged:
            self.totals = [self.totals[0] + elapsed, self.totals[1] + wait, self.totals[2] + self.images]
        if self.logged and self.since >= self.warm:
            seconds, waited, images, n = self.judged
            self.judged = [seconds + elapsed, waited + wait, images + self.images, n + 1]
        self.logged, self.since = self.logged + 1, done

    def steady(self) -> dict[str, float]:
        """train/img_per_s and train/data_wait over the run after warm-up (the last window's if only
        one)."""
        seconds, wait, images = self.totals
        if not seconds:
            return {}
        return {"train/img_per_s": images / seconds, "train/data_wait": wait / seconds}


def _set_lr(optimizer, r: Recipe, step: int, total_steps: int) -> float:
    """Set the schedule's lr at `step`, times each group's lr_scale, on the optimizer; return the
    lr."""
    lr = learning_rate(step, peak_lr=r.optim.lr, total_steps=total_steps,
                       warmup_steps=r.schedule.warmup_steps, decay=r.schedule.decay, end_lr=r.schedule.end_lr)
    # a layer's share under optim.layer_decay (train.optim.param_groups)
    wd = r.optim.weight_decay
    # optim.weight_decay_end: DINO's cosine from weight_decay, as its utils.cosine_scheduler (no
    # warm-up); each group keeps its own share of it (0 for those not decayed)
    scale = (learning_rate(step, peak_lr=wd, total_steps=total_steps, warmup_steps=0, decay="cosine",
                           end_lr=r.optim.weight_decay_end) / wd
             if r.optim.weight_decay_end >= 0 and wd > 0 else 1.0)
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
        if scale != 1.0 or "initial_weight_decay" in group:
            base = group.setdefault("initial_weight_decay", group["weight_decay"])
            group["weight_decay"] = base * scale
    return lr


def _log(window: _Window, wait: float, advise, metrics: MetricsLog, bar, task, done: int, row: dict) -> None:
    """Every run.log_every steps (and at the end): a metrics.jsonl row and the progress bar's stats;
    once two windows after warm-up are in, a warning the first time the loop waited too long for
    data over them all (`advise`: input_bound)."""
    elapsed = max(time.perf_counter() - window.start, 1e-9)
    window.last = {**row, "train/img_per_s": window.images / elapsed,
                   "train/data_wait": min(wait / elapsed, 1.0)}
    metrics.write(done, window.last)
    window.add(elapsed, wait, done)
    window.memory.sample()
    # judged on the steady windows together, from the second on: one window that met a slow batch (a
    # checkpoint written, the machine busy for a moment) is not a run that waits for its data
    seconds, waited, images, judged = window.judged
    warning = advise(waited, seconds, images) if judged >= 2 and not window.warned else None
    if warning:
        console.log(f"[yellow]warning: step {done}: {warning}")
        window.warned = True
    window.start, window.images = time.perf_counter(), 0
    stats = (f"loss {row['train/loss']:.4f}  lr {row['train/lr']:.2e}  "
             f"{window.last['train/img_per_s']:.0f} img/s")
    bar.update(task, stats=stats)


def _step(optimizer, model, ema: WeightEma | None, done: int, objective: Objective) -> None:
    """The objective's look at the clipped gradients, the optimizer's step, then the EMA's update
    with its result (timm's train.py order), then the objective's own (nothing, but for one with
    state of its own): step `done`."""
    objective.before_update(model, done - 1)
    optimizer.step()
    if ema is not None:
        ema.update(model, done)
    objective.after_step(model, done)


def _save_final(job: Job, parallel: parallelize.Parallel, ema: WeightEma | None, dist: Dist) -> None:
    """model.safetensors: the weights ema.save names (the trained ones, or the EMA swapped in), and
    its metadata saying which (`weights`), beside the recipe and the model spec."""
    which = job.recipe.ema.save
    with ema.swapped(parallel.model) if which == "ema" else contextlib.nullcontext():
        # every rank takes part: sharded weights are gathered; written inside, where they are the
        # EMA's
        weights = parallel.full_state(job.objective.exported(parallel.model))
        if dist.is_main:
            meta = {"recipe": to_dict(job.recipe), "model": job.model_meta, "weights": which}
            save_weights(job.workdir / MODEL_FILE, weights, meta)


def _periodic(job: Job, model, ema: WeightEma | None, metrics: MetricsLog,
              done: int) -> BaseException | None:
    """Evaluators due at this step (the last step's run after the loop), on the EMA weights too if
    any; what job.on_eval, told their metrics, returns to end the run with."""
    due = [ev for every, ev in job.evaluators if every and done % every == 0 and done != job.total_steps]
    if due:
        results = _evaluate(due, model, ema)
        metrics.write(done, results)
        console.log(f"step {done}: " + "  ".join(f"{k} {v:.4f}" for k, v in results.items()))
        if job.on_eval is not None:
            return job.on_eval(done, results)
    return None


def _objective(objective: Objective, r: Recipe, step: int, first_micro: int, skips: tuple = ()):
    """This step's loss(model, x, y, i) -> (loss, accuracy or None) for the rank's i-th micro-batch
    (global micro-batch first_micro + i): the objective's, whichever it is (supervised, beside a
    teacher if the recipe names one; masked patch prediction; MAE: the objectives package).

    Every random draw of the model's side gets its own seed per (run seed, step, global
    micro-batch), as the augmentation does (sampler.micro_seed, through Draws; of the step whose
    batch it takes past the `skips`: sampler.batch_step): Mixup and CutMix
    from a numpy Generator of their own (augmentations.mix), dropout and drop-path from torch's
    global RNG (pinned here for the call), the masking of masked patch prediction from its own
    generator. MAE's masks are drawn per image instead, from (run seed, the image's index in the
    run: Draws.first_sample), so they do not change with the micro-batch size either. So a run
    repeats exactly, resumes exactly, and trains the same with one process or several.
    """

    batch = sampler.batch_step(step, skips)

    def draws(i: int) -> Draws:
        return Draws(r.run.seed, step, first_micro + i, r.data.batch_size, batch)

    def loss(model, x, y, i):
        with seeded(draws(i)(MODEL_STREAM)):
            return objective.loss(model, x, y, draws(i))

    def before(xs: list) -> None:  # the objective's look at the whole step (whole_step)
        objective.before_step(xs, [draws(i) for i in range(len(xs))])

    loss.before = before
    return loss


def _accumulate_grads(parallel: parallelize.Parallel, optimizer, stream, accum: int, objective,
                      precision: str, dist: Dist, whole_step: bool = False):
    """Gradients of one optimizer step over `accum` micro-batches of `parallel.train`; (loss,
    accuracy or None) of this rank as 0-d tensors, averaged over its micro-batches, not read (no
    host-device sync). With `whole_step`, the step's micro-batches are all taken first and shown to
    the objective (objective.before)."""
    optimizer.zero_grad(set_to_none=True)
    loss_sum = accuracy_sum = None
    taken = [next(stream) for _ in range(accum)] if whole_step else None
    if taken is not None:
        with autocast(dist.device, precision):
            objective.before([x for x, _ in taken])
    for i in range(accum):
        # x on the run's device: the stream finished its uint8 batch there
        x, y = taken[i] if taken is not None else next(stream)
        y = y.to(dist.device, non_blocking=True)
        # DDP syncs gradients only on the last micro-batch; the others just accumulate locally.
        sync = i == accum - 1 or dist.world_size == 1
        with parallel.gradient_sync(sync):
            with autocast(dist.device, precision):
                loss, accuracy = objective(parallel.train, x, y, i)
            (loss / accum).backward()
        loss_sum = _add(loss_sum, loss.detach() / accum)
        accuracy_sum = _add(accuracy_sum, None if accuracy is None else torch.as_tensor(accuracy) / accum)
    return loss_sum, accuracy_sum


def _add(total, value):
    return value if total is None else total + value


def _clip(model, max_norm: float) -> torch.Tensor:
    """Clip the global gradient norm (no-op clip when 0); the norm before clipping, as a 0-d
    tensor."""
    return parallelize.clip_grad_norm(model, max_norm)


@contextlib.contextmanager
def seeded(seed: int):
    """Pin torch's global RNG, which dropout and drop-path draw from, to `seed` for the block, then
    restore it so the caller's own stream is untouched. (Nothing of training draws from python's or
    numpy's global RNGs: the augmentation and the mixing take Generators of their own.)"""
    saved = torch.get_rng_state()
    torch.manual_seed(seed)
    try:
        yield
    finally:
        torch.set_rng_state(saved)
