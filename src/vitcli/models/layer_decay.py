"""Layer-wise learning-rate decay as a model's layers see it (BEiT; timm's
param_groups_layer_decay).

timm numbers a model's layers with its `group_matcher` (ViT, DeiT, the hybrid: the embeddings, stem
included, are layer 0, block i is layer i + 1, the final norm joins the last block, the head comes
last; T2T-ViT's matcher, models.t2t, the same with its tokens-to-token module as layer 0) and trains
layer i of n at lr * decay^(n - 1 - i). The optimizer takes its groups from timm too
(vitcli.train.optim.param_groups); this says what they will be, for the table a run prints at its
start.
"""

from __future__ import annotations

from timm.optim import param_groups_layer_decay
from torch import nn


def lr_scales(model: nn.Module, decay: float) -> list[float]:
    """The lr multiplier of each layer with parameters that train, lowest (the embeddings) first."""
    return sorted({group["lr_scale"] for group in param_groups_layer_decay(model, layer_decay=decay)})


def describe(model: nn.Module, decay: float) -> str:
    """`lr x 0.0037 (embeddings) to 1 (head) over 14 layers, 0.65 per layer`."""
    scales = lr_scales(model, decay)
    return (f"lr x {scales[0]:.2g} (embeddings) to {scales[-1]:.2g} (head) over {len(scales)} layers, "
            f"{decay:g} per layer")
