"""The model zoo: every family builds and runs, position tables match their formulas, heads behave
as the paper's transfer protocol needs, and plain ViTs stay interchangeable with timm's."""

import dataclasses
import json
import math

import numpy as np
import pytest
import timm
import torch
from timm.layers import GroupNormAct, HybridEmbed, StdConv2d, StdConv2dSame
from timm.models.vision_transformer import VisionTransformer

from vitcli.errors import ModelError
from vitcli.models.t2t import T2TViT
from vitcli.models.zoo import (
    build_model,
    model_spec,
    resolve_name,
    zero_head,
)
from vitcli.recipe.names import PAPER_VITS
from vitcli.recipe.schema import ModelConfig

K = 5
TINY = {"name": "custom", "img_size": 32, "patch_size": 8, "embed_dim": 32, "depth": 2, "num_heads": 2,
        "mlp_dim": 64}


def tiny(**overrides) -> ModelConfig:
    return ModelConfig(**{**TINY, **overrides})


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def images() -> torch.Tensor:
    return torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))


def shapes(model: torch.nn.Module) -> dict:
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


# ---------------------------------------------------------------- ViT family


@pytest.mark.parametrize("representation_size", [0, 24])
@pytest.mark.parametrize("pos_embed", ["learned_1d", "learned_2d", "sincos_2d", "none"])
@pytest.mark.parametrize("pool", ["token", "gap"])
def test_custom_vit_runs_every_pool_posemb_and_head(pool, pos_embed, representation_size, images):
    model = build_model(tiny(pool=pool, pos_embed=pos_embed, representation_size=representation_size), K)
    model.eval()
    prefix = 1 if pool == "token" else 0
    width = representation_size or 32
    assert model.num_prefix_tokens == prefix and model.patch_embed.grid_size == (4, 4)
    assert model.num_features == width
    feats = model.forward_features(images)
    assert feats.shape == (2, prefix + 16, 32)
    # pre-logits recomputed by hand: class token (already normed) or mean of patches then fc_norm
    pooled = feats[:, 0] if pool == "token" else model.fc_norm(feats.mean(dim=1))
    if representation_size:
        pooled = torch.tanh(pooled @ model.pre_logits.fc.weight.T + model.pre_logits.fc.bias)
    pre_logits = model.forward_head(feats, pre_logits=True)
    torch.testing.assert_close(pre_logits, pooled, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model(images), model.head(pre_logits), rtol=1e-5, atol=1e-6)
    model.reset_classifier(3)
    assert model(images).shape == (2, 3)


def test_head_bias_init_dropout_drop_path_and_exact_mlp_dim_are_honoured():
    cfg = tiny(embed_dim=48, num_heads=3, mlp_dim=100, head_bias_init=-10.0, dropout=0.1, drop_path=0.2,
               head_zero_init=False)
    model = build_model(cfg, K)
    assert torch.equal(model.head.bias, torch.full((K,), -10.0))
    assert model.head.weight.abs().sum() > 0  # timm's weight init is kept when asked
    assert model.blocks[0].mlp.fc1.out_features == 100  # 100 / 48 is not exact in floating point
    assert model.pos_drop.p == 0.1 and model.blocks[0].attn.proj_drop.p == 0.1
    assert model.blocks[-1].drop_path1.drop_prob == pytest.approx(0.2)  # linear rule ends at drop_path


@pytest.mark.parametrize("name", ["custom", "T2T-ViT-14", "BiT-R50x1"])
def test_pretraining_heads_start_with_a_zero_kernel_and_the_recipe_bias(name):
    # big_vision/vit_jax `head_zeroinit`: the first logits are the bias alone, for every family we
    # build
    cfg = tiny(name=name, img_size=32, head_bias_init=-10.0) if name == "custom" else ModelConfig(
        name=name, img_size=32, depth=1, head_bias_init=-10.0)
    head = build_model(cfg, K).get_classifier()
    assert head.weight.abs().max() == 0
    assert torch.equal(head.bias.flatten(), torch.full((K,), -10.0))
    random_head = build_model(dataclasses.replace(cfg, head_zero_init=False), K).get_classifier()
    assert random_head.weight.abs().max() > 0


