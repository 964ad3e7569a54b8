"""The recipe's classification loss (`loss_fn`, optim.loss). The trainer and the evaluators both
take it from here, so `val/loss` is the quantity `train/loss` is (big_vision hands its evaluator the
training loss by name). The pretext losses sit beside their networks: models.mpp (masked patch
prediction), models.mae.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vitcli.recipe.schema import OptimConfig


def loss_fn(cfg: OptimConfig):
    """The recipe's loss(logits (B, K), target) -> mean over the batch: softmax or sigmoid
    cross-entropy (optim.loss) on integer labels (B,), with optim.label_smoothing, or on soft
    targets (B, K) (mixup's, already smoothed).

    The held-out evaluators call this same function on their labels, label smoothing included:
    `val/loss` is then the very quantity `train/loss` is, on other images, so the two share a panel
    of curves.png (mixup is not in it: it mixes the training images and their targets before the
    loss sees them).
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
