"""Batched RandAugment (vitcli.data.augmentation.randaugment) is timm's: each op on a batch of uint8
tensors equals timm's PIL op (timm.data.auto_augment.NAME_TO_OP) on the same image with the same
argument, the level functions equal timm's for both signs, the draws follow timm's RandAugment's
distribution (ops, how often applied, arguments), any image size works, and the result depends only
on the draws."""

from __future__ import annotations

import math
import random
from functools import cache

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps
from timm.data import auto_augment as aa

from vitcli.data.augmentation import randaugment as ra
from vitcli.errors import DataError

try:  # real photographs when scikit-image is there; drawn images with edges and gradients otherwise
    from skimage import data as photos
except ImportError:
    photos = None

HPARAMS = {"translate_const": int(32 * 0.45), "img_mean": (128, 128, 128), "interpolation": Image.BILINEAR}
SPECS = {0: ra.parse("rand-m9", 32), 1: ra.parse("rand-m9-inc1", 32)}  # every op of the two rand sets
OPS = [(inc, name) for inc, spec in SPECS.items() for name in spec.names]
SIZES = [(32, 32), (24, 40), (5, 7)]  # (H, W): square, non-square, tiny
NEGATED = {"Rotate", "ShearX", "ShearY", "TranslateXRel", "TranslateYRel", "ColorIncreasing",
           "ContrastIncreasing", "BrightnessIncreasing", "SharpnessIncreasing"}


