"""Batched augmentation on uint8 pixels: big_vision's Inception crop boxes (drawn for a whole
micro-batch in numpy), one batched half-pixel bilinear resize of crops of different sizes, flip and
the normalisation (data.mean and data.std; the ViT paper's [-1, 1] by default).

The loader workers resize each crop themselves (`resize_each`, torch's own kernel), and `finish`
only normalises on the model's device. With batches.RESIZE_IN_WORKERS off (gpu_check's comparison)
the workers ship whole crops and `finish` resizes them there (`levels`, one batched gather) and
flips: the same code on any device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from vitcli.data.augmentation.augmentations import Augmentation, Drawn, apply_levels, apply_normalised
from vitcli.runtime.dist import to_device

SIGNED = (0.5, 0.5, 0.5)  # mean = std = 0.5: x / 127.5 - 1, the ViT paper's [-1, 1]
# big_vision inception_crop = TF sample_distorted_bounding_box's default
ASPECT_RANGE = (3 / 4, 4 / 3)
ATTEMPTS = 100  # TF's max_attempts default


class Normalise:
    """uint8 levels x (B, 3, H, W) -> float32 (x / 255 - mean) / std per RGB channel, as one op that
    also casts (torch.addcdiv promotes uint8): x / (255 std) + (-mean / std), each (1, 3, 1, 1),
    made once per device. The default is the ViT paper's [-1, 1]: x / 127.5 - 1, bit for bit as
    before these keys, and exactly -1 and 1 at 0 and 255 (a multiply by 1 / 127.5 would give 1 +
    1.2e-7)."""

    def __init__(self, mean: Sequence[float] = SIGNED, std: Sequence[float] = SIGNED):
        self.mean, self.std = tuple(mean), tuple(std)
        self._on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.device not in self._on:
            divisor = [255 * s for s in self.std]
            shift = [-m / s for m, s in zip(self.mean, self.std)]
            self._on[x.device] = tuple(torch.tensor(v, dtype=torch.float32, device=x.device).view(1, 3, 1, 1)
                                       for v in (divisor, shift))
        divisor, shift = self._on[x.device]
        return torch.addcdiv(shift, x, divisor)  # (B, 3, H, W) float32


@dataclass
class Pixels:
    """A micro-batch as it leaves a loader worker: crops padded into one uint8 tensor (B, 3, Hmax,
    Wmax), each crop's own (height, width) (B, 2) int64, the flips still to apply (B,) bool, and the
    output side `size`. A quarter of the bytes of the float batch, and the resize to size x size is
    left to `finish`. `aug`: the recipe's augmentation draws still to apply (augmentations.Drawn),
    None when there are none."""

    pixels: torch.Tensor
    sizes: torch.Tensor
    flips: torch.Tensor
    size: int
    aug: Drawn | None = None

    def pin_memory(self) -> Pixels:
        """The DataLoader pins what it ships (pin_memory=True on CUDA hosts) through this method:
        the sizes, flips and augmentation draws too, so `finish` copies them all without a sync
        (`to_device`)."""
        return Pixels(self.pixels.pin_memory(), self.sizes.pin_memory(), self.flips.pin_memory(), self.size,
                      None if self.aug is None else self.aug.pin_memory())


def pack(crops: list[torch.Tensor], flips: np.ndarray, size: int, aug: Drawn | None = None) -> Pixels:
    """uint8 crops (3, h_i, w_i) -> one Pixels, zero-padded to the largest height and width, on the
    crops' device, with the augmentation draws `aug`."""
    sizes = torch.tensor([c.shape[1:] for c in crops], dtype=torch.int64).reshape(-1, 2)  # (B, 2)
    h, w = (sizes.max(0).values.tolist() if len(crops) else (size, size))
    out = torch.zeros((len(crops), 3, h, w), dtype=torch.uint8, device=crops[0].device if crops else None)
    for o, c in zip(out, crops):
        o[:, : c.shape[1], : c.shape[2]] = c
    return Pixels(out, sizes, torch.as_tensor(np.asarray(flips, dtype=bool)).reshape(-1), size, aug)


