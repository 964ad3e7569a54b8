"""An image folder of JPEG photographs of ImageNet's sizes, written afresh for a measurement (no data is
committed): root/train/<class>/<i>.jpg, random crops of one source picture per class, re-encoded at quality
90 with 375-640 px on the longer side.

The pictures are scikit-image's sample photographs (the `bench` extra) where it is installed, the real
content a JPEG decoder is measured on; without it (CI installs no `bench` extra) each class is a drawn
stand-in of the same sizes (smooth gradients, discs and grain), enough to check the scripts, not to read
decode rates from.
"""

from __future__ import annotations

from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image

PHOTOS = ["astronaut", "coffee", "chelsea", "rocket", "hubble_deep_field", "immunohistochemistry", "retina",
          "camera", "brick", "grass"]  # colour and grey photographs, 300-1000 px, in the scikit-image wheel
LONG_SIDE = (375, 640)  # ImageNet's range of the longer side
QUALITY = 90


def picture(name: str) -> Image.Image:
    """The source picture of class `name`: its scikit-image photograph, else a drawn stand-in."""
    try:
        import skimage.data
    except ImportError:
        return drawn(PHOTOS.index(name) if name in PHOTOS else hash(name) % 1000)
    return Image.fromarray(getattr(skimage.data, name)()).convert("RGB")


def drawn(seed: int, size: tuple[int, int] = (600, 800)) -> Image.Image:
    """A picture of `size` (height, width): a colour gradient, a few soft discs, and grain."""
    rng = np.random.default_rng(seed)
    h, w = size
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    img = rng.uniform(0, 255, 3) * (x / w)[..., None] + rng.uniform(0, 255, 3) * (y / h)[..., None]
    for _ in range(6):
        cy, cx, r = rng.uniform(0, h), rng.uniform(0, w), rng.uniform(20, 150)
        img += rng.uniform(-120, 120, 3) * np.exp(-((y - cy) ** 2 + (x - cx) ** 2) / (2 * r**2))[..., None]
    img += rng.normal(0, 8, img.shape)
    return Image.fromarray(np.clip(img / 2, 0, 255).astype(np.uint8))


def write_class(root: Path, name: str, n: int, seed: int = 0) -> None:
    """root/train/<name>/0000.jpg ...: `n` random crops (60-100% of each side) of the class's picture."""
    rng = np.random.default_rng([seed, PHOTOS.index(name) if name in PHOTOS else 0])
    img = picture(name)
    (root / "train" / name).mkdir(parents=True, exist_ok=True)
    for i in range(n):
        w, h = img.size
        cw, ch = (int(s * rng.uniform(0.6, 1.0)) for s in (w, h))
        x, y = rng.integers(0, w - cw + 1), rng.integers(0, h - ch + 1)
        scale = int(rng.integers(LONG_SIDE[0], LONG_SIDE[1] + 1)) / max(cw, ch)
        crop = img.crop((x, y, x + cw, y + ch)).resize((round(cw * scale), round(ch * scale)),
                                                       Image.BILINEAR)
        crop.save(root / "train" / name / f"{i:04d}.jpg", quality=QUALITY)


def write_jpegs(root: Path, per_class: int, seed: int = 0, classes: int = len(PHOTOS),
                processes: int = 1) -> Path:
    """root/train/<photo>/<i>.jpg for the first `classes` photographs, `per_class` each, classes written in
    `processes` processes at once."""
    names = PHOTOS[:classes]
    if processes <= 1:
        for name in names:
            write_class(root, name, per_class, seed)
        return root
    with ProcessPoolExecutor(min(processes, len(names))) as pool:
        list(pool.map(write_class, [root] * len(names), names, [per_class] * len(names),
                      [seed] * len(names)))
    return root
