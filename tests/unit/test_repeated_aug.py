"""Repeated augmentation (data.repeated_aug), DeiT's RASampler inside the keyed sampler: a rank
reads the rows DeiT's sampler (transliterated) and timm's RepeatAugSampler give it for the same
permutation, each image k times an epoch with its copies in different micro-batches (on different
ranks when each takes one per step), the global sequence the same for any world size, resumed
exactly, each copy with its own draws."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import datasets
import numpy as np
import pytest
import torch
from PIL import Image
from timm.data.distributed_sampler import RepeatAugSampler

from vitcli.data.batching import batches, sampler
from vitcli.errors import DataError, RecipeError
from vitcli.recipe.checks import check
from vitcli.recipe.layers import merge
from vitcli.recipe.schema import DataConfig, Recipe


def deit_ra_sampler(n: int, num_replicas: int, rank: int, epoch: int, num_repeats: int) -> list[int]:
    """DeiT's RASampler (facebookresearch/deit samplers.py) `__iter__`, transliterated: randperm
    seeded by the epoch, each index num_repeats times in a row, padded to a multiple of the ranks,
    every num_replicas-th from `rank`, cut to (n // 256 * 256) / num_replicas."""
    num_samples = math.ceil(n * num_repeats / num_replicas)
    total_size = num_samples * num_replicas
    num_selected_samples = math.floor(n // 256 * 256 / num_replicas)
    g = torch.Generator()
    g.manual_seed(epoch)
    indices = torch.randperm(n, generator=g)
    indices = torch.repeat_interleave(indices, repeats=num_repeats, dim=0).tolist()
    padding_size = total_size - len(indices)
    if padding_size > 0:
        indices += indices[:padding_size]
    assert len(indices) == total_size
    indices = indices[rank:total_size:num_replicas]
    assert len(indices) == num_samples
    return indices[:num_selected_samples]


def loader_batches(indices: list[int], batch: int) -> list[list[int]]:
    """A DataLoader's batches of a sampler's indices with drop_last=True, as DeiT's train loader."""
    return [indices[i : i + batch] for i in range(0, len(indices) - batch + 1, batch)]


def deit_permute(seed: int, epoch: int, n: int) -> np.ndarray:
    """DeiT's permutation (seed ignored: DeiT seeds by the epoch), injected into the keyed
    sampler."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(epoch)).numpy()


def rank_rows(n: int, micro: int, accum: int, world: int, rank: int, steps: int, k: int, start: int = 0,
              permute=sampler.epoch_order) -> list[list[int]]:
    """This rank's micro-batches' rows for `steps` optimizer steps from its micro-batch `start`."""
    keys = sampler.train_keys(n, micro, accum, 7, start, rank, world, k, permute)
    return [rows for _, rows in itertools.islice(keys, steps * accum - start)]


def global_micro_batches(n: int, micro: int, accum: int, world: int, steps: int, k: int) -> list:
    """Per step, the global micro-batches j = 0 .. accum x world - 1 as (seed, rows), gathered from
    every rank (rank r's i-th of a step is j = r * accum + i)."""
    per_rank = [list(itertools.islice(sampler.train_keys(n, micro, accum, 7, 0, r, world, k), steps * accum))
                for r in range(world)]
    return [[per_rank[r][s * accum + i] for r in range(world) for i in range(accum)] for s in range(steps)]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_each_rank_reads_deits_indices_for_the_same_permutation(world):
    """One micro-batch per process (DeiT has no accumulation): rank r's batches are DeiT's rank r's,
    in order, for two epochs. n = 520, global batch 16 x world: both epochs are 520 // (16 x world)
    steps (DeiT's 512 // ... agrees, see sampler.train_keys)."""
    n, batch = 520, 16
    steps = n // (batch * world)
    for r in range(world):
        ours = rank_rows(n, batch, 1, world, r, 2 * steps, 3, permute=deit_permute)
        deit = [b for e in (0, 1) for b in loader_batches(deit_ra_sampler(n, world, r, e, 3), batch)]
        assert ours == deit


@pytest.mark.parametrize("n", [520, 200])
@pytest.mark.parametrize("world", [1, 3, 4])
def test_each_rank_reads_timms_repeat_aug_sampler(world, n):
    """timm's RepeatAugSampler (DeiT's, with its rounding to 256 only for splits of 256 images or
    more) gives rank r, batched as its loader does (drop_last), what the keyed sampler gives it, for
    two epochs."""
    batch = 16
    for r in range(world):
        sampler = RepeatAugSampler(range(n), num_replicas=world, rank=r, num_repeats=3)
        timm = []
        for epoch in (0, 1):
            sampler.set_epoch(epoch)
            timm += loader_batches(list(sampler), batch)
        assert rank_rows(n, batch, 1, world, r, 2 * (n // (batch * world)), 3, permute=deit_permute) == timm


def test_accumulation_keeps_deits_multiset_per_step():
    """Two processes accumulating two micro-batches of 8 read, each step, the multiset DeiT's two
    ranks read with batches of 16 (which micro-batch holds a copy changes, not which rows the step
    reads)."""
    n = 520
    deit = [loader_batches(deit_ra_sampler(n, 2, r, 0, 3), 16) for r in (0, 1)]
    ours = [rank_rows(n, 8, 2, 2, r, 16, 3, permute=deit_permute) for r in (0, 1)]
    for s in range(16):
        step = Counter(itertools.chain(*ours[0][2 * s : 2 * s + 2], *ours[1][2 * s : 2 * s + 2]))
        assert step == Counter(deit[0][s] + deit[1][s])


@pytest.mark.parametrize(("k", "counts"), [(3, [3] * 12), (4, [4] * 9), (5, [1] + [5] * 7)])
def test_each_image_k_times_per_epoch_across_ranks(k, counts):
    """An epoch reads n // G x G = 36 entries of the repeated order (n 40, G = 4 x 3 ranks): when k
    divides that, each image it reaches is there exactly k times; else the last one only 36 mod k
    times. The images are the first ceil(36 / k) of the epoch's permutation."""
    for epoch in (0, 1):
        seen = Counter(row for r in range(3)
                       for rows in rank_rows(40, 4, 1, 3, r, 6, k)[3 * epoch : 3 * epoch + 3] for row in rows)
        assert sorted(seen.values()) == counts
        assert set(seen) == set(sampler.epoch_order(7, epoch, 40)[: len(counts)].tolist())


@pytest.mark.parametrize(("world", "k"), [(3, 3), (4, 3), (2, 2), (8, 3)])
def test_the_copies_of_an_image_are_on_different_ranks(world, k):
    """World size >= k with one micro-batch per rank: no rank reads an image twice in an epoch."""
    n, micro = 200, 4
    steps = n // (micro * world)
    for r in range(world):
        batches_of_rank = rank_rows(n, micro, 1, world, r, 2 * steps, k)
        for epoch in (0, 1):
            rows = list(itertools.chain(*batches_of_rank[epoch * steps : (epoch + 1) * steps]))
            assert len(rows) == len(set(rows))


def test_with_accumulation_the_copies_are_in_different_micro_batches():
    """One process accumulating 4 micro-batches (k = 3 <= 4): no micro-batch holds an image
    twice."""
    for rows in rank_rows(100, 5, 4, 1, 0, 10, 3):
        assert len(rows) == len(set(rows))


def test_the_global_sequence_is_the_same_for_1_2_and_4_processes():
    """Global batch 12 of micro-batches of 3, over 10 steps (three epochs of 50 images): the same
    global micro-batches, rows and augmentation seeds, whatever the split into processes."""
    one = global_micro_batches(50, 3, 4, 1, 10, 3)
    assert global_micro_batches(50, 3, 2, 2, 10, 3) == one
    assert global_micro_batches(50, 3, 1, 4, 10, 3) == one
    assert sorted(Counter(itertools.chain(*(rows for _, rows in one[0]))).values()) == [3] * 4


@pytest.mark.parametrize("start", [1, 5, 9, 14])
def test_keys_from_a_start_are_the_tail_of_the_keys_from_zero(start):
    """Rank 1 of 2, accumulating 2: its keys from micro-batch `start` (steps 0 .. 8, an epoch of 40
    images is 5 steps of 8) are those it would have read after `start` keys from the beginning."""
    straight = list(itertools.islice(sampler.train_keys(40, 2, 2, 3, 0, 1, 2, 3), 18))
    resumed = list(itertools.islice(sampler.train_keys(40, 2, 2, 3, start, 1, 2, 3), 18 - start))
    assert resumed == straight[start:]


def test_repeats_1_is_the_plain_sampler():
    """data.repeated_aug=1 reads contiguous slices of the epoch order: the sampler vitcli has always
    had."""
    order = sampler.epoch_order(0, 0, 40)
    keys = list(itertools.islice(sampler.train_keys(40, 4, 2, 0, 0, 1, 2, 1), 2))
    assert [rows for _, rows in keys] == [order[8:12].tolist(), order[12:16].tolist()]


def _indexed(n: int) -> datasets.Dataset:
    """Random 8 px images whose label is their row, so a batch's labels say which rows it holds."""
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)) for _ in range(n)]
    features = datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")})
    return datasets.Dataset.from_dict({"image": images, "label": list(range(n))}, features=features)


CFG = DataConfig(num_workers=0, repeated_aug=3, crop_min_area=0.3)


def test_each_copy_gets_its_own_augmentation_draws():
    """One process, micro-batch 6: the first holds two images three times each, each copy cropped
    and flipped differently; with two processes of 3 the copies spread over both ranks, again each
    its own."""
    ds = _indexed(24)
    x, y = next(batches.train_batches(ds, CFG, 8, 6, seed=0))
    assert len(set(y.tolist())) == 2
    ranks = [next(batches.train_batches(ds, CFG, 8, 3, seed=0, rank=r, world_size=2)) for r in (0, 1)]
    x2, y2 = torch.cat([x for x, _ in ranks]), torch.cat([y for _, y in ranks])
    assert sorted(y2.tolist()) == sorted(y.tolist())
    for xs, ys in ((x, y), (x2, y2)):
        for label in set(ys.tolist()):
            copies = xs[ys == label]
            assert len(copies) == 3
            assert all(not torch.equal(copies[a], copies[b]) for a, b in itertools.combinations(range(3), 2))


def test_a_resumed_stream_gives_the_same_batches():
    """Placed at micro-batch 3 by a saved state, the stream gives what the uninterrupted one gave
    from 3."""
    ds = _indexed(24)
    straight = list(itertools.islice(batches.train_batches(ds, CFG, 8, 4, seed=1, accum=2), 8))
    resumed = batches.train_batches(ds, CFG, 8, 4, seed=1, accum=2)
    resumed.load_state_dict({"kind": "mapped", "world_size": 1, "micro_batches": 3})
    for (xs, ys), (xr, yr) in zip(straight[3:], itertools.islice(resumed, 5), strict=True):
        assert torch.equal(xs, xr) and torch.equal(ys, yr)


def _check(**data) -> None:
    """recipe.checks.check of a recipe with these data keys (a length and a batch not being asked
    for)."""
    r = Recipe()
    merge(r, {"data": data})
    check(r, inputs=False)


@pytest.mark.parametrize("bad", [0, -1])
def test_a_repeat_count_below_one_is_refused_in_one_line(bad):
    with pytest.raises(RecipeError, match=rf"^data.repeated_aug must be positive, got {bad}$"):
        _check(repeated_aug=bad)


def test_a_stream_refuses_repeated_augmentation():
    with pytest.raises(DataError, match="data.repeated_aug=3 .* data.streaming=false$"):
        _check(repeated_aug=3, streaming=True, source="some/hub-id")
    _check(repeated_aug=1, streaming=True, source="some/hub-id")
    _check(repeated_aug=3)
