"""`--preflight`'s estimate: the whole run's figures (step time, memory, ETA, disk, SLURM requeues)
from what its short run measured (run.measure), by train.cost's arithmetic."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

from vitcli.data.batching.batches import cache_capacity
from vitcli.recipe.cluster_checks import time_limit_seconds
from vitcli.recipe.schema import Recipe, micro_batches
from vitcli.run.measure import Measured
from vitcli.runtime.dist import Dist
from vitcli.runtime.peak import mfu
from vitcli.runtime.workdir import existing_ancestor
from vitcli.train import cost
from vitcli.train.throughput import feeding, input_bound


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
        **disk(m, workdir), **slurm(r, eta, fixed, steps["train/step_s"], saving),
    }


def stepping(m: Measured, dist: Dist) -> dict:
    """The step's figures: the steady step (the decoded-image cache read, if the run keeps one) and
    the first epoch's (decoding), the wait and its advice, MFU; what the run's steps take
    (eta/steps_s) and, under `own`, what the short run's took at those times."""
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
    """train.throughput's warning for the steady steps (None while the wait is small), with
    data.cache_mb's advice where the decoded-image cache would take the images but is off."""
    r, seconds = m.recipe, step_s * steps
    advice = input_bound(wait * seconds, seconds, steps * r.data.batch_size, feeding(r))
    if advice is None or r.data.streaming:
        return advice
    knob = cost.cache_knob(r.data.cache_mb, bool(m.split.warm), m.split.on_disk)
    return advice + (f", {knob}" if knob else "")


def memory(m: Measured) -> dict:
    """Peak resident MiB of the main process and of the largest loader worker (runtime.memory), with
    what the decoded-image cache will still grow by (in the process that reads it: the main one
    without workers), and the device's peak (CUDA: allocated by tensors, reserved by the caching
    allocator; None on a CPU)."""
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
    """The checkpoint and model sizes written, what the run keeps of them, against the free space
    where the workdir would be (measured with the throwaway folder gone)."""
    needed = cost.disk_needed(m.state_bytes, m.recipe.run.keep_checkpoints, m.model_bytes)
    free = shutil.disk_usage(existing_ancestor(workdir)).free
    return {"disk/checkpoint_bytes": m.state_bytes,
            "disk/checkpoints_kept": m.recipe.run.keep_checkpoints + 1, "disk/model_bytes": m.model_bytes,
            "disk/needed_bytes": needed, "disk/checked_bytes": m.checked_bytes, "disk/free_bytes": free,
            "disk/fits": max(needed, m.checked_bytes) <= free}


def slurm(r: Recipe, eta: float, fixed: float, step_s: float, saving: float) -> dict:
    """slurm.time in seconds and the requeues it implies (None: no slurm.time, or a limit that
    leaves no time to train); the shortest limit under which a job moves the run on, in whole
    minutes: its start-up, a step, a checkpoint and the warning's lead (a shorter one requeues
    without progress until the no-progress rule fails the job)."""
    limit = time_limit_seconds(r.slurm.time)
    least = fixed + step_s + saving + r.slurm.signal_seconds
    return {"slurm/time_limit_s": limit or None,
            "slurm/requeues": cost.requeues(eta, fixed, limit, r.slurm.signal_seconds) if limit else None,
            "slurm/least_time_limit_s": math.ceil(least / 60) * 60}
