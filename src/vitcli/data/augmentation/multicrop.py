"""DINO's multi-crop input (Caron et al. 2021): per image, two global crops of model.img_size and
`local_crops` local crops of local_crop_size, each a RandomResizedCrop (bicubic) and a flip, then
BYOL's colour augmentation (colour.py), as DINO's and DINOv2's DataAugmentationDINO make them, for
a whole micro-batch in the loader worker.

Every draw of an image comes from (run seed, the image's index in the run: sampler.first_sample of
its micro-batch + its row), never from its micro-batch: one process, accumulation and several
ranks draw the same crops and colours for the image at a position of a global batch. The worker
decodes each image once, only the region its crops cover and at the smallest scale they allow (the
decoder's reduced-scale crop path), resizes each crop on uint8 (torch's kernel) and gives it its
colour ops; `Views.finish` normalises the batch on the model's device.

Departures from the references (DINO's main_dino.py, dinov2/data/augmentations.py), named:
- The box sampler is torchvision's RandomResizedCrop.get_params transliterated to numpy, all ten
  attempts of all crops drawn at once (the same distribution, other numbers, as
  augment.inception_boxes vectorises TF's); the resize is torch's antialiased bicubic on uint8
  (within 2 levels of PIL's, which the references run).
- The colour ops are the references' own PIL ops, bit for bit (colour.py), with DINO's blur (PIL's
  ImageFilter.GaussianBlur(radius=sigma)). DINOv2 blurs with torchvision's 9-tap Gaussian instead,
  and its GaussianBlur passes 1 - p to RandomApply, which applies with p: it never blurs the first
  global crop and blurs the second with 0.9 (dinov2 #411, dinov3 #286). The blur here is applied
  with the probabilities the recipe gives (DINO's 1.0 / 0.1 / 0.5).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from vitcli.data.augmentation import colour
from vitcli.data.augmentation.augment import Normalise, Pixels, finish, resample_uint8
from vitcli.data.decoding import jpeg_region
from vitcli.data.decoding.bad_images import Undecodable
from vitcli.data.decoding.decode import SCALES, Encoded
from vitcli.recipe.schema import DinoConfig

RATIO = (3 / 4, 4 / 3)  # RandomResizedCrop's default aspect range, both references'
ATTEMPTS = 10  # torchvision's get_params tries ten boxes before its central fallback
INTERPOLATION = "bicubic"  # both references' RandomResizedCrop(interpolation=BICUBIC)
# the purpose of an image's multi-crop draws (sampler.micro_seed's purposes are per micro-batch)
STREAM = 2


@dataclass(frozen=True)
class MultiCrop:
    """What a multi-crop stream makes of each image: 2 global crops of `global_size` over
    `global_scale` of the area, `local_crops` of `local_size` over `local_scale`, flips (`hflip`),
    colour jitter and grayscale with their probabilities, blur with (global 1, global 2, local)
    probabilities and a sigma in `blur_sigma` pixels, solarisation of the second global crop."""

    global_size: int = 224
    global_scale: tuple[float, float] = (0.4, 1.0)
    local_crops: int = 8
    local_size: int = 96
    local_scale: tuple[float, float] = (0.05, 0.4)
    jitter_prob: float = 0.8
    grayscale_prob: float = 0.2
    blur_prob: tuple[float, float, float] = (1.0, 0.1, 0.5)
    solarize_prob: float = 0.2
    hflip: bool = True
    blur_sigma: tuple[float, float] = colour.SIGMA_RANGE  # pixels of the resized crop

    @classmethod
    def of(cls, dino: DinoConfig, img_size: int) -> MultiCrop:
        """The recipe's multi-crop: its `dino` section, global crops of model.img_size."""
        return cls(img_size, tuple(dino.global_crop_scale), dino.local_crops, dino.local_crop_size,
                   tuple(dino.local_crop_scale), dino.color_jitter_prob, dino.grayscale_prob,
                   tuple(dino.blur_prob), dino.solarize_prob, blur_sigma=tuple(dino.blur_sigma))

    @property
    def views(self) -> int:
        """Crops per image: 2 globals, then the locals."""
        return 2 + self.local_crops


