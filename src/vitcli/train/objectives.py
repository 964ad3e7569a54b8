"""Every loss a run minimises: the recipe's classification loss (`loss_fn`, optim.loss) and masked patch
prediction (paper App. B.1.2) on a plain ViT. The trainer and the evaluators both take theirs from here, so
`val/loss` is the quantity `train/loss` is (big_vision hands its evaluator the training loss by name).

`MppModel` wraps the ViT the run exports: a learned [mask] embedding replaces patch embeddings before the
position embedding is added (so a masked patch still knows where it is), and a linear head reads each
patch's output token. Its targets are read from the pixels as the paper's [-1, 1] whatever data.mean and
data.std normalised them to (the colour bins are of (x + 1) / 2). Only the ViT (`backbone`) is exported to
model.safetensors; the wrapper hands `forward_features` / `forward_head` through, so few-shot evaluation
during pretraining sees the backbone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from timm.layers import trunc_normal_
from torch import nn

from vitcli.data.augmentation.augment import SIGNED
from vitcli.models import mpp
from vitcli.recipe.schema import MppConfig, OptimConfig


def loss_fn(cfg: OptimConfig):
    """The recipe's loss(logits (B, K), target) -> mean over the batch: softmax or sigmoid cross-entropy
    (optim.loss) on integer labels (B,), with optim.label_smoothing, or on soft targets (B, K) (mixup's,
    already smoothed).

    The held-out evaluators call this same function on their labels, label smoothing included: `val/loss` is
    then the very quantity `train/loss` is, on other images, so the two share a panel of curves.png (mixup
    is not in it: it mixes the training images and their targets before the loss sees them).
    """
    return _softmax_xent(cfg.label_smoothing) if cfg.loss == "softmax" else _sigmoid_xent(cfg.label_smoothing)


def _soft_targets(target: torch.Tensor, logits: torch.Tensor, smoothing: float) -> torch.Tensor:
    """(B, K) targets in the logits' dtype: integer labels one-hot and smoothed;
    soft (mixup) ones as they are."""
    if target.ndim == 2:  # mixup already smoothed them
        return target
    num_classes = logits.shape[-1]
    return F.one_hot(target, num_classes).to(logits.dtype) * (1 - smoothing) + smoothing / num_classes


def _softmax_xent(smoothing: float):
    def softmax_xent(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if target.ndim == 1:
            return F.cross_entropy(logits, target, label_smoothing=smoothing)
        return torch.sum(-target * F.log_softmax(logits, dim=-1), dim=-1).mean()

    return softmax_xent


def _sigmoid_xent(smoothing: float):
    def sigmoid_xent(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # Summed over classes, averaged over the batch (big_vision's sigmoid_xent).
        soft = _soft_targets(target, logits, smoothing)
        return F.binary_cross_entropy_with_logits(logits, soft, reduction="none").sum(-1).mean()

    return sigmoid_xent


class MppModel(nn.Module):
    """A ViT plus the [mask] embedding and per-patch prediction head of masked patch prediction."""

    def __init__(self, backbone: nn.Module, cfg: MppConfig, patch_size: int,
                 mean: Sequence[float] = SIGNED, std: Sequence[float] = SIGNED):
        super().__init__()
        self.backbone, self.cfg, self.patch_size = backbone, cfg, patch_size
        # normalised x -> x / 127.5 - 1 of its pixel: x * 2 std + (2 mean - 1), per channel (2, 1, 3, 1, 1)
        signed = torch.tensor([[2 * s for s in std], [2 * m - 1 for m in mean]]).view(2, 1, 3, 1, 1)
        self.register_buffer("signed", signed, persistent=False)  # on the model's device, in no checkpoint
        dim = backbone.embed_dim
        self.mask_token = nn.Parameter(trunc_normal_(torch.empty(dim), std=0.02))  # (D,)
        self.pred_shape = mpp.pred_shape(cfg.target, patch_size)
        self.head = nn.Linear(dim, math.prod(self.pred_shape))

    def forward(self, images: torch.Tensor, mode: torch.Tensor, other: torch.Tensor):
        """(pred, target) for normalised images (B, 3, H, W) corrupted as drawn (`mode` (B, N) from
        mpp.corruption, `other` (B*N,) from mpp.other_patches: mpp_step draws them)."""
        b = self.backbone
        tokens = b.patch_embed(images)  # (B, N, D)
        x = b._pos_embed(mpp.corrupt(tokens, mode, self.mask_token, other))  # (B, P+N, D)
        x = b.norm(b.blocks(b.norm_pre(b.patch_drop(x))))
        out = x[:, b.num_prefix_tokens:]  # (B, N, D): the patches' own output tokens
        pred = self.head(out).unflatten(-1, self.pred_shape)
        pixels = torch.addcmul(self.signed[1], images, self.signed[0])  # (B, 3, H, W) in [-1, 1]
        return pred, mpp.make_target(mpp.patchify(pixels, self.patch_size), self.cfg.target)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """The backbone's tokens: evaluators read the ViT, not the pretext head."""
        return self.backbone.forward_features(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """The backbone's head (pre-logits for few-shot)."""
        return self.backbone.forward_head(x, pre_logits=pre_logits)


def exported(model: nn.Module) -> nn.Module:
    """The network a run writes to model.safetensors: the ViT alone, whatever pretext parts trained it."""
    return model.backbone if isinstance(model, MppModel) else model


def mpp_step(model: nn.Module, images: torch.Tensor, seed: int, cfg: MppConfig, patch_size: int):
    """(loss, mean-colour accuracy) of one masked-patch-prediction batch of `model` (an MppModel, maybe
    wrapped: DDP, torch.compile); `seed` fixes the corruption draws.

    The draws are made here, eagerly, and handed to the model as tensors: a torch.Generator inside a compiled
    forward breaks its graph at every draw. Nothing in the step reads a device value back on the host."""
    b, _, h, w = images.shape
    num_patches = (h // patch_size) * (w // patch_size)  # (mpp.patchify refuses a size P does not divide)
    generator = torch.Generator(device=images.device).manual_seed(seed)
    mode = mpp.corruption(b, num_patches, generator, cfg.corrupt_ratio, cfg.mask_prob, cfg.random_prob)
    pred, target = model(images, mode, mpp.other_patches(b, num_patches, generator))
    return mpp.mpp_loss(pred.float(), target, mode > 0, cfg.target, nonempty=True)
