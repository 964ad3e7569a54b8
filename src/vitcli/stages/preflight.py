"""`vit pretrain --preflight` (and `vit finetune --preflight`): what a training run will cost, measured on the
run itself before committing to it.

A few real steps of the run as the command would start it (stages.run.build_job: the real data, model,
micro-batch, precision and loader workers; train.loop.train: the one loop) in a throwaway folder beside the
workdir, on the file system the run would write to, removed on every way out (an error, Ctrl-C, SIGTERM);
the workdir itself is never created or touched. The loop runs a warm-up window and the measured steps,
writes one real checkpoint, runs each of the run's evaluators once (a held-out split larger than
EVAL_BATCHES batches on that many, its time scaled to the split) and saves the final model: every cost of
the run is met once and timed, and the whole run is modelled as (`eta_seconds`)

    fixed       everything the run does once: start-up (imports, data, model, loader workers), the warm-up
                steps' extra time (compilation, first batches), the final save and the wind-down; measured
                as this process's age at the end less the parts below (`fixed_seconds`)
  + steps x one step's time over the steady logging windows (`steady`)
  + each evaluator's runs in the schedule x one run's time (`evaluations`)
  + the checkpoint writes of the schedule x one write's time (`checkpoint_writes`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import shutil
import signal
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.table import Table

from vitcli.data.batching.batches import cache_capacity
from vitcli.data.decoding.image_cache import CACHE_ENCODED_BYTES, encoded_bytes
from vitcli.errors import Interrupted
from vitcli.evaluators.heldout import SplitEvaluator
from vitcli.figures import curves
from vitcli.recipe.cluster_checks import procs_per_node, time_limit_seconds
from vitcli.recipe.schema import Recipe
from vitcli.runtime import threads
from vitcli.runtime.dist import Dist, all_gather, all_reduce_max, setup
from vitcli.runtime.metrics import console, pairs_table, read_metrics, stdout
from vitcli.runtime.precision import resolved, resolved_compile
from vitcli.runtime.run_files import METRICS_FILE, MODEL_FILE, RUN_OUTPUTS
from vitcli.runtime.workdir import check_workdir, check_writable, existing_ancestor
from vitcli.stages.run import build_job, utilisation
from vitcli.train.loop import Job, train
from vitcli.train.throughput import feeding, input_bound

WINDOWS = 4  # logging windows the measured steps fall into: enough to tell a slow leading one
SLOW = 1.5  # a leading window this much slower per step than the median of the later ones is warm-up still
EVAL_BATCHES = 8  # a held-out split of more eval batches (per process) is timed on this many, then scaled
PREFIX = ".vit-preflight-"  # the throwaway folder's name; one left by a SIGKILL is safe to delete


# ---------------------------------------------------------------- the arithmetic, pure


def plan(steps: int) -> tuple[int, int]:
    """(run.log_every, steps to run): at least `steps` measured in WINDOWS logging windows, after one more
    window of warm-up (the first step, compilation, the loader workers' start)."""
    every = max(1, math.ceil(steps / WINDOWS))
    return every, every * (math.ceil(steps / every) + 1)


def windows(rows: list[dict], batch: int) -> list[tuple[float, float, int]]:
    """(seconds, seconds waiting for data, steps) of each logging window from metrics.jsonl's train rows
    (train/img_per_s and train/data_wait of the window ending at `step`; `batch` images per step)."""
    out, last = [], 0
    for row in rows:
        if "train/img_per_s" in row:
            steps = row["step"] - last
            seconds = steps * batch / row["train/img_per_s"]
            out.append((seconds, seconds * row["train/data_wait"], steps))
            last = row["step"]
    return out


def steady(found: list[tuple[float, float, int]]) -> tuple[float, float, int]:
    """(seconds per step, share of them waiting for data, steps) over the windows after the warm-up: the
    first window, and the second too if it is still SLOW x slower per step than the median of the later
    ones (a recompilation at the second step). No more: on a busy machine a slow window is the run's too."""
    rest = found[1:] or found
    if len(rest) > 2 and _per_step(rest[0]) > SLOW * statistics.median(map(_per_step, rest[1:])):
        rest = rest[1:]
    seconds, waited, steps = (sum(w[i] for w in rest) for i in range(3))
    return seconds / steps, waited / max(seconds, 1e-12), steps


def _per_step(window: tuple[float, float, int]) -> float:
    return window[0] / window[2]


def evaluations(total: int, every: int) -> int:
    """Runs of an evaluator due every `every` steps (0: at the end only) in a schedule of `total` steps, as
    train.loop runs them: at each multiple before the last step, and once after it."""
    return (total - 1) // every + 1 if every else 1


def checkpoint_writes(total: int, every: int, minutes: float, step_s: float) -> int:
    """Checkpoints a schedule of `total` steps writes (train.loop): every `every` steps and at the last, and
    between those whenever `minutes` have passed since the last (run.ckpt_every_minutes; 0: never) at
    `step_s` seconds a step, the clock starting again at each write."""
    by_step = total // every + (1 if total % every else 0)
    if not minutes or step_s <= 0:
        return by_step
    gap = math.ceil(minutes * 60 / step_s)  # steps after a write at which the clock is due again
    full, rest = divmod(total, every)
    # a stretch of k steps that ends in a write by step has (k - 1) // gap timed ones before that write
    return by_step + full * ((every - 1) // gap) + ((rest - 1) // gap if rest else 0)


def fixed_seconds(age: float, steps_run: int, step_s: float, evaluating: float, saving: float) -> float:
    """What a run spends once (start-up, warm-up's extra, final save, wind-down): the preflight process's
    `age` when done less its steps at the steady time and what it spent evaluating and checkpointing."""
    return max(0.0, age - steps_run * step_s - evaluating - saving)


def eta_seconds(fixed: float, steps: int, step_s: float, evals: list[tuple[int, float]], writes: int,
                write_s: float) -> float:
    """The whole run's seconds: `fixed` + its steps + (runs, seconds of one run) of each evaluator + its
    checkpoint writes."""
    return fixed + steps * step_s + sum(n * s for n, s in evals) + writes * write_s


def disk_needed(state_bytes: int, keep: int, model_bytes: int) -> int:
    """Bytes a run's workdir needs at most: run.keep_checkpoints states and one being written, and the final
    model (stages.run.checkpoint_bytes estimates the same from the parameter count)."""
    return (keep + 1) * state_bytes + model_bytes


def requeues(eta: float, startup: float, limit: float, signal_s: float) -> int | None:
    """Requeues a SLURM time limit of `limit` seconds implies: each job segment pays the start-up again and
    stops slurm.signal_seconds before its limit, so gives the run's work (eta - startup) limit - signal_s -
    startup seconds; None when that is nothing (the run could never advance)."""
    useful = limit - signal_s - startup
    if useful <= 0:
        return None
    return max(0, math.ceil((eta - startup) / useful) - 1)


def cache_growth_mb(held_mb: float, images: int, rows: int, capacity_mb: float) -> float:
    """MiB the decoded-image cache still grows after a preflight that left it holding `images` images in
    `held_mb`: it fills to the split's `rows` images, or to its capacity (data.cache_mb)."""
    if not images:
        return 0.0
    return max(0.0, min(capacity_mb, held_mb / images * rows) - held_mb)


def cache_knob(cache_mb: int, on: bool, on_disk: int) -> str | None:
    """data.cache_mb's advice for an input-bound run whose train images take `on_disk` bytes: keep them
    decoded after the first epoch where the cache would take them (image_cache.cache_for) but is off."""
    if on or on_disk > CACHE_ENCODED_BYTES:
        return None
    if cache_mb <= 0:
        return "data.cache_mb=1024 (the decoded-image cache is off: every epoch decodes every image again)"
    return (f"data.cache_mb={math.ceil(on_disk / 2**20) * 4} or more (now {cache_mb}: too small for the "
            f"{on_disk / 2**20:.0f} MiB of images, which are decoded again every epoch)")


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
class Measured:
    """What the short run found."""

    recipe: Recipe  # the run's
    job: Job  # the short run's: its recipe logs in windows and writes no checkpoint but its last step's
    total_steps: int  # the run's schedule
    results: dict  # what train.loop.train returned, with utilisation's MFU
    evaluators: list[Timed]
    rows: list[dict]  # its metrics.jsonl
    state_bytes: int  # the one checkpoint it wrote
    model_bytes: int
    age: float  # this process's seconds when all was done


def probe(r: Recipe, steps: int) -> Recipe:
    """The recipe of the short run: logging windows that split warm-up from steady steps, no checkpoint but
    the last step's (its time is known), no tracker (a W&B run would be made for it)."""
    every, run = plan(steps)
    return dataclasses.replace(r, run=dataclasses.replace(
        r.run, log_every=every, ckpt_every=run, ckpt_every_minutes=0.0, loggers=["jsonl"]))


def measure(r: Recipe, tmp: Path, dist: Dist, steps: int) -> Measured:
    """Build the run as `vit pretrain` does in `tmp`, run it for the planned steps with every evaluator once
    at the end, and collect what it cost."""
    torch.manual_seed(r.run.seed)
    job = build_job(probe(r, steps), tmp, dist)
    evaluators = [timed(ev, every, dist) for every, ev in job.evaluators]
    evaluators += [timed(ev, 0, dist) for ev in job.final_evaluators]
    short = dataclasses.replace(job, total_steps=plan(steps)[1], evaluators=[],
                                final_evaluators=list(evaluators))
    _announce(short, job.total_steps, tmp, dist)
    results = train(short, dist)
    results.update(utilisation(short, dist, results.get("train/img_per_s")))
    if dist.is_main:
        curves.write_run_curves(tmp)  # the real run draws them too: part of its wind-down
    states = [p for p in tmp.iterdir() if p.name not in RUN_OUTPUTS]
    return Measured(r, short, job.total_steps, results, evaluators, read_metrics(tmp / METRICS_FILE),
                    sum(map(_bytes, states)), _bytes(tmp / MODEL_FILE), process_age())


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


def _announce(short: Job, total: int, tmp: Path, dist: Dist) -> None:
    if dist.is_main:
        r, every = short.recipe, short.recipe.run.log_every
        console.log(f"preflight: {short.total_steps - every} steps timed after {every} of warm-up, of the "
                    f"{total} of {r.model.name} at {r.data.batch_size} a step, {r.run.precision}, "
                    f"{'compiled' if r.run.compile else 'eager'}, in {tmp} (removed after)")


# ---------------------------------------------------------------- the driver and its report


def preflight(recipe: Recipe, workdir: Path, *, steps: int) -> dict:
    """`--preflight`: join the process group, time the run in a throwaway folder beside `workdir` (never
    touched), print what the whole run will cost; returns those figures (what --json prints)."""
    dist = setup(recipe.run.device)
    check_workdir(workdir)
    recipe, _ = resolved(recipe, dist.device)  # the precision and compilation the run would get
    recipe, _ = resolved_compile(recipe, dist.device)
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
    r = m.recipe
    step_s, wait, timed_steps = steady(windows(m.rows, r.data.batch_size))
    saving = m.results.get("time/checkpoint_s", 0.0)  # the short run wrote one checkpoint
    fixed = fixed_seconds(m.age, m.job.total_steps, step_s, sum(ev.seconds for ev in m.evaluators), saving)
    runs = {ev.name: (evaluations(m.total_steps, ev.every), ev.seconds * ev.scale) for ev in m.evaluators}
    writes = checkpoint_writes(m.total_steps, r.run.ckpt_every, r.run.ckpt_every_minutes, step_s)
    eta = eta_seconds(fixed, m.total_steps, step_s, list(runs.values()), writes, saving)
    cuda = dist.device.type == "cuda"
    figures = {
        "stage": r.stage, "preflight/steps_run": m.job.total_steps, "preflight/steps_timed": timed_steps,
        "train/step_s": step_s, "train/img_per_s": r.data.batch_size / step_s, "train/data_wait": wait,
        "train/input_advice": input_advice(m, step_s, wait, timed_steps),
        "train/mfu": m.results.get("train/mfu"),
        **memory(m, dist), "schedule/steps": m.total_steps, "schedule/checkpoint_writes": writes,
        **{f"eval/{name}_runs": n for name, (n, _) in runs.items()},
        **{f"eval/{name}_s": s for name, (_, s) in runs.items()}, "time/checkpoint_s": saving,
        "eta/fixed_s": fixed, "eta/steps_s": m.total_steps * step_s,
        "eta/eval_s": sum(n * s for n, s in runs.values()), "eta/checkpoint_s": writes * saving,
        "eta/seconds": eta, "eta/processes": dist.world_size,
        "eta/gpu_hours": eta * dist.world_size / 3600 if cuda else None,
        **disk(m, workdir), **slurm(r, eta, fixed),
    }
    return figures


def input_advice(m: Measured, step_s: float, wait: float, steps: int) -> str | None:
    """train.throughput's warning for the timed steps (None while the wait is small), with data.cache_mb's
    advice where the decoded-image cache would help, or a note when the steps ran while it filled."""
    r, seconds = m.recipe, step_s * steps
    advice = input_bound(wait * seconds, seconds, steps * r.data.batch_size, feeding(r))
    if advice is None or r.data.streaming:
        return advice
    if "data/cache_images" in m.results:
        epoch = len(m.job.train_ds) // r.data.batch_size
        cold = m.job.total_steps < epoch
        return advice + (f" (timed while the decoded-image cache fills, in the first epoch of {epoch} steps: "
                         "later epochs decode nothing and wait less)" if cold else "")
    on_disk = encoded_bytes(m.job.train_ds, r.data.image_column, CACHE_ENCODED_BYTES)
    knob = cache_knob(r.data.cache_mb, False, on_disk)
    return advice + (f", {knob}" if knob else "")


def memory(m: Measured, dist: Dist) -> dict:
    """Peak resident MiB of the main process and of the largest loader worker (runtime.memory), with what
    the decoded-image cache will still grow by (in the process that reads it: the main one without workers),
    and the device's peak (CUDA: allocated by tensors, reserved by the caching allocator; None on a CPU)."""
    r, res = m.recipe, m.results
    growth = 0.0 if r.data.streaming else cache_growth_mb(
        res.get("data/cache_held_mb", 0.0), int(res.get("data/cache_images", 0)), len(m.job.train_ds),
        cache_capacity(r.data) / 2**20)
    main, worker = res["mem/main_peak_mb"], res.get("mem/worker_peak_mb")
    if r.data.num_workers == 0:
        main += growth
    elif worker is not None:
        worker += growth
    device = [None, None]
    if dist.device.type == "cuda":
        device = all_reduce_max([torch.cuda.max_memory_allocated(dist.device) / 2**20,
                                 torch.cuda.max_memory_reserved(dist.device) / 2**20], dist)
    return {"mem/main_peak_mb": main, "mem/worker_peak_mb": worker, "mem/cache_growth_mb": growth,
            "mem/device_allocated_mb": device[0], "mem/device_reserved_mb": device[1]}


def disk(m: Measured, workdir: Path) -> dict:
    """The checkpoint and model sizes written, what the run keeps of them, against the free space where the
    workdir would be (measured with the throwaway folder gone)."""
    needed = disk_needed(m.state_bytes, m.recipe.run.keep_checkpoints, m.model_bytes)
    free = shutil.disk_usage(existing_ancestor(workdir)).free
    return {"disk/checkpoint_bytes": m.state_bytes,
            "disk/checkpoints_kept": m.recipe.run.keep_checkpoints + 1, "disk/model_bytes": m.model_bytes,
            "disk/needed_bytes": needed, "disk/free_bytes": free,
            "disk/fits": needed <= free}


def slurm(r: Recipe, eta: float, fixed: float) -> dict:
    """slurm.time in seconds and the requeues it implies (None: no slurm.time, or a limit that leaves no
    time to train)."""
    limit = time_limit_seconds(r.slurm.time)
    return {"slurm/time_limit_s": limit or None,
            "slurm/requeues": requeues(eta, fixed, limit, r.slurm.signal_seconds) if limit else None}


def warnings(f: dict, r: Recipe, dist: Dist) -> list[str]:
    """What the run should change before it starts: an input-bound loader, a disk that cannot hold its
    checkpoints, a SLURM time limit too short or needing more requeues than slurm.max_requeues allows."""
    out = [f["train/input_advice"]] if f["train/input_advice"] else []
    if not f["disk/fits"]:
        out.append(f"the run needs {size(f['disk/needed_bytes'])} of disk ({f['disk/checkpoints_kept']} "
                   f"checkpoints and the model) but {size(f['disk/free_bytes'])} is free: free some, lower "
                   "run.keep_checkpoints or pick another --workdir")
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
    return (f"{duration(f['train/step_s'])}, {f['train/img_per_s']:.0f} img/s (timed over "
            f"{f['preflight/steps_timed']} of {f['preflight/steps_run']} steps){mfu}")


def _host(f: dict) -> str:
    worker = f["mem/worker_peak_mb"]
    workers = f"largest loader worker {worker:.0f} MiB" if worker is not None else "no loader workers"
    growth = f["mem/cache_growth_mb"]
    grown = f" (with the {growth:.0f} MiB the image cache still grows by)" if growth else ""
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
