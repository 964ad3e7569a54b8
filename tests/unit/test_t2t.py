"""T2T-ViT as published (yitu-opensource/T2T-ViT, models/t2t_vit.py, token_performer.py,
token_transformer.py): the official state-dict layout, the official equations, the README's
parameter counts, and official checkpoints (torch.save pickles, read with weights_only=True)
reaching `vit finetune --init` / `vit eval-fewshot` as they are."""

import argparse
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from vitcli.checkpoints.complete import complete
from vitcli.checkpoints.describe import describe
from vitcli.checkpoints.read import Loaded, read_checkpoint
from vitcli.checkpoints.transfer import load_for_eval, load_init
from vitcli.errors import CheckpointError
from vitcli.models.t2t import T2TViT, sincos_1d_table
from vitcli.models.zoo import T2T_VITS, build_model, count_params, model_spec, resolve_name
from vitcli.recipe.resolve import resolve
from vitcli.recipe.schema import ModelConfig, OptimConfig
from vitcli.runtime import dist as dist_mod
from vitcli.train.optim import build_optimizer

K = 5
TINY = {"img_size": 32, "num_classes": K, "embed_dim": 32, "depth": 2, "num_heads": 2, "token_dim": 16}


pytestmark = pytest.mark.usefixtures("one_thread")


def shapes(model: torch.nn.Module) -> dict:
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


# ---------------------------------------------------------------- the official layout, from its
# source


