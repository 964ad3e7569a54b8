"""T2T-ViT (Yuan et al. 2021, "Tokens-to-Token ViT"), built from timm layers since timm does not ship it.

The tokens-to-token module replaces the single 16x16 patch projection by three overlapping soft splits
(nn.Unfold with kernels 7, 3, 3, strides 4, 2, 2, paddings 2, 1, 1: an effective patch of 16) with a
small transformer layer between them that mixes neighbouring tokens before they are re-folded into an
image. Deviation from the reference code: its Token_transformer attends from the unfolded width straight to
`token_dim` and keeps `v` as the residual; here a Linear maps the unfolded width to `token_dim` and a
standard timm Block follows, so every layer is a stock timm layer. The backbone is the ViT one, with the
paper's fixed 1-D sinusoidal position table.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from timm.layers import calculate_drop_path_rates, trunc_normal_
from timm.models.vision_transformer import Block
from torch import nn

SPLITS = ((7, 4, 2), (3, 2, 1), (3, 2, 1))  # (kernel, stride, padding) of the three soft splits


def sincos_1d_table(num_positions: int, dim: int, temperature: float = 10_000.0) -> torch.Tensor:
    """Transformer sinusoid table (num_positions, dim): sin on even channels, cos on odd, as in T2T-ViT."""
    pos = torch.arange(num_positions, dtype=torch.float64)[:, None]
    # channels 2i and 2i+1 share the frequency temperature^(-2i/dim)
    freq = temperature ** (-2.0 * (torch.arange(dim, dtype=torch.float64) // 2) / dim)
    angle = pos * freq  # (P, dim)
    table = torch.where(torch.arange(dim) % 2 == 0, angle.sin(), angle.cos())
    return table.float()


class TokensToToken(nn.Module):
    """Soft split -> token mixing -> re-structurize, three times; (B, 3, S, S) -> (B, (S/16)^2, embed_dim)."""

    def __init__(self, img_size: int, in_chans: int = 3, embed_dim: int = 384, token_dim: int = 64):
        super().__init__()
        self.splits = nn.ModuleList(nn.Unfold(k, stride=s, padding=p) for k, s, p in SPLITS)
        widths = [in_chans * 7 * 7, token_dim * 3 * 3]
        self.reduce = nn.ModuleList(nn.Linear(w, token_dim) for w in widths)
        self.mix = nn.ModuleList(Block(token_dim, num_heads=1, mlp_ratio=1.0) for _ in widths)
        self.proj = nn.Linear(token_dim * 3 * 3, embed_dim)
        self.img_size = img_size
        self.grid_size = (img_size // 16, img_size // 16)
        self.num_patches = self.grid_size[0] * self.grid_size[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        side = x.shape[-1]
        for split, reduce, mix, (_, stride, _) in zip(self.splits[:2], self.reduce, self.mix, SPLITS):
            side //= stride  # unfold with these paddings maps side S to S / stride for S divisible by 16
            x = mix(reduce(split(x).transpose(1, 2)))  # (B, side^2, token_dim)
            x = x.transpose(1, 2).reshape(x.shape[0], -1, side, side)  # back to an image (B, C, side, side)
        return self.proj(self.splits[2](x).transpose(1, 2))  # (B, (S/16)^2, embed_dim)


class T2TViT(nn.Module):
    """T2T-ViT with the ViT model interface: forward_features / forward_head / reset_classifier."""

    def __init__(self, img_size: int = 224, num_classes: int = 1000, embed_dim: int = 384, depth: int = 14,
                 num_heads: int = 6, mlp_ratio: float = 3.0, token_dim: int = 64, class_token: bool = True,
                 representation_size: int = 0, drop_rate: float = 0.0, drop_path_rate: float = 0.0):
        super().__init__()
        self.num_classes = num_classes
        self.embed_dim = embed_dim
        self.num_prefix_tokens = 1 if class_token else 0
        self.patch_embed = TokensToToken(img_size, embed_dim=embed_dim, token_dim=token_dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if class_token else None
        table = sincos_1d_table(self.patch_embed.num_patches + self.num_prefix_tokens, embed_dim)
        self.pos_embed = nn.Parameter(table[None], requires_grad=False)  # fixed, as in the paper
        self.pos_drop = nn.Dropout(drop_rate)
        self.blocks = nn.Sequential(*[
            Block(embed_dim, num_heads, mlp_ratio, qkv_bias=False, proj_drop=drop_rate, drop_path=r)
            for r in calculate_drop_path_rates(drop_path_rate, depth)])  # grows linearly with depth
        # like timm: token pooling normalises all tokens, average pooling normalises the pooled vector
        self.norm = nn.LayerNorm(embed_dim) if class_token else nn.Identity()
        self.fc_norm = nn.Identity() if class_token else nn.LayerNorm(embed_dim)
        self.pre_logits = nn.Identity()
        if representation_size:
            self.pre_logits = nn.Sequential(OrderedDict(
                fc=nn.Linear(embed_dim, representation_size), act=nn.Tanh()))
        self.num_features = self.head_hidden_size = representation_size or embed_dim
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(self.num_features, num_classes) if num_classes > 0 else nn.Identity()
        self.apply(_init_linear)
        if self.cls_token is not None:
            trunc_normal_(self.cls_token, std=0.02)

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        """Parameters the optimizer should not decay."""
        return {"cls_token", "pos_embed"}

    def get_classifier(self) -> nn.Module:
        """The final Linear layer."""
        return self.head

    def reset_classifier(self, num_classes: int) -> None:
        """Replace the head by a fresh Linear(num_features, num_classes) (Identity for 0)."""
        self.num_classes = num_classes
        self.head = nn.Linear(self.num_features, num_classes) if num_classes > 0 else nn.Identity()

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Images (B, 3, S, S) -> normalised tokens (B, prefix + (S/16)^2, D)."""
        x = self.patch_embed(x)
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = self.pos_drop(x + self.pos_embed)
        return self.norm(self.blocks(x))

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Tokens -> pooled pre-logits (B, num_features), or logits (B, K)."""
        x = x[:, 0] if self.cls_token is not None else x.mean(dim=1)
        x = self.head_drop(self.pre_logits(self.fc_norm(x)))
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Images (B, 3, S, S) -> logits (B, K)."""
        return self.forward_head(self.forward_features(x))


def _init_linear(module: nn.Module) -> None:
    # the reference T2T-ViT init: truncated normal weights, zero biases
    if isinstance(module, nn.Linear):
        trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
