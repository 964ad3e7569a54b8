"""Random erasing is timm's RandomErasing: the boxes we draw for a batch follow the distribution of
the boxes timm's own `_erase` writes (recorded from timm itself, its Python `random` replaced by a
seeded instance), and `apply` fills exactly those boxes (N(0, 1) per pixel, one colour per box and
channel, or zeros) and leaves every other pixel as it was.

Tolerances come from the sample size: 20000 images per sample; a frequency or a mean may differ from
timm's by 5 standard errors of the difference; distributions are compared with the two-sample
Kolmogorov-Smirnov test at p > 1e-4, and quantiles must fall inside the band that the DKW bound at
the same level allows.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from scipy.stats import ks_2samp
from timm.data import random_erasing
from timm.data.random_erasing import RandomErasing

from vitcli.data.augmentation.erasing import ErasingDraws, ErasingSpec, apply, box_masks, draw

N = 20000
ALPHA = 1e-4
Z = 5.0  # standard errors a frequency or a mean may stray


class Recorder:
    """Stands in for an image tensor in timm's `_erase`: records each box it writes, (top, left, h,
    w)."""

    def __init__(self):
        self.boxes = []

    def __setitem__(self, key, value):
        _, rows, cols = key
        self.boxes.append((rows.start, cols.start, rows.stop - rows.start, cols.stop - cols.start))


def timm_boxes(spec: ErasingSpec, n: int, height: int, width: int, seed: int, monkeypatch) -> list[list]:
    """The boxes timm's RandomErasing writes into n images, per image, its draws from
    random.Random(seed) (the module's `random` replaced, so the global one is neither used nor
    touched)."""
    monkeypatch.setattr(random_erasing, "random", random.Random(seed))
    eraser = RandomErasing(spec.prob, spec.min_area, spec.max_area, spec.min_aspect, spec.max_aspect,
                           mode="const", min_count=spec.min_count, max_count=spec.max_count, device="cpu")
    out = []
    for _ in range(n):
        rec = Recorder()
        eraser._erase(rec, 3, height, width, torch.float32)
        out.append([b for b in rec.boxes if b[2] > 0 and b[3] > 0])  # a 0-wide box erases nothing
    return out


def our_boxes(spec: ErasingSpec, n: int, height: int, width: int, seed: int) -> list[list]:
    boxes = draw(spec, n, height, width, np.random.default_rng(seed)).boxes.tolist()
    return [[tuple(b) for b in image if b[2] > 0] for image in boxes]


def flat(per_image: list[list]) -> np.ndarray:
    return np.array([b for image in per_image for b in image], dtype=np.float64).reshape(-1, 4)


def same_frequency(ours: float, theirs: float, n: int, m: int):
    p = (ours * n + theirs * m) / (n + m)
    se = math.sqrt(max(p * (1 - p), 1e-12) * (1 / n + 1 / m))
    assert abs(ours - theirs) <= Z * se, (ours, theirs, se)


def same_distribution(ours: np.ndarray, theirs: np.ndarray):
    """Mean within Z standard errors, two-sample KS at ALPHA, and our 10/25/50/75/90% quantiles
    inside timm's band [q(p - e), q(p + e)], e the DKW half-width at ALPHA for the two samples."""
    se = math.sqrt(ours.var() / len(ours) + theirs.var() / len(theirs))
    assert abs(ours.mean() - theirs.mean()) <= Z * se + 1e-12, (ours.mean(), theirs.mean(), se)
    assert ks_2samp(ours, theirs).pvalue > ALPHA
    e = math.sqrt(math.log(2 / ALPHA) / 2 * (1 / len(ours) + 1 / len(theirs)))
    for p in (0.1, 0.25, 0.5, 0.75, 0.9):
        lo, hi = np.quantile(theirs, [max(p - e, 0), min(p + e, 1)])
        assert lo <= np.quantile(ours, p) <= hi, (p, np.quantile(ours, p), lo, hi)


SPECS = {
    "one box": ErasingSpec(prob=0.5),
    "1-3 boxes": ErasingSpec(prob=0.5, min_count=1, max_count=3),
    "aspect range": ErasingSpec(prob=0.5, min_aspect=0.5, max_aspect=3.0, min_area=0.1, max_area=0.6),
    # large, thin boxes: most attempts rejected, a box that fails all 10 is common
    "mostly rejected": ErasingSpec(prob=0.5, min_area=0.3, max_area=0.9, min_aspect=0.1, max_count=2),
}


