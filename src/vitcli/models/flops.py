"""Analytic FLOPs of a plain ViT (2 FLOPs per multiply-add): the numerator of MFU (model FLOPs
utilisation).

Counted by hand rather than with torch.utils.flop_counter because it is free (no forward pass, no
model) and the same on every device and precision. Only the matmuls count, as in the MFU convention
(Chowdhery et al., PaLM App. B): norms, softmax, GELU and the optimizer are left out, a few percent
at ViT sizes.
"""

from __future__ import annotations

from vitcli.recipe.choices import CLASS_TOKEN_POOLS
from vitcli.recipe.names import HYBRID, is_vit_family
from vitcli.recipe.schema import MaeConfig, ModelConfig


def forward_flops(m: ModelConfig, attention: bool = True, num_classes: int | None = None) -> float:
    """Matmul FLOPs of one image's forward pass through a ViT; `num_classes` defaults to
    m.num_classes.

    N tokens (the patches, and a class token with pool `token` or `gap_fc_norm`) of width D, MLP
    width M: patch embedding N_p P^2 3 D; per block qkv 3 N D^2, q k^T and attn v 2 N^2 D
    (`attention`), projection N D^2, MLP 2 N D M; then the pre-logits layer (D R, if any) and the
    head (R or D, times the classes)."""
    patches = (m.img_size // m.patch_size) ** 2
    n, d = patches + (m.pool in CLASS_TOKEN_POOLS), m.embed_dim
    k = m.num_classes if num_classes is None else num_classes
    rep = m.representation_size
    head = d * rep + rep * k if rep else d * k
    return 2 * (patches * m.patch_size**2 * 3 * d + m.depth * _block(n, d, m.mlp_dim, attention) + head)


def _block(n: int, d: int, mlp: int, attention: bool = True) -> float:
    """Multiply-adds of one transformer block on n tokens of width d, MLP width mlp."""
    return 3 * n * d * d + (2 * n * n * d if attention else 0) + n * d * d + 2 * n * d * mlp


def mae_forward_flops(m: ModelConfig, a: MaeConfig, attention: bool = True) -> float:
    """Matmul FLOPs of one image's MAE forward, what runs: the patch embedding of all N patches, the
    encoder on its K = int(N (1 - mask_ratio)) kept patches (and the class token, with pool
    `token`), then the decoder on all of them: the embedding of the encoder's tokens to its width W,
    its blocks (MLP 4 W) and the prediction of P^2 3 values per token (MAE predicts the class
    token's too, then drops it)."""
    patches = (m.img_size // m.patch_size) ** 2
    prefix, d, w = int(m.pool in CLASS_TOKEN_POOLS), m.embed_dim, a.decoder_embed_dim
    kept = prefix + int(patches * (1 - a.mask_ratio))  # models.mae.keep_count
    every = prefix + patches
    encoder = patches * m.patch_size**2 * 3 * d + m.depth * _block(kept, d, m.mlp_dim, attention)
    decoder = (kept * d * w + a.decoder_depth * _block(every, w, 4 * w, attention)
               + every * w * m.patch_size**2 * 3)
    return 2 * (encoder + decoder)


def train_flops_per_image(m: ModelConfig, num_classes: int | None = None,
                          mae: MaeConfig | None = None) -> float:
    """Forward + backward: the backward pass costs twice the forward (gradients of inputs and of
    weights). With `mae`, the MAE step's (mae_forward_flops): the network that runs, not the ViT on
    whole images."""
    return 3 * (mae_forward_flops(m, mae) if mae is not None else forward_flops(m, num_classes=num_classes))


def counted(m: ModelConfig) -> str:
    """"" when forward_flops describes the network `m` names, else why not (for a run's summary)."""
    if m.name == HYBRID:
        return f"{HYBRID}: its ResNet stem is not in the plain-ViT count"
    if not is_vit_family(m.name):
        return f"{m.name}: the analytic count covers plain ViTs (custom and the paper's sizes) only"
    return ""
