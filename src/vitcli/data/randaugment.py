"""timm's RandAugment, batched on uint8 tensors (B, 3, H, W) on any device.

timm runs RandAugment per PIL image with the global `random` and `np.random`. Here `parse` reads the ops back
from timm's own RandAugment object (so a spec means what it means in timm), `draw` makes a micro-batch's
choices on the host from the caller's numpy Generator exactly as timm's RandAugment.__call__ and
AugmentOp.__call__ draw them, and `apply` does the pixel work on whatever device the batch is on: layer by
layer, each op on the images that drew it, with Pillow's arithmetic (what ImageOps, ImageEnhance and
Image.transform compute in C, truncations and rounding included). Nothing here is in timm or torchvision:
torchvision's RandAugment draws one op per batch and does not follow Pillow's rounding.

One deliberate difference: timm's Posterize at 0 bits (PosterizeIncreasing at magnitude 10, Posterize below
2.5) raises in Pillow >= 13; here it is TF's posterize, a shift by 8 bits: a black image.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from timm.data import auto_augment as aa

from vitcli.errors import DataError
from vitcli.runtime.dist import to_device

TRUNCATE_SLACK = 1e-3  # see affine
DENOM = 10.0  # timm's _LEVEL_DENOM: magnitudes are tenths of an op's range, clipped at 10 unless mmax says


# Level functions: timm's LEVEL_TO_ARG transliterated onto arrays (float64 magnitudes, as timm's Python
# floats), with the random sign of timm's `_randomly_negate` passed in (drawn from the caller's Generator).
# tests/unit/test_randaugment.py holds each against timm's own function, both signs.

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
    """timm's RandAugment read back: per op (K,) its name, prob, magnitude, magnitude std (inf: uniform), the
    magnitude's upper bound (mmax, else 10) and its level function bound to the op's hparams; the layers per
    image, the op weights (None: uniform with replacement) and the fill of geometric ops."""

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
    """`spec` (timm's grammar: m, n, mstd, mmax, inc, p, t) for images of side `img_size`, as timm reads
    it: its op list, probabilities, magnitudes and level functions read back from timm's RandAugment."""
    ra = _timm(spec, img_size)
    missing = [op.name for op in ra.ops if op.name not in PIXEL_OPS and op.name not in MATRICES]
    if missing:
        raise DataError(f"data.randaugment: '{spec}' uses {missing}, which vitcli's batched RandAugment does "
                        "not implement; use the rand op sets (rand-..., rand-...-inc1, rand-...-tweights)")
    ops = ra.ops
    weights = None if ra.choice_weights is None else np.asarray(ra.choice_weights, dtype=np.float64)
    if weights is not None and ra.num_layers > np.count_nonzero(weights):  # numpy would refuse in draw
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
    """One micro-batch's choices, (B, num_layers) each: op index into RandSpec.names, whether it applies, its
    magnitude after noise and clipping, the sign timm's `_randomly_negate` would have drawn (+-1), and the
    op's argument (level function of both), as apply reads it. Magnitudes, signs and arguments are float64,
    as timm's Python floats (a shift of 0.405 * W pixels in float32 moves by a few 1e-6 of a pixel)."""

    op: torch.Tensor
    applied: torch.Tensor
    magnitude: torch.Tensor
    sign: torch.Tensor
    arg: torch.Tensor
    # per layer, op index -> the indices of the images that apply it, on the draws' device: found on the
    # host (`chosen`) before the draws leave it, so that apply never asks the device (nonzero would sync)
    chosen: list[dict[int, torch.Tensor]] | None = field(default=None, repr=False)

    TENSORS = ("op", "applied", "magnitude", "sign", "arg")

    def pin_memory(self) -> RandDraws:
        """Every tensor in page-locked memory (the DataLoader calls this on what it ships)."""
        return RandDraws(**{n: getattr(self, n).pin_memory() for n in self.TENSORS})

    def to(self, device) -> RandDraws:
        """Every tensor on `device`, copied asynchronously where it can be, with the images of each op."""
        device = torch.device(device)
        chosen = (chosen_images(self.op, self.applied, device) if self.op.device.type == "cpu"
                  else self.chosen)
        return RandDraws(**{n: to_device(getattr(self, n), device) for n in self.TENSORS}, chosen=chosen)


def chosen_images(op: torch.Tensor, applied: torch.Tensor,
                  device: torch.device) -> list[dict[int, torch.Tensor]]:
    """Per layer, each drawn op's images (those that apply it) as int64 indices on `device`, from host
    tensors op, applied (B, L): found on the host, copied in one transfer without a sync (to_device) and
    cut into views there."""
    found = []  # (layer, op, indices)
    for layer in range(op.shape[1]):
        o, a = op[:, layer].cpu(), applied[:, layer].cpu()
        found += [(layer, int(k), (a & (o == k)).nonzero().squeeze(1)) for k in o[a].unique().tolist()]
    flat = to_device(torch.cat([idx for _, _, idx in found]) if found else torch.zeros(0, dtype=torch.int64),
                     device)
    out: list[dict[int, torch.Tensor]] = [{} for _ in range(op.shape[1])]
    start = 0
    for layer, k, idx in found:
        out[layer][k] = flat[start : start + len(idx)]
        start += len(idx)
    return out


def _choose(spec: RandSpec, n: int, rng: np.random.Generator) -> np.ndarray:
    """(n, L) op indices as timm's np.random.choice draws them: uniform with replacement, or without
    replacement by weight. The latter through Gumbel top-k, which draws the same distribution as numpy's
    successive weighted draws but for the whole batch at once."""
    k, layers = len(spec.names), spec.num_layers
    if spec.choice_weights is None:
        return rng.integers(0, k, size=(n, layers))
    with np.errstate(divide="ignore"):
        keys = np.log(spec.choice_weights) + rng.gumbel(size=(n, k))
    return np.argsort(-keys, axis=1, kind="stable")[:, :layers]


def _magnitudes(spec: RandSpec, op: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """AugmentOp.__call__'s magnitude: gauss(m, mstd) when mstd > 0, uniform(0, m) when mstd is inf, then
    clipped to [0, mmax or 10]. (n, L) float64."""
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
    """n images' choices, drawn from `rng` only: ops, whether each applies (random() <= prob, as timm skips an
    op when random() > prob), magnitude noise, and the random sign of the level functions that negate."""
    op = _choose(spec, n, rng)
    applied = (spec.prob[op] >= 1.0) | (rng.random(op.shape) <= spec.prob[op])
    magnitude = _magnitudes(spec, op, rng)
    sign = np.where(rng.random(op.shape) > 0.5, -1.0, 1.0)  # _randomly_negate: -v if random() > 0.5
    arg = _args(spec, op, magnitude, sign)
    return RandDraws(op=torch.from_numpy(op.astype(np.int64)), applied=torch.from_numpy(applied),
                     magnitude=torch.from_numpy(magnitude), sign=torch.from_numpy(sign),
                     arg=torch.from_numpy(arg))


# Pixel ops. Each takes uint8 (n, 3, H, W) and its images' arguments (n,) float64, and returns uint8.

def _per_image(v: torch.Tensor) -> torch.Tensor:
    return v.view(-1, 1, 1, 1)


def _blend(degenerate: torch.Tensor, x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """Pillow's Image.blend(degenerate, x, factor) (ImageEnhance's enhance): degenerate + factor * (x -
    degenerate) in float32 (Pillow passes the factor as a C float), clipped to [0, 255] and truncated
    (Blend.c casts, it does not round; so does the cast to uint8). In place, in Pillow's order of
    operations."""
    out = x.float().sub_(degenerate).mul_(_per_image(factor.float())).add_(degenerate)
    return out.clamp_(0, 255).to(torch.uint8)


def grey(x: torch.Tensor) -> torch.Tensor:
    """Pillow's convert("L"), (n, 1, H, W) int32: ITU-R 601-2 luma in its fixed point, (19595 R + 38470 G +
    7471 B + 2^15) >> 16, equal to (299 R + 587 G + 114 B) / 1000 rounded but for ties."""
    r, g, b = x.int().unbind(1)
    luma = r.mul_(19595).add_(g.mul_(38470)).add_(b.mul_(7471)).add_(32768)
    return luma.bitwise_right_shift_(16).unsqueeze(1)


def color(x, factor):
    """ImageEnhance.Color: blend with the grey image."""
    return _blend(grey(x).float(), x, factor)


def contrast(x, factor):
    """ImageEnhance.Contrast: blend with the grey image's mean, rounded to an integer as Pillow does
    (int(ImageStat mean + 0.5))."""
    mean = grey(x).flatten(1).sum(1, dtype=torch.int64).double() / (x.shape[2] * x.shape[3])
    return _blend(_per_image(torch.floor(mean + 0.5).float()), x, factor)


def brightness(x, factor):
    """ImageEnhance.Brightness: blend with black."""
    return _blend(torch.zeros((), device=x.device), x, factor)


def smooth(x: torch.Tensor) -> torch.Tensor:
    """Pillow's ImageFilter.SMOOTH (3x3 kernel [[1,1,1],[1,5,1],[1,1,1]] / 13, rounded): the border pixels are
    kept. Pillow sums in float32 with 0.5 added; the exact sum S / 13 is never within 1/26 of a half, so
    it is floor((S + 6) / 13), which float32 computes exactly (S < 2^24, a quotient off an integer by at
    least 1/13). Returned as float32."""
    out = x.float()
    if x.shape[2] < 3 or x.shape[3] < 3:
        return out
    rows = out[:, :, :-2] + out[:, :, 1:-1] + out[:, :, 2:]  # (n, 3, H-2, W): separable 3x3 box sum
    box = rows[..., :-2] + rows[..., 1:-1] + rows[..., 2:]
    inner = box.add_(out[:, :, 1:-1, 1:-1], alpha=4).add_(6).div_(13).floor_()  # (n, 3, H-2, W-2)
    out[:, :, 1:-1, 1:-1] = inner
    return out


def sharpness(x, factor):
    """ImageEnhance.Sharpness: blend with the SMOOTH-filtered image."""
    return _blend(smooth(x), x, factor)


def invert(x, arg):
    """ImageOps.invert."""
    return 255 - x


def posterize(x, bits):
    """ImageOps.posterize keeping `bits` high bits; 8 or more: unchanged (timm); 0 or fewer: black, TF's
    shift by 8 (Pillow >= 13 refuses 0 bits)."""
    shift = (8 - bits).clamp(0, 8).to(torch.int32)
    mask = torch.bitwise_left_shift(torch.bitwise_right_shift(torch.full_like(shift, 255), shift), shift)
    return x & _per_image(mask).to(torch.uint8)


def solarize(x, threshold):
    """ImageOps.solarize: a level at or above `threshold` (0..256) inverted. In uint8 throughout: 255 - v
    is v XOR 255, so the inverted levels are an XOR with a 0/255 mask (torch.where on uint8 costs ~7x more
    on a CPU core)."""
    at_or_above = (x >= _per_image(threshold.clamp(max=255).to(torch.uint8))) & _per_image(threshold <= 255)
    return x ^ at_or_above.view(torch.uint8).mul_(255)


def solarize_add(x, add):
    """timm's solarize_add: min(255, v + add) for a level below 128, others kept. In uint8 throughout: the
    addition masked to 0 where v >= 128 (no torch.where, see `solarize`)."""
    room = torch.minimum(_per_image(add.clamp(0, 255).to(torch.uint8)), 255 - x)
    return x + room.mul_((x < 128).view(torch.uint8))


def _levels(x: torch.Tensor) -> torch.Tensor:
    """(n * 3 * H * W,) int32 index of each pixel's level in a table of the batch's (n * 3 * 256) entries
    (int32, not int64: half the bytes, and index_select and bincount take it; 0.25 vs 0.59 ms per 224 px
    image on a CPU core)."""
    n = x.shape[0]
    offsets = torch.arange(0, n * 3 * 256, 256, device=x.device, dtype=torch.int32).view(n, 3, 1)
    return x.flatten(2).int().add_(offsets).flatten()


def _lookup(x: torch.Tensor, idx: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """x through per image per channel tables (n, 3, 256) of integers in [0, 255]."""
    return table.to(torch.uint8).flatten().index_select(0, idx).view_as(x)


def autocontrast(x, arg):
    """ImageOps.autocontrast (cutoff 0): each channel's [lo, hi] stretched to [0, 255] through Pillow's table
    int(i * scale + offset) in float64, clipped; a channel with hi <= lo kept."""
    lo, hi = x.amin((2, 3)).double(), x.amax((2, 3)).double()  # (n, 3)
    scale = torch.full_like(lo, 255.0) / (hi - lo).clamp(min=1)  # `255.0 / t` multiplies by 1 / t: not IEEE
    offset = -lo * scale
    i = torch.arange(256, device=x.device, dtype=torch.float64)
    table = torch.trunc(i * scale[..., None] + offset[..., None]).clamp(0, 255)  # (n, 3, 256)
    table = torch.where((hi > lo)[..., None], table, i)
    return _lookup(x, _levels(x), table)


def equalize(x, arg):
    """ImageOps.equalize per channel, in Pillow's integers: step = (count - count of the highest level
    present) // 255; table[i] = (step // 2 + pixels below i) // step, clipped to 255 as Image.point does;
    step 0 (one level present, or too few pixels) keeps the channel. Histograms: one bincount."""
    idx = _levels(x)
    h = torch.bincount(idx, minlength=x.shape[0] * 3 * 256).view(-1, 3, 256)
    top = 255 - (h > 0).flip(2).int().argmax(2, keepdim=True)  # highest level present, (n, 3, 1)
    step = (h.sum(2, keepdim=True) - h.gather(2, top)) // 255
    below = h.cumsum(2) - h
    table = (step // 2 + below) // step.clamp(min=1)
    table = torch.where(step > 0, table.clamp(max=255), torch.arange(256, device=x.device))
    return _lookup(x, idx, table)


PIXEL_OPS = {  # timm's op name -> uint8 op of (images, argument)
    "AutoContrast": autocontrast, "Equalize": equalize, "Invert": invert,
    "Posterize": posterize, "PosterizeIncreasing": posterize, "PosterizeOriginal": posterize,
    "Solarize": solarize, "SolarizeIncreasing": solarize, "SolarizeAdd": solarize_add,
    "Color": color, "ColorIncreasing": color, "Contrast": contrast, "ContrastIncreasing": contrast,
    "Brightness": brightness, "BrightnessIncreasing": brightness,
    "Sharpness": sharpness, "SharpnessIncreasing": sharpness,
}


# Geometric ops: Pillow's Image.transform(AFFINE, (a, b, c, d, e, f)) data, (n, 6), which maps the output
# pixel centre (x, y) to the input point (a x + b y + c, d x + e y + f).

def _matrix(v: torch.Tensor, a, b, c, d, e, f) -> torch.Tensor:
    """(n, 6) from six entries, each a number or an (n,) tensor like `v`."""
    return torch.stack([torch.as_tensor(t, dtype=v.dtype, device=v.device).expand_as(v)
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
    """Image.rotate(degrees) about the centre (w/2, h/2), counter-clockwise, as Pillow builds its matrix."""
    angle = -degrees * (math.pi / 180)
    cos, sin = torch.round(torch.cos(angle), decimals=15), torch.round(torch.sin(angle), decimals=15)
    cx, cy = w / 2.0, h / 2.0
    return _matrix(degrees, cos, sin, cos * -cx + sin * -cy + cx, -sin, cos, -sin * -cx + cos * -cy + cy)


MATRICES = {"Rotate": _rotate_matrix, "ShearX": _shear_x, "ShearY": _shear_y,
            "TranslateX": _translate_x, "TranslateY": _translate_y,
            "TranslateXRel": _translate_x_rel, "TranslateYRel": _translate_y_rel}


def _grid(matrix: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """grid_sample's grid (n, H, W, 2) for Pillow's affine data (n, 6): each output pixel centre (x + 0.5,
    y + 0.5) mapped to its source point, normalised to [-1, 1] at the image's outer edges (align_corners
    False). Built by broadcasting: affine_grid's batched matmul is slower on the CPU. The column and row
    terms, (n, 1, W) and (n, H, 1), are computed in float64 and only their sum in float32, straight into
    the grid: float64 planes for the whole image cost 1.1 ms per 224 px image on a core, this 0.1 (the sum
    is within 2e-5 of a pixel of float64's)."""
    m = [v.view(-1, 1, 1) for v in matrix.double().unbind(1)]
    xs = (torch.arange(w, device=matrix.device, dtype=torch.float64) + 0.5).view(1, 1, w)
    ys = (torch.arange(h, device=matrix.device, dtype=torch.float64) + 0.5).view(1, h, 1)
    grid = torch.empty((len(matrix), h, w, 2), device=matrix.device, dtype=torch.float32)
    for axis, (a, b, c, side) in enumerate(((m[0], m[1], m[2], w), (m[3], m[4], m[5], h))):
        columns = ((a * (2 / side)) * xs).float()  # (n, 1, W)
        rows = ((b * (2 / side)) * ys + (c * (2 / side) - 1)).float()  # (n, H, 1)
        torch.add(columns, rows, out=grid[..., axis])
    return grid


def affine(x: torch.Tensor, matrix: torch.Tensor, fill: tuple[int, int, int]) -> torch.Tensor:
    """Pillow's Image.transform(AFFINE, matrix (n, 6), BILINEAR, fillcolor=fill) on uint8 (n, 3, H, W): a
    source point outside [0, W) x [0, H) gives `fill`; inside, the four nearest pixels (clamped at the edges:
    padding_mode border) blend and the result is truncated, as Pillow's bilinear filter does. TRUNCATE_SLACK
    keeps float32's error from truncating a level away where Pillow's double lands on an integer (flat
    regions, where the weights' sum is 1 only up to rounding)."""
    h, w = x.shape[2:]
    grid = _grid(matrix, h, w)
    out = F.grid_sample(x.float(), grid, mode="bilinear", padding_mode="border", align_corners=False)
    gx, gy = grid.unbind(3)
    inside = ((gx >= -1) & (gx < 1) & (gy >= -1) & (gy < 1)).unsqueeze(1)  # (n, 1, H, W)
    fill = torch.tensor(fill, dtype=torch.uint8, device=x.device).view(1, 3, 1, 1)
    return torch.where(inside, out.add_(TRUNCATE_SLACK).to(torch.uint8), fill)


def _geometric(x, op, applied, arg, spec) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, 6) matrices of the layer's geometric ops and the (B,) mask of images that have one."""
    h, w = x.shape[2], x.shape[3]
    matrix = _matrix(arg, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0)
    hit = torch.zeros_like(applied)
    for k, name in enumerate(spec.names):
        if name in MATRICES:
            mine = applied & (op == k)
            matrix = torch.where(mine[:, None], MATRICES[name](arg, h, w), matrix)
            hit = hit | mine
    return matrix, hit


def _layer(x: torch.Tensor, op, applied, arg, chosen: dict[int, torch.Tensor],
           spec: RandSpec) -> torch.Tensor:
    """One layer: each image its drawn op, computed on the images that drew it (`chosen`: op -> their
    indices) and written back; the geometric ops of the layer in one affine sampling."""
    out = x.clone()
    for k, idx in chosen.items():
        if spec.names[k] in PIXEL_OPS:
            out.index_copy_(0, idx, PIXEL_OPS[spec.names[k]](x[idx], arg[idx]))
    geometric = [idx for k, idx in chosen.items() if spec.names[k] in MATRICES]
    if geometric:
        idx = torch.cat(geometric)
        matrix, _ = _geometric(x, op, applied, arg, spec)
        out.index_copy_(0, idx, affine(x[idx], matrix[idx], spec.fill))
    return out


def apply(x: torch.Tensor, draws: RandDraws, spec: RandSpec) -> torch.Tensor:
    """RandAugment on uint8 (B, 3, H, W) with `draws` on x's device: layer 0's ops, then layer 1's, ...
    Which images take which op was read on the host when the draws moved (RandDraws.to); draws that never
    left the CPU are read here."""
    chosen = draws.chosen if draws.chosen is not None else chosen_images(draws.op, draws.applied, x.device)
    for layer in range(draws.op.shape[1]):
        x = _layer(x, draws.op[:, layer], draws.applied[:, layer], draws.arg[:, layer], chosen[layer], spec)
    return x
