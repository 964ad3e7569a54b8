"""Optimizer construction through timm, with the paper's no-decay set and, optionally, layer-wise lr
decay; DINOv2's parameter groups (dinov2_param_groups)."""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from timm.optim import create_optimizer_v2, param_groups_layer_decay, param_groups_weight_decay
from torch.distributed.tensor import DTensor

from vitcli.recipe.schema import OptimConfig

# Position tables and tokens carry no decay (the paper; timm's ViT.no_weight_decay() lists the same
# for its own names). The row/col tables of learned_2d and T2T's tables are ours, so we match by
# substring.
_NO_DECAY_NAMES = ("pos_embed", "cls_token", "reg_token", "dist_token")
# Devices with torch's fused (one kernel for the whole update) Adam/AdamW/SGD; timm's SGDW has only
# foreach (one kernel per operation over all tensors). Both replace a Python loop over ~150 tensors
# per step.
FUSED_DEVICES = ("cpu", "cuda", "xpu", "mps")
# The fused kernels that also run on FSDP2's sharded DTensors: torch 2.14 registers a sharding rule
# for aten._fused_adamw_ (and Adam's), none for aten._fused_sgd_ (NotImplementedError at the first
# step); the foreach ops have rules for all. Checked per pair by
# tests/integration/test_parallelize.py.
FUSED_ON_DTENSORS = ("adamw",)


def no_decay_names(model: torch.nn.Module) -> set[str]:
    """Names of parameters exempt from weight decay besides biases and norms (1-D tensors)."""
    names = set(getattr(model, "no_weight_decay", lambda: set())())
    names.update(n for n, _ in model.named_parameters() if any(k in n for k in _NO_DECAY_NAMES))
    return names


def torch_weight_decay(cfg: OptimConfig) -> float:
    """The `weight_decay` a torch optimizer needs to decay as `cfg` means.

    torch (AdamW, timm SGDW) decays by lr_t * wd each step, with lr_t = lr * s_t and s_t the
    schedule's multiplier; big_vision/optax by s_t * wd (its chain adds wd * p after scaling the
    update by lr and before the schedule). lr_t * (wd / lr) = s_t * wd, so dividing by the peak lr
    turns one into the other exactly.
    """
    return cfg.weight_decay / cfg.lr if cfg.weight_decay_convention == "big_vision" else cfg.weight_decay


def param_groups(model: torch.nn.Module, cfg: OptimConfig) -> list[dict]:
    """timm's parameter groups: weight decay on all but biases, norms and no_decay_names; with
    optim.layer_decay < 1, one group per layer and decay with its `lr_scale` (timm's
    param_groups_layer_decay, the layers vitcli.models.layer_decay describes), which
    vitcli.train.loop._set_lr multiplies the lr by."""
    wd, no_decay = torch_weight_decay(cfg), no_decay_names(model)
    if cfg.layer_decay == 1:
        return param_groups_weight_decay(model, wd, no_weight_decay_list=no_decay)
    return param_groups_layer_decay(model, wd, no_weight_decay_list=no_decay, layer_decay=cfg.layer_decay)


# DINOv2's layer 0 (dinov2/utils/param_groups.py get_vit_lr_decay_rate): the embeddings and tokens.
# timm names a ViT's register tokens reg_token, DinoVisionTransformer register_tokens (0.0.1.dev2
# has none; its main branch puts them in layer 0, as here)
_DINOV2_LAYER0 = ("pos_embed", "patch_embed", "mask_token", "cls_token", "register_tokens",
                  "reg_token")


