"""Pillow's uint8 image operations, batched with an argument per image, on any device: the colour
enhancements (ImageEnhance: Color, Contrast, Brightness, Sharpness), the point operations (ImageOps:
invert, posterize, solarize, autocontrast, equalize; timm's solarize_add) and the affine transform
(Image.transform(AFFINE, BILINEAR, fillcolor)), each computing what Pillow computes in C,
truncations and rounding included. RandAugment (randaugment.py) applies them; 3-Augment
(three_augment.py) takes its grey and solarize from here. Written by hand: torchvision's tensor ops
take one argument per call, not one per image, and do not follow Pillow's rounding.

Each op takes uint8 (n, 3, H, W) and, where it has one, its images' arguments (n,) float64, and
returns uint8.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

TRUNCATE_SLACK = 1e-3  # see affine


def _per_image(v: torch.Tensor) -> torch.Tensor:
    return v.view(-1, 1, 1, 1)


def _blend(degenerate: torch.Tensor, x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """Pillow's Image.blend(degenerate, x, factor) (ImageEnhance's enhance): degenerate + factor *
    (x - degenerate) in float32 (Pillow passes the factor as a C float), clipped to [0, 255] and
    truncated (Blend.c casts, it does not round; so does the cast to uint8). In place, in Pillow's
    order of operations."""
    out = x.float().sub_(degenerate).mul_(_per_image(factor.float())).add_(degenerate)
    return out.clamp_(0, 255).to(torch.uint8)


def grey(x: torch.Tensor) -> torch.Tensor:
    """Pillow's convert("L"), (n, 1, H, W) int32: ITU-R 601-2 luma in its fixed point, (19595 R +
    38470 G + 7471 B + 2^15) >> 16, equal to (299 R + 587 G + 114 B) / 1000 rounded but for ties."""
    r, g, b = x.int().unbind(1)
    luma = r.mul_(19595).add_(g.mul_(38470)).add_(b.mul_(7471)).add_(32768)
    return luma.bitwise_right_shift_(16).unsqueeze(1)


def color(x, factor):
    """ImageEnhance.Color: blend with the grey image."""
    return _blend(grey(x).float(), x, factor)


def contrast(x, factor):
    """ImageEnhance.Contrast: blend with the grey image's mean, rounded to an integer as Pillow does
    (int(ImageStat mean + 0.5))."""
    mean = grey(x).flatten(1).sum(1, dtype=torch.int64).double() / (x.shape[2] * x.shape[3])
    return _blend(_per_image(torch.floor(mean + 0.5).float()), x, factor)


def brightness(x, factor):
    """ImageEnhance.Brightness: blend with black."""
    return _blend(torch.zeros((), device=x.device), x, factor)


def smooth(x: torch.Tensor) -> torch.Tensor:
    """Pillow's ImageFilter.SMOOTH (3x3 kernel [[1,1,1],[1,5,1],[1,1,1]] / 13, rounded): the border
    pixels are kept. Pillow sums in float32 with 0.5 added; the exact sum S / 13 is never within
    1/26 of a half, so it is floor((S + 6) / 13), which float32 computes exactly (S < 2^24, a
    quotient off an integer by at least 1/13). Returned as float32."""
    out = x.float()
    if x.shape[2] < 3 or x.shape[3] < 3:
        return out
    rows = out[:, :, :-2] + out[:, :, 1:-1] + out[:, :, 2:]  # (n, 3, H-2, W): separable 3x3 box sum
    box = rows[..., :-2] + rows[..., 1:-1] + rows[..., 2:]
    inner = box.add_(out[:, :, 1:-1, 1:-1], alpha=4).add_(6).div_(13).floor_()  # (n, 3, H-2, W-2)
    out[:, :, 1:-1, 1:-1] = inner
    return out


def sharpness(x, factor):
    """ImageEnhance.Sharpness: blend with the SMOOTH-filtered image."""
    return _blend(smooth(x), x, factor)


def invert(x, arg):
    """ImageOps.invert."""
    return 255 - x


def posterize(x, bits):
    """ImageOps.posterize keeping `bits` high bits; 8 or more: unchanged (timm); 0 or fewer: black,
    TF's shift by 8 (Pillow >= 13 refuses 0 bits)."""
    shift = (8 - bits).clamp(0, 8).to(torch.int32)
    mask = torch.bitwise_left_shift(torch.bitwise_right_shift(torch.full_like(shift, 255), shift), shift)
    return x & _per_image(mask).to(torch.uint8)


def solarize(x, threshold):
    """ImageOps.solarize: a level at or above `threshold` (0..256) inverted. In uint8 throughout:
    255 - v is v XOR 255, so the inverted levels are an XOR with a 0/255 mask (torch.where on uint8
    costs ~7x more on a CPU core)."""
    at_or_above = (x >= _per_image(threshold.clamp(max=255).to(torch.uint8))) & _per_image(threshold <= 255)
    return x ^ at_or_above.view(torch.uint8).mul_(255)


def solarize_add(x, add):
    """timm's solarize_add: min(255, v + add) for a level below 128, others kept. In uint8
    throughout: the addition masked to 0 where v >= 128 (no torch.where, see `solarize`)."""
    room = torch.minimum(_per_image(add.clamp(0, 255).to(torch.uint8)), 255 - x)
    return x + room.mul_((x < 128).view(torch.uint8))


