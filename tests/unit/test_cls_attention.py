"""DINO's Figure 1 maths (figures.attention): the class token's last-layer attention against timm's
own unfused Attention, a transliteration of DINO's vision_transformer.Attention, and the official
dinov2 package's whole DinoVisionTransformer on the same weights (0.0.1.dev2 from PyPI; skipped
where it is not installed); the patch grid's orientation on a non-square grid; the 60%-mass
threshold against a transliteration of visualize_attention.py's loop; the nearest upsampling and
the figure's panels."""

import numpy as np
import pytest
import torch
from timm.models.vision_transformer import VisionTransformer

from vitcli.errors import ModelError
from vitcli.figures import attention

TOL = 1e-12  # float64 on both sides: the same products summed in a different order


def tiny(**kwargs) -> VisionTransformer:
    torch.manual_seed(0)
    args = {"img_size": 32, "patch_size": 8, "embed_dim": 32, "depth": 2, "num_heads": 4,
            "num_classes": 0}
    return VisionTransformer(**{**args, **kwargs}).double().eval()


def timm_unfused(model: VisionTransformer, x: torch.Tensor) -> torch.Tensor:
    """(B, heads, T, T): what timm's Attention itself softmaxes when its fused kernel is off, read
    at the input of its attention dropout."""
    attn, seen = model.blocks[-1].attn, []
    attn.fused_attn = False
    hook = attn.attn_drop.register_forward_hook(lambda mod, args, out: seen.append(args[0]))
    try:
        model(x)
    finally:
        hook.remove()
        attn.fused_attn = True
    return seen[0]


