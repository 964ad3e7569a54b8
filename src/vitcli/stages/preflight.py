"""`vit pretrain --preflight` (and `vit finetune --preflight`): what a training run will cost, measured on the
run itself before committing to it.

A few real steps of the run as the command would start it (stages.run.build_job: the real data, model,
micro-batch, precision and loader workers; train.loop.train: the one loop) in a throwaway folder beside the
workdir, on the file system the run would write to, removed on every way out (an error, Ctrl-C, SIGTERM);
the workdir itself is never created or touched. The short run trains a warm-up window and the timed steps,
writes one real checkpoint, runs each of the run's evaluators once (a held-out split larger than
EVAL_BATCHES batches on that many, its time scaled to the split) and saves the final model, so every cost
of the run is met once and timed; train.cost turns that into the whole run's. Two things a few steps would
get wrong are set right:
- a split the decoded-image cache keeps is decoded in the run's first epoch only: the short run trains on a
  sample of it whose first epoch ends halfway through the timed steps, which so time both;
- steady steps timed for less than TIMED_S (fast steps, a busy machine's bursts) are timed on for longer,
  in a second short run after the first, whose time is left out of the ETA.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from rich.table import Table

from vitcli.data.batching.batches import cache_capacity
from vitcli.data.decoding.decode import encoded
from vitcli.data.decoding.image_cache import CACHE_ENCODED_BYTES, cache_for, encoded_bytes
from vitcli.errors import Interrupted
from vitcli.evaluators.heldout import SplitEvaluator
from vitcli.figures import curves
from vitcli.recipe.cluster_checks import procs_per_node, time_limit_seconds
from vitcli.recipe.schema import Recipe, micro_batches
from vitcli.runtime import threads
from vitcli.runtime.dist import Dist, all_gather, all_reduce_max, setup
from vitcli.runtime.metrics import console, pairs_table, read_metrics, stdout
from vitcli.runtime.peak import mfu
from vitcli.runtime.precision import resolved, resolved_compile
from vitcli.runtime.run_files import METRICS_FILE, MODEL_FILE, RUN_OUTPUTS
from vitcli.runtime.workdir import check_workdir, check_writable, existing_ancestor
from vitcli.stages.run import build_job, checkpoint_bytes, train_feed, utilisation
from vitcli.train import cost, micro_batch
from vitcli.train.cost import Window
from vitcli.train.loop import Job, train
from vitcli.train.throughput import feeding, input_bound

EVAL_BATCHES = 8  # a held-out split of more eval batches (per process) is timed on this many, then scaled
TIMED_S = 10.0  # seconds of steady steps timed at least: where the short run's took less, more steps follow
PREFIX = ".vit-preflight-"  # the throwaway folder's name; one left by a SIGKILL is safe to delete


# ---------------------------------------------------------------- the measurement


class Timed:
    """One of the run's evaluators, timed (`seconds`, every call: with an EMA the loop runs it twice, on
    either weights, per evaluation); `scale` is its split's rows over those it is timed on."""

    def __init__(self, name: str, evaluator, every: int, scale: float = 1.0):
        self.name, self.evaluator, self.every, self.scale = name, evaluator, every, scale
        self.seconds = 0.0

    def run(self, model: torch.nn.Module) -> Iterator[tuple[str, float]]:
        """The evaluator's metrics, all computed before returning, so the time is the whole evaluation's."""
        t0 = time.perf_counter()
        found = list(self.evaluator.run(model))
        self.seconds += time.perf_counter() - t0
        return iter(found)


def timed(ev, every: int, dist: Dist) -> Timed:
    """`ev` timed; a held-out split larger than EVAL_BATCHES eval batches per process cut to that many."""
    if not isinstance(ev, SplitEvaluator):
        return Timed("fewshot", ev, every)
    rows, sample = len(ev.ds), EVAL_BATCHES * ev.cfg.eval_batch_size * dist.world_size
    if rows <= sample:
        return Timed(ev.prefix, ev, every)
    ev.ds = ev.ds.select(range(sample))
    return Timed(ev.prefix, ev, every, rows / sample)


@dataclass
class Split:
    """The run's train split as the preflight sees it: its rows (0 when streamed), the bytes its images take
    on disk as image_cache.cache_for counted them, and the step from which a short run's data are warm (0:
    no decoded-image cache, every step decodes)."""

    rows: int
    on_disk: int
    warm: int


