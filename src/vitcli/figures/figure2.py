"""MAE's Figure 2 (He et al., CVPR 2022): per image the masked input, the reconstruction with the
visible patches pasted back, and the original, from an MAE decoder's prediction.

What the decoder predicts is a patch of the image as the model was fed it (normalised by data.mean
and data.std), or with norm_pix_loss that patch less its own mean, over its own std: it is brought
back with the original patch's mean and variance first (as MAE's visualisation notebook does; the
removed patches' own statistics are the only ones the loss defines), then data.mean and data.std are
undone for display.
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
COLUMNS = ("masked input", "reconstruction + visible", "original")


def unnormalised_prediction(pred: torch.Tensor, target: torch.Tensor, norm_pix: bool) -> torch.Tensor:
    """(B, N, P*P*3) predicted patches in the target's units: with norm_pix, times the target
    patch's std (torch's unbiased var, + mae.NORM_PIX_EPS under the root, as the loss divided) plus
    its mean."""
    if not norm_pix:
        return pred.float()
    target = target.float()
    mean, var = target.mean(dim=-1, keepdim=True), target.var(dim=-1, keepdim=True)
    return pred.float() * (var + mae.NORM_PIX_EPS) ** 0.5 + mean


def panels(images: torch.Tensor, pred: torch.Tensor, mask: torch.Tensor, patch: int, norm_pix: bool,
           mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """(B, 3, H, W, 3) RGB in [0, 1]: per image its masked input (removed patches FILL),
    reconstruction (the visible patches are the original's own values, pasted back) and original.
    `images` (B, 3, H, W) normalised as fed, `pred` (B, N, P*P*3) the decoder's, `mask` (B, N) 1
    where removed."""
    grid = (images.shape[-2] // patch, images.shape[-1] // patch)
    target = mae.patchify(images.float(), patch)  # (B, N, P*P*3)
    removed = mask.bool()[..., None]  # (B, N, 1)
    recon = torch.where(removed, unnormalised_prediction(pred, target, norm_pix), target)
    mean_t, std_t = torch.tensor(mean).view(1, 3, 1, 1), torch.tensor(std).view(1, 3, 1, 1)

    def rgb(patches: torch.Tensor) -> torch.Tensor:  # (B, N, P*P*3) -> (B, H, W, 3) in [0, 1]
        x = mae.unpatchify(patches.cpu(), patch, grid) * std_t + mean_t
        return x.clamp(0, 1).permute(0, 2, 3, 1)

    original, reconstruction = rgb(target), rgb(recon)
    hidden = mae.unpatchify(removed.expand_as(target).float().cpu(), patch, grid)[:, 0, ..., None] > 0
    masked = torch.where(hidden, torch.full_like(original, FILL), original)  # (B, H, W, 3)
    return torch.stack([masked, reconstruction, original], dim=1).numpy()


def reconstruction_figure(tiles: np.ndarray, title: str) -> Figure:
    """One row per image, `panels`' three columns side by side, each column named above its first
    row."""
    rows = len(tiles)
    fig = new_figure(figsize=(6.0, 2.0 * rows + 0.7))
    axes = fig.subplots(rows, 3, squeeze=False)
    for row, images in zip(axes, tiles):
        for ax, image in zip(row, images):
            ax.imshow(image, interpolation="nearest")
            ax.set_axis_off()
    for ax, name in zip(axes[0], COLUMNS):
        ax.set_title(name, fontsize="small")
    fig.suptitle(title, fontsize="small")
    return fig
