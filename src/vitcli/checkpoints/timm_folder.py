"""A folder timm wrote (`timm.models.save_for_hf`, `push_to_hub`, `vit export --format timm`), read
whole: config.json's `architecture` and `model_args` say the network, `pretrained_cfg` its pixels,
`label_names` its classes; the weights are model.safetensors or, timm's default, pytorch_model.bin
(read by checkpoints.pth, torch.load weights_only=True).

The network timm would build, `timm.create_model(architecture, **model_args)`, is built on the meta
device (no memory, no weights) and compared with what vit would build for it: its own ViT with the
sizes, pooling and LayerNorm eps read off timm's (`custom`), else timm's architecture by name at its
registered sizes (zoo builds any timm name so). Compared are every module's class and plain
attributes (heads, eps, pooling, prefix tokens, activation, ...) and every tensor's name and shape;
the first that vit's builds cannot match is one line naming the architecture (a `convit_tiny` at
other sizes than timm registers, a ViT with LayerScale or a register token). So a model_args'
`num_heads: 8` is 8 heads, never the 6 of the name's registered size.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import timm
import torch
from torch import nn

from vitcli.errors import CheckpointError, ModelError, first_line
from vitcli.models import zoo
from vitcli.recipe.data_checks import json_object
from vitcli.recipe.schema import ModelConfig
from vitcli.runtime.run_files import MODEL_FILE

# what save_for_hf writes: safetensors when asked, torch.save's pickle by default
WEIGHTS_FILES = (MODEL_FILE, "pytorch_model.bin")
# attributes that change nothing at inference: dropout rates, in-place flags
IGNORED = {"training", "p", "drop_prob", "scale_by_keep", "inplace", "grad_checkpointing"}
PLAIN = (bool, int, float, str, tuple, type(None))
# timm.create_model's own arguments, not the network's: a config.json that sets one (a
# checkpoint_path to load, pretrained weights to fetch) is refused, never passed on
FACTORY_ARGS = ("pretrained", "pretrained_cfg", "pretrained_cfg_overlay", "checkpoint_path",
                "cache_dir", "scriptable", "exportable", "no_jit")


@dataclass(frozen=True)
class TimmFolder:
    """What a timm folder's config.json says, and how vit builds it."""

    architecture: str
    # "custom": vit's own ViT (sizes below); else the timm name, built as timm registers it
    built_as: str
    model: ModelConfig  # the network vit builds, name and sizes
    # timm's built attention heads; for a timm name without them, the size fields zoo leaves
    num_heads: int
    num_classes: int
    class_names: list[str] | None  # label_names, when one per class
    # the patch grid (H, W) of timm's position table and the token rows before it (a DeiT
    # distilled's 2, no_embed_class's 0), which its shape alone cannot always tell; None: no table
    grid: tuple[int, int] | None
    num_prefix_tokens: int


def is_timm_folder(folder: Path) -> bool:
    """Whether `folder` holds timm's config.json: an `architecture`, no transformers model_type."""
    config = json_object(folder / "config.json")
    return "architecture" in config and "model_type" not in config


def weights_file(folder: Path) -> Path | None:
    """The weights save_for_hf wrote into `folder`: safetensors first; None when neither is
    there."""
    return next((folder / n for n in WEIGHTS_FILES if (folder / n).is_file()), None)


