"""Layer-wise learning-rate decay as a model's layers see it (BEiT; timm's
param_groups_layer_decay).

timm numbers a model's layers with its `group_matcher` (ViT, DeiT, the hybrid: the embeddings, stem
included, are layer 0, block i is layer i + 1, the final norm joins the last block, the head comes
last; T2T-ViT's matcher, models.t2t, the same with its tokens-to-token module as layer 0) and trains
layer i of n at lr * decay^(n - 1 - i). The optimizer takes its groups from timm too
(vitcli.train.optim.param_groups); this says what they will be, for the table a run prints at its
start. DINOv2 numbers its layers its own way (dinov2_scales, dinov2_param_groups: DINO's student
takes its groups from them).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
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


# DINOv2's layer 0 (dinov2/utils/param_groups.py get_vit_lr_decay_rate): the embeddings and tokens.
# timm names a ViT's register tokens reg_token, DinoVisionTransformer register_tokens (0.0.1.dev2
# has none; its main branch puts them in layer 0, as here)
_DINOV2_LAYER0 = ("pos_embed", "patch_embed", "mask_token", "cls_token", "register_tokens",
                  "reg_token")


def dinov2_scales(name: str, depth: int, layer_decay: float = 1.0, patch_embed_lr_scale: float = 1.0
                  ) -> tuple[float, float]:
    """(lr_scale, wd_scale) of the parameter `name` of a `depth`-block ViT, as DINOv2's
    get_params_groups_with_decay computes them (backbone names, as timm's VisionTransformer and
    DinoVisionTransformer spell them alike, a prefix such as `student.backbone.` stripped).

    Layer 0 the embeddings and tokens, i + 1 block i, depth + 1 the rest (the final norm; a head's
    parameters, none of these names, get lr_scale 1, as dinov2 gives its heads);
    lr_scale = layer_decay ** (depth + 1 - layer), times patch_embed_lr_scale for the patch
    embedding. wd_scale 0 for biases, norms and LayerScale's gamma, else 1: unlike
    optim.param_groups, the class and register tokens and the position table are decayed, as both
    DINO (its 1-D rule) and DINOv2 (its name rule) decay them.
    """
    if any(k in name for k in _DINOV2_LAYER0):
        layer = 0
    elif (block := re.search(r"(?:^|\.)blocks\.(\d+)\.", name)) and "residual." not in name:
        layer = int(block.group(1)) + 1
    else:
        layer = depth + 1
    lr_scale = layer_decay ** (depth + 1 - layer)
    if "patch_embed" in name:
        lr_scale *= patch_embed_lr_scale
    no_decay = name.endswith(".bias") or "norm" in name or "gamma" in name
    return lr_scale, 0.0 if no_decay else 1.0


def dinov2_param_groups(named_parameters: Iterable[tuple[str, torch.nn.Parameter]], depth: int,
                        layer_decay: float = 1.0, patch_embed_lr_scale: float = 1.0) -> list[dict]:
    """The trainable parameters grouped by dinov2_scales: [{"params", "lr_scale", "wd_scale"}], one
    group per distinct pair in first-seen order (dinov2's fuse_params_groups, without its
    is_last_layer split: DinoHead's frozen_last freezes the last layer instead of a zero lr).
    The loop multiplies each group's lr by lr_scale and its weight decay by wd_scale."""
    groups: dict[tuple[float, float], dict] = {}
    for name, param in named_parameters:
        if not param.requires_grad:
            continue
        lr_scale, wd_scale = dinov2_scales(name, depth, layer_decay, patch_embed_lr_scale)
        group = groups.setdefault((lr_scale, wd_scale),
                                  {"params": [], "lr_scale": lr_scale, "wd_scale": wd_scale})
        group["params"].append(param)
    return list(groups.values())
