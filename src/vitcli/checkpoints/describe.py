"""What network a checkpoint holds: the one place that reads a checkpoint's geometry and sizes.

Ours say it in their metadata. Foreign files (timm safetensors, Google .npz, Hub models) are taken
to be a plain timm-layout ViT and read from the tensors' shapes. The number of attention heads is
not in a timm state dict's shapes (qkv is (3D, D) for any head count), so it comes from evidence
only: our metadata, the npz query kernel (D, H, D/H), the Hub model's attn.num_heads, the recipe's
explicit model.num_heads, or the paper's Table 1 for its own widths. Never width // 64: ViT-H/14 is
1280 wide with 16 heads, not 20.

A foreign file holding timm's R50 HybridEmbed ResNet (`patch_embed.backbone.*`, the names the
vit_jax hybrid .npz is read into) is the R50+ViT-B/16 hybrid, whose 1x1 kernel sits on a stride-16
map.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vitcli.checkpoints.read import Loaded
from vitcli.errors import CheckpointError
from vitcli.recipe.names import HYBRID, NAMED, PAPER_VITS, T2T_VITS, t2t_name

# width -> heads: {192: 3, 384: 6, 768: 12, 1024: 16, 1280: 16}
PAPER_HEADS: dict[int, int] = {width: heads for _, width, _, heads, _ in PAPER_VITS.values()}
ARCH_FIELDS = (
    "name", "patch_size", "embed_dim", "depth", "num_heads", "mlp_dim", "pool", "pos_embed",
    "representation_size", "layer_norm_eps",
)
HEADS_FROM_SOURCE = {"npz": "attention kernels", "hub": "Hub model", "hf": "config.json",
                     "timm": "config.json (timm)"}
# what a timm folder's config.json builds (checkpoints.timm_folder), over what the shapes say
TIMM_FIELDS = ("patch_size", "embed_dim", "depth", "mlp_dim", "pool", "pos_embed")
# official T2T-ViT state dicts: the first token layer's attention input weights name the token mixer
T2T_MIXER_KEYS = {"tokens_to_token.attention1.kqv.weight": "performer",
                  "tokens_to_token.attention1.attn.qkv.weight": "transformer"}
# models.HYBRID: a BiT ResNet of stages with 3, 4, 9 units, stride 16, under 1x1 "patches"
HYBRID_UNITS, HYBRID_STRIDE = (3, 4, 9), 16
BACKBONE = "patch_embed.backbone."


@dataclass(frozen=True)
class CheckpointSpec:
    """A checkpoint's network, as far as the checkpoint tells it."""

    # model.name that builds it: ours as recorded; foreign plain ViTs "custom"; "" = not a ViT we
    # read
    name: str
    patch_size: int
    grid: tuple[int, int] | None  # patch grid (H, W) of the position table; None when nothing tells
    # class/register tokens that own a pos_embed row (timm no_embed_class: 0)
    num_prefix_tokens: int
    pos_embed: str  # learned_1d | learned_2d | sincos_2d | sincos_1d | none
    pool: str  # token | gap | gap_fc_norm
    embed_dim: int
    depth: int
    num_heads: int  # 0 = unknown
    heads_from: str  # where num_heads came from, for messages and the run's report
    mlp_dim: int
    representation_size: int
    num_classes: int  # rows of the checkpoint's head, 0 if none
    # native resolution: our metadata, else grid x patch when the grid is square
    img_size: int | None
    path: str = ""  # the file or Hub name it was read from, for messages
    layer_norm_eps: float = 1e-6  # our metadata's, a transformers config.json's; else timm's
    # what states `grid` besides the table's shape (our metadata, a transformers config.json),
    # which init.grid may not contradict; "" when only the table tells (a .npz, a timm file)
    grid_from: str = ""

    def architecture(self) -> dict:
        """The ModelConfig fields that rebuild this network; a CheckpointError when the
        file cannot tell them."""
        if not self.name:
            raise CheckpointError(
                f"cannot infer the architecture of {self.path or 'the checkpoint'} (no patch_embed/blocks "
                "keys); set model.name to its architecture (e.g. model.name=ViT-B/16 or a timm name)"
            )
        if not self.num_heads and self.name in NAMED:  # a timm name's are timm's
            raise CheckpointError(
                f"{self.path or 'the checkpoint'} (width {self.embed_dim}): its number of attention heads is "
                "unknown; set model.num_heads (or model.name to its architecture)"
            )
        return {k: getattr(self, k) for k in ARCH_FIELDS}


def describe(loaded: Loaded, num_heads: int = 0) -> CheckpointSpec:
    """The network `loaded` holds; `num_heads` is the recipe's explicit model.num_heads (0: not
    set)."""
    model, sd = _our_model(loaded), loaded.state_dict
    fields = _ours(sd, model) if model is not None else _t2t(sd, loaded.path) or _foreign(sd, loaded.path)
    if loaded.meta.get("built_as"):
        fields = _timm_folder(fields, loaded.meta)
    heads, heads_from = _heads(loaded, model or {}, fields["embed_dim"], num_heads, fields["name"])
    said = model if model is not None else loaded.meta if loaded.kind in ("hf", "timm") else {}
    return CheckpointSpec(**fields, num_heads=heads, heads_from=heads_from, path=loaded.path,
                          layer_norm_eps=float(said.get("layer_norm_eps") or 1e-6),
                          grid_from=_grid_from(loaded, model, fields["grid"], fields["patch_size"]))


