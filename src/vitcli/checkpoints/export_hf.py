"""A plain ViT in Hugging Face transformers' layout: `ViTForImageClassification` weights, config and
image processor, so that `from_pretrained(DIR)` rebuilds the same network.

The key mapping is the one transformers' own `convert_vit_timm_to_pytorch.py` applies (hf_vit.py
holds it, and reads such a folder back): timm's fused qkv (3D, D) is split into query, key and
value, `norm1`/`norm2` become `layernorm_before`/`layernorm_after`, the MLP's fc1/fc2 become
`intermediate`/`output` dense layers, the final norm `vit.layernorm` and the head `classifier`.

`ViTForImageClassification` is one architecture: class token read after the final LayerNorm, a
learned 1-D table over [class; patches], exact GELU, the model's LayerNorm eps
(model.layer_norm_eps, set in the config: timm's 1e-6, where transformers' default is 1e-12), no
pre-logits layer (ViTModel's tanh `pooler` is not used by the classifier). Anything else is refused
by `check_hf`, never exported as a different network.

A headless MAE encoder (one of MAE's .pth files, or our run of objective mae) goes to `ViTMAEModel`
instead: the same encoder and names, its position table loaded as it is (MAE's is a fixed sin-cos
one), LayerNorm eps 1e-6 (MAE's, as timm's), and `mask_ratio` 0.0: ViTMAEModel masks 75% of the
patches by default, at inference too (transformers #20328). With 0.0 every patch is kept, but still
in the order of a random shuffle unless `noise` is passed (`noise=torch.arange(N)` keeps the order;
`ids_restore` undoes it).
"""

from __future__ import annotations

import torch

from vitcli.checkpoints.export_timm import timm_refusal
from vitcli.checkpoints.hf_vit import BLOCK_NAMES, TOP_NAMES
from vitcli.checkpoints.read import Loaded
from vitcli.errors import CheckpointError
from vitcli.recipe.names import HYBRID, T2T_VITS, is_vit_family
from vitcli.recipe.schema import ModelConfig

# what an exported MAE encoder's card says of running it
MAE_USE = ("`config.mask_ratio` is 0.0, so every patch is kept (transformers' default, 0.75, masks at "
           "inference too); the tokens still come in a random order unless `noise` is passed: "
           "`ViTMAEModel.from_pretrained(DIR)(pixel_values, noise=torch.arange(N).expand(B, N))` keeps the "
           "image's order (N patches), or put them back with the output's `ids_restore`. "
           "`last_hidden_state` is (B, 1 + N, D), the class token first, after the final LayerNorm.")
# transformers' processor that runs timm's eval transform (needs timm where it is loaded)
PROCESSOR = "TimmWrapperImageProcessor"
# data.interpolation -> PIL.Image.Resampling, as BitImageProcessor stores `resample` (0: its
# torchvision backend's nearest-exact)
PIL_RESAMPLE = {"nearest": 0, "bilinear": 2, "bicubic": 3}


def is_mae_encoder(loaded: Loaded, num_classes: int) -> bool:
    """A headless MAE encoder, which goes to ViTMAEModel: one of MAE's .pth files, or our run whose
    recipe's objective is mae (its model.safetensors holds the encoder, the decoder stays in the
    training state)."""
    recipe = loaded.meta.get("recipe") if loaded.kind == "vitcli" else None
    ours = isinstance(recipe, dict) and recipe.get("objective") == "mae"
    return num_classes == 0 and (loaded.kind == "mae" or ours)


def check_hf(model: ModelConfig, num_classes: int, path: str, mae: bool = False) -> None:
    """A CheckpointError naming the first feature ViTForImageClassification (with `mae`,
    ViTMAEModel) cannot hold."""
    why = _unsupported(model, num_classes, mae)
    if why:
        formats = "onnx" if timm_refusal(model) else "onnx or timm"  # only formats that take it
        target = "ViTMAEModel" if mae else "ViTForImageClassification"
        raise CheckpointError(f"{path}: {why}, which transformers' {target} cannot hold; "
                              f"export it with --format {formats}")


