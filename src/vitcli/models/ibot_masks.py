"""iBOT's block-wise patch masks as DINOv2 draws them (BEiT's blockwise masking; dinov2/data/
masking.py MaskingGenerator, dinov2/data/collate.py), each image's from (seed, its global sample
index, its view) alone, so a mask does not change with the micro-batch or the rank that holds it.

`block_mask` is MaskingGenerator transliterated to numpy: python's `random.uniform(a, b)` becomes
a + (b - a) * rng.random() (what both compute), `random.randint(a, b)` rng.integers(a, b + 1); given
the same numbers it draws the same masks (tests/unit/test_dino_reference.py replays ours through
the reference).

A departure from dinov2's collate: it masks exactly int(B * prob) of a batch's B global crops, the
k-th of them with a ratio drawn from U(r_k, r_k+1) on linspace(ratio_range, k + 1 points), and
shuffles: a draw over the whole batch, which cannot stay the same when the batch is split
differently. Here each image is masked with probability `prob`, with a ratio from U(ratio_range):
per image the same distribution in expectation (masked w.p. prob, the ratio uniform over the range),
but the number masked in a batch varies (binomial) where the reference's is fixed.
"""

from __future__ import annotations

import math

import numpy as np
import torch

IBOT_MASK_STREAM = 45  # the masks' numpy stream, apart from the crops' and augmentations' streams
MIN_NUM_PATCHES = 4  # MaskingGenerator's defaults (train.py keeps them)
LOG_ASPECT = (math.log(0.3), math.log(1 / 0.3))


def max_num_patches(grid: int) -> int:
    """The largest block, as dinov2's train.py sets it: 0.5 * img_size // patch_size * img_size //
    patch_size, which is (grid // 2) * grid (half the patches for an even grid)."""
    return (grid // 2) * grid


def _block(rng: np.random.Generator, mask: np.ndarray, max_mask_patches: int) -> int:
    """One block of at most `max_mask_patches` new patches, up to 10 tries (MaskingGenerator._mask):
    the number of patches it masked."""
    grid = mask.shape[0]
    for _ in range(10):
        target_area = MIN_NUM_PATCHES + (max_mask_patches - MIN_NUM_PATCHES) * rng.random()
        aspect = math.exp(LOG_ASPECT[0] + (LOG_ASPECT[1] - LOG_ASPECT[0]) * rng.random())
        h = round(math.sqrt(target_area * aspect))
        w = round(math.sqrt(target_area / aspect))
        if w < grid and h < grid:
            top, left = int(rng.integers(0, grid - h + 1)), int(rng.integers(0, grid - w + 1))
            new = h * w - int(mask[top:top + h, left:left + w].sum())
            if 0 < new <= max_mask_patches:  # overlaps allowed, not a block of nothing new
                mask[top:top + h, left:left + w] = True
                return new
    return 0


def block_mask(rng: np.random.Generator, grid: int, num_masking_patches: int) -> np.ndarray:
    """(grid, grid) bool: blocks added until at least `num_masking_patches` are masked or a block
    fails (MaskingGenerator.__call__; it may overshoot by part of the last block)."""
    mask = np.zeros((grid, grid), dtype=bool)
    count = 0
    while count < num_masking_patches:
        delta = _block(rng, mask, min(num_masking_patches - count, max_num_patches(grid)))
        if delta == 0:
            break
        count += delta
    return mask


def masks_for(seed: int, first_sample: int, count: int, grid: int, prob: float,
              ratio_range: tuple[float, float], view: int = 0) -> torch.Tensor:
    """(count, grid * grid) bool masks of global samples first_sample .. first_sample + count - 1
    on global crop `view`: each masked with probability `prob`, int(N * U(ratio_range)) patches
    asked of block_mask (N = grid * grid; collate's int(N * random.uniform(...)))."""
    n = grid * grid
    out = np.zeros((count, n), dtype=bool)
    for row, sample in enumerate(range(first_sample, first_sample + count)):
        rng = np.random.default_rng([seed, IBOT_MASK_STREAM, sample, view])
        masked, u = rng.random() < prob, rng.random()
        if masked:
            ratio = ratio_range[0] + (ratio_range[1] - ratio_range[0]) * u
            out[row] = block_mask(rng, grid, int(n * ratio)).reshape(-1)
    return torch.from_numpy(out)
