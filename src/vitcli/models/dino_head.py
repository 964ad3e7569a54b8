"""DINO's projection head (Caron et al. 2021; facebookresearch/dino vision_transformer.py DINOHead,
dinov2/layers/dino_head.py): an MLP to a bottleneck, L2-normalised, then a weight-normalised linear
layer onto `out_dim` prototypes.

The last layer's weight normalisation is written out here, not torch.nn.utils.weight_norm (a
forward pre-hook, deprecated) nor its parametrization (which caches under a context manager): the
weight is g * v / ||v|| per output row, computed in forward from two plain parameters that keep
the references' names, `last_layer.weight_g` (out_dim, 1) and `last_layer.weight_v` (out_dim,
bottleneck_dim), so a DINO or DINOv2 head's state dict loads as it is (`load_reference`).
"""

from __future__ import annotations

import itertools
import math

import torch
from torch import nn
from torch.nn import functional as F


class WeightNormLinear(nn.Module):
    """A linear layer without bias whose weight is g * v / ||v|| (each output row's norm)."""

    def __init__(self, in_dim: int, out_dim: int, train_g: bool):
        super().__init__()
        # v as nn.Linear initialises its weight (the references build the last layer after their
        # trunc_normal init, so it keeps torch's default); g = 1, fixed unless train_g
        v = torch.empty(out_dim, in_dim)
        nn.init.kaiming_uniform_(v, a=math.sqrt(5))
        self.weight_v = nn.Parameter(v)
        self.weight_g = nn.Parameter(torch.ones(out_dim, 1), requires_grad=train_g)

    def weight(self) -> torch.Tensor:
        """(out_dim, in_dim), in float32 at least whatever the parameters' dtype."""
        dtype = torch.promote_types(self.weight_v.dtype, torch.float32)
        v, g = self.weight_v.to(dtype), self.weight_g.to(dtype)
        return v * (g / v.norm(dim=1, keepdim=True))  # torch._weight_norm's order: v * (g / |v|)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight().to(x.dtype))


def _mlp(in_dim: int, hidden_dim: int, bottleneck_dim: int, layers: int) -> nn.Module:
    """Linear, GELU, ..., Linear: `layers` linear layers (no BatchNorm: the references' default)."""
    if layers == 1:
        return nn.Linear(in_dim, bottleneck_dim)
    dims = [in_dim] + [hidden_dim] * (layers - 1)
    blocks: list[nn.Module] = []
    for a, b in itertools.pairwise(dims):
        blocks += [nn.Linear(a, b), nn.GELU()]
    return nn.Sequential(*blocks, nn.Linear(hidden_dim, bottleneck_dim))


class DinoHead(nn.Module):
    """(B, in_dim) features -> (B, out_dim) logits over the prototypes."""

    def __init__(self, in_dim: int, out_dim: int, hidden_dim: int = 2048, bottleneck_dim: int = 256,
                 layers: int = 3, norm_last_layer: bool = True):
        super().__init__()
        self.mlp = _mlp(in_dim, hidden_dim, bottleneck_dim, max(layers, 1))
        for m in self.mlp.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)
        # norm_last_layer (DINO's default): g stays 1, so every prototype has unit norm and the
        # logits are cosines; DINOv2's head trains g
        self.last_layer = WeightNormLinear(bottleneck_dim, out_dim, train_g=not norm_last_layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The logits. DINO's frozen last layer (the first epoch) is the run's: its gradients are
        dropped after the clip (objectives.dino's before_update), as DINO v1 does, so the optimizer
        leaves it alone."""
        x = self.mlp(x)
        # dinov2's eps: 1e-6 in float16, whose 1e-12 is zero
        x = F.normalize(x, dim=-1, p=2, eps=1e-6 if x.dtype == torch.float16 else 1e-12)
        return self.last_layer(x)


def load_reference(head: DinoHead, reference: nn.Module) -> None:
    """Copy a facebookresearch DINOHead's weights (dino's or dinov2's, built with the same sizes
    and no BatchNorm; their weight_norm names v and g as we do) into `head`."""
    state = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    head.load_state_dict(state, strict=True)
