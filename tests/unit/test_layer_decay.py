"""optim.layer_decay: the parameter groups are timm's (`create_optimizer_v2(model,
layer_decay=...)`, itself param_groups_layer_decay) for our ViT, a DeiT and a hybrid; T2T-ViT
numbers its own layers; the schedule scales each group's lr and the fused step applies it."""

import functools

import pytest
import timm
import torch
import torch.nn.functional as F
from timm.layers import HybridEmbed, StdConv2dSame
from timm.models.resnetv2 import ResNetV2
from timm.optim import create_optimizer_v2

from vitcli.models import layer_decay
from vitcli.models.t2t import T2TViT
from vitcli.models.zoo import ViT, build_model
from vitcli.recipe.resolve import resolve
from vitcli.recipe.schema import ModelConfig, OptimConfig
from vitcli.train.loop import _set_lr
from vitcli.train.optim import build_optimizer
from vitcli.train.schedule import learning_rate

DECAY, WD = 0.65, 0.05
TINY = {"img_size": 32, "patch_size": 8, "embed_dim": 32, "depth": 3, "num_heads": 2, "mlp_dim": 64}
VIT = {"img_size": 32, "embed_dim": 32, "depth": 3, "num_heads": 2, "mlp_ratio": 2.0}


def tiny_hybrid() -> ViT:
    """Our ViT class on timm's HybridEmbed as zoo builds R50+ViT-B/16, over a one-unit BiT ResNet
    (tiny)."""
    backbone = ResNetV2(layers=(1,), channels=(128,), num_classes=0, global_pool="", preact=False,
                        stem_type="same", conv_layer=functools.partial(StdConv2dSame, eps=1e-8))
    return ViT(patch_size=1, embed_layer=functools.partial(HybridEmbed, backbone=backbone), num_classes=5,
               **VIT)


MODELS = {  # the models the groups are compared on, each a few thousand parameters
    "vit": lambda: build_model(ModelConfig(**TINY), 5),
    # gap, the 2-D learned table (ours: pos_embed_row/col) and a pre-logits layer in the head's
    # layer
    "vit_gap_2d": lambda: build_model(ModelConfig(**TINY, pool="gap", pos_embed="learned_2d",
                                                  representation_size=16), 5),
    # timm's DeiT with a distillation token and head
    "deit": lambda: timm.create_model("deit_tiny_distilled_patch16_224", patch_size=8, num_classes=5, **VIT),
    "hybrid": tiny_hybrid,
}


def named_groups(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[tuple]:
    """Each group as (its parameters' names, lr_scale, weight_decay), in the optimizer's order."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [(tuple(names[id(p)] for p in g["params"]), g["lr_scale"], g["weight_decay"])
            for g in optimizer.param_groups]


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("opt", ["adamw", "sgd"])
def test_parameter_groups_are_timms_layer_decay_groups(name, opt):
    model = MODELS[name]()
    cfg = OptimConfig(name=opt, weight_decay=WD, layer_decay=DECAY)
    ours = named_groups(model, build_optimizer(model, cfg))
    timm_opt = "adamw" if opt == "adamw" else "momentum"
    theirs = named_groups(model, create_optimizer_v2(model, timm_opt, lr=1e-3, weight_decay=WD,
                                                     layer_decay=DECAY))
    assert ours == theirs  # names, order, and scales and decay as exact floats
    depth = VIT["depth"]  # the embeddings, the blocks, the head: timm's ViT layers
    assert sorted({scale for _, scale, _ in ours}) == [DECAY ** (depth + 1 - i) for i in range(depth + 2)]


def t2t_layer(name: str, depth: int) -> int:
    """T2T-ViT's layers written out: tokens-to-token and class token 0, block i i + 1, the final
    norm with the last block, the head after it."""
    if name.startswith(("tokens_to_token.", "cls_token", "pos_embed")):
        return 0
    if name.startswith("blocks."):
        return int(name.split(".")[1]) + 1
    return depth if name.startswith("norm.") else depth + 1


@pytest.mark.parametrize("representation_size", [0, 8])
def test_t2t_vit_groups_its_own_layers_with_the_tokens_to_token_module_first(representation_size):
    depth = 2
    model = T2TViT(img_size=32, embed_dim=32, depth=depth, num_heads=2, token_dim=16,
                   representation_size=representation_size)
    groups = named_groups(model, build_optimizer(model, OptimConfig(weight_decay=WD, layer_decay=DECAY)))
    params = dict(model.named_parameters())
    for names, scale, decay in groups:
        for n in names:
            assert scale == DECAY ** (depth + 1 - t2t_layer(n, depth)), n
            assert decay == (0.0 if params[n].ndim <= 1 or n == "cls_token" else WD), n
    grouped = [n for names, _, _ in groups for n in names]
    assert sorted(grouped) == sorted(n for n, p in params.items() if p.requires_grad)  # frozen ones: none
    assert len({scale for _, scale, _ in groups}) == depth + 2


def test_off_is_one_group_per_decay_without_scales():
    model = MODELS["vit"]()
    groups = build_optimizer(model, OptimConfig(weight_decay=WD)).param_groups
    assert [g["weight_decay"] for g in groups] == [0.0, WD] and not any("lr_scale" in g for g in groups)


def test_the_table_row_gives_the_lr_multipliers_from_the_embeddings_to_the_head():
    model = MODELS["vit"]()
    low = DECAY ** (TINY["depth"] + 1)
    assert layer_decay.describe(model, DECAY) == (f"lr x {low:.2g} (embeddings) to 1 (head) over "
                                                  f"{TINY['depth'] + 2} layers, {DECAY} per layer")


@pytest.mark.parametrize("fused", [True, False])
def test_each_group_steps_at_the_schedules_lr_times_its_scale(fused):
    """Adam's first step moves a weight by lr * g / (|g| + eps), so by ~lr where the gradient is
    large: the largest move in each tensor is its group's lr, which the fused kernel (or the loop)
    read off the group."""
    torch.manual_seed(0)
    model = MODELS["vit"]()
    torch.nn.init.normal_(model.head.weight, std=0.02)  # zero-initialised: the blocks would get no gradient
    r = resolve("pretrain", None, ["schedule.steps=10", "schedule.warmup_steps=2", "optim.weight_decay=0",
                                   f"optim.layer_decay={DECAY}"])
    optimizer = build_optimizer(model, r.optim, fast=fused)
    assert optimizer.defaults.get("fused") is (True if fused else None)
    lr = _set_lr(optimizer, r, 4, 10)
    assert lr == learning_rate(4, peak_lr=r.optim.lr, total_steps=10, warmup_steps=2, decay=r.schedule.decay,
                               end_lr=r.schedule.end_lr)
    assert [g["lr"] for g in optimizer.param_groups] == [lr * g["lr_scale"] for g in optimizer.param_groups]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    F.cross_entropy(model(torch.randn(4, 3, 32, 32)), torch.arange(4)).backward()
    optimizer.step()
    names = {id(p): n for n, p in model.named_parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            moved = (p.detach() - before[names[id(p)]]).abs().max().item()
            assert moved == pytest.approx(group["lr"], rel=1e-3), names[id(p)]
