"""The built-in procedural dataset: shapes x textures, drawn so that only local spatial structure
tells the classes apart.

Class k is the pair (SHAPES[k % 6], TEXTURES[k % 5]); since 6 and 5 are coprime this enumerates all
30 pairs (Chinese remainder theorem), and any prefix of the classes mixes shapes and textures, so a
model must read both the outline and the fill pattern. Everything that is *not* the class is random
per image: background and foreground colours (drawn from the same distribution, so mean colour
carries no label), a lighting gradient, object position, scale and a small rotation, texture period
and phase, and pixel noise. Hence a linear model on raw pixels stays weak while a small ViT or conv
net learns it. Horizontal flips and mild crops preserve every class (no chiral pairs), so the usual
augmentations are safe.

Images are drawn in normalised coordinates and anti-aliased over one pixel, so any `img_size` gives
the same picture at a different resolution. Generation is vectorised over chunks of images; nothing
is cached on disk.
"""

from __future__ import annotations

import io

import datasets
import numpy as np
from PIL import Image

from vitcli.errors import DataError
from vitcli.recipe.schema import SyntheticConfig

SHAPES = ("disk", "square", "triangle", "ring", "plus", "diamond")
TEXTURES = ("solid", "hstripes", "vstripes", "checker", "dots")
SPLIT_IDS = {"train": 0, "validation": 1, "test": 2}
_CHUNK = 256  # images rendered at once: keeps the (n, H, W, 3) float32 arrays in cache at 32 px


def class_names(num_classes: int) -> list[str]:
    """Names `shape_texture` of the first `num_classes` classes."""
    return [f"{SHAPES[k % len(SHAPES)]}_{TEXTURES[k % len(TEXTURES)]}" for k in range(num_classes)]


def split_size(cfg: SyntheticConfig, split: str) -> int:
    """Number of images in a synthetic split."""
    return {"train": cfg.train_size, "validation": cfg.val_size, "test": cfg.test_size}[split]


