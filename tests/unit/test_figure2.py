"""MAE's Figure 2 as facebookresearch/mae's demo/mae_visualize.ipynb draws it: the reconstruction
column is the decoder's output on every patch (y, unpatchified), the last column that output on the
removed patches and the original on the visible ones (im_paste); nothing of the removed patches'
originals reaches either; a norm-pix model's output is shown as the normalised patches it predicts,
and the title says so; grey images stay grey."""

import numpy as np
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg

from vitcli.figures import figure2
from vitcli.models import mae

IMAGENET = ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
PATCH, GRID = 4, (4, 4)


def normalised(pixels: torch.Tensor) -> torch.Tensor:
    """(B, 3, H, W) pixels in [0, 1] -> as the model is fed them, by ImageNet's statistics."""
    mean, std = (torch.tensor(v).view(1, 3, 1, 1) for v in IMAGENET)
    return (pixels - mean) / std


def shown(patches: torch.Tensor, norm_pix: bool) -> np.ndarray:
    """(B, N, P*P*3) -> (B, H, W, 3) as drawn: pixels (undoing ImageNet's statistics) or norm-pix
    units on the fixed scale, clipped to [0, 1]."""
    x = mae.unpatchify(patches, PATCH, GRID)
    if norm_pix:
        x = 0.5 + x / (2 * figure2.NORM_PIX_RANGE)
    else:
        mean, std = (torch.tensor(v).view(1, 3, 1, 1) for v in IMAGENET)
        x = x * std + mean
    return x.clamp(0, 1).permute(0, 2, 3, 1).numpy()


def norm_pix_target(patches: torch.Tensor) -> torch.Tensor:
    """MAE's forward_loss target, transliterated: mean and unbiased var over the patch, +1e-6."""
    mean, var = patches.mean(dim=-1, keepdim=True), patches.var(dim=-1, keepdim=True)
    return (patches - mean) / (var + 1.0e-6) ** 0.5


def case(seed: int = 0, grey: bool = False):
    """Colour (or grey) images, a prediction unlike them, half of each image's 16 patches
    removed."""
    g = torch.Generator().manual_seed(seed)
    pixels = torch.rand(2, 1 if grey else 3, 16, 16, generator=g).expand(2, 3, 16, 16)
    pred = torch.randn(2, 16, PATCH * PATCH * 3, generator=g)
    mask = (torch.rand(2, 16, generator=g).argsort(dim=1) < 8).float()
    return normalised(pixels), pred, mask


def removed_pixels(mask: torch.Tensor) -> np.ndarray:
    """(B, H, W, 3) bool: where the removed patches lie."""
    pixels = np.kron(mask.numpy().reshape(-1, *GRID), np.ones((PATCH, PATCH)))  # (B, H, W)
    return pixels[..., None].repeat(3, -1) > 0


def test_the_reconstruction_is_the_output_on_every_patch_and_the_last_column_pastes_the_visible():
    images, pred, mask = case()
    tiles = figure2.panels(images, pred, mask, PATCH, False, *IMAGENET)
    original, masked, recon, pasted = (tiles[:, i] for i in range(4))
    removed = removed_pixels(mask)
    assert np.allclose(recon, shown(pred, False), atol=1e-6)  # masked AND visible patches
    assert not np.allclose(recon[~removed], original[~removed])  # the output, not the input
    assert np.allclose(pasted[removed], recon[removed], atol=1e-6)
    assert np.allclose(pasted[~removed], original[~removed], atol=1e-6)
    assert (masked[removed] == figure2.FILL).all()
    assert np.array_equal(masked[~removed], original[~removed])


def test_a_norm_pix_model_is_shown_in_its_own_units_with_the_visible_targets_beside():
    images, pred, mask = case(1)
    tiles = figure2.panels(images, pred, mask, PATCH, True, *IMAGENET)
    removed = removed_pixels(mask)
    assert np.allclose(tiles[:, 2], shown(pred, True), atol=1e-6)
    target = shown(norm_pix_target(mae.patchify(images, PATCH)), True)
    assert np.allclose(tiles[:, 3][removed], tiles[:, 2][removed], atol=1e-6)
    assert np.allclose(tiles[:, 3][~removed], target[~removed], atol=1e-6)


def test_no_statistic_of_a_removed_patch_reaches_the_reconstruction():
    for norm_pix in (False, True):
        images, pred, mask = case(2)
        other = images.clone()
        hidden = mae.unpatchify(mask[..., None].expand(-1, -1, PATCH * PATCH * 3), PATCH, GRID) > 0
        other[hidden] = other[hidden] * 3 + 1  # the removed patches' means and spreads changed
        a = figure2.panels(images, pred, mask, PATCH, norm_pix, *IMAGENET)
        b = figure2.panels(other, pred, mask, PATCH, norm_pix, *IMAGENET)
        assert np.array_equal(a[:, 1:], b[:, 1:]) and not np.array_equal(a[:, 0], b[:, 0])


def rendered(tiles: np.ndarray, title: str) -> np.ndarray:
    """The figure as matplotlib's Agg draws it: (H, W, 3) uint8."""
    canvas = FigureCanvasAgg(figure2.reconstruction_figure(tiles, title))
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3]


def test_grey_images_give_a_grey_figure():
    for norm_pix in (False, True):
        images, pred, mask = case(3, grey=True)
        assert figure2.is_grey(images, *IMAGENET)
        target = mae.patchify(images, PATCH)
        # a perfect model of each kind (whose norm-pix target, in ImageNet's units, is bluish), and
        # an arbitrary one
        for output in (norm_pix_target(target) if norm_pix else target, pred):
            tiles = figure2.panels(images, output, mask, PATCH, norm_pix, *IMAGENET)
            picture = rendered(tiles, "t")
            assert np.array_equal(picture[..., 0], picture[..., 1])
            assert np.array_equal(picture[..., 0], picture[..., 2])
    colour = case(3)[0]
    assert not figure2.is_grey(colour, *IMAGENET)
    tiles = figure2.panels(colour, pred, mask, PATCH, True, *IMAGENET)
    assert not np.allclose(tiles[..., 0], tiles[..., 2])  # colour is not greyed


def test_a_perfect_norm_pix_model_on_grey_images_shows_each_patchs_pattern():
    images, _, mask = case(4, grey=True)
    target = mae.patchify(images, PATCH)
    tiles = figure2.panels(images, norm_pix_target(target), mask, PATCH, True, *IMAGENET)
    drawn = mae.patchify(torch.from_numpy(tiles[:, 2]).permute(0, 3, 1, 2), PATCH)[..., 0::3]
    pixels = mae.patchify(torch.from_numpy(tiles[:, 0]).permute(0, 3, 1, 2), PATCH)[..., 0::3]
    # (B, N) correlation of the drawn patch with the original's pixels: the pattern, up to its
    # mean and contrast (all a norm-pix model predicts)
    a, b = drawn - drawn.mean(-1, keepdim=True), pixels - pixels.mean(-1, keepdim=True)
    corr = (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))
    assert corr.min() > 0.99


def test_the_caption_says_what_the_reconstruction_columns_show():
    assert "normalised patches" in figure2.caption(True, False)
    pixels = figure2.caption(False, False)
    assert "in pixels" in pixels and "normalised" not in pixels and "grey" not in pixels
    assert all("grey images" in figure2.caption(norm_pix, True) for norm_pix in (False, True))
