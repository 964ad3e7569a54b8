"""timm's RandAugment, batched on uint8 tensors (B, 3, H, W) on any device.

timm runs RandAugment per PIL image with the global `random` and `np.random`. Here `parse` reads the
ops back from timm's own RandAugment object (so a spec means what it means in timm), `draw` makes a
micro-batch's choices on the host from the caller's numpy Generator exactly as timm's
RandAugment.__call__ and AugmentOp.__call__ draw them, and `apply` does the pixel work on whatever
device the batch is on: layer by layer, each op on the images that drew it, with Pillow's arithmetic
(pillow_ops: what ImageOps, ImageEnhance and Image.transform compute in C, truncations and rounding
included). Nothing here is in timm or torchvision: torchvision's RandAugment draws one op per batch
and does not follow Pillow's rounding.

One deliberate difference: timm's Posterize at 0 bits (PosterizeIncreasing at magnitude 10,
Posterize below 2.5) raises in Pillow >= 13; here it is TF's posterize, a shift by 8 bits: a black
image.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import partial

import numpy as np
import torch
from PIL import Image
from timm.data import auto_augment as aa

from vitcli.data.augmentation.pillow_ops import (
    affine,
    autocontrast,
    brightness,
    color,
    contrast,
    equalize,
    invert,
    posterize,
    sharpness,
    solarize,
    solarize_add,
)
from vitcli.errors import DataError
from vitcli.runtime.dist import to_device

# timm's _LEVEL_DENOM: magnitudes are tenths of an op's range, clipped at 10 unless mmax says
DENOM = 10.0


# Level functions: timm's LEVEL_TO_ARG transliterated onto arrays (float64 magnitudes, as timm's
# Python floats), with the random sign of timm's `_randomly_negate` passed in (drawn from the
# caller's Generator). tests/unit/test_randaugment.py holds each against timm's own function, both
# signs.

def _no_arg(m, sign, hp):
    return np.zeros_like(m)


def _rotate(m, sign, hp):
    return sign * ((m / DENOM) * 30.0)


def _enhance(m, sign, hp):
    return (m / DENOM) * 1.8 + 0.1


def _enhance_increasing(m, sign, hp):
    return np.maximum(0.1, 1.0 + sign * ((m / DENOM) * 0.9))


def _shear(m, sign, hp):
    return sign * ((m / DENOM) * 0.3)


def _translate_abs(m, sign, hp):
    return sign * ((m / DENOM) * float(hp["translate_const"]))


def _translate_rel(m, sign, hp):
    return sign * ((m / DENOM) * hp.get("translate_pct", 0.45))


def _posterize(m, sign, hp):
    return np.floor((m / DENOM) * 4)  # int() of a value >= 0


def _posterize_increasing(m, sign, hp):
    return 4 - _posterize(m, sign, hp)


def _posterize_original(m, sign, hp):
    return _posterize(m, sign, hp) + 4


def _solarize(m, sign, hp):
    return np.minimum(256, np.floor((m / DENOM) * 256))


def _solarize_increasing(m, sign, hp):
    return 256 - _solarize(m, sign, hp)


def _solarize_add(m, sign, hp):
    return np.minimum(128, np.floor((m / DENOM) * 110))


LEVELS = {  # timm's level function -> ours
    None: _no_arg,
    aa._rotate_level_to_arg: _rotate,
    aa._enhance_level_to_arg: _enhance,
    aa._enhance_increasing_level_to_arg: _enhance_increasing,
    aa._shear_level_to_arg: _shear,
    aa._translate_abs_level_to_arg: _translate_abs,
    aa._translate_rel_level_to_arg: _translate_rel,
    aa._posterize_level_to_arg: _posterize,
    aa._posterize_increasing_level_to_arg: _posterize_increasing,
    aa._posterize_original_level_to_arg: _posterize_original,
    aa._solarize_level_to_arg: _solarize,
    aa._solarize_increasing_level_to_arg: _solarize_increasing,
    aa._solarize_add_level_to_arg: _solarize_add,
}


@dataclass(frozen=True)
class RandSpec:
    """timm's RandAugment read back: per op (K,) its name, prob, magnitude, magnitude std (inf:
    uniform), the magnitude's upper bound (mmax, else 10) and its level function bound to the op's
    hparams; the layers per image, the op weights (None: uniform with replacement) and the fill of
    geometric ops."""

    spec: str
    names: tuple[str, ...]
    prob: np.ndarray
    magnitude: np.ndarray
    magnitude_std: np.ndarray
    upper: np.ndarray
    levels: tuple
    num_layers: int
    choice_weights: np.ndarray | None
    fill: tuple[int, int, int]


def _timm(spec: str, img_size: int):
    """timm's RandAugment for `spec` with the hparams transforms._randaugment has always passed."""
    hparams = {"translate_const": int(img_size * 0.45), "img_mean": (128, 128, 128),
               "interpolation": Image.BILINEAR}
    try:
        return aa.rand_augment_transform(spec, hparams)
    except (AssertionError, ValueError, KeyError, IndexError, TypeError) as e:
        raise DataError(f"data.randaugment: timm cannot parse '{spec}' ({e!r}); use a timm spec like "
                        "rand-m9-mstd0.5-inc1") from None


