"""The model zoo: names -> architectures, one builder for every family, and the transfer-time head
surgery.

Families: the paper's ViTs and `custom` are timm's VisionTransformer, subclassed only for what timm
lacks (the learned 2-D position embedding of App. D.4 and the i21k Dense+tanh pre-logits layer), so
a plain configuration keeps timm's exact state-dict layout. R50+ViT-B/16 is the same class on timm's
HybridEmbed over a BiT ResNet (stem + stages of 3, 4, 9 units: stride 16, the paper's hybrid).
BiT-R50x1 and any other timm name are built as timm registers them. T2T-ViT lives in t2t.py, with
the official names: T2T-ViT-N (7, 10, 12, 14, 19, 24) mixes tokens with the Performer (the paper's
default), T2T-ViT_t-N (14, 19, 24) with the Transformer; the name alone records the mixer. The
official code names (t2t_vit_14, t2t_vit_t_14) are aliases.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
from collections import OrderedDict

import timm
import torch
from timm.layers import HybridEmbed, LayerNorm, StdConv2dSame, trunc_normal_
from timm.models.resnetv2 import ResNetV2
from timm.models.vision_transformer import VisionTransformer, init_weights_vit_timm
from torch import nn

from vitcli.errors import ModelError
from vitcli.models.posemb import sincos_2d
from vitcli.models.t2t import T2TViT
from vitcli.recipe.choices import CLASS_TOKEN_POOLS
from vitcli.recipe.names import BIT, HYBRID, NAMED, T2T_VITS, is_vit_family, resolve_known, with_sizes
from vitcli.recipe.schema import ModelConfig


class ViT(VisionTransformer):
    """timm's VisionTransformer + learned 2-D / fixed sin-cos position embeddings + optional
    pre-logits."""

    def __init__(self, pos_embed_type: str = "learned_1d", representation_size: int = 0, **kwargs):
        timm_pos = "learn" if pos_embed_type in ("learned_1d", "sincos_2d") else "none"
        super().__init__(pos_embed=timm_pos, **kwargs)
        dim, (gh, gw) = self.embed_dim, self.patch_embed.grid_size
        self.pos_embed_row = self.pos_embed_col = None
        if pos_embed_type == "sincos_2d":
            # kept in timm's `pos_embed` (zero rows for prefix tokens) so the state dict loads into
            # timm
            table = torch.cat([torch.zeros(1, self.num_prefix_tokens, dim), sincos_2d((gh, gw), dim)], dim=1)
            with torch.no_grad():
                self.pos_embed.copy_(table)  # (1, prefix + H*W, D)
            self.pos_embed.requires_grad_(False)
        elif pos_embed_type == "learned_2d":
            # App. D.4: per patch, concat(row table[y], column table[x]), each D/2 wide;
            # prefix tokens get none
            self.pos_embed_row = nn.Parameter(trunc_normal_(torch.empty(1, gh, dim // 2), std=0.02))
            self.pos_embed_col = nn.Parameter(trunc_normal_(torch.empty(1, gw, dim // 2), std=0.02))
        self.pre_logits = nn.Identity()
        if representation_size:
            self.pre_logits = nn.Sequential(OrderedDict(fc=nn.Linear(dim, representation_size),
                                                        act=nn.Tanh()))
            init_weights_vit_timm(self.pre_logits.fc)
            self.num_features = self.head_hidden_size = representation_size
            self.reset_classifier(self.num_classes)
            init_weights_vit_timm(self.head)

    def no_weight_decay(self) -> set[str]:
        """Position tables and prefix tokens are not decayed."""
        return super().no_weight_decay() | {"pos_embed_row", "pos_embed_col"}

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """timm's reset, but the new head reads the pre-logits width (num_features), not
        embed_dim."""
        super().reset_classifier(num_classes, global_pool)
        if num_classes > 0 and self.num_features != self.embed_dim:
            w = self.head.weight
            self.head = nn.Linear(self.num_features, num_classes, device=w.device, dtype=w.dtype)

    def _pos_embed(self, x: torch.Tensor) -> torch.Tensor:
        if self.pos_embed is not None:
            return super()._pos_embed(x)
        if self.pos_embed_row is not None:
            x = x + self.learned_2d_table()  # (B, H*W, D)
        return self.pos_drop(super()._pos_embed(x))

    def learned_2d_table(self) -> torch.Tensor:
        """(1, H*W, D) of the App. D.4 embedding: patch (y, x) gets concat(row table[y], column
        table[x])."""
        (gh, gw), half = self.patch_embed.grid_size, self.embed_dim // 2
        rows = self.pos_embed_row[:, :, None].expand(-1, gh, gw, half)  # (1, H, W, D/2)
        cols = self.pos_embed_col[:, None, :].expand(-1, gh, gw, half)  # (1, H, W, D/2)
        # timm only prepends prefix tokens when pos_embed is None
        return torch.cat([rows, cols], dim=-1).flatten(1, 2)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Tokens (B, N, D) -> pooled, normalised, pre-logits (B, num_features), or logits (B,
        K)."""
        x = self.head_drop(self.pre_logits(self.fc_norm(self.pool(x))))
        return x if pre_logits else self.head(x)