@dataclass
class Measured:
    """What the short run found: numbers only, so that its job (model, data, loader workers, evaluators) is
    let go before another is built, as a run holds one."""

    recipe: Recipe  # the run's
    every: int  # the short run's logging window, in steps
    steps_run: int
    total_steps: int  # the run's schedule
    split: Split
    results: dict  # what train.loop.train returned, with utilisation's MFU
    evaluations: list[tuple[str, int, float, float]]  # (name, due every, seconds, scale) of each evaluator
    metrics: list[dict]  # its metrics.jsonl
    state_bytes: int  # the one checkpoint it wrote
    checked_bytes: int  # what the run's own check of the free space asks for (stages.run.checkpoint_bytes)
    model_bytes: int
    device_mb: list  # CUDA's peak allocated and reserved MiB, the most of any process ([None, None]: a CPU)
    age: float  # this process's seconds when all the run would do was done
    more: list[Window] = field(default_factory=list)  # steady windows of the second short run, if any


def probe(r: Recipe, every: int, run: int) -> Recipe:
    """The recipe of a short run of `run` steps: logging windows of `every` steps that tell warm-up from
    steady steps, no checkpoint but the last step's (its time is known), no tracker (a W&B run would be made
    for it)."""
    return dataclasses.replace(r, run=dataclasses.replace(
        r.run, log_every=every, ckpt_every=run, ckpt_every_minutes=0.0, loggers=["jsonl"]))


def measure(r: Recipe, tmp: Path, dist: Dist, steps: int) -> Measured:
    """`short_run`, then more steady steps timed if it had too few."""
    m = short_run(r, tmp, dist, steps)
    gc.collect()  # the short run's job let go now, its loader workers stopped
    m.more = more_steps(m, tmp / "more", dist)  # after m.age: no part of the run's time
    return m