def read_config(folder: Path) -> TimmFolder:
    """The network `folder`'s config.json names, as vit builds it; one line naming the architecture
    when vit cannot build it as timm does."""
    path = folder / "config.json"
    config = json_object(path)
    arch, args = str(config["architecture"]), config.get("model_args") or {}
    if not isinstance(args, dict):
        raise CheckpointError(f"{path}: model_args is {type(args).__name__}, not an object")
    factory = [k for k in args if k in FACTORY_ARGS]
    if factory:
        raise CheckpointError(f"{path}: model_args sets {factory[0]}, an argument of "
                              "timm.create_model, not of the network; remove it from model_args")
    theirs = _timm_net(path, arch, args)
    num_classes = int(getattr(theirs, "num_classes", config.get("num_classes", 0)) or 0)
    ours, why = _as_vit(path, arch, args, theirs, num_classes)
    if why:
        named = dataclasses.replace(ModelConfig(), name=arch, img_size=_img_size(theirs, config))
        why_named = _differs(theirs, _build(named, num_classes))
        if why_named:
            shown = json.dumps({k: v for k, v in args.items()
                                if k not in ("num_classes", "in_chans")})
            raise CheckpointError(
                f"{path} names architecture {arch} with model_args {shown}, which vit cannot "
                f"build: not as its ViT ({why}) nor as timm's {arch} at its registered sizes "
                f"({why_named}); vit builds timm's plain VisionTransformer at any size and other "
                "timm architectures at the sizes timm registers")
        ours = zoo.resolve_name(named)  # timm's sizes where it has them, the recipe's defaults else
    return TimmFolder(arch, ours.name, ours, _heads(theirs) or ours.num_heads, num_classes,
                      _label_names(config, num_classes), *_table(theirs))


def _table(net: nn.Module) -> tuple[tuple[int, int] | None, int]:
    """(the grid timm's position table spans, the prefix-token rows it holds); (None, 0) without
    one."""
    grid = getattr(getattr(net, "patch_embed", None), "grid_size", None)
    if getattr(net, "pos_embed", None) is None or grid is None:
        return None, 0
    prefix = 0 if getattr(net, "no_embed_class", False) else getattr(net, "num_prefix_tokens", 0)
    return (int(grid[0]), int(grid[1])), int(prefix)


def _heads(net: nn.Module) -> int:
    """The first block's attention heads; 0 for a network without them."""
    blocks = getattr(net, "blocks", None)
    first = blocks[0] if isinstance(blocks, nn.Sequential | nn.ModuleList) and len(blocks) else None
    return int(getattr(getattr(first, "attn", None), "num_heads", 0) or 0)


def _as_vit(path: Path, arch: str, args: dict, theirs: nn.Module,
            num_classes: int) -> tuple[ModelConfig, str]:
    """vit's own ViT for timm's `theirs`, and the first way it is not the same network ("" when
    none)."""
    if getattr(theirs, "dynamic_img_size", False):
        # timm resamples the table to each input's grid: at the one resolution vit feeds (its
        # native one, or a table vit resampled) the same network without it
        theirs = _timm_net(path, arch, {**args, "dynamic_img_size": False})
    ours = _vit_model(theirs, num_classes)
    if isinstance(ours, str):
        return ModelConfig(), ours
    return ours, _differs(theirs, _build(ours, num_classes))


def _timm_net(path: Path, arch: str, args: dict) -> nn.Module:
    """timm's network for the folder, on the meta device."""
    if not timm.is_model(arch):
        raise CheckpointError(f"{path} names architecture {arch}, which timm {timm.__version__} "
                              "does not know; a newer timm may")
    try:
        with torch.device("meta"):
            return timm.create_model(arch, pretrained=False, **args).eval()
    except (TypeError, ValueError, AssertionError, RuntimeError) as e:
        raise CheckpointError(f"{path}: timm cannot build architecture {arch} with its model_args "
                              f"({first_line(e)})") from None


def _build(model: ModelConfig, num_classes: int) -> nn.Module | str:
    """vit's network for `model`, on the meta device; why not, as a string."""
    try:
        with torch.device("meta"):
            return zoo.build_model(model, num_classes).eval()
    except (ModelError, TypeError, ValueError, AssertionError, RuntimeError) as e:
        return first_line(e)


