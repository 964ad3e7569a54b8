"""Mixup and CutMix (data.mixing) are timm's Mixup: given the same random values, the same images
and soft targets in every mode; drawn from a Generator, the same distributions as timm's draws; and
neither half touches a global RNG nor reads anything back from the device.

`GlobalNumpy` answers the Generator calls `draw` makes from numpy's global RNG, the one timm draws
from: seeded alike, the two consume the very same values wherever they make the same calls in the
same order.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy.stats import ks_2samp
from timm.data import Mixup
from timm.data import mixup as timm_mixup

from vitcli.data.augmentation.mixing import MixDraws, MixSpec, apply, draw

K = 10  # classes
SPECS = {  # timm Mixup arguments; every one of them is also a MixSpec
    "mixup": {"mixup_alpha": 0.8},
    "cutmix": {"cutmix_alpha": 1.0},
    "switch": {"mixup_alpha": 0.8, "cutmix_alpha": 1.0, "switch_prob": 0.5},
    "minmax": {"mixup_alpha": 0.5, "cutmix_minmax": (0.2, 0.8)},
    "minmax uncorrected": {"cutmix_minmax": (0.2, 0.8), "correct_lam": False},  # timm corrects it anyway
    "prob": {"mixup_alpha": 0.8, "cutmix_alpha": 1.0, "prob": 0.5},
    "uncorrected": {"cutmix_alpha": 1.0, "correct_lam": False},
    "small alpha": {"mixup_alpha": 0.1, "cutmix_alpha": 0.1},  # many lambdas that round to 1 in float32
}
SHAPES = [(4, 4), (8, 12)]
SEEDS = range(16)


class GlobalNumpy:
    """A numpy Generator's calls, answered from numpy's global RNG."""

    def random(self, size=None):
        return np.random.random_sample(size)

    def beta(self, a, b, size=None):
        return np.random.beta(a, b, size)

    def integers(self, low, high, size=None):
        return np.random.randint(low, high, size)


@pytest.fixture(autouse=True)
def global_numpy_restored():
    state = np.random.get_state()
    yield
    np.random.set_state(state)


def spec_of(name: str, mode: str) -> MixSpec:
    return MixSpec(**SPECS[name], mode=mode, label_smoothing=0.1, num_classes=K)


def batch(n: int, shape: tuple[int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, *shape, generator=g), torch.randint(0, K, (n,), generator=g)


def timm_mix(spec: MixSpec, x: torch.Tensor, y: torch.Tensor):
    return Mixup(**dataclasses.asdict(spec))(x.clone(), y)


def assert_as_timm(ours, theirs):
    (x, t), (x_timm, t_timm) = ours, theirs
    assert torch.equal(x, x_timm)
    assert t.dtype == torch.float32 and t.shape == t_timm.shape
    torch.testing.assert_close(t, t_timm.float(), rtol=0, atol=1e-6)


def kinds(draws: MixDraws) -> set[str]:
    """Which of CutMix, blended and left-alone images the draws hold."""
    unmixed = (draws.lam == 1) & ~draws.use_cutmix
    found = {"cutmix"} if (draws.use_cutmix & (draws.lam != 1)).any() else set()
    found |= {"mixup"} if (~draws.use_cutmix & (draws.lam != 1)).any() else set()
    return found | ({"unmixed"} if unmixed.any() else set())


def expected_kinds(name: str) -> set[str]:
    spec = SPECS[name]
    found = {"cutmix"} if spec.get("cutmix_alpha") or spec.get("cutmix_minmax") else set()
    found |= {"mixup"} if spec.get("mixup_alpha") else set()
    return found | ({"unmixed"} if spec.get("prob", 1) < 1 else set())


# 1. Exact against timm, given the same draws

@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", SPECS)
@pytest.mark.parametrize("mode, n", [("batch", 8), ("pair", 2)])
def test_same_values_drawn_as_timm_and_the_same_batch(mode, n, name, shape):
    """Batch mode, and pair mode with one pair, draw at most one box: `draw` makes timm's very
    calls, so from one seed it consumes exactly what timm's unpatched Mixup consumes, and mixes
    exactly as it does."""
    spec, seen = spec_of(name, mode), set()
    for seed in SEEDS:
        x, y = batch(n, shape, seed)
        np.random.seed(seed)
        draws = draw(spec, n, *shape, GlobalNumpy())
        after_ours = np.random.get_state()[1:3]
        np.random.seed(seed)
        assert_as_timm(apply(x, y, draws, spec), timm_mix(spec, x, y))
        after_timm = np.random.get_state()[1:3]
        assert np.array_equal(after_ours[0], after_timm[0]) and after_ours[1] == after_timm[1]
        seen |= kinds(draws)
    if mode == "batch":  # 16 batches: each kind the spec can draw happens
        assert seen >= expected_kinds(name)


def timm_given_our_boxes(monkeypatch, spec: MixSpec, draws: MixDraws, x, y):
    """timm's Mixup in elem or pair mode on its own per-image decisions (drawn first, from the
    global RNG), its rand_bbox / rand_bbox_minmax answering with the boxes `draw` made for the
    images timm cuts: `draw` makes all images' boxes at once where timm draws one image's after the
    other's."""
    mix, cuts = Mixup(**dataclasses.asdict(spec)), []
    params = mix._params_per_elem

    def recorded(count):
        lam, use_cutmix = params(count)
        assert np.array_equal(use_cutmix, draws.use_cutmix[:count].numpy())
        cuts.extend(np.flatnonzero(use_cutmix & (lam != 1)))
        return lam, use_cutmix

    def ours(*args, **kwargs):
        return tuple(np.int64(v) for v in draws.boxes[cuts.pop(0)].tolist())

    monkeypatch.setattr(mix, "_params_per_elem", recorded)
    monkeypatch.setattr(timm_mixup, "rand_bbox", ours)
    monkeypatch.setattr(timm_mixup, "rand_bbox_minmax", ours)
    out = mix(x.clone(), y)
    assert not cuts
    return out


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", SPECS)
@pytest.mark.parametrize("mode", ["elem", "pair"])
def test_per_image_and_per_pair_mixing_as_timm_given_the_same_boxes(monkeypatch, mode, name, shape):
    """Where timm loops over the images: the same decisions (both draw them first, from one seed),
    the same boxes handed to timm, then the same images, lambdas after the box correction and soft
    targets."""
    spec, n, seen = spec_of(name, mode), 8, set()
    for seed in SEEDS:
        x, y = batch(n, shape, seed)
        np.random.seed(seed)
        draws = draw(spec, n, *shape, GlobalNumpy())
        np.random.seed(seed)
        assert_as_timm(apply(x, y, draws, spec), timm_given_our_boxes(monkeypatch, spec, draws, x, y))
        seen |= kinds(draws)
    assert seen >= expected_kinds(name)


