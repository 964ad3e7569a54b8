"""Test-time augmentation: a batch's probabilities averaged over views of its images, made on the
device from the eval batch itself (the one pass over the split; no image is read twice).

The views of an eval view x (B, 3, S, S), the image resized and centre-cropped as the model was
trained:
- `flip`: x and x mirrored left-right (2 views);
- `multicrop`: torchvision's FiveCrop of x (Krizhevsky et al. 2012's centre and four corner crops;
ttach's
  `five_crop_transform`) with crops of side round(CROP_FRACTION * S), torchvision's 224 of 256, each
  resized back to S x S (bilinear: the network takes S), 5 views;
- both: torchvision's TenCrop, the five crops and their mirror images (ttach's
`ten_crop_transform`), 10. `flip` holds x itself; `multicrop` does not (its centre crop is x zoomed
by 1 / CROP_FRACTION). The model sees one view at a time, so its activations take what a plain
batch's do (the views' pixels, up to 10 copies of the batch's, are held together).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torchvision.transforms.v2 import functional as TF

from vitcli.recipe.choices import TTA_VIEWS

CROP_FRACTION = 0.875  # torchvision's (and AlexNet's) 224-pixel crops of a 256-pixel image


def views(x: torch.Tensor, kinds: tuple[str, ...]) -> list[torch.Tensor]:
    """The views of x (B, 3, S, S) for the chosen `kinds` (a subset of TTA_VIEWS), each (B, 3, S,
    S)."""
    unknown = set(kinds) - set(TTA_VIEWS)
    if unknown:  # the CLI offers TTA_VIEWS alone: a caller's bug
        raise ValueError(f"unknown test-time views {sorted(unknown)}; known: {TTA_VIEWS}")
    if "multicrop" not in kinds:
        return [x, TF.horizontal_flip(x)] if "flip" in kinds else [x]
    size = x.shape[-1]
    crop = [round(CROP_FRACTION * size)] * 2
    crops = TF.ten_crop(x, crop) if "flip" in kinds else TF.five_crop(x, crop)
    return [TF.resize(c, [size, size], interpolation=TF.InterpolationMode.BILINEAR, antialias=True)
            for c in crops]


def averaged_probs(model: torch.nn.Module, x: torch.Tensor, kinds: tuple[str, ...],
                   probs: Callable[[torch.Tensor], torch.Tensor],
                   plain: torch.Tensor | None = None) -> torch.Tensor:
    """(B, K) float32: the mean over the views of x of probs(logits), probs the loss's own (softmax,
    or sigmoid for a sigmoid-loss model). `plain`: the probabilities of x itself, which the caller's
    pass has already computed: the view that is x (`flip`'s first) takes them instead of a second
    forward."""
    made = views(x, kinds)
    known = [plain] if plain is not None and made[0] is x else []
    # (B, K)
    return (sum(known) + sum(probs(model(view).float()) for view in made[len(known):])) / len(made)
