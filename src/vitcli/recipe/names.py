"""Model names a recipe can give and the architecture each stands for, without torch or timm.

The paper's ViTs (Table 1), the R50+ViT-B/16 hybrid, BiT-R50x1, T2T-ViT (official names; the name
records the token mixer) and `custom` are known here; any other name is a timm model, which only
timm can describe (vitcli.models.zoo.resolve_name reads it off a weightless build).
"""

from __future__ import annotations

import dataclasses

from vitcli.errors import RecipeError
from vitcli.recipe.schema import ModelConfig

# Table 1 of the paper, (patch_size, embed_dim, depth, num_heads, mlp_dim); Ti and S are the
# DeiT/AugReg sizes
PAPER_VITS = {
    "ViT-Ti/16": (16, 192, 12, 3, 768),
    "ViT-S/16": (16, 384, 12, 6, 1536),
    "ViT-B/32": (32, 768, 12, 12, 3072),
    "ViT-B/16": (16, 768, 12, 12, 3072),
    "ViT-L/32": (32, 1024, 24, 16, 4096),
    "ViT-L/16": (16, 1024, 24, 16, 4096),
    "ViT-H/14": (14, 1280, 32, 16, 5120),
}
# Official t2t_vit.py factories: name -> (embed_dim, depth, num_heads, mlp_dim, token mixer);
# token_dim 64
T2T_VITS = {
    "T2T-ViT-7": (256, 7, 4, 512, "performer"),
    "T2T-ViT-10": (256, 10, 4, 512, "performer"),
    "T2T-ViT-12": (256, 12, 4, 512, "performer"),
    **{f"T2T-ViT{kind}-{depth}": (dim, depth, heads, 3 * dim, mixer)
       for kind, mixer in (("", "performer"), ("_t", "transformer"))
       for dim, depth, heads in ((384, 14, 6), (448, 19, 7), (512, 24, 8))},
}
# (width, depth, heads, mlp_dim) -> size letter: a geometry any patch size shares, so a foreign file
# is named by its size (a timm vit_tiny_patch16_224 is ViT-Ti/16); where each size was defined
SIZES = {sizes[1:]: name.split("-")[1].split("/")[0] for name, sizes in PAPER_VITS.items()}
SIZE_ORIGINS = {"Ti": "DeiT-Ti / AugReg Ti", "S": "DeiT-S / AugReg S", "B": "paper Table 1",
                "L": "paper Table 1", "H": "paper Table 1"}
HYBRID, BIT = "R50+ViT-B/16", "BiT-R50x1"
NAMED = ["custom", *PAPER_VITS, HYBRID, BIT, *T2T_VITS]
# the official code's own names, lower-case with underscores: t2t_vit_14 -> T2T-ViT-14,
# t2t_vit_t_14 -> T2T-ViT_t-14
ALIASES = {name.lower().replace("-", "_"): name for name in T2T_VITS}


def is_vit_family(name: str) -> bool:
    """Built by our ViT class (paper sizes, custom, hybrid): every pool and position-embedding
    option applies."""
    return name in ("custom", *PAPER_VITS, HYBRID)


def t2t_name(mixer: str, embed_dim: int, depth: int) -> str:
    """The T2T-ViT name with this token mixer, width and depth; "" when none has them."""
    return next((name for name, (dim, layers, _, _, kind) in T2T_VITS.items()
                 if (kind, dim, layers) == (mixer, embed_dim, depth)), "")


def paper_size(patch_size: int, embed_dim: int, depth: int, num_heads: int, mlp_dim: int) -> str:
    """`ViT-Ti/16` when the geometry is a paper or DeiT/AugReg size (patch as given), else ""."""
    letter = SIZES.get((embed_dim, depth, num_heads, mlp_dim), "")
    return f"ViT-{letter}/{patch_size}" if letter else ""


def size_origin(name: str) -> str:
    """Where a `ViT-<size>/<patch>` name's size was defined: `DeiT-Ti / AugReg Ti`, `paper Table
    1`."""
    return SIZE_ORIGINS.get(name.removeprefix("ViT-").split("/")[0], "")


def with_sizes(cfg: ModelConfig, patch_size: int, embed_dim: int, depth: int, num_heads: int, mlp_dim: int,
                **extra) -> ModelConfig:
    """A copy of cfg with these architecture sizes (and `extra` fields)."""
    return dataclasses.replace(cfg, patch_size=patch_size, embed_dim=embed_dim, depth=depth,
                               num_heads=num_heads, mlp_dim=mlp_dim, **extra)


def resolve_known(cfg: ModelConfig) -> ModelConfig:
    """A copy of cfg under its canonical name with the architecture fields a known name defines
    filled in.

    Paper ViTs define their sizes; T2T-ViT also its fixed 1-D sinusoid table (pos_embed `sincos_1d`;
    its token mixer is in the name); BiT has no class token or position table (pool `gap`, pos_embed
    `none`; its ViT size fields are unused). Official T2T-ViT code names (t2t_vit_t_14) become ours.
    A timm name comes back unchanged (`cfg.name not in NAMED`).
    """
    key = cfg.name.lower()
    name = next((n for n in NAMED if n.lower() == key), ALIASES.get(key, cfg.name))
    cfg = dataclasses.replace(cfg, name=name)
    if name in PAPER_VITS:
        return with_sizes(cfg, *PAPER_VITS[name])
    if name == HYBRID:
        return with_sizes(cfg, 16, *PAPER_VITS["ViT-B/16"][1:])
    if name in T2T_VITS:  # the soft splits make an effective patch of 16
        return with_sizes(cfg, 16, *T2T_VITS[name][:4], pos_embed="sincos_1d")
    if name == BIT:
        return dataclasses.replace(cfg, pool="gap", pos_embed="none")
    return cfg


SIZE_KEYS = ("patch_size", "embed_dim", "depth", "num_heads", "mlp_dim")


def refuse_resized(given: ModelConfig, known: ModelConfig, layers: list[dict]) -> None:
    """Refuse a size the user set that the model's name overrides: `model.name: ViT-L/16` from a
    recipe with `model.embed_dim=32` on the command line would otherwise train ViT-L silently (a
    known name's sizes here; a timm name's, timm's, once vitcli.recipe.resolve has them).

    `layers` are the user's, in order (recipe file, overrides, flags); a size set before the layer
    that names the model is that layer's to replace (a file's custom sizes, then `model.name=ViT-B/16`
    on the command line), one set with or after it contradicts it.
    """
    named_at = max((i for i, layer in enumerate(layers) if "name" in _model(layer)), default=-1)
    for key in SIZE_KEYS:
        said = any(key in _model(layer) for layer in layers[max(named_at, 0):])
        if said and getattr(given, key) != getattr(known, key):
            raise RecipeError(
                f"model.{key}={getattr(given, key)} contradicts model.name={known.name}, whose {key} is "
                f"{getattr(known, key)}: drop model.{key}, or set model.name=custom to size it yourself")


def _model(layer: dict) -> dict:
    """A layer's model section ({} when it has none)."""
    return layer["model"] if isinstance(layer.get("model"), dict) else {}
