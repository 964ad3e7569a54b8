"""MAE against the reference client: transformers' ViTMAEForPreTraining on a tiny configuration,
with our weights copied across and the same noise passed in, keeps the same patches, restores the
same order and computes the same loss, with norm_pix_loss on and off.

Where the defaults differ: transformers' ViTMAEConfig has layer_norm_eps 1e-12, MAE (models_mae.py)
and timm 1e-6; the config below sets 1e-6, as the converted facebook/vit-mae-* configs do not (they
keep 1e-12). Its norm_pix_loss defaults to off, MAE's pretraining turns it on (our default). And
transformers 5.24's ViTMAEForPreTraining built from a config leaves both position tables (and the
class and [mask] tokens) at zero: its _init_weights zeroes decoder_pos_embed, and the encoder's
initialize_weights returns early once the patch projection is marked initialised. Only
from_pretrained fills them, so the tables are copied across like the weights, and compared with the
sin-cos function transformers' own initialisation would use. Tolerance: the loss to 1e-5 relative in
float32 (two implementations of the same arithmetic, summed in other orders)."""

import pytest
import torch

from vitcli.models import mae, zoo
from vitcli.models.mae import MaeModel
from vitcli.recipe.schema import MaeConfig, ModelConfig

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = ModelConfig(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, mlp_dim=128)
DECODER = {"decoder_embed_dim": 16, "decoder_depth": 2, "decoder_num_heads": 2}


def reference(norm_pix: bool) -> torch.nn.Module:
    config = transformers.ViTMAEConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128, image_size=32,
        patch_size=8, decoder_hidden_size=16, decoder_num_hidden_layers=2, decoder_num_attention_heads=2,
        decoder_intermediate_size=64, mask_ratio=0.75, norm_pix_loss=norm_pix, layer_norm_eps=1e-6,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.ViTMAEForPreTraining(config).eval()


def block_weights(ours: dict, prefix: str, theirs: str) -> dict:
    """One timm Block's tensors under transformers' ViTMAELayer names (fused qkv split in three)."""
    out = {}
    for kind in ("weight", "bias"):
        q, k, v = ours[f"{prefix}attn.qkv.{kind}"].chunk(3)
        out.update({f"{theirs}attention.q_proj.{kind}": q, f"{theirs}attention.k_proj.{kind}": k,
                    f"{theirs}attention.v_proj.{kind}": v,
                    f"{theirs}attention.o_proj.{kind}": ours[f"{prefix}attn.proj.{kind}"],
                    f"{theirs}layernorm_before.{kind}": ours[f"{prefix}norm1.{kind}"],
                    f"{theirs}layernorm_after.{kind}": ours[f"{prefix}norm2.{kind}"],
                    f"{theirs}mlp.fc1.{kind}": ours[f"{prefix}mlp.fc1.{kind}"],
                    f"{theirs}mlp.fc2.{kind}": ours[f"{prefix}mlp.fc2.{kind}"]})
    return out


def their_state(model: MaeModel) -> dict:
    """Our MaeModel's weights and position tables as ViTMAEForPreTraining's state dict."""
    sd = model.state_dict()
    out = {"vit.embeddings.cls_token": sd["backbone.cls_token"],
           "decoder.mask_token": sd["decoder.mask_token"],
           "vit.embeddings.position_embeddings": sd["backbone.pos_embed"],
           "decoder.decoder_pos_embed": model.decoder.pos_embed}
    for ours, theirs in (("backbone.patch_embed.proj", "vit.embeddings.patch_embeddings.projection"),
                         ("backbone.norm", "vit.layernorm"), ("decoder.embed", "decoder.decoder_embed"),
                         ("decoder.norm", "decoder.decoder_norm"), ("decoder.pred", "decoder.decoder_pred")):
        out.update({f"{theirs}.{kind}": sd[f"{ours}.{kind}"] for kind in ("weight", "bias")})
    for i in range(2):
        out.update(block_weights(sd, f"backbone.blocks.{i}.", f"vit.layers.{i}."))
        out.update(block_weights(sd, f"decoder.blocks.{i}.", f"decoder.decoder_layers.{i}."))
    return out


@pytest.mark.parametrize("norm_pix", [True, False])
def test_kept_patches_restore_order_and_loss_agree_with_transformers(norm_pix):
    torch.manual_seed(0)
    cfg = MaeConfig(norm_pix_loss=norm_pix, **DECODER)
    ours = MaeModel(zoo.build_model(MODEL, 0), cfg, 8).eval()
    theirs = reference(norm_pix)
    theirs.load_state_dict(their_state(ours), strict=True)

    images = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    noise = mae.mask_noise(7, torch.arange(4), 16).float()  # transformers draws float32 noise itself
    with torch.no_grad():
        out = theirs(pixel_values=images, noise=noise)
        ids_keep, ids_restore, mask = mae.random_masking(noise, ours.keep)
        pred, target, our_mask = ours(images, noise)
        loss = mae.mae_loss(pred, target, our_mask, norm_pix)
    assert torch.equal(out.ids_restore, ids_restore)
    assert torch.equal(out.mask, our_mask) and torch.equal(mask, our_mask)
    their_kept = torch.argsort(noise, dim=1)[:, :4]  # transformers' ids_keep: its shuffle's first len_keep
    assert torch.equal(their_kept, ids_keep) and int((1 - out.mask).sum(1)[0]) == 4
    assert torch.allclose(out.logits, pred, rtol=1e-5, atol=1e-5)
    assert torch.allclose(out.loss, loss, rtol=1e-5, atol=0), (out.loss.item(), loss.item())


@pytest.mark.parametrize("dim", [16, 32, 768])
def test_the_sincos_tables_are_the_ones_transformers_initialises_with(dim):
    """transformers' initialize_weights: its canonical [sin_h|cos_h|sin_w|cos_w] table with the
    halves swapped, 'to match' MAE's layout."""
    from transformers.models.vit_mae.modeling_vit_mae import build_2d_sinusoidal_position_embedding

    table = build_2d_sinusoidal_position_embedding(height=4, width=4, embed_dim=dim, cls_token=True)
    theirs = torch.cat([table[..., dim // 2:], table[..., : dim // 2]], dim=-1)
    assert torch.allclose(mae.sincos_table((4, 4), dim)[0], theirs, atol=1e-6)