def dino_transliterated(model: VisionTransformer, x: torch.Tensor) -> torch.Tensor:
    """(B, heads, T, T): facebookresearch/dino vision_transformer.Attention.forward on the last
    block's normalised input: attn = (q @ k^T) * scale, softmax (scaled after the product)."""
    block, seen = model.blocks[-1], []
    hook = block.norm1.register_forward_hook(lambda mod, args, out: seen.append(out))
    try:
        model(x)
    finally:
        hook.remove()
    t = seen[0]
    b, n, c = t.shape
    heads = block.attn.num_heads
    qkv = block.attn.qkv(t).reshape(b, n, 3, heads, c // heads).permute(2, 0, 3, 1, 4)
    q, k = qkv[0], qkv[1]
    return ((q @ k.transpose(-2, -1)) * (c // heads) ** -0.5).softmax(dim=-1)


@pytest.mark.parametrize("reg_tokens", [0, 2])
def test_class_token_attention_is_what_timm_and_dino_compute(reg_tokens):
    model = tiny(reg_tokens=reg_tokens)
    x = torch.randn(3, 3, 32, 32, dtype=torch.float64)
    probs = attention.last_attention(model, x)  # (B, heads, T, T)
    prefix = 1 + reg_tokens
    assert probs.shape == (3, 4, prefix + 16, prefix + 16)
    assert torch.allclose(probs, timm_unfused(model, x), rtol=0, atol=TOL)
    assert torch.allclose(probs, dino_transliterated(model, x), rtol=0, atol=TOL)
    ones = torch.ones(3, 4, prefix + 16, dtype=torch.float64)
    assert torch.allclose(probs.sum(dim=-1), ones, atol=TOL)  # every key: class, registers, patches

    maps = attention.cls_attention(model, x)  # (B, heads, 4, 4): the class token's row, patch keys
    assert maps.shape == (3, 4, 4, 4)
    # what the class token gives itself and the registers
    to_prefix = probs[:, :, 0, :prefix].sum(dim=-1)
    assert torch.allclose(maps.sum(dim=(-2, -1)), 1 - to_prefix, atol=TOL)
    assert torch.equal(maps.flatten(-2), probs[:, :, 0, prefix:])


def test_class_token_attention_is_what_the_official_dinov2_model_attends():
    """dinov2's own forward (its token order, position table, layer scale, Attention) on random
    weights, read at its last attention dropout; ours on those weights as timm converts them."""
    pytest.importorskip("dinov2")
    from dinov2.models.vision_transformer import DinoVisionTransformer
    from timm.models.vision_transformer import checkpoint_filter_fn

    torch.manual_seed(0)
    sizes = {"img_size": 32, "patch_size": 8, "embed_dim": 32, "depth": 2, "num_heads": 2,
             "mlp_ratio": 2.0, "init_values": 0.5}
    reference = DinoVisionTransformer(**sizes, block_chunks=0).double().eval()
    for p in reference.parameters():  # its init leaves the class token, biases and mask token at 0
        torch.nn.init.normal_(p, std=0.2)
    ours = VisionTransformer(**sizes, num_classes=0).double().eval()
    ours.load_state_dict(checkpoint_filter_fn(reference.state_dict(), ours))
    seen = []
    last = reference.blocks[-1].attn
    last.attn_drop.register_forward_hook(lambda mod, args, out: seen.append(args[0]))
    x = torch.randn(3, 3, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        reference(x)
        maps = attention.cls_attention(ours, x)
    assert torch.allclose(maps, seen[0][:, :, 0, 1:].reshape(3, 2, 4, 4), rtol=0, atol=TOL)


def test_the_map_is_the_patch_grid_row_major_on_a_non_square_image():
    """A one-head ViT on 16 x 32 px (grid 2 x 4) whose only non-zero patch token is the one at row
    1, column 2, equal to the class token: the class token attends to it, and the map says where."""
    torch.manual_seed(0)
    model = VisionTransformer(img_size=(16, 32), patch_size=8, embed_dim=8, depth=1, num_heads=1,
                              num_classes=0).double().eval()
    v = torch.randn(8, dtype=torch.float64)
    with torch.no_grad():
        model.patch_embed.proj.weight.zero_()
        model.patch_embed.proj.bias.zero_()
        model.pos_embed.zero_()
        model.cls_token.copy_(v)
        model.pos_embed[0, 1 + 1 * 4 + 2] = v  # token order: class, then patches row by row
        model.blocks[0].attn.qkv.weight.copy_(torch.cat([10 * torch.eye(8)] * 3).double())
        model.blocks[0].attn.qkv.bias.zero_()
    maps = attention.cls_attention(model, torch.randn(2, 3, 16, 32, dtype=torch.float64))
    assert maps.shape == (2, 1, 2, 4)
    peak = [divmod(int(m.argmax()), 4) for m in maps[:, 0]]
    assert peak == [(1, 2), (1, 2)]


def test_a_model_without_a_class_token_or_timms_attention_is_refused():
    with pytest.raises(ModelError, match="no class token"):
        attention.cls_attention(tiny(class_token=False, global_pool="avg"),
                                torch.zeros(1, 3, 32, 32))
    model = tiny()
    model.blocks[-1].attn = torch.nn.Identity()
    with pytest.raises(ModelError, match="last block's attention \\(Identity\\) is not timm's"):
        attention.cls_attention(model, torch.zeros(1, 3, 32, 32, dtype=torch.float64))


def reference_threshold(attentions: torch.Tensor, threshold: float) -> torch.Tensor:
    """visualize_attention.py's threshold, transliterated: attentions (nh, N) -> kept (nh, N)."""
    val, idx = torch.sort(attentions)
    val /= torch.sum(val, dim=1, keepdim=True)
    cumval = torch.cumsum(val, dim=1)
    th_attn = cumval > (1 - threshold)
    idx2 = torch.argsort(idx)
    for head in range(attentions.shape[0]):
        th_attn[head] = th_attn[head][idx2[head]]
    return th_attn


def test_keep_mass_is_the_reference_threshold():
    torch.manual_seed(1)
    maps = torch.rand(6, 3, 5).double() ** 4  # (heads, h, w): peaked, like attention
    kept = attention.keep_mass(maps, 0.6)
    assert torch.equal(kept.flatten(-2), reference_threshold(maps.flatten(-2).clone(), 0.6))
    share = (maps * kept).sum(dim=(-2, -1)) / maps.sum(dim=(-2, -1))
    assert (share >= 0.6).all()
    smallest = torch.where(kept, maps, torch.inf).flatten(-2).min(dim=-1).values
    # and no more than needed: without its smallest kept weight a map falls short of 60%
    assert ((maps * kept).sum(dim=(-2, -1)) - smallest < 0.6 * maps.sum(dim=(-2, -1))).all()


def test_upsampling_gives_each_patch_its_pixels():
    maps = torch.arange(2 * 3 * 2 * 4, dtype=torch.float32).reshape(2, 3, 2, 4)  # grid 2 x 4
    up = attention.upsample(maps, (16, 32))  # patch 8
    assert np.array_equal(up.numpy(), np.kron(maps.numpy(), np.ones((1, 1, 8, 8))))


def test_the_figure_has_the_image_the_threshold_the_mean_and_at_most_six_heads():
    rng = np.random.default_rng(0)
    # 2 images of 16 x 32 px, 8 heads on a 2 x 4 grid
    images, maps = rng.random((2, 16, 32, 3)), rng.random((2, 8, 2, 4)) ** 4
    fig = attention.attention_figure(images, maps, "a title")
    axes = np.array(fig.axes).reshape(2, 3 + attention.MAX_HEADS)
    assert [ax.get_title().splitlines()[0] for ax in axes[0, :4]] == [
        "image", "60% of the mean's mass", "mean of 8 heads (6 drawn)", "head 0"]
    assert axes[0, -1].get_title().startswith("head 5")
    for row, image, per_head in zip(axes, images, maps):
        shown = [ax.get_images()[0] for ax in row]
        assert np.array_equal(shown[0].get_array(), image)
        mean = per_head.mean(axis=0)
        kept = attention.keep_mass(torch.from_numpy(mean)).numpy()
        region = np.kron(kept, np.ones((8, 8)))[..., None]  # each patch over its 8 x 8 pixels
        dimmed = image * (attention.DIM + (1 - attention.DIM) * region)
        assert np.allclose(shown[1].get_array(), dimmed)
        assert np.allclose(shown[2].get_array(), mean)
        assert all(np.array_equal(s.get_array(), m) for s, m in zip(shown[3:], per_head))
        # every map spans the image's own pixel extent: patch (r, c) over pixels 8r.., 8c..
        assert all(s.get_extent() == list(shown[0].get_extent()) for s in shown[2:])
        assert row[2].get_title().endswith(f"peak {mean.max():.2g}")
    assert fig._suptitle.get_text() == "a title"