@pytest.fixture(scope="module", params=[(32, 32), (24, 40)], ids=["32x32", "24x40"])
def size(request):
    return request.param


@pytest.fixture(scope="module", params=list(SPECS))
def samples(request, size):
    spec = SPECS[request.param]
    with pytest.MonkeyPatch.context() as mp:
        theirs = timm_boxes(spec, N, *size, seed=1, monkeypatch=mp)
    return spec, size, our_boxes(spec, N, *size, seed=2), theirs


def test_as_many_images_are_erased_as_by_timm(samples):
    spec, _, ours, theirs = samples
    f_ours, f_theirs = np.mean([len(b) > 0 for b in ours]), np.mean([len(b) > 0 for b in theirs])
    same_frequency(f_ours, f_theirs, N, N)
    assert f_ours <= spec.prob + Z * math.sqrt(spec.prob * (1 - spec.prob) / N)


def test_box_counts_follow_timm(samples):
    spec, _, ours, theirs = samples
    n_ours = np.array([len(b) for b in ours if b])
    n_theirs = np.array([len(b) for b in theirs if b])
    for k in range(1, spec.max_count + 1):
        same_frequency(np.mean(n_ours == k), np.mean(n_theirs == k), len(n_ours), len(n_theirs))
    assert n_ours.max() == spec.max_count


def test_box_areas_follow_timm(samples):
    _, _, ours, theirs = samples
    a, b = flat(ours), flat(theirs)
    same_distribution(a[:, 2] * a[:, 3], b[:, 2] * b[:, 3])


def test_box_aspects_follow_timm(samples):
    _, _, ours, theirs = samples
    a, b = flat(ours), flat(theirs)
    same_distribution(np.log(a[:, 2] / a[:, 3]), np.log(b[:, 2] / b[:, 3]))


@pytest.mark.parametrize("axis", [0, 1], ids=["top", "left"])
def test_corners_are_uniform_over_every_place_the_box_fits(samples, axis):
    """The corner's place relative to its range [0, extent - size], compared with timm's; and the
    last place is reached as often as timm reaches it (randint includes its upper end)."""
    _, size, ours, theirs = samples
    a, b = flat(ours), flat(theirs)
    places = [size[axis] - x[:, axis + 2] + 1 for x in (a, b)]
    same_distribution((a[:, axis] + 0.5) / places[0], (b[:, axis] + 0.5) / places[1])
    last = [np.mean(x[:, axis] == p - 1) for x, p in zip((a, b), places)]
    same_frequency(last[0], last[1], len(a), len(b))
    assert (a[:, axis] <= places[0] - 1).all() and (a[:, axis + 2] < size[axis]).all()


@pytest.mark.parametrize("size", [(4, 4), (8, 12)])
def test_tiny_images_get_boxes_that_fit_strictly_inside(size):
    spec = ErasingSpec(prob=1.0, max_count=2)
    boxes = draw(spec, 2000, *size, np.random.default_rng(0)).boxes
    top, left, h, w = boxes.unbind(-1)
    used = h > 0
    assert used.any() and (w[used] > 0).all()
    assert (h < size[0]).all() and (w < size[1]).all()
    assert (top + h <= size[0]).all() and (left + w <= size[1]).all()
    assert ((w == 0) | used).all()  # an unused slot is all zeros


