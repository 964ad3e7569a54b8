"""The paper's Figure 7 as numbers, then pictures: what a ViT's patch filters, position table and
heads do.

Left: the top principal components of the patch-embedding filters. Centre: the cosine similarity of
each patch's position embedding with every other one. Right: the mean attention distance of every
head against depth (App. D.7), the analogue of a CNN's receptive field. The maths is here in small
functions; reading the tables and attention maps out of a model is the `vit inspect` driver's
(vitcli.stages.inspect).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from vitcli.errors import ModelError
from vitcli.figures.canvas import new_figure
from vitcli.runtime.files import atomic_path

if TYPE_CHECKING:
    from matplotlib.figure import Figure

NUM_COMPONENTS = 28  # Figure 7 (left) shows 28 components in a 4 x 7 grid


# ---------------------------------------------------------------- maths


def filter_components(kernel: np.ndarray, k: int = NUM_COMPONENTS) -> tuple[np.ndarray, np.ndarray]:
    """Top-k principal components of patch filters (D, C, P, P) -> ((k, C, P, P), explained variance
    (k,)).

    Each of the D filters is one sample of C*P*P numbers; components are unit vectors, sign
    arbitrary.
    """
    flat = kernel.reshape(len(kernel), -1).astype(np.float64)  # (D, C*P*P)
    flat = flat - flat.mean(axis=0)
    _, s, vt = np.linalg.svd(flat, full_matrices=False)  # rows of vt: principal directions
    k = min(k, len(s))
    variance = s**2
    return vt[:k].reshape(k, *kernel.shape[1:]), variance[:k] / max(variance.sum(), 1e-30)


def to_rgb(component: np.ndarray) -> np.ndarray:
    """A component (3, P, P) as an image (P, P, 3) in [0, 1], min-max scaled on its own."""
    lo, hi = component.min(), component.max()
    return np.transpose((component - lo) / max(hi - lo, 1e-12), (1, 2, 0))


def patch_table(grid: tuple[int, int], pos_embed: np.ndarray) -> np.ndarray:
    """Each patch's position embedding (H*W, D), row-major, from a table (T, D) in timm's layout:
    learned, fixed sin-cos, or a learned 2-D pair expanded by ViT.learned_2d_table. Its first T -
    H*W rows belong to prefix tokens (class, registers; none for timm no_embed_class) and are
    dropped."""
    h, w = grid
    prefix = len(pos_embed) - h * w
    if prefix < 0:
        raise ModelError(f"pos_embed has {len(pos_embed)} rows, fewer than the {h}x{w} patch grid")
    return pos_embed[prefix:]


def cosine_maps(table: np.ndarray, grid: tuple[int, int]) -> np.ndarray:
    """(H, W, H, W): [y, x] is the cosine similarity of patch (y, x)'s embedding with every
    patch's."""
    unit = table / np.maximum(np.linalg.norm(table, axis=-1, keepdims=True), 1e-12)  # (N, D)
    return (unit @ unit.T).reshape(*grid, *grid)


def mosaic(maps: np.ndarray, gap: int = 1, fill: float = np.nan) -> np.ndarray:
    """Small maps (H, W, h, w, ...) tiled into one image (H*(h+gap)-gap, W*(w+gap)-gap, ...), `fill`
    between.

    One image drawn once rather than H*W axes: a ViT-B/16 has 196 maps, and axes cost ~30 ms each.
    """
    big_h, big_w, h, w = maps.shape[:4]
    out = np.full((big_h * (h + gap) - gap, big_w * (w + gap) - gap, *maps.shape[4:]), fill)
    for y in range(big_h):
        for x in range(big_w):
            out[y * (h + gap): y * (h + gap) + h, x * (w + gap): x * (w + gap) + w] = maps[y, x]
    return out


def patch_distances(grid: tuple[int, int], cell: float) -> torch.Tensor:
    """(N, N) Euclidean distances in pixels between the centres of the grid's patches (cell pixels
    apart)."""
    ys, xs = torch.meshgrid(torch.arange(grid[0]), torch.arange(grid[1]), indexing="ij")
    # (N, 2), row-major
    centres = (torch.stack([ys, xs], dim=-1).reshape(-1, 2).double() + 0.5) * cell
    return torch.cdist(centres, centres)


def uniform_distance(distances: torch.Tensor) -> float:
    """The mean attention distance of a head that attends to every patch alike: the mean pixel
    distance between two patches of the grid, query and key drawn uniformly (N x N `distances`). A
    head near it looks everywhere, not far; one well below it is local."""
    return float(distances.double().mean())


