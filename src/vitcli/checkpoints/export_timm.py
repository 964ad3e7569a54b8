"""A checkpoint as a timm model folder: what `timm.models.save_for_hf` writes (model.safetensors in
timm's names, config.json with architecture, num_classes, label_names, model_args and
pretrained_cfg), so that `timm.create_model("local-dir:DIR", pretrained=True)` and `push_to_hf_hub`
take it as it is.

timm writes the folder itself from a timm-built model: a plain ViT of ours is rebuilt as timm's
VisionTransformer with the same sizes (our ViT subclass keeps timm's exact state-dict layout for
plain configurations), a timm-named model is timm's already. What timm's VisionTransformer has no
option for (the learned 2-D position embedding, the Dense+tanh pre-logits layer, T2T-ViT, our
hybrid) is refused.
"""

from __future__ import annotations

from pathlib import Path

import timm
import torch
from timm.models import save_for_hf
from torch import nn

from vitcli.errors import CheckpointError, first_line
from vitcli.models import zoo
from vitcli.recipe.choices import CLASS_TOKEN_POOLS
from vitcli.recipe.names import HYBRID, T2T_VITS, is_vit_family, paper_size
from vitcli.recipe.schema import ModelConfig

TIMM_SIZES = {"Ti": "tiny", "S": "small", "B": "base", "L": "large", "H": "huge"}
FALLBACK = "vit_base_patch16_224"  # any registered ViT: model_args set every size


def check_timm(model: ModelConfig, path: str) -> None:
    """A CheckpointError naming the first feature timm's models cannot hold."""
    why = timm_refusal(model)
    if why:
        raise CheckpointError(f"{path}: {why}; export it with --format onnx")


def timm_refusal(model: ModelConfig) -> str:
    """The first feature of `model` timm's models cannot hold; "" when there is none."""
    if model.name in T2T_VITS or model.name == HYBRID:
        return f"a {model.name}, which timm does not build"
    if model.pos_embed == "learned_2d":
        return "a learned_2d position embedding (model.pos_embed), which timm's VisionTransformer lacks"
    if model.representation_size:
        return (f"a pre-logits layer (model.representation_size: {model.representation_size}), which timm's "
                "VisionTransformer lacks")
    return ""


def timm_model(model: ModelConfig, num_classes: int) -> nn.Module:
    """The timm-built network with `model`'s sizes (weights still to load)."""
    if not is_vit_family(model.name):
        # a timm name: timm builds it, with its pretrained_cfg
        return zoo.build_model(model, num_classes)
    token = model.pool == "token"
    args = {"img_size": model.img_size, "patch_size": model.patch_size, "embed_dim": model.embed_dim,
            "depth": model.depth, "num_heads": model.num_heads, "mlp_ratio": model.mlp_dim / model.embed_dim,
            "num_classes": num_classes, "class_token": model.pool in CLASS_TOKEN_POOLS,
            "global_pool": "token" if token else "avg", "fc_norm": model.pool == "gap_fc_norm",
            "pos_embed": "none" if model.pos_embed == "none" else "learn"}
    return timm.create_model(_architecture(model), pretrained=False, **args)


def _architecture(model: ModelConfig) -> str:
    """timm's name for a paper / DeiT size at this patch and resolution when it registers one, else
    any."""
    size = paper_size(model.patch_size, model.embed_dim, model.depth, model.num_heads, model.mlp_dim)
    letter = size.removeprefix("ViT-").split("/")[0]
    name = f"vit_{TIMM_SIZES.get(letter, '')}_patch{model.patch_size}_{model.img_size}"
    return name if letter and timm.is_model(name) else FALLBACK


def write_timm(net: nn.Module, sd: dict[str, torch.Tensor], out: Path, class_names: list[str] | None,
               prep: dict) -> None:
    """Load `sd` into timm's `net` (strict) and let timm write the folder with our preprocessing."""
    try:
        net.load_state_dict(sd, strict=True)
    # torch's first line is a header ("Error(s) in loading ..."), its next the keys
    except RuntimeError as e:
        lines = str(e).strip().splitlines()
        detail = lines[1].strip() if len(lines) > 1 else first_line(e)
        raise CheckpointError(f"the weights do not fit timm's {type(net).__name__}: {detail}") from None
    data = {"mean": tuple(prep["mean"]), "std": tuple(prep["std"]), "interpolation": prep["interpolation"],
            "crop_pct": prep["crop_pct"], "crop_mode": prep["crop_mode"]}
    config = {"label_names": list(class_names)} if class_names else None
    # timm's registered weights for the architecture name are not these: their tag and licence are
    # dropped
    net.pretrained_cfg = {**{k: v for k, v in net.pretrained_cfg.items() if k not in ("tag", "license")},
                          "tag": "vitcli"}
    save_for_hf(net.eval(), str(out), model_config=config, safe_serialization=True, data_config=data)
