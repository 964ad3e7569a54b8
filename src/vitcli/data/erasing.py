"""Random erasing with timm's `RandomErasing` semantics, its boxes drawn on the host for a whole micro-batch
(numpy, from the caller's Generator) and erased on the model's device in one batched pass.

timm erases image by image in the dataset transform (timm/data/random_erasing.py): per image, with
probability `prob`, `count` boxes (fixed, or uniform in [min_count, max_count]); each box tries up to 10
times an area fraction ~ U(min_area, max_area) / count and a log-uniform aspect, keeps the first that fits
strictly inside the image, and puts its corner uniformly over the places it fits. We draw the same boxes
(`draw`) for all images x boxes x attempts at once, and `apply` fills them after normalisation: N(0, 1)
noise per pixel (`pixel`), one N(0, 1) colour per box and channel (`rand`), or zeros (`const`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from vitcli.runtime.dist import to_device

ATTEMPTS = 10  # timm's tries per box


@dataclass(frozen=True)
class ErasingSpec:
    """timm RandomErasing's arguments (probability, mode, min_count, max_count, min_area, max_area,
    min_aspect, max_aspect), our defaults: timm's train-time defaults (re_prob 0.25, re_mode pixel)."""

    prob: float = 0.25
    mode: Literal["pixel", "rand", "const"] = "pixel"
    min_count: int = 1
    max_count: int = 1
    min_area: float = 0.02
    max_area: float = 1 / 3
    min_aspect: float = 0.3
    max_aspect: float | None = None  # None: 1 / min_aspect, as timm

    def __post_init__(self):
        if self.mode not in ("pixel", "rand", "const"):
            raise ValueError(f"erasing mode {self.mode!r}: choose pixel, rand or const")
        if not 1 <= self.min_count <= self.max_count:
            raise ValueError(f"erasing counts ({self.min_count}, {self.max_count}): need 1 <= min <= max")


@dataclass
class ErasingDraws:
    """A micro-batch's erasing as drawn on the host: `boxes` (B, max_count, 4) int64 (top, left, height,
    width), height 0 for no box; `noise_seed` (B,) int64, which seeds the fill (apply reads the first)."""

    boxes: torch.Tensor
    noise_seed: torch.Tensor
    # the images with a box (erased_images), found where the draws are made, so that apply neither asks the
    # device (nonzero would sync) nor fills every image, and pinned with the batch by the DataLoader
    erased: torch.Tensor

    def pin_memory(self) -> ErasingDraws:
        """Page-locked copies, so that `to` copies the boxes to a GPU without a sync (the DataLoader calls
        this when it pins a batch)."""
        return ErasingDraws(self.boxes.pin_memory(), self.noise_seed.pin_memory(), self.erased.pin_memory())

    def to(self, device: torch.device | str) -> ErasingDraws:
        """The boxes and erased images on `device` (to_device: asynchronous from pinned memory). `noise_seed`
        stays on the host: it seeds a torch.Generator, which takes a Python int, and reading it back from a
        GPU would stall."""
        device = torch.device(device)
        return ErasingDraws(to_device(self.boxes, device), self.noise_seed, to_device(self.erased, device))


def erased_images(boxes: torch.Tensor) -> torch.Tensor:
    """(n,) int64 indices of the images with at least one box, from host boxes (B, K, 4)."""
    return (boxes[:, :, 2] > 0).any(1).nonzero().squeeze(1)


def _counts(spec: ErasingSpec, n: int, rng: np.random.Generator) -> np.ndarray:
    """(n,) boxes per image: min_count, or uniform in [min_count, max_count] (timm's random.randint, which
    includes both ends)."""
    if spec.min_count == spec.max_count:
        return np.full(n, spec.min_count, dtype=np.int64)
    return rng.integers(spec.min_count, spec.max_count + 1, n)