def drawn(h: int, w: int, seed: int = 0) -> np.ndarray:
    """(h, w, 3) uint8 with what RandAugment's ops react to: edges, a gradient, a disc, a checker, a
    flat patch, saturated levels."""
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float64)
    r = 128 + 127 * np.sin(xx / (3.0 + seed) + yy / 5.0)
    g = 255 * xx / max(w - 1, 1) * (0.6 + 0.4 * yy / max(h - 1, 1))
    b = np.where((xx - w / 2) ** 2 + (yy - h / 2) ** 2 < (min(h, w) / 3) ** 2, 230, 20)
    b = b + ((xx // 4 + yy // 4) % 2) * 25
    img = np.stack([r, g, b], -1)
    img[: h // 4, : w // 4] = (200, 60 + 10 * seed, 0)
    return np.clip(np.round(img), 0, 255).astype(np.uint8)


def picture(h: int, w: int, seed: int = 0) -> np.ndarray:
    if photos is None:
        return drawn(h, w, seed)
    photo = [photos.astronaut, photos.chelsea, photos.coffee][seed % 3]()
    return np.asarray(Image.fromarray(photo).resize((w, h), Image.BILINEAR))


def tensor(images: list[np.ndarray]) -> torch.Tensor:
    return torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).contiguous()


def forced(spec: ra.RandSpec, k: int, magnitude, sign) -> ra.RandDraws:
    """Draws that apply op k to every image, one layer, at the given magnitudes and signs (n,)."""
    magnitude, sign = np.asarray(magnitude, np.float64), np.asarray(sign, np.float64)
    n = len(magnitude)
    return ra.RandDraws.of(op=torch.full((n, 1), k), applied=torch.ones(n, 1, dtype=torch.bool),
                           magnitude=torch.from_numpy(magnitude[:, None]),
                           sign=torch.from_numpy(sign[:, None]),
                           arg=torch.from_numpy(spec.levels[k](magnitude, sign)[:, None]))


def timm_op(spec: ra.RandSpec, k: int):
    return timm_ops(spec.spec)[k]


@cache
def timm_ops(spec: str) -> list:
    return aa.rand_augment_transform(spec, dict(HPARAMS)).ops


def pil(name: str, img: np.ndarray, arg: float, op) -> np.ndarray:
    """timm's own op with the resolved argument (ints for posterize and solarize, as its levels give
    them). Posterize to 0 bits: black, TF's posterize, which vitcli follows where Pillow 13
    refuses."""
    if op.level_fn is None:
        args = ()
    else:
        args = (int(arg),) if name.startswith(("Posterize", "Solarize")) else (float(arg),)
    if name.startswith("Posterize") and args[0] <= 0:
        return np.zeros_like(img)
    return np.asarray(aa.NAME_TO_OP[name](Image.fromarray(img), *args, **dict(op.kwargs)))


def ours(spec, k, images, magnitude, sign) -> np.ndarray:
    out = ra.apply(tensor(images), forced(spec, k, magnitude, sign), spec)
    return out.permute(0, 2, 3, 1).numpy()


def close_enough(name: str, a: np.ndarray, b: np.ndarray) -> bool:
    """Per-op tolerance. Every op but the geometric ones is bit-exact: vitcli computes Pillow's
    integers (equalize, autocontrast's float64 table, luma 19595/38470/7471, SMOOTH's rounding) and
    its float32 blend in Pillow's order. Geometric ops sample in float32 (grid_sample) where Pillow
    works in double and truncates: a point whose exact value is an integer (a flat region, a linear
    gradient shifted by a round fraction) truncates to it or to the level below as the last bit
    falls, so pixels may be 1 level off (measured on these images: mean <= 0.12 levels, none more
    than 1 apart; the wrong direction: mean >= 29); a point within rounding of the image's edge may
    flip between the fill and a pixel: 0.5% allowed past 1."""
    diff = np.abs(a.astype(int) - b.astype(int))
    if name not in ra.MATRICES:
        return diff.max() == 0
    return diff.mean() <= 0.25 and (diff > 1).mean() <= 0.005


@pytest.mark.parametrize("inc,name", OPS)
@pytest.mark.parametrize("size", SIZES)
def test_each_op_equals_timms_pil_op(inc, name, size):
    spec = SPECS[inc]
    k = spec.names.index(name)
    grid = [(m, s) for m in (0, 5, 9, 10) for s in ((1, -1) if name in NEGATED else (1,))]
    img = picture(*size)
    got = ours(spec, k, [img] * len(grid), *zip(*grid))  # one batch: each image its own magnitude and sign
    for (m, s), mine in zip(grid, got):
        arg = spec.levels[k](np.array([m], float), np.array([s], float))[0]
        want = pil(name, img, arg, timm_op(spec, k))
        assert close_enough(name, mine, want), (name, size, m, s)
        if name in ra.MATRICES and m >= 5:  # the tolerance tells a rotation, shear or shift the wrong way
            wrong = ours(spec, k, [img], [m], [-s])[0]
            assert not close_enough(name, wrong, want), (name, size, m, s)


@pytest.mark.parametrize("inc", [0, 1])
def test_level_functions_equal_timms_for_both_signs(inc, monkeypatch):
    spec = ra.parse(f"rand-m9-mmax15-inc{inc}", 224)  # magnitudes past 10 too
    ops = aa.rand_augment_transform(spec.spec, {**HPARAMS, "translate_const": int(224 * 0.45)}).ops
    m = np.linspace(0, 15, 61)
    for sign in (1.0, -1.0):
        monkeypatch.setattr(aa, "_randomly_negate", (lambda v: v) if sign > 0 else (lambda v: -v))
        for k, op in enumerate(ops):
            want = [op.level_fn(v, op.hparams)[0] if op.level_fn else 0.0 for v in m]
            np.testing.assert_array_equal(spec.levels[k](m, np.full_like(m, sign)), want, err_msg=op.name)


class Spy:
    """Stands in for one of timm's AugmentOps in RandAugment.ops: logs that it was chosen, and
    (through its aug_fn, which no longer touches pixels) the arguments it would have applied."""

    def __init__(self, op, log: list):
        self.op, self.log = op, log
        op.aug_fn = self.record

    def __call__(self, img):
        self.log.append([self.op.name, False, 0.0])
        return self.op(img)

    def record(self, img, *args, **kwargs):
        self.log[-1][1:] = [True, float(args[0]) if args else 0.0]
        return img


def timm_draws(spec: str, n: int, seed: int) -> list:
    """n images' [op name, applied, argument] per layer, from timm's RandAugment and its global
    RNGs."""
    t = aa.rand_augment_transform(spec, dict(HPARAMS))
    log = []
    t.ops = [Spy(op, log) for op in t.ops]
    state = random.getstate(), np.random.get_state()
    random.seed(seed)
    np.random.seed(seed)
    try:
        for _ in range(n):
            t(None)
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])
    return log