# ---------------------------------------------------------------- names


def _unknown(name: str) -> ModelError:
    close = difflib.get_close_matches(name, NAMED + timm.list_models(), n=3, cutoff=0.5)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return ModelError(f"model.name: unknown model '{name}'{hint} "
                      f"(use a paper name, T2T-ViT-N, T2T-ViT_t-N, {BIT}, "
                      f"{HYBRID}, a timm.list_models() name, or 'custom')")


@functools.cache
def _timm_probe(name: str) -> tuple:
    """(is_vit, takes_img_size, sizes, pool, pos_embed) of a timm model, read from a weightless meta
    build."""
    if not timm.is_model(name):
        raise _unknown(name)
    with torch.device("meta"):
        probe = timm.create_model(name, pretrained=False)
    if not isinstance(probe, VisionTransformer):
        return False, hasattr(probe, "patch_embed"), None, "gap", "none"
    block, embed = probe.blocks[0], probe.patch_embed
    sizes = (embed.img_size[0] // embed.grid_size[0], probe.embed_dim, len(probe.blocks),
             getattr(block.attn, "num_heads", 0), getattr(getattr(block.mlp, "fc1", None), "out_features", 0))
    # attention-pooled (map) timm models have no class token either: recorded as gap
    pool = "token" if probe.global_pool == "token" else "gap"
    return True, True, sizes, pool, "learned_1d" if probe.pos_embed is not None else "none"


def resolve_name(cfg: ModelConfig) -> ModelConfig:
    """A copy of cfg with the architecture fields its name defines filled in, so a recipe says what
    is built.

    Known names as vitcli.recipe.names.resolve_known fills them; other timm models as timm registers
    them: non-ViTs have no class token or position table (pool `gap`, pos_embed `none`; their ViT
    size fields are unused). Values are checked by vitcli.recipe.checks, not here.
    """
    cfg = resolve_known(cfg)
    if cfg.name in NAMED:
        return cfg
    _, _, sizes, pool, pos_embed = _timm_probe(cfg.name)
    cfg = dataclasses.replace(cfg, pool=pool, pos_embed=pos_embed)
    if not sizes:
        return cfg
    old = (cfg.patch_size, cfg.embed_dim, cfg.depth, cfg.num_heads, cfg.mlp_dim)
    # a size timm hides (0) keeps the recipe's
    return with_sizes(cfg, *(new or was for new, was in zip(sizes, old)))


# ---------------------------------------------------------------- building


def _r50_stages() -> nn.Module:
    """BiT ResNet-50 stem and its first three stages (3, 4, 9 units): stride 16, 1024 channels."""
    # weight-standardised, as in BiT and timm's hybrids
    conv = functools.partial(StdConv2dSame, eps=1e-8)
    return ResNetV2(layers=(3, 4, 9), num_classes=0, global_pool="", preact=False, stem_type="same",
                    conv_layer=conv)