def rrc_boxes(sizes: np.ndarray, scale: np.ndarray, rng: np.random.Generator,
              ratio: tuple[float, float] = RATIO, attempts: int = ATTEMPTS) -> np.ndarray:
    """(N, 2) image (height, width), (N, 2) area range per crop -> (N, 4) boxes (top, left, height,
    width): torchvision's RandomResizedCrop.get_params, every attempt of every crop at once.

    Each attempt: target area = area x U(scale), aspect = exp(U(log ratio)), w = round(sqrt(area x
    aspect)), h = round(sqrt(area / aspect)) (Python's round: half to even, as np.rint); accepted if
    0 < w <= width and 0 < h <= height, its corner uniform over the places it fits. The first
    accepted attempt wins; none: the central crop of the whole image clipped to the ratio range
    (height or width cut to round(side / ratio bound)). torchvision stops at the first accepted
    attempt and draws in float32; we draw all of them in float64: the same distribution, other
    numbers."""
    hw = np.asarray(sizes, dtype=np.int64).reshape(-1, 2)
    n = len(hw)
    H, W = hw[:, :1], hw[:, 1:]  # (N, 1)
    scale = np.asarray(scale, dtype=np.float64).reshape(-1, 2)
    target = (H * W) * rng.uniform(scale[:, :1], scale[:, 1:], (n, attempts))  # (N, A)
    aspect = np.exp(rng.uniform(np.log(ratio[0]), np.log(ratio[1]), (n, attempts)))
    w = np.rint(np.sqrt(target * aspect)).astype(np.int64)
    h = np.rint(np.sqrt(target / aspect)).astype(np.int64)
    ok = (w > 0) & (w <= W) & (h > 0) & (h <= H)
    top = rng.integers(0, np.maximum(H - h + 1, 1))
    left = rng.integers(0, np.maximum(W - w + 1, 1))
    first = ok.argmax(1)
    pick = np.arange(n), first
    boxes = np.stack([top[pick], left[pick], h[pick], w[pick]], axis=1)
    return np.where(ok.any(1)[:, None], boxes, central_boxes(hw, ratio))


