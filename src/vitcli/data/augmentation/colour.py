"""BYOL's colour augmentation (Grill et al. 2020) on one crop, as DINO's DataAugmentationDINO
chains it (main_dino.py; dinov2/data/augmentations.py): colour jitter (brightness, contrast,
saturation and hue in a random order, torchvision's ColorJitter), grayscale, Gaussian blur and
solarisation. multicrop.py draws the arguments per image and runs this in the loader worker on each
resized crop.

The references' own ops on the crop's PIL image, bit for bit (tests/unit/test_multicrop.py), but
the hue, which gives PIL's result through two tables instead of PIL's HSV conversions (3-4x
faster).
Not batched on tensors as the rest of the pipeline is, because that measured slower on a CPU core
(the loader's bottleneck): torchvision's tensor adjust_* transliterated for a batch with a factor
per image cost 95-125 ns a pixel, 14 ms for an image's ten crops, against ~10 ns a pixel for PIL's
uint8 ops; a batched separable 9-tap blur (dinov2's kernel) 20-40 ns a pixel against ~19 for PIL's
box-blur Gaussian, which is DINO's own.
"""

from __future__ import annotations

import functools

import numpy as np
from PIL import Image, ImageFilter, ImageOps
from torchvision.transforms import functional as TF

# BYOL's jitter strengths (brightness, contrast, saturation, hue): factors ~ U(1 - s, 1 + s), the
# hue's shift ~ U(-0.1, 0.1)
JITTER = (0.4, 0.4, 0.2, 0.1)
SIGMA_RANGE = (0.1, 2.0)  # radius_min, radius_max of both references
THRESHOLD = 128  # RandomSolarize(threshold=128)


@functools.cache
def hue_tables() -> tuple[np.ndarray, np.ndarray]:
    """PIL's RGB -> HSV and HSV -> RGB conversions of every 8-bit triple, as (2^24,) uint32 tables
    indexed and valued by the triple's bytes packed little-endian (a | b << 8 | c << 16, what a
    4-byte pixel (a, b, c, 0) reads as): computed by PIL itself (one 4096 x 4096 image each way,
    ~1-2 s and 128 MB once per process, shared by the loader workers it forks), so a lookup is its
    conversion, bit for bit."""
    every = np.arange(1 << 24, dtype=np.uint32)
    square = every.view(np.uint8).reshape(4096, 4096, 4)[..., :3]  # every triple once
    tables = []
    for source, target in (("RGB", "HSV"), ("HSV", "RGB")):
        image = Image.fromarray(np.ascontiguousarray(square), source)
        converted = np.asarray(image.convert(target))
        tables.append(_packed(converted).reshape(-1))
    return tables[0], tables[1]


def _packed(a: np.ndarray) -> np.ndarray:
    """(..., 3) uint8 -> (...) uint32, each triple's bytes as (a, b, c, 0) little-endian."""
    out = np.zeros((*a.shape[:-1], 4), dtype=np.uint8)
    out[..., :3] = a
    return out.view(np.uint32)[..., 0]


def adjust_hue(img: Image.Image, hue_factor: float) -> Image.Image:
    """torchvision's adjust_hue of a PIL RGB image (PIL's 8-bit HSV, the hue plus int(hue_factor x
    255) wrapped mod 256, back to RGB), bit for bit, through two table lookups on its 4-byte pixels
    (hue_tables): 0.5 against 1.6-2.1 ms for PIL's conversions of a 224 px crop, which were the
    largest cost of the whole multi-crop input."""
    to_hsv, to_rgb = hue_tables()
    # r | g << 8 | b << 16 (little-endian)
    pixels = np.frombuffer(img.tobytes("raw", "RGBX"), dtype=np.uint32) & 0xFFFFFF
    hsv = to_hsv.take(pixels)  # h | s << 8 | v << 16
    # the hue byte, wrapping as torchvision's does
    hsv.view(np.uint8)[::4] += np.int32(hue_factor * 255).astype(np.uint8)
    return Image.frombytes("RGB", img.size, to_rgb.take(hsv), "raw", "RGBX")


_ADJUST = (TF.adjust_brightness, TF.adjust_contrast, TF.adjust_saturation)
HUE = 3  # the fourth of ColorJitter's factors


def jitter(img: Image.Image, factors: np.ndarray, order: np.ndarray) -> Image.Image:
    """An RGB image, factors (4,) (brightness, contrast, saturation factors, hue shift), order (4,)
    (a permutation of the four) -> the image jittered: torchvision's ColorJitter with these draws,
    its adjust_brightness, adjust_contrast and adjust_saturation of a PIL image (PIL's
    ImageEnhance) and adjust_hue (bit for bit through tables) in that order."""
    for op in order:
        img = (adjust_hue if op == HUE else _ADJUST[op])(img, float(factors[op]))
    return img


def byol(crop: np.ndarray, factors: np.ndarray | None, order: np.ndarray, grey: bool,
         sigma: float | None, solarize: bool) -> np.ndarray:
    """One crop (H, W, 3) uint8 through BYOL's colour augmentation as DINO's DataAugmentationDINO
    chains it -> (H, W, 3) uint8: the jitter (when `factors`), RandomGrayscale (PIL's convert("L")
    in each channel), GaussianBlur (when `sigma`: DINO's PIL ImageFilter.GaussianBlur(radius=
    sigma)), RandomSolarize(128) (ImageOps.solarize). The references' own ops on the crop's PIL
    image, bit for bit."""
    img = Image.fromarray(crop)
    if factors is not None:
        img = jitter(img, factors, order)
    if grey:
        img = img.convert("L").convert("RGB")
    if sigma is not None:
        img = img.filter(ImageFilter.GaussianBlur(radius=sigma))
    if solarize:
        img = ImageOps.solarize(img, THRESHOLD)
    return np.asarray(img)
