"""T2T-ViT (Yuan et al. 2021, "Tokens-to-Token ViT") as the official code (yitu-opensource/T2T-ViT)
builds it.

The tokens-to-token module replaces the single 16x16 patch projection by three overlapping soft
splits (nn.Unfold with kernels 7, 3, 3, strides 4, 2, 2, paddings 2, 1, 1: an effective patch of 16)
with a small token layer after each of the first two that mixes neighbouring tokens before they are
re-folded into an image. That layer maps the unfolded width (3*7*7, then token_dim*3*3) down to
token_dim and, since input and output widths differ, uses `v` as its residual. Two kinds, as
published:

- `performer` (`Token_performer`, the paper's T2T-ViT-N): FAVOR+ attention with positive random
features,
  m = token_dim / 2 fixed orthogonal projections `w` stored as a frozen Parameter (so checkpoints
  carry them);
- `transformer` (`Token_transformer`, T2T-ViT_t-N): one-head softmax attention whose scale is the
unfolded
  width^-0.5 (the official head_dim is the input width, not token_dim).

Module and parameter names are the official ones, so official state dicts load strictly. The
backbone is a ViT (timm Blocks without qkv bias) with the fixed 1-D sinusoid table. Not reproduced:
the official `pretrained=True` factories override the backbone's attention scale with
embed_dim^-0.5; the official eval and transfer scripts build with pretrained=False, the
head_dim^-0.5 used here.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch
import torch.nn.functional as F
from timm.layers import Mlp, calculate_drop_path_rates, trunc_normal_
from timm.models.vision_transformer import Block
from torch import nn

from vitcli.errors import ModelError

MIXERS = ("performer", "transformer")
KERNEL_RATIO = 0.5  # official Token_performer: m = token_dim * 0.5 random features
# official Token_performer dp1/dp2 defaults, which its T2T module never overrides
PERFORMER_DROPOUT = 0.1
PERFORMER_EPS = 1e-8  # keeps the linear-attention normaliser away from zero


def sincos_1d_table(num_positions: int, dim: int, temperature: float = 10_000.0) -> torch.Tensor:
    """Transformer sinusoid table (num_positions, dim): sin on even channels, cos on odd, as in
    T2T-ViT."""
    pos = torch.arange(num_positions, dtype=torch.float64)[:, None]
    # channels 2i and 2i+1 share the frequency temperature^(-2i/dim)
    freq = temperature ** (-2.0 * (torch.arange(dim, dtype=torch.float64) // 2) / dim)
    angle = pos * freq  # (P, dim)
    table = torch.where(torch.arange(dim) % 2 == 0, angle.sin(), angle.cos())
    return table.float()


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """x in float32, or wider: the official performer takes its random features in x.float()."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def positive_random_features(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """(B, T, d) x (m, d) -> (B, T, m): exp(w.x - |x|^2/2) / sqrt(m), whose inner products
    estimate exp(q.k)."""
    half_sq = (x * x).sum(dim=-1, keepdim=True) / 2  # (B, T, 1)
    x = at_least_fp32(x)
    return torch.exp(x @ w.to(x.dtype).t() - half_sq) / math.sqrt(w.shape[0])


class TokenPerformer(nn.Module):
    """Official Token_performer: (B, T, dim) -> (B, T, in_dim), linear-time attention with `v` as
    residual."""

    def __init__(self, dim: int, in_dim: int, kernel_ratio: float = KERNEL_RATIO,
                 dropout: float = PERFORMER_DROPOUT):
        super().__init__()
        self.emb = in_dim
        self.kqv = nn.Linear(dim, 3 * in_dim)  # official order: k, q, v
        self.dp = nn.Dropout(dropout)
        self.proj = nn.Linear(in_dim, in_dim)
        self.norm1 = nn.LayerNorm(dim)
        self.norm2 = nn.LayerNorm(in_dim)
        self.mlp = nn.Sequential(nn.Linear(in_dim, in_dim), nn.GELU(), nn.Linear(in_dim, in_dim),
                                 nn.Dropout(dropout))
        m = int(in_dim * kernel_ratio)
        # fixed, never trained: orthogonal rows scaled by sqrt(m), as the official code draws them
        self.w = nn.Parameter(nn.init.orthogonal_(torch.empty(m, in_dim)) * math.sqrt(m), requires_grad=False)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        """FAVOR+ attention, then `v` + projected output: (B, T, dim) -> (B, T, in_dim)."""
        k, q, v = self.kqv(x).split(self.emb, dim=-1)  # (B, T, in_dim) each
        # (B, T, m)
        kp, qp = positive_random_features(k, self.w), positive_random_features(q, self.w)
        denom = qp @ kp.sum(dim=1)[..., None]  # (B, T, 1): each query's sum of estimated weights
        kv = at_least_fp32(v).transpose(1, 2) @ kp  # (B, in_dim, m)
        y = (qp @ kv.transpose(1, 2)) / (denom + PERFORMER_EPS)  # (B, T, in_dim)
        return v + self.dp(self.proj(y))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TokenAttention(nn.Module):
    """Official token_transformer.Attention with its one head: (B, T, dim) -> (B, T, in_dim),
    `v` as residual."""

    def __init__(self, dim: int, in_dim: int):
        super().__init__()
        # official: (dim // num_heads)^-0.5 with the input width dim and one head
        self.scale = dim**-0.5
        self.qkv = nn.Linear(dim, 3 * in_dim, bias=False)
        self.proj = nn.Linear(in_dim, in_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # (B, T, in_dim) each
        y = F.scaled_dot_product_attention(q, k, v, scale=self.scale)  # (B, T, in_dim)
        return v + self.proj(y)


class TokenTransformer(nn.Module):
    """Official Token_transformer: attention from the unfolded width to in_dim, then an in_dim
    MLP."""

    def __init__(self, dim: int, in_dim: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = TokenAttention(dim, in_dim)
        self.norm2 = nn.LayerNorm(in_dim)
        self.mlp = Mlp(in_dim, in_dim, in_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def _as_image(tokens: torch.Tensor) -> torch.Tensor:
    """Re-structurize: (B, side^2, C) tokens -> (B, C, side, side) image."""
    side = math.isqrt(tokens.shape[1])
    return tokens.transpose(1, 2).reshape(tokens.shape[0], -1, side, side)


class TokensToToken(nn.Module):
    """Official T2T_module: soft split, token layer, re-fold, twice, then a last split and a
    projection.

    (B, 3, S, S) -> (B, (S/16)^2, embed_dim); also the `patch_embed` of the model (grid_size,
    num_patches).
    """

    def __init__(self, img_size: int, mixer: str = "performer", in_chans: int = 3, embed_dim: int = 384,
                 token_dim: int = 64):
        super().__init__()
        if mixer not in MIXERS:
            raise ModelError(f"T2T-ViT token mixer '{mixer}' is not one of {', '.join(MIXERS)}")
        layer = TokenPerformer if mixer == "performer" else TokenTransformer
        self.soft_split0 = nn.Unfold(kernel_size=7, stride=4, padding=2)
        self.soft_split1 = nn.Unfold(kernel_size=3, stride=2, padding=1)
        self.soft_split2 = nn.Unfold(kernel_size=3, stride=2, padding=1)
        self.attention1 = layer(in_chans * 7 * 7, token_dim)
        self.attention2 = layer(token_dim * 3 * 3, token_dim)
        self.project = nn.Linear(token_dim * 3 * 3, embed_dim)
        self.mixer, self.img_size = mixer, img_size
        self.grid_size = (img_size // 16, img_size // 16)
        self.num_patches = self.grid_size[0] * self.grid_size[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attention1(self.soft_split0(x).transpose(1, 2))  # (B, (S/4)^2, token_dim)
        # (B, (S/8)^2, token_dim)
        x = self.attention2(self.soft_split1(_as_image(x)).transpose(1, 2))
        # (B, (S/16)^2, embed_dim)
        return self.project(self.soft_split2(_as_image(x)).transpose(1, 2))


class T2TViT(nn.Module):
    """T2T-ViT with the ViT model interface: forward_features / forward_head / reset_classifier.

    Defaults give the official state dict; ours on top: `class_token=False` (average pooling over
    the normalised tokens, no `cls_token`) and `representation_size` (a Dense+tanh `pre_logits.fc`).
    """

    def __init__(self, img_size: int = 224, num_classes: int = 1000, embed_dim: int = 384, depth: int = 14,
                 num_heads: int = 6, mlp_ratio: float = 3.0, token_dim: int = 64, mixer: str = "performer",
                 class_token: bool = True, representation_size: int = 0, drop_rate: float = 0.0,
                 drop_path_rate: float = 0.0):
        super().__init__()
        self.num_classes = num_classes
        self.embed_dim = embed_dim
        self.num_prefix_tokens = 1 if class_token else 0
        self.tokens_to_token = TokensToToken(img_size, mixer, embed_dim=embed_dim, token_dim=token_dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if class_token else None
        table = sincos_1d_table(self.tokens_to_token.num_patches + self.num_prefix_tokens, embed_dim)
        # (1, P+N, D), fixed as in the paper
        self.pos_embed = nn.Parameter(table[None], requires_grad=False)
        self.pos_drop = nn.Dropout(drop_rate)
        # torch's LayerNorm (eps 1e-5) as the official Block, not timm's 1e-6
        self.blocks = nn.Sequential(*[
            Block(embed_dim, num_heads, mlp_ratio, qkv_bias=False, proj_drop=drop_rate, drop_path=r,
                  norm_layer=nn.LayerNorm)
            for r in calculate_drop_path_rates(drop_path_rate, depth)])  # grows linearly with depth
        self.norm = nn.LayerNorm(embed_dim)
        self.pre_logits = nn.Identity()
        if representation_size:
            self.pre_logits = nn.Sequential(OrderedDict(
                fc=nn.Linear(embed_dim, representation_size), act=nn.Tanh()))
        self.num_features = self.head_hidden_size = representation_size or embed_dim
        self.head = nn.Linear(self.num_features, num_classes) if num_classes > 0 else nn.Identity()
        self.apply(_init_linear)
        if self.cls_token is not None:
            trunc_normal_(self.cls_token, std=0.02)

    @property
    def patch_embed(self) -> TokensToToken:
        """The tokens-to-token module under the name ViT code reads (grid_size, num_patches,
        img_size)."""
        return self.tokens_to_token

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        """Parameters the optimizer should not decay (the frozen pos_embed and `w` are not trained
        at all)."""
        return {"cls_token", "pos_embed"}

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> dict:
        """timm's parameter layers (layer-wise lr decay, timm.models.group_parameters): timm's ViT
        matcher with the tokens-to-token module as the embedding, layer 0; block i is layer i + 1,
        the final norm joins the last block (99999: timm's MATCH_PREV_GROUP), the head (unmatched)
        comes last. `coarse` is timm's interface; like its ViT's, the matcher is the same either
        way."""
        return {"stem": r"^cls_token|pos_embed|tokens_to_token",
                "blocks": [(r"^blocks\.(\d+)", None), (r"^norm", (99999,))]}

    def get_classifier(self) -> nn.Module:
        """The final Linear layer."""
        return self.head

    def reset_classifier(self, num_classes: int) -> None:
        """Replace the head by a fresh Linear(num_features, num_classes) (Identity for 0)."""
        self.num_classes = num_classes
        self.head = nn.Linear(self.num_features, num_classes) if num_classes > 0 else nn.Identity()

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Images (B, 3, S, S) -> normalised tokens (B, prefix + (S/16)^2, D)."""
        x = self.tokens_to_token(x)
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = self.pos_drop(x + self.pos_embed)
        return self.norm(self.blocks(x))

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Tokens -> pooled pre-logits (B, num_features), or logits (B, K)."""
        x = self.pre_logits(x[:, 0] if self.cls_token is not None else x.mean(dim=1))
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Images (B, 3, S, S) -> logits (B, K)."""
        return self.forward_head(self.forward_features(x))


def _init_linear(module: nn.Module) -> None:
    # the official T2T-ViT init: truncated normal weights, zero biases (LayerNorms keep torch's 1
    # and 0)
    if isinstance(module, nn.Linear):
        trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
