"""What a pretraining run minimises besides labels: masked patch prediction (paper App. B.1.2) on a plain ViT.

`MppModel` wraps the ViT the run exports: a learned [mask] embedding replaces patch embeddings before the
position embedding is added (so a masked patch still knows where it is), and a linear head reads each
patch's output token. Only the ViT (`backbone`) is exported to model.safetensors; the wrapper hands
`forward_features` / `forward_head` through, so few-shot evaluation during pretraining sees the backbone.
"""

from __future__ import annotations

import math

import torch
from timm.layers import trunc_normal_
from torch import nn

from vitcli.models import mpp
from vitcli.recipe.schema import MppConfig


class MppModel(nn.Module):
    """A ViT plus the [mask] embedding and per-patch prediction head of masked patch prediction."""

    def __init__(self, backbone: nn.Module, cfg: MppConfig, patch_size: int):
        super().__init__()
        self.backbone, self.cfg, self.patch_size = backbone, cfg, patch_size
        dim = backbone.embed_dim
        self.mask_token = nn.Parameter(trunc_normal_(torch.empty(dim), std=0.02))  # (D,)
        self.pred_shape = mpp.pred_shape(cfg.target, patch_size)
        self.head = nn.Linear(dim, math.prod(self.pred_shape))

    def forward(self, images: torch.Tensor, generator: torch.Generator):
        """(pred, target, corrupted (B, N) bool) for images (B, 3, H, W) in [-1, 1]."""
        b, c = self.backbone, self.cfg
        tokens = b.patch_embed(images)  # (B, N, D)
        mode = mpp.corruption(tokens.shape[0], tokens.shape[1], generator, c.corrupt_ratio, c.mask_prob,
                              c.random_prob)
        x = b._pos_embed(mpp.corrupt(tokens, mode, self.mask_token, generator))  # (B, P+N, D)
        x = b.norm(b.blocks(b.norm_pre(b.patch_drop(x))))
        out = x[:, b.num_prefix_tokens:]  # (B, N, D): the patches' own output tokens
        pred = self.head(out).unflatten(-1, self.pred_shape)
        target = mpp.make_target(mpp.patchify(images, self.patch_size), c.target)
        return pred, target, mode > 0

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """The backbone's tokens: evaluators read the ViT, not the pretext head."""
        return self.backbone.forward_features(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """The backbone's head (pre-logits for few-shot)."""
        return self.backbone.forward_head(x, pre_logits=pre_logits)


def exported(model: nn.Module) -> nn.Module:
    """The network a run writes to model.safetensors: the ViT alone, whatever pretext parts trained it."""
    return model.backbone if isinstance(model, MppModel) else model


def mpp_step(model: nn.Module, images: torch.Tensor, seed: int, target: str):
    """(loss, mean-colour accuracy) of one masked-patch-prediction batch; `seed` fixes the corruption draws."""
    generator = torch.Generator(device=images.device).manual_seed(seed)
    pred, tgt, corrupted = model(images, generator)
    return mpp.mpp_loss(pred.float(), tgt, corrupted, target)
