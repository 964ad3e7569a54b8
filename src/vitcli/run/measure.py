"""`--preflight`'s measurement: a few real steps of the run as the command would start it
(run.build.build_job: the real data, model, micro-batch, precision and loader workers;
train.loop.train: the one loop) in a throwaway folder (stages.preflight makes it). The short run
trains a warm-up window and the timed steps, writes one real checkpoint, runs each of the run's
evaluators once (a held-out split larger than EVAL_BATCHES batches on that many, its time scaled to
the split) and saves the final model, so every cost of the run is met once and timed (run.estimate
turns that into the whole run's). Two things a few steps would get wrong are set right:
- a split the decoded-image cache keeps is decoded in the run's first epoch only: the short run
  trains on a sample of it whose first epoch ends halfway through the timed steps, which so time
  both;
- steady steps timed for less than TIMED_S (fast steps, a busy machine's bursts) are timed on for
  longer, in a second short run after the first, whose time is left out of the ETA.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from vitcli.data.batching.batches import cache_capacity
from vitcli.data.decoding.decode import encoded
from vitcli.data.decoding.image_cache import CACHE_ENCODED_BYTES, cache_for, encoded_bytes
from vitcli.evaluators.heldout import SplitEvaluator
from vitcli.figures import curves
from vitcli.recipe.schema import Recipe, micro_batches
from vitcli.run.build import build_job, checkpoint_bytes, utilisation
from vitcli.run.feed import train_feed
from vitcli.runtime.dist import Dist, all_reduce_max
from vitcli.runtime.metrics import console, read_metrics
from vitcli.runtime.run_files import METRICS_FILE, MODEL_FILE, RUN_OUTPUTS
from vitcli.train import cost
from vitcli.train.cost import Window
from vitcli.train.loop import Job, train

# a held-out split of more eval batches (per process) is timed on this many, then scaled
EVAL_BATCHES = 8
# seconds of steady steps timed at least: where the short run's took less, more steps follow
TIMED_S = 10.0


class Timed:
    """One of the run's evaluators, timed (`seconds`, every call: with an EMA the loop runs it
    twice, on either weights, per evaluation); `scale` is its split's rows over those it is timed
    on."""

    def __init__(self, name: str, evaluator, every: int, scale: float = 1.0):
        self.name, self.evaluator, self.every, self.scale = name, evaluator, every, scale
        self.seconds = 0.0

    def run(self, model: torch.nn.Module) -> Iterator[tuple[str, float]]:
        """The evaluator's metrics, all computed before returning, so the time is the whole
        evaluation's."""
        t0 = time.perf_counter()
        found = list(self.evaluator.run(model))
        self.seconds += time.perf_counter() - t0
        return iter(found)


def timed(ev, every: int, dist: Dist) -> Timed:
    """`ev` timed; a held-out split larger than EVAL_BATCHES eval batches per process cut to that
    many."""
    if not isinstance(ev, SplitEvaluator):
        return Timed("fewshot", ev, every)
    rows, sample = len(ev.ds), EVAL_BATCHES * ev.cfg.eval_batch_size * dist.world_size
    if rows <= sample:
        return Timed(ev.prefix, ev, every)
    ev.ds = ev.ds.select(range(sample))
    return Timed(ev.prefix, ev, every, rows / sample)


@dataclass
class Split:
    """The run's train split as the preflight sees it: its rows (0 when streamed), the bytes its
    images take on disk as image_cache.cache_for counted them, and the step from which a short run's
    data are warm (0: no decoded-image cache, every step decodes)."""

    rows: int
    on_disk: int
    warm: int


@dataclass
class Measured:
    """What the short run found: numbers only, so that its job (model, data, loader workers,
    evaluators) is let go before another is built, as a run holds one."""

    recipe: Recipe  # the run's
    every: int  # the short run's logging window, in steps
    steps_run: int
    total_steps: int  # the run's schedule
    split: Split
    results: dict  # what train.loop.train returned, with utilisation's MFU
    # (name, due every, seconds, scale) of each evaluator
    evaluations: list[tuple[str, int, float, float]]
    metrics: list[dict]  # its metrics.jsonl
    state_bytes: int  # the one checkpoint it wrote
    # what the run's own check of the free space asks for (run.build.checkpoint_bytes)
    checked_bytes: int
    model_bytes: int
    # CUDA's peak allocated and reserved MiB, the most of any process ([None, None]: a CPU)
    device_mb: list
    age: float  # this process's seconds when all the run would do was done
    # steady windows of the second short run, if any
    more: list[Window] = field(default_factory=list)


def probe(r: Recipe, every: int, run: int) -> Recipe:
    """The recipe of a short run of `run` steps: logging windows of `every` steps that tell warm-up
    from steady steps, no checkpoint but the last step's (its time is known), no tracker (a W&B run
    would be made for it), no run.ckpt_dir (its upload would replace the run's own there)."""
    return dataclasses.replace(r, run=dataclasses.replace(
        r.run, log_every=every, ckpt_every=run, ckpt_every_minutes=0.0, loggers=["jsonl"],
        ckpt_dir=""))


def measure(r: Recipe, tmp: Path, dist: Dist, steps: int) -> Measured:
    """`short_run`, then more steady steps timed if it had too few."""
    m = short_run(r, tmp, dist, steps)
    gc.collect()  # the short run's job let go now, its loader workers stopped
    m.more = more_steps(m, tmp / "more", dist)  # after m.age: no part of the run's time
    return m