def _timm_folder(fields: dict, meta: dict) -> dict:
    """A timm folder's network as timm_folder decided vit builds it: its own ViT with the sizes
    config.json's model_args give, or a timm name at timm's registered sizes, its head's width and
    resolution from config.json; its position table's grid and prefix rows as timm built them."""
    named = meta["built_as"] != "custom"
    table = {"grid": tuple(meta["grid"] or ()), "num_prefix_tokens": meta["num_prefix_tokens"]}
    return {**fields, "name": meta["built_as"], **{k: meta["model"][k] for k in TIMM_FIELDS},
            **(table if meta["grid"] else {}), "img_size": fields["img_size"] or meta["img_size"],
            "num_classes": meta["num_classes"] if named else fields["num_classes"]}


def _grid_from(loaded: Loaded, model: dict | None, grid: tuple[int, int] | None, patch: int) -> str:
    """What states the patch grid besides the table's shape: our metadata, a transformers
    config.json; "" for nothing."""
    if grid is None:
        return ""
    if model is not None and model.get("img_size"):  # _ours took the grid from it
        return f"metadata (model.img_size {model['img_size']}, patch {patch})"
    said = loaded.meta if loaded.kind == "hf" else {}
    size, side = said.get("image_size"), said.get("patch_size")
    if size and side and grid == (size // side,) * 2:
        return f"config.json (image_size {size}, patch_size {side})"
    return ""


def _our_model(loaded: Loaded) -> dict | None:
    """The model spec our metadata records, None for foreign files."""
    model = loaded.meta.get("model") if loaded.kind == "vitcli" else None
    return model if isinstance(model, dict) else None


def _ours(sd: dict[str, torch.Tensor], model: dict) -> dict:
    """Our metadata, with the tensors filling what an older or partial spec leaves out."""
    sizes = _sizes(sd)
    fields = {**sizes, **{k: model[k] for k in sizes if model.get(k) is not None}}
    img_size = int(model["img_size"]) if model.get("img_size") else None
    # a hybrid's 1x1 kernel sits on a stride-16 ResNet map: trust the spec
    patch = fields["patch_size"]
    grid = (img_size // patch,) * 2 if img_size and patch and img_size % patch == 0 else None
    prefix = _prefix_tokens(sd, grid)
    return {**fields, "name": model.get("name", "custom"), "grid": grid, "num_prefix_tokens": prefix,
            "img_size": img_size}


def _foreign(sd: dict[str, torch.Tensor], path: str) -> dict:
    """A plain timm-layout ViT (or the R50 hybrid) read from the tensors' shapes; name "" when it is
    none (a ResNet, another hybrid), whose position tables are still described so that a model named
    in the recipe can load it."""
    kernel = sd.get("patch_embed.proj.weight")  # (D, C, ph, pw)
    plain_vit = kernel is not None and "blocks.0.mlp.fc1.weight" in sd
    if plain_vit and kernel.shape[-2] != kernel.shape[-1]:
        raise CheckpointError(
            f"{path}: patch_embed.proj.weight {tuple(kernel.shape)} cuts "
            f"{kernel.shape[-2]}x{kernel.shape[-1]} patches; only square patches are supported"
        )
    fields, name = _sizes(sd), "custom" if plain_vit else ""
    # another backbone than R50's: only model.name can tell it
    if any(k.startswith(BACKBONE) for k in sd):
        name = HYBRID if plain_vit and _backbone_units(sd) == HYBRID_UNITS else ""
        fields["patch_size"] = HYBRID_STRIDE if name else 0
    prefix = _prefix_tokens(sd, None)
    grid = _table_grid(sd, fields["pos_embed"], prefix)
    img_size = grid[0] * fields["patch_size"] if grid and grid[0] == grid[1] else None
    return {**fields, "name": name, "grid": grid, "num_prefix_tokens": prefix, "img_size": img_size}


def _backbone_units(sd: dict[str, torch.Tensor]) -> tuple[int, ...]:
    """Units per stage of a hybrid's ResNet, from `patch_embed.backbone.stages.{i}.blocks.{j}.*`."""
    units: dict[int, int] = {}
    for k in sd:
        if k.startswith(BACKBONE + "stages."):
            stage, unit = (int(n) for n in k.split(".")[3:6:2])
            units[stage] = max(units.get(stage, 0), unit + 1)
    return tuple(units[i] for i in sorted(units))


def _t2t(sd: dict[str, torch.Tensor], path: str) -> dict | None:
    """An official T2T-ViT state dict as the T2T-ViT name with its mixer, width and depth; None if
    not one."""
    mixer = next((kind for key, kind in T2T_MIXER_KEYS.items() if key in sd), None)
    if mixer is None:
        return None
    fields = {**_sizes(sd), "patch_size": 16, "pos_embed": "sincos_1d",
              "embed_dim": _rows(sd, "tokens_to_token.project.weight")}  # (D, token_dim * 9)
    name = t2t_name(mixer, fields["embed_dim"], fields["depth"])
    if not name:
        raise CheckpointError(f"{path}: a T2T-ViT ({mixer} token mixer) of width {fields['embed_dim']} and "
                              f"depth {fields['depth']}, which is none of {', '.join(T2T_VITS)}")
    prefix = _prefix_tokens(sd, None)
    grid = _table_grid(sd, "learned_1d", prefix)  # the fixed table has the same (1, P+N, D) layout
    return {**fields, "name": name, "grid": grid, "num_prefix_tokens": prefix,
            "img_size": grid[0] * 16 if grid else None}


def _sizes(sd: dict[str, torch.Tensor]) -> dict:
    """What the tensors of a timm-layout ViT say; 0 where the tensor is absent."""
    kernel = sd.get("patch_embed.proj.weight")  # (D, C, ph, pw)
    return {
        "patch_size": int(kernel.shape[-1]) if kernel is not None else 0,
        "embed_dim": int(kernel.shape[0]) if kernel is not None else 0,
        "depth": 1 + max((int(k.split(".")[1]) for k in sd if k.startswith("blocks.")), default=-1),
        "mlp_dim": _rows(sd, "blocks.0.mlp.fc1.weight"),  # (mlp, D)
        "pool": _pool(sd),
        "pos_embed": _pos_kind(sd),
        "representation_size": _rows(sd, "pre_logits.fc.weight"),  # (R, D)
        "num_classes": _rows(sd, "head.weight"),  # (K, R or D)
    }


def _pool(sd: dict[str, torch.Tensor]) -> str:
    """token, gap, or gap_fc_norm: a class token with a norm after the pooling and none before it
    (MAE's global-pool fine-tune, timm's fc_norm)."""
    if "cls_token" not in sd:
        return "gap"
    return "gap_fc_norm" if "fc_norm.weight" in sd and "norm.weight" not in sd else "token"


def _rows(sd: dict[str, torch.Tensor], key: str) -> int:
    return int(sd[key].shape[0]) if key in sd else 0


def _pos_kind(sd: dict[str, torch.Tensor]) -> str:
    """Learned tables only: a fixed sin-cos table is indistinguishable from a learned one in a
    file."""
    if "pos_embed_row" in sd and "pos_embed_col" in sd:
        return "learned_2d"
    return "learned_1d" if "pos_embed" in sd else "none"


def _prefix_tokens(sd: dict[str, torch.Tensor], grid: tuple[int, int] | None) -> int:
    """Class and register tokens that own a row of pos_embed (1, P+N, D)."""
    if "pos_embed" not in sd:
        return 0
    rows = sd["pos_embed"].shape[1]
    # reg (1, R, D)
    tokens = ("cls_token" in sd) + (sd["reg_token"].shape[1] if "reg_token" in sd else 0)
    if grid is not None:
        return 0 if rows == grid[0] * grid[1] else tokens
    # timm no_embed_class: the table covers the patches only, so it is square without the tokens
    if tokens and math.isqrt(rows) ** 2 == rows and math.isqrt(rows - tokens) ** 2 != rows - tokens:
        return 0
    return tokens


def _table_grid(sd: dict[str, torch.Tensor], kind: str, prefix: int) -> tuple[int, int] | None:
    """The patch grid the position tables span; a 1-D table only tells when its grid rows are a
    square."""
    if kind == "learned_2d":
        # (1, H, D/2) and (1, W, D/2)
        return int(sd["pos_embed_row"].shape[1]), int(sd["pos_embed_col"].shape[1])
    if kind != "learned_1d":
        return None
    n = sd["pos_embed"].shape[1] - prefix
    side = math.isqrt(n)
    return (side, side) if side * side == n else None


def _heads(loaded: Loaded, model: dict, width: int, asked: int, name: str = "") -> tuple[int, str]:
    """(num_heads, where it came from): evidence, else the recipe's value, else Table 1, else
    unknown."""
    found, source = _heads_evidence(loaded, model, name)
    if found and asked and asked != found:
        raise CheckpointError(
            f"model.num_heads={asked} in the recipe, but {loaded.path} has {found} attention heads "
            f"({source}); set model.num_heads={found} or leave it out"
        )
    if found:
        return found, source
    if asked:
        return asked, "recipe (model.num_heads)"
    if width in PAPER_HEADS:
        return PAPER_HEADS[width], f"paper Table 1 (width {width})"
    return 0, "unknown"


def _heads_evidence(loaded: Loaded, model: dict, name: str = "") -> tuple[int, str]:
    """What the checkpoint itself says about its heads: our metadata, npz kernels, the Hub model, or
    the T2T-ViT its keys identify (official T2T-ViT names define their heads)."""
    if model.get("num_heads"):
        return int(model["num_heads"]), "metadata"
    if loaded.num_heads:
        return loaded.num_heads, HEADS_FROM_SOURCE.get(loaded.kind, loaded.kind)
    if name in T2T_VITS:
        return T2T_VITS[name][2], f"{name} definition"
    return 0, ""
