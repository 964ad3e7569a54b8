"""Encoded image bytes -> uint8 (3, H, W) RGB tensors, never PIL images past the header.

torchvision's decoders (libjpeg-turbo, libpng) do the work; grey, palette and RGBA images become RGB
there. What they cannot read (BMP, TIFF, float images...) goes through PIL. A JPEG whose crop is
much larger than the output is decoded at 1/2, 1/4 or 1/8 scale by libjpeg's DCT scaling (PIL's
`draft`): measured on 500 px JPEGs, 547 us full (torchvision) against 514, 418 and 383 us at those
scales. Where the C extension is built, jpeg_region decodes a JPEG crop's region alone, at the same
scale, to the same pixels.
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

from vitcli.data.decoding import jpeg_region

SCALES = (8, 4, 2)  # libjpeg's DCT scalings PIL's draft can ask for, largest first


def encoded(ds: datasets.Dataset, column: str) -> datasets.Dataset:
    """The dataset with its image column left encoded: {"bytes", "path"} rows instead of PIL
    images."""
    return ds.cast_column(column, datasets.Image(decode=False))


def read(raw: dict) -> bytes:
    """The bytes of an encoded image; imagefolder sources keep only the file's path."""
    data = raw.get("bytes")
    return data if data is not None else Path(raw["path"]).read_bytes()


def stretch_binary(pixels: np.ndarray) -> np.ndarray:
    """An image stored as 0/1 pixels (dSprites) -> 0/255, task_adaptation's `image * 255`; else
    unchanged.

    Decided on the pixel range: only an image whose largest value is <= 1 is multiplied (so a copy
    already stored as 0..255 passes as it is). For integer images that means every pixel is 0 or 1;
    a float image in [0, 1] is scaled linearly and rounded. An image with any value above 1 is never
    touched, however dark: its scale is already 0..255, and guessing from its contents would
    brighten real dark images.
    """
    if pixels.size == 0 or pixels.max() > 1:
        return pixels
    return np.rint(pixels.astype(np.float32) * 255).astype(np.uint8)


def _pil_pixels(img: Image.Image, binary: bool) -> torch.Tensor:
    """PIL image -> uint8 (3, H, W), 0/1 images stretched (binary); float and 32-bit images are
    stretched before their 8-bit cast, so the 0/1 test sees their values."""
    if binary and img.mode in ("F", "I", "I;16"):
        arr = stretch_binary(np.asarray(img))
        img = Image.fromarray(arr) if arr.dtype == np.uint8 else img
    # (H, W, 3), writable (torch wants it)
    arr = np.array(img if img.mode == "RGB" else img.convert("RGB"))
    arr = stretch_binary(arr) if binary else arr
    # (3, H, W) over (H, W, 3) memory, as torchvision's decoders return it: resizing reads it
    # channels-last
    return torch.from_numpy(arr).permute(2, 0, 1)


# A JPEG's start-of-frame markers (baseline, extended, progressive, lossless; Huffman or arithmetic
# coded): the segment that holds the size. DHT (C4), JPG (C8) and DAC (CC) share the range but are
# not frames.
_SOF = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})
_PNG = b"\x89PNG\r\n\x1a\n"