# 2. The same distributions as timm's own draws

N = 5000  # batches (batch mode) or images (elem mode), each side
Z = 5  # proportions and means: within 5 standard errors of the difference of two independent samples
KS_ALPHA = 1e-4  # two-sample Kolmogorov-Smirnov: D <= 2.23 * sqrt(2 / N) = 0.045 (conservative when discrete)
H, W = 16, 24
DISTRIBUTED = MixSpec(mixup_alpha=0.2, cutmix_alpha=1.0, switch_prob=0.3, prob=0.7, num_classes=K)


def timm_draws(spec: MixSpec, seed: int) -> dict[str, np.ndarray]:
    """N draws (lam, cutmix, boxes) of timm's own _params_per_batch / _params_per_elem and
    cutmix_bbox_and_lam, from numpy's global RNG."""
    mix = Mixup(**dataclasses.asdict(spec))
    np.random.seed(seed)
    if spec.mode == "batch":
        params = [mix._params_per_batch() for _ in range(N)]
    else:
        params = zip(*mix._params_per_elem(N))
    lam, cut, boxes = [], [], []
    for lam_i, cut_i in params:
        box = (0, 0, 0, 0)
        if cut_i and lam_i != 1:
            box, lam_i = timm_mixup.cutmix_bbox_and_lam(
                (H, W), lam_i, ratio_minmax=spec.cutmix_minmax, correct_lam=spec.correct_lam)
        lam, cut, boxes = lam + [lam_i], cut + [cut_i], boxes + [box]
    return {"lam": np.array(lam, dtype=np.float64), "cut": np.array(cut), "boxes": np.array(boxes)}