def official_token_layer(prefix: str, mixer: str, dim: int, t: int) -> dict:
    """Token_performer(dim, in_dim=t) / Token_transformer(dim, in_dim=t, num_heads=1,
    mlp_ratio=1)."""
    if mixer == "performer":  # kqv, proj, norm1, norm2, mlp = Sequential(Linear, GELU, Linear, Dropout), w
        layer = {"kqv.weight": (3 * t, dim), "kqv.bias": (3 * t,), "proj.weight": (t, t), "proj.bias": (t,),
                 "norm1.weight": (dim,), "norm1.bias": (dim,), "norm2.weight": (t,), "norm2.bias": (t,),
                 "mlp.0.weight": (t, t), "mlp.0.bias": (t,), "mlp.2.weight": (t, t), "mlp.2.bias": (t,),
                 "w": (t // 2, t)}
    else:  # norm1, attn.qkv (no bias), attn.proj, norm2, mlp.fc1, mlp.fc2
        layer = {"norm1.weight": (dim,), "norm1.bias": (dim,), "attn.qkv.weight": (3 * t, dim),
                 "attn.proj.weight": (t, t), "attn.proj.bias": (t,), "norm2.weight": (t,), "norm2.bias": (t,),
                 "mlp.fc1.weight": (t, t), "mlp.fc1.bias": (t,), "mlp.fc2.weight": (t, t),
                 "mlp.fc2.bias": (t,)}
    return {f"{prefix}.{k}": v for k, v in layer.items()}


def official_shapes(mixer: str, dim: int, depth: int, mlp: int, classes: int, img: int, t: int = 64) -> dict:
    """Every key of the official T2T_ViT state dict with its shape."""
    out = {"cls_token": (1, 1, dim), "pos_embed": (1, 1 + (img // 16) ** 2, dim),
           **official_token_layer("tokens_to_token.attention1", mixer, 3 * 7 * 7, t),
           **official_token_layer("tokens_to_token.attention2", mixer, t * 3 * 3, t),
           "tokens_to_token.project.weight": (dim, t * 9), "tokens_to_token.project.bias": (dim,),
           "norm.weight": (dim,), "norm.bias": (dim,), "head.weight": (classes, dim), "head.bias": (classes,)}
    for i in range(depth):  # transformer_block.Block, qkv_bias=False
        out |= {f"blocks.{i}.norm1.weight": (dim,), f"blocks.{i}.norm1.bias": (dim,),
                f"blocks.{i}.attn.qkv.weight": (3 * dim, dim), f"blocks.{i}.attn.proj.weight": (dim, dim),
                f"blocks.{i}.attn.proj.bias": (dim,), f"blocks.{i}.norm2.weight": (dim,),
                f"blocks.{i}.norm2.bias": (dim,), f"blocks.{i}.mlp.fc1.weight": (mlp, dim),
                f"blocks.{i}.mlp.fc1.bias": (mlp,), f"blocks.{i}.mlp.fc2.weight": (dim, mlp),
                f"blocks.{i}.mlp.fc2.bias": (dim,)}
    return out


@pytest.mark.parametrize("name", list(T2T_VITS))
def test_named_models_have_exactly_the_official_state_dict(name):
    dim, depth, _, mlp, mixer = T2T_VITS[name]
    with torch.device("meta"):
        model = build_model(ModelConfig(name=name), 1000)
    assert shapes(model) == official_shapes(mixer, dim, depth, mlp, 1000, 224)


@pytest.mark.parametrize("mixer", ["performer", "transformer"])
def test_tiny_model_has_the_official_state_dict(mixer):
    model = T2TViT(**TINY, mixer=mixer)
    assert shapes(model) == official_shapes(mixer, 32, 2, 96, K, 32, t=16)


# README, "T2T-ViT Models" and the lite variants; T2T-ViT-24 to the three decimals of the official
# code's count
README_MILLIONS = {"T2T-ViT-7": "4.3", "T2T-ViT-10": "5.9", "T2T-ViT-12": "6.9", "T2T-ViT-14": "21.5",
                   "T2T-ViT-19": "39.2", "T2T-ViT-24": "64.106", "T2T-ViT_t-14": "21.5",
                   "T2T-ViT_t-19": "39.2", "T2T-ViT_t-24": "64.101"}


@pytest.mark.parametrize("name", list(README_MILLIONS))
def test_parameter_counts_are_the_official_ones(name):
    # counted as the official code counts: every Parameter, the frozen pos_embed and performer `w`
    # included
    with torch.device("meta"):
        model = build_model(ModelConfig(name=name), 1000)
    figure = README_MILLIONS[name]
    decimals = len(figure.split(".")[1])
    assert f"{count_params(model) / 1e6:.{decimals}f}" == figure


# ---------------------------------------------------------------- the official equations, written
# out


def ln(x, sd, p):
    return F.layer_norm(x, x.shape[-1:], sd[f"{p}.weight"], sd[f"{p}.bias"], eps=1e-5)


def linear(x, sd, p):
    return F.linear(x, sd[f"{p}.weight"], sd.get(f"{p}.bias"))


def official_sinusoid(n_position: int, d_hid: int) -> np.ndarray:
    """transformer_block.get_sinusoid_encoding: position / 10000^(2*(j//2)/d), sin on even j, cos on
    odd."""
    table = np.array([[pos / np.power(10000, 2 * (j // 2) / d_hid) for j in range(d_hid)]
                      for pos in range(n_position)])
    table[:, 0::2], table[:, 1::2] = np.sin(table[:, 0::2]), np.cos(table[:, 1::2])
    return table


def token_performer(x, sd, p):
    """Token_performer.forward: single_attn(norm1(x)), then + mlp(norm2(.)); k, q, v in that
    order."""
    x = ln(x, sd, f"{p}.norm1")
    emb, w = sd[f"{p}.proj.weight"].shape[0], sd[f"{p}.w"]
    k, q, v = torch.split(linear(x, sd, f"{p}.kqv"), emb, dim=-1)

    def prm_exp(z):  # exp(w^T z - |z|^2/2) / sqrt(m)
        xd = (z * z).sum(dim=-1, keepdim=True).repeat(1, 1, w.shape[0]) / 2
        return torch.exp(torch.einsum("bti,mi->btm", z, w) - xd) / math.sqrt(w.shape[0])

    kp, qp = prm_exp(k), prm_exp(q)
    d = torch.einsum("bti,bi->bt", qp, kp.sum(dim=1)).unsqueeze(dim=2)
    kptv = torch.einsum("bin,bim->bnm", v, kp)
    y = torch.einsum("bti,bni->btn", qp, kptv) / (d.repeat(1, 1, emb) + 1e-8)
    y = v + linear(y, sd, f"{p}.proj")
    return y + linear(F.gelu(linear(ln(y, sd, f"{p}.norm2"), sd, f"{p}.mlp.0")), sd, f"{p}.mlp.2")


def token_transformer(x, sd, p):
    """Token_transformer.forward with its one-head Attention: scale = (input width)^-0.5, v as
    residual."""
    x = ln(x, sd, f"{p}.norm1")
    q, k, v = linear(x, sd, f"{p}.attn.qkv").chunk(3, dim=-1)
    attn = ((q * x.shape[-1] ** -0.5) @ k.transpose(-2, -1)).softmax(dim=-1)
    y = v + linear(attn @ v, sd, f"{p}.attn.proj")
    return y + linear(F.gelu(linear(ln(y, sd, f"{p}.norm2"), sd, f"{p}.mlp.fc1")), sd, f"{p}.mlp.fc2")


def block(x, sd, p, heads):
    """transformer_block.Block: pre-norm multi-head attention and MLP, both residual."""
    b, n, c = x.shape
    qkv = linear(ln(x, sd, f"{p}.norm1"), sd, f"{p}.attn.qkv").reshape(b, n, 3, heads, c // heads)
    q, k, v = qkv.permute(2, 0, 3, 1, 4)
    attn = (q @ k.transpose(-2, -1) * (c // heads) ** -0.5).softmax(dim=-1)
    x = x + linear((attn @ v).transpose(1, 2).reshape(b, n, c), sd, f"{p}.attn.proj")
    return x + linear(F.gelu(linear(ln(x, sd, f"{p}.norm2"), sd, f"{p}.mlp.fc1")), sd, f"{p}.mlp.fc2")


def refold(tokens: torch.Tensor) -> torch.Tensor:
    """(B, side^2, C) -> (B, C, side, side), as T2T_module.forward reshapes between soft splits."""
    side = math.isqrt(tokens.shape[1])
    return tokens.transpose(1, 2).reshape(tokens.shape[0], -1, side, side)


def reference_logits(sd: dict, images: torch.Tensor, mixer: str, heads: int) -> torch.Tensor:
    """T2T_ViT.forward from the state dict: soft splits, token layers, project, class token, blocks,
    head."""
    token_layer = token_performer if mixer == "performer" else token_transformer
    x = F.unfold(images, 7, padding=2, stride=4).transpose(1, 2)  # soft_split0
    x = token_layer(x, sd, "tokens_to_token.attention1")
    x = F.unfold(refold(x), 3, padding=1, stride=2).transpose(1, 2)  # soft_split1
    x = token_layer(x, sd, "tokens_to_token.attention2")
    x = F.unfold(refold(x), 3, padding=1, stride=2).transpose(1, 2)  # soft_split2
    x = linear(x, sd, "tokens_to_token.project")
    x = torch.cat([sd["cls_token"].expand(x.shape[0], -1, -1), x], dim=1)
    x = x + torch.from_numpy(official_sinusoid(x.shape[1], x.shape[2])).to(x)[None]
    depth = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("blocks."))
    for i in range(depth):
        x = block(x, sd, f"blocks.{i}", heads)
    return linear(ln(x, sd, "norm")[:, 0], sd, "head")


def randomise(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Weights of order-one effect everywhere (the trained regime), so a wrong equation shows in the
    logits.

    Frozen tensors (pos_embed, the performer's `w`) stay as built: the reference recomputes the
    table."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            noise = torch.randn(p.shape, generator=g, dtype=p.dtype)
            if p.ndim == 2:
                p.copy_(noise / math.sqrt(p.shape[1]))  # (out, in): unit-variance outputs
            else:  # LayerNorm scales near 1, biases (and the class token) near 0
                is_scale = name.endswith(".weight") and name.rsplit(".", 2)[-2].startswith("norm")
                p.copy_(float(is_scale) + 0.1 * noise)
    return model


@pytest.mark.parametrize("mixer", ["performer", "transformer"])
def test_tiny_model_equals_the_official_equations(mixer):
    model = randomise(T2TViT(**TINY, mixer=mixer)).double().eval()
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with torch.no_grad():
        ours, ref = model(images), reference_logits(model.state_dict(), images, mixer, heads=2)
    assert ref.abs().max() > 0.1  # logits far from zero: the comparison below means something
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["T2T-ViT-14", "T2T-ViT_t-14"])
def test_full_size_model_at_224_equals_the_official_equations(name):
    # ~0.4 s per forward on one thread in float32
    model = randomise(build_model(ModelConfig(name=name), 1000)).eval()
    images = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = model(images)
        ref = reference_logits(model.state_dict(), images, T2T_VITS[name][4], heads=T2T_VITS[name][2])
    assert ref.abs().max() > 0.1
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)


def test_pos_embed_is_the_fixed_sinusoid_and_performer_w_is_frozen_and_never_optimised():
    model = T2TViT(**TINY)
    expected = official_sinusoid(5, 32)  # class token + 2x2 patches
    np.testing.assert_allclose(model.pos_embed[0].detach().numpy(), expected, atol=1e-6)
    np.testing.assert_allclose(sincos_1d_table(5, 32).numpy(), expected, atol=1e-6)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {"pos_embed", "tokens_to_token.attention1.w", "tokens_to_token.attention2.w"}
    w = model.tokens_to_token.attention1.w  # (m, d) = (8, 16): orthogonal rows of norm sqrt(m)
    torch.testing.assert_close(w @ w.T, 8 * torch.eye(8), rtol=0, atol=1e-5)
    optimised = {id(p) for group in build_optimizer(model, OptimConfig()).param_groups
                 for p in group["params"]}
    names = {n for n, p in model.named_parameters() if id(p) in optimised}
    assert names == {n for n, p in model.named_parameters()} - frozen


# ---------------------------------------------------------------- names, extras and the recipe


def test_names_set_official_sizes_and_aliases_resolve_case_insensitively():
    for name, (dim, depth, heads, mlp, _) in T2T_VITS.items():
        cfg = resolve_name(ModelConfig(name=name.upper()))
        assert cfg.name == name
        assert (cfg.embed_dim, cfg.depth, cfg.num_heads, cfg.mlp_dim) == (dim, depth, heads, mlp)
        assert cfg.patch_size == 16 and cfg.pos_embed == "sincos_1d"
    aliases = {"t2t_vit_14": "T2T-ViT-14", "T2T_VIT_T_24": "T2T-ViT_t-24", "t2t_vit_7": "T2T-ViT-7"}
    assert {a: resolve_name(ModelConfig(name=a)).name for a in aliases} == aliases


@pytest.mark.parametrize("name", ["T2T-ViT-14", "T2T-ViT_t-14"])
def test_saved_spec_rebuilds_the_same_token_mixer(name):
    spec = model_spec(ModelConfig(name=name, img_size=64), K)
    with torch.device("meta"):
        rebuilt = build_model(ModelConfig(**{k: v for k, v in spec.items() if k != "num_classes"}), K)
    assert spec["name"] == name
    assert rebuilt.patch_embed.mixer == T2T_VITS[name][4]


def test_gap_and_representation_extras_still_work():
    images = torch.randn(2, 3, 64, 64)
    model = T2TViT(**{**TINY, "img_size": 64}, class_token=False, representation_size=8).eval()
    assert model.num_prefix_tokens == 0 and "cls_token" not in model.state_dict()
    assert model.patch_embed.grid_size == (4, 4) and model.pos_embed.shape == (1, 16, 32)
    assert model.forward_features(images).shape == (2, 16, 32)  # effective patch 16
    assert model.forward_head(model.forward_features(images), pre_logits=True).shape == (2, 8)
    assert model(images).shape == (2, K)


# ---------------------------------------------------------------- official checkpoints


@pytest.mark.parametrize("name,img", [("T2T-ViT-7", 224), ("T2T-ViT_t-14", 384), ("T2T-ViT-24", 224)])
def test_official_state_dict_describes_itself_as_its_t2t_model(name, img):
    with torch.device("meta"):
        sd = build_model(ModelConfig(name=name, img_size=img), 1000).state_dict()
    spec = describe(Loaded(sd, {}, "timm", "official.safetensors"))
    dim, depth, heads, mlp, _ = T2T_VITS[name]
    assert spec.architecture() == {
        "name": name, "patch_size": 16, "embed_dim": dim, "depth": depth, "num_heads": heads, "mlp_dim": mlp,
        "pool": "token", "pos_embed": "sincos_1d", "representation_size": 0, "layer_norm_eps": 1e-6}
    assert (spec.grid, spec.img_size, spec.num_prefix_tokens, spec.num_classes) == (
        (img // 16,) * 2, img, 1, 1000)
    assert name in spec.heads_from


def test_t2t_state_dict_of_unknown_size_is_named_in_the_error():
    sd = T2TViT(**TINY).state_dict()
    with pytest.raises(CheckpointError,
                       match=r"odd\.safetensors: a T2T-ViT \(performer.*width 32 and depth 2"):
        describe(Loaded(sd, {}, "timm", "odd.safetensors"))


@pytest.fixture
def official_pickle(tmp_path):
    """An official-format T2T-ViT-7 training checkpoint: EMA and raw weights under DDP names, plus
    `args`."""
    model = randomise(build_model(ModelConfig(name="T2T-ViT-7", img_size=32), 1000)).eval()
    ema = {f"module.{k}": v for k, v in model.state_dict().items()}
    raw = {k: v + 1 for k, v in ema.items()}  # not the weights to use: the official transfer code takes EMA
    path = tmp_path / "71.7_T2T_ViT_7.pth.tar"
    torch.save({"epoch": 310, "arch": "t2t_vit_7", "state_dict": raw, "state_dict_ema": ema,
                "args": argparse.Namespace(model="t2t_vit_7", img_size=224)}, path)
    return path, model


def test_an_official_checkpoint_loads_strictly_for_eval_and_finetune(official_pickle):
    """The .pth.tar is read as it is (weights_only=True, its argparse.Namespace allowed): the EMA
    weights, DDP's module. prefix stripped, the rest said unused."""
    path, model = official_pickle
    out = str(path)
    loaded = read_checkpoint(out)
    assert loaded.kind == "torch"
    assert loaded.dropped == ("not used: epoch, arch, state_dict, args (argparse.Namespace)",)
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))

    recipe = resolve("eval-fewshot", None, [f"init.checkpoint={out}"], complete=complete, inputs=False)
    assert (recipe.model.name, recipe.model.img_size) == ("T2T-ViT-7", 32)  # read off the official tensors
    ours = load_for_eval(recipe)  # strict load inside
    with torch.no_grad():
        expected = model.forward_head(model.forward_features(images), pre_logits=True)
        torch.testing.assert_close(ours(images), expected, rtol=0, atol=0)

    recipe = resolve("finetune", None, [f"init.checkpoint={out}", "model.img_size=32"], complete=complete,
                     inputs=False)
    tuned = build_model(recipe.model, 3)
    rows = dict(load_init(tuned, recipe, 3, dist_mod.setup("cpu")))  # strict load inside
    assert "T2T-ViT-7" in rows["architecture"]
    assert torch.equal(tuned.tokens_to_token.attention1.w, model.tokens_to_token.attention1.w)
    assert torch.equal(tuned.blocks[6].mlp.fc2.weight, model.blocks[6].mlp.fc2.weight)


def test_every_attention_runs_pytorch_sdpa(monkeypatch):
    # the two token transformers (tokens-to-token) and every backbone block: one fused call each
    model = T2TViT(**TINY, mixer="transformer").eval()
    real, calls = F.scaled_dot_product_attention, []
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        model(torch.randn(1, 3, 32, 32))
    assert len(calls) == 2 + TINY["depth"]
