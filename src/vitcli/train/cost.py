"""What a whole training run will cost, from what a few steps of it cost: pure arithmetic for
`--preflight` (run/measure.py, run/estimate.py), each rule the loop's own (train.loop: when it
evaluates, when it writes a checkpoint, from which step its data come from the decoded-image cache),
tested against a step-by-step simulation.

The run is modelled as (`eta_seconds`)

    fixed       everything it does once: start-up (imports, data, model, loader workers), the warm-up steps'
                extra time (compilation, first batches), the final save and the wind-down; a
                preflight's process age at its end less the parts below (`fixed_seconds`)
  + its steps   the first epoch's decoding every image (of a split the decoded-image cache keeps), the rest
                at the steady time (`step_seconds`)
  + each evaluator's runs in the schedule (`evaluations`) x one run's time
  + its checkpoint writes (`checkpoint_writes`) x one write's time.
"""

from __future__ import annotations

import math
import statistics

from vitcli.data.decoding.image_cache import CACHE_ENCODED_BYTES

WINDOWS = 4  # logging windows the timed steps fall into: enough to tell a slow leading one
# the window after the warm-up this much slower a step than the median of the later ones: warm-up
SLOW = 1.5

# (seconds, seconds waiting for data, steps) of one logging window
Window = tuple[float, float, int]


def plan(steps: int) -> tuple[int, int]:
    """(run.log_every, steps to run): at least `steps` timed in WINDOWS logging windows, after one
    more window of warm-up (the first step, compilation, the loader workers' start)."""
    every = max(1, math.ceil(steps / WINDOWS))
    return every, every * (math.ceil(steps / every) + 1)


def windows(rows: list[dict], batch: int) -> list[Window]:
    """Each logging window of metrics.jsonl's train rows (train/img_per_s and train/data_wait of the
    window ending at `step`; `batch` images per step)."""
    out, last = [], 0
    for row in rows:
        if "train/img_per_s" in row:
            steps = row["step"] - last
            seconds = steps * batch / row["train/img_per_s"]
            out.append((seconds, seconds * row["train/data_wait"], steps))
            last = row["step"]
    return out


def timed_windows(found: list[Window], every: int, boundary: int = 0) -> tuple[list[Window], list[Window]]:
    """(cold, warm): the windows of `every` steps after the warm-up, those before the step
    `boundary` from which the data are read from the decoded-image cache (0: no cache, all warm) and
    those from it on. The warm-up is the first window, and the next too where it is still SLOW x
    slower per step than the median of the later ones of its kind (a recompilation at the second
    step); no more: on a busy machine a slow window is the run's too."""
    cold = [w for i, w in enumerate(found) if i and i * every < boundary]
    warm = [w for i, w in enumerate(found) if i and i * every >= boundary]
    first = cold or warm
    if len(first) > 2 and _per_step(first[0]) > SLOW * statistics.median(map(_per_step, first[1:])):
        del first[0]
    return cold, warm


def rate(found: list[Window]) -> tuple[float, float, int]:
    """(seconds per step, share of them waiting for data, steps) over the windows `found`."""
    seconds, waited, steps = (sum(w[i] for w in found) for i in range(3))
    return seconds / steps, waited / max(seconds, 1e-12), steps


def _per_step(window: Window) -> float:
    return window[0] / window[2]


