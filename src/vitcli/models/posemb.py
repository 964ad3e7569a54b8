"""Position embeddings: resampling to a new patch grid (high-res fine-tuning) and the fixed 2-D
sin-cos table.

Pure tensor-in/tensor-out functions that return their input unchanged when nothing changes (like
timm's `resample_abs_pos_embed`). Layout everywhere is timm's: `(1, P+N, D)` with the P prefix
tokens (class token) first, then the N = gh * gw grid positions in row-major order.

Two resampling methods, each reproducing a reference:
- `bilinear` is big_vision / vit_jax `resample_posemb`: `scipy.ndimage.zoom(grid, (gh'/gh, gw'/gw,
1),
  order=1)`. With scipy's default `grid_mode=False` zoom maps the first and last output samples onto
  the first and last input samples, input coordinate = output coordinate * (gh-1)/(gh'-1), which is
  exactly `F.interpolate(..., mode="bilinear", align_corners=True)`; tests/unit/test_posemb.py
  checks the two agree.
- `bicubic` is timm's default: `resample_abs_pos_embed(..., interpolation="bicubic",
antialias=True)`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from timm.layers import resample_abs_pos_embed

from vitcli.errors import CheckpointError, ModelError
from vitcli.recipe.choices import POSEMB_METHODS


def check_method(method: str, name: str = "position-embedding resampling method") -> None:
    """A CheckpointError naming `name` (e.g. the flag) unless `method` is one of POSEMB_METHODS."""
    if method not in POSEMB_METHODS:
        raise CheckpointError(f"{name} '{method}': expected one of {', '.join(POSEMB_METHODS)}")


def _square_grid(num_tokens: int) -> tuple[int, int]:
    side = math.isqrt(num_tokens)
    if side * side != num_tokens:
        raise CheckpointError(
            f"cannot infer the patch grid: {num_tokens} position tokens is not a square number; "
            "give the old grid (image size and patch size) explicitly"
        )
    return side, side


def _resize_nchw(x: torch.Tensor, size: tuple[int, int], method: str) -> torch.Tensor:
    """Resize a (1, D, H, W) map; bilinear in float64 because scipy's zoom computes in float64."""
    if method == "bilinear":
        out = F.interpolate(x.double(), size=size, mode="bilinear", align_corners=True)
    else:
        out = F.interpolate(x.float(), size=size, mode="bicubic", align_corners=False, antialias=True)
    return out.to(x.dtype)


def resample_posemb(
    posemb: torch.Tensor,
    old_grid: tuple[int, int] | None,
    new_grid: tuple[int, int],
    num_prefix_tokens: int,
    method: str = "bilinear",
) -> torch.Tensor:
    """Resize a (1, P+N, D) position embedding from old_grid to new_grid; the P prefix rows are kept
    as is."""
    check_method(method)
    num_grid = posemb.shape[1] - num_prefix_tokens
    old_grid = tuple(old_grid) if old_grid is not None else _square_grid(num_grid)
    new_grid = tuple(new_grid)
    if old_grid[0] * old_grid[1] != num_grid:
        raise CheckpointError(
            f"pos_embed {tuple(posemb.shape)} has {num_grid} grid rows after {num_prefix_tokens} prefix "
            f"tokens, but grid {old_grid[0]}x{old_grid[1]} needs {old_grid[0] * old_grid[1]}"
        )
    if old_grid == new_grid:
        return posemb
    if method == "bicubic":  # timm is the reference, so use it rather than restate it
        return resample_abs_pos_embed(
            posemb,
            new_size=list(new_grid),
            old_size=list(old_grid),
            num_prefix_tokens=num_prefix_tokens,
            interpolation="bicubic",
            antialias=True,
        )
    prefix, grid = posemb[:, :num_prefix_tokens], posemb[:, num_prefix_tokens:]
    dim = grid.shape[-1]
    grid = grid.reshape(1, *old_grid, dim).permute(0, 3, 1, 2)  # (1, D, gh, gw)
    grid = _resize_nchw(grid, new_grid, method)  # (1, D, gh', gw')
    grid = grid.permute(0, 2, 3, 1).reshape(1, new_grid[0] * new_grid[1], dim)  # (1, N', D)
    return torch.cat([prefix, grid], dim=1)


def resample_axis(table: torch.Tensor, new_len: int, method: str = "bilinear") -> torch.Tensor:
    """Resize one axis table (1, L, d) of the 2-D learned embedding to (1, L', d).

    Done as a 2-D resize of an (L, 2) map so that it equals resizing the full (gh, gw) embedding
    along that axis: both methods weight neighbours with weights summing to one, so resizing
    concat(row[y], col[x]) on the grid is concat of the two 1-D resizes.
    """
    check_method(method)
    if table.shape[1] == new_len:
        return table
    # A width-2 map, not width 1: torch's antialiased bicubic returns a constant for (L, 1) inputs
    # (seen in torch 2.14); two identical columns resize to two identical columns either way.
    x = table.permute(0, 2, 1).unsqueeze(-1).expand(-1, -1, -1, 2)  # (1, d, L, 2)
    x = _resize_nchw(x.contiguous(), (new_len, 2), method)  # (1, d, L', 2)
    return x[..., 0].permute(0, 2, 1).contiguous()


def sincos_2d(grid: tuple[int, int], dim: int, temperature: float = 10_000.0) -> torch.Tensor:
    """Fixed 2-D sin-cos table (1, gh*gw, dim) as big_vision `posemb_sincos_2d` (MoCo v3).

    Feature order is [sin(x w), cos(x w), sin(y w), cos(y w)], x the column and y the row index,
    each block dim/4 wide with frequencies w_k = temperature^(-k / (dim/4 - 1)).
    """
    if dim % 4 or dim < 8:
        raise ModelError(
            f"sincos_2d position embedding needs a width that is a multiple of 4 and >= 8, got {dim}"
        )
    gh, gw = grid
    y, x = torch.meshgrid(
        torch.arange(gh, dtype=torch.float64), torch.arange(gw, dtype=torch.float64), indexing="ij"
    )
    quarter = dim // 4
    # (D/4,)
    omega = 1.0 / temperature ** (torch.arange(quarter, dtype=torch.float64) / (quarter - 1))
    xw = x.reshape(-1, 1) * omega  # (N, D/4)
    yw = y.reshape(-1, 1) * omega
    pe = torch.cat([xw.sin(), xw.cos(), yw.sin(), yw.cos()], dim=1)  # (N, D)
    return pe.float().unsqueeze(0)
