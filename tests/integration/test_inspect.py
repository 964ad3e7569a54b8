"""`vit inspect`: the paper's Figure 7 maths against direct computations, and the command on real
files.

Attention distances are checked against brute-force double loops over patch centres written here,
position similarities against a per-pair cosine, filter components against an eigen-decomposition of
the covariance, and the per-patch position tables against what the model itself adds to its tokens.
"""

import functools
import json
import math

import numpy as np
import pytest
import timm
import torch
from PIL import Image
from safetensors.torch import save_file
from timm.layers import HybridEmbed
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from helpers import export_npz, run_vit, tiny_vit
from vitcli.checkpoints.weights import save_weights
from vitcli.figures import figure7
from vitcli.models.t2t import T2TViT
from vitcli.models.zoo import ViT, build_model, model_spec
from vitcli.recipe.layers import to_dict
from vitcli.recipe.schema import ModelConfig, Recipe
from vitcli.runtime.run_files import MODEL_FILE
from vitcli.stages.inspect import (
    attention_probabilities,
    mean_attention_distances,
    pixel_filters,
    position_table,
)

TINY = {"img_size": 32, "patch_size": 4, "embed_dim": 32, "depth": 2, "num_heads": 2, "mlp_dim": 64}
TOL = 1e-9  # float64 maths on both sides


def centres(grid, cell):
    """Patch centres in pixels, row-major, written out by hand."""
    return [((y + 0.5) * cell, (x + 0.5) * cell) for y in range(grid[0]) for x in range(grid[1])]


def brute_force_distance(attn, grid, cell, prefix):
    """Per (image, head): mean over query patches of sum over key patches of renormalised weight x
    distance."""
    c = centres(grid, cell)
    n = len(c)
    out = np.zeros(attn.shape[:2])
    for b in range(attn.shape[0]):
        for h in range(attn.shape[1]):
            total = 0.0
            for i in range(n):
                weights = [float(attn[b, h, prefix + i, prefix + j]) for j in range(n)]
                norm = sum(weights)
                total += sum(w / norm * math.dist(c[i], c[j]) for j, w in enumerate(weights))
            out[b, h] = total / n
    return out


# ---------------------------------------------------------------- attention distance


def test_a_head_attending_only_to_itself_has_distance_zero():
    grid, prefix = (3, 4), 1
    attn = torch.eye(prefix + 12).expand(2, 3, -1, -1)  # (B, heads, T, T)
    got = figure7.attention_distance(attn, figure7.patch_distances(grid, 8.0), prefix)
    assert got.shape == (2, 3)
    assert torch.allclose(got, torch.zeros(2, 3, dtype=torch.float64), atol=TOL)


@pytest.mark.parametrize("prefix", [0, 1])
def test_uniform_attention_is_the_mean_pairwise_patch_distance(prefix):
    grid, cell = (3, 4), 8.0
    attn = torch.full((1, 2, prefix + 12, prefix + 12), 1 / (prefix + 12))  # the class token's share dropped
    got = figure7.attention_distance(attn, figure7.patch_distances(grid, cell), prefix)
    c = centres(grid, cell)
    expected = sum(math.dist(p, q) for p in c for q in c) / len(c) ** 2
    assert torch.allclose(got, torch.full((1, 2), expected, dtype=torch.float64), atol=TOL)


def test_the_uniform_line_is_what_uniform_attention_measures():
    grid, cell = (3, 4), 8.0
    distances = figure7.patch_distances(grid, cell)
    attn = torch.full((1, 1, 12, 12), 1 / 12)
    assert figure7.uniform_distance(distances) == pytest.approx(
        float(figure7.attention_distance(attn, distances, 0)), abs=TOL)
    fig = figure7.distance_figure(np.full((2, 3), 5.0), 32, "t", figure7.uniform_distance(distances))
    line = fig.axes[0].get_lines()[-1]
    assert list(line.get_ydata()) == pytest.approx([figure7.uniform_distance(distances)] * 2)
    assert "uniform attention" in line.get_label()
    assert "uniform attention" in [t.get_text() for t in fig.axes[0].get_legend().get_texts()][-1]