def within(p1: float, p2: float, n1: int, n2: int) -> bool:
    """Two frequencies agree within 5 standard errors of their difference."""
    p = (p1 * n1 + p2 * n2) / (n1 + n2)
    return abs(p1 - p2) <= 5 * math.sqrt(max(p * (1 - p), 1e-12) * (1 / n1 + 1 / n2)) + 1e-12


def ks_agrees(a: np.ndarray, b: np.ndarray, alpha: float = 1e-6) -> bool:
    """Two-sample Kolmogorov-Smirnov at level alpha (conservative for discrete arguments)."""
    grid = np.union1d(a, b)
    d = np.abs(np.searchsorted(np.sort(a), grid, "right") / len(a)
               - np.searchsorted(np.sort(b), grid, "right") / len(b)).max()
    return d <= math.sqrt(-math.log(alpha / 2) / 2 * (len(a) + len(b)) / (len(a) * len(b)))


@pytest.mark.parametrize("spec", ["rand-m9-mstd0.5-inc1", "rand-m9-n2-mstd0.5", "rand-m7-mstd101-inc1",
                                  "rand-m9-tweights"])
def test_draws_follow_timms_distribution(spec):
    """`rand-m9-tweights` is timm's weighted choice (without replacement); timm 1.0 refuses the old
    `w0`."""
    n = 20000
    theirs = timm_draws(spec, n, seed=0)
    parsed = ra.parse(spec, 32)
    d = ra.draw(parsed, n, np.random.default_rng(0))
    names = np.array(parsed.names)[d.op.numpy()].ravel()
    applied, args = d.applied.numpy().ravel(), d.arg.numpy().ravel()
    t_names = np.array([r[0] for r in theirs])
    t_applied, t_args = np.array([r[1] for r in theirs]), np.array([r[2] for r in theirs])
    assert len(t_names) == len(names)
    for name in parsed.names:
        mine, their = names == name, t_names == name
        assert within(mine.mean(), their.mean(), len(names), len(t_names)), name
        assert within(applied[mine].mean(), t_applied[their].mean(), mine.sum(), their.sum()), name
        a, b = args[mine & applied], t_args[their & t_applied]
        assert ks_agrees(a, b), name
        spread = math.sqrt(a.var() / len(a) + b.var() / len(b))
        assert abs(a.mean() - b.mean()) <= 5 * spread + 1e-9, name
    if parsed.choice_weights is not None:  # no op twice in one image, as numpy's replace=False
        assert (d.op[:, 0] != d.op[:, 1]).all()
        assert (t_names[0::2] != t_names[1::2]).all()


def odd_images() -> dict[str, list[np.ndarray]]:
    grey = drawn(16, 16)[..., :1].repeat(3, 2)
    return {"grey": [grey, grey[::-1].copy()], "4x4": [drawn(4, 4), drawn(4, 4, 1)],
            "1x1": [drawn(1, 1), drawn(3, 3)[1:2, 1:2].copy()], "2x3": [drawn(2, 3)],
            "5x9": [drawn(5, 9), drawn(5, 9, 2)]}