def _shape_sdf(shape: int, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Signed distance-like field (negative inside) of one shape in object units, on coordinates (n,
    H, W)."""
    au, av = np.abs(u), np.abs(v)
    if shape == 0:  # disk
        return np.hypot(u, v) - 0.9
    # square; its rotation jitter stays below 22.5 deg, so it never looks like the diamond
    if shape == 1:
        return np.maximum(au, av) - 0.8
    # equilateral triangle pointing up, circumradius 1.2: max over its three edge normals
    if shape == 2:
        tv = 0.3 - v  # image rows grow downwards
        return np.maximum(-tv, np.maximum(0.866 * u + 0.5 * tv, -0.866 * u + 0.5 * tv)) - 0.6
    if shape == 3:  # ring
        return np.abs(np.hypot(u, v) - 0.65) - 0.3
    if shape == 4:  # plus: union of two bars
        return np.minimum(np.maximum(au - 0.95, av - 0.32), np.maximum(au - 0.32, av - 0.95))
    return (au + av) * 0.7071 - 0.78  # diamond: the square turned by 45 deg


def _texture(texture: int, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Fill pattern in [0, 1], on image-aligned coordinates (n, H, W) measured in texture
    periods."""
    if texture == 0:  # solid
        return np.ones_like(x)
    if texture == 1:  # horizontal stripes vary along y
        return np.clip(0.5 + 2.0 * np.sin(2 * np.pi * y), 0, 1)
    if texture == 2:
        return np.clip(0.5 + 2.0 * np.sin(2 * np.pi * x), 0, 1)
    if texture == 3:  # checker
        return np.clip(0.5 + 4.0 * np.sin(2 * np.pi * x) * np.sin(2 * np.pi * y), 0, 1)
    # round dots on a grid
    return np.clip(2.0 * (np.cos(2 * np.pi * x) + np.cos(2 * np.pi * y)) - 1.5, 0, 1)


def _rotate(x: np.ndarray, y: np.ndarray, angle: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rotate coordinates by per-image angles (n, 1, 1); broadcasts (1, 1, W) and (1, H, 1) to (n,
    H, W)."""
    c, s = np.cos(angle), np.sin(angle)
    return c * x + s * y, -s * x + c * y


def render(labels: np.ndarray, img_size: int, rng: np.random.Generator) -> np.ndarray:
    """Draw one image per label; returns uint8 (n, img_size, img_size, 3)."""
    n, f32 = len(labels), np.float32
    shape, texture = labels % len(SHAPES), labels % len(TEXTURES)
    grid = ((np.arange(img_size) + 0.5) / img_size * 2 - 1).astype(f32)  # pixel centres in (-1, 1)
    gx, gy = grid[None, None, :], grid[None, :, None]

    def draw(*size: int, lo: float = 0.0, hi: float = 1.0) -> np.ndarray:
        return rng.uniform(lo, hi, (n, *size)).astype(f32)

    # every random number is drawn up front in a fixed order: the stream must not depend on the
    # grouping below
    scale = draw(1, 1, lo=0.55, hi=0.75)  # object radius as a fraction of the half-width
    # stay inside the frame
    cx, cy = draw(1, 1, lo=-1) * (0.97 - scale), draw(1, 1, lo=-1) * (0.97 - scale)
    spin = np.where(
        np.isin(shape, (0, 3))[:, None, None], draw(1, 1, lo=-np.pi, hi=np.pi), draw(1, 1, lo=-0.25, hi=0.25)
    )
    period, tilt, px, py = draw(1, 1, lo=0.3, hi=0.42), draw(1, 1, lo=-0.25, hi=0.25), draw(1, 1), draw(1, 1)
    bg = draw(1, 1, 3)
    # >= 0.3 from bg per channel; still uniform like bg
    on = (bg + draw(1, 1, 3, lo=0.3, hi=0.7)) % 1.0
    light_dir, light_amp = draw(1, 1, lo=-np.pi, hi=np.pi), draw(1, 1, hi=0.25)
    sigma = draw(1, 1, 1, lo=0.02, hi=0.06)
    noise = rng.random((n, img_size, img_size, 3), dtype=f32)

    mask = np.empty((n, img_size, img_size), f32)
    for k in range(len(SHAPES)):
        i = np.flatnonzero(shape == k)
        u, v = _rotate(gx - cx[i], gy - cy[i], spin[i])
        # one pixel in object units: the soft edge is one pixel wide
        pixel = (2.0 / img_size) / scale[i]
        mask[i] = np.clip(0.5 - _shape_sdf(k, u / scale[i], v / scale[i]) / pixel, 0, 1)
    fill = np.empty_like(mask)
    for k in range(len(TEXTURES)):
        i = np.flatnonzero(texture == k)
        tx, ty = _rotate(gx, gy, tilt[i])
        fill[i] = _texture(k, tx / period[i] + px[i], ty / period[i] + py[i])

    # composite in place: these (n, H, W, 3) passes dominate the cost, so no temporaries
    off = 0.5 * (on + bg)
    img = fill[..., None] * (on - off)
    img += off
    img -= bg
    img *= mask[..., None]
    img += bg
    # lighting gradient
    img += (light_amp * (np.cos(light_dir) * gx + np.sin(light_dir) * gy))[..., None]
    noise -= 0.5
    noise *= sigma * 3.4641  # uniform noise with standard deviation sigma
    img += noise
    np.clip(img, 0, 1, out=img)
    img *= 255
    img += 0.5
    return img.astype(np.uint8)


def _png(array: np.ndarray) -> dict:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return {"bytes": buf.getvalue(), "path": None}


def make_synthetic(cfg: SyntheticConfig, split: str) -> datasets.Dataset:
    """Synthetic split `train`, `validation` or `test`: balanced labels, deterministic per (seed,
    split)."""
    if split not in SPLIT_IDS:
        raise DataError(f"synthetic has no split '{split}'; available: {', '.join(SPLIT_IDS)}")
    n = split_size(cfg, split)
    rng = np.random.default_rng([cfg.seed, SPLIT_IDS[split]])
    # balanced to within one image per class
    labels = rng.permutation(np.arange(n) % cfg.num_classes)
    images = []
    for lo in range(0, n, _CHUNK):
        images.extend(_png(a) for a in render(labels[lo : lo + _CHUNK], cfg.img_size, rng))
    features = datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=class_names(cfg.num_classes))}
    )
    return datasets.Dataset.from_dict(
        {"image": images, "label": labels.tolist()}, features=features, split=split
    )