def draws(sizes: np.ndarray, seed: int, area: tuple[float, float] | None,
          hflip: bool) -> tuple[np.ndarray, np.ndarray]:
    """A micro-batch's random draws for images of (height, width) `sizes` (B, 2), from one numpy
    Generator seeded by the micro-batch: Inception crop boxes (B, 4) over `area` of each image
    (None: whole images), then flips (B,) bool (none unless `hflip`)."""
    rng = np.random.default_rng(seed)
    boxes = inception_boxes(sizes, rng, area) if area is not None else whole_boxes(sizes)
    flips = rng.random(len(boxes)) < 0.5 if hflip else np.zeros(len(boxes), bool)
    return boxes, flips


def whole_boxes(sizes: np.ndarray) -> np.ndarray:
    """(B, 2) (height, width) -> (B, 4) boxes (top, left, height, width) covering each whole
    image."""
    sizes = np.asarray(sizes, dtype=np.int64).reshape(-1, 2)
    return np.concatenate([np.zeros_like(sizes), sizes], axis=1)


def inception_boxes(sizes: np.ndarray, rng: np.random.Generator, area_range: tuple[float, float],
                    aspect_range: tuple[float, float] = ASPECT_RANGE, attempts: int = ATTEMPTS) -> np.ndarray:
    """(B, 2) image (height, width) -> (B, 4) crop boxes (top, left, height, width): big_vision's
    `inception_crop`, i.e. tf.image.sample_distorted_bounding_box(area_range, aspect_ratio_range,
    min_object_covered=0, max_attempts, use_image_if_no_bounding_boxes=True), all images x attempts
    at once.

    Each attempt, transliterated from TF's kernel (sample_distorted_bounding_box_op.cc,
    GenerateRandomCrop): aspect ~ U(lo, hi); the height range [rint(sqrt(min_area / aspect)),
    rint(sqrt(max_area / aspect))] is cut so the width fits and the height fits; a height is drawn
    uniformly from it, width = rint(height * aspect), one row added or removed when rounding left
    the area outside the range; the attempt is rejected if the box still leaves the range or the
    image; its corner is uniform over the places it fits. The first accepted attempt wins; none
    accepted: the whole image. numpy's rint rounds half to even, as lrint does. TF stops at the
    first accepted attempt and we draw all of them: the same distribution, other numbers.
    """
    hw = np.asarray(sizes, dtype=np.int64).reshape(-1, 2)
    b = len(hw)
    H, W = hw[:, :1].astype(np.float64), hw[:, 1:].astype(np.float64)  # (B, 1)
    aspect = rng.uniform(aspect_range[0], aspect_range[1], (b, attempts))  # (B, A)
    min_area, max_area = area_range[0] * W * H, area_range[1] * W * H  # (B, 1)
    height = np.rint(np.sqrt(min_area / aspect))
    max_height = np.rint(np.sqrt(max_area / aspect))
    too_wide = np.rint(max_height * aspect) > W
    max_height = np.where(too_wide, np.floor((W + 0.5 - 1e-7) / aspect), max_height)
    max_height -= too_wide & (np.rint(max_height * aspect) > W)
    max_height = np.minimum(max_height, H)
    height = np.minimum(height, max_height)
    span = np.maximum(max_height - height, 0).astype(np.int64)
    height += np.where(height < max_height, rng.integers(0, span + 1), 0)
    width = np.rint(height * aspect)
    low = width * height < min_area
    height += low
    width = np.where(low, np.rint(height * aspect), width)
    high = width * height > max_area
    height -= high
    width = np.where(high, np.rint(height * aspect), width)
    area = width * height
    ok = ((area >= min_area) & (area <= max_area) & (width <= W) & (height <= H) & (width > 0) & (height > 0)
          & (area >= 1))
    top = rng.integers(0, np.maximum(H - height, 1).astype(np.int64)) * (height < H)
    left = rng.integers(0, np.maximum(W - width, 1).astype(np.int64)) * (width < W)
    first = ok.argmax(1)  # (B,): the first accepted attempt (0 when none is)
    pick = np.arange(b), first
    boxes = np.stack([top[pick], left[pick], height[pick], width[pick]], axis=1).astype(np.int64)
    return np.where(ok.any(1)[:, None], boxes, whole_boxes(hw))