def dinov2_scales(name: str, depth: int, layer_decay: float = 1.0, patch_embed_lr_scale: float = 1.0
                  ) -> tuple[float, float]:
    """(lr_scale, wd_scale) of the parameter `name` of a `depth`-block ViT, as DINOv2's
    get_params_groups_with_decay computes them (backbone names, as timm's VisionTransformer and
    DinoVisionTransformer spell them alike, a prefix such as `student.backbone.` stripped).

    Layer 0 the embeddings and tokens, i + 1 block i, depth + 1 the rest (the final norm; a head's
    parameters, none of these names, get lr_scale 1, as dinov2 gives its heads);
    lr_scale = layer_decay ** (depth + 1 - layer), times patch_embed_lr_scale for the patch
    embedding. wd_scale 0 for biases, norms and LayerScale's gamma, else 1: unlike
    optim.param_groups, the class and register tokens and the position table are decayed, as both
    DINO (its 1-D rule) and DINOv2 (its name rule) decay them.
    """
    if any(k in name for k in _DINOV2_LAYER0):
        layer = 0
    elif (block := re.search(r"(?:^|\.)blocks\.(\d+)\.", name)) and "residual." not in name:
        layer = int(block.group(1)) + 1
    else:
        layer = depth + 1
    lr_scale = layer_decay ** (depth + 1 - layer)
    if "patch_embed" in name:
        lr_scale *= patch_embed_lr_scale
    no_decay = name.endswith(".bias") or "norm" in name or "gamma" in name
    return lr_scale, 0.0 if no_decay else 1.0


def dinov2_param_groups(named_parameters: Iterable[tuple[str, torch.nn.Parameter]], depth: int,
                        layer_decay: float = 1.0, patch_embed_lr_scale: float = 1.0) -> list[dict]:
    """The trainable parameters grouped by dinov2_scales: [{"params", "lr_scale", "wd_scale"}], one
    group per distinct pair in first-seen order (dinov2's fuse_params_groups, without its
    is_last_layer split: DinoHead's frozen_last freezes the last layer instead of a zero lr).
    The loop multiplies each group's lr by lr_scale and its weight decay by wd_scale."""
    groups: dict[tuple[float, float], dict] = {}
    for name, param in named_parameters:
        if not param.requires_grad:
            continue
        lr_scale, wd_scale = dinov2_scales(name, depth, layer_decay, patch_embed_lr_scale)
        group = groups.setdefault((lr_scale, wd_scale),
                                  {"params": [], "lr_scale": lr_scale, "wd_scale": wd_scale})
        group["params"].append(param)
    return list(groups.values())


def step_kernel(opt: str, device: torch.device, sharded: bool = False) -> dict[str, bool]:
    """The fastest implementation torch offers for timm optimizer `opt` on `device`, for plain or
    `sharded` (DTensor) parameters: fused, else foreach."""
    fused = FUSED_ON_DTENSORS if sharded else ("adamw", "momentum")
    if opt in fused and device.type in FUSED_DEVICES:
        return {"fused": True}
    return {"foreach": True}


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig, fast: bool = True) -> torch.optim.Optimizer:
    """Adam with decoupled weight decay (torch AdamW semantics) or SGD with momentum (fine-tuning).

    SGD decays as torch.optim.SGD does (an L2 term in the gradient, through the momentum) under the
    torch convention; big_vision decouples it from the momentum, so that convention takes timm's
    SGDW. The step runs fused or foreach on the parameters' device and kind (step_kernel);
    `fast=False` is torch's per-tensor loop, the same update.
    """
    groups = param_groups(model, cfg)
    if cfg.name == "adamw":
        opt, kwargs = "adamw", {"betas": (cfg.beta1, cfg.beta2)}
    elif cfg.weight_decay_convention == "big_vision":
        opt, kwargs = "sgdw", {"momentum": cfg.momentum, "nesterov": False}
    else:
        # timm's "sgd" is Nesterov; the paper's fine-tuning uses plain momentum, which timm calls
        # "momentum"
        opt, kwargs = "momentum", {"momentum": cfg.momentum}
    param = next(model.parameters())
    kernel = step_kernel(opt, param.device, isinstance(param, DTensor)) if fast else {"foreach": False}
    return create_optimizer_v2(groups, opt=opt, lr=cfg.lr, **kwargs, **kernel)
