"""Batched augmentation is big_vision's: the Inception crop boxes follow TF's
sample_distorted_bounding_box (compared by distribution with a plain scalar transliteration of the
TF kernel), the batched resize is tf.image.resize(bilinear, antialias=False) per crop cast back to
uint8, flips mirror only their rows."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from vitcli.data.augmentation.augment import (
    Pixels,
    finish,
    inception_boxes,
    levels,
    pack,
    resize_each,
    tf_bilinear,
    whole_boxes,
)


def lrint(v: float) -> int:
    return round(v)  # Python rounds half to even, as lrint does in the default rounding mode


def tf_crop(h: int, w: int, area_range, rnd: random.Random, aspect_range=(3 / 4, 4 / 3), attempts=100):
    """One box (top, left, height, width), line by line from TF's GenerateRandomCrop and its caller
    (tensorflow/core/kernels/image/sample_distorted_bounding_box_op.cc); the whole image when no
    attempt passes (use_image_if_no_bounding_boxes, min_object_covered=0)."""
    min_area, max_area = area_range[0] * w * h, area_range[1] * w * h
    for _ in range(attempts):
        aspect = rnd.uniform(*aspect_range)
        height = lrint(math.sqrt(min_area / aspect))
        max_height = lrint(math.sqrt(max_area / aspect))
        if lrint(max_height * aspect) > w:
            max_height = int((w + 0.5 - 1e-7) / aspect)
            if lrint(max_height * aspect) > w:
                max_height -= 1
        max_height = min(max_height, h)
        height = min(height, max_height)
        if height < max_height:
            height += rnd.randint(0, max_height - height)  # closed interval
        width = lrint(height * aspect)
        area = width * height
        if area < min_area:
            height += 1
            width = lrint(height * aspect)
            area = width * height
        if area > max_area:
            height -= 1
            width = lrint(height * aspect)
            area = width * height
        if area < min_area or area > max_area or width > w or height > h or width <= 0 or height <= 0:
            continue
        top = rnd.randrange(h - height) if height < h else 0  # TF's Uniform(n): 0 .. n - 1
        left = rnd.randrange(w - width) if width < w else 0
        if area < 1:
            continue
        return top, left, height, width
    return 0, 0, h, w


def statistics(boxes: np.ndarray, h: int, w: int) -> dict[str, np.ndarray]:
    top, left, bh, bw = boxes.T.astype(np.float64)
    return {"area": bh * bw / (h * w), "aspect": bw / bh, "y_centre": (top + bh / 2) / h,
            "x_centre": (left + bw / 2) / w, "whole": (bh == h) & (bw == w)}


@pytest.mark.parametrize("h,w,area_range,n", [
    (375, 500, (0.05, 1.0), 20000),  # ImageNet-like, wide
    (640, 240, (0.08, 1.0), 20000),  # tall
    (7, 5, (0.05, 1.0), 20000),  # tiny: rounding decides everything
    (32, 32, (0.5, 1.0), 20000),
    (16, 400, (0.5, 1.0), 3000),  # no box of this area has an aspect in range: always the whole image
])
def test_inception_boxes_follow_tfs_distribution(h, w, area_range, n):
    rnd = random.Random(h * w)
    want = statistics(np.array([tf_crop(h, w, area_range, rnd) for _ in range(n)]), h, w)
    sizes = np.tile([h, w], (n, 1))
    got = statistics(inception_boxes(sizes, np.random.default_rng(h + w), area_range), h, w)
    for name in want:
        a, b = got[name].astype(np.float64), want[name].astype(np.float64)
        se = math.sqrt(a.var() / n + b.var() / n)
        assert abs(a.mean() - b.mean()) <= 4 * se + 1e-12, (name, a.mean(), b.mean())
        for q in (0.1, 0.25, 0.5, 0.75, 0.9):
            # a quantile of one sample must sit among the other's quantiles within 4 standard errors
            # of rank
            d = 4 * math.sqrt(2 * q * (1 - q) / n)
            lo, hi = np.quantile(b, max(q - d, 0)), np.quantile(b, min(q + d, 1))
            assert lo - 1e-9 <= np.quantile(a, q) <= hi + 1e-9, (name, q)


def test_inception_boxes_lie_inside_and_keep_the_area_range():
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 300, (5000, 2))
    boxes = inception_boxes(sizes, rng, (0.3, 0.9))
    top, left, bh, bw = boxes.T
    h, w = sizes.T
    assert (top >= 0).all() and (left >= 0).all() and (bh >= 1).all() and (bw >= 1).all()
    assert (top + bh <= h).all() and (left + bw <= w).all()
    whole = (bh == h) & (bw == w)
    area = bh * bw / (h * w)
    assert ((area >= 0.3 - 1e-9) & (area <= 0.9 + 1e-9) | whole).all()
    assert np.array_equal(whole_boxes(sizes), np.stack([0 * h, 0 * w, h, w], 1))


def test_batched_resize_is_per_crop_tf_bilinear_within_one_level():
    """Each crop of a padded batch resizes as F.interpolate (TF's half-pixel bilinear) does it
    alone, then clipped and rounded to uint8 levels (big_vision truncates: at most one level above
    it). Not bit-exact: the gather sums its four float32 products in another order than torch's
    kernel, so a value within ~1e-4 of a half level may land one level apart; the workers' uint8
    kernel blends in fixed point."""
    g = torch.Generator().manual_seed(0)
    crops = [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g)
             for h, w in torch.randint(1, 90, (64, 2), generator=g).tolist()]
    # shapes met more than once (resize_each sends them through the kernel together), and 32 x 32
    # crops, which at size 32 are only copied
    crops += [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g)
              for h, w in [(32, 32), (20, 17), (32, 32), (20, 17), (32, 32)]]
    for size in (7, 32, 64):
        batch = pack(crops, np.zeros(len(crops), bool), size)
        got = levels(batch.pixels, batch.sizes, size)  # (B, 3, S, S)
        exact = torch.stack([tf_bilinear(c.float(), size).clamp(0, 255) for c in crops])
        want = exact.round()
        diff = (got - want).abs()
        assert diff.max() <= 1 and (diff > 0).float().mean() < 0.01
        above = got - exact.floor()  # against big_vision's truncation: never below, at most one above
        assert above.min() >= 0 and above.max() <= 1
        flips = np.arange(len(crops)) % 3 == 0
        each = resize_each(crops, flips, size).float()  # one call per shape: torch's uint8 kernel
        mirrored = torch.where(torch.as_tensor(flips)[:, None, None, None], exact.flip(-1), exact)
        # the kernel blends with fixed-point weights (measured: ~19% of pixels a level off the exact
        # rounding), but stays within a level of the exact value and unbiased (measured +0.01..0.07)
        assert (each - mirrored).abs().max() <= 1 + 2e-3 and abs((each - mirrored).mean()) < 0.1


def test_finish_flips_only_the_flagged_rows_and_scales_to_signed_range():
    x = torch.arange(2 * 3 * 4 * 4, dtype=torch.uint8).reshape(2, 3, 4, 4)
    batch = Pixels(x, torch.full((2, 2), 4), torch.tensor([True, False]), 4)
    out = finish(batch, torch.device("cpu"))
    want = torch.stack([x[0].flip(-1), x[1]]).float() / 127.5 - 1
    assert torch.equal(out, want) and out.dtype == torch.float32
    crops = pack(list(x), np.array([True, False]), 3)  # 4 x 4 crops to 3 x 3: flipped as they are resized
    want = levels(x, torch.full((2, 2), 4), 3)
    mirrored = torch.stack([want[0].flip(-1), want[1]]) / 127.5 - 1
    assert torch.equal(finish(crops, torch.device("cpu")), mirrored)


def test_a_crop_of_the_size_asked_for_passes_unchanged_through_the_resize():
    crop = torch.randint(0, 256, (3, 9, 9), dtype=torch.uint8)
    batch = pack([crop, torch.zeros((3, 20, 13), dtype=torch.uint8)], np.zeros(2, bool), 9)
    assert torch.equal(levels(batch.pixels, batch.sizes, 9)[0], crop.float())
