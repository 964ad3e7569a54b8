"""Optimizer construction through timm, with the paper's no-decay set and, optionally, layer-wise lr
decay; DINOv2's parameter groups (dinov2_param_groups)."""

from __future__ import annotations

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
    """Names of parameters exempt from weight decay besides biases and norms (1-D tensors). None for
    a model that sets `decays_tokens` (MAE's pretraining network, models.mae.MaeModel): MAE's
    main_pretrain.py groups with timm's add_weight_decay and no skip list, so its cls_token and
    mask_token decay; its fixed position table is frozen, in no group."""
    if getattr(model, "decays_tokens", False):
        return set()
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
    own = getattr(model, "optimizer_groups", None)  # DINO's student: DINOv2's groups (dinov2_param_groups)
    if own is not None:
        groups = own(cfg.layer_decay, cfg.patch_embed_lr_scale)
        return [{**g, "weight_decay": wd * g["wd_scale"]} for g in groups]
    if cfg.layer_decay == 1:
        return param_groups_weight_decay(model, wd, no_weight_decay_list=no_decay)
    return param_groups_layer_decay(model, wd, no_weight_decay_list=no_decay, layer_decay=cfg.layer_decay)


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