def attention_distance(attn: torch.Tensor, distances: torch.Tensor, prefix: int) -> torch.Tensor:
    """Mean attention distance (B, heads) of attention probabilities (B, heads, T, T)
    over T = prefix + N tokens.

    Per query patch: sum over key patches of weight x distance between the patch centres; then the
    mean over query patches. Prefix tokens (class, registers) have no place in the image, so they
    are dropped as queries and as keys, and each query's weights over the patches are renormalised
    to sum to 1: the result is a distance in pixels, whatever share of attention a head gives the
    class token. (The Keras/probing-vits reimplementation drops them without renormalising, which
    counts class-token attention as distance 0 and makes heads that attend to the class token look
    local; the paper does not say.)
    """
    n = distances.shape[0]
    if attn.shape[-1] != prefix + n:
        raise ModelError(f"attention over {attn.shape[-1]} tokens, "
                         f"but {prefix} prefix + {n} patches expected")
    patches = attn[..., prefix:, prefix:].double()  # (B, heads, N, N)
    patches = patches / patches.sum(dim=-1, keepdim=True).clamp_min(1e-30)
    return (patches * distances.to(patches.device)).sum(dim=-1).mean(dim=-1)


# ---------------------------------------------------------------- figures


def save_figure(fig: Figure, path: Path) -> None:
    """Write a figure as PNG atomically (no pyplot: Agg through the object API, no display
    needed)."""
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)


def filters_figure(components: np.ndarray, explained: np.ndarray, title: str) -> Figure:
    """Figure 7 left: each component (3, P, P) an RGB patch, 7 to a row, on white, with the share of
    the filters' variance it explains above it and the share of all of them shown in the title."""
    cols = min(7, len(components))
    rows = -(-len(components) // cols)
    patch = components.shape[-1]
    gap = max(1, patch // 8)
    tiles = np.ones((rows * cols, patch, patch, 3))  # blank (white) after the last component
    tiles[: len(components)] = [to_rgb(c) for c in components]
    fig = new_figure(figsize=(1.1 * cols + 0.4, 1.25 * rows + 0.8))
    ax = fig.subplots()
    ax.imshow(mosaic(tiles.reshape(rows, cols, patch, patch, 3), gap=gap, fill=1.0),
              interpolation="nearest")
    for i, share in enumerate(explained):
        row, col = divmod(i, cols)
        ax.text(col * (patch + gap) + (patch - 1) / 2, row * (patch + gap) - 0.5, f"{100 * share:.1f}%",
                ha="center", va="bottom", fontsize="xx-small")
    ax.set_axis_off()
    ax.set_title(f"{title}\n(they explain {100 * float(np.sum(explained)):.0f}% of the filters' variance; "
                 "each its share)", fontsize="small", pad=14)
    return fig


def position_figure(maps: np.ndarray, title: str) -> Figure:
    """Figure 7 centre: one H x W similarity map per patch, placed at that patch's row and
    column."""
    h, w = maps.shape[:2]
    fig = new_figure(figsize=(6.4, 5.4))
    ax = fig.subplots()
    gap = 1
    image = ax.imshow(mosaic(maps, gap), vmin=-1, vmax=1, cmap="viridis", interpolation="nearest")
    ticks_y = np.arange(h) * (maps.shape[2] + gap) + (maps.shape[2] - 1) / 2
    ticks_x = np.arange(w) * (maps.shape[3] + gap) + (maps.shape[3] - 1) / 2
    step_y, step_x = max(1, h // 8), max(1, w // 8)  # at most ~8 labels per axis
    ax.set_yticks(ticks_y[::step_y], [str(i + 1) for i in range(0, h, step_y)])
    ax.set_xticks(ticks_x[::step_x], [str(i + 1) for i in range(0, w, step_x)])
    ax.set_ylabel("input patch row")
    ax.set_xlabel("input patch column")
    fig.colorbar(image, ax=ax, label="cosine similarity")
    ax.set_title(title)
    return fig


def distance_figure(distances: np.ndarray, img_size: int, title: str, uniform: float) -> Figure:
    """Figure 7 right: one dot per head (colour = head index) at each layer, distance in pixels, and
    the distance of uniform attention (`uniform_distance`) as a dashed line: a head on it attends
    everywhere."""
    depth, heads = distances.shape
    fig = new_figure(figsize=(5.5, 4))
    ax = fig.subplots()
    layers = np.arange(1, depth + 1)
    for head in range(heads):
        ax.scatter(layers, distances[:, head], s=14, label=f"head {head + 1}")
    ax.set_xlabel("network depth (layer)")
    ax.set_ylabel("mean attention distance (pixels)")
    ax.axhline(uniform, color="grey", linestyle="--", linewidth=1,
               label=f"uniform attention ({uniform:.1f} px)")
    # the paper's scale: up to ~half the image
    ax.set_ylim(0, max(img_size / 2, 1.05 * float(distances.max()), 1.05 * uniform))
    ax.set_xticks(layers if depth <= 16 else layers[:: max(1, depth // 12)])
    ax.grid(alpha=0.3)
    if heads <= 16:
        ax.legend(fontsize="x-small", ncol=2, loc="lower right")
    else:  # the heads unlabelled, the line still named
        ax.legend(handles=ax.get_lines()[-1:], fontsize="x-small", loc="lower right")
    ax.set_title(title)
    return fig