def test_the_filter_figure_says_how_much_variance_each_component_explains():
    kernel = np.random.default_rng(0).normal(size=(16, 3, 4, 4))
    comps, explained = figure7.filter_components(kernel, k=5)
    ax = figure7.filters_figure(comps, explained, "x").axes[0]
    assert [t.get_text() for t in ax.texts] == [f"{100 * v:.1f}%" for v in explained]
    assert f"explain {100 * explained.sum():.0f}%" in ax.get_title()


def test_any_attention_matches_the_brute_force_weighted_sum():
    grid, cell, prefix = (2, 3), 16.0, 1
    attn = torch.randn(2, 3, prefix + 6, prefix + 6, generator=torch.Generator().manual_seed(0)).softmax(-1)
    got = figure7.attention_distance(attn, figure7.patch_distances(grid, cell), prefix)
    np.testing.assert_allclose(got.numpy(), brute_force_distance(attn, grid, cell, prefix), atol=1e-6)


def test_the_attention_read_from_timm_blocks_is_the_softmax_the_block_uses():
    model = build_model(ModelConfig(**TINY), 0).eval()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        fused_out = model(x)
        seen = {}
        with attention_probabilities(model.blocks, lambda layer, p: seen.setdefault(layer, p.clone())):
            hooked_out = model(x)
    assert sorted(seen) == [0, 1] and seen[0].shape == (2, 2, 65, 65)  # (B, heads, 1 + 8*8, 1 + 8*8)
    assert torch.allclose(seen[0].sum(-1), torch.ones(2, 2, 65), atol=1e-5)
    assert torch.allclose(hooked_out, fused_out, atol=1e-5)  # the same network, just unfused
    # recomputed by hand from the first block's qkv: softmax(q k^T / sqrt(d))
    block = model.blocks[0]
    with torch.no_grad():
        tokens = block.norm1(model._pos_embed(model.patch_embed(x)))
        q, k, _ = block.attn.qkv(tokens).reshape(2, 65, 3, 2, 16).permute(2, 0, 3, 1, 4)
        expected = (q @ k.transpose(-2, -1) / 4.0).softmax(-1)
    assert torch.allclose(seen[0], expected, atol=1e-5)
    assert all(b.attn.fused_attn == timm.layers.use_fused_attn() for b in model.blocks), "restored afterwards"


def test_mean_distances_over_a_stream_average_per_image_values():
    model = build_model(ModelConfig(**TINY), 0).eval()
    xs = [torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(s)) for s in (0, 1)]
    got, seen = mean_attention_distances(model, [(x, None) for x in xs], (8, 8), 4.0, torch.device("cpu"))
    per_image = []
    with torch.no_grad(), attention_probabilities(model.blocks,
                                                  lambda i, p: per_image.append((i, p.clone()))):
        model(torch.cat(xs))
    distances = figure7.patch_distances((8, 8), 4.0)
    expected = np.stack([figure7.attention_distance(p, distances, 1).mean(0).numpy()  # over all 6 images
                         for _, p in sorted(per_image, key=lambda t: t[0])])
    assert seen == 6 and got.shape == (2, 2)
    np.testing.assert_allclose(got, expected, atol=1e-6)


# ---------------------------------------------------------------- position tables