def central_boxes(hw: np.ndarray, ratio: tuple[float, float] = RATIO) -> np.ndarray:
    """(N, 2) -> (N, 4): get_params's fallback, the whole image cut to the aspect range, centred
    (margins floored)."""
    H, W = hw[:, 0], hw[:, 1]
    in_ratio = W / H
    w = np.where(in_ratio > ratio[1], np.rint(H * ratio[1]).astype(np.int64), W)
    h = np.where(in_ratio < ratio[0], np.rint(W / ratio[0]).astype(np.int64), H)
    return np.stack([(H - h) // 2, (W - w) // 2, h, w], axis=1)


@dataclass
class Draws:
    """One image's draws for its V = 2 + n crops (globals first): boxes (V, 4), flips (V,),
    jitter applied (V,) with its factors (V, 4) (brightness, contrast, saturation, hue shift) and
    order (V, 4), grayscale (V,), blur (V,) with its sigma (V,), solarise (V,)."""

    boxes: np.ndarray
    flips: np.ndarray
    jitter: np.ndarray
    factors: np.ndarray
    order: np.ndarray
    grey: np.ndarray
    blur: np.ndarray
    sigma: np.ndarray
    solarize: np.ndarray


def draw(spec: MultiCrop, size: tuple[int, int], rng: np.random.Generator) -> Draws:
    """The draws of one image of (height, width) `size`, all from `rng` (the image's own)."""
    v, locals_ = spec.views, spec.local_crops
    scale = np.array([spec.global_scale] * 2 + [spec.local_scale] * locals_, dtype=np.float64)
    boxes = rrc_boxes(np.tile(np.asarray(size), (v, 1)), scale, rng)
    flips = rng.random(v) < 0.5 if spec.hflip else np.zeros(v, bool)
    jitter = rng.random(v) < spec.jitter_prob
    strength = np.array(colour.JITTER)
    low = np.r_[np.maximum(0, 1 - strength[:3]), -strength[3]]
    high = np.r_[1 + strength[:3], strength[3]]
    factors = rng.uniform(low, high, (v, 4))  # ColorJitter.get_params's ranges
    order = rng.permuted(np.tile(np.arange(4), (v, 1)), axis=1)
    grey = rng.random(v) < spec.grayscale_prob
    blur_p = np.array([spec.blur_prob[0], spec.blur_prob[1]] + [spec.blur_prob[2]] * locals_)
    blur = rng.random(v) < blur_p
    sigma = rng.uniform(*spec.blur_sigma, v)
    solarize = (rng.random(v) < spec.solarize_prob) & (np.arange(v) == 1)
    return Draws(boxes, flips, jitter, factors, order, grey, blur, sigma, solarize)


def image_draws(spec: MultiCrop, sizes: list[tuple[int, int]], seed: int,
                first: int) -> list[Draws]:
    """The draws of images at run-wide indices first, first + 1, ...: each from its own generator
    keyed (seed, index, STREAM)."""
    return [draw(spec, hw, np.random.default_rng([seed, first + i, STREAM]))
            for i, hw in enumerate(sizes)]


def _scale(box: np.ndarray, out: int) -> int:
    """The largest of libjpeg's 1/k scalings at which the crop keeps `out` pixels a side
    (decode.py's rule for one crop); 1 when none."""
    return next((k for k in SCALES if min(box[2], box[3]) >= out * k), 1)


def crops_of(img, boxes: np.ndarray, outs: list[int]) -> list[torch.Tensor]:
    """An image's crops `boxes` (V, 4) as uint8 (3, h, w), from one decode: a JPEG's region that
    holds every box (jpeg_region), at the smallest scale any crop allows for its output side
    `outs`; anything else decoded (or cached) whole and sliced."""
    if isinstance(img, Encoded) and not img.binary and img.format == "JPEG":
        k = min(_scale(b, o) for b, o in zip(boxes, outs))
        top, left = boxes[:, 0].min(), boxes[:, 1].min()
        bottom, right = (boxes[:, 0] + boxes[:, 2]).max(), (boxes[:, 1] + boxes[:, 3]).max()
        union = (int(top), int(left), int(bottom - top), int(right - left))
        region = jpeg_region.crop(img.data, img.size, union, k)
        if region is not None:
            y0, x0, _, _ = jpeg_region.scaled_box(union, img.size, k)
            scaled = [jpeg_region.scaled_box(tuple(int(v) for v in b), img.size, k) for b in boxes]
            return [region[:, t - y0 : t - y0 + h, x - x0 : x - x0 + w] for t, x, h, w in scaled]
    whole = img.pixels(None)  # (3, H, W): Decoded's own, or a whole decode
    return [whole[:, t : t + h, x : x + w] for t, x, h, w in boxes.tolist()]


@dataclass
class Views:
    """A multi-crop micro-batch as it leaves a loader worker: the global crops (2B, 3, S, S) and the
    local crops (nB, 3, s, s), uint8, view-major (every image's first crop, then every image's
    second...), resized and augmented; `finish` normalises them on the model's device."""

    globals_: Pixels
    locals_: Pixels

    def pin_memory(self) -> Views:
        """The DataLoader pins what it ships through this method."""
        return Views(self.globals_.pin_memory(), self.locals_.pin_memory())

    def finish(self, device: torch.device,
               normalise: Normalise | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(globals float32 (2B, 3, S, S), locals float32 (nB, 3, s, s)), normalised on `device`."""
        return (finish(self.globals_, device, None, normalise),
                finish(self.locals_, device, None, normalise))


def _square(x: torch.Tensor) -> Pixels:
    """uint8 (N, 3, s, s) -> Pixels that finish only normalises."""
    s = x.shape[-1]
    sizes = torch.full((len(x), 2), s, dtype=torch.int64)
    return Pixels(x, sizes, torch.zeros(len(x), dtype=torch.bool), s)


def augment(hwc: np.ndarray, d: dict[str, np.ndarray]) -> None:
    """Crops (N, s, s, 3) uint8 and their stacked draws (N rows of each Draws field): each crop
    given its colour augmentation (colour.byol) in place, where it draws any."""
    touched = d["jitter"] | d["grey"] | d["blur"] | d["solarize"]
    for i in np.flatnonzero(touched):
        hwc[i] = colour.byol(hwc[i], d["factors"][i] if d["jitter"][i] else None, d["order"][i],
                             bool(d["grey"][i]), float(d["sigma"][i]) if d["blur"][i] else None,
                             bool(d["solarize"][i]))


def resized(crops: list[torch.Tensor], flips: np.ndarray, size: int) -> torch.Tensor:
    """uint8 crops (3, h_i, w_i) -> (N, size, size, 3) uint8, each resized (augment.resample_uint8,
    bicubic: channels-last, the layout its kernel writes and PIL reads) and flipped where `flips`
    says."""
    out = torch.empty((len(crops), size, size, 3), dtype=torch.uint8)
    for o, crop, flip in zip(out, crops, flips):
        y = resample_uint8(crop[None], size, INTERPOLATION)[0]  # (3, size, size)
        o.copy_((y.flip(-1) if flip else y).permute(1, 2, 0))
    return out


def _view_major(per_image: list[np.ndarray]) -> np.ndarray:
    """B arrays (V', ...) -> (V'B, ...): every image's first row, then every image's second..."""
    a = np.stack(per_image, 1)  # (V', B, ...)
    return a.reshape(-1, *a.shape[2:])


def _views(spec: MultiCrop, draws: list[Draws], crops: list[list[torch.Tensor]], which: slice,
           size: int) -> Pixels:
    """The crops `which` of every image, view-major, resized to `size`, flipped and augmented."""
    picked = range(spec.views)[which]
    flat = [crops[i][v] for v in picked for i in range(len(crops))]
    fields = ("flips", "jitter", "factors", "order", "grey", "blur", "sigma", "solarize")
    stacked = {f: _view_major([getattr(d, f)[which] for d in draws]) for f in fields}
    x = resized(flat, stacked["flips"], size)  # (V'B, s, s, 3)
    augment(x.numpy(), stacked)
    return _square(x.permute(0, 3, 1, 2).contiguous())  # (V'B, 3, s, s)


def _sizes(images: list) -> list[tuple[int, int]]:
    sizes = []
    for i, img in enumerate(images):
        try:
            sizes.append(tuple(img.size))
        # PIL's errors for unknown bytes: UnidentifiedImageError, OSError
        except Exception as e:  # noqa: BLE001
            raise Undecodable(i, e) from None
    return sizes


def _transform(images: list, first: int, spec: MultiCrop, seed: int) -> Views:
    """A micro-batch of images (decode.Encoded or Decoded) at run-wide indices first.. -> Views; an
    image that fails names its position (Undecodable), for the batch to put a stand-in there."""
    draws = image_draws(spec, _sizes(images), seed, first)
    outs = [spec.global_size] * 2 + [spec.local_size] * spec.local_crops
    crops = []
    for i, (img, d) in enumerate(zip(images, draws)):
        try:
            crops.append(crops_of(img, d.boxes, outs))
        # decoders fail on corrupt data as OSError, RuntimeError...
        except Exception as e:  # noqa: BLE001
            raise Undecodable(i, e) from None
    return Views(_views(spec, draws, crops, slice(0, 2), spec.global_size),
                 _views(spec, draws, crops, slice(2, None), spec.local_size))


def transform(spec: MultiCrop, seed: int):
    """transform(images, first) -> Views for the loader workers (picklable): `first` is the run-wide
    index of the micro-batch's first image (sampler.first_sample), `seed` the run's. The hue's
    tables are built here, in the process that starts the workers: forked, they share its copy."""
    if spec.jitter_prob > 0:
        colour.hue_tables()
    return partial(_transform, spec=spec, seed=seed)
