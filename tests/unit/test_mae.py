"""MAE's maths and network: its sin-cos table against an independent numpy transcription, its patch
layout, masking and loss as models_mae.py defines them, an encoder that runs on the kept patches
only, masks that belong to the image (not to the batch that holds it), and FLOPs that count what
runs."""

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from helpers import mae_sincos_reference
from vitcli.data.batching import sampler
from vitcli.models import mae, zoo
from vitcli.models.flops import mae_forward_flops, train_flops_per_image
from vitcli.models.mae import MaeModel, mae_step
from vitcli.objectives import registry
from vitcli.recipe.resolve import resolve
from vitcli.recipe.schema import MaeConfig, ModelConfig, OptimConfig
from vitcli.train import loop
from vitcli.train.optim import param_groups

pytestmark = pytest.mark.usefixtures("one_thread")
TINY = ModelConfig(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, mlp_dim=64)
DECODER = MaeConfig(decoder_embed_dim=16, decoder_depth=1, decoder_num_heads=2)


@pytest.mark.parametrize("dim, grid", [(16, 4), (32, 7), (768, 14)])
def test_the_sincos_table_is_maes(dim, grid):
    ours = mae.sincos_table((grid, grid), dim)[0].double().numpy()
    assert ours.shape == (1 + grid * grid, dim)
    assert np.abs(ours - mae_sincos_reference(dim, grid)).max() < 1e-6  # float32 rounding in [-1, 1]
    # patch 1 is one column to the right of patch 0: only the first half (the column's) changes
    assert np.allclose(ours[1, dim // 2:], ours[2, dim // 2:]) and not np.allclose(ours[1], ours[2])


def test_patchify_is_maes_channel_last_layout_and_unpatchify_inverts_it():
    images = torch.randn(2, 3, 16, 24)
    reference = torch.einsum("nchpwq->nhwpqc", images.reshape(2, 3, 2, 8, 3, 8)).reshape(2, 6, 8 * 8 * 3)
    assert torch.equal(mae.patchify(images, 8), reference)
    assert torch.equal(mae.unpatchify(mae.patchify(images, 8), 8, (2, 3)), images)


def test_masking_keeps_the_patches_of_smallest_noise_and_restores_the_order():
    noise = torch.rand(5, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    ids_keep, ids_restore, mask = mae.random_masking(noise, 4)
    assert torch.equal(ids_keep.sort(1).values, noise.topk(4, dim=1, largest=False).indices.sort(1).values)
    assert torch.equal(mask.sum(1), torch.full((5,), 12.0))
    assert torch.equal(mask.gather(1, ids_keep), torch.zeros(5, 4))
    shuffled = torch.argsort(noise, 1)
    assert torch.equal(shuffled.gather(1, ids_restore), torch.arange(16).expand(5, -1))
    assert mae.keep_count(196, 0.75) == 49 and mae.keep_count(64, 0.75) == 16


def test_the_noise_is_a_function_of_seed_image_and_patch():
    whole = mae.mask_noise(3, torch.arange(100, 140), 64)
    assert torch.equal(whole[10:20], mae.mask_noise(3, torch.arange(110, 120), 64)), "batch-independent"
    assert not torch.equal(whole, mae.mask_noise(4, torch.arange(100, 140), 64))
    assert ((whole >= 0) & (whole < 1)).all()
    assert all(len(set(row.tolist())) == 64 for row in whole), "no ties within an image"
    far = mae.mask_noise(3, torch.tensor([2**40 + 7, 7]), 16)  # the high word of the index counts
    assert not torch.equal(far[0], far[1])


def test_the_noise_is_uniform_and_every_patch_is_removed_at_the_ratio():
    """40,000 images x 64 patches: the mean of U(0, 1) has standard error 0.29 / sqrt(2.56e6) =
    1.8e-4, so 5e-3 is far outside chance; each patch position is removed in 0.75 of 40,000 images
    (standard error 2.2e-3): 0.015 is 7 standard errors, while a sampler that favoured some
    positions by 2% fails."""
    noise = mae.mask_noise(0, torch.arange(40_000), 64)
    assert abs(noise.mean().item() - 0.5) < 5e-3 and abs(noise.var().item() - 1 / 12) < 5e-3
    removed = mae.random_masking(noise, 16)[2].mean(0)  # (64,)
    assert (removed - 0.75).abs().max() < 0.015, removed
    neighbours = torch.corrcoef(torch.stack([noise[:-1].flatten(), noise[1:].flatten()]))[0, 1]
    assert abs(neighbours) < 5e-3, "consecutive images draw independent masks"


def test_the_loss_is_the_mean_squared_error_over_removed_patches_only():
    g = torch.Generator().manual_seed(1)
    pred, target = torch.randn(2, 4, 12, generator=g), torch.randn(2, 4, 12, generator=g)
    mask = torch.tensor([[1.0, 0, 0, 1], [0, 1, 0, 0]])
    per_patch = ((pred - target) ** 2).mean(-1)
    assert torch.allclose(mae.mae_loss(pred, target, mask, False), per_patch[mask.bool()].mean())
    normed = (target - target.mean(-1, keepdim=True)) / (target.var(-1, keepdim=True) + 1e-6) ** 0.5
    expected = ((pred - normed) ** 2).mean(-1)[mask.bool()].mean()
    assert torch.allclose(mae.mae_loss(pred, target, mask, True), expected)
    kept_changed = torch.where(mask[..., None].bool(), pred, pred + 100)
    assert mae.mae_loss(kept_changed, target, mask, True) == mae.mae_loss(pred, target, mask, True)


def _model(fresh=True, seed=0, cfg=DECODER, model=TINY):
    torch.manual_seed(seed)
    return MaeModel(zoo.build_model(model, 0), cfg, model.patch_size, fresh=fresh)


def test_the_encoder_runs_the_vits_own_layers_on_the_kept_patches_only():
    model, images = _model(), torch.randn(3, 3, 32, 32)
    seen = []
    model.backbone.blocks[0].register_forward_hook(lambda m, args, out: seen.append(tuple(args[0].shape)))
    mae_step(model, images, 0, 0, DECODER, 8)
    assert seen == [(3, 1 + 4, 32)], "the class token and 4 of 16 patches"
    everything = torch.arange(16).expand(3, -1)  # kept in grid order, the encoder is the ViT itself
    assert torch.allclose(model.encode(images, everything), model.backbone.forward_features(images),
                          atol=1e-6)


def test_the_position_tables_are_maes_fixed_ones_and_only_the_vit_is_exported():
    model = _model()
    assert not model.backbone.pos_embed.requires_grad
    assert torch.equal(model.backbone.pos_embed, mae.sincos_table((4, 4), 32))
    assert torch.equal(model.decoder.pos_embed, mae.sincos_table((4, 4), 16))
    assert "decoder.pos_embed" not in model.state_dict(), "a function of the grid: in no checkpoint"
    r = resolve("pretrain", None, ["objective=mae"], inputs=False)
    objective = registry.build(r, 0, torch.device("cpu"))
    assert objective.exported(model) is model.backbone
    assert not any(k.startswith("decoder") for k in objective.exported(model).state_dict())


def decayed(model: torch.nn.Module) -> set[str]:
    """Names of the parameters our optimizer groups decay."""
    groups = param_groups(model, OptimConfig(lr=1e-3, weight_decay=0.05))
    ids = {id(p) for g in groups if g["weight_decay"] > 0 for p in g["params"]}
    return {n for n, p in model.named_parameters() if id(p) in ids}


def test_pretraining_decays_the_tokens_as_maes_main_pretrain():
    model = _model()
    # main_pretrain.py: timm 0.3.2's add_weight_decay(model, 0.05), no skip list, transliterated:
    # trainable tensors decay unless 1-D or a bias
    reference = {n for n, p in model.named_parameters()
                 if p.requires_grad and not (len(p.shape) == 1 or n.endswith(".bias"))}
    assert decayed(model) == reference
    assert {"backbone.cls_token", "decoder.mask_token"} <= reference
    assert "backbone.pos_embed" not in reference  # frozen: in no group
    # the fine-tune's ViT exempts its class token, as main_finetune.py's param_groups_lrd does
    assert "cls_token" not in decayed(zoo.build_model(TINY, 10))


def test_a_loaded_encoder_keeps_its_weights_and_only_the_decoder_is_initialised():
    backbone = zoo.build_model(TINY, 0)
    before = {k: v.clone() for k, v in backbone.state_dict().items()}
    MaeModel(backbone, DECODER, 8, fresh=False)
    assert all(torch.equal(before[k], v) for k, v in backbone.state_dict().items() if k != "pos_embed")
    fresh = MaeModel(zoo.build_model(TINY, 0), DECODER, 8)
    assert (fresh.backbone.blocks[0].attn.qkv.bias == 0).all(), "MAE's init: zero biases"


def _masks(recipe_args: list[str], step: int, rank_micro: int, micro_batches: int) -> torch.Tensor:
    """The masks the loop's MAE objective draws for `micro_batches` micro-batches of a rank whose
    first global micro-batch is rank_micro, at `step`, concatenated (B, N)."""
    r = resolve("pretrain", None, ["objective=mae", *recipe_args], inputs=False)
    model = _model(cfg=r.mae)
    seen = []
    real = model.forward
    model.forward = lambda images, noise: seen.append(mae.random_masking(noise, model.keep)[2]) or real(
        images, noise)
    objective = loop._objective(registry.build(r, 0, torch.device("cpu")), r, step, rank_micro)
    micro = r.data.micro_batch_size or r.data.batch_size
    for i in range(micro_batches):
        objective(model, torch.randn(micro, 3, 32, 32), None, i)
    return torch.cat(seen)


def test_an_images_mask_is_the_same_however_the_batch_is_split():
    """A global batch of 8 at step 5: one process with one micro-batch, one with 4 accumulated
    micro-batches of 2, and rank 1 of 2 processes with 2 micro-batches of 2 each (its global
    micro-batches 2 and 3)."""
    common = ["model.img_size=32", "model.patch_size=8", "model.embed_dim=32", "model.depth=2",
              "model.num_heads=2", "model.mlp_dim=64", "mae.decoder_embed_dim=16", "mae.decoder_depth=1",
              "mae.decoder_num_heads=2", "data.batch_size=8"]
    whole = _masks(common, 5, 0, 1)
    assert whole.shape == (8, 16) and len({tuple(m.tolist()) for m in whole}) == 8
    assert torch.equal(_masks([*common, "data.micro_batch_size=2"], 5, 0, 4), whole)
    assert torch.equal(_masks([*common, "data.micro_batch_size=2"], 5, 2, 2), whole[4:])
    assert not torch.equal(_masks(common, 6, 0, 1), whole), "another step, other images, other masks"
    assert sampler.first_sample(5, 2, 2, 8) == 5 * 8 + 4


@pytest.mark.parametrize("pool", ["token", "gap"])
def test_the_flop_count_is_the_step_that_runs(pool):
    """Exact against PyTorch's counter for the matmuls it counts (linear layers and the patch
    convolution; CPU attention is not counted, so the N x N products are left out of both): the
    encoder on 4 of 16 patches, the decoder on all 16 (and the class token)."""
    model_cfg = ModelConfig(**{**TINY.__dict__, "pool": pool})
    model, images = _model(model=model_cfg), torch.randn(2, 3, 32, 32)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(images, mae.mask_noise(0, torch.arange(2), 16))
    assert counter.get_total_flops() / 2 == mae_forward_flops(model_cfg, DECODER, attention=False)
    assert train_flops_per_image(model_cfg, 0, DECODER) == 3 * mae_forward_flops(model_cfg, DECODER)