def python_mask(boxes: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """bool (B, 1, H, W) of every box's pixels, written with plain slices (independent of
    box_masks)."""
    mask = torch.zeros((len(boxes), 1, height, width), dtype=torch.bool)
    for i, image in enumerate(boxes.tolist()):
        for top, left, h, w in image:
            mask[i, :, top : top + h, left : left + w] = True
    return mask


def erased(mode: str, size: tuple[int, int], n: int = 400, seed: int = 0, max_count: int = 2):
    spec = ErasingSpec(prob=0.8, mode=mode, max_count=max_count)
    x = torch.full((n, 3, *size), 7.0)
    draws = draw(spec, n, *size, np.random.default_rng(seed))
    return spec, x, draws, apply(x.clone(), draws, spec)


@pytest.mark.parametrize("mode", ["pixel", "rand", "const"])
@pytest.mark.parametrize("size", [(4, 4), (8, 12), (32, 32)])
def test_only_the_boxes_change_and_the_images_are_erased_in_place(mode, size):
    _, x, draws, out = erased(mode, size)
    mask = python_mask(draws.boxes, *size).expand_as(x)
    assert torch.equal(box_masks(draws.boxes, *size).any(1), mask[:, 0])
    assert torch.equal(out[~mask], x[~mask])
    assert mask.any()
    assert (out[mask] == 0).all() if mode == "const" else (out[mask] != 7.0).all()
    y = x.clone()
    assert apply(y, draws, ErasingSpec(prob=0.8, mode=mode, max_count=2)) is y and torch.equal(y, out)


def test_pixel_mode_fills_with_standard_normal_noise():
    _, x, draws, out = erased("pixel", (32, 32))
    v = out[python_mask(draws.boxes, 32, 32).expand_as(x)].double()
    n = len(v)
    assert abs(v.mean()) <= Z / math.sqrt(n) and abs(v.std() - 1) <= Z / math.sqrt(2 * n)
    right = out[:, :, :, 1:][(python_mask(draws.boxes, 32, 32)[..., 1:]
                              & python_mask(draws.boxes, 32, 32)[..., :-1]).expand(-1, 3, -1, -1)]
    left = out[:, :, :, :-1][(python_mask(draws.boxes, 32, 32)[..., 1:]
                              & python_mask(draws.boxes, 32, 32)[..., :-1]).expand(-1, 3, -1, -1)]
    assert abs(np.corrcoef(left.numpy(), right.numpy())[0, 1]) <= Z / math.sqrt(len(left))


def test_rand_mode_fills_each_box_with_one_normal_colour_per_channel():
    _, _, draws, out = erased("rand", (24, 40), n=2000, max_count=1)
    colours = []
    for image, boxes in zip(out, draws.boxes.tolist()):
        top, left, h, w = boxes[0]
        if h:
            patch = image[:, top : top + h, left : left + w].reshape(3, -1)
            assert (patch == patch[:, :1]).all()
            colours.append(patch[:, 0])
    c = torch.stack(colours).double()  # (boxes, 3)
    n = len(c)
    assert (c.mean(0).abs() <= Z / math.sqrt(n)).all()
    assert ((c.std(0) - 1).abs() <= Z / math.sqrt(2 * n)).all()
    assert (c[:, 0] != c[:, 1]).all()


def test_where_boxes_overlap_the_later_box_wins_as_in_timm():
    boxes = torch.tensor([[[0, 0, 3, 3], [1, 1, 3, 3]]])
    draws = ErasingDraws(boxes, torch.tensor([5]))
    out = apply(torch.zeros(1, 3, 5, 5), draws, ErasingSpec(mode="rand", max_count=2))
    assert torch.equal(out[0, :, 0, 0], out[0, :, 0, 2]) and torch.equal(out[0, :, 1, 1], out[0, :, 3, 3])
    assert not torch.equal(out[0, :, 0, 0], out[0, :, 1, 1])


@pytest.mark.parametrize("mode", ["pixel", "rand", "const"])
def test_the_same_generator_gives_the_same_erasing_and_no_global_rng_moves(mode):
    states = random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state()
    a = erased(mode, (8, 12), seed=3)
    b = erased(mode, (8, 12), seed=3)
    assert torch.equal(a[2].boxes, b[2].boxes) and torch.equal(a[2].noise_seed, b[2].noise_seed)
    assert torch.equal(a[3], b[3])
    c = erased(mode, (8, 12), seed=4)
    assert not torch.equal(a[2].boxes, c[2].boxes)
    assert random.getstate() == states[0] and (np.random.get_state()[1] == states[1]).all()
    assert torch.equal(torch.get_rng_state(), states[2])


def test_draws_travel_as_the_loader_ships_them():
    draws = draw(ErasingSpec(max_count=2), 4, 8, 12, np.random.default_rng(0))
    moved = draws.to("cpu")
    assert torch.equal(moved.boxes, draws.boxes) and moved.noise_seed.device.type == "cpu"
    assert draws.boxes.shape == (4, 2, 4) and draws.noise_seed.dtype == torch.int64


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the host sync only shows on a CUDA device")
@pytest.mark.parametrize("mode", ["pixel", "rand", "const"])
def test_apply_on_a_gpu_never_waits_for_it(mode):
    spec = ErasingSpec(prob=0.9, mode=mode, max_count=3, min_count=1)
    draws = draw(spec, 64, 32, 32, np.random.default_rng(0)).pin_memory().to("cuda")
    x = torch.randn(64, 3, 32, 32, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = apply(x.clone(), draws, spec)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    mask = python_mask(draws.boxes.cpu(), 32, 32).expand(-1, 3, -1, -1)
    assert torch.equal(out.cpu()[~mask], x.cpu()[~mask])