def parse(spec: str, img_size: int) -> RandSpec:
    """`spec` (timm's grammar: m, n, mstd, mmax, inc, p, t) for images of side `img_size`, as timm
    reads it: its op list, probabilities, magnitudes and level functions read back from timm's
    RandAugment."""
    ra = _timm(spec, img_size)
    missing = [op.name for op in ra.ops if op.name not in PIXEL_OPS and op.name not in MATRICES]
    if missing:
        raise DataError(f"data.randaugment: '{spec}' uses {missing}, which vitcli's batched RandAugment does "
                        "not implement; use the rand op sets (rand-..., rand-...-inc1, rand-...-tweights)")
    ops = ra.ops
    weights = None if ra.choice_weights is None else np.asarray(ra.choice_weights, dtype=np.float64)
    # numpy would refuse in draw
    if weights is not None and ra.num_layers > np.count_nonzero(weights):
        raise DataError(f"data.randaugment: '{spec}' draws {ra.num_layers} ops per image without replacement "
                        f"from {np.count_nonzero(weights)}; lower n")
    return RandSpec(
        spec=spec, names=tuple(op.name for op in ops),
        prob=np.array([op.prob for op in ops], dtype=np.float64),
        magnitude=np.array([op.magnitude for op in ops], dtype=np.float64),
        magnitude_std=np.array([op.magnitude_std for op in ops], dtype=np.float64),
        upper=np.array([op.magnitude_max or DENOM for op in ops], dtype=np.float64),  # timm's `or`
        levels=tuple(partial(LEVELS[op.level_fn], hp=dict(op.hparams)) for op in ops),
        num_layers=ra.num_layers, choice_weights=weights,
        fill=tuple(int(v) for v in ops[0].kwargs["fillcolor"]),
    )


@dataclass
class RandDraws:
    """One micro-batch's choices, (B, num_layers) each: op index into RandSpec.names, whether it
    applies, its magnitude after noise and clipping, the sign timm's `_randomly_negate` would have
    drawn (+-1), and the op's argument (level function of both), as apply reads it. Magnitudes,
    signs and arguments are float64, as timm's Python floats (a shift of 0.405 * W pixels in float32
    moves by a few 1e-6 of a pixel).

    `images` and `groups` say which images take which op, found where the draws are made (`draw`, in
    a loader worker): `images` the indices of every (layer, op)'s images one after the other,
    `groups` each (layer, op, start, count) of them. So apply never asks the device (nonzero would
    sync), and the one index tensor is pinned with the batch by the DataLoader's pinning thread
    rather than by the training loop (a fresh pinned block costs milliseconds of cudaHostAlloc)."""

    op: torch.Tensor
    applied: torch.Tensor
    magnitude: torch.Tensor
    sign: torch.Tensor
    arg: torch.Tensor
    images: torch.Tensor
    groups: tuple[tuple[int, int, int, int], ...]

    TENSORS = ("op", "applied", "magnitude", "sign", "arg", "images")
    DRAWN = TENSORS[:5]  # what `of` takes

    @classmethod
    def of(cls, op: torch.Tensor, applied: torch.Tensor, magnitude: torch.Tensor, sign: torch.Tensor,
           arg: torch.Tensor) -> RandDraws:
        """Host draws (B, L) each, with the images of each op found (`_groups`)."""
        images, groups = _groups(op.numpy(), applied.numpy())
        return cls(op, applied, magnitude, sign, arg, images, groups)

    def pin_memory(self) -> RandDraws:
        """Every tensor in page-locked memory (the DataLoader calls this on what it ships)."""
        return replace(self, **{n: getattr(self, n).pin_memory() for n in self.TENSORS})

    def to(self, device) -> RandDraws:
        """What apply reads, the arguments and the images' indices, on `device` (asynchronously from
        pinned memory); the rest stays where it is."""
        device = torch.device(device)
        return replace(self, arg=to_device(self.arg, device), images=to_device(self.images, device))

    def chosen(self) -> list[dict[int, torch.Tensor]]:
        """Per layer, op index -> the indices of its images, views of `images` on its device."""
        out: list[dict[int, torch.Tensor]] = [{} for _ in range(self.op.shape[1])]
        for layer, k, start, count in self.groups:
            out[layer][k] = self.images[start : start + count]
        return out