def test_position_similarity_is_the_cosine_of_every_pair():
    grid = (3, 4)
    table = np.random.default_rng(0).standard_normal((12, 10))
    maps = figure7.cosine_maps(table, grid)
    assert maps.shape == (3, 4, 3, 4)
    for i in range(12):
        for j in range(12):
            cosine = table[i] @ table[j] / (np.linalg.norm(table[i]) * np.linalg.norm(table[j]))
            assert maps[i // 4, i % 4, j // 4, j % 4] == pytest.approx(cosine, abs=TOL)


def test_learned_2d_tables_concatenate_row_and_column():
    model = build_model(ModelConfig(**TINY, pos_embed="learned_2d"), 0)
    with torch.no_grad():  # a 3x5 grid: the row and column tables of other lengths
        model.patch_embed.grid_size = (3, 5)
        model.pos_embed_row = torch.nn.Parameter(torch.randn(1, 3, 16))
        model.pos_embed_col = torch.nn.Parameter(torch.randn(1, 5, 16))
    row, col = model.pos_embed_row[0].detach().numpy(), model.pos_embed_col[0].detach().numpy()
    table = position_table(model, (3, 5))
    assert table.shape == (15, 32)
    for y in range(3):
        for x in range(5):
            np.testing.assert_array_equal(table[y * 5 + x], np.concatenate([row[y], col[x]]))


@pytest.mark.parametrize("pos_embed, pool", [("learned_1d", "token"), ("learned_2d", "token"),
                                             ("sincos_2d", "token"), ("learned_1d", "gap")])
def test_the_patch_table_is_what_the_model_adds_to_its_patches(pos_embed, pool):
    model = build_model(ModelConfig(**TINY, pos_embed=pos_embed, pool=pool), 0).eval()
    with torch.no_grad():
        added = model._pos_embed(torch.zeros(1, 64, 32))[0, model.num_prefix_tokens:]  # (N, D): patches only
    np.testing.assert_allclose(position_table(model, (8, 8)), added.numpy(), atol=1e-7)


def test_a_model_without_a_position_table_has_none():
    model = build_model(ModelConfig(**TINY, pos_embed="none"), 0)
    assert position_table(model, (8, 8)) is None


def test_a_table_shorter_than_the_grid_is_an_error():
    with pytest.raises(Exception, match="fewer than the 3x3"):
        figure7.patch_table((3, 3), np.zeros((5, 4)))


# ---------------------------------------------------------------- patch filters


def test_filter_components_are_the_covariance_eigenvectors():
    kernel = np.random.default_rng(0).standard_normal((40, 3, 2, 2))  # D=40 filters of 12 numbers
    comps, explained = figure7.filter_components(kernel, k=5)
    flat = kernel.reshape(40, -1)
    eigvals, eigvecs = np.linalg.eigh(np.cov(flat, rowvar=False))  # ascending
    order = np.argsort(eigvals)[::-1][:5]
    for c, v in zip(comps.reshape(5, -1), eigvecs[:, order].T):
        assert abs(c @ v) == pytest.approx(1.0, abs=1e-9)  # same direction up to sign
    np.testing.assert_allclose(explained, eigvals[order] / eigvals.sum(), atol=1e-12)


def test_components_are_capped_by_the_filter_count_and_scaled_to_rgb():
    comps, _ = figure7.filter_components(np.random.default_rng(1).standard_normal((6, 3, 4, 4)))
    assert comps.shape == (6, 3, 4, 4)  # fewer filters than 28
    image = figure7.to_rgb(comps[0])
    assert image.shape == (4, 4, 3) and image.min() == 0.0 and image.max() == pytest.approx(1.0)


def test_hybrid_and_t2t_have_no_pixel_filters_and_say_why():
    t2t = T2TViT(img_size=32, num_classes=0, embed_dim=32, depth=1, num_heads=2, token_dim=8)
    kernel, why = pixel_filters(t2t)
    assert kernel is None and "T2T-ViT" in why
    embed = nn.Sequential(nn.Conv2d(3, 16, 4, stride=4))  # a stand-in ResNet: stride 4, 16 channels
    hybrid = VisionTransformer(img_size=32, patch_size=1, embed_dim=32, depth=1, num_heads=2, num_classes=0,
                               embed_layer=functools.partial(HybridEmbed, backbone=embed))
    kernel, why = pixel_filters(hybrid)
    assert kernel is None and "16-channel" in why and "hybrid" in why
    kernel, why = pixel_filters(ViT(img_size=32, patch_size=4, embed_dim=32, depth=1, num_heads=2))
    assert kernel.shape == (32, 3, 4, 4) and why == ""


# ---------------------------------------------------------------- the command


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Tiny checkpoints as the trainer writes them (ours), as timm and Google write them, and a
    CNN."""
    root = tmp_path_factory.mktemp("inspect")
    for kind in ("learned_1d", "learned_2d", "sincos_2d"):
        cfg = ModelConfig(**TINY, pos_embed=kind)
        torch.manual_seed(0)
        save_weights(root / kind / MODEL_FILE, build_model(cfg, 10).state_dict(),
                           {"recipe": to_dict(Recipe(model=cfg)), "model": model_spec(cfg, 10)})
    export_npz(tiny_vit(), root / "google.npz")  # 32 px, patch 8, 2 heads (told by the query kernels)
    save_file(tiny_vit().state_dict(), str(root / "timm.safetensors"))
    save_file(timm.create_model("test_resnet", num_classes=5).state_dict(), str(root / "resnet.safetensors"))
    return root


def test_inspect_writes_the_three_figures_and_prints_the_summary(ckpts, tmp_path, monkeypatch, capsys):
    code, out, err = run_vit(monkeypatch, capsys, "inspect", "--ckpt", ckpts / "learned_1d", "--out",
                             tmp_path / "o", "--images", "16")
    assert code == 0, err
    for name in ("embedding_filters.png", "position_similarity.png", "attention_distance.png"):
        with Image.open(tmp_path / "o" / name) as image:
            assert image.format == "PNG" and min(image.size) >= 200 and max(image.size) <= 2000, image.size
        assert f"wrote {tmp_path / 'o' / name}" in out
    for row in ("custom", "8x8", "4 px", "token", "learned_1d", "32 px", "32 / 2 / 2"):
        assert row in out, row
    numbers = json.loads((tmp_path / "o" / "attention_distance.json").read_text())
    assert (numbers["images"] == 16
            and np.array(numbers["mean_distance_px"]).shape == (2, 2))  # (layers, heads)
    assert 0 < np.min(numbers["mean_distance_px"]) and np.max(numbers["mean_distance_px"]) < 32 * math.sqrt(2)
    c = centres((8, 8), 4.0)
    assert numbers["uniform_attention_px"] == pytest.approx(
        sum(math.dist(p, q) for p in c for q in c) / len(c) ** 2)


@pytest.mark.parametrize("source, grid, pos_embed", [
    ("learned_2d", [8, 8], "learned_2d"), ("sincos_2d", [8, 8], "sincos_2d"),
    ("google.npz", [4, 4], "learned_1d"), ("timm.safetensors", [4, 4], "learned_1d"),
])
def test_inspect_json_for_every_kind_of_file(ckpts, tmp_path, monkeypatch, capsys, source, grid, pos_embed):
    # a foreign file cannot tell its heads
    extra = ["model.num_heads=2"] if source == "timm.safetensors" else []
    code, out, err = run_vit(monkeypatch, capsys, "inspect", "--ckpt", ckpts / source, "--out", tmp_path,
                             "--images", "4", "--json", *extra)
    assert code == 0, err
    report = json.loads(out)
    assert report["model"]["grid"] == grid and report["model"]["pos_embed"] == pos_embed
    assert len(report["written"]) == 4 and not report["skipped"]
    assert np.array(report["attention_distance"]["mean_distance_px"]).shape == (2, 2)
    assert sum(report["filter_explained_variance"]) <= 1 + 1e-9


def test_a_cnn_is_a_one_line_error(ckpts, tmp_path, monkeypatch, capsys):
    code, out, err = run_vit(monkeypatch, capsys, "inspect", "--ckpt", ckpts / "resnet.safetensors", "--out",
                             tmp_path)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "no ViT" in err and "resnet.safetensors" in err
    assert not list(tmp_path.iterdir()), "nothing written"
