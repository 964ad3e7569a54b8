"""Which rows and which random draws each training micro-batch gets: a pure function of (seed,
optimizer step, global micro-batch), never of the number of processes or workers, so a run resumes
exactly and trains the same on one process or several. The plain epoch order, DeiT's repeated
augmentation (step_rows), the rank's share of a step (micro_batch), the seed of every draw
(micro_seed) and each image's index in the run (first_sample). batches.py and streams.py load what
this decides."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import numpy as np

# windows (first, last) of optimizer steps whose batches a run skips, as metrics.jsonl numbers steps
# (from 1, inclusive), sorted and disjoint: recipe.rollback_checks.skip_windows reads them
Windows = tuple[tuple[int, int], ...]


def epoch_order(seed: int, epoch: int, n: int) -> np.ndarray:
    """The train split's rows in the order epoch `epoch` reads them: a permutation of (seed, epoch)
    alone."""
    return np.random.default_rng([seed, epoch]).permutation(n)


def train_keys(n: int, micro: int, accum: int, seed: int, start: int, rank: int, world_size: int,
                repeats: int = 1, permute: Callable[[int, int, int], np.ndarray] = epoch_order,
                by_sample: bool = False, skips: Windows = ()) -> Iterator:
    """Endless (augmentation seed, rows) keys of this rank's micro-batches, from its micro-batch
    `start` on; no image is touched. `by_sample`: the key's first element is the run-wide index of
    the micro-batch's first image (first_sample) instead of its seed, for a transform that draws
    per image (multicrop.py).

    Every optimizer step s takes one global batch of micro x accum x world_size rows of the epoch's
    order (`permute(seed, epoch, n)`, epoch_order unless a test injects another; drop_last), cut
    into global micro-batches j = 0, 1, ...; rank r computes j = r * accum + i for its i-th
    micro-batch. A micro-batch's rows and augmentation draws depend on (seed, s, j) only, so one
    process accumulating 2k micro-batches sees exactly the images two processes see with k each: the
    world size changes the float summation order of the gradient, nothing else. `repeats` k > 1 is
    DeiT's repeated augmentation (step_rows): an epoch is still n // global batch steps, so it reads
    about n / k distinct rows k times each, as DeiT's does. (DeiT rounds n down to a multiple of 256
    first, a constant of its ImageNet runs that would leave a split of fewer images no epoch at all;
    the two epochs agree whenever 256 divides the global batch.) `skips`: optimizer step s takes the
    batch of step batch_step(s, skips), its rows and its draws (a rollback's skip).
    """
    global_batch = micro * accum * world_size
    per_epoch = n // global_batch
    epoch, order = -1, None
    for k in itertools.count(start):
        step, j = micro_batch(k, accum, rank)
        step = batch_step(step, skips)
        e, b = divmod(step, per_epoch)
        if e != epoch:
            epoch, order = e, permute(seed, e, n)
        draws = (first_sample(step, j, micro, global_batch) if by_sample
                 else micro_seed(seed, step, j))
        yield draws, step_rows(order, b, j, micro, accum * world_size, repeats)


def step_rows(order: np.ndarray, b: int, j: int, micro: int, micro_batches: int, repeats: int) -> list[int]:
    """The rows of global micro-batch j (of `micro_batches` J of `micro` rows) in the epoch's step
    b.

    repeats 1: the step's global batch is the epoch order's next micro x J rows, j its j-th slice.
    repeats k > 1, DeiT's RASampler (samplers.py): the epoch reads the order with each row k times
    in a row (order[0] k times, then order[1] ...) and deals each global batch of it round-robin,
    position p to micro-batch p % J, as DeiT deals its sequence to the ranks
    (indices[rank::num_replicas]). Consecutive copies of a row so land in different micro-batches
    when k <= J; with one micro-batch per process (accumulation 1) that is DeiT's "each copy on
    another process". Each copy draws its own augmentation: another micro-batch seeds other draws
    (micro_seed), another position in one takes the next. DeiT pads its sequence to a multiple of
    the ranks; an epoch, at most n of its n x k entries, never reaches it. Written here rather than
    taken from timm's RepeatAugSampler (DeiT's, installed): a torch Sampler of one rank's share of
    an epoch knows no step or micro-batch, so it could neither keep a step's rows the same for any
    world size nor start mid-epoch; tests/unit/test_repeated_aug.py holds this rule to it.
    """
    if repeats == 1:
        first = (b * micro_batches + j) * micro
        return order[first : first + micro].tolist()
    # (micro,) in the sequence
    positions = b * micro * micro_batches + j + micro_batches * np.arange(micro)
    return order[positions // repeats].tolist()


def micro_batch(k: int, accum: int, rank: int) -> tuple[int, int]:
    """A rank's k-th micro-batch as (optimizer step, global micro-batch j): its i-th of a step is
    j = rank * accum + i, for map-style and streamed batches alike."""
    step, i = divmod(k, accum)
    return step, rank * accum + i


def micro_seed(seed: int, step: int, micro: int, purpose: int = 0) -> int:
    """The seed of one global micro-batch's random draws (augmentation: purpose 0; the trainer's
    mixup, dropout and masking use others), a function of (run seed, optimizer step, global
    micro-batch) alone."""
    return int(np.random.SeedSequence([seed, step, micro, purpose]).generate_state(1)[0])


def first_sample(step: int, micro: int, micro_size: int, batch_size: int) -> int:
    """The run-wide index of the first image of global micro-batch `micro` (of `micro_size` images)
    at optimizer `step`: step x batch + micro x micro_size, its position in the step's global batch
    after the steps before. An image's index so depends on neither the micro-batch size nor the rank
    that computes it (global micro-batch j holds positions j x micro_size onwards of the same global
    batch for any split; with data.repeated_aug > 1 the rows dealt to a position depend on the
    split, step_rows): the key of its per-image draws (MAE's mask, models.mae.mask_noise)."""
    return step * batch_size + micro * micro_size


def batch_step(step: int, skips: Windows = ()) -> int:
    """The optimizer step of a run without skips whose batch (rows and every random draw) optimizer
    `step` takes (both counted from 0) when the batches of `skips` are skipped: windows (first,
    last) of steps as metrics.jsonl numbers them (from 1, inclusive), sorted and disjoint
    (recipe.rollback_checks.skip_windows). Each window at or before the batch it has reached moves
    it past that window, in order: step 4 past (3, 5) takes the batch of step 7."""
    for first, last in skips:
        if step + 1 < first:
            break
        step += last - first + 1
    return step


def skipped(skips: Windows, start: int, end: int) -> Windows:
    """`skips` and the batches optimizer steps start+1 .. end (as metrics.jsonl numbers them) took,
    in one sorted list of disjoint windows (overlapping or adjacent ones merged: they skip the same
    batches): what a rollback from step `end` to a checkpoint of step `start` skips."""
    return merged(skips, (batch_step(start, skips) + 1, batch_step(end - 1, skips) + 1))


def merged(skips: Windows, *more: tuple[int, int]) -> Windows:
    """The windows of `skips` and `more` as one sorted list of disjoint windows, overlapping or
    adjacent ones merged (they skip the same batches)."""
    out: list[tuple[int, int]] = []
    for first, last in sorted({*skips, *more}):
        if out and first <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(last, out[-1][1]))
        else:
            out.append((first, last))
    return tuple(out)
