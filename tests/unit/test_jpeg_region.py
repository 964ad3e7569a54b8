"""jpeg_region decodes a JPEG's crop alone and gives the pixels the whole-image decoders give,
sliced: torchvision's decode_jpeg at full scale, PIL's draft at 1/2, 1/4 and 1/8 (the box mapped as
decode.py maps it), bit for bit. Tolerance 0 because the three run the same libjpeg-turbo code paths
(islow IDCT, fancy upsampling, the same DCT scaling) even where they bundle different releases
(torchvision's wheel, Pillow's 3.2, Debian's 2.1.5 for the extension): a level of difference would
mean the region decode lost its context. On photograph-like JPEGs of sizes that are not whole MCUs,
every subsampling, grey, progressive and with restart markers; boxes at every edge and corner and of
one pixel. What it does not do (CMYK, data that does not decode, a file cut short) it leaves to the
whole-image decoders, so a bad image fails as before."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.io import ImageReadMode, decode_jpeg

from vitcli.data.decoding import jpeg_region
from vitcli.data.decoding.decode import Encoded

built = pytest.mark.skipif(jpeg_region._jpeg_region is None, reason=(
    "the C extension vitcli.data.decoding._jpeg_region is not built (pip install -e . builds it where gcc "
    "and jpeglib.h are found: Debian's libjpeg-dev)"))

SIZES = [(237, 301), (100, 81), (17, 33), (1, 40)]  # (height, width): none a whole number of 16 px MCUs
KINDS = {  # PIL's save options: 4:2:0 (its default), 4:2:2, 4:4:4, grey, progressive, restart markers
    "420": {"quality": 90}, "422": {"quality": 90, "subsampling": 1},
    "444": {"quality": 90, "subsampling": 0}, "grey": {"quality": 90},
    "progressive": {"quality": 90, "progressive": True},
    "restarts": {"quality": 75, "restart_marker_blocks": 3},
}


def _picture(height: int, width: int, seed: int = 0) -> np.ndarray:
    """uint8 (H, W, 3): colour waves (smooth) under grain (texture), what chroma upsampling has to
    get right at every edge."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    waves = (60 * np.sin(x / 17)[..., None] * np.array([1, 0.3, -0.5])
             + 50 * np.cos(y / 11)[..., None] * np.array([-0.4, 1, 0.6]))
    grain = np.random.default_rng(seed).normal(0, 20, (height, width, 3))
    return np.clip(128 + waves + grain, 0, 255).astype(np.uint8)


def _jpeg(kind: str, size: tuple[int, int]) -> bytes:
    pixels = _picture(*size)
    buf = io.BytesIO()
    Image.fromarray(pixels[..., 0] if kind == "grey" else pixels).save(buf, "JPEG", **KINDS[kind])
    return buf.getvalue()


def _boxes(size: tuple[int, int], n: int, seed: int = 0) -> list[tuple[int, int, int, int]]:
    """(top, left, height, width): the whole image, a pixel at each corner, a strip along each edge,
    then `n` random boxes (some of one pixel a side)."""
    height, width = size
    fixed = [(0, 0, height, width), (0, 0, 1, 1), (0, width - 1, 1, 1), (height - 1, 0, 1, 1),
             (height - 1, width - 1, 1, 1), (0, 0, height, 1), (0, width - 1, height, 1), (0, 0, 1, width),
             (height - 1, 0, 1, width)]
    rng = np.random.default_rng(seed)
    drawn = []
    for _ in range(n):
        h, w = (int(rng.integers(1, s + 1)) if rng.random() < 0.8 else 1 for s in size)
        drawn.append((int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1)), h, w))
    return fixed + drawn


def _torchvision(data: bytes) -> torch.Tensor:
    return decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)


