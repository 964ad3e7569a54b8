"""Batched augmentation on uint8 pixels: big_vision's Inception crop boxes (drawn for a whole micro-batch in
numpy), one batched half-pixel bilinear resize of crops of different sizes, flip and the [-1, 1] scaling.

The loader workers only decode and cut crops (decode.py, transforms.py); `finish` runs the resize, flip and
normalisation on the device the model runs on, in the same code for CPU and CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

ASPECT_RANGE = (3 / 4, 4 / 3)  # big_vision inception_crop = TF sample_distorted_bounding_box's default
ATTEMPTS = 100  # TF's max_attempts default


@dataclass
class Pixels:
    """A micro-batch as it leaves a loader worker: crops padded into one uint8 tensor (B, 3, Hmax, Wmax), each
    crop's own (height, width) (B, 2) int64, the flips still to apply (B,) bool, and the output side `size`.
    A quarter of the bytes of the float batch, and the resize to size x size is left to `finish`."""

    pixels: torch.Tensor
    sizes: torch.Tensor
    flips: torch.Tensor
    size: int

    def pin_memory(self) -> Pixels:
        """The DataLoader pins what it ships (pin_memory=True on CUDA hosts) through this method."""
        return Pixels(self.pixels.pin_memory(), self.sizes, self.flips, self.size)

    def __len__(self) -> int:
        return len(self.pixels)


def pack(crops: list[torch.Tensor], flips: np.ndarray, size: int) -> Pixels:
    """uint8 crops (3, h_i, w_i) -> one Pixels, zero-padded to the largest height and width."""
    sizes = torch.tensor([c.shape[1:] for c in crops], dtype=torch.int64).reshape(-1, 2)  # (B, 2)
    h, w = (sizes.max(0).values.tolist() if len(crops) else (size, size))
    out = torch.zeros((len(crops), 3, h, w), dtype=torch.uint8)
    for o, c in zip(out, crops):
        o[:, : c.shape[1], : c.shape[2]] = c
    return Pixels(out, sizes, torch.as_tensor(np.asarray(flips, dtype=bool)).reshape(-1), size)


def whole_boxes(sizes: np.ndarray) -> np.ndarray:
    """(B, 2) (height, width) -> (B, 4) boxes (top, left, height, width) covering each whole image."""
    sizes = np.asarray(sizes, dtype=np.int64).reshape(-1, 2)
    return np.concatenate([np.zeros_like(sizes), sizes], axis=1)


def inception_boxes(sizes: np.ndarray, rng: np.random.Generator, area_range: tuple[float, float],
                    aspect_range: tuple[float, float] = ASPECT_RANGE, attempts: int = ATTEMPTS) -> np.ndarray:
    """(B, 2) image (height, width) -> (B, 4) crop boxes (top, left, height, width): big_vision's
    `inception_crop`, i.e. tf.image.sample_distorted_bounding_box(area_range, aspect_ratio_range,
    min_object_covered=0, max_attempts, use_image_if_no_bounding_boxes=True), all images x attempts at once.

    Each attempt, transliterated from TF's kernel (sample_distorted_bounding_box_op.cc, GenerateRandomCrop):
    aspect ~ U(lo, hi); the height range [rint(sqrt(min_area / aspect)), rint(sqrt(max_area / aspect))] is
    cut so the width fits and the height fits; a height is drawn uniformly from it, width = rint(height *
    aspect), one row added or removed when rounding left the area outside the range; the attempt is rejected
    if the box still leaves the range or the image; its corner is uniform over the places it fits. The first
    accepted attempt wins; none accepted: the whole image. numpy's rint rounds half to even, as lrint does.
    TF stops at the first accepted attempt and we draw all of them: the same distribution, other numbers.
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
    """Half-pixel source positions of `out` outputs over each crop's `extent` (B,): (lower, upper, weight of
    the upper), each (B, out); positions clamped to the crop's own edges, not the padded tensor's."""
    scale = extent.to(torch.float32)[:, None] / out  # (B, 1), float32 as torch's own bilinear computes it
    src = (torch.arange(out, device=extent.device, dtype=torch.float32)[None] + 0.5) * scale - 0.5
    src = src.clamp(min=0.0)  # (B, out)
    lo = src.to(torch.int64)  # floor, src >= 0
    last = (extent - 1)[:, None]
    lo = torch.minimum(lo, last)
    hi = torch.minimum(lo + 1, last)
    return lo, hi, src - lo


def resize(pixels: torch.Tensor, sizes: torch.Tensor, size: int) -> torch.Tensor:
    """uint8 (B, 3, Hmax, Wmax) crops, each of its own (height, width) in `sizes` (B, 2) at the top left ->
    uint8 (B, 3, size, size): tf.image.resize(bilinear, antialias=False) per crop, then cast back to uint8 by
    clipping and truncating, as big_vision's resize op returns its input's dtype.

    A gather of the four neighbours per output pixel, weighted in torch's own order of float32 operations
    (upsample_bilinear2d, align_corners=False), so on CPU a crop comes out bit-identical to F.interpolate on
    that crop alone. Written by hand because F.interpolate and grid_sample take one source size per call, and
    the crops of a batch all differ.
    """
    b, c, hmax, wmax = pixels.shape
    y0, y1, wy = _axis(size, sizes[:, 0])  # (B, S)
    x0, x1, wx = _axis(size, sizes[:, 1])
    flat = pixels.reshape(b, c, hmax * wmax).to(torch.float32)

    def at(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        index = (y[:, :, None] * wmax + x[:, None, :]).reshape(b, 1, size * size).expand(b, c, -1)
        return flat.gather(2, index).reshape(b, c, size, size)

    wy, wx = wy[:, None, :, None], wx[:, None, None, :]  # (B, 1, S, 1), (B, 1, 1, S)
    top = (1 - wx) * at(y0, x0) + wx * at(y0, x1)
    bottom = (1 - wx) * at(y1, x0) + wx * at(y1, x1)
    out = (1 - wy) * top + wy * bottom  # (B, 3, S, S)
    return out.clamp_(0, 255).to(torch.uint8)  # .to truncates toward zero: tf.cast


def flip(pixels: torch.Tensor, flips: torch.Tensor) -> torch.Tensor:
    """(B, 3, H, W) with the rows of `flips` (B,) bool mirrored left-right."""
    return torch.where(flips.to(pixels.device)[:, None, None, None], pixels.flip(-1), pixels)


def resized(batch: Pixels) -> torch.Tensor:
    """The batch's uint8 (B, 3, S, S), resized and flipped where it is not yet (on the batch's device)."""
    x, s = batch.pixels, batch.size
    if x.shape[-2:] != (s, s) or bool((batch.sizes != s).any()):
        x = resize(x, batch.sizes.to(x.device), s)
    return flip(x, batch.flips) if bool(batch.flips.any()) else x


def finish(batch: Pixels, device: torch.device) -> torch.Tensor:
    """A worker's uint8 batch -> float32 (B, 3, S, S) in [-1, 1] on `device`: the copy (4x fewer bytes than
    float, asynchronous from pinned memory), then resize, flip and x / 127.5 - 1 (the ViT's mean = std = 0.5)
    there."""
    x = batch.pixels
    if device.type == "cuda" and not x.is_pinned():
        x = x.pin_memory()  # non_blocking only overlaps from page-locked memory
    moved = Pixels(x.to(device, non_blocking=True), batch.sizes.to(device, non_blocking=True), batch.flips,
                   batch.size)
    return resized(moved).to(torch.float32) / 127.5 - 1.0