def _axis(out: int, extent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Half-pixel source positions of `out` outputs over each crop's `extent` (B,): (lower, upper,
    weight of the upper), each (B, out); positions clamped to the crop's own edges, not the padded
    tensor's."""
    # (B, 1), float32 as torch's own bilinear computes it
    scale = extent.to(torch.float32)[:, None] / out
    src = (torch.arange(out, device=extent.device, dtype=torch.float32)[None] + 0.5) * scale - 0.5
    src = src.clamp(min=0.0)  # (B, out)
    lo = src.to(torch.int64)  # floor, src >= 0
    last = (extent - 1)[:, None]
    lo = torch.minimum(lo, last)
    hi = torch.minimum(lo + 1, last)
    return lo, hi, src - lo


def levels(pixels: torch.Tensor, sizes: torch.Tensor, size: int,
           flips: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 (B, 3, Hmax, Wmax) crops, each of its own (height, width) in `sizes` (B, 2) at the top
    left -> float32 (B, 3, size, size) holding uint8 levels: tf.image.resize(bilinear,
    antialias=False) per crop, then clipped and rounded to the nearest level, as torch's uint8
    kernel (`bilinear_uint8`, the workers' resize on a CPU) rounds, so a run's batches agree within
    a level whichever device resized them; big_vision's cast back to uint8 truncates instead (half a
    level lower on average). Rows of `flips` (B,) come out mirrored left-right: their output columns
    read the source in reverse, at no cost.

    A gather of the four neighbours of each output pixel straight from the uint8 tensor (the padding
    is never converted), blended with torch.lerp. Written by hand because F.interpolate and
    grid_sample take one source size per call, and the crops of a batch all differ. Within one level
    of F.interpolate on each crop alone: the blend rounds in another order, so a value within ~1e-4
    of a half level may round a level apart.
    """
    b, c, hmax, wmax = pixels.shape
    y0, y1, wy = _axis(size, sizes[:, 0])  # (B, S)
    x0, x1, wx = _axis(size, sizes[:, 1])
    if flips is not None:
        mirror = to_device(flips, x0.device)[:, None]  # (B, 1)
        x0, x1, wx = (torch.where(mirror, t.flip(-1), t) for t in (x0, x1, wx))
    flat = pixels.reshape(b, c, hmax * wmax)
    rows = torch.stack([y0, y0, y1, y1], 1)[:, :, :, None] * wmax  # (B, 4, S, 1): the four corners
    index = (rows + torch.stack([x0, x1, x0, x1], 1)[:, :, None, :]).reshape(b, 1, 4 * size * size)
    corners = flat.gather(2, index.expand(b, c, -1)).reshape(b, c, 4, size, size).to(torch.float32)
    wx = wx[:, None, None, :]  # (B, 1, 1, S)
    top = corners[:, :, 0].lerp_(corners[:, :, 1], wx)  # (B, 3, S, S)
    bottom = corners[:, :, 2].lerp_(corners[:, :, 3], wx)
    return top.lerp_(bottom, wy[:, None, :, None]).clamp_(0, 255).round_()


def tf_bilinear(x: torch.Tensor, size: int) -> torch.Tensor:
    """(n, 3, H, W) or (3, H, W) float -> (..., 3, size, size): tf.image.resize(method="bilinear",
    antialias=False), the TF2 half-pixel-centre sampling (source = (dst + 0.5) * in / out - 0.5,
    clamped at the edges), no prefilter. Channels-last, the layout decoders write: torch's kernel
    for it is ~1.7x faster on a CPU (measured 379 vs 628 us for a 400 px crop to 224) and gives the
    same bits."""
    batch = (x if x.dim() == 4 else x[None]).contiguous(memory_format=torch.channels_last)
    y = F.interpolate(batch, size=(size, size), mode="bilinear", align_corners=False, antialias=False)
    return y if x.dim() == 4 else y[0]


def per_shape(images: list[torch.Tensor], fn, empty: tuple, channels_last: bool = False,
              mirror: np.ndarray | None = None) -> torch.Tensor:
    """fn over uint8 images (3, h_i, w_i) grouped by shape, each group stacked (n, 3, h, w) into one
    call; the results (B, ...) as uint8 in the images' order (`empty`: the shape of none; a float
    result is cast, which truncates), those `mirror` (B,) bool marks flipped left-right on their way
    in. Torch's resize kernels take one source size per call, so images of one shape (a 32 px
    dataset's, whole) cost one call a batch, not one each: ~20x less time at 32 px. A crop of its
    own shape (most, from photographs) is copied straight to its row, flipped in the same copy:
    indexing with a list of rows, then flipping the mirrored rows of the whole batch, cost 0.44
    against 0.26 ms per 224 px crop on one thread. `channels_last`: each group is stacked
    channels-last, the layout decoders write, for an `fn` that reads it so (stack_hwc)."""
    shapes: dict[tuple, list[int]] = {}
    for i, x in enumerate(images):
        shapes.setdefault(tuple(x.shape), []).append(i)
    out = torch.empty(empty, dtype=torch.uint8)
    for rows in shapes.values():
        group = [images[i] for i in rows]
        stack = stack_hwc if channels_last else torch.stack
        y = fn(group[0][None] if len(rows) == 1 else stack(group))
        if len(out) != len(images):
            out = torch.empty((len(images), *y.shape[1:]), dtype=torch.uint8)
        flipped = np.zeros(len(rows), dtype=bool) if mirror is None else np.asarray(mirror, dtype=bool)[rows]
        if flipped.all():
            y = y.flip(-1)
        elif flipped.any():
            y = torch.where(torch.from_numpy(flipped)[:, None, None, None], y.flip(-1), y)
        if len(rows) == len(images):
            # one shape (the usual batch): one copy, the cast and the change of layout together
            out.copy_(y)
        elif len(rows) == 1:
            out[rows[0]].copy_(y[0])
        else:
            out[rows] = y.to(torch.uint8)
    return out


def stack_hwc(images: list[torch.Tensor]) -> torch.Tensor:
    """uint8 images (3, h, w) of one shape -> (n, 3, h, w) channels-last, stacked without the
    transposing copy torch.stack makes of views over (h, w, 3) memory (what the decoders return)."""
    return torch.stack([x.permute(1, 2, 0) for x in images]).permute(0, 3, 1, 2)


def tf_bilinear_clamped(x: torch.Tensor, size: int) -> torch.Tensor:
    """uint8 (n, 3, h, w) -> float32 (n, 3, size, size): `tf_bilinear`, clipped to [0, 255]:
    big_vision's cast back to the decoded dtype but its truncation, left to the caller's cast into
    uint8 (per_shape's copy: one pass fewer). A batch already size x size is returned as it is:
    half-pixel centres at scale 1 sample every pixel exactly."""
    if tuple(x.shape[-2:]) == (size, size):
        return x
    # converted once, channels-last
    x = x.contiguous(memory_format=torch.channels_last).to(torch.float32)
    return tf_bilinear(x, size).clamp_(0, 255)


def bilinear_uint8(x: torch.Tensor, size: int) -> torch.Tensor:
    """uint8 (n, 3, h, w) -> uint8 (n, 3, size, size): TF's half-pixel bilinear (no antialias),
    computed by torch's uint8 kernel, which rounds where big_vision's cast truncates (+0.5 level on
    average; `levels` rounds too), at a quarter of the float path's time on a CPU (measured 63 vs
    245 us, a 300 x 250 crop to 224, one thread). Training only: few-shot features keep the exact
    cast (tf_bilinear_clamped)."""
    if tuple(x.shape[-2:]) == (size, size):
        return x
    # the layout decoders write, the kernel's fast one
    x = x.contiguous(memory_format=torch.channels_last)
    return F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False, antialias=False)


def resample_uint8(x: torch.Tensor, size: int, interpolation: str = "bilinear") -> torch.Tensor:
    """uint8 (n, 3, h, w) -> uint8 (n, 3, size, size) as data.interpolation says: bilinear is
    big_vision's (`bilinear_uint8`, no antialias); bicubic is antialiased, as PIL's resize that
    timm's RandomResizedCrop runs (torch's uint8 kernel, within a level or two of PIL's); nearest
    samples pixel centres, as PIL's (torch's nearest-exact; its `nearest` is off by half a
    pixel)."""
    if interpolation == "bilinear" or tuple(x.shape[-2:]) == (size, size):
        return bilinear_uint8(x, size)
    x = x.contiguous(memory_format=torch.channels_last)
    if interpolation == "nearest":
        return F.interpolate(x, size=(size, size), mode="nearest-exact")
    return F.interpolate(x, size=(size, size), mode=interpolation, align_corners=False, antialias=True)


def resize_each(crops: list[torch.Tensor], flips: np.ndarray, size: int,
                interpolation: str = "bilinear") -> torch.Tensor:
    """uint8 crops (3, h_i, w_i) -> uint8 (B, 3, size, size), flipped where `flips` (B,) says, for a
    loader worker on a CPU: torch's uint8 kernel (`resample_uint8`), one call per crop shape
    (per_shape); the batched gather of `levels` is ~3x slower there (measured: 31 vs 94 ms for 32
    crops of 100-640 px to 224, one thread)."""
    return per_shape(crops, lambda x: resample_uint8(x, size, interpolation), (0, 3, size, size),
                     mirror=np.asarray(flips, dtype=bool).reshape(-1))


def flip(pixels: torch.Tensor, flips: torch.Tensor) -> torch.Tensor:
    """(B, 3, H, W) with the rows of `flips` (B,) bool mirrored left-right."""
    return torch.where(to_device(flips, pixels.device)[:, None, None, None], pixels.flip(-1), pixels)


_SIGNED = Normalise()


def _needs_resize(batch: Pixels) -> bool:
    s = batch.size
    return batch.pixels.shape[-2:] != (s, s) or bool((batch.sizes != s).any())


def finish(batch: Pixels, device: torch.device, aug: Augmentation | None = None,
           normalise: Normalise | None = None) -> torch.Tensor:
    """A worker's uint8 batch -> float32 (B, 3, S, S) on `device`: the copy (4x fewer bytes than
    float, asynchronous from pinned memory), then resize, flip, the recipe's augmentation `aug`
    (what the worker left of it: the batch's draws say), `normalise` (the recipe's data.mean and
    data.std; [-1, 1] when None) and erasing, there."""
    x = to_device(batch.pixels, device)
    drawn = None if batch.aug is None or aug is None else batch.aug.to(device)
    if _needs_resize(batch):
        x = levels(x, to_device(batch.sizes, device), batch.size, batch.flips)  # float32 levels
        if drawn is not None and drawn.on_levels:  # rounded and clamped: exact uint8 levels
            x = x.to(torch.uint8)
    elif bool(batch.flips.any()):
        x = flip(x, batch.flips)
    if drawn is not None and drawn.on_levels:
        x, drawn = apply_levels(x, aug, drawn)
    out = (normalise or _SIGNED)(x)  # levels: uint8, or float32 after a resize here
    return out if drawn is None else apply_normalised(out, aug, drawn)