def short_run(r: Recipe, tmp: Path, dist: Dist, steps: int) -> Measured:
    """Build the run as `vit pretrain` does in `tmp`, train it for the planned steps with every evaluator
    once at the end, and collect what it cost."""
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
    """The job on a sample of its train split where the run keeps its images decoded (image_cache.cache_for
    decides, on the whole split): the run's first epoch decodes every image and the rest read the cache, so
    the short run's first epoch is cut to its warm-up window and `cold_windows` more (cost.cold_rows, rows
    spread over the split), and the later windows time the cache. Without a cache the job is unchanged."""
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
    """Where the short run's steady steps took less than TIMED_S (fast steps; and a busy machine's bursts
    average out only over longer), the steady windows of a second short run long enough to make up the
    difference: the same job built again in `tmp`, its first epoch (a cached split's sample) its warm-up
    window, no evaluator."""
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
    """CUDA's peak MiB allocated by tensors and reserved by its caching allocator, the most of any process;
    [None, None] on a CPU."""
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
    """Seconds since this process started (Linux: /proc), so start-up counts its imports; elsewhere since
    this module was imported."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rpartition(")")[2].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _IMPORTED


_IMPORTED = time.perf_counter()


@contextlib.contextmanager
def throwaway(workdir: Path, dist: Dist) -> Iterator[Path]:
    """A new folder beside `workdir`, on the file system it would be made on, every rank told its path;
    removed with all it holds on every way out (a return, an error, Ctrl-C, SIGTERM: cli.entry unwinds)."""
    where = existing_ancestor(workdir.absolute().parent)
    check_writable(where / PREFIX, "--preflight's throwaway folder")
    made = tempfile.mkdtemp(prefix=PREFIX, dir=where) if dist.is_main else None
    try:
        yield Path(all_gather(made, dist)[0])
    finally:
        if made:
            shutil.rmtree(made, ignore_errors=True)


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


# ---------------------------------------------------------------- the driver and its report


def preflight(recipe: Recipe, workdir: Path, *, steps: int) -> dict:
    """`--preflight`: join the process group, time the run in a throwaway folder beside `workdir` (never
    touched), print what the whole run will cost; returns those figures (what --json prints)."""
    dist = setup(recipe.run.device)
    check_workdir(workdir)
    recipe, _ = resolved(recipe, dist.device)  # the precision and compilation the run would get
    recipe, _ = resolved_compile(recipe, dist.device)
    # and its micro-batch: data.micro_batch_size auto searched as a fresh run searches it (its time is the
    # run's start-up too)
    recipe = micro_batch.resolved(recipe, dist, None)
    shared = dist.device.type == "cpu" and threads.check(recipe.data.num_workers)
    try:
        with throwaway(workdir, dist) as tmp:
            found = measure(recipe, tmp, dist, steps)
    except Interrupted as e:  # the loop's checkpoint went with the folder: nothing to resume
        name = signal.Signals(e.exit_code - 128).name
        raise Interrupted(f"preflight stopped by {name}: its throwaway folder is removed, {workdir} "
                          "untouched", exit_code=e.exit_code) from None
    figures = estimate(found, workdir, dist)
    figures["warnings"] = ([shared] if shared else []) + warnings(figures, recipe, dist)
    if dist.is_main:
        for line in figures["warnings"]:
            console.log(f"[yellow]warning: {line}")
        stdout.print(report(figures))
    return figures


def estimate(m: Measured, workdir: Path, dist: Dist) -> dict:
    """The whole run's figures from the short run's (what the report shows and --json prints)."""
    r, steps = m.recipe, stepping(m, dist)
    saving = m.results.get("time/checkpoint_s", 0.0)  # the short run wrote one checkpoint
    fixed = cost.fixed_seconds(m.age, steps.pop("own"), sum(e[2] for e in m.evaluations), saving)
    runs = {name: (cost.evaluations(m.total_steps, due), seconds * scale)
            for name, due, seconds, scale in m.evaluations}
    writes = cost.checkpoint_writes(m.total_steps, r.run.ckpt_every, r.run.ckpt_every_minutes,
                                    steps["train/step_s"])
    eta = cost.eta_seconds(fixed, steps["eta/steps_s"], list(runs.values()), writes, saving)
    cuda = dist.device.type == "cuda"
    return {
        "stage": r.stage, **steps, **memory(m), "schedule/steps": m.total_steps,
        "schedule/checkpoint_writes": writes, **{f"eval/{name}_runs": n for name, (n, _) in runs.items()},
        **{f"eval/{name}_s": s for name, (_, s) in runs.items()}, "time/checkpoint_s": saving,
        "eta/fixed_s": fixed, "eta/eval_s": sum(n * s for n, s in runs.values()),
        "eta/checkpoint_s": writes * saving, "eta/seconds": eta, "eta/processes": dist.world_size,
        "eta/gpu_hours": eta * dist.world_size / 3600 if cuda else None,
        **disk(m, workdir), **slurm(r, eta, fixed),
    }


def stepping(m: Measured, dist: Dist) -> dict:
    """The step's figures: the steady step (the decoded-image cache read, if the run keeps one) and the
    first epoch's (decoding), the wait and its advice, MFU; what the run's steps take (eta/steps_s) and, under
    `own`, what the short run's took at those times."""
    r, res, world = m.recipe, m.results, dist.world_size
    found = cost.windows(m.metrics, r.data.batch_size)
    cold, warm = cost.timed_windows(found, m.every, m.split.warm)
    step_s, wait, timed = cost.rate(warm + m.more or cold)
    cold_s = cost.rate(cold)[0] if cold else step_s
    micro, accum = micro_batches(r, world)
    first = (cost.first_epoch_steps(m.split.rows, micro, accum, world, r.data.repeated_aug)
             if m.split.warm else 0)
    share = cost.cached_share(res.get("data/cache_held_mb", 0.0), int(res.get("data/cache_images", 0)),
                              m.split.rows, cache_capacity(r.data) / 2**20)
    return {"preflight/steps_run": m.steps_run, "preflight/steps_timed": timed,
            "data/micro_batch_size": micro, "data/accumulation": accum,
            "train/step_s": step_s, "train/img_per_s": r.data.batch_size / step_s,
            "train/first_epoch_step_s": cold_s if first else None, "train/first_epoch_steps": first,
            "train/data_wait": wait, "train/input_advice": input_advice(m, step_s, wait, timed),
            # over the steady step (utilisation's was over the short run's windows)
            "train/mfu": mfu(r.data.batch_size / step_s, res["train/flops_per_img"], res["train/peak_flops"])
            if "train/peak_flops" in res else None,
            "eta/steps_s": cost.step_seconds(m.total_steps, first, cold_s, step_s, share),
            "own": cost.step_seconds(m.steps_run, m.split.warm, cold_s, step_s)}