def _vit(cfg: ModelConfig, num_classes: int) -> ViT:
    mlp_ratio = cfg.mlp_dim / cfg.embed_dim
    if int(cfg.embed_dim * mlp_ratio) != cfg.mlp_dim:  # timm floors dim * ratio; keep mlp_dim exact
        mlp_ratio = math.nextafter(mlp_ratio, math.inf)
    hybrid = cfg.name == HYBRID
    kwargs = {
        "img_size": cfg.img_size, "patch_size": 1 if hybrid else cfg.patch_size, "num_classes": num_classes,
        "embed_dim": cfg.embed_dim, "depth": cfg.depth, "num_heads": cfg.num_heads, "mlp_ratio": mlp_ratio,
        "class_token": cfg.pool in CLASS_TOKEN_POOLS,
        "global_pool": "token" if cfg.pool == "token" else "avg",
        # gap as in big_vision/vit_jax: final LayerNorm before pooling, not timm's fc_norm after it,
        # so Google GAP checkpoints (and timm's *_gap_* models) load unchanged; gap_fc_norm as MAE's
        # fine-tune (models_vit.py, global_pool=True): timm then drops the final norm and norms the
        # patch tokens' mean
        "fc_norm": cfg.pool == "gap_fc_norm",
        # timm's own default is 1e-6
        "norm_layer": functools.partial(LayerNorm, eps=cfg.layer_norm_eps),
        # the paper's dropout: after every dense layer except qkv, and after adding position
        # embeddings
        "pos_drop_rate": cfg.dropout, "proj_drop_rate": cfg.dropout, "drop_path_rate": cfg.drop_path}
    if hybrid:  # the ResNet's stride-16 map is cut into 1x1 "patches"
        kwargs["embed_layer"] = functools.partial(HybridEmbed, backbone=_r50_stages())
    return ViT(pos_embed_type=cfg.pos_embed, representation_size=cfg.representation_size, **kwargs)


def _timm(cfg: ModelConfig, num_classes: int) -> nn.Module:
    # GroupNorm + weight standardisation
    arch = "resnetv2_50x1_bit" if cfg.name == BIT else cfg.name
    is_vit, takes_img_size = _timm_probe(arch)[:2]
    kwargs: dict = {"num_classes": num_classes}
    if takes_img_size:
        kwargs["img_size"] = cfg.img_size
    if cfg.dropout:
        kwargs.update({"pos_drop_rate": cfg.dropout, "proj_drop_rate": cfg.dropout} if is_vit else
                      {"drop_rate": cfg.dropout})
    if cfg.drop_path:
        kwargs["drop_path_rate"] = cfg.drop_path
    try:
        return timm.create_model(arch, pretrained=False, **kwargs)
    except TypeError as e:
        raise ModelError(f"timm model '{arch}' rejects {sorted(kwargs)}: {e}") from None


def build_model(cfg: ModelConfig, num_classes: int) -> nn.Module:
    """A freshly initialised model for cfg (resolved on a copy) with a num_classes-way head (0:
    none)."""
    if num_classes < 0:
        raise ModelError(f"num_classes must be >= 0, got {num_classes}")
    cfg = resolve_name(cfg)
    if cfg.name in T2T_VITS:
        model = T2TViT(
            img_size=cfg.img_size, num_classes=num_classes, embed_dim=cfg.embed_dim, depth=cfg.depth,
            num_heads=cfg.num_heads, mlp_ratio=cfg.mlp_dim / cfg.embed_dim, mixer=T2T_VITS[cfg.name][4],
            class_token=cfg.pool == "token", representation_size=cfg.representation_size,
            drop_rate=cfg.dropout, drop_path_rate=cfg.drop_path)
    elif is_vit_family(cfg.name):
        model = _vit(cfg, num_classes)
    else:
        model = _timm(cfg, num_classes)
    for head in classifiers(model) if num_classes > 0 else ():
        if cfg.head_zero_init and getattr(head, "weight", None) is not None:
            nn.init.zeros_(head.weight)
        if getattr(head, "bias", None) is not None:
            nn.init.constant_(head.bias, cfg.head_bias_init)
    return model


def classifiers(model: nn.Module) -> tuple[nn.Module, ...]:
    """The model's classification heads: its one, or a DeiT distilled model's two (timm's
    get_classifier gives the class token's and the distillation token's as a pair)."""
    heads = model.get_classifier()
    return heads if isinstance(heads, tuple) else (heads,)


# ---------------------------------------------------------------- transfer surgery and bookkeeping


def zero_head(model: nn.Module, num_classes: int) -> None:
    """Replace the head by a fresh num_features x num_classes layer with zero weight and bias
    (paper's FT); a DeiT distilled model's two heads both."""
    if num_classes <= 0:
        raise ModelError(f"zero_head needs num_classes > 0, got {num_classes}")
    model.reset_classifier(num_classes)
    for head in classifiers(model):
        nn.init.zeros_(head.weight)
        nn.init.zeros_(head.bias)


def model_spec(cfg: ModelConfig, num_classes: int) -> dict:
    """JSON-able description of the architecture (resolved config + num_classes) for checkpoint
    metadata."""
    return {**dataclasses.asdict(resolve_name(cfg)), "num_classes": num_classes}


def count_params(model: nn.Module) -> int:
    """Number of parameters, trainable or frozen (the paper's counts include the position table)."""
    return sum(p.numel() for p in model.parameters())
