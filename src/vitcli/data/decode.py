"""Encoded image bytes -> uint8 (3, H, W) RGB tensors, never PIL images past the header.

torchvision's decoders (libjpeg-turbo, libpng) do the work; grey, palette and RGBA images become RGB there.
What they cannot read (BMP, TIFF, float images...) goes through PIL. A JPEG whose crop is much larger than the
output is decoded at 1/2, 1/4 or 1/8 scale by libjpeg's DCT scaling (PIL's `draft`): measured on 500 px
JPEGs, 547 us full (torchvision) against 514, 418 and 383 us at those scales, 16 us to read the header.
"""

from __future__ import annotations

import functools
import io
import warnings
from pathlib import Path

import datasets
import numpy as np
import torch
from PIL import Image
from torchvision.io import ImageReadMode, decode_image

SCALES = (8, 4, 2)  # libjpeg's DCT scalings PIL's draft can ask for, largest first


def encoded(ds: datasets.Dataset, column: str) -> datasets.Dataset:
    """The dataset with its image column left encoded: {"bytes", "path"} rows instead of PIL images."""
    return ds.cast_column(column, datasets.Image(decode=False))


def read(raw: dict) -> bytes:
    """The bytes of an encoded image; imagefolder sources keep only the file's path."""
    data = raw.get("bytes")
    return data if data is not None else Path(raw["path"]).read_bytes()


def stretch_binary(pixels: np.ndarray) -> np.ndarray:
    """An image stored as 0/1 pixels (dSprites) -> 0/255, task_adaptation's `image * 255`; else unchanged.

    Decided on the pixel range: only an image whose largest value is <= 1 is multiplied (so a copy already
    stored as 0..255 passes as it is). For integer images that means every pixel is 0 or 1; a float image in
    [0, 1] is scaled linearly and rounded. An image with any value above 1 is never touched, however dark:
    its scale is already 0..255, and guessing from its contents would brighten real dark images.
    """
    if pixels.size == 0 or pixels.max() > 1:
        return pixels
    return np.rint(pixels.astype(np.float32) * 255).astype(np.uint8)


def _pil_pixels(img: Image.Image, binary: bool) -> torch.Tensor:
    """PIL image -> uint8 (3, H, W), 0/1 images stretched (binary); float and 32-bit images are stretched
    before their 8-bit cast, so the 0/1 test sees their values."""
    if binary and img.mode in ("F", "I", "I;16"):
        arr = stretch_binary(np.asarray(img))
        img = Image.fromarray(arr) if arr.dtype == np.uint8 else img
    arr = np.array(img if img.mode == "RGB" else img.convert("RGB"))  # (H, W, 3), writable (torch wants it)
    arr = stretch_binary(arr) if binary else arr
    # (3, H, W) over (H, W, 3) memory, as torchvision's decoders return it: resizing reads it channels-last
    return torch.from_numpy(arr).permute(2, 0, 1)


class Encoded:
    """One encoded image: its header (format, size) read when first asked for, its pixels decoded on demand,
    whole or a crop.

    Reading the header raises for bytes no decoder knows (PIL's UnidentifiedImageError): such an image is
    undecodable before any pixel is read. A truncated file fails later, in `pixels`. Lazily: a whole-image
    decode (evaluation, few-shot) never needs it, and PIL's parse of a small PNG costs more than its decode
    (measured 30 vs 27 us at 32 px)."""

    def __init__(self, data: bytes, binary: bool = False):
        self.data, self.binary = data, binary  # binary: 0/1 images stretched to 0/255 (data.binary_pixels)

    @functools.cached_property
    def header(self) -> Image.Image:
        """PIL's view of the file's header; no pixel decoded."""
        return Image.open(io.BytesIO(self.data))

    @property
    def size(self) -> tuple[int, int]:
        """(height, width) at full resolution."""
        return self.header.height, self.header.width

    def full(self) -> torch.Tensor:
        """uint8 (3, H, W): torchvision's decoder, PIL for the formats it lacks."""
        try:
            data = torch.frombuffer(bytearray(self.data), dtype=torch.uint8)
            x = _quietly(decode_image, data, mode=ImageReadMode.RGB)
        except RuntimeError:  # BMP, TIFF, GIF frames...: not torchvision's
            x = None
        if x is None or x.dtype != torch.uint8:  # 16-bit PNGs decode to uint16
            return _pil_pixels(Image.open(io.BytesIO(self.data)), self.binary)
        return torch.from_numpy(stretch_binary(x.numpy())) if self.binary else x

    def pixels(self, box=None, out: int = 0) -> torch.Tensor:
        """uint8 (3, h, w): the crop `box` (top, left, height, width; None: the whole image). When the image
        is a JPEG and the crop holds at least `out` pixels per side at 1/k scale (k = 8, 4, 2), it is decoded
        at that scale and the box scaled with it: libjpeg's DCT scaling averages blocks, a prefilter much like
        the one a downscale wants anyway, at a fraction of the cost."""
        if box is None:
            return self.full()
        top, left, h, w = (int(v) for v in box)
        k = next((k for k in SCALES if min(h, w) >= out * k), 1) if out and not self.binary else 1
        if k == 1 or self.header.format != "JPEG":
            return self.full()[:, top : top + h, left : left + w]
        img = Image.open(io.BytesIO(self.data))
        img.draft("RGB", (self.header.width // k, self.header.height // k))
        x = _pil_pixels(img, False)  # (3, ~H/k, ~W/k)
        sy, sx = x.shape[1] / self.header.height, x.shape[2] / self.header.width
        y0, x0 = int(top * sy), int(left * sx)
        y1, x1 = max(y0 + 1, round((top + h) * sy)), max(x0 + 1, round((left + w) * sx))
        return x[:, y0:y1, x0:x1]


class Decoded:
    """An image already decoded (the small-dataset cache): the same `size` and `pixels` as Encoded."""

    def __init__(self, x: torch.Tensor):
        self.x = x  # uint8 (3, H, W)

    @property
    def size(self) -> tuple[int, int]:
        """(height, width)."""
        return self.x.shape[1], self.x.shape[2]

    def pixels(self, box=None, out: int = 0) -> torch.Tensor:
        """uint8 (3, h, w): the crop `box` (top, left, height, width) or the whole image."""
        if box is None:
            return self.x
        top, left, h, w = (int(v) for v in box)
        return self.x[:, top : top + h, left : left + w]


def _quietly(decoder, *args, **kwargs):
    """A torchvision decoder's result, without the notice torchvision 0.29 gives at every call (TorchCodec
    will take its decoders over one day)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return decoder(*args, **kwargs)