def big_vision_sincos_2d(gh: int, gw: int, dim: int) -> np.ndarray:
    """posemb_sincos_2d written out entry by entry: [sin x, cos x, sin y, cos y],
    omega_k = 1e4^(-k/(D/4-1))."""
    q = dim // 4
    table = np.zeros((gh * gw, dim))
    for i in range(gh):
        for j in range(gw):
            for k in range(q):
                omega = 1.0 / 10_000 ** (k / (q - 1))
                table[i * gw + j, [k, q + k, 2 * q + k, 3 * q + k]] = [
                    math.sin(j * omega), math.cos(j * omega), math.sin(i * omega), math.cos(i * omega)]
    return table


@pytest.mark.parametrize("pool", ["token", "gap"])
def test_sincos_2d_is_frozen_in_timm_pos_embed_with_zero_class_row(pool, images):
    model = build_model(tiny(pool=pool, pos_embed="sincos_2d"), K)
    prefix = model.num_prefix_tokens
    table = torch.from_numpy(big_vision_sincos_2d(4, 4, 32)).float()
    assert model.pos_embed.shape == (1, prefix + 16, 32) and not model.pos_embed.requires_grad
    assert torch.equal(model.pos_embed[0, :prefix], torch.zeros(prefix, 32))
    torch.testing.assert_close(model.pos_embed[0, prefix:], table)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    model(images).square().sum().backward()
    opt.step()
    torch.testing.assert_close(model.pos_embed[0, prefix:], table)


def test_learned_2d_adds_row_and_column_tables_to_patches_only():
    model = build_model(tiny(pos_embed="learned_2d"), K).eval()
    assert model.pos_embed is None
    assert model.pos_embed_row.shape == (1, 4, 16) and model.pos_embed_col.shape == (1, 4, 16)
    out = model._pos_embed(torch.zeros(1, 16, 32))  # zero patches: what remains is the position embedding
    assert out.shape == (1, 17, 32)
    torch.testing.assert_close(out[0, 0], model.cls_token[0, 0])  # class token gets no position
    for i, j in [(0, 0), (1, 3), (3, 1), (2, 2)]:
        expected = torch.cat([model.pos_embed_row[0, i], model.pos_embed_col[0, j]])
        torch.testing.assert_close(out[0, 1 + i * 4 + j], expected)
    out.sum().backward()
    assert model.pos_embed_row.grad is not None and model.pos_embed_col.grad is not None
    assert {"pos_embed_row", "pos_embed_col"} <= model.no_weight_decay()


# ---------------------------------------------------------------- timm interop


@pytest.mark.parametrize("pool,pos_embed", [("token", "learned_1d"), ("gap", "learned_1d"),
                                            ("token", "sincos_2d"), ("token", "none")])
def test_state_dict_loads_strictly_into_timm_vision_transformer(pool, pos_embed, images):
    ours = build_model(tiny(pool=pool, pos_embed=pos_embed), K).eval()
    theirs = VisionTransformer(
        img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, mlp_ratio=2.0, num_classes=K,
        class_token=pool == "token", global_pool="token" if pool == "token" else "avg",
        fc_norm=False,  # gap normalises before pooling, as big_vision and timm's vit_*_gap_* models do
        pos_embed="none" if pos_embed == "none" else "learn").eval()
    theirs.load_state_dict(ours.state_dict(), strict=True)
    torch.testing.assert_close(theirs(images), ours(images), rtol=0, atol=0)


