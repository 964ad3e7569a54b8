"""DeiT III's 3-Augment on uint8 pixels: drawn on the host for a micro-batch, applied batched on any
device.

DeiT (facebookresearch/deit, augment.py, new_data_aug_generator) runs, after the crop and flip, on
each PIL image: RandomChoice of {Grayscale(3), Solarization (ImageOps.solarize, threshold 128),
GaussianBlur (ImageFilter.GaussianBlur, radius ~ U(0.1, 2.0))}, then ColorJitter(cj, cj, cj) when
color_jitter is not 0 (brightness, contrast and saturation factors ~ U(1 - cj, 1 + cj), in a random
order, no hue). Here `draw` makes those choices in numpy and `apply` runs all images at once: every
image is blurred, greyed and solarised and `torch.where` keeps its own op (no gather of a subset, so
no host sync), then the jitter runs three blend steps, each image taking its own op at each step.

Written by hand because torchvision's transforms take one set of parameters per call (one image, or
one draw for a whole batch). Grayscale and solarize give PIL's exact levels; the blur is the
Gaussian that torchvision's gaussian_blur computes (kernel 2 * ceil(3 sigma) + 1, reflected edges),
not PIL's box-blur approximation of it (0.63 levels from PIL's on average over smooth 32 px images,
0.42 away from the border where PIL extends the edge and we reflect; test_three_augment.py measures
it); the jitter is torchvision's tensor adjust_brightness/contrast/saturation, bit for bit on a CPU
(0.13 levels from PIL's ImageEnhance on average, which DeiT runs: PIL's grey is fixed point and its
contrast mean rounded).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from vitcli.data.augmentation import pillow_ops
from vitcli.runtime.dist import to_device

GRAY, SOLARIZE, BLUR = 0, 1, 2  # the ops, DeiT's RandomChoice order
BRIGHTNESS, CONTRAST, SATURATION = 0, 1, 2  # the jitter's factors, in ColorJitter's order
# DeiT's GaussianBlur radius_min, radius_max (PIL's radius is the Gaussian's sigma)
SIGMA_RANGE = (0.1, 2.0)
# 6: one kernel width (13 taps) for every sigma drawn, so no sync
RADIUS = math.ceil(3 * SIGMA_RANGE[1])
THRESHOLD = 128  # ImageOps.solarize's default


@dataclass
class ThreeDraws:
    """A micro-batch's 3-Augment: `op` (B,) int64 (GRAY, SOLARIZE, BLUR), blur `sigma` (B,) float32,
    jitter `factors` (B, 3) float32 (brightness, contrast, saturation; all 1 without jitter) and
    `order` (B, 3) int64, the factors' indices in the order they apply."""

    op: torch.Tensor
    sigma: torch.Tensor
    factors: torch.Tensor
    order: torch.Tensor

    def pin_memory(self) -> ThreeDraws:
        """Page-locked copies, so that `to` copies to a GPU without a sync (the DataLoader calls
        this)."""
        return ThreeDraws(*(t.pin_memory() for t in (self.op, self.sigma, self.factors, self.order)))

    def to(self, device: torch.device | str) -> ThreeDraws:
        """All four on `device` (to_device: asynchronous from pinned memory)."""
        device = torch.device(device)
        return ThreeDraws(*(to_device(t, device) for t in (self.op, self.sigma, self.factors, self.order)))


def draw(n: int, rng: np.random.Generator, color_jitter: float = 0.3) -> ThreeDraws:
    """The 3-Augment of `n` images, all from `rng`: the op uniformly among three, a blur sigma ~
    U(0.1, 2.0) (drawn for every image, used by the blurred), jitter factors ~ U(max(0, 1 - cj), 1 +
    cj) (torchvision's ColorJitter range) and a uniformly random order of the three."""
    op = rng.integers(0, 3, n)
    sigma = rng.uniform(*SIGMA_RANGE, n)
    low, high = max(0.0, 1 - color_jitter), 1 + color_jitter
    factors = rng.uniform(low, high, (n, 3)) if color_jitter else np.ones((n, 3))
    order = rng.permuted(np.tile(np.arange(3), (n, 1)), axis=1)
    return ThreeDraws(torch.from_numpy(op.astype(np.int64)), torch.from_numpy(sigma.astype(np.float32)),
                      torch.from_numpy(factors.astype(np.float32)), torch.from_numpy(order.astype(np.int64)))


def grayscale(x: torch.Tensor) -> torch.Tensor:
    """uint8 (B, 3, H, W) -> uint8 (B, 3, H, W) grey: PIL's convert("L") (what torchvision's
    Grayscale(3) does to a PIL image), pillow_ops.grey, in each channel."""
    return pillow_ops.grey(x).to(torch.uint8).expand(-1, 3, -1, -1)


