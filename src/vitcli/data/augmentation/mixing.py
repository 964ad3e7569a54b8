"""Mixup and CutMix as timm's `Mixup` does them, in two halves: `draw` makes a micro-batch's random
decisions on the host from a numpy Generator the caller seeds, `apply` mixes the images and labels
on their device.

Written here rather than calling timm's `Mixup` because that one draws from numpy's global RNG, and
its `pair` and `elem` modes loop over the images in Python and read each box back to the host. The
decisions are timm's, in its order (`Mixup._params_per_batch`, `_params_per_elem`, `rand_bbox`,
`rand_bbox_minmax`, `cutmix_bbox_and_lam`): mix with probability `prob`; with both alphas > 0,
CutMix with probability `switch_prob`, else mixup; lambda ~ Beta(alpha, alpha); a CutMix box of side
sqrt(1 - lambda) centred uniformly and clipped to the image (or of sides drawn between the
`cutmix_minmax` fractions), lambda then recomputed as the share of the image left outside the box.
Image i mixes with image B-1-i: one lambda for the batch (`batch`), one per image (`elem`), or one
per pair, which both images of the pair take (`pair`). Every draw is kept per image, so `apply` is
one route for the three modes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np
import torch

from vitcli.data.augmentation.erasing import box_masks
from vitcli.runtime.dist import to_device

MixMode = Literal["batch", "pair", "elem"]


@dataclass(frozen=True)
class MixSpec:
    """What to mix, with timm `Mixup`'s arguments and defaults."""

    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0
    # box sides as fractions of the image's; forces CutMix
    cutmix_minmax: tuple[float, float] | None = None
    prob: float = 1.0  # per batch (batch mode) or per image or pair
    switch_prob: float = 0.5  # CutMix rather than mixup, when both alphas > 0
    mode: MixMode = "batch"
    correct_lam: bool = True  # lambda from the clipped box's area (always so with cutmix_minmax)
    label_smoothing: float = 0.1
    num_classes: int = 1000

    def __post_init__(self):
        if self.mode not in get_args(MixMode):
            raise ValueError(f"mode '{self.mode}' is not one of {', '.join(get_args(MixMode))}")
        if self.cutmix_minmax is not None and len(self.cutmix_minmax) != 2:
            raise ValueError(f"cutmix_minmax needs (min, max), got {self.cutmix_minmax}")

    @property
    def active(self) -> bool:
        """Whether anything is ever mixed."""
        some = self.mixup_alpha > 0 or self.cutmix_alpha > 0 or self.cutmix_minmax is not None
        return some and self.prob > 0

    @property
    def cutmix_beta(self) -> float:
        """CutMix's Beta parameter: timm sets it to 1 when cutmix_minmax is given (lambda then comes
        from the box, but the draw still happens and decides whether the image is mixed)."""
        return 1.0 if self.cutmix_minmax is not None else self.cutmix_alpha


@dataclass
class MixDraws:
    """One micro-batch's draws, per image: `lam` (B,) float64, the weight of the image itself (after
    the box correction; 1 where it is not mixed), `use_cutmix` (B,) bool, `boxes` (B, 4) int64 (y0,
    y1, x0, x1), the region taken from the partner image B-1-i (empty where no box was drawn)."""

    lam: torch.Tensor
    use_cutmix: torch.Tensor
    boxes: torch.Tensor

    def pin_memory(self) -> MixDraws:
        """Page-locked copies, so that `to` a GPU is asynchronous (a DataLoader calls this)."""
        return MixDraws(self.lam.pin_memory(), self.use_cutmix.pin_memory(), self.boxes.pin_memory())

    def to(self, device: torch.device) -> MixDraws:
        """The draws on `device`, copied without a host-device sync (runtime.dist.to_device), in one
        copy of one (B, 6) float64 tensor (exact: the boxes are integers far below 2**53) where they
        are not there: the training loop draws them, so each tensor pinned is a page-locked block it
        allocates itself."""
        device = torch.device(device)
        if self.lam.device == device:
            return self
        packed = torch.cat([self.lam[:, None], self.use_cutmix[:, None].double(), self.boxes.double()], 1)
        lam, use_cutmix, boxes = to_device(packed, device).split([1, 1, 4], 1)
        return MixDraws(lam[:, 0], use_cutmix[:, 0].bool(), boxes.long())


