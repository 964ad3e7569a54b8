"""Masked patch prediction maths: hand-made colours, timm's token order, masking statistics,
gradients, loss."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from timm.layers import PatchEmbed

from vitcli.errors import RecipeError
from vitcli.models.mpp import (
    MASK,
    NUM_BINS,
    RANDOM,
    UNCHANGED,
    UNTOUCHED,
    color_4x4_target,
    color_bins,
    corrupt,
    corruption,
    make_target,
    mean_color_of_pixels,
    mean_color_target,
    mpp_loss,
    other_patches,
    patchify,
    pixels_target,
    pred_shape,
    quantise,
)
from vitcli.recipe.choices import MPP_TARGETS

BATCH, PATCHES = 2000, 64  # 128,000 patches, 64,000 of them corrupted
# Among the 64,000 corrupted patches a fraction p has binomial standard deviation sqrt(p (1-p) /
# 64000): 0.0016 for p = 0.8 and 0.0012 for p = 0.1, so +-0.01 is 6 and 8 standard deviations: a
# correct sampler fails with probability < 1e-8, while a sampler off by 0.01 or more (say
# 0.8/0.2/0.0) fails.
FRACTION_TOL = 0.01


def _patch(rgb, p=16):
    """One (1, 1, 3, P, P) patch of a single colour given in [-1, 1]."""
    return torch.tensor(rgb, dtype=torch.float32)[:, None, None].expand(3, p, p)[None, None]


@pytest.mark.parametrize("rgb,bin", [
    ((1.0, -1.0, -1.0), 448),  # pure red, pixel (255, 0, 0): levels (7, 0, 0)
    ((0.0, 0.0, 0.0), 292),  # mid grey: v = 0.5 starts level 4 -> (4, 4, 4)
    ((-1.0, -1.0, -1.0), 0),
    ((1.0, 1.0, 1.0), 511),  # v = 1.0 is level 7, not 8
    ((-1.0, 1.0, -1.0), 56),  # green (0, 7, 0)
    ((-1.0, -1.0, 1.0), 7),  # blue (0, 0, 7)
    ((-0.5, 0.0, 0.5), 2 * 64 + 4 * 8 + 6),  # v = (0.25, 0.5, 0.75) start levels 2, 4, 6
])
def test_a_patch_of_one_colour_maps_to_its_bin(rgb, bin):
    assert mean_color_target(_patch(rgb)).tolist() == [[bin]]


def test_levels_change_exactly_at_multiples_of_one_eighth():
    edges = torch.arange(1, 8, dtype=torch.float32) / 8  # exact in float32
    below = torch.nextafter(edges, torch.zeros(()))
    assert quantise(below).tolist() == list(range(7))
    assert quantise(edges).tolist() == list(range(1, 8))
    # the ends, and values a rounding error outside [0, 1], clamp to the first and last level
    assert quantise(torch.tensor([0.0, 1.0, -1e-7, 1 + 1e-7])).tolist() == [0, 7, 0, 7]
    assert quantise(torch.tensor([0.2499, 0.25, 0.9999, 1.0]), bits=2).tolist() == [0, 1, 3, 3]


def test_every_8_bit_pixel_quantises_like_integer_arithmetic():
    """pixel p in [0, 255] -> x = p/127.5 - 1 -> level floor(8 p / 255), computed here in
    integers."""
    pixels = torch.arange(256)
    levels = quantise((pixels / 127.5 - 1 + 1) / 2)
    assert levels.tolist() == [min(8 * p // 255, 7) for p in range(256)]


def test_color_bins_are_r64_g8_b():
    levels = np.stack(np.meshgrid(np.arange(8), np.arange(8), np.arange(8), indexing="ij"), -1).reshape(-1, 3)
    centres = torch.tensor((levels + 0.5) / 8, dtype=torch.float32)  # (512, 3), mid-level colours
    assert color_bins(centres).tolist() == (levels @ np.array([64, 8, 1])).tolist()
    assert sorted(color_bins(centres).tolist()) == list(range(NUM_BINS))


@pytest.mark.parametrize("p", [4, 8, 16])
def test_4x4_target_of_16_constant_cells_is_the_cells_bins(p):
    rng = np.random.default_rng(p)
    levels = rng.integers(0, 8, size=(4, 4, 3))  # a level per cell and channel
    # 0.3 of a level above the edge: the cells' mean never lands on a level edge (sums of 1/16 +
    # 0.3)
    cells01 = (levels + 0.3) / 8
    patch01 = np.kron(cells01.transpose(2, 0, 1), np.ones((p // 4, p // 4)))  # (3, P, P), each cell constant
    patch = torch.tensor(patch01 * 2 - 1, dtype=torch.float32)[None, None]
    target = color_4x4_target(patch)
    assert target.shape == (1, 1, 17)
    mean_levels = np.floor(patch01.mean(axis=(1, 2)) * 8).astype(int)
    assert target[0, 0, 0].item() == mean_levels @ [64, 8, 1]
    assert target[0, 0, 1:].tolist() == (levels.reshape(16, 3) @ [64, 8, 1]).tolist()  # row-major cells
    assert target[0, 0, 0] == mean_color_target(patch)[0, 0]


def test_4x4_target_needs_a_patch_divisible_by_4():
    with pytest.raises(RecipeError, match="patch size 6"):
        color_4x4_target(torch.zeros(1, 2, 3, 6, 6))


def _images(b=2, h=32, w=48, seed=0):
    return torch.rand(b, 3, h, w, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def test_patchify_matches_timm_patch_embed_token_order():
    """timm's PatchEmbed (Conv2d stride P, flattened row-major) with a one-hot kernel copies out the
    patches."""
    p, images = 8, _images()
    embed = PatchEmbed(img_size=(32, 48), patch_size=p, in_chans=3, embed_dim=3 * p * p)
    with torch.no_grad():
        embed.proj.weight.copy_(torch.eye(3 * p * p).reshape(3 * p * p, 3, p, p))
        embed.proj.bias.zero_()
        tokens = embed(images)  # (B, N, 3*P*P)
    ours = patchify(images, p)
    assert ours.shape == (2, 4 * 6, 3, p, p)
    assert (ours.flatten(2) - tokens).abs().max() < 1e-6  # a one-hot convolution adds only zeros
    assert torch.equal(ours.flatten(2), F.unfold(images, p, stride=p).transpose(1, 2))


def test_patchify_rejects_an_image_not_a_multiple_of_the_patch():
    with pytest.raises(RecipeError, match="patch size 16"):
        patchify(torch.zeros(1, 3, 40, 48), 16)


def test_pixels_target_round_trips_to_the_image():
    p, images = 8, _images(seed=1)
    target = pixels_target(patchify(images, p))
    assert target.shape == (2, 24, 3 * p * p)
    assert torch.equal(F.fold(target.transpose(1, 2), (32, 48), p, stride=p), images)


@pytest.fixture(scope="module")
def mode():
    return corruption(BATCH, PATCHES, torch.Generator().manual_seed(0))


def test_exactly_half_of_every_image_is_corrupted(mode):
    assert mode.shape == (BATCH, PATCHES) and mode.dtype == torch.int8
    assert ((mode != UNTOUCHED).sum(dim=1) == PATCHES // 2).all()
    # the corrupted half is a random subset: each position is corrupted in about half of the images
    # (sd sqrt(0.25 / 2000) = 0.011 per position; 0.06 is over 5 sd, a fixed subset would sit at 0
    # or 1)
    per_position = (mode != UNTOUCHED).double().mean(dim=0)
    assert (per_position - 0.5).abs().max() < 0.06, per_position


def test_corrupted_patches_are_mask_random_unchanged_80_10_10(mode):
    how = mode[mode != UNTOUCHED]
    fractions = [(how == m).double().mean().item() for m in (MASK, RANDOM, UNCHANGED)]
    assert fractions == pytest.approx([0.8, 0.1, 0.1], abs=FRACTION_TOL), fractions
    assert sum(fractions) == pytest.approx(1.0)


def test_corruption_rounds_the_count_and_checks_its_fractions():
    g = torch.Generator().manual_seed(0)
    assert ((corruption(8, 49, g) != UNTOUCHED).sum(dim=1) == 24).all()  # round(24.5) = 24, half to even
    assert ((corruption(8, 196, g, ratio=0.4) != UNTOUCHED).sum(dim=1) == 78).all()
    with pytest.raises(RecipeError, match="mask 0.9 \\+ random 0.2"):
        corruption(8, 16, g, mask=0.9, random=0.2)
    with pytest.raises(RecipeError, match="ratio 0"):
        corruption(8, 16, g, ratio=0.0)
    with pytest.raises(RecipeError, match="0.03 of 16 patches corrupts none"):  # round(0.48) = 0
        corruption(8, 16, g, ratio=0.03)


def _tokens(b, n, d=4, seed=1):
    """(B, N, D) random embeddings whose first coordinate is the patch's flat index,
    so a copy names its source."""
    tokens = torch.randn(b, n, d, generator=torch.Generator().manual_seed(seed))
    tokens[..., 0] = torch.arange(b * n, dtype=torch.float32).reshape(b, n)  # exact below 2**24
    return tokens


def test_corrupt_keeps_untouched_masks_mode_1_and_copies_another_patch_for_mode_2(mode):
    tokens, mask_token = _tokens(BATCH, PATCHES), torch.randn(4)
    out = corrupt(tokens, mode, mask_token, other_patches(BATCH, PATCHES, torch.Generator().manual_seed(2)))
    kept = (mode == UNTOUCHED) | (mode == UNCHANGED)
    assert torch.equal(out[kept], tokens[kept])  # bit-identical
    assert torch.equal(out[mode == MASK], mask_token.expand(int((mode == MASK).sum()), 4))
    source = out[mode == RANDOM][:, 0].long()
    own = torch.arange(BATCH * PATCHES).reshape(BATCH, PATCHES)[mode == RANDOM]
    assert (source != own).all()
    assert torch.equal(out[mode == RANDOM], tokens.reshape(-1, 4)[source])
    assert (source // PATCHES != own // PATCHES).float().mean() > 0.99  # mostly from other images, as drawn


def test_the_random_patch_is_uniform_over_all_other_patches_of_the_batch():
    b, n, calls = 2, 4, 3500
    tokens, g = _tokens(b, n), torch.Generator().manual_seed(3)
    everywhere = torch.full((b, n), RANDOM, dtype=torch.int8)
    counts = torch.zeros(b * n, b * n)
    for _ in range(calls):
        source = corrupt(tokens, everywhere, torch.zeros(4), other_patches(b, n, g))[..., 0].long().flatten()
        counts[torch.arange(b * n), source] += 1
    assert counts.diagonal().sum() == 0  # never itself
    # each of the 7 others: mean 500, sd sqrt(3500 * 1/7 * 6/7) = 20.7; 105 is 5 sd
    off = counts[~torch.eye(b * n, dtype=torch.bool)]
    assert (off - calls / (b * n - 1)).abs().max() < 105, counts


def test_same_seed_same_corruption_and_a_saved_generator_resumes():
    def draw(g):
        m = corruption(16, 64, g)
        return m, corrupt(_tokens(16, 64), m, torch.ones(4), other_patches(16, 64, g))

    first, again = draw(torch.Generator().manual_seed(7)), draw(torch.Generator().manual_seed(7))
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert not torch.equal(first[0], draw(torch.Generator().manual_seed(8))[0])
    g = torch.Generator().manual_seed(7)
    draw(g)
    state = g.get_state()
    step2 = draw(g)
    resumed = torch.Generator()
    resumed.set_state(state)
    assert all(torch.equal(a, b) for a, b in zip(draw(resumed), step2))


def test_gradient_reaches_the_mask_token_and_each_kept_token_only_through_its_own_position():
    g = torch.Generator().manual_seed(4)
    m = corruption(8, 16, g)
    tokens = torch.randn(8, 16, 4, generator=g, requires_grad=True)
    mask_token = torch.zeros(4, requires_grad=True)
    weights = torch.randn(8, 16, 4, generator=g)  # d loss / d out
    (corrupt(tokens, m, mask_token, other_patches(8, 16, g)) * weights).sum().backward()
    kept = ((m == UNTOUCHED) | (m == UNCHANGED))[..., None]
    assert torch.equal(tokens.grad, torch.where(kept, weights, torch.zeros(())))
    assert torch.allclose(mask_token.grad, weights[m == MASK].sum(dim=0), atol=1e-5)


def test_the_mask_token_learns_from_the_mpp_loss():
    g = torch.Generator().manual_seed(5)
    m = corruption(4, 16, g)
    tokens, mask_token = torch.randn(4, 16, 8, generator=g), torch.nn.Parameter(torch.zeros(8))
    head = torch.nn.Linear(8, NUM_BINS)
    target = torch.randint(NUM_BINS, (4, 16), generator=g)
    loss, _ = mpp_loss(head(corrupt(tokens, m, mask_token, other_patches(4, 16, g))), target, m != UNTOUCHED,
                       "mean_color")
    loss.backward()
    assert mask_token.grad is not None and mask_token.grad.abs().sum() > 0


def _logits(b, n, *extra):
    return torch.zeros(b, n, *extra, NUM_BINS)


def test_mean_color_loss_is_the_hand_computed_cross_entropy():
    pred, target = _logits(1, 3), torch.tensor([[5, 9, 300]])
    pred[0, 0, 5] = math.log(511)  # p(target) = 511 / (511 + 511) = 1/2: cross-entropy log 2
    pred[0, 2] = torch.randn(NUM_BINS) * 10  # not corrupted
    # patch 1 keeps uniform logits: cross-entropy log 512 = 9 log 2
    loss, accuracy = mpp_loss(pred, target, torch.tensor([[True, True, False]]), "mean_color")
    assert loss.item() == pytest.approx((math.log(2) + 9 * math.log(2)) / 2, abs=1e-5)
    assert accuracy.item() == pytest.approx(0.5)  # patch 0 argmax 5 is right; patch 1 argmax 0 is wrong


def test_color_4x4_loss_averages_the_17_predictions():
    pred, target = _logits(1, 2, 17), torch.full((1, 2, 17), 3)
    pred[0, 0, 4, 3] = math.log(511)
    loss, _ = mpp_loss(pred, target, torch.tensor([[True, False]]), "color_4x4")
    assert loss.item() == pytest.approx((16 * math.log(512) + math.log(2)) / 17, abs=1e-5)


def test_cross_entropy_matches_numpy_on_random_logits():
    g = torch.Generator().manual_seed(6)
    pred, target = (torch.randn(3, 5, 17, NUM_BINS, generator=g),
                    torch.randint(NUM_BINS, (3, 5, 17), generator=g))
    corrupted = torch.rand(3, 5, generator=g) < 0.5
    logits, t = pred[corrupted].double().numpy(), target[corrupted].numpy()
    log_softmax = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    expected = -np.take_along_axis(log_softmax, t[..., None], axis=-1).mean()
    assert mpp_loss(pred, target, corrupted, "color_4x4")[0].item() == pytest.approx(expected, abs=1e-5)


def test_pixels_loss_is_the_squared_error_of_the_corrupted_patches():
    target = torch.rand(2, 3, 12) * 2 - 1
    pred = target + 0.5
    corrupted = torch.tensor([[True, False, True], [False, False, True]])
    pred[~corrupted] = 100.0
    loss, _ = mpp_loss(pred, target, corrupted, "pixels_l2")
    assert loss.item() == pytest.approx(0.25, abs=1e-6)


@pytest.mark.parametrize("kind", MPP_TARGETS)
def test_the_loss_ignores_uncorrupted_patches(kind):
    g = torch.Generator().manual_seed(7)
    patches = torch.rand(3, 8, 3, 8, 8, generator=g) * 2 - 1
    target = make_target(patches, kind)
    pred = torch.randn(3, 8, *pred_shape(kind, 8), generator=g)
    corrupted = corruption(3, 8, g) != UNTOUCHED
    changed = pred.clone()
    changed[~corrupted] = torch.randn_like(changed[~corrupted]) * 50
    assert not torch.equal(pred, changed)
    for a, b in zip(mpp_loss(pred, target, corrupted, kind), mpp_loss(changed, target, corrupted, kind)):
        assert torch.equal(a, b)


def test_accuracy_counts_the_mean_colour_of_corrupted_patches_only():
    target = torch.tensor([[1, 2, 3, 4, 5, 6]])
    pred = _logits(1, 6)
    for i, guess in enumerate([1, 2, 3, 0, 0, 0]):  # right, right, right, wrong, then two uncorrupted wrong
        pred[0, i, guess] = 1.0
    corrupted = torch.tensor([[True, True, True, True, False, False]])
    assert mpp_loss(pred, target, corrupted, "mean_color")[1].item() == pytest.approx(0.75)
    # color_4x4: only prediction 0, the mean colour, counts; the 16 cells are all wrong here
    target17 = torch.cat([target[..., None], torch.full((1, 6, 16), 7)], dim=-1)
    pred17 = torch.cat([pred[:, :, None], _logits(1, 6, 16)], dim=2)
    assert mpp_loss(pred17, target17, corrupted, "color_4x4")[1].item() == pytest.approx(0.75)


def test_mean_color_of_pixels_reads_the_pixels_target_layout():
    patches = _images(b=4, h=16, w=16, seed=2).reshape(4, 4, 3, 8, 8)  # any (B, N, 3, P, P) in [-1, 1]
    assert torch.equal(mean_color_of_pixels(pixels_target(patches)), mean_color_target(patches))


def test_pixels_accuracy_compares_mean_colour_bins():
    patches = torch.stack([_patch(c, p=4)[0, 0] for c in [(1.0, -1.0, -1.0), (0.0, 0.0, 0.0)]])[None]
    target = pixels_target(patches)  # (1, 2, 48): red (bin 448) and grey (bin 292)
    pred = target.clone()
    pred[0, 0] += torch.linspace(-0.1, 0.1, 48) - 0.1  # a different patch, same mean-colour bin (7, 0, 0)
    pred[0, 1] += 0.3  # grey shifted up by 0.3 -> v = 0.65 -> level 5
    _, accuracy = mpp_loss(pred, target, torch.tensor([[True, True]]), "pixels_l2")
    assert accuracy.item() == pytest.approx(0.5)


def test_bad_shapes_kinds_and_empty_masks_are_errors():
    target, corrupted = torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="expected pred \\(2, 3, 512\\)"):
        mpp_loss(torch.zeros(2, 3, 17 * NUM_BINS), target, corrupted, "mean_color")
    with pytest.raises(ValueError, match="no corrupted patch"):
        mpp_loss(_logits(2, 3), target, ~corrupted, "mean_color")
    with pytest.raises(RecipeError, match="expected one of mean_color, color_4x4, pixels_l2"):
        mpp_loss(_logits(2, 3), target, corrupted, "colour")
    assert pred_shape("color_4x4", 16) == (17, NUM_BINS) and pred_shape("pixels_l2", 16) == (768,)
