"""Encoded image bytes -> uint8 (3, H, W) RGB tensors, never PIL images past the header.

torchvision's decoders (libjpeg-turbo, libpng) do the work; grey, palette and RGBA images become RGB there.
What they cannot read (BMP, TIFF, float images...) goes through PIL. A JPEG whose crop is much larger than the
output is decoded at 1/2, 1/4 or 1/8 scale by libjpeg's DCT scaling (PIL's `draft`): measured on 500 px
JPEGs, 547 us full (torchvision) against 514, 418 and 383 us at those scales, 16 us to read the header.

With data.decode_device=model the training JPEGs skip the workers' decoding: `decode_jpegs` decodes a whole
micro-batch where the model runs, in one torchvision call (nvJPEG on CUDA, libjpeg-turbo on the CPU), always
at full resolution.
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
from torchvision.io import ImageReadMode, decode_image, decode_jpeg

from vitcli.runtime.dist import to_device

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

    @property
    def jpeg(self) -> bool:
        """Whether decode_jpegs may decode it on the model's device: a baseline-colour JPEG (RGB or grey).
        CMYK/YCCK JPEGs (a few dozen in ImageNet) and 0/1 images stay with the workers' decoders."""
        return self.header.format == "JPEG" and self.header.mode in ("RGB", "L") and not self.binary

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

    jpeg = False  # nothing left to decode on the model's device

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


def decode_jpegs(files: list[torch.Tensor], device: torch.device) -> list[torch.Tensor | Exception]:
    """Encoded JPEGs, each a uint8 (n_i,) CPU tensor -> uint8 (3, H_i, W_i) RGB on `device`, in one
    torchvision call (nvJPEG's batched decode on CUDA; on the CPU the same call loops libjpeg-turbo). When
    that call fails (a truncated file fails the whole batch) each file is decoded alone, and the ones that
    still fail come back as their exception, in their place.

    nvJPEG decodes a truncated file to whatever it reached without an error (seen on an H100, torchvision
    0.26: libjpeg-turbo says "Image is incomplete or truncated"), so on CUDA a file that does not end with
    the JPEG end-of-image marker is decoded by libjpeg-turbo on the CPU, which reports it, and the rare
    one it reads anyway is copied to the device."""
    cut = [i for i, f in enumerate(files) if device.type == "cuda" and not _ends_whole(f)]
    if not cut:
        return _decode_each(files, device)
    whole = sorted(set(range(len(files))) - set(cut))
    out: list = [None] * len(files)
    for i, x in zip(whole, _decode_each([files[i] for i in whole], device)):
        out[i] = x
    for i, x in zip(cut, _decode_each([files[i] for i in cut], torch.device("cpu"))):
        out[i] = x if isinstance(x, Exception) else to_device(x, device)
    return out


def _ends_whole(f: torch.Tensor) -> bool:
    """Whether encoded JPEG bytes end with the end-of-image marker FF D9, as a whole file does."""
    return len(f) >= 2 and f[-2:].tolist() == [0xFF, 0xD9]


def _decode_each(files: list[torch.Tensor], device: torch.device) -> list[torch.Tensor | Exception]:
    """`_decode_jpeg` of the whole batch, else of each file alone, a failure as its exception."""
    if not files:
        return []
    try:
        return _decode_jpeg(files, device)
    except RuntimeError:
        pass
    out: list[torch.Tensor | Exception] = []
    for f in files:
        try:
            out.extend(_decode_jpeg([f], device))
        except RuntimeError as e:  # torchvision reports corrupt data as RuntimeError on either device
            out.append(e)
    return out


def _decode_jpeg(files: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    if device.type != "cuda":
        return _quietly(decode_jpeg, files, mode=ImageReadMode.RGB, device=device)
    # nvJPEG writes its outputs without waiting for the work queued on the stream it is given, and
    # torchvision allocates them on the caller's stream, from blocks the last backward freed while queued
    # kernels still read them: silent corruption (pytorch/vision PR 9606: 199 of 200 batches on an H100; the
    # NaN loss a lent H100 gave with data.decode_device=model). On a stream of its own the decode draws only
    # from blocks that stream freed, which nothing else reads; the training stream then waits for it, and
    # each output is marked as used there, so its block is not handed back to the decoder before that use.
    main, side = torch.cuda.current_stream(device), _decode_stream(device)
    with torch.cuda.stream(side):
        out = _quietly(decode_jpeg, files, mode=ImageReadMode.RGB, device=device)
    main.wait_stream(side)
    for x in out:
        x.record_stream(main)
    return out


@functools.cache
def _decode_stream(device: torch.device) -> torch.cuda.Stream:
    """The one stream each CUDA device decodes JPEGs on (_decode_jpeg)."""
    return torch.cuda.Stream(device)


def _quietly(decoder, *args, **kwargs):
    """A torchvision decoder's result, without the notice torchvision 0.29 gives at every call (TorchCodec
    will take its decoders over one day)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return decoder(*args, **kwargs)