def draw(spec: MixSpec, n: int, height: int, width: int, rng: np.random.Generator) -> MixDraws:
    """The draws for `n` images of height x width, from `rng` only: timm's decisions in timm's
    order. An inactive spec draws nothing and mixes nothing."""
    _check_even(n)
    if not spec.active:
        return _per_image(np.ones(n), np.zeros(n, dtype=bool), np.zeros((n, 4), dtype=np.int64))
    if spec.mode == "batch":
        lam, use_cutmix = _params_per_batch(spec, rng)
        # float64, as timm keeps a Python float
        lam, use_cutmix = np.array([lam]), np.array([use_cutmix])
    else:
        lam, use_cutmix = _params_per_elem(spec, n // 2 if spec.mode == "pair" else n, rng)
    lam, boxes = _cut(spec, lam, use_cutmix, height, width, rng)
    if spec.mode == "batch":
        return _per_image(*(np.repeat(a, n, axis=0) for a in (lam, use_cutmix, boxes)))
    # the second of pair (i, B-1-i) takes the first's draws (timm's _mix_pair)
    if spec.mode == "pair":
        return _per_image(*(np.concatenate([a, a[::-1]]) for a in (lam, use_cutmix, boxes)))
    return _per_image(lam, use_cutmix, boxes)


def _per_image(lam: np.ndarray, use_cutmix: np.ndarray, boxes: np.ndarray) -> MixDraws:
    return MixDraws(torch.from_numpy(lam), torch.from_numpy(use_cutmix), torch.from_numpy(boxes))


def _cut(spec: MixSpec, lam: np.ndarray, use_cutmix: np.ndarray, height: int, width: int,
         rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(lambda (k,) float64, boxes (k, 4)) for k images or pairs, or one batch, given their lambdas
    before the box: timm draws a box only for those it mixes with CutMix, and keeps lambda in its
    dtype (float32 per image, a Python float per batch) through the correction."""
    boxes = np.zeros((len(lam), 4), dtype=np.int64)
    cut = use_cutmix & (lam != 1)
    if cut.any():
        lam = lam.copy()
        boxes[cut], lam[cut] = _boxes(spec, lam[cut], height, width, rng)
    return lam.astype(np.float64), boxes


def _check_even(n: int) -> None:
    if n % 2:
        raise ValueError(f"mixup and CutMix pair image i with image B-1-i: the micro-batch needs an even "
                         f"size, got {n}")


def _params_per_batch(spec: MixSpec, rng: np.random.Generator) -> tuple[float, bool]:
    """(lambda before the box, CutMix?) for a whole batch: timm's Mixup._params_per_batch."""
    if not rng.random() < spec.prob:
        return 1.0, False
    mixup_alpha, cutmix_alpha = spec.mixup_alpha, spec.cutmix_beta
    use_cutmix = cutmix_alpha > 0
    if mixup_alpha > 0 and cutmix_alpha > 0:
        use_cutmix = bool(rng.random() < spec.switch_prob)
    alpha = cutmix_alpha if use_cutmix else mixup_alpha
    return float(rng.beta(alpha, alpha)), use_cutmix


def _params_per_elem(spec: MixSpec, count: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(lambda before the box (count,) float32, CutMix? (count,) bool) per image or pair: timm's
    Mixup._params_per_elem, which draws both Betas for every image when it switches."""
    mixup_alpha, cutmix_alpha = spec.mixup_alpha, spec.cutmix_beta
    if mixup_alpha > 0 and cutmix_alpha > 0:
        use_cutmix = rng.random(count) < spec.switch_prob
        cutmix_lam = rng.beta(cutmix_alpha, cutmix_alpha, size=count)
        lam_mix = np.where(use_cutmix, cutmix_lam, rng.beta(mixup_alpha, mixup_alpha, size=count))
    else:
        use_cutmix = np.full(count, cutmix_alpha > 0)
        alpha = cutmix_alpha if cutmix_alpha > 0 else mixup_alpha
        lam_mix = rng.beta(alpha, alpha, size=count)
    mixed = rng.random(count) < spec.prob
    return np.where(mixed, lam_mix.astype(np.float32), np.float32(1)), use_cutmix


def _boxes(spec: MixSpec, lam: np.ndarray, height: int, width: int,
           rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(boxes (k, 4) (y0, y1, x0, x1), lambda (k,)) for k images that CutMix: timm's
    cutmix_bbox_and_lam, drawing each coordinate for all k images at once where timm draws image by
    image."""
    if spec.cutmix_minmax is not None:
        boxes = _boxes_minmax(spec.cutmix_minmax, len(lam), height, width, rng)
    else:
        boxes = _boxes_from_lam(lam, height, width, rng)
    if spec.correct_lam or spec.cutmix_minmax is not None:
        y0, y1, x0, x1 = boxes.T
        lam = 1.0 - (y1 - y0) * (x1 - x0) / float(height * width)
    return boxes, lam


def _boxes_from_lam(lam: np.ndarray, height: int, width: int, rng: np.random.Generator) -> np.ndarray:
    """timm's rand_bbox: sides sqrt(1 - lambda) of the image's (computed in lambda's dtype, as timm
    does), centres uniform over the pixels, the box clipped to the image."""
    ratio = np.sqrt(1 - lam)
    cut_h, cut_w = (height * ratio).astype(np.int64), (width * ratio).astype(np.int64)
    cy = rng.integers(0, height, size=len(lam))
    cx = rng.integers(0, width, size=len(lam))
    y0, y1 = np.clip(cy - cut_h // 2, 0, height), np.clip(cy + (cut_h + 1) // 2, 0, height)
    x0, x1 = np.clip(cx - cut_w // 2, 0, width), np.clip(cx + (cut_w + 1) // 2, 0, width)
    return np.stack([y0, y1, x0, x1], axis=1)


def _boxes_minmax(minmax: tuple[float, float], k: int, height: int, width: int,
                  rng: np.random.Generator) -> np.ndarray:
    """timm's rand_bbox_minmax: sides uniform between the min and max fractions of the image's, the
    box placed uniformly inside the image."""
    cut_h = rng.integers(int(height * minmax[0]), int(height * minmax[1]), size=k)
    cut_w = rng.integers(int(width * minmax[0]), int(width * minmax[1]), size=k)
    y0 = rng.integers(0, height - cut_h + 1, size=k)
    x0 = rng.integers(0, width - cut_w + 1, size=k)
    return np.stack([y0, y0 + cut_h, x0, x0 + cut_w], axis=1)


def apply(x: torch.Tensor, y: torch.Tensor, draws: MixDraws,
          spec: MixSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(mixed images (B, C, H, W), soft targets (B, K) float32) from images x and int64 labels y
    (B,) on one device: timm's Mixup.__call__ given the same draws, batched, with nothing read back
    to the host."""
    n = x.shape[0]
    _check_even(n)
    if draws.lam.shape != (n,):
        raise ValueError(f"draws for {draws.lam.shape[0]} images, got a micro-batch of {n}")
    d = draws.to(x.device)
    partner = x.flip(0)  # (B, C, H, W): image i mixes with image B-1-i
    per_image = (n, 1, 1, 1)
    lam, rest = d.lam.to(x.dtype).view(per_image), (1 - d.lam).to(x.dtype).view(per_image)
    blend = (~d.use_cutmix & (d.lam != 1)).view(per_image)
    # where rather than x * 1 + partner * 0: an image left alone stays bit for bit what it was
    mixed = torch.where(blend, x * lam + partner * rest, x)
    inside = _box_mask(d.boxes, x.shape[-2], x.shape[-1]) & d.use_cutmix.view(per_image)
    return torch.where(inside, partner, mixed), _targets(y, d.lam, spec)


def _box_mask(boxes: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """(B, 1, H, W) bool: the pixels inside each image's box (y0, y1, x0, x1), ends excluded;
    erasing's box_masks on the same boxes as (top, left, height, width)."""
    y0, y1, x0, x1 = boxes.unbind(1)
    return box_masks(torch.stack([y0, x0, y1 - y0, x1 - x0], 1)[:, None], height, width)


def _targets(y: torch.Tensor, lam: torch.Tensor, spec: MixSpec) -> torch.Tensor:
    """(B, K) float32: timm's mixup_target, the smoothed one-hot of each label weighted by its
    image's lambda plus its partner's weighted by 1 - lambda."""
    off = spec.label_smoothing / spec.num_classes
    on = 1.0 - spec.label_smoothing + off
    hot = torch.full((y.shape[0], spec.num_classes), off, dtype=torch.float32, device=y.device)
    hot = hot.scatter_(1, y.long().view(-1, 1), on)
    return hot * lam.float()[:, None] + hot.flip(0) * (1 - lam).float()[:, None]