def _vit_model(net: nn.Module, num_classes: int) -> ModelConfig | str:
    """vit's own ViT with `net`'s sizes, pooling and eps; why none, as a string."""
    try:
        embed, block = net.patch_embed, net.blocks[0]
        (side, width), (patch, tall) = embed.img_size, embed.patch_size
        norm = net.norm if isinstance(net.norm, nn.LayerNorm) else net.fc_norm
        has_token, fc_norm = net.cls_token is not None, not isinstance(net.fc_norm, nn.Identity)
        pool = {("token", True, False): "token", ("avg", False, False): "gap",
                ("avg", True, True): "gap_fc_norm"}.get((net.global_pool, has_token, fc_norm))
        sizes = {"img_size": side, "patch_size": patch, "embed_dim": net.embed_dim,
                 "depth": len(net.blocks), "num_heads": block.attn.num_heads,
                 "mlp_dim": block.mlp.fc1.out_features, "layer_norm_eps": norm.eps}
    except (AttributeError, TypeError, ValueError, IndexError):
        return f"a {type(net).__name__}, not timm's VisionTransformer"
    if side != width or patch != tall:
        return f"{side}x{width} images in {patch}x{tall} patches, not square"
    if pool is None:
        return f"global_pool {net.global_pool} with class token {has_token}, fc_norm {fc_norm}"
    return ModelConfig(name="custom", pool=pool, num_classes=num_classes,
                       pos_embed="learned_1d" if net.pos_embed is not None else "none", **sizes)


def _signature(net: nn.Module) -> tuple[dict, dict]:
    """({module: (class, its plain attributes)}, {tensor: shape}) of a network."""
    modules = {}
    for name, module in net.named_modules():
        attrs = {k: v for k, v in vars(module).items()
                 if not k.startswith("_") and k not in IGNORED and isinstance(v, PLAIN)}
        # vit's ViT is timm's VisionTransformer with options timm lacks (left None, Identity)
        kind = "VisionTransformer" if isinstance(module, zoo.ViT) else type(module).__name__
        modules[name] = (kind, attrs)
    return modules, {k: tuple(v.shape) for k, v in net.state_dict().items()}


def _differs(theirs: nn.Module, ours: nn.Module | str) -> str:
    """The first way `ours` is not `theirs`, as a phrase; "" when none."""
    if isinstance(ours, str):
        return ours
    (their_modules, their_shapes), (our_modules, our_shapes) = _signature(theirs), _signature(ours)
    for key, shape in their_shapes.items():
        if our_shapes.get(key) != shape:
            got = our_shapes.get(key)
            return f"{key} {shape} in timm's, {'none' if got is None else got} in vit's"
    extra = [k for k in our_shapes if k not in their_shapes]
    if extra:
        return f"{extra[0]} in vit's, none in timm's"
    for name, (kind, attrs) in their_modules.items():
        mine = our_modules.get(name)
        where = name or "the network"
        if mine is None or mine[0] != kind:
            return f"{where} is a {kind} in timm's, {mine[0] if mine else 'none'} in vit's"
        for k, v in attrs.items():
            if k in mine[1] and mine[1][k] != v:
                return f"{where}.{k} {v!r} in timm's, {mine[1][k]!r} in vit's"
    return ""


def _img_size(net: nn.Module, config: dict) -> int:
    """The resolution timm built `net` at (its patch embedding's), else pretrained_cfg's."""
    embed = getattr(net, "patch_embed", None)
    size = getattr(embed, "img_size", None)
    if size:
        return int(size[0])
    input_size = (config.get("pretrained_cfg") or {}).get("input_size") or [3, 224, 224]
    return int(input_size[-1])


def _label_names(config: dict, num_classes: int) -> list[str] | None:
    """label_names as a list of one name per class (timm writes a list, or a dict index -> name
    when there are gaps); None otherwise."""
    names = config.get("label_names")
    if isinstance(names, dict):
        try:
            names = [names[k] for k in sorted(names, key=int)]
        except (TypeError, ValueError):
            return None
    if isinstance(names, list) and len(names) == num_classes:
        return [str(n) for n in names]
    return None