def test_gap_fc_norm_is_maes_fine_tune_network_and_timms_avg_pool_with_fc_norm(images):
    """pool gap_fc_norm: MAE's models_vit.py with global_pool=True, as timm builds it
    (class_token=True, global_pool='avg', fc_norm=True): a class token in the sequence, no final
    norm, the mean of the patch tokens alone through fc_norm, then the head. Same weights, logits
    within 1e-5 of both."""
    ours = build_model(tiny(pool="gap_fc_norm"), K).eval()
    with torch.no_grad():
        for p in ours.parameters():  # every weight random: timm's ones and zeros would hide mix-ups
            p.normal_(0, 0.5, generator=torch.Generator().manual_seed(p.numel()))
    theirs = timm.create_model("vit_base_patch16_224", pretrained=False, img_size=32, patch_size=8,
                               embed_dim=32, depth=2, num_heads=2, mlp_ratio=2.0, num_classes=K,
                               class_token=True, global_pool="avg", fc_norm=True).eval()
    theirs.load_state_dict(ours.state_dict(), strict=True)
    assert "cls_token" in ours.state_dict() and not any(k.startswith("norm.") for k in ours.state_dict())
    torch.testing.assert_close(ours(images), theirs(images), rtol=0, atol=1e-5)
    # MAE's forward_features, restated: cls token + patches, + pos_embed, blocks, x[:, 1:].mean,
    # fc_norm
    x = ours.patch_embed(images)  # (B, N, D)
    x = torch.cat([ours.cls_token.expand(len(x), -1, -1), x], dim=1) + ours.pos_embed  # (B, 1 + N, D)
    mae = ours.head(ours.fc_norm(ours.blocks(x)[:, 1:].mean(dim=1)))
    torch.testing.assert_close(ours(images), mae, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name,timm_name", [("ViT-B/16", "vit_base_patch16_224"),
                                            ("R50+ViT-B/16", "vit_base_r50_s16_224")])
def test_named_models_have_timm_state_dict_layout(name, timm_name):
    with torch.device("meta"):  # weightless: same keys and shapes means load_state_dict(strict=True) fits
        ours = build_model(ModelConfig(name=name, img_size=64), K)
        theirs = timm.create_model(timm_name, num_classes=K, img_size=64)
    assert shapes(ours) == shapes(theirs)


# ---------------------------------------------------------------- names


@pytest.mark.parametrize("name,timm_name", [
    ("ViT-Ti/16", "vit_tiny_patch16_224"), ("ViT-S/16", "vit_small_patch16_224"),
    ("ViT-B/32", "vit_base_patch32_224"), ("ViT-B/16", "vit_base_patch16_224"),
    ("ViT-L/32", "vit_large_patch32_224"), ("ViT-L/16", "vit_large_patch16_224"),
    ("ViT-H/14", "vit_huge_patch14_224")])
def test_resolve_fills_paper_sizes_that_agree_with_timm_registry(name, timm_name):
    paper, registered = ModelConfig(name=name.lower()), ModelConfig(name=timm_name)
    paper, registered = resolve_name(paper), resolve_name(registered)  # the latter read off timm's own model
    sizes = ("patch_size", "embed_dim", "depth", "num_heads", "mlp_dim")
    assert paper.name == name  # case-insensitive, canonicalised
    assert [getattr(paper, s) for s in sizes] == [getattr(registered, s) for s in sizes]
    assert [getattr(paper, s) for s in sizes] == list(PAPER_VITS[name])


@pytest.mark.parametrize("name,suggestion", [("ViT-B/61", "ViT-B/16"), ("T2T-ViT-41", "T2T-ViT-14"),
                                             ("vit_base_patch16_22", "vit_base_patch16_224")])
def test_unknown_name_suggests_the_closest(name, suggestion):
    with pytest.raises(ModelError, match=f"unknown model '{name}'.*'{suggestion}'"):
        build_model(ModelConfig(name=name), K)


def test_resolving_a_name_returns_a_new_config_and_leaves_the_given_one_alone():
    given = ModelConfig(name="vit-b/16", embed_dim=64)
    resolved = resolve_name(given)
    assert (given.name, given.embed_dim) == ("vit-b/16", 64)
    assert (resolved.name, resolved.embed_dim) == ("ViT-B/16", 768)


# ---------------------------------------------------------------- other families


def test_bit_r50x1_is_groupnorm_weight_standardised_resnet(images):
    cfg = resolve_name(ModelConfig(name="bit-r50x1", img_size=32))
    assert (cfg.name, cfg.pool, cfg.pos_embed) == ("BiT-R50x1", "gap", "none")
    model = build_model(cfg, K).eval()
    kinds = {type(m) for m in model.modules()}
    assert StdConv2d in kinds and GroupNormAct in kinds
    assert model.num_features == 2048
    assert model.forward_head(model.forward_features(images), pre_logits=True).shape == (2, 2048)
    zero_head(model, 3)
    assert torch.equal(model(images), torch.zeros(2, 3))