def _groups(op: np.ndarray, applied: np.ndarray) -> tuple[torch.Tensor, tuple]:
    """(images, groups) of RandDraws from host op, applied (B, L): each layer's drawn ops in
    increasing order, each with the images that apply it."""
    found, groups, start = [], [], 0
    for layer in range(op.shape[1]):
        o, a = op[:, layer], applied[:, layer]
        for k in np.unique(o[a]).tolist():
            idx = np.flatnonzero(a & (o == k))
            found.append(idx)
            groups.append((layer, int(k), start, len(idx)))
            start += len(idx)
    images = np.concatenate(found) if found else np.zeros(0, dtype=np.int64)
    return torch.from_numpy(images.astype(np.int64)), tuple(groups)


def _choose(spec: RandSpec, n: int, rng: np.random.Generator) -> np.ndarray:
    """(n, L) op indices as timm's np.random.choice draws them: uniform with replacement, or without
    replacement by weight. The latter through Gumbel top-k, which draws the same distribution as
    numpy's successive weighted draws but for the whole batch at once."""
    k, layers = len(spec.names), spec.num_layers
    if spec.choice_weights is None:
        return rng.integers(0, k, size=(n, layers))
    with np.errstate(divide="ignore"):
        keys = np.log(spec.choice_weights) + rng.gumbel(size=(n, k))
    return np.argsort(-keys, axis=1, kind="stable")[:, :layers]


