"""Decode only a training crop of a JPEG, at the crop's reduced scale: libjpeg-turbo's partial
decoding (jpeg_crop_scanline: the crop's iMCU columns; jpeg_skip_scanlines: the rows above without
IDCT; the rows below never read) through _jpeg_region, the package's one C extension
(_jpeg_region.c, built by setup.py where a C compiler and jpeglib.h are found). Without it `crop`
answers None and decode.py decodes whole.

Why C: no maintained binding decodes a region. PyTurboJPEG (2.6.1) decodes whole images, scaled or
not, and its `crop` is the lossless transform (it writes a new JPEG); simplejpeg scales but does not
crop; and both PyTurboJPEG and libjpeg-turbo 3's tj3SetCroppingRegion want a libturbojpeg newer than
the 2.1.5 Debian ships. libjpeg's own API has had partial decoding since libjpeg-turbo 1.5.

What it returns equals the whole image decoded at the same scale and sliced
(tests/unit/test_jpeg_region.py: torchvision's decode_jpeg at full scale, PIL's draft at 1/2, 1/4,
1/8, bit for bit). Per Inception crop of an ImageNet-sized JPEG, one core (`python
bench/decode_crop.py`, best of 9 passes over 200, an AMD EPYC shared with other jobs, three runs):
545-579 us for a 224 px output, against 720-826 without the extension and 695-745 for torchvision's
whole decode sliced; 358-381 us for 32 px, against 619-717 and 684-783. libjpeg's other M/8 scalings
are not used: for the crops of 256-447 px a side (84 of the 200), decoding at the smallest M/8
(5/8..7/8) that keeps 224 px took 939-996 us against 690-754 at full scale (those IDCTs have no
SIMD), and its crop, resized to 224, differed from the full-scale one by 1.14 levels on average (68
at most).
"""

from __future__ import annotations

import numpy as np
import torch

try:
    from vitcli.data.decoding import _jpeg_region
# not built (setup.py's extension is optional): decode.py's whole-image paths serve
except ImportError:
    _jpeg_region = None

EOI = b"\xff\xd9"  # a JPEG's last marker


def scaled_box(box: tuple[int, int, int, int], size: tuple[int, int], k: int) -> tuple[int, int, int, int]:
    """The crop `box` (top, left, height, width) of an image of `size` (height, width), in pixels of
    the image decoded at 1/k scale (ceil(H/k) x ceil(W/k), as libjpeg sizes it): the near corner
    floored, the far one rounded, at least one pixel a side."""
    (top, left, h, w), (height, width) = box, size
    sy, sx = -(-height // k) / height, -(-width // k) / width
    y0, x0 = int(top * sy), int(left * sx)
    y1, x1 = max(y0 + 1, round((top + h) * sy)), max(x0 + 1, round((left + w) * sx))
    return y0, x0, y1 - y0, x1 - x0


def crop(data: bytes, size: tuple[int, int], box: tuple[int, int, int, int], k: int) -> torch.Tensor | None:
    """uint8 (3, h, w) over (h, w, 3) memory: the JPEG `data`'s crop `box` (top, left, height,
    width) of its full `size` (height, width), decoded at 1/k scale (k = 1, 2, 4, 8; the box scaled
    by scaled_box).

    None where the whole-image decoders should decide, as they did before: no extension; a colour
    space libjpeg does not turn into RGB (CMYK, YCCK); data libjpeg fails on (they fail too, in
    their own words); a box outside the frame libjpeg reads; a file that does not end in EOI. The
    last one because this decoder stops at the crop's last row, so a file cut short below it would
    decode here, where torchvision and PIL refuse every crop of it ("Image is incomplete or
    truncated"): a bad image stays bad whatever crop is drawn, named with the same reason as
    before."""
    if _jpeg_region is None or not data.endswith(EOI):
        return None
    top, left, h, w = scaled_box(box, size, k)
    out = np.empty((h, w, 3), dtype=np.uint8)
    try:
        decoded = _jpeg_region.decode(data, out, top, left, h, w, 8 // k)
    # libjpeg's error, or a frame of another size than the header said
    except (OSError, ValueError):
        return None
    return torch.from_numpy(out).permute(2, 0, 1) if decoded else None