@pytest.mark.parametrize("inc", [0, 1])
@pytest.mark.parametrize("m", [0, 10])
@pytest.mark.parametrize("mstd", [0, 0.5])
def test_every_op_at_its_bounds_on_odd_images(inc, m, mstd):
    """Magnitudes 0 and 10, with and without noise, on grey (R=G=B), tiny (down to 1x1) and
    non-square images: every op runs and keeps shape and dtype; all but the geometric ones still
    equal timm's PIL op exactly."""
    spec = ra.parse(f"rand-m{m}-mstd{mstd}-inc{inc}", 16)
    for label, images in odd_images().items():
        n = len(images)
        d = ra.draw(spec, n, np.random.default_rng(m))
        for k, name in enumerate(spec.names):
            magnitude, sign = d.magnitude[:, 0].double().numpy(), d.sign[:, 0].double().numpy()
            out = ours(spec, k, images, magnitude, sign)
            assert out.shape == np.stack(images).shape and out.dtype == np.uint8, (label, name)
            if name not in ra.MATRICES:
                args = spec.levels[k](magnitude, sign)
                for img, mine, arg in zip(images, out, args):
                    assert (mine == pil(name, img, arg, timm_op(spec, k))).all(), (label, name, arg)


def test_posterize_to_zero_bits_is_black_where_pillow_refuses_or_gives_black():
    spec = SPECS[1]
    k = spec.names.index("PosterizeIncreasing")
    img = drawn(8, 8)
    assert spec.levels[k](np.array([10.0]), np.array([1.0]))[0] == 0
    try:  # Pillow 13 refuses 0 bits: what made timm's PIL RandAugment stop at a random step
        theirs = np.asarray(aa.NAME_TO_OP["PosterizeIncreasing"](Image.fromarray(img), 0))
    except ValueError:
        theirs = np.zeros_like(img)  # Pillow 12 (trackio's pin) still gives black
    assert (theirs == 0).all() and (ours(spec, k, [img], [10.0], [1.0]) == 0).all()


def test_same_seed_same_draws_same_pixels_and_batching_changes_nothing():
    spec = ra.parse("rand-m9-mstd0.5-inc1-p0.9", 24)
    images = [picture(24, 40, seed) for seed in range(3)] * 12  # 36 images: every op drawn somewhere
    x = tensor(images)
    d1, d2 = ra.draw(spec, len(x), np.random.default_rng(7)), ra.draw(spec, len(x), np.random.default_rng(7))
    for name in ra.RandDraws.TENSORS:
        assert torch.equal(getattr(d1, name), getattr(d2, name)), name
    assert len(set(d1.op.ravel().tolist())) == len(spec.names)
    out = ra.apply(x, d1, spec)
    assert torch.equal(out, ra.apply(x, d2.to(torch.device("cpu")), spec))
    assert not torch.equal(out, x)
    for i in range(len(x)):
        one = ra.RandDraws.of(**{name: getattr(d1, name)[i : i + 1] for name in ra.RandDraws.DRAWN})
        assert torch.equal(ra.apply(x[i : i + 1], one, spec)[0], out[i]), i


def test_layers_run_in_order():
    """Layer 0's op, then layer 1's: solarize at 128 then invert is not invert then solarize."""
    spec = SPECS[0]
    k_inv, k_sol = spec.names.index("Invert"), spec.names.index("Solarize")
    img = drawn(8, 8)
    d = ra.RandDraws.of(op=torch.tensor([[k_sol, k_inv]]), applied=torch.ones(1, 2, dtype=torch.bool),
                        magnitude=torch.zeros(1, 2, dtype=torch.float64),
                        sign=torch.ones(1, 2, dtype=torch.float64), arg=torch.tensor([[128.0, 0.0]]).double())
    want = ImageOps.invert(ImageOps.solarize(Image.fromarray(img), 128))
    got = ra.apply(tensor([img]), d, spec)[0].permute(1, 2, 0).numpy()
    assert (got == np.asarray(want)).all()


@pytest.mark.parametrize("spec", ["rand-m9-bogus1", "randy-m9", "rand-m9-w0"])
def test_a_spec_timm_refuses_is_one_line_naming_the_key(spec):
    with pytest.raises(DataError) as e:
        ra.parse(spec, 224)
    assert "data.randaugment" in str(e.value) and spec in str(e.value) and "\n" not in str(e.value)


def test_an_op_timm_has_and_vitcli_does_not_is_named():
    with pytest.raises(DataError, match="Desaturate"):
        ra.parse("rand-m9-t3a", 224)