def _unsupported(model: ModelConfig, num_classes: int, mae: bool = False) -> str:
    """What of the network has no place in ViTForImageClassification, or ViTMAEModel for a headless
    MAE encoder (`mae`: its table is loaded as it is, so a fixed sin-cos one fits); "" when it all
    fits."""
    if model.name in T2T_VITS:
        return f"a {model.name} (Tokens-to-Token embedding)"
    if model.name == HYBRID:
        return "a hybrid (ResNet feature map as patches)"
    if not is_vit_family(model.name):
        return f"a timm '{model.name}' network"
    if model.pool != "token":
        return f"a {model.pool}-pooled model (model.pool: {model.pool}; the classifier reads the class token)"
    if model.pos_embed not in (("learned_1d", "sincos_2d") if mae else ("learned_1d",)):
        return f"a {model.pos_embed} position embedding (model.pos_embed)"
    if model.representation_size:
        return f"a pre-logits layer (model.representation_size: {model.representation_size})"
    if not num_classes and not mae:
        return ("no classification head (masked patch prediction or headless: transformers would attach a "
                "random classifier; fine-tune it first)")
    return ""


def hf_state_dict(sd: dict[str, torch.Tensor], depth: int) -> dict[str, torch.Tensor]:
    """timm names -> ViTForImageClassification names; every tensor is used once, none is left
    over."""
    out = {TOP_NAMES[k]: v for k, v in sd.items() if k in TOP_NAMES}
    for i in range(depth):
        src, dst = f"blocks.{i}.", f"vit.encoder.layer.{i}."
        for part in ("weight", "bias"):
            # weight (3D, D) -> 3 x (D, D), bias (3D,) -> 3 x (D,): rows are query, key, value in
            # timm's qkv
            q, k, v = sd[f"{src}attn.qkv.{part}"].chunk(3, dim=0)
            for name, t in (("query", q), ("key", k), ("value", v)):
                out[f"{dst}attention.attention.{name}.{part}"] = t
            out.update({f"{dst}{new}.{part}": sd[f"{src}{old}.{part}"] for old, new in BLOCK_NAMES.items()})
    used = set(TOP_NAMES) | {f"blocks.{i}.{n}.{p}" for i in range(depth) for n in [*BLOCK_NAMES, "attn.qkv"]
                             for p in ("weight", "bias")}
    left = sorted(set(sd) - used)
    if left:
        raise CheckpointError(f"tensors with no place in ViTForImageClassification: {', '.join(left[:3])}")
    return {k: v.contiguous() for k, v in out.items()}


def hf_config(model: ModelConfig, class_names: list[str]) -> dict:
    """config.json of a ViTForImageClassification with these sizes and labels."""
    return {
        "architectures": ["ViTForImageClassification"], "model_type": "vit",
        "hidden_size": model.embed_dim, "num_hidden_layers": model.depth,
        "num_attention_heads": model.num_heads, "intermediate_size": model.mlp_dim,
        "image_size": model.img_size, "patch_size": model.patch_size, "num_channels": 3, "qkv_bias": True,
        "hidden_act": "gelu",  # exact erf GELU, as timm's nn.GELU; "gelu_new" would be the tanh one
        "layer_norm_eps": model.layer_norm_eps,
        "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
        "id2label": {str(i): name for i, name in enumerate(class_names)},
        "label2id": {name: i for i, name in enumerate(class_names)},
    }


def hf_mae_config(model: ModelConfig) -> dict:
    """config.json of a ViTMAEModel holding this encoder, every patch kept (mask_ratio 0.0)."""
    return {
        "architectures": ["ViTMAEModel"], "model_type": "vit_mae",
        "hidden_size": model.embed_dim, "num_hidden_layers": model.depth,
        "num_attention_heads": model.num_heads, "intermediate_size": model.mlp_dim,
        "image_size": model.img_size, "patch_size": model.patch_size, "num_channels": 3, "qkv_bias": True,
        "hidden_act": "gelu", "layer_norm_eps": model.layer_norm_eps,  # MAE's 1e-6, as timm's
        "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
        # transformers' default 0.75 drops three patches in four at inference too
        "mask_ratio": 0.0,
    }