def _levels(x: torch.Tensor) -> torch.Tensor:
    """(n * 3 * H * W,) int32 index of each pixel's level in a table of the batch's (n * 3 * 256)
    entries (int32, not int64: half the bytes, and index_select and bincount take it; 0.25 vs 0.59
    ms per 224 px image on a CPU core)."""
    n = x.shape[0]
    offsets = torch.arange(0, n * 3 * 256, 256, device=x.device, dtype=torch.int32).view(n, 3, 1)
    return x.flatten(2).int().add_(offsets).flatten()


def _lookup(x: torch.Tensor, idx: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """x through per image per channel tables (n, 3, 256) of integers in [0, 255]."""
    return table.to(torch.uint8).flatten().index_select(0, idx).view_as(x)


def autocontrast(x, arg):
    """ImageOps.autocontrast (cutoff 0): each channel's [lo, hi] stretched to [0, 255] through
    Pillow's table int(i * scale + offset) in float64, clipped; a channel with hi <= lo kept."""
    lo, hi = x.amin((2, 3)).double(), x.amax((2, 3)).double()  # (n, 3)
    # `255.0 / t` multiplies by 1 / t: not IEEE
    scale = torch.full_like(lo, 255.0) / (hi - lo).clamp(min=1)
    offset = -lo * scale
    i = torch.arange(256, device=x.device, dtype=torch.float64)
    table = torch.trunc(i * scale[..., None] + offset[..., None]).clamp(0, 255)  # (n, 3, 256)
    table = torch.where((hi > lo)[..., None], table, i)
    return _lookup(x, _levels(x), table)


def equalize(x, arg):
    """ImageOps.equalize per channel, in Pillow's integers: step = (count - count of the highest
    level present) // 255; table[i] = (step // 2 + pixels below i) // step, clipped to 255 as
    Image.point does; step 0 (one level present, or too few pixels) keeps the channel. Histograms:
    one index_add_ into a table of known size (bincount sizes its output by the largest index, which
    a GPU must send back to the host first: a sync per call)."""
    idx = _levels(x)
    ones = torch.ones((), dtype=torch.int64, device=x.device).expand(idx.shape)
    h = torch.zeros(x.shape[0] * 3 * 256, dtype=torch.int64, device=x.device).index_add_(0, idx, ones)
    h = h.view(-1, 3, 256)
    top = 255 - (h > 0).flip(2).int().argmax(2, keepdim=True)  # highest level present, (n, 3, 1)
    step = (h.sum(2, keepdim=True) - h.gather(2, top)) // 255
    below = h.cumsum(2) - h
    table = (step // 2 + below) // step.clamp(min=1)
    table = torch.where(step > 0, table.clamp(max=255), torch.arange(256, device=x.device))
    return _lookup(x, idx, table)


def _grid(matrix: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """grid_sample's grid (n, H, W, 2) for Pillow's affine data (n, 6): each output pixel centre (x
    + 0.5, y + 0.5) mapped to its source point, normalised to [-1, 1] at the image's outer edges
    (align_corners False). Built by broadcasting: affine_grid's batched matmul is slower on the CPU.
    The column and row terms, (n, 1, W) and (n, H, 1), are computed in float64 and only their sum in
    float32, straight into the grid: float64 planes for the whole image cost 1.1 ms per 224 px image
    on a core, this 0.1 (the sum is within 2e-5 of a pixel of float64's)."""
    m = [v.view(-1, 1, 1) for v in matrix.double().unbind(1)]
    xs = (torch.arange(w, device=matrix.device, dtype=torch.float64) + 0.5).view(1, 1, w)
    ys = (torch.arange(h, device=matrix.device, dtype=torch.float64) + 0.5).view(1, h, 1)
    grid = torch.empty((len(matrix), h, w, 2), device=matrix.device, dtype=torch.float32)
    for axis, (a, b, c, side) in enumerate(((m[0], m[1], m[2], w), (m[3], m[4], m[5], h))):
        columns = ((a * (2 / side)) * xs).float()  # (n, 1, W)
        rows = ((b * (2 / side)) * ys + (c * (2 / side) - 1)).float()  # (n, H, 1)
        torch.add(columns, rows, out=grid[..., axis])
    return grid


def affine(x: torch.Tensor, matrix: torch.Tensor, fill: tuple[int, int, int]) -> torch.Tensor:
    """Pillow's Image.transform(AFFINE, matrix (n, 6), BILINEAR, fillcolor=fill) on uint8 (n, 3, H,
    W): a source point outside [0, W) x [0, H) gives `fill`; inside, the four nearest pixels
    (clamped at the edges: padding_mode border) blend and the result is truncated, as Pillow's
    bilinear filter does. TRUNCATE_SLACK keeps float32's error from truncating a level away where
    Pillow's double lands on an integer (flat regions, where the weights' sum is 1 only up to
    rounding)."""
    h, w = x.shape[2:]
    grid = _grid(matrix, h, w)
    out = F.grid_sample(x.float(), grid, mode="bilinear", padding_mode="border", align_corners=False)
    gx, gy = grid.unbind(3)
    inside = ((gx >= -1) & (gx < 1) & (gy >= -1) & (gy < 1)).unsqueeze(1)  # (n, 1, H, W)
    return torch.where(inside, out.add_(TRUNCATE_SLACK).to(torch.uint8), _colour(fill, x.device))


def _colour(fill: tuple[int, int, int], device: torch.device) -> torch.Tensor:
    """(1, 3, 1, 1) uint8 on `device`, filled there: torch.tensor(fill, device=cuda) copies from
    pageable memory, which waits for the GPU, and pinning a block for three bytes costs more than
    three fills."""
    out = torch.empty((1, 3, 1, 1), dtype=torch.uint8, device=device)
    for c, v in enumerate(fill):
        out[:, c].fill_(v)
    return out
