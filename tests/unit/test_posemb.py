"""Position-embedding maths against independent references: scipy's zoom (big_vision), timm,
numpy."""

import numpy as np
import pytest
import scipy.ndimage
import torch
from timm.layers import resample_abs_pos_embed, resample_abs_pos_embed_nhwc

from vitcli.errors import CheckpointError, ModelError, RecipeError
from vitcli.models.posemb import resample_axis, resample_posemb, sincos_2d
from vitcli.recipe.checks import grid_for

TOL = 1e-5
# (old grid, new grid): upsampling, downsampling, non-square both ways, one axis unchanged
GRIDS = [
    ((7, 7), (12, 12)),
    ((14, 14), (24, 24)),
    ((12, 12), (7, 7)),
    ((3, 5), (8, 6)),
    ((4, 6), (6, 9)),
    ((5, 4), (2, 3)),
    ((6, 6), (6, 9)),
]


def _posemb(grid, prefix, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, prefix + grid[0] * grid[1], dim, generator=g)


def _big_vision_bilinear(posemb, old, new, prefix):
    """big_vision / vit_jax resample_posemb, generalised to (gh, gw): scipy zoom with order=1."""
    tok, grid = posemb[:, :prefix].numpy(), posemb[0, prefix:].numpy()
    grid = grid.reshape(old[0], old[1], -1)
    grid = scipy.ndimage.zoom(grid, (new[0] / old[0], new[1] / old[1], 1), order=1)
    assert grid.shape[:2] == tuple(new)  # zoom rounds the output shape; make sure it is the grid we asked for
    return np.concatenate([tok, grid.reshape(1, new[0] * new[1], -1)], axis=1)


@pytest.mark.parametrize("old,new", GRIDS)
@pytest.mark.parametrize("prefix", [0, 1])
def test_bilinear_matches_scipy_zoom(old, new, prefix):
    posemb = _posemb(old, prefix)
    ours = resample_posemb(posemb, old, new, prefix, "bilinear")
    ref = _big_vision_bilinear(posemb, old, new, prefix)
    assert ours.shape == (1, prefix + new[0] * new[1], 16)
    assert np.abs(ours.numpy() - ref).max() < TOL
    assert torch.equal(ours[:, :prefix], posemb[:, :prefix])


@pytest.mark.parametrize("old,new", GRIDS)
@pytest.mark.parametrize("prefix", [0, 1])
def test_bicubic_matches_timm(old, new, prefix):
    posemb = _posemb(old, prefix, seed=1)
    ours = resample_posemb(posemb, old, new, prefix, "bicubic")
    # timm's NHWC variant (bicubic, antialias=True by default) on the grid alone: an independent
    # code path that checks our prefix split and row-major layout
    grid = posemb[:, prefix:].reshape(1, old[0], old[1], -1)
    ref = resample_abs_pos_embed_nhwc(grid, list(new)).reshape(1, -1, posemb.shape[-1])
    assert (ours[:, prefix:] - ref).abs().max() < TOL
    assert torch.equal(ours[:, :prefix], posemb[:, :prefix])


def test_bicubic_square_matches_timm_default_call():
    posemb = _posemb((7, 7), 1, seed=2)
    ref = resample_abs_pos_embed(posemb, [12, 12], num_prefix_tokens=1)  # old grid inferred by timm too
    assert (resample_posemb(posemb, None, (12, 12), 1, "bicubic") - ref).abs().max() < TOL


@pytest.mark.parametrize("method", ["bilinear", "bicubic"])
def test_same_grid_returns_the_same_tensor(method):
    posemb = _posemb((3, 5), 1)
    assert resample_posemb(posemb, (3, 5), (3, 5), 1, method) is posemb
    table = posemb[:, :4]
    assert resample_axis(table, 4, method) is table


def test_old_grid_is_inferred_when_square_and_refused_otherwise():
    posemb = _posemb((4, 4), 1)
    assert torch.equal(resample_posemb(posemb, None, (6, 6), 1), resample_posemb(posemb, (4, 4), (6, 6), 1))
    with pytest.raises(CheckpointError, match="not a square"):
        resample_posemb(_posemb((3, 5), 1), None, (6, 6), 1)


def test_grid_that_does_not_match_the_table_is_an_error():
    with pytest.raises(CheckpointError, match=r"grid 4x4 needs 16"):
        resample_posemb(_posemb((3, 5), 1), (4, 4), (6, 6), 1)
    with pytest.raises(CheckpointError, match="bilinear"):
        resample_posemb(_posemb((3, 5), 1), (3, 5), (6, 6), 1, method="nearest")


@pytest.mark.parametrize("method", ["bilinear", "bicubic"])
@pytest.mark.parametrize("old,new", [((4, 6), (7, 3)), ((5, 5), (8, 8)), ((6, 6), (6, 9))])
def test_axis_tables_resize_like_the_full_2d_embedding(method, old, new):
    """learned_2d: concat(row[y], col[x]) resized on the grid equals the two tables resized in
    1-D."""
    g = torch.Generator().manual_seed(3)
    row, col = torch.randn(1, old[0], 8, generator=g), torch.randn(1, old[1], 8, generator=g)

    def full(r, c):  # (1, gh*gw, 16), row-major
        gh, gw = r.shape[1], c.shape[1]
        return torch.cat([r[0][:, None].expand(gh, gw, 8), c[0][None].expand(gh, gw, 8)], -1).reshape(
            1, -1, 16
        )

    resized = resample_posemb(full(row, col), old, new, 0, method)
    by_axis = full(resample_axis(row, new[0], method), resample_axis(col, new[1], method))
    assert (resized - by_axis).abs().max() < TOL


def _sincos_numpy(gh, gw, dim, temperature=10_000.0):
    """Element by element: row i, column j -> [sin(j w_k)], [cos(j w_k)], [sin(i w_k)], [cos(i
    w_k)]."""
    q = dim // 4
    out = np.zeros((gh * gw, dim))
    for i in range(gh):
        for j in range(gw):
            for k in range(q):
                w = temperature ** (-k / (q - 1))
                out[i * gw + j, [k, q + k, 2 * q + k, 3 * q + k]] = [
                    np.sin(j * w),
                    np.cos(j * w),
                    np.sin(i * w),
                    np.cos(i * w),
                ]
    return out


@pytest.mark.parametrize("grid,dim", [((3, 5), 8), ((4, 4), 32), ((2, 7), 16)])
def test_sincos_matches_formula(grid, dim):
    pe = sincos_2d(grid, dim)
    assert pe.shape == (1, grid[0] * grid[1], dim) and pe.dtype == torch.float32
    assert np.abs(pe[0].numpy() - _sincos_numpy(*grid, dim)).max() < TOL


def test_sincos_width_must_split_in_four():
    with pytest.raises(ModelError, match="multiple of 4"):
        sincos_2d((2, 2), 30)


def test_grid_for():
    assert grid_for(224, 16) == (14, 14)
    assert grid_for(384, 16) == (24, 24)
    assert grid_for((32, 48), 16) == (2, 3)
    with pytest.raises(RecipeError,
                       match=r"image size=100 is not a multiple of 16 \(the patch size\); .* 96"):
        grid_for(100, 16)
    with pytest.raises(RecipeError, match=r"--res=40x30 is not a multiple of 8x8 \(--patch\); .* 40x32"):
        grid_for((40, 30), 8, "--res", "--patch")