def test_r50_vit_b16_hybrid_runs_at_32px(images):
    model = build_model(ModelConfig(name="R50+ViT-B/16", img_size=32), K).eval()  # ~1.3 s on one thread
    assert isinstance(model.patch_embed, HybridEmbed)
    assert any(isinstance(m, StdConv2dSame) for m in model.patch_embed.backbone.modules())
    assert len(model.patch_embed.backbone.stages) == 3  # the paper's hybrid drops the 4th ResNet stage
    assert model.patch_embed.grid_size == (2, 2) and model.num_prefix_tokens == 1
    with torch.no_grad():
        assert model(images).shape == (2, K)


@pytest.mark.parametrize("name,pool", [("test_vit", "token"), ("test_resnet", "gap")])
def test_any_timm_name_builds_and_is_described_in_the_recipe(name, pool, images):
    cfg = resolve_name(ModelConfig(name=name, img_size=32))
    assert cfg.pool == pool
    model = build_model(cfg, K).eval()
    assert model(images).shape == (2, K)
    assert model.forward_head(model.forward_features(images), pre_logits=True).shape[1] == model.num_features


# ---------------------------------------------------------------- transfer surgery and specs


@pytest.mark.parametrize("model_fn", [
    lambda: build_model(tiny(representation_size=24), K),
    lambda: build_model(tiny(pool="gap", pos_embed="learned_2d"), K),
    lambda: T2TViT(img_size=32, num_classes=K, embed_dim=32, depth=1, num_heads=2, token_dim=16)])
def test_zero_head_gives_exactly_zero_logits(model_fn, images):
    model = model_fn()
    zero_head(model, 7)
    assert torch.equal(model(images), torch.zeros(2, 7))
    assert model.get_classifier().weight.shape == (7, model.num_features)


def rebuild(spec: dict):
    """The network a stored spec describes: every ModelConfig field and the class count are in
    it."""
    return build_model(ModelConfig(**{k: v for k, v in spec.items() if k != "num_classes"}),
                       spec["num_classes"])


@pytest.mark.parametrize("cfg", [tiny(pos_embed="learned_2d", representation_size=24),
                                 tiny(pool="gap", pos_embed="sincos_2d", dropout=0.1)], ids=["l2d", "sincos"])
def test_model_spec_round_trip_rebuilds_the_same_function(cfg, images):
    model = build_model(cfg, K).eval()
    spec = json.loads(json.dumps(model_spec(cfg, K)))
    rebuilt = rebuild(spec).eval()
    rebuilt.load_state_dict(model.state_dict(), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(images), model(images), rtol=0, atol=0)


@pytest.mark.parametrize("name", ["T2T-ViT-14", "T2T-ViT_t-14", "BiT-R50x1", "R50+ViT-B/16", "test_vit"])
def test_model_spec_round_trip_rebuilds_named_architectures(name):
    cfg = ModelConfig(name=name, img_size=64, representation_size=16 if name.startswith("T2T") else 0)
    with torch.device("meta"):  # layout only: the tiny ViTs above check the function
        model = build_model(cfg, K)
        rebuilt = rebuild(json.loads(json.dumps(model_spec(cfg, K))))
    assert shapes(rebuilt) == shapes(model)
    assert type(rebuilt) is type(model)


def test_model_spec_is_resolved_so_the_recipe_is_truthful():
    spec = model_spec(ModelConfig(name="ViT-L/16"), 10)
    assert (spec["embed_dim"], spec["depth"], spec["num_heads"], spec["num_classes"]) == (1024, 24, 16, 10)
    assert dataclasses.asdict(ModelConfig()).keys() == spec.keys()


def count_sdpa_calls(monkeypatch, model: torch.nn.Module, x: torch.Tensor) -> int:
    """How often a forward pass calls PyTorch's fused attention (looked up at call time, so
    patchable)."""
    real, calls = torch.nn.functional.scaled_dot_product_attention, []
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        model(x)
    return len(calls)


def test_vit_attention_runs_pytorch_sdpa(monkeypatch, images):
    # timm decides once at import (env TIMM_FUSED_ATTN=0 would turn it off); its per-block flag
    # follows
    assert timm.layers.use_fused_attn()
    model = build_model(tiny(), K).eval()
    attention = [m for m in model.modules() if isinstance(m, timm.layers.Attention)]
    assert len(attention) == TINY["depth"] and all(m.fused_attn for m in attention)
    assert count_sdpa_calls(monkeypatch, model, images) == TINY["depth"]  # one fused call per block