def box_sizes(spec: ErasingSpec, counts: np.ndarray, height: int, width: int,
              rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(n,) counts -> each box's (height, width) at its first accepted attempt and whether one was, each
    (n, max_count). timm per attempt: target = U(min_area, max_area) * area / count, aspect =
    exp(U(log lo, log hi)), h = round(sqrt(target * aspect)), w = round(sqrt(target / aspect)), accepted if
    w < width and h < height (strictly). Python's round and numpy's rint both round half to even."""
    shape = (len(counts), spec.max_count, ATTEMPTS)
    hi = spec.max_aspect or 1 / spec.min_aspect  # `or`, as timm: 0 counts as None
    target = rng.uniform(spec.min_area, spec.max_area, shape) * (height * width) / counts[:, None, None]
    aspect = np.exp(rng.uniform(math.log(spec.min_aspect), math.log(hi), shape))
    h = np.rint(np.sqrt(target * aspect)).astype(np.int64)
    w = np.rint(np.sqrt(target / aspect)).astype(np.int64)
    ok = (w < width) & (h < height)
    first = ok.argmax(-1)[..., None]  # (n, K, 1): the first accepted attempt (0 when none is)
    return (np.take_along_axis(h, first, -1)[..., 0], np.take_along_axis(w, first, -1)[..., 0],
            ok.any(-1))


def draw(spec: ErasingSpec, n: int, height: int, width: int, rng: np.random.Generator) -> ErasingDraws:
    """The erasing of `n` images of height x width, all from `rng`: which images (prob), their box counts,
    box sizes (box_sizes), corners uniform over [0, height - h] x [0, width - w] (both ends included, as
    Python's randint), and the fill's seed. timm draws box after box and stops at the first accepted attempt;
    we draw every attempt of every box: the same distribution, other numbers."""
    erased = rng.random(n) < spec.prob  # timm skips when random() > prob: the same but for a null set
    counts = _counts(spec, n, rng)
    h, w, ok = box_sizes(spec, counts, height, width, rng)  # (n, K) each
    top = rng.integers(0, np.maximum(height - h, 0) + 1)
    left = rng.integers(0, np.maximum(width - w, 0) + 1)
    # a box of zero height or width erases nothing in timm either
    used = erased[:, None] & (np.arange(spec.max_count) < counts[:, None]) & ok & (h > 0) & (w > 0)
    boxes = np.stack([top, left, h, w], -1) * used[..., None]  # (n, K, 4), all zero where unused
    seeds = rng.integers(0, np.iinfo(np.int64).max, n, dtype=np.int64)
    boxes = torch.from_numpy(boxes.astype(np.int64))
    return ErasingDraws(boxes, torch.from_numpy(seeds), erased_images(boxes))


def box_masks(boxes: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """(B, K, 4) (top, left, h, w) -> bool (B, K, H, W): each box's pixels, by broadcasting row and column
    ranges against the boxes (no loop over images); a box of height 0 covers nothing."""
    top, left, h, w = (boxes[..., i, None, None] for i in range(4))  # (B, K, 1, 1) each
    rows = torch.arange(height, device=boxes.device)[:, None]  # (H, 1)
    cols = torch.arange(width, device=boxes.device)[None, :]  # (1, W)
    return (rows >= top) & (rows < top + h) & (cols >= left) & (cols < left + w)


def apply(x: torch.Tensor, draws: ErasingDraws, spec: ErasingSpec) -> torch.Tensor:
    """Float (B, C, H, W), normalised, on any device -> an erased copy (x itself is left as it was): the
    images with a box are erased (`erase`), the others copied. The fill comes from one torch.Generator on
    x's device seeded with draws.noise_seed[0] (a host tensor), so the result is a function of the draws
    on a given device; no host sync (the erased images were found with the draws: ErasingDraws.erased)."""
    out = x.clone()
    if len(draws.erased):
        idx = to_device(draws.erased, x.device)
        boxes = to_device(draws.boxes, x.device)[idx]
        out.index_copy_(0, idx, erase(x[idx], boxes, int(draws.noise_seed[0]), spec))
    return out


def erase(x: torch.Tensor, boxes: torch.Tensor, seed: int, spec: ErasingSpec) -> torch.Tensor:
    """Images x (n, C, H, W) with their boxes (n, K, 4) on x's device -> erased copies, the fill from a
    torch.Generator seeded with `seed`. Where boxes overlap the later one's fill wins, as timm writes box
    after box."""
    b, c, height, width = x.shape
    masks = box_masks(boxes, height, width)[:, :, None]  # (n, K, 1, H, W)
    if spec.mode == "const":
        return x.masked_fill(masks.any(1), 0.0)
    gen = torch.Generator(device=x.device)
    gen.manual_seed(seed)
    if spec.mode == "pixel":  # each pixel is noise once, whichever box wrote it last
        noise = torch.randn(x.shape, generator=gen, device=x.device, dtype=torch.float32)
        return torch.where(masks.any(1), noise.to(x.dtype), x)
    colours = torch.randn((b, masks.shape[1], c, 1, 1), generator=gen, device=x.device).to(x.dtype)
    out = x
    for k in range(masks.shape[1]):  # max_count boxes, in timm's order
        out = torch.where(masks[:, k], colours[:, k], out)
    return out.clone() if out is x else out