def first_epoch_steps(rows: int, micro: int, accum: int, world: int, repeats: int) -> int:
    """Steps until every image of a cached split has been decoded once: the stream's warm_after in
    micro-batches (an epoch of repeated augmentation reads 1 / repeats of the rows), in steps as
    train.loop counts it."""
    return -(-(rows // (micro * world) * repeats) // accum)


def cold_rows(every: int, cold_windows: int, batch: int, repeats: int) -> int:
    """Rows of a cached split to train on so that their first epoch is the warm-up window and
    `cold_windows` more (each of `every` steps): those decode every image once, the later ones read
    the cache."""
    return max(batch, every * (1 + cold_windows) * batch // repeats)


def step_seconds(total: int, cold_steps: int, cold_s: float, warm_s: float, cached: float = 1.0) -> float:
    """Seconds of a schedule's `total` steps: the first `cold_steps` decode their images, the rest
    read them from the decoded-image cache, for the share `cached` of them it holds (data.cache_mb
    bounds it) and decode the others."""
    cold = min(total, cold_steps)
    return cold * cold_s + (total - cold) * (warm_s + (1 - cached) * (cold_s - warm_s))


def evaluations(total: int, every: int) -> int:
    """Runs of an evaluator due every `every` steps (0: at the end only) in a schedule of `total`
    steps, as train.loop runs them: at each multiple before the last step, and once after it."""
    return (total - 1) // every + 1 if every else 1


def checkpoint_writes(total: int, every: int, minutes: float, step_s: float) -> int:
    """Checkpoints a schedule of `total` steps writes (train.loop): every `every` steps and at the
    last, and between those whenever `minutes` have passed since the last (run.ckpt_every_minutes;
    0: never) at `step_s` seconds a step, the clock starting again at each write."""
    by_step = total // every + (1 if total % every else 0)
    if not minutes or step_s <= 0:
        return by_step
    gap = math.ceil(minutes * 60 / step_s)  # steps after a write at which the clock is due again
    full, rest = divmod(total, every)
    # a stretch of k steps that ends in a write by step has (k - 1) // gap timed ones before that
    # write
    return by_step + full * ((every - 1) // gap) + ((rest - 1) // gap if rest else 0)


def fixed_seconds(age: float, stepping: float, evaluating: float, saving: float) -> float:
    """What a run spends once (start-up, warm-up's extra, final save, wind-down): the preflight
    process's `age` at its end less what its steps take at the steady times (step_seconds) and what
    it spent evaluating and checkpointing."""
    return max(0.0, age - stepping - evaluating - saving)


def eta_seconds(fixed: float, stepping: float, evals: list[tuple[int, float]], writes: int,
                write_s: float) -> float:
    """The whole run's seconds: `fixed` + its steps' (step_seconds) + (runs, seconds of one run) of
    each evaluator + its checkpoint writes."""
    return fixed + stepping + sum(n * s for n, s in evals) + writes * write_s


def disk_needed(state_bytes: int, keep: int, model_bytes: int) -> int:
    """Bytes a run's workdir needs at most: run.keep_checkpoints states and one being written, and
    the final model (run.build.checkpoint_bytes estimates the same from the parameter count)."""
    return (keep + 1) * state_bytes + model_bytes


def requeues(eta: float, startup: float, limit: float, signal_s: float) -> int | None:
    """Requeues a SLURM time limit of `limit` seconds implies: each job segment pays the start-up
    again and stops slurm.signal_seconds before its limit, so gives the run's work (eta - startup)
    limit - signal_s - startup seconds; None when that is nothing (the run could never advance)."""
    useful = limit - signal_s - startup
    if useful <= 0:
        return None
    return max(0, math.ceil((eta - startup) / useful) - 1)


def cache_growth_mb(held_mb: float, images: int, rows: int, capacity_mb: float) -> float:
    """MiB the decoded-image cache still grows by after a run that left it holding `images` images
    in `held_mb`: it fills to the split's `rows` images, or to its capacity (data.cache_mb)."""
    if not images:
        return 0.0
    return max(0.0, min(capacity_mb, held_mb / images * rows) - held_mb)


def cached_share(held_mb: float, images: int, rows: int, capacity_mb: float) -> float:
    """The share of the split's `rows` images the decoded-image cache will hold (the others are
    decoded every epoch), from `images` decoded into `held_mb`; 1 when nothing was decoded into
    it."""
    if not images:
        return 1.0
    return min(1.0, capacity_mb / (held_mb / images * rows))


def cache_knob(cache_mb: int, on: bool, on_disk: int) -> str | None:
    """data.cache_mb's advice for an input-bound run whose train images take `on_disk` bytes: keep
    them decoded after the first epoch where the cache would take them (image_cache.cache_for) but
    is off."""
    if on or on_disk > CACHE_ENCODED_BYTES:
        return None
    if cache_mb <= 0:
        return "data.cache_mb=1024 (the decoded-image cache is off: every epoch decodes every image again)"
    return (f"data.cache_mb={math.ceil(on_disk / 2**20) * 4} or more (now {cache_mb}: too small for the "
            f"{on_disk / 2**20:.0f} MiB of images, which are decoded again every epoch)")