def solarize(x: torch.Tensor) -> torch.Tensor:
    """uint8 -> uint8: ImageOps.solarize(threshold=128), every level >= 128 inverted
    (pillow_ops.solarize)."""
    return pillow_ops.solarize(x, torch.full((len(x),), THRESHOLD, dtype=torch.float64, device=x.device))


def kernel_radius(sigma: torch.Tensor) -> torch.Tensor:
    """(B,) sigma -> (B,) the radius ceil(3 sigma) of each image's kernel (2 * radius + 1 taps)."""
    return torch.ceil(3 * sigma.to(torch.float32))


def gaussian_kernels(sigma: torch.Tensor) -> torch.Tensor:
    """(B,) sigma -> (B, 2 RADIUS + 1) normalised 1-D Gaussians, each zero past its own radius: the
    kernel torchvision's gaussian_blur builds for kernel_size 2 * ceil(3 sigma) + 1, padded to the
    widest."""
    k = torch.arange(-RADIUS, RADIUS + 1, device=sigma.device, dtype=torch.float32)
    s = sigma.to(torch.float32)[:, None]
    w = torch.exp(-0.5 * (k / s) ** 2) * (k.abs() <= kernel_radius(sigma)[:, None])
    return w / w.sum(1, keepdim=True)


def reflected(n: int, device: torch.device) -> torch.Tensor:
    """Indices of positions -RADIUS .. n - 1 + RADIUS mirrored into [0, n) about the edge pixels
    (torch's reflect padding, repeated where the pad is wider than the image: a 4 px image, a 13-tap
    kernel)."""
    j = torch.arange(-RADIUS, n + RADIUS, device=device).abs()
    if n == 1:
        return torch.zeros_like(j)
    period = 2 * (n - 1)
    j = j % period
    return torch.where(j >= n, period - j, j)


def blur(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """uint8 (B, C, H, W), (B,) sigma -> uint8: each image blurred by its own Gaussian
    (gaussian_kernels), separably: reflect-pad rows, one grouped conv (groups = B*C), the same for
    columns; rounded to levels."""
    b, c, h, w = x.shape
    if x.numel() == 0:
        return x.clone()
    kernels = gaussian_kernels(to_device(sigma, x.device)).repeat_interleave(c, 0)  # (B*C, K)
    y = x.to(torch.float32).reshape(1, b * c, h, w)
    y = F.conv2d(y.index_select(2, reflected(h, x.device)), kernels[:, None, :, None], groups=b * c)
    y = F.conv2d(y.index_select(3, reflected(w, x.device)), kernels[:, None, None, :], groups=b * c)
    return y.reshape(b, c, h, w).round_().clamp_(0, 255).to(torch.uint8)


def _grey_levels(y: torch.Tensor) -> torch.Tensor:
    """float (B, 3, H, W) levels -> (B, 1, H, W): torchvision's grey of a uint8 image inside
    adjust_contrast/adjust_saturation, floor(0.2989 R + 0.587 G + 0.114 B), computed as it computes
    it."""
    r, g, b = y.unbind(1)
    return r.mul(0.2989).add_(g, alpha=0.587).add_(b, alpha=0.114).floor_()[:, None]


def jitter(x: torch.Tensor, factors: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """uint8 (B, 3, H, W), factors (B, 3), order (B, 3) -> uint8: torchvision's adjust_brightness,
    adjust_contrast and adjust_saturation of a uint8 tensor, per image in its order. Each is a blend
    f * x + (1 - f) * d, clamped to [0, 255] and truncated to a level as torchvision's cast does,
    with d black (brightness), the mean grey level (contrast) or the pixel's grey (saturation)."""
    factors, order = to_device(factors, x.device), to_device(order, x.device)
    y = x.to(torch.float32)
    for step in range(3):
        op = order[:, step, None, None, None]  # (B, 1, 1, 1)
        # (B, 1, 1, 1)
        f = factors.gather(1, order[:, step, None])[:, :, None, None].to(torch.float32)
        grey = _grey_levels(y)
        d = torch.where(op == SATURATION, grey, grey.mean((1, 2, 3), keepdim=True) * (op == CONTRAST))
        # fused as torchvision's add(alpha=)
        y = torch.addcmul(y.mul(f), d, 1 - f).clamp_(0, 255).trunc_()
    return y.to(torch.uint8)


def apply(x: torch.Tensor, draws: ThreeDraws) -> torch.Tensor:
    """uint8 (B, 3, H, W) on any device -> uint8, a new tensor: each image greyed, solarised or
    blurred as draws.op says, then jittered (identity where the factors are 1). No host sync."""
    op = to_device(draws.op, x.device)[:, None, None, None]
    picked = torch.where(op == GRAY, grayscale(x), torch.where(op == SOLARIZE, solarize(x),
                                                              blur(x, draws.sigma)))
    return jitter(picked, draws.factors, draws.order)