def short_run(r: Recipe, tmp: Path, dist: Dist, steps: int) -> Measured:
    """Build the run as `vit pretrain` does in `tmp`, train it for the planned steps with every
    evaluator once at the end, and collect what it cost."""
    every, run = cost.plan(steps)
    torch.manual_seed(r.run.seed)
    job = build_job(probe(r, every, run), tmp, dist)
    job, split = sampled(job, r, every, (run // every - 1) // 2, dist)
    evaluators = [timed(ev, due, dist) for due, ev in job.evaluators]
    evaluators += [timed(ev, 0, dist) for ev in job.final_evaluators]
    short = dataclasses.replace(job, total_steps=run, evaluators=[], final_evaluators=list(evaluators))
    _announce(short, job.total_steps, split, tmp, dist)
    results = train(short, dist)
    results.update(utilisation(short, dist, results.get("train/img_per_s")))
    if dist.is_main:
        curves.write_run_curves(tmp)  # the real run draws them too: part of its wind-down
    states = [p for p in tmp.iterdir() if p.name not in RUN_OUTPUTS]
    evaluations = [(ev.name, ev.every, ev.seconds, ev.scale) for ev in evaluators]
    return Measured(r, every, run, job.total_steps, split, results, evaluations,
                    read_metrics(tmp / METRICS_FILE), sum(map(_bytes, states)), checkpoint_bytes(short),
                    _bytes(tmp / MODEL_FILE), device_peaks(dist), process_age())


def sampled(job: Job, r: Recipe, every: int, cold_windows: int, dist: Dist) -> tuple[Job, Split]:
    """The job on a sample of its train split where the run keeps its images decoded
    (image_cache.cache_for decides, on the whole split): the run's first epoch decodes every image
    and the rest read the cache, so the short run's first epoch is cut to its warm-up window and
    `cold_windows` more (cost.cold_rows, rows spread over the split), and the later windows time the
    cache. Without a cache the job is unchanged."""
    cfg = r.data
    if cfg.streaming:
        return job, Split(0, 0, 0)
    images = encoded(job.train_ds.select_columns([cfg.image_column]), cfg.image_column)
    cache, on_disk = cache_for(images, cfg.image_column, cache_capacity(cfg))
    rows = len(job.train_ds)
    if cache is None:  # data.cache_mb=0 counts nothing: counted here, for the advice to turn it on
        on_disk = on_disk or encoded_bytes(images, cfg.image_column, CACHE_ENCODED_BYTES)
        return job, Split(rows, on_disk, 0)
    sample = min(rows, cost.cold_rows(every, cold_windows, cfg.batch_size, cfg.repeated_aug))
    if sample < rows:
        picked = job.train_ds.select(np.linspace(0, rows - 1, sample).round().astype(int))
        job = dataclasses.replace(job, train_ds=picked, feed=train_feed(r, picked, job.num_classes))
    micro, accum = micro_batches(r, dist.world_size)
    return job, Split(rows, on_disk, cost.first_epoch_steps(sample, micro, accum, dist.world_size,
                                                            cfg.repeated_aug))


def more_steps(m: Measured, tmp: Path, dist: Dist) -> list[Window]:
    """Where the short run's steady steps took less than TIMED_S (fast steps; and a busy machine's
    bursts average out only over longer), the steady windows of a second short run long enough to
    make up the difference: the same job built again in `tmp`, its first epoch (a cached split's
    sample) its warm-up window, no evaluator."""
    r, batch = m.recipe, m.recipe.data.batch_size
    cold, warm = cost.timed_windows(cost.windows(m.metrics, batch), m.every, m.split.warm)
    step_s, timed = cost.rate(warm or cold)[0], sum(w[0] for w in warm)
    if timed >= TIMED_S:
        return []
    every, run = cost.plan(math.ceil((TIMED_S - timed) / step_s))
    tmp.mkdir(exist_ok=True)
    torch.manual_seed(r.run.seed)
    job, split = sampled(build_job(probe(r, every, run), tmp, dist), r, every, 0, dist)
    if dist.is_main:
        console.log(f"preflight: {run - every} more steps, to time {TIMED_S:.0f} s of steady ones")
    train(dataclasses.replace(job, total_steps=run, evaluators=[], final_evaluators=[]), dist)
    return cost.timed_windows(cost.windows(read_metrics(tmp / METRICS_FILE), batch), every, split.warm)[1]


def device_peaks(dist: Dist) -> list:
    """CUDA's peak MiB allocated by tensors and reserved by its caching allocator, the most of any
    process; [None, None] on a CPU."""
    if dist.device.type != "cuda":
        return [None, None]
    return all_reduce_max([torch.cuda.max_memory_allocated(dist.device) / 2**20,
                           torch.cuda.max_memory_reserved(dist.device) / 2**20], dist)


def _bytes(path: Path) -> int:
    """A file's size, or everything below a folder (a sharded checkpoint)."""
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size if path.exists() else 0


def process_age() -> float:
    """Seconds since this process started (Linux: /proc), so start-up counts its imports; elsewhere
    since this module was imported."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rpartition(")")[2].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _IMPORTED


_IMPORTED = time.perf_counter()


def _announce(short: Job, total: int, split: Split, tmp: Path, dist: Dist) -> None:
    if not dist.is_main:
        return
    r, every = short.recipe, short.recipe.run.log_every
    sample = (f"; {len(short.train_ds)} of the {split.rows} train images, so that from step {split.warm} "
              "they are read from the decoded-image cache as in the run's later epochs"
              if split.warm and len(short.train_ds) < split.rows else "")
    console.log(f"preflight: {short.total_steps - every} steps timed after {every} of warm-up, of the "
                f"{total} of {r.model.name} at {r.data.batch_size} a step, {r.run.precision}, "
                f"{'compiled' if r.run.compile else 'eager'}, in {tmp} (removed after){sample}")
