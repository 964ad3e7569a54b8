"""decode.header_size against PIL's own header parse (the reference it stands in for), on the JPEG
and PNG variants real datasets hold, and on bytes it must leave to PIL."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from vitcli.data.decoding.decode import Encoded, header_size


def _image(mode: str, size: tuple[int, int], seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    rgb = Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
    return rgb.convert(mode)


def _bytes(img: Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kwargs)
    return buf.getvalue()


def _exif() -> bytes:
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotated; the stored size is still the frame's
    exif[0x010F] = "camera"
    return exif.tobytes()


CASES = {
    "baseline": lambda: _bytes(_image("RGB", (37, 23)), "JPEG", quality=90),
    "grey": lambda: _bytes(_image("L", (640, 375)), "JPEG"),
    "cmyk": lambda: _bytes(_image("CMYK", (50, 70)), "JPEG"),
    "progressive": lambda: _bytes(_image("RGB", (300, 200)), "JPEG", progressive=True),
    "optimised": lambda: _bytes(_image("RGB", (129, 65)), "JPEG", optimize=True, quality=95),
    "restart markers and exif": lambda: _bytes(_image("RGB", (64, 48)), "JPEG", restart_marker_rows=1,
                                               exif=_exif()),
    "icc profile": lambda: _bytes(_image("RGB", (33, 90)), "JPEG", icc_profile=b"\0" * 5000),
    "4:4:4": lambda: _bytes(_image("RGB", (80, 60)), "JPEG", subsampling=0),
    "png rgb": lambda: _bytes(_image("RGB", (31, 17)), "PNG"),
    "png grey 16-bit": lambda: _bytes(Image.fromarray(np.full((9, 11), 4000, np.uint16)), "PNG"),
    "png palette": lambda: _bytes(_image("P", (20, 21)), "PNG"),
}


@pytest.mark.parametrize("name", CASES)
def test_the_size_is_pils(name):
    data = CASES[name]()
    found = header_size(data)
    pil = Image.open(io.BytesIO(data))
    assert found == (pil.format if pil.format != "MPO" else "JPEG", pil.height, pil.width)
    assert Encoded(data).size == (pil.height, pil.width)


@pytest.mark.parametrize("data", [
    b"", b"\xff\xd8", b"\xff\xd8\xff", b"GIF89a" + b"\0" * 20, b"not an image at all",
    b"\xff\xd8\xff\xe0\x00\x01",  # a segment length below 2
    b"\xff\xd8\xff\xda\x00\x08" + b"\0" * 10,  # the scan before any frame
    b"\xff\xd8\x00\x00\x00\x00",  # no marker where one must be
    b"\xff\xd8\xff\xc0\x00\x11\x08\x00\x00\x00\x10",  # height 0: given by a DNL segment later
])
def test_what_it_cannot_vouch_for_is_left_to_pil(data):
    assert header_size(data) is None


def test_other_formats_and_unknown_bytes_still_go_through_pil():
    data = _bytes(_image("RGB", (12, 34)), "BMP")
    assert header_size(data) is None and Encoded(data).size == (34, 12) and Encoded(data).format == "BMP"
    with pytest.raises(Exception, match="cannot identify"):
        _ = Encoded(b"not an image at all").size


def test_a_truncated_jpeg_has_a_size_and_fails_at_its_pixels():
    """As before the reader: the header is whole, the pixels are not, and that shows when they are
    read."""
    data = CASES["baseline"]()
    cut = Encoded(data[: len(data) // 2])
    assert cut.size == (23, 37)
    with pytest.raises(Exception):  # noqa: B017 - torchvision's and PIL's errors differ by version
        cut.pixels((0, 0, 23, 37), 0)


def test_a_drafted_crop_reuses_the_header_and_matches_a_fresh_decode():
    data = _bytes(_image("RGB", (640, 480), seed=3), "JPEG", quality=90)
    box = (40, 60, 400, 320)  # >= 8 x 32 on each side: decoded at 1/8 scale
    once = Encoded(data)
    _ = once.header  # parsed first, as a header read by PIL would be
    again = Encoded(data)
    a, b = once.pixels(box, 32), again.pixels(box, 32)
    assert a.shape[1] < 400 // 4 and torch.equal(a, b)