def hf_processor_config(prep: dict) -> dict:
    """preprocessor_config.json of our eval transform: shorter side (crop_mode squash: both sides)
    to floor(size / crop_pct) (data.interpolation), centre crop, (x / 255 - mean) / std.

    transformers' own processors floor the crop's offset, (H - S) // 2, where torchvision's
    CenterCrop (ours, timm's) rounds half to even: one pixel further whenever the margin is 3 mod 4
    (a 640 x 427 photograph at 224: margin 111, offsets 55 and 56; up to 193 levels apart on
    scikit-image's photographs). So BitImageProcessor only where no margin can be 3 mod 4 (squash:
    both margins are floor(size / crop_pct) - size); its torchvision backend resizes as ours does,
    bit for bit. Elsewhere `TimmWrapperImageProcessor`, which runs timm's eval transform of a
    pretrained_cfg (hf_processor_in_config: config.json holds it too) and crops as ours does; it
    resizes with PIL, a level or two of rounding from torchvision's tensor resize. But nearest:
    PIL's nearest picks other pixels than torchvision's nearest-exact (ours, and transformers'
    torchvision backend), so BitImageProcessor, and processor_mismatch says where it is off.
    """
    if _crop_exact(prep) or prep["interpolation"] == "nearest":
        return _bit(prep)
    size = prep["size"]
    cfg = {"input_size": [3, size, size], "interpolation": prep["interpolation"],
           "mean": list(prep["mean"]), "std": list(prep["std"]), "crop_pct": prep["crop_pct"],
           "crop_mode": prep["crop_mode"]}
    return {"image_processor_type": PROCESSOR, "pretrained_cfg": cfg}


def hf_processor_in_config(processor: dict) -> dict:
    """What config.json repeats of the processor: a local folder's AutoImageProcessor reads
    TimmWrapperImageProcessor's pretrained_cfg there (a Hub repository's, from
    preprocessor_config.json); {} for BitImageProcessor."""
    return processor if processor["image_processor_type"] == PROCESSOR else {}


def processor_mismatch(prep: dict) -> str:
    """One line naming the setting where no processor of transformers' gives our pixels; "" where
    the one written does (within the resize rounding)."""
    if prep["interpolation"] != "nearest" or _crop_exact(prep):
        return ""
    return (f"data.interpolation nearest, data.eval_crop_mode {prep['crop_mode']}: transformers' "
            "processors floor the centre crop's offset where vit rounds it half to even, so images "
            "whose crop margin is 3 mod 4 come out one pixel shifted (timm's processor, which "
            "crops as vit does, resizes with PIL's nearest, further off); BitImageProcessor "
            "written")


def _crop_exact(prep: dict) -> bool:
    """transformers' floored crop offset is ours for every image: squashed, so both margins are
    resize_shorter_side - size, and that is not 3 mod 4."""
    return prep["crop_mode"] == "squash" and (prep["resize_shorter_side"] - prep["size"]) % 4 != 3


def _bit(prep: dict) -> dict:
    """BitImageProcessor (ViTImageProcessor can only squash to the model's size)."""
    side, size = prep["resize_shorter_side"], prep["size"]
    resized = {"shortest_edge": side} if prep["crop_mode"] == "center" else {"height": side,
                                                                             "width": side}
    return {"image_processor_type": "BitImageProcessor", "do_convert_rgb": True,
            "do_resize": True, "size": resized, "resample": PIL_RESAMPLE[prep["interpolation"]],
            "do_center_crop": True, "crop_size": {"height": size, "width": size},
            "do_rescale": True, "rescale_factor": 1 / 255,
            "do_normalize": True, "image_mean": list(prep["mean"]), "image_std": list(prep["std"])}
