"""MAE's Figure 2 (He et al., CVPR 2022) as facebookresearch/mae's demo/mae_visualize.ipynb draws
it: per image the original, the masked input, the reconstruction (the decoder's output on every
patch, visible ones included: the paper's caption says it deliberately does not paste them back, "so
we can more comprehensively demonstrate the method's behavior") and the reconstruction + visible
(the output on the removed patches, the original's on the visible ones, the notebook's `im_paste`).
Nothing of the original's removed patches, not even their statistics, reaches the two reconstruction
columns.

Units. The decoder predicts a patch of the image as the model was fed it, normalised by data.mean
and data.std; undoing those gives pixels (the notebook's `show_image` undoes ImageNet's). A
norm_pix_loss model predicts each patch less its own mean over its own std: it never learns a
patch's mean or contrast, and those of the removed patches are not ours to lend it (the notebook
draws a model trained on pixels, not norm-pix). Its output is shown as the normalised patch it is,
on a fixed scale: 0 (the patch's mean) mid grey, +-NORM_PIX_RANGE standard deviations white and
black, per channel; the visible patches in the last column are the loss's targets there (the
original's patches normalised the same way), so the whole column is in one unit. `caption` says
which.

Grey images (all three channels equal, Fashion-MNIST's) are drawn grey, three equal channels in
every column. A pixel model's output is the mean of its three channels. Normalised by per-channel
statistics (ImageNet's), a grey patch is no longer grey (its norm-pix target carries the channels'
offsets, -mean_c / std_c, which drew it blue): channel c is scaled back by its std_c, the channels
averaged (weighted by std_c, so the unit stays the normalised patch's) and the result centred on its
own patch mean, which removes the offsets and keeps the pattern.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from vitcli.figures.canvas import new_figure
from vitcli.models import mae

if TYPE_CHECKING:
    from matplotlib.figure import Figure

FILL = 0.5  # a removed patch in the masked input: mid grey, as in the paper's figure
NORM_PIX_RANGE = 2.0  # a norm-pix patch's values shown from -2 (black) to +2 (white) std
GREY_TOLERANCE = 1 / 512  # pixels (0..1) whose channels differ by less are grey: half a uint8 level
COLUMNS = ("original", "masked", "reconstruction", "reconstruction + visible")


def patch_targets(patches: torch.Tensor) -> torch.Tensor:
    """(B, N, P*P*3) patches less their mean, over their std: mae.mae_loss's norm-pix target."""
    patches = patches.float()
    mean, var = patches.mean(dim=-1, keepdim=True), patches.var(dim=-1, keepdim=True)
    return (patches - mean) / (var + mae.NORM_PIX_EPS) ** 0.5


def is_grey(images: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> bool:
    """Whether images (B, 3, H, W), normalised as fed, are grey in pixels: equal channels."""
    mean_t, std_t = torch.tensor(mean).view(1, 3, 1, 1), torch.tensor(std).view(1, 3, 1, 1)
    pixels = images.float().cpu() * std_t + mean_t
    return bool((pixels.amax(dim=1) - pixels.amin(dim=1)).max() < GREY_TOLERANCE)


def _grey_normalised(patches: torch.Tensor, std: Sequence[float]) -> torch.Tensor:
    """(B, N, P*P*3) norm-pix units -> (B, N, P*P*3), the three channels equal: each channel times
    its std_c, averaged with weights std_c / sum(std), centred on the patch's own mean."""
    b, n, width = patches.shape
    s = torch.tensor(std, dtype=torch.float32)
    grey = (patches.float().view(b, n, width // 3, 3) * s).sum(dim=-1) / s.sum()  # (B, N, P*P)
    grey = grey - grey.mean(dim=-1, keepdim=True)
    return grey[..., None].expand(b, n, width // 3, 3).reshape(b, n, width)


def panels(images: torch.Tensor, pred: torch.Tensor, mask: torch.Tensor, patch: int, norm_pix: bool,
           mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """(B, 4, H, W, 3) RGB in [0, 1], COLUMNS per image: the original, the masked input (removed
    patches FILL), the decoder's output on every patch, and its output on the removed patches with
    the original's on the visible ones. `images` (B, 3, H, W) normalised as fed, `pred` (B, N,
    P*P*3) the decoder's, `mask` (B, N) 1 where removed. norm_pix: the two reconstruction columns in
    the normalised patches' units (the module's docstring); for grey images every column has three
    equal channels."""
    images, pred, removed = images.float().cpu(), pred.float().cpu(), mask.cpu().bool()[..., None]
    grid = (images.shape[-2] // patch, images.shape[-1] // patch)
    mean_t, std_t = torch.tensor(mean).view(1, 3, 1, 1), torch.tensor(std).view(1, 3, 1, 1)
    grey = is_grey(images, mean, std)
    target = mae.patchify(images, patch)  # (B, N, P*P*3)
    shown = patch_targets(target) if norm_pix else target  # the visible patches, in pred's units
    paste = torch.where(removed, pred, shown)

    def rgb(patches: torch.Tensor, normalised: bool) -> torch.Tensor:  # -> (B, H, W, 3) in [0, 1]
        if normalised:
            patches = _grey_normalised(patches, std) if grey else patches
            x = 0.5 + mae.unpatchify(patches, patch, grid) / (2 * NORM_PIX_RANGE)
        else:
            x = mae.unpatchify(patches, patch, grid) * std_t + mean_t
            x = x.mean(dim=1, keepdim=True).expand_as(x) if grey else x
        return x.clamp(0, 1).permute(0, 2, 3, 1)

    original = rgb(target, False)
    hidden = mae.unpatchify(removed.expand_as(target).float(), patch, grid)[:, 0, ..., None] > 0
    masked = torch.where(hidden, torch.full_like(original, FILL), original)  # (B, H, W, 3)
    reconstruction, pasted = rgb(pred, norm_pix), rgb(paste, norm_pix)
    return torch.stack([original, masked, reconstruction, pasted], dim=1).numpy()


def caption(norm_pix: bool, grey: bool) -> str:
    """What the reconstruction columns show, in words: the figure's last title lines."""
    if norm_pix:
        scale = f"each patch's mean mid grey, +-{NORM_PIX_RANGE:g} std white/black"
        what = ("reconstruction: the decoder's output on every patch, the normalised patches "
                f"norm_pix\npredicts ({scale}); + visible: the visible patches normalised alike")
    else:
        what = ("reconstruction: the decoder's output on every patch, in pixels; "
                "+ visible: the original's")
    return what + ("; grey images kept grey" if grey else "")


def reconstruction_figure(tiles: np.ndarray, title: str) -> Figure:
    """One row per image, `panels`' four columns side by side, each named above its first row."""
    rows = len(tiles)
    fig = new_figure(figsize=(8.0, 2.0 * rows + 0.9))
    axes = fig.subplots(rows, len(COLUMNS), squeeze=False)
    for row, images in zip(axes, tiles):
        for ax, image in zip(row, images):
            ax.imshow(image, interpolation="nearest")  # RGB in [0, 1]: no colour map applies
            ax.set_axis_off()
    for ax, name in zip(axes[0], COLUMNS):
        ax.set_title(name, fontsize="small")
    fig.suptitle(title, fontsize="small")
    return fig
