"""Analytic FLOPs of a plain ViT (2 FLOPs per multiply-add): the numerator of MFU (model FLOPs utilisation).

Counted by hand rather than with torch.utils.flop_counter because it is free (no forward pass, no model) and
the same on every device and precision. Only the matmuls count, as in the MFU convention (Chowdhery et al.,
PaLM App. B): norms, softmax, GELU and the optimizer are left out, a few percent at ViT sizes.
"""

from __future__ import annotations

from vitcli.recipe.names import HYBRID, is_vit_family
from vitcli.recipe.schema import ModelConfig


def forward_flops(m: ModelConfig, attention: bool = True, num_classes: int | None = None) -> float:
    """Matmul FLOPs of one image's forward pass through a ViT; `num_classes` defaults to m.num_classes.

    N tokens (the patches, and a class token with pool `token`) of width D, MLP width M: patch embedding
    N_p P^2 3 D; per block qkv 3 N D^2, q k^T and attn v 2 N^2 D (`attention`), projection N D^2, MLP
    2 N D M; then the pre-logits layer (D R, if any) and the head (R or D, times the classes)."""
    patches = (m.img_size // m.patch_size) ** 2
    n, d = patches + (m.pool == "token"), m.embed_dim
    k = m.num_classes if num_classes is None else num_classes
    block = 3 * n * d * d + (2 * n * n * d if attention else 0) + n * d * d + 2 * n * d * m.mlp_dim
    rep = m.representation_size
    head = d * rep + rep * k if rep else d * k
    return 2 * (patches * m.patch_size**2 * 3 * d + m.depth * block + head)


def train_flops_per_image(m: ModelConfig, num_classes: int | None = None) -> float:
    """Forward + backward: the backward pass costs twice the forward (gradients of inputs and of weights)."""
    return 3 * forward_flops(m, num_classes=num_classes)


def counted(m: ModelConfig) -> str:
    """"" when forward_flops describes the network `m` names, else why not (for a run's summary)."""
    if m.name == HYBRID:
        return f"{HYBRID}: its ResNet stem is not in the plain-ViT count"
    if not is_vit_family(m.name):
        return f"{m.name}: the analytic count covers plain ViTs (custom and the paper's sizes) only"
    return ""
