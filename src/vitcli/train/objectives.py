"""Every loss a run minimises: the recipe's classification loss (`loss_fn`, optim.loss), masked patch
prediction (paper App. B.1.2) and masked autoencoders (MAE, He et al. 2022) on a plain ViT. The trainer and
the evaluators both take theirs from here, so `val/loss` is the quantity `train/loss` is (big_vision hands its
evaluator the training loss by name).

`MppModel` wraps the ViT the run exports: a learned [mask] embedding replaces patch embeddings before the
position embedding is added (so a masked patch still knows where it is), and a linear head reads each
patch's output token. Its targets are read from the pixels as the paper's [-1, 1] whatever data.mean and
data.std normalised them to (the colour bins are of (x + 1) / 2). Only the ViT (`backbone`) is exported to
model.safetensors; the wrapper hands `forward_features` / `forward_head` through, so few-shot evaluation
during pretraining sees the backbone.

`MaeModel` wraps it the same way: the ViT's own patch embedding, blocks and norm encode the visible patches
only (gathered, not masked in place), models.mae.MaeDecoder reconstructs every patch, and only the ViT is
exported; the decoder lives in the training state.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from timm.layers import trunc_normal_
from torch import nn

from vitcli.data.augmentation.augment import SIGNED
from vitcli.models import mae, mpp
from vitcli.recipe.schema import MaeConfig, MppConfig, OptimConfig


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


class MaeModel(nn.Module):
    """A ViT as MAE's encoder, plus MAE's decoder. The ViT's position table becomes MAE's fixed 2-D sin-cos
    (frozen while pretraining; exported as timm's pos_embed, which fine-tuning trains, as MAE's own encoders
    carry it). `fresh`: a new network, which takes MAE's initialisation; else only the decoder does."""

    def __init__(self, backbone: nn.Module, cfg: MaeConfig, patch_size: int, fresh: bool = True):
        super().__init__()
        self.backbone, self.cfg, self.patch_size = backbone, cfg, patch_size
        grid, prefix = tuple(backbone.patch_embed.grid_size), backbone.num_prefix_tokens
        self.keep = mae.keep_count(grid[0] * grid[1], cfg.mask_ratio)
        self.decoder = mae.MaeDecoder(backbone.embed_dim, patch_size, grid, prefix, cfg.decoder_embed_dim,
                                      cfg.decoder_depth, cfg.decoder_num_heads)
        mae.init_weights(self if fresh else self.decoder)
        with torch.no_grad():
            backbone.pos_embed.copy_(mae.sincos_table(grid, backbone.embed_dim, prefix))  # (1, P+N, D)
        backbone.pos_embed.requires_grad_(False)

    def forward(self, images: torch.Tensor, noise: torch.Tensor):
        """(pred, target (B, N, P*P*3), mask (B, N): 1 removed) for normalised images (B, 3, H, W) and the
        masking noise (B, N) (mae.mask_noise: mae_step draws it)."""
        ids_keep, ids_restore, mask = mae.random_masking(noise.to(images.device), self.keep)
        pred = self.decoder(self.encode(images, ids_keep), ids_restore)
        return pred, mae.patchify(images, self.patch_size), mask

    def encode(self, images: torch.Tensor, ids_keep: torch.Tensor) -> torch.Tensor:
        """(B, P+K, D): the ViT on its prefix tokens and the K kept patches (ids_keep (B, K)), MAE's
        forward_encoder: positions added before the gather, the class token's after."""
        b = self.backbone
        prefix, pos = b.num_prefix_tokens, b.pos_embed  # (1, P+N, D)
        x = mae.gather_tokens(b.patch_embed(images) + pos[:, prefix:], ids_keep)  # (B, K, D)
        if b.cls_token is not None:
            x = torch.cat([(b.cls_token + pos[:, :prefix]).expand(x.shape[0], -1, -1), x], dim=1)
        return b.norm(b.blocks(b.norm_pre(b.pos_drop(x))))

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """The backbone's tokens on whole images: evaluators read the ViT, unmasked."""
        return self.backbone.forward_features(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """The backbone's head (pre-logits for few-shot)."""
        return self.backbone.forward_head(x, pre_logits=pre_logits)


def exported(model: nn.Module) -> nn.Module:
    """The network a run writes to model.safetensors: the ViT alone, whatever pretext parts trained it."""
    return model.backbone if isinstance(model, (MppModel, MaeModel)) else model


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


def mae_step(model: nn.Module, images: torch.Tensor, seed: int, first: int, cfg: MaeConfig,
             patch_size: int) -> torch.Tensor:
    """MAE's loss on one batch of `model` (an MaeModel, maybe wrapped: DDP, torch.compile); image b is the
    run's image `first` + b, which with `seed` fixes its mask (mae.mask_noise), whatever batch holds it. The
    noise is drawn here, outside the model, as mpp_step's; nothing is read back on the host."""
    b, _, h, w = images.shape
    samples = torch.arange(first, first + b, device=images.device)
    noise = mae.mask_noise(seed, samples, (h // patch_size) * (w // patch_size))  # (B, N)
    pred, target, mask = model(images, noise)
    return mae.mae_loss(pred, target, mask, cfg.norm_pix_loss)