def input_advice(m: Measured, step_s: float, wait: float, steps: int) -> str | None:
    """train.throughput's warning for the steady steps (None while the wait is small), with data.cache_mb's
    advice where the decoded-image cache would take the images but is off."""
    r, seconds = m.recipe, step_s * steps
    advice = input_bound(wait * seconds, seconds, steps * r.data.batch_size, feeding(r))
    if advice is None or r.data.streaming:
        return advice
    knob = cost.cache_knob(r.data.cache_mb, bool(m.split.warm), m.split.on_disk)
    return advice + (f", {knob}" if knob else "")


def memory(m: Measured) -> dict:
    """Peak resident MiB of the main process and of the largest loader worker (runtime.memory), with what
    the decoded-image cache will still grow by (in the process that reads it: the main one without workers),
    and the device's peak (CUDA: allocated by tensors, reserved by the caching allocator; None on a CPU)."""
    r, res = m.recipe, m.results
    growth = 0.0 if r.data.streaming else cost.cache_growth_mb(
        res.get("data/cache_held_mb", 0.0), int(res.get("data/cache_images", 0)), m.split.rows,
        cache_capacity(r.data) / 2**20)
    main, worker = res["mem/main_peak_mb"], res.get("mem/worker_peak_mb")
    if r.data.num_workers == 0:
        main += growth
    elif worker is not None:
        worker += growth
    device = m.device_mb
    return {"mem/main_peak_mb": main, "mem/worker_peak_mb": worker, "mem/cache_growth_mb": growth,
            "mem/device_allocated_mb": device[0], "mem/device_reserved_mb": device[1]}


def disk(m: Measured, workdir: Path) -> dict:
    """The checkpoint and model sizes written, what the run keeps of them, against the free space where the
    workdir would be (measured with the throwaway folder gone)."""
    needed = cost.disk_needed(m.state_bytes, m.recipe.run.keep_checkpoints, m.model_bytes)
    free = shutil.disk_usage(existing_ancestor(workdir)).free
    return {"disk/checkpoint_bytes": m.state_bytes,
            "disk/checkpoints_kept": m.recipe.run.keep_checkpoints + 1, "disk/model_bytes": m.model_bytes,
            "disk/needed_bytes": needed, "disk/checked_bytes": m.checked_bytes, "disk/free_bytes": free,
            "disk/fits": max(needed, m.checked_bytes) <= free}


def slurm(r: Recipe, eta: float, fixed: float) -> dict:
    """slurm.time in seconds and the requeues it implies (None: no slurm.time, or a limit that leaves no
    time to train)."""
    limit = time_limit_seconds(r.slurm.time)
    return {"slurm/time_limit_s": limit or None,
            "slurm/requeues": cost.requeues(eta, fixed, limit, r.slurm.signal_seconds) if limit else None}


def warnings(f: dict, r: Recipe, dist: Dist) -> list[str]:
    """What the run should change before it starts: an input-bound loader, a disk that cannot hold its
    checkpoints, a SLURM time limit too short or needing more requeues than slurm.max_requeues allows."""
    out = [f["train/input_advice"]] if f["train/input_advice"] else []
    if not f["disk/fits"]:
        out.append(f"the run needs {size(f['disk/needed_bytes'])} of disk ({f['disk/checkpoints_kept']} "
                   f"checkpoints and the model; its check before it starts asks for "
                   f"{size(f['disk/checked_bytes'])}) but {size(f['disk/free_bytes'])} is free: free some, "
                   "lower run.keep_checkpoints or pick another --workdir")
    if f["slurm/time_limit_s"] is None:
        return out
    if f["slurm/requeues"] is None:
        out.append(f"slurm.time={r.slurm.time} leaves no time to train after the start-up "
                   f"({f['eta/fixed_s']:.0f} s) and slurm.signal_seconds={r.slurm.signal_seconds}")
    elif f["slurm/requeues"] > r.slurm.max_requeues:
        out.append(f"slurm.time={r.slurm.time} needs {f['slurm/requeues']} requeues, more than "
                   f"slurm.max_requeues={r.slurm.max_requeues}: raise either")
    procs = r.slurm.nodes * procs_per_node(r.slurm)
    if procs != dist.world_size:
        out.append(f"timed with {dist.world_size} process(es), while the slurm section asks for {procs}: "
                   "the step time, ETA and requeues there differ")
    return out