def our_draws(spec: MixSpec, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    if spec.mode == "batch":
        draws = [draw(spec, 2, H, W, rng) for _ in range(N)]
        lam, cut, boxes = (torch.stack([getattr(d, f)[0] for d in draws]).numpy()
                           for f in ("lam", "use_cutmix", "boxes"))
    else:
        d = draw(spec, N, H, W, rng)
        lam, cut, boxes = d.lam.numpy(), d.use_cutmix.numpy(), d.boxes.numpy()
    return {"lam": lam, "cut": cut, "boxes": boxes}


def assert_same_proportion(a: np.ndarray, b: np.ndarray):
    p = (a.mean() + b.mean()) / 2
    sigma = np.sqrt(p * (1 - p) * (1 / len(a) + 1 / len(b)))
    assert abs(a.mean() - b.mean()) <= Z * sigma, (a.mean(), b.mean())


def assert_same_distribution(a: np.ndarray, b: np.ndarray):
    assert abs(a.mean() - b.mean()) <= Z * np.sqrt(a.var() / len(a) + b.var() / len(b)), (a.mean(), b.mean())
    assert ks_2samp(a, b, method="asymp").pvalue >= KS_ALPHA, (np.quantile(a, [.1, .5, .9]),
                                                               np.quantile(b, [.1, .5, .9]))


@pytest.mark.parametrize("spec", [DISTRIBUTED, dataclasses.replace(DISTRIBUTED, mode="elem"),
                                  MixSpec(cutmix_minmax=(0.2, 0.8), prob=0.7, num_classes=K)],
                         ids=["batch", "elem", "minmax"])
def test_draws_distributed_as_timms(spec):
    """How often a batch (or image) is mixed, how often with CutMix, lambda's mean and distribution
    for mixup and for CutMix, box sides, corners and centres: ours from a Generator, timm's from
    numpy's global RNG, two samples of N."""
    ours, timms = our_draws(spec, 0), timm_draws(spec, 0)
    assert_same_proportion(ours["lam"] != 1, timms["lam"] != 1)
    for d in (ours, timms):
        d["mixup"], d["cutmix"] = d["lam"][~d["cut"] & (d["lam"] != 1)], d["cut"] & (d["lam"] != 1)
    assert_same_proportion(ours["cutmix"][ours["lam"] != 1], timms["cutmix"][timms["lam"] != 1])
    if spec.mixup_alpha:
        assert_same_distribution(ours["mixup"], timms["mixup"])
    assert_same_distribution(ours["lam"][ours["cutmix"]], timms["lam"][timms["cutmix"]])
    (y0, y1, x0, x1), theirs = ours["boxes"][ours["cutmix"]].T, timms["boxes"][timms["cutmix"]].T
    for side, their_side in [(y1 - y0, theirs[1] - theirs[0]), (x1 - x0, theirs[3] - theirs[2]),
                             (y0, theirs[0]), (x0, theirs[2]),
                             (y0 + y1, theirs[0] + theirs[1]), (x0 + x1, theirs[2] + theirs[3])]:
        assert_same_distribution(side.astype(float), their_side.astype(float))


def test_minmax_box_centres_spread_evenly():
    """cutmix_minmax places a box uniformly among the positions where it fits: each row is a box's
    top equally often (sides from int(0.5 * 24) to int(0.55 * 24) exclusive: 12 rows, fixed for
    clarity)."""
    spec = MixSpec(cutmix_minmax=(0.5, 0.55), num_classes=K, mode="elem")
    boxes = draw(spec, N, 24, 24, np.random.default_rng(1)).boxes.numpy()
    assert (boxes[:, 1] - boxes[:, 0] == 12).all()
    counts = np.bincount(boxes[:, 0], minlength=13)  # tops 0..12, each expected N / 13
    assert len(counts) == 13 and abs(counts - N / 13).max() <= Z * np.sqrt(N / 13 * (1 - 1 / 13))


# 3. Determinism

@pytest.mark.parametrize("mode", ["batch", "pair", "elem"])
def test_a_seed_gives_the_same_draws_and_no_global_rng_moves(mode):
    spec = spec_of("switch", mode)
    x, y = batch(8, (8, 12), 0)
    before = random.getstate(), np.random.get_state(), torch.get_rng_state()
    runs = [draw(spec, 8, 8, 12, np.random.default_rng(7)) for _ in range(2)]
    apply(x, y, runs[0], spec)
    assert random.getstate() == before[0]
    assert all(np.array_equal(a, b) for a, b in zip(np.random.get_state(), before[1]))
    assert torch.equal(torch.get_rng_state(), before[2])
    same = [torch.equal(getattr(runs[0], f), getattr(runs[1], f)) for f in ("lam", "use_cutmix", "boxes")]
    assert all(same)
    other = draw(spec, 8, 8, 12, np.random.default_rng(8))
    assert not torch.equal(other.lam, runs[0].lam)


# 4. Edge cases

@pytest.mark.parametrize("mode", ["batch", "pair", "elem"])
def test_an_odd_micro_batch_is_refused(mode):
    spec = spec_of("switch", mode)
    with pytest.raises(ValueError, match="even"):
        draw(spec, 7, 8, 8, np.random.default_rng(0))
    x, y = batch(7, (8, 8), 0)
    with pytest.raises(ValueError, match="even"):
        apply(x, y, draw(spec, 8, 8, 8, np.random.default_rng(0)), spec)


def smoothed_one_hot(y: torch.Tensor, smoothing: float) -> torch.Tensor:
    return F.one_hot(y, K).float() * (1 - smoothing) + smoothing / K


@pytest.mark.parametrize("mode", ["batch", "pair", "elem"])
def test_prob_zero_leaves_the_batch_and_smooths_the_labels(mode):
    spec = dataclasses.replace(spec_of("switch", mode), prob=0.0)
    assert not spec.active
    x, y = batch(8, (8, 12), 0)
    out, targets = apply(x, y, draw(spec, 8, 8, 12, np.random.default_rng(0)), spec)
    assert torch.equal(out, x)
    torch.testing.assert_close(targets, smoothed_one_hot(y, 0.1), rtol=0, atol=1e-6)


def test_lambda_one_leaves_an_image_bit_for_bit_even_beside_infinities():
    x, y = batch(4, (4, 4), 0)
    x[3] = float("inf")  # image 0's partner: x * 1 + partner * 0 would be nan
    draws = MixDraws(lam=torch.tensor([1.0, 0.5, 0.5, 1.0], dtype=torch.float64),
                     use_cutmix=torch.tensor([False, False, True, True]),
                     boxes=torch.tensor([[0, 0, 0, 0], [0, 0, 0, 0], [0, 2, 0, 4], [0, 0, 0, 0]]))
    out, targets = apply(x, y, draws, spec_of("switch", "elem"))
    assert torch.equal(out[0], x[0]) and torch.equal(out[3], x[3])
    assert torch.equal(out[1], 0.5 * x[1] + 0.5 * x[2])
    assert torch.equal(out[2, :, :2], x[1, :, :2]) and torch.equal(out[2, :, 2:], x[2, :, 2:])
    torch.testing.assert_close(targets[0], smoothed_one_hot(y, 0.1)[0], rtol=0, atol=1e-6)


@pytest.mark.parametrize("shape", [(4, 4), (8, 12), (12, 8)])
@pytest.mark.parametrize("name", ["cutmix", "uncorrected", "minmax", "minmax uncorrected"])
def test_boxes_lie_in_the_image_and_lambda_is_what_they_leave(name, shape):
    spec, (h, w) = spec_of(name, "elem"), shape
    d = draw(spec, 2000, h, w, np.random.default_rng(0))
    y0, y1, x0, x1 = d.boxes[d.use_cutmix].T
    assert ((0 <= y0) & (y0 <= y1) & (y1 <= h) & (0 <= x0) & (x0 <= x1) & (x1 <= w)).all()
    # timm corrects lambda in float64 and keeps a per-image one in float32
    left = (1 - ((y1 - y0) * (x1 - x0)).double() / (h * w)).float().double()
    if spec.correct_lam or spec.cutmix_minmax:
        assert torch.equal(d.lam[d.use_cutmix], left)
    else:  # lambda as drawn: the clipped box takes less than 1 - lambda
        assert (d.lam[d.use_cutmix] <= left).all() and (d.lam[d.use_cutmix] < left).any()
    if spec.cutmix_minmax:
        lo, hi = spec.cutmix_minmax
        assert ((int(h * lo) <= y1 - y0) & (y1 - y0 < int(h * hi))).all()
        assert ((int(w * lo) <= x1 - x0) & (x1 - x0 < int(w * hi))).all()


def test_spec_names_its_modes_and_when_it_mixes():
    with pytest.raises(ValueError, match="batch, pair, elem"):
        MixSpec(mixup_alpha=1.0, mode="half")
    assert not MixSpec().active and not MixSpec(mixup_alpha=1.0, prob=0).active
    assert MixSpec(mixup_alpha=1.0).active and MixSpec(cutmix_alpha=1.0).active
    assert MixSpec(cutmix_minmax=(0.2, 0.8)).active


# 5. Nothing read back from the device

def test_apply_runs_on_meta_tensors_so_it_reads_no_value():
    """Meta tensors hold no values: any .item(), .tolist(), .cpu() or `if tensor` in apply would
    fail."""
    spec = spec_of("switch", "elem")
    draws = draw(spec, 8, 8, 12, np.random.default_rng(0))
    x, y = torch.empty(8, 3, 8, 12, device="meta"), torch.empty(8, dtype=torch.int64, device="meta")
    out, targets = apply(x, y, draws.to(torch.device("meta")), spec)
    assert out.shape == x.shape and out.device.type == "meta"
    assert targets.shape == (8, K) and targets.dtype == torch.float32


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_apply_on_cuda_syncs_nothing():
    spec = spec_of("switch", "pair")
    x, y = (t.cuda() for t in batch(8, (8, 12), 0))
    draws = draw(spec, 8, 8, 12, np.random.default_rng(0)).pin_memory()
    assert all(t.is_pinned() for t in (draws.lam, draws.use_cutmix, draws.boxes))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, targets = apply(x, y, draws, spec)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    cpu = apply(x.cpu(), y.cpu(), draws, spec)
    torch.testing.assert_close(out.cpu(), cpu[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(targets.cpu(), cpu[1], rtol=0, atol=1e-6)