def header_size(data: bytes) -> tuple[str, int, int] | None:
    """("JPEG" or "PNG", height, width) read from the first bytes of a JPEG (its start-of-frame
    segment) or a PNG (its IHDR chunk); None for any other file, or one these few lines cannot vouch
    for (PIL then decides). By hand because PIL's header parse reads every table in Python: 93 us
    per JPEG of ImageNet's size, ~7% of what a training crop costs on a core, where walking the
    segment lengths costs ~2 us."""
    if data[:8] == _PNG and data[12:16] == b"IHDR" and len(data) >= 24:
        width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
        return ("PNG", height, width) if height and width else None
    if data[:2] != b"\xff\xd8":
        return None
    i = 2
    while i + 4 <= len(data):
        if data[i] != 0xFF:
            return None  # not at a marker: leave the file to PIL
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte before a marker
            i += 1
        elif marker == 0x01 or 0xD0 <= marker <= 0xD8:  # markers without a length
            i += 2
        elif marker in _SOF:
            if i + 9 > len(data):
                return None
            height, width = (int.from_bytes(data[j : j + 2], "big") for j in (i + 5, i + 7))
            # height 0: given later (DNL)
            return ("JPEG", height, width) if height and width else None
        else:
            length = int.from_bytes(data[i + 2 : i + 4], "big")
            # a broken length, or the scan reached before any frame
            if length < 2 or marker == 0xDA:
                return None
            i += 2 + length
    return None


class Encoded:
    """One encoded image: its size read from its header when first asked for, its pixels decoded on
    demand, whole or a crop.

    Reading the header raises for bytes no decoder knows (PIL's UnidentifiedImageError): such an
    image is undecodable before any pixel is read. A truncated file fails later, in `pixels`.
    Lazily: a whole-image decode (evaluation, few-shot) never needs it. A JPEG's or PNG's size is
    read by header_size; PIL parses the headers of the rest."""

    def __init__(self, data: bytes, binary: bool = False):
        # binary: 0/1 images stretched to 0/255 (data.binary_pixels)
        self.data, self.binary = data, binary

    @functools.cached_property
    def header(self) -> Image.Image:
        """PIL's view of the file's header; no pixel decoded."""
        return Image.open(io.BytesIO(self.data))

    @functools.cached_property
    def found(self) -> tuple[str, int, int] | None:
        """header_size's reading of the bytes."""
        return header_size(self.data)

    @property
    def format(self) -> str:
        """"JPEG", "PNG", or PIL's name for the file's format."""
        return self.found[0] if self.found else self.header.format

    @property
    def size(self) -> tuple[int, int]:
        """(height, width) at full resolution."""
        return self.found[1:] if self.found else (self.header.height, self.header.width)

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
        """uint8 (3, h, w): the crop `box` (top, left, height, width; None: the whole image). When
        the image is a JPEG and the crop holds at least `out` pixels per side at 1/k scale (k = 8,
        4, 2), it is decoded at that scale and the box scaled with it: libjpeg's DCT scaling
        averages blocks, a prefilter much like the one a downscale wants anyway, at a fraction of
        the cost. A JPEG's crop alone is decoded where jpeg_region can (the same pixels); else the
        whole image is, then sliced."""
        if box is None:
            return self.full()
        top, left, h, w = box = tuple(int(v) for v in box)
        if self.format != "JPEG" or self.binary:
            return self.full()[:, top : top + h, left : left + w]
        k = next((k for k in SCALES if min(h, w) >= out * k), 1) if out else 1
        x = jpeg_region.crop(self.data, self.size, box, k)
        if x is None and k == 1:
            x = self.full()[:, top : top + h, left : left + w]
        return self._drafted(box, k) if x is None else x

    def _drafted(self, box: tuple[int, int, int, int], k: int) -> torch.Tensor:
        """uint8 (3, h, w): the crop `box`, from the whole image decoded at 1/k scale by PIL's
        draft."""
        height, width = self.size
        # drafted below
        img = self.__dict__.pop("header", None) or Image.open(io.BytesIO(self.data))
        img.draft("RGB", (width // k, height // k))
        x = _pil_pixels(img, False)  # (3, ceil(H/k), ceil(W/k))
        top, left, h, w = jpeg_region.scaled_box(box, self.size, k)
        return x[:, top : top + h, left : left + w]


class Decoded:
    """An image already decoded (the small-dataset cache): the same `size` and `pixels` as
    Encoded."""

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
    """A torchvision decoder's result, without the notice torchvision 0.29 gives at every call
    (TorchCodec will take its decoders over one day)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return decoder(*args, **kwargs)