def _magnitudes(spec: RandSpec, op: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """AugmentOp.__call__'s magnitude: gauss(m, mstd) when mstd > 0, uniform(0, m) when mstd is inf,
    then clipped to [0, mmax or 10]. (n, L) float64."""
    m, std = spec.magnitude[op], spec.magnitude_std[op]
    gauss = m + np.where(np.isinf(std), 0.0, std) * rng.standard_normal(op.shape)
    uniform = m * rng.random(op.shape)
    noisy = np.where(np.isinf(std), uniform, np.where(std > 0, gauss, m))
    return np.clip(noisy, 0.0, spec.upper[op])


def _args(spec: RandSpec, op: np.ndarray, magnitude: np.ndarray, sign: np.ndarray) -> np.ndarray:
    """Each draw's argument: its op's level function at its magnitude and sign. (n, L) float64."""
    arg = np.zeros_like(magnitude)
    for k, level in enumerate(spec.levels):
        hit = op == k
        arg[hit] = level(magnitude[hit], sign[hit])
    return arg


def draw(spec: RandSpec, n: int, rng: np.random.Generator) -> RandDraws:
    """n images' choices, drawn from `rng` only: ops, whether each applies (random() <= prob, as
    timm skips an op when random() > prob), magnitude noise, and the random sign of the level
    functions that negate."""
    op = _choose(spec, n, rng)
    applied = (spec.prob[op] >= 1.0) | (rng.random(op.shape) <= spec.prob[op])
    magnitude = _magnitudes(spec, op, rng)
    sign = np.where(rng.random(op.shape) > 0.5, -1.0, 1.0)  # _randomly_negate: -v if random() > 0.5
    arg = _args(spec, op, magnitude, sign)
    return RandDraws.of(op=torch.from_numpy(op.astype(np.int64)), applied=torch.from_numpy(applied),
                        magnitude=torch.from_numpy(magnitude), sign=torch.from_numpy(sign),
                        arg=torch.from_numpy(arg))


PIXEL_OPS = {  # timm's op name -> uint8 op of (images, argument)
    "AutoContrast": autocontrast, "Equalize": equalize, "Invert": invert,
    "Posterize": posterize, "PosterizeIncreasing": posterize, "PosterizeOriginal": posterize,
    "Solarize": solarize, "SolarizeIncreasing": solarize, "SolarizeAdd": solarize_add,
    "Color": color, "ColorIncreasing": color, "Contrast": contrast, "ContrastIncreasing": contrast,
    "Brightness": brightness, "BrightnessIncreasing": brightness,
    "Sharpness": sharpness, "SharpnessIncreasing": sharpness,
}


# Geometric ops: Pillow's Image.transform(AFFINE, (a, b, c, d, e, f)) data, (n, 6), which maps the
# output pixel centre (x, y) to the input point (a x + b y + c, d x + e y + f).

def _matrix(v: torch.Tensor, a, b, c, d, e, f) -> torch.Tensor:
    """(n, 6) from six entries, each a number or an (n,) tensor like `v`. A number is filled on v's
    device (torch.as_tensor of a number on a GPU copies it from pageable memory: a sync)."""
    return torch.stack([t.expand_as(v) if isinstance(t, torch.Tensor) else torch.full_like(v, t)
                        for t in (a, b, c, d, e, f)], 1)


def _shear_x(v, h, w):
    return _matrix(v, 1.0, v, 0.0, 0.0, 1.0, 0.0)


def _shear_y(v, h, w):
    return _matrix(v, 1.0, 0.0, 0.0, v, 1.0, 0.0)


def _translate_x(v, h, w):
    return _matrix(v, 1.0, 0.0, v, 0.0, 1.0, 0.0)


def _translate_y(v, h, w):
    return _matrix(v, 1.0, 0.0, 0.0, 0.0, 1.0, v)


def _translate_x_rel(v, h, w):
    return _translate_x(v * w, h, w)


def _translate_y_rel(v, h, w):
    return _translate_y(v * h, h, w)


def _rotate_matrix(degrees, h, w):
    """Image.rotate(degrees) about the centre (w/2, h/2), counter-clockwise, as Pillow builds its
    matrix."""
    angle = -degrees * (math.pi / 180)
    cos, sin = torch.round(torch.cos(angle), decimals=15), torch.round(torch.sin(angle), decimals=15)
    cx, cy = w / 2.0, h / 2.0
    return _matrix(degrees, cos, sin, cos * -cx + sin * -cy + cx, -sin, cos, -sin * -cx + cos * -cy + cy)


MATRICES = {"Rotate": _rotate_matrix, "ShearX": _shear_x, "ShearY": _shear_y,
            "TranslateX": _translate_x, "TranslateY": _translate_y,
            "TranslateXRel": _translate_x_rel, "TranslateYRel": _translate_y_rel}


def _layer(x: torch.Tensor, arg: torch.Tensor, chosen: dict[int, torch.Tensor],
           spec: RandSpec) -> torch.Tensor:
    """One layer, in place: each image its drawn op, computed on the images that drew it (`chosen`:
    op -> their indices, no image twice) and written back into x; the layer's geometric ops, each
    image its own matrix, in one affine sampling."""
    h, w = x.shape[2], x.shape[3]
    geometric = []  # (indices, their matrices (n, 6))
    for k, idx in chosen.items():
        name = spec.names[k]
        if name in PIXEL_OPS:
            x.index_copy_(0, idx, PIXEL_OPS[name](x[idx], arg[idx]))
        else:  # parse admits no op that is neither
            geometric.append((idx, MATRICES[name](arg[idx], h, w)))
    if geometric:
        idx = torch.cat([i for i, _ in geometric])
        x.index_copy_(0, idx, affine(x[idx], torch.cat([m for _, m in geometric]), spec.fill))
    return x


def apply(x: torch.Tensor, draws: RandDraws, spec: RandSpec) -> torch.Tensor:
    """RandAugment on uint8 (B, 3, H, W) with `draws` on x's device: layer 0's ops, then layer 1's,
    ... Which images take which op was found when the draws were made (RandDraws.chosen)."""
    chosen = draws.chosen()
    # once: the layers write into it (a clone per layer cost ~3 ms a batch of 64 at 224 px)
    x = x.clone()
    for layer in range(draws.op.shape[1]):
        x = _layer(x, draws.arg[:, layer], chosen[layer], spec)
    return x