def report(f: dict) -> Table:
    """The figures as a two-column table."""
    title = f"preflight of {f['stage']}: the whole run in about {duration(f['eta/seconds'])}"
    return pairs_table(title, [(what, detail(f)) for what, detail in ROWS])


def _step(f: dict) -> str:
    mfu = f", MFU {f['train/mfu']:.1%}" if f["train/mfu"] is not None else ""
    first = (f"; the first epoch's {f['train/first_epoch_steps']} steps, decoding every image for the cache, "
             f"{duration(f['train/first_epoch_step_s'])}" if f["train/first_epoch_steps"] else "")
    return (f"{duration(f['train/step_s'])}, {f['train/img_per_s']:.0f} img/s (over "
            f"{f['preflight/steps_timed']} steady steps, micro-batches of {f['data/micro_batch_size']} x "
            f"{f['data/accumulation']}){mfu}{first}")


def _host(f: dict) -> str:
    worker = f["mem/worker_peak_mb"]
    workers = f"largest loader worker {worker:.0f} MiB" if worker is not None else "no loader workers"
    growth = f["mem/cache_growth_mb"]
    grown = f" (with the {growth:.0f} MiB the image cache still grows by)" if growth >= 0.5 else ""
    return f"main process {f['mem/main_peak_mb']:.0f} MiB, {workers}{grown}"


def _device(f: dict) -> str:
    if f["mem/device_allocated_mb"] is None:
        return "none (CPU)"
    return f"{f['mem/device_allocated_mb']:.0f} MiB allocated, {f['mem/device_reserved_mb']:.0f} MiB reserved"


def _schedule(f: dict) -> str:
    evals = [f"{f[k]} x {k[5:-5]} ({duration(f[k[:-5] + '_s'])})"
             for k in f if k.startswith("eval/") and k.endswith("_runs")]
    return (f"{f['schedule/steps']} steps, {', '.join(evals) or 'no evaluation'}, "
            f"{f['schedule/checkpoint_writes']} checkpoints ({duration(f['time/checkpoint_s'])} each)")


def _eta(f: dict) -> str:
    parts = {"start-up and wind-down": "fixed_s", "steps": "steps_s", "evaluations": "eval_s",
             "checkpoints": "checkpoint_s"}
    return f"{duration(f['eta/seconds'])}: " + ", ".join(f"{k} {duration(f['eta/' + v])}"
                                                         for k, v in parts.items())


def _gpu_hours(f: dict) -> str:
    if f["eta/gpu_hours"] is None:
        return "none (CPU)"
    return f"{f['eta/gpu_hours']:.2f} ({f['eta/processes']} processes)"


def _disk(f: dict) -> str:
    return (f"{f['disk/checkpoints_kept']} x {size(f['disk/checkpoint_bytes'])} checkpoints + "
            f"{size(f['disk/model_bytes'])} model = {size(f['disk/needed_bytes'])} of "
            f"{size(f['disk/free_bytes'])} free" + ("" if f["disk/fits"] else ": does NOT fit"))


def _requeues(f: dict) -> str:
    if f["slurm/time_limit_s"] is None:
        return "no slurm.time"
    if f["slurm/requeues"] is None:
        return "the time limit leaves no time to train"
    return f"{f['slurm/requeues']} (jobs of {duration(f['slurm/time_limit_s'])})"


ROWS = [("step", _step), ("waiting for data", lambda f: f"{f['train/data_wait']:.0%} of the time"),
        ("host memory", _host), ("device memory", _device), ("schedule", _schedule), ("ETA", _eta),
        ("GPU-hours", _gpu_hours), ("disk", _disk), ("SLURM requeues", _requeues)]


def duration(seconds: float) -> str:
    """0.0813 s, 7.25 s, 38 s, 12 min 5 s, 3 h 20 min."""
    if seconds < 10:
        return f"{seconds:.3g} s"
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds // 60:.0f} min {seconds % 60:.0f} s"
    return f"{seconds // 3600:.0f} h {seconds % 3600 // 60:.0f} min"


def size(n: float) -> str:
    """Bytes in binary units: 945 KiB, 1.2 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" or n >= 100 else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n} B"
