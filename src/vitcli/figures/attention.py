"""DINO's Figure 1 (Caron et al., ICCV 2021): the self-attention of the class token in the last
block, per head, over a few images, as facebookresearch/dino's visualize_attention.py computes it:
the last block's attention probabilities, row 0 (the class token's query) over the patch keys
(`attentions[0, :, 0, 1:]`), reshaped to the patch grid and upsampled to the image by nearest
neighbour. Its optional threshold keeps the smallest set of patches holding 60% of a map's mass
(`keep_mass`); the paper's Figure 3 colours those masks per head.

What is drawn (`attention_figure`), one row per image: the image; the image dimmed outside the
region holding 60% of the mean map's mass; the mean over heads; then each head (the first
MAX_HEADS when there are more). Each map is min-max scaled on its own, as the reference's
`plt.imsave` of each head is (its peak weight is in the panel's title). The one departure, said in
the figure too: the reference thresholds each head, here the mean over heads is thresholded, so that
one panel shows where the heads together look.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from timm.layers import Attention
from torch import nn

from vitcli.errors import ModelError
from vitcli.figures.canvas import new_figure

if TYPE_CHECKING:
    from matplotlib.figure import Figure

MASS = 0.6  # DINO's threshold: the patches that hold 60% of the class token's attention
MAX_HEADS = 6  # heads drawn beside the mean: all of ViT-S/16's
DIM = 0.25  # brightness left outside the thresholded region
CMAP = "viridis"  # matplotlib's default, as the reference's plt.imsave draws each head


# ---------------------------------------------------------------- maths


def last_attention(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """(B, heads, T, T) attention probabilities of the last block for images `x` (B, 3, H, W),
    read as its forward forms them (attention_probabilities)."""
    attn = getattr(model.blocks[-1], "attn", None)
    # timm's Attention exactly: another (EVA's rotary one) is refused, as no test holds its reading
    if not isinstance(attn, Attention):
        raise ModelError(f"the last block's attention ({type(attn).__name__}) is not timm's "
                         "Attention: its attention probabilities cannot be recomputed")
    seen: list[torch.Tensor] = []
    with attention_probabilities(model.blocks[-1:], lambda layer, probs: seen.append(probs)):
        model(x)
    return seen[-1]


@contextlib.contextmanager
def attention_probabilities(blocks: nn.Module,
                            receive: Callable[[int, torch.Tensor], None]) -> Iterator[None]:
    """Inside the block, every forward hands each layer's attention probabilities (B, heads, T, T)
    to `receive(layer, probs)`. timm's fused kernel never forms them, so it is switched off
    meanwhile and the input of the attention dropout (the softmax output) is read."""
    attns = [getattr(block, "attn", None) for block in blocks]
    unusable = [i for i, a in enumerate(attns) if not hasattr(a, "fused_attn") or not hasattr(a, "attn_drop")]
    if unusable:
        raise ModelError(f"block {unusable[0]} has no timm Attention ({type(attns[unusable[0]]).__name__}); "
                         "its attention probabilities cannot be read")
    fused = [a.fused_attn for a in attns]
    hooks = [a.attn_drop.register_forward_hook(lambda mod, args, res, i=i: receive(i, args[0]))
             for i, a in enumerate(attns)]
    for a in attns:
        a.fused_attn = False
    try:
        yield
    finally:
        for a, was, hook in zip(attns, fused, hooks):
            a.fused_attn = was
            hook.remove()


def cls_attention(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """(B, heads, grid_h, grid_w): the last block's attention of the class token to each patch.
    A row of `last_attention` sums to 1 over every key (class token, registers, patches): these
    maps sum to 1 less what the class token gives the prefix tokens."""
    if getattr(model, "cls_token", None) is None:
        raise ModelError("the model has no class token: there is no class-token attention to draw")
    grid_h, grid_w = model.patch_embed.grid_size
    prefix = int(model.num_prefix_tokens)  # timm: class token first, then registers, then patches
    probs = last_attention(model, x)
    return probs[:, :, 0, prefix:].reshape(len(x), probs.shape[1], grid_h, grid_w)


def keep_mass(maps: torch.Tensor, mass: float = MASS) -> torch.Tensor:
    """Boolean maps (..., h, w): the largest weights of each map (..., h, w) that together hold
    `mass` of its total, as the reference's threshold picks them (sorted ascending, normalised, the
    weights whose cumulative sum passes 1 - mass)."""
    flat = maps.flatten(-2)
    weights, order = flat.sort(dim=-1)
    cumulative = (weights / weights.sum(dim=-1, keepdim=True)).cumsum(dim=-1)
    kept = torch.zeros_like(flat, dtype=torch.bool).scatter(-1, order, cumulative > 1 - mass)
    return kept.reshape(maps.shape)


def pixels(images: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """Images (B, 3, H, W) normalised as fed -> (B, H, W, 3) in [0, 1] for display."""
    mean_t, std_t = torch.tensor(mean).view(1, 3, 1, 1), torch.tensor(std).view(1, 3, 1, 1)
    x = images.float().cpu() * std_t + mean_t
    return x.clamp(0, 1).permute(0, 2, 3, 1).numpy()


def upsample(maps: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Maps (B, C, h, w) -> (B, C, H, W) by nearest neighbour: each patch's value over its pixels
    (the reference scales by the patch size, which is the same when H, W are multiples of it)."""
    return F.interpolate(maps.float(), size=size, mode="nearest")


# ---------------------------------------------------------------- the picture


def attention_figure(images: np.ndarray, maps: np.ndarray, title: str) -> Figure:
    """One row per image: `images` (B, H, W, 3) in [0, 1]; the image dimmed outside the region
    holding MASS of the mean map; the mean of `maps` (B, heads, h, w) over heads; each head up to
    MAX_HEADS. The maps are drawn over the image's pixel extent, so a patch's square covers its
    pixels; each is scaled to its own min and max."""
    b, heads = maps.shape[:2]
    height, width = images.shape[1:3]
    mean = maps.mean(axis=1)  # (B, h, w)
    region = upsample(keep_mass(torch.from_numpy(mean))[:, None], (height, width))[:, 0].numpy()
    shown = min(heads, MAX_HEADS)
    drawn = f" ({shown} drawn)" if shown < heads else ""
    names = ["image", f"{MASS:.0%} of the mean's mass", f"mean of {heads} heads{drawn}",
             *(f"head {h}" for h in range(shown))]
    fig = new_figure(figsize=(max(1.4 * len(names), 7.0), 1.55 * b + 1.1))
    axes = fig.subplots(b, len(names), squeeze=False)
    # (left, right, bottom, top) as imshow gives the image: pixel centres at 0 .. W-1, row 0 on top
    extent = (-0.5, width - 0.5, height - 0.5, -0.5)
    for i, row in enumerate(axes):
        row[0].imshow(images[i], interpolation="nearest")
        row[1].imshow(images[i] * (DIM + (1 - DIM) * region[i][..., None]), interpolation="nearest")
        for ax, panel in zip(row[2:], [mean[i], *maps[i, :shown]]):
            ax.imshow(panel, cmap=CMAP, interpolation="nearest", extent=extent)
            ax.set_title(f"peak {panel.max():.2g}", fontsize="x-small", pad=2)
        for ax in row:
            ax.set_axis_off()
    for ax, name in zip(axes[0], names):
        ax.set_title(f"{name}\n{ax.get_title()}".strip(), fontsize="x-small", pad=2)
    fig.suptitle(title, fontsize="small")
    return fig