def _drafted(data: bytes, size: tuple[int, int], k: int) -> torch.Tensor:
    img = Image.open(io.BytesIO(data))
    img.draft("RGB", (size[1] // k, size[0] // k))
    return torch.from_numpy(np.array(img.convert("RGB"))).permute(2, 0, 1)


@built
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("kind", KINDS)
def test_a_full_scale_crop_equals_torchvision_whole_then_sliced(kind, size):
    data = _jpeg(kind, size)
    whole = _torchvision(data)
    for top, left, h, w in _boxes(size, 60):
        got = jpeg_region.crop(data, size, (top, left, h, w), 1)
        assert torch.equal(got, whole[:, top : top + h, left : left + w]), (top, left, h, w)


@built
@pytest.mark.parametrize("k", [2, 4, 8])
@pytest.mark.parametrize("size", SIZES[:3])  # a crop decoded at 1/k is >= k px a side: not the 1-row image
@pytest.mark.parametrize("kind", KINDS)
def test_a_reduced_scale_crop_equals_pil_draft_whole_then_sliced(kind, size, k):
    data = _jpeg(kind, size)
    whole = _drafted(data, size, k)
    assert whole.shape[1:] == (-(-size[0] // k), -(-size[1] // k))  # the size scaled_box assumes
    for box in _boxes(size, 40):
        top, left, h, w = jpeg_region.scaled_box(box, size, k)
        want = whole[:, top : top + h, left : left + w]
        assert torch.equal(jpeg_region.crop(data, size, box, k), want), box


@built
def test_the_crop_comes_back_as_uint8_rgb_over_channels_last_memory():
    size, box = (237, 301), (10, 20, 30, 40)
    got = jpeg_region.crop(_jpeg("grey", size), size, box, 1)
    assert got.dtype == torch.uint8 and got.shape == (3, 30, 40)
    assert got.permute(1, 2, 0).is_contiguous()  # (3, h, w) over (h, w, 3), as torchvision's decoders give it
    assert torch.equal(got[0], got[1]) and torch.equal(got[1], got[2])  # grey repeated


@built
def test_the_extension_checks_its_box_and_buffer_and_names_libjpeg_errors():
    data = _jpeg("420", (100, 81))
    out = np.zeros((10, 10, 3), dtype=np.uint8)
    with pytest.raises(ValueError, match="leaves the image"):
        jpeg_region._jpeg_region.decode(data, out, 95, 0, 10, 10, 8)
    with pytest.raises(ValueError, match="height \\* width \\* 3"):
        jpeg_region._jpeg_region.decode(data, out, 0, 0, 10, 11, 8)
    with pytest.raises(TypeError, match="read-write"):
        jpeg_region._jpeg_region.decode(data, bytes(300), 0, 0, 10, 10, 8)
    with pytest.raises(OSError, match="JPEG"):  # libjpeg's own words ("Not a JPEG file: ...")
        jpeg_region._jpeg_region.decode(b"\x89PNG not a jpeg", out, 0, 0, 10, 10, 8)


@built
def test_cmyk_is_left_to_the_whole_image_decoders():
    size, box = (70, 50), (5, 6, 30, 20)
    buf = io.BytesIO()
    Image.fromarray(_picture(*size)).convert("CMYK").save(buf, "JPEG", quality=90)
    data = buf.getvalue()
    out = np.zeros((30, 20, 3), dtype=np.uint8)
    assert jpeg_region._jpeg_region.decode(data, out, *box, 8) is False and not out.any()  # untouched
    assert jpeg_region.crop(data, size, box, 1) is None
    assert Encoded(data).pixels(box, 0).shape == (3, 30, 20)  # PIL's CMYK conversion, as before


def test_a_file_cut_short_fails_whatever_crop_is_drawn():
    """A crop above the cut would decode from the bytes that are there; it is refused, as
    torchvision and PIL refuse every crop of a truncated file, so a bad image is bad whichever box
    is drawn."""
    size = (237, 301)
    data = _jpeg("420", size)
    cut = data[: len(data) // 2]
    assert jpeg_region.crop(cut, size, (0, 0, 16, 16), 1) is None
    for box, out in (((0, 0, 16, 16), 0), ((0, 0, 200, 200), 16), ((0, 0, 200, 200), 0)):
        with pytest.raises(Exception, match="truncated"):  # torchvision's RuntimeError, PIL's OSError
            Encoded(cut).pixels(box, out)


@built
def test_a_file_cut_then_closed_decodes_as_torchvision_decodes_it():
    """Data cut mid-scan but ending in an EOI marker: libjpeg warns and fills the rest with grey,
    for torchvision as here; the crop is the same pixels."""
    size = (237, 301)
    data = _jpeg("420", size)
    closed = data[: len(data) // 2] + jpeg_region.EOI
    whole = _torchvision(closed)
    for top, left, h, w in _boxes(size, 20):
        assert torch.equal(jpeg_region.crop(closed, size, (top, left, h, w), 1),
                           whole[:, top : top + h, left : left + w])


@built
@pytest.mark.parametrize("kind", ["420", "grey", "progressive"])
def test_encoded_pixels_are_the_same_with_and_without_the_extension(kind, monkeypatch):
    size = (237, 301)
    data = _jpeg(kind, size)
    rng = np.random.default_rng(1)
    cases = [(box, int(rng.choice([0, 8, 16, 32, 224]))) for box in _boxes(size, 40, seed=2)]
    with_region = [Encoded(data).pixels(box, out) for box, out in cases]
    monkeypatch.setattr(jpeg_region, "_jpeg_region", None)
    for (box, out), got in zip(cases, with_region, strict=True):
        assert torch.equal(got, Encoded(data).pixels(box, out)), (box, out)
